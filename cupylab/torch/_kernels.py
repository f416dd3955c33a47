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
           "add_rms_norm_", "cross_entropy", "cross_entropy_loss", "scale_grad", "mean_scale",
           "unscaled_mean", "add", "subtract",
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
    """``(loss, dlogits)`` with the class axis last: ``dlogits`` is the gradient of the
    returned loss (of the sum of the row losses for ``"none"``), written during the forward
    pass, or a (0,)-shaped tensor when ``compute_grad`` is false. ``loss`` is in the logits'
    dtype, or float32 with ``fp32_loss``.

    float16 logits with ``"mean"``: ``dlogits`` is the gradient of the *sum* (softmax minus
    the smoothed one-hot, of order 1), which the backward divides by the count of kept rows
    in float32 (:func:`mean_scale`): divided here, a large batch's small gradients would
    fall below float16's range before any loss scale is applied."""
    if not compute_grad:
        loss = cross_entropy_loss(logits, target, ignore_index, reduction, label_smoothing,
                                  fp32_loss)
        return loss, logits.new_empty((0,))
    if unscaled_mean(logits.dtype, reduction):
        loss, dx = cupylab.cross_entropy(_rows(logits), target, ignore_index, label_smoothing,
                                         "sum", return_grad=True)
        return _loss(loss * mean_scale(target, ignore_index, True), logits, fp32_loss), dx
    loss, dx = cupylab.cross_entropy(_rows(logits), target, ignore_index, label_smoothing,
                                     reduction, return_grad=True)
    return _loss(loss, logits, fp32_loss), dx


def unscaled_mean(dtype, reduction):
    """Whether :func:`cross_entropy` leaves the mean's division to the backward."""
    return dtype == torch.float16 and reduction == "mean"


def mean_scale(target, ignore_index, for_loss=False):
    """``1 / count`` of the rows not ignored, float32 on the target's device: for the
    gradient 0 when every row is ignored (as torch's gradient), for the loss NaN then (as
    torch's loss)."""
    count = (target != ignore_index).sum(dtype=torch.float32)
    inv = 1.0 / count
    return inv if for_loss else torch.where(count > 0, inv, torch.zeros_like(inv))


def scale_grad(g, s):
    """``g * s`` computed in float32 (float64 for float64 ``g``) and written in ``g``'s dtype,
    ``s`` a float32 (float64) tensor broadcast to ``g``: the loss's gradient is not rounded
    to a 16-bit dtype before it multiplies (GradScaler's 65536 overflows float16)."""
    out = torch.empty_like(g, memory_format=torch.contiguous_format)
    # s may require grad (an incoming gradient that does, create_graph=True): the kernel
    # reads its value; a second differentiation is refused by the caller
    return cupylab.multiply(_d(g), _d(s), out=out, dtype=s.dtype)


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
