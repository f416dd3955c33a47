"""The lean path of ``add_rms_norm`` over a float32 residual stream and of its backward
(:mod:`cupylab.ops.resnorm`): every operand a plain C-contiguous torch tensor (or every one a
CuPy array) on the current device, 16-byte aligned, rows of whole quads that a register class
holds; no ``out=``, no ``inplace``, no ``stream=``; ``dtype`` / ``x_dtype`` None or the
framework's own dtype object.

As in :mod:`cupylab.ops._rowfast`, the kernel, its grid and the constant tail of its arguments
are planned once per signature with the general path's functions; a call reads each operand's
pointer, allocates the outputs and launches. Anything else, every error case included, returns
:data:`MISS` and the general path validates, raises or launches the same kernels with the same
arguments (a CPU test compares the two paths' arguments).
"""
from __future__ import annotations

import math

from .. import _dtypes, _runtime
from . import _rowcore as rc
from . import _rowfast as F
from . import resnorm as R

MISS = F.MISS
_plans: dict = {}
_PLAN_CACHE_MAX = 512


class Plan:
    """``k``, ``grid``, ``block``; ``tail`` (rows ... eps excluded, :func:`resnorm._pack`);
    ``fdt`` (the framework dtype of ``y`` forward, of ``dx`` backward, None: not written);
    ``lead`` (the statistics' shape); ``ks`` (the column-sum kernel, backward with a weight
    gradient)."""

    __slots__ = ("k", "grid", "block", "tail", "fdt", "lead", "ks")


def _dt(fdt):
    try:
        return _dtypes.resolve(fdt)
    except TypeError:
        return None


def _framework_dtype(d, like):
    """Whether ``d`` is a dtype object of the framework whose dtype ``like`` is (a
    ``torch.dtype``; a NumPy dtype for CuPy), not a name or a type of another kind."""
    return type(d) is type(like) or type(type(d)) is type(type(like)) is not type


def _rows_layout(shape, slots):
    """The general path's layout (:func:`resnorm.layout`) of C-contiguous row operands of
    ``shape`` in ``slots`` (the others absent)."""
    lay = R._Layout()
    lay.rows, lay.cols, lay.lead = math.prod(shape[:-1]), shape[-1], tuple(shape[:-1])
    lay.n1 = max(1, lay.rows)
    lay.so = [0] * 5
    lay.si = [lay.cols if len(shape) > 1 and i in slots else 0 for i in range(5)]
    lay.cs = [1 if i in slots else 0 for i in range(5)]
    lay.quad_ok = True
    return lay


def _keep(key, plan):
    if len(_plans) >= _PLAN_CACHE_MAX:
        _plans.clear()
    _plans[key] = plan
    return plan


def _probe_like(fw, tp, a, shape, dev):
    """The probe of ``a`` (an array of the lead's type and device, and of ``shape`` unless it
    is None), or None."""
    if type(a) is not tp:
        return None
    p = fw[0](a)
    return p if p is not None and (shape is None or p[1] == shape) and p[3] == dev else None


def _weight(fw, tp, w, cols, dev):
    """``(pointer, framework dtype)`` of a weight, ``(0, None)`` without one, None to miss."""
    if w is None:
        return 0, None
    p = _probe_like(fw, tp, w, None, dev)
    return None if p is None or tuple(p[1]) != (cols,) else (p[2], p[0])


# -- forward ------------------------------------------------------------------------------------
def forward(x, residual, weight, eps, dtype, return_stats):
    """``(y, h[, rstd])`` as the general path returns them, or :data:`MISS`."""
    try:
        fe = float(eps) if type(eps) in (float, int) else -1.0
        lead = F._lead(x) if 0.0 <= fe < F._INF else None
        if lead is None:
            return MISS
        fw, tp, px = lead
        fdt, shape, p0, dev = px
        pr = _probe_like(fw, tp, residual, shape, dev)
        if pr is None or (pr[0] == fdt and (dtype is None or dtype == fdt)):
            return MISS  # one dtype throughout: the row kernels (as the general path)
        if dtype is not None and not _framework_dtype(dtype, fdt):
            return MISS
        wp = _weight(fw, tp, weight, shape[-1], dev)
        if wp is None or (p0 | pr[2] | wp[0]) & 15:
            return MISS
        key = ("fwd", fdt, pr[0], wp[1], dtype, shape, dev)
        plan = _plans.get(key, 0)
        if plan == 0:
            plan = _keep(key, _forward_plan(fdt, pr[0], wp[1], dtype, shape, dev))
        if plan is None:
            return MISS
        new = fw[1]
        y, py = new(x, None, plan.fdt)
        h, ph = new(residual, None, None)
        rstd, ps = new(residual, plan.lead, None) if return_stats else (None, 0)
        stream = fw[2](dev)
    except Exception:  # noqa: BLE001 - anything odd: the general path validates and explains
        return MISS
    plan.k.launch(dev, plan.grid, plan.block, stream,
                  (p0, pr[2], py, ph, 0, wp[0], ps, 0, *plan.tail, fe))
    return (y, h, rstd) if return_stats else (y, h)


def _forward_plan(fdt, rfdt, wfdt, dtype, shape, dev):
    xd, rd = _dt(fdt), _dt(rfdt)
    yfdt = rfdt if dtype is None else dtype
    yd = _dt(yfdt)
    if (xd not in R.TYPES or rd is not R.F32 or yd not in R.TYPES
            or (wfdt is not None and _dt(wfdt) is not R.F32)):
        return None
    cls = R.choose("fwd", shape[-1], True)
    if cls is None:
        return None
    lay = _rows_layout(shape, (0, 1, 2, 3))
    p = Plan()
    p.k = R._kernel(xd, R.kernel_name("fwd", xd, yd, cls))
    p.block = cls[0]
    p.grid = min(-(-lay.rows // (cls[0] // cls[1])), R._INT32_MAX)
    p.tail = R._pack((0,) * 8, lay)[8:-1]
    p.fdt, p.lead, p.ks = yfdt, lay.lead, None
    return p


# -- backward -----------------------------------------------------------------------------------
def backward(dy, h, weight, rstd, dh, x_dtype, weight_grad):
    """``(dresidual, dx, dweight)`` as the general path returns them, or :data:`MISS`."""
    try:
        lead = F._lead(h)
        if lead is None:
            return MISS
        fw, tp, phh = lead
        hfdt, shape, ph, dev = phh
        pdy = _probe_like(fw, tp, dy, shape, dev)
        pdh = (0, None) if dh is None else _probe_like(fw, tp, dh, shape, dev)
        prs = _probe_like(fw, tp, rstd, shape[:-1], dev)
        wp = _weight(fw, tp, weight, shape[-1], dev)
        if (pdy is None or pdh is None or prs is None or wp is None
                or (dh is not None and pdh[0] != hfdt) or prs[0] != hfdt
                or (x_dtype is not None and not _framework_dtype(x_dtype, hfdt))):
            return MISS
        if (pdy[2] | ph | (pdh[2] if dh is not None else 0) | wp[0]) & 15:
            return MISS
        wgrad = weight is not None and bool(weight_grad)
        key = ("bwd", pdy[0], hfdt, x_dtype, wp[1], wgrad, dh is not None, shape, dev)
        plan = _plans.get(key, 0)
        if plan == 0:
            plan = _keep(key, _backward_plan(pdy[0], hfdt, x_dtype, wp[1], wgrad, dh is not None,
                                             shape, dev))
        if plan is None:
            return MISS
        new = fw[1]
        g, pg = new(h, None, None)
        gx, pgx = new(h, None, plan.fdt) if plan.fdt is not None else (g, 0)
        dw, pdw = new(h, (shape[-1],), None) if wgrad else (None, 0)
        part, pp = new(h, (plan.grid, shape[-1]), None) if wgrad else (None, 0)
        stream = fw[2](dev)
    except Exception:  # noqa: BLE001
        return MISS
    plan.k.launch(dev, plan.grid, plan.block, stream,
                  (pdy[2], ph, pdh[2] if dh is not None else 0, pg, pgx, wp[0], prs[2], pp,
                   *plan.tail, 0.0))
    if wgrad:
        rc.launch_col_sum(plan.ks, dev, stream, pp, plan.grid, shape[-1], pdw)
    return g, gx, dw


def _backward_plan(dyfdt, hfdt, x_dtype, wfdt, wgrad, has_dh, shape, dev):
    dyd, hd = _dt(dyfdt), _dt(hfdt)
    xd = R.F32 if x_dtype is None else _dt(x_dtype)
    if (dyd not in R.TYPES or hd is not R.F32 or xd not in R.TYPES
            or (wfdt is not None and _dt(wfdt) is not R.F32)):
        return None
    cls = R.choose("bwd", shape[-1], True)
    if cls is None:
        return None
    lay = _rows_layout(shape, (0, 1, 3) + ((2,) if has_dh else ()) + (() if xd is R.F32
                                                                         else (4,)))
    p = Plan()
    p.k = R._kernel(xd, R.kernel_name("bwd", xd, dyd, cls))
    p.block = cls[0]
    p.grid = R.backward_grid(lay.rows, cls, _runtime.device_info(dev).sm_count)
    p.tail = R._pack((0,) * 8, lay)[8:-1]
    p.fdt = None if xd is R.F32 else x_dtype
    p.lead = lay.lead
    p.ks = R.col_sum(xd) if wgrad else None
    return p
