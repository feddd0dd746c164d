"""1-bit compression with error feedback, with no process group: sign packing, the scale, the error
carried from call to call, and OneBitAdam's warm-up against torch's AdamW on one process."""
from __future__ import annotations

import pytest
import torch

from deepshard.compression import ExchangeLayout, OneBitAdam, compress, decompress, pack_signs, unpack_signs
from deepshard.optim import build_optimizer


def test_pack_unpack_signs_round_trip() -> None:
    x = torch.tensor([[0.5, -1.0, 0.0, -0.0, 3.0, -2.0, 1e-9, -1e-9, 7.0, -7.0, 1.0, 1.0, -1.0, -1.0, 2.0, -2.0]])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 2)
    expected = torch.where(x >= 0, 1.0, -1.0)  # zero (either sign) counts as +
    assert torch.equal(unpack_signs(packed), expected)
    assert packed[0].tolist() == [0b01011101, 0b01001101]  # bit j of byte k: element 8k + j
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.ones(1, 12))


def test_layout_pads_each_tensor_and_round_trips() -> None:
    tensors = [torch.randn(3, 5), torch.randn(7), torch.randn(40)]
    layout = ExchangeLayout([t.numel() for t in tensors], world=2)
    assert layout.widths == [8, 8, 24]  # ceil(n / 16) * 8 columns: every row a whole number of bytes
    matrix = layout.to_matrix(tensors)
    assert matrix.shape == (2, 40)
    assert layout.counts(torch.device("cpu")).tolist() == [[8.0, 7.0, 24.0], [7.0, 0.0, 16.0]]
    assert float((matrix * (1 - layout.mask)).abs().sum()) == 0.0  # padding is zero
    out = [torch.empty_like(t) for t in tensors]
    layout.from_matrix(matrix, out)
    assert all(torch.equal(a, b) for a, b in zip(tensors, out))


def test_compress_keeps_the_norm_and_the_error_is_the_rest() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(30) * 5.0, torch.randn(9) * 0.01]  # magnitudes far apart: scales per tensor
    layout = ExchangeLayout([30, 9], world=2)
    x, mask = layout.to_matrix(tensors), layout.mask
    counts = layout.counts(x.device)
    message, error = compress(x, layout, mask, counts)
    approx = decompress(message, layout) * mask
    assert torch.allclose(approx + error, x, atol=1e-6)  # nothing lost: sent + kept = input
    assert float((error * (1 - mask)).abs().sum()) == 0.0  # no error on padding
    for seg in range(2):  # every (row, tensor) cell keeps its L2 norm, so the small tensor keeps its scale
        cols = layout.segment_ids == seg
        for row in range(2):
            want, got = x[row, cols].norm(), approx[row, cols].norm()
            assert torch.allclose(got, want, rtol=1e-5), (seg, row)
    assert torch.equal(torch.sign(approx[mask > 0]), torch.where(x[mask > 0] >= 0, 1.0, -1.0))
    assert message.to_bytes().shape == (2, layout.columns // 8 + 4 * 2)  # signs + one fp32 scale per tensor, per row


def test_error_feedback_carries_the_residual() -> None:
    """Feeding ``x_t + e_{t-1}`` each time, the sum of what was sent equals the sum of the inputs minus the
    last error (nothing is lost, only delayed), and the error stays bounded (the same largest size over
    steps 1-100 as over steps 900-1000), so the average sent converges to the average input; without
    feedback the bias of the sign compressor grows with every step."""
    torch.manual_seed(1)
    layout = ExchangeLayout([64], world=1)
    mask, counts = layout.mask, layout.counts(torch.device("cpu"))
    error = torch.zeros(1, layout.columns)
    sent_total, input_total, sizes = torch.zeros(1, 64), torch.zeros(1, 64), []
    drift = torch.randn(1, 64)  # a consistent direction plus noise, like a momentum
    steps = 1000
    for _ in range(steps):
        x = drift + 0.3 * torch.randn(1, 64)
        message, error = compress(x + error, layout, mask, counts)
        sent_total += decompress(message, layout)
        input_total += x
        sizes.append(float(error.norm()))
    assert torch.allclose(sent_total + error, input_total, atol=1e-2)
    assert max(sizes[900:]) < 1.2 * max(sizes[:100])  # bounded, not growing
    assert float((sent_total - input_total).norm()) / steps < 0.01 * float(drift.norm())
    once = decompress(compress(drift, layout, mask, counts)[0], layout)
    assert float((once - drift).norm()) > 0.5 * float(drift.norm())  # one compression alone is far off


def test_onebit_adam_warm_up_is_adamw_and_then_freezes_the_variance() -> None:
    torch.manual_seed(2)
    a = torch.nn.Linear(6, 3)
    b = torch.nn.Linear(6, 3)
    b.load_state_dict(a.state_dict())
    ours = build_optimizer("OneBitAdam", {"lr": 0.01, "freeze_step": 3, "weight_decay": 0.1,
                                          "comm_backend_name": "gloo", "cuda_aware": False}, a.parameters())
    assert isinstance(ours, OneBitAdam)
    ref = torch.optim.AdamW(b.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(5):
        x = torch.randn(4, 6)
        for model, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
        same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        assert same == (step < 3), step  # bit-identical during warm-up, different once v is frozen
        assert ours.reduces_gradients == (step >= 2)
    v_ours = ours.state[a.weight]["exp_avg_sq"]
    assert not torch.equal(v_ours, ref.state[b.weight]["exp_avg_sq"])  # ours stopped at step 3


def test_onebit_adam_config_errors_name_the_key() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="freeze_step"):
        build_optimizer("OneBitAdam", {"freeze_step": 0}, params)
    with pytest.raises(ValueError, match="amsgrad"):
        build_optimizer("OneBitAdam", {"amsgrad": True}, params)
    # (its ZeRO-stage and model-parallel rules: the plan check, tests/unit/test_plan.py)
    with pytest.raises(ValueError, match="'OneBitAdam'"):
        build_optimizer("ZeroOneAdam", {}, params)
