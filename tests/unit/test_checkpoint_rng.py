"""What a resume does to random state: torch's global generator is left as the script had it (DeepSpeed's
``load_checkpoint`` does not restore it either, so a script's post-load draws, e.g. its data shuffle, are
DeepSpeed's), while deepshard's own streams (a tensor-parallel dropout's tracker) come back as saved."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import deepshard
from deepshard.checkpoint.rng_streams import model_trackers, stream_states
from deepshard.tp import tensor_parallel_rng
from deepshard.tp.layers import TensorParallelDropout


def _engine() -> tuple[object, object]:
    torch.manual_seed(0)
    tracker = tensor_parallel_rng(seed=5, tp_rank=0)
    model = nn.Sequential(nn.Linear(4, 4), TensorParallelDropout(0.5, tracker), nn.Linear(4, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 0}}
    return deepshard.initialize(model=model, config=cfg)[0], tracker


def test_load_leaves_the_global_generator_and_restores_deepshards_streams(tmp_path: Path) -> None:
    import torch.distributed as dist

    created = not dist.is_initialized()
    engine, tracker = _engine()
    try:
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
        engine.save_checkpoint(tmp_path)
        assert list(stream_states(engine.module)) == ["tracker0/tensor-parallel"] and model_trackers(engine.module) == [tracker]
        with tracker.fork():
            after_save = torch.rand(4)  # the stream moves on past the saved state
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        torch.manual_seed(123)  # what the script seeds before resuming (its shuffle draws from here)
        before = torch.get_rng_state()
        engine.load_checkpoint(tmp_path)
        post_load = torch.rand(4)
        torch.set_rng_state(before)
        assert torch.equal(post_load, torch.rand(4)), "load_checkpoint changed torch's global generator"
        with tracker.fork():
            assert torch.equal(torch.rand(4), after_save), "the tensor-parallel stream was not restored"
    finally:
        engine.destroy()
        if created and dist.is_initialized():
            dist.destroy_process_group()
