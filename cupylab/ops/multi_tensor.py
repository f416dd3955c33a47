"""foreach operators: one launch over lists of arrays of mixed sizes (and dtypes).

Every function takes lists (or tuples) of GPU arrays from one framework (CuPy, torch, JAX
read-only, Numba, CAI, DLPack), validated once per list and then served from the cache of
:mod:`cupylab.ops._mt_plan` (CuPy and torch lists; other frameworks are validated on every
call). Launches go to the caller's current stream (torch's for torch arrays, CuPy's
otherwise) or ``stream=``; nothing synchronises the host, and the norms, the clip factor and
``found_inf`` stay on the device.

Rules for every function: arrays C-contiguous, float16 / bfloat16 / float32 / float64, the
arrays at one position of every list of the same shape and dtype (``copy_`` converts), all on
one device, all from one framework; a written array may be the same array as the one it is
computed from at its own position (in place), and must not overlap any other array of the
call. Empty lists are a no-op; empty arrays are skipped.
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
    """New arrays shaped like ``xs`` for the outputs (see :func:`_new`)."""
    return [_new(plan, v.shape, v.dtype, s, stream)
            for v in (_arrays.as_view(x, f"{opname}: x") for x in xs)]


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


# -- public operators ----------------------------------------------------------------------------
def add_(tensors, other, *, alpha=1.0, stream=None):
    """In place ``tensors[i] += alpha * other[i]`` (``other`` a list) or ``+= other`` (a number).

    Parameters
    ----------
    tensors : list of GPU arrays
        Written in place.
    other : list of GPU arrays or float
        Same length, shapes and dtypes as ``tensors``.
    alpha : float
        Multiplier of ``other`` when it is a list.
    stream : stream, optional
        Launch stream (default: the caller's current stream).

    Raises
    ------
    TypeError
        Not lists, host arrays, unsupported or mismatched dtypes, mixed frameworks.
    ValueError
        Different lengths or shapes, non-contiguous or read-only arrays, overlapping arrays,
        arrays on different GPUs.
    """
    _binary("foreach.add_", tensors, other, None, stream, "add", "add_scalar", alpha)


def add(tensors, other, *, alpha=1.0, out=None, stream=None):
    """``tensors[i] + alpha * other[i]`` (or ``+ other`` for a number) into ``out`` (a list,
    allocated in the caller's framework when not given). Returns the output list. Parameters
    and errors as :func:`add_`; ``out[i]`` may be ``tensors[i]``."""
    return _out_of_place("foreach.add", tensors, other, out, stream, "add", "add_scalar", alpha)


def axpy_(alpha, x, y, *, stream=None):
    """BLAS axpy over lists: ``y[i] += alpha * x[i]`` in one launch; ``x`` a list, or a
    number (then ``y[i] += alpha * x``). See :func:`add_`."""
    if _is_scalar(x):  # a number: alpha * x is the scalar added (alpha was dropped)
        if not _is_scalar(alpha):
            raise TypeError(f"foreach.axpy_: alpha must be a Python number (got {alpha!r})")
        x = alpha * x
    _binary("foreach.axpy_", y, x, None, stream, "add", "add_scalar", alpha)


def mul_(tensors, other, *, stream=None):
    """In place ``tensors[i] *= other[i]`` (a list) or ``*= other`` (a number). See
    :func:`add_` for the rules and errors."""
    _binary("foreach.mul_", tensors, other, None, stream, "mul", "mul_scalar")


def mul(tensors, other, *, out=None, stream=None):
    """``tensors[i] * other[i]`` (or ``* other``) into ``out`` (allocated when not given).
    Returns the output list. See :func:`add_`."""
    return _out_of_place("foreach.mul", tensors, other, out, stream, "mul", "mul_scalar")


def scale_(tensors, factor, *, stream=None):
    """In place ``tensors[i] *= factor``; ``factor`` a number or a one-element float32 GPU
    array read by the kernel (no host synchronisation; CUDA-graph safe). See :func:`add_`."""
    if _is_scalar(factor):
        return mul_(tensors, factor, stream=stream)
    plan, s = resolve("foreach.scale_", ["tensors"], [tensors], 1, stream=stream)
    if plan is None:
        return None
    with _launch.ensure_device(plan.device):
        ptr = device_scalar("foreach.scale_", "factor", factor, plan, stream=s)
        P.launch(plan, _ew_kernel("mul_scalar", True), _args((0.0,), (ptr,)), s)
    return None


def lerp_(tensors, ends, weight, *, stream=None):
    """In place ``tensors[i] += weight * (ends[i] - tensors[i])`` (torch's lerp formula, which
    is exact at ``weight`` 0 and 1). See :func:`add_`."""
    if not _is_scalar(weight):
        raise TypeError(f"foreach.lerp_: weight must be a Python number (got {type(weight)})")
    plan, s = resolve("foreach.lerp_", ["tensors", "ends"], [tensors, ends], 1, stream=stream)
    if plan is not None:
        with _launch.ensure_device(plan.device):
            P.launch(plan, _ew_kernel("lerp", True), _args((weight,)), s)


def lerp(tensors, ends, weight, *, out=None, stream=None):
    """``tensors[i] + weight * (ends[i] - tensors[i])`` into ``out`` (allocated when not
    given). Returns the output list. See :func:`lerp_`."""
    if not _is_scalar(weight):
        raise TypeError(f"foreach.lerp: weight must be a Python number (got {type(weight)})")
    if type(tensors) not in (list, tuple):
        raise TypeError("foreach.lerp: tensors must be a list or tuple of GPU arrays")
    if not tensors:
        return []
    if out is None:
        plan, s = resolve("foreach.lerp", ["tensors"], [tensors], 0, stream=stream)
        with _launch.ensure_device(plan.device):
            out = _alloc_like("foreach.lerp", tensors, plan, s, stream)
        fresh = True
    else:
        fresh = False
    plan, s = resolve("foreach.lerp", ["out", "tensors", "ends"], [out, tensors, ends], 1,
                      stream=stream, free=(0,) if fresh else ())
    with _launch.ensure_device(plan.device):
        P.launch(plan, _ew_kernel("lerp", False), _args((weight,)), s)
    return _finish_list(plan, out, s) if fresh else out


def copy_(dst, src, *, stream=None):
    """``dst[i][...] = src[i]``, converting dtypes (float16, bfloat16, float32, float64 in any
    combination), in one launch per dtype pair. See :func:`add_`."""
    plan, s = resolve("foreach.copy_", ["dst", "src"], [dst, src], 1, same_dtype=(), stream=stream)
    if plan is not None:
        with _launch.ensure_device(plan.device):
            P.launch(plan, lambda sig: P.kernel("foreach", P.copy_name(sig[0], sig[1])),
                     P.NO_ARGS, s)


def zero_(tensors, *, stream=None):
    """``tensors[i][...] = 0`` in one launch per dtype. See :func:`add_`."""
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


def norm(tensors, *, stream=None):
    """The L2 norm of all the arrays together, ``sqrt(sum_i sum(tensors[i] ** 2))``.

    One launch per dtype group (each block a chunk's sum of squares) and one small finishing
    kernel that adds the partial sums in a fixed order (deterministic run to run). The result
    stays on the device: nothing synchronises the host.

    Parameters
    ----------
    tensors : list of GPU arrays
    stream : stream, optional

    Returns
    -------
    array
        0-d float32 (float64 when every array is float64) in the caller's framework (CuPy for
        CAI/DLPack inputs; JAX / Numba wrapped back). Empty list: ``0.0`` on the device of
        nothing is impossible, so an empty list raises.

    Raises
    ------
    ValueError
        Empty list; the rules of :func:`add_`.
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


def norms(tensors, *, stream=None):
    """Per-array L2 norms as one 1-D device array of ``len(tensors)`` values (float32, or
    float64 when every array is float64), computed like :func:`norm` (no host sync)."""
    plan, s = resolve("foreach.norms", ["tensors"], [tensors], 0, stream=stream)
    if plan is None:
        raise ValueError("foreach.norms: tensors is empty")
    with _launch.ensure_device(plan.device):
        out = _new(plan, (plan.n,), _result_dtype(plan), s, stream)
        _norm_launch(plan, s, _arrays.as_view(out).ptr, 0, 0)
    return finish_output(plan.kind, out, s, plan.device) if plan.kind not in ("torch", "cupy") \
        else out


def clip_by_global_norm_(tensors, max_norm, *, eps=1e-6, stream=None):
    """Scale the arrays in place so that their global L2 norm is at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_``): factor ``min(1, max_norm / (norm + eps))``.

    The norm, the factor and the scaling run on the device, in three launches and no host
    round trip (CUDA-graph safe once the list has been seen); the scaling launch returns at
    once when the factor is 1. A non-finite norm gives a NaN factor, as torch does.

    Returns
    -------
    array
        The global norm before clipping (0-d, float32 or float64), on the device.
    """
    if not _is_scalar(max_norm):
        raise TypeError(f"foreach.clip_by_global_norm_: max_norm must be a number (got {max_norm!r})")
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
    stream ``s`` (``stream``: the call's ``stream=``)."""
    if found_inf is None:
        found_inf = _new(plan, (1,), _result_dtype_f32(), s, stream)
        ptr = _arrays.as_view(found_inf).ptr
        _runtime.cupy().cuda.runtime.memsetAsync(ptr, 0, 4, s)
        return found_inf, ptr
    return found_inf, device_scalar(opname, "found_inf", found_inf, plan, writable=True,
                                    stream=s)


def _result_dtype_f32():
    from .. import _dtypes  # noqa: PLC0415

    return _dtypes.from_name("float32")


def nonfinite_check(tensors, found_inf=None, *, stream=None):
    """Set ``found_inf`` (a one-element float32 device array) to 1 when any element of the
    arrays is inf or NaN; it is left as it was otherwise (so several lists can share one flag).
    Allocated zeroed when not given. Returns ``found_inf``; no host synchronisation."""
    plan, s = resolve("foreach.nonfinite_check", ["tensors"], [tensors], 0, stream=stream)
    if plan is None:
        return found_inf
    with _launch.ensure_device(plan.device):
        found_inf, fptr = _found_inf("foreach.nonfinite_check", plan, found_inf, s, stream)
        P.launch(plan, lambda sig: P.kernel("foreach", P.unscale_name(sig[0], True)),
                 _args((1.0,), (0, 0, fptr)), s)
    return found_inf


def unscale_(tensors, inv_scale, found_inf=None, *, stream=None):
    """Mixed-precision gradient unscaling: ``tensors[i] *= inv_scale`` in place and
    ``found_inf = 1`` when any element was inf or NaN before scaling (torch's
    ``_amp_foreach_non_finite_check_and_unscale_``). ``inv_scale``: a number or a one-element
    float32 device array; ``found_inf``: a one-element float32 device array (allocated zeroed
    when not given). Returns ``found_inf``; no host synchronisation."""
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
    prepared call returned (its output arrays, norm, ``found_inf``...)."""

    __slots__ = ("_launches", "_stream", "result", "_keep")

    def __init__(self, launches, stream, result, keep):
        self._launches = tuple(launches)
        self._stream = stream
        self.result = result
        self._keep = keep

    def __call__(self):
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


def prepare(fn, *args, stream=None, **kwargs):
    """Validate a foreach or optimizer call once; return a callable that only launches.

    ``call = cupylab.foreach.prepare(cupylab.foreach.add_, xs, ys, alpha=0.5)`` then
    ``call()`` in the loop: no per-array host work at all (one launch per dtype group; the
    host cost does not depend on the number of arrays). Everything is validated here, nothing
    runs here except allocations the call makes (outputs, a zeroed ``found_inf``) and the
    upload of the launch tables, which this function waits for (once, on the host), since the
    replays may run on any stream.

    Host scalars are frozen into the launch (``alpha``, ``lr``, an integer ``step``...): pass
    one-element float32 GPU arrays for values that change between calls (``lr``, ``step``,
    ``found_inf``, ``inv_scale``) and advance a device step with
    :func:`cupylab.optim.increment_step_` (which can be prepared too).

    Parameters
    ----------
    fn : a function of :mod:`cupylab.foreach` or :mod:`cupylab.optim`
    *args, **kwargs
        Its arguments. The arrays must stay alive and keep their storage while the prepared
        call is used (it holds references to them).
    stream : optional
        Fix the launch stream instead of following the caller's current one. The launch
        tables come from the memory pool of the stream the call is prepared on; a prepared
        call replayed on other streams must be dropped only once those replays have finished
        (after a synchronisation), or its tables' memory could be handed out again under
        them.

    Returns
    -------
    PreparedForeach

    Raises
    ------
    TypeError
        ``fn`` is not a multi-tensor operator; the errors of ``fn`` itself.
    """
    mod = getattr(fn, "__module__", "")
    if mod not in (__name__, "cupylab.optim") or getattr(fn, "__name__", "") in (
            "prepare", "resolve", "device_scalar"):
        raise TypeError(f"prepare: {getattr(fn, '__name__', fn)!r} is not a cupylab.foreach "
                        "or cupylab.optim function")
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
