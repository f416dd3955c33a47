"""Float64 NumPy references for every operator (used by the tests and by cupylab-bench).

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


def _fused_add_mul(a, b, s):
    return (_f(a) + _f(b)) * _f(s)


REFERENCES = {
    "add": _add, "vector_add": _add, "sub": _sub, "mul": _mul, "div": _div,
    "fused_add_mul": _fused_add_mul,
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
}


def tolerance(dtype):
    return TOLERANCES[str(dtype)]
