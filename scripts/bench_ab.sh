#!/usr/bin/env bash
# A/B of two source trees of cupylab on one GPU, for a kernel or host-path change: the same
# `cupylab-bench run` arguments on tree A, then B, then A, then B (ROUNDS rounds, default 2),
# each in its own process with its own kernel cache, so that clock and thermal drift show up
# as A-to-A differences rather than as a verdict. Writes OUTDIR/a_<k>.json and b_<k>.json; the
# last round's pair, copied to docs/perf/<name>_before.json / <name>_after.json, is what
# scripts/make_perf_md.py turns into an A/B table (on docs/tuning.md).
#
#   git archive REV_A | (mkdir -p out/a && tar -x -C out/a)     # the trees, made where git is
#   git archive REV_B | (mkdir -p out/b && tar -x -C out/b)
#   git rev-parse --short REV_A > out/a/.rev; git rev-parse --short REV_B > out/b/.rev
#   scripts/bench_ab.sh OUTDIR out/a out/b rms_norm -d bfloat16 -s 32768x1024 --peers torch -r 5 -q
#   ROUNDS=3 scripts/bench_ab.sh OUTDIR out/a out/b overhead      # host cost: `cupylab-bench overhead`
#
# Arguments after the trees go to `cupylab-bench run`, or to `cupylab-bench overhead` when the
# first of them is `overhead`.
# A GPU machine without git gets the trees carried with the checkout. PYTHON picks the
# interpreter (default python3); ROUNDS the rounds. Exit code: the largest of the runs'.
set -u
if [ $# -lt 4 ]; then
    echo "usage: $0 OUTDIR TREE_A TREE_B [overhead] BENCH-ARGS..." >&2
    exit 2
fi
OUT=$1 A=$(cd "$2" && pwd) B=$(cd "$3" && pwd)
shift 3
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$OUT"  # not from a checkout: `python -m` would import the cupylab of the current folder
PY=${PYTHON:-python3}
if [ "$1" = overhead ]; then cmd=("$@"); else cmd=(run "$@"); fi
worst=0
for k in $(seq 1 "${ROUNDS:-2}"); do
    for arm in a b; do
        tree=$A
        [ $arm = b ] && tree=$B
        # the revision the results record: the tree's .rev, else its folder's name (an
        # exported tree has no .git; the checkout around it is not its revision)
        rev=$(cat "$tree/.rev" 2>/dev/null || echo "tree:$(basename "$tree")")
        CUPYLAB_GIT_REV=$rev CUPYLAB_CACHE_DIR=$OUT/cache_$arm \
            PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} \
            "$PY" -m cupylab.bench "${cmd[@]}" --json "$OUT/${arm}_$k.json" > "$OUT/${arm}_$k.log" 2>&1
        rc=$?
        echo "round $k, $arm ($tree): rc=$rc"
        grep -vE "^\s*$" "$OUT/${arm}_$k.log" | tail -n 40
        [ $rc -gt $worst ] && worst=$rc
    done
done
exit $worst
