"""The shared core of the foreach operators (:mod:`cupylab.ops.multi_tensor`).

Argument resolution: a call's lists checked once (frameworks, devices, dtypes, shapes,
contiguity, aliasing) and turned into a launch plan of :mod:`cupylab.ops._mt_plan`, found
again in its cache by :func:`cache_key` (:func:`resolve`); one-element device scalars
(:func:`device_scalar`); the helpers every operator module uses (Python-number checks, the
packed launch arguments, the elementwise kernel names, output allocation); and the docstring
pieces the public operators share (:data:`_DOC_PIECES`, :func:`_fill_doc`), used by
:mod:`cupylab.optim` too. The rules these checks enforce are in the docstring of
:mod:`cupylab.ops.multi_tensor`.
"""
from __future__ import annotations

import sys

from .. import _arrays, _launch, _runtime
from .._elementwise_core import allocate, finish_output, real_value
from . import _mt_plan as P

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
    except (TypeError, AttributeError, RuntimeError):  # not tensors, sparse tensors (no
        return None  # storage): the full path refuses them with the documented errors
    return (writes, ids, ptrs)


def call_key(lists, writes, same_dtype=None, free=()):
    """The plan cache's key of a :func:`resolve` call with these arguments (``None``: not
    cacheable); what a call of an unchanged list reads before its launch that grows with the
    list (the multi-tensor bench times it alone)."""
    if same_dtype is None:
        same_dtype = range(len(lists))
    return cache_key(lists, (writes, tuple(same_dtype), tuple(free)))


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


def _not_a_list(opname, name, lst):
    return TypeError(f"{opname}: {name} must be a list or tuple of GPU arrays "
                     f"(got {type(lst).__module__}.{type(lst).__qualname__})")


def _validate(opname, names, lists, writes, same_dtype, stream, inplace_pairs=(), free=()):
    n, lead = None, None
    for k, lst in enumerate(lists):
        if lst is None:
            continue
        if type(lst) not in (list, tuple):
            raise _not_a_list(opname, names[k], lst)
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
            free=(), optional=()):
    """The plan and stream for one call (validated and built on a cache miss).

    ``lists``: per slot a list of arrays, or ``None`` for a slot in ``optional`` (absent);
    ``writes``: bit mask of written slots; ``same_dtype``: slots whose dtype must equal the
    lead slot's (default: all); ``free``: slots whose arrays may come from another framework
    (outputs allocated here). Returns ``(plan, stream)``, or ``(None, None)`` for empty
    lists."""
    if None in lists:
        for k, lst in enumerate(lists):
            if lst is None and k not in optional:
                raise _not_a_list(opname, names[k], lst)
    if same_dtype is None:
        same_dtype = range(len(lists))
    key = call_key(lists, writes, same_dtype, free)
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


def _scalar_or_device(opname, pname, x, plan, stream=None):
    """(host value, device pointer) for a Python number or a one-element float32 array."""
    if _is_scalar(x):
        return real_value(opname, pname, x, "a finite number"), 0
    return 0.0, device_scalar(opname, pname, x, plan, stream=stream)


_NO_S, _NO_P = (0.0,) * 8, (0,) * 4


def _args(s=(), p=()):
    """The packed ``Args`` of a launch: up to 8 numbers (as floats) and 4 addresses (ints)."""
    return (*map(float, s), *_NO_S[len(s):], *map(int, p), *_NO_P[len(p):])


def _ew_kernel(op, inplace):
    return lambda sig: P.kernel("foreach", P.ew_name(op, sig[0], inplace))


def _new(plan, shape, dt, s, stream):
    """A new result array; ``s`` the launch stream, ``stream`` the call's ``stream=``."""
    kind = plan.kind if plan.kind in ("torch", "cupy") else "cupy"
    return allocate(kind, shape, dt, plan.device, None if stream is None else s)


def _alloc_like(opname, xs, plan, s, stream):
    """New arrays shaped like ``xs`` for the outputs (see :func:`_new`); ``xs`` read as for a
    launch on ``s`` (DLPack producers are told that stream, as when the lists are checked)."""
    return [_new(plan, v.shape, v.dtype, s, stream)
            for v in (_arrays.as_view(x, f"{opname}: x", s) for x in xs)]


def _finish_list(plan, outs, stream):
    if plan.kind in ("torch", "cupy"):
        return outs
    return [finish_output(plan.kind, o, stream, plan.device) for o in outs]


# -- docstrings ----------------------------------------------------------------------------------
# Pieces shared by the docstrings of the public functions (of _mt_elementwise, _mt_reduce and
# cupylab.optim): a line of a docstring that holds only one of these keys is replaced by its
# text, indented like the key.
_DOC_PIECES = {
    "{prepared_flag_note}": """\
Under :func:`prepare` a new flag is allocated once, when the call is prepared, and
zeroed on the launch stream before the check at every replay (a memset, which a CUDA
graph capture of the replay records too), so that each replay reports its own arrays,
as a new call would. A flag passed in is never zeroed, prepared or not: it keeps
accumulating.""",
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
