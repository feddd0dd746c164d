#!/usr/bin/env bash
# deepshard on one lent GPU (H100 or H200): set up offline, run the CUDA tests, the GPT bf16 benchmark and
# the single-GPU ZeRO-Infinity headline, and write every figure, with the device named, under $OUT.
#
# Before the GPU session, on a machine with network (once):   benchmarks/gpu/fetch_wheels.sh
# On the GPU machine (the device tool: carry .whl, timeout_s 560):
#     bash benchmarks/gpu_check.sh
#     PHASES="gpt infinity" bash benchmarks/gpu_check.sh     # a rerun of some phases only
#
# Phases, most valuable first, each under its own `timeout` so one hang costs that phase alone (seconds,
# overridable as LIMIT_<PHASE>=N); together they stay under 10 minutes (560 s; the device tool allows 600 a command):
#   probe        20  the device's name, memory, versions and measured bf16 matmul rate; whether a wait on NCCL
#                    holds the host (benchmarks/gpu/nccl_wait.py)
#   world1       80  tests/multiproc/test_device_world1.py --device cuda: ZeRO 0-3, fp32/bf16/fp16,
#                    checkpoints, offload to pinned host memory and to files, a pipeline, on NCCL
#   gpt         120  GPT-style bf16 model at the largest size that fits: deepshard ZeRO 0 and 3 vs torch
#                    and FSDP2 (and DeepSpeed when its wheel was carried): tokens/s and MFU
#   sp          100  sequence parallelism at world size 1 on NCCL: deepshard's Ulysses and ring attention against
#                    torch's SDPA kernels (numerics against float32/float64, step time at 8k and 32k tokens),
#                    the longest sequence with and without activation checkpointing and tiled MLP / loss
#   infinity    195  CPU Adam throughput; largest model without offload under a GPU memory cap; offload to
#                    host memory at 3x (then on disk), 6x, 10x of it: tokens/s, GPU time waiting
#   gloo         45  the multi-process suite's selection on 2 and 4 processes over gloo with CUDA tensors
# Output ($OUT, at most 8 files): gpu_results.md, gpu_results.json, gpu_check.log (every phase's output),
# tests_world1.xml, tests_gloo.xml, case_logs.tar.gz (each benchmark case's own log).
# Exit status: 0 when every phase ran (tests may have failed: read the results), 2 with no CUDA device.
# CHECK_ON_CPU=1 runs the phases on a machine without one, tiny models on the CPU: a check of this script.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-out}
WORK=${WORK:-/tmp/gpu_check}
PY=${PY:-python3}
PHASES=${PHASES:-probe world1 gpt sp infinity gloo}
mkdir -p "$OUT" "$WORK"
LOG=$OUT/gpu_check.log
: >"$WORK/phases.tsv"
START=$(date +%s)

say() { echo "[gpu_check +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

# run_phase NAME DEFAULT_LIMIT COMMAND...: SIGTERM at the limit (pytest through benchmarks.gpu.run_pytest and
# the drivers unwind and write what they have), SIGKILL 15 s later; output appended to the log; exit status
# and seconds to phases.tsv
run_phase() {
  local name=$1 default=$2 var limit t0 rc
  shift 2
  case " $PHASES " in *" $name "*) ;; *) return 0 ;; esac
  var=LIMIT_$(echo "$name" | tr '[:lower:]' '[:upper:]')
  limit=${!var:-$default}
  say "phase $name: up to ${limit}s: $*"
  t0=$(date +%s)
  timeout -s TERM -k 15 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$WORK/phases.tsv"
  say "phase $name: exit $rc after $(($(date +%s) - t0))s"
}

report() {
  "$PY" -m benchmarks.gpu.report --work "$WORK" --out "$OUT" >>"$LOG" 2>&1 || say "report failed (see the log)"
  tar -czf "$OUT/case_logs.tar.gz" -C /tmp deepshard-gpu-bench 2>/dev/null || true
  [ -f "$OUT/gpu_results.md" ] && cat "$OUT/gpu_results.md"
}

# ---------------------------------------------------------------------------------------------- setup
say "machine: $(uname -m), $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, python $($PY -V 2>&1)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1
# wheels carried in .whl (benchmarks/gpu/fetch_wheels.sh): pydantic and its parts; DeepSpeed apart, so that
# `import deepspeed` exists only where the DeepSpeed rows ask for it
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    >>"$LOG" 2>&1 || say "installing .whl failed (see the log; expected off the GPU machine: the wheels are for its python 3.12)"
fi
if compgen -G ".whl/deepspeed/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/ds-site" \
    .whl/deepspeed/*.whl >>"$LOG" 2>&1 && export DEEPSPEED_SITE="$WORK/ds-site"
fi
export PYTHONPATH="$ROOT/src:$ROOT:$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
if ! "$PY" -c "import deepshard" >>"$LOG" 2>&1; then
  say "deepshard does not import (pydantic missing? run benchmarks/gpu/fetch_wheels.sh here and carry .whl)"
  printf 'setup\t1\t0\n' >>"$WORK/phases.tsv"
  report
  exit 1
fi

# ---------------------------------------------------------------------------------------------- probe
"$PY" -m benchmarks.gpu.probe --out "$WORK/device.json" >>"$LOG" 2>&1
probe_rc=$?
printf 'probe\t%s\t%s\n' "$probe_rc" "$(($(date +%s) - START))" >>"$WORK/phases.tsv"
[ "$probe_rc" = 0 ] && timeout 60 "$PY" -m benchmarks.gpu.nccl_wait --out "$WORK/nccl_wait.json" >>"$LOG" 2>&1
DEVICE=cuda
SIZE=()
if [ "$probe_rc" = 3 ]; then
  if [ "${CHECK_ON_CPU:-0}" != 1 ]; then
    say "no CUDA device here: nothing to run (this script is for the lent GPU machine)"
    report
    exit 2
  fi
  # CHECK_ON_CPU=1: the same phases on the CPU with tiny models, to check this script; no figure means anything
  say "CHECK_ON_CPU=1: running the phases on the CPU with tiny models (a check of the script, not a measurement)"
  DEVICE=cpu
  SIZE=(--device cpu --size tiny)
fi

# ------------------------------------------------------------------------------------------ the phases
pytest_opts=(-q -p no:cacheprovider -rfE --device "$DEVICE")
"$PY" -c "import pytest_timeout" 2>/dev/null && pytest_opts+=(--timeout 150)
xdist=()
"$PY" -c "import xdist" 2>/dev/null && xdist=(-n 4 --dist loadfile)

run_phase world1 80 "$PY" -m benchmarks.gpu.run_pytest "${pytest_opts[@]}" --junitxml "$WORK/tests_world1.xml" \
  tests/multiproc/test_device_world1.py
# GPT_ENGINES: the engines to run (default all six); GPT_ARGS: more options (e.g. "--profile 3": where each
# engine's step time goes, device busy against idle, copies, host synchronizations)
gpt_limit=${LIMIT_GPT:-120}
# shellcheck disable=SC2086
run_phase gpt 120 "$PY" -m benchmarks.gpu.gpt_bench "${SIZE[@]}" --device-json "$WORK/device.json" \
  --budget $((gpt_limit - 10)) --case-timeout 45 \
  --engines ${GPT_ENGINES:-torch deepshard-z0 deepshard-z3 fsdp2 deepspeed-z0 deepspeed-z3} ${GPT_ARGS:-} \
  --out "$WORK/gpt.json"
sp_limit=${LIMIT_SP:-100}
run_phase sp 100 "$PY" -m benchmarks.gpu.sp_gpu "${SIZE[@]}" --budget $((sp_limit - 10)) --out "$WORK/sp.json"
# INFINITY_ARGS: more options for the driver (e.g. "--multiples 3 --nvme-multiple 1.25" for a shorter rerun)
inf_limit=${LIMIT_INFINITY:-195}
# shellcheck disable=SC2086
run_phase infinity 195 "$PY" -m benchmarks.gpu.infinity_bench "${SIZE[@]}" --budget $((inf_limit - 10)) \
  ${INFINITY_ARGS:-} --out "$WORK/infinity.json"
run_phase gloo 45 "$PY" -m benchmarks.gpu.run_pytest "${pytest_opts[@]}" "${xdist[@]}" --junitxml "$WORK/tests_gloo.xml" \
  tests/multiproc/test_oracle.py tests/multiproc/test_engine_api.py tests/multiproc/test_offload.py \
  tests/multiproc/test_checkpointing.py tests/multiproc/test_zero12.py tests/multiproc/test_stage3.py \
  tests/multiproc/test_pipe.py tests/multiproc/test_tp.py
cp -f "$WORK"/tests_*.xml "$OUT"/ 2>/dev/null
say "done in $(($(date +%s) - START))s"
report
exit 0
