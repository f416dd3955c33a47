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
    if out is not None:
        raise TypeError(f"{name}: out= is not supported with Dask arrays (they are lazy graphs, "
                        "never written in place); use the returned Dask array")
    if stream is not None:
        raise TypeError(f"{name}: stream= is not supported with Dask arrays: each chunk runs on "
                        "its worker's current stream")
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
            arr = da.from_array(a, chunks=tuple(a.shape) or (), asarray=False,
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
