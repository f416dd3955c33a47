#!/usr/bin/env bash
# The whole GPU check in one command, for a GPU machine with no network, from a plain checkout:
#   1. the full test suite (CPU and GPU tests),
#   2. compute-sanitizer memcheck over the GPU kernel tests, racecheck over a subset,
#   3. the short benchmark (cupylab-bench: vector_add and fused_add_mul at 2^26, fp32 and bf16,
#      beside torch) and the host-overhead table,
# then a summary. Usage: scripts/gpu_check.sh [OUTDIR]   (logs go to OUTDIR, default ./out)
# STEPS (default "tests sanitizer bench") picks steps; PYTEST_ARGS adds pytest arguments.
#
# INSTALLED=1 first makes a regular (non-editable) install of this checkout into the current
# interpreter (`pip install --no-deps --no-build-isolation .`, no network needed) and runs
# everything from outside the checkout against the installed package, as a user would.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${1:-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
export CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-$OUT/kernel-cache}
PY=${PYTHON:-python3}
STEPS=${STEPS:-tests sanitizer bench}
summary=()
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
if [ "${INSTALLED:-0}" = 1 ]; then
  $PY -m pip install -q --no-deps --no-build-isolation "$REPO" > "$OUT/install.log" 2>&1
  summary+=("install (rc=$?): $(tail -n 1 "$OUT/install.log")")
  mkdir -p "$OUT/elsewhere" && cd "$OUT/elsewhere"   # outside the checkout: the installed package
  summary+=("cupylab imported from: $($PY -c 'import cupylab; print(cupylab.__file__)')")
else
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi

if has tests; then
  $PY -m pytest -q -p no:cacheprovider -rs "$REPO/tests" ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
  summary+=("pytest (all tests): $(tail -n 1 "$OUT/pytest.log")")
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 20
fi

SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
if has sanitizer; then
  if command -v "$SAN" >/dev/null 2>&1; then
    # memcheck: every elementwise kernel variant on CuPy inputs (torch's own start-up under the
    # sanitizer costs minutes and exercises the same kernels), and the user-kernel launches.
    "$SAN" --tool memcheck --error-exitcode 99 --target-processes all \
      $PY -m pytest -q -p no:cacheprovider "$REPO/tests/test_gpu_elementwise.py" "$REPO/tests/test_kernels_gpu.py" \
      -k "${MEMCHECK_SELECT:-(cupy or kernels_gpu) and not large and not torch and not jax and not numba and not two_threads and not new_process and not example}" \
      > "$OUT/memcheck.log" 2>&1
    summary+=("compute-sanitizer memcheck (rc=$?): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';') $(grep -E '(passed|failed)' "$OUT/memcheck.log" | tail -n 1)")
    "$SAN" --tool racecheck --error-exitcode 99 --target-processes all \
      $PY -m pytest -q -p no:cacheprovider "$REPO/tests/test_gpu_elementwise.py" "$REPO/tests/test_kernels_gpu.py" \
      -k "${RACECHECK_SELECT:-(cupy_every and float32) or shared or graph}" \
      > "$OUT/racecheck.log" 2>&1
    summary+=("compute-sanitizer racecheck (rc=$?): $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';') $(grep -E '(passed|failed)' "$OUT/racecheck.log" | tail -n 1)")
  else
    summary+=("compute-sanitizer: not found")
  fi
fi

if has bench; then
  ${BENCH:-$PY -m cupylab.bench} run vector_add fused_add_mul --dtype float32,bfloat16 --size 2^26 \
    --peers torch,cupy --json "$OUT/bench-short.json" > "$OUT/bench-short.log" 2>&1
  summary+=("bench (rc=$?):")
  while IFS= read -r line; do summary+=("  $line"); done < <(grep -E "^(op |vector_add|fused_add_mul|ceiling)" "$OUT/bench-short.log")
  ${BENCH:-$PY -m cupylab.bench} overhead --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
  summary+=("overhead (rc=$?): see $OUT/overhead.log")
fi

printf '\n==== SUMMARY ====\n'
printf '%s\n' "${summary[@]}"
