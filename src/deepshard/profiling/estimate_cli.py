"""``deepshard estimate_memory`` (alias ``deepshard_estimate_memory``): the whole-run memory estimate for a
config and a model, per process.

    deepshard estimate_memory --config ds_config.json --model examples.gpt_model:build_model \\
        --inputs examples.gpt_model:example_batch --dp 2

``--model`` names a callable returning the ``torch.nn.Module``; ``--inputs`` a callable taking the micro
batch size and returning the positional arguments of one forward (one micro-batch). Prints DeepSpeed's
ZeRO-2/ZeRO-3 model-state tables too, for comparison.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Callable

from deepshard.profiling.ds_estimators import (estimate_zero2_model_states_mem_needs_all_live,
                                               estimate_zero3_model_states_mem_needs_all_live)
from deepshard.profiling.memory_estimator import estimate_run_memory, format_estimate


def load_callable(spec: str) -> Callable[..., Any]:
    """``package.module:function`` -> the function."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise ValueError(f"{spec!r} must look like package.module:function")
    return getattr(importlib.import_module(module_name), attr)


def main(argv: list[str] | None = None, prog: str = "deepshard_estimate_memory") -> int:
    """Entry point of ``deepshard estimate_memory`` (alias ``deepshard_estimate_memory``); returns the exit
    status."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, help="DeepSpeed/deepshard JSON config")
    parser.add_argument("--model", required=True, help="module:function returning the model")
    parser.add_argument("--inputs", required=True, help="module:function(micro_batch) returning forward args")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel processes (default 1)")
    args = parser.parse_args(argv)
    from deepshard.config import load_config

    try:
        config = load_config(args.config, dp_world_size=args.dp)
        model = load_callable(args.model)()
        inputs = tuple(load_callable(args.inputs)(config.train_micro_batch_size_per_gpu))
    except (ValueError, ImportError, AttributeError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    est = estimate_run_memory(model, config, inputs, args.dp)
    print(f"ZeRO stage {config.zero_stage}, {config.model_dtype}, {args.dp} data-parallel process(es), "
          f"micro batch {config.train_micro_batch_size_per_gpu}: estimated bytes per process")
    print(format_estimate(est))
    print()
    estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=args.dp)
    print()
    estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=args.dp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
