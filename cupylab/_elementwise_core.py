"""Shared machinery for NumPy-style elementwise operators: argument classification,
broadcasting, the dtype rule, ``out=`` checks, output allocation in the caller's framework,
and the choice of stream and device.

Used by :mod:`cupylab.ops.elementwise` and by user-defined elementwise kernels
(:mod:`cupylab.kernels`); each supplies the kernel launch.
"""
from __future__ import annotations

import math
import numbers
import sys

from . import _arrays, _launch, _runtime
from ._arrays import View

__all__ = ["Call", "prepare_call", "broadcast_shapes", "c_strides", "coalesce"]


def c_strides(shape):
    """C-contiguous strides (in elements) for ``shape``."""
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(reversed(st))


def real_value(opname, name, value, what):
    """``value`` as a float: a real number (Python or NumPy, not a bool) that a C double
    holds finitely; TypeError for a non-number, ValueError (``what``: the rule) for an
    infinite, NaN or too large one."""
    if not isinstance(value, numbers.Real) or type(value).__name__ in ("bool", "bool_"):
        raise TypeError(f"{opname}: {name} must be a real number (got {value!r})")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v):
        raise ValueError(f"{opname}: {name} must be {what} (got {value!r})")
    return v


def overlaps_itself(shape, strides):
    """Whether a view of ``shape`` and ``strides`` (elements) may put two of its elements at
    one address (an ``as_strided`` view, a broadcast): then it cannot be written. Sufficient
    test for the contrary: ordered by stride, each dimension steps past everything the
    smaller ones reach. Empty views never overlap."""
    if 0 in shape:
        return False
    reach = 0
    for st, e in sorted((abs(st), e) for st, e in zip(strides, shape) if e > 1):
        if st <= reach:
            break
        reach += st * (e - 1)
    else:
        return False
    n = 1
    for e in shape:
        n *= e
    if n > 1 << 16:  # too many to list: the sufficient test's answer (it may refuse a few)
        return True
    offs = {0}
    for st, e in zip(strides, shape):  # every element's offset, exactly
        offs = {o + st * i for o in offs for i in range(e)}
    return len(offs) < n


def broadcast_shapes(shapes, what="operands"):
    """NumPy broadcasting of several shapes; raises ``ValueError`` naming them all."""
    nd = max((len(s) for s in shapes), default=0)
    out = [1] * nd
    for s in shapes:
        off = nd - len(s)
        for i, e in enumerate(s):
            o = out[off + i]
            if e != o:
                if o == 1:
                    out[off + i] = e
                elif e != 1:
                    raise ValueError(
                        f"{what}: shapes {' and '.join(str(tuple(x)) for x in shapes)} cannot be "
                        "broadcast together")
    return tuple(out)


def broadcast_strides(view: View, shape):
    """Strides of ``view`` stretched to ``shape`` (0 where it is broadcast)."""
    off = len(shape) - len(view.shape)
    st = [0] * off
    for e, s, target in zip(view.shape, view.strides, shape[off:]):
        st.append(s if e == target and e != 1 else 0)  # extent-1 dims: stride is irrelevant
    return tuple(st)


def coalesce(shape, strides_list):
    """Drop extent-1 dims and merge neighbours that are contiguous with each other in every
    operand. Returns ``(shape, [strides...])`` with the same element order."""
    keep = [i for i, e in enumerate(shape) if e != 1]
    if not keep:
        return (), [() for _ in strides_list]
    sh = [shape[keep[0]]]
    sts = [[st[keep[0]]] for st in strides_list]
    for i in keep[1:]:
        e = shape[i]
        if all(s[-1] == st[i] * e for s, st in zip(sts, strides_list)):
            sh[-1] *= e
            for s, st in zip(sts, strides_list):
                s[-1] = st[i]
        else:
            sh.append(e)
            for s, st in zip(sts, strides_list):
                s.append(st[i])
    return tuple(sh), [tuple(s) for s in sts]


def _span(v: View, shape, strides):
    """Byte range [lo, hi) a view touches (for overlap checks)."""
    if 0 in shape:
        return None
    isz = v.dtype.itemsize
    lo = hi = v.ptr
    for e, s in zip(shape, strides):
        if s > 0:
            hi += (e - 1) * s * isz
        else:
            lo += (e - 1) * s * isz
    return lo, hi + isz


# --------------------------------------------------------------------------------------------
# output allocation in the caller's framework
_torch_dt: dict = {}
_torch_dev: dict = {}
_cupy_dt: dict = {}


def _np_dtype_for(dt):
    d = _cupy_dt.get(dt.name)
    if d is None:
        if dt.name == "bfloat16":
            try:
                import ml_dtypes  # noqa: PLC0415

                d = ml_dtypes.bfloat16
            except ImportError:
                raise TypeError("bfloat16 results as CuPy arrays need the ml_dtypes package "
                                "(pip install ml_dtypes)") from None
        else:
            import numpy  # noqa: PLC0415

            d = numpy.dtype(dt.name)
        _cupy_dt[dt.name] = d
    return d


def allocate(kind, shape, dt, device, stream=None):
    """A new C-contiguous array on ``device``: torch for torch callers, CuPy for everyone else
    (JAX and Numba results are wrapped from it after the launch: :func:`finish_output`). The
    callers need not have made ``device`` current (CuPy allocates on the current device).

    ``stream``: the stream whose kernels use the array, when that may differ from the
    framework's current stream (a ``stream=`` argument; internal tables and temporaries).
    The array is then allocated while ``stream`` is the framework's current stream, so it
    belongs to that stream as the framework defines it: it is handed out only when free for
    work on ``stream`` (not while the current stream's queued kernels may still use it), and
    it returns to the allocator behind ``stream``'s work. torch's caching allocator and
    CuPy's pool both keep their free lists per stream. A torch array is also
    ``record_stream``'d on the current stream, on which the caller may go on using it."""
    if kind == "torch":
        torch = sys.modules["torch"]
        tdt = _torch_dt.get(dt.name)
        if tdt is None:
            tdt = _torch_dt[dt.name] = getattr(torch, dt.name)
        dev = _torch_dev.get(device)
        if dev is None:
            dev = _torch_dev[device] = torch.device("cuda", device)
        cur = None if stream is None else _launch.current_stream("torch", device)
        if stream is not None and stream != cur:
            with torch.cuda.stream(_launch.torch_stream(stream, device)):
                obj = torch.empty(shape, dtype=tdt, device=dev)
            # the caller may go on using it on its current stream: freed behind that too
            obj.record_stream(_launch.torch_stream(cur, device))
            return obj
        return torch.empty(shape, dtype=tdt, device=dev)
    cp = _runtime.cupy()
    if stream is None and (device is None or _runtime.current_device() == device):
        return cp.empty(shape, dtype=_np_dtype_for(dt))
    dev = _runtime.current_device() if device is None else device
    with cp.cuda.Device(dev):
        if stream is not None and stream != cp.cuda.get_current_stream().ptr:
            with _launch.cupy_stream(stream, dev):
                return cp.empty(shape, dtype=_np_dtype_for(dt))
        return cp.empty(shape, dtype=_np_dtype_for(dt))


def finish_output(kind, out, stream, device):
    """Hand a freshly written CuPy output to JAX / Numba callers (zero-copy)."""
    if kind == "jax":
        import jax.dlpack  # noqa: PLC0415 - JAX is only imported when the caller uses it

        cp = _runtime.cupy()
        # JAX's import waits on CuPy's current stream; order it after our launch stream.
        _launch.wait_for(cp.cuda.get_current_stream().ptr, stream, device)
        return jax.dlpack.from_dlpack(out)
    if kind == "numba":
        from numba import cuda as ncuda  # noqa: PLC0415

        try:
            return ncuda.as_cuda_array(out, sync=False)
        except TypeError:  # older numba without sync=
            return ncuda.as_cuda_array(out)
    return out


# --------------------------------------------------------------------------------------------
def _is_scalar(v):
    return isinstance(v, numbers.Number) and not hasattr(v, "__cuda_array_interface__") and (
        getattr(v, "shape", ()) == ())


class Call:
    """Everything an elementwise launch needs, validated.

    Attributes: ``views`` (per operand a View or None for scalars), ``scalars`` (per operand
    the scalar kernel argument or 0), ``dtype`` (the computation dtype), ``shape``
    (broadcast), ``out`` (View), ``out_obj`` (what to return), ``kind`` (output framework),
    ``device``, ``stream``, ``size``, ``allocated`` (the output was allocated here) and
    ``overlap`` (NumPy-style mode: ``out`` partially overlaps an input, so the caller
    computes into a temporary and copies).
    """

    __slots__ = ("views", "scalars", "dtype", "shape", "out", "out_obj", "kind", "device",
                 "stream", "size", "allocated", "overlap")


def wait_producers(c):
    """Order ``c``'s launch after producers that told us their stream (CAI v3): the inputs'
    and a given ``out``'s (its pending work must not overlap the launch's writes). Call it
    with ``c.device`` current."""
    for v in c.views + ([] if c.allocated else [c.out]):
        if v is not None and v.stream is not None:
            _launch.wait_for(c.stream, v.stream, c.device)


def prepare_call(name, operands, out=None, stream=None, names=None, allow_scalars=None,
                 dtype_check=None, promote=None) -> Call:
    """Validate elementwise operands and produce a :class:`Call` (output allocated).

    Parameters
    ----------
    name : str
        Operator name for messages.
    operands : sequence
        Arrays or Python/NumPy scalars; at least one must be an array.
    out : array, optional
        Where to write. Must be writable, of the broadcast shape and the result dtype, on the
        same device; may be exactly one of the inputs, must not partially overlap any.
    stream : optional
        Stream override (see :func:`cupylab._launch.resolve_stream`).
    names : sequence of str
        Parameter names for messages.
    allow_scalars : sequence of bool
        Per operand, whether a scalar is accepted there.
    dtype_check : callable(DType) -> None
        Raises for dtypes the operator does not support (no-promotion mode only).
    promote : callable(rule, keys, out dtype) -> (computation dtype, result dtype), optional
        NumPy-style mode (the arithmetic operators): arrays may differ in dtype, scalars may
        be Python numbers, NumPy scalars or 0-d host arrays, and ``promote`` decides the
        dtypes under the framework ``rule`` (``"numpy"``, ``"torch"``, ``"jax"``) from the
        operand keys of :func:`cupylab._promotion.operand_key` (it also checks the casts).
        ``out`` may then have another dtype, and a partial overlap sets ``Call.overlap``
        instead of raising. Without it (``ElementwiseKernel``): every array must have one
        dtype, scalars take it, ``out`` must have it.

    Returns
    -------
    Call
        Or ``None`` in NumPy-style mode when every operand is a scalar and there is no
        ``out`` (the caller computes on the host).
    """
    names = names or [f"x{i}" for i in range(len(operands))]
    ops = list(operands)
    n = len(ops)
    fns = [None] * n
    lead = None
    for i, o in enumerate(ops):
        fn = _arrays.framework_of(o)
        if fn is None:
            if _is_scalar(o) or (promote is not None and _is_host_scalar(o)):
                if allow_scalars is not None and not allow_scalars[i]:
                    raise TypeError(f"{name}: {names[i]} must be a GPU array (got a scalar {o!r})")
                continue
            if promote is not None and allow_scalars is not None and allow_scalars[i]:
                raise TypeError(f"{name}: {names[i]} must be a GPU array or a Python scalar "
                                f"(got {_arrays._what(o)})")
            raise _arrays._host_error(f"{name}: {names[i]}", o)
        fns[i] = fn
        if lead is None:
            lead = i
    if lead is None and promote is not None:
        if out is None:
            return None
        ofn = _arrays.framework_of(out)
        if ofn is None:
            raise _arrays._host_error(f"{name}: out", out)
        ops.append(out)  # the output leads (device, stream, rules); it is not read
        names = list(names) + ["out"]
        fns.append(ofn)
        lead = n
    elif lead is None:
        raise TypeError(f"{name}: at least one operand must be a GPU array (all are scalars)")
    elif out is not None:
        # out is imported like the inputs (not read): a DLPack producer is then asked to
        # order its work before the launch stream, not the legacy one
        ofn = _arrays.framework_of(out)
        if ofn is None:
            raise _arrays._host_error(f"{name}: out", out)
        ops.append(out)
        names = list(names) + ["out"]
        fns.append(ofn)

    deferred = _arrays.DEFERRED
    views = [None] * len(ops)
    pending = False
    lead_dev = None
    for i, fn in enumerate(fns):
        if fn is not None:
            if fn in deferred:
                d = _arrays.deferred_device(ops[i], fn, f"{name}: {names[i]}")
                if i == lead:
                    lead_dev = d
                pending = True
            else:
                views[i] = fn(ops[i], f"{name}: {names[i]}", None)
    # Everything that needs no GPU is checked before the runtime is touched.
    kind = _kind_of(fns[lead])
    if not pending:
        dt, scalars, shape, ov = _validate(name, ops, views, names, dtype_check, promote, out,
                                           kind, n)

    # device: the first array's
    lv = views[lead]
    if lv is not None:
        device = lv.device
        if device is None:
            device = _arrays.resolve_device(lv, None if lv.ptr else _runtime.current_device())
    else:
        device = lead_dev

    with _launch.ensure_device(device):
        if stream is None:
            s = _launch.current_stream(kind, device)
        else:
            s = _launch.resolve_stream(stream)
        if pending:
            for i, fn in enumerate(fns):
                if fn in deferred:
                    views[i] = _arrays.import_deferred(ops[i], fn, f"{name}: {names[i]}", s)
            dt, scalars, shape, ov = _validate(name, ops, views, names, dtype_check, promote,
                                               out, kind, n)
        views = views[:n]
        for i, v in enumerate(views):
            if v is None:
                continue
            if _arrays.resolve_device(v, device) != device:
                raise ValueError(
                    f"{name}: arrays are on different GPUs ({names[lead]} on cuda:{device}, "
                    f"{names[i]} on cuda:{v.device})")
        c = Call()
        c.views, c.scalars, c.dtype, c.shape, c.device, c.stream, c.kind = (
            views, scalars, dt, shape, device, s, kind)
        c.overlap = False
        size = 1
        for e in shape:
            size *= e
        c.size = size
        if out is None:
            c.out_obj = allocate(kind, shape, ov, device, None if stream is None else s)
            c.out = _arrays.as_view(c.out_obj, f"{name}: out")
            c.allocated = True
        else:
            if _arrays.resolve_device(ov, device) != device:
                raise ValueError(
                    f"{name}: out is on cuda:{ov.device} but the inputs are on cuda:{device}")
            if promote is None:
                check_overlap(name, ov, shape, views, names)
            else:
                try:
                    check_overlap(name, ov, shape, views, names)
                except ValueError:
                    c.overlap = True
            c.out, c.out_obj, c.allocated = ov, out, False
        return c


def _validate(name, ops, views, names, dtype_check, promote, out, kind, n):
    """dtypes, the operator's dtype rule, scalars, broadcasting and the static ``out`` checks
    (no GPU needed). Returns ``(computation dtype, scalars, shape, out view or result
    dtype)``."""
    if promote is not None:
        return _validate_promote(name, ops, views, names, promote, out, kind, n)
    dt = None
    for i, v in enumerate(views[:n]):  # the inputs (out, when given, is views[n])
        if v is None:
            continue
        if dt is None:
            dt = v.dtype
        elif v.dtype is not dt:
            raise TypeError(
                f"{name}: dtypes must match (got {dt.name} and {v.dtype.name} for "
                f"{names[i]}); cupylab does not promote between arrays, cast one first")
    if dtype_check is not None:
        dtype_check(dt)
    scalars = [0] * n
    for i, o in enumerate(ops[:n]):
        if views[i] is None:
            scalars[i] = _scalar_for(name, names[i], o, dt)
    shape = _shape_of(name, views[:n])
    ov = (_check_out_static(name, out, shape, dt, views[n] if len(views) > n else None)
          if out is not None else dt)
    return dt, scalars, shape, ov


def _shape_of(name, views):
    shapes = [v.shape for v in views if v is not None]
    return shapes[0] if all(sh == shapes[0] for sh in shapes) else broadcast_shapes(shapes, name)


_RULE_OF_KIND = {"torch": "torch", "jax": "jax"}


def _validate_promote(name, ops, views, names, promote, out, kind, n):
    from ._promotion import operand_key  # noqa: PLC0415

    ov = None
    if out is not None:
        ov = views[n] if len(views) > n else _arrays.as_view(out, f"{name}: out")
    keys = tuple(operand_key(ops[i], views[i]) for i in range(n))
    ct, res = promote(_RULE_OF_KIND.get(kind, "numpy"), keys, None if ov is None else ov.dtype)
    scalars = [0] * n
    for i in range(n):
        if views[i] is None:
            try:
                scalars[i] = ct.scalar_bits(_host_value(ops[i]))
            except OverflowError as e:
                raise OverflowError(f"{name}: {names[i]}: {e}") from None
    arr = [v for v in views[:n] if v is not None]
    if arr:
        shape = _shape_of(name, arr)
    else:  # only scalars: they broadcast to out
        shape = ov.shape
    if ov is None:
        return ct, scalars, shape, res
    _check_out_static(name, out, shape, None, ov)
    return ct, scalars, shape, ov


def _host_value(v):
    """A Python number from a Python/NumPy scalar, a 0-d host array, or an instance of a
    subclass of a Python number type (IntEnum, a float subclass: their value as the base
    type)."""
    if type(v) in (int, float, bool, complex):
        return v
    item = getattr(v, "item", None)
    if item is not None:
        return item()
    for base in (bool, int, float, complex):
        if isinstance(v, base):
            return base(v)
    return v


def _is_host_scalar(v):
    """A NumPy scalar or a 0-d NumPy array (strong scalars in NumPy's rules)."""
    tp = type(v)
    if tp.__module__.split(".", 1)[0] not in ("numpy", "ml_dtypes"):
        return False
    return getattr(v, "shape", None) == () and hasattr(v, "dtype") and hasattr(v, "item")


def _kind_of(fn):
    return {_arrays._from_torch: "torch", _arrays._from_cupy: "cupy", _arrays._from_jax: "jax",
            _arrays._from_numba: "numba"}.get(fn, "cupy")


def _scalar_for(name, pname, v, dt):
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        raise TypeError(f"{name}: {pname} is a bool scalar; arithmetic on booleans is not supported")
    if isinstance(v, numbers.Complex) and not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: {pname} is a complex scalar; complex dtypes are not supported")
    if dt.kind == "i" and not isinstance(v, numbers.Integral):
        raise TypeError(
            f"{name}: {pname}={v!r} is a float scalar but the arrays are {dt.name}; NumPy would "
            "promote to float64, cupylab does not promote: cast the array or pass an int")
    try:
        return dt.scalar_bits(v)
    except OverflowError as e:
        raise OverflowError(f"{name}: {pname}: {e}") from None


def _check_out_static(name, out, shape, dt, ov=None):
    """Checks on ``out`` that need no GPU: writable, shape, dtype (when ``dt`` is given), no
    zero strides."""
    if ov is None:
        ov = _arrays.as_view(out, f"{name}: out")
    if ov.readonly:
        raise ValueError(
            f"{name}: out is read-only ({ov.kind} array); JAX arrays are immutable, so pass no "
            "out= and use the returned array")
    if ov.shape != shape:
        raise ValueError(f"{name}: out has shape {ov.shape}, expected {shape}")
    if dt is not None and ov.dtype is not dt:
        raise TypeError(f"{name}: out has dtype {ov.dtype.name}, expected {dt.name}")
    if any(s == 0 and e > 1 for s, e in zip(ov.strides, ov.shape)) and 0 not in ov.shape:
        raise ValueError(f"{name}: out has zero strides (a broadcast view); it cannot be written")
    if overlaps_itself(ov.shape, ov.strides):
        raise ValueError(f"{name}: out overlaps itself (strides {ov.strides} for shape "
                         f"{ov.shape} put several elements at one address); it cannot be written")
    return ov


def check_overlap(name, ov, shape, views, names, out_name="out"):
    """Refuse an ``out`` that shares memory with an input unless it is exactly that input
    (same pointer and strides over the broadcast shape). Conservative: byte ranges that
    intersect count as overlap even if interleaved views never touch the same element."""
    ospan = _span(ov, ov.shape, ov.strides)
    if ospan is None:
        return
    for i, v in enumerate(views):
        if v is None:
            continue
        bst = broadcast_strides(v, shape)
        if (v.ptr == ov.ptr and v.dtype.itemsize == ov.dtype.itemsize
                and all(a == b or e == 1 for a, b, e in zip(bst, ov.strides, shape))):
            continue  # exactly in place: every element is read and written by one thread
        sp = _span(v, shape, bst)
        if sp is not None and sp[0] < ospan[1] and ospan[0] < sp[1]:
            raise ValueError(
                f"{name}: {out_name} overlaps {names[i]} without being exactly the same view; "
                "partial overlap would read elements after they are written")
