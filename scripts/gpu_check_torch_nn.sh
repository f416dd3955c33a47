#!/usr/bin/env bash
# GPU check of cupylab.torch.nn and the training example (issue 17, part 2), offline:
#   import   cupylab.torch.nn imports (needs cupylab.torch.functional),
#   tests    tests/test_torch_nn_gpu.py and tests/test_torch_nn_cpu.py (pytest-xdist workers when
#            installed): each module's forward and backward vs torch's in float64, a swapped
#            model under autocast and torch.compile(fullgraph=True), 8-step runs of the example,
#   example  scripts/examples/train_tiny_llm.py at its default size, EXAMPLE_STEPS (60) steps,
#            all five modes (torch, torch-alt, cupylab, torch-compile, cupylab-compile),
#   full     the same with 200 steps (not in the default STEPS),
# then a summary. Usage: scripts/gpu_check_torch_nn.sh [OUTDIR]; STEPS="tests example" picks
# steps; PYTHON picks the interpreter (python3).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-$PWD/$OUT/kernel-cache}
PY=${PYTHON:-python3}
. scripts/pytest_args.sh  # PARGS: the extra pytest arguments of $PYTEST_ARGS
STEPS=${STEPS:-import tests example}
summary=()
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

if has import; then
  $PY -c 'import torch, cupylab.torch.nn as n, cupylab.torch.functional as f
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print("nn:", n.__file__, "functional:", f.__file__)' > "$OUT/import.log" 2>&1
  summary+=("import (rc=$?): $(tail -n 1 "$OUT/import.log")")
  stamp "import done"
fi

if has tests; then
  par=()
  $PY -c 'import xdist' 2>/dev/null && par=(-n "${TEST_JOBS:-4}" -v)
  timeout ${TESTS_TIMEOUT:-330} $PY -m pytest -q -p no:cacheprovider -rs --tb=short "${par[@]}" \
    tests/test_torch_nn_gpu.py tests/test_torch_nn_cpu.py "${PARGS[@]}" > "$OUT/pytest.log" 2>&1
  summary+=("pytest torch nn (rc=$?): $(tail -n 1 "$OUT/pytest.log")")
  grep -E "^(FAILED|ERROR)| FAILED | ERROR " "$OUT/pytest.log" | head -n 30
  stamp "tests done"
fi

run_example() {  # name steps
  timeout ${EXAMPLE_TIMEOUT:-240} $PY scripts/examples/train_tiny_llm.py --steps "$2" \
    ${EXAMPLE_ARGS:-} --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  summary+=("$1, $2 steps (rc=$?; 0 = losses agree): $(grep -E '^check:' "$OUT/$1.log" || tail -n 1 "$OUT/$1.log")")
  stamp "$1 done"
}
has example && run_example example "${EXAMPLE_STEPS:-60}"
has full && run_example full 200

echo "================ torch nn GPU check summary ================"
for s in "${summary[@]}"; do echo "$s"; done
for f in example full; do
  if [ -f "$OUT/$f.log" ]; then
    echo "--- $f.log"
    sed -n '/^TinyLM/,$p' "$OUT/$f.log"
    grep -E "Error|error:" "$OUT/$f.log" | head -n 5
  fi
done
