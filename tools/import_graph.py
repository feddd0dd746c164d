"""Draw deepshard's import graph between folders as ``docs/images/import-graph.svg``.

    python tools/import_graph.py            # rewrite the picture
    python tools/import_graph.py --check    # exit 1 when the committed picture is stale

Nodes are the package's folders (its subpackages, and ``(top)`` for the files at its top level); a cell
of the matrix is shaded by how many modules of the row's folder import modules of the column's folder
(every import counts: module level, inside functions, under ``TYPE_CHECKING``). Folders are ordered so
that most imports point up and to the right of the diagonal (towards the folders they build on). Folders
may import each other both ways through different modules: ``tests/unit/test_import_circles.py`` holds
the rule that matters, no circle of modules across folders. Pure Python: no drawing library needed.
"""
from __future__ import annotations

import argparse
import ast
import math
import sys
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "src" / "deepshard"
TARGET = ROOT / "docs" / "images" / "import-graph.svg"
CELL, LABEL = 22, 150


def modules(root: Path = PACKAGE_DIR) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("deepshard",) + path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def folder(module: str, files: dict[str, Path]) -> str:
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and files[module].name == "__init__.py"):
        return parts[1]
    return "(top)"


def _targets(module: str, path: Path, files: dict[str, Path]) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(here[:len(here) - (node.level - 1)] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    found = set()
    for name in names:
        while name and name not in files:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def folder_edges(root: Path = PACKAGE_DIR) -> dict[tuple[str, str], int]:
    """(importing folder, imported folder) -> how many module-to-module imports cross between them."""
    files = modules(root)
    edges: dict[tuple[str, str], int] = {}
    for module, path in files.items():
        for target in _targets(module, path, files):
            a, b = folder(module, files), folder(target, files)
            if a != b:
                edges[(a, b)] = edges.get((a, b), 0) + 1
    return edges


def order(nodes: list[str], edges: dict[tuple[str, str], int]) -> list[str]:
    """Foundations first: repeatedly take the folder importing least from the folders not yet placed
    (a greedy ordering that keeps most imports pointing to earlier folders)."""
    left, placed = set(nodes), []
    while left:
        def weight(n: str) -> tuple[int, int, str]:
            out = sum(c for (a, b), c in edges.items() if a == n and b in left)
            into = sum(c for (a, b), c in edges.items() if b == n and a in left)
            return out - into, out, n
        best = min(left, key=weight)
        placed.append(best)
        left.remove(best)
    return placed


def render(root: Path = PACKAGE_DIR) -> str:
    edges = folder_edges(root)
    nodes = order(sorted({n for e in edges for n in e}), edges)
    index = {n: i for i, n in enumerate(nodes)}
    n, top = len(nodes), 40
    size = LABEL + n * CELL + 20
    peak = max(edges.values())
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{size}" height="{size + top}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{size}" height="{size + top}" fill="white"/>',
           f'<text x="10" y="18" font-size="13">deepshard: imports between folders (row imports column; '
           f'darker = more module imports)</text>']
    for name, i in index.items():
        y = top + LABEL + i * CELL + CELL * 0.7
        x = LABEL + i * CELL + CELL * 0.7
        out.append(f'<text x="{LABEL - 6}" y="{y:.0f}" text-anchor="end">{escape(name)}</text>')
        out.append(f'<text x="{x:.0f}" y="{top + LABEL - 6}" transform="rotate(-60 {x:.0f} {top + LABEL - 6})">'
                   f'{escape(name)}</text>')
    for i in range(n + 1):
        p = LABEL + i * CELL
        out.append(f'<line x1="{LABEL}" y1="{top + p}" x2="{LABEL + n * CELL}" y2="{top + p}" stroke="#ddd"/>')
        out.append(f'<line x1="{p}" y1="{top + LABEL}" x2="{p}" y2="{top + LABEL + n * CELL}" stroke="#ddd"/>')
    for (a, b), count in sorted(edges.items()):
        shade = 0.25 + 0.75 * math.log1p(count) / math.log1p(peak)
        colour = "#c0392b" if index[b] > index[a] else "#2c3e50"  # red: imports a folder placed later
        out.append(f'<rect x="{LABEL + index[b] * CELL + 1}" y="{top + LABEL + index[a] * CELL + 1}" '
                   f'width="{CELL - 2}" height="{CELL - 2}" fill="{colour}" fill-opacity="{shade:.2f}">'
                   f'<title>{escape(a)} imports {escape(b)}: {count}</title></rect>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the picture differs from the source")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        same = TARGET.exists() and TARGET.read_text() == text
        print(f"{TARGET}: {'up to date' if same else 'stale: run python tools/import_graph.py'}")
        return 0 if same else 1
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
