#!/usr/bin/env bash
# GPU check of the row-wise family (issue 15) in one command:
#   compile   every rowwise program for this GPU, in parallel (fills the kernel cache),
#   tests     tests/test_rowwise_gpu.py, test_rowfew_gpu.py and their CPU files,
#   nopipe    the forward GPU tests again with CUPYLAB_ROWWISE_PIPELINE=0 (the register
#             kernels without the cp.async pipeline),
#   memcheck  compute-sanitizer memcheck on a CuPy-only subset (sub-warp, block, cluster,
#             generic kernels; backward; cross-entropy),
#   racecheck compute-sanitizer racecheck on a smaller CuPy-only subset (shared memory and
#             cluster / distributed shared memory paths),
#   bench     cupylab-bench for the registered row-wise ops beside torch eager at the issue's
#             shapes, and softmax / rms_norm without the pipeline,
#   benchc    a few cases beside torch.compile (Inductor compiles each: slow),
#   ce        cross-entropy 8192 x 128256 bf16 forward with gradient vs torch eager and
#             torch.compile forward + backward,
# then a summary. Usage: scripts/gpu_check_rowwise.sh [OUTDIR]; STEPS picks steps.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-$PWD/$OUT/kernel-cache}
PY=${PYTHON:-python3}
. scripts/pytest_args.sh  # PARGS: the extra pytest arguments of $PYTEST_ARGS
STEPS=${STEPS:-compile tests nopipe memcheck racecheck bench ce benchc}
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
summary=()
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

if has compile; then
  cc=$($PY -c 'from cupylab import _runtime; print(_runtime.device_info(0).cc)')
  $PY -m cupylab precompile --arch "sm_$cc" --families rowwise > "$OUT/compile.log" 2>&1
  summary+=("compile: $(tail -n 1 "$OUT/compile.log")")
  stamp "compile done"
fi

if has tests; then
  timeout ${TESTS_TIMEOUT:-150} $PY -m pytest -q -p no:cacheprovider -rs --tb=short \
    tests/test_rowwise_gpu.py tests/test_rowfew_gpu.py tests/test_rowwise_cpu.py \
    tests/test_rowfew_cpu.py -k "not every" "${PARGS[@]}" \
    > "$OUT/pytest.log" 2>&1
  summary+=("pytest rowwise (rc=$?): $(tail -n 1 "$OUT/pytest.log")")
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 30
  stamp "tests done"
fi

if has bench; then
  timeout ${BENCH_TIMEOUT:-150} $PY -m cupylab.bench run ${BENCH_OPS:-softmax log_softmax rms_norm layer_norm add_rms_norm softmax_backward} \
    -d ${BENCH_DTYPES:-bfloat16} ${BENCH_SIZES:--s 8192x8192 -s 32768x1024 -s 1024x65536 -s 128x4096} \
    --peers torch -r 5 -q --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?" >> "$OUT/bench.log"
  CUPYLAB_ROWWISE_PIPELINE=0 timeout 60 $PY -m cupylab.bench run softmax rms_norm -d bfloat16 \
    -s 8192x8192 -s 32768x1024 --peers none -r 5 -q > "$OUT/bench_nopipe.log" 2>&1
  summary+=("bench: see below")
  stamp "bench done"
fi

SUBSET='(softmax_forward and bfloat16 and (199-33 or 199-1000 or 2-262144 or 5-65537 or 199-3)) or (norms_forward and float32 and same and (199-31 or 60-4097 or 5-65537 or 1-300000)) or (norms_forward and bfloat16 and same and (5-65537 or 1-300000)) or (backward_analytic and bfloat16 and (199-33 or 30-4097 or 5-9000 or 2-70001)) or (cross_entropy and bfloat16 and 0.0 and (199-3 or 2-128256 or 1-300000)) or (softmax_forward and float32 and (5-65537 or 7-40000)) or (cross_entropy and float32 and 0.0 and (3-65537 or 2-128256)) or other_axis or bad_targets or (many_rows and offset and bfloat16 and (3000-1000 or 20000-33)) or (weight_alignment and bfloat16 and (3000-1000 or 700-4096))'
if has memcheck && command -v "$SAN" >/dev/null 2>&1; then
  timeout ${SAN_TIMEOUT:-120} "$SAN" --tool memcheck --error-exitcode 99 --target-processes all \
    $PY -m pytest -q -p no:cacheprovider tests/test_rowwise_gpu.py -k "${MEMCHECK_SELECT:-$SUBSET}" \
    > "$OUT/memcheck.log" 2>&1
  summary+=("memcheck (rc=$?): $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';') $(grep -E '(passed|failed)' "$OUT/memcheck.log" | tail -n 1)")
  stamp "memcheck done"
fi
RSUB='(softmax_forward and bfloat16 and (199-33 or 199-1000 or 2-262144 or 60-4097)) or (norms_forward and (float32 or bfloat16) and same and (60-4097 or 5-65537)) or (backward_analytic and (float32 or bfloat16) and (30-4097 or 5-9000)) or (cross_entropy and bfloat16 and 0.1 and 2-128256) or (softmax_forward and softmax- and float32 and 5-65537) or (cross_entropy and float32 and 0.0 and 2-128256) or (many_rows and offset and float32 and 1500-8192) or (weight_alignment and 3000-1000-0-contig-bfloat16)'
if has racecheck && command -v "$SAN" >/dev/null 2>&1; then
  timeout ${SAN_TIMEOUT:-120} "$SAN" --tool racecheck --error-exitcode 99 --target-processes all \
    $PY -m pytest -q -p no:cacheprovider tests/test_rowwise_gpu.py -k "${RACECHECK_SELECT:-$RSUB}" \
    > "$OUT/racecheck.log" 2>&1
  summary+=("racecheck (rc=$?): $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';') $(grep -E '(passed|failed)' "$OUT/racecheck.log" | tail -n 1)")
  stamp "racecheck done"
fi

if has ce; then
  timeout ${CE_TIMEOUT:-120} $PY - > "$OUT/ce.log" 2>&1 <<'PYEOF'
import os
import torch, cupylab
rows, cols = 8192, int(os.environ.get("CE_COLS", 128256))
x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
t = torch.randint(0, cols, (rows,), device="cuda")
g = torch.empty_like(x)
def timeit(f, n=10):
    f(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(n):
        s.record(); f(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); return ts[len(ts) // 2]
ours = timeit(lambda: cupylab.cross_entropy(x, t, return_grad=True, grad_out=g))
def eager():
    xr = x.detach().requires_grad_()
    torch.nn.functional.cross_entropy(xr.float(), t).backward()
def fwdbwd(xx, tt):
    xr = xx.detach().requires_grad_()
    l = torch.nn.functional.cross_entropy(xr.float(), tt)
    l.backward()
    return l, xr.grad
eag = timeit(eager, 5)
comp = torch.compile(fwdbwd)
try:
    cmp_ms = timeit(lambda: comp(x, t), 5)
except Exception as ex:  # noqa: BLE001
    cmp_ms = float("nan"); print("torch.compile failed:", ex)
gb = 2 * x.numel() * 2 / 1e9  # GB read + written
l1, g1 = cupylab.cross_entropy(x, t, return_grad=True)
l2, g2 = fwdbwd(x, t)
print(f"check: loss {float(l1):.6f} vs torch {float(l2):.6f}; max|dgrad| {float((g1.float() - g2.float()).abs().max()):.3e}")
print(f"CE {rows}x{cols} bf16 fwd+grad: cupylab {ours:.3f} ms ({gb / (ours / 1e3):.0f} GB/s), torch eager {eag:.3f} ms "
      f"(x{eag / ours:.2f}), torch.compile fwd+bwd {cmp_ms:.3f} ms (x{cmp_ms / ours:.2f})")
PYEOF
  summary+=("ce: $(tail -n 1 "$OUT/ce.log")")
  stamp "ce done"
fi

if has nopipe; then
  CUPYLAB_ROWWISE_PIPELINE=0 timeout ${TESTS_TIMEOUT:-150} $PY -m pytest -q -p no:cacheprovider \
    tests/test_rowwise_gpu.py -k "softmax_forward or norms_forward or layouts or many_rows" \
    > "$OUT/pytest_nopipe.log" 2>&1
  summary+=("pytest forward, CUPYLAB_ROWWISE_PIPELINE=0 (rc=$?): $(tail -n 1 "$OUT/pytest_nopipe.log")")
  stamp "nopipe done"
fi

if has benchc; then
  timeout ${BENCHC_TIMEOUT:-90} $PY -m cupylab.bench run ${BENCHC_OPS:-softmax rms_norm} -d bfloat16 \
    -s 8192x8192 --peers torch,torch.compile -r 5 -q > "$OUT/bench_compile.log" 2>&1
  stamp "benchc done"
fi

echo "================ rowwise GPU check summary ================"
for s in "${summary[@]}"; do echo "$s"; done
for f in bench.log bench_nopipe.log bench_compile.log; do
  if [ -f "$OUT/$f" ]; then echo "--- $f"; grep -E "^(op|--|[a-z_]+ +(bfloat16|float))|rc=|cases" "$OUT/$f"; fi
done
