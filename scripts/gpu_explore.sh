#!/usr/bin/env bash
# One device session's measurements for issues 3 and 4, from a plain checkout:
#   cli      a regular (non-editable) pip install of this checkout into a fresh prefix, then
#            its `cupylab-bench` console script's quick suite, run from another directory;
#   explore  scripts/explore_launch.py (launch-shape experiments beside torch);
#   ncu      Nsight Compute on torch's and cupylab's elementwise kernels;
#   ncu16    the same for bf16/fp32 add at 2^26 with the cache-policy variants (traffic, stalls);
#   ncuocc   ew_contig add at 2^26 uncapped and capped (occupancy, DRAM throughput);
#   ncuhot   fp64/fp32 add on L2-resident 48 MB operands: torch, uncapped, capped (L2 hit rate);
#   ncuhot2  the hot2 variants back to back on one buffer set, application replay, L2 not
#            flushed (DRAM bytes read per call in steady state);
#   ncurange 50 calls per profiler range (app-range replay, L2 not flushed): DRAM bytes per
#            call, hot and cold, at 48 MB per call (the time includes the profiler's work);
#   sweep    scripts/bench_sweep.sh with the installed console script (needs cli);
#   host     scripts/host_profile.py (where the host time of a small call goes);
#   medium   the installed console script at every power 2^20..2^23, float dtypes, beside torch,
#            7 repeats (the L2-resident range of issue 4's medium-size target).
# Usage: scripts/gpu_explore.sh OUTDIR   (STEPS picks steps; logs and results.tgz in OUTDIR)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out}; mkdir -p "$OUT/r"; OUT=$(cd "$OUT" && pwd); ROOT=$PWD
export PYTHONUNBUFFERED=1 CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-/tmp/clc}
STEPS=${STEPS:-cli explore ncu}
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
PFX=/tmp/clprefix
SITE=$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '$PFX', 'platbase': '$PFX'}))")
if has cli; then
  python3 -m pip install -q --no-deps --no-build-isolation --prefix "$PFX" . > "$OUT/r/cli_install.log" 2>&1
  echo "install rc=$?"
  (cd /tmp && export PYTHONPATH=$SITE && ls -l "$PFX/bin/cupylab-bench" && \
    python3 -c "import cupylab; print('cupylab from', cupylab.__file__)" && \
    time "$PFX/bin/cupylab-bench") > "$OUT/cli_quick.log" 2>&1
  echo "cli rc=$?"; cat "$OUT/cli_quick.log"
fi
if has explore; then
  PYTHONPATH=$PWD python3 scripts/explore_launch.py ${EXPLORE:-} > "$OUT/explore.log" 2>&1
  echo "explore rc=$?"; cat "$OUT/explore.log"
fi
run_ncu() {  # run_ncu NAME MODE METRICS [NCU OPTION...]: Nsight Compute over `explore_launch.py MODE`
  PYTHONPATH=$ROOT ncu --clock-control none "${@:4}" --csv --metrics "$3" \
    python3 scripts/explore_launch.py "$2" > "$OUT/r/$1.csv" 2> "$OUT/r/$1.err"
  echo "$1 rc=$?"
  python3 - "$OUT/r/$1.csv" <<'PY' > "$OUT/$1.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]
iK, iM, iV, iID = (hdr.index(k) for k in ("Kernel Name", "Metric Name", "Metric Value", "ID"))
by = {}
for r in rows[1:]:
    if not any(t in r[iK] for t in ("cl::", "clx::", "CUDAFunctor", "BinaryFunctor")):
        continue  # torch's input generation and copies
    by.setdefault((int(r[iID]), r[iK][:48]), {})[r[iM]] = r[iV]
for (i, k), m in sorted(by.items()):
    print(i, k, " ".join(f"{n.split('__', 1)[1][:40]}={v}" for n, v in sorted(m.items())))
PY
  cat "$OUT/$1.txt"
}
if has ncu; then
  run_ncu ncu --ncu launch__grid_size,launch__block_size,launch__registers_per_thread,\
gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes.sum,\
smsp__inst_executed.sum
fi
if has ncuocc; then
  run_ncu ncuocc --ncuocc launch__grid_size,launch__block_size,launch__shared_mem_per_block_dynamic,\
launch__occupancy_limit_shared_mem,gpu__time_duration.sum,dram__bytes_read.sum,\
dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__warps_active.avg.pct_of_peak_sustained_active
fi
if has ncuhot; then
  # L2-resident medium operands (48 MB per call): the L2 is not flushed between kernels
  run_ncu ncuhot --ncuhot launch__grid_size,launch__block_size,launch__shared_mem_per_block_dynamic,\
gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,\
lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,smsp__inst_executed.sum,\
sm__warps_active.avg.pct_of_peak_sustained_active --cache-control none
fi
if has ncuhot2; then
  # one pass per application run, no memory save/restore: each kernel sees the L2 that the
  # previous kernel left
  run_ncu ncuhot2 --ncuhot2 launch__grid_size,launch__block_size,launch__registers_per_thread,\
launch__waves_per_multiprocessor,gpu__time_duration.sum,dram__bytes_read.sum,\
dram__bytes_write.sum,lts__t_sector_hit_rate.pct --cache-control none --replay-mode application
fi
if has ncurange; then
  for mode in app-range range; do
    PYTHONPATH=$ROOT ncu --clock-control none --cache-control none --replay-mode $mode --csv --print-units base \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      python3 scripts/explore_launch.py --ncurange > "$OUT/r/ncurange.csv" 2> "$OUT/r/ncurange.err"
    rc=$?; echo "ncurange ($mode) rc=$rc"; [ $rc = 0 ] && break
  done
  python3 - "$OUT/r/ncurange.csv" "$OUT/r/ncurange.err" <<'PY' > "$OUT/ncurange.txt"
import csv, sys
labels = [l.split("range: ", 1)[1].strip() for l in open(sys.argv[2]) if l.startswith("range: ")]
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
hdr = rows[0]
iID, iM, iV = (hdr.index(k) for k in ("ID", "Metric Name", "Metric Value"))
by = {}
for r in rows[1:]:
    by.setdefault(int(r[iID]), {})[r[iM]] = r[iV].replace(",", "")
print("range  label  |  us per call (with the profiler's work)  |  DRAM read MB per call  |  "
      "DRAM write MB per call")
for k, (i, m) in enumerate(sorted(by.items())):
    lab = labels[k] if k < len(labels) else "?"
    t = float(m.get("gpu__time_duration.sum", "nan")) / 50 / 1e3
    rd = float(m.get("dram__bytes_read.sum", "nan")) / 50 / 1e6
    wr = float(m.get("dram__bytes_write.sum", "nan")) / 50 / 1e6
    print(f"{i:3d} {lab:34s} {t:8.2f} {rd:8.2f} {wr:8.2f}")
PY
  cat "$OUT/ncurange.txt"; head -c 1500 "$OUT/r/ncurange.csv"; grep -v "^range: " "$OUT/r/ncurange.err" | tail -5
fi
if has ncu16; then
  # bf16/fp32 add at 2^26: torch, ew_contig, x_hint variants; DRAM and L2 traffic, stalls
  run_ncu ncu16 --ncu16 launch__grid_size,launch__block_size,launch__registers_per_thread,\
gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_read.sum,\
lts__t_sectors_op_write.sum,lts__t_sector_hit_rate.pct,smsp__inst_executed.sum,\
sm__warps_active.avg.pct_of_peak_sustained_active,\
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_drain_per_issue_active.ratio
fi
if has sweep; then
  (export PYTHONPATH=$SITE; cd /tmp && BENCH="$PFX/bin/cupylab-bench" REPEAT=${REPEAT:-3} \
    PEERS=${PEERS:-torch,cupy} bash "$ROOT/scripts/bench_sweep.sh" "$OUT/r/sweep") \
    > "$OUT/sweep_run.log" 2>&1
  echo "sweep rc=$?"; grep -E "^\+|exit|done" "$OUT/sweep_run.log"
fi
if has medium; then
  (export PYTHONPATH=$SITE; cd /tmp && "$PFX/bin/cupylab-bench" run \
    --dtype float16,bfloat16,float32,float64 --size '2^20..2^23' --framework torch \
    --peers torch --repeat 7 --json "$OUT/r/medium.json") > "$OUT/r/medium.log" 2>&1
  echo "medium rc=$?"; cat "$OUT/r/medium.log"
fi
if has host; then
  (cd scripts && PYTHONPATH=$ROOT python3 host_profile.py) > "$OUT/r/host_profile.log" 2>&1
  echo "host rc=$?"; cat "$OUT/r/host_profile.log"
fi
tar czf "$OUT/results.tgz" -C "$OUT/r" . && rm -rf "$OUT/r"
