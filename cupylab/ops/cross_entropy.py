"""Cross-entropy over the last axis of logits, with the gradient written during the forward
pass or computed afterwards from the forward's log-sum-exp (kernels in ``cuda_src/rowwise.cu``:
the row kernels with ``OP_CE``, ``ce_aux`` and ``ce_backward``)."""
from __future__ import annotations

import math
import numbers

from .. import _dask
from . import _rowcore as rc

__all__ = ["cross_entropy", "cross_entropy_backward"]

_REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(logits, target, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                  return_grad=False, return_lse=False, grad_out=None, *, stream=None):
    """Softmax cross-entropy of ``logits`` (shape ``(..., n)``) against class indices
    ``target`` (shape ``logits.shape[:-1]``), like ``torch.nn.functional.cross_entropy`` with
    the class axis last.

    Per row ``lse = logsumexp(logits)`` and ``loss = (1 - s) * (lse - logits[t]) + s * (lse -
    mean(logits))`` with ``s = label_smoothing``. Rows whose target is ``ignore_index`` have
    loss 0 and gradient 0 and do not count in the mean. **Targets out of range** (``t < 0`` or
    ``t >= n``, other than ``ignore_index``) are not checked on the host (that would
    synchronise): such a row's loss and gradient are NaN, so a mean or sum is NaN too.
    A row's loss keeps float32's relative precision even when it is tiny (a confident row,
    loss ~1e-7): when the target is the row's maximum the loss is computed as
    ``log1p(sum over the other classes of exp(x - max))``, the target's own term kept out of
    the float32 sum (added to it, the others would round away).

    With ``return_grad=True`` the same kernel writes ``dlogits``, the gradient of the returned
    (reduced) loss: ``scale * (softmax(logits) - (1 - s) * onehot(t) - s / n)`` with ``scale =
    1 / (number of rows not ignored)`` for ``"mean"`` and 1 for ``"sum"`` and ``"none"`` (for
    ``"none"``: the gradient of the sum of the row losses). The logits are read once; nothing
    is allocated beyond the gradient (or nothing at all with ``grad_out=logits``) and
    O(rows) float32 values.

    Parameters
    ----------
    logits : GPU array, float16 / bfloat16 / float32 / float64
        Last axis contiguous for the single-read kernels (up to 262,144 classes of 16-bit
        data on compute capability 9.0), else read by the generic kernel.
    target : GPU array of int64 or int32
    ignore_index : int
    label_smoothing : float in [0, 1]
    reduction : {"mean", "sum", "none"}
    return_grad : bool
    return_lse : bool
        Also return the per-row logsumexp (float32; float64 for float64 logits).
    grad_out : GPU array, optional
        Where to write the gradient (logits' shape and dtype); may be ``logits`` itself, which
        then holds the gradient afterwards. Implies ``return_grad``.
    stream : stream, optional

    Returns
    -------
    loss, or a tuple ``(loss, dlogits)``, ``(loss, lse)`` or ``(loss, dlogits, lse)``
        ``loss``: a 0-d array for ``"mean"``/``"sum"``, per row (shape ``logits.shape[:-1]``)
        for ``"none"``; float32 (float64 for float64 logits). ``"mean"`` over no counted row
        is NaN (like torch).

    Raises
    ------
    TypeError
        ``logits`` or ``target`` (or ``grad_out``) not a GPU array (host data, None, any other
        object), unsupported dtypes (target must be int32 or int64), torch tensors that
        require grad.
    ValueError
        Shapes that do not match, an unknown ``reduction``, ``label_smoothing`` outside
        [0, 1], a bad ``grad_out``, arrays on different GPUs.
    """
    op = "cross_entropy"
    check_options(op, ignore_index, label_smoothing, reduction)
    return_grad = return_grad or grad_out is not None
    if _dask.is_dask(logits) or _dask.is_dask(target):
        refuse = [("return_grad", return_grad)] if return_grad else []
        return _dask.cross_entropy(cross_entropy, logits, target, ignore_index,
                                   label_smoothing, reduction, refuse, stream, return_lse)
    c = rc.gather(op, {"logits": logits, "target": target, "grad_out": grad_out}, stream,
                  required=2)
    xv, tv = c.views["logits"], c.views["target"]
    check_arrays(op, xv, tv)
    rc.check_columns(op, xv.shape, "logits has no classes")
    a = rc.acc_dtype(xv.dtype)
    gv = gobj = None
    if return_grad:
        if grad_out is not None:
            gv, gobj = c.views["grad_out"], grad_out
            rc.check_out(op, "grad_out", gv, xv.shape, xv.dtype)
            rc.overlap(op, gv, "grad_out", [("logits", xv)])
            # the targets are read by the row kernel and again by the reduction after it:
            # no shared byte (broadcast to the logits' shape, only their first was compared)
            rc.disjoint(op, gv, "grad_out", [("target", tv)])
        else:
            gobj, gv = rc.new_array(c, xv.shape, xv.dtype)
    lay = rc.row_layout(op, xv.shape, [xv, None, gv, None], -1, extra=(tv,))
    rows = lay.rows
    loss_obj, lv = rc.new_array(c, lay.lead_shape, a)
    lse_obj = lsv = None
    if return_lse:
        lse_obj, lsv = rc.new_array(c, lay.lead_shape, a)
    red_obj = rv = None
    if reduction != "none":
        red_obj, rv = rc.new_array(c, (), a)
    flags = rc.FLAG_TARGET_I32 if tv.dtype is rc.I32 else 0
    with rc._launch.ensure_device(c.device):
        tptr = tv.ptr
        scale_obj = sv = None
        if return_grad and reduction == "mean" and rows:
            scale_obj, sv = _mean_scale(c, xv, tv, lay, ignore_index, flags)
        if rows:
            rc.launch_rows(c, rc.OP[op], xv.dtype, lay, lambda parts: rc.pack(
                {"in0": xv.ptr, "out0": gv.ptr if gv is not None else 0, "target": tptr,
                 "loss": lv.ptr, "st0": lsv.ptr if lsv is not None else 0,
                 "scale": sv.ptr if sv is not None else 0},
                lay, ignore_index=ignore_index, flags=flags, smooth=label_smoothing))
        if rv is not None:
            mean = rc.FLAG_MEAN if reduction == "mean" else 0
            _aux(xv.dtype).launch(c.device, 1, 1024, c.stream, rc.pack(
                {"target": tptr, "loss": lv.ptr, "out0": rv.ptr}, lay,
                ignore_index=ignore_index, flags=flags | mean))
    res = [rc.finish(c, red_obj if red_obj is not None else loss_obj)]
    if return_grad:
        res.append(gobj if grad_out is not None else rc.finish(c, gobj))
    if return_lse:
        res.append(rc.finish(c, lse_obj))
    return res[0] if len(res) == 1 else tuple(res)


def cross_entropy_backward(logits, target, lse, grad_loss=None, ignore_index=-100,
                           label_smoothing=0.0, reduction="mean", out=None, *, stream=None):
    """The gradient of :func:`cross_entropy`'s loss with respect to ``logits``, from the
    per-row log-sum-exp its forward returned (``return_lse=True``): one read of the logits
    and one write of the gradient.

    ``dlogits = g * (softmax(logits) - (1 - s) * onehot(t) - s / n)`` per row, with
    ``softmax = exp(logits - lse)``, ``s = label_smoothing``, ``n`` the number of classes and
    ``g = grad_loss`` (the incoming gradient of the loss) times ``1 / (number of rows not
    ignored)`` for ``"mean"``. Rows whose target is ``ignore_index`` get 0; a target out of
    range (not ``ignore_index``) gives NaN in its row, as the forward's gradient does. The
    result equals ``cross_entropy(..., return_grad=True)``'s gradient scaled by
    ``grad_loss``, computed in float32 (float64 for float64 logits) and rounded once to the
    logits' dtype: a loss scale (float16 training) never meets a rounded 16-bit gradient.

    Parameters
    ----------
    logits : GPU array, float16 / bfloat16 / float32 / float64
        The forward's logits, classes on the last axis (any row and column strides).
    target : GPU array of int64 or int32
        Shape ``logits.shape[:-1]``.
    lse : GPU array
        The forward's log-sum-exp: float32 (float64 for float64 logits), one value per row,
        C-contiguous.
    grad_loss : GPU array or real number, optional
        The gradient of the returned loss (default 1). For ``"mean"`` and ``"sum"`` a
        single value (shape ``()``); for ``"none"`` shape ``()`` or ``logits.shape[:-1]``
        (any strides, broadcast ones included). Its dtype is the logits' or float32
        (float64 for float64 logits).
    ignore_index, label_smoothing, reduction
        As given to the forward.
    out : GPU array, optional
        Where to write the gradient (logits' shape and dtype); may be ``logits`` itself.
    stream : stream, optional

    Returns
    -------
    dlogits : array of the logits' shape and dtype, in the caller's framework (``out`` when
        given); lazy when any array is a Dask array (chunk by chunk of rows, the mean's count
        of kept rows taken by Dask over all of them; ``lse`` must then have the shape
        ``logits.shape[:-1]``).

    Raises
    ------
    TypeError
        Arrays that are not GPU arrays, unsupported dtypes, torch tensors that require grad;
        with Dask arrays, ``out=`` or ``stream=``.
    ValueError
        Shapes that do not match, an ``lse`` that is not one contiguous value per row, an
        unknown ``reduction``, ``label_smoothing`` outside [0, 1], a bad ``out``, arrays on
        different GPUs.
    """
    op = "cross_entropy_backward"
    check_options(op, ignore_index, label_smoothing, reduction)
    if any(_dask.is_dask(a) for a in (logits, target, lse, grad_loss, out)):
        if isinstance(grad_loss, numbers.Number):
            rc.real_value(op, "grad_loss", grad_loss, "a finite number")
        return _dask.cross_entropy_backward(cross_entropy_backward, logits, target, lse,
                                            grad_loss, ignore_index, label_smoothing,
                                            reduction, out, stream)
    gl_array = grad_loss is not None and not isinstance(grad_loss, numbers.Number)
    scalar = 1.0 if grad_loss is None else (
        None if gl_array else rc.real_value(op, "grad_loss", grad_loss, "a finite number"))
    c = rc.gather(op, {"logits": logits, "target": target, "lse": lse,
                       "grad_loss": grad_loss if gl_array else None, "out": out}, stream,
                  required=3)
    xv, tv, lv = c.views["logits"], c.views["target"], c.views["lse"]
    check_arrays(op, xv, tv)
    rc.check_columns(op, xv.shape, "logits has no classes")
    a = rc.acc_dtype(xv.dtype)
    rows = math.prod(xv.shape[:-1])
    rc.check_stats(op, "lse", lv, rows, a)
    gv = c.views.get("grad_loss")
    flags = rc.FLAG_TARGET_I32 if tv.dtype is rc.I32 else 0
    extra = [tv]
    if gv is not None:
        flags |= check_grad_loss(op, gv, xv, a, reduction)
        if gv.shape != ():
            extra.append(gv)
    if out is not None:
        ov, oobj = c.views["out"], out
        rc.check_out(op, "out", ov, xv.shape, xv.dtype)
        rc.overlap(op, ov, "out", [("logits", xv)])
        rc.disjoint(op, ov, "out", [("target", tv), ("lse", lv), ("grad_loss", gv)])
    else:
        oobj, ov = rc.new_array(c, xv.shape, xv.dtype)
    lay = rc.row_layout(op, xv.shape, [xv, None, ov, None], -1, extra=tuple(extra))
    if rows:
        with rc._launch.ensure_device(c.device):
            scale_obj = sv = None
            if reduction == "mean":
                scale_obj, sv = _mean_scale(c, xv, tv, lay, ignore_index, flags)
            k = rc.kernel("ce", xv.dtype, f"cl::ce_backward<{xv.dtype.ctype}>")
            v = 16 // xv.dtype.itemsize
            tiles = -(-(lay.cols + v) // (v * CEB_SLOTS))
            k.launch(c.device, min(rows, 2**31 - 1), CEB_THREADS, c.stream, rc.pack(
                {"in0": xv.ptr, "out0": ov.ptr, "target": tv.ptr, "st0": lv.ptr,
                 "loss": gv.ptr if gv is not None else 0,
                 "scale": sv.ptr if sv is not None else 0},
                lay, ignore_index=ignore_index, flags=flags,
                eps=scalar if scalar is not None else 0.0, smooth=label_smoothing),
                grid_yz=(min(tiles, 65535), 1))
    return oobj if out is not None else rc.finish(c, oobj)


#: flags bit of ce_backward: the loss gradient is of the logits' dtype (else float32/64)
FLAG_DLOSS_T = 8
#: CEB_THREADS, CEB_U in cupylab_ce_backward.cuh: threads per block, 16-byte slots per thread
#: in a tile (CEB_SLOTS = slots per block tile)
CEB_THREADS, CEB_U = 256, 4
CEB_SLOTS = CEB_THREADS * CEB_U


def _mean_scale(c, xv, tv, lay, ignore_index, flags):
    """``1 / count`` of the rows not ignored (0 when none), written by ``ce_aux`` on
    ``c.stream`` into a new one-element array of the accumulation dtype: ``(array, view)``;
    the caller keeps the array until the kernels that read it are queued."""
    obj, sv = rc.new_array(c, (1,), rc.acc_dtype(xv.dtype))
    _aux(xv.dtype).launch(c.device, 1, 1024, c.stream, rc.pack(
        {"target": tv.ptr, "scale": sv.ptr}, lay, ignore_index=ignore_index, flags=flags))
    return obj, sv


def _aux(dt):
    """``ce_aux`` (the kept-row count, the mean's scale, the loss's reduction) for logits of
    ``dt``."""
    return rc.kernel("ce", dt, f"cl::ce_aux<{rc.acc_dtype(dt).ctype}>")


def check_grad_loss(op, gv, xv, a, reduction):
    """The loss gradient's view ``gv``: of the logits' dtype or the accumulation dtype ``a``,
    shape ``()`` (or ``logits.shape[:-1]`` for ``"none"``). Returns the flags bit that says
    it is of the logits' dtype (:data:`FLAG_DLOSS_T`, 0 when not)."""
    if gv.dtype is not xv.dtype and gv.dtype is not a:
        want = a.name if xv.dtype is a else f"{xv.dtype.name} or {a.name}"
        raise TypeError(f"{op}: grad_loss must be {want} (got {gv.dtype.name})")
    lead = xv.shape[:-1]
    if gv.shape != () and (reduction != "none" or gv.shape != lead):
        want = "() or " + str(lead) if reduction == "none" else "()"
        raise ValueError(f"{op}: grad_loss must have shape {want} for reduction="
                         f"{reduction!r}; got {gv.shape}")
    return FLAG_DLOSS_T if gv.dtype is xv.dtype and xv.dtype is not a else 0


def check_options(op, ignore_index, label_smoothing, reduction):
    """The scalar arguments: ``reduction`` one of "mean", "sum", "none"; ``label_smoothing`` a
    real number in [0, 1]; ``ignore_index`` an int (not a bool) that 64 bits hold."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS} (got {reduction!r})")
    what = "a number in [0, 1]"
    if not 0.0 <= rc.real_value(op, "label_smoothing", label_smoothing, what) <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be {what} (got {label_smoothing!r})")
    if not isinstance(ignore_index, numbers.Integral) or type(ignore_index).__name__ in (
            "bool", "bool_"):
        raise TypeError(f"{op}: ignore_index must be an int (got {ignore_index!r})")
    if not -2**63 <= int(ignore_index) < 2**63:
        raise ValueError(f"{op}: ignore_index must fit in 64 bits (got {ignore_index!r})")


def check_arrays(op, xv, tv):
    """The checks of the logits and target views that need no GPU (the Dask form makes them
    when it is called): logits of a float dtype with at least one dimension, a target of
    int64 or int32 with the shape ``logits.shape[:-1]``."""
    rc.check_float(op, "logits", xv)
    rc.check_not_0d(op, "logits", xv)
    if tv.dtype not in (rc.I64, rc.I32):
        raise TypeError(f"{op}: target must be int64 or int32 (got {tv.dtype.name})")
    if tv.shape != xv.shape[:-1]:
        raise ValueError(f"{op}: target must have shape {xv.shape[:-1]} (logits.shape[:-1]); "
                         f"got {tv.shape}")
