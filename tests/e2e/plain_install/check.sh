#!/usr/bin/env bash
# CI step: deepshard from this checkout with no extras (`pip install .`) into its own venv, then a real script end to end
# (training on 2 processes through the launcher, save_checkpoint, load_checkpoint, zero_to_fp32), and the
# environment report (`deepshard report`) from that fresh venv.
# The suite's venv holds the dev extras (numpy, pytest, ...), which would hide a missing runtime
# dependency; this venv holds only what pyproject.toml's `dependencies` pull in.
# Usage: tests/e2e/plain_install/check.sh [python] [venv dir] [torch requirement]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
PY="${1:-python3}"
VENV="$(realpath -m "${2:-$ROOT/.venv-plain}")"  # absolute: the check runs from a scratch directory
TORCH="${3:-torch==2.13.0}"
STAMP="$VENV/.installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q "$TORCH"    # the CPU wheel is available offline
    "$VENV/bin/pip" install -q -e "$ROOT"  # no extras: the runtime dependencies only
    touch "$STAMP"
fi
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
cd "$OUT"
# the check must see only the plain install: nothing from a caller's PYTHONPATH
env -u PYTHONPATH "$VENV/bin/deepshard" --num_gpus 2 "$ROOT/tests/e2e/plain_install/train_save_load.py" \
    --out "$OUT" > "$OUT/log.txt" 2>&1 || { cat "$OUT/log.txt"; echo "plain-install check FAILED"; exit 1; }
grep -q '"ok": true' "$OUT/log.txt" || { cat "$OUT/log.txt"; echo "plain-install check FAILED"; exit 1; }
env -u PYTHONPATH "$VENV/bin/deepshard" report > "$OUT/report.txt" 2>&1 \
    && grep -q "^torch install path" "$OUT/report.txt" \
    || { cat "$OUT/report.txt"; echo "plain-install check FAILED: deepshard report"; exit 1; }
echo "plain-install check passed: $(grep '"ok": true' "$OUT/log.txt" | sed 's/^.*\({.*}\).*$/\1/')"
