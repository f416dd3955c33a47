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

__all__ = ["REFERENCES", "reference", "TOLERANCES", "tolerance", "MAGNITUDES"]


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


# ======================================================================================

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
# ============================================================================================
# Row-wise operators (issue 15): float64 references over the last axis. Inputs are NumPy
# arrays of any float dtype; results are float64. Semantics match the kernels (and torch):
# softmax of a row of -inf only is NaN, layer_norm uses the biased variance.
def _softmax_rows(x):
    x = _f(x)
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.max(x, axis=-1, keepdims=True)
        e = np.exp(x - m)
        return e / np.sum(e, axis=-1, keepdims=True)


def _log_softmax_rows(x):
    x = _f(x)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = np.max(x, axis=-1, keepdims=True)
        return (x - m) - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def _rms_norm_rows(x, weight=None, eps=1e-6):
    x = _f(x)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    y = x * rstd
    return (y * _f(weight) if weight is not None else y), rstd[..., 0]


def _layer_norm_rows(x, weight=None, bias=None, eps=1e-5):
    x = _f(x)
    mean = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    y = (x - mean) * rstd
    if weight is not None:
        y = y * _f(weight)
    if bias is not None:
        y = y + _f(bias)
    return y, mean[..., 0], rstd[..., 0]


def _cross_entropy_rows(logits, target, ignore_index=-100, label_smoothing=0.0):
    """Per-row loss, logsumexp and the per-row gradient of the loss (float64)."""
    x = _f(logits)
    t = np.asarray(target).astype(np.int64)
    n = x.shape[-1]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = np.max(x, axis=-1, keepdims=True)
        lse = (m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True)))[..., 0]
        ignored = t == ignore_index
        bad = ~ignored & ((t < 0) | (t >= n))
        tc = np.where(ignored | bad, 0, t)
        xt = np.take_along_axis(x, tc[..., None], axis=-1)[..., 0]
        s = label_smoothing
        loss = lse - xt
        if s:  # without smoothing the row's mean is not a term (0 * inf would be NaN)
            loss = (1 - s) * loss + s * (lse - np.mean(x, axis=-1))
        loss = np.where(ignored, 0.0, np.where(bad, np.nan, loss))
        grad = np.exp(x - lse[..., None]) - s / n
        onehot = np.zeros_like(x)
        np.put_along_axis(onehot, tc[..., None], 1.0, axis=-1)
        grad = grad - (1 - s) * onehot
        grad = np.where(ignored[..., None], 0.0, np.where(bad[..., None], np.nan, grad))
    return loss, lse, grad


def _softmax_backward_rows(y, dy):
    y, dy = _f(y), _f(dy)
    return y * (dy - np.sum(y * dy, axis=-1, keepdims=True))


def _log_softmax_backward_rows(y, dy):
    y, dy = _f(y), _f(dy)
    return dy - np.exp(y) * np.sum(dy, axis=-1, keepdims=True)


def _layer_norm_backward_rows(dy, x, weight, mean, rstd):
    dy, x = _f(dy), _f(x)
    xh = (x - _f(mean)[..., None]) * _f(rstd)[..., None]
    g = dy * (_f(weight) if weight is not None else 1.0)
    r = _f(rstd)[..., None]
    dx = r * (g - np.mean(g, axis=-1, keepdims=True) - xh * np.mean(g * xh, axis=-1,
                                                                   keepdims=True))
    lead = tuple(range(x.ndim - 1))
    return dx, np.sum(dy * xh, axis=lead), np.sum(dy, axis=lead)


def _rms_norm_backward_rows(dy, x, weight, rstd):
    dy, x = _f(dy), _f(x)
    r = _f(rstd)[..., None]
    xh = x * r
    g = dy * (_f(weight) if weight is not None else 1.0)
    dx = r * (g - xh * np.mean(g * xh, axis=-1, keepdims=True))
    return dx, np.sum(dy * xh, axis=tuple(range(x.ndim - 1)))


def bench_vector(cols, bias=False):
    """The weight (``bias=False``: 0.5 to 1.5) or bias (-0.625 to 0.625) of the weighted norm
    cases of cupylab-bench (``rms_norm_w``, ``layer_norm_wb``): multiples of 1/16 and 1/8,
    exact in every float dtype, so that the GPU's copy in x's dtype and this float64 one
    hold the same values. Made from the column index alone, as the sampled rows require."""
    j = np.arange(cols)
    return ((j * 13) % 11 - 5) / 8.0 if bias else 1.0 + ((j * 37) % 17 - 8) / 16.0


ROWWISE_REFERENCES = {
    "softmax": _softmax_rows, "log_softmax": _log_softmax_rows,
    "rms_norm": _rms_norm_rows, "layer_norm": _layer_norm_rows,
    "cross_entropy": _cross_entropy_rows,
    "softmax_backward": _softmax_backward_rows,
    "log_softmax_backward": _log_softmax_backward_rows,
    "layer_norm_backward": _layer_norm_backward_rows,
    "rms_norm_backward": _rms_norm_backward_rows,
}
# Whole-row references of one output, for cupylab-bench (spec.reference "rows:<op>"; the
# inputs arrive as (rows, cols) arrays).
REFERENCES.update({
    "rows:softmax": _softmax_rows, "rows:log_softmax": _log_softmax_rows,
    "rows:rms_norm": lambda x: _rms_norm_rows(x)[0],
    "rows:layer_norm": lambda x: _layer_norm_rows(x)[0],
    "rows:add_rms_norm": lambda x, r: _rms_norm_rows(_f(x) + _f(r))[0],
    "rows:rms_norm_w": lambda x: _rms_norm_rows(x, bench_vector(np.shape(x)[-1]))[0],
    "rows:layer_norm_wb": lambda x: _layer_norm_rows(
        x, bench_vector(np.shape(x)[-1]), bench_vector(np.shape(x)[-1], True))[0],
    "rows:softmax_backward": _softmax_backward_rows,
    "rows:log_softmax_backward": _log_softmax_backward_rows,
    # the norms' backward: dx only (no weight), with the statistics of x at the forward's eps
    "rows:rms_norm_backward": lambda dy, x: _rms_norm_backward_rows(
        dy, x, None, _rms_norm_rows(x)[1])[0],
    "rows:layer_norm_backward": lambda dy, x: _layer_norm_backward_rows(
        dy, x, None, *_layer_norm_rows(x)[1:])[0],
    # dlogits of reduction="sum" (softmax - onehot). A row's target is how many of its logits
    # have the sign bit set, modulo the row length: what the bench case computes on the GPU
    # (cupylab.ops.rowwise._register), from the row alone as the sampled rows require.
    "rows:cross_entropy": lambda x: _cross_entropy_rows(
        x, np.signbit(x).sum(axis=-1) % np.shape(x)[-1])[2],
})
# the same gradient, computed by the backward from the forward's log-sum-exp
REFERENCES["rows:cross_entropy_backward"] = REFERENCES["rows:cross_entropy"]
#: The size of the terms a result is computed from, where it can be far larger than the result
#: (cancellation: dx = y * (dy - s) with dy close to s). A correct float32 kernel's error is a
#: few roundings of these terms, not of the result; cupylab-bench scales its tolerance by them.
MAGNITUDES = {
    "rows:softmax_backward": lambda y, dy: np.abs(_f(y)) * (
        np.abs(_f(dy)) + np.sum(np.abs(_f(y) * _f(dy)), axis=-1, keepdims=True)),
    "rows:log_softmax_backward": lambda y, dy: np.abs(_f(dy)) + np.exp(_f(y)) * np.sum(
        np.abs(_f(dy)), axis=-1, keepdims=True),
}
# ============================================================================================
