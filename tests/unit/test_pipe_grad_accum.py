"""fp32 gradient accumulation of 16-bit pipeline stages (pipe/grad_accum.py), with no process group."""
from __future__ import annotations

import torch

from deepshard.pipe.grad_accum import Fp32GradSums
from deepshard.pipe.weight_grad import WeightGradStore

SMALL = 2.0 ** -9  # under half a bf16 ulp of 1.0 (2^-7): lost whole when added to 1.0 in bf16


def _backward(w: torch.nn.Parameter, scale: float) -> None:
    (w * torch.full_like(w, scale)).sum().backward()


def test_fp32_sums_keep_what_bf16_accumulation_loses() -> None:
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    summed = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    sums = Fp32GradSums([summed])
    for scale in [1.0] + [SMALL] * 8:
        _backward(plain, scale)
        _backward(summed, scale)
    assert summed.grad is not None and float(summed.grad.abs().max()) == 0.0  # moved into the sums each time
    sums.flush()
    assert plain.grad.tolist() == [1.0] * 4  # bf16 accumulation: the eight small gradients are gone
    assert summed.grad.dtype == torch.bfloat16 and summed.grad.tolist() == [1.0 + 8 * SMALL] * 4
    summed.grad.zero_()  # the optimizer step's zero_grad
    _backward(summed, 0.5)  # the sums start the next batch from zero
    sums.flush()
    assert summed.grad.tolist() == [0.5] * 4
    sums.remove()


def test_a_parameter_without_gradient_stays_none_and_grads_reaching_grad_directly_count() -> None:
    used, unused = (torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)) for _ in range(2))
    fp32 = torch.nn.Parameter(torch.ones(3))
    sums = Fp32GradSums([used, unused, fp32])
    assert sums.params == [used, unused]  # fp32 parameters need no sums
    _backward(used, 1.0)
    used.grad.add_(SMALL * 4)  # what reached .grad without the hook (e.g. before the sums existed)
    sums.flush()
    assert unused.grad is None and used.grad.tolist() == [1.0 + 4 * SMALL] * 3
    sums.remove()


def test_hooks_run_after_a_strategy_hook_that_binds_grad_to_a_buffer_view() -> None:
    """Stage 1 copies each gradient into its flat buffer and binds ``.grad`` to the view: the sums read
    it there and zero it in place, so the binding survives."""
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    flat = torch.zeros(4, dtype=torch.bfloat16)

    def bind(p: torch.Tensor) -> None:
        if p.grad.data_ptr() != flat.data_ptr():
            flat.copy_(p.grad)
            p.grad = flat

    w.register_post_accumulate_grad_hook(bind)
    sums = Fp32GradSums([w])
    for scale in [1.0] + [SMALL] * 4:
        _backward(w, scale)
        assert w.grad.data_ptr() == flat.data_ptr()
    sums.flush()
    assert w.grad.data_ptr() == flat.data_ptr() and flat.tolist() == [1.0 + 4 * SMALL] * 4
    sums.remove()


def test_the_zero_bubble_weight_pass_adds_into_the_sums() -> None:
    w = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.bfloat16))
    sums = Fp32GradSums([w])
    for scale in [1.0] + [SMALL] * 8:
        store = WeightGradStore(sums.add)
        x = torch.ones(1, 2, dtype=torch.bfloat16)
        store.pending.append((x, torch.full((1, 2), scale, dtype=torch.bfloat16), w, None))
        store.run()
    assert w.grad is None  # nothing went through .grad
    sums.flush()
    assert w.grad.tolist() == [[1.0 + 8 * SMALL] * 2] * 2
    sums.remove()
