"""DeepSpeed helper functions and small classes called on the same inputs; ``run()`` returns what each call
gave (a value, or the exception's type), as JSON-able data. Run once under DeepSpeed 0.19.8 and once under
deepshard (``import deepspeed`` answered by deepshard.compat), the two must agree. No pytest here: DeepSpeed's
python imports this module too."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable


def _call(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (ValueError, AssertionError) as exc:  # DeepSpeed asserts where deepshard raises ValueError: both refuse
        return {"raised": "refused"}
    except (TypeError, KeyError, FileNotFoundError) as exc:
        return {"raised": type(exc).__name__}


def _numa() -> dict[str, Any]:
    from deepspeed.utils.numa import parse_range_list

    cases = ["0,2-4,6,8-9", "3", "0-0", "0,2-6,5-9", "8,2-6", "1,6-2", "1,1", "a-b"]
    return {c: _call(lambda c=c: parse_range_list(c)) for c in cases}


def _partitions() -> dict[str, Any]:
    from deepspeed.runtime import utils as ds_utils

    out: dict[str, Any] = {}
    for weights, parts in (([1, 2, 1], 4), ([1, 1, 1, 1], 4), ([1, 1, 1, 1, 1], 4), ([1, 1, 1, 1, 0, 1], 4),
                           ([5, 1, 1, 1, 1, 5], 3), ([3, 1, 4, 1, 5, 9, 2, 6], 3), ([2] * 7, 2), ([7], 1)):
        result = ds_utils.partition_balanced(weights=weights, num_parts=parts)
        sums = [sum(weights[b:e]) for b, e in zip(result[:-1], result[1:])]
        out[f"{weights}/{parts}"] = {"parts": len(result) - 1, "heaviest": max(sums), "spread": max(sums) - min(sums)}
    for items, parts in ((7, 3), (2, 4), (8, 4), (0, 2)):
        out[f"uniform {items}/{parts}"] = list(ds_utils.partition_uniform(items, parts))
    return out


def _launcher() -> dict[str, Any]:
    from deepspeed.launcher import runner

    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    specs = [("", ""), ("worker-1:0,3", ""), ("", "worker-1"), ("", "worker-0:0,1@worker-1:3"), ("worker-0", ""),
             ("worker-0:1,1@worker-0:2", ""), ("jeff", ""), ("", "worker-1:4"), ("A", "B"), ("", "worker-0@worker-1")]
    out: dict[str, Any] = {f"{i}|{e}": _call(lambda i=i, e=e: runner.parse_resource_filter(hosts, i, e))
                           for i, e in specs}
    for text in ("worker-1 slots=2\n\n# c\nlocalhost slots=1", "a slots=1\na slots=2", "bad line slots=1", "\n"):
        out[f"hostfile {text!r}"] = _call(lambda text=text: runner._parse_hostfile(text.splitlines()))
    return out


def _files() -> dict[str, Any]:
    from deepspeed.utils.zero_to_fp32 import get_optim_files

    with tempfile.TemporaryDirectory() as tmp:
        for i in (10, 2, 1, 0, 11):
            open(os.path.join(tmp, f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt"), "w").close()
        names = [os.path.basename(p) for p in get_optim_files(tmp)]
        empty = _call(lambda: get_optim_files(os.path.join(tmp, "nothing")))
    return {"order": names, "empty": empty}


def _numbers() -> dict[str, Any]:
    from deepspeed.utils.comms_logging import convert_size
    from deepspeed.utils.pin_memory_tracker import _fmt_bytes
    from deepspeed.utils.timer import trim_mean

    data = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 100.0]
    return {"trim": [trim_mean(list(data), p) for p in (0.0, 0.1, 0.2)], "trim_empty": trim_mean([], 0.1),
            "size": [convert_size(n) for n in (0, 1, 1536, 2**20, 3 * 2**30)],
            "fmt": [_fmt_bytes(n) for n in (512, 2048, 2**20, 2**30)]}


def _tracker() -> list[Any]:
    from deepspeed.utils.pin_memory_tracker import _tracker, track_pinned_memory

    _tracker.reset()
    seen = []
    for gb in (30, 10, 100, 1):
        track_pinned_memory(gb * 2**30)
        seen.append([_tracker._bytes, _tracker._calls, _tracker._next_checkpoint])
    _tracker.reset()
    return seen


def _configs() -> dict[str, Any]:
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config, get_bfloat16_config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    def fp16(**kw: Any) -> Any:
        cfg = DeepSpeedFP16Config(**kw)
        return [cfg.loss_scale, cfg.loss_scale_window, cfg.min_loss_scale, cfg.initial_dynamic_scale()]

    fp16_cases = [{}, {"loss_scale": 128}, {"loss_scale": -1}, {"loss_scale": True}, {"loss_scale": float("nan")},
                  {"enabled": True, "loss_scale_window": 0}, {"enabled": True, "loss_scale": 8, "min_loss_scale": 0},
                  {"enabled": True, "min_loss_scale": False}, {"initial_scale_power": 8}]
    zero_cases = [{}, {"stage": 3}, {"stage3_prefetch_bucket_size": 123}, {"cpu_offload": True},
                  {"stage3_gather_fp16_weights_on_model_save": True}, {"offload_param": {"device": "cpu"}}]

    def zero(kw: dict[str, Any]) -> Any:
        cfg = DeepSpeedZeroConfig(**kw)
        # prefetch_bucket_size is left out: its default differs on purpose (docs/zero.md)
        return [cfg.stage, cfg.overlap_comm,
                cfg.prefetch_bucket_size if "stage3_prefetch_bucket_size" in kw else "default",
                cfg.gather_16bit_weights_on_model_save,
                None if cfg.offload_optimizer is None else str(cfg.offload_optimizer.device),
                None if cfg.offload_param is None else str(cfg.offload_param.device)]

    return {"fp16": [_call(lambda kw=kw: fp16(**kw)) for kw in fp16_cases],
            "zero": [_call(lambda kw=kw: zero(kw)) for kw in zero_cases],
            "bf16": [get_bfloat16_config({k: {"enabled": True}}).enabled for k in ("bf16", "bfloat16")],
            "enums": [int(ZeroStageEnum.weights), ZeroStageEnum(1).name, OffloadDeviceEnum.cpu == "cpu",
                      f"offload={OffloadDeviceEnum.nvme:4}"]}


def _config_object() -> dict[str, Any]:
    from deepspeed.runtime.config import DeepSpeedConfig

    out: dict[str, Any] = {}
    for given in ({"train_batch_size": 8}, {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2},
                  {"train_batch_size": 8, "gradient_accumulation_steps": 2}, {"gradient_accumulation_steps": 2}):
        def build(given: dict[str, Any] = given) -> Any:
            cfg = DeepSpeedConfig(given)
            return [cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps]
        out[json.dumps(given)] = _call(build)
    cfg = DeepSpeedConfig({"train_batch_size": 4})
    rederived = []
    for tbs, micro, gas in ((32, 16, None), (33, 17, 2), (None, 4, 2), (12, None, 3)):
        cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = tbs, micro, gas

        def again() -> Any:
            cfg._configure_train_batch_size()
            return [cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps]
        rederived.append(_call(again))
    out["rederived"] = rederived
    return out


def _ops_and_device() -> dict[str, Any]:
    import torch

    import deepspeed
    from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder

    with deepspeed.OnDevice(dtype=torch.half, device="meta"):
        layer = torch.nn.Linear(3, 4)
    from deepspeed.utils.torch import required_torch_version

    versions = [required_torch_version(min_version=a, max_version=b) for a, b in (
        (1.9, None), ("2.1", None), (None, "1.13"), (99, None), (None, 99), ("2.13", "2.13"), (2.0, 3.0))]
    return {"ops": [deepspeed.ops.__compatible_ops__[b.NAME] for b in (CPUAdamBuilder, FusedAdamBuilder)],
            "torch_versions": versions,
            "on_device": [str(layer.weight.device), str(layer.weight.dtype), str(torch.get_default_dtype())],
            "version": [deepspeed.__version_major__, deepspeed.__version_minor__]}


def _comms_logger() -> dict[str, Any]:
    from deepspeed.utils.comms_logging import CommsLogger

    log = CommsLogger()
    flags = [log.prof_all]
    log.stop_profiling_comms()
    flags.append(log.prof_all)
    log.start_profiling_op(["all_reduce"])
    flags.append(list(log.prof_ops))
    log.comms_dict = {"all_reduce": {1024: [3, [3.0, 1.0, 2.0], [1.0, 3.0, 2.0], [2.0, 6.0, 4.0]]}}
    summary = log.get_operation_summary("all_reduce")[1024]
    return {"flags": flags, "summary": {k: v for k, v in summary.items()}, "total": log.get_total_operations(),
            "names": log.get_operation_names(), "raw_kept": log.get_raw_data()["all_reduce"][1024][1],
            "missing": log.get_operation_summary("broadcast")}


def _runners() -> dict[str, Any]:
    from types import SimpleNamespace

    from deepspeed.launcher.multinode_runner import MultiNodeRunner, PDSHRunner

    class Dummy(MultiNodeRunner):
        def backend_exists(self) -> bool:
            return True

        def get_cmd(self, environment: dict, active_resources: dict) -> list:
            return []

    dummy = Dummy(SimpleNamespace(user_args=["--x", "1"], user_script="s.py"), "token")
    for key, value in (("A", "64(x2)"), ("B", "/usr/lib/python3/site-packages"), ("C", " spaced value ")):
        dummy.add_export(key, value)
    return {"exports": dummy.exports, "user": dummy.user_arguments, "name": dummy.name,
            "pdsh_name": PDSHRunner.__name__}


def _config_model() -> dict[str, Any]:
    from typing import List, Optional

    from pydantic import Field, ValidationError

    from deepspeed.runtime.config_utils import DeepSpeedConfigModel, get_config_default

    class Conf(DeepSpeedConfigModel):
        a: int = 0
        old: Optional[str] = Field(None, json_schema_extra={"deprecated": True, "new_param": "new",
                                                            "new_param_fn": lambda x: [x]})
        new: Optional[List[str]] = None
        c: int = Field(3, alias="c_alias")

    def build(**kw: Any) -> Any:
        try:
            conf = Conf(**kw)
        except ValidationError:
            return "invalid"
        return [conf.a, conf.new, conf.c]

    return {"cases": [_call(lambda kw=kw: build(**kw)) for kw in (
        {}, {"a": "auto"}, {"old": "x"}, {"c_alias": 5}, {"c": 6}, {"a": "x"}, {"typo": 1}, {"new": ["y"], "old": "x"})],
        "default": get_config_default(Conf, "c")}


def _engine_precision() -> dict[str, Any]:
    """The engine's mixed-precision resolution, validation and cast, on stand-in engines."""
    from types import SimpleNamespace

    import torch

    from deepspeed.runtime.engine import DeepSpeedEngine

    def engine(param: Any = None, buffer: Any = None, fp16: bool = False, bf16: bool = False) -> Any:
        return SimpleNamespace(_config=SimpleNamespace(param_dtype=param, buffer_dtype=buffer),
                               fp16_enabled=lambda: fp16, bfloat16_enabled=lambda: bf16)

    combos = [(p, f, b) for p in (None, "fp16", "bf16", "fp32") for f, b in ((False, False), (True, False),
                                                                            (False, True))]
    checks = [_call(lambda p=p, f=f, b=b: DeepSpeedEngine._assert_valid_mixed_precision_config(engine(p, None, f, b))
                    or "ok") for p, f, b in combos]
    dtypes = [[str(d) for d in DeepSpeedEngine._mixed_precision_dtypes(engine(None, buf, f, b))]
              for buf in (None, "bf16", "fp32") for f, b in ((False, False), (True, False), (False, True))]
    casts = []
    for param_dtype, buffer_dtype, zero_init in ((torch.bfloat16, None, False), (torch.bfloat16, torch.float16, False),
                                                 (torch.bfloat16, None, True), (None, torch.bfloat16, False)):
        module = torch.nn.Linear(2, 2)
        module.register_buffer("freq", torch.ones(2))
        DeepSpeedEngine._cast_module_mixed_precision(SimpleNamespace(module=module), param_dtype, buffer_dtype,
                                                     zero_init)
        casts.append([str(module.weight.dtype), str(module.freq.dtype)])
    return {"checks": checks, "dtypes": dtypes, "casts": casts}


def _expert_ranks() -> list[Any]:
    """DeepSpeed's expert-parallel layout of a world: ranks only, no process group."""
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    cases = [(16, 2, 4, 1, False), (16, 2, 4, 1, True), (16, 1, 2, 2, True), (32, 2, 2, 2, False),
             (24, 2, 3, 2, True), (8, 1, 8, 1, False), (12, 2, 4, 1, False), (12, 5, 1, 1, False)]
    return [_call(lambda c=c: _get_expert_parallel_ranks(*c)) for c in cases]


def _throughput_timer() -> list[Any]:
    """DeepSpeed's ThroughputTimer counting over 4 optimizer steps of 3 micro-steps (the clock's values
    differ between runs; what is compared is whether each field moved)."""
    from types import SimpleNamespace

    from deepspeed.utils.timer import ThroughputTimer

    timer = ThroughputTimer(SimpleNamespace(enabled=True, synchronized=False), batch_size=12, start_step=2)
    seen = [[timer.avg_samples_per_sec()]]
    timer.stop()  # before any start: no effect
    for micro in range(12):
        timer.start()
        timer.stop(global_step=(micro + 1) % 3 == 0)
        seen.append([timer.initialized, timer.started, timer.micro_step_count, timer.global_step_count,
                     timer.start_time > 0, timer.total_elapsed_time > 0, timer.step_elapsed_time > 0])
    seen.append([timer.batch_size, timer.avg_samples_per_sec() > 0])
    return seen


def _single_rank_group() -> list[Any]:
    """zero.Init's check for a one-rank group under a multi-process launch (DeepSpeed's private name)."""
    from deepspeed.runtime.zero.partition_parameters import _contradicting_single_rank_pg_error as check

    cases = [(1, None, {"WORLD_SIZE": "8"}), (1, None, {"WORLD_SIZE": "1"}), (1, None, {}), (8, None, {"WORLD_SIZE": "8"}),
             (1, object(), {"WORLD_SIZE": "8"}), (1, None, {"WORLD_SIZE": ""}), (1, None, {"WORLD_SIZE": "x"}),
             (1, None, {"WORLD_SIZE": None}), (2, None, {"WORLD_SIZE": "4"})]
    out = []
    for size, group, env in cases:
        message = check(size, group, env)
        out.append(None if message is None else ["WORLD_SIZE=8" in message, "init_distributed" in message])
    return out


def run() -> dict[str, Any]:
    """Every case, by name."""
    return {"engine_precision": _engine_precision(), "comms_logger": _comms_logger(), "runners": _runners(),
            "config_model": _config_model(), "numa": _numa(), "partitions": _partitions(), "launcher": _launcher(),
            "files": _files(), "expert_ranks": _expert_ranks(),
            "numbers": _numbers(), "tracker": _tracker(), "configs": _configs(), "config_object": _config_object(),
            "ops": _ops_and_device(), "throughput_timer": _throughput_timer(),
            "single_rank_group": _single_rank_group()}


if __name__ == "__main__":
    results = run()  # first: the libraries log while it runs
    print("=====")
    print(json.dumps(results, sort_keys=True, default=str))
