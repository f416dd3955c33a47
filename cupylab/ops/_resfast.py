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

from .. import _arrays, _runtime
from . import _rowcore as rc
from . import _rowfast as F
from . import resnorm as R

MISS = F.MISS
_plans: dict = {}
_PLAN_CACHE_MAX = 512


class Plan:
    """``k``, ``grid``, ``block``; ``tail`` (rows ... eps excluded, :func:`resnorm._pack`);
    ``lead`` (the statistics' shape); ``ks`` (the column-sum kernel, backward with a weight
    gradient)."""

    __slots__ = ("k", "grid", "block", "tail", "lead", "ks")


def _framework_dtype(d, like):
    """Whether ``d`` is a dtype object of the framework whose dtype ``like`` is (a
    ``torch.dtype``; a NumPy dtype for CuPy), not a name or a type of another kind."""
    return type(d) is type(like) or type(type(d)) is type(type(like)) is not type


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
        if plan is None:
            return MISS
        new = fw[1]
        y, py = new(x, None, pr[0] if dtype is None else dtype)
        h, ph = new(residual, None, None)
        if plan == 0:
            plan = _keep(key, _forward_plan(x, residual, weight, y, h, dev))
            if plan is None:
                return MISS
        rstd, ps = new(residual, plan.lead, None) if return_stats else (None, 0)
        stream = fw[2](dev)
    except Exception:  # noqa: BLE001 - anything odd: the general path validates and explains
        return MISS
    plan.k.launch(dev, plan.grid, plan.block, stream,
                  (p0, pr[2], py, ph, 0, wp[0], ps, 0, *plan.tail, fe))
    return (y, h, rstd) if return_stats else (y, h)


def _views(objs):
    return [None if o is None else _arrays.as_view(o, "add_rms_norm") for o in objs]


def _forward_plan(x, residual, weight, y, h, dev):
    """The plan of the first call of a signature: the general path's class, grid and layout
    (:func:`resnorm.layout`) of these arrays; None where the general path must run."""
    xv, rv, yv, hv, wv = _views((x, residual, y, h, weight))
    if (xv.dtype not in R.TYPES or rv.dtype is not R.F32 or yv.dtype not in R.TYPES
            or (wv is not None and wv.dtype is not R.F32)):
        return None
    lay = R.layout("add_rms_norm", xv.shape, [xv, rv, yv, hv], wv)
    cls = R.choose("fwd", lay.cols, lay.quad_ok)
    if cls is None:
        return None
    p = Plan()
    p.k = R._kernel(xv.dtype, R.kernel_name("fwd", xv.dtype, yv.dtype, cls))
    p.block, p.grid = cls[0], R.forward_grid(lay.rows, cls)
    p.tail = R._pack((0,) * 8, lay)[8:-1]
    p.lead, p.ks = lay.lead, None
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
        if plan is None:
            return MISS
        new = fw[1]
        g, pg = new(h, None, None)
        gx, pgx = (g, 0) if x_dtype is None or x_dtype == hfdt else new(h, None, x_dtype)
        if plan == 0:
            plan = _keep(key, _backward_plan(dy, h, dh, g, None if gx is g else gx, weight,
                                             wgrad, dev))
            if plan is None:
                return MISS
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


def _backward_plan(dy, h, dh, g, gx, weight, wgrad, dev):
    """As :func:`_forward_plan`, for the backward (``gx`` None: the branch is float32)."""
    dyv, hv, dhv, gv, gxv, wv = _views((dy, h, dh, g, gx, weight))
    xd = R.F32 if gxv is None else gxv.dtype
    if (dyv.dtype not in R.TYPES or hv.dtype is not R.F32 or xd not in R.TYPES
            or (wv is not None and wv.dtype is not R.F32)):
        return None
    lay = R.layout("add_rms_norm_backward", hv.shape, [dyv, hv, dhv, gv, gxv], wv)
    cls = R.choose("bwd", lay.cols, lay.quad_ok)
    if cls is None:
        return None
    p = Plan()
    p.k = R._kernel(xd, R.kernel_name("bwd", xd, dyv.dtype, cls))
    p.block = cls[0]
    p.grid = R.backward_grid(lay.rows, cls, _runtime.device_info(dev).sm_count)
    p.tail = R._pack((0,) * 8, lay)[8:-1]
    p.lead = lay.lead
    p.ks = R.col_sum(xd) if wgrad else None
    return p
