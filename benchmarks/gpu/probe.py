"""The device, named, and its measured bf16 matrix-product rate: the first thing benchmarks/gpu_check.sh
records (``python -m benchmarks.gpu.probe --out device.json``). Exits 3 where torch sees no CUDA device."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.common import cuda_available, device_info, measure_matmul_flops  # noqa: E402

NO_CUDA = 3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--matmul-size", type=int, default=8192)
    args = p.parse_args(argv)
    if not cuda_available():
        info = {"status": "skipped", "detail": "torch sees no CUDA device", **device_info("cpu")}
        code = NO_CUDA
    else:
        info = {"status": "ok", **device_info("cuda")}
        info["measured_matmul_flops"] = measure_matmul_flops("cuda", args.matmul_size)
        code = 0
    print(json.dumps(info, indent=1, default=str), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(info, indent=1, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())
