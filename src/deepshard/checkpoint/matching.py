"""Does a checkpoint fit the model? One check for every stage, so a wrong checkpoint never loads silently.

``check_names`` compares the model's tensor names with the checkpoint's: strict loading refuses any
missing or unexpected name; non-strict loading warns with the names it skips, and refuses a checkpoint
that shares no name with the model at all (that loads nothing: it is the wrong checkpoint).
``check_coverage`` refuses a checkpoint whose fragments do not cover every element of every parameter
(a rank's file is missing): that is a damaged checkpoint, which non-strict loading cannot fix.
"""
from __future__ import annotations

from pathlib import Path

from deepshard.checkpoint.io import CheckpointError
from deepshard.utils.logging import logger

_SHOWN = 10


def _some(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{names[:_SHOWN]}{more}"


def check_names(model_names: list[str], missing: list[str], unexpected: list[str], strict: bool,
                where: Path) -> None:
    """Raise (strict, or nothing matches) or warn (non-strict) about ``missing``/``unexpected`` names.

    ``model_names``: every state-dict name the model expects; ``missing``: those the checkpoint lacks;
    ``unexpected``: checkpoint names the model does not have.
    """
    if not missing and not unexpected:
        return
    matched = len(model_names) - len(missing)
    summary = (f"checkpoint {where} does not match the model: {matched} of the model's {len(model_names)} "
               f"tensors found; missing from the checkpoint: {_some(missing)} ({len(missing)}); "
               f"in the checkpoint but not in the model: {_some(unexpected)} ({len(unexpected)})")
    if matched == 0 and model_names:
        raise CheckpointError(f"{summary}. No name matches, so nothing would be loaded: this checkpoint was "
                              "saved from a different model (or with different module prefixes); pass the "
                              "checkpoint of this model")
    if strict:
        raise KeyError(f"{summary}. Load the checkpoint of this model, or pass load_module_strict=False to "
                       "load the matching tensors and keep the others as initialized")
    logger.warning("%s; load_module_strict=False: loaded the %d matching tensors, the missing ones keep their "
                   "initial values", summary, matched)


def check_coverage(directory: Path, shapes: dict[str, tuple[int, ...]], covered: dict[str, int],
                   ranks_found: list[int], saved_world: int | None) -> None:
    """Refuse a checkpoint whose fragments leave part of a parameter unwritten (a rank's files missing)."""
    expected = list(range(saved_world)) if saved_world else []
    absent = [r for r in expected if r not in ranks_found]
    short = []
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= int(d)
        if covered.get(name, 0) < numel:
            short.append(f"{name} ({covered.get(name, 0)} of {numel} elements)")
    if not short:
        return  # complete (stage 0 writes rank 0's files only)
    files = ", ".join(f"zero_rank{r}.json/.safetensors" for r in absent) or "none missing by name"
    raise CheckpointError(
        f"checkpoint {directory} is incomplete: it was saved by {saved_world or '?'} rank(s) but holds the "
        f"files of ranks {ranks_found} (missing: {files}); parameters not fully present: {_some(short)}. "
        "Non-strict loading cannot repair this: copy the missing files from where the checkpoint was saved, "
        "or load another tag")
