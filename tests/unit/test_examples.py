"""The demo's pieces in plain PyTorch (no process group): the byte-level GPT, the stdlib corpus, and
the script's batch-size fitting."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from corpus import ByteWindowDataset, load_stdlib_corpus, stdlib_source_files, train_val_split  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402


def expected_param_count(cfg: GPTConfig) -> int:
    """Hand count: embeddings + per block (2 LayerNorms, qkv, proj, fc, proj) + final LayerNorm;
    the LM head is tied to the token embedding, so it adds nothing."""
    d = cfg.d_model
    block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return cfg.vocab_size * d + cfg.block_size * d + cfg.n_layer * block + 2 * d


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return load_stdlib_corpus(max_bytes=300_000)


def test_param_count_is_a_few_million_and_matches_hand_count() -> None:
    cfg = GPTConfig()
    model = GPT(cfg)
    n = model.num_parameters()
    assert n == expected_param_count(cfg) == 3_257_856
    assert 1_000_000 < n < 10_000_000
    assert model.head.weight is model.tok_emb.weight


def test_init_is_deterministic_given_the_seed() -> None:
    torch.manual_seed(7)
    a = GPT(GPTConfig(n_layer=1))
    torch.manual_seed(7)
    b = GPT(GPTConfig(n_layer=1))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_loss_at_init_is_about_ln_256(corpus: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = GPT()
    ds = ByteWindowDataset(corpus, 128)
    x, y = (torch.stack(t) for t in zip(*(ds[i] for i in range(0, 400, 50))))
    loss = model(x, y).item()
    assert abs(loss - math.log(256)) < 0.3, loss
    logits = model(x)
    assert logits.shape == (8, 128, 256)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).item()
    assert loss == pytest.approx(ref, rel=1e-6)


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4, block_size=16)).eval()
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_a_few_adamw_steps_reduce_the_loss_on_one_batch(corpus: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, d_model=128, n_head=4, block_size=64))
    ds = ByteWindowDataset(corpus, 64)
    x, y = (torch.stack(t) for t in zip(*(ds[i] for i in range(4))))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_corpus_is_deterministic_nonempty_and_starts_with_the_first_file(corpus: torch.Tensor) -> None:
    again = load_stdlib_corpus(max_bytes=300_000)
    assert corpus.dtype == torch.uint8 and corpus.dim() == 1
    assert corpus.numel() == 300_000
    assert torch.equal(corpus, again)
    files = stdlib_source_files()
    assert files == sorted(files)
    assert not any("site-packages" in f.parts for f in files)
    first = files[0].read_bytes()[:1000]
    assert bytes(corpus[:len(first)].tolist()) == first


def test_windows_are_shifted_by_one_at_fixed_offsets() -> None:
    data = torch.arange(100, dtype=torch.uint8)
    ds = ByteWindowDataset(data, block_size=8, stride=5)
    assert len(ds) == (100 - 8 - 1) // 5 + 1 == 19
    for i in (0, 7, len(ds) - 1):
        x, y = ds[i]
        assert x.dtype == torch.long and x.shape == y.shape == (8,)
        assert torch.equal(x, torch.arange(5 * i, 5 * i + 8))
        assert torch.equal(y, x + 1)
    assert int(ds[len(ds) - 1][1][-1]) <= 99  # the last window's target stays inside the data
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="block_size"):
        ByteWindowDataset(data[:8], block_size=8)


def test_train_val_split_keeps_every_byte_in_order() -> None:
    data = torch.arange(200, dtype=torch.uint8)
    train, val = train_val_split(data, val_fraction=0.1)
    assert train.numel() == 180 and val.numel() == 20
    assert torch.equal(torch.cat([train, val]), data)


def test_batch_config_is_refit_for_another_process_count() -> None:
    from train_gpt import fit_batch_to_world

    config = json.loads((EXAMPLES / "ds_config.json").read_text())
    assert config["train_batch_size"] == (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * 2)
    assert fit_batch_to_world(config, 2) is None
    one = fit_batch_to_world(config, 1)
    assert one is not None and "gradient_accumulation_steps" not in one
    assert one["train_batch_size"] == 32 and one["train_micro_batch_size_per_gpu"] == 8
    assert "gradient_accumulation_steps" in config  # the original is not modified
    with pytest.raises(ValueError, match="multiple"):
        fit_batch_to_world(config, 3)


# ------------------------------------------------------------------ the scripts, run as a user would

def _run_script(args: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                     "DEEPSHARD_PROGRESS")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    env.update({"DEEPSHARD_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **extra})
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, timeout=120)
    # decoded here, not with text=True, whose universal newlines would turn a progress bar's \r into \n
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def test_readme_example_is_the_quickstart_files() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    blocks = re.findall(r"```(\w+)\n(.*?)```", readme, re.S)
    python = [body for lang, body in blocks if lang == "python"]
    configs = [body for lang, body in blocks if lang == "json"]
    assert python[0] == (EXAMPLES / "quickstart.py").read_text()
    assert configs[0] == (EXAMPLES / "quickstart_config.json").read_text()


def test_quickstart_trains_and_checkpoints_on_one_process(tmp_path: Path) -> None:
    done = _run_script([str(EXAMPLES / "quickstart.py"), "--deepspeed", "--deepspeed_config",
                        str(EXAMPLES / "quickstart_config.json")], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(m) for m in re.findall(r"loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0] / 4, done.stdout
    # 100 micro-steps / 2 accumulation steps = 50 optimizer steps
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "global_step50"
    assert (tmp_path / "checkpoints" / "global_step50" / "manifest.json").is_file()


def test_train_gpt_runs_a_few_steps_and_prints_the_summary(tmp_path: Path) -> None:
    """Output captured (not a terminal): no progress bar redraws, a plain line with the rate per interval."""
    done = _run_script([str(EXAMPLES / "train_gpt.py"), "--deepspeed_config", str(EXAMPLES / "ds_config.json"),
                        "--steps", "4", "--max_bytes", "200000", "--val_batches", "2", "--log_every", "2"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "\r" not in out + done.stderr and "train:" not in done.stderr, done.stderr
    # durations past a minute print as 1m04s (a loaded machine takes that long)
    duration = r"(?:\d+m)?\d+s"
    progress = re.findall(rf"^step +(\d)/4  loss [0-9.]+  lr \S+  [0-9.]+ step/s  elapsed {duration}  left {duration}$",
                          out, re.M)
    assert progress == ["1", "2", "4"], out
    assert "=== summary ===" in out and "1 process(es), global batch 32 x 128 tokens" in out, out
    first, last = (float(v) for v in re.search(r"train loss\s+([0-9.]+) -> ([0-9.]+)", out).groups())
    assert abs(first - math.log(256)) < 0.5 and last < first, out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["rank"])
    labels = lines[header].replace("peak RSS", "peak_rss").split()
    mib = dict(zip(labels, (float(v) for v in lines[header + 1].split())))
    n = 3_257_856
    assert mib["rank"] == 0
    # bf16 + AdamW on one process: 2 + 2 + 4 + 8 bytes per parameter (the ZeRO paper's 16 psi); on a CPU
    # that only emulates bf16 the demo trains in fp32 (and says so): 4 + 4 + 0 + 8
    bf16 = "the demo trains in fp32" not in out
    assert ("torch.bfloat16 on cpu" in done.stderr) == bf16, done.stderr
    assert mib["params"] == pytest.approx((2 if bf16 else 4) * n / 2**20, abs=0.1)
    assert mib["grads"] == pytest.approx((2 if bf16 else 4) * n / 2**20, abs=0.1)
    assert mib["master"] == pytest.approx((4 if bf16 else 0) * n / 2**20, abs=0.1)
    assert mib["optim"] == pytest.approx(8 * n / 2**20, abs=0.1)
    parts = [v for k, v in mib.items() if k not in ("rank", "total", "peak_rss")]
    assert mib["total"] == pytest.approx(sum(parts), abs=0.1 * len(parts))
    assert mib["peak_rss"] > mib["total"]


def test_train_gpt_draws_its_bar_where_progress_bars_are_on(tmp_path: Path) -> None:
    """DEEPSHARD_PROGRESS=1 (what the launcher sets for its ranks when it runs on a terminal): tqdm's bar."""
    done = _run_script([str(EXAMPLES / "train_gpt.py"), "--deepspeed_config", str(EXAMPLES / "ds_config.json"),
                        "--steps", "2", "--max_bytes", "200000", "--val_batches", "2"], tmp_path,
                       DEEPSHARD_PROGRESS="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "\r" in done.stderr and "train: 100%" in done.stderr and "2/2" in done.stderr, done.stderr
    assert re.search(r"^step +2/2  loss [0-9.]+  lr \S+$", done.stdout, re.M), done.stdout  # the bar has the rate
