"""Automatic tensor parallelism of a Hugging Face model: each process holds a slice of every weight matrix.

    deepshard --num_gpus 2 examples/train_autotp.py       # tp = 2: each process holds half of each layer
    python examples/train_autotp.py                       # one process, the whole model: the same losses

A small LLaMA (``transformers``' ``LlamaForCausalLM``, built from a config: nothing is downloaded; needs
``pip install ".[hf]"``) is passed to ``deepshard.initialize`` unchanged; the config's
``"tensor_parallel": {"autotp_size": N}`` splits its attention and MLP projections, embedding and head over
the N processes. With as many processes as ``autotp_size`` the data-parallel size is 1: every process
takes the same batch, as tensor-parallel ranks must. Each process reports the parameters it holds (about
1/N of the model: the norms stay whole) and rank 0 the loss, which equals the one-process run's (fp32, to
round-off). docs/tensor-parallel.md says what is split and how it combines with ZeRO and data parallelism.
"""
from __future__ import annotations

import argparse
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import deepshard

VOCAB, SEQ = 128, 32


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights on every process before the split
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def batch(step: int, size: int = 8) -> torch.Tensor:
    """Token sequences with a learnable rule (counting with a random start and stride), the same everywhere."""
    g = torch.Generator().manual_seed(step)
    start, stride = torch.randint(0, VOCAB, (size, 1), generator=g), torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = {"train_micro_batch_size_per_gpu": 8, "tensor_parallel": {"autotp_size": world},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 1}}
    engine, *_ = deepshard.initialize(model=model(), config=config)
    held = sum(p.numel() for p in engine.module.parameters())
    print(f"rank {engine.global_rank}: holds {held:,} parameters (tensor parallel size {world})", flush=True)
    for step in range(1, args.steps + 1):
        ids = batch(step)
        loss = engine(input_ids=ids, labels=ids).loss  # the model's own loss, on the gathered logits
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            print(f"step {step:3d}  loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
