#!/usr/bin/env bash
# GPU check of users' kernels (load_kernels, Kernel, ElementwiseKernel and their lean path):
#   1. their tests (GPU and CPU),
#   2. the host-overhead table (cupylab-bench overhead: user kernels beside cupy.RawKernel,
#      ElementwiseKernel beside cupylab.add),
#   3. compute-sanitizer memcheck over the CuPy user-kernel tests (time-limited),
# then a summary. Usage: scripts/gpu_check_kernels.sh [OUTDIR]   (logs in OUTDIR, default ./out)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-$PWD/$OUT/kernel-cache}
PY=${PYTHON:-python3}
$PY -m pytest -q -p no:cacheprovider -rs tests/test_kernels_gpu.py tests/test_kernels.py \
  tests/test_kernels_lean.py > "$OUT/pytest.log" 2>&1
rc_tests=$?
$PY -m cupylab.bench overhead --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
rc_bench=$?
timeout "${MEMCHECK_SECONDS:-40}" compute-sanitizer --tool memcheck --error-exitcode 99 \
  $PY -m pytest -q -p no:cacheprovider tests/test_kernels_gpu.py -k "cupy" \
  > "$OUT/memcheck.log" 2>&1
rc_mem=$?
echo "== summary"
echo "pytest (rc=$rc_tests): $(tail -n 1 "$OUT/pytest.log")"
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 20
echo "memcheck (rc=$rc_mem, 124 = time limit): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';') $(grep -E '(passed|failed)' "$OUT/memcheck.log" | tail -n 1)"
echo "overhead (rc=$rc_bench):"
cat "$OUT/overhead.log"
