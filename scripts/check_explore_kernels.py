"""Correctness of the experiment kernel x_gs (scripts/explore_launch.cu) that the hot2/hot3 and
ncurange timings rely on: every element written once with a + b, nothing written past the end,
for odd vector counts, every chunk shift, both forms (LEAN or not) and 1, 2 or 4 vectors in
flight. CuPy only (no torch), so that it runs quickly under compute-sanitizer memcheck:

    compute-sanitizer --tool memcheck --error-exitcode 99 python3 scripts/check_explore_kernels.py

Exits 1 on a wrong result.
"""
import sys
from pathlib import Path

import cupy as cp
import numpy as np

from cupylab import _compile, _dtypes, _launch

HERE = Path(__file__).resolve().parent
SMS = cp.cuda.Device().attributes["MultiProcessorCount"]


def main():
    bad = 0
    cases = 0
    for dname in ("float64", "float32", "float16"):
        dt = _dtypes.DTYPES[dname]
        npdt = np.dtype(dt.typestr)
        V = 16 // dt.itemsize
        shapes = [(u, lean) for u in (1, 2, 4) for lean in ("true", "false")]
        names = [f"clx::x_gs<{dt.ctype}, 0, {u}, {lean}>" for u, lean in shapes]
        prog = _compile.Program.from_file(HERE / "explore_launch.cu", names,
                                          include_dirs=[_compile.cuda_src_dir()])
        for name, (u, _) in zip(names, shapes):
            k = _launch.Kernel(prog, name, ["Q", "Q", "Q", "q", "I"])
            for nvec in (1, 255, 257, SMS * 8 * 256 * u + 17, 1 << 18):
                n = nvec * V
                rng = np.random.default_rng(nvec)
                a = cp.asarray(rng.standard_normal(n).astype(npdt))
                b = cp.asarray(rng.standard_normal(n).astype(npdt))
                # one guard vector past the end must stay untouched
                out = cp.full(n + V, 7, dtype=npdt)
                acc = np.float32 if npdt == np.float16 else npdt  # the kernel's arithmetic
                ref = (a.astype(acc) + b.astype(acc)).astype(npdt)
                for grid in (1, 3, SMS * 8):
                    for shift in sorted({0, grid // 2, grid - 1}):
                        out[:n] = 0
                        k.launch(0, grid, 256, 0, (out.data.ptr, a.data.ptr, b.data.ptr, nvec,
                                                   shift))
                        cases += 1
                        ok = bool(cp.array_equal(out[:n], ref)) and bool((out[n:] == 7).all())
                        if not ok:
                            bad += 1
                            print(f"WRONG {name} nvec={nvec} grid={grid} shift={shift}")
    cp.cuda.runtime.deviceSynchronize()
    print(f"x_gs: {cases} cases, {bad} wrong")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
