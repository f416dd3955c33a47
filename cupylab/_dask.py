"""Dask arrays in, Dask arrays out: cupylab's elementwise operators on ``dask.array.Array``
operands whose chunks are GPU arrays (CuPy, or anything cupylab accepts).

Dask is the engine: a call builds a lazy Dask array with Dask's own graph tool
(:func:`dask.array.blockwise`), one cupylab call per output chunk, and Dask schedules it
(threads, or ``dask.distributed`` workers, one per GPU with ``dask-cuda``). Nothing here
computes. Broadcasting follows NumPy across chunked operands; chunk alignment is left to Dask
(``unify_chunks``); Python and NumPy scalars go to every chunk as they are; a GPU array that is
not a Dask array becomes a one-chunk Dask array, which Dask aligns like the others. The result's
dtype comes from the same promotion rule the call would use on the chunks themselves (NumPy's
for CuPy chunks), and its ``meta`` is an empty array of the chunks' type, so Dask knows the
chunk type without computing anything.

When the call is made, the eager operator's argument checks that need no GPU run as well,
through the eager operator's own helpers, on what the Dask arrays say without computing (their
shape and dtype): dtypes, shapes, ``axis``, ``eps``, weights, statistics, targets, ``casting``,
``dtype=``, Python ints that do not fit. Only what depends on the chunks themselves (host or
GPU memory, layout, device) is left to each chunk's call.

``import cupylab`` does not import Dask: this module imports it when a Dask array is seen.
"""
from __future__ import annotations

import functools
import math
import numbers
import sys

from . import _arrays, _dtypes, _runtime

__all__ = ["is_dask", "any_dask", "elementwise", "view"]


def is_dask(obj) -> bool:
    """Whether ``obj`` is a Dask array (without importing Dask)."""
    t = type(obj)
    return ((t.__module__ or "").startswith("dask.") and hasattr(t, "chunks")
            and hasattr(obj, "_meta"))


def any_dask(operands) -> bool:
    for a in operands:
        if is_dask(a):
            return True
    return False


def _is_scalar(v):
    return isinstance(v, numbers.Number) and getattr(v, "shape", ()) == ()


#: the chunks' top-level module -> the kind whose promotion rule they follow (else NumPy's)
_KIND_OF_MODULE = {"torch": "torch", "jax": "jax", "jaxlib": "jax"}


def _kind(meta):
    """The chunks' framework kind for the eager promotion rule: ``"torch"`` for torch chunks,
    ``"jax"`` for JAX chunks (JAX's rule, as the chunk calls will use), else ``"cupy"``
    (NumPy's rule)."""
    return _KIND_OF_MODULE.get((type(meta).__module__ or "").split(".", 1)[0], "cupy")


def _refuse_out_stream(name, out, stream):
    if out is not None:
        raise TypeError(f"{name}: out= is not supported with Dask arrays (they are lazy graphs, "
                        "never written in place); use the returned Dask array")
    if stream is not None:
        raise TypeError(f"{name}: stream= is not supported with Dask arrays: each chunk runs on "
                        "its worker's current stream")


def _key(name, arrays):
    """A graph key for a task whose function carries the GPU ``arrays`` (weights, biases; None
    where absent): a fresh one when there are any, since Dask's default key hashes the
    function's arguments and hashing a CuPy array copies it to the host; else None (Dask's
    own)."""
    if all(a is None for a in arrays):
        return None
    import uuid  # noqa: PLC0415

    return f"cupylab-{name}-{uuid.uuid4().hex}"


def view(name, pname, a, dask_ok=True):
    """What the eager operators' checks read of ``a`` (a Dask array, or a GPU array beside
    Dask arrays), known without computing, as a :class:`cupylab._arrays.View` with no
    address: shape, dtype, and strides in elements (the GPU array's own; C order for a Dask
    array, whose chunks' layout is known only at compute time, where the chunk call checks
    it).

    An object with no ``shape`` or ``dtype`` but a ``__cuda_array_interface__`` is read from
    the interface, as the eager operators read it.

    Raises
    ------
    TypeError
        ``a`` is not an array (no ``shape`` and ``dtype``; without ``dask_ok``, where only a
        GPU array is taken, the eager operator's message), or cupylab does not know its dtype.
    """
    from ._arrays import View, _host_error, view_from_cai  # noqa: PLC0415
    from ._elementwise_core import c_strides  # noqa: PLC0415

    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        cai = getattr(a, "__cuda_array_interface__", None)
        if isinstance(cai, dict):  # a bare CUDA array interface (read without a GPU call)
            return view_from_cai(cai, a, f"{name}: {pname}", "dask")
        if not dask_ok:
            raise _host_error(f"{name}: {pname}", a)
        raise TypeError(f"{name}: {pname} must be a Dask array or a GPU array (got "
                        f"{type(a).__module__}.{type(a).__qualname__})")
    if not is_dask(a):
        _require_gpu(f"{name}: {pname}", a)
    try:
        dt = _dtypes.resolve(a.dtype)
    except TypeError:
        raise TypeError(f"{name}: {pname} has unsupported dtype {a.dtype}") from None
    shape = tuple(a.shape)
    strides = c_strides(shape)
    if not is_dask(a):
        if callable(getattr(a, "stride", None)):  # torch: in elements
            strides = tuple(a.stride())
        elif isinstance(getattr(a, "strides", None), tuple):  # NumPy, CuPy, Numba: in bytes
            strides = tuple(b // dt.itemsize for b in a.strides)
    return View(0, shape, strides, dt, None, False, None, "dask", a)


def _require_gpu(what, a):
    """Refuse ``a`` (not a Dask array) when the eager operators would refuse it as host data,
    now rather than when a chunk's task runs: a NumPy array, a torch tensor in host memory, a
    JAX CPU array or another host DLPack producer. Makes no GPU call."""
    fn = _arrays.framework_of(a)
    if fn is None:
        raise _arrays._host_error(what, a)
    if fn is _arrays._from_torch:
        if not a.is_cuda:
            raise _arrays._host_error(what, a)
    elif fn in _arrays.DEFERRED:
        _arrays.deferred_device(a, fn, what)


def _vectors(name, kwargs):
    """The weight and bias among ``kwargs`` (GPU arrays, or None: left out) as views, for
    :func:`cupylab.ops._rowargs.check_vectors`."""
    return {k: view(name, k, kwargs[k], dask_ok=False)
            for k in ("weight", "bias") if kwargs.get(k) is not None}


def _chunk_call(fn, dtype, casting, *blocks):
    return fn(*blocks, dtype=dtype, casting=casting)


def elementwise(name, promo_op, fn, operands, names, out, dtype, casting, stream, allow=None):
    """Build the lazy Dask array for ``fn(*operands)`` (a cupylab elementwise operator).

    Parameters
    ----------
    name : str
        The operator's public name, for messages.
    promo_op : str
        The operator's name in :mod:`cupylab._promotion` (``"add"``, ``"true_divide"`` ...).
    fn : callable
        The public operator, called on each output chunk's blocks.
    operands, names : sequences
        The operands (at least one a Dask array) and their parameter names.
    out, dtype, casting, stream
        As the operator received them.
    allow : sequence of bool, optional
        Per operand, whether a scalar is accepted there.

    Raises
    ------
    TypeError
        ``out=`` or ``stream=`` given (a Dask array is a lazy graph: use the returned array;
        each chunk runs on its worker's current stream), an operand that is neither a Dask
        array, a GPU array nor a scalar, an unknown ``dtype``, or a dtype combination the
        promotion rule refuses.
    ValueError
        Shapes that do not broadcast, an unknown ``casting``.
    OverflowError
        A Python int that does not fit the computation dtype.
    """
    _refuse_out_stream(name, out, stream)
    import dask.array as da  # noqa: PLC0415 - only when a Dask array is seen
    from dask.array.utils import meta_from_array  # noqa: PLC0415

    from ._elementwise_core import _np_dtype_for, _validate_promote  # noqa: PLC0415
    from .ops.elementwise import _promoter, check_casting_dtype  # noqa: PLC0415

    dt = check_casting_dtype(name, casting, dtype)
    lead = next(a for a in operands if is_dask(a))
    args, views = [], []
    for i, (a, nm) in enumerate(zip(operands, names)):
        if _is_scalar(a):
            if allow is not None and not allow[i]:
                raise TypeError(f"{name}: {nm} must be a GPU array (got a scalar {a!r})")
            args += [a, None]
            views.append(None)
            continue
        if not is_dask(a):
            if not (hasattr(a, "shape") and hasattr(a, "dtype")) and not isinstance(
                    getattr(a, "__cuda_array_interface__", None), dict):
                raise TypeError(f"{name}: {nm} must be a Dask array, a GPU array or a scalar "
                                f"beside Dask arrays (got {type(a).__module__}."
                                f"{type(a).__qualname__})")
            a = _as_dask(a, f"{name}: {nm}")  # beside Dask arrays: one chunk, aligned by Dask
        views.append(view(name, nm, a))
        args += [a, tuple(range(a.ndim))[::-1]]
    # the eager operator's checks: promotion (and casts), the scalars, broadcasting
    _, _, shape, res = _validate_promote(name, operands, views, names,
                                         _promoter(name, promo_op, dt, casting), None,
                                         _kind(lead._meta), len(operands))
    npdt = _np_dtype_for(res)
    meta = meta_from_array(lead._meta, ndim=len(shape), dtype=npdt)
    return da.blockwise(functools.partial(_chunk_call, fn, dtype, casting),
                        tuple(range(len(shape)))[::-1], *args, dtype=npdt, meta=meta,
                        concatenate=True)


def _whole_rows(name, pname, a, axis):
    """``a`` with ``axis`` in one chunk: rechunked when it is split, unless the Dask config
    says ``cupylab.rechunk: False``, then a ``ValueError``."""
    import dask  # noqa: PLC0415

    n = len(a.chunks[axis])
    if n == 1:
        return a
    if not dask.config.get("cupylab.rechunk", True):
        raise ValueError(
            f"{name}: axis {axis} of {pname} is split into {n} chunks, but row-wise operators "
            f"need whole rows in a chunk, and rechunking is turned off (dask config "
            f"cupylab.rechunk=False); rechunk it first: {pname}.rechunk({{{axis}: -1}})")
    return a.rechunk({axis: -1})


def rowwise(name, fn, arrays, axis, kwargs, out, stream, refuse=()):
    """Build the lazy Dask array for a row-wise operator ``fn`` over ``axis``.

    ``arrays`` are ``(name, operand)`` pairs of the operands of the input's shape (``x``; ``y``
    and ``dy`` for the backward), at least one of them a Dask array; ``kwargs`` go to every
    chunk's call as they are (weights, ``eps``); ``refuse`` names ``(parameter, value)`` pairs
    that cannot be honoured on Dask arrays. Rows along ``axis`` are made whole (see
    :func:`_whole_rows`), the other axes keep their chunks, aligned by Dask.

    The eager operator's checks run first: the first operand's dtype is a float one, the
    others have its dtype and shape, ``axis`` is an int in range; with ``eps`` in ``kwargs``
    (the norms) ``eps``, the weight and bias, and rows that have no element.

    Raises
    ------
    TypeError
        ``out=``, ``stream=`` or a refused option given; a keyword operand that is a Dask array
        (weights are small: pass a GPU array); an operand that is not a Dask or GPU array; a
        dtype the eager operator refuses (not a float one, operands or weight and bias of
        different dtypes, a weight of another dtype than x's or float32 with 16-bit x); an
        axis that is not an int.
    ValueError
        A split row axis with rechunking turned off; shapes that differ; a 0-d input, an axis
        out of range; a negative ``eps``, a weight or bias that is not ``(n,)`` and
        contiguous, rows of no element (the norms).
    """
    _refuse_out_stream(name, out, stream)
    for pname, value in refuse:
        raise TypeError(f"{name}: {pname}={value!r} is not supported with Dask arrays")
    for k, v in kwargs.items():
        if is_dask(v):
            raise TypeError(f"{name}: {k} must be a GPU array (it is small: one copy goes to "
                            "every chunk), not a Dask array")
    import dask.array as da  # noqa: PLC0415
    from dask.array.utils import meta_from_array  # noqa: PLC0415

    from .ops import _rowcore as rc  # noqa: PLC0415
    from .ops.rowwise import _axis  # noqa: PLC0415

    (rname, rv), *others = [(pname, view(name, pname, a)) for pname, a in arrays]
    rc.check_float(name, rname, rv)
    for pname, v in others:
        rc.check_same(name, pname, v, rv, rname)
    rc.check_not_0d(name, rname, rv)
    axis = _axis(name, axis, rv.ndim)
    if "eps" in kwargs:  # the norms, as rowwise._norm checks them
        rc.check_eps(name, kwargs["eps"])
        rc.check_vectors(name, _vectors(name, kwargs), rv)
        rc.check_columns(name, rv.shape)
    lead = next(a for _, a in arrays if is_dask(a))
    nd = lead.ndim
    ops = [_whole_rows(name, pname, _as_dask(a, f"{name}: {pname}"), axis)
           for pname, a in arrays]
    # map_blocks pairs blocks by position: give every operand the chunks of the first Dask one
    # (lead, made whole along the row axis), so that the rows of y and dy meet in one task
    ref = ops[next(i for i, (_, a) in enumerate(arrays) if a is lead)].chunks
    ops = [a if a.chunks == ref else a.rechunk(ref) for a in ops]
    meta = meta_from_array(lead._meta, ndim=nd, dtype=lead.dtype)
    call = functools.partial(_rows_call, fn, axis, kwargs)
    return da.map_blocks(call, *ops, dtype=lead.dtype, meta=meta,
                         name=_key(name, [kwargs.get("weight"), kwargs.get("bias")]))


def _rows_call(fn, axis, kwargs, *blocks):
    if axis != blocks[0].ndim - 1:
        kwargs = dict(kwargs, axis=axis)
    return fn(*blocks, **kwargs)


def cross_entropy(fn, logits, target, ignore_index, label_smoothing, reduction, refuse, stream,
                  return_lse=False):
    """The lazy Dask array of ``fn`` (:func:`cupylab.cross_entropy`) on ``logits`` / ``target``
    (either or both Dask arrays): per chunk of rows the per-row losses (``reduction="none"``,
    the class axis made whole as in :func:`rowwise`, the target's row chunks aligned with the
    logits'), then Dask's own sum for ``"sum"``, and that sum divided by Dask's count of the
    rows not ignored for ``"mean"``. With ``return_lse``, ``(loss, lse)``: each chunk's call
    returns both, stacked on a last axis of 2 that the two results are sliced from.
    ``refuse``: ``(parameter, value)`` pairs that cannot be honoured on Dask arrays (the
    gradient output). The eager operator's checks of the arrays run first (logits of a float
    dtype, at least 1-D, with classes; target int64 or int32, of shape
    ``logits.shape[:-1]``); it has checked the other arguments.
    """
    name = "cross_entropy"
    _refuse_out_stream(name, None, stream)
    for pname, value in refuse:
        raise TypeError(f"{name}: {pname}={value!r} is not supported with Dask arrays")
    import dask.array as da  # noqa: PLC0415
    from dask.array.utils import meta_from_array  # noqa: PLC0415

    from .ops import _rowcore as rc  # noqa: PLC0415
    from .ops.cross_entropy import check_arrays  # noqa: PLC0415

    xv = view(name, "logits", logits)
    check_arrays(name, xv, view(name, "target", target))
    rc.check_columns(name, xv.shape, "logits has no classes")
    x = _as_dask(logits, f"{name}: logits")
    t = _as_dask(target, f"{name}: target", view=True)  # Dask counts the rows not ignored
    nd = x.ndim
    x = _whole_rows(name, "logits", x, nd - 1)
    t = t.rechunk(x.chunks[:-1])
    acc = _np_acc(x.dtype)
    rows = tuple(range(nd - 1))
    call = functools.partial(_ce_call, fn, ignore_index, label_smoothing, return_lse)
    if return_lse:  # (rows..., 2): the loss and the lse of each row
        both = da.blockwise(call, rows + (nd,), x, rows + (nd - 1,), t, rows, dtype=acc,
                            concatenate=True, new_axes={nd: 2},
                            meta=meta_from_array(x._meta, ndim=nd, dtype=acc))
        loss, lse = both[..., 0], both[..., 1]
    else:
        loss = da.blockwise(call, rows, x, rows + (nd - 1,), t, rows, dtype=acc,
                            concatenate=True, meta=meta_from_array(x._meta, ndim=nd - 1,
                                                                   dtype=acc))
    if reduction != "none":
        total = loss.sum(dtype=acc)
        loss = total if reduction == "sum" else (total / (t != ignore_index).sum()).astype(acc)
    return (loss, lse) if return_lse else loss


def _ce_call(fn, ignore_index, label_smoothing, return_lse, logits, target):
    r = fn(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
           reduction="none", return_lse=return_lse)
    if not return_lse:
        return r
    import numpy as np  # noqa: PLC0415 - dispatches to the chunk's array type (NEP 18)

    return np.stack(r, axis=-1)


def cross_entropy_backward(fn, logits, target, lse, grad_loss, ignore_index, label_smoothing,
                           reduction, out, stream):
    """The lazy gradient of ``fn`` (:func:`cupylab.cross_entropy_backward`) on Dask arrays:
    chunk by chunk of rows (the class axis whole as in :func:`rowwise`; the target, ``lse``
    and a per-row ``grad_loss`` aligned with the logits' rows), each chunk's call made with
    ``reduction="sum"`` and the loss gradient it must scale by. For ``"mean"`` that is
    ``grad_loss`` times ``1 / (Dask's count of the rows not ignored)`` (0 when none is), a
    0-d Dask array every chunk's task receives; a number or a GPU array ``grad_loss`` goes to
    every chunk as it is. The eager operator's checks run first (the arrays as in
    :func:`cross_entropy`; ``lse`` of the accumulation dtype and of shape
    ``logits.shape[:-1]``, stricter than the eager operator's count, since chunks go by rows;
    ``grad_loss``'s dtype and shape); it has checked the other arguments."""
    name = "cross_entropy_backward"
    _refuse_out_stream(name, out, stream)
    import dask.array as da  # noqa: PLC0415
    from dask.array.utils import meta_from_array  # noqa: PLC0415

    from .ops import _rowcore as rc  # noqa: PLC0415
    from .ops.cross_entropy import check_arrays, check_grad_loss  # noqa: PLC0415

    xv = view(name, "logits", logits)
    check_arrays(name, xv, view(name, "target", target))
    rc.check_columns(name, xv.shape, "logits has no classes")
    lead = xv.shape[:-1]
    lv = view(name, "lse", lse)
    if lv.shape != lead:
        raise ValueError(f"{name}: lse must have shape {lead} (one value per row); got "
                         f"{lv.shape}")
    acc = rc.acc_dtype(xv.dtype)
    rc.check_stats(name, "lse", lv, math.prod(lead), acc)
    g = grad_loss
    if g is not None and not _is_scalar(g):
        check_grad_loss(name, view(name, "grad_loss", g), xv, acc, reduction)
    nd = xv.ndim
    x = _whole_rows(name, "logits", _as_dask(logits, f"{name}: logits"), nd - 1)
    rows = tuple(range(nd - 1))
    t = _as_dask(target, f"{name}: target", view=True).rechunk(x.chunks[:-1])
    ls = _as_dask(lse, f"{name}: lse").rechunk(x.chunks[:-1])
    npacc = _np_acc(x.dtype)
    if reduction == "mean":
        count = (t != ignore_index).sum()
        scale = da.where(count > 0, 1.0 / count, 0.0).astype(npacc)
        g = scale if g is None else scale * (g if _is_scalar(g) else _as_dask(
            g, f"{name}: grad_loss").astype(npacc))
    elif g is not None and not _is_scalar(g) and (is_dask(g) or len(g.shape)):
        g = _as_dask(g, f"{name}: grad_loss")
    args = [x, rows + (nd - 1,), t, rows, ls, rows]
    if is_dask(g):
        args += [g.rechunk(x.chunks[:-1]) if g.ndim else g, rows if g.ndim else ()]
        kw = {}
    else:
        kw = {"grad_loss": g}
    call = functools.partial(_ceb_call, fn, ignore_index, label_smoothing, kw)
    return da.blockwise(call, rows + (nd - 1,), *args, dtype=x.dtype, concatenate=True,
                        name=_key(name, [g] if not is_dask(g) else []),
                        meta=meta_from_array(x._meta, ndim=nd, dtype=x.dtype))


def _ceb_call(fn, ignore_index, label_smoothing, kw, logits, target, lse, *grad):
    g = grad[0] if grad else kw.get("grad_loss")
    red = "sum" if grad == () or getattr(g, "ndim", 0) == 0 else "none"
    return fn(logits, target, lse, g, ignore_index=ignore_index,
              label_smoothing=label_smoothing, reduction=red)


def _as_dask(a, what="operand", view=False):
    """``a`` (checked by :func:`view`) as a Dask array: itself, or a one-chunk Dask array of
    a GPU array (a bare ``__cuda_array_interface__`` object wrapped as a CuPy array first,
    zero-copy). Host data (:func:`_require_gpu`) or a torch tensor that requires grad is
    refused as the eager operators refuse it; otherwise a torch tensor goes into the graph as
    it is (the chunk calls get the tensor and check it as the eager operators do: lazy
    conj/neg bits, layout), the Dask array declaring the NumPy dtype of the same name (Dask's ``from_array``
    cannot read a torch dtype) and a NumPy meta; with ``view`` (integer targets, on which
    Dask's own operations run) as a zero-copy CuPy array instead."""
    if is_dask(a):
        return a
    _require_gpu(what, a)
    import dask.array as da  # noqa: PLC0415
    from dask.array.utils import meta_from_array  # noqa: PLC0415

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):  # in GPU memory (_require_gpu)
        if a.requires_grad:
            raise TypeError(f"{what} is a torch tensor that requires grad; cupylab kernels "
                            "are not recorded by autograd. Pass tensor.detach()")
        if view:
            a = _runtime.cupy().asarray(a)
        else:
            return _one_chunk(a)
    elif not hasattr(a, "shape"):
        a = _runtime.cupy().asarray(a)
    # name=False: a random key; Dask's default hashes the data, which copies a CuPy array to
    # the host
    return da.from_array(a, chunks=tuple(a.shape), asarray=False, name=False,
                         meta=meta_from_array(a, ndim=len(a.shape)))


def _one_chunk(a):
    """A one-chunk Dask array whose only block is ``a`` itself (a torch tensor), declaring
    the NumPy dtype of ``a``'s dtype name and a NumPy meta."""
    import uuid  # noqa: PLC0415

    import dask.array as da  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from dask.highlevelgraph import HighLevelGraph  # noqa: PLC0415

    from ._elementwise_core import _np_dtype_for  # noqa: PLC0415

    shape = tuple(a.shape)
    npdt = np.dtype(_np_dtype_for(_dtypes.resolve(a.dtype)))
    key = f"cupylab-operand-{uuid.uuid4().hex}"
    graph = HighLevelGraph.from_collections(key, {(key,) + (0,) * len(shape): a}, ())
    return da.Array(graph, key, tuple((n,) for n in shape), dtype=npdt,
                    meta=np.empty((0,) * len(shape), npdt))


def _np_acc(dtype):
    """The NumPy dtype of the statistics, losses and sums for data of ``dtype`` (rc.acc_dtype's
    rule): float64 for float64, else float32."""
    import numpy as np  # noqa: PLC0415

    return np.dtype(dtype) if np.dtype(dtype).itemsize == 8 else np.dtype(np.float32)


def norm_backward(name, fn, dy, x, weight, stats, stream, weight_grad=True):
    """The lazy gradients of a norm's backward ``fn`` (:func:`cupylab.rms_norm_backward` or
    :func:`cupylab.layer_norm_backward`) on Dask arrays: ``dx`` chunk by chunk (whole rows,
    the statistics' chunks aligned with the rows'), and the weight (and bias) gradients as
    Dask's sum of every chunk's own in the accumulation dtype (float64 for float64 x, else
    float32; a 16-bit weight is given to the chunks as float32, so that each chunk's sums
    come back unrounded), cast once to the weight's dtype. The chunk's kernel
    runs once for ``dx`` and once more for the weight gradients (two tasks per chunk).
    ``stats``: ``(name, array)`` pairs, the forward's statistics in ``fn``'s order. The eager
    operator's checks run first (x of a float dtype, at least 1-D, with columns; dy of its
    dtype and shape; the weight; the statistics given, of the accumulation dtype), and the
    statistics must have the shape ``x.shape[:-1]`` (their chunks are aligned with the
    rows'; the eager operator takes any shape of one value per row)."""
    _refuse_out_stream(name, None, stream)
    if is_dask(weight):
        raise TypeError(f"{name}: weight must be a GPU array (it is small: one copy goes to "
                        "every chunk), not a Dask array")
    import dask.array as da  # noqa: PLC0415
    from dask.array.utils import meta_from_array  # noqa: PLC0415

    from .ops import _rowcore as rc  # noqa: PLC0415

    dv, xv = view(name, "dy", dy), view(name, "x", x)
    rc.check_float(name, "x", xv)
    rc.check_same(name, "dy", dv, xv)
    rc.check_not_0d(name, "x", xv)
    rc.check_vectors(name, _vectors(name, {"weight": weight}), xv)
    nd, lead_shape = xv.ndim, xv.shape[:-1]
    for pname, a in stats:
        if a is None:
            raise TypeError(f"{name}: {pname} is required (the statistics the forward returned)")
        sv = view(name, pname, a)
        if sv.shape != lead_shape:  # stricter than the eager op's count: chunks go by rows
            raise ValueError(f"{name}: {pname} must have shape {lead_shape} (one value per "
                             f"row); got {sv.shape}")
        rc.check_stats(name, pname, sv, math.prod(lead_shape), rc.acc_dtype(xv.dtype))
    rc.check_columns(name, xv.shape)
    # the chunks of the first Dask operand (dy, x, then the statistics), rows made whole
    lead = next((a for a in (dy, x) if is_dask(a)), None)
    if lead is not None:
        chunks = _whole_rows(name, "dy" if lead is dy else "x", lead, nd - 1).chunks
    else:
        chunks = next(a for _, a in stats if is_dask(a)).chunks + ((xv.shape[-1],),)
    xd = _whole_rows(name, "x", _as_dask(x, f"{name}: x"), nd - 1).rechunk(chunks)
    dyd = _whole_rows(name, "dy", _as_dask(dy, f"{name}: dy"), nd - 1).rechunk(chunks)
    st = [_as_dask(a, f"{name}: {pn}").rechunk(chunks[:-1]) for pn, a in stats]
    rows = tuple(range(nd - 1))
    full = rows + (nd - 1,)
    args = [dyd, full, xd, full]
    for a in st:
        args += [a, rows]
    dx = da.blockwise(functools.partial(_nb_call, fn, weight, None), full, *args,
                      name=_key(name, [weight]), dtype=xd.dtype, concatenate=True,
                      meta=meta_from_array(xd._meta, ndim=nd, dtype=xd.dtype))
    if weight is None or not weight_grad:
        return (dx, None, None) if len(stats) == 2 else (dx, None)
    k = len(stats)  # weight gradients: dweight, and dbias for layer_norm
    acc = _np_acc(xd.dtype)
    from ._elementwise_core import _np_dtype_for  # noqa: PLC0415

    wdt = view(name, "weight", weight, dask_ok=False).dtype  # a CAI weight has no .dtype
    # with 16-bit x and weight, each chunk's call is given the weight as float32 (cast in the
    # chunk's task, on its device and stream; the op takes float32 weights with 16-bit x,
    # and the weight's values do not enter its gradients), so its sums come back unrounded
    wide = xv.dtype.itemsize == 2 and wdt.itemsize == 2
    part = da.blockwise(functools.partial(_nb_call, fn, _Float32(weight) if wide else weight,
                                          acc), rows + (nd, nd - 1),
                        *args, name=_key(f"{name}-grads", [weight]), new_axes={nd: k},
                        adjust_chunks={i: 1 for i in rows},
                        dtype=acc, concatenate=True,
                        meta=meta_from_array(xd._meta, ndim=nd + 1, dtype=acc))
    g = part.sum(axis=rows, dtype=acc).astype(_np_dtype_for(wdt))
    return (dx,) + tuple(g[j] for j in range(k))


class _Float32:
    """A weight that a chunk's task casts to float32 before the call (:func:`_nb_call`)."""

    __slots__ = ("weight",)

    def __init__(self, weight):
        self.weight = weight

    def get(self):
        from .ops.elementwise import add  # noqa: PLC0415

        return add(self.weight, 0.0, dtype="float32")


def _nb_call(fn, weight, acc, dy, x, *stats):
    """One chunk's backward: ``dx`` (``acc`` None), or its weight gradients (dweight, and
    dbias for layer_norm) stacked in ``acc``, shape ``(1, ..., 1, k, n)``: one per chunk of
    rows."""
    import numpy as np  # noqa: PLC0415 - dispatches to the chunk's array type (NEP 18)

    if type(weight) is _Float32:
        weight = weight.get()
    if acc is None:  # dx alone: no weight gradients computed
        return fn(dy, x, weight, *stats, weight_grad=False)[0]
    r = fn(dy, x, weight, *stats)
    g = np.stack([w.astype(acc) for w in r[1:]])
    return g.reshape((1,) * (x.ndim - 1) + g.shape)
