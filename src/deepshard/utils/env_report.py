"""``deepshard report`` (alias ``ds_report_deepshard``): what this machine offers deepshard.

DeepSpeed's ``ds_report`` lists compiled operators and versions. deepshard compiles nothing, so the report
says instead what a run here would find: versions and install paths, the devices and collective backends,
which optional features have their dependency installed, the space offload would write to (``/dev/shm``
and the temporary directory), and what ``deepshard train.py`` would start on this machine.

Every probe is guarded: a missing or broken dependency is reported as such, never a crash.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass, field

GB = 1024 ** 3

# feature -> (distribution that provides it, module to import)
OPTIONAL_FEATURES: dict[str, tuple[str, str]] = {
    "TensorBoard monitor (tensorboard)": ("tensorboard", "tensorboard"),
    "Weights & Biases monitor (wandb)": ("wandb", "wandb"),
    "Accelerate YAML configs": ("pyyaml", "yaml"),
    "Hugging Face models in examples/tests": ("transformers", "transformers"),
    "safetensors checkpoints": ("safetensors", "safetensors"),
    "numpy (safetensors' torch saver)": ("numpy", "numpy"),
    "benchmark baseline: DeepSpeed": ("deepspeed", "deepspeed"),
    "benchmark baseline: Accelerate": ("accelerate", "accelerate"),
    "pictures as PNG (matplotlib)": ("matplotlib", "matplotlib"),
}
CORE_PACKAGES = ("deepshard", "torch", "pydantic", "safetensors", "tqdm", "psutil")


@dataclass
class Section:
    """One titled block of ``name .......... value`` rows."""

    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)

    def add(self, name: str, value: object) -> None:
        self.rows.append((name, str(value)))


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions_section() -> Section:
    """Python, the core packages' versions and where deepshard and torch are installed."""
    sec = Section("versions")
    sec.add("python", f"{platform.python_version()} ({sys.executable})")
    sec.add("platform", platform.platform())
    for dist in CORE_PACKAGES:
        sec.add(dist, _version(dist))
    for mod in ("deepshard", "torch"):
        try:
            sec.add(f"{mod} install path", os.path.dirname(importlib.import_module(mod).__file__ or "?"))
        except Exception as exc:  # noqa: BLE001 - a broken install is what the report is for
            sec.add(f"{mod} install path", f"import failed: {exc}")
    return sec


def devices_section() -> Section:
    """The accelerator deepshard would pick, CUDA details, and the collective backends torch offers."""
    import torch
    import torch.distributed as dist

    sec = Section("devices and backends")
    try:
        from deepshard.accelerator import get_accelerator

        acc = get_accelerator()
        sec.add("deepshard accelerator", f"{acc.kind} ({acc.device}, backend {acc.backend})")
    except Exception as exc:  # noqa: BLE001
        sec.add("deepshard accelerator", f"error: {exc}")
    sec.add("torch CUDA build", torch.version.cuda or "none (CPU build)")
    sec.add("cuda available", torch.cuda.is_available())
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            sec.add(f"cuda:{i}", f"{props.name}, {props.total_memory / GB:.1f} GB, "
                                 f"capability {props.major}.{props.minor}")
        sec.add("bf16 supported", torch.cuda.is_bf16_supported())
    sec.add("CPU cores (logical)", os.cpu_count())
    sec.add("torch threads", torch.get_num_threads())
    sec.add("torch.distributed available", dist.is_available())
    if dist.is_available():
        for name in ("gloo", "nccl", "mpi"):
            probe = getattr(dist, f"is_{name}_available", None)
            sec.add(f"backend {name}", "yes" if probe is not None and probe() else "no")
    return sec


def features_section() -> Section:
    """Each optional feature and whether its dependency imports."""
    sec = Section("optional features")
    for feature, (dist, module) in OPTIONAL_FEATURES.items():
        try:
            importlib.import_module(module)
            state = f"yes ({dist} {_version(dist)})"
        except Exception as exc:  # noqa: BLE001 - ImportError or a broken package
            state = f"no (pip install {dist})" if isinstance(exc, ImportError) else f"broken: {exc}"
        sec.add(feature, state)
    return sec


def _disk(path: str) -> str:
    try:
        usage = shutil.disk_usage(path)
    except OSError as exc:
        return f"unavailable ({exc.strerror})"
    return f"{usage.free / GB:.1f} GB free of {usage.total / GB:.1f} GB"


def memory_section() -> Section:
    """Host memory and the space offload can use: /dev/shm (pinned staging) and the temporary directory."""
    import psutil

    sec = Section("memory and offload space")
    vm = psutil.virtual_memory()
    sec.add("host memory", f"{vm.available / GB:.1f} GB available of {vm.total / GB:.1f} GB")
    sec.add("/dev/shm", _disk("/dev/shm"))
    sec.add(f"temporary directory {tempfile.gettempdir()}", _disk(tempfile.gettempdir()))
    sec.add(f"working directory {os.getcwd()}", _disk(os.getcwd()))
    return sec


def launcher_section() -> Section:
    """What ``deepshard train.py`` (no other flags) would start here, found with the launcher's own code."""
    sec = Section("launcher plan for `deepshard train.py`")
    from deepshard.utils.logging import logger

    level = logger.level
    logger.setLevel("WARNING")  # the launcher's own INFO lines would interleave with the report
    try:
        from deepshard.launcher import cli
        from deepshard.launcher.hostfile import read_hostfile

        args = cli.parse_args(["train.py"])
        hostfile = read_hostfile(args.hostfile)
        cuda = cli.detect_cuda_devices(os.environ)
        active = cli.select_nodes(args, hostfile, cuda, cli.local_hostnames())
        sec.add("hostfile", args.hostfile if hostfile is not None else f"{args.hostfile} absent: this machine only")
        sec.add("nodes", ", ".join(f"{h} (slots {s})" for h, s in active.items()))
        sec.add("processes", sum(len(s) for s in active.values()))
        sec.add("mode", cli.launch_mode(args, active, shutil.which("pdsh") is not None))
        sec.add("device per rank", "cuda:<local_rank>" if cuda else "cpu (gloo); --num_gpus N starts N processes")
    except Exception as exc:  # noqa: BLE001 - a bad hostfile is worth reporting, not raising
        sec.add("plan", f"the launcher would fail: {exc}")
    finally:
        logger.setLevel(level)
    return sec


def format_sections(sections: list[Section]) -> str:
    """Render sections as ``name ....... value`` lines under each title."""
    width = max((len(name) for s in sections for name, _ in s.rows), default=10) + 4
    lines: list[str] = []
    for sec in sections:
        lines.append("-" * 78)
        lines.append(sec.title)
        lines.append("-" * 78)
        lines.extend(f"{(name + ' ').ljust(width, '.')} {value}" for name, value in sec.rows)
    return "\n".join(lines)


def collect(hide_devices: bool = False) -> list[Section]:
    """Every section of the report, in printing order."""
    sections = [versions_section()]
    if not hide_devices:
        sections.append(devices_section())
    sections += [features_section(), memory_section(), launcher_section()]
    return sections


def main(argv: list[str] | None = None, prog: str = "ds_report_deepshard") -> int:
    """Entry point of ``deepshard report`` (alias ``ds_report_deepshard``); prints the report and returns 0."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--hide_operator_status", action="store_true",
                        help="accepted for ds_report compatibility (deepshard has no compiled operators)")
    parser.add_argument("--hide_errors_and_warnings", action="store_true",
                        help="accepted for ds_report compatibility")
    parser.add_argument("--hide_devices", action="store_true", help="leave out the devices section")
    args = parser.parse_args(argv)
    print(format_sections(collect(hide_devices=args.hide_devices)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
