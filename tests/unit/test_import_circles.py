"""No import circle of deepshard spans more than one folder.

A circle (a strongly connected component of the module import graph) inside one folder is one design
unit read together; a circle across folders ties their designs together, so neither can be read, tested
or changed alone. Every import counts: at module level, inside a function, and under ``TYPE_CHECKING``
(a dependency of the design either way). The graph is built here from the source with ``ast``, so the
test needs nothing but the tree.
"""
from __future__ import annotations

import ast
from pathlib import Path

import deepshard

SRC = Path(deepshard.__file__).resolve().parent
PACKAGE = "deepshard"

KNOWN_WIDE: set[frozenset[str]] = set()
"""Circles across folders that are known and being removed (module names without the package prefix,
e.g. ``frozenset({"autotuning.tuner", "launcher.cli"})``): none today."""


def module_files(root: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, a package named by its ``__init__.py``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = (package,) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` lands in: itself, else its longest dotted prefix that is a module
    (``from deepshard.zero.strategy import ZeroStrategy`` -> ``deepshard.zero.strategy``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name ``module`` imports, wherever the import statement stands. ``from a import b``
    imports ``a`` (its ``__init__`` runs) and ``a.b`` (when ``b`` is a module)."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path = SRC, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = module_files(root, package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {_resolve(name, modules) for name in imported_names(module, path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def folder(module: str, modules: dict[str, Path]) -> str:
    """The folder a module belongs to: its subpackage, or ``(top)`` for the package's own files."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and modules[module].name == "__init__.py"):
        return parts[1]
    return "(top)"


def wide_circles(root: Path = SRC, package: str = PACKAGE) -> list[tuple[frozenset[str], set[str]]]:
    """Each circle spanning more than one folder: (its modules without the package prefix, its folders)."""
    modules = module_files(root, package)
    out = []
    for component in circles(import_graph(root, package)):
        folders = {folder(m, modules) for m in component}
        if len(folders) > 1:
            out.append((frozenset(m.split(".", 1)[1] for m in component), folders))
    return out


def test_the_graph_check_finds_a_circle_across_folders(tmp_path: Path) -> None:
    """The check itself: a made-up package with one circle across two folders and one inside a folder
    (function-level and TYPE_CHECKING imports included) is read as such."""
    pkg = tmp_path / "pkg"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    for init in (pkg, pkg / "a", pkg / "b"):
        (init / "__init__.py").write_text("")
    (pkg / "a" / "one.py").write_text("def f():\n    from pkg.b.two import g\n")
    (pkg / "b" / "two.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from pkg.a import one\n")
    (pkg / "b" / "three.py").write_text("from . import four\n")
    (pkg / "b" / "four.py").write_text("from .three import x\n")
    (pkg / "top.py").write_text("import pkg.b.three\n")
    found = wide_circles(pkg, "pkg")
    assert found == [(frozenset({"a.one", "b.two"}), {"a", "b"})]
    assert {frozenset(c) for c in circles(import_graph(pkg, "pkg"))} == {
        frozenset({"pkg.a.one", "pkg.b.two"}), frozenset({"pkg.b.three", "pkg.b.four"})}


def test_no_import_circle_spans_more_than_one_folder() -> None:
    found = wide_circles()
    unknown = [(sorted(modules), sorted(folders)) for modules, folders in found if modules not in KNOWN_WIDE]
    assert not unknown, ("import circles across folders (move the shared piece below both, or pass data instead "
                         f"of importing the other side): {unknown}")


def test_known_circles_are_still_there() -> None:
    """A known circle that is gone comes off :data:`KNOWN_WIDE`, so it cannot come back unnoticed."""
    present = {modules for modules, _ in wide_circles()}
    gone = [sorted(c) for c in KNOWN_WIDE if c not in present]
    assert not gone, f"these circles are gone: remove them from KNOWN_WIDE in {__file__}: {gone}"
