"""The kernels behind cupylab's torch operators: torch tensors in, cupylab launches on torch's
current stream, torch tensors (allocated by torch) out.

Each function here is the real implementation of the registered operator of the same name
(``torch.ops.cupylab.<name>``, :mod:`cupylab.torch._library`) and what the eager
``torch.autograd.Function`` path calls directly (:mod:`cupylab.torch._autograd`): one body for
both. They take tensors that may require grad (cupylab refuses those, so they are detached
here: a view, no copy) and return new C-contiguous tensors, except where a docstring says
otherwise; the fake implementations in :mod:`cupylab.torch._library` mirror every shape,
dtype and stride.

Row-wise tensors of more than three dimensions that are not contiguous are made contiguous
first: cupylab's row kernels take any strides whose leading dimensions merge into two strided
levels, which up to two leading dimensions always do.
"""

import torch

import cupylab

__all__ = ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "rms_norm",
           "rms_norm_backward", "layer_norm", "layer_norm_backward", "add_rms_norm",
           "add_rms_norm_", "add_rms_norm_mixed", "add_rms_norm_mixed_backward",
           "cross_entropy", "cross_entropy_loss", "cross_entropy_backward",
           "add", "subtract",
           "multiply", "divide", "fused_add_mul", "fused_add_mul_scalar"]


_TENSOR = torch.Tensor


def _d(t):
    """``t`` without autograd history (a view sharing memory) and as a plain tensor (a frozen
    ``Parameter`` detached: the lean launch paths take plain tensors only), or ``t`` / None
    as given."""
    return t.detach() if t is not None and (t.requires_grad or type(t) is not _TENSOR) else t


def _rows(t):
    """``t`` detached, and contiguous when its leading dimensions might not merge into two
    strided levels (more than three dimensions and not contiguous)."""
    if t.requires_grad:
        t = t.detach()
    return t if t.dim() <= 3 or t.is_contiguous() else t.contiguous()


def _vec(t):
    """A weight or bias: detached and contiguous (cupylab reads it as one contiguous vector);
    None stays None. A frozen ``Parameter`` (no grad) is detached too: the lean launch path
    takes plain tensors only."""
    if t is None:
        return None
    if t.requires_grad or type(t) is not _TENSOR:
        t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def _none_to_empty(t, like):
    """The registered operators return tensors only: an absent gradient is a (0,)-shaped
    tensor."""
    return like.new_empty((0,)) if t is None else t


def acc_dtype(dt):
    """The dtype of the statistics and sums for data of ``dt``: float64 for float64, else
    float32 (cupylab's rule, :func:`cupylab.ops._rowcore.acc_dtype`)."""
    return torch.float64 if dt == torch.float64 else torch.float32


# -- softmax ----------------------------------------------------------------------------------
def softmax(x, dim):
    """softmax of ``x`` along ``dim`` (any dim: the last one is the fast path)."""
    return cupylab.softmax(_rows(x), axis=dim)


def log_softmax(x, dim):
    """log_softmax of ``x`` along ``dim``."""
    return cupylab.log_softmax(_rows(x), axis=dim)


def _softmax_bwd(fn, y, dy, dim):
    y, dy = _d(y).contiguous(), _d(dy).contiguous()  # no copies in the usual case
    nd = y.dim()
    dim = dim % nd
    if dim == nd - 1:
        return fn(y, dy)
    # the gradient along another dim: the same kernel over moved views (y and dy contiguous,
    # so the dims before and after ``dim`` merge into two strided levels); the result is the
    # kernel's C-contiguous output moved back (a view, not contiguous)
    return fn(y.movedim(dim, -1), dy.movedim(dim, -1)).movedim(-1, dim)


def softmax_backward(y, dy, dim):
    """Input gradient of softmax from its output ``y`` and the output gradient ``dy``. For a
    ``dim`` other than the last the result is a view of a contiguous tensor whose last axis is
    ``dim`` (``empty(moved shape).movedim(-1, dim)``)."""
    return _softmax_bwd(cupylab.softmax_backward, y, dy, dim)


def log_softmax_backward(y, dy, dim):
    """Input gradient of log_softmax from its output ``y``; strides as
    :func:`softmax_backward`."""
    return _softmax_bwd(cupylab.log_softmax_backward, y, dy, dim)


# -- norms ------------------------------------------------------------------------------------
def rms_norm(x, weight, eps, stats=True):
    """``(y, rstd)`` over the last axis; ``rstd`` float32 of shape ``x.shape[:-1]`` (float64
    for float64 x). ``stats=False`` (the no-grad path): ``y`` alone."""
    return cupylab.rms_norm(_rows(x), _vec(weight), eps, return_stats=stats)


def rms_norm_backward(dy, x, weight, rstd, weight_grad=True):
    """``(dx, dweight)``; ``dweight`` is a (0,)-shaped tensor without a weight or with
    ``weight_grad=False`` (then not computed)."""
    dx, dw = cupylab.rms_norm_backward(_d(dy).contiguous(), _rows(x), _vec(weight), rstd,
                                       weight_grad=weight_grad)
    return dx, _none_to_empty(dw, dx)


def layer_norm(x, weight, bias, eps, stats=True):
    """``(y, mean, rstd)`` over the last axis (statistics as :func:`rms_norm`);
    ``stats=False``: ``y`` alone."""
    return cupylab.layer_norm(_rows(x), _vec(weight), _vec(bias), eps, return_stats=stats)


def layer_norm_backward(dy, x, weight, mean, rstd, weight_grad=True):
    """``(dx, dweight, dbias)``; the weight gradients are (0,)-shaped without a weight or with
    ``weight_grad=False`` (then not computed)."""
    dx, dw, db = cupylab.layer_norm_backward(_d(dy).contiguous(), _rows(x), _vec(weight), mean,
                                             rstd, weight_grad=weight_grad)
    return dx, _none_to_empty(dw, dx), _none_to_empty(db, dx)


def add_rms_norm(x, residual, weight, eps, stats=True):
    """``(y, h, rstd)``: ``h = x + residual``, ``y = rms_norm(h)``, ``rstd`` of ``h``;
    ``stats=False``: ``(y, h)``."""
    return cupylab.add_rms_norm(_rows(x), _rows(residual), _vec(weight), eps,
                                return_stats=stats)


def add_rms_norm_(x, residual, weight, eps):
    """``y``, with ``h = x + residual`` written into ``residual`` (which must be writable in
    place: not a non-contiguous tensor of more than three dimensions)."""
    return cupylab.add_rms_norm(_rows(x), _d(residual), _vec(weight), eps, inplace=True)[0]


def add_rms_norm_mixed(x, residual, weight, eps, out_dtype, stats=True):
    """``(y, h, rstd)`` over a float32 residual stream: ``h = residual + x`` in float32 (``x``
    16-bit or float32), ``y = rms_norm(h)`` written in ``out_dtype``; ``stats=False``:
    ``(y, h)``."""
    return cupylab.add_rms_norm(_rows(x), _rows(residual), _vec(weight), eps,
                                return_stats=stats, dtype=out_dtype)


def add_rms_norm_mixed_backward(dy, dh, h, weight, rstd, x_dtype, weight_grad=True):
    """``(dresidual, dx, dweight)`` in one pass: ``dresidual`` float32 (``dh`` added when
    given), ``dx`` the same values in ``x_dtype`` or a (0,)-shaped tensor when ``x_dtype`` is
    float32 (then ``dresidual`` is the branch's gradient too: a registered operator's outputs
    may not alias), ``dweight`` (0,)-shaped without a weight or with ``weight_grad=False``."""
    g, gx, dw = cupylab.add_rms_norm_backward(
        _d(dy).contiguous(), _rows(h), _vec(weight), rstd,
        None if dh is None else _rows(dh), x_dtype=x_dtype, weight_grad=weight_grad)
    return g, (g.new_empty((0,)) if gx is g else gx), _none_to_empty(dw, g)


# -- cross-entropy ----------------------------------------------------------------------------
def _loss(loss, logits, fp32_loss):
    """The kernel's float32 (float64) loss in the logits' dtype, or float32 with
    ``fp32_loss``."""
    dt = torch.float32 if fp32_loss else logits.dtype
    return loss if loss.dtype == dt else loss.to(dt)


def cross_entropy_loss(logits, target, ignore_index, reduction, label_smoothing,
                       fp32_loss=False):
    """The loss alone, in the logits' dtype (torch's ``F.cross_entropy`` dtype), or float32
    with ``fp32_loss`` (torch's under autocast); the kernel computes it in float32."""
    loss = cupylab.cross_entropy(_rows(logits), target, ignore_index, label_smoothing,
                                 reduction)
    return _loss(loss, logits, fp32_loss)


def cross_entropy(logits, target, ignore_index, reduction, label_smoothing, compute_grad,
                  fp32_loss=False):
    """``(loss, lse)`` with the class axis last: ``lse`` is the per-row log-sum-exp (float32,
    float64 for float64 logits) that :func:`cross_entropy_backward` takes, or a (0,)-shaped
    tensor when ``compute_grad`` is false. ``loss`` is in the logits' dtype, or float32 with
    ``fp32_loss``. The logits are read once either way."""
    if not compute_grad:
        loss = cross_entropy_loss(logits, target, ignore_index, reduction, label_smoothing,
                                  fp32_loss)
        return loss, logits.new_empty((0,))
    loss, lse = cupylab.cross_entropy(_rows(logits), target, ignore_index, label_smoothing,
                                      reduction, return_lse=True)
    return _loss(loss, logits, fp32_loss), lse


def cross_entropy_backward(logits, target, lse, dloss, ignore_index, reduction,
                           label_smoothing):
    """``dlogits``: the gradient of :func:`cross_entropy`'s loss times ``dloss`` (the loss's
    incoming gradient: one value, or one a row for ``"none"``), from the saved logits and
    ``lse`` in one pass (read the logits, write the gradient), computed in float32 (float64)
    and rounded once to the logits' dtype: a loss scale never meets a rounded 16-bit
    gradient."""
    x = _rows(logits)
    acc = acc_dtype(x.dtype)
    if dloss.requires_grad:  # create_graph=True: its value is read; the caller refuses a
        dloss = dloss.detach()  # second differentiation
    if dloss.dtype != x.dtype and dloss.dtype != acc:
        dloss = dloss.to(acc)
    if dloss.dim() > 1 and not dloss.is_contiguous() and any(dloss.stride()):
        dloss = dloss.contiguous()  # leading dimensions that might not merge with the logits'
    return cupylab.cross_entropy_backward(x, target, lse, dloss, ignore_index, label_smoothing,
                                          reduction)


# -- elementwise ------------------------------------------------------------------------------
def add(a, b):
    return cupylab.add(_d(a), _d(b))


def subtract(a, b):
    return cupylab.subtract(_d(a), _d(b))


def multiply(a, b):
    return cupylab.multiply(_d(a), _d(b))


def divide(a, b):
    return cupylab.divide(_d(a), _d(b))


def fused_add_mul(a, b, s):
    """``(a + b) * s`` with ``s`` a tensor."""
    return cupylab.fused_add_mul(_d(a), _d(b), _d(s))


def fused_add_mul_scalar(a, b, s):
    """``(a + b) * s`` with ``s`` a Python number (bool, int, float or complex)."""
    return cupylab.fused_add_mul(_d(a), _d(b), s)
