#!/usr/bin/env bash
# The row-wise family's benchmark, for docs/perf.md: every row-wise operator beside torch eager
# and torch.compile (static shapes) in one process per group, at the shapes of issue #15:
#
#   rowwise_bf16.json   forwards, bfloat16, 4096x4096, 8192x8192, 32768x1024, 1024x65536,
#                       16384x131072
#   rowwise_fp32.json   forwards, float32, the same shapes with 16384x32768 as the largest
#   rowwise_bwd.json    backwards (softmax, log_softmax, rms_norm, layer_norm), bfloat16 and
#                       float32, 8192x8192 and 32768x1024
#   rowwise_small.json  forwards, bfloat16, decoding shapes 16x4096 and 128x4096
#   rowwise_ce.json     cross-entropy with its gradient written in the forward, bfloat16,
#                       8192x128256 (a 128k vocabulary)
#
#   scripts/bench_rowwise.sh OUTDIR
#
# To refresh docs/perf.md: copy the five JSON files into docs/perf/ and run
# python scripts/make_perf_md.py. BENCH overrides the command (default cupylab-bench, else
# python -m cupylab.bench); REPEAT the timed repetitions (default 5). Exit code: the largest
# exit code of the five runs (1: a case FAILED or raised).
set -u
. "$(dirname "$0")/bench_args.sh"  # OUT, B
FWD=(softmax log_softmax rms_norm layer_norm add_rms_norm)
BWD=(softmax_backward log_softmax_backward rms_norm_backward layer_norm_backward)
COMMON=(--framework torch --peers torch,torch.compile -r "${REPEAT:-5}" -q)
worst=0
run() {  # run NAME ARGS...
    local name=$1; shift
    echo "${B[*]} run $* ${COMMON[*]} --json $name.json" >> "$OUT/commands.txt"
    "${B[@]}" run "$@" "${COMMON[@]}" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name (rc=$rc)"; grep -vE "^\s*$" "$OUT/$name.log"
    [ $rc -gt $worst ] && worst=$rc
}
: > "$OUT/commands.txt"
run rowwise_bf16 "${FWD[@]}" -d bfloat16 -s 4096x4096 -s 8192x8192 -s 32768x1024 \
    -s 1024x65536 -s 16384x131072
run rowwise_fp32 "${FWD[@]}" -d float32 -s 4096x4096 -s 8192x8192 -s 32768x1024 \
    -s 1024x65536 -s 16384x32768
run rowwise_bwd "${BWD[@]}" -d bfloat16,float32 -s 8192x8192 -s 32768x1024
run rowwise_small "${FWD[@]}" -d bfloat16 -s 16x4096 -s 128x4096
run rowwise_ce cross_entropy -d bfloat16 -s 8192x128256
exit $worst
