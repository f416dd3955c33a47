"""The row-wise operators' arguments (:mod:`cupylab.ops.rowwise`, :mod:`.cross_entropy`,
:mod:`.resnorm`, :mod:`cupylab._dask`): any framework's arrays gathered into Views on one device
and the caller's stream (kept in one function so the shared DLPack-with-stream helper planned
for the core can replace it), the checks that name the function and parameter at fault, and
the outputs in the caller's framework. :mod:`._rowcore` re-exports every name here, which is
how the operators call them."""
from __future__ import annotations

from .. import _arrays, _dtypes, _launch, _runtime
from .._elementwise_core import (_span, allocate, check_overlap, finish_output, overlaps_itself,
                                 real_value)

FLOATS = tuple(_dtypes.from_name(n) for n in ("float16", "bfloat16", "float32", "float64"))
F32 = _dtypes.from_name("float32")
#: the RowArgs flags bit of float32 weights with 16-bit rows (check_vector's result)
FLAG_W_F32 = 4


class Ctx:
    __slots__ = ("views", "kind", "device", "stream", "explicit_stream")


_KINDS = {"torch": "torch", "cupy": "cupy", "jax": "jax", "numba": "numba"}


def gather(opname, arrays, stream=None, required=1):
    """Views for ``arrays`` (an ordered dict ``name -> object or None``; the first array
    decides the device and the output framework), on the caller's stream (torch's for torch
    inputs, CuPy's otherwise) or ``stream``. DLPack-only producers (JAX ...) are imported with
    that stream; producers that name their stream (CAI v3) are waited for. The first
    ``required`` entries must be arrays (None there raises the not-an-array ``TypeError``);
    the others are optional (None: absent)."""
    items = []
    fns, views, deferred_dev = {}, {}, {}
    for i, (k, v) in enumerate(arrays.items()):  # checked in order: the first bad one is named
        if v is None and i >= required:
            continue  # an optional array, absent
        items.append((k, v))
        fn = _arrays.framework_of(v)
        if fn is None:  # None where an array is required, host data, any other object
            raise _arrays._host_error(f"{opname}: {k}", v)
        fns[k] = fn
        if fn in _arrays.DEFERRED:  # imported once the stream is known (DLPack, JAX)
            deferred_dev[k] = _arrays.deferred_device(v, fn, f"{opname}: {k}")
        else:
            views[k] = fn(v, f"{opname}: {k}", None)
    lk, lv = items[0]
    if lk in views:
        kind = _KINDS.get(views[lk].kind, "cupy")
        device = _arrays.resolve_device(
            views[lk], None if views[lk].ptr else _runtime.current_device())
    else:
        kind = "jax" if fns[lk] is _arrays._from_jax else "cupy"
        device = deferred_dev[lk]
    c = Ctx()
    with _launch.ensure_device(device):
        s = (_launch.current_stream(kind, device) if stream is None
             else _launch.resolve_stream(stream))
        for k, v in items:
            if k not in views:
                views[k] = _arrays.import_deferred(v, fns[k], f"{opname}: {k}", s)
        for k, v in views.items():
            if _arrays.resolve_device(v, device) != device:
                raise ValueError(f"{opname}: arrays are on different GPUs ({lk} on cuda:{device}, "
                                 f"{k} on cuda:{v.device})")
            if v.stream is not None:
                _launch.wait_for(s, v.stream, device)
    c.views, c.kind, c.device, c.stream, c.explicit_stream = views, kind, device, s, stream
    return c


def check_float(opname, name, v):
    if v.dtype not in FLOATS:
        raise TypeError(f"{opname}: {name} must be float16, bfloat16, float32 or float64 "
                        f"(got {v.dtype.name})")


def check_not_0d(opname, name, v):
    if v.ndim == 0:
        raise ValueError(f"{opname}: {name} must have at least one dimension (got a 0-d array)")


def check_same(opname, name, v, ref, ref_name="x"):
    if v.dtype is not ref.dtype:
        raise TypeError(f"{opname}: {name} must have the dtype of {ref_name} ({ref.dtype.name}); "
                        f"got {v.dtype.name}")
    if v.shape != ref.shape:
        raise ValueError(f"{opname}: {name} must have the shape of {ref_name} {ref.shape}; "
                         f"got {v.shape}")


def check_vector(opname, name, v, x, cols, allow_f32=True):
    """A weight/bias: shape (cols,), contiguous, x's dtype or float32 with 16-bit x.
    Returns the FLAG_W_F32 bit."""
    if v.shape != (cols,):
        raise ValueError(f"{opname}: {name} must have shape ({cols},) (got {v.shape})")
    if cols > 1 and v.strides[0] != 1:
        raise ValueError(f"{opname}: {name} must be contiguous (got stride {v.strides[0]})")
    if v.dtype is x.dtype:
        return 0
    if allow_f32 and v.dtype is F32 and x.dtype.itemsize == 2:
        return FLAG_W_F32
    raise TypeError(f"{opname}: {name} must be {x.dtype.name}"
                    f"{' or float32' if x.dtype.itemsize == 2 else ''} (got {v.dtype.name})")


def check_eps(opname, eps):
    """The norms' ``eps``: a non-negative finite real number (NumPy scalars too)."""
    what = "a non-negative number"
    if not real_value(opname, "eps", eps, what) >= 0:
        raise ValueError(f"{opname}: eps must be {what} (got {eps!r})")


def check_vectors(opname, vectors, x):
    """The norms' weight and bias (``vectors``: name -> view, absent ones left out):
    :func:`check_vector` each, and one dtype for both. Returns the FLAG_W_F32 bit."""
    flags = 0
    for name, v in vectors.items():
        flags |= check_vector(opname, name, v, x, x.shape[-1])
    if len(vectors) == 2 and vectors["weight"].dtype is not vectors["bias"].dtype:
        raise TypeError(f"{opname}: weight and bias must have one dtype (got "
                        f"{vectors['weight'].dtype.name} and {vectors['bias'].dtype.name})")
    return flags


def check_columns(opname, shape, message="the last axis of x is empty"):
    """Refuse rows that hold no element (a last axis of 0 with rows present)."""
    if shape and shape[-1] == 0 and 0 not in shape[:-1]:
        raise ValueError(f"{opname}: {message} (shape {shape})")


def check_stats(opname, name, v, rows, a):
    if v.dtype is not a:
        raise TypeError(f"{opname}: {name} must be {a.name} (the statistics the forward "
                        f"returns); got {v.dtype.name}")
    if v.size != rows:
        raise ValueError(f"{opname}: {name} must hold one value per row ({rows}); got shape "
                         f"{v.shape}")
    acc = 1  # C-contiguous in any shape (the forward returns them in x.shape[:-1]); an
    # empty one has no layout to check (its strides are whatever the producer chose)
    for e, s in zip(reversed(v.shape), reversed(v.strides)) if v.size else ():
        if e != 1 and s != acc:
            raise ValueError(f"{opname}: {name} must be contiguous")
        acc *= e


def check_out(opname, name, v, shape, dt):
    if v.readonly:
        raise ValueError(f"{opname}: {name} is read-only ({v.kind} array); pass none and use the "
                         "returned array")
    if v.shape != tuple(shape):
        raise ValueError(f"{opname}: {name} has shape {v.shape}, expected {tuple(shape)}")
    if v.dtype is not dt:
        raise TypeError(f"{opname}: {name} has dtype {v.dtype.name}, expected {dt.name}")
    if 0 not in v.shape and any(s == 0 and e > 1 for s, e in zip(v.strides, v.shape)):
        raise ValueError(f"{opname}: {name} has zero strides (a broadcast view); it cannot be "
                         "written")
    if overlaps_itself(v.shape, v.strides):
        raise ValueError(f"{opname}: {name} overlaps itself (strides {v.strides} for shape "
                         f"{v.shape} put several elements at one address); it cannot be written")


def overlap(opname, out, out_name, inputs):
    """``out`` may be exactly one of the inputs (in place) but must not partly overlap any."""
    names = [n for n, v in inputs if v is not None]
    views = [v for _, v in inputs if v is not None]
    check_overlap(opname, out, out.shape, views, names, out_name)


def disjoint(opname, out, out_name, inputs):
    """``out`` must share no byte with any of ``inputs`` that are not elementwise partners
    (weights, biases, targets: read across rows, or not of the rows' shape), each taken
    with its own shape and strides (broadcast to the rows, a one-row weight looked like the
    same view as a residual at its address)."""
    ospan = _span(out, out.shape, out.strides)
    if ospan is None:
        return
    for n, v in inputs:
        sp = None if v is None else _span(v, v.shape, v.strides)
        if sp is not None and sp[0] < ospan[1] and ospan[0] < sp[1]:
            raise ValueError(f"{opname}: {out_name} overlaps {n} in memory; it must not "
                             f"share memory with {n}")


def new_array(c, shape, dt):
    """A new C-contiguous array in the caller's framework, and its View."""
    obj = allocate(c.kind, tuple(shape), dt, c.device,
                   None if c.explicit_stream is None else c.stream)
    return obj, _arrays.as_view(obj, "output")


def finish(c, obj):
    return finish_output(c.kind, obj, c.stream, c.device)
