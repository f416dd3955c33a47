#!/usr/bin/env bash
# GPU check of the multi-tensor family (issue 16) in one command:
#   1. its tests (CPU host-side tests, foreach/functional-optimizer GPU tests, torch optimizers),
#   2. the list-shaped bench (python -m cupylab.bench.multi_tensor --quick),
#   3. compute-sanitizer memcheck on the CuPy-only GPU tests, racecheck on the norm kernels,
# then a summary. Usage: scripts/gpu_check_multi_tensor.sh [OUTDIR]  (default ./out)
# STEPS (default "tests bench sanitizer"); T_TESTS, T_BENCH, T_MEM, T_RACE: per-step time
# limits in seconds (a step that runs out is reported, and the next one still runs).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-$PWD/$OUT/kernel-cache}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
. scripts/pytest_args.sh  # PARGS: the extra pytest arguments of $PYTEST_ARGS
STEPS=${STEPS:-tests bench sanitizer}
summary=()
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
TESTS="tests/test_multi_tensor_cpu.py tests/test_multi_tensor_plan_cpu.py tests/test_multi_tensor_gpu.py tests/test_optim_torch_gpu.py"

if has tests; then
  timeout "${T_TESTS:-80}" $PY -m pytest -q -p no:cacheprovider -rs $TESTS \
    -k "not every_multi_tensor_kernel" "${PARGS[@]}" > "$OUT/pytest_mt.log" 2>&1
  summary+=("pytest multi-tensor (rc=$?): $(tail -n 1 "$OUT/pytest_mt.log")")
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_mt.log" | head -n 30
fi

if has bench; then
  timeout "${T_BENCH:-40}" $PY -m cupylab.bench.multi_tensor --quick \
    --llama-fraction "${LLAMA_FRACTION:-1.0}" --json "$OUT/bench_mt.json" > "$OUT/bench_mt.log" 2>&1
  summary+=("bench multi-tensor (rc=$?):")
  while IFS= read -r line; do summary+=("  $line"); done < <(grep -E "^case=" "$OUT/bench_mt.log")
  tail -n 5 "$OUT/bench_mt.log" | grep -vE "^case=" | sed 's/^/  bench: /'
fi

SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
if has sanitizer; then
  if command -v "$SAN" >/dev/null 2>&1; then
    timeout "${T_MEM:-45}" "$SAN" --tool memcheck --error-exitcode 99 --target-processes all \
      $PY -m pytest -q -p no:cacheprovider tests/test_multi_tensor_gpu.py \
      -k "${MEMCHECK_SELECT:-not torch and not large and not 5000 and not jax and not mixed and not reallocated and not 300}" \
      > "$OUT/memcheck_mt.log" 2>&1
    summary+=("compute-sanitizer memcheck (rc=$?): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_mt.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';') $(grep -E '(passed|failed)' "$OUT/memcheck_mt.log" | tail -n 1)")
    timeout "${T_RACE:-25}" "$SAN" --tool racecheck --error-exitcode 99 --target-processes all \
      $PY -m pytest -q -p no:cacheprovider tests/test_multi_tensor_gpu.py \
      -k "${RACECHECK_SELECT:-norms_and_clip and cupy and float32}" > "$OUT/racecheck_mt.log" 2>&1
    summary+=("compute-sanitizer racecheck (rc=$?): $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck_mt.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';') $(grep -E '(passed|failed)' "$OUT/racecheck_mt.log" | tail -n 1)")
  else
    summary+=("compute-sanitizer: not found")
  fi
fi

printf '\n==== SUMMARY ====\n'
printf '%s\n' "${summary[@]}"
