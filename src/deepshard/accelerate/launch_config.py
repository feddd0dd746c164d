"""Accelerate's launch configuration (its YAML file, its flags) turned into a deepshard launch."""
from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepshard.launcher.options import DEFAULT_HOSTFILE, LaunchError

# Top-level keys of Accelerate's cluster config (``accelerate config`` writes a subset).
TOP_KEYS = frozenset({
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config",
    "fsdp_config", "parallelism_config", "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name",
    "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config", "ipex_config", "mpirun_config"})

# ``deepspeed_config`` sub-keys Accelerate knows (all honoured here).
DS_KEYS = frozenset({
    "deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
    "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping",
    "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_multinode_launcher", "deepspeed_hostfile",
    "deepspeed_inclusion_filter", "deepspeed_exclusion_filter", "deepspeed_moe_layer_cls_names"})

# Sub-keys that a ``deepspeed_config_file`` already sets: giving both is a conflict.
FILE_EXCLUSIVE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                  "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path",
                  "zero3_save_16bit_model")

# ``deepspeed_config`` sub-key -> the variable Accelerate's ``DeepSpeedPlugin`` reads in the script.
DS_ENV = {
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
    "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "deepspeed_moe_layer_cls_names": "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
}

DISTRIBUTED_TYPES = ("DEEPSPEED", "NO", "MULTI_CPU", "MULTI_GPU")
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
MULTINODE_LAUNCHERS = {"pdsh": ["--launcher", "pdsh"], "standard": ["--no_ssh"], "nossh": ["--no_ssh"],
                       "openmpi": ["--launcher", "openmpi"], "mvapich": ["--launcher", "mvapich"],
                       "mpich": ["--launcher", "mpich"], "slurm": ["--launcher", "slurm"]}
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class LaunchPlan:
    """What ``deepshard launch`` runs: the ``deepshard`` launcher's argv and the variables it adds."""

    launcher_argv: list[str]
    env: dict[str, str]
    num_processes: int
    distributed_type: str


def default_config_file(environ: Mapping[str, str]) -> Path:
    """Accelerate's default location: ``$HF_HOME/accelerate/default_config.yaml`` (``HF_HOME`` defaults
    to ``$XDG_CACHE_HOME/huggingface``, and that to ``~/.cache/huggingface``)."""
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = environ.get("HF_HOME") or os.path.join(cache, "huggingface")
    return Path(os.path.expanduser(home)) / "accelerate" / "default_config.yaml"


YAML_HINT = ("pip install pyyaml (from a deepshard checkout: pip install '.[accelerate]'), "
             "or use a .json file")


def yaml_module(purpose: str) -> Any:
    """PyYAML, or a :class:`LaunchError` saying what ``purpose`` needs and how to install it."""
    try:
        import yaml
    except ImportError:
        raise LaunchError(f"{purpose} needs PyYAML: {YAML_HINT}") from None
    return yaml


def read_config_file(path: str | Path) -> dict[str, Any]:
    """An Accelerate config file (YAML, or JSON by extension) as a dict. Anything else (unreadable, not
    UTF-8 text, a syntax error, empty, not a mapping, a ``*_config`` section that is not a mapping) is a
    one-line :class:`LaunchError` naming the file and, where known, the line."""
    text = _config_text(Path(path))
    if str(path).endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise LaunchError(f"{path}:{err.lineno}:{err.colno}: not valid JSON ({err.msg})") from None
    else:
        data = _parse_yaml(path, text)
    if data is None:
        raise LaunchError(f"{path} holds no settings (only comments or blank lines): write the config with "
                          "`accelerate config`")
    if not isinstance(data, dict):
        raise LaunchError(f"{path}: an Accelerate config is a mapping of keys, got {type(data).__name__}")
    for key, value in data.items():
        if isinstance(key, str) and key.endswith("_config") and value is not None and not isinstance(value, dict):
            raise LaunchError(f"{path}:{_line_of(text, key)}: {key} must be a mapping of keys (e.g. "
                              f"'{key}:' then indented 'zero_stage: 2'), got {value!r}")
    return data


def _config_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise LaunchError(f"{path}: cannot read it ({err.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise LaunchError(f"{path}:{line}: not a text file (byte {err.start} is not UTF-8); an Accelerate config "
                          "is YAML or JSON text") from None
    if not text.strip():
        raise LaunchError(f"{path} is empty: write the config with `accelerate config`")
    return text


def _parse_yaml(path: str | Path, text: str) -> Any:
    yaml = yaml_module(f"reading {path}")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        hint = "; YAML is indented with spaces, not tabs" if ("\\t" in str(problem) or "\t" in str(problem)) else ""
        raise LaunchError(f"{where}: not valid YAML ({problem}){hint}") from None


def _line_of(text: str, key: str) -> int:
    """The 1-based line where top-level ``key`` is set (0 when not found)."""
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith((f"{key}:", f'"{key}"', f"'{key}'")):
            return number
    return 0


def _closest(unknown: list[str], known: frozenset[str]) -> str:
    """`` (did you mean 'x'?)`` for the first unknown key that has a close known one, else ``""``."""
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1)
        if close:
            return f" (did you mean {close[0]!r} for {key!r}?)"
    return ""


def merge(config: Mapping[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with every flag that was given (not None) put over it; DeepSpeed flags go under
    ``deepspeed_config``. Unknown keys are refused with the list of known ones."""
    merged = {k: v for k, v in config.items()}
    unknown = sorted(set(merged) - TOP_KEYS)
    if unknown:
        raise LaunchError(f"unknown key(s) {unknown} in the Accelerate config{_closest(unknown, TOP_KEYS)}; "
                          f"known top-level keys: {sorted(TOP_KEYS)}")
    ds = dict(merged.get("deepspeed_config") or {})
    unknown = sorted(set(ds) - DS_KEYS)
    if unknown:
        raise LaunchError(f"unknown deepspeed_config key(s) {unknown}{_closest(unknown, DS_KEYS)} (Accelerate would "
                          f"silently ignore them); known: {sorted(DS_KEYS)}")
    for key, value in flags.items():
        if value is None:
            continue
        if key in DS_KEYS:
            ds[key] = value
        else:
            merged[key] = value
    merged["deepspeed_config"] = ds
    return merged


def as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", "none", ""):
        return False
    raise LaunchError(f"{key}={value!r} is not a boolean; use true or false")


def _int(value: Any, key: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LaunchError(f"{key}={value!r} is not an integer") from None


def check(merged: Mapping[str, Any]) -> str:
    """Validate the merged config; returns the distributed type."""
    dtype = str(merged.get("distributed_type") or "DEEPSPEED").upper()
    if dtype not in DISTRIBUTED_TYPES:
        raise LaunchError(f"distributed_type={dtype}: deepshard launch runs {', '.join(DISTRIBUTED_TYPES)}; "
                          "use `accelerate launch` for the others")
    mp = str(merged.get("mixed_precision") or "no").lower()
    if mp not in MIXED_PRECISION:
        raise LaunchError(f"mixed_precision={mp!r}: choose one of {MIXED_PRECISION}")
    ds = merged["deepspeed_config"]
    if ds and dtype != "DEEPSPEED":
        raise LaunchError(f"deepspeed_config {sorted(ds)} given with distributed_type={dtype}; set "
                          "distributed_type: DEEPSPEED (or --use_deepspeed), or drop the DeepSpeed keys")
    if ds.get("deepspeed_config_file"):
        clash = [k for k in FILE_EXCLUSIVE if ds.get(k) is not None]
        if merged.get("mixed_precision") not in (None, "no"):
            clash.append("mixed_precision")
        if clash:
            raise LaunchError(f"deepspeed_config_file={ds['deepspeed_config_file']} sets these itself; {clash} "
                              "would be ignored: put them in that JSON file (\"auto\" lets the script fill them) "
                              "and remove them from the Accelerate config / command line")
        if not os.path.isfile(ds["deepspeed_config_file"]):
            raise LaunchError(f"deepspeed_config_file={ds['deepspeed_config_file']} does not exist")
    for key in ("offload_optimizer_device", "offload_param_device"):
        if ds.get(key) is not None and str(ds[key]).lower() not in OFFLOAD_DEVICES:
            raise LaunchError(f"deepspeed_config.{key}={ds[key]!r}: choose one of {OFFLOAD_DEVICES}")
    if ds.get("zero_stage") is not None and _int(ds["zero_stage"], "zero_stage") not in (0, 1, 2, 3):
        raise LaunchError(f"deepspeed_config.zero_stage={ds['zero_stage']}: choose 0, 1, 2 or 3")
    return dtype


def _processes(merged: Mapping[str, Any], dtype: str) -> tuple[int, int]:
    """(total processes, machines); the total must split evenly over the machines."""
    machines = _int(merged.get("num_machines") or 1, "num_machines")
    total = _int(merged.get("num_processes") if merged.get("num_processes") not in (None, -1) else machines,
                 "num_processes")
    if dtype == "NO":
        total = 1
    if machines < 1 or total < machines or total % machines:
        raise LaunchError(f"num_processes ({total}) must be a positive multiple of num_machines ({machines}): "
                          f"{total} processes cannot be split evenly over {machines} machine(s)")
    return total, machines


AS_WRITTEN = frozenset({"deepspeed_config_file", "offload_optimizer_nvme_path", "offload_param_nvme_path",
                        "deepspeed_moe_layer_cls_names"})


def deepspeed_env(ds: Mapping[str, Any], file_keys: list[str]) -> dict[str, str]:
    """The variables ``DeepSpeedPlugin`` reads: one per given sub-key (paths and class names as written,
    the rest lower-case as Accelerate writes them), and ``ACCELERATE_CONFIG_DS_FIELDS``: the sub-keys
    that came from the config file."""
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_CONFIG_DS_FIELDS": ",".join(file_keys).lower()}
    for key, var in DS_ENV.items():
        if ds.get(key) is not None:
            env[var] = str(ds[key]) if key in AS_WRITTEN else str(ds[key]).lower()
    return env


def device_env(merged: Mapping[str, Any], dtype: str) -> dict[str, str]:
    """Where the ranks compute. DeepSpeed with ``use_cpu`` stays DeepSpeed on the CPU (deepshard's device
    and Accelerate's device set to cpu); the other types get Accelerate's ``ACCELERATE_USE_CPU``."""
    env: dict[str, str] = {}
    use_cpu = as_bool(merged.get("use_cpu", False), "use_cpu")
    if use_cpu and dtype == "DEEPSPEED":
        env.update(DEEPSHARD_ACCELERATOR="cpu", ACCELERATE_TORCH_DEVICE="cpu")
    elif use_cpu or dtype == "MULTI_CPU":
        env.update(ACCELERATE_USE_CPU="true", DEEPSHARD_ACCELERATOR="cpu")
    gpu_ids = merged.get("gpu_ids")
    if gpu_ids not in (None, "", "all") and not use_cpu:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu_ids)
    return env


def _multinode_argv(ds: Mapping[str, Any], merged: Mapping[str, Any], machines: int) -> list[str]:
    if machines == 1:
        return []
    runner = str(ds.get("deepspeed_multinode_launcher") or "pdsh").lower()
    if runner not in MULTINODE_LAUNCHERS:
        raise LaunchError(f"deepspeed_multinode_launcher={runner!r}: choose one of {sorted(MULTINODE_LAUNCHERS)}")
    argv = ["--hostfile", str(ds.get("deepspeed_hostfile") or DEFAULT_HOSTFILE), "--num_nodes", str(machines),
            *MULTINODE_LAUNCHERS[runner]]
    if "--no_ssh" in argv:
        argv += ["--node_rank", str(_int(merged.get("machine_rank") or 0, "machine_rank"))]
    if not merged.get("main_process_ip"):
        raise LaunchError(f"num_machines={machines} needs main_process_ip (the address of machine 0)")
    return argv


def plan(config: Mapping[str, Any], flags: Mapping[str, Any], script: str, script_args: list[str],
         as_module: bool = False, replace_deepspeed: bool = False) -> LaunchPlan:
    """The launch ``config`` (a parsed Accelerate config file) and ``flags`` (command-line values, None
    when not given) describe, as the ``deepshard`` launcher's argv plus the script's environment."""
    merged = merge(config, flags)
    dtype = check(merged)
    ds = merged["deepspeed_config"]
    total, machines = _processes(merged, dtype)
    given = merged.get("main_process_port")
    port = _int(29500 if given is None else given, "main_process_port")  # 0: the launcher picks a free port
    if port == 0 and machines > 1:
        raise LaunchError("main_process_port 0 (a free port) works on one machine only: every machine must know "
                          "the port, so give all of them the same free port number")
    argv = ["--num_gpus", str(total // machines), "--master_port", str(port), "--no_local_rank",
            "--max_restarts", str(_int(merged.get("max_restarts") or 0, "max_restarts"))]
    if merged.get("main_process_ip"):
        argv += ["--master_addr", str(merged["main_process_ip"])]
    argv += _multinode_argv(ds, merged, machines)
    if ds.get("deepspeed_inclusion_filter") or ds.get("deepspeed_exclusion_filter"):
        argv = argv[2:]  # DeepSpeed's rule: a node filter and --num_gpus do not go together
        for key, flag in (("deepspeed_inclusion_filter", "--include"), ("deepspeed_exclusion_filter", "--exclude")):
            if ds.get(key):
                argv += [flag, str(ds[key])]
    env = {"ACCELERATE_MIXED_PRECISION": str(merged.get("mixed_precision") or "no").lower(),
           **device_env(merged, dtype)}
    if as_bool(merged.get("debug", False), "debug"):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    if as_bool(merged.get("enable_cpu_affinity", False), "enable_cpu_affinity"):
        env["ACCELERATE_CPU_AFFINITY"] = "1"
    if merged.get("num_cpu_threads_per_process"):
        env["OMP_NUM_THREADS"] = str(_int(merged["num_cpu_threads_per_process"], "num_cpu_threads_per_process"))
    if dtype == "DEEPSPEED":
        env.update(deepspeed_env(ds, sorted(set((config.get("deepspeed_config") or {})) & DS_KEYS)))
        if replace_deepspeed:
            env["DEEPSHARD_REPLACE_DEEPSPEED"] = "1"
        target = ["--module", "deepshard.compat.run", *(["-m"] if as_module else []), script]
    else:
        target = ["--module", script] if as_module else [script]
    return LaunchPlan(argv + target + list(script_args), env, total, dtype)
