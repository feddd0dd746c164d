"""Automatic tensor parallelism for Hugging Face-style decoders, with no change to the model's code.

``plan_model`` decides, per layer, how to split it (no process group: unit-testable); ``apply_plan``
swaps each split layer for its tensor-parallel form in place, keeping the parameter names (``weight``,
``bias``), so the state dict's keys stay the model's own. Priority of the decisions (as DeepSpeed's
AutoTP): the config's ``partition_config.layer_specs`` > the model's Hugging Face ``tp_plan`` > the
naming rules below.

Naming rules (the last component of a module's qualified name):

- column (split the outputs): ``q_proj k_proj v_proj gate_proj up_proj query key value fc1 c_fc w1 w3
  wq wk wv dense_h_to_4h``; fused ones are split part by part: ``c_attn qkv_proj Wqkv wqkv`` (q, k, v)
  and ``gate_up_proj`` (gate, up).
- row (split the inputs; the bias is added after the all-reduce): ``o_proj out_proj down_proj c_proj
  fc2 w2 wo dense_4h_to_h``.
- ``lm_head``: column with the output gathered (the model's own loss sees full logits); the token
  embedding (``embed_tokens wte word_embeddings tok_embeddings``): vocab-parallel. Tied to each other,
  both stay replicated (DeepSpeed does the same), and stay tied.
- replicated: MoE routers (``gate router``), classification heads (``score classifier``), every other
  embedding (positions), every norm.

A linear layer matching none of them is an error that names it, with the ``layer_specs`` fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any, Optional

import torch
from torch import nn

from deepshard.comm.group import CommGroup
from deepshard.tp.autotp_config import AutoTPConfig
from deepshard.tp.layers import ColumnParallelLinear, RowParallelLinear, SharedInput, VocabParallelEmbedding

COLUMN_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "query", "key", "value", "fc1",
                          "c_fc", "w1", "w3", "wq", "wk", "wv", "dense_h_to_4h"})
ROW_NAMES = frozenset({"o_proj", "out_proj", "down_proj", "c_proj", "fc2", "w2", "wo", "dense_4h_to_h"})
FUSED_QKV_NAMES = frozenset({"c_attn", "qkv_proj", "Wqkv", "wqkv"})
FUSED_PAIR_NAMES = frozenset({"gate_up_proj"})
HEAD_NAMES = frozenset({"lm_head"})
TOKEN_EMBEDDING_NAMES = frozenset({"embed_tokens", "wte", "word_embeddings", "tok_embeddings"})
REPLICATED_NAMES = frozenset({"gate", "router", "score", "classifier"})
HEAD_COUNT_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads", "split_size",
                    "all_head_size", "num_kv_heads")
_TP_PLAN_KINDS = {"colwise": "column", "rowwise": "row", "colwise_gather_output": "gather",
                  "replicated": "skip", "embedding_rowwise": "vocab", "packed_colwise": "column"}


@dataclass(frozen=True)
class Decision:
    """How one layer is split: ``column``, ``row``, ``gather`` (column with the output gathered),
    ``vocab`` (embedding rows) or ``skip`` (replicated); ``parts``: a fused layer's part sizes;
    ``source``: which rule decided (``config``, ``tp_plan``, ``naming``)."""

    kind: str
    source: str
    parts: Optional[tuple[int, ...]] = None
    transposed: bool = False


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` or GPT-2's ``Conv1D`` (a linear layer storing its weight as ``[in, out]``)."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def _transposed(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


def _tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's Hugging Face tensor-parallel plan (patterns relative to the base model)."""
    plan = dict(getattr(model, "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    plan.update(getattr(config, "base_model_tp_plan", None) or {})
    return plan


def _from_tp_plan(name: str, plan: dict[str, str]) -> Optional[str]:
    for pattern, style in plan.items():
        if fnmatch(name, pattern) or fnmatch(name, "*." + pattern):
            return _TP_PLAN_KINDS.get(style)
    return None


def _fused_parts(module: nn.Module, leaf: str, model: nn.Module) -> Optional[tuple[int, ...]]:
    """The part sizes of a fused projection (q, k, v or gate, up) along its output features."""
    out = module.weight.shape[1] if _transposed(module) else module.weight.shape[0]
    if leaf in FUSED_PAIR_NAMES:
        return (out // 2, out // 2)
    if leaf not in FUSED_QKV_NAMES:
        return None
    heads, kv_heads = head_counts(model)
    if heads and kv_heads and kv_heads != heads:
        head_dim = out // (heads + 2 * kv_heads)
        return (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    return (out // 3, out // 3, out // 3)


def _tied_ids(model: nn.Module) -> set[int]:
    """Parameters held by more than one module (tied embedding and head)."""
    owners: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {pid for pid, n in owners.items() if n > 1}


def _by_naming(name: str, module: nn.Module, model: nn.Module, tied: set[int]) -> Optional[Decision]:
    leaf = name.rsplit(".", 1)[-1]
    is_tied = id(module.weight) in tied
    if isinstance(module, nn.Embedding):
        kind = "vocab" if leaf in TOKEN_EMBEDDING_NAMES and not is_tied else "skip"
        return Decision(kind, "naming")
    if leaf in HEAD_NAMES:
        return Decision("skip" if is_tied else "gather", "naming", transposed=_transposed(module))
    if leaf in REPLICATED_NAMES:
        return Decision("skip", "naming")
    if leaf in ROW_NAMES:
        return Decision("row", "naming", transposed=_transposed(module))
    if leaf in COLUMN_NAMES or leaf in FUSED_QKV_NAMES or leaf in FUSED_PAIR_NAMES:
        return Decision("column", "naming", _fused_parts(module, leaf, model), _transposed(module))
    return None


def _decide(name: str, module: nn.Module, model: nn.Module, config: AutoTPConfig, plan: dict[str, str],
            tied: set[int]) -> Optional[Decision]:
    for rule in config.rules:
        if rule.matches(name):
            return Decision(rule.partition_type, "config", rule.parts, _transposed(module))
    if not config.use_default_specs:
        return Decision("skip", "config")
    kind = _from_tp_plan(name, plan)
    if kind is not None and not (kind != "skip" and id(module.weight) in tied):
        leaf = name.rsplit(".", 1)[-1]
        parts = _fused_parts(module, leaf, model) if kind == "column" and is_linear(module) else None
        return Decision(kind, "tp_plan", parts, _transposed(module))
    return _by_naming(name, module, model, tied)


def plan_model(model: nn.Module, config: AutoTPConfig) -> dict[str, Decision]:
    """Every linear layer's and embedding's decision; raises naming the layers no rule classifies."""
    check_head_counts(model, config.tp_size)
    plan, tied = _tp_plan(model), _tied_ids(model)
    decisions: dict[str, Decision] = {}
    unknown: list[str] = []
    for name, module in model.named_modules():
        if not (is_linear(module) or isinstance(module, nn.Embedding)):
            continue
        decision = _decide(name, module, model, config, plan, tied)
        if decision is None:
            unknown.append(f"{name} ({type(module).__name__} {tuple(module.weight.shape)})")
        else:
            decisions[name] = decision
    if unknown:
        raise ValueError(
            f"automatic tensor parallelism cannot classify {len(unknown)} layer(s): {', '.join(unknown)}. "
            "Say how to split them in the config: \"tensor_parallel\": {\"partition_config\": {\"layer_specs\": "
            "[{\"patterns\": [\"<regex of the name>\"], \"partition_type\": \"column\" | \"row\" | \"skip\"}]}} "
            "(column: a layer feeding the attention or the MLP; row: the one leaving it; skip: replicated)")
    return decisions


def head_counts(model: nn.Module) -> tuple[Optional[int], Optional[int]]:
    """``(attention heads, key/value heads)`` from the model's config, when it has one."""
    config = getattr(model, "config", None)
    heads = next((getattr(config, a) for a in ("num_attention_heads", "n_head", "num_heads")
                  if isinstance(getattr(config, a, None), int)), None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    return heads, kv_heads if isinstance(kv_heads, int) else heads


ATTENTION_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads")


def attention_head_counts(model: nn.Module, module_attributes: bool = False) -> tuple[Optional[int], Optional[int]]:
    """``(query heads, key/value heads)`` of the model's attention: its config's counts; else, with
    ``module_attributes`` (a model automatic TP has not split yet, so the counts are whole), the first
    module carrying an integer head count (``num_heads`` ...; key/value heads from ``num_key_value_heads`` /
    ``num_kv_heads``, the query count when absent). ``(None, None)`` when neither says."""
    heads, kv_heads = head_counts(model)
    if heads is not None or not module_attributes:
        return heads, kv_heads
    for module in model.modules():
        found = next((getattr(module, a) for a in ATTENTION_HEAD_ATTRS if _is_count(getattr(module, a, None))), None)
        if found is not None:
            kv = next((getattr(module, a) for a in KV_HEAD_ATTRS if _is_count(getattr(module, a, None))), found)
            return found, kv
    return None, None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_head_counts(model: nn.Module, tp: int) -> None:
    """The tensor-parallel size must divide the attention and key/value head counts."""
    heads, kv_heads = head_counts(model)
    for what, count in (("attention heads (config.num_attention_heads)", heads),
                        ("key/value heads (config.num_key_value_heads)", kv_heads)):
        if count is not None and count % tp != 0:
            fits = [d for d in range(1, count + 1) if count % d == 0]
            raise ValueError(f"tensor-parallel size {tp} does not divide the model's {count} {what}: each rank "
                             f"must hold whole heads; use a tensor-parallel size in {fits}")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def _parallel_module(module: nn.Module, decision: Decision, group: CommGroup) -> Optional[nn.Module]:
    if decision.kind in ("column", "gather"):
        return ColumnParallelLinear.from_linear(module, group, gather_output=decision.kind == "gather",
                                                parts=decision.parts, transposed=decision.transposed)
    if decision.kind == "row":
        return RowParallelLinear.from_linear(module, group, transposed=decision.transposed)
    if decision.kind == "vocab":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"a vocab-parallel split needs an nn.Embedding, got {type(module).__name__}")
        return VocabParallelEmbedding.from_embedding(module, group)
    return None


def _divide_head_attrs(model: nn.Module, split_parents: set[str], tp: int) -> None:
    """Attention modules that count their heads locally (GPT-2's ``split_size``) now hold 1/tp of them."""
    for parent_name in split_parents:
        parent = model.get_submodule(parent_name) if parent_name else model
        for attr in HEAD_COUNT_ATTRS:
            value = getattr(parent, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value % tp == 0:
                setattr(parent, attr, value // tp)


def apply_plan(model: nn.Module, decisions: dict[str, Decision], group: CommGroup) -> int:
    """Swap every split layer for its tensor-parallel form; returns how many were split."""
    split_parents: set[str] = set()
    count = 0
    shared = SharedInput(group)  # q/k/v (gate/up) reading one tensor all-reduce its gradient once
    for name, decision in decisions.items():
        new = _parallel_module(model.get_submodule(name), decision, group)
        if new is None:
            continue
        if isinstance(new, ColumnParallelLinear):
            new.shared_input = shared
        _replace(model, name, new)
        count += 1
        if decision.kind == "column":
            split_parents.add(name.rpartition(".")[0])
    _divide_head_attrs(model, split_parents, group.size)
    return count


def _fingerprint(value: Any, out: list[tuple[Any, ...]]) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().double().reshape(-1).cpu()
        weights = torch.arange(1, t.numel() + 1, dtype=torch.float64)
        out.append((tuple(value.shape), float(t.sum()), float((t * weights).sum())))
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            _fingerprint(value[key], out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _fingerprint(item, out)


def install_input_check(model: nn.Module, group: CommGroup) -> None:
    """At the first forward, check that every rank of the tensor-parallel group got the same inputs
    (they compute one model together); then the check removes itself."""
    if group.size == 1:
        return

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        mine: list[tuple[Any, ...]] = []
        _fingerprint((args, kwargs), mine)
        first = group.broadcast_object(mine, src=0)
        if group.all_reduce_max_flag(first != mine):
            raise RuntimeError(
                f"tensor-parallel ranks {list(group.peers)} received different inputs at the first forward; "
                "every rank of a tensor-parallel group must get the same batch: shard the data by the "
                "data-parallel rank (engine.topology.coord.dp, as deepshard's dataloader does), not by the "
                "global rank")

    handle = model.register_forward_pre_hook(check, with_kwargs=True)


def autotp_model(model: nn.Module, group: CommGroup, config: AutoTPConfig) -> dict[str, Decision]:
    """Shard ``model`` in place over ``group`` (``config.tp_size`` must equal its size); returns the plan."""
    if config.tp_size != group.size:
        raise ValueError(f"tensor_parallel.autotp_size is {config.tp_size} but the tensor-parallel group has "
                         f"{group.size} ranks; the grid's tp size comes from the config, so they must agree")
    if config.dtype is not None:
        model.to(config.dtype)
    decisions = plan_model(model, config)
    apply_plan(model, decisions, group)
    install_input_check(model, group)
    return decisions


def split_names(decisions: dict[str, Decision]) -> list[str]:
    """The layers a plan splits (for logs and tests)."""
    return [n for n, d in decisions.items() if d.kind != "skip"]



def apply_tensor_parallel(model: nn.Module, section: Any, topology: Any) -> Optional[dict[str, Decision]]:
    """``initialize``'s tensor-parallel step: shard ``model`` over ``topology.tp`` when the config's
    ``tensor_parallel`` section (or ``tp_model_init``) asks for automatic TP; None when it does not
    (a model built with the Megatron layers, or no TP at all, is left as it is)."""
    from deepshard.tp.autotp_config import resolve_tp_config
    from deepshard.utils.logging import logger

    config = resolve_tp_config(model, section)
    if not config.enabled:
        return None
    decisions = autotp_model(model, topology.tp, config)
    if topology.rank == 0:
        logger.info("automatic tensor parallelism over %d ranks: %d layers split, %d replicated", config.tp_size,
                    len(split_names(decisions)), len(decisions) - len(split_names(decisions)))
    return decisions
