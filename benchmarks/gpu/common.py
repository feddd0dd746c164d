"""What the GPU benchmarks share: the device's name and peak rate, the GPT shapes and their FLOPs, and
running one case in a fresh interpreter under a time limit.

Each case runs in its own process (``python -m benchmarks.gpu.<script> --case ...``) so that no case
inherits another's CUDA allocations, and a hang or a crash costs that case alone: the driver kills it
at its deadline and records ``timeout`` or the tail of its log.

On a machine without CUDA the scripts still start: ``--device cpu`` runs the same code on the CPU with
a tiny model (to check the script, not to measure anything), and without it every case reports
``skipped: no CUDA device``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30

# Dense bf16 tensor-core rates from NVIDIA's datasheets (without sparsity), by a name fragment that
# torch.cuda.get_device_name() reports; the first match wins, so the specific names come first.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989.4e12), ("H200", 989.4e12), ("H800", 989.4e12),
    ("GH200", 989.4e12), ("A100", 312e12), ("L40S", 362e12), ("B200", 2250e12),
]


def datasheet_peak(name: str) -> float | None:
    """The datasheet's dense bf16 FLOP/s for a device name, or None when the name is not in the table."""
    for fragment, flops in PEAK_BF16_FLOPS:
        if fragment in name:
            return flops
    return None


def device_info(device: str) -> dict[str, Any]:
    """Name, memory, torch and driver versions of the device this process would use."""
    import torch

    info: dict[str, Any] = {"device": device, "torch": torch.__version__, "cpu_count": os.cpu_count()}
    try:
        import psutil

        info["host_memory_gib"] = round(psutil.virtual_memory().total / GiB, 1)
    except ImportError:
        pass
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=torch.cuda.get_device_name(0), memory_gib=round(props.total_memory / GiB, 1),
                    multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                    cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
        info["peak_bf16_flops_datasheet"] = datasheet_peak(info["name"])
    else:
        info.update(name="cpu (script check only: no figure from this run means anything)")
    return info


def measure_matmul_flops(device: str, n: int = 8192, reps: int = 10) -> float:
    """bf16 FLOP/s of an n x n x n matrix product on random data: the median of ``reps`` timed products
    after three warm-ups (CUDA events)."""
    import statistics

    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


# ------------------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class GPTShape:
    """A GPT-style decoder (benchmarks.workloads.TinyGPT: learned positions, pre-norm blocks with 4x MLP,
    untied head)."""

    layers: int
    dim: int
    heads: int
    vocab: int
    seq_len: int

    def params(self) -> int:
        per_block = 12 * self.dim * self.dim + 13 * self.dim  # qkv, proj, fc1, fc2 + biases, two norms
        return 2 * self.vocab * self.dim + self.seq_len * self.dim + self.layers * per_block + 2 * self.dim

    def matmul_params(self) -> int:
        """Parameters that take part in matrix products (all but the two embeddings)."""
        return self.params() - self.vocab * self.dim - self.seq_len * self.dim

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x matmul parameters + 12 x layers x dim x sequence for attention
        (the PaLM paper's appendix B count; the causal mask's skipped half is counted, as is usual)."""
        return 6.0 * self.matmul_params() + 12.0 * self.layers * self.dim * self.seq_len

    def build(self, seed: int = 0) -> Any:
        import torch

        from benchmarks.workloads import TinyGPT

        torch.manual_seed(seed)
        return TinyGPT(self.vocab, self.dim, self.layers, self.heads, self.seq_len)

    def describe(self) -> str:
        return (f"{self.params() / 1e9:.2f}B parameters ({self.layers} layers x width {self.dim}, {self.heads} "
                f"heads, vocabulary {self.vocab}, {self.seq_len} tokens)")


def gpt_batches(shape: GPTShape, batch: int, steps: int, device: str, seed: int = 0) -> list[tuple[Any, Any]]:
    """Next-token batches of arithmetic sequences (the CPU benchmark's data), built ahead, on ``device``."""
    import torch

    out = []
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, shape.vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 8, (batch, 1), generator=gen)
        seqs = (start + stride * torch.arange(shape.seq_len + 1)) % shape.vocab
        out.append((seqs[:, :-1].contiguous().to(device), seqs[:, 1:].contiguous().to(device)))
    return out


def init_single_process_group(device: str) -> None:
    """A world of one process on the backend deepshard picks itself: NCCL on a GPU, gloo on the CPU."""
    import torch
    import torch.distributed as dist

    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "DEEPSHARD_ACCELERATOR": device})
    if device == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def peak_device_memory(device: str) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


# ------------------------------------------------------------------------------------ running cases
def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def run_case(module: str, case: dict[str, Any], timeout: float, log_dir: Path) -> dict[str, Any]:
    """Run ``python -m module --case <json>`` in a fresh interpreter; its result is the JSON it writes.
    A case that outlives ``timeout`` seconds is killed (``status: timeout``); one that dies without a
    result gets ``status: error`` and the last lines of its log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    name = case["name"]
    result_path, log_path = log_dir / f"{name}.json", log_dir / f"{name}.log"
    result_path.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "src")] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [sys.executable, "-m", module, "--case", json.dumps({**case, "result": str(result_path)})]
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                start_new_session=True)
        try:
            proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        except BaseException:  # the driver itself was stopped (a phase's time limit): take the case along
            os.killpg(proc.pid, 9)
            proc.wait()
            raise
    wall = time.monotonic() - t0
    if result_path.exists():
        result = json.loads(result_path.read_text())
    elif proc.returncode in (-9, None) and wall >= timeout:
        result = {"status": "timeout", "detail": f"killed after {timeout:.0f}s"}
    else:
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        result = {"status": "error", "detail": f"exit code {proc.returncode}", "log_tail": tail}
    result.update(name=name, wall_s=round(wall, 1))
    print(f"  {name}: {result.get('status')} ({wall:.0f}s){'' if result.get('status') == 'ok' else ' ' + str(result.get('detail', ''))[:300]}",
          flush=True)
    return result


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt here (SIGINT also where it was inherited ignored), so a
    phase stopped at its time limit unwinds: running cases are killed, finished results stay written."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def write_result(path: str, result: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(result, indent=1, default=str))


def case_main(run: Any, argv: list[str]) -> int:
    """The ``--case`` entry point of a benchmark module: run ``run(case)`` and write its result; an
    exception becomes ``status: error`` (``oom`` for CUDA out-of-memory) with its message."""
    import traceback

    case = json.loads(argv[argv.index("--case") + 1])
    try:
        result = run(case)
    except Exception as exc:  # noqa: BLE001 - every failure is a reported result
        oom = "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"
        result = {"status": "oom" if oom else "error", "detail": f"{type(exc).__name__}: {str(exc)[:500]}",
                  "traceback": traceback.format_exc()[-3000:]}
    write_result(case["result"], result)
    return 0


def as_dict(shape: GPTShape) -> dict[str, Any]:
    return {**asdict(shape), "params": shape.params(), "flops_per_token": shape.flops_per_token()}
