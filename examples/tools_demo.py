"""The demo GPT for the monitoring tools (docs/tools.md): a model factory and a micro-batch factory for
``deepshard_estimate_memory``, and ``python examples/tools_demo.py`` prints the FLOPs profile of one
training micro-step.

    deepshard_estimate_memory --config examples/ds_config.json --model tools_demo:build_model \\
        --inputs tools_demo:example_batch --dp 2          # with examples/ on PYTHONPATH
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt_model import GPT, GPTConfig  # noqa: E402


def build_model() -> GPT:
    """The demo's default GPT (3.26M parameters, context 128)."""
    torch.manual_seed(0)
    return GPT(GPTConfig())


def example_batch(micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of token ids and targets."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (micro_batch, 128), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def main() -> None:
    from deepshard.profiling.flops_profiler import get_model_profile

    flops, macs, params = get_model_profile(build_model(), args=list(example_batch(8)), mode="train",
                                            module_depth=2, top_modules=2, detailed=False)
    print(f"fwd+bwd FLOPs {flops}, MACs {macs}, params {params}")


if __name__ == "__main__":
    main()
