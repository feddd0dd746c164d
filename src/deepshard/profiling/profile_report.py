"""Text rendering of a FLOPs profile: the summary, the top modules per depth, the per-module tree.

The formatting helpers keep DeepSpeed's names (``flops_to_string``, ``macs_to_string``,
``params_to_string``, ``duration_to_string``) so scripts that import them from the profiler keep working.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepshard.profiling.flop_count import ModuleStats

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))

# Dense bf16/fp16 tensor-core peak FLOP/s per device, from the vendors' data sheets (no sparsity).
PEAK_FLOPS_BY_DEVICE: dict[str, float] = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "V100": 125e12,
}


def _scaled(num: float, units: str | None, precision: int) -> tuple[str, str]:
    """``(value, prefix)``: 1234567 -> ("1.23", "M"); small integers stay whole."""
    if units is not None:
        scale = {u: s for s, u in _PREFIXES}.get(units, 1.0)
        return f"{num / scale:.{precision}f}", units if scale != 1.0 else ""
    for scale, prefix in _PREFIXES:
        if abs(num) >= scale:
            return f"{num / scale:.{precision}f}", prefix
    return (f"{int(num)}" if float(num).is_integer() else f"{num:.{precision}f}"), ""


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """``1.23 G`` style; ``units`` ("T", "G", "M", "K" or "") forces a prefix."""
    value, prefix = _scaled(num, units, precision)
    return f"{value} {prefix}".rstrip()


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    value, prefix = _scaled(flops, units, precision)
    return f"{value} {prefix}FLOPS"


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    value, prefix = _scaled(macs, units, precision)
    return f"{value} {prefix}MACs"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(params, units, precision)


def duration_to_string(seconds: float, units: str | None = None, precision: int = 2) -> str:
    if units == "ms" or (units is None and 1e-3 <= seconds < 1):
        return f"{seconds * 1e3:.{precision}f} ms"
    if units == "us" or (units is None and seconds < 1e-3):
        return f"{seconds * 1e6:.{precision}f} us"
    return f"{seconds:.{precision}f} s"


def peak_flops_for_device(device: torch.device) -> float | None:
    """The dense 16-bit peak of a known CUDA device, or None (CPU, unknown GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_FLOPS_BY_DEVICE.items():  # ordered so "H100 PCIe" is tried before "H100"
        if key in name:
            return peak
    return None


@dataclass
class ProfileSummary:
    """Whole-model figures for the profiled window (durations in seconds; 0 = not measured)."""

    params: int
    fwd_flops: int
    bwd_flops: int
    fwd_latency: float
    bwd_latency: float = 0.0
    step_latency: float = 0.0
    samples: int = 0
    world_size: int = 1
    peak_flops: float | None = None
    extra: list[tuple[str, str]] = field(default_factory=list)

    @property
    def iter_latency(self) -> float:
        return self.fwd_latency + self.bwd_latency + self.step_latency


def _rate(flops: float, seconds: float) -> str:
    return flops_to_string(flops / seconds) + "/s" if seconds > 0 else "n/a"


def summary_lines(s: ProfileSummary) -> list[str]:
    """The summary block: counts, latencies, achieved FLOP/s and (given a peak) MFU."""
    rows = list(s.extra) + [
        ("world size", str(s.world_size)),
        ("params of model", params_to_string(s.params)),
        ("fwd MACs per process", macs_to_string(s.fwd_flops // 2)),
        ("fwd FLOPs per process", flops_to_string(s.fwd_flops)),
        ("bwd FLOPs per process (measured)", flops_to_string(s.bwd_flops)),
        ("bwd / fwd FLOPs", f"{s.bwd_flops / s.fwd_flops:.2f}" if s.fwd_flops else "n/a"),
        ("fwd+bwd FLOPs per process", flops_to_string(s.fwd_flops + s.bwd_flops)),
        ("fwd latency", duration_to_string(s.fwd_latency)),
        ("fwd FLOPS per process", _rate(s.fwd_flops, s.fwd_latency)),
    ]
    if s.bwd_latency > 0:
        rows += [("bwd latency", duration_to_string(s.bwd_latency)),
                 ("bwd FLOPS per process", _rate(s.bwd_flops, s.bwd_latency)),
                 ("step latency", duration_to_string(s.step_latency)),
                 ("iter latency", duration_to_string(s.iter_latency)),
                 ("FLOPS per process", _rate(s.fwd_flops + s.bwd_flops, s.iter_latency))]
        if s.samples:
            rows.append(("samples/second", f"{s.samples * s.world_size / s.iter_latency:.2f}"))
        if s.peak_flops:
            mfu = (s.fwd_flops + s.bwd_flops) / s.iter_latency / s.peak_flops
            rows.append(("MFU", f"{mfu:.1%} of {flops_to_string(s.peak_flops)}/s peak"))
    width = max(len(name) for name, _ in rows) + 2
    return [f"{name + ':':<{width}} {value}" for name, value in rows]


def top_module_lines(stats: list[ModuleStats], top: int, max_depth: int) -> list[str]:
    """The ``top`` modules at each depth by params, forward MACs and forward latency."""
    lines = [f"Top {top} modules in terms of params, MACs or fwd latency at different model depths:"]
    depths = sorted({s.depth for s in stats if s.depth > 0 and (max_depth < 0 or s.depth <= max_depth)})
    for depth in depths:
        here = [s for s in stats if s.depth == depth]
        lines.append(f"depth {depth}:")
        for label, key, fmt in (("params", "params", params_to_string), ("MACs", "fwd_macs", macs_to_string),
                                ("fwd latency", "fwd_latency", duration_to_string)):
            best = sorted(here, key=lambda s: getattr(s, key), reverse=True)[:top]
            cells = ", ".join(f"{s.name} ({s.type_name}): {fmt(getattr(s, key))}" for s in best)
            lines.append(f"    {label:<12} - {{{cells}}}")
    return lines


def module_tree_lines(stats: list[ModuleStats], root: ModuleStats, max_depth: int) -> list[str]:
    """One line per module (indented by depth): params %, MACs %, latency %, FLOPs and FLOP/s."""
    def pct(part: float, whole: float) -> str:
        return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"

    lines = ["Each module: params (% of model), fwd MACs (% of model), fwd latency (% of model), fwd FLOPS, "
             "measured bwd FLOPs"]
    for s in stats:
        if max_depth >= 0 and s.depth > max_depth:
            continue
        label = f"{s.name or '(root)'} ({s.type_name})"
        lines.append("  " * s.depth + f"{label}: {params_to_string(s.params)} ({pct(s.params, root.params)}), "
                     f"{macs_to_string(s.fwd_macs)} ({pct(s.fwd_macs, root.fwd_macs)}), "
                     f"{duration_to_string(s.fwd_latency)} ({pct(s.fwd_latency, root.fwd_latency)}), "
                     f"{_rate(s.fwd_flops, s.fwd_latency)}, bwd {flops_to_string(s.bwd_flops)}")
    return lines


def render(summary: ProfileSummary, stats: list[ModuleStats], module_depth: int, top_modules: int,
           detailed: bool, profile_step: int | None = None) -> str:
    """The whole report as text."""
    title = "DeepShard Flops Profiler" + (f" (profile step {profile_step})" if profile_step is not None else "")
    bar = "-" * 30
    lines = [f"{bar} {title} {bar}"] + summary_lines(summary)
    root = next(s for s in stats if s.depth == 0)
    lines += ["", *top_module_lines(stats, top_modules, module_depth)]
    if detailed:
        lines += ["", *module_tree_lines(stats, root, module_depth)]
    lines.append("-" * (len(lines[0])))
    return "\n".join(lines)
