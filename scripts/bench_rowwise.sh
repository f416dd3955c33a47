#!/usr/bin/env bash
# The row-wise family's benchmark, for docs/perf.md: every row-wise operator beside torch eager
# and torch.compile (static shapes) in one process per group, at the shapes of issue #15:
#
#   rowwise_bf16.json   forwards, bfloat16, 4096x4096, 8192x8192, 32768x1024, 1024x65536,
#                       16384x131072
#   rowwise_fp32.json   forwards, float32, the same shapes with 16384x32768 as the largest
#   rowwise_bwd.json    backwards (softmax, log_softmax, rms_norm, layer_norm), bfloat16 and
#                       float32, 8192x8192 and 32768x1024
#   rowwise_small.json  forwards, bfloat16, decoding shapes 16x4096 and 128x4096, with the
#                       weighted norms (rms_norm_w, layer_norm_wb) beside
#   rowwise_ce.json     cross-entropy with its gradient written in the forward, bfloat16,
#                       8192x128256 (a 128k vocabulary)
#
#   scripts/bench_rowwise.sh OUTDIR
#
# To refresh docs/perf.md: copy the five JSON files into docs/perf/ and run
# python scripts/make_perf_md.py. BENCH overrides the command (default cupylab-bench, else
# python -m cupylab.bench); REPEAT the timed repetitions (default 5); SETS picks the runs
# (default "bf16 fp32 bwd small ce"; each takes minutes with the torch.compile peers, so a
# device with a per-command limit can take them in two calls, e.g. SETS="bf16 fp32" then
# SETS="bwd small ce" into the same OUTDIR). Exit code: the largest exit code of the runs (1: a
# case FAILED or raised), 2 for an unknown set.
set -u
. "$(dirname "$0")/bench_args.sh"  # OUT, B
FWD=(softmax log_softmax rms_norm layer_norm add_rms_norm)
BWD=(softmax_backward log_softmax_backward rms_norm_backward layer_norm_backward)
COMMON=(--framework torch --peers torch,torch.compile -r "${REPEAT:-5}" -q)
worst=0
SETS=${SETS:-bf16 fp32 bwd small ce}
for set in $SETS; do
    case $set in
        bf16|fp32|bwd|small|ce) ;;
        *) echo "$0: unknown set '$set' in SETS (bf16 fp32 bwd small ce)" >&2; exit 2 ;;
    esac
done
run() {  # run NAME ARGS...: the set NAME (rowwise_<set>) when SETS names it
    local name=$1; shift
    case " $SETS " in *" ${name#rowwise_} "*) ;; *) return 0 ;; esac
    echo "${B[*]} run $* ${COMMON[*]} --json $name.json" >> "$OUT/commands.txt"
    "${B[@]}" run "$@" "${COMMON[@]}" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name (rc=$rc)"; grep -vE "^\s*$" "$OUT/$name.log"
    [ $rc -gt $worst ] && worst=$rc
}
touch "$OUT/commands.txt"  # appended to: a second call with other SETS adds its commands
run rowwise_bf16 "${FWD[@]}" -d bfloat16 -s 4096x4096 -s 8192x8192 -s 32768x1024 \
    -s 1024x65536 -s 16384x131072
run rowwise_fp32 "${FWD[@]}" -d float32 -s 4096x4096 -s 8192x8192 -s 32768x1024 \
    -s 1024x65536 -s 16384x32768
run rowwise_bwd "${BWD[@]}" -d bfloat16,float32 -s 8192x8192 -s 32768x1024
run rowwise_small "${FWD[@]}" rms_norm_w layer_norm_wb -d bfloat16 -s 16x4096 -s 128x4096
run rowwise_ce cross_entropy -d bfloat16 -s 8192x128256
exit $worst
