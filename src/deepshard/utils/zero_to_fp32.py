"""DeepSpeed's ``zero_to_fp32``: turn a ZeRO checkpoint into one fp32 state dict (any stage, any world size).

Python::

    from deepshard.utils.zero_to_fp32 import (get_fp32_state_dict_from_zero_checkpoint,
        convert_zero_checkpoint_to_fp32_state_dict, load_state_dict_from_zero_checkpoint)
    state_dict = get_fp32_state_dict_from_zero_checkpoint("checkpoints")      # tag from 'latest'
    convert_zero_checkpoint_to_fp32_state_dict("checkpoints", "hf_out", safe_serialization=True)
    model = load_state_dict_from_zero_checkpoint(model, "checkpoints", tag="global_step100")

Command line (``deepshard_zero_to_fp32`` and ``python -m deepshard.utils.zero_to_fp32`` work the same)::

    deepshard zero_to_fp32 CKPT_DIR OUT_DIR [--max_shard_size 5GB] [--safe_serialization] [-t TAG]
                           [--exclude_frozen_parameters] [-d]

Differences from DeepSpeed, all deliberate: the checkpoint's manifest (size + sha256 of every file) is
verified before anything is read; no process or GPU is needed and nothing is unpickled;
``lazy_mode=True`` returns the same fully loaded dict (its tensors have ``.contiguous()`` like
DeepSpeed's lazy ones, so code written for lazy mode works); floating-point buffers and frozen
parameters come back as fp32 (integer buffers keep their dtype); ``load_state_dict_from_zero_checkpoint``
loads strictly. The logic lives in :mod:`deepshard.checkpoint.consolidate`.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from deepshard.utils.checkpoint_files import get_model_state_files, get_optim_files
from deepshard.utils.logging import logger

if TYPE_CHECKING:  # torch is imported lazily so ``--help`` is instant
    import torch

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "get_model_state_files", "get_optim_files",
           "load_state_dict_from_zero_checkpoint", "main"]

PROG = "deepshard_zero_to_fp32"


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> "dict[str, torch.Tensor]":
    """The model's full state dict in fp32, rebuilt on CPU from a checkpoint of any ZeRO stage.

    Args:
        checkpoint_dir: the directory given to ``engine.save_checkpoint`` (holding the tag folders and
            ``latest``), or one tag folder itself.
        tag: the checkpoint to read, e.g. ``"global_step100"``; None reads the tag in ``latest``.
        exclude_frozen_parameters: leave out parameters with ``requires_grad=False`` (buffers stay).
            Needs a checkpoint that records which extra tensors are frozen parameters; otherwise a
            warning is logged and all are kept.
        lazy_mode: accepted for DeepSpeed compatibility; the dict is loaded fully either way.

    Returns every state_dict key: trainable parameters from the fp32 master fragments, tied names as
    the very same tensor object as their canonical name, then buffers and frozen parameters.
    Raises ``FileNotFoundError`` (no such directory or tag), ``ValueError`` (no ``latest`` and no tag)
    or :class:`deepshard.checkpoint.CheckpointError` (damaged or incomplete checkpoint).
    """
    from deepshard.checkpoint.consolidate import consolidate

    del lazy_mode  # a fully loaded dict is a valid lazy-mode result
    return consolidate(checkpoint_dir, tag, exclude_frozen_parameters).state_dict


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | Path, output_dir: str | Path,
                                               max_shard_size: int | str = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """Consolidate a checkpoint and write it to ``output_dir`` in the Hugging Face layout.

    Writes ``model.safetensors`` (``safe_serialization=True``) or ``pytorch_model.bin``; when the
    weights exceed ``max_shard_size`` (``"5GB"``, ``"500MB"``, ``"10KB"``, ``"2GiB"`` or an int of
    bytes), numbered shards ``model-00001-of-0000N.safetensors`` / ``pytorch_model-00001-of-0000N.bin``
    plus ``model.safetensors.index.json`` / ``pytorch_model.bin.index.json``. Tied weights are stored
    under every name (cloned in safetensors, which refuses shared tensors). Files are written atomically.
    """
    summary = _convert(checkpoint_dir, output_dir, max_shard_size, safe_serialization, tag,
                       exclude_frozen_parameters)
    logger.info("zero_to_fp32: %s", summary)


def _convert(checkpoint_dir: str | Path, output_dir: str | Path, max_shard_size: int | str,
             safe_serialization: bool, tag: str | None, exclude_frozen_parameters: bool) -> str:
    """Do the conversion; return the one-line summary."""
    from deepshard.checkpoint.consolidate import consolidate, parse_size, write_state_dict

    parse_size(max_shard_size)  # a bad size fails before the checkpoint is read
    result = consolidate(checkpoint_dir, tag, exclude_frozen_parameters)
    written = write_state_dict(result.state_dict, output_dir, max_shard_size, safe_serialization)
    sd = result.state_dict
    unique = {id(t): t for t in sd.values()}
    elements = sum(t.numel() for t in unique.values())
    trainable = sum(sd[n].numel() for n in result.trainable)
    names = written.files if len(written.files) <= 3 else written.files[:2] + ["..."] + written.files[-1:]
    index = f" + {written.index}" if written.index else ""
    excluded = f", {len(result.excluded)} frozen left out" if result.excluded else ""
    summary = (f"{result.tag_dir}: {len(sd)} tensors ({len(unique)} distinct{excluded}), {elements:,} elements "
               f"({trainable:,} in trainable parameters); wrote {len(written.files)} file(s), "
               f"{written.total_size:,} bytes, to {written.output_dir}: {', '.join(names)}{index}")
    return summary


def load_state_dict_from_zero_checkpoint(model: "torch.nn.Module", checkpoint_dir: str | Path,
                                         tag: str | None = None) -> "torch.nn.Module":
    """Move ``model`` to CPU, load the checkpoint's fp32 weights into it strictly, and return it.

    The model must have the saved model's state_dict keys and shapes (``RuntimeError`` naming the
    missing and unexpected keys otherwise). Values are copied into the model's own dtype. Do not use the
    model with a running engine afterwards: build a new engine (or use ``engine.load_checkpoint``).
    """
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=True)
    return model


# --------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------

def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False, description="Consolidate a deepshard/DeepSpeed-style ZeRO checkpoint into fp32 weights "
                               "(pytorch_model.bin or model.safetensors, sharded above --max_shard_size).")
    parser.add_argument("checkpoint_dir", help="the save directory (holding 'latest' and the tag folders), "
                                               "or one tag folder")
    parser.add_argument("output_dir", help="where to write the weights (created if missing)")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="largest shard, e.g. 5GB, 500MB, 2GiB or bytes (default: %(default)s)")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="write safetensors (model.safetensors) instead of pytorch_model.bin")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step100 "
                                                          "(default: the one in 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out parameters with requires_grad=False")
    parser.add_argument("-d", "--debug", action="store_true", help="debug logging; full tracebacks on errors")
    return parser


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Entry point of ``deepshard zero_to_fp32`` (alias ``deepshard_zero_to_fp32``); returns the exit status
    (0 ok, 1 error)."""
    args = build_parser(prog).parse_args(argv)
    if args.debug:
        logger.setLevel(logging.DEBUG)
    from deepshard.checkpoint.io import CheckpointError

    try:
        summary = _convert(args.checkpoint_dir, args.output_dir, args.max_shard_size, args.safe_serialization,
                           args.tag, args.exclude_frozen_parameters)
    except (FileNotFoundError, NotADirectoryError, ValueError, TypeError, CheckpointError) as err:
        if args.debug:
            raise
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
