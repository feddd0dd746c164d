"""Per-rank bodies for automatic TP: an unmodified model sharded by ``autotp_model`` trains exactly as the
plain model (tp=2 on a 2 x 2 grid's tp groups, tp=4 on the world); Hugging Face LLaMA and GPT-2 models
when ``transformers`` is installed; the identical-inputs check."""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from deepshard.comm.group import CommGroup
from deepshard.tp import clip_tp_grad_norm_, shard_of
from deepshard.tp.autotp import autotp_model, split_names
from deepshard.tp.autotp_config import parse_tp_config
from deepshard.tp.params import tp_split_dim
from tests.multiproc.tp_models import LlamaLike, LlamaLikeConfig


def _slice(full: torch.Tensor, p: torch.Tensor, group: CommGroup) -> torch.Tensor:
    dim = tp_split_dim(p)
    return full if dim is None else shard_of(full, dim, group.rank, group.size, getattr(p, "tp_fused_parts", None))


def _worst(model: nn.Module, ref: nn.Module, group: CommGroup, grads: bool) -> float:
    full = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        r = full[name].grad if grads else full[name].detach()
        mine = p.grad if grads else p.detach()
        worst = max(worst, float((mine - _slice(r, p, group)).abs().max()))
    return worst


def compare_training(make: Callable[[], nn.Module], loss_of: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                     group: CommGroup, vocab: int, seed: int) -> dict[str, Any]:
    """Three SGD steps with clipping: the plain model vs its automatically sharded copy."""
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    plan = autotp_model(model, group, parse_tp_config({"autotp_size": group.size}))
    out = {"split": len(split_names(plan)), "same_keys": list(model.state_dict()) == list(ref.state_dict()),
           "loss": 0.0, "grad": 0.0, "norm": 0.0}
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        ids = torch.randint(0, vocab, (2, 9), generator=g)
        losses = [loss_of(m, ids) for m in (ref, model)]
        for loss in losses:
            loss.backward()
        out["loss"] = max(out["loss"], abs(float(losses[0].detach()) - float(losses[1].detach())))
        out["grad"] = max(out["grad"], _worst(model, ref, group, grads=True))
        norms = (torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5),
                 clip_tp_grad_norm_(model.parameters(), 0.5, group))
        out["norm"] = max(out["norm"], abs(float(norms[0]) - float(norms[1])))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out["params"] = _worst(model, ref, group, grads=False)
    return out


def _llama_like_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids[:, :-1], ids[:, 1:])


def _hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _hf_models() -> dict[str, Callable[[], nn.Module]]:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    except ImportError:
        return {}
    llama = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1,
                        attn_implementation="eager")
    gpt2 = GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1, attn_implementation="eager")
    return {"hf_llama": lambda: LlamaForCausalLM(llama), "hf_gpt2": lambda: GPT2LMHeadModel(gpt2)}


def _input_check(group: CommGroup) -> str:
    torch.manual_seed(0)
    model = LlamaLike()
    autotp_model(model, group, parse_tp_config({"autotp_size": group.size}))
    ids = torch.full((1, 5), group.rank % 3)  # tp rank 0 and 1 differ
    try:
        model(ids, ids)
    except RuntimeError as err:
        return str(err)
    return ""


def _traffic(group: CommGroup) -> dict[str, Any]:
    """One forward/backward of the sharded LlamaLike (separate q/k/v and gate/up layers)."""
    torch.manual_seed(0)
    model = LlamaLike(LlamaLikeConfig(num_key_value_heads=4))
    autotp_model(model, group, parse_tp_config({"autotp_size": group.size}))
    ids = torch.randint(0, 32, (2, 9))
    model(ids[:, :-1], ids[:, 1:])  # the first forward runs the identical-inputs check
    group.logger.reset()
    model(ids[:, :-1], ids[:, 1:]).backward()
    return group.logger.summary()


def autotp_checks(group: CommGroup, dp_rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kv = 2 if group.size == 2 else 4
    out["llama_like"] = compare_training(lambda: LlamaLike(LlamaLikeConfig(num_key_value_heads=kv)),
                                         _llama_like_loss, group, 32, seed=5 + dp_rank)
    out["traffic"] = _traffic(group)
    if group.size == 2:
        for name, make in _hf_models().items():
            out[name] = compare_training(make, _hf_loss, group, 64, seed=7 + dp_rank)
        out["input_check"] = _input_check(group)
    return out
