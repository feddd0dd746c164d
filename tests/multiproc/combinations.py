"""The combination matrix: which cells of pp x tp x dp x sp x ZeRO x precision x accumulation x offload x
model are tested, which of them are refused (and with which reason), and the markdown table
``docs/parallelism.md`` shows. Pure Python (no process group): the test module, the per-rank scenario and
``python -m tests.multiproc.combinations`` (rewrites the docs table) all read it.

Cells are an all-pairs design over the valid cells (every pair of axis values that can meet does, in at
least one valid cell; generated here, deterministically), the cells where a bug lived (``EXTRA_CELLS``)
cells breaking each refusal rule (``REFUSED_CELLS``) and the sequence-parallel cells (``SP_CELLS``: hand-picked,
an attention model whose tokens are split over the sp ranks). Grids of 8 processes are left out (no pair needs
pp, tp and dp all at 2; ``test_tp_3d.py`` runs that grid).
"""
from __future__ import annotations

import itertools
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

AXES: dict[str, tuple] = {
    "pp": (1, 2), "tp": (1, 2), "dp": (1, 2), "zero": (0, 1, 2, 3), "precision": ("fp32", "bf16", "fp16"),
    "gas": (1, 3), "offload": ("none", "optimizer", "params"), "model": ("plain", "autotp", "megatron", "tied"),
}
MAX_WORLD = 4


@dataclass(frozen=True)
class Cell:
    pp: int
    tp: int
    dp: int
    zero: int
    precision: str
    gas: int
    offload: str
    model: str
    reload: Optional[tuple[int, int, int]] = None
    """(pp, tp, dp) the checkpoint is loaded on; None: chosen by ``reload_grid``."""
    why: str = ""
    """Why the cell is in the matrix beyond the all-pairs design (a bug that lived there)."""
    sp: int = 1
    """``sequence_parallel_size`` (more than 1 only with the attention models ``attn*``)."""
    sp_mode: str = "ulysses"
    """``sequence_parallel.mode``: ulysses, ring or hybrid (hybrid: Ulysses pairs, a ring over them)."""
    zeropp: str = "none"
    """Hierarchical ZeRO (``ZEROPP_KEYS``): none, hybrid (MiCS shard groups of half the data-parallel ranks),
    hpz (secondary shards over 2 ranks), zeropp (hpZ + qwZ + qgZ)."""
    deterministic: bool = False
    """``"deterministic": true`` (``docs/determinism.md``): the canonical sum over micro-batches."""
    ep: int = 1
    """The ``ep_size`` of the ``moe`` model's MoE layers (expert parallelism over the data-parallel ranks)."""

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp * self.sp

    @property
    def id(self) -> str:
        base = (f"pp{self.pp}-tp{self.tp}-dp{self.dp}-z{self.zero}-{self.precision}-gas{self.gas}-"
                f"off_{self.offload}-{self.model}")
        base += f"-sp{self.sp}_{self.sp_mode}" if self.sp > 1 else ""
        base += f"-zpp_{self.zeropp}" if self.zeropp != "none" else ""
        base += "-det" if self.deterministic else ""
        base += f"-ep{self.ep}" if self.ep > 1 else ""
        return base + (f"-reload{''.join(map(str, self.reload))}" if self.reload else "")


# ------------------------------------------------------------------------------------- all pairs
def all_pairs(axes: dict[str, tuple], allowed: Optional[Callable[[dict], bool]] = None) -> list[dict]:
    """A small set of rows covering every pair of values of two different axes (greedy, deterministic):
    each row starts from the first uncovered pair and fills the other axes, in order, with the value
    covering most uncovered pairs (ties: the value listed first). ``allowed(partial_row)`` may rule a
    value out (e.g. a grid too large)."""
    names = list(axes)
    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2) for va in axes[a] for vb in axes[b]}
    order = {(a, va, b, vb): i for i, (a, va, b, vb) in enumerate(
        (a, va, b, vb) for a, b in itertools.combinations(names, 2) for va in axes[a] for vb in axes[b])}
    rows: list[dict] = []
    while uncovered:
        a, va, b, vb = min(uncovered, key=order.__getitem__)
        row = {a: va, b: vb}
        if allowed is not None and not allowed(row):
            uncovered.discard((a, va, b, vb))  # a pair no row may hold (the refused cells cover it)
            continue
        for name in names:
            if name in row:
                continue
            options = [v for v in axes[name] if allowed is None or allowed({**row, name: v})]
            row[name] = max(options, key=lambda v: (_gain(row, name, v, uncovered), -axes[name].index(v)))
        rows.append(row)
        uncovered -= {(x, row[x], y, row[y]) for x, y in itertools.combinations(names, 2)}
    return rows


def _gain(row: dict, name: str, value: object, uncovered: set) -> int:
    return sum(1 for other, v in row.items()
               if (other, v, name, value) in uncovered or (name, value, other, v) in uncovered)


EXTRA_CELLS: list[Cell] = [
    Cell(2, 1, 1, 1, "fp32", 3, "none", "plain",
         why="a 2-stage pipeline's save_16bit_model kept only one stage's layers"),
    Cell(1, 1, 2, 2, "fp32", 1, "none", "tied", reload=(2, 1, 1),
         why="every pipeline stage opened every stage's checkpoint files on load"),
    Cell(1, 2, 1, 1, "fp32", 1, "none", "megatron",
         why="Megatron-attribute parameters were counted as replicated in the gradient norm"),
    Cell(2, 1, 2, 0, "fp32", 1, "none", "plain",
         why="PipelineModule.mpu() returned None"),
]
"""Cells where a bug lived, beyond the all-pairs rows."""

REFUSED_CELLS: list[Cell] = [
    Cell(2, 1, 1, 3, "fp32", 1, "none", "plain"),
    Cell(2, 1, 2, 3, "bf16", 3, "params", "tied"),
    Cell(2, 2, 1, 3, "fp16", 1, "none", "megatron"),
    Cell(1, 1, 1, 0, "fp32", 1, "optimizer", "plain"),
    Cell(1, 2, 2, 0, "fp16", 3, "optimizer", "autotp"),
    Cell(2, 1, 2, 0, "bf16", 1, "optimizer", "tied"),
    Cell(2, 2, 1, 1, "fp32", 1, "none", "autotp"),
    Cell(2, 2, 1, 2, "bf16", 3, "params", "autotp"),
]
"""Cells each breaking one refusal rule (every pair a rule forbids is among them)."""


SP_CELLS: list[Cell] = [
    Cell(1, 1, 1, 1, "fp32", 1, "none", "attn", sp=2, sp_mode="ulysses"),
    Cell(1, 1, 1, 3, "bf16", 1, "none", "attn", sp=2, sp_mode="ring"),
    Cell(1, 1, 2, 2, "fp32", 3, "optimizer", "attn", sp=2, sp_mode="ring"),
    Cell(1, 1, 1, 0, "fp16", 1, "none", "attn", sp=4, sp_mode="hybrid"),
    Cell(1, 2, 1, 1, "fp32", 1, "none", "attn", sp=2, sp_mode="ulysses"),
    Cell(1, 2, 1, 3, "fp32", 1, "none", "attn", sp=2, sp_mode="ring"),
    Cell(1, 2, 1, 2, "fp32", 1, "none", "attn_megatron", sp=2, sp_mode="ring"),
    Cell(2, 1, 1, 1, "fp32", 1, "none", "attn", sp=2),
    Cell(1, 2, 1, 1, "fp32", 1, "none", "attn_mqa", sp=2),
]
"""Sequence parallelism (an ``sp`` value beyond 1 is not an all-pairs axis: it needs the attention model,
4 query heads over 2 key/value heads): every ZeRO stage, each mode, accumulation, offload, the three
precisions; with automatic TP (tp=2 x sp=2: each tensor-parallel rank's 2 query heads and 1 key/value head
go through the sequence-parallel attention), and with the user's own Megatron-style attention layers
(``attn_megatron``: each rank keeps its heads' rows of q/k/v; the plan cannot read the counts, the attention
checks the local heads); refused with pp, and with tp where the heads do not divide
(``attn_mqa``: one key/value head)."""


ZEROPP_CELLS: list[Cell] = [
    Cell(1, 1, 4, 3, "fp32", 1, "none", "tied", zeropp="hybrid"),
    Cell(1, 2, 2, 2, "bf16", 3, "optimizer", "autotp", zeropp="hybrid"),
    Cell(1, 1, 2, 3, "fp16", 1, "optimizer", "tied", zeropp="hpz"),
    Cell(1, 1, 4, 3, "bf16", 3, "params", "plain", zeropp="zeropp"),
    Cell(1, 2, 2, 3, "fp32", 1, "none", "megatron", zeropp="zeropp"),
    Cell(1, 1, 2, 0, "fp32", 1, "none", "plain", zeropp="hybrid"),
    Cell(1, 1, 2, 2, "fp32", 1, "none", "plain", zeropp="hpz"),
]
"""Hybrid sharding and ZeRO++ (not an all-pairs axis: each needs 2 or more data-parallel ranks, and the
quantized cells a tolerance of their own): with tensor parallelism (automatic and the user's), the three
precisions, accumulation and both offloads; refused at stage 0 (hybrid) and below stage 3 (hpZ)."""

DETERMINISTIC_CELLS: list[Cell] = [
    Cell(1, 1, 2, 2, "fp32", 3, "optimizer", "tied", deterministic=True),
    Cell(1, 2, 2, 1, "bf16", 3, "none", "megatron", deterministic=True),
    Cell(1, 1, 4, 3, "fp32", 3, "params", "plain", deterministic=True),
    Cell(1, 1, 2, 0, "fp16", 3, "none", "plain", deterministic=True),
    Cell(2, 1, 2, 1, "fp32", 3, "none", "plain", deterministic=True),
    Cell(1, 1, 2, 3, "fp32", 3, "optimizer", "tied", deterministic=True),
]
"""The deterministic mode (not an all-pairs axis: its bitwise claims are ``test_determinism.py``'s; here it
trains to the single-process result): every stage, accumulation, both offloads, tensor parallelism, the
three precisions; refused with a pipeline, and at ZeRO-3 with gradients in swap files and accumulation."""

MOE_CELLS: list[Cell] = [
    Cell(1, 1, 2, 0, "fp32", 3, "none", "moe", ep=2),
    Cell(1, 1, 2, 2, "bf16", 1, "none", "moe", ep=2),
    Cell(1, 1, 2, 3, "fp16", 1, "none", "moe", ep=2),
    Cell(1, 1, 4, 1, "fp32", 1, "optimizer", "moe", ep=2),
    Cell(1, 2, 1, 1, "fp32", 1, "none", "moe"),
    Cell(2, 1, 1, 1, "fp32", 3, "none", "moe"),
    Cell(1, 2, 2, 1, "fp32", 1, "none", "moe", ep=2),
    Cell(2, 1, 2, 1, "fp32", 1, "none", "moe", ep=2),
]
"""Mixture of experts (not an all-pairs axis: the ``moe`` model's blocks are DeepSpeed's ``MoE`` layer, 4
experts, top-2 without token dropping, l_aux left out of the loss, so each token's output does not depend on
the batch it came in and the single-process reference holds every expert): experts split over 2 of 2 or 4
data-parallel ranks at every ZeRO stage (3: beyond DeepSpeed), the three precisions, accumulation, offload;
replicated experts (ep 1) with tensor parallelism and inside a pipeline; split experts refused with either.
The checkpoint resumes with the experts whole (ep 1)."""

MOE_BF16_TOLERANCE = 5e-2
"""Relative error allowed for the bf16 mixture-of-experts cell against the fp32 reference: the LayerNorm bias in
front of the first MoE layer (zero at the start, small after two updates) is off by 0.033 of its norm
(measured; every other tensor within 0.01). A misrouted or misplaced expert moves its tensors by their whole
update."""

ZEROPP_TOLERANCE = 0.2
"""Relative error allowed for the quantized cells (``zeropp``: 8-bit weights, 4-bit gradients in two hops on
the 4-rank cells) against the fp32 reference over the matrix's 3 steps: the parameters' worst element moves by
about a tenth of the update (0.11 measured; ``test_zeropp.py`` allows the same 0.2). A wrong sum or scale
moves them by the whole update."""


def zeropp_keys(cell: Cell) -> dict[str, object]:
    """The ``zero_optimization`` keys of ``cell.zeropp``. On one data-parallel rank (a checkpoint reloaded on
    another grid) hpZ is off: a secondary shard over 1 rank is the primary one."""
    replicas = cell.dp * cell.sp
    if cell.zeropp == "hybrid":
        return {"mics_shard_size": max(replicas // 2, 1)}
    if cell.zeropp == "hpz":
        return {"zero_hpz_partition_size": min(2, replicas)}
    if cell.zeropp == "zeropp":
        return {"zero_hpz_partition_size": min(2, replicas), "zero_quantized_weights": True,
                "zero_quantized_gradients": True}
    return {}


ZEROPP_NODE_SIZE = 2
"""The zeropp cells' ranks are faked as machines of 2 (``DEEPSHARD_NODE_SIZE``): on 4 ranks the hierarchical
collectives take their two hops."""


def cells() -> list[Cell]:
    """Every cell of the matrix in a fixed order: all-pairs rows over the valid cells (every pair of
    values that can meet does, in a valid cell), the bug cells, the refused cells, the
    sequence-parallel cells, the hybrid sharding / ZeRO++ cells, the deterministic-mode cells, then the
    mixture-of-experts cells."""
    rows = [Cell(**row) for row in all_pairs(AXES, allowed)]
    seen = {c.id for c in rows}
    extra = [c for c in EXTRA_CELLS + REFUSED_CELLS + SP_CELLS + ZEROPP_CELLS + DETERMINISTIC_CELLS + MOE_CELLS
             if c.id not in seen]
    return rows + extra


# ------------------------------------------------------------------------------------- refusals
REFUSALS: list[tuple[str, str, str, str]] = [
    # (rule, where it applies, distinctive substring of today's message, the reason for the docs table)
    ("pipeline-zero3", "pp = 2 with zero = 3", "cannot be combined with pipeline parallelism",
     "each stage already holds only its layers; use ZeRO 0-2"),
    ("offload-zero0", "offload = optimizer with zero = 0", "needs ZeRO stage 1, 2 or 3",
     "offload moves each process's optimizer partition; use ZeRO 1-3"),
    ("autotp-pipeline", "model = autotp with pp = 2 and tp = 2", "with pipeline parallelism",
     "automatic TP does not split pipeline stages (nor does DeepSpeed's); build the stages with "
     "deepshard.tp's ColumnParallelLinear/RowParallelLinear"),
    ("sp-pipeline", "sp = 2 with pp = 2", "sequence parallelism composes with data parallelism",
     "sequence parallelism composes with data parallelism, ZeRO and tensor parallelism, not pipeline stages"),
    ("sp-tp-heads", "sp = 2 with tp = 2 on attention whose head counts tp does not divide (model attn_mqa: "
     "4 query heads, 1 key/value head)", "each tensor-parallel rank must hold whole heads",
     "each tensor-parallel rank must hold whole query and key/value heads; use a tp size dividing both"),
    ("hybrid-zero0", "zeropp = hybrid (mics_shard_size) with zero = 0", "stage 0 partitions nothing",
     "hybrid sharding partitions the optimizer states (ZeRO 1-2) or everything (ZeRO 3) over its shard groups"),
    ("hpz-below-3", "zeropp = hpz or zeropp (zero_hpz_partition_size, zero_quantized_weights) with zero 0-2",
     "they act on ZeRO-3's parameter gathers", "below ZeRO-3 every rank holds the whole parameters"),
    ("deterministic-pipeline", "deterministic with pp = 2", "a pipeline model (each stage adds its micro-batches'",
     "a pipeline stage adds its micro-batches' gradients in schedule order, outside the canonical sum"),
    ("deterministic-nvme-gas", "deterministic with zero = 3, offload = optimizer (nvme) and gas = 3",
     "ZeRO-3 gradients in nvme swap files with gradient_accumulation_steps",
     "the canonical sum over micro-batches keeps partial sums in memory; offload to cpu, or accumulate 1 step"),
    ("moe-ep-tp", "model = moe with ep = 2 and tp = 2", "and tensor parallelism (tp=",
     "every tensor-parallel rank holds the same tokens, which the all-to-all would send tp times; use ep_size 1 "
     "(experts replicated) with tensor parallelism"),
    ("moe-ep-pipeline", "model = moe with ep = 2 and pp = 2", "inside a PipelineModule",
     "a pipeline stage passes one activation tensor on; use ep_size 1 (experts replicated) inside a pipeline"),
]
"""The expected refusals, in one place: a plan check that lists every conflict keeps these substrings."""


def rules_broken(row: dict) -> list[str]:
    """The refusal rules a (possibly partial) row breaks."""
    out = []
    if row.get("pp", 1) > 1 and row.get("zero") == 3:
        out.append("pipeline-zero3")
    if row.get("offload") == "optimizer" and row.get("zero") == 0:
        out.append("offload-zero0")
    if row.get("model") == "autotp" and row.get("pp", 1) > 1 and row.get("tp", 1) > 1:
        out.append("autotp-pipeline")
    if row.get("sp", 1) > 1 and row.get("pp", 1) > 1:
        out.append("sp-pipeline")
    if row.get("sp", 1) > 1 and row.get("tp", 1) > 1 and row.get("model") == "attn_mqa":
        out.append("sp-tp-heads")
    if row.get("zeropp") == "hybrid" and row.get("zero") == 0:
        out.append("hybrid-zero0")
    hpz_on = row.get("zeropp") == "hpz" and row.get("dp", 1) * row.get("sp", 1) > 1
    if (hpz_on or row.get("zeropp") == "zeropp") and row.get("zero", 3) < 3:
        out.append("hpz-below-3")
    if row.get("deterministic") and row.get("pp", 1) > 1:
        out.append("deterministic-pipeline")
    if row.get("deterministic") and row.get("zero") == 3 and row.get("offload") == "optimizer" and row.get("gas", 1) > 1:
        out.append("deterministic-nvme-gas")
    if row.get("ep", 1) > 1 and row.get("tp", 1) > 1:
        out.append("moe-ep-tp")
    if row.get("ep", 1) > 1 and row.get("pp", 1) > 1:
        out.append("moe-ep-pipeline")
    return out


def allowed(row: dict) -> bool:
    """A (partial) row the all-pairs rows may hold: valid, on at most ``MAX_WORLD`` processes."""
    world = row.get("pp", 1) * row.get("tp", 1) * row.get("dp", 1) * row.get("sp", 1)
    return world <= MAX_WORLD and not rules_broken(row)


def refusals(cell: Cell) -> list[str]:
    """The rule names ``cell`` breaks (empty: it must train)."""
    return rules_broken({"pp": cell.pp, "tp": cell.tp, "dp": cell.dp, "zero": cell.zero, "offload": cell.offload,
                         "model": cell.model, "sp": cell.sp, "zeropp": cell.zeropp, "gas": cell.gas,
                         "deterministic": cell.deterministic, "ep": cell.ep})


def refusal_substrings(cell: Cell) -> list[str]:
    texts = {name: text for name, _, text, _ in REFUSALS}
    return [texts[name] for name in refusals(cell)]


KNOWN_FAILURES: list[tuple[str, str]] = []
"""Valid cells that fail today because of a known bug (the test marks them xfail, strict)."""


def known_failure(cell: Cell) -> Optional[str]:
    """The ``KNOWN_FAILURES`` entry ``cell`` falls under, or None."""
    return None


def notes(cell: Cell) -> list[str]:
    """What a valid cell does that the user may not expect."""
    if cell.offload == "params" and cell.zero < 3:
        return ["offload_param has no effect below ZeRO-3 (a warning; parameters stay in memory)"]
    return []


def reload_grid(cell: Cell) -> tuple[int, int, int]:
    """Another (pp, tp, dp) of the same world size the checkpoint is loaded on, keeping the global batch
    (``dp`` must divide it) and valid for the cell's model and stage; the cell's own grid when there is
    none (a world of 1)."""
    if cell.reload is not None:
        return cell.reload
    batch = cell.dp * cell.gas
    for pp, tp, dp in [(1, 1, 2), (1, 2, 1), (2, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1), (1, 1, 4)]:
        if pp * tp * dp != cell.world or (pp, tp, dp) == (cell.pp, cell.tp, cell.dp) or batch % dp:
            continue
        if refusals(replace(cell, pp=pp, tp=tp, dp=dp, reload=None)):
            continue
        return pp, tp, dp
    return cell.pp, cell.tp, cell.dp


def reload_cell(cell: Cell) -> Cell:
    """The engine the checkpoint is resumed in: ``reload_grid``'s grid; on a world of 1 (no other grid)
    the next ZeRO stage that is valid with the cell's offload, so the checkpoint still moves somewhere."""
    if cell.ep > 1:  # the experts whole on every rank: the checkpoint moves to another expert layout
        return replace(cell, ep=1, reload=None)
    if cell.sp > 1:
        other = _sp_reload(cell)
    else:
        pp, tp, dp = reload_grid(cell)
        other = replace(cell, pp=pp, tp=tp, dp=dp, reload=None)
    pp, tp, dp = other.pp, other.tp, other.dp
    if (pp, tp, dp, other.sp) == (cell.pp, cell.tp, cell.dp, cell.sp):
        for step in (1, 2, 3):
            moved = replace(other, zero=(cell.zero + step) % 4)
            if not refusals(moved):
                return moved
    return other


def _sp_reload(cell: Cell) -> Cell:
    """A sequence-parallel cell's checkpoint loads at another tp x dp x sp split of its world (the weights
    do not depend on sp), keeping the global batch and the tensor-parallel size where some split does;
    its own grid when there is none."""
    rows = cell.dp * cell.gas
    rest = cell.world // cell.tp
    for tp, dp, sp in ((cell.tp, rest, 1), (cell.tp, 1, rest), (cell.tp, 2, 2), (1, 1, cell.world),
                       (1, 2, cell.world // 2)):
        if tp * dp * sp != cell.world or (tp, dp, sp) == (cell.tp, cell.dp, cell.sp) or rows % dp:
            continue
        mode = cell.sp_mode if sp == 4 or cell.sp_mode != "hybrid" else "ulysses"
        moved = replace(cell, tp=tp, dp=dp, sp=sp, sp_mode=mode, reload=None)
        if not refusals(moved):
            return moved
    return replace(cell, reload=None)


# ------------------------------------------------------------------------------------- docs table
TABLE_BEGIN = "<!-- combinations table: generated by `python -m tests.multiproc.combinations`; do not edit -->"
TABLE_END = "<!-- end of combinations table -->"


def markdown_table() -> str:
    """What combines with what: every pair of axis values that some refusal rule forbids, with the reason;
    every other pair is tested together in at least one matrix cell."""
    all_cells = cells()
    lines = [TABLE_BEGIN, "",
             f"The combination matrix (`tests/multiproc/test_combinations.py`) runs {len(all_cells)} cells. Every "
             "pair of the values below meets in at least one valid cell, unless the pair is refused (then it "
             "meets in a refused cell). A valid cell trains with gradient clipping active and is compared with "
             "single-process PyTorch (losses, the reported global gradient norm, the parameters), resumes from "
             "its checkpoint on another grid of the same size (on one process: another ZeRO stage), and its `save_16bit_model` file and "
             "`zero_to_fp32` output load into the plain model. A refused cell is refused by `initialize` "
             "with the reason below.", "",
             "| axis | values |", "| --- | --- |"]
    legend = {"offload": "none; optimizer (optimizer states in files: `offload_optimizer` nvme); params "
                         "(parameters in files: `offload_param` nvme)",
              "model": "plain layers; autotp (plain layers split by `tensor_parallel.autotp_size`); megatron "
                       "(the user's own column/row-parallel layers marked with Megatron's attributes, "
                       "`initialize(mpu=...)`); tied (the embedding is also the output head)",
              "gas": "1, 3 (gradient accumulation steps)"}
    for name, values in AXES.items():
        lines.append(f"| {name} | {legend.get(name, ', '.join(map(str, values)))} |")
    sp_valid = [c for c in SP_CELLS if not refusals(c)]
    lines.append(f"| sp | 1; 2 and 4 (`sequence_parallel_size`) in {len(sp_valid)} cells of their own, on a model with "
                 "causal self-attention (4 query heads, 2 key/value heads; the tp=2 cells split them with automatic TP, "
                 "or with the user's own Megatron-style attention layers where marked megatron) "
                 "whose tokens are split over the sp ranks: "
                 + "; ".join(f"{'dp=2 x ' if c.dp > 1 else ''}{'tp=2 x ' if c.tp > 1 else ''}sp={c.sp} {c.sp_mode} ZeRO {c.zero} {c.precision}"
                             f"{f' gas {c.gas}' if c.gas > 1 else ''}"
                             f"{f' offload {c.offload}' if c.offload != 'none' else ''}"
                             f"{' megatron' if c.model == 'attn_megatron' else ''}" for c in sp_valid) + " |")
    z_valid = [c for c in ZEROPP_CELLS if not refusals(c)]
    lines.append(f"| hierarchical ZeRO | none; in {len(z_valid)} cells of their own: hybrid (`mics_shard_size` = half the "
                 "data-parallel ranks), hpz (`zero_hpz_partition_size` 2), zeropp (hpZ + `zero_quantized_weights` + "
                 f"`zero_quantized_gradients`; compared within {ZEROPP_TOLERANCE}): "
                 + "; ".join(f"{c.zeropp} with {'tp=2 x ' if c.tp > 1 else ''}dp={c.dp} ZeRO {c.zero} {c.precision}"
                             f"{f' gas {c.gas}' if c.gas > 1 else ''}"
                             f"{f' offload {c.offload}' if c.offload != 'none' else ''} {c.model}" for c in z_valid)
                 + " |")
    d_valid = [c for c in DETERMINISTIC_CELLS if not refusals(c)]
    lines.append(f"| deterministic | off; on (`\"deterministic\": true`) in {len(d_valid)} cells of their own: "
                 + "; ".join(f"{'tp=2 x ' if c.tp > 1 else ''}dp={c.dp} ZeRO {c.zero} {c.precision} gas {c.gas}"
                             f"{f' offload {c.offload}' if c.offload != 'none' else ''} {c.model}" for c in d_valid)
                 + " |")
    m_valid = [c for c in MOE_CELLS if not refusals(c)]
    lines.append(f"| mixture of experts | none; in {len(m_valid)} cells of their own, on a model whose blocks are "
                 "DeepSpeed's `MoE` layer (4 experts, top-2, no token dropping; the checkpoint resumes with ep 1): "
                 + "; ".join(f"{'pp=2 x ' if c.pp > 1 else ''}{'tp=2 x ' if c.tp > 1 else ''}dp={c.dp} ep={c.ep} "
                             f"ZeRO {c.zero} {c.precision}{f' gas {c.gas}' if c.gas > 1 else ''}"
                             f"{f' offload {c.offload}' if c.offload != 'none' else ''}" for c in m_valid) + " |")
    lines += ["", "| combination | result |", "| --- | --- |"]
    for _, where, _, reason in REFUSALS:
        lines.append(f"| {where} | refused: {reason} |")
    lines.append("| offload = params with zero 0-2 | accepted; offload_param has no effect below ZeRO-3 "
                 "(a warning; parameters stay in memory) |")
    for where, what in KNOWN_FAILURES:
        lines.append(f"| {where} | {what} |")
    lines.append("| every other pair | combines; tested together in a valid cell |")
    valid = [c for c in all_cells if not refusals(c)]
    failing = sum(1 for c in valid if known_failure(c))
    failing_note = f" ({failing} of them failing today, as listed above)" if failing else ", all passing"
    lines += ["", f"Cells: {len(valid)} valid{failing_note}; {len(all_cells) - len(valid)} refused.", "", TABLE_END]
    return "\n".join(lines)


def write_docs(path: Path) -> bool:
    """Replace the generated table in ``path``; True when the file changed."""
    text = path.read_text()
    pattern = re.compile(re.escape(TABLE_BEGIN) + ".*?" + re.escape(TABLE_END), re.S)
    new = pattern.sub(lambda _: markdown_table(), text) if pattern.search(text) else text.rstrip() + (
        "\n\n## What combines with what\n\n" + markdown_table() + "\n")
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    target = Path(__file__).resolve().parents[2] / "docs" / "parallelism.md"
    print(f"{target}: {'updated' if write_docs(target) else 'already up to date'}")
    sys.exit(0)
