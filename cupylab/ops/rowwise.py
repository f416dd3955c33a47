"""Row-wise fused operators over the last axis: ``softmax``, ``log_softmax``, ``rms_norm``,
``layer_norm``, ``add_rms_norm`` and their backward (``softmax_backward``,
``log_softmax_backward``, ``rms_norm_backward``, ``layer_norm_backward``). Cross-entropy is in
:mod:`cupylab.ops.cross_entropy`.

Every function takes arrays of any leading shape from any framework (CuPy, torch, JAX, Numba,
CUDA Array Interface, DLPack) zero-copy, runs on the caller's current stream (torch's for torch
inputs, CuPy's otherwise) or ``stream=``, and returns arrays of the caller's framework.
Kernel choice per row length: :mod:`cupylab.ops._rowcore`.
"""
from __future__ import annotations

import math

from .. import _dask
from . import _rowcore as rc
from . import _rowfast
from . import _resfast
from . import resnorm as _resnorm

_MISS = _rowfast.MISS

__all__ = ["softmax", "log_softmax", "rms_norm", "layer_norm", "add_rms_norm",
           "softmax_backward", "log_softmax_backward", "rms_norm_backward",
           "layer_norm_backward"]

_COMMON = """
    Arrays may come from CuPy, torch, JAX, Numba or anything with ``__cuda_array_interface__``
    / ``__dlpack__``; they are used without copying. Leading dimensions may be strided (they
    must merge into at most two strided levels); rows are read once from memory when the last
    axis is contiguous and the row fits the register kernels (forwards: up to 262,144 16-bit
    elements, 131,072 float32, 65,536 float64 on compute capability 9.0; 32,768 / 16,384 /
    8,192 before; backwards, which hold two rows: 16,384 / 8,192 / 4,096), else by a slower
    generic kernel that reads each row two or three times.
    Computation is in float32 for 16-bit and float32 data, float64 for float64.

    Runs on the caller's current stream (torch's for torch arrays, CuPy's otherwise) or on
    ``stream``; never blocks the host. New arrays are of the first argument's framework
    (torch, CuPy, JAX, Numba; CuPy for other producers).

    Raises
    ------
    TypeError
        An array argument that is not a GPU array (host data, None where an array is
        required, any other object), dtypes other than float16/bfloat16/float32/float64,
        mismatched dtypes, torch tensors that require grad; a backward without the forward's
        statistics.
    ValueError
        Mismatched shapes, a bad ``out`` (shape, read-only, partial overlap with an input),
        arrays on different GPUs, leading dimensions that cannot be merged.
"""


def _doc(f, text):
    f.__doc__ = text + _COMMON
    return f


def _axis(opname, axis, nd):
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"{opname}: axis must be an int (got {axis!r})")
    if nd == 0:
        raise ValueError(f"{opname}: x must have at least one dimension (got a 0-d array)")
    if not -nd <= axis < nd:
        raise ValueError(f"{opname}: axis {axis} is out of range for {nd} dimensions")
    return axis % nd


def _softmax_like(opname, x, axis, out, stream):
    if out is None and stream is None:
        r = _rowfast.softmax(opname, x, axis)
        if r is not _MISS:
            return r
    if _dask.is_dask(x):
        return _dask.rowwise(opname, globals()[opname], [("x", x)], axis, {}, out, stream)
    c = rc.gather(opname, {"x": x, "out": out}, stream)
    xv = c.views["x"]
    rc.check_float(opname, "x", xv)
    ax = _axis(opname, axis, xv.ndim)
    if out is not None:
        ov = c.views["out"]
        rc.check_out(opname, "out", ov, xv.shape, xv.dtype)
        rc.overlap(opname, ov, "out", [("x", xv)])
        obj = out
    else:
        obj, ov = rc.new_array(c, xv.shape, xv.dtype)
    lay = rc.row_layout(opname, xv.shape, [xv, None, ov, None], ax)
    if lay.rows and lay.cols:
        op = rc.OP[opname]
        with rc._launch.ensure_device(c.device):
            rc.launch_rows(c, op, xv.dtype, lay,
                           lambda parts: rc.pack({"in0": xv.ptr, "out0": ov.ptr}, lay))
    return obj if out is not None else rc.finish(c, obj)


def softmax(x, axis=-1, out=None, *, stream=None):
    return _softmax_like("softmax", x, axis, out, stream)


def log_softmax(x, axis=-1, out=None, *, stream=None):
    return _softmax_like("log_softmax", x, axis, out, stream)


_doc(softmax, """``exp(x - max) / sum(exp(x - max))`` along ``axis``.

    Parameters
    ----------
    x : GPU array, float16 / bfloat16 / float32 / float64
    axis : int
        The last axis is the fast path; any other axis is reduced through a strided view by the
        generic kernel (correct, slower).
    out : GPU array, optional
        Of x's shape and dtype; may be ``x`` itself (in place).
    stream : stream, optional

    Returns
    -------
    array
        Rows of ``-inf`` only give NaN (like torch); a NaN or ``+inf`` in a row makes the row
        NaN.
""")
_doc(log_softmax, """``x - max - log(sum(exp(x - max)))`` along ``axis``.

    Parameters
    ----------
    x : GPU array, float16 / bfloat16 / float32 / float64
    axis : int
        As for :func:`softmax`.
    out : GPU array, optional
        Of x's shape and dtype; may be ``x`` itself.
    stream : stream, optional

    Returns
    -------
    array
""")


def _norm(opname, x, residual, weight, bias, eps, return_stats, inplace, out, stream,
          dtype=None):
    if out is None and stream is None:
        # the lean paths: one dtype throughout (_rowfast), or a float32 residual stream
        # (_resfast; add_rms_norm with a residual of another dtype, or dtype=)
        stream32 = residual is not None and (dtype is not None or getattr(
            x, "dtype", None) != getattr(residual, "dtype", None))
        r = _MISS
        if not stream32:
            r = _rowfast.norm(opname, x, residual, weight, bias, eps, return_stats, inplace)
        elif not inplace:
            r = _resfast.forward(x, residual, weight, eps, dtype, return_stats)
        if r is not _MISS:
            return r
    if _dask.is_dask(x) or _dask.is_dask(residual):
        kw = {"eps": eps}
        if residual is not None:  # add_rms_norm: h by the elementwise add, then rms_norm of h
            if dtype is not None:
                raise TypeError(f"{opname}: dtype= is not supported with Dask arrays")
            if inplace:
                raise TypeError(f"{opname}: inplace=True is not supported with Dask arrays "
                                "(they are immutable); use the returned h")
            if return_stats:
                raise TypeError(f"{opname}: return_stats=True is not supported with Dask "
                                "arrays")
            # the eager op's checks of the two rows (one dtype, the same shape: no broadcast
            # residual), before the add
            xv = _dask.view(opname, "x", x)
            rc.check_float(opname, "x", xv)
            rv = _dask.view(opname, "residual", residual)
            if rv.dtype is not xv.dtype and rv.dtype is rc.F32 and xv.dtype in _resnorm.TYPES:
                raise TypeError(f"{opname}: a residual of another dtype than x (a float32 "
                                "residual stream) is not supported with Dask arrays")
            rc.check_same(opname, "residual", rv, xv)
            from .elementwise import add  # noqa: PLC0415

            h = add(x, residual)
            if weight is not None:
                kw["weight"] = weight
            return _dask.rowwise(opname, rms_norm, [("x", h)], -1, kw, out, stream), h
        if weight is not None:
            kw["weight"] = weight
        if bias is not None:
            kw["bias"] = bias
        return _dask.rowwise(opname, globals()[opname], [("x", x)], -1, kw, out, stream,
                             refuse=[("return_stats", True)] if return_stats else ())
    c = rc.gather(opname, {"x": x, "residual": residual, "weight": weight, "bias": bias,
                           "out": out}, stream)
    v = c.views
    xv = v["x"]
    rc.check_float(opname, "x", xv)
    rc.check_not_0d(opname, "x", xv)
    rc.check_eps(opname, eps)
    flags = rc.check_vectors(opname, {k: v[k] for k in ("weight", "bias") if k in v}, xv)
    rc.check_columns(opname, xv.shape)  # before any output is allocated
    rv = v.get("residual")
    if rv is not None and (
            (rv.dtype is not xv.dtype and rv.dtype is rc.F32)
            or (dtype is not None and not (rv.dtype is xv.dtype
                                           and _resnorm.same_dtype(dtype, xv.dtype)))):
        # a float32 residual stream (a float32 residual under another branch dtype, or a y of
        # another dtype): h stays float32
        return _resnorm.add_rms_norm_mixed(c, opname, residual, eps, inplace, out, dtype,
                                           return_stats)
    if rv is not None:
        rc.check_same(opname, "residual", rv, xv)
        if inplace and rv.readonly:
            raise ValueError(f"{opname}: residual is read-only ({rv.kind}); inplace=True needs "
                             "a writable residual")
        if inplace:  # h is written into it: an output's rules
            rc.check_out(opname, "residual", rv, xv.shape, xv.dtype)
            rc.overlap(opname, rv, "residual", [("x", xv)])
            # h is stored before the weight is read: no shared byte at all (a one-row
            # residual at the weight's address passed as "exactly in place")
            rc.disjoint(opname, rv, "residual", [("weight", v.get("weight")),
                                                 ("bias", v.get("bias"))])
    if out is not None:
        ov = v["out"]
        rc.check_out(opname, "out", ov, xv.shape, xv.dtype)
        ins = [("x", xv), ("weight", v.get("weight")), ("bias", v.get("bias"))]
        if rv is not None:
            ins.append(("residual", rv))
        rc.overlap(opname, ov, "out", ins if rv is None or not inplace else ins[:3])
        if rv is not None and inplace:
            rc.overlap(opname, ov, "out", [("residual", rv)])
            if ov.ptr == rv.ptr and ov.size:
                raise ValueError(f"{opname}: out cannot be the residual when inplace=True")
        yobj = out
    else:
        yobj, ov = rc.new_array(c, xv.shape, xv.dtype)
    hobj = hv = None
    if rv is not None:
        if inplace:
            hobj, hv = residual, rv
        else:
            hobj, hv = rc.new_array(c, xv.shape, xv.dtype)
    lay = rc.row_layout(opname, xv.shape, [xv, rv, ov, hv], -1)
    a = rc.acc_dtype(xv.dtype)
    lead = lay.lead_shape
    mean_obj = mv = rstd_obj = sv = None
    if return_stats:
        if opname == "layer_norm":
            mean_obj, mv = rc.new_array(c, lead, a)
        rstd_obj, sv = rc.new_array(c, lead, a)
    if lay.rows:
        ptrs = {"in0": xv.ptr, "in1": rv.ptr if rv is not None else 0, "out0": ov.ptr,
                "out1": hv.ptr if hv is not None else 0,
                "w": v["weight"].ptr if "weight" in v else 0,
                "b": v["bias"].ptr if "bias" in v else 0,
                "st0": mv.ptr if mv is not None else 0, "st1": sv.ptr if sv is not None else 0}
        with rc._launch.ensure_device(c.device):
            op = rc.OP[opname]
            wb = rc.staged_weight_bytes(op, lay.cols, v.get("weight"), v.get("bias"))
            rc.launch_rows(c, op, xv.dtype, lay,
                           lambda parts: rc.pack(ptrs, lay, flags=flags, eps=eps), wbytes=wb)
    y = yobj if out is not None else rc.finish(c, yobj)
    res = [y]
    if rv is not None:
        res.append(hobj if inplace else rc.finish(c, hobj))
    if return_stats:
        if mean_obj is not None:
            res.append(rc.finish(c, mean_obj))
        res.append(rc.finish(c, rstd_obj))
    return res[0] if len(res) == 1 else tuple(res)


def rms_norm(x, weight=None, eps=1e-6, return_stats=False, out=None, *, stream=None):
    return _norm("rms_norm", x, None, weight, None, eps, return_stats, False, out, stream)


def layer_norm(x, weight=None, bias=None, eps=1e-5, return_stats=False, out=None, *,
               stream=None):
    return _norm("layer_norm", x, None, weight, bias, eps, return_stats, False, out, stream)


def add_rms_norm(x, residual, weight, eps=1e-6, inplace=False, out=None, *, return_stats=False,
                 dtype=None, stream=None):
    if residual is None:
        raise TypeError("add_rms_norm: residual is required (a GPU array of x's shape and "
                        "dtype); without one, call rms_norm")
    return _norm("add_rms_norm", x, residual, weight, None, eps, return_stats, inplace, out,
                 stream, dtype)


_doc(rms_norm, """``x / sqrt(mean(x**2) + eps) * weight`` over the last axis.

    Parameters
    ----------
    x : GPU array, float16 / bfloat16 / float32 / float64, shape ``(..., n)``
    weight : GPU array, optional
        Shape ``(n,)``, contiguous; x's dtype, or float32 with 16-bit x.
    eps : float
    return_stats : bool
        Also return ``rstd`` (shape ``x.shape[:-1]``; float32, float64 for float64 x), what
        :func:`rms_norm_backward` needs.
    out : GPU array, optional
        Of x's shape and dtype; may be ``x``.
    stream : stream, optional

    Returns
    -------
    y or (y, rstd)
""")
_doc(layer_norm, """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis
    (biased variance, computed from the row held in registers; the mean is shifted by the
    row's first element, so a constant row's is exact and the row gives exactly 0).

    Parameters
    ----------
    x : GPU array, float16 / bfloat16 / float32 / float64, shape ``(..., n)``
    weight, bias : GPU arrays, optional
        Shape ``(n,)``, contiguous, one dtype: x's, or float32 with 16-bit x.
    eps : float
    return_stats : bool
        Also return ``mean`` and ``rstd`` (shape ``x.shape[:-1]``, float32; float64 for
        float64 x).
    out : GPU array, optional
    stream : stream, optional

    Returns
    -------
    y or (y, mean, rstd)
""")
_doc(add_rms_norm, """``h = x + residual`` (rounded to x's dtype), ``y = rms_norm(h, weight,
    eps)``, in one pass.

    Over a float32 residual stream (mixed-precision training: a float32 ``residual`` under a
    float16 / bfloat16 / float32 ``x``, or any ``dtype=``), ``h`` is float32 (``x`` widened,
    the sum rounded once), ``y`` is written in ``dtype`` (float32 by default), the weight must
    be float32 or None, and :func:`add_rms_norm_backward` is the backward (Dask arrays are
    not supported there).

    Parameters
    ----------
    x, residual : GPU arrays of one shape
        One dtype, or a float32 ``residual`` under a 16-bit or float32 ``x``.
    weight : GPU array or None
        Shape ``(n,)``; x's dtype, or float32 with 16-bit x (float32 over a float32 stream).
    eps : float
    inplace : bool
        Write ``h`` into ``residual`` (what inference engines do) instead of a new array.
    out : GPU array, optional
        For ``y`` (of ``dtype`` over a float32 stream); may be ``x``.
    return_stats : bool
        Also return ``rstd`` of ``h`` (shape ``x.shape[:-1]``; float32, float64 for float64
        x), what :func:`rms_norm_backward` needs (with ``h`` as its ``x``).
    dtype : dtype, optional
        The dtype of ``y``: float16, bfloat16 or float32, over a float32 residual stream (with
        ``x``'s dtype and a residual of that dtype, the same-dtype operator runs). The dtype its
        consumer wants: a 16-bit matrix multiply's input, written once instead of cast in a
        pass of its own.
    stream : stream, optional

    Returns
    -------
    (y, h) or (y, h, rstd)
        ``h`` is ``residual`` itself when ``inplace=True``.
""")


# --------------------------------------------------------------------------------------------
# backward
def _softmax_bwd(opname, y, dy, out, stream):
    if out is None and stream is None:
        r = _rowfast.softmax_backward(opname, y, dy)
        if r is not _MISS:
            return r
    if _dask.is_dask(y) or _dask.is_dask(dy):
        return _dask.rowwise(opname, globals()[opname], [("y", y), ("dy", dy)], -1, {}, out,
                             stream)
    c = rc.gather(opname, {"y": y, "dy": dy, "out": out}, stream, required=2)
    yv, dv = c.views["y"], c.views["dy"]
    rc.check_float(opname, "y", yv)
    rc.check_same(opname, "dy", dv, yv, "y")
    rc.check_not_0d(opname, "y", yv)
    if out is not None:
        ov = c.views["out"]
        rc.check_out(opname, "out", ov, yv.shape, yv.dtype)
        rc.overlap(opname, ov, "out", [("y", yv), ("dy", dv)])
        obj = out
    else:
        obj, ov = rc.new_array(c, yv.shape, yv.dtype)
    lay = rc.row_layout(opname, yv.shape, [yv, dv, ov, None], -1)
    if lay.rows and lay.cols:
        with rc._launch.ensure_device(c.device):
            rc.launch_rows(c, rc.OP[opname], yv.dtype, lay, lambda parts: rc.pack(
                {"in0": yv.ptr, "in1": dv.ptr, "out0": ov.ptr}, lay))
    return obj if out is not None else rc.finish(c, obj)


def softmax_backward(y, dy, out=None, *, stream=None):
    return _softmax_bwd("softmax_backward", y, dy, out, stream)


def log_softmax_backward(y, dy, out=None, *, stream=None):
    return _softmax_bwd("log_softmax_backward", y, dy, out, stream)


_doc(softmax_backward, """Gradient of :func:`softmax` over the last axis:
    ``dx = y * (dy - sum(y * dy))``.

    Parameters
    ----------
    y : GPU array
        The softmax output.
    dy : GPU array
        Gradient of the loss with respect to ``y`` (same shape and dtype).
    out : GPU array, optional
        For ``dx``; may be ``y`` or ``dy``.
    stream : stream, optional

    Returns
    -------
    dx
""")
_doc(log_softmax_backward, """Gradient of :func:`log_softmax` over the last axis:
    ``dx = dy - exp(y) * sum(dy)``.

    Parameters
    ----------
    y : GPU array
        The log_softmax output.
    dy : GPU array
    out : GPU array, optional
        For ``dx``; may be ``y`` or ``dy``.
    stream : stream, optional

    Returns
    -------
    dx
""")


def _norm_bwd(opname, dy, x, weight, mean, rstd, weight_grad, stream):
    if stream is None:
        r = _rowfast.norm_backward(opname, dy, x, weight, mean, rstd, weight_grad)
        if r is not _MISS:
            return r
    if any(_dask.is_dask(a) for a in (dy, x, mean, rstd)):
        stats = [("mean", mean)] if opname == "layer_norm_backward" else []
        return _dask.norm_backward(opname, globals()[opname], dy, x, weight,
                                   stats + [("rstd", rstd)], stream, weight_grad)
    c = rc.gather(opname, {"dy": dy, "x": x, "weight": weight, "mean": mean, "rstd": rstd},
                  stream, required=2)
    v = c.views
    dv, xv = v["dy"], v["x"]
    rc.check_float(opname, "x", xv)
    rc.check_same(opname, "dy", dv, xv)
    rc.check_not_0d(opname, "x", xv)
    cols = xv.shape[-1]
    flags = rc.check_vectors(opname, {k: v[k] for k in ("weight",) if k in v}, xv)
    a = rc.acc_dtype(xv.dtype)
    rows = math.prod(xv.shape[:-1])
    for name in (("mean", "rstd") if opname == "layer_norm_backward" else ("rstd",)):
        if name not in v:
            raise TypeError(f"{opname}: {name} is required (the statistics the forward returned)")
        rc.check_stats(opname, name, v[name], rows, a)
    rc.check_columns(opname, xv.shape)
    dxobj, dxv = rc.new_array(c, xv.shape, xv.dtype)  # after every argument check
    lay = rc.row_layout(opname, xv.shape, [xv, dv, dxv, None], -1)
    wdt = v["weight"].dtype if "weight" in v and weight_grad else None
    dw = dwv = db = dbv = None
    if wdt is not None:
        dw, dwv = rc.new_array(c, (cols,), wdt)
        if opname == "layer_norm_backward":
            db, dbv = rc.new_array(c, (cols,), wdt)
    bufs = []  # the partial-sum arrays, alive until the column sum is queued
    parts = {}  # their addresses: "part0" (dweight), "part1" (dbias)

    def parts_cb(n):
        for key, target in (("part0", dwv), ("part1", dbv)):
            if target is not None:
                o, pv = rc.new_array(c, (n, cols), a)
                bufs.append(o)
                parts[key] = pv.ptr
        return parts

    ptrs = {"in0": xv.ptr, "in1": dv.ptr, "out0": dxv.ptr,
            "w": v["weight"].ptr if "weight" in v else 0,
            "st0": v["mean"].ptr if "mean" in v else 0, "st1": v["rstd"].ptr}
    with rc._launch.ensure_device(c.device):
        nparts = 0
        if lay.rows:
            nparts = rc.launch_rows(c, rc.OP[opname], xv.dtype, lay,
                                    lambda pp: rc.pack({**ptrs, **pp}, lay, flags=flags),
                                    parts_cb if wdt is not None else None)
        if wdt is not None:
            rc.launch_col_sum(rc.col_sum_kernel(xv.dtype, wdt), c.device, c.stream,
                              parts.get("part0", 0), nparts, cols, dwv.ptr,
                              parts.get("part1", 0), dbv.ptr if dbv is not None else 0)
    res = [rc.finish(c, dxobj), rc.finish(c, dw) if dw is not None else None]
    if opname == "layer_norm_backward":
        res.append(rc.finish(c, db) if db is not None else None)
    return tuple(res)


def rms_norm_backward(dy, x, weight, rstd, *, weight_grad=True, stream=None):
    return _norm_bwd("rms_norm_backward", dy, x, weight, None, rstd, weight_grad, stream)


def layer_norm_backward(dy, x, weight, mean, rstd, *, weight_grad=True, stream=None):
    return _norm_bwd("layer_norm_backward", dy, x, weight, mean, rstd, weight_grad, stream)


_doc(rms_norm_backward, """Gradients of :func:`rms_norm`: with ``xh = x * rstd`` and
    ``g = dy * weight``, ``dx = rstd * (g - xh * mean(g * xh))`` and
    ``dweight = sum over rows of dy * xh``. The weight gradient is reduced in two
    deterministic stages (float32 partial sums per block, then a column-sum kernel; no
    atomics): the same inputs give the same bits.

    Parameters
    ----------
    dy, x : GPU arrays of one shape and dtype
    weight : GPU array or None
        As given to the forward.
    rstd : GPU array
        The statistics from ``rms_norm(..., return_stats=True)``.
    weight_grad : bool
        False: ``dx`` only (the weight still scales it), no weight gradient computed (a
        frozen weight, gradients with respect to ``x`` alone).
    stream : stream, optional

    Returns
    -------
    (dx, dweight)
        ``dweight`` in the weight's dtype, None without a weight or with
        ``weight_grad=False``.
""")
_doc(layer_norm_backward, """Gradients of :func:`layer_norm`: with ``xh = (x - mean) * rstd``
    and ``g = dy * weight``, ``dx = rstd * (g - mean(g) - xh * mean(g * xh))``,
    ``dweight = sum over rows of dy * xh`` and ``dbias = sum over rows of dy`` (two-stage,
    deterministic, no atomics).

    Parameters
    ----------
    dy, x : GPU arrays of one shape and dtype
    weight : GPU array or None
    mean, rstd : GPU arrays
        The statistics from ``layer_norm(..., return_stats=True)``.
    weight_grad : bool
        False: ``dx`` only, no weight or bias gradient computed.
    stream : stream, optional

    Returns
    -------
    (dx, dweight, dbias)
        ``dweight`` and ``dbias`` in the weight's dtype; both None without a weight or with
        ``weight_grad=False``.
""")


# -- registry entries (tests and cupylab-bench): _rowwise_cases.py -----------------------------
from . import _rowwise_cases  # noqa: E402 - its cases call the functions above

_rowwise_cases.register()
