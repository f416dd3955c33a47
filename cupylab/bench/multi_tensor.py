"""List-shaped benchmark cases (multi-tensor operators and fused optimizers) beside torch.

The registry of :mod:`cupylab.bench` describes one array shape per case; these cases take
lists of arrays, so they run here: ``python -m cupylab.bench.multi_tensor [--quick]
[--json PATH]``. Needs torch with CUDA.

Cases
-----
adam_1000x4096
    Wall clock per optimizer step, host included (each timing: ``n`` steps back to back, then
    a synchronisation; median of 5): torch Adam foreach / fused, ``cupylab.torch.optim.Adam``
    and ``AdamW``, the functional ``cupylab.optim.adam_``, and the same prepared
    (``cupylab.foreach.prepare``) with the step counter on the device. The AdamW rows' speed-up
    is against torch's fused AdamW, the others' against its fused Adam.
adam_llama
    The LLaMA-3.2-1B-like parameter list (146 tensors, 1.236 G float32 parameters, tied
    embedding): GPU time per step by CUDA events and bandwidth on the 28 bytes a parameter
    must move (read p, g, m, v; write p, m, v), against a device-to-device copy measured in the
    same run and the 4.25 TB/s ceiling of docs/targets.md.
foreach_add_1000x4096
    ``torch._foreach_add_(xs, ys)`` against ``cupylab.foreach.add_`` on the same torch lists
    (and on CuPy lists, and prepared with ``cupylab.foreach.prepare``), wall clock per call.
clip_llama
    Global-norm clipping of the LLaMA-like gradients: ``torch.nn.utils.clip_grad_norm_``
    (foreach) against ``cupylab.foreach.clip_by_global_norm_``; and whether the cupylab call
    can be captured in a CUDA graph (it cannot if it synchronises the host).

Both small-list cases add a ``floor:`` row: the part of a call that grows with the list
(reading every array's identity and address to find the cached launch table), timed alone.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

from . import _timing

LLAMA_LAYERS = 16
SCHEMA = "cupylab-multi-tensor/1"
#: The rows of the per-call reads alone: what a call of an unchanged list does before its
#: launch that grows with the list (finding its cached launch table), timed on its own. No
#: call that checks its list each time can be faster than these.
FLOOR_ADAM = "floor: the step's table lookup alone (p.grad, data_ptr of params and grads)"
FLOOR_ADD = "floor: the table lookup alone (id, and data_ptr for torch, of every array)"


def llama_shapes(layers=LLAMA_LAYERS, hidden=2048, kv=512, ffn=8192, vocab=128256):
    """The parameter shapes of a LLaMA-3.2-1B-like model (tied embedding): 146 tensors."""
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                   (ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]
    return shapes + [(hidden,)]


def _wall(torch, fn, n, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(ts)


_events = _timing.torch_events_ms


def _params(torch, shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g, device="cuda")) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, device="cuda") * 1e-2
    return ps


def adam_small(torch, rows, n):
    from cupylab import optim as F
    from cupylab.torch import optim as clo

    ps = _params(torch, [(4096,)] * 1000)
    out = {}
    for name, opt in [("torch Adam foreach", torch.optim.Adam(ps, lr=1e-4, foreach=True)),
                      ("torch Adam fused", torch.optim.Adam(ps, lr=1e-4, fused=True)),
                      ("torch AdamW fused", torch.optim.AdamW(ps, lr=1e-4, fused=True)),
                      ("cupylab.torch Adam", clo.Adam(ps, lr=1e-4)),
                      ("cupylab.torch AdamW", clo.AdamW(ps, lr=1e-4))]:
        out[name] = _wall(torch, opt.step, n)
    pd = [p.detach() for p in ps]
    gd = [p.grad for p in ps]
    m = [torch.zeros_like(p) for p in pd]
    v = [torch.zeros_like(p) for p in pd]
    st = [0]

    def functional():
        st[0] += 1
        F.adam_(pd, gd, m, v, lr=1e-4, step=st[0])

    out["cupylab.optim.adam_ (functional)"] = _wall(torch, functional, n)
    from cupylab import foreach

    step = torch.zeros(1, device="cuda")
    inc = foreach.prepare(F.increment_step_, step)
    adam = foreach.prepare(F.adam_, pd, gd, m, v, lr=1e-4, step=step)

    def prepared():
        inc()
        adam()

    out["cupylab.optim.adam_ prepared (device step)"] = _wall(torch, prepared, n)
    cl = clo.Adam(ps, lr=1e-4)
    cl.step()
    out[FLOOR_ADAM] = _wall(torch, lambda: cl._cl_plan(0, cl.param_groups[0]), n)
    for k, t in out.items():  # AdamW rows against torch's fused AdamW, the others its Adam
        ref = out["torch AdamW fused" if "AdamW" in k else "torch Adam fused"]
        rows.append({"case": "adam_1000x4096", "impl": k, "ms_per_step_wall": round(t, 4),
                     "speedup_vs_torch_fused": round(ref / t, 2)})


def copy_ceiling(torch, nbytes=4 << 30):
    a = torch.empty(nbytes // 4, device="cuda")
    b = torch.empty_like(a)
    copy = functools.partial(b.copy_, a)
    t = _events(torch, copy, 5)
    del a, b, copy
    return 2 * nbytes / (t * 1e-3) / 1e9


def adam_llama(torch, rows, n, fraction=1.0):
    from cupylab.ops import _mt_plan as P
    from cupylab.torch import optim as clo

    shapes = llama_shapes(max(1, round(LLAMA_LAYERS * fraction)))
    ps = _params(torch, shapes)
    nparam = sum(p.numel() for p in ps)
    ceil = copy_ceiling(torch)
    byts = 28 * nparam
    out = {}
    variants = [("torch Adam fused", None, None)]
    variants += [(f"cupylab.torch Adam (U={u}, chunk<={P.MAX_CHUNK})", u, P.MAX_CHUNK)
                 for u in P.ADAM_U_CHOICES]
    variants += [(f"cupylab.torch Adam (U={P.ADAM_F32_U}, chunk<=16384)", P.ADAM_F32_U, 16384)]
    default_u, default_chunk = P.ADAM_F32_U, P.MAX_CHUNK
    try:
        for name, u, chunk in variants:
            if u is None:
                opt = torch.optim.Adam(ps, lr=1e-4, fused=True)
            else:
                P.ADAM_F32_U, P.MAX_CHUNK = u, chunk
                opt = clo.Adam(ps, lr=1e-4)
            out[name] = _events(torch, opt.step, n)
            del opt
            torch.cuda.empty_cache()
    finally:
        P.ADAM_F32_U, P.MAX_CHUNK = default_u, default_chunk
    ref = out["torch Adam fused"]
    for k, t in out.items():
        gbs = byts / (t * 1e-3) / 1e9
        rows.append({"case": f"adam_llama ({len(ps)} tensors, {nparam / 1e9:.3f} G params)",
                     "impl": k, "ms_per_step_gpu": round(t, 3), "GB/s": round(gbs),
                     "pct_of_copy_ceiling": round(100 * gbs / ceil, 1),
                     "pct_of_4.25TB/s": round(100 * gbs / 4250, 1),
                     "speedup_vs_torch_fused": round(ref / t, 3)})
    return ps, ceil


def foreach_add(torch, rows, n):
    import cupy as cp

    from cupylab import foreach
    from cupylab.ops import _mt_core as C, _mt_plan as P

    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(4096, generator=g, device="cuda") for _ in range(1000)]
    ys = [torch.randn(4096, generator=g, device="cuda") for _ in range(1000)]
    cx = [cp.random.standard_normal(4096, dtype=cp.float32) for _ in range(1000)]
    cy = [cp.random.standard_normal(4096, dtype=cp.float32) for _ in range(1000)]
    out = {"torch._foreach_add_": _wall(torch, lambda: torch._foreach_add_(xs, ys), n),
           "cupylab.foreach.add_ (torch lists)": _wall(torch, lambda: foreach.add_(xs, ys), n),
           "cupylab.foreach.add_ (CuPy lists)": _wall(torch, lambda: foreach.add_(cx, cy), n),
           "cupylab.foreach.prepare(add_) (torch lists)": _wall(
               torch, foreach.prepare(foreach.add_, xs, ys), n)}
    for lists, what in (([xs, ys], "torch lists"), ([cx, cy], "CuPy lists")):
        if P.cache_get(C.call_key(lists, 1)) is None:  # add_(xs, ys): both read, xs written
            raise RuntimeError(f"{FLOOR_ADD} ({what}): the call's plan is not found this way")
        out[f"{FLOOR_ADD} ({what})"] = _wall(
            torch, lambda lists=lists: P.cache_get(C.call_key(lists, 1)), n)
    ref = out["torch._foreach_add_"]
    for k, t in out.items():
        rows.append({"case": "foreach_add_1000x4096", "impl": k, "ms_per_call_wall": round(t, 4),
                     "speedup_vs_torch": round(ref / t, 2)})


def clip_llama(torch, rows, ps, ceil, n):
    from cupylab import foreach

    grads = [p.grad for p in ps]
    nparam = sum(p.numel() for p in ps)
    # torch reads every gradient for the norm, then reads and writes it to scale (12 bytes per
    # parameter) whether or not the factor is 1. cupylab skips the scaling launch's work when
    # the factor is exactly 1 (a no-op clip: 4 bytes per parameter); with eps=1 the factor
    # stays below 1 call after call, so every call scales (12 bytes per parameter).
    t_torch = _events(torch, lambda: torch.nn.utils.clip_grad_norm_(ps, 1e-3, foreach=True), n)
    t_cl = _events(torch, lambda: foreach.clip_by_global_norm_(grads, 1e-3, eps=1.0), n)
    t_noop = _events(torch, lambda: foreach.clip_by_global_norm_(grads, 1e30), n)
    captured = "yes"
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            foreach.clip_by_global_norm_(grads, 1e-3)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            foreach.clip_by_global_norm_(grads, 1e-3)
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        captured = f"no ({type(e).__name__}: {e})"
    for k, t, b in [("torch clip_grad_norm_ (foreach)", t_torch, 12),
                    ("cupylab.foreach.clip_by_global_norm_ (scaling)", t_cl, 12),
                    ("cupylab.foreach.clip_by_global_norm_ (factor 1: norm only)", t_noop, 4)]:
        gbs = b * nparam / (t * 1e-3) / 1e9
        rows.append({"case": "clip_llama", "impl": k, "ms_per_call_gpu": round(t, 3),
                     "bytes_per_param": b, "GB/s": round(gbs),
                     "pct_of_copy_ceiling": round(100 * gbs / ceil, 1),
                     "speedup_vs_torch": round(t_torch / t, 3),
                     **({"cuda_graph_capture": captured} if k.startswith("cupylab") else {})})


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m cupylab.bench.multi_tensor",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps per timing")
    ap.add_argument("--llama-fraction", type=float, default=1.0,
                    help="share of the 16 LLaMA layers to allocate (memory / time)")
    ap.add_argument("--json", default=None, help="write the rows, with the environment record "
                    "(GPU, versions, command line), to this JSON file (schema "
                    f"{SCHEMA}; docs/perf/multi_tensor.json is one)")
    a = ap.parse_args(argv)
    import torch

    n_small, n_big = (20, 3) if a.quick else (100, 10)
    rows = []
    adam_small(torch, rows, n_small)
    foreach_add(torch, rows, n_small * 2)
    ps, ceil = adam_llama(torch, rows, n_big, a.llama_fraction)
    clip_llama(torch, rows, ps, ceil, n_big)
    rows.append({"case": "ceiling", "impl": "torch copy_ 4 GiB d2d", "GB/s": round(ceil)})
    for r in rows:
        print(" | ".join(f"{k}={v}" for k, v in r.items()))
    if a.json:
        import cupy  # noqa: PLC0415 - installed with cupylab

        from . import _env  # noqa: PLC0415

        doc = {"schema": SCHEMA, "env": _env.collect(cupy), "quick": a.quick,
               "llama_fraction": a.llama_fraction, "rows": rows}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
