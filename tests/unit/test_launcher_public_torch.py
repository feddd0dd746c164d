"""The launcher uses torch's public interface only (the next torch release may change anything private): no
import of a private torch name or module, no ``._private`` attribute (or ``getattr(x, "_private")``) on anything
but the object's own class, and no override of a torch class's private method. The checker is shown to find
each kind in a sample, so the check can fail."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import deepshard.launcher

LAUNCHER = Path(deepshard.launcher.__file__).parent
ALLOWED = {("os", "_exit")}  # the standard library's public "exit now"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def source_violations(text: str, where: str) -> list[str]:
    """Private torch imports and private attribute access found in one module's source."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = (node.module or "").split(".") + [a.name for a in node.names]
            found += [f"{where}:{node.lineno}: imports {n} from {node.module}" for n in names if _private(n)]
        elif isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno}: imports {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner not in ("self", "cls") and (owner, node.attr) not in ALLOWED:
                found.append(f"{where}:{node.lineno}: reads {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value)):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def _self_privates(cls: type) -> set[str]:
    """The ``self._x`` names a class's source uses."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return set()
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self" and _private(n.attr)}


def override_violations(module_name: str) -> list[str]:
    """Private methods of torch classes that a class of the module redefines, and torch's private fields it
    touches through ``self``."""
    module = importlib.import_module(module_name)
    found = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module_name:
            continue
        bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] == "torch"]
        for name, value in vars(cls).items():
            base = next((b for b in bases if name in vars(b)), None)
            if _private(name) and inspect.isfunction(value) and base is not None:
                found.append(f"{module_name}.{cls.__name__}.{name} overrides torch's {base.__name__}.{name}")
        theirs = set().union(*(_self_privates(base) for base in bases)) if bases else set()
        found += [f"{module_name}.{cls.__name__} uses torch's self.{name}" for name in
                  sorted(_self_privates(cls) & theirs)]
    return found


def test_the_launcher_uses_no_private_torch_name() -> None:
    found = []
    for path in sorted(LAUNCHER.glob("*.py")):
        found += source_violations(path.read_text(encoding="utf-8"), path.name)
        if path.stem != "__main__":  # importing it would run the launcher
            found += override_violations(f"deepshard.launcher.{path.stem}")
    assert found == [], "\n".join(found)


def test_the_checker_finds_each_kind() -> None:
    sample = ("from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler\n"
              "import torch._C\n"
              "from torch.distributed.elastic.rendezvous import _etcd_stub\n"
              "def f(agent):\n"
              "    agent._pcontext.close()\n"
              "    getattr(agent, '_remaining_restarts')\n"
              "    self._fine = os._exit\n")
    found = source_violations(sample, "sample.py")
    assert sorted(line.split(": ", 1)[1] for line in found) == [
        "getattr(agent, '_remaining_restarts')", "imports _etcd_stub from torch.distributed.elastic.rendezvous",
        "imports _terminate_process_handler from torch.distributed.elastic.multiprocessing.api",
        "imports torch._C", "reads agent._pcontext"]
    assert override_violations("tests.unit.launcher_override_sample") == [
        "tests.unit.launcher_override_sample.Agent._monitor_workers overrides torch's "
        "LocalElasticAgent._monitor_workers",
        "tests.unit.launcher_override_sample.Agent uses torch's self._pcontext"]
