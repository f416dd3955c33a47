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


# =============================================================================================
# Multi-tensor operators and optimizers (cupylab.foreach, cupylab.optim): float64 references on
# lists of NumPy arrays. Each returns new float64 arrays; nothing is modified.
# =============================================================================================
def foreach_add(xs, other, alpha=1.0):
    if isinstance(other, (list, tuple)):
        return [_f(x) + alpha * _f(y) for x, y in zip(xs, other)]
    return [_f(x) + other for x in xs]


def foreach_mul(xs, other):
    if isinstance(other, (list, tuple)):
        return [_f(x) * _f(y) for x, y in zip(xs, other)]
    return [_f(x) * other for x in xs]


def foreach_lerp(xs, ends, weight):
    return [_f(x) + weight * (_f(e) - _f(x)) for x, e in zip(xs, ends)]


def per_tensor_norms(xs):
    return np.array([np.sqrt(np.sum(_f(x) ** 2)) for x in xs])


def global_norm(xs):
    return float(np.sqrt(sum(np.sum(_f(x) ** 2) for x in xs)))


def clip_by_global_norm(xs, max_norm, eps=1e-6):
    """``(clipped arrays, norm before clipping)`` as torch.nn.utils.clip_grad_norm_."""
    total = global_norm(xs)
    c = min(1.0, max_norm / (total + eps))
    return [_f(x) * c for x in xs], total


def unscale(xs, inv_scale):
    """``(scaled arrays, found_inf)``."""
    bad = any(not np.all(np.isfinite(_f(x))) for x in xs)
    return [_f(x) * inv_scale for x in xs], bad


def adam_step(p, g, m, v, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
              adamw=False, maximize=False):
    """One Adam / AdamW step on one array: returns ``(p, m, v)`` in float64."""
    p, g, m, v = _f(p), _f(g), _f(m), _f(v)
    if maximize:
        g = -g
    if weight_decay:
        if adamw:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    p = p - (lr / bc1) * m / (np.sqrt(v) / np.sqrt(bc2) + eps)
    return p, m, v


def sgd_step(p, g, buf, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
             maximize=False, first_step=False):
    """One SGD step on one array: returns ``(p, buf)`` (``buf`` None without momentum)."""
    p, g = _f(p), _f(g)
    if maximize:
        g = -g
    if weight_decay:
        g = g + weight_decay * p
    if momentum:
        buf = g.copy() if first_step else momentum * _f(buf) + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, buf


def lion_step(p, g, m, *, lr, beta1=0.9, beta2=0.99, weight_decay=0.0, maximize=False):
    """One Lion step on one array: returns ``(p, m)``."""
    p, g, m = _f(p), _f(g), _f(m)
    if maximize:
        g = -g
    u = np.sign(beta1 * m + (1 - beta1) * g)
    p = p * (1 - lr * weight_decay) - lr * u
    m = beta2 * m + (1 - beta2) * g
    return p, m
