"""A MoE language model whose blocks read their fused experts' weights themselves (the experts module has no
forward), as DeepSpeed's AutoEP test models are written: AutoEP must route for such blocks (Mixtral's rule)
and still train as the dense model does."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, INTER, EXPERTS, TOP_K = 64, 16, 24, 4, 2


class FusedExperts(nn.Module):
    """The fused ``[E, 2I, H]`` / ``[E, H, I]`` weights only."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER) * 0.2)


class InlineMoEBlock(nn.Module):
    """Softmax router, top-2 renormalised, SwiGLU experts computed here, expert by expert."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = FusedExperts()
        self.top_k = TOP_K

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, HIDDEN)
        scores = torch.softmax(self.gate(flat), dim=-1)
        weights, chosen = torch.topk(scores, TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(EXPERTS):
            token, route = (chosen == e).nonzero(as_tuple=True)
            gate, up = (flat[token] @ self.experts.gate_up_proj[e].t()).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.experts.down_proj[e].t()
            out = out.index_add(0, token, y * weights[token, route].unsqueeze(-1))
        return out.reshape(x.shape)


class InlineMoELM(nn.Module):
    """Embedding, 2 pre-norm MoE blocks (``model.layers[i].mlp``), head; ``forward`` returns ``.loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.norm = nn.LayerNorm(HIDDEN)
            layer.mlp = InlineMoEBlock()
            self.model.layers.append(layer)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        h = self.embed(input_ids)
        for layer in self.model.layers:
            h = h + layer.mlp(layer.norm(h))
        logits = self.head(h).float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)
