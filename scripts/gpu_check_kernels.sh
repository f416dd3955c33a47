#!/usr/bin/env bash
# GPU check of users' kernels (load_kernels, Kernel, ElementwiseKernel and their lean path):
#   1. the host-overhead table (cupylab-bench overhead: user kernels beside cupy.RawKernel,
#      ElementwiseKernel beside cupylab.add, with cupylab's operators beside their peers),
#   2. the user-kernel tests (GPU and CPU),
#   3. compute-sanitizer memcheck over the CuPy user-kernel tests, if time is left,
# then a summary. Usage: scripts/gpu_check_kernels.sh [OUTDIR]   (logs in OUTDIR, default ./out)
# BUDGET (seconds, default 140) bounds the whole check: each step gets a share of it.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-$PWD/$OUT/kernel-cache}
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-140}
left() { echo $((BUDGET - SECONDS)); }
timeout $((BUDGET * 35 / 100)) $PY -m cupylab.bench overhead --json "$OUT/overhead.json" \
  > "$OUT/overhead.log" 2>&1
rc_bench=$?
timeout $(($(left) - 15)) $PY -m pytest -q -p no:cacheprovider -rs tests/test_kernels_gpu.py \
  tests/test_kernels.py tests/test_kernels_lean.py > "$OUT/pytest.log" 2>&1
rc_tests=$?
rc_mem=skipped
if [ "$(left)" -gt 20 ]; then
  timeout $(($(left) - 5)) compute-sanitizer --tool memcheck --error-exitcode 99 \
    $PY -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k "cupy" \
    > "$OUT/memcheck.log" 2>&1
  rc_mem=$?
fi
echo "== summary ($SECONDS s; rc 124 = step ran out of time)"
echo "pytest (rc=$rc_tests): $(tail -n 1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 20
[ "$rc_mem" = skipped ] || echo "memcheck (rc=$rc_mem): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';') $(grep -E '(passed|failed)' "$OUT/memcheck.log" | tail -n 1)"
echo "overhead (rc=$rc_bench):"
cat "$OUT/overhead.log"
