"""The lean path of the row-wise operators: every operand a plain C-contiguous torch tensor (or
every one a CuPy array) on the current device, no ``out=``, no ``stream=``, rows to compute.

The general path (:mod:`cupylab.ops.rowwise`) turns each operand into a View, checks it, lays
the rows out, chooses the kernel and its grid, packs the arguments and launches: about 30-90 µs
of host time per call, several times the GPU time of a norm over a few thousand rows. Here the
choice is made once per *signature* — operator, dtype, shape, the weight's dtype, which
operands are present, every input's address modulo 16 and the device (whose SM count, compute
capability and shared-memory opt-in the plan depends on) — by the general path's own
functions (:func:`_rowcore.make_layout`, :func:`_rowcore.choose`, :func:`_rowcore.grid_for`,
:func:`_rowcore.pipe_plan`) and kept as a :class:`Plan`; a call then reads each operand's
pointer, shape and dtype, allocates its outputs and launches the planned kernel(s).

Anything else — including every error case — returns :data:`MISS` and the caller takes the
general path, which validates fully and raises the documented errors; both paths launch the
same kernels with the same arguments (GPU tests compare both paths' launches and results bit for
bit; a CPU test drives this module with a fake framework).
"""
from __future__ import annotations

import functools
import math
import sys

from .. import _arrays, _launch, _runtime
from .._elementwise_core import _np_dtype_for
from . import _rowcore as rc

MISS = object()
_INF = float("inf")

_PLAN_CACHE_MAX = 1024
_plans: dict = {}


class Plan:
    """What a call of one signature launches: the row kernel (``k``, ``grid``, ``block``,
    ``smem``: :func:`_rowcore.plan_rows`), the constant tail of its arguments (``tail``: rows
    ... column strides), ``nparts`` rows of partial sums and the column-sum kernel ``ks`` for
    the weight gradients, and the leading shape of the statistics (``lead``)."""

    __slots__ = ("k", "grid", "block", "smem", "tail", "nparts", "ks", "lead")


# -- the two frameworks ------------------------------------------------------------------------
# probe(a) -> (framework dtype, shape, pointer, device) for a plain C-contiguous GPU array,
# else None; new(like, shape, framework dtype or None for like's dtype) -> (array, pointer)
def _probe_torch(t):
    if t.requires_grad or t.is_neg() or not t.is_contiguous():
        return None
    return t.dtype, t.shape, t.data_ptr(), t.get_device()


def _probe_cupy(a):
    if not a._c_contiguous:
        return None
    m = a.data
    return a.dtype, a.shape, m.ptr, m.device_id


_torch_empty_like = _torch_empty = None


def _new_torch(like, shape, fdt):
    if fdt is None and shape is None:
        o = _torch_empty_like(like)
    else:
        o = _torch_empty(shape if shape is not None else like.shape,
                         dtype=like.dtype if fdt is None else fdt, device=like.device)
    return o, o.data_ptr()


_cupy_ndarray = None


def _new_cupy(like, shape, fdt):
    o = _cupy_ndarray(like.shape if shape is None else shape, like.dtype if fdt is None else fdt)
    return o, o.data.ptr


_frameworks: dict = {}  # type -> (probe, new, stream(device), {dtype: accumulation dtype})
_get_device = None


def _acc_table(conv):
    """Framework dtype -> the framework's accumulation dtype (:func:`_rowcore.acc_dtype`), for
    the float dtypes it has; ``conv`` maps a cupylab DType to the framework's (TypeError when
    it has none)."""
    table = {}
    for d in rc.FLOATS:
        try:
            table[conv(d)] = conv(rc.acc_dtype(d))
        except TypeError:  # bfloat16 CuPy arrays without ml_dtypes
            pass
    return table


def _framework(tp):
    """Classify an array type (first use, by the adapters' own rule: :mod:`cupylab._arrays`):
    the torch or CuPy tuple for the plain ``torch.Tensor`` / ``cupy.ndarray`` (not a subclass),
    or None."""
    global _torch_empty_like, _torch_empty, _cupy_ndarray, _get_device
    fw = None
    adapter = _arrays._ADAPTERS.get(tp) or _arrays._classify(tp)
    torch = sys.modules["torch"] if adapter is _arrays._from_torch else None
    cp = sys.modules["cupy"] if adapter is _arrays._from_cupy else None
    if torch is not None and tp is torch.Tensor:
        _torch_empty_like, _torch_empty = torch.empty_like, torch.empty
        fw = (_probe_torch, _new_torch, functools.partial(_launch.current_stream, "torch"),
              _acc_table(lambda d: getattr(torch, d.name)))
    elif cp is not None and tp is cp.ndarray:
        _cupy_ndarray = cp.ndarray
        fw = (_probe_cupy, _new_cupy, functools.partial(_launch.current_stream, "cupy"),
              _acc_table(lambda d: cp.dtype(_np_dtype_for(d))))
    if fw is not None and _get_device is None:
        _get_device = _runtime.cupy().cuda.runtime.getDevice
    _frameworks[tp] = fw
    return fw


def _fw(tp):
    """The framework tuple for arrays of type ``tp`` (cached), or None."""
    fw = _frameworks.get(tp, 0)
    return _framework(tp) if fw == 0 else fw


def _lead(x):
    """``(framework, type, probe)`` of a call's first array when the lean path may take it:
    a plain C-contiguous float array of a known framework with rows to compute, on the
    current device; else None."""
    tp = type(x)
    fw = _fw(tp)
    if fw is None:
        return None
    px = fw[0](x)
    if px is None or px[0] not in fw[3] or not px[1] or 0 in px[1] or _get_device() != px[3]:
        return None
    return fw, tp, px


def _same(fw, tp, b, pa):
    """The address of ``b`` when it is an array like the probed one (``pa``): same type,
    dtype, shape and device, plain C-contiguous; else None."""
    if type(b) is not tp:
        return None
    pb = fw[0](b)
    if pb is None or pb[0] != pa[0] or pb[1] != pa[1] or pb[3] != pa[3]:
        return None
    return pb[2]


def _lead_pair(a, b):
    """:func:`_lead` of ``a`` plus the address of ``b``, an array like it; or None."""
    lead = _lead(a)
    if lead is None:
        return None
    p1 = _same(lead[0], lead[1], b, lead[2])
    return None if p1 is None else (*lead, p1)


def _plan(key, opname, objs, weight, flags, dev, bias=None):
    """Build the plan of ``key`` from the first call's operands (``objs``: the row operands in
    slot order in0, in1, out0, out1, None for absent; on device ``dev``; ``weight`` and
    ``bias``, None for absent) with the general path's functions."""
    op = rc.OP[opname]
    views = [None if o is None else _arrays.as_view(o, opname) for o in objs]
    x = views[0]
    dt = x.dtype
    lay = rc.make_layout(opname, x.shape, views, -1)
    p = Plan()
    wv, bv = (None if a is None else _arrays.as_view(a, opname) for a in (weight, bias))
    wb = rc.staged_weight_bytes(op, lay.cols, wv, bv)
    p.k, p.grid, p.block, p.smem, p.nparts = rc.plan_rows(op, dt, lay, dev, wb)
    p.tail = rc.pack_tail(lay, flags)
    p.ks = None
    if wv is not None and op in rc.BWD_W:
        p.ks = rc.col_sum_kernel(dt, wv.dtype)
    p.lead = tuple(x.shape[:-1])
    if len(_plans) >= _PLAN_CACHE_MAX:
        _plans.clear()
    _plans[key] = p
    return p


def _weight(fw, tp, w, fdt, cols, dev):
    """``(pointer, flags, dtype)`` of a weight/bias for x of dtype ``fdt``, or None to miss:
    x's array type ``tp``, shape (cols,), contiguous, x's dtype or float32 with 16-bit x, on
    ``dev``."""
    if type(w) is not tp:
        return None
    pw = fw[0](w)
    if (pw is None or pw[3] != dev or len(pw[1]) != 1 or pw[1][0] != cols
            or pw[2] % pw[0].itemsize):  # a byte-offset CuPy .view(): the general path refuses
        return None
    if pw[0] == fdt:
        return pw[2], 0, pw[0]
    if fw[3].get(fdt) == pw[0] and fdt.itemsize == 2:
        return pw[2], rc.FLAG_W_F32, pw[0]
    return None


def _overlap(a, alen, b, blen):
    """Whether the byte spans ``[a, a + alen)`` and ``[b, b + blen)`` meet."""
    return a < b + blen and b < a + alen


def norm(opname, x, residual, weight, bias, eps, return_stats, inplace):
    """``rms_norm`` / ``layer_norm`` / ``add_rms_norm`` with ``out=None``, ``stream=None``:
    the result as the general path returns it, or :data:`MISS`."""
    try:
        # a finite eps >= 0 (eps=inf, NaN or an int past float's range: the general path's
        # errors; float() of a huge int raises here, inside the try)
        fe = float(eps) if type(eps) in (float, int) else -1.0
        lead = _lead(x) if 0.0 <= fe < _INF else None
        if lead is None:
            return MISS
        fw, tp, px = lead
        new, stream_of = fw[1], fw[2]
        fdt, shape, p0, dev = px
        a = fw[3][fdt]
        cols = shape[-1]
        p1 = pw = pb = flags = 0
        wdt = None
        if residual is not None:
            p1 = _same(fw, tp, residual, px)
            if p1 is None:
                return MISS
            if inplace:
                nb = math.prod(shape) * fdt.itemsize
                if p1 != p0 and _overlap(p0, nb, p1, nb):
                    return MISS  # h written over part of x: the general path refuses it
        if weight is not None:
            r = _weight(fw, tp, weight, fdt, cols, dev)
            if r is None:
                return MISS
            pw, flags, wdt = r
            if inplace and residual is not None and _overlap(pw, cols * wdt.itemsize, p1, nb):
                return MISS  # h written over the weight
        if bias is not None:
            r = _weight(fw, tp, bias, fdt, cols, dev)
            if r is None or (wdt is not None and r[2] != wdt):
                return MISS
            pb, flags = r[0], r[1]
        key = (opname, fdt, shape, wdt, flags, bias is not None, residual is not None,
               p0 & 15, p1 & 15, dev)
        y, py = new(x, None, None)
        h = None
        ph = 0
        if residual is not None:
            if inplace:
                h, ph = residual, p1
            else:
                h, ph = new(x, None, None)
        plan = _plans.get(key)
        if plan is None:
            plan = _plan(key, opname, (x, residual, y, h), weight, flags, dev, bias)
        if py & 15 or (ph & 15 and not inplace):
            return MISS  # a fresh output off 16 bytes: not what the plan assumed
        mean = rstd = None
        pm = ps = 0
        if return_stats:
            if opname == "layer_norm":
                mean, pm = new(x, plan.lead, a)
            rstd, ps = new(x, plan.lead, a)
        stream = stream_of(dev)
    except Exception:  # noqa: BLE001 - anything odd: the general path validates and explains
        return MISS
    plan.k.launch(dev, plan.grid, plan.block, stream,
                  (py, ph, p0, p1, pw, pb, pm, ps, 0, 0, 0, 0, 0, *plan.tail, fe, 0.0),
                  shared_mem=plan.smem)
    res = (y,) if h is None else (y, h)
    if return_stats:
        res += (rstd,) if mean is None else (mean, rstd)
    return res[0] if len(res) == 1 else res


def softmax(opname, x, axis):
    """``softmax`` / ``log_softmax`` over the last axis with ``out=None``, ``stream=None``."""
    try:
        lead = _lead(x) if type(axis) is int else None
        if lead is None:
            return MISS
        fw, _, px = lead
        new, stream_of = fw[1], fw[2]
        fdt, shape, p0, dev = px
        if axis != -1 and axis != len(shape) - 1:
            return MISS
        y, py = new(x, None, None)
        key = (opname, fdt, shape, p0 & 15, dev)
        plan = _plans.get(key)
        if plan is None:
            plan = _plan(key, opname, (x, None, y, None), None, 0, dev)
        if py & 15:
            return MISS
        stream = stream_of(dev)
    except Exception:  # noqa: BLE001
        return MISS
    plan.k.launch(dev, plan.grid, plan.block, stream,
                  (py, 0, p0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, *plan.tail, 0.0, 0.0),
                  shared_mem=plan.smem)
    return y


def softmax_backward(opname, y, dy):
    """``softmax_backward`` / ``log_softmax_backward`` with ``out=None``, ``stream=None``."""
    try:
        lead = _lead_pair(y, dy)
        if lead is None:
            return MISS
        fw, _, (fdt, shape, p0, dev), p1 = lead
        dx, pd = fw[1](y, None, None)
        key = (opname, fdt, shape, p0 & 15, p1 & 15, dev)
        plan = _plans.get(key)
        if plan is None:
            plan = _plan(key, opname, (y, dy, dx, None), None, 0, dev)
        if pd & 15:
            return MISS
        stream = fw[2](dev)
    except Exception:  # noqa: BLE001
        return MISS
    plan.k.launch(dev, plan.grid, plan.block, stream,
                  (pd, 0, p0, p1, 0, 0, 0, 0, 0, 0, 0, 0, 0, *plan.tail, 0.0, 0.0),
                  shared_mem=plan.smem)
    return dx


def _stats(fw, s, a, rows, dev):
    """Pointer of a statistics operand: ``a`` dtype, C-contiguous, ``rows`` values, or None."""
    ps = fw[0](s)
    if ps is None or ps[0] != a or ps[3] != dev or ps[2] % a.itemsize:  # (misaligned view)
        return None
    return ps[2] if math.prod(ps[1]) == rows else None


def norm_backward(opname, dy, x, weight, mean, rstd, weight_grad=True):
    """``rms_norm_backward`` / ``layer_norm_backward`` with ``stream=None``."""
    try:
        lead = _lead_pair(x, dy)
        if lead is None or type(rstd) is not lead[1]:
            return MISS
        fw, tp, (fdt, shape, p0, dev), p1 = lead
        new = fw[1]
        a = fw[3][fdt]
        cols = shape[-1]
        rows = math.prod(shape[:-1])
        ps = _stats(fw, rstd, a, rows, dev)
        pm = 0
        if opname == "layer_norm_backward":
            if type(mean) is not tp:
                return MISS
            pm = _stats(fw, mean, a, rows, dev)
            if pm is None:
                return MISS
        if ps is None:
            return MISS
        pw = flags = 0
        wdt = None
        if weight is not None:
            r = _weight(fw, tp, weight, fdt, cols, dev)
            if r is None:
                return MISS
            pw, flags, wdt = r
        dx, pd = new(x, None, None)
        key = (opname, fdt, shape, wdt, p0 & 15, p1 & 15, dev)
        plan = _plans.get(key)
        if plan is None:
            plan = _plan(key, opname, (x, dy, dx, None), weight, flags, dev)
        if pd & 15:
            return MISS
        dw = db = parts0 = parts1 = None  # the partial sums live until both launches are queued
        pp0 = pp1 = pdw = pdb = 0
        if wdt is not None and weight_grad:
            dw, pdw = new(x, (cols,), wdt)
            if plan.nparts:
                parts0, pp0 = new(x, (plan.nparts, cols), a)
            if opname == "layer_norm_backward":
                db, pdb = new(x, (cols,), wdt)
                if plan.nparts:
                    parts1, pp1 = new(x, (plan.nparts, cols), a)
        stream = fw[2](dev)
    except Exception:  # noqa: BLE001
        return MISS
    plan.k.launch(dev, plan.grid, plan.block, stream,
                  (pd, 0, p0, p1, pw, 0, pm, ps, pp0, pp1, 0, 0, 0, *plan.tail, 0.0, 0.0),
                  shared_mem=plan.smem)
    if dw is not None:
        rc.launch_col_sum(plan.ks, dev, stream, pp0, plan.nparts, cols, pdw, pp1, pdb)
    del parts0, parts1  # freed in stream order: the launches above are queued first
    if opname == "layer_norm_backward":
        return dx, dw, db
    return dx, dw
