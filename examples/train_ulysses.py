"""Sequence parallelism (DeepSpeed-Ulysses): every process holds a slice of each sample's tokens.

    deepshard --num_gpus 2 examples/train_ulysses.py      # sp = 2: each process holds half of every sequence
    python examples/train_ulysses.py                      # one process, plain attention: the same losses

A tiny causal language model written for it: embeddings, norms, MLPs and the loss work on this process's
tokens only; the attention is made whole by ``engine.sequence_parallel.attention`` (an all-to-all trades
the token split for a head split, attends over every token, and trades back). The config sets
``"sequence_parallel_size"`` to the number of processes, so the data-parallel size is 1 and every process
takes the same samples. The loss is the mean over all tokens of the sequence, the same value on every
rank. On one process the model takes the plain path (``torch``'s attention, ``cross_entropy``), which is
the reference: both print the same losses (fp32, to round-off). docs/sequence-parallel.md has the rest
(ring attention, hybrid, packed documents, Hugging Face models).
"""
from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import deepshard

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 64, 4, 2, 96


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, sp: Any, seq_len: int) -> torch.Tensor:
        b, s, _ = x.shape  # s: this process's tokens (all of them without sequence parallelism)
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)  # each [b, h, s, d]
        if sp is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = sp.attention(q, k, v, seq_len)  # this rank's queries against every token of the sequence
        return self.out(y.transpose(1, 2).reshape(b, s, DIM))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor, sp: Any, seq_len: int) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), sp, seq_len)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Learned position embeddings, looked up by each token's global position."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, sp: Any, seq_len: int) -> torch.Tensor:
        # a padded tail (a length sp does not divide) has positions past the end: clamp, never attended to
        x = self.tokens(ids) + self.positions(positions.clamp(max=SEQ - 1))
        for block in self.blocks:
            x = block(x, sp, seq_len)
        return self.head(self.norm(x))


def batch(step: int, size: int = 4) -> torch.Tensor:
    """Whole sequences, the same on every process: counting with a random start and stride (learnable)."""
    g = torch.Generator().manual_seed(step)
    start, stride = torch.randint(0, VOCAB, (size, 1), generator=g), torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def loss_of(engine: Any, ids: torch.Tensor) -> torch.Tensor:
    sp = engine.sequence_parallel  # None unless sequence_parallel_size > 1
    if sp is None:
        labels = F.pad(ids[:, 1:], (0, 1), value=-100)  # the next token; none after the last
        logits = engine(ids, torch.arange(SEQ).expand_as(ids), None, SEQ)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    part = sp.shard_batch({"input_ids": ids, "labels": ids})  # this rank's tokens, positions and labels
    logits = engine(part["input_ids"], part["position_ids"], sp, part["seq_len"])
    return sp.loss(logits, part["shift_labels"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--local_rank", type=int, default=0, help="set by the launcher")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = {"train_micro_batch_size_per_gpu": 4, "sequence_parallel_size": world,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 1}}
    torch.manual_seed(0)  # the same weights on every process
    engine, *_ = deepshard.initialize(model=TinyLM(), config=config)
    for step in range(1, args.steps + 1):
        loss = loss_of(engine, batch(step))
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            print(f"step {step:3d}  loss {loss.item():.6f}  (sequence parallel size {world})", flush=True)


if __name__ == "__main__":
    main()
