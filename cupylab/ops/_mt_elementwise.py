"""The elementwise foreach operators, one launch per dtype group.

:func:`add_`, :func:`add`, :func:`axpy_`, :func:`mul_`, :func:`mul`, :func:`scale_`,
:func:`lerp_`, :func:`lerp`, :func:`copy_` and :func:`zero_`, in place or into output lists,
re-exported by :mod:`cupylab.ops.multi_tensor`. The rules they share are in that module's
docstring; their argument checks are in :mod:`cupylab.ops._mt_core`.
"""
from __future__ import annotations

from .. import _launch
from . import _mt_plan as P
from ._mt_core import (_alloc_like, _args, _ew_kernel, _fill_doc, _finish_list, _is_scalar,
                       device_scalar, resolve)


def _check_alpha(opname, alpha):
    """``alpha`` of add_, add and axpy_: a Python number, as lerp's ``weight``."""
    if not _is_scalar(alpha):
        raise TypeError(f"{opname}: alpha must be a Python number (got {alpha!r})")


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
