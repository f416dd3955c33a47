"""Host cost per call with tiny inputs, cupylab beside the peers.

Each row times two callables on 1024-element float32 inputs: ``calls`` back-to-back calls,
then a device synchronize, by wall clock, after a warm-up; ``rounds`` rounds, cupylab and the
peer alternating, median reported. At this size the GPU work is far shorter than the host's,
so the time per call is what the host spends issuing it.

Rows, for torch and for CuPy inputs (whichever are usable):

* ``add(x, y, out=z)`` against ``torch.add(x, y, out=z)`` / ``cupy.add(x, y, out=z)``;
* ``add(x, y)`` (allocating) against ``x + y``;
* ``fused_add_mul(a, b, s, out=d)`` against the registered peer writing into ``d`` too
  (torch ``torch.mul(torch.add(a, b), s, out=d)``, the CuPy ElementwiseKernel);
* ``cupylab.prepare(fused_add_mul, a, b, s, out=d)()`` against the same peer;
* one ``add(out=)`` replayed inside a CUDA graph of 100 (captured with torch.cuda.CUDAGraph
  for torch inputs, CuPy stream capture for CuPy inputs), against the framework's own add
  captured the same way: µs per add;
* the same 100 adds captured with cupylab's own helper when it has one (``cupylab.Graph``:
  ``with g.capture(): ...`` then ``g.replay()``), against the framework's graph;
* a user's kernel (:data:`USER_SRC`'s ``vadd`` through ``cupylab.load_kernels``, launched
  with ``launch_1d``: every argument check included) against ``cupy.RawKernel`` of the same
  source on the same memory (CuPy arrays; for torch inputs, CuPy views of the tensors made
  once beforehand), and for torch inputs also against ``cupy.RawKernel`` given the tensors'
  ``data_ptr()`` at each call (how a RawKernel takes a torch tensor, with no check) and
  against ``torch.add(x, y, out=z)``;
* ``cupylab.ElementwiseKernel`` of ``ew_add`` (``out=z`` and allocating) against
  ``cupylab.add`` on the same arrays: a user's elementwise kernel beside cupylab's own;
* torch inputs only, the torch integration's layers on one :data:`RMS_SHAPE` bfloat16
  ``rms_norm`` with a weight (no grad), each against ``torch.nn.functional.rms_norm``:
  ``cupylab.torch.functional.rms_norm`` (the eager no-grad path), the registered operator
  ``torch.ops.cupylab.rms_norm`` (the dispatcher and the custom-op layer; it also returns
  ``rstd``), and ``cupylab.rms_norm`` called directly; and with grad, forward + backward
  through autograd against torch's, and ``cupylab.rms_norm_backward`` against
  ``aten._fused_rms_norm_backward`` (torch >= 2.9).
"""
from __future__ import annotations

import statistics
import time

__all__ = ["measure", "N", "GRAPH_OPS"]

#: Elements of the tiny inputs.
N = 1024
#: Operations captured per CUDA graph.
GRAPH_OPS = 100
#: Warm-up calls before timing.
WARMUP = 200
#: The user kernels of the ``load_kernels`` / ``ElementwiseKernel`` rows: a grid-stride
#: ``vadd`` (also the ``cupy.RawKernel`` peer's source) and ``ew_add`` in the
#: ``k(out, in..., n)`` form ``ElementwiseKernel`` takes.
USER_SRC = r"""
extern "C" __global__ void vadd(const float* x, const float* y, float* out, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = x[i] + y[i];
}
extern "C" __global__ void ew_add(float* out, const float* x, const float* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + y[i];
}
"""
USER_BLOCK = 256
#: The rms_norm rows' input (bfloat16; rows x columns).
RMS_SHAPE = (16, 4096)


def _row(inputs, case, make_cl, peer, make_peer, per=1):
    return {"inputs": inputs, "case": case, "make_cl": make_cl, "peer": peer,
            "make_peer": make_peer, "per": per}


def _torch_graph(torch, fn, count=GRAPH_OPS):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(count):
            fn()
    torch.cuda.synchronize()
    return g.replay


def _cupy_graph(cp, fn, count=GRAPH_OPS):
    for _ in range(3):
        fn()
    cp.cuda.runtime.deviceSynchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        try:
            for _ in range(count):
                fn()
        finally:
            g = s.end_capture()
    return g.launch


def _cupylab_graph(cupylab, fn, sync, count=GRAPH_OPS):
    """Replay function of ``count`` calls of ``fn`` captured with ``cupylab.Graph``."""
    for _ in range(3):
        fn()
    sync()
    g = cupylab.Graph()
    with g.capture():
        for _ in range(count):
            fn()
    return g.replay


def _user_vadd(cupylab, x, y, z):
    k = cupylab.load_kernels(source=USER_SRC)["vadd"]
    return lambda: k.launch_1d(N, x, y, z, N, block=USER_BLOCK)


def _raw_kernel(cp):
    """``cupy.RawKernel`` of the same ``vadd``, the grid and block ``launch_1d`` picks for
    ``N``, and the count as a 32-bit scalar (a Python int would be passed as 64 bits)."""
    return cp.RawKernel(USER_SRC, "vadd"), (-(-N // USER_BLOCK),), (USER_BLOCK,), cp.int32(N)


def _raw_vadd(cp, x, y, z):
    """The RawKernel ``vadd`` on arrays CuPy takes."""
    k, grid, block, n = _raw_kernel(cp)
    args = (x, y, z, n)
    return lambda: k(grid, block, args)


def _raw_vadd_ptrs(cp, x, y, z):
    """The RawKernel ``vadd`` given torch tensors' ``data_ptr()``, read at each call:
    RawKernel takes no torch tensor, and a pointer parameter accepts an ``int``."""
    k, grid, block, n = _raw_kernel(cp)
    return lambda: k(grid, block, (x.data_ptr(), y.data_ptr(), z.data_ptr(), n))


def _ew_add(cupylab):
    return cupylab.ElementwiseKernel(cupylab.load_kernels(source=USER_SRC)["ew_add"],
                                     block=USER_BLOCK)


def _user_rows(inputs, cupylab, cp, x, y, z):
    """The user-kernel rows for ``x``, ``y``, ``z`` of framework ``inputs``."""
    views = (lambda: (x, y, z)) if inputs == "cupy" else (
        lambda: tuple(cp.asarray(a) for a in (x, y, z)))
    vadd = "vadd.launch_1d(n, x, y, z, n), load_kernels"
    return [
        _row(inputs, vadd, lambda: _user_vadd(cupylab, x, y, z),
             "cupy.RawKernel vadd" + (" on CuPy views" if inputs != "cupy" else ""),
             lambda: _raw_vadd(cp, *views())),
        _row(inputs, "ElementwiseKernel ew_add(x, y, out=z)",
             lambda: (lambda e: lambda: e(x, y, out=z))(_ew_add(cupylab)),
             "cupylab.add(x, y, out=z)", lambda: lambda: cupylab.add(x, y, out=z)),
        _row(inputs, "ElementwiseKernel ew_add(x, y)",
             lambda: (lambda e: lambda: e(x, y))(_ew_add(cupylab)),
             "cupylab.add(x, y)", lambda: lambda: cupylab.add(x, y)),
    ]


def _torch_rows(torch, cupylab, cp):
    from .._registry import OPS  # noqa: PLC0415

    x, y, z, a, b, s, d = (torch.rand(N, device="cuda") + 0.5 for _ in range(7))
    fam = OPS["fused_add_mul"].peers.get("torch") if "fused_add_mul" in OPS else None
    rows = [
        _row("torch", "add(x, y, out=z)", lambda: lambda: cupylab.add(x, y, out=z),
             "torch.add(x, y, out=z)", lambda: lambda: torch.add(x, y, out=z)),
        _row("torch", "add(x, y)", lambda: lambda: cupylab.add(x, y),
             "x + y", lambda: lambda: x + y),
        _row("torch", "fused_add_mul(a, b, s, out=d)",
             lambda: lambda: cupylab.fused_add_mul(a, b, s, out=d),
             "torch.mul(torch.add(a, b), s, out=d)", lambda: _torch_fam(torch, fam, a, b, s, d)),
    ]
    rows.append(_row("torch", "prepare(fused_add_mul, a, b, s, out=d)()",
                     lambda: cupylab.prepare(cupylab.fused_add_mul, a, b, s, out=d),
                     "torch.mul(torch.add(a, b), s, out=d)",
                     lambda: _torch_fam(torch, fam, a, b, s, d)))
    rows.append(_row("torch", f"add(out=) in a torch CUDA graph of {GRAPH_OPS}, per add",
                     lambda: _torch_graph(torch, lambda: cupylab.add(x, y, out=z)),
                     f"torch.add(out=) in a torch CUDA graph of {GRAPH_OPS}",
                     lambda: _torch_graph(torch, lambda: torch.add(x, y, out=z)), GRAPH_OPS))
    rows.append(_row("torch", f"add(out=) in a cupylab.Graph of {GRAPH_OPS}, per add",
                     lambda: _cupylab_graph(cupylab, lambda: cupylab.add(x, y, out=z),
                                            torch.cuda.synchronize),
                     f"torch.add(out=) in a torch CUDA graph of {GRAPH_OPS}",
                     lambda: _torch_graph(torch, lambda: torch.add(x, y, out=z)), GRAPH_OPS))
    user = _user_rows("torch", cupylab, cp, x, y, z)
    rows.append(user[0])
    rows.append(_row("torch", user[0]["case"], user[0]["make_cl"],
                     "cupy.RawKernel vadd, data_ptr() per call",
                     lambda: _raw_vadd_ptrs(cp, x, y, z)))
    rows.append(_row("torch", user[0]["case"], user[0]["make_cl"], "torch.add(x, y, out=z)",
                     lambda: lambda: torch.add(x, y, out=z)))
    return rows + user[1:] + _torch_integration_rows(torch, cupylab)


def _torch_integration_rows(torch, cupylab):
    """rms_norm through each layer of ``cupylab.torch`` (imported when the row is made)."""
    rows, cols = RMS_SHAPE
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    size = f"{rows} x {cols} bf16"
    peer = f"torch.nn.functional.rms_norm(x, ({cols},), w, 1e-6)"

    def make_peer():
        return lambda: torch.nn.functional.rms_norm(x, (cols,), w, 1e-6)

    def functional():
        from ..torch import functional as CF  # noqa: PLC0415 - torch only on request

        return lambda: CF.rms_norm(x, (cols,), w, 1e-6)

    def registered():
        from ..torch import functional  # noqa: F401, PLC0415 - registers torch.ops.cupylab

        op = torch.ops.cupylab.rms_norm
        return lambda: op(x, w, 1e-6)

    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_()
    dy = torch.randn_like(x)
    rstd = cupylab.rms_norm(x, w, 1e-6, return_stats=True)[1]

    def train_step():
        from ..torch import functional as CF  # noqa: PLC0415

        return lambda: CF.rms_norm(xg, (cols,), wg, 1e-6).backward(dy)

    def torch_train_step():
        return lambda: torch.nn.functional.rms_norm(xg, (cols,), wg, 1e-6).backward(dy)

    def torch_backward():
        if not hasattr(torch.ops.aten, "_fused_rms_norm_backward"):  # torch < 2.9
            raise RuntimeError("torch.ops.aten._fused_rms_norm_backward needs torch >= 2.9")
        r2 = rstd.view(rows, 1)
        op = torch.ops.aten._fused_rms_norm_backward
        return lambda: op(dy, x, [cols], r2, w, [True, True])

    return [
        _row("torch", f"cupylab.torch.functional.rms_norm(x, ({cols},), w), {size}, no grad",
             functional, peer, make_peer),
        _row("torch", f"cupylab.torch.functional.rms_norm forward + backward (autograd), {size}",
             train_step, "torch.nn.functional.rms_norm forward + backward (autograd)",
             torch_train_step),
        _row("torch", f"cupylab.rms_norm_backward(dy, x, w, rstd) (direct), {size}",
             lambda: lambda: cupylab.rms_norm_backward(dy, x, w, rstd),
             "torch.ops.aten._fused_rms_norm_backward (dx and dw)", torch_backward),
        _row("torch", f"torch.ops.cupylab.rms_norm(x, w, 1e-6) (registered op), {size}",
             registered, peer, make_peer),
        _row("torch", f"cupylab.rms_norm(x, w, 1e-6) (direct), {size}",
             lambda: lambda: cupylab.rms_norm(x, w, 1e-6), peer, make_peer),
    ]


def _torch_fam(torch, fam, a, b, s, d):
    """torch's two-kernel (a + b) * s writing into ``d`` (the registered peer when there is
    one)."""
    if fam:
        return fam(torch, a, b, s, out=d)
    return lambda: torch.mul(torch.add(a, b), s, out=d)


def _cupy_rows(cp, cupylab):
    from .._registry import OPS  # noqa: PLC0415

    x, y, z, a, b, s, d = (cp.random.random(N, dtype=cp.float32) + 0.5 for _ in range(7))
    fam = OPS["fused_add_mul"].peers.get("cupy") if "fused_add_mul" in OPS else None
    rows = [
        _row("cupy", "add(x, y, out=z)", lambda: lambda: cupylab.add(x, y, out=z),
             "cupy.add(x, y, out=z)", lambda: lambda: cp.add(x, y, out=z)),
        _row("cupy", "add(x, y)", lambda: lambda: cupylab.add(x, y),
             "x + y", lambda: lambda: x + y),
        _row("cupy", "fused_add_mul(a, b, s, out=d)",
             lambda: lambda: cupylab.fused_add_mul(a, b, s, out=d),
             "ElementwiseKernel (a + b) * s, out=d" if fam else "cupy.multiply(a + b, s, out=d)",
             (lambda: fam(cp, a, b, s, out=d)) if fam
             else (lambda: lambda: cp.multiply(a + b, s, out=d))),
    ]
    rows.append(_row("cupy", "prepare(fused_add_mul, a, b, s, out=d)()",
                     lambda: cupylab.prepare(cupylab.fused_add_mul, a, b, s, out=d),
                     rows[-1]["peer"], rows[-1]["make_peer"]))
    rows.append(_row("cupy", f"add(out=) in a CuPy CUDA graph of {GRAPH_OPS}, per add",
                     lambda: _cupy_graph(cp, lambda: cupylab.add(x, y, out=z)),
                     f"cupy.add(out=) in a CuPy CUDA graph of {GRAPH_OPS}",
                     lambda: _cupy_graph(cp, lambda: cp.add(x, y, out=z)), GRAPH_OPS))
    rows.append(_row("cupy", f"add(out=) in a cupylab.Graph of {GRAPH_OPS}, per add",
                     lambda: _cupylab_graph(cupylab, lambda: cupylab.add(x, y, out=z),
                                            cp.cuda.runtime.deviceSynchronize),
                     f"cupy.add(out=) in a CuPy CUDA graph of {GRAPH_OPS}",
                     lambda: _cupy_graph(cp, lambda: cp.add(x, y, out=z)), GRAPH_OPS))
    return rows + _user_rows("cupy", cupylab, cp, x, y, z)


def _err(e):
    return f"{type(e).__name__}: {str(e).strip() or repr(e)}"


def _time_row(row, calls, rounds, sync):
    reps = max(1, calls // row["per"])
    fns, errs = {}, {}
    for side in ("cl", "peer"):
        try:
            f = row["make_" + side]()
            for _ in range(max(3, WARMUP // row["per"])):
                f()
            sync()
            fns[side] = f
        except Exception as e:  # noqa: BLE001 - the row reports it
            errs[side] = _err(e)
            try:
                sync()
            except Exception:  # noqa: BLE001
                pass
    times = {side: [] for side in fns}
    for _ in range(max(1, rounds)):
        for side, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            sync()
            times[side].append((time.perf_counter() - t0) * 1e6 / (reps * row["per"]))
    out = {"inputs": row["inputs"], "case": row["case"], "peer": row["peer"],
           "cupylab_us": None, "cupylab_min": None, "cupylab_max": None,
           "peer_us": None, "ratio": None, "error": errs.get("cl"), "peer_error": errs.get("peer"),
           "calls": reps * row["per"], "rounds": max(1, rounds), "per": row["per"]}
    for side, key in (("cl", "cupylab"), ("peer", "peer")):
        t = times.get(side)
        if t:
            out[f"{key}_us"] = statistics.median(t)
            if side == "cl":
                out["cupylab_min"], out["cupylab_max"] = min(t), max(t)
    if out["cupylab_us"] and out["peer_us"]:
        out["ratio"] = out["peer_us"] / out["cupylab_us"]
    return out


def measure(cp, frameworks=("torch", "cupy"), calls=3000, rounds=5, progress=None) -> list:
    """Host cost per call, one record per row.

    Parameters
    ----------
    cp : module
        CuPy with a usable GPU.
    frameworks : sequence of str
        Input frameworks to measure (``"torch"``, ``"cupy"``); unusable ones are reported as
        one row with ``error`` set.
    calls : int
        Back-to-back calls per round (graph rows: replays of ``calls / 100``).
    rounds : int
        Rounds per callable (cupylab and peer alternate).
    progress : callable(str), optional
        Called with a label before each row.

    Returns
    -------
    list of dict
        ``inputs``, ``case``, ``cupylab_us`` (median), ``cupylab_min``/``cupylab_max`` (the
        fastest and slowest round), ``peer``, ``peer_us``, ``ratio`` (peer / cupylab),
        ``error``, ``peer_error``, ``calls``, ``rounds``, ``per`` (operations per timed call).
    """
    import cupylab  # noqa: PLC0415

    from . import _frameworks  # noqa: PLC0415

    def sync():
        cp.cuda.runtime.deviceSynchronize()

    out = []
    for fw in frameworks:
        try:
            mod = _frameworks.load(fw)
            rows = (_torch_rows(mod, cupylab, cp) if fw == "torch"
                    else _cupy_rows(mod, cupylab))
        except Exception as e:  # noqa: BLE001 - Unavailable, or making the inputs failed
            out.append({"inputs": fw, "case": "(inputs)", "peer": None, "cupylab_us": None,
                        "cupylab_min": None, "cupylab_max": None, "peer_us": None,
                        "ratio": None, "error": str(e) if isinstance(e, _frameworks.Unavailable)
                        else _err(e), "peer_error": None, "calls": 0, "rounds": 0, "per": 1})
            continue
        for row in rows:
            if progress is not None:
                progress(f"{fw}: {row['case']}")
            out.append(_time_row(row, calls, rounds, sync))
    return out
