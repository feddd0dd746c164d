"""``deepshard convert SRC DST --to deepspeed|deepshard``: a checkpoint in the other library's format."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Iterable

from deepshard.checkpoint import io as ckpt_io
from deepshard.commands import DefaultsHelpFormatter


def build_parser(prog: str = "deepshard convert") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=DefaultsHelpFormatter,
        description="Convert a checkpoint between deepshard's format and DeepSpeed's (no pickle is run).")
    parser.add_argument("src", type=Path, help="the checkpoint: a save directory with 'latest', or a tag directory")
    parser.add_argument("dst", type=Path, help="the save directory to write (the tag folder and 'latest' go in it)")
    parser.add_argument("--to", required=True, choices=["deepspeed", "deepshard"], help="the format to write")
    parser.add_argument("--dp", type=int, default=None,
                        help="data-parallel size of the target job (default: the source's)")
    parser.add_argument("--stage", type=int, default=None, choices=[0, 1, 2, 3],
                        help="ZeRO stage of the target job (default: the source's; 1 for a stage-0 source to DeepSpeed)")
    parser.add_argument("--ep", type=int, default=1,
                        help="--to deepspeed of a mixture-of-experts model: the ep_size of the target job's MoE layers")
    parser.add_argument("--tag", default=None, help="tag of the source to convert (default: its 'latest'); "
                                                     "the target keeps the same tag")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _tag_dir(src: Path, tag: str | None) -> tuple[Path, str]:
    if tag is not None:
        return src / tag, tag
    if (src / ckpt_io.LATEST_NAME).is_file():
        latest = ckpt_io.read_latest(src)
        return src / str(latest), str(latest)
    if src.is_dir():
        return src, src.name
    raise FileNotFoundError(f"{src} does not exist")


def _progress(quiet: bool) -> Any:
    """A bar per file written (on a terminal, or with DEEPSHARD_PROGRESS=1; deepshard.utils.progress)."""
    from deepshard.utils.progress import progress

    def wrap(items: Iterable[Any], what: str) -> Iterable[Any]:
        items = list(items)
        return progress(items, f"writing {what}", total=len(items), unit="file", enabled=not quiet)
    return wrap


def convert(src: Path, dst: Path, to: str, dp: int | None = None, stage: int | None = None, tag: str | None = None,
            quiet: bool = True, ep: int = 1) -> Path:
    """Convert; returns the written tag directory. Raises ``CheckpointError``/``ValueError`` with the cause."""
    from deepshard.checkpoint.deepspeed_format import is_deepspeed_tag

    tag_dir, tag_name = _tag_dir(src, tag)
    if not tag_dir.is_dir():
        raise ckpt_io.CheckpointError(f"checkpoint {tag_dir} does not exist")
    from_deepspeed = is_deepspeed_tag(tag_dir)
    if to == "deepshard":
        if not from_deepspeed:
            raise ckpt_io.CheckpointError(f"{tag_dir} is not a DeepSpeed checkpoint (no *model_states.pt): "
                                          "--to deepshard converts DeepSpeed checkpoints")
        from deepshard.checkpoint.deepspeed_format.read import read_engine_record
        from deepshard.checkpoint.deepspeed_format.to_deepshard import write_deepshard

        record = read_engine_record(tag_dir)
        return write_deepshard(tag_dir, dst, tag_name, dp or record.dp_world_size,
                               record.zero_stage if stage is None else stage, _progress(quiet))
    if from_deepspeed:
        raise ckpt_io.CheckpointError(f"{tag_dir} is already a DeepSpeed checkpoint; --to deepspeed converts "
                                      "deepshard checkpoints (deepshard loads DeepSpeed's directly)")
    from deepshard.checkpoint.deepspeed_format.write import read_source, write_deepspeed

    ckpt_io.verify_manifest(tag_dir)
    source = read_source(tag_dir)
    stage = stage if stage is not None else max(1, int(source.engine.get("zero_stage", 1)))
    dp = dp or int(source.engine.get("grid", {}).get("dp", source.engine.get("dp_world_size", 1)))
    return write_deepspeed(source, dst, tag_name, dp, stage, _progress(quiet), ep)


def main(argv: list[str] | None = None, prog: str = "deepshard convert") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        out = convert(args.src, args.dst, args.to, args.dp, args.stage, args.tag, quiet=args.quiet, ep=args.ep)
    except (ckpt_io.CheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(f"wrote {out}", flush=True)
    return 0
