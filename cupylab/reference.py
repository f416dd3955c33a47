"""Float64 NumPy references for every operator (used by the tests and by cupylab-bench).

``div`` is the bench's division case (floor division for integers, so that the result keeps
the operands' dtype); ``divide``/``true_divide`` is NumPy's true division (float64 for
integers) and ``floor_divide`` NumPy's floor division.

Each reference takes NumPy arrays (any dtype; they are computed in float64, or exactly in
int64 for integers) and returns the float64/int64 result the kernel must match within the
dtype's tolerance.
"""
from __future__ import annotations

import numpy as np

__all__ = ["REFERENCES", "reference", "TOLERANCES", "tolerance"]


def _f(x):
    x = np.asarray(x)
    return x.astype(np.int64) if x.dtype.kind in "iu" else x.astype(np.float64)


def _add(x, y):
    return _f(x) + _f(y)


def _sub(x, y):
    return _f(x) - _f(y)


def _mul(x, y):
    return _f(x) * _f(y)


def _div(x, y):
    x, y = _f(x), _f(y)
    if x.dtype.kind == "i":
        with np.errstate(divide="ignore", over="ignore"):
            return np.floor_divide(x, y)
    with np.errstate(divide="ignore", invalid="ignore"):
        return x / y


def _true_div(x, y):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(x, np.float64) / np.asarray(y, np.float64)


def _floor_div(x, y):
    x, y = _f(x), _f(y)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return np.floor_divide(x, y)


def _fused_add_mul(a, b, s):
    return (_f(a) + _f(b)) * _f(s)


REFERENCES = {
    "add": _add, "vector_add": _add, "sub": _sub, "mul": _mul, "div": _div,
    "fused_add_mul": _fused_add_mul, "subtract": _sub, "multiply": _mul, "divide": _true_div,
    "true_divide": _true_div, "floor_divide": _floor_div,
}


def reference(op, *args, dtype=None):
    """The float64 (or int64) reference of ``op`` on host arrays; integer results are wrapped
    to ``dtype``'s width when given."""
    r = REFERENCES[op](*args)
    if dtype is not None and np.asarray(r).dtype.kind == "i":
        r = np.asarray(r).astype(dtype).astype(np.int64)
    return r


#: (rtol, atol) per dtype for one rounding of the result (and of the inputs' conversion).
TOLERANCES = {
    "float16": (1e-3, 1e-3),
    "bfloat16": (8e-3, 8e-3),
    "float32": (1e-6, 1e-6),
    "float64": (1e-13, 1e-13),
    "int32": (0, 0),
    "int64": (0, 0),
    "complex64": (1e-6, 1e-6),
    "complex128": (1e-13, 1e-13),
}


def tolerance(dtype):
    return TOLERANCES[str(dtype)]
