# Sourced by the bench scripts (bench_sweep.sh, bench_rowwise.sh): checks the one OUTDIR
# argument and creates it (OUT), and picks the bench command (array B): $BENCH when set, else
# cupylab-bench when installed, else python -m cupylab.bench. Exits 2 on bad usage.
if [ $# -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT" || exit 2
if [ -n "${BENCH:-}" ]; then
    read -r -a B <<<"$BENCH"
elif command -v cupylab-bench >/dev/null 2>&1; then
    B=(cupylab-bench)
else
    B=(python -m cupylab.bench)
fi
