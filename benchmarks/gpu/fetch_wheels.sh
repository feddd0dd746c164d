#!/usr/bin/env bash
# Fetch, on a machine with network, the Python wheels the GPU machine lacks, into .whl/ at the repository
# root (ignored by git through .git/info/exclude). The GPU machine has python3 3.12 with torch, pytest,
# numpy, psutil, safetensors, tqdm and typing_extensions, and no network: deepshard's other runtime
# dependency, pydantic, travels as wheels, and so does DeepSpeed (optional: its sdist built here into a
# pure-Python wheel, no ops compiled, plus hjson, the one requirement the GPU machine lacks).
#
#   benchmarks/gpu/fetch_wheels.sh                 # ~3 MiB; WITH_DEEPSPEED=0 to leave DeepSpeed out
#
# Then name .whl in the device call's carry; benchmarks/gpu_check.sh installs what it finds there.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
target=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}")
# the versions deepshard's own test environment runs with
"$PY" -m pip download -q "${target[@]}" -d .whl \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
if [ "${WITH_DEEPSPEED:-1}" = 1 ]; then
  mkdir -p .whl/deepspeed
  "$PY" -m pip download -q "${target[@]}" -d .whl/deepspeed hjson==3.1.0
  # setup.py imports torch: build with this interpreter's torch (no isolated build env); ops are JIT-only
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl/deepspeed deepspeed==0.19.8
fi
ls -la .whl .whl/deepspeed 2>/dev/null || ls -la .whl
du -sh .whl
