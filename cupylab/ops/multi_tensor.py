"""foreach operators: one launch over lists of arrays of mixed sizes (and dtypes).

Every function takes lists (or tuples) of GPU arrays from one framework (CuPy, torch, JAX
read-only, Numba, CAI, DLPack), validated once per list and then served from the cache of
:mod:`cupylab.ops._mt_plan` (CuPy and torch lists; other frameworks are validated on every
call). Launches go to the caller's current stream (torch's for torch arrays, CuPy's
otherwise) or ``stream=``; nothing synchronises the host, and the norms, the clip factor and
``found_inf`` stay on the device.

Rules for every function: arrays C-contiguous, float16 / bfloat16 / float32 / float64, the
arrays at one position of every list of the same shape and dtype (``copy_`` converts), all on
one device, all from one framework; torch tensors must not require grad (pass
``p.detach()``); a written array may be the same array as the one it is computed from at its
own position (in place), and must not overlap any other array of the call. Empty lists are a
no-op; empty arrays are skipped. Arithmetic runs in float32 for 16-bit and float32 arrays, in
float64 for float64 arrays.
"""
from __future__ import annotations

import sys

from .. import _arrays, _launch, _runtime
from .._elementwise_core import allocate, finish_output, real_value
from . import _mt_plan as P

__all__ = ["add", "add_", "axpy_", "mul", "mul_", "scale_", "lerp", "lerp_", "copy_", "zero_",
           "norm", "norms", "clip_by_global_norm_", "nonfinite_check", "unscale_", "prepare",
           "PreparedForeach", "resolve", "device_scalar"]

_KINDS = {_arrays._from_torch: "torch", _arrays._from_cupy: "cupy", _arrays._from_jax: "jax",
          _arrays._from_numba: "numba", _arrays._from_dlpack: "dlpack"}
_modes: dict = {}
_torch_ptr = None


def _mode(tp):
    m = _modes.get(tp)
    if m is None:
        fn = _arrays._ADAPTERS.get(tp) or _arrays._classify(tp)
        m = _modes.setdefault(tp, "torch" if fn is _arrays._from_torch else
                              "cupy" if fn is _arrays._from_cupy else "")
    return m


def cache_key(lists, writes):
    """The cache key of a call (``None``: not cacheable). Identity of every array, plus the
    data pointers of torch tensors (whose storage can change under the same object)."""
    global _torch_ptr
    first = None
    for lst in lists:
        if lst is not None:
            if type(lst) not in (list, tuple) or not lst:
                return None
            if first is None:
                first = lst[0]
    m = _mode(type(first))
    if not m:
        return None
    ids = tuple(None if lst is None else tuple(map(id, lst)) for lst in lists)
    if m == "cupy":
        return (writes, ids)
    f = _torch_ptr
    if f is None:
        f = _torch_ptr = sys.modules["torch"].Tensor.data_ptr
    try:
        ptrs = tuple(None if lst is None else tuple(map(f, lst)) for lst in lists)
    except (TypeError, AttributeError):
        return None
    return (writes, ids, ptrs)


def _contiguous(v):
    if 0 in v.shape:
        return True
    acc = 1
    for e, s in zip(reversed(v.shape), reversed(v.strides)):
        if e != 1 and s != acc:
            return False
        acc *= e
    return True


def _check_aliasing(opname, names, slot_views, writes, inplace_pairs=()):
    """Refuse a written array that overlaps any other array of the call, except the very same
    array at the same position of another list that is only read (in place: every element is
    read before it is written, by the same thread). The same array twice in one written list,
    or in two written lists (two results of one element), is refused."""
    spans = []
    for k, vs in enumerate(slot_views):
        if vs is None:
            continue
        w = bool((writes >> k) & 1)
        for i, v in enumerate(vs):
            n = v.size
            if n:
                lo = v.ptr
                spans.append((lo, lo + n * v.dtype.itemsize, w, k, i))
    if not any(s[2] for s in spans):
        return
    spans.sort()
    cluster, end = [], -1
    for s in spans + [(float("inf"), 0, False, -1, -1)]:
        if s[0] >= end:
            if len(cluster) > 1 and any(c[2] for c in cluster):
                pairs = [(a, b) for i, a in enumerate(cluster) for b in cluster[i + 1:]
                         if a[2] or b[2]]  # every pair with a written array, in any order
                for a, b in pairs:
                    # an array and its own result at one position: elementwise, safe; two
                    # results written to one array are not
                    ok = (a[0], a[1], a[4]) == (b[0], b[1], b[4]) and (
                        (a[3] != b[3] and not (a[2] and b[2])) or not (a[2] or b[2]))
                    if not ok:
                        raise ValueError(
                            f"{opname}: {names[a[3]]}[{a[4]}] and {names[b[3]]}[{b[4]}] overlap in "
                            "memory and one of them is written; only an array and its own "
                            "in-place result may share memory")
            cluster, end = [], -1
        cluster.append(s)
        end = max(end, s[1])


def _validate(opname, names, lists, writes, same_dtype, stream, inplace_pairs=(), free=()):
    n, lead = None, None
    for k, lst in enumerate(lists):
        if lst is None:
            continue
        if type(lst) not in (list, tuple):
            raise TypeError(f"{opname}: {names[k]} must be a list or tuple of GPU arrays "
                            f"(got {type(lst).__module__}.{type(lst).__qualname__})")
        if n is None:
            n, lead = len(lst), k
        elif len(lst) != n:
            raise ValueError(f"{opname}: {names[k]} has {len(lst)} arrays but {names[lead]} "
                             f"has {n}; the lists must have the same length")
    if not n:
        return None
    lead = next(k for k, lst in enumerate(lists) if lst is not None and k not in free)
    obj0 = lists[lead][0]
    fn0 = _arrays.framework_of(obj0)
    if fn0 is None:
        raise _arrays._host_error(f"{opname}: {names[lead]}[0]", obj0)
    kind = _KINDS.get(fn0, "cai")
    fns = []
    for k, lst in enumerate(lists):
        if lst is None:
            fns.append(None)
            continue
        row = []
        for i, o in enumerate(lst):
            fn = _arrays.framework_of(o)
            if fn is None:
                raise _arrays._host_error(f"{opname}: {names[k]}[{i}]", o)
            if fn is not fn0 and k not in free:
                raise TypeError(
                    f"{opname}: {names[k]}[{i}] is a {_KINDS.get(fn, 'CAI/DLPack')} array but "
                    f"{names[lead]}[0] is a {kind} array; one call takes arrays of one framework")
            row.append(fn)
        fns.append(row)
    if fn0 in _arrays.DEFERRED:  # imported once the stream is known (DLPack, JAX)
        device = _arrays.deferred_device(obj0, fn0, f"{opname}: {names[lead]}[0]")
    else:
        v0 = fn0(obj0, f"{opname}: {names[lead]}[0]", None)
        device = _arrays.resolve_device(v0, None if v0.ptr else _runtime.current_device())
    with _launch.ensure_device(device):
        s = _launch.current_stream(kind, device) if stream is None else _launch.resolve_stream(stream)
        slot_views = []
        for k, lst in enumerate(lists):
            if lst is None:
                slot_views.append(None)
                continue
            vs = [fn(o, f"{opname}: {names[k]}[{i}]", s) for fn, o in zip(fns[k], lst)]
            slot_views.append(vs)
            written = (writes >> k) & 1
            for i, v in enumerate(vs):
                what = f"{opname}: {names[k]}[{i}]"
                if _arrays.resolve_device(v, device) != device:
                    raise ValueError(f"{what} is on cuda:{v.device} but {names[lead]}[0] is on "
                                     f"cuda:{device}; all arrays must be on one GPU")
                if v.dtype.name not in P.FLOATS:
                    raise TypeError(f"{what} has dtype {v.dtype.name}; supported: "
                                    f"{', '.join(P.FLOATS)}")
                if not _contiguous(v):
                    raise ValueError(f"{what} is not C-contiguous (shape {v.shape}, strides "
                                     f"{v.strides}); pass contiguous arrays")
                if written and v.readonly:
                    raise ValueError(f"{what} is read-only (JAX arrays and read-only DLPack "
                                     "tensors are never written); pass a writable array")
                if v.stream is not None:
                    _launch.wait_for(s, v.stream, device)
        ref = slot_views[lead]
        for k, vs in enumerate(slot_views):
            if vs is None or k == lead:
                continue
            for i, (a, b) in enumerate(zip(ref, vs)):
                if a.shape != b.shape:
                    raise ValueError(f"{opname}: {names[k]}[{i}] has shape {b.shape} but "
                                     f"{names[lead]}[{i}] has shape {a.shape}")
                if k in same_dtype and a.dtype is not b.dtype:
                    raise TypeError(f"{opname}: {names[k]}[{i}] has dtype {b.dtype.name} but "
                                    f"{names[lead]}[{i}] has dtype {a.dtype.name}")
        _check_aliasing(opname, names, slot_views, writes, inplace_pairs)
        sizes = [v.size for v in ref]
        plan = P.build(slot_views, sizes, device, kind, s)
    return plan, s


def resolve(opname, names, lists, writes, *, same_dtype=None, stream=None, inplace_pairs=(),
            free=()):
    """The plan and stream for one call (validated and built on a cache miss).

    ``lists``: per slot a list of arrays or ``None``; ``writes``: bit mask of written slots;
    ``same_dtype``: slots whose dtype must equal the lead slot's (default: all);
    ``free``: slots whose arrays may come from another framework (outputs allocated here).
    Returns ``(plan, stream)``, or ``(None, None)`` for empty lists."""
    if same_dtype is None:
        same_dtype = range(len(lists))
    key = cache_key(lists, (writes, tuple(same_dtype), tuple(free)))
    if key is not None:
        plan = P.cache_get(key)
        if plan is not None:
            with _launch.ensure_device(plan.device):
                s = (_launch.current_stream(plan.kind, plan.device) if stream is None
                     else _launch.resolve_stream(stream))
                plan = P.for_stream(plan, s)
            if plan.captured and not plan.pinned:
                P.pin(key, plan)
            return plan, s
    r = _validate(opname, names, lists, writes, same_dtype, stream, inplace_pairs, free)
    if r is None:
        return None, None
    if key is not None:
        P.cache_put(key, r[0], [o for lst in lists if lst is not None for o in lst])
    return r


def device_scalar(opname, pname, a, plan, writable=False, stream=None):
    """The address of a one-element float32 device array (lr, step, found_inf, scale), read
    by a launch on ``stream``: imported for that stream (DLPack) and ordered after the stream
    a CUDA Array Interface v3 producer names, like the lists' arrays."""
    v = _arrays.as_view(a, f"{opname}: {pname}", stream)
    if v.dtype.name != "float32" or v.size != 1:
        raise TypeError(f"{opname}: {pname} must be a one-element float32 GPU array (got "
                        f"dtype {v.dtype.name}, shape {v.shape})")
    if writable and v.readonly:
        raise ValueError(f"{opname}: {pname} is read-only; pass a writable array")
    dev = _arrays.resolve_device(v, plan.device)
    if dev != plan.device:
        raise ValueError(f"{opname}: {pname} is on cuda:{dev} but the lists are on "
                         f"cuda:{plan.device}")
    if v.stream is not None and stream is not None:
        _launch.wait_for(stream, v.stream, plan.device)
    return v.ptr


def _is_scalar(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_alpha(opname, alpha):
    """``alpha`` of add_, add and axpy_: a Python number, as lerp's ``weight``."""
    if not _is_scalar(alpha):
        raise TypeError(f"{opname}: alpha must be a Python number (got {alpha!r})")


def _scalar_or_device(opname, pname, x, plan, stream=None):
    """(host value, device pointer) for a Python number or a one-element float32 array."""
    if _is_scalar(x):
        return real_value(opname, pname, x, "a finite number"), 0
    return 0.0, device_scalar(opname, pname, x, plan, stream=stream)


def _args(s=(), p=()):
    s = tuple(float(v) for v in s) + (0.0,) * (8 - len(s))
    p = tuple(int(v) for v in p) + (0,) * (4 - len(p))
    return s + p


def _ew_kernel(op, inplace):
    return lambda sig: P.kernel("foreach", P.ew_name(op, sig[0], inplace))


def _alloc_like(opname, xs, plan, s, stream):
    """New arrays shaped like ``xs`` for the outputs (see :func:`_new`); ``xs`` read as for a
    launch on ``s`` (DLPack producers are told that stream, as when the lists are checked)."""
    return [_new(plan, v.shape, v.dtype, s, stream)
            for v in (_arrays.as_view(x, f"{opname}: x", s) for x in xs)]


def _finish_list(plan, outs, stream):
    if plan.kind in ("torch", "cupy"):
        return outs
    return [finish_output(plan.kind, o, stream, plan.device) for o in outs]


def _binary(opname, xs, other, out, stream, list_op, scalar_op, alpha=None, free=()):
    inplace = out is None
    if isinstance(other, (list, tuple)):
        op = list_op
        lists = [xs, other] if inplace else [out, xs, other]
        names = ["tensors", "other"] if inplace else ["out", "tensors", "other"]
    elif _is_scalar(other):
        op = scalar_op
        lists = [xs] if inplace else [out, xs]
        names = ["tensors"] if inplace else ["out", "tensors"]
    else:
        raise TypeError(f"{opname}: other must be a list of GPU arrays or a Python number "
                        f"(got {type(other).__module__}.{type(other).__qualname__})")
    plan, s = resolve(opname, names, lists, 1, stream=stream, free=free)
    if plan is None:
        return None
    with _launch.ensure_device(plan.device):
        if op == scalar_op:
            a = _args((other,))
        else:
            a = _args((1.0 if alpha is None else alpha,))
        P.launch(plan, _ew_kernel(op, inplace), a, s)
    return None


def _out_of_place(opname, xs, other, out, stream, list_op, scalar_op, alpha=None):
    if type(xs) not in (list, tuple):
        raise TypeError(f"{opname}: tensors must be a list or tuple of GPU arrays")
    if out is None:
        if not xs:
            return []
        plan, s = resolve(opname, ["tensors"], [xs], 0, stream=stream)
        with _launch.ensure_device(plan.device):
            out = _alloc_like(opname, xs, plan, s, stream)
        _binary(opname, xs, other, out, stream, list_op, scalar_op, alpha, free=(0,))
        return _finish_list(plan, out, s)
    _binary(opname, xs, other, out, stream, list_op, scalar_op, alpha)
    return out


# -- docstrings ----------------------------------------------------------------------------------
# Pieces shared by the docstrings of the public functions (here and in cupylab.optim): a line of
# a docstring that holds only one of these keys is replaced by its text, indented like the key.
_DOC_PIECES = {
    "{list_type_errors}": """\
A list argument that is not a list or tuple; an element that is not a GPU array (host
data such as a NumPy array or a CPU tensor, a Dask array, any other object); a torch
tensor that requires grad, is sparse or has a lazy conj/neg bit; a dtype other than
float16, bfloat16, float32 or float64; arrays of two frameworks in one call; a
``stream`` that is neither an int nor a stream object.""",
    "{list_value_errors}": """\
Lists of different lengths; two arrays at one position with different shapes; an array
that is not C-contiguous; a written array that is read-only (a JAX array, a read-only
CUDA Array Interface or DLPack array); arrays on more than one GPU; a written array that
shares memory with another array of the call, except the one at its own position of a
list that is only read (in place); a CUDA Array Interface array with byte strides that
are not a multiple of its item size or a misaligned data pointer; a negative ``stream``
handle.""",
    "{runtime_errors}": """\
RuntimeError
    A list seen for the first time during a CUDA graph capture: its launch table is
    uploaded on first use, which a capture does not allow. Run the call once before
    capturing.
cupylab.NoGPUError
    CuPy cannot be imported, or it finds no usable CUDA GPU.""",
    "{stream_param}": """\
stream : int or stream object, optional
    The launch stream: a ``cudaStream_t`` handle (0 is the legacy default stream), a CuPy
    or torch stream, or an object with ``__cuda_stream__``. Default: the current stream of
    the arrays' framework (torch's for torch tensors, CuPy's for every other kind).""",
    "{launch_notes}": """\
One launch per group of positions whose arrays have the same dtypes, on ``stream``;
nothing synchronises the host. The first call with given CuPy or torch lists checks them
and uploads their launch table; later calls with the same arrays (same objects and, for
torch, the same data pointers) find the table in a cache and skip the checks. Lists of
other frameworks are checked on every call. Inside a CUDA graph capture, only lists that
were used before the capture can be launched.""",
    "{alloc_notes}": """\
With ``out=None`` the outputs are new arrays on every call, so every call also checks the
lists and builds and uploads a new launch table: in a loop pass ``out=`` (or use
:func:`prepare`); inside a CUDA graph capture ``out=`` is required (the new table cannot
be uploaded there).""",
}


def _fill_doc(f, pieces=None):
    """Replace the keys of ``pieces`` (default :data:`_DOC_PIECES`) in ``f``'s docstring,
    each alone on its line, by their text (which may hold keys in turn), indented like the
    key; returns ``f`` itself (a decorator). Changes nothing but ``f.__doc__``."""
    if f.__doc__ is None:  # python -OO
        return f
    if pieces is None:
        pieces = _DOC_PIECES

    def expand(text, depth=0):
        out = []
        for line in text.split("\n"):
            piece = pieces.get(line.strip())
            if piece is None or depth > 4:
                out.append(line)
                continue
            indent = line[:len(line) - len(line.lstrip())]
            out += [indent + t if t else "" for t in expand(piece, depth + 1)]
        return out

    f.__doc__ = "\n".join(expand(f.__doc__))
    return f


# -- public operators ----------------------------------------------------------------------------
@_fill_doc
def add_(tensors, other, *, alpha=1.0, stream=None):
    """Add a list (times ``alpha``) or a number to every array of a list, in place.

    ``tensors[i] += alpha * other[i]`` when ``other`` is a list; ``tensors[i] += other``
    when it is a number (``alpha`` is then not used).

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        Written in place: float16, bfloat16, float32 or float64, C-contiguous, any shapes.
    other : list or tuple of GPU arrays, or int or float
        A list has the length of ``tensors``, and ``other[i]`` the shape and dtype of
        ``tensors[i]`` (it may be ``tensors[i]`` itself). A number must be a Python ``int``
        or ``float`` (a ``numpy.float64`` passes, being a float; ``bool``, other NumPy
        scalars and device arrays do not) and is used as it is, inf and NaN included.
    alpha : int or float, default 1.0
        Multiplier of a list ``other``: a Python number (``bool``, NumPy scalars other than
        ``numpy.float64`` and device arrays are refused, even when ``other`` is a number),
        not checked for finiteness.
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    TypeError
        ``alpha`` not a Python number (checked first); ``other`` neither a list or tuple
        nor a Python number; ``other[i]`` of another dtype than ``tensors[i]``.
        {list_type_errors}
    ValueError
        {list_value_errors}
    OverflowError
        A Python ``int`` ``other``, or ``alpha`` with a list ``other``, too large for a
        float64.
    {runtime_errors}

    Notes
    -----
    {launch_notes}
    """
    _check_alpha("foreach.add_", alpha)
    _binary("foreach.add_", tensors, other, None, stream, "add", "add_scalar", alpha)


@_fill_doc
def add(tensors, other, *, alpha=1.0, out=None, stream=None):
    """Sum of a list and a list (times ``alpha``) or a number, into an output list.

    ``out[i] = tensors[i] + alpha * other[i]`` when ``other`` is a list,
    ``out[i] = tensors[i] + other`` when it is a number (``alpha`` is then not used).

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        float16, bfloat16, float32 or float64, C-contiguous, any shapes.
    other : list or tuple of GPU arrays, or int or float
        As for :func:`add_`: a list of the arrays' length, shapes and dtypes, or a Python
        ``int`` or ``float``.
    alpha : int or float, default 1.0
        Multiplier of a list ``other``: a Python number, as for :func:`add_`.
    out : list or tuple of GPU arrays, optional
        Written: ``out[i]`` of the shape and dtype of ``tensors[i]``, from the same
        framework. ``out[i]`` may be ``tensors[i]`` or ``other[i]`` (in place) but must not
        overlap any other array of the call. Default: new arrays.
    {stream_param}

    Returns
    -------
    list or tuple of GPU arrays
        ``out`` itself when given. Otherwise a new list of new C-contiguous arrays, one per
        input, in the inputs' framework (torch tensors for torch, CuPy arrays for CuPy,
        JAX arrays for JAX, Numba device arrays for Numba, CuPy arrays for other CUDA Array
        Interface or DLPack producers); an empty ``tensors`` gives ``[]``.

    Raises
    ------
    TypeError
        ``alpha`` not a Python number (checked first); ``tensors`` not a list or tuple;
        ``other`` neither a list or tuple nor a Python number; ``other[i]`` or ``out[i]``
        of another dtype than ``tensors[i]``.
        {list_type_errors}
    ValueError
        {list_value_errors}
    OverflowError
        A Python ``int`` ``other``, or ``alpha`` with a list ``other``, too large for a
        float64.
    {runtime_errors}

    Notes
    -----
    {launch_notes}

    {alloc_notes}
    """
    _check_alpha("foreach.add", alpha)
    return _out_of_place("foreach.add", tensors, other, out, stream, "add", "add_scalar", alpha)


@_fill_doc
def axpy_(alpha, x, y, *, stream=None):
    """BLAS axpy over lists: ``y[i] += alpha * x[i]``, in place, in one launch per dtype.

    ``x`` may also be a number: then ``y[i] += alpha * x`` (the product is formed on the
    host, in Python).

    Parameters
    ----------
    alpha : int or float
        The multiplier: a Python number (``bool``, NumPy scalars other than
        ``numpy.float64`` and device arrays are refused), not checked for finiteness.
    x : list or tuple of GPU arrays, or int or float
        A list of the length of ``y``, ``x[i]`` of the shape and dtype of ``y[i]`` (it may
        be ``y[i]`` itself); or a Python ``int`` or ``float``.
    y : list or tuple of GPU arrays
        Written in place: float16, bfloat16, float32 or float64, C-contiguous. Error
        messages call it ``tensors`` (and ``x`` ``other``), as :func:`add_` does.
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    TypeError
        ``alpha`` not a Python number (checked first); ``x`` neither a list or tuple nor a
        Python number; ``x[i]`` of another dtype than ``y[i]``.
        {list_type_errors}
    ValueError
        {list_value_errors}
    OverflowError
        ``alpha * x`` (numbers) or a Python ``int`` too large for a float64.
    {runtime_errors}

    Notes
    -----
    {launch_notes}
    """
    _check_alpha("foreach.axpy_", alpha)
    if _is_scalar(x):  # a number: alpha * x is the scalar added (alpha was dropped)
        x = alpha * x
    _binary("foreach.axpy_", y, x, None, stream, "add", "add_scalar", alpha)


@_fill_doc
def mul_(tensors, other, *, stream=None):
    """Multiply every array of a list by a list or a number, in place.

    ``tensors[i] *= other[i]`` when ``other`` is a list, ``tensors[i] *= other`` when it is
    a number.

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        Written in place: float16, bfloat16, float32 or float64, C-contiguous, any shapes.
    other : list or tuple of GPU arrays, or int or float
        A list has the length of ``tensors``, and ``other[i]`` the shape and dtype of
        ``tensors[i]`` (it may be ``tensors[i]`` itself). A number must be a Python ``int``
        or ``float`` (``bool``, NumPy scalars other than ``numpy.float64`` and device
        arrays are refused; see :func:`scale_` for a factor on the device).
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    TypeError
        ``other`` neither a list or tuple nor a Python number; ``other[i]`` of another
        dtype than ``tensors[i]``.
        {list_type_errors}
    ValueError
        {list_value_errors}
    OverflowError
        A Python ``int`` ``other`` too large for a float64.
    {runtime_errors}

    Notes
    -----
    {launch_notes}
    """
    _binary("foreach.mul_", tensors, other, None, stream, "mul", "mul_scalar")


@_fill_doc
def mul(tensors, other, *, out=None, stream=None):
    """Product of a list and a list or a number, into an output list.

    ``out[i] = tensors[i] * other[i]`` when ``other`` is a list, ``out[i] = tensors[i] *
    other`` when it is a number.

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        float16, bfloat16, float32 or float64, C-contiguous, any shapes.
    other : list or tuple of GPU arrays, or int or float
        As for :func:`mul_`: a list of the arrays' length, shapes and dtypes, or a Python
        ``int`` or ``float``.
    out : list or tuple of GPU arrays, optional
        Written: ``out[i]`` of the shape and dtype of ``tensors[i]``, from the same
        framework. ``out[i]`` may be ``tensors[i]`` or ``other[i]`` (in place) but must not
        overlap any other array of the call. Default: new arrays.
    {stream_param}

    Returns
    -------
    list or tuple of GPU arrays
        ``out`` itself when given. Otherwise a new list of new arrays in the inputs'
        framework (CuPy arrays for CUDA Array Interface or DLPack producers other than
        torch, JAX and Numba), as :func:`add` returns; an empty ``tensors`` gives ``[]``.

    Raises
    ------
    TypeError
        ``tensors`` not a list or tuple; ``other`` neither a list or tuple nor a Python
        number; ``other[i]`` or ``out[i]`` of another dtype than ``tensors[i]``.
        {list_type_errors}
    ValueError
        {list_value_errors}
    OverflowError
        A Python ``int`` ``other`` too large for a float64.
    {runtime_errors}

    Notes
    -----
    {launch_notes}

    {alloc_notes}
    """
    return _out_of_place("foreach.mul", tensors, other, out, stream, "mul", "mul_scalar")


@_fill_doc
def scale_(tensors, factor, *, stream=None):
    """Multiply every array of a list by one factor, in place: ``tensors[i] *= factor``.

    The factor may live on the device: the kernel reads it there, so neither the call nor
    a CUDA graph that captured it needs its value on the host, and a graph replay uses the
    value the array holds at that time.

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        Written in place: float16, bfloat16, float32 or float64, C-contiguous, any shapes.
    factor : int, float or one-element float32 GPU array
        A Python number (then the call is :func:`mul_`, whose name its error messages
        carry), or a one-element float32 array of any framework on the arrays' GPU.
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    TypeError
        A device ``factor`` that is not a one-element float32 array; a ``factor`` that is
        neither a Python number nor a GPU array (``bool``, a NumPy scalar other than
        ``numpy.float64``, host data).
        {list_type_errors}
    ValueError
        A device ``factor`` on another GPU than the arrays.
        {list_value_errors}
    OverflowError
        A Python ``int`` ``factor`` too large for a float64.
    {runtime_errors}

    Notes
    -----
    {launch_notes}

    A device ``factor`` is checked only when ``tensors`` is not empty.
    """
    if _is_scalar(factor):
        return mul_(tensors, factor, stream=stream)
    plan, s = resolve("foreach.scale_", ["tensors"], [tensors], 1, stream=stream)
    if plan is None:
        return None
    with _launch.ensure_device(plan.device):
        ptr = device_scalar("foreach.scale_", "factor", factor, plan, stream=s)
        P.launch(plan, _ew_kernel("mul_scalar", True), _args((0.0,), (ptr,)), s)
    return None


@_fill_doc
def lerp_(tensors, ends, weight, *, stream=None):
    """Linear interpolation towards a second list, in place.

    ``tensors[i] += weight * (ends[i] - tensors[i])``, computed with torch's formula for
    ``torch.lerp`` (``ends[i] - (ends[i] - tensors[i]) * (1 - weight)`` when ``|weight| >=
    0.5``), which is exact at ``weight`` 0 and 1.

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        Written in place: float16, bfloat16, float32 or float64, C-contiguous, any shapes.
    ends : list or tuple of GPU arrays
        Read: the length of ``tensors``, ``ends[i]`` of the shape and dtype of
        ``tensors[i]``.
    weight : int or float
        A Python number (``bool`` and NumPy scalars other than ``numpy.float64`` are
        refused); not limited to [0, 1] and not checked for finiteness.
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    TypeError
        ``weight`` not a Python number (checked first); ``ends[i]`` of another dtype than
        ``tensors[i]``.
        {list_type_errors}
    ValueError
        {list_value_errors}
    OverflowError
        A Python ``int`` ``weight`` too large for a float64.
    {runtime_errors}

    Notes
    -----
    {launch_notes}
    """
    if not _is_scalar(weight):
        raise TypeError(f"foreach.lerp_: weight must be a Python number (got {type(weight)})")
    plan, s = resolve("foreach.lerp_", ["tensors", "ends"], [tensors, ends], 1, stream=stream)
    if plan is not None:
        with _launch.ensure_device(plan.device):
            P.launch(plan, _ew_kernel("lerp", True), _args((weight,)), s)


@_fill_doc
def lerp(tensors, ends, weight, *, out=None, stream=None):
    """Linear interpolation between two lists, into an output list.

    ``out[i] = tensors[i] + weight * (ends[i] - tensors[i])``, with torch's formula (see
    :func:`lerp_`).

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        float16, bfloat16, float32 or float64, C-contiguous, any shapes.
    ends : list or tuple of GPU arrays
        The length of ``tensors``, ``ends[i]`` of the shape and dtype of ``tensors[i]``.
    weight : int or float
        A Python number, as for :func:`lerp_`.
    out : list or tuple of GPU arrays, optional
        Written: ``out[i]`` of the shape and dtype of ``tensors[i]``, from the same
        framework; it may be ``tensors[i]`` or ``ends[i]`` but must not overlap any other
        array of the call. Default: new arrays.
    {stream_param}

    Returns
    -------
    list or tuple of GPU arrays
        ``out`` itself when given (the lengths of ``out``, ``tensors`` and ``ends`` are
        checked even when ``tensors`` is empty); otherwise a new list of new arrays in the
        inputs' framework, as :func:`add` returns, and ``[]`` for an empty ``tensors``.

    Raises
    ------
    TypeError
        ``weight`` not a Python number (checked first); ``tensors`` not a list or tuple;
        ``ends[i]`` or ``out[i]`` of another dtype than ``tensors[i]``.
        {list_type_errors}
    ValueError
        {list_value_errors}
    OverflowError
        A Python ``int`` ``weight`` too large for a float64.
    {runtime_errors}

    Notes
    -----
    {launch_notes}

    {alloc_notes}
    """
    if not _is_scalar(weight):
        raise TypeError(f"foreach.lerp: weight must be a Python number (got {type(weight)})")
    if type(tensors) not in (list, tuple):
        raise TypeError("foreach.lerp: tensors must be a list or tuple of GPU arrays")
    if out is None:
        if not tensors:
            return []
        plan, s = resolve("foreach.lerp", ["tensors"], [tensors], 0, stream=stream)
        with _launch.ensure_device(plan.device):
            out = _alloc_like("foreach.lerp", tensors, plan, s, stream)
        fresh = True
    else:
        fresh = False
    plan, s = resolve("foreach.lerp", ["out", "tensors", "ends"], [out, tensors, ends], 1,
                      stream=stream, free=(0,) if fresh else ())
    if plan is None:  # empty lists (of equal lengths): nothing to compute, as add and mul
        return out
    with _launch.ensure_device(plan.device):
        P.launch(plan, _ew_kernel("lerp", False), _args((weight,)), s)
    return _finish_list(plan, out, s) if fresh else out


@_fill_doc
def copy_(dst, src, *, stream=None):
    """Copy a list into another, converting dtypes: ``dst[i][...] = src[i]``.

    Any combination of float16, bfloat16, float32 and float64 (values go through float64,
    then are rounded to ``dst[i]``'s dtype), in one launch per pair of dtypes.

    Parameters
    ----------
    dst : list or tuple of GPU arrays
        Written: float16, bfloat16, float32 or float64, C-contiguous.
    src : list or tuple of GPU arrays
        Read: the length of ``dst``, ``src[i]`` of the shape of ``dst[i]`` and any of the
        four dtypes.
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    TypeError
        {list_type_errors}
    ValueError
        {list_value_errors}
    {runtime_errors}

    Notes
    -----
    {launch_notes}
    """
    plan, s = resolve("foreach.copy_", ["dst", "src"], [dst, src], 1, same_dtype=(), stream=stream)
    if plan is not None:
        with _launch.ensure_device(plan.device):
            P.launch(plan, lambda sig: P.kernel("foreach", P.copy_name(sig[0], sig[1])),
                     P.NO_ARGS, s)


@_fill_doc
def zero_(tensors, *, stream=None):
    """Set every element of every array of a list to zero, in place: ``tensors[i][...] = 0``.

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        Written: float16, bfloat16, float32 or float64, C-contiguous, any shapes.
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    TypeError
        {list_type_errors}
    ValueError
        {list_value_errors}
    {runtime_errors}

    Notes
    -----
    {launch_notes}
    """
    plan, s = resolve("foreach.zero_", ["tensors"], [tensors], 1, stream=stream)
    if plan is not None:
        with _launch.ensure_device(plan.device):
            P.launch(plan, _ew_kernel("zero", True), P.NO_ARGS, s)


_SUMSQ_FMTS = ("Q", "Q", "q", "Q")
_FINISH_FMTS = ("Q", "i", "Q", "i", "Q", "Q", "Q", "d", "d")


def _norm_launch(plan, s, per_tensor_ptr, total_ptr, coef_ptr, max_norm=0.0, eps=0.0):
    base, _ = plan.workspace()
    for g in plan.groups:
        if g.nblocks:
            k = P.kernel("norm", f"cl::mt::mt_sumsq<{P.CT[g.sig[0]]}>", _SUMSQ_FMTS)
            P.run_kernel(k, plan, g.nblocks, P.BLOCK, s,
                         (g.tab_ptr, g.map_ptr, plan.chunk, base + 8 * g.first))
    o = "double" if all(g.sig[0] == "float64" for g in plan.groups) else "float"
    k = P.kernel("norm", f"cl::mt::mt_norm_finish<{o}>", _FINISH_FMTS)
    P.run_kernel(k, plan, 1, 1024, s, (base, plan.nblocks, plan.tb_ptr, plan.n,
                                       per_tensor_ptr, total_ptr, coef_ptr,
                                       float(max_norm), float(eps)))
    return o


def _result_dtype(plan):
    from .. import _dtypes  # noqa: PLC0415

    return _dtypes.from_name("float64" if all(g.sig[0] == "float64" for g in plan.groups)
                             else "float32")


def _new(plan, shape, dt, s, stream):
    """A new result array; ``s`` the launch stream, ``stream`` the call's ``stream=``."""
    kind = plan.kind if plan.kind in ("torch", "cupy") else "cupy"
    return allocate(kind, shape, dt, plan.device, None if stream is None else s)


@_fill_doc
def norm(tensors, *, stream=None):
    """The L2 norm of all the arrays together, ``sqrt(sum_i sum(tensors[i] ** 2))``.

    One launch per dtype group (each block a chunk's sum of squares, accumulated in float32
    for 16-bit and float32 arrays, float64 for float64) and one small finishing kernel that
    adds the partial sums in float64 in a fixed order (deterministic run to run). The result
    stays on the device: nothing synchronises the host.

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        Read only (JAX arrays are fine): float16, bfloat16, float32 or float64, mixed dtypes
        allowed, C-contiguous, any shapes. Empty arrays count as zero.
    {stream_param}

    Returns
    -------
    array
        A new 0-d array, float32 (float64 when every array is float64), in the inputs'
        framework: a torch tensor for torch, a CuPy array for CuPy and for other CUDA Array
        Interface or DLPack producers, wrapped back (zero-copy) for JAX and Numba.

    Raises
    ------
    TypeError
        {list_type_errors}
    ValueError
        An empty list (there is no device to put a zero on).
        {list_value_errors}
    {runtime_errors}

    Notes
    -----
    {launch_notes}

    The result array is allocated on every call (inside a CUDA graph capture, under the
    capture's allocator rules: see :class:`cupylab.Graph`).
    """
    plan, s = resolve("foreach.norm", ["tensors"], [tensors], 0, stream=stream)
    if plan is None:
        raise ValueError("foreach.norm: tensors is empty")
    with _launch.ensure_device(plan.device):
        out = _new(plan, (), _result_dtype(plan), s, stream)
        ptr = _arrays.as_view(out).ptr
        _norm_launch(plan, s, 0, ptr, 0)
    return finish_output(plan.kind, out, s, plan.device) if plan.kind not in ("torch", "cupy") \
        else out


@_fill_doc
def norms(tensors, *, stream=None):
    """The L2 norm of each array, as one 1-D device array.

    ``out[i] = sqrt(sum(tensors[i] ** 2))``, computed like :func:`norm` (per-chunk sums of
    squares, then a fixed-order float64 sum per array): deterministic, no host
    synchronisation.

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        Read only (JAX arrays are fine): float16, bfloat16, float32 or float64, mixed dtypes
        allowed, C-contiguous, any shapes. An empty array has norm 0.
    {stream_param}

    Returns
    -------
    array
        A new 1-D array of ``len(tensors)`` values, float32 (float64 when every array is
        float64), in the inputs' framework as for :func:`norm`.

    Raises
    ------
    TypeError
        {list_type_errors}
    ValueError
        An empty list.
        {list_value_errors}
    {runtime_errors}

    Notes
    -----
    {launch_notes}

    The result array is allocated on every call, as in :func:`norm`.
    """
    plan, s = resolve("foreach.norms", ["tensors"], [tensors], 0, stream=stream)
    if plan is None:
        raise ValueError("foreach.norms: tensors is empty")
    with _launch.ensure_device(plan.device):
        out = _new(plan, (plan.n,), _result_dtype(plan), s, stream)
        _norm_launch(plan, s, _arrays.as_view(out).ptr, 0, 0)
    return finish_output(plan.kind, out, s, plan.device) if plan.kind not in ("torch", "cupy") \
        else out


@_fill_doc
def clip_by_global_norm_(tensors, max_norm, *, eps=1e-6, stream=None):
    """Scale the arrays in place so that their global L2 norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_`` (L2, ``error_if_nonfinite=False``): every array is
    multiplied by ``min(1, max_norm / (norm + eps))``, with ``norm`` the global L2 norm
    computed as by :func:`norm` and the factor computed in float64. The norm, the factor
    and the scaling run on the device, in one launch per dtype group for the norm, one
    finishing launch and one scaling launch per dtype group, with no host round trip; the
    scaling blocks return at once when the factor is 1. As in torch, a NaN norm gives a NaN
    factor and an infinite norm a factor of 0 (the arrays then hold NaN or 0).

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        Written in place: float16, bfloat16, float32 or float64, mixed dtypes allowed,
        C-contiguous, any shapes.
    max_norm : int or float
        A Python number (``bool`` and NumPy scalars other than ``numpy.float64`` are
        refused). Not checked further: a negative value gives a negative factor, ``inf``
        leaves the arrays unchanged.
    eps : int or float, default 1e-6
        Added to the norm before the division: a finite Python number >= 0 (``bool`` and
        NumPy scalars other than ``numpy.float64`` are refused).
    {stream_param}

    Returns
    -------
    array
        The global norm before clipping: a new 0-d array, float32 (float64 when every array
        is float64), in the inputs' framework as for :func:`norm`.

    Raises
    ------
    TypeError
        ``max_norm`` or ``eps`` not a Python number (checked first).
        {list_type_errors}
    ValueError
        ``eps`` negative or not finite (checked first); an empty list.
        {list_value_errors}
    OverflowError
        A Python ``int`` ``max_norm`` too large for a float64.
    {runtime_errors}

    Notes
    -----
    {launch_notes}

    The returned norm is allocated on every call, as in :func:`norm`.
    """
    if not _is_scalar(max_norm):
        raise TypeError(f"foreach.clip_by_global_norm_: max_norm must be a number (got {max_norm!r})")
    if not _is_scalar(eps):
        raise TypeError(f"foreach.clip_by_global_norm_: eps must be a Python number "
                        f"(got {eps!r})")
    # ValueError for inf, NaN and an int too large for a float64; then the sign
    if real_value("foreach.clip_by_global_norm_", "eps", eps, "a finite number >= 0") < 0:
        raise ValueError(f"foreach.clip_by_global_norm_: eps must be a finite number >= 0 "
                         f"(got {eps!r})")
    plan, s = resolve("foreach.clip_by_global_norm_", ["tensors"], [tensors], 1, stream=stream)
    if plan is None:
        raise ValueError("foreach.clip_by_global_norm_: tensors is empty")
    with _launch.ensure_device(plan.device):
        out = _new(plan, (), _result_dtype(plan), s, stream)
        _, coef = plan.workspace()
        _norm_launch(plan, s, 0, _arrays.as_view(out).ptr, coef, max_norm, eps)
        P.launch(plan, _ew_kernel("mul_scalar", True), _args((0.0, 1.0, 1.0), (coef,)), s)
    return finish_output(plan.kind, out, s, plan.device) if plan.kind not in ("torch", "cupy") \
        else out


def _found_inf(opname, plan, found_inf, s, stream):
    """``(found_inf, its address)``: the caller's flag, or a new one zeroed on the launch
    stream ``s`` (``stream``: the call's ``stream=``), and zeroed again at every replay when
    the call is prepared. A caller's flag is never zeroed (it accumulates)."""
    if found_inf is None:
        found_inf = _new(plan, (1,), _result_dtype_f32(), s, stream)
        ptr = _arrays.as_view(found_inf).ptr
        P.zero_fill(plan, ptr, 4, s)
        return found_inf, ptr
    return found_inf, device_scalar(opname, "found_inf", found_inf, plan, writable=True,
                                    stream=s)


def _result_dtype_f32():
    from .. import _dtypes  # noqa: PLC0415

    return _dtypes.from_name("float32")


@_fill_doc
def nonfinite_check(tensors, found_inf=None, *, stream=None):
    """Flag on the device whether any element of the arrays is inf or NaN.

    Sets ``found_inf`` to 1 when some element is not finite and leaves it as it was
    otherwise, so several lists (or calls) can share one flag; nothing else is written and
    the host is not synchronised.

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        Read only (JAX arrays are fine): float16, bfloat16, float32 or float64, mixed dtypes
        allowed, C-contiguous, any shapes.
    found_inf : one-element float32 GPU array, optional
        The flag: writable, on the arrays' GPU, any framework. Default: a new one, zeroed on
        the launch stream.
    {stream_param}

    Returns
    -------
    array or None
        ``found_inf``: the array given, or the new one of shape ``(1,)`` (a torch tensor for
        torch inputs, a CuPy array for every other kind, JAX and Numba included). An empty
        ``tensors`` returns ``found_inf`` as given (``None`` when not given) and checks
        nothing.

    Raises
    ------
    TypeError
        A ``found_inf`` that is not a one-element float32 GPU array.
        {list_type_errors}
    ValueError
        A read-only ``found_inf``, or one on another GPU than the arrays.
        {list_value_errors}
    {runtime_errors}

    Notes
    -----
    {launch_notes}

    Under :func:`prepare` a new flag is allocated once, when the call is prepared, and
    zeroed on the launch stream before the check at every replay (a memset, which a CUDA
    graph capture of the replay records too), so that each replay reports its own arrays,
    as a new call would. A flag passed in is never zeroed, prepared or not: it keeps
    accumulating.
    """
    plan, s = resolve("foreach.nonfinite_check", ["tensors"], [tensors], 0, stream=stream)
    if plan is None:
        return found_inf
    with _launch.ensure_device(plan.device):
        found_inf, fptr = _found_inf("foreach.nonfinite_check", plan, found_inf, s, stream)
        P.launch(plan, lambda sig: P.kernel("foreach", P.unscale_name(sig[0], True)),
                 _args((1.0,), (0, 0, fptr)), s)
    return found_inf


@_fill_doc
def unscale_(tensors, inv_scale, found_inf=None, *, stream=None):
    """Mixed-precision gradient unscaling, in place, with a non-finite check.

    ``tensors[i] *= inv_scale``, and ``found_inf`` set to 1 when any element was inf or NaN
    before the scaling (left as it was otherwise), as torch's
    ``_amp_foreach_non_finite_check_and_unscale_``. No host synchronisation.

    Parameters
    ----------
    tensors : list or tuple of GPU arrays
        Written in place: float16, bfloat16, float32 or float64, mixed dtypes allowed,
        C-contiguous, any shapes.
    inv_scale : int, float or one-element float32 GPU array
        The factor: a finite Python number, or a one-element float32 array on the arrays'
        GPU, read by the kernel (capturable, changeable between graph replays).
    found_inf : one-element float32 GPU array, optional
        The flag: writable, on the arrays' GPU, any framework. Default: a new one, zeroed on
        the launch stream.
    {stream_param}

    Returns
    -------
    array or None
        ``found_inf``: the array given, or the new one (a torch tensor for torch inputs, a
        CuPy array otherwise). An empty ``tensors`` returns ``found_inf`` as given
        (``None`` when not given) and checks neither ``inv_scale`` nor ``found_inf``.

    Raises
    ------
    TypeError
        An ``inv_scale`` that is neither a Python number nor a one-element float32 GPU
        array (``bool``, NumPy scalars other than ``numpy.float64`` and host data are
        refused); a ``found_inf`` that is not a one-element float32 GPU array.
        {list_type_errors}
    ValueError
        A non-finite number ``inv_scale``; a read-only ``found_inf``; ``inv_scale`` or
        ``found_inf`` on another GPU than the arrays.
        {list_value_errors}
    {runtime_errors}

    Notes
    -----
    {launch_notes}

    Under :func:`prepare` a new flag is allocated once, when the call is prepared, and
    zeroed on the launch stream before the check at every replay (a memset, which a CUDA
    graph capture of the replay records too), so that each replay reports its own arrays,
    as a new call would. A flag passed in is never zeroed, prepared or not: it keeps
    accumulating.
    """
    plan, s = resolve("foreach.unscale_", ["tensors"], [tensors], 1, stream=stream)
    if plan is None:
        return found_inf
    with _launch.ensure_device(plan.device):
        val, iptr = _scalar_or_device("foreach.unscale_", "inv_scale", inv_scale, plan, s)
        found_inf, fptr = _found_inf("foreach.unscale_", plan, found_inf, s, stream)
        P.launch(plan, lambda sig: P.kernel("foreach", P.unscale_name(sig[0], False)),
                 _args((val,), (iptr, 0, fptr)), s)
    return found_inf


# -- prepared calls: the host work of a hot loop down to the launches -------------------------
class PreparedForeach:
    """A multi-tensor call validated, packed and frozen once (see :func:`prepare`).

    Calling it replays the recorded launches, with the same arguments, on the caller's current
    stream at call time (or the ``stream`` fixed at prepare time), and returns what the
    prepared call returned (its output arrays, norm, ``found_inf``...).

    Made only by :func:`prepare`; the constructor is internal. Calling it takes no
    arguments (see :meth:`__call__`).

    Attributes
    ----------
    result : object
        What the prepared call returned when it was prepared (``None`` for the in-place
        operators and the optimizer steps); every replay returns this same object.
    """

    __slots__ = ("_launches", "_stream", "result", "_keep")

    def __init__(self, launches, stream, result, keep):
        self._launches = tuple(launches)
        self._stream = stream
        self.result = result
        self._keep = keep

    def __call__(self):
        """Replay the recorded launches.

        They go to the ``stream`` fixed by :func:`prepare`, else to the current stream of the
        prepared arrays' framework on their GPU (made current for the launches). Nothing is
        checked or allocated, and the host is not synchronised.

        Returns
        -------
        object
            :attr:`result`: the same object at every replay (output lists, a norm array and
            ``found_inf`` are overwritten in place by each replay).
        """
        launches = self._launches
        if launches:
            _, device, _, _, _, kind = launches[0]
            with _launch.ensure_device(device):
                s = self._stream if self._stream is not None else _launch.current_stream(
                    kind, device)
                for k, dev, grid, block, args, _ in launches:
                    k.launch(dev, grid, block, s, args)
        return self.result

    def __repr__(self):
        return f"<cupylab prepared multi-tensor call, {len(self._launches)} launch(es)>"


#: What :func:`prepare` takes: the public operators of cupylab.foreach and the steps of
#: cupylab.optim, by module.
_PREPARABLE = (("foreach", ("add", "add_", "axpy_", "mul", "mul_", "scale_", "lerp", "lerp_",
                            "copy_", "zero_", "norm", "norms", "clip_by_global_norm_",
                            "nonfinite_check", "unscale_")),
               ("optim", ("adam_", "adamw_", "sgd_", "lion_", "increment_step_")))
_preparable_fns = None


def _preparable():
    """The functions of :data:`_PREPARABLE` (looked up at the first call: cupylab.optim
    imports this module)."""
    global _preparable_fns
    if _preparable_fns is None:
        from .. import optim  # noqa: PLC0415

        mods = {"foreach": sys.modules[__name__], "optim": optim}
        _preparable_fns = tuple(getattr(mods[m], n) for m, names in _PREPARABLE for n in names)
    return _preparable_fns


def prepare(fn, *args, stream=None, **kwargs):
    """Validate a foreach or optimizer call once; return a callable that only launches.

    ``call = cupylab.foreach.prepare(cupylab.foreach.add_, xs, ys, alpha=0.5)`` then
    ``call()`` in the loop: no per-array host work at all (one launch per dtype group; the
    host cost does not depend on the number of arrays). Everything is validated here, nothing
    runs here except allocations the call makes (outputs, a zeroed ``found_inf``) and the
    upload of the launch tables, which this function waits for (once, on the host), since the
    replays may run on any stream. A ``found_inf`` flag the call allocates is zeroed again at
    every replay, before the launches (see :func:`nonfinite_check`).

    Host scalars are frozen into the launch (``alpha``, ``lr``, an integer ``step``...): pass
    one-element float32 GPU arrays for values that change between calls (``lr``, ``step``,
    ``found_inf``, ``inv_scale``) and advance a device step with
    :func:`cupylab.optim.increment_step_` (which can be prepared too).

    Parameters
    ----------
    fn : callable
        A public function of :mod:`cupylab.foreach` (other than ``prepare``) or of
        :mod:`cupylab.optim`: ``add``, ``add_``, ``axpy_``, ``mul``, ``mul_``, ``scale_``,
        ``lerp``, ``lerp_``, ``copy_``, ``zero_``, ``norm``, ``norms``,
        ``clip_by_global_norm_``, ``nonfinite_check``, ``unscale_``, ``adam_``, ``adamw_``,
        ``sgd_``, ``lion_`` or ``increment_step_``.
    *args, **kwargs
        Its arguments (``stream`` excepted: pass it to ``prepare``). The arrays must stay
        alive and keep their storage while the prepared call is used (it holds references
        to them).
    stream : int or stream object, optional
        Fix the launch stream instead of following the caller's current one; the call is
        also prepared on it. The launch tables come from the memory pool of the stream the
        call is prepared on; a prepared call replayed on other streams must be dropped only
        once those replays have finished (after a synchronisation), or its tables' memory
        could be handed out again under them.

    Returns
    -------
    PreparedForeach
        Call it (no arguments) to replay; ``.result`` is what ``fn`` returned here.

    Raises
    ------
    TypeError
        ``fn`` is not one of those functions (decided by identity: a wrapper of one of them,
        a private helper or :class:`PreparedForeach` is refused).
    RuntimeError
        ``prepare`` called while another ``prepare`` runs in the same thread (from ``fn``).
    Exception
        Whatever ``fn`` raises for these arguments (nothing is then recorded).
    """
    if not any(fn is f for f in _preparable()):
        raise TypeError(f"prepare: {getattr(fn, '__name__', fn)!r} is not a cupylab.foreach "
                        "or cupylab.optim function that can be prepared (one of "
                        + ", ".join(f"{m}.{n}" for m, names in _PREPARABLE for n in names) + ")")
    with P.record() as rec:
        result = fn(*args, stream=stream, **kwargs)
    fixed = None
    if stream is not None:
        fixed = _launch.resolve_stream(stream)
    if rec.launches:
        # the call's tables were uploaded on its stream; the replays may run on another
        _, device, _, _, _, kind = rec.launches[0]
        with _launch.ensure_device(device):
            s = fixed if fixed is not None else _launch.current_stream(kind, device)
            _runtime.cupy().cuda.runtime.streamSynchronize(s)
    # the arrays, and the plans whose tables and workspace the recorded arguments point into
    return PreparedForeach(rec.launches, fixed, result, (args, kwargs, rec.plans))
