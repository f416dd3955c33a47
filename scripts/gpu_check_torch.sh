#!/usr/bin/env bash
# GPU check of the torch integration (issue 17: cupylab.torch.functional, torch.ops.cupylab)
# in one command, offline:
#   compile   every row-wise program for this GPU, in parallel (fills the kernel cache, so the
#             tests do not compile them one by one),
#   tests     tests/test_torch_gpu.py (gradcheck, torch comparisons, opcheck, torch.compile,
#             CUDA graphs, reduce-overhead) and the torch CPU tests (tests/test_torch_*_cpu.py),
#   bench     cupylab-bench overhead --framework torch (the rms_norm rows: the functional
#             no-grad path, the registered operator, the direct call, each beside torch),
# then a summary. Usage: scripts/gpu_check_torch.sh [OUTDIR]  (default ./out)
# STEPS (default "compile tests bench"); T_TESTS, T_BENCH: per-step time limits in seconds
# (defaults 420 and 100: the whole check fits in 10 minutes; a step that runs out is reported
# and the next one still runs); PYTEST_ARGS: extra pytest arguments, shell-quoted (e.g.
# PYTEST_ARGS="-k 'not compile'").
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# caches outside OUTDIR (the Inductor cache grows to tens of MB; OUTDIR keeps only logs)
CACHES=${TMPDIR:-/tmp}/cupylab-torch-check
export CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-$CACHES/kernel-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$CACHES/inductor-cache}
PY=${PYTHON:-python3}
. scripts/pytest_args.sh  # PARGS: the extra pytest arguments of $PYTEST_ARGS
STEPS=${STEPS:-compile tests bench}
summary=()
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

$PY - > "$OUT/env.log" 2>&1 <<'PYEOF'
import sys, torch, cupy
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cupy {cupy.__version__}, "
      f"GPU {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
PYEOF
summary+=("env: $(tail -n 1 "$OUT/env.log")")

if has compile; then
  cc=$($PY -c 'from cupylab import _runtime; print(_runtime.device_info(0).cc)')
  $PY -m cupylab precompile --arch "sm_$cc" --families rowwise > "$OUT/compile.log" 2>&1
  summary+=("compile (rc=$?): $(tail -n 1 "$OUT/compile.log")")
  stamp "compile done"
fi

if has tests; then
  timeout "${T_TESTS:-420}" $PY -m pytest -q -rs -p no:cacheprovider --tb=short \
    tests/test_torch_gpu.py "${PARGS[@]}" > "$OUT/pytest_torch_gpu.log" 2>&1
  summary+=("pytest tests/test_torch_gpu.py (rc=$?): $(tail -n 1 "$OUT/pytest_torch_gpu.log")")
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_torch_gpu.log" | head -n 40
  timeout 60 $PY -m pytest -q -rs -p no:cacheprovider --tb=short tests/test_torch_cpu.py \
    tests/test_torch_compile_cpu.py tests/test_torch_nn_cpu.py tests/test_torch_optim_cpu.py tests/test_torch_optim_state_cpu.py \
    tests/test_torch_promotion_cpu.py \
    > "$OUT/pytest_torch_cpu.log" 2>&1
  summary+=("pytest tests/test_torch_*_cpu.py (rc=$?): $(tail -n 1 "$OUT/pytest_torch_cpu.log")")
  grep -E "^(FAILED|ERROR)" "$OUT/pytest_torch_cpu.log" | head -n 20
  stamp "tests done"
fi

if has bench; then
  timeout "${T_BENCH:-100}" $PY -m cupylab.bench overhead --framework torch --calls 2000 \
    --rounds 5 -q --json "$OUT/overhead_torch.json" > "$OUT/overhead_torch.log" 2>&1
  summary+=("bench overhead --framework torch (rc=$?): rows below")
  stamp "bench done"
fi

echo "================ torch integration GPU check summary ================"
for s in "${summary[@]}"; do echo "$s"; done
if [ -f "$OUT/pytest_torch_gpu.log" ]; then
  echo "--- skipped / failed (test_torch_gpu)"
  grep -E "^(SKIPPED|FAILED|ERROR)" "$OUT/pytest_torch_gpu.log" | head -n 20
fi
if [ -f "$OUT/overhead_torch.log" ]; then
  echo "--- overhead (host us per call; the rms_norm rows are the torch integration's)"
  grep -E "^(inputs|--|torch )" "$OUT/overhead_torch.log" | grep -E "inputs|---|rms_norm|add\(x, y\)"
fi
