#!/usr/bin/env bash
# Device session of 2026-12-02 (issues 3 and 4): the installed console script's quick suite
# from a clean install, the launch-shape experiments, and Nsight Compute on torch's and
# cupylab's kernels. Usage: scripts/gpu_explore.sh OUTDIR   (STEPS picks: cli explore ncu)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUPYLAB_CACHE_DIR=${CUPYLAB_CACHE_DIR:-/tmp/clc}
STEPS=${STEPS:-cli explore ncu}
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
if has cli; then
  # a fresh venv that sees the image's CuPy/torch, a regular (non-editable) install of this
  # checkout, run from another directory so the checkout is not on the path
  python3 -m venv --system-site-packages /tmp/clvenv && \
    /tmp/clvenv/bin/python -m pip install -q --no-deps --no-build-isolation . > "$OUT/cli_install.log" 2>&1
  (cd /tmp && command -v /tmp/clvenv/bin/cupylab-bench && \
    /tmp/clvenv/bin/python -c "import cupylab, sys; print(cupylab.__file__)" && \
    time /tmp/clvenv/bin/cupylab-bench) > "$OUT/cli_quick.log" 2>&1
  echo "cli rc=$?"; tail -n 40 "$OUT/cli_quick.log"
fi
if has explore; then
  PYTHONPATH=$PWD python3 scripts/explore_launch.py ${EXPLORE:-} > "$OUT/explore.log" 2>&1
  echo "explore rc=$?"; cat "$OUT/explore.log"
fi
if has ncu; then
  PYTHONPATH=$PWD ncu --clock-control none --csv --metrics \
launch__grid_size,launch__block_size,launch__registers_per_thread,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_registers,dram__bytes.sum,smsp__inst_executed.sum \
    python3 scripts/explore_launch.py --ncu > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
  echo "ncu rc=$?"; tail -n 3 "$OUT/ncu.err"
  python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; iK, iM, iV = hdr.index("Kernel Name"), hdr.index("Metric Name"), hdr.index("Metric Value")
iID = hdr.index("ID")
by = {}
for r in rows[1:]:
    by.setdefault((int(r[iID]), r[iK][:60]), {})[r[iM]] = r[iV]
for (i, k), m in sorted(by.items()):
    print(i, k, " ".join(f"{n.split('__')[1][:28]}={v}" for n, v in sorted(m.items())))
PY
fi
