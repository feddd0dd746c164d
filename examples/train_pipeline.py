"""A DeepSpeed-style pipeline-parallel script: a PipelineModule of LayerSpecs (embedding tied to the
output head), ``engine.train_batch()`` in a loop over a ``RepeatingLoader``. Written against DeepSpeed's
API only; ``import deepshard as deepspeed`` runs it.

    deepshard --num_gpus 2 examples/train_pipeline.py --steps 20          # 2 stages
    deepshard --num_gpus 4 examples/train_pipeline.py --stages 2          # 2 stages x 2 data parallel
    deepshard --num_gpus 2 examples/train_pipeline.py --schedule zb-h1    # the zero-bubble schedule
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import deepshard as deepspeed
from deepshard.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepshard.utils import RepeatingLoader

VOCAB, HIDDEN, SEQ = 64, 32, 16


class Embedding(nn.Embedding):
    def __init__(self) -> None:
        super().__init__(VOCAB, HIDDEN)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def logits(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), labels.reshape(-1))


class CountingTask(torch.utils.data.Dataset):
    """Sequences that count up modulo VOCAB: the next token is learnable."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = (torch.arange(SEQ + 1) + i) % VOCAB
        return seq[:-1], seq[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or zb-h1")
    args = parser.parse_args()
    deepspeed.init_distributed()
    layers = ([TiedLayerSpec("embed", Embedding)] + [LayerSpec(Block) for _ in range(4)]
              + [TiedLayerSpec("embed", Embedding, forward_fn=logits)])
    model = PipelineModule(layers=layers, num_stages=args.stages, loss_fn=loss_fn, seed_layers=True)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, "steps_per_print": 5,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 1},
              "pipeline": {"schedule": args.schedule}}
    engine, _, loader, _ = deepspeed.initialize(model=model, config=config, training_data=CountingTask(),
                                                model_parameters=[p for p in model.parameters() if p.requires_grad])
    data = RepeatingLoader(loader)
    first = last = None
    for step in range(args.steps):
        loss = engine.train_batch(data)
        first = float(loss) if first is None else first
        last = float(loss)
    if engine.global_rank == 0:
        print(f"stage {engine.stage_id}: loss {first:.4f} -> {last:.4f} after {args.steps} steps "
              f"(first stage {engine.is_first_stage()}, last stage {engine.is_last_stage()})")


if __name__ == "__main__":
    main()
