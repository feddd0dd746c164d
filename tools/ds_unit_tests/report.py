"""docs/compatibility.md from the conformance results (``tools/ds_unit_tests/results.json``, written by
``runner.py``): per DeepSpeed test file, how many tests pass on DeepSpeed 0.19.8's CPU path and how many of
those pass on deepshard, at world size 1 and 2, and for each one that does not, why.

The why is the curated sentence of ``reasons.tsv`` (``pattern<TAB>reason``; the first fnmatch pattern over
``file::test`` wins) where someone has looked at the test, else the first line of deepshard's failure.

    python tools/ds_unit_tests/report.py [--results R.json] [--out docs/compatibility.md] [--checkout DS]
"""
from __future__ import annotations

import argparse
import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

IMPLEMENTATION_INTERNAL: tuple[str, ...] = (
    "v1/moe/test_autoep_unit.py",
    "v1/moe/test_autoep_autotp_*.py",
    "v1/moe/test_autoep_checkpoint.py",
    "v1/moe/test_fused_expert_layout.py",
    "checkpoint/test_autotp_uc_checkpoint.py",
)
"""fnmatch patterns of the DeepSpeed test files that unit-test the private modules of DeepSpeed's own
implementations rather than the behaviour its users reach, judged by what each file imports at its top:
the AutoEP implementation (its layout planners, routers, repacking and preset adapters in
``deepspeed.module_inject.auto_ep_*`` / ``deepspeed.moe.ep_*``, the AutoEP x AutoTP folding tables of
``auto_ep_folding``, its fused-expert layout detection) and the universal-checkpoint converter's private
helpers (``deepspeed.checkpoint.ds_to_universal``, and ``deepspeed.checkpoint.autoep_universal``'s
``_zero12_fragment_path`` and folding metadata). deepshard meets the same contracts with designs of its own
(its AutoEP reads the same ``expert_parallel`` config; its checkpoints load at another layout without a
conversion step), so the page gives a second figure without these files, under the overall one. The AutoEP
files that import only DeepSpeed's public surface (``test_autoep_integration.py``,
``test_autoep_grad_parity.py``) count in both figures."""

IMPLEMENTATION_INTERNAL_WHY = (
    "they unit-test private modules of DeepSpeed's own implementations, as the imports at the top of each "
    "file show (AutoEP's layout planners, routers and preset adapters in `deepspeed.module_inject.auto_ep_*` / "
    "`deepspeed.moe.ep_*`, its AutoTP folding tables in `auto_ep_folding`, its fused-expert layout detection, "
    "and the private helpers of the universal-checkpoint converter `deepspeed.checkpoint.ds_to_universal` / "
    "`deepspeed.checkpoint.autoep_universal`), where deepshard meets the same contracts with designs of its "
    "own (its AutoEP reads the same `expert_parallel` config; its checkpoints load at another layout without a "
    "conversion step); the AutoEP files that import only DeepSpeed's public surface "
    "(`v1/moe/test_autoep_integration.py`, `v1/moe/test_autoep_grad_parity.py`) count in both figures")
"""Why the second figure leaves :data:`IMPLEMENTATION_INTERNAL` out (a sentence of the generated page)."""


@dataclass
class FileRow:
    """The counts of one test file; ``ws`` 1 is every test that runs in one process (plain pytest tests
    and DistributedTest at world size 1), 2 every test that spawns two."""

    name: str
    collected: int = 0
    ds_pass: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})
    shard_pass: dict[int, int] = field(default_factory=lambda: {1: 0, 2: 0})
    gaps: list[tuple[str, str, str]] = field(default_factory=list)
    note: str = ""
    ds_unfinished: int = 0
    """Tests DeepSpeed's run did not reach (its file was cut short by a hang or the time limit): unjudged."""

    @property
    def ds_total(self) -> int:
        return sum(self.ds_pass.values())

    @property
    def shard_total(self) -> int:
        return sum(self.shard_pass.values())


def load_reasons(path: Path) -> list[tuple[str, str]]:
    """``(pattern, reason)`` pairs of ``reasons.tsv`` in file order."""
    if not path.exists():
        return []
    pairs = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pattern, _, reason = line.partition("\t")
            if not reason:
                raise SystemExit(f"{path}: line {line!r} has no tab between pattern and reason")
            pairs.append((pattern.strip(), reason.strip()))
    return pairs


def reason_for(test: str, reasons: list[tuple[str, str]], fallback: str) -> str:
    for pattern, reason in reasons:
        if fnmatch.fnmatchcase(test, pattern):
            return reason
    return fallback


def _bucket(ws: list[int]) -> int:
    return 2 if max(ws) >= 2 else 1


def file_row(name: str, sides: dict[str, Any], reasons: list[tuple[str, str]]) -> FileRow:
    """The counts and the gaps (passing on DeepSpeed, not on deepshard) of one file."""
    row = FileRow(name)
    ds = sides.get("deepspeed", {}).get("tests", {})
    shard_side = sides.get("deepshard")
    shard = shard_side.get("tests", {}) if shard_side else {}
    row.collected = len(ds)
    shard_collect = "; ".join(shard_side.get("collect_errors", [])) if shard_side else ""
    for test_id, entry in sorted(ds.items()):
        row.ds_unfinished += entry["outcome"] == "not run"
        if entry["outcome"] != "passed":
            continue
        bucket = _bucket(entry["ws"])
        row.ds_pass[bucket] += 1
        ours = shard.get(test_id)
        if ours is not None and ours["outcome"] == "passed":
            row.shard_pass[bucket] += 1
            continue
        short = test_id.removeprefix("unit/")
        if shard_side is None:
            outcome, why = "not run", "not run on deepshard yet"
        elif ours is None:
            outcome, why = "not collected", shard_collect or "not collected"
        else:
            outcome, why = ours["outcome"], ours["why"] or ours["outcome"]
        row.gaps.append((short.split("::", 1)[1], outcome, reason_for(short, reasons, why)))
    if shard_side is None:
        row.note = reason_for(name + "::*", reasons, "not run on deepshard yet")
    return row


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def not_run(files: list[str], globs: list[str]) -> list[str]:
    """The globs of the default list (``files.txt``) that no file of the results matches."""
    return [g for g in globs if not any(fnmatch.fnmatchcase(f, g) for f in files)]


def is_implementation_internal(name: str) -> bool:
    """Whether the test file ``name`` (relative to tests/unit) is one of :data:`IMPLEMENTATION_INTERNAL`."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in IMPLEMENTATION_INTERNAL)


def second_figure(judged: list[FileRow]) -> list[str]:
    """The line under the overall figure: the share without the implementation-internal files, naming each
    with its counts (passing on DeepSpeed, of those passing on deepshard)."""
    internal = [r for r in judged if is_implementation_internal(r.name)]
    kept = [r for r in judged if not is_implementation_internal(r.name)]
    ds_total = sum(r.ds_total for r in kept)
    shard_total = sum(r.shard_total for r in kept)
    named = ", ".join(f"`{r.name}` ({r.shard_total} of {r.ds_total})" for r in internal) or "none in these results"
    left_out = sum(r.ds_total for r in internal)
    return [f"**Without the implementation-internal files: {shard_total} of the {ds_total} tests that pass on "
            f"DeepSpeed pass on deepshard ({_pct(shard_total, ds_total)}).** It leaves out {left_out} tests that "
            f"pass on DeepSpeed, in {len(internal)} files, because {IMPLEMENTATION_INTERNAL_WHY}: {named}."]


def render(results: dict[str, Any], reasons: list[tuple[str, str]], globs: list[str] | None = None) -> str:
    """The page; ``globs``: the default file list, whose files not in ``results`` are named as not run yet."""
    rows = [file_row(name, sides, reasons) for name, sides in sorted(results["files"].items())]
    judged = [r for r in rows if not r.note]
    ds_total = sum(r.ds_total for r in judged)
    shard_total = sum(r.shard_total for r in judged)
    meta = results.get("meta", {})
    out = [
        "# DeepSpeed's own unit tests on deepshard",
        "",
        "DeepSpeed's unit tests (`tests/unit` of deepspeedai/DeepSpeed at "
        f"`{meta.get('checkout_commit', 'unknown')[:8]}`, close to 0.19.8), unmodified, run on DeepSpeed 0.19.8's "
        "CPU path (`DS_ACCELERATOR=cpu`) and on deepshard through `deepshard.compat.install()` (`import deepspeed` "
        f"is deepshard), with `LOCAL_SIZE={meta.get('local_size', 2)}` so both CPU accelerators count two devices: "
        "tests DeepSpeed runs at world size 1 and 2 run, larger ones skip on both. A test counts for deepshard when "
        "it passes on DeepSpeed and on deepshard.",
        "",
        "Generated by `tools/ds_unit_tests/report.py` from `tools/ds_unit_tests/results.json`; rerun "
        "`tools/ds_unit_tests/runner.py --checkout <DeepSpeed checkout>` to refresh it (it needs DeepSpeed's "
        "test dependencies, `pytest` and `hjson`, and `transformers` for `runtime/zero/test_zeropp.py`, in both environments).",
        "",
        f"**Overall: {shard_total} of the {ds_total} tests that pass on DeepSpeed pass on deepshard "
        f"({_pct(shard_total, ds_total)}).**",
        "",
        *second_figure(judged),
        "",
        "`unfinished` counts the tests DeepSpeed's own run did not reach (a hang, or the time limit, cut its file "
        "short); they are not judged.",
        "",
        "| file | collected | pass on DeepSpeed (ws 1 / ws 2) | pass on deepshard (ws 1 / ws 2) | share | unfinished |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        shard_cell = "pending" if r.note else f"{r.shard_pass[1]} / {r.shard_pass[2]}"
        out.append(f"| `{r.name}` | {r.collected} | {r.ds_pass[1]} / {r.ds_pass[2]} | {shard_cell} | "
                   f"{'-' if r.note else _pct(r.shard_total, r.ds_total)} | {r.ds_unfinished or ''} |")
    out += ["", "## Passing on DeepSpeed, not on deepshard", ""]
    for r in rows:
        if r.note:
            out += [f"### `{r.name}`", "", f"Not judged: {_escape(r.note)}", ""]
        elif r.gaps:
            out += [f"### `{r.name}`", "", "| test | on deepshard | why |", "|---|---|---|"]
            out += [f"| `{_escape(t)}` | {o} | {_escape(w)} |" for t, o, w in r.gaps]
            out.append("")
    missing = not_run(sorted(results["files"]), globs or [])
    if missing:
        out += ["## Not run yet", "", "Files of the default list (`tools/ds_unit_tests/files.txt`) these results do not "
                "cover (the overall figure above does not count them): " + ", ".join(f"`{g}`" for g in missing) + ".",
                ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=HERE / "results.json")
    parser.add_argument("--reasons", type=Path, default=HERE / "reasons.tsv")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "compatibility.md")
    parser.add_argument("--checkout", type=Path, help="DeepSpeed checkout: name the default list's files not run "
                        "one by one (without it, the globs no file of the results matches)")
    args = parser.parse_args(argv)
    globs = [line.strip() for line in (HERE / "files.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    if args.checkout is not None:
        unit = args.checkout / "tests" / "unit"
        globs = sorted({p.relative_to(unit).as_posix() for g in globs for p in unit.glob(g) if p.is_file()})
    text = render(json.loads(args.results.read_text()), load_reasons(args.reasons), globs)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
