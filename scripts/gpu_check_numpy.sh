#!/usr/bin/env bash
# The GPU check of the NumPy drop-in (elementwise family), in one command:
#   1. precompile (python -m cupylab precompile: every dtype pair, NumPy and torch rules) into
#      a fresh cache, timed; the cold and warm first call of a new dtype combination;
#   2. the elementwise GPU tests and the conformance suite (NumPy and torch), plus the CPU
#      tests of the same family;
#   3. cupylab-bench's mixed-dtype cases (--dtype a+b) at 2^24 and 2^26 elements against
#      cupy.add and torch.add, with GB/s on the bytes moved and the share of the ceiling;
#   4. compute-sanitizer memcheck on a CuPy subset (mixed dtypes, every layout, edge values);
# then a summary. Usage: scripts/gpu_check_numpy.sh [OUTDIR]   (default ./out; $OUT if set)
# STEPS (default "precompile firstcall tests bench sanitizer") picks steps; T_PRE, T_TESTS, T_SAN, T_BENCH
# bound each step (seconds).
set -u
cd "$(dirname "$0")/.."
OUTD=${1:-${OUT:-out}}
mkdir -p "$OUTD"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-$PWD/$OUTD/kernel-cache}
PY=${PYTHON:-python3}
. scripts/pytest_args.sh  # PARGS: the extra pytest arguments of $PYTEST_ARGS
STEPS=${STEPS:-precompile firstcall tests bench sanitizer}
summary=()
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
t0=$(date +%s)

if has precompile; then
  timeout ${T_PRE:-120} $PY -m cupylab precompile --arch sm_90 --rules numpy,torch --jobs "$(nproc)" \
    > "$OUTD/precompile.log" 2>&1
  summary+=("precompile (rc=$?): $(tail -n 1 "$OUTD/precompile.log")")
fi
if has firstcall; then
  # cold: a fresh cache, the first call of a new combination after CuPy and NVRTC are up;
  # warm: a new process, the same combination from the disk cache
  COLD=$(mktemp -d)
  for phase in cold warm; do
    CUPYLAB_CACHE_DIR=$COLD timeout 60 $PY - <<'PYEOF' >> "$OUTD/first_call.log" 2>&1
import time, cupy as cp, cupylab
x = cp.ones(1 << 20, cp.float32); cupylab.add(x, x); cp.cuda.Device().synchronize()  # NVRTC, CuPy up
a, b = cp.ones(1 << 20, cp.int16), cp.ones(1 << 20, cp.float32)
t = time.perf_counter(); cupylab.multiply(a, b); cp.cuda.Device().synchronize()
first = time.perf_counter() - t
t = time.perf_counter(); cupylab.multiply(a, b); cp.cuda.Device().synchronize()
print(f"first call of int16*float32: {first * 1e3:.1f} ms (then {(time.perf_counter() - t) * 1e3:.2f} ms)")
PYEOF
  done
  summary+=("first call, new combination: cold / warm: $(grep -o 'first call.*' "$OUTD/first_call.log" | tr '\n' ' ')")
  rm -rf "$COLD"
fi
summary+=("  (elapsed $(( $(date +%s) - t0 )) s)")

if has tests; then
  timeout ${T_TESTS:-300} $PY -m pytest -q -p no:cacheprovider -rs tests/test_gpu_conformance.py \
    tests/test_gpu_elementwise.py tests/test_ufunc_cpu.py tests/test_ops_cpu.py \
    tests/test_interop_cpu.py "${PARGS[@]}" > "$OUTD/pytest.log" 2>&1
  summary+=("pytest (elementwise + conformance, rc=$?): $(tail -n 1 "$OUTD/pytest.log")")
  while IFS= read -r line; do summary+=("  $line"); done < <(grep -E "^(FAILED|ERROR)" "$OUTD/pytest.log" | head -n 30)
  summary+=("  (elapsed $(( $(date +%s) - t0 )) s)")
fi

if has bench; then
  # cupylab-bench with mixed-dtype cases (a+b: the inputs' dtypes; the output NumPy's promotion)
  timeout ${T_BENCH:-120} $PY -m cupylab.bench run add --framework cupy --peers cupy,torch \
    --dtype ${BENCH_DTYPES:-float32,float32+float16,float16+float32,int64+int32,float64+float32,bfloat16+float32,int32+float32} \
    --size ${BENCH_SIZES:-2^24,2^26} --json "$OUTD/bench-mixed.json" > "$OUTD/bench-mixed.log" 2>&1
  summary+=("mixed-dtype bench (rc=$?; peers' ratio = peer time / cupylab time, >1: cupylab faster):")
  while IFS= read -r line; do summary+=("  $line"); done < <(grep -vE "^\s*$" "$OUTD/bench-mixed.log" | tail -n 40)
fi

SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
if has sanitizer; then
  if command -v "$SAN" >/dev/null 2>&1; then
    timeout ${T_SAN:-200} "$SAN" --tool memcheck --error-exitcode 99 --target-processes all \
      $PY -m pytest -q -p no:cacheprovider tests/test_gpu_conformance.py tests/test_gpu_elementwise.py \
      -k "${MEMCHECK_SELECT:-(layouts and (float32-float16 or int64-int32 or complex64-float32)) or edge_values or all_scalar}" \
      > "$OUTD/memcheck.log" 2>&1
    summary+=("compute-sanitizer memcheck (rc=$?): $(grep -E 'ERROR SUMMARY' "$OUTD/memcheck.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';') $(grep -E '(passed|failed)' "$OUTD/memcheck.log" | tail -n 1)")
  else
    summary+=("compute-sanitizer: not found")
  fi
  summary+=("  (elapsed $(( $(date +%s) - t0 )) s)")
fi

printf '\n==== SUMMARY ====\n'
printf '%s\n' "${summary[@]}"
