"""Time compile-time variants of the vectorised elementwise kernel (unroll for 16-bit types,
unroll for the rest, minimum blocks per SM) at 2^26 elements, beside torch, in one process.
Prints µs, GB/s and the ratio to torch per variant; the registers and spills the compiler chose
for each are recorded in docs/perf.md (cuobjdump -res-usage on the cubin).

Usage: python scripts/tune_elementwise.py
"""
import itertools

import torch

from cupylab import _compile, _dtypes, _launch

from _gpu_timing import gpu_us

N = 1 << 26


def variant_kernel(dt, op, u16, u, minb):
    src = (_compile.cuda_src_dir() / "elementwise.cu")
    name = f"cl::ew_contig<{dt.ctype}, {op}, {16 // dt.itemsize}>"
    prog = _compile.Program.from_file(src, [name], options=(
        f"-DCL_UNROLL16={u16}", f"-DCL_UNROLL={u}", f"-DCL_MIN_BLOCKS={minb}"))
    t = dt.fmt
    return _launch.Kernel(prog, name, ["Q", "Q", "Q", "Q", t, t, t, "q", "q"])


for tname, dname in (("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "float16")):
    tdt = getattr(torch, tname)
    dt = _dtypes.DTYPES[dname]
    a, b, s = (torch.randn(N, device="cuda").to(tdt) for _ in range(3))
    d = torch.empty_like(a)
    nbytes = {0: 3, 4: 4}
    t_add = gpu_us(lambda: torch.add(a, b, out=d), reps=7)
    t_fam = gpu_us(lambda: torch.mul(torch.add(a, b), s, out=d), reps=7)
    print(f"{tname}: torch add {t_add:.1f} us ({3 * N * a.element_size() / t_add / 1e3:.0f} GB/s), "
          f"torch (a+b)*s {t_fam:.1f} us")
    for u, minb in itertools.product([1, 2, 4, 8] if dt.itemsize == 2 else [2, 4, 8], [1, 2, 3, 4]):
        u16, uo = (u, 4) if dt.itemsize == 2 else (2, u)
        for op in (0, 4):
            k = variant_kernel(dt, op, u16, uo, minb)
            nvec = N // (16 // dt.itemsize)
            grid = -(-nvec // (256 * u))
            args = (d.data_ptr(), a.data_ptr(), b.data_ptr(), s.data_ptr() if op == 4 else 0,
                    0, 0, 0, N, 0)
            us = gpu_us(lambda: k.launch(0, grid, 256, 0, args), reps=7)
            gb = nbytes[op] * N * a.element_size() / us / 1e3
            print(f"  {tname:9s} op={'add' if op == 0 else 'fam'} unroll={u} minblocks={minb}: "
                  f"{us:7.1f} us {gb:6.0f} GB/s  torch/this {(t_add if op == 0 else t_fam) / us:5.2f}")
    del a, b, s, d
