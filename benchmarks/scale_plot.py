"""The figure and table of ``benchmarks/scale.py``'s results: per-rank costs against the rank count, real
processes (solid) and dry runs (dashed), log-scaled N. Hand-written SVG: no plotting library needed.

The figure is drawn from result rows (``benchmarks/results/scale.jsonl``, not checked in) or from the table
this module writes, read back from a page that holds it (``rows_from_table``): the figure in the docs is
drawn from the rows the docs show, measured on a quiet machine."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable

PANELS: list[tuple[str, str, Callable[[dict[str, Any]], float | None]]] = [
    ("CPU ms per step (training thread)", "cpu_step_s", lambda r: r["cpu_step_s"] * 1e3),
    ("initialize, s", "init_s", lambda r: r["init_s"]),
    ("process groups created", "groups_created", lambda r: r["groups_created"]),
    ("MiB read by load_checkpoint", "load_bytes", lambda r: None if r["load_bytes"] in (None, 0) else r["load_bytes"] / 2**20),
    ("save_checkpoint, s", "save_s", lambda r: r["save_s"]),
    ("collective KiB per step", "collective_bytes", lambda r: r["collective_bytes"] / 1024),
]
COLORS = {"dp": "#1f77b4", "pp2": "#d62728"}
W, H, PAD = 300, 200, 44


def latest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last measured row of each (mode, layout, N): a size measured again (``--force``) replaces its
    older figures."""
    kept: dict[tuple[str, str, int], dict[str, Any]] = {}
    for row in rows:
        if row.get("ranks"):
            kept[(row["mode"], row["layout"], row["n"])] = row
    return list(kept.values())


def series(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], float | None]) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """``(mode, layout) -> [(N, worst rank's value)]`` for one panel."""
    out: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in latest(rows):
        values = [v for v in (key(r) for r in row.get("ranks", [])) if v is not None and not math.isnan(v)]
        if values:
            out.setdefault((row["mode"], row["layout"]), []).append((row["n"], max(values)))
    return {k: sorted(v) for k, v in out.items()}


def _panel(x0: int, y0: int, title: str, data: dict[tuple[str, str], list[tuple[int, float]]]) -> list[str]:
    points = [p for s in data.values() for p in s]
    if not points:
        return [f'<text x="{x0 + W / 2}" y="{y0 + H / 2}" text-anchor="middle" font-size="11">{title}: no data</text>']
    nmax = max(n for n, _ in points)
    top = max(v for _, v in points) * 1.15 or 1.0
    sx = lambda n: x0 + PAD + (W - PAD - 10) * math.log2(n) / max(1.0, math.log2(nmax))  # noqa: E731
    sy = lambda v: y0 + H - 24 - (H - 48) * v / top  # noqa: E731
    parts = [f'<rect x="{x0 + PAD}" y="{y0 + 24}" width="{W - PAD - 10}" height="{H - 48}" fill="none" stroke="#999"/>',
             f'<text x="{x0 + W / 2}" y="{y0 + 16}" text-anchor="middle" font-size="12">{title}</text>']
    for frac in (0.0, 0.5, 1.0):
        v = top * frac / 1.15
        parts.append(f'<text x="{x0 + PAD - 4}" y="{sy(v) + 4:.1f}" text-anchor="end" font-size="9">{v:.3g}</text>')
    n = 1
    while n <= nmax:
        if n > 1:
            parts.append(f'<text x="{sx(n):.1f}" y="{y0 + H - 10}" text-anchor="middle" font-size="9">{n}</text>')
        n *= 4 if nmax > 64 else 2
    for (mode, layout), pts in sorted(data.items()):
        path = " ".join(f"{sx(n):.1f},{sy(v):.1f}" for n, v in pts)
        dash = ' stroke-dasharray="5,3"' if mode == "dry" else ""
        parts.append(f'<polyline points="{path}" fill="none" stroke="{COLORS.get(layout, "#333")}" stroke-width="1.6"{dash}/>')
        parts += [f'<circle cx="{sx(n):.1f}" cy="{sy(v):.1f}" r="2.2" fill="{COLORS.get(layout, "#333")}"/>' for n, v in pts]
    return parts


def write_figure(rows: list[dict[str, Any]], path: Path) -> str:
    """Write the SVG; return a Markdown table of the same figures (for docs/benchmarks.md)."""
    cols = 3
    height = H * ((len(PANELS) + cols - 1) // cols) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W * cols}" height="{height}" font-family="sans-serif">',
             '<rect width="100%" height="100%" fill="white"/>']
    for i, (title, _, key) in enumerate(PANELS):
        parts += _panel((i % cols) * W, (i // cols) * H, title, series(rows, key))
    legend = [("dp (ZeRO-2), real", "dp", ""), ("pp=2 (ZeRO-1), real", "pp2", ""),
              ("dry run", "dp", ' stroke-dasharray="5,3"')]
    for i, (label, layout, dash) in enumerate(legend):
        x = 20 + i * 220
        parts.append(f'<line x1="{x}" y1="{height - 12}" x2="{x + 24}" y2="{height - 12}" stroke="{COLORS[layout]}" '
                     f'stroke-width="2"{dash}/>')
        parts.append(f'<text x="{x + 30}" y="{height - 8}" font-size="11">{label}</text>')
    parts.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts) + "\n")
    return table(rows)


def table(rows: list[dict[str, Any]]) -> str:
    """One line per (mode, layout, N): the worst rank's figures."""
    lines = ["| run | N | CPU ms/step | initialize s | groups | load MiB (files) | save s | collective KiB/step |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in sorted(latest(rows), key=lambda r: (r["layout"], r["mode"] != "real", r["n"])):
        ranks = row.get("ranks") or []
        if not ranks:
            continue
        worst = lambda k: max((r.get(k) or 0) for r in ranks)  # noqa: E731
        load = f"{worst('load_bytes') / 2**20:.2f} ({worst('load_files')})" if worst("load_bytes") else "-"
        lines.append(f"| {row['layout']} {row['mode']} | {row['n']} | {worst('cpu_step_s') * 1e3:.1f} | "
                     f"{worst('init_s'):.2f} | {worst('groups_created')} | {load} | {worst('save_s'):.2f} | "
                     f"{worst('collective_bytes') / 1024:.1f} |")
    return "\n".join(lines)


_ROW = re.compile(r"^\|\s*(\w+) (real|dry)\s*\|" + r"([^|]*)\|" * 7 + r"\s*$")


def rows_from_table(text: str) -> list[dict[str, Any]]:
    """The rows of a table ``table()`` wrote, found in ``text`` (a Markdown page), as result rows of one
    rank each (the worst rank's figures, which is what the figure plots). Raises when there is none."""
    rows = []
    for line in text.splitlines():
        match = _ROW.match(line.strip())
        if match is None:
            continue
        layout, mode, n, cpu_ms, init_s, groups, load, save_s, kib = (c.strip() for c in match.groups())
        load_mib, _, files = load.partition(" ")
        rank = {"rank": 0, "cpu_step_s": float(cpu_ms) / 1e3, "init_s": float(init_s), "groups_created": int(groups),
                "load_bytes": None if load_mib == "-" else float(load_mib) * 2**20,
                "load_files": int(files.strip("()")) if files else None, "save_s": float(save_s),
                "collective_bytes": float(kib) * 1024}
        rows.append({"mode": mode, "layout": layout, "n": int(n), "ranks": [rank]})
    if not rows:
        raise ValueError("no row of the scale table (| dp real | 2 | ... |) found: pass the page that holds it "
                         "(docs/scale.md)")
    return rows
