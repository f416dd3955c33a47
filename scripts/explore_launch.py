"""Where do small and medium elementwise launches lose to torch, and what do the fp64 division
and row-broadcast kernels need? Experiments on the H200, one process, every row beside torch.

The library's ew_contig is the winner of these experiments (it was "y_contig" in the logs of
docs/perf/); the "ew_contig" rows time whatever the library has now.

Sections (all GPU times: CUDA events after warm-up, a hold kernel in front when launch-bound,
median of repetitions, inputs rotated through buffer sets spanning 2x L2 — the bench's Timer):

  sizes    torch vs cl::ew_contig, the leanest vector kernel (x_vec, one vector per thread;
           the first session also had 2 and 4 per thread, blocks of 128, 32-bit indices: none
           better), x_vec with ew_contig's nine parameters (x_vec_pad) and ew_contig's instance
           with scalar checks at 2^10 .. 2^24,
           fp32/bf16/fp64 add and fp64 div;
  graph    GPU time per kernel replayed from a CUDA graph of 100 (1024 elements);
  host     host µs per call, interleaved rounds: launch forms (kernel_params vs one packed
           `extra` buffer) and the public calls beside torch;
  rows     row broadcast (8192 x 8192): torch, cupylab.add, and x_rowbcast with the row
           operand kept in registers;
  hints    16-bit and fp32 add at 2^24/2^26/2^28: cache-policy variants (x_hint<LD, ST>)
           beside torch, ew_contig and cupylab.add;
  hints2   ld.cs + st.cs against the default by size (2^20 .. 2^25), alone and chained;
  occ, occ2, occ3, occ4
           resident blocks per SM capped with dynamic shared memory, by block size, next to
           torch's kernels, and with the occupancy API and the carveout preference;
  occ5     the cap at medium sizes (2^20..2^23: below the third session's STREAM_MIN_GRID);
  occ6     the same with one buffer set reused every call (operands L2-resident);
  occ7     hot and cold medium operands, more rounds, beside other shapes (x2, b128, x4/128);
  hot2     hot and cold medium add: one-wave grid-stride kernels whose chunks stay on, or move
           between, blocks from call to call;
  hot3     hot and cold add 2^20..2^24: a lean one-wave grid-stride kernel (x_gs LEAN) by blocks
           per SM and vectors in flight, beside the shipped shape;
  order    torch and ew_contig each timed first and last in a round (order bias?);
  burst    host cost per launch with the GPU free-running vs held busy (host- or GPU-bound?);
  lean     host cost of a flatter torch lean path (prototype) beside the library's;
  ncu      (--ncu) one call of each case for Nsight Compute to profile;
  ncu16    (--ncu16) bf16/fp32 add at 2^26, torch, ew_contig and x_hint variants;
  ncuocc   (--ncuocc) bf16/fp32/fp64 add at 2^26, ew_contig uncapped and capped;
  ncuhot   (--ncuhot) fp64 add 2^21 and fp32 add 2^22 on L2-resident operands: torch,
           ew_contig uncapped and capped (L2 hit rate, DRAM traffic);
  ncuhot2  (--ncuhot2) the hot2 variants at fp64 2^21 and fp32 2^22, four calls in a row each;
  ncurange (--ncurange) 50 back-to-back add calls per profiler range, hot and cold, at 48 MB per
           call: torch, ew_contig 6 and 8 per SM, x_gs LEAN one wave (DRAM bytes per range).

Usage: python scripts/explore_launch.py [SECTION ...] | --ncu | --ncu16 | --ncuocc | --ncuhot
       | --ncuhot2 | --ncurange
"""
import ctypes
import functools
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

import cupy as cp
import torch

import cupylab
from cupylab import _compile, _dtypes, _launch
from cupylab.bench._timing import Timer

HERE = Path(__file__).resolve().parent
L2 = cp.cuda.Device().attributes["L2CacheSize"]
SMS = cp.cuda.Device().attributes["MultiProcessorCount"]
OPS = {"add": 0, "div": 3}
SIZES = (10, 14, 16, 18, 20, 22, 24)
TDT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64,
       "float16": torch.float16}


def prog(names):
    return _compile.Program.from_file(HERE / "explore_launch.cu", names,
                                      include_dirs=[_compile.cuda_src_dir()])


@functools.lru_cache(None)
def cur_kernel(dt, op):
    name = f"cl::ew_contig<{dt.ctype}, {op}, {16 // dt.itemsize}, true>"
    t = dt.fmt
    return _launch.Kernel(prog([name]), name, ["Q", "Q", "Q", "Q", t, t, t, "q", "q", "q"])


def ew_add(dt, nvec, block=256, smem=0, op=0):
    """f(a, b, d) launching the library's ew_contig instance (all arrays) of operator ``op``
    (default add) for ``nvec`` aligned 16-byte vectors on the default stream, ``smem`` bytes of
    dynamic shared memory."""
    kc = cur_kernel(dt, op)
    grid = max(1, -(-nvec // block))
    return lambda a, b, d: kc.launch(0, grid, block, 0, (d.data_ptr(), a.data_ptr(), b.data_ptr(),
                                                         0, 0, 0, 0, nvec, 0, 0), shared_mem=smem)


def on_set(f):
    """f(a, b, d) as a function of one buffer set s = (a, b, d, ...)."""
    return lambda s: f(s[0], s[1], s[2])


def cap_smem(cap):
    """Dynamic shared memory that leaves room for at most ``cap`` resident blocks per SM."""
    return cp.cuda.Device().attributes["MaxSharedMemoryPerMultiprocessor"] // cap - 1024 if cap else 0


@functools.lru_cache(None)
def x_kernel(dt, op, vpt, it):
    name = f"clx::x_vec<{dt.ctype}, {op}, {vpt}, {it}>"
    return _launch.Kernel(prog([name]), name, ["Q", "Q", "Q", "i" if it == "int" else "q"])


def buffer_sets(n, tdt, k=3):
    isz = torch.empty(0, dtype=tdt).element_size()
    nsets = max(2, min(64, math.ceil(2 * L2 / (k * n * isz))))
    return [[torch.randn(n, device="cuda").to(tdt) for _ in range(k)] for _ in range(nsets)]


def operand_sets(n, tdt, hot):
    """One buffer set of three (``hot``: the same operands every call, L2-resident when they
    fit) or the sets of :func:`buffer_sets`, rotated over 2x L2 (cold)."""
    return [[torch.randn(n, device="cuda").to(tdt) for _ in range(3)]] if hot \
        else buffer_sets(n, tdt)


@functools.lru_cache(None)
def named_kernel(name, fmts):
    return _launch.Kernel(prog([name]), name, list(fmts))


def variants(dt, op, n):
    """name -> function(a, b, d) launching on the default stream."""
    V = 16 // dt.itemsize
    nvec = n // V
    t = dt.fmt
    out = {"ew_contig": ew_add(dt, nvec, op=op)}
    kx = x_kernel(dt, op, 1, "long long")
    out["x_vec1"] = lambda a, b, d: kx.launch(
        0, max(1, -(-nvec // 256)), 256, 0, (d.data_ptr(), a.data_ptr(), b.data_ptr(), nvec))
    kp = named_kernel(f"clx::x_vec_pad<{dt.ctype}, {op}>", ("Q", "Q", "Q", "Q", t, t, t, "q", "q"))
    out["x_vec_pad"] = lambda a, b, d: kp.launch(
        0, max(1, -(-nvec // 256)), 256, 0,
        (d.data_ptr(), a.data_ptr(), b.data_ptr(), 0, 0, 0, 0, nvec, 0))
    # the library's instance with the per-operand scalar checks (calls with a scalar operand)
    ks = named_kernel(f"cl::ew_contig<{dt.ctype}, {op}, {V}, false>",
                      ("Q", "Q", "Q", "Q", t, t, t, "q", "q", "q"))
    out["ew_contig/scalar-checks"] = lambda a, b, d: ks.launch(
        0, max(1, -(-nvec // 256)), 256, 0,
        (d.data_ptr(), a.data_ptr(), b.data_ptr(), 0, 0, 0, 0, nvec, 0, 0))
    return out


def gpu_rounds(timer, fns, sets, rounds=3, reps=5):
    """{name: median GPU µs} over ``rounds`` interleaved rounds; ``fns[name](s)`` launches one
    call on buffer set ``s`` (rotated through ``sets``)."""
    res = {k: [] for k in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            res[name].append(timer.events([lambda s=s, f=f: f(s) for s in sets], reps).median)
    return {k: statistics.median(v) for k, v in res.items()}


def ratio_row(label, med, ref="torch"):
    """One printed row: the reference's time, then every other case with ref/case."""
    tt = med[ref]
    return f"{label} {ref} {tt:7.2f} | " + " | ".join(
        f"{k} {v:7.2f} ({tt / v:5.3f})" for k, v in med.items() if k != ref)


def host_rounds(cases, rounds=9, calls=2000):
    """Print host µs per call of each zero-argument case: wall clock over ``calls`` calls ending
    in a synchronize, median (min, max) of ``rounds`` interleaved rounds, after warm-up."""
    res = {k: [] for k in cases}
    for fn in cases.values():
        for _ in range(300):
            fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in cases.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            res[name].append((time.perf_counter() - t) / calls * 1e6)
    for name, v in res.items():
        print(f"{name:36s} {statistics.median(v):7.3f} us  (min {min(v):.3f}, max {max(v):.3f})")


def section_sizes(timer):
    print("\n== sizes: GPU us per call (median), ratio torch/variant ==", flush=True)
    for dname, opname in (("float32", "add"), ("bfloat16", "add"), ("float64", "add"),
                          ("float64", "div")):
        dt, tdt, op = _dtypes.DTYPES[dname], TDT[dname], OPS[opname]
        tfn = torch.add if opname == "add" else torch.div
        for lg in SIZES:
            n = 1 << lg
            sets = buffer_sets(n, tdt)
            tt = timer.events([lambda s=s: tfn(s[0], s[1], out=s[2]) for s in sets], 5).median
            row = [f"{dname:8s} {opname} 2^{lg:<2d} torch {tt:8.2f}"]
            for name, f in variants(dt, op, n).items():
                us = timer.events([lambda s=s, f=f: f(s[0], s[1], s[2]) for s in sets], 5).median
                row.append(f"{name} {us:8.2f} ({tt / us:4.2f})")
            print(" | ".join(row), flush=True)
            del sets


def section_graph(timer):
    print("\n== graph: GPU us per kernel replayed from a graph of 100 (1024 elements) ==",
          flush=True)

    kempty = _launch.Kernel(prog(["clx::x_empty"]), "clx::x_empty", [])
    for dname in ("float32", "bfloat16"):
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        a, b, d = (torch.randn(1024, device="cuda").to(tdt) for _ in range(3))
        s = cp.cuda.Stream(non_blocking=True)
        res = {"empty": _replay_us(_capture(s, lambda: kempty.launch(0, 1, 32, 0, ())), s)}
        for name, f in variants(dt, 0, 1024).items():
            res[name] = _replay_us(_capture(s, lambda f=f: f(a, b, d)), s)
        cupylab.add(a, b, out=d)
        torch.cuda.synchronize()
        for label, fn in (("torch.add", lambda: torch.add(a, b, out=d)),
                          ("cupylab.add", lambda: cupylab.add(a, b, out=d))):
            tg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(tg):
                for _ in range(100):
                    fn()
            torch.cuda.synchronize()
            res[f"{label} (torch graph)"] = _replay_us(tg, None)
        print(f"{dname}: " + " | ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)


_cur_stream = 0
_orig_launch = _launch.Kernel.launch


def _launch_on_cur(self, device, grid, block, stream, args, **kw):
    # the variants launch on stream 0: redirect them to the capture stream
    return _orig_launch(self, device, grid, block, stream or _cur_stream, args, **kw)


def _capture(s, body, count=100):
    global _cur_stream
    _launch.Kernel.launch = _launch_on_cur
    _cur_stream = s.ptr
    try:
        body()
        s.synchronize()
        with s:
            s.begin_capture()
            try:
                for _ in range(count):
                    body()
            finally:
                g = s.end_capture()
    finally:
        _launch.Kernel.launch = _orig_launch
        _cur_stream = 0
    try:
        g.upload(s)
    except AttributeError:
        pass
    return g


def _replay_us(g, s, reps=30, count=100):
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    samples = []
    for _ in range(5):
        if s is None:
            g.replay()
            torch.cuda.synchronize()
            te0, te1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            te0.record()
            for _ in range(reps):
                g.replay()
            te1.record()
            te1.synchronize()
            samples.append(te0.elapsed_time(te1) * 1e3 / reps / count)
        else:
            g.launch(s)
            s.synchronize()
            e0.record(s)
            for _ in range(reps):
                g.launch(s)
            e1.record(s)
            e1.synchronize()
            samples.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps / count)
    return statistics.median(samples)


def section_host():
    print("\n== host: us per call, 1024 fp32, interleaved rounds (median of 9 rounds x 2000) ==",
          flush=True)
    from cupy_backends.cuda.api import driver
    dt = _dtypes.DTYPES["float32"]
    x, y, z = (torch.randn(1024, device="cuda") for _ in range(3))
    k = cur_kernel(dt, 0)
    f = k.function(0)
    args = (z.data_ptr(), x.data_ptr(), y.data_ptr(), 0, 0.0, 0.0, 0.0, 256, 0, 0)
    buf, _, params = k._buffers()
    k._struct.pack_into(buf, 0, *args)
    size = ctypes.c_size_t(k._size)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
    pextra = ctypes.addressof(extra)
    ke = _launch.Kernel(prog(["clx::x_empty"]), "clx::x_empty", [])
    fe = ke.function(0)
    L = driver.launchKernel
    call = cupylab.prepare(cupylab.add, x, y, out=z)
    cases = {
        "launch empty kernel (no params)": lambda: L(fe, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0),
        "launch ew_contig, kernel_params": lambda: L(f, 1, 1, 1, 256, 1, 1, 0, 0, params, 0),
        "launch ew_contig, extra buffer": lambda: L(f, 1, 1, 1, 256, 1, 1, 0, 0, 0, pextra),
        "torch.cuda._sleep(0)": lambda: torch.cuda._sleep(0),
        "torch.add(x, y, out=z)": lambda: torch.add(x, y, out=z),
        "cupylab.add(x, y, out=z)": lambda: cupylab.add(x, y, out=z),
        "x + y": lambda: x + y,
        "cupylab.add(x, y)": lambda: cupylab.add(x, y),
        "prepared add()": call,
    }
    host_rounds(cases)


def section_rows(timer):
    print("\n== rows: out[r,:] = a[r,:] + b[:], 8192 x 8192 ==", flush=True)
    R = C = 8192
    for dname in ("float32", "bfloat16", "float64"):
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        V = 16 // dt.itemsize
        cvec = C // V
        a = torch.randn(R, C, device="cuda").to(tdt)
        b = torch.randn(C, device="cuda").to(tdt)
        d = torch.empty_like(a)
        nbytes = 2 * R * C * dt.itemsize
        tt = timer.events([lambda: torch.add(a, b, out=d)], 7).median
        tc = timer.events([lambda: cupylab.add(a, b, out=d)], 7).median
        row = [f"{dname:8s} torch {tt:7.1f} ({nbytes / tt / 1e3:5.0f} GB/s) | cupylab {tc:7.1f} ({tt / tc:4.2f})"]
        for rows_per in (1, 2, 4):
            name = f"clx::x_rowbcast<{dt.ctype}, 0, {rows_per}>"
            k = _launch.Kernel(prog([name]), name, ["Q", "Q", "Q", "q", "q"])
            gx = -(-cvec // 256)
            for label, gy in (("all", R // rows_per), ("8w", max(1, SMS * 8 * 8 // gx)),
                              ("2w", max(1, SMS * 8 * 2 // gx))):
                gy = min(gy, R // rows_per, 65535)
                us = timer.events([lambda k=k, gx=gx, gy=gy: k.launch(
                    0, gx, 256, 0, (d.data_ptr(), a.data_ptr(), b.data_ptr(), R, cvec),
                    grid_yz=(gy, 1))], 7).median
                row.append(f"rows{rows_per}/{label}(gy={gy}) {us:7.1f} ({tt / us:4.2f})")
        print(" | ".join(row), flush=True)



def section_memcpy(timer):
    print("\n== memcpy: device-to-device copy moving as many bytes as an operator call ==",
          flush=True)
    for label, traffic in (("bf16 add 2^24 (96 MB)", 96 << 20),
                           ("fp32 add 2^24 (192 MB)", 192 << 20),
                           ("bf16 add 2^26 (384 MB)", 384 << 20), ("1 GiB copy", 2 << 30)):
        half = traffic // 2
        nsets = max(2, math.ceil(2 * L2 / traffic))
        bufs = [(cp.empty(half, cp.uint8), cp.empty(half, cp.uint8)) for _ in range(nsets)]
        fns = [lambda s=s_: cp.cuda.runtime.memcpyAsync(s[1].data.ptr, s[0].data.ptr, half, 3, 0)
               for s_ in bufs]
        us = timer.events(fns, 7).median
        print(f"{label:24s} {us:8.2f} us  {traffic / us / 1e3:6.0f} GB/s", flush=True)
        del bufs, fns


def ncu_cases():
    """One call of each case, for `ncu --clock-control none` to profile."""
    for dname, lgs in (("float32", (10, 16, 20, 22)), ("bfloat16", (20, 24)), ("float64", (20, 24))):
        tdt = TDT[dname]
        for lg in lgs:
            a, b, d = (torch.randn(1 << lg, device="cuda").to(tdt) for _ in range(3))
            for _ in range(2):
                torch.add(a, b, out=d)
                cupylab.add(a, b, out=d)
            if dname == "float64" and lg == 24:
                torch.div(a, b, out=d)
                cupylab.div(a, b, out=d)
    torch.cuda.synchronize()


HINTS = ((0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (0, 1), (1, 1), (2, 1), (0, 2))


def section_hints(timer):
    print("\n== hints: cache-policy variants of one vector per thread (x_hint<LD, ST>), add, "
          "GPU us (median of 3 interleaved rounds), ratio torch/variant ==", flush=True)
    for dname in ("bfloat16", "float16", "float32"):
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        V = 16 // dt.itemsize
        for lg in (24, 26, 28):
            n = 1 << lg
            nvec = n // V
            sets = buffer_sets(n, tdt)
            grid = -(-nvec // 256)
            fns = {"torch": lambda s: torch.add(s[0], s[1], out=s[2]),
                   "cupylab.add": lambda s: cupylab.add(s[0], s[1], out=s[2])}
            fns["ew_contig"] = on_set(ew_add(dt, nvec))
            for ld, st in HINTS:
                k = named_kernel(f"clx::x_hint<{dt.ctype}, 0, {ld}, {st}>", ("Q", "Q", "Q", "q"))
                fns[f"ld{ld}st{st}"] = lambda s, k=k: k.launch(
                    0, grid, 256, 0, (s[2].data_ptr(), s[0].data_ptr(), s[1].data_ptr(), nvec))
            med = gpu_rounds(timer, fns, sets)
            gbs = 3 * n * dt.itemsize / med["torch"] / 1e3
            print(ratio_row(f"{dname:8s} 2^{lg} ({gbs:4.0f} GB/s for torch)", med), flush=True)
            del sets, fns


def section_hints2(timer):
    print("\n== hints2: ld.cs + st.cs (x_hint<2, 1>) vs default (x_hint<0, 0>) by size, alone and "
          "chained (y = a + b; z = y + c: does an evict-first store cost the consumer its L2 "
          "hit?), GPU us, median of 3 interleaved rounds, ratio torch/variant ==", flush=True)
    for dname in ("bfloat16", "float32"):
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        V = 16 // dt.itemsize
        for lg in (20, 21, 22, 23, 24, 25):
            n = 1 << lg
            nvec = n // V
            grid = -(-nvec // 256)
            sets = buffer_sets(n, tdt, k=5)
            fns = {"torch": lambda s: torch.add(s[0], s[1], out=s[2]),
                   "torch chain": lambda s: (torch.add(s[0], s[1], out=s[2]),
                                             torch.add(s[2], s[3], out=s[4]))}
            for ld, st in ((0, 0), (2, 1)):
                k = named_kernel(f"clx::x_hint<{dt.ctype}, 0, {ld}, {st}>", ("Q", "Q", "Q", "q"))

                def one(s, k=k, i=0, j=1, o=2):
                    k.launch(0, grid, 256, 0, (s[o].data_ptr(), s[i].data_ptr(),
                                               s[j].data_ptr(), nvec))
                fns[f"ld{ld}st{st}"] = one
                fns[f"ld{ld}st{st} chain"] = lambda s, one=one: (one(s), one(s, i=2, j=3, o=4))
            med = gpu_rounds(timer, fns, sets)
            row = []
            for k_, v in med.items():
                ref = med["torch chain" if k_.endswith("chain") else "torch"]
                row.append(f"{k_} {v:7.2f}" + ("" if k_.startswith("torch") else f" ({ref / v:5.3f})"))
            print(f"{dname:8s} 2^{lg} " + " | ".join(row), flush=True)
            del sets, fns


def section_occ(timer):
    print("\n== occ: ew_contig (add) with its resident blocks per SM capped by dynamic shared "
          "memory (torch's kernel runs at 34 registers, 63 % warps active; ew_contig at 25, "
          "81 %), GPU us, median of 3 interleaved rounds, ratio torch/variant ==", flush=True)
    for dname, lgs in (("bfloat16", (24, 26, 28)), ("float32", (24, 26))):
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        nvec = None
        for lg in lgs:
            n = 1 << lg
            nvec = n // (16 // dt.itemsize)
            sets = buffer_sets(n, tdt)
            fns = {"torch": lambda s: torch.add(s[0], s[1], out=s[2])}
            for k in (8, 7, 6, 5):
                fns[f"{k}/SM"] = on_set(ew_add(dt, nvec, smem=cap_smem(0 if k == 8 else k)))
            med = gpu_rounds(timer, fns, sets)
            print(ratio_row(f"{dname:8s} 2^{lg}", med), flush=True)
            del sets, fns


OCC2 = ((256, 0), (256, 7), (128, 0), (128, 15), (128, 14), (128, 13), (192, 0), (192, 9),
        (224, 0), (224, 8), (160, 0), (160, 11))


def section_occ2(timer):
    print("\n== occ2: ew_contig (add) by block size and resident blocks per SM (0: not capped; "
          "a cap is set with dynamic shared memory), GPU us, median of 3 interleaved rounds, "
          "ratio torch/variant ==", flush=True)
    for dname, lgs in (("bfloat16", (22, 24, 26, 28)), ("float32", (24, 26)),
                       ("float64", (26,))):
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        for lg in lgs:
            n = 1 << lg
            nvec = n // (16 // dt.itemsize)
            sets = buffer_sets(n, tdt)
            fns = {"torch": lambda s: torch.add(s[0], s[1], out=s[2])}
            for blk, cap in OCC2:
                fns[f"{blk}/{cap or '-'}"] = on_set(ew_add(dt, nvec, blk, cap_smem(cap)))
            med = gpu_rounds(timer, fns, sets)
            print(ratio_row(f"{dname:8s} 2^{lg}", med), flush=True)
            del sets, fns


def _capped(dt, nvec, cap):
    """ew_contig add launcher with at most ``cap`` resident 256-thread blocks per SM (0: none)."""
    return ew_add(dt, nvec, smem=cap_smem(cap))


def section_occ3(timer):
    print("\n== occ3: does the 7-per-SM cap (dynamic shared memory) cost anything next to "
          "torch's kernels (an L1/shared carveout change between kernels)? torch.add then "
          "ew_contig add, per pair, GPU us, median of 3 interleaved rounds ==", flush=True)
    for dname, lgs in (("bfloat16", (10, 16, 20, 26)), ("float32", (16, 26))):
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        for lg in lgs:
            n = 1 << lg
            nvec = n // (16 // dt.itemsize)
            sets = buffer_sets(n, tdt, k=4)
            fns = {"torch+torch": lambda s: (torch.add(s[0], s[1], out=s[2]),
                                             torch.add(s[2], s[1], out=s[3]))}
            for cap in (0, 7):
                f = _capped(dt, nvec, cap)
                fns[f"torch+cl/{cap or '-'}"] = lambda s, f=f: (torch.add(s[0], s[1], out=s[2]),
                                                                f(s[2], s[1], s[3]))
                fns[f"cl+cl/{cap or '-'}"] = lambda s, f=f: (f(s[0], s[1], s[2]),
                                                             f(s[2], s[1], s[3]))
            med = gpu_rounds(timer, fns, sets)
            print(f"{dname:8s} 2^{lg} " + " | ".join(f"{k_} {v:8.2f}" for k_, v in med.items()),
                  flush=True)
            del sets, fns


def _ncu_add_launches(cases, order):
    """For each (dtype name, log2 n) of ``cases``: fresh a, b, d, then the add launches of
    ``order`` on them, each "torch" or a cap for ew_contig (0: uncapped), for Nsight Compute."""
    for dname, lg in cases:
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        n = 1 << lg
        nvec = n // (16 // dt.itemsize)
        a, b, d = (torch.randn(n, device="cuda").to(tdt) for _ in range(3))
        for step in order:
            if step == "torch":
                torch.add(a, b, out=d)
            else:
                _capped(dt, nvec, step)(a, b, d)
    torch.cuda.synchronize()


def ncuocc_cases():
    """bf16, fp32 and fp64 add at 2^26: ew_contig uncapped and capped at 7 blocks per SM."""
    _ncu_add_launches([(d, 26) for d in ("bfloat16", "float32", "float64")],
                      ("torch", 0, 7, 0, 7))


def ncuhot_cases():
    """fp64 add at 2^21 and fp32 add at 2^22 (48 MB per call) on one L2-resident buffer set:
    torch, ew_contig uncapped and capped, three times each, interleaved (profile with
    ``ncu --cache-control none`` so that the L2 stays warm between kernels)."""
    _ncu_add_launches((("float64", 21), ("float32", 22)), ("torch", 0, 7) * 3)


def ncuhot2_cases():
    """fp64 add at 2^21 and fp32 add at 2^22 on one buffer set: torch, then each hot2 variant,
    four calls in a row each (the 2nd to 4th follow a call of the same kernel on the same
    operands); profile with ``--cache-control none --replay-mode application``."""
    for dname, lg in (("float64", 21), ("float32", 22)):
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        n = 1 << lg
        nvec = n // (16 // dt.itemsize)
        a, b, d = (torch.randn(n, device="cuda").to(tdt) for _ in range(3))
        fns = {"torch": lambda a, b, d: torch.add(a, b, out=d)}
        fns.update(hot2_variants(dt, nvec))
        for f in fns.values():
            for _ in range(4):
                f(a, b, d)
    torch.cuda.synchronize()


def ncurange_cases():
    """Back-to-back add calls inside profiler ranges (cudaProfilerStart/Stop), one range per
    variant: fp64 2^21, fp32 2^22 and bf16 2^23 (48 MB per call), hot (one buffer set) and cold
    (sets rotated over 2x L2). Profile with ``--replay-mode app-range --cache-control none``:
    metrics per range, with nothing saved, restored or flushed between the calls of a range, so
    each call meets the L2 the call before it left (the range's duration includes the
    profiler's work around each call). Range labels go to stderr, in order."""
    calls = 50
    for dname, lg in (("float64", 21), ("float32", 22), ("bfloat16", 23)):
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        n = 1 << lg
        nvec = n // (16 // dt.itemsize)
        for hot in (True, False):
            sets = operand_sets(n, tdt, hot)
            variants = hot3_variants(dt, nvec)
            fns = {"torch": lambda a, b, d: torch.add(a, b, out=d)}
            fns.update((k, variants[k]) for k in (("6/SM", "8/SM", "gl8u2", "gl8u2h") if hot
                                                  else ("6/SM", "gl8u2")))
            for name, f in fns.items():
                for i in range(2 * len(sets)):
                    f(*sets[i % len(sets)][:3])
                torch.cuda.synchronize()
                print(f"range: {'hot ' if hot else 'cold'} {dname} 2^{lg} {name} x{calls}",
                      file=sys.stderr, flush=True)
                torch.cuda.profiler.start()
                for i in range(calls):
                    f(*sets[i % len(sets)][:3])
                torch.cuda.profiler.stop()
                torch.cuda.synchronize()
            del sets


def section_occ4(timer):
    print("\n== occ4: ew_contig add, 256 threads, by dynamic shared memory per block, with the "
          "driver's default L1/shared carveout, then with the carveout preference at 100 % "
          "shared; 'occ' = cuOccupancyMaxActiveBlocksPerMultiprocessor; GPU us, median of 3 "
          "interleaved rounds, ratio torch/variant ==", flush=True)
    from cupy_backends.cuda.api import driver
    smems = (0, 24000, 28000, 32000, 36000, 40000, 45000)
    for phase in ("default", "carveout100"):
        for dname, lgs in (("bfloat16", (24, 26, 28)), ("float32", (26,))):
            dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
            kc = cur_kernel(dt, 0)
            f = kc.function(0)
            if phase == "carveout100":
                driver.funcSetAttribute(f, 9, 100)  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            occ = {sm: driver.occupancyMaxActiveBlocksPerMultiprocessor(f, 256, sm) for sm in smems}
            for lg in lgs:
                n = 1 << lg
                nvec = n // (16 // dt.itemsize)
                sets = buffer_sets(n, tdt)
                fns = {"torch": lambda s: torch.add(s[0], s[1], out=s[2])}
                for sm in smems:
                    fns[f"{sm}B(occ {occ[sm]})"] = on_set(ew_add(dt, nvec, smem=sm))
                med = gpu_rounds(timer, fns, sets)
                print(ratio_row(f"{phase:11s} {dname:8s} 2^{lg}", med), flush=True)
                del sets, fns


MEDIUM_CASES = (("bfloat16", (20, 21, 22, 23)), ("float16", (22, 23)),
                ("float32", (20, 21, 22)), ("float64", (20, 21)))


def _occ_medium(timer, title, hot, cases=MEDIUM_CASES, rounds=5, reps=5, shapes=False):
    """Medium sizes: torch beside ew_contig uncapped and capped (and, with ``shapes``, the x_vec
    shapes x2, b128 and x4/128), one L2-resident buffer set (``hot``) or sets rotated over 2x L2;
    one printed row per case."""
    print(f"\n== {title}: medium sizes (2^20..2^23), the library's ew_contig (add, div) uncapped "
          "(8 blocks per SM) and with the residency cap's 32,329 B (6 per SM)"
          + (", x_vec with 2 vectors per thread in blocks of 256 (x2), with 1 in blocks of "
             "128 (b128) and with 4 in blocks of 128 (x4/128, torch's fp64 shape)" if shapes else "")
          + f", beside torch; GPU us, median of {rounds} interleaved rounds of {reps} batches, "
          "ratio torch/variant; grid = blocks of 256 ==", flush=True)
    smem = cap_smem(7)  # 233,472 // 7 - 1,024 = 32,329 B on the H200: 6 blocks per SM
    for dname, lgs in cases:
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        for opname, op in OPS.items():
            peer = torch.add if op == 0 else torch.div
            for lg in lgs:
                n = 1 << lg
                nvec = n // (16 // dt.itemsize)
                grid = -(-nvec // 256)
                sets = operand_sets(n, tdt, hot)
                fns = {"torch": lambda s, peer=peer: peer(s[0], s[1], out=s[2])}
                for label, sm in (("8/SM", 0), ("6/SM", smem)):
                    fns[label] = on_set(ew_add(dt, nvec, smem=sm, op=op))
                if shapes:
                    for label, vpt, block in (("x2", 2, 256), ("b128", 1, 128), ("x4/128", 4, 128)):
                        k = x_kernel(dt, op, vpt, "long long")  # cached per instance
                        fns[label] = lambda s, k=k, g=-(-nvec // (vpt * block)), block=block, \
                            nvec=nvec: k.launch(0, g, block, 0, (s[2].data_ptr(), s[0].data_ptr(),
                                                                 s[1].data_ptr(), nvec))
                med = gpu_rounds(timer, fns, sets, rounds=rounds, reps=reps)
                label = (("hot  " if hot else "cold ") if shapes else "") + f"{dname:8s}"
                print(ratio_row(f"{label} {opname} 2^{lg} grid {grid:5d}", med), flush=True)
                del sets, fns


def section_occ5(timer):
    _occ_medium(timer, "occ5 (inputs rotated through buffer sets spanning 2x L2)", hot=False)


def section_occ6(timer):
    _occ_medium(timer, "occ6 (one buffer set, the same every call: L2-resident)", hot=True)


def section_occ7(timer):
    cases = (("bfloat16", (21, 22, 23)), ("float32", (20, 21, 22)), ("float64", (20, 21)))
    for hot in (True, False):
        _occ_medium(timer, f"occ7 ({'hot: one buffer set' if hot else 'cold: rotated sets'})",
                    hot, cases, rounds=9, reps=7, shapes=True)


def gs_add(dt, nvec, per_sm, u, shift=None, lean=False):
    """f(a, b, d) launching x_gs (add, grid-stride, ``u`` vectors in flight) as one wave of
    ``per_sm`` blocks of 256 per SM (fewer if the kernel's occupancy is lower; ``lean``: also
    no more blocks than the operands need, and no 64-bit modulo); call number ``c`` passes
    ``shift(c, grid)`` (default 0), which moves every chunk to block (b - shift) mod grid."""
    from cupy_backends.cuda.api import driver
    k = named_kernel(f"clx::x_gs<{dt.ctype}, 0, {u}, {'true' if lean else 'false'}>",
                     ("Q", "Q", "Q", "q", "I"))
    occ = driver.occupancyMaxActiveBlocksPerMultiprocessor(k.function(0), 256, 0)
    grid = SMS * min(per_sm, occ)
    if lean:
        grid = max(1, min(grid, -(-nvec // (256 * u))))
    shift = shift or MOVES["same"]
    calls = itertools.count()
    return lambda a, b, d: k.launch(0, grid, 256, 0, (d.data_ptr(), a.data_ptr(), b.data_ptr(),
                                                      nvec, shift(next(calls), grid)))


MOVES = {"same": lambda c, g: 0, "half": lambda c, g: (c & 1) * (g // 2),
         "step": lambda c, g: c % g}
HOT2_CASES = (("float64", 20), ("float64", 21), ("float32", 20), ("float32", 22),
              ("bfloat16", 21), ("bfloat16", 23))


def hot2_variants(dt, nvec):
    """name -> f(a, b, d) for the hot2 section and the --ncuhot2 mode."""
    fns = {"6/SM": ew_add(dt, nvec, smem=cap_smem(7)), "8/SM": ew_add(dt, nvec)}
    for mv in MOVES:
        fns[f"gs8u2 {mv}"] = gs_add(dt, nvec, 8, 2, MOVES[mv])
    fns["gs4u4 same"] = gs_add(dt, nvec, 4, 4)
    return fns


def _hot_cold_add(timer, cases, variants):
    """For each (dtype name, log2 sizes) of ``cases``, hot (one buffer set, skipped when it does
    not fit in L2) then cold (sets rotated over 2x L2): torch.add beside ``variants(dt, nvec)``
    (name -> f(a, b, d)); one printed row per case, 9 interleaved rounds of 7 batches."""
    for hot in (True, False):
        for dname, lgs in cases:
            dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
            for lg in lgs:
                n = 1 << lg
                if hot and n * dt.itemsize * 3 > L2:
                    continue
                nvec = n // (16 // dt.itemsize)
                sets = operand_sets(n, tdt, hot)
                fns = {"torch": lambda s: torch.add(s[0], s[1], out=s[2])}
                fns.update({k: on_set(f) for k, f in variants(dt, nvec).items()})
                med = gpu_rounds(timer, fns, sets, rounds=9, reps=7)
                print(ratio_row(f"{'hot ' if hot else 'cold'} {dname:8s} 2^{lg}", med), flush=True)
                del sets, fns


def section_hot2(timer):
    print("\n== hot2: add on medium operands, one buffer set (hot) and rotated sets (cold): torch, "
          "ew_contig with 6 and 8 blocks per SM, and one-wave grid-stride kernels x_gs (gsPuU: P "
          "blocks of 256 per SM, U vectors in flight) whose chunks stay on the same block every "
          "call (same), alternate between two halves of the grid (half) or move one block per "
          "call (step); GPU us, median "
          "of 9 interleaved rounds of 7 batches, ratio torch/variant ==", flush=True)
    _hot_cold_add(timer, [(d, (lg,)) for d, lg in HOT2_CASES], hot2_variants)


HOT3_CASES = (("float64", (20, 21, 22)), ("float32", (20, 21, 22, 23, 24)),
              ("bfloat16", (21, 22, 23, 24)))


def hot3_variants(dt, nvec):
    """name -> f(a, b, d) for the hot3 section."""
    fns = {"6/SM": ew_add(dt, nvec, smem=cap_smem(7)), "8/SM": ew_add(dt, nvec),
           "gs8u2": gs_add(dt, nvec, 8, 2)}
    for per_sm, u, half in ((8, 1, False), (8, 2, False), (6, 2, False), (8, 2, True),
                            (8, 4, False)):
        fns[f"gl{per_sm}u{u}{'h' if half else ''}"] = gs_add(
            dt, nvec, per_sm, u, MOVES["half"] if half else None, lean=True)
    return fns


def section_hot3(timer):
    print("\n== hot3: add, hot (one buffer set) and cold (rotated sets): torch, ew_contig with 6 "
          "(shipped) and 8 blocks per SM, x_gs (gs8u2) and the lean one-wave grid-stride x_gs LEAN "
          "(glPuU: at most P blocks of 256 per SM, U vectors in flight; 'h' = chunks move by half "
          "the grid every other call); GPU us, median of 9 interleaved rounds of 7 batches, "
          "ratio torch/variant ==", flush=True)
    _hot_cold_add(timer, HOT3_CASES, hot3_variants)


def section_order(timer):
    print("\n== order: is the 16-bit gap an artefact of timing order? torch and ew_contig (add) "
          "each timed twice per round, first and last; GPU us, median of 5 interleaved rounds, "
          "ratio torch/case ==", flush=True)
    for dname, lgs in (("bfloat16", (24, 26, 28)), ("float16", (26,)), ("float32", (26,))):
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        for lg in lgs:
            n = 1 << lg
            nvec = n // (16 // dt.itemsize)
            sets = buffer_sets(n, tdt)
            ours = on_set(ew_add(dt, nvec))

            def theirs(s):
                torch.add(s[0], s[1], out=s[2])
            fns = {"torch": theirs, "ew_contig": ours, "ew_contig again": ours,
                   "torch again": theirs}
            med = gpu_rounds(timer, fns, sets, rounds=5)
            print(ratio_row(f"{dname:8s} 2^{lg}", med), flush=True)
            del sets, fns


def section_burst():
    print("\n== burst: host us per launch of an empty kernel, GPU held busy by a long kernel "
          "first (host-bound if it matches the free-running loop) ==", flush=True)
    from cupy_backends.cuda.api import driver
    ke = _launch.Kernel(prog(["clx::x_empty"]), "clx::x_empty", [])
    fe = ke.function(0)
    L = driver.launchKernel
    x, y, z = (torch.randn(1024, device="cuda") for _ in range(3))
    for label, fn in (("cuLaunchKernel (CuPy binding)", lambda: L(fe, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0)),
                      ("torch.add(x, y, out=z)", lambda: torch.add(x, y, out=z)),
                      ("cupylab.add(x, y, out=z)", lambda: cupylab.add(x, y, out=z))):
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        free, held = [], []
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(300):
                fn()
            free.append((time.perf_counter() - t) / 300 * 1e6)
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)  # ~ tens of ms of GPU time
            t = time.perf_counter()
            for _ in range(300):
                fn()
            held.append((time.perf_counter() - t) / 300 * 1e6)
            torch.cuda.synchronize()
        print(f"{label:32s} free-running {statistics.median(free):6.3f} us | behind a busy GPU "
              f"{statistics.median(held):6.3f} us", flush=True)


def section_lean():
    print("\n== lean: host us per call, 1024 fp32, out=, interleaved rounds: how much of the gap "
          "to torch a flatter lean path (all checks kept, one function) closes ==", flush=True)
    from cupylab.ops import _fast
    x, y, z = (torch.randn(1024, device="cuda") for _ in range(3))
    cx, cy, cz = (cp.random.standard_normal(1024, dtype=cp.float32) for _ in range(3))
    cupylab.add(x, y, out=z)
    info = _fast._kinfo[0][torch.float32]
    getdev = cp.cuda.runtime.getDevice
    raw = torch._C._cuda_getCurrentRawStream
    launch = _fast._launch
    TT = torch.Tensor

    def proto(x, y, out):
        fdt = x.dtype
        if type(y) is not TT or type(out) is not TT or y.dtype is not fdt or out.dtype is not fdt:
            return None
        dev = x.get_device()
        shape = x.shape
        if (x.requires_grad or y.requires_grad or out.requires_grad or x.is_neg() or y.is_neg()
                or out.is_neg() or not x.is_contiguous() or not y.is_contiguous()
                or not out.is_contiguous() or y.shape != shape or out.shape != shape
                or y.get_device() != dev or out.get_device() != dev or dev < 0
                or getdev() != dev):
            return None
        n = x.numel()
        p0, p1, po = x.data_ptr(), y.data_ptr(), out.data_ptr()
        nb = n * 4
        if (p0 != po and -nb < p0 - po < nb) or (p1 != po and -nb < p1 - po < nb):
            return None
        launch(info, n, po, p0, p1, 0, 0, 0, dev, raw(dev))
        return out

    cases = {
        "torch.add(x, y, out=z)": lambda: torch.add(x, y, out=z),
        "cupylab.add(x, y, out=z)": lambda: cupylab.add(x, y, out=z),
        "_fast.run(0, x, y, ABSENT, z)": lambda: _fast.run(0, x, y, _fast.ABSENT, z, None),
        "flat prototype(x, y, z)": lambda: proto(x, y, z),
        "_fast._launch only": lambda: launch(info, 1024, z.data_ptr(), x.data_ptr(),
                                             y.data_ptr(), 0, 0, 0, 0, raw(0)),
        "x + y": lambda: x + y,
        "cupylab.add(x, y)": lambda: cupylab.add(x, y),
        "alloc torch.empty_like(x)": lambda: torch.empty_like(x),
        "alloc torch.empty(1024, dtype=, device=)": lambda: torch.empty(
            1024, dtype=torch.float32, device=x.device),
        "alloc x.new_empty((1024,))": lambda: x.new_empty((1024,)),
        "cupy.add(cx, cy, out=cz)": lambda: cp.add(cx, cy, out=cz),
        "cupylab.add(cx, cy, out=cz)": lambda: cupylab.add(cx, cy, out=cz),
        "cx + cy": lambda: cx + cy,
        "cupylab.add(cx, cy)": lambda: cupylab.add(cx, cy),
        "alloc cupy.empty": lambda: cp.empty((1024,), cp.float32),
        "alloc cupy.ndarray": lambda: cp.ndarray((1024,), cp.float32),
        "cx.flags.c_contiguous": lambda: cx.flags.c_contiguous,
        "cx._c_contiguous": lambda: cx._c_contiguous,
    }
    host_rounds(cases)


def ncu16_cases():
    """bf16 and fp32 add at 2^26: torch, ew_contig and the x_hint variants, one call each."""
    for dname in ("bfloat16", "float32"):
        dt, tdt = _dtypes.DTYPES[dname], TDT[dname]
        n = 1 << 26
        nvec = n // (16 // dt.itemsize)
        grid = -(-nvec // 256)
        a, b, d = (torch.randn(n, device="cuda").to(tdt) for _ in range(3))
        args4 = (d.data_ptr(), a.data_ptr(), b.data_ptr(), nvec)
        torch.add(a, b, out=d)
        cupylab.add(a, b, out=d)
        for ld, st in ((1, 0), (2, 1), (3, 0)):
            named_kernel(f"clx::x_hint<{dt.ctype}, 0, {ld}, {st}>", ("Q", "Q", "Q", "q")).launch(
                0, grid, 256, 0, args4)
    torch.cuda.synchronize()


NCU_MODES = {"--ncu": ncu_cases, "--ncuocc": ncuocc_cases, "--ncu16": ncu16_cases,
             "--ncuhot": ncuhot_cases, "--ncuhot2": ncuhot2_cases,
             "--ncurange": ncurange_cases}
SECTIONS = {  # name -> runner, in the order they run
    "host": lambda t: section_host(), "graph": section_graph, "rows": section_rows,
    "memcpy": section_memcpy, "sizes": section_sizes, "hints": section_hints,
    "hints2": section_hints2, "occ": section_occ, "occ2": section_occ2, "occ3": section_occ3,
    "occ4": section_occ4, "occ5": section_occ5, "occ6": section_occ6, "occ7": section_occ7,
    "hot2": section_hot2, "hot3": section_hot3, "order": section_order,
    "burst": lambda t: section_burst(), "lean": lambda t: section_lean(),
}

if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 1 and args[0] in NCU_MODES:
        NCU_MODES[args[0]]()
        sys.exit(0)
    want = set(args) or {"sizes", "graph", "host", "rows"}
    unknown = want - set(SECTIONS)
    if unknown:
        sys.exit(f"unknown section(s): {', '.join(sorted(unknown))}; known: {', '.join(SECTIONS)}")
    print(f"GPU: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {SMS} SMs, "
          f"L2 {L2 >> 20} MiB; torch {torch.__version__}, CuPy {cp.__version__}", flush=True)
    timer = Timer(cp)
    for name, section in SECTIONS.items():
        if name in want:
            section(timer)
