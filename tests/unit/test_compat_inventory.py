"""The inventory of ``deepspeed`` names real clients use (tests/compat_inventory/names.tsv: DeepSpeedExamples,
Accelerate, transformers, TRL, LLaMA-Factory, OpenRLHF, Megatron-DeepSpeed): under ``deepshard.compat``
each resolves to deepshard's implementation, or fails with an error that says why and what to use."""
from __future__ import annotations

from pathlib import Path


from tests.compat_inventory.resolve import resolve

TSV = Path(__file__).resolve().parents[1] / "compat_inventory" / "names.tsv"


def _entries() -> list[tuple[str, str, int, str]]:
    rows = [line.rstrip("\n").split("\t") for line in TSV.read_text().splitlines() if not line.startswith("#")]
    assert rows[0] == ["name", "expect", "uses", "sources"]
    return [(name, expect, int(uses), sources) for name, expect, uses, sources in rows[1:]]


def test_inventory_is_whole_and_sourced() -> None:
    entries = _entries()
    assert len(entries) >= 190 and len({e[0] for e in entries}) == len(entries)
    projects = {s.split(":")[0] for e in entries for s in e[3].split()}
    assert {"DeepSpeedExamples", "accelerate", "trl", "LLaMA-Factory", "OpenRLHF", "Megatron-DeepSpeed",
            "transformers"} <= projects
    assert all(e[1] in ("real", "refused") and e[2] >= 1 for e in entries)


def test_every_name_resolves_or_is_refused_with_what_to_use(shim: None) -> None:
    wrong = []
    for name, expect, _, _ in _entries():
        try:
            value = resolve(name)
        except (ImportError, AttributeError, NotImplementedError) as exc:
            text = str(exc)
            clear = "deepshard" in text and ("use " in text or "instead" in text)
            if expect != "refused" or not clear:
                wrong.append(f"{name}: expected {expect}, raised {type(exc).__name__}: {text}")
            continue
        if expect != "real" or value is None:
            wrong.append(f"{name}: expected {expect}, resolved to {value!r}")
    assert not wrong, "\n".join(wrong)


def _implementation(value: object) -> object:
    """A module alias's deepshard module (``deepspeed.zero`` and ``deepshard.runtime.zero`` are aliases of
    ``deepshard.zero``), anything else itself."""
    return getattr(value, "_deepshard_target", value)


def _same(a: object, b: object) -> bool:
    return _implementation(a) is _implementation(b) or (callable(a) and a == b)  # bound methods compare equal


def _deepshard_spelling(name: str) -> str:
    return "deepshard" + name[len("deepspeed"):]


def test_every_name_resolves_under_the_deepshard_spelling_too(shim: None) -> None:
    """``deepshard.X`` for every ``deepspeed.X`` of the inventory (one table serves both spellings): the same
    object where it resolves, a refusal that says why and what to use where it does not."""
    wrong = []
    for name, expect, _, _ in _entries():
        spelled = _deepshard_spelling(name)
        try:
            value = resolve(spelled)
        except (ImportError, AttributeError, NotImplementedError) as exc:
            text = str(exc)
            if expect != "refused" or "deepshard" not in text or not ("use " in text or "instead" in text):
                wrong.append(f"{spelled}: expected {expect}, raised {type(exc).__name__}: {text}")
            continue
        if expect != "real":
            wrong.append(f"{spelled}: expected a refusal, resolved to {value!r}")
        elif "()" not in name and not name.endswith("__version__") and not _same(value, resolve(name)):
            wrong.append(f"{spelled} is {value!r}, not the object {name} resolves to")
    assert not wrong, "\n".join(wrong)
