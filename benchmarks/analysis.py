"""The physical limits and the arithmetic of the report, as pure functions (no process group).

Model-state bytes per process with Adam (Ψ parameters, N data-parallel processes; the ZeRO paper,
Rajbhandari et al. 2020, and PRODUCT.md):

========  ==============  ===============
stage     fp32            bf16 mixed
========  ==============  ===============
0 (DDP)   16Ψ             16Ψ
1         8Ψ + 8Ψ/N       4Ψ + 12Ψ/N
2         4Ψ + 12Ψ/N      2Ψ + 14Ψ/N
3         16Ψ/N           16Ψ/N
========  ==============  ===============

Communication per process and step, by the paper's accounting (an all-reduce counts 2x its tensor):
stages 0-2 move 2Ψ elements, stage 3 moves 3Ψ (all-gather in forward, again in backward,
reduce-scatter of the gradients). A single process communicates nothing.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

# bytes per parameter: (replicated part, sharded part divided by N)
_STATE_BYTES: dict[str, dict[int, tuple[int, int]]] = {
    "fp32": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},
    "bf16": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},
}
NOT_MODEL_STATE = ("total", "buffers", "comm_buckets")
# final-loss agreement: fp32 engines differ only in summation order; in bf16 each engine rounds in
# different places (on the benchmark workloads every engine but one lands within 0.1% of DDP)
LOSS_RTOL = {"fp32": 1e-4, "bf16": 1e-2}


# gradient bytes per parameter in the sharded part: what a step taken in backward never keeps
_GRAD_BYTES = {"fp32": 4, "bf16": 2}


def model_state_formula(stage: int, psi: int, nprocs: int, dtype: str, keeps_grads: bool = True) -> float:
    """Model-state bytes per process (parameters, gradients, master weights, Adam moments);
    ``keeps_grads=False``: stage 3 with the optimizer step in backward (no gradient shard)."""
    if dtype not in _STATE_BYTES or stage not in _STATE_BYTES[dtype]:
        raise ValueError(f"no ZeRO formula for stage {stage} / dtype {dtype!r}; stages 0-3, dtypes fp32, bf16")
    replicated, sharded = _STATE_BYTES[dtype][stage]
    if not keeps_grads:
        sharded -= _GRAD_BYTES[dtype]
    return replicated * psi + sharded * psi / nprocs


def analytic_volume_elements(stage: int, psi: int, nprocs: int) -> int:
    """Elements each process moves per step: 2Ψ for stages 0-2, 3Ψ for stage 3, 0 alone."""
    if nprocs <= 1:
        return 0
    return (3 if stage == 3 else 2) * psi


def ratio(value: float | None, reference: float | None) -> float | None:
    """value / reference, or None where either is missing or the reference is zero."""
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def model_state_bytes(report: dict[str, int] | None) -> int | None:
    """The model-state part of a ``memory_report()``: every category except the module's buffers,
    communication scratch and the total (parameters, gradients, master weights, optimizer state, and
    whatever else a stage keeps between steps, e.g. stage 3's small parameters kept whole)."""
    if not report:
        return None
    return sum(int(v) for key, v in report.items() if key not in NOT_MODEL_STATE)


# ------------------------------------------------------------------------------------- aggregation
def summarize_case(case: dict[str, Any], ranks: list[dict[str, Any]], psi: int, samples_per_step: int,
                   family: str, stage: int, keeps_grads: bool = True) -> dict[str, Any]:
    """One table row from the per-rank results of one case."""
    row: dict[str, Any] = {k: case[k] for k in ("engine", "workload", "dtype", "nprocs", "warmup", "steps")}
    row.update(family=family, stage=stage, psi=psi, keeps_grads=keeps_grads, status="ok", reason="")
    bad = [r for r in ranks if r.get("status") != "ok"]
    if bad:
        worst = next((r for r in bad if r.get("status") == "error"), bad[0])
        row.update(status=worst.get("status", "error"), reason=str(worst.get("reason", "")))
        return row
    warmup = int(case["warmup"])
    slowest = [max(r["step_times"][i] for r in ranks) for i in range(warmup, len(ranks[0]["step_times"]))]
    step_time = statistics.median(slowest)
    losses = [statistics.fmean(r["losses"][i] for r in ranks) for i in range(len(ranks[0]["losses"]))]
    measured = max(1, len(slowest))
    ops = ranks[0]["comm_ops"]
    volume_elements = sum(s["volume_elements"] for s in ops.values()) / measured
    state = model_state_bytes(ranks[0].get("model_state"))
    row.update(
        step_time=step_time, step_times=slowest, throughput=samples_per_step / step_time, losses=losses,
        final_loss=losses[-1], peak_rss=max(r["peak_rss"] for r in ranks),
        peak_rss_per_rank=[r["peak_rss"] for r in ranks], rss_base=max(r["rss_base"] for r in ranks),
        peak_method=ranks[0].get("peak_method", ""), live_tensor_bytes=max(r["live_tensor_bytes"] for r in ranks),
        model_state=state, memory_report=ranks[0].get("model_state"),
        comm_bytes=sum(s["volume_bytes"] for s in ops.values()) / measured, comm_volume_elements=volume_elements,
        comm_ops={op: {k: v / measured for k, v in s.items()} for op, s in ops.items()},
        formula_state=model_state_formula(stage, psi, int(case["nprocs"]), case["dtype"], keeps_grads),
        analytic_volume=analytic_volume_elements(stage, psi, int(case["nprocs"])))
    row["cpu_time"] = busiest_cpu(ranks, warmup)
    row["state_vs_formula"] = ratio(state if state is not None else None, row["formula_state"])
    row["live_vs_formula"] = ratio(row["live_tensor_bytes"], row["formula_state"])
    row["volume_vs_analytic"] = ratio(volume_elements, row["analytic_volume"])
    return row


def busiest_cpu(ranks: list[dict[str, Any]], warmup: int) -> float | None:
    """CPU seconds per measured step of the busiest rank (every thread of its process), median over the
    steps; None for results recorded without them. Beside the step time it tells work from waiting: on
    contended cores an engine can take longer per step at the same or less CPU per step (its ranks wait
    for a core or for each other), which no change of its computation would remove."""
    if not all(r.get("step_cpu_times") for r in ranks):
        return None
    steps = range(warmup, len(ranks[0]["step_cpu_times"]))
    busiest = [max(r["step_cpu_times"][i] for r in ranks) for i in steps]
    return statistics.median(busiest) if busiest else None


NOISY_SPREAD = 1.5  # slowest / fastest measured step above which a step time is marked as disturbed


def merge_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the repeats of one engine (each a ``summarize_case`` row, run interleaved with the
    other engines): the step time is the median of the repeats' medians and ``spread`` their
    (fastest, slowest); the other figures are the median repeat's. A repeat that did not run makes the
    row that repeat's status."""
    bad = [r for r in runs if r["status"] != "ok"]
    if bad:
        return next((r for r in bad if r["status"] == "error"), bad[0])
    medians = [r["step_time"] for r in runs]
    base = sorted(runs, key=lambda r: r["step_time"])[len(runs) // 2]
    row = dict(base)
    step_time = statistics.median(medians)
    row.update(step_time=step_time, throughput=base["throughput"] * base["step_time"] / step_time,
               repeats=len(runs), repeat_step_times=medians, spread=(min(medians), max(medians)),
               step_times=[t for r in runs for t in r["step_times"]],
               peak_rss=statistics.median(r["peak_rss"] for r in runs),
               cpu_time=_median_or_none([r.get("cpu_time") for r in runs]),
               final_losses=[r["final_loss"] for r in runs])
    return row


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def spread_of(row: dict[str, Any]) -> tuple[float, float]:
    """(fastest, slowest) repeat median of a row; a single run's own median twice."""
    lo, hi = row.get("spread") or (row["step_time"], row["step_time"])
    return float(lo), float(hi)


def peers_of(row: dict[str, Any], ok: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The engines a deepshard row is compared with: every other library's engine at its ZeRO stage
    (DDP and DeepSpeed's stage 0 for stage 0, DeepSpeed's stage k for k, DeepSpeed's stage 3 and FSDP2
    for stage 3)."""
    return [a for a in ok if a["family"] != "deepshard" and a["stage"] == row["stage"]]


def step_spread(row: dict[str, Any]) -> float | None:
    """Slowest / fastest measured step: ~1.0-1.2 on a quiet machine; far above when other work ran."""
    times = row.get("step_times") or []
    return max(times) / min(times) if times and min(times) > 0 else None


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Ratios to DDP and to the best alternative (fastest non-deepshard engine of the same ZeRO stage;
    FSDP2 counts as stage 3), within each (workload, dtype, nprocs) group; and the loss agreement."""
    for group in _groups(rows).values():
        ok = [r for r in group if r["status"] == "ok"]
        ddp = next((r for r in ok if r["engine"] == "ddp"), None)
        for r in ok:
            r["vs_ddp"] = ratio(r["step_time"], ddp["step_time"]) if ddp else None
            r["mem_vs_ddp"] = ratio(r["peak_rss"], ddp["peak_rss"]) if ddp else None
            alts = peers_of(r, ok)
            # stage 3's target is DDP's step time too (it trades bytes for memory, not time)
            watched = alts + [ddp] if ddp is not None and r["stage"] == 3 else alts
            if r["family"] == "deepshard" and watched:
                if alts:
                    best = min(alts, key=lambda a: a["step_time"])
                    r["best_alternative"] = best["engine"]
                    r["vs_best_alternative"] = r["step_time"] / best["step_time"]
                # slower outside the spread: even this row's fastest repeat is slower than the peer's slowest
                r["slower_than"] = [a["engine"] for a in watched if spread_of(r)[0] > spread_of(a)[1]]
                # the CPU per step against each of those peers: above 1 more work, at or below 1 more waiting
                r["cpu_vs_slower"] = {a["engine"]: ratio(r.get("cpu_time"), a.get("cpu_time"))
                                      for a in watched if a["engine"] in r["slower_than"]}
        check_losses(ok)


def check_losses(rows: list[dict[str, Any]]) -> None:
    """Every engine's final loss must match the reference (DDP, else the first row) within the dtype's
    relative tolerance; sets ``loss_rel_diff`` and ``loss_ok`` on each row."""
    if not rows:
        return
    reference = next((r for r in rows if r["engine"] == "ddp"), rows[0])
    for r in rows:
        diff = abs(r["final_loss"] - reference["final_loss"]) / max(abs(reference["final_loss"]), 1e-12)
        r["loss_reference"] = reference["engine"]
        r["loss_rel_diff"] = diff
        r["loss_ok"] = diff <= LOSS_RTOL.get(r["dtype"], 1e-4)


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], list[dict[str, Any]]]:
    out: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["workload"], r["dtype"], r["nprocs"]), []).append(r)
    return out


# ----------------------------------------------------------------------------------------- targets
NOT_JUDGED = "not judged at --quick sizes"
# what a --quick run still judges: exact byte counts that do not depend on the model's size, at the stages
# that shard every parameter alike. Step times and peak memory of 1-6M-parameter models are fixed overheads,
# and stage 3 keeps parameters under its persistence threshold whole, which the shrunk models are made of
# (docs/benchmarks.md, "Reading the figures")
QUICK_JUDGED = ("model-state bytes / formula", "volume per step / analytic")


@dataclass(frozen=True)
class Target:
    """One target of issue 6, evaluated on one row: ``value`` against ``limit`` (``kind`` "max" or "band").
    ``judged`` False: shown, but set for sizes the run did not measure (``--quick``), so no verdict."""

    name: str
    where: str
    value: float | None
    limit: float
    kind: str = "max"
    note: str = ""
    judged: bool = True

    @property
    def verdict(self) -> str:
        if self.value is None:
            return "n/a"
        if not self.judged:
            return NOT_JUDGED
        ok = self.value <= self.limit if self.kind == "max" else abs(self.value - 1.0) <= self.limit
        return "met" if ok else "MISSED"

    def describe(self) -> str:
        shown = "-" if self.value is None else f"{self.value:.3f}"
        bound = f"<= {self.limit:.2f}" if self.kind == "max" else f"1 +/- {self.limit:.2f}"
        note = f"; {self.note}" if self.note else ""
        return f"{self.name} [{self.where}]: {shown} (target {bound}) {self.verdict}{note}"


def _time_of(row: dict[str, Any] | None) -> float | None:
    return None if row is None else row["step_time"]


def _stage3_targets(r: dict[str, Any], ok: dict[str, dict[str, Any]], where: str) -> list[Target]:
    ddp = ok.get("ddp")
    peak = ratio(r["peak_rss"], ddp and ddp["peak_rss"])
    above = ratio(r["peak_rss"] - r["rss_base"], ddp and ddp["peak_rss"] - ddp["rss_base"])
    return [Target("step time / FSDP2", where, ratio(r["step_time"], _time_of(ok.get("fsdp2"))), 1.0),
            Target("peak memory / DDP", where, peak, 0.60,
                   note="" if above is None else f"{above:.3f} above idle")]


def evaluate_targets(rows: list[dict[str, Any]], quick: bool = False) -> list[Target]:
    """The issue's targets for every deepshard row that ran; with ``quick`` (the shrunk models) only the
    size-independent ones of stages 0-2 (``QUICK_JUDGED``) get a verdict."""
    out = _targets(rows)
    if not quick:
        return out
    stages = {f"{r['engine']} {r['workload']} {r['dtype']} N={r['nprocs']}": r["stage"] for r in rows}
    return [t if t.name in QUICK_JUDGED and stages[t.where] <= 2 else dataclasses.replace(t, judged=False)
            for t in out]


def _targets(rows: list[dict[str, Any]]) -> list[Target]:
    out: list[Target] = []
    for (workload, dtype, nprocs), group in _groups(rows).items():
        ok = {r["engine"]: r for r in group if r["status"] == "ok"}
        for r in (r for r in group if r["status"] == "ok" and r["family"] == "deepshard"):
            where = f"{r['engine']} {workload} {dtype} N={nprocs}"
            if r["stage"] <= 2:
                out.append(Target("step time / DDP", where, r.get("vs_ddp"), 1.10))
            else:
                out.extend(_stage3_targets(r, ok, where))
            out.append(Target("model-state bytes / formula", where, r.get("state_vs_formula"), 0.05, "band"))
            if r["analytic_volume"]:
                out.append(Target("volume per step / analytic", where, r.get("volume_vs_analytic"), 0.02, "band"))
    return out


def _measured_state(r: dict[str, Any]) -> float | None:
    if r["status"] != "ok":
        return None
    return r["model_state"] if r.get("model_state") is not None else r["live_tensor_bytes"]


def scaling_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Model-state bytes per process against the process count: measured (deepshard's memory_report;
    live tensor bytes for the others), the formula, and the ratio to the 1-process figure (ideal 1/N)."""
    out: list[dict[str, Any]] = []
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_engine.setdefault(r["engine"], []).append(r)
    for engine, group in by_engine.items():
        group.sort(key=lambda r: r["nprocs"])
        one = next((r for r in group if r["nprocs"] == 1), None)
        base = _measured_state(one) if one is not None else None
        for r in group:
            measured = _measured_state(r)
            out.append({"engine": engine, "nprocs": r["nprocs"], "status": r["status"], "measured": measured,
                        "source": "memory_report" if r.get("model_state") is not None else "live tensors",
                        "formula": model_state_formula(r["stage"], r["psi"], r["nprocs"], r["dtype"],
                                                       r.get("keeps_grads", True)),
                        "vs_one_process": ratio(measured, base), "ideal": 1.0 / r["nprocs"]})
    return out
