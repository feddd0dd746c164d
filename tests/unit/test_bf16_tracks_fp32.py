"""bf16 training tracks fp32 on a small CNN (ZeRO-2, a world of one): same start, same data, the loss falls
as fast. Kept tiny (8x8 images, 40 steps): bf16 arithmetic is emulated, and slow, on CPUs without
avx512_bf16. The fp32 masters start from the exact fp32 weights, not the bf16-rounded ones.

Also the inputs' dtypes, by DeepSpeed 0.19.8's rule (``runtime/engine.py``: ``_forward_prologue``): the engine
casts floating-point positional inputs to fp16 only with ``fp16.auto_cast``, never keyword inputs, never under
bf16; a model refusing fp32 inputs gets an error naming the dtypes and the fix."""
from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import deepshard
from deepshard.precision import PrecisionPolicy
from deepshard.precision.inputs import InputDtypeMismatch


class _Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc1, self.fc2 = nn.Linear(8 * 3 * 3, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def _train(bf16: bool, steps: int = 40) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _Cnn()
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    centers = torch.randn(4, 3, 8, 8, generator=g)
    cfg = {"train_batch_size": 16, "gradient_clipping": 1.0, "bf16": {"enabled": bf16},
           "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "betas": [0.8, 0.999], "eps": 1e-8}},
           "zero_optimization": {"stage": 2}}
    engine = deepshard.initialize(model=model, config=cfg)[0]
    masters = {n: deepshard.utils.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    losses = []
    try:
        for _ in range(steps):
            y = torch.randint(0, 4, (16,), generator=g)
            x = centers[y] + torch.randn(16, 3, 8, 8, generator=g)
            loss = F.cross_entropy(engine(x.to(torch.bfloat16) if bf16 else x).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    finally:
        engine.destroy()
    return losses, init, masters


def test_bf16_loss_falls_with_fp32s() -> None:
    import torch.distributed as dist

    created = not dist.is_initialized()
    try:
        fp32, _, _ = _train(bf16=False)
        bf16, init, masters = _train(bf16=True)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
    for name, value in init.items():
        assert torch.equal(masters[name], value), f"{name}: the bf16 run's masters are not the fp32 weights"
    first, last = sum(bf16[:10]) / 10, sum(bf16[-10:]) / 10
    assert last < 0.5 * first, bf16  # it learns
    assert abs(last - sum(fp32[-10:]) / 10) < 0.03, (bf16[-10:], fp32[-10:])  # measured: 0.0982 vs 0.0979


Pair = namedtuple("Pair", "a b")


def _dtypes(value: Any) -> Any:
    """The same nesting with every tensor replaced by its dtype (containers' types kept)."""
    if torch.is_tensor(value):
        return value.dtype
    if isinstance(value, Pair):
        return Pair(*(_dtypes(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_dtypes(v) for v in value)
    if isinstance(value, dict):
        return {k: _dtypes(v) for k, v in value.items()}
    return value


def _nested() -> tuple[Any, ...]:
    f, i = torch.ones(2), torch.ones(2, dtype=torch.long)
    return (f, [f, {"x": f, "ids": i}], Pair(f, i), 3.0)


def test_policy_casts_positional_inputs_only_with_fp16_auto_cast() -> None:
    h, f32, i64 = torch.float16, torch.float32, torch.long
    cast = PrecisionPolicy(param_dtype=h, auto_cast=True).cast_inputs(_nested())
    assert _dtypes(cast) == (h, [h, {"x": h, "ids": i64}], Pair(h, i64), 3.0)
    assert type(cast[2]) is Pair
    for policy in (PrecisionPolicy(param_dtype=h), PrecisionPolicy(param_dtype=torch.bfloat16), PrecisionPolicy()):
        kept = policy.cast_inputs(_nested())
        assert _dtypes(kept) == (f32, [f32, {"x": f32, "ids": i64}], Pair(f32, i64), 3.0)


def test_dtype_mismatch_error_names_the_dtypes_and_the_fix() -> None:
    x, w = torch.ones(3, 4), torch.ones(2, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError) as torch_error:
        F.linear(x, w)  # torch's own message, the reference
    with pytest.raises(InputDtypeMismatch) as err:
        with PrecisionPolicy(param_dtype=torch.bfloat16).forward_errors(((x,), {})):
            F.linear(x, w)
    text = str(err.value)
    assert text.startswith(str(torch_error.value)) and type(err.value.__cause__) is RuntimeError
    assert "computes in torch.bfloat16" in text and "tensors of torch.float32" in text
    assert "x.to(torch.bfloat16)" in text and '"auto_cast": true' not in text  # bf16 has no auto_cast
    with pytest.raises(InputDtypeMismatch, match=r'x.to\(torch.float16\), or set "fp16": \{"auto_cast": true\}'):
        with PrecisionPolicy(param_dtype=torch.float16).forward_errors(((), {"x": [x]})):
            F.linear(x, w.half())
    # inputs already in the model's dtype, or another kind of error: torch's error unchanged
    for inputs, call in ((((x.bfloat16(),), {}), lambda: F.linear(x, w)), (((x,), {}), lambda: F.linear(x, torch.ones(2, 5)))):
        with pytest.raises(RuntimeError) as other:
            with PrecisionPolicy(param_dtype=torch.bfloat16).forward_errors(inputs):
                call()
        assert type(other.value) is RuntimeError


class _Recorder(nn.Module):
    """Records the dtypes its forward receives; a Linear that needs its inputs in the training dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)
        self.seen: Any = None

    def forward(self, x: torch.Tensor, nested: Any = None, kw: torch.Tensor | None = None,
                linear: bool = False) -> torch.Tensor:
        self.seen = _dtypes((x, nested, kw))
        return self.fc(x).float().sum() if linear else (x.float() * self.fc.weight.float().sum()).sum()


@pytest.mark.parametrize("section, dtype, auto_cast", [
    ({"bf16": {"enabled": True}}, torch.bfloat16, False),
    ({"fp16": {"enabled": True}}, torch.float16, False),
    ({"fp16": {"enabled": True, "auto_cast": True}}, torch.float16, True),
    ({"bf16": {"enabled": True}, "fp16": {"auto_cast": True}}, torch.bfloat16, False),  # fp16-only, warned
])
def test_engine_forward_follows_deepspeeds_input_rule(section: dict[str, Any], dtype: torch.dtype,
                                                      auto_cast: bool) -> None:
    import torch.distributed as dist

    created = not dist.is_initialized()
    model = _Recorder()
    engine = deepshard.initialize(model=model, config={"train_batch_size": 1, **section,
                                                       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]
    try:
        f = torch.ones(1, 2)
        engine(f, [f, {"ids": torch.ones(1, dtype=torch.long)}], kw=f)
        pos = torch.float16 if auto_cast else torch.float32
        assert model.seen == (pos, [pos, {"ids": torch.long}], torch.float32)  # keyword inputs never cast
        if auto_cast:
            engine(f, linear=True)  # cast to fp16: the fp16 Linear takes it
        else:
            with pytest.raises(InputDtypeMismatch, match=f"computes in {dtype}"):
                engine(f, linear=True)
            engine(f.to(dtype), linear=True)  # the user's cast, as with DeepSpeed
    finally:
        engine.destroy()
        if created and dist.is_initialized():
            dist.destroy_process_group()
