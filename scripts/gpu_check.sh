#!/usr/bin/env bash
# The whole GPU check in one command, for a GPU machine with no network, from a plain checkout:
#   1. the full test suite (CPU and GPU tests),
#   2. compute-sanitizer memcheck and racecheck over the GPU elementwise tests,
#   3. the short benchmark (cupylab-bench), then a summary.
# Usage: scripts/gpu_check.sh [OUTDIR]   (logs and results go to OUTDIR, default ./out)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-$PWD/$OUT/kernel-cache}
PY=${PYTHON:-python3}
summary=()

$PY -m pytest -q -p no:cacheprovider -rs tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log"
summary+=("pytest: $(tail -n 1 "$OUT/pytest.log")")

SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
if command -v "$SAN" >/dev/null 2>&1; then
  for tool in memcheck racecheck; do
    sel=${SANITIZER_SELECT:-"not large and not two_threads and not new_process and not torch"}
    [ "$tool" = racecheck ] && sel="$sel and (odd_large or offset or broadcast or graph)"
    "$SAN" --tool "$tool" --error-exitcode 99 --target-processes all \
      $PY -m pytest -q -p no:cacheprovider tests/test_gpu_elementwise.py -k "$sel" \
      > "$OUT/sanitizer-$tool.log" 2>&1
    rc=$?
    summary+=("compute-sanitizer $tool (rc=$rc): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | sort | uniq -c | tr '\n' ' ') $(grep -E '^[0-9]+ passed|passed|failed' "$OUT/sanitizer-$tool.log" | tail -n 1)")
  done
else
  summary+=("compute-sanitizer: not found")
fi

if $PY -c "import cupylab.bench.cli" 2>/dev/null; then
  $PY -m cupylab.bench.cli run vector_add fused_add_mul --dtype float32 --dtype bfloat16 \
      --size 67108864 --json "$OUT/bench-short.json" 2>&1 | tee "$OUT/bench-short.log"
  summary+=("bench: see $OUT/bench-short.log")
fi

printf '\n==== SUMMARY ====\n'
printf '%s\n' "${summary[@]}"
