"""The foreach reductions and mixed-precision checks, one launch per dtype group.

:func:`norm`, :func:`norms` and :func:`clip_by_global_norm_` (per-chunk sums of squares and a
fixed-order finishing kernel, results left on the device), :func:`nonfinite_check` and
:func:`unscale_` (a ``found_inf`` flag set on the device), re-exported by
:mod:`cupylab.ops.multi_tensor`. The rules they share are in that module's docstring; their
argument checks are in :mod:`cupylab.ops._mt_core`.
"""
from __future__ import annotations

from .. import _arrays, _launch
from .._elementwise_core import finish_output, real_value
from . import _mt_plan as P
from ._mt_core import (_args, _ew_kernel, _fill_doc, _is_scalar, _new, _scalar_or_device,
                       device_scalar, resolve)

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

    {prepared_flag_note}
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

    {prepared_flag_note}
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
