"""Gather what benchmarks/gpu_check.sh's phases left in its work folder into one JSON and one markdown
file: the device, each phase's exit status and time, the CUDA test results, the GPT table and the
ZeRO-Infinity figures, and what did not run.

    python -m benchmarks.gpu.report --work /tmp/gpu_check --out "$OUT"
"""
from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.gpt_bench import table as gpt_table  # noqa: E402
from benchmarks.gpu.infinity_bench import summary_text  # noqa: E402
from benchmarks.gpu.sp_gpu import table as sp_table  # noqa: E402

TEST_SETS = {"tests_world1": "world size 1 on NCCL (tests/multiproc/test_device_world1.py)",
             "tests_gloo": "2 and 4 processes on gloo with CUDA tensors (the multi-process suite's selection)"}


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def junit_summary(path: Path) -> dict[str, Any] | None:
    """Counts and the failing tests (name and first line of the message) of a pytest --junitxml file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["time_s"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    failed = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                message = (node.get("message") or node.text or "").strip().splitlines()
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": tag,
                               "message": (message[0] if message else "")[:300]})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def read_phases(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds = (line.split("\t") + ["", "", ""])[:3]
            rows.append({"phase": name, "exit": int(rc) if rc.lstrip("-").isdigit() else rc,
                         "seconds": int(seconds) if seconds.isdigit() else seconds,
                         "timed_out": rc in ("124", "130", "137")})
    return rows


def gather(work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"device": read_json(work / "device.json"), "phases": read_phases(work / "phases.tsv")}
    out["tests"] = {name: junit_summary(work / f"{name}.xml") for name in TEST_SETS}
    out["gpt"] = read_json(work / "gpt.json")
    out["infinity"] = read_json(work / "infinity.json")
    out["nccl_wait"] = read_json(work / "nccl_wait.json")
    out["sp"] = read_json(work / "sp.json")
    return out


def markdown(res: dict[str, Any]) -> str:
    dev = res.get("device") or {}
    lines = ["# deepshard on a GPU: benchmarks/gpu_check.sh", ""]
    if dev.get("status") == "ok":
        peak = dev.get("peak_bf16_flops_datasheet")
        lines += [f"Device: **{dev.get('name')}**, {dev.get('memory_gib')} GiB, {dev.get('multiprocessors')} SMs, "
                  f"CUDA {dev.get('cuda')}, NCCL {dev.get('nccl')}, torch {dev.get('torch')}, "
                  f"{dev.get('cpu_count')} CPU cores, {dev.get('host_memory_gib')} GiB host memory.",
                  f"Peak dense bf16: {peak / 1e12:.1f} TFLOP/s (datasheet); " if peak else "Peak: not in the table; ",
                  f"measured {dev.get('measured_matmul_flops', 0) / 1e12:.0f} TFLOP/s (8192^3 bf16 matmul, random data)."]
    else:
        lines.append(f"Device: none ({(dev or {}).get('detail', 'the probe did not run')}): nothing was measured.")
    wait = res.get("nccl_wait")
    if wait and "plain_ms" in wait:
        lines += ["", f"Waiting on an NCCL all-reduce behind {wait['queue_ms']:.0f} ms of queued GPU work holds the "
                      f"host: plain wait {wait['plain_ms']:.2f} ms, timed wait {wait['timed_ms']:.1f} ms, "
                      f"deepshard's watchdog {wait['watchdog_ms']:.2f} ms."]
    lines += ["", "## Phases", "", "| phase | exit | seconds |", "| --- | --- | --- |"]
    for p in res["phases"]:
        lines.append(f"| {p['phase']} | {p['exit']}{' (time limit)' if p['timed_out'] else ''} | {p['seconds']} |")
    lines += ["", "## CUDA tests", ""]
    for name, what in TEST_SETS.items():
        t = res["tests"].get(name)
        if t is None:
            lines.append(f"- {what}: not run (or stopped before pytest wrote its report)")
            continue
        lines.append(f"- {what}: {t['passed']} passed, {t['failures']} failed, {t['errors']} errors, "
                     f"{t['skipped']} skipped in {t['time_s']}s")
        lines += [f"  - {f['test']}: {f['message']}" for f in t["failed"][:40]]
    gpt = res.get("gpt")
    lines += ["", "## GPT-style model, bf16, world size 1", ""]
    if gpt and gpt.get("rows"):
        shape = gpt["shape"]
        lines.append(f"{shape['params'] / 1e9:.2f}B parameters ({shape['layers']} layers x {shape['dim']}, "
                     f"{shape['seq_len']} tokens), micro-batch {gpt['micro_batch']}, {gpt['steps']} timed steps "
                     f"after {gpt['warmup']}; MFU = {shape['flops_per_token'] / 1e9:.2f} GFLOP/token x tokens/s / peak.")
        lines += ["", gpt_table(gpt)]
    else:
        lines.append(f"not run: {(gpt or {}).get('detail', 'no result')}")
    sp = res.get("sp")
    lines += ["", "## Sequence parallelism at world size 1 (Ulysses, ring) against torch's SDPA", ""]
    if sp and sp.get("results"):
        m = sp["model"]
        lines += [f"{m['layers']} layers x width {m['dim']}, {m['heads']} heads over {m['kv_heads']} key/value heads, "
                  f"vocabulary {m['vocab']}, causal.", "", sp_table(sp["results"])]
    else:
        lines.append(f"not run: {(sp or {}).get('skipped', 'no result')}")
    inf = res.get("infinity")
    lines += ["", "## ZeRO-Infinity on one GPU", ""]
    if inf and inf.get("status") in ("ok", "partial"):
        lines.append(f"GPU memory cap {inf.get('gpu_cap_gib')} GiB, micro-batch {inf.get('batch')} x 1024 tokens.")
        lines += ["", "```", summary_text(inf), "```"]
    else:
        lines.append(f"not run: {(inf or {}).get('detail', 'no result')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    res = gather(Path(args.work))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_results.json").write_text(json.dumps(res, indent=1, default=str))
    text = markdown(res)
    (out / "gpu_results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
