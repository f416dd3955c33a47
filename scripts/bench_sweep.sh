#!/usr/bin/env bash
# The full cupylab-bench sweep, for docs/perf.md: every registered operator x every dtype x
# sizes 2^10 .. 2^28 (every second power of two: 2^10, 2^12, ..., 2^28 -- ten sizes, 360 cases
# for the six elementwise operators), torch inputs, peers torch eager, CuPy and JAX (those
# installed); then fused_add_mul against torch.compile at the large sizes, the ceiling and the
# host overhead per call. Aims at about 5 minutes on an H200.
#
#   scripts/bench_sweep.sh OUTDIR
#
# Writes under OUTDIR:
#   sweep.json sweep.csv sweep.png sweep.log        the full sweep (and its plot)
#   fusion.json fusion.csv fusion.log               fused_add_mul with --compile, 2^24..2^28
#   overhead.json overhead.csv overhead.log         host cost per call
#   sweep.md                                        the sweep and fusion tables in Markdown
#   commands.txt                                    the exact commands, for docs/perf.md
#
# To refresh docs/perf.md: copy sweep.json, fusion.json, overhead.json and sweep.png into
# docs/perf/ and commands.txt to docs/perf/sweep_commands.txt, then run
# python scripts/make_perf_md.py (it rewrites the page's tables from those files).
#
# Environment overrides: BENCH (command, default cupylab-bench, else python -m cupylab.bench),
# SIZES (default 2^10..2^28:2; 2^10..2^28 for every power), DTYPES (all), REPEAT (5),
# FRAMEWORK (torch), PEERS (torch,cupy,jax), FUSION_SIZES (2^24,2^26,2^28).
# Exit code: 0 when every step succeeded, else the largest step exit code (1: a case FAILED or
# raised; 2: bad arguments or no GPU). Every step runs even if an earlier one failed.
set -u

. "$(dirname "$0")/bench_args.sh"  # OUT, B
SIZES=${SIZES:-2^10..2^28:2}
DTYPES=${DTYPES:-all}
REPEAT=${REPEAT:-5}
FRAMEWORK=${FRAMEWORK:-torch}
PEERS=${PEERS:-torch,cupy,jax}
FUSION_SIZES=${FUSION_SIZES:-2^24,2^26,2^28}

: >"$OUT/commands.txt"
worst=0
step() {  # step LOGFILE ARGS...: run "${B[@]}" ARGS, tee to LOGFILE, remember the exit code
    local log=$1
    shift
    echo "+ ${B[*]} $*" | tee -a "$OUT/commands.txt"
    "${B[@]}" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    echo "  -> exit $rc"
    if [ "$rc" -gt "$worst" ]; then worst=$rc; fi
}

t0=$(date +%s)
step "$OUT/sweep.log" run --dtype "$DTYPES" --size "$SIZES" --framework "$FRAMEWORK" \
    --peers "$PEERS" --repeat "$REPEAT" --json "$OUT/sweep.json" --csv "$OUT/sweep.csv"
step "$OUT/fusion.log" run fused_add_mul --compile --dtype float32,bfloat16 \
    --size "$FUSION_SIZES" --framework "$FRAMEWORK" --peers "$PEERS" --repeat 7 \
    --json "$OUT/fusion.json" --csv "$OUT/fusion.csv"
step "$OUT/overhead.log" overhead --json "$OUT/overhead.json" --csv "$OUT/overhead.csv"
if [ -f "$OUT/sweep.json" ]; then
    step "$OUT/plot.log" plot "$OUT/sweep.json" -o "$OUT/sweep.png" --peer torch
    {
        echo "## Full sweep"
        echo
        "${B[@]}" show --markdown "$OUT/sweep.json"
        if [ -f "$OUT/fusion.json" ]; then
            echo
            echo "## fused_add_mul against torch.compile"
            echo
            "${B[@]}" show --markdown "$OUT/fusion.json"
        fi
        if [ -f "$OUT/overhead.json" ]; then
            echo
            echo "## Host cost per call"
            echo
            "${B[@]}" show --markdown "$OUT/overhead.json"
        fi
    } >"$OUT/sweep.md"
fi
echo "bench_sweep: done in $(( $(date +%s) - t0 )) s; results in $OUT (worst exit code $worst)"
exit "$worst"
