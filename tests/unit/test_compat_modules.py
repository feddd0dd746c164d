"""DeepSpeed module paths clients import (the CIFAR tutorial's ``deepspeed.moe.utils``, the pipeline example's
``deepspeed.runtime.utils.set_random_seed``, the estimators' documented paths, config constants ...) do
DeepSpeed's thing under ``import deepspeed`` = deepshard."""
from __future__ import annotations

import io
import json
import random
from contextlib import redirect_stdout

import numpy
import pytest
import torch
from torch import nn



def _net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 30 * 30, 10))


def test_moe_utils_leave_a_dense_model_as_it_is(shim: None) -> None:
    from deepspeed.moe.utils import (configure_moe_param_groups, has_moe_layers, is_moe_param,
                                     split_params_into_different_moe_groups_for_optimizer,
                                     split_params_into_shared_and_expert_params)

    net = _net()
    params = list(net.parameters())
    # the CIFAR tutorial's create_moe_param_groups: one group of every parameter, its name and lr kept
    groups = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "parameters", "lr": 0.1})
    assert len(groups) == 1 and groups[0]["name"] == "parameters" and groups[0]["lr"] == 0.1
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in params]
    two = ({"params": params[:2], "name": "a"}, {"params": params[2:], "name": "b", "weight_decay": 0.0})
    assert [g["name"] for g in split_params_into_different_moe_groups_for_optimizer(two)] == ["a", "b"]
    assert configure_moe_param_groups(params)[0]["name"] == "dense-params"
    assert has_moe_layers(net) == (False, 0) and not any(is_moe_param(p) for p in params)
    assert split_params_into_shared_and_expert_params(params) == (params, [])
    with pytest.raises(ValueError, match="Unknown param group type"):
        split_params_into_different_moe_groups_for_optimizer("params")  # type: ignore[arg-type]


def test_moe_param_groups_split_experts_as_deepspeed_does(shim: None) -> None:
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.sharded_moe import MOELayer, TopKGate
    from deepspeed.moe.utils import (configure_moe_param_groups, has_moe_layers, is_moe_param_group,
                                     split_params_grads_into_shared_and_expert_params,
                                     split_params_into_different_moe_groups_for_optimizer)

    assert deepspeed.moe.layer.MoE is MoE  # the tutorial's attribute spelling reaches it too
    net = nn.Sequential(nn.Linear(8, 8), MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=4, ep_size=2),
                        MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2, ep_size=1))
    assert has_moe_layers(net) == (True, 4) and isinstance(net[1].deepspeed_moe, MOELayer)
    assert isinstance(net[1].deepspeed_moe.gate, TopKGate)
    params = list(net.parameters())
    dense = [p for n, p in net.named_parameters() if "deepspeed_experts" not in n]
    groups = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "parameters", "lr": 0.1})
    assert [(g["name"], g.get("moe", False), g["lr"], len(g["params"])) for g in groups] == [
        ("parameters", False, 0.1, len(dense)), ("ep_size_2", True, 0.1, 4), ("ep_size_1", True, 0.1, 4)]
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in dense]
    assert [is_moe_param_group(g) for g in groups] == [False, True, True]
    small = split_params_into_different_moe_groups_for_optimizer([{"params": params, "name": "all"}], max_group_size=72)
    assert [len(g["params"]) for g in small if g.get("moe")] == [2, 2, 2, 2]  # 72 + 8 elements per expert Linear
    assert [g["name"] for g in configure_moe_param_groups(params)] == ["dense-params", "ep_size_2", "ep_size_1"]
    with pytest.raises(KeyError, match="'name'"):
        split_params_into_different_moe_groups_for_optimizer({"params": params})
    net[2](torch.randn(6, 8))[0].sum().backward()
    shared, expert = split_params_grads_into_shared_and_expert_params(list(net[2].parameters()))
    assert len(shared) == 1 and len(expert) == 4


def test_runtime_utils(shim: None) -> None:
    import deepspeed

    deepspeed.runtime.utils.set_random_seed(2**40 + 5)  # the pipeline example's spelling, no import of utils
    got = (random.random(), float(numpy.random.rand()), float(torch.rand(1)))
    random.seed(2**40 + 5)
    numpy.random.seed((2**40 + 5) % 2**32)
    torch.manual_seed(2**40 + 5)
    assert got == (random.random(), float(numpy.random.rand()), float(torch.rand(1)))

    from deepspeed.runtime.utils import move_to_device, see_memory_usage

    t = torch.ones(2, dtype=torch.float64)
    moved = move_to_device({"a": [t, (t, 3)], "b": "x"}, "cpu", criterion_func=lambda x: torch.is_tensor(x))
    assert moved["a"][0] is t and moved["a"][1][1] == 3 and moved["b"] == "x"
    out = io.StringIO()
    with redirect_stdout(out):
        see_memory_usage("quiet")
        see_memory_usage("loud", force=True)
    assert "quiet" not in out.getvalue() and "loud" in out.getvalue() and "MA " in out.getvalue()


def test_estimators_at_deepspeeds_documented_paths(shim: None) -> None:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live

    from deepshard.profiling import ds_estimators

    assert estimate_zero3_model_states_mem_needs_all_live is ds_estimators.estimate_zero3_model_states_mem_needs_all_live
    assert estimate_zero2_model_states_mem_needs_all_live is ds_estimators.estimate_zero2_model_states_mem_needs_all_live
    out = io.StringIO()
    with redirect_stdout(out):
        estimate_zero2_model_states_mem_needs_all_live(_net(), num_gpus_per_node=2)
    assert "offload_optimizer" in out.getvalue()
    from deepspeed.runtime.zero.stage3 import GatheredParameters  # the rest of the module's names stay

    assert GatheredParameters is not None


def test_config_constants_and_helpers(shim: None) -> None:
    from deepspeed.runtime import config, config_utils, lr_schedules

    assert (config.ADAM_OPTIMIZER, config.ADAMW_OPTIMIZER, config.LAMB_OPTIMIZER, config.ADAGRAD_OPTIMIZER,
            config.LION_OPTIMIZER, config.MUON_OPTIMIZER) == ("adam", "adamw", "lamb", "adagrad", "lion", "muon")
    from deepshard.config import DeepShardConfig

    assert len(config.DEEPSPEED_OPTIMIZERS) == 9 and issubclass(config.DeepSpeedConfig, DeepShardConfig)
    ds_config = config.DeepSpeedConfig({"train_batch_size": 8, "gradient_accumulation_steps": 2})  # dp 1
    assert (ds_config.train_micro_batch_size_per_gpu, ds_config._param_dict) == (4, {"train_batch_size": 8,
                                                                                     "gradient_accumulation_steps": 2})
    ds_config.train_batch_size, ds_config.train_micro_batch_size_per_gpu = 9, 4
    with pytest.raises(AssertionError, match=r"train_batch_size \(9\) must equal"):
        ds_config._configure_train_batch_size()
    assert config.get_gradient_clipping({}) == 1.0 and config.get_log_level({"log_level": "INFO"}) == "INFO"
    assert config.load_config is not None  # deepshard.config's names are there too
    import deepspeed

    assert deepspeed.DeepSpeedConfigError is config.DeepSpeedConfigError  # DeepSpeed's top-level name too
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="tag_validation"):
        deepspeed.DeepSpeedConfig({"train_batch_size": 2, "checkpoint": {"tag_validation": "foo"}})
    assert len(lr_schedules.CONFIG_KEYS) == 25 and lr_schedules.WARMUP_MIN_LR == "warmup_min_lr"
    assert (lr_schedules.CYCLE_FIRST_STEP_SIZE, lr_schedules.LR_RANGE_TEST_STAIRCASE, lr_schedules.TOTAL_NUM_STEPS) == (
        "cycle_first_step_size", "lr_range_test_staircase", "total_num_steps")
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['a'\]"):
        json.loads('{"a": 1, "b": 2, "a": 3}', object_pairs_hook=config_utils.dict_raise_error_on_duplicate_keys)
    assert config_utils.get_scalar_param({"x": 1}, "y", 7) == 7
    assert repr(config_utils.pp_int(100000)) == "100,000"
    assert json.dumps({"n": 20000, "m": 5}, cls=config_utils.ScientificNotationEncoder) == (
        '{\n    "n": 2.000000e+04, \n    "m": 5\n}')


def test_accelerator_and_version_info(shim: None) -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator, is_current_accelerator_supported
    from deepspeed.git_version_info import git_hash, installed_ops, version

    assert is_current_accelerator_supported() and deepspeed.get_accelerator is get_accelerator
    acc = get_accelerator()
    t = acc.FloatTensor([1, 2])
    assert t.dtype == torch.float32 and t.device.type == acc.device_name().split(":")[0]
    assert acc.LongTensor([1]).dtype == torch.int64 and acc.BFloat16Tensor([1.0]).dtype == torch.bfloat16
    calls = []
    acc.lazy_call(lambda: calls.append(1))
    assert calls == [1] or acc.device_name() != "cpu"
    assert isinstance(acc.default_generator(0), torch.Generator)
    with pytest.raises(NotImplementedError, match="builds no DeepSpeed ops"):
        acc.get_op_builder("CPUAdamBuilder")
    assert version == deepspeed.__version__ and installed_ops == {} and git_hash == "unknown"
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert DeepSpeedEngine is deepspeed.DeepSpeedEngine and deepspeed.PipelineEngine.__name__ == "PipelineEngine"


def test_deepspeed_assertions_are_assertion_errors_too() -> None:
    """Where DeepSpeed asserts, deepshard's error is also an AssertionError (code written for DeepSpeed catches
    that), still saying what is wrong and what to do."""
    import torch.distributed as dist

    from deepshard import initialize
    from deepshard.distributed import init_distributed

    assert not dist.is_initialized()
    with pytest.raises(AssertionError, match="not initialized; call torch.distributed.init_process_group"):
        init_distributed(dist_init_required=False)
    with pytest.raises(ValueError, match="needs model="):
        initialize(model=None, config={"train_batch_size": 1})
    with pytest.raises(AssertionError, match="needs model="):
        initialize(model=None, config={"train_batch_size": 1})


def test_config_log_level_sets_the_logger() -> None:
    import logging

    from deepshard.utils.logging import get_log_level_from_string, logger, set_log_level_from_string

    saved = logger.level
    try:
        set_log_level_from_string("ERROR")
        assert logger.getEffectiveLevel() == logging.ERROR and get_log_level_from_string("debug") == logging.DEBUG
        with pytest.raises(ValueError, match="'loud' is not one of debug, info"):
            set_log_level_from_string("loud")
    finally:
        logger.setLevel(saved)
        for handler in logger.handlers:
            handler.setLevel(logging.NOTSET)


def test_tiled_linear_is_the_linear_map_it_cuts_up() -> None:
    """``deepspeed.zero.TiledLinear``: tiles copied from a full ``nn.Linear`` give its output and, sliced, its
    gradients (a bias on the last input tile of each row only); ``TiledLinearReturnBias`` hands the bias back;
    one optimizer step at ZeRO-3 (one process) moves it as the full layer moves."""
    import torch.distributed as dist

    import deepshard
    from deepshard.zero import TiledLinear, TiledLinearReturnBias

    class ReturnsBias(nn.Linear):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            return nn.functional.linear(x, self.weight), self.bias

    torch.manual_seed(0)
    for fan_in, fan_out, splits, bias in ((23, 29, 2, True), (29, 23, 5, False), (8, 8, 8, True)):
        base = nn.Linear(fan_in, fan_out, bias=bias)
        tiled = TiledLinear(fan_in, fan_out, bias=bias, in_splits=splits, out_splits=splits, init_linear=base)
        x = torch.randn(3, fan_in)
        torch.testing.assert_close(tiled(x), base(x))
        base(x).square().sum().backward()
        tiled(x).square().sum().backward()
        for o, row in enumerate(tiled.linears):
            rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
            for i, tile in enumerate(row):
                cols = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
                torch.testing.assert_close(tile.weight.grad, base.weight.grad[rows, cols])
                assert (tile.bias is not None) == (bias and i == splits - 1)
                if tile.bias is not None:
                    torch.testing.assert_close(tile.bias.grad, base.bias.grad[rows])
        parts = TiledLinear(fan_in, fan_out, bias=bias, in_splits=splits, out_splits=splits, init_linear=base,
                            combine_out_splits=False)(x)
        assert len(parts) == splits and torch.equal(torch.cat(parts, -1), tiled(x))
        returns = TiledLinearReturnBias(fan_in, fan_out, bias=bias, in_splits=splits, out_splits=splits,
                                        linear_cls=ReturnsBias, init_linear=base)
        out, b = returns(x)
        torch.testing.assert_close(out, nn.functional.linear(x, base.weight))
        assert (b is None) if not bias else torch.equal(b, base.bias)
    for bad in (0, 9):
        with pytest.raises(RuntimeError, match="in_splits"):
            TiledLinear(8, 8, in_splits=bad)

    created = not dist.is_initialized()
    base = nn.Linear(6, 4)
    tiled = TiledLinear(6, 4, in_splits=2, out_splits=2, init_linear=base)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "gradient_clipping": 0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = deepshard.initialize(model=tiled, config=cfg)[0]
    try:
        x = torch.randn(2, 6)
        engine.backward(engine(x).square().sum())
        engine.step()
        with torch.no_grad():
            expected = base.weight - 0.1 * torch.autograd.functional.jacobian(
                lambda w: nn.functional.linear(x, w, base.bias).square().sum(), base.weight)
        with deepshard.zero.GatheredParameters(list(tiled.parameters())):
            got = torch.cat([torch.cat([t.weight for t in row], 1) for row in tiled.linears], 0)
            torch.testing.assert_close(got, expected)
    finally:
        engine.destroy()
        if created and dist.is_initialized():
            dist.destroy_process_group()


def test_zero3_linear_wrap_is_linear_with_its_own_backward() -> None:
    """``deepspeed.runtime.zero.linear.zero3_linear_wrap``: ``F.linear``'s values and gradients (batched and not),
    under ``torch.func.grad`` and ``vmap`` too; forward under bf16 autocast gives bf16 and fp32 gradients, and an
    autocast region around ``backward()`` does not change a forward that ran without one."""
    from deepshard.zero.linear import LinearFunctionForZeroStage3, zero3_linear_wrap

    torch.manual_seed(0)
    for shape, with_bias in (((3, 5, 8), True), ((8,), True), ((2, 8), False)):
        x, w, b = torch.randn(*shape, requires_grad=True), torch.randn(4, 8, requires_grad=True), torch.randn(4)
        b = b.requires_grad_() if with_bias else None
        ours = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
        out = zero3_linear_wrap(*ours)
        torch.testing.assert_close(out, nn.functional.linear(x, w, b))
        assert "LinearFunctionForZeroStage3" in type(out.grad_fn).__name__
        out.square().sum().backward()
        nn.functional.linear(x, w, b).square().sum().backward()
        for mine, ref in zip(ours, (x, w, b)):
            if ref is not None:
                torch.testing.assert_close(mine.grad, ref.grad)
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    torch.testing.assert_close(torch.func.grad(lambda w: zero3_linear_wrap(x, w).sin().sum())(w),
                               torch.func.grad(lambda w: nn.functional.linear(x, w).sin().sum())(w))
    torch.testing.assert_close(torch.func.vmap(lambda r: LinearFunctionForZeroStage3.apply(r, w, None).sum())(x),
                               (x @ w.t()).sum(-1))
    w32 = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = zero3_linear_wrap(x, w32)
    assert low.dtype == torch.bfloat16
    low.float().sum().backward()
    assert w32.grad.dtype == torch.float32
    torch.testing.assert_close(w32.grad, x.sum(0).expand(4, 8), atol=0.05, rtol=0.02)
    w_plain = w.clone().requires_grad_()
    plain = zero3_linear_wrap(x, w_plain)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # around backward only: the gradients stay fp32's
        plain.sum().backward()
    torch.testing.assert_close(w_plain.grad, x.sum(0).expand(4, 8))


def test_module_inject_holds_autoep_layer_only(shim: None) -> None:
    """``deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer`` is deepshard's (the class AutoEP's MoE blocks
    become); the rest of ``deepspeed.module_inject`` (kernel injection for inference) is refused with why."""
    import deepspeed.module_inject as module_inject
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    from deepshard.moe.autoep_layer import AutoEPMoELayer as ours

    assert AutoEPMoELayer is ours
    with pytest.raises(ImportError, match="kernel injection"):
        from deepspeed.module_inject import replace_transformer_layer  # noqa: F401
    with pytest.raises(ImportError, match="kernel injection"):
        import deepspeed.module_inject.auto_tp  # noqa: F401
    assert not hasattr(module_inject, "GroupQuantizer")
