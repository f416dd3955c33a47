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

``import cupylab`` does not import Dask: this module imports it when a Dask array is seen.
"""
from __future__ import annotations

import functools
import numbers

from . import _dtypes, _promotion

__all__ = ["is_dask", "any_dask", "elementwise"]


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


def _rule(meta):
    return "torch" if (type(meta).__module__ or "").split(".", 1)[0] == "torch" else "numpy"


def _refuse_out_stream(name, out, stream):
    if out is not None:
        raise TypeError(f"{name}: out= is not supported with Dask arrays (they are lazy graphs, "
                        "never written in place); use the returned Dask array")
    if stream is not None:
        raise TypeError(f"{name}: stream= is not supported with Dask arrays: each chunk runs on "
                        "its worker's current stream")


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
        array, a GPU array nor a scalar, or a dtype combination the promotion rule refuses.
    ValueError
        Shapes that do not broadcast.
    """
    _refuse_out_stream(name, out, stream)
    import dask.array as da  # noqa: PLC0415 - only when a Dask array is seen
    from dask.array.utils import meta_from_array  # noqa: PLC0415

    from ._elementwise_core import broadcast_shapes, _np_dtype_for  # noqa: PLC0415

    lead = next(a for a in operands if is_dask(a))
    args, keys, shapes = [], [], []
    for i, (a, nm) in enumerate(zip(operands, names)):
        if is_dask(a):
            arr = a
        elif _is_scalar(a):
            if allow is not None and not allow[i]:
                raise TypeError(f"{name}: {nm} must be a GPU array (got a scalar {a!r})")
            args += [a, None]
            keys.append(_promotion.operand_key(a, None))
            continue
        elif hasattr(a, "shape") and hasattr(a, "dtype"):
            # a GPU array beside Dask arrays: one chunk, aligned (and split) by Dask
            arr = da.from_array(a, chunks=tuple(a.shape) or (), asarray=False, name=False,
                                meta=meta_from_array(a, ndim=len(a.shape)))
        else:
            raise TypeError(f"{name}: {nm} must be a Dask array, a GPU array or a scalar beside "
                            f"Dask arrays (got {type(a).__module__}.{type(a).__qualname__})")
        try:
            dt = _dtypes.resolve(arr.dtype)
        except TypeError:
            raise TypeError(f"{name}: {nm} has unsupported dtype {arr.dtype}") from None
        keys.append(("a", dt.name, arr.ndim == 0))
        shapes.append(tuple(arr.shape))
        args += [arr, tuple(range(arr.ndim))[::-1]]
    shape = broadcast_shapes(shapes, name)
    dt = None if dtype is None else _dtypes.resolve(dtype)
    try:
        _, res = _promotion.resolve(_rule(lead._meta), promo_op, tuple(keys), dt, None, casting)
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None
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

    Raises
    ------
    TypeError
        ``out=``, ``stream=`` or a refused option given; a keyword operand that is a Dask array
        (weights are small: pass a GPU array); an operand that is not a Dask or GPU array.
    ValueError
        A split row axis with rechunking turned off; shapes that differ.
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

    lead = next(a for _, a in arrays if is_dask(a))
    nd = lead.ndim
    if nd == 0:
        raise ValueError(f"{name}: x must have at least one dimension (got a 0-d array)")
    if not isinstance(axis, int) or isinstance(axis, bool) or not -nd <= axis < nd:
        raise ValueError(f"{name}: axis {axis!r} is out of range for {nd} dimensions")
    axis %= nd
    ops = []
    for pname, a in arrays:
        a = _as_dask(name, pname, a)
        if a.shape != lead.shape:
            raise ValueError(f"{name}: {pname} has shape {a.shape}, expected {lead.shape}")
        ops.append(_whole_rows(name, pname, a, axis))
    # map_blocks pairs blocks by position: give every operand the chunks of the first Dask one
    # (lead, made whole along the row axis), so that the rows of y and dy meet in one task
    ref = ops[next(i for i, (_, a) in enumerate(arrays) if a is lead)].chunks
    ops = [a if a.chunks == ref else a.rechunk(ref) for a in ops]
    meta = meta_from_array(lead._meta, ndim=nd, dtype=lead.dtype)
    call = functools.partial(_rows_call, fn, axis, kwargs)
    return da.map_blocks(call, *ops, dtype=lead.dtype, meta=meta)


def _rows_call(fn, axis, kwargs, *blocks):
    if axis != blocks[0].ndim - 1:
        kwargs = dict(kwargs, axis=axis)
    return fn(*blocks, **kwargs)


def cross_entropy(fn, logits, target, ignore_index, label_smoothing, reduction, refuse, stream):
    """The lazy Dask array of ``fn`` (:func:`cupylab.cross_entropy`) on ``logits`` / ``target``
    (either or both Dask arrays): per chunk of rows the per-row losses (``reduction="none"``,
    the class axis made whole as in :func:`rowwise`, the target's row chunks aligned with the
    logits'), then Dask's own sum for ``"sum"``, and that sum divided by Dask's count of the
    rows not ignored for ``"mean"``. ``refuse``: ``(parameter, value)`` pairs that cannot be
    honoured on Dask arrays (the gradient and logsumexp outputs).
    """
    name = "cross_entropy"
    _refuse_out_stream(name, None, stream)
    for pname, value in refuse:
        raise TypeError(f"{name}: {pname}={value!r} is not supported with Dask arrays")
    import dask.array as da  # noqa: PLC0415
    from dask.array.utils import meta_from_array  # noqa: PLC0415

    x, t = (_as_dask(name, p, a) for p, a in (("logits", logits), ("target", target)))
    nd = x.ndim
    if nd == 0:
        raise ValueError(f"{name}: logits must have at least one dimension (got a 0-d array)")
    if t.shape != x.shape[:-1]:
        raise ValueError(f"{name}: target must have shape {x.shape[:-1]} (logits.shape[:-1]); "
                         f"got {t.shape}")
    x = _whole_rows(name, "logits", x, nd - 1)
    t = t.rechunk(x.chunks[:-1])
    acc = x.dtype if x.dtype.itemsize == 8 else _np_float32()
    rows = tuple(range(nd - 1))
    loss = da.blockwise(functools.partial(_ce_call, fn, ignore_index, label_smoothing), rows,
                        x, rows + (nd - 1,), t, rows, dtype=acc, concatenate=True,
                        meta=meta_from_array(x._meta, ndim=nd - 1, dtype=acc))
    if reduction == "none":
        return loss
    total = loss.sum(dtype=acc)
    if reduction == "sum":
        return total
    return (total / (t != ignore_index).sum()).astype(acc)


def _ce_call(fn, ignore_index, label_smoothing, logits, target):
    return fn(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
              reduction="none")


def _as_dask(name, pname, a):
    """``a`` as a Dask array: itself, or a one-chunk Dask array of a GPU array."""
    if is_dask(a):
        return a
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        raise TypeError(f"{name}: {pname} must be a Dask array or a GPU array (got "
                        f"{type(a).__module__}.{type(a).__qualname__})")
    import dask.array as da  # noqa: PLC0415
    from dask.array.utils import meta_from_array  # noqa: PLC0415

    # name=False: a random key; Dask's default hashes the data, which copies a CuPy array to
    # the host
    return da.from_array(a, chunks=tuple(a.shape), asarray=False, name=False,
                         meta=meta_from_array(a, ndim=len(a.shape)))


def _np_float32():
    import numpy as np  # noqa: PLC0415

    return np.dtype(np.float32)


def norm_backward(name, fn, dy, x, weight, stats, stream):
    """The lazy gradients of a norm's backward ``fn`` (:func:`cupylab.rms_norm_backward` or
    :func:`cupylab.layer_norm_backward`) on Dask arrays: ``dx`` chunk by chunk (whole rows,
    the statistics' chunks aligned with the rows'), and the weight (and bias) gradients as
    Dask's float32 sum of every chunk's own, cast to the weight's dtype. The chunk's kernel
    runs once for ``dx`` and once more for the weight gradients (two tasks per chunk).
    ``stats``: ``(name, array)`` pairs, the forward's statistics in ``fn``'s order."""
    _refuse_out_stream(name, None, stream)
    if is_dask(weight):
        raise TypeError(f"{name}: weight must be a GPU array (it is small: one copy goes to "
                        "every chunk), not a Dask array")
    import dask.array as da  # noqa: PLC0415
    from dask.array.utils import meta_from_array  # noqa: PLC0415

    dyd, xd = _as_dask(name, "dy", dy), _as_dask(name, "x", x)
    nd = xd.ndim
    if nd == 0:
        raise ValueError(f"{name}: x must have at least one dimension (got a 0-d array)")
    if dyd.shape != xd.shape:
        raise ValueError(f"{name}: dy has shape {dyd.shape}, expected {xd.shape}")
    xd = _whole_rows(name, "x", xd, nd - 1)
    dyd = _whole_rows(name, "dy", dyd, nd - 1).rechunk(xd.chunks)
    st = []
    for pname, a in stats:
        a = _as_dask(name, pname, a)
        if a.shape != xd.shape[:-1]:
            raise ValueError(f"{name}: {pname} must have shape {xd.shape[:-1]} (one value per "
                             f"row); got {a.shape}")
        st.append(a.rechunk(xd.chunks[:-1]))
    rows = tuple(range(nd - 1))
    full = rows + (nd - 1,)
    args = [dyd, full, xd, full]
    for a in st:
        args += [a, rows]
    dx = da.blockwise(functools.partial(_nb_call, fn, weight, False), full, *args,
                      dtype=xd.dtype, concatenate=True,
                      meta=meta_from_array(xd._meta, ndim=nd, dtype=xd.dtype))
    if weight is None:
        return (dx, None, None) if len(stats) == 2 else (dx, None)
    k = len(stats)  # weight gradients: dweight, and dbias for layer_norm
    f32 = _np_float32()
    part = da.blockwise(functools.partial(_nb_call, fn, weight, True), rows + (nd, nd - 1),
                        *args, new_axes={nd: k}, adjust_chunks={i: 1 for i in rows},
                        dtype=f32, concatenate=True,
                        meta=meta_from_array(xd._meta, ndim=nd + 1, dtype=f32))
    g = part.sum(axis=rows, dtype=f32).astype(weight.dtype)
    return (dx,) + tuple(g[j] for j in range(k))


def _nb_call(fn, weight, grads, dy, x, *stats):
    """One chunk's backward: ``dx``, or with ``grads`` its weight gradients (dweight, and
    dbias for layer_norm) stacked in float32, shape ``(1, ..., 1, k, n)``: one per chunk of
    rows."""
    import numpy as np  # noqa: PLC0415 - dispatches to the chunk's array type (NEP 18)

    r = fn(dy, x, weight, *stats)
    if not grads:
        return r[0]
    g = np.stack([w.astype("float32") for w in r[1:]])
    return g.reshape((1,) * (x.ndim - 1) + g.shape)