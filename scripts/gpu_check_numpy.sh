#!/usr/bin/env bash
# The GPU check of the NumPy drop-in (elementwise family), in one command:
#   1. precompile (python -m cupylab precompile: every dtype pair, NumPy and torch rules) into
#      a fresh cache, timed; the cold and warm first call of a new dtype combination;
#   2. the elementwise GPU tests and the conformance suite (NumPy and torch), plus the CPU
#      tests of the same family;
#   3. compute-sanitizer memcheck on a CuPy subset (mixed dtypes, every layout, edge values);
#   4. a short mixed-dtype bench at 2^24 and 2^26 elements against cupy.add and torch.add,
#      with GB/s on the bytes moved and the share of the streaming ceiling;
# then a summary. Usage: scripts/gpu_check_numpy.sh [OUTDIR]   (default ./out; $OUT if set)
# STEPS (default "precompile firstcall tests sanitizer bench") picks steps; T_PRE, T_TESTS, T_SAN, T_BENCH
# bound each step (seconds).
set -u
cd "$(dirname "$0")/.."
OUTD=${1:-${OUT:-out}}
mkdir -p "$OUTD"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-$PWD/$OUTD/kernel-cache}
PY=${PYTHON:-python3}
STEPS=${STEPS:-precompile firstcall tests sanitizer bench}
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
    tests/test_interop_cpu.py ${PYTEST_ARGS:-} > "$OUTD/pytest.log" 2>&1
  summary+=("pytest (elementwise + conformance, rc=$?): $(tail -n 1 "$OUTD/pytest.log")")
  while IFS= read -r line; do summary+=("  $line"); done < <(grep -E "^(FAILED|ERROR)" "$OUTD/pytest.log" | head -n 30)
  summary+=("  (elapsed $(( $(date +%s) - t0 )) s)")
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

if has bench; then
  timeout ${T_BENCH:-120} $PY - > "$OUTD/bench-mixed.log" 2>&1 <<'PYEOF'
import numpy as np, cupy as cp, cupylab
try:
    import torch
except ImportError:
    torch = None
import ml_dtypes
BF = np.dtype(ml_dtypes.bfloat16)
ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()

def timed(f, reps=15, batch=10):
    for _ in range(3):
        f()
    ts = []
    for _ in range(reps):
        ev0.record()
        for _ in range(batch):
            f()
        ev1.record(); ev1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(ev0, ev1) * 1e3 / batch)
    return float(np.median(ts))

# streaming ceiling: a device-to-device copy of 2^28 bytes (reads + writes)
buf = cp.empty(1 << 28, cp.uint8); dst = cp.empty_like(buf)
us = timed(lambda: dst.__setitem__(Ellipsis, buf))
ceil = 2 * buf.nbytes / (us * 1e3)
print(f"ceiling (copy) {ceil:.0f} GB/s")
del buf, dst
print(f"{'case':28s} {'n':>6s} {'cupylab us':>10s} {'GB/s':>7s} {'%ceil':>6s} {'cupy us':>8s} {'cl/cupy':>8s} {'torch us':>8s} {'cl/torch':>8s}")
pairs = [("float32", "float32"), ("float32", "float16"), ("float16", "float32"), ("int64", "int32"),
         ("float64", "float32"), ("bfloat16", "float32"), ("int32", "float32"), ("uint8", "float32")]
for n in (1 << 24, 1 << 26):
    for a, b in pairs:
        da = BF if a == "bfloat16" else np.dtype(a)
        db = BF if b == "bfloat16" else np.dtype(b)
        rt = np.result_type(da, db)
        ha = cp.random.standard_normal(n, dtype=cp.float32) * 4 + 1
        hb = cp.random.standard_normal(n, dtype=cp.float32) * 4 + 1
        def conv(v, d):
            if d == BF:
                return (v.view(cp.uint32) >> 16).astype(cp.uint16).view(BF)
            return v.astype(d)
        A, B = conv(ha, da), conv(hb, db)
        O = cp.empty(n, rt if rt != BF else cp.uint16).view(rt)
        nbytes = n * (da.itemsize + db.itemsize + np.dtype(rt).itemsize)
        cl = timed(lambda: cupylab.add(A, B, out=O))
        row = f"add {a}+{b}->{np.dtype(rt).name}"
        try:
            cu = timed(lambda: cp.add(A, B, out=O)) if BF not in (da, db) else None
        except Exception:
            cu = None
        th = None
        if torch is not None:
            TA, TB, TO = (torch.from_dlpack(v.view(cp.uint16)).view(torch.bfloat16) if v.dtype == BF
                          else torch.from_dlpack(v) for v in (A, B, O))
            th = timed(lambda: torch.add(TA, TB, out=TO))
        gbps = nbytes / (cl * 1e3)
        f = lambda v: f"{v:8.1f}" if v else "     n/a"
        r = lambda v: f"{v / cl:8.2f}" if v else "     n/a"
        print(f"{row:28s} 2^{n.bit_length() - 1:<4d} {cl:10.1f} {gbps:7.0f} {100 * gbps / ceil:6.1f} {f(cu)} {r(cu)} {f(th)} {r(th)}")
        del A, B, O, ha, hb
        cp.get_default_memory_pool().free_all_blocks()
PYEOF
  summary+=("mixed-dtype bench (rc=$?; ratio = peer time / cupylab time, >1: cupylab faster):")
  while IFS= read -r line; do summary+=("  $line"); done < <(grep -vE "^\s*$" "$OUTD/bench-mixed.log" | tail -n 20)
fi

printf '\n==== SUMMARY ====\n'
printf '%s\n' "${summary[@]}"
