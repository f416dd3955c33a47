"""Registers and spills of cupylab's kernel instances, as ptxas reports them. Needs no GPU.

Compiles a family's programs through NVRTC with ``--ptxas-options=-v`` for one architecture
and prints, per kernel instance, the registers a thread uses and the bytes of spill stores and
loads. A kernel whose ``__launch_bounds__`` caps its registers below what it needs spills to
local memory, which costs load/store bandwidth on the GPU; docs/tuning.md cites this report for
the 16-bit norm backwards.

Usage (from the repository root)::

    python scripts/ptxas_report.py rowwise [--arch sm_90] [--match REGEX] [--spills]
    python scripts/ptxas_report.py elementwise|multi_tensor|resnorm ...

``--match`` keeps the name expressions that match a regular expression (e.g.
``'bf16_t, 1[23],'`` for the bfloat16 norm backwards); ``--spills`` prints only instances
that spill. Compiling every row-wise instance takes a few minutes on two CPU cores.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupylab import _compile  # noqa: E402

_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _programs(family):
    if family == "rowwise":
        from cupylab.ops import _rowcore as m
    elif family == "elementwise":
        from cupylab.ops import elementwise as m
    elif family == "multi_tensor":
        from cupylab.ops import _mt_plan as m
    elif family == "resnorm":
        from cupylab.ops import resnorm as m
    else:
        raise SystemExit(f"ptxas_report: unknown family {family!r} "
                         "(rowwise, elementwise, multi_tensor or resnorm)")
    return m.all_programs()


def report(program, arch, match=None):
    """``[(name expression, registers, spill store bytes, spill load bytes)]`` for the
    instances of ``program`` whose name matches ``match`` (all when None)."""
    names = [n for n in program.name_expressions if match is None or re.search(match, n)]
    if not names:
        return []
    subset = _compile.Program(program.source, program.filename, names, program.options,
                              program.include_dirs)
    log, lowered = subset.run_nvrtc(
        [f"-arch={arch}", "--ptxas-options=-v"],
        lambda nvrtc, prog: (nvrtc.getProgramLog(prog),
                             {nvrtc.getLoweredName(prog, n): n for n in names}))
    rows, current, spill = {}, None, (0, 0)
    for line in log.splitlines():
        if "Compiling entry function" in line:
            current, spill = lowered.get(line.split("'")[1]), (0, 0)
        elif current is not None and (m := _SPILL.search(line)):
            spill = (int(m.group(1)), int(m.group(2)))
        elif current is not None and (m := _USED.search(line)):
            rows[current] = (int(m.group(1)), *spill)
    return [(n, *rows[n]) for n in names if n in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=("rowwise", "elementwise", "multi_tensor", "resnorm"))
    ap.add_argument("--arch", default="sm_90", help="NVRTC target (default sm_90)")
    ap.add_argument("--match", help="regular expression on the name expressions")
    ap.add_argument("--spills", action="store_true", help="only instances that spill")
    a = ap.parse_args(argv)
    print(f"{'kernel instance':60s} {'regs':>5s} {'spill st':>9s} {'spill ld':>9s}")
    for program in _programs(a.family):
        for name, regs, st, ld in report(program, a.arch, a.match):
            if st or ld or not a.spills:
                print(f"{name:60s} {regs:5d} {st:9d} {ld:9d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
