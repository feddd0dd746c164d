"""Per-rank body of the combination matrix (``combinations.py``): every cell of one world size runs in one
spawned world, one after another.

One small decoder, written four ways with the same parameter names and the same initial values: plain
layers, plain layers split by automatic TP, user-written Megatron-style layers (slices marked with
``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``, communicating themselves) and a
version whose token embedding is also the output head (tied), and one whose blocks start with causal
self-attention (attn: the sequence-parallel cells split its tokens over the sp ranks). At pp=1 it is one module whose children are
named as a ``PipelineModule``'s layers (``0.``, ``1.``, ``tied_modules.embed.``), so a checkpoint moves
between pipeline and non-pipeline grids. The reference is the plain (or tied) model in this process:
SGD with momentum (sensitive to the clipping coefficient) and torch's ``clip_grad_norm_``.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deepshard.comm.nodes import NODE_SIZE_VAR
from tests.multiproc.combinations import (ZEROPP_NODE_SIZE, Cell, cells, refusal_substrings, reload_cell,
                                          zeropp_keys)

VOCAB, HIDDEN, FFN, SEQ, HEADS, KV_HEADS, HEAD_DIM = 16, 8, 16, 4, 4, 2, 2
MOE_EXPERTS = 4
BASE_SEED, LR, CLIP, STEPS = 1234, 0.1, 0.3, 3  # STEPS - 1 before the checkpoint, 1 after it


# ----------------------------------------------------------------------------------------- models
class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)


class TiedEmbed(nn.Embedding):
    def __init__(self) -> None:
        super().__init__(VOCAB, HIDDEN)


def tied_head(module: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight.t()


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lm_head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.up_proj, self.down_proj = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(F.gelu(self.up_proj(self.ln(x))))


class AttnBlock(Block):
    """Causal self-attention with grouped-query heads (``HEADS`` query heads, ``kv_heads`` key/value heads),
    then ``Block``'s MLP. With ``sp`` set (a ``deepshard.sp.SequenceParallel``) ``x`` holds this rank's
    tokens of a ``SEQ``-token sequence and the attention runs sequence-parallel. The head counts are
    attributes automatic TP divides (each tensor-parallel rank holds heads/tp and kv_heads/tp)."""

    def __init__(self, kv_heads: int = KV_HEADS) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads = HEADS, kv_heads
        self.attn_ln = nn.LayerNorm(HIDDEN)
        self.q_proj, self.o_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM), nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.k_proj, self.v_proj = nn.Linear(HIDDEN, kv_heads * HEAD_DIM), nn.Linear(HIDDEN, kv_heads * HEAD_DIM)
        self.sp: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.o_proj(self.heads(self.attn_ln(x))))

    def heads(self, h: torch.Tensor) -> torch.Tensor:
        """The attention of this block's heads over ``h`` [b, s, num_heads * HEAD_DIM] (before ``o_proj``)."""
        b, s, _ = h.shape
        q, k, v = (proj(h).view(b, s, n, HEAD_DIM).transpose(1, 2) for proj, n in (
            (self.q_proj, self.num_heads), (self.k_proj, self.num_key_value_heads),
            (self.v_proj, self.num_key_value_heads)))
        if self.sp is None:
            group = self.num_heads // self.num_key_value_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = self.sp.attention(q, k, v, SEQ)
        return att.transpose(1, 2).reshape(b, s, self.num_heads * HEAD_DIM)


def _megatron_slice(linear: nn.Linear, name: str, dim: int, rank: int, size: int) -> None:
    """Keep ``rank``'s slice of ``linear.<name>`` along ``dim``, marked the way Megatron marks it."""
    full = getattr(linear, name)
    step = full.shape[dim] // size
    part = nn.Parameter(full.detach().narrow(dim, rank * step, step).clone())
    part.tensor_model_parallel, part.partition_dim, part.partition_stride = True, dim, 1
    setattr(linear, name, part)


class MegatronBlock(Block):
    """A user's own column/row-parallel MLP (as Megatron-LM writes it): the full layers are drawn as in
    ``Block``, then each rank keeps its slice; the layer does its own communication."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        rank, size = (group.rank, group.size) if group is not None else (0, 1)
        _megatron_slice(self.up_proj, "weight", 0, rank, size)
        _megatron_slice(self.up_proj, "bias", 0, rank, size)
        _megatron_slice(self.down_proj, "weight", 1, rank, size)  # its bias stays whole (replicated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepshard.tp.mappings import copy_to_tp_region, reduce_from_tp_region

        y = self.ln(x)
        if self.group is not None:
            y = copy_to_tp_region(y, self.group)
        h = F.gelu(self.up_proj(y))
        out = F.linear(h, self.down_proj.weight)
        if self.group is not None:
            out = reduce_from_tp_region(out, self.group)
        return x + out + self.down_proj.bias


class MegatronAttnBlock(AttnBlock):
    """A user's own tensor-parallel attention (as Megatron-LM writes it): the full q/k/v/o layers are drawn
    as in ``AttnBlock``, then each rank keeps its heads' rows of q/k/v and the matching columns of o, and
    counts only its heads (Megatron's heads per partition; the plan cannot read a split model's counts, the
    sequence-parallel attention checks the local heads it is given). The layer does its own communication."""

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        rank, size = (group.rank, group.size) if group is not None else (0, 1)
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            _megatron_slice(proj, "weight", 0, rank, size)
            _megatron_slice(proj, "bias", 0, rank, size)
        _megatron_slice(self.o_proj, "weight", 1, rank, size)  # its bias stays whole (replicated)
        self.num_heads, self.num_key_value_heads = HEADS // size, KV_HEADS // size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepshard.tp.mappings import copy_to_tp_region, reduce_from_tp_region

        if self.group is None:
            return super().forward(x)
        out = F.linear(self.heads(copy_to_tp_region(self.attn_ln(x), self.group)), self.o_proj.weight)
        return Block.forward(self, x + reduce_from_tp_region(out, self.group) + self.o_proj.bias)


class MoEBlock(nn.Module):
    """A residual block around DeepSpeed's MoE layer: ``MOE_EXPERTS`` experts over ``ep`` data-parallel ranks,
    top-2 without token dropping or random draws, l_aux left out (it depends on the micro-batch), so a token's
    output is the same in any batch. Expert ``g`` (global id) has ``0.05 (g + 1)`` added to its first bias,
    so the experts differ from the start and a misplaced one shows."""

    def __init__(self, ep: int = 1) -> None:
        super().__init__()
        from deepshard.moe.layer import MoE

        self.ln = nn.LayerNorm(HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=MOE_EXPERTS, ep_size=ep, k=2, drop_tokens=False, use_rts=False,
                       top2_2nd_expert_sampling=False, min_capacity=0)
        ep_rank = dist.get_rank() % ep if ep > 1 else 0  # DeepSpeed's layout when dp is the whole world
        local = self.moe.num_local_experts
        with torch.no_grad():
            for i, module in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                module[0].bias.add_(0.05 * (ep_rank * local + i + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.ln(x))[0]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def layer_specs(model: str, tp_group: Any = None, ep: int = 1) -> list:
    from deepshard.pipe import LayerSpec, TiedLayerSpec

    block = {"megatron": LayerSpec(MegatronBlock, tp_group), "attn": LayerSpec(AttnBlock),
             "attn_mqa": LayerSpec(AttnBlock, 1), "attn_megatron": LayerSpec(MegatronAttnBlock, tp_group),
             "moe": LayerSpec(MoEBlock, ep)}.get(model, LayerSpec(Block))
    if model == "tied":
        return [TiedLayerSpec("embed", TiedEmbed), block, block, TiedLayerSpec("embed", TiedEmbed, forward_fn=tied_head)]
    return [LayerSpec(Embed), block, block, LayerSpec(Head)]


class Flat(nn.Module):
    """The layers in one module, named as a ``PipelineModule`` names them, each seeded as it seeds them."""

    def __init__(self, specs: list) -> None:
        super().__init__()
        from deepshard.pipe import TiedLayerSpec

        self.tied_modules = nn.ModuleDict()
        self.funcs: list[Callable] = []
        for index, spec in enumerate(specs):
            torch.manual_seed(BASE_SEED + index)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                fn = spec.forward_fn
                self.funcs.append(module if fn is None else (lambda x, m=module, f=fn: f(m, x)))
            else:
                module = spec.build()
                self.add_module(str(index), module)
                self.funcs.append(module)

        self.sp: Any = None

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = ids
        for fn in self.funcs:
            x = fn(x)
        return lm_loss(x, labels) if self.sp is None else self.sp.loss(x, labels)

    def use_sequence_parallel(self, sp: Any) -> None:
        """Split the tokens over ``sp``'s ranks: the attention blocks' and the loss's."""
        self.sp = sp
        for module in self.modules():
            if isinstance(module, AttnBlock):
                module.sp = sp


def reference_kind(model: str) -> str:
    if model == "attn_megatron":  # the same full weights, split by the user's layers
        return "attn"
    return model if model in ("tied", "attn", "attn_mqa", "moe") else "plain"


# ------------------------------------------------------------------------------------ data, reference
def batches(rows: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g) for _ in range(STEPS)]


def micro_batches(batch: torch.Tensor, gas: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = batch[dp_rank * gas:(dp_rank + 1) * gas]
    return [(row[None, :-1], row[None, 1:]) for row in rows]


_REFERENCES: dict[tuple[str, int], dict[str, Any]] = {}


def reference(kind: str, rows: int) -> dict[str, Any]:
    """Single-process PyTorch on the whole global batch: losses, norms (before clipping) and the
    parameters after each step."""
    key = (kind, rows)
    if key not in _REFERENCES:
        state = torch.get_rng_state()
        model = Flat(layer_specs(kind))
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        out: dict[str, Any] = {"losses": [], "norms": [], "params": []}
        for batch in batches(rows):
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
            out["losses"].append(float(loss.detach()))
            out["params"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
        torch.set_rng_state(state)
        _REFERENCES[key] = out
    return _REFERENCES[key]


def rel(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    if set(got) != set(want):
        raise AssertionError(f"names differ: missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}")
    return max(rel(got[k].float(), want[k]) for k in want)


# ---------------------------------------------------------------------------------------- engine
_TOPOLOGIES: dict[tuple[int, int, int, int], Any] = {}


def topology(pp: int, tp: int, dp: int, sp: int = 1) -> Any:
    from deepshard.topology import ParallelDims, Topology

    if (pp, tp, dp, sp) not in _TOPOLOGIES:
        _TOPOLOGIES[(pp, tp, dp, sp)] = Topology.build(ParallelDims(pp=pp, dp=dp, tp=tp, sp=sp))
    return _TOPOLOGIES[(pp, tp, dp, sp)]


def config(cell: Cell, gas: int, directory: str, coalesce: bool = True) -> dict[str, Any]:
    """``coalesce``: stage 3 gathers small blocks as one group each (the default); False: one per module."""
    zero: dict[str, Any] = {"stage": cell.zero}
    if cell.zero == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        if not coalesce:
            zero["stage3_min_gather_size"] = 0
    if cell.offload == "optimizer":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": os.path.join(directory, "swap")}
    if cell.offload == "params":
        zero["offload_param"] = {"device": "nvme", "nvme_path": os.path.join(directory, "swap")}
    zero.update(zeropp_keys(cell))
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
                           "gradient_clipping": CLIP, "zero_optimization": zero,
                           "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}}
    if cell.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if cell.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if cell.model == "autotp" or (cell.model in ("attn", "attn_mqa") and cell.tp > 1):
        cfg["tensor_parallel"] = {"autotp_size": cell.tp}
    if cell.deterministic:
        cfg["deterministic"] = True
    if cell.sp > 1:
        cfg["sequence_parallel_size"] = cell.sp
        cfg["sequence_parallel"] = {"mode": cell.sp_mode, **({"ulysses_size": 2} if cell.sp_mode == "hybrid" else {})}
    return cfg


def make_model(cell: Cell) -> tuple[nn.Module, Any]:
    """``cell``'s model on its grid, and the grid."""
    from deepshard.pipe import PipelineModule

    topo = topology(cell.pp, cell.tp, cell.dp, cell.sp)
    specs = layer_specs(cell.model, topo.tp if cell.model in ("megatron", "attn_megatron") and cell.tp > 1 else None,
                        cell.ep)
    if cell.pp > 1:
        return PipelineModule(specs, topology=topo, loss_fn=lm_loss, seed_layers=True, base_seed=BASE_SEED,
                              partition_method="uniform"), topo
    return Flat(specs), topo


def build(cell: Cell, gas: int, directory: str, model: Optional[nn.Module] = None,
          coalesce: bool = True) -> tuple[Any, nn.Module, Any]:
    """(engine, module, topology) of ``cell``'s grid; raises what ``initialize`` refuses."""
    import deepshard

    made, topo = (model, topology(cell.pp, cell.tp, cell.dp, cell.sp)) if model is not None else make_model(cell)
    engine = deepshard.initialize(model=made, config=config(cell, gas, directory, coalesce), mpu=topo)[0]
    if isinstance(made, Flat):
        made.use_sequence_parallel(engine.sequence_parallel)
    return engine, made, topo


def _grid_dp_rank(model: nn.Module) -> Optional[int]:
    """``model.mpu().get_data_parallel_rank()``, as DeepSpeed's pipeline scripts call it; None without a grid."""
    mpu = model.mpu() if callable(getattr(model, "mpu", None)) else None
    return None if mpu is None else int(mpu.get_data_parallel_rank())


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {name: (tuple(p.shape), p.dtype, float(p.detach().double().sum())) for name, p in model.named_parameters()}


def train_step(engine: Any, cell: Cell, topo: Any, batch: torch.Tensor, gas: int) -> tuple[float, float]:
    """One global batch: (mean loss over the global batch, the engine's reported gradient norm)."""
    micro = micro_batches(batch, gas, topo.coord.dp)
    sp = engine.sequence_parallel
    if sp is not None:  # this rank's tokens of each sample (labels padded with -100)
        micro = [(sp.shard(x), sp.shard(y, pad_value=-100)) for x, y in micro]
    if cell.pp > 1:
        loss = float(engine.train_batch(iter(micro)))
    else:
        total = torch.zeros(())
        for x, y in micro:
            out = engine(x, y)
            engine.backward(out)
            engine.step()
            total += out.detach().float()
        topo.dp.all_reduce(total)
        loss = float(total) / (gas * cell.dp)
    return loss, float(engine.get_global_grad_norm())


def whole_params(engine: Any, model: nn.Module, topo: Any) -> dict[str, torch.Tensor]:
    """Every parameter of the model as one tensor (tensor-parallel slices joined, every stage's layers, every
    expert under its global name), from the engine's fp32 values; the same dict on every rank."""
    from deepshard.placement import expert_of, split_of
    from deepshard.tp.params import unshard

    mine: dict[str, Any] = {}
    experts: dict[str, Any] = {}
    for name, p in model.named_parameters():
        value = engine.strategy.full_fp32_param(p).detach().clone()
        found = expert_of(p)
        if found is not None:  # each expert-parallel rank holds its own experts
            experts[found.saved_name] = (value, None, 0, None)
            continue
        split = split_of(p)
        if split is not None:
            mine[name] = (value, split.dim, split.index, split.fused)
        elif getattr(p, "tensor_model_parallel", False) and topo.dims.tp > 1:
            mine[name] = (value, int(p.partition_dim), topo.coord.tp, None)
        else:
            mine[name] = (value, None, 0, None)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {**(mine if topo.coord.dp == 0 else {}), **experts})
    parts: dict[str, dict[int, Any]] = {}
    for ranks in everyone:
        for name, (value, dim, index, fused) in ranks.items():
            parts.setdefault(name, {})[index] = (value, dim, fused)
    out = {}
    for name, by_index in parts.items():
        value, dim, fused = by_index[0]
        out[name] = value if dim is None else unshard([by_index[i][0] for i in sorted(by_index)], dim, fused)
    return out


# ------------------------------------------------------------------------------------------ a cell
def run_cell(cell: Cell, directory: str) -> dict[str, Any]:
    """Train, compare, save, check the 16-bit and fp32 exports, resume on another grid, compare."""
    rows = cell.dp * cell.gas
    data, ref = batches(rows), reference(reference_kind(cell.model), rows)
    model, _ = make_model(cell)
    before = _snapshot(model)
    has_grid = cell.pp > 1 and _grid_dp_rank(model) is not None  # DeepSpeed's PipelineModule has it at once
    try:
        engine, model, topo = build(cell, cell.gas, directory, model)
    except Exception as err:  # noqa: BLE001 - a refusal is a result here
        # refused before anything was built: the user's model is as it was, no swap directory exists
        untouched = _snapshot(model) == before and not os.path.exists(os.path.join(directory, "swap"))
        return {"refused": f"{type(err).__name__}: {err}", "untouched": untouched}
    if refusal_substrings(cell):
        engine.destroy()
        return {"refused": None}
    out: dict[str, Any] = {"refused": None}
    if cell.zero == 3:  # small blocks gathered as one group each, by default (zero/stage3/units.py)
        out["units"] = len(engine.strategy.units)
    steps = [train_step(engine, cell, topo, batch, cell.gas) for batch in data[:STEPS - 1]]
    out["loss"] = max(rel(loss, want) for (loss, _), want in zip(steps, ref["losses"]))
    out["norm"] = max(rel(norm, want) for (_, norm), want in zip(steps, ref["norms"]))
    out["params"] = worst(whole_params(engine, model, topo), ref["params"][STEPS - 2])
    engine.save_checkpoint(directory, tag="t")
    engine.save_16bit_model(directory, "model16.safetensors")
    if cell.pp > 1:  # before initialize and after it, the grid's data-parallel rank is this rank's
        out["mpu"] = has_grid and _grid_dp_rank(model) == topo.coord.dp
    engine.destroy()
    if dist.get_rank() == 0:
        out.update(_exports(cell, directory, ref["params"][STEPS - 2]))
    dist.barrier()
    out.update(_resumed(cell, directory, data, ref))
    return out


def _exports(cell: Cell, directory: str, want: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The 16-bit file and zero_to_fp32's state dict, each loaded into the plain model (strict)."""
    from deepshard.checkpoint import io as ckpt_io
    from deepshard.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out: dict[str, Any] = {}
    for key, load in (("w16", lambda: ckpt_io.load_tensors(os.path.join(directory, "model16.safetensors"))),
                      ("w32", lambda: get_fp32_state_dict_from_zero_checkpoint(directory, tag="t"))):
        try:
            plain = Flat(layer_specs(reference_kind(cell.model)))
            plain.load_state_dict({k: v.float() for k, v in load().items()}, strict=True)
            out[key] = worst(dict(plain.state_dict()), want)
        except Exception as err:  # noqa: BLE001 - reported per cell
            out[key] = f"{type(err).__name__}: {err}"
    return out


def _resumed(cell: Cell, directory: str, data: list[torch.Tensor], ref: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint loaded by ``reload_cell``'s engine (same global batch): its next step against the
    reference's next step. A stage-3 engine resumes with one group per module (``stage3_min_gather_size``
    0), whatever groups wrote the checkpoint: the groups are the run's, not the checkpoint's."""
    other = reload_cell(cell)
    gas = cell.dp * cell.gas // other.dp
    torch.manual_seed(99)  # other initial values: the load must replace them
    try:
        engine, model, topo = build(other, gas, os.path.join(directory, "again"), coalesce=False)
        units = len(getattr(engine.strategy, "units", ()))
        engine.load_checkpoint(directory, tag="t")
        loss, norm = train_step(engine, other, topo, data[STEPS - 1], gas)
        params = worst(whole_params(engine, model, topo), ref["params"][STEPS - 1])
        engine.destroy()
    except Exception as err:  # noqa: BLE001 - reported per cell
        if os.environ.get("COMBINATIONS_RAISE"):
            raise
        return {"resume": f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-3)}"}
    return {"resume_loss": rel(loss, ref["losses"][STEPS - 1]), "resume_norm": rel(norm, ref["norms"][STEPS - 1]),
            "resume_params": params, "reloaded_as": other.id, "resumed_units": units}


def matrix_world(rank: int, world: int, directory: str, only: Optional[list[str]] = None) -> dict[str, Any]:
    """Every cell of this world size (or the ``only`` ids), one after another, each in its directory."""
    out: dict[str, Any] = {}
    for cell in cells():
        if cell.world != world or (only is not None and cell.id not in only):
            continue
        where = os.path.join(directory, cell.id)
        if cell.zeropp != "none":
            os.environ[NODE_SIZE_VAR] = str(ZEROPP_NODE_SIZE)
        try:
            out[cell.id] = run_cell(cell, where)
        except Exception as err:  # noqa: BLE001 - one cell's failure is that cell's result
            out[cell.id] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-4)}"}
        finally:
            os.environ.pop(NODE_SIZE_VAR, None)
    return out
