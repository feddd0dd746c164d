"""A small mixture-of-experts model, its experts placed by global id, and the single-process PyTorch
reference the expert-parallel runs are compared with."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.moe.layer import MoE
from deepshard.topology import ParallelDims
from tests.multiproc.models import CLASSES, IN_FEATURES

HIDDEN = 16


class MoENet(nn.Module):
    """Dense in, two MoE layers (``experts`` and 2 experts), dense out; the loss adds 0.01 x each layer's
    l_aux. Routing draws no random numbers (no RTS, no top-2 sampling), so a reference on one process
    routes exactly as the distributed run."""

    def __init__(self, experts: int = 4, ep_size: int = 1, k: int = 2, drop_tokens: bool = True,
                 capacity_factor: float = 1.0, residual: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(IN_FEATURES, HIDDEN)
        mlp = nn.Sequential(nn.Linear(HIDDEN, 24), nn.ReLU(), nn.Linear(24, HIDDEN))
        options = {"k": k, "drop_tokens": drop_tokens, "capacity_factor": capacity_factor, "use_rts": False,
                   "top2_2nd_expert_sampling": False, "min_capacity": 0, "use_residual": residual}
        self.moe_a = MoE(HIDDEN, mlp, num_experts=experts, ep_size=ep_size, **options)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.moe_b = MoE(HIDDEN, mlp, num_experts=2, ep_size=min(ep_size, 2), **options)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        h, aux_a, _ = self.moe_a(h)
        h = torch.tanh(self.mid(h))
        h, aux_b, _ = self.moe_b(h)
        return F.cross_entropy(self.head(h).float(), y) + 0.01 * (aux_a + aux_b)


def _full(seed: int, **options: Any) -> MoENet:
    """All experts on one process (ep_size 1), each expert made different from the others."""
    torch.manual_seed(seed)
    net = MoENet(ep_size=1, **options)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for layer in (net.moe_a, net.moe_b):
            for expert in layer.deepspeed_moe.experts.deepspeed_experts:
                for p in expert.parameters():
                    p.add_(0.2 * torch.randn(p.shape, generator=g))
    return net


def ep_rank_of(rank: int, world: int, ep_size: int) -> int:
    """This rank's place in its expert-parallel group (DeepSpeed's default layout, pure data parallel)."""
    ep_groups, _ = ParallelDims(dp=world).expert_group_ranks(ep_size)
    return next(group.index(rank) for group in ep_groups if rank in group)


def make_moe_model(rank: int, world: int, ep_size: int, seed: int = 0, **options: Any) -> MoENet:
    """The model with experts over ``ep_size`` ranks, holding the reference's values: dense weights as in
    :func:`_full`, local expert ``i`` of a layer = global expert ``ep_rank * local + i``."""
    full = _full(seed, **options)
    if ep_size == 1:
        return full
    net = MoENet(ep_size=ep_size, **options)
    source = full.state_dict()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if ".deepspeed_experts." in name:
                layer = net.get_submodule(name.split(".deepspeed_moe.")[0])
                head, tail = name.split(".deepspeed_experts.")
                local, rest = tail.split(".", 1)
                ep_rank = ep_rank_of(rank, world, layer.ep_size)
                name = f"{head}.deepspeed_experts.{ep_rank * layer.num_local_experts + int(local)}.{rest}"
            p.copy_(source[name])
    return net


def reference_moe(batches: list[tuple[torch.Tensor, torch.Tensor]], chunks: int | list[int], clip: float,
                  lr: float = 1e-2, sizes: tuple[int, ...] | None = None,
                  **options: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process PyTorch: every expert on one process; each step the mean of the losses of the
    ``chunks`` micro-batches (ranks x accumulation steps; a list: per step) the global batch is cut into (an
    MoE layer's capacity and l_aux are per micro-batch), AdamW, torch's clip_grad_norm_. ``sizes``: cut
    every batch into micro-batches of these sizes instead (uneven token counts per rank)."""
    per_step = chunks if isinstance(chunks, list) else [chunks] * len(batches)
    model = _full(0, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for (x, y), cut in zip(batches, per_step):
        bounds = _bounds(sizes or [x.shape[0] // cut] * cut)
        loss = torch.stack([model(x[a:b], y[a:b]) for a, b in bounds]).mean()
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bounds(sizes: Any) -> list[tuple[int, int]]:
    """(start, end) of consecutive slices of these sizes."""
    ends = torch.tensor(list(sizes)).cumsum(0).tolist()
    return [(end - size, end) for size, end in zip(sizes, ends)]


def uneven_slice(batch: tuple[torch.Tensor, torch.Tensor], sizes: tuple[int, ...], rank: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s samples when the ranks take consecutive slices of ``sizes`` samples."""
    start, end = _bounds(sizes)[rank]
    return batch[0][start:end], batch[1][start:end]


def tiny_moe_config(kind: str) -> Any:
    """A tiny transformers MoE model's config (no download): 4 experts, top-2, 2 layers."""
    import transformers

    common = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 32}
    if kind == "mixtral":
        return transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **common)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(intermediate_size=32, moe_intermediate_size=24, num_experts=4,
                                           num_experts_per_tok=2, shared_expert_intermediate_size=24, **common)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=24, num_experts=4,
                                           num_experts_per_tok=2, head_dim=8, **common)
    if kind == "olmoe":
        return transformers.OlmoeConfig(intermediate_size=32, num_experts=4, num_experts_per_tok=2, **common)
    raise ValueError(kind)


def make_hf_moe(kind: str, seed: int = 0) -> nn.Module:
    """A tiny transformers MoE model of ``kind``, or (``"inline"``) a model whose MoE blocks read their fused
    experts' weights themselves (``tests/multiproc/inline_moe.py``)."""
    import transformers

    torch.manual_seed(seed)
    if kind == "inline":
        from tests.multiproc.inline_moe import InlineMoELM

        return InlineMoELM()
    config = tiny_moe_config(kind)
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config)


def token_batches(steps: int, batch: int, seed: int = 3, length: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (batch, length), generator=g) for _ in range(steps)]


def reference_hf(kind: str, batches: list[torch.Tensor], clip: float = 1.0, lr: float = 1e-2
                 ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The dense run: one process, every expert, the whole batch, AdamW, torch's clipping."""
    model = make_hf_moe(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
