#!/usr/bin/env bash
# The whole GPU check in one command, for a GPU machine with no network, from a plain checkout:
#   precompile  every kernel family for this GPU into the cache, in parallel processes
#               (python -m cupylab precompile);
#   tests       the full test suite (CPU and GPU tests; pytest-xdist workers when installed);
#   sanitizer   compute-sanitizer memcheck and racecheck on CuPy-only subsets of every kernel
#               family (elementwise and user kernels, NumPy conformance, row-wise, multi-tensor),
#               the sanitizer processes running side by side, next to the tests;
#   bench       host cost per call (cupylab-bench overhead: operators, prepared calls, graphs,
#               user kernels against cupy.RawKernel), the mixed-dtype elementwise cases, the
#               row-wise ops at two bf16 shapes, and the multi-tensor quick bench, each beside its
#               peers, one after another (nothing else runs on the GPU while they time);
# then a summary (also written to OUTDIR/summary.txt).
# Usage: scripts/gpu_check.sh [OUTDIR]   (logs go to OUTDIR, default ./out)
# STEPS (default "precompile tests sanitizer overhead mixed rowbench mtbench": the bench is the
# last four) picks steps; JOBS sets the parallelism; T_PRE, T_TESTS, T_SAN, T_BENCH cap the
# steps in seconds (a step that runs out is reported with rc=124). The tests step leaves out the
# slow-marked tests (CPU compile and wheel tests, run by CI) unless SLOW=1.
#
# INSTALLED=1 first makes a regular (non-editable) install of this checkout into the current
# interpreter (`pip install --no-deps --no-build-isolation .`, no network needed) and runs the
# tests and the bench from outside the checkout against the installed package, as a user
# would. Wheels in .whl (scripts/device_wheels.sh) are installed first where the interpreter
# lacks Dask. The family scripts (gpu_check_rowwise.sh, gpu_check_multi_tensor.sh,
# gpu_check_numpy.sh) hold the longer checks of one family each.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${1:-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-$OUT/kernel-cache}
PY=${PYTHON:-python3}
. scripts/pytest_args.sh  # PARGS: the extra pytest arguments of $PYTEST_ARGS
STEPS=${STEPS:-precompile tests sanitizer overhead mixed rowbench mtbench}
JOBS=${JOBS:-$(nproc)}
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
t0=$(date +%s)
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"
# the revision, "-dirty" when the tracked files differ from it (a copied tree whose .git is older)
say "gpu_check: $(git -C "$REPO" describe --always --dirty 2>/dev/null) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"

# Wheels carried for an offline machine (scripts/device_wheels.sh): Dask for the Dask tests.
if [ -d "$REPO/.whl" ] && ! $PY -c 'import dask, distributed' 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$OUT/site" "$REPO"/.whl/*.whl \
    > "$OUT/wheels.log" 2>&1
  say "wheels from .whl (rc=$?): $(ls "$REPO/.whl" | tr '\n' ' ')"
  export PYTHONPATH=$OUT/site${PYTHONPATH:+:$PYTHONPATH}
fi
BENCH="$PY -m cupylab.bench"
if [ "${INSTALLED:-0}" = 1 ]; then
  # the bench's result files record the revision, which an installed copy cannot find: the
  # bench's own lookup asked here, in the checkout ("-dirty" when tracked files differ)
  CUPYLAB_GIT_REV=$(cd "$REPO" && $PY -c 'from cupylab.bench._env import git_revision
r, d = git_revision(); print((r + ("-dirty" if d else "")) if r else "")' 2>/dev/null)
  [ -n "$CUPYLAB_GIT_REV" ] && export CUPYLAB_GIT_REV
  $PY -m pip install -q --no-deps --no-build-isolation "$REPO" > "$OUT/install.log" 2>&1
  say "install (rc=$?): regular install of the checkout"
  mkdir -p "$OUT/elsewhere" && cd "$OUT/elsewhere"   # outside the checkout: the installed package
  say "cupylab imported from: $($PY -c 'import cupylab; print(cupylab.__file__)')"
  command -v cupylab-bench >/dev/null && BENCH=cupylab-bench
else
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi
T="$REPO/tests"

if has precompile; then
  cc=$($PY -c 'import cupy; d = cupy.cuda.Device(); print(d.compute_capability)')
  timeout "${T_PRE:-150}" $PY -m cupylab precompile --arch "sm_$cc" --rules "${RULES:-numpy}" \
    --jobs "$JOBS" > "$OUT/precompile.log" 2>&1
  say "precompile (rc=$?): $(tail -n 1 "$OUT/precompile.log")  [$(( $(date +%s) - t0 )) s]"
fi

# -- sanitizer jobs, started in the background next to the tests ---------------------------
san_pids=()
san() {  # san NAME TOOL -k SELECTION FILES...
  local name=$1 tool=$2 sel=$3; shift 3
  local files=()
  for f in "$@"; do files+=("$T/$f"); done
  ( cd "$REPO" && timeout "${T_SAN:-240}" "$SAN" --tool "$tool" --error-exitcode 99 \
      --target-processes all $PY -m pytest -q -p no:cacheprovider "${files[@]}" -k "$sel" \
      > "$OUT/san_$name.log" 2>&1; echo "rc=$?" >> "$OUT/san_$name.log" ) &
  san_pids+=($!)
}
if has sanitizer && command -v "$SAN" >/dev/null 2>&1; then
  san ew_mem memcheck "(cupy or kernels_gpu) and not large and not torch and not jax and not numba and not two_threads and not new_process and not example" \
    test_gpu_elementwise.py test_kernels_gpu.py
  san conf_mem memcheck "(layouts and (float32-float16 or int64-int32 or complex64-float32)) or edge_values or all_scalar" \
    test_gpu_conformance.py
  san row_mem memcheck '(softmax_forward and bfloat16 and (199-33 or 199-1000 or 99-2000 or 2-262144 or 5-65537 or 199-3)) or (norms_forward and float32 and same and (199-31 or 199-1000 or 60-4097 or 5-65537 or 1-300000)) or (norms_forward and bfloat16 and same and (5-65537 or 1-300000)) or (backward_analytic and bfloat16 and (199-33 or 4500-1000 or 30-4097 or 33-4100 or 1-4096 or 5-9000 or 2-70001)) or (cross_entropy and bfloat16 and 0.0 and (199-3 or 2-128256 or 1-300000)) or (softmax_forward and float32 and (5-65537 or 7-40000)) or (cross_entropy and float32 and 0.0 and (3-65537 or 2-128256)) or other_axis or bad_targets or (weight_alignment and bfloat16 and (3000-1000 or 700-4096)) or (one_row_an_sm and bfloat16) or (staged_weights and (5-1001-1-float32 or 16-4096-0-same or 128-33-8 or 3-8192-1-same)) or (few_rows and (4096-contig-bfloat16 or 1025-offset-float32)) or exact_fit' \
    test_rowwise_gpu.py test_rowfew_gpu.py
  san row_race racecheck '(softmax_forward and bfloat16 and (199-33 or 199-1000 or 2-262144 or 60-4097)) or (norms_forward and (float32 or bfloat16) and same and (60-4097 or 5-65537)) or (backward_analytic and (float32 or bfloat16) and (1-1000 or 77-500 or 30-4097 or 5-9000)) or (cross_entropy and bfloat16 and 0.1 and 2-128256) or (softmax_forward and softmax- and float32 and 5-65537) or (cross_entropy and float32 and 0.0 and 2-128256) or (weight_alignment and 3000-1000-0-contig-bfloat16) or (one_row_an_sm and bfloat16 and 33-4) or (staged_weights and bfloat16 and (5-1001-1-float32 or 16-4096-0-same or 128-33-8-same)) or (few_rows and (4096-contig-bfloat16 or 2048-offset-float16)) or (exact_fit and bfloat16)' \
    test_rowwise_gpu.py test_rowfew_gpu.py
  san ceb_mem memcheck '(reductions and (bfloat16 or float64) and (199-33 or 9-4097 or 2-128256 or 1-300000 or 1-1)) or alignment or broadcast or ignored' \
    test_cross_entropy_backward_gpu.py
  san ceb_race racecheck 'reductions and bfloat16 and (contig or offset) and (9-4097 or 2-128256)' \
    test_cross_entropy_backward_gpu.py
  san rn_mem memcheck '(test_forward and bfloat16 and (1-4 or 7-64 or 65-512 or 9-1000 or 2-8192 or 2-8200)) or (test_backward and bfloat16 and (0-8 or 7-64 or 65-512 or 3-4096 or 2-8200)) or inplace or errors or empty_rows or dispatch or torch or lean or broadcast' \
    test_resnorm_gpu.py
  san rn_race racecheck '(test_forward and contig and bfloat16 and (33-256 or 65-512 or 5-2048 or 2-8192)) or (test_backward and contig and float32 and (7-64 or 65-512 or 3-4096 or 2-8192 or 2-8200))' \
    test_resnorm_gpu.py
  # not numba: numba-cuda's driver bindings probe entry points this driver lacks, which
  # memcheck reports as API errors (cuGetProcAddress_v2) that are not cupylab's. Not
  # cache_hits: its arrays outlive their last reference only under the sanitizer (0 memcheck
  # errors; two lists refer to them there; cause not found) - it runs in the plain suite.
  # Not another_stream: it needs two streams' kernels to run at once, and the sanitizer runs
  # kernels one at a time (under memcheck its held stream's kernel ran to its 20 s bail-out
  # before the other stream's work could start; 0 errors) - it runs in the plain suite.
  san mt_mem memcheck "not torch and not large and not 5000 and not jax and not mixed and not reallocated and not 300 and not numba and not cache_hits and not another_stream" \
    test_multi_tensor_gpu.py
  san mt_race racecheck "norms_and_clip and cupy and float32" test_multi_tensor_gpu.py
  say "sanitizer: ${#san_pids[@]} jobs started  [$(( $(date +%s) - t0 )) s]"
fi

if has tests; then
  par=(-q)
  # -v (and no -q, which would cancel it) with xdist: one line per test as it finishes, so a
  # run cut short by its time cap still names what failed
  $PY -c 'import xdist' 2>/dev/null && par=(-n "${TEST_JOBS:-$(( JOBS > 12 ? 12 : JOBS ))}" -v)
  # the slow tests (every kernel template compiled for three architectures, a wheel built) are
  # CPU work that CI runs; here the precompile step compiles every instance for this GPU, and
  # the compile tests, landing on one worker at the end, ran past the time cap (2026-12-06).
  # SLOW=1 keeps them; a -m of PYTEST_ARGS, coming after, replaces this one
  [ "${SLOW:-0}" = 1 ] || par+=(-m "not slow")
  timeout "${T_TESTS:-300}" $PY -m pytest -p no:cacheprovider -rsfE "${par[@]}" "$T" "${PARGS[@]}" \
    > "$OUT/pytest.log" 2>&1
  say "pytest, all tests (rc=$?): $(tail -n 1 "$OUT/pytest.log")  [$(( $(date +%s) - t0 )) s]"
  say "  $(grep -cE " PASSED " "$OUT/pytest.log") passed, $(grep -cE " FAILED " "$OUT/pytest.log") failed, $(grep -cE " SKIPPED " "$OUT/pytest.log") skipped (per-test lines)"
  # pytest's short summary first (-rfE: each failure with its message), then the per-test lines
  { grep -E "^(FAILED|ERROR) " "$OUT/pytest.log"; grep -E " FAILED | ERROR " "$OUT/pytest.log"; } \
    | head -n 40 | tee -a "$OUT/summary.txt"
fi

if [ ${#san_pids[@]} -gt 0 ]; then
  wait "${san_pids[@]}"
  for f in "$OUT"/san_*.log; do
    say "$(basename "$f" .log) ($(tail -n 1 "$f")): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | sort | uniq -c | tr -s ' ' | tr '\n' ';') $(grep -E '[0-9]+ (passed|failed)' "$f" | tail -n 1)"
  done
  say "  [$(( $(date +%s) - t0 )) s]"
fi

if has overhead; then
  timeout "${T_BENCH:-90}" $BENCH overhead --json "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
  say "overhead (rc=$?):"; grep -vE "^\s*$" "$OUT/overhead.log" | tail -n 40 | tee -a "$OUT/summary.txt"
fi
if has mixed; then
  timeout "${T_BENCH:-90}" $BENCH run add --framework cupy --peers cupy,torch \
    --dtype float32,float32+float16,int64+int32,int32+float32 --size 2^24,2^26 \
    --json "$OUT/bench-mixed.json" > "$OUT/bench-mixed.log" 2>&1
  say "mixed-dtype add (rc=$?):"; grep -vE "^\s*$" "$OUT/bench-mixed.log" | tail -n 14 | tee -a "$OUT/summary.txt"
fi
if has rowbench; then
  timeout "${T_BENCH:-90}" $BENCH run softmax rms_norm layer_norm -d bfloat16 -s 8192x8192 \
    -s 32768x1024 --peers torch -r 5 -q --json "$OUT/bench-rowwise.json" > "$OUT/bench-rowwise.log" 2>&1
  say "row-wise (rc=$?):"; grep -vE "^\s*$" "$OUT/bench-rowwise.log" | tail -n 10 | tee -a "$OUT/summary.txt"
fi
if has mtbench; then
  timeout "${T_BENCH:-90}" $PY -m cupylab.bench.multi_tensor --quick --json "$OUT/bench-mt.json" \
    > "$OUT/bench-mt.log" 2>&1
  say "multi-tensor (rc=$?):"; grep -E "^case=" "$OUT/bench-mt.log" | tee -a "$OUT/summary.txt"
fi
say "done  [$(( $(date +%s) - t0 )) s]"
