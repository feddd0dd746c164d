"""``deepshard launch`` and ``deepshard config``: Accelerate's launch front end on deepshard's launcher."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepshard.accelerate import launch_config as ac
from deepshard.launcher.options import LaunchError

_TOP_FLAGS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
              "mixed_precision", "gpu_ids", "rdzv_backend", "max_restarts", "num_cpu_threads_per_process")
_DS_FLAGS = ("deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
             "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_accumulation_steps",
             "gradient_clipping", "zero3_init_flag", "zero3_save_16bit_model", "deepspeed_hostfile",
             "deepspeed_multinode_launcher", "deepspeed_inclusion_filter", "deepspeed_exclusion_filter",
             "deepspeed_moe_layer_cls_names")
_INT_FLAGS = {"num_processes", "num_machines", "machine_rank", "main_process_port", "max_restarts", "zero_stage",
              "gradient_accumulation_steps", "num_cpu_threads_per_process"}


# Help text of every setting flag (the same key in the config file).
_HELP = {
    "num_processes": "processes in total, over all machines",
    "num_machines": "machines (nodes) in the job",
    "machine_rank": "this machine's index, 0..num_machines-1 (multi-node without ssh)",
    "main_process_ip": "address of machine 0 (needed with several machines)",
    "main_process_port": "rendezvous port (Accelerate's default 29500; 0: a free port, one machine only)",
    "mixed_precision": "no, fp16, bf16 (or fp8): what Accelerate tells the script",
    "gpu_ids": "GPUs to use, e.g. '0,1' (sets CUDA_VISIBLE_DEVICES; 'all' for every GPU)",
    "rdzv_backend": "Accelerate's rendezvous backend; deepshard's launcher always uses torch's c10d rendezvous",
    "max_restarts": "restart every rank up to N times after a failure",
    "num_cpu_threads_per_process": "OMP_NUM_THREADS for each process",
    "deepspeed_config_file": "a DeepSpeed JSON config (then the settings below come from that file)",
    "zero_stage": "ZeRO stage 0, 1, 2 or 3",
    "offload_optimizer_device": "none, cpu or nvme: where the optimizer states live",
    "offload_param_device": "none, cpu or nvme: where the parameters live (ZeRO-3)",
    "offload_optimizer_nvme_path": "directory for optimizer states with nvme offload",
    "offload_param_nvme_path": "directory for parameters with nvme offload",
    "gradient_accumulation_steps": "micro-batches per optimizer step",
    "gradient_clipping": "clip the gradient norm to this value (0: off)",
    "zero3_init_flag": "true/false: build the model sharded (ZeRO-3 Init) under from_pretrained",
    "zero3_save_16bit_model": "true/false: save the gathered 16-bit model under ZeRO-3",
    "deepspeed_hostfile": "hostfile of the machines (multi-node)",
    "deepspeed_multinode_launcher": "pdsh, standard/nossh, openmpi, mvapich, mpich or slurm (multi-node)",
    "deepspeed_inclusion_filter": "hosts/slots to use, DeepSpeed's --include syntax",
    "deepspeed_exclusion_filter": "hosts/slots to leave out, DeepSpeed's --exclude syntax",
    "deepspeed_moe_layer_cls_names": "comma-separated MoE layer class names (passed to the script)",
    "use_cpu": "train on the CPU (DeepSpeed stays on: deepshard runs it with gloo)",
    "same_network": "the machines share a network (Accelerate's key; accepted)",
    "debug": "Accelerate's debug mode (ACCELERATE_DEBUG_MODE)",
}


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    for name in _TOP_FLAGS + _DS_FLAGS:
        kind: Any = int if name in _INT_FLAGS else (float if name == "gradient_clipping" else str)
        parser.add_argument(f"--{name}", type=kind, default=None, help=_HELP[name])
    for name in ("use_cpu", "same_network", "debug"):
        parser.add_argument(f"--{name}", action="store_const", const=True, default=None, help=_HELP[name])
    parser.add_argument("--cpu", dest="use_cpu", action="store_const", const=True,
                        help="Accelerate's spelling of --use_cpu")
    types = parser.add_mutually_exclusive_group()
    for flag, dtype, text in (("--use_deepspeed", "DEEPSPEED", "run with DeepSpeed (deepshard): the default"),
                              ("--multi_gpu", "MULTI_GPU", "plain DDP over GPUs (no DeepSpeed)"),
                              ("--use_fsdp", "FSDP", "FSDP: not run by deepshard (refused with the reason)"),
                              ("--multi_cpu", "MULTI_CPU", "plain DDP over CPU processes (no DeepSpeed)")):
        types.add_argument(flag, dest="distributed_type", action="store_const", const=dtype, default=None,
                           help=text)


def build_launch_parser(prog: str = "deepshard launch") -> argparse.ArgumentParser:
    """``deepshard launch``'s flags; everything after the script belongs to the script (no prefix
    matching: ``train.py --deepspeed ds.json`` is never read as a launcher flag)."""
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                                     description="Run a script written for Accelerate on deepshard's launcher.",
                                     epilog="example: deepshard launch --num_processes 2 --use_cpu train.py "
                                            "--deepspeed ds_config.json")
    parser.add_argument("--config_file", default=None, help="Accelerate config (default: Accelerate's location)")
    _add_setting_flags(parser)
    parser.add_argument("-m", "--module", action="store_true", help="the script is a module name")
    parser.add_argument("--replace_deepspeed", action="store_true",
                        help="shadow a real DeepSpeed installed in this environment (else refused)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the full traceback of a rank's config error")
    parser.add_argument("training_script", help="the training script (a module name with -m)")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="arguments passed on to the script")
    return parser


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    names = _TOP_FLAGS + _DS_FLAGS + ("use_cpu", "same_network", "debug", "distributed_type")
    return {name: getattr(args, name) for name in names}


def _config_source(path: str | None) -> dict[str, Any]:
    if path is not None:
        if not os.path.isfile(path):
            raise LaunchError(f"--config_file {path} does not exist")
        return ac.read_config_file(path)
    default = ac.default_config_file(os.environ)
    return ac.read_config_file(default) if default.is_file() else {}


def launch_main(argv: Sequence[str], prog: str = "deepshard launch") -> int:
    """``deepshard launch``: plan, export the environment, run the ``deepshard`` launcher."""
    from deepshard.launcher import cli

    args = build_launch_parser(prog).parse_args(list(argv))
    try:
        plan = ac.plan(_config_source(args.config_file), _flags(args), args.training_script,
                       args.training_script_args, as_module=args.module, replace_deepspeed=args.replace_deepspeed)
    except LaunchError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    os.environ.update(plan.env)  # the launcher passes its environment on to every rank
    return cli.main((["--verbose"] if args.verbose else []) + plan.launcher_argv, port_flag="--main_process_port")


# --------------------------------------------------------------------------------------------- config
_QUESTIONS = (("num_processes", "How many processes in total?", "2"),
              ("use_cpu", "Train on the CPU (DeepSpeed on CPU, gloo)? [yes/no]", "no"),
              ("zero_stage", "ZeRO stage [0/1/2/3]?", "2"),
              ("offload_optimizer_device", "Offload the optimizer states [none/cpu/nvme]?", "none"),
              ("offload_param_device", "Offload the parameters [none/cpu/nvme]?", "none"),
              ("gradient_accumulation_steps", "Gradient accumulation steps?", "1"),
              ("gradient_clipping", "Gradient clipping (0 for none)?", "1.0"),
              ("mixed_precision", "Mixed precision [no/fp16/bf16]?", "no"))


def _ask(answers: dict[str, Any]) -> None:
    for key, question, default in _QUESTIONS:
        if answers.get(key) is None:
            reply = input(f"{question} [{default}]: ").strip() or default
            answers[key] = reply


def config_document(values: dict[str, Any]) -> dict[str, Any]:
    """The Accelerate config ``accelerate config`` would write for these answers (DeepSpeed type)."""
    ds_keys = [k for k in _DS_FLAGS if values.get(k) is not None]
    doc: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": bool(values.get("debug") or False),
                           "distributed_type": "DEEPSPEED",
                           "deepspeed_config": {k: values[k] for k in ds_keys},
                           "machine_rank": int(values.get("machine_rank") or 0),
                           "main_training_function": "main",
                           "mixed_precision": str(values.get("mixed_precision") or "no"),
                           "num_machines": int(values.get("num_machines") or 1),
                           "num_processes": int(values.get("num_processes") or 1),
                           "rdzv_backend": "static", "same_network": True,
                           "use_cpu": ac.as_bool(values.get("use_cpu") or False, "use_cpu")}
    for key in ("main_process_ip", "main_process_port", "gpu_ids"):
        if values.get(key) is not None:
            doc[key] = values[key]
    ds = doc["deepspeed_config"]
    for key in ("zero_stage", "gradient_accumulation_steps"):
        if key in ds:
            ds[key] = int(ds[key])
    if "gradient_clipping" in ds:
        ds["gradient_clipping"] = float(ds["gradient_clipping"])
    ds.setdefault("zero3_init_flag", int(ds.get("zero_stage", 2)) == 3)
    ac.check(ac.merge(doc, {}))
    return doc


def config_main(argv: Sequence[str], prog: str = "deepshard config") -> int:
    """``deepshard config``: ask (or take flags), write the YAML (JSON for a ``.json`` path), print where."""
    parser = argparse.ArgumentParser(prog=prog, description="Write an Accelerate config for deepshard.",
                                     allow_abbrev=False)
    parser.add_argument("--config_file", default=None,
                        help="where to write (default: Accelerate's location); a .json name writes JSON")
    parser.add_argument("--non_interactive", "-y", action="store_true", help="take flags and defaults, ask nothing")
    _add_setting_flags(parser)
    args = parser.parse_args(list(argv))
    values = _flags(args)
    if not args.non_interactive and sys.stdin.isatty():
        _ask(values)
    path = Path(args.config_file) if args.config_file else ac.default_config_file(os.environ)
    try:
        doc = config_document(values)
        text = (json.dumps(doc, indent=2, sort_keys=True) + "\n" if path.suffix == ".json"
                else ac.yaml_module(f"writing {path}").safe_dump(doc, sort_keys=True))
    except (LaunchError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"{prog}: wrote {path}")
    return 0
