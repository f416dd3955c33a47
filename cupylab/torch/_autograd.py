"""Backward formulas of cupylab's torch operators, written once for both paths.

Each operator has a ``setup_context(ctx, inputs, output)`` (what the forward saves: the
statistics and the tensors the formula needs, never a recomputed activation) and a
``backward(k, ctx, *grads)``, where ``k`` provides the backward kernels by name:

* the registered operators (:mod:`cupylab.torch._library`) pass ``torch.ops.cupylab``, so that
  torch.compile traces the backward into calls of registered operators;
* the eager ``torch.autograd.Function`` classes built here (:data:`FUNCTIONS`) pass
  :mod:`cupylab.torch._kernels`, which launches the same kernels without the dispatcher. They
  return the differentiable outputs only: a norm's statistics and cross-entropy's ``lse``
  are saved in the context, not returned (each extra output costs autograd host time).

The forward of a Function is the function of the same name in :mod:`cupylab.torch._kernels`,
the real implementation of the registered operator too. Gradients of unused outputs arrive as
None (``set_materialize_grads(False)``: no zero tensors are made for them). Elementwise
gradients are torch operations, reduced to each input's shape with ``sum_to_size`` and cast to
its dtype. Statistics outputs (``rstd``, ``mean``, cross-entropy's ``lse``) are
non-differentiable. Double backward (``create_graph=True``): the elementwise operators' eager
backward is differentiable; the row-wise operators' gradients raise when differentiated again.
"""
import functools

import torch

from . import _kernels

_grad_enabled = torch.is_grad_enabled

__all__ = ["FORMULAS", "FUNCTIONS"]


_acc = _kernels.acc_dtype


# -- softmax / log_softmax: save the output ---------------------------------------------------
def _softmax_setup(ctx, inputs, output):
    ctx.dim = inputs[1]
    ctx.save_for_backward(output)


def _softmax_backward(k, ctx, dy):
    if dy is None:
        return None, None
    (y,) = ctx.saved_tensors
    return k.softmax_backward(y, dy, ctx.dim), None


def _log_softmax_backward(k, ctx, dy):
    if dy is None:
        return None, None
    (y,) = ctx.saved_tensors
    return k.log_softmax_backward(y, dy, ctx.dim), None


# -- norms: save x (or h), the weight and the statistics ---------------------------------------
def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_backward(k, ctx, dy, _drstd):
    if dy is None:
        return None, None, None
    x, weight, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    wg = weight is not None and need[1]  # a frozen weight: no weight gradient computed
    dx, dw = k.rms_norm_backward(dy, x, weight, rstd, wg)
    return (dx if need[0] else None), (dw if wg else None), None


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(x, weight, output[1], output[2])


def _layer_norm_backward(k, ctx, dy, _dmean, _drstd):
    if dy is None:
        return None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dw, db = k.layer_norm_backward(dy, x, weight, mean, rstd,
                                       weight is not None and (need[1] or need[2]))
    if weight is None:
        dw = None
        db = None
        if ctx.bias_dtype is not None and need[2]:  # a bias without a weight: sum of dy
            lead = tuple(range(dy.dim() - 1))
            db = dy.sum(dim=lead, dtype=_acc(dy.dtype)).to(ctx.bias_dtype)
    else:
        dw = dw if need[1] else None
        db = db if ctx.bias_dtype is not None and need[2] else None
    return (dx if need[0] else None), dw, db, None


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, _ = inputs
    _, h, rstd = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(h, weight, rstd)


def _add_rms_norm_backward(k, ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    g = dw = None
    if dy is not None:
        wg = weight is not None and ctx.needs_input_grad[2]
        g, dw = k.rms_norm_backward(dy, h, weight, rstd, wg)
        if not wg:
            dw = None
    if dh is not None:  # h is also an output (the next residual): its gradient adds
        g = dh if g is None else g + dh
    need = ctx.needs_input_grad
    return (g if need[0] else None), (g if need[1] else None), dw, None


def _add_rms_norm_mixed_setup(ctx, inputs, output):
    x, _, weight, _, _ = inputs
    _, h, rstd = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(rstd)
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(h, weight, rstd)


def _add_rms_norm_mixed_backward(k, ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    dw = None
    if dy is not None:  # one pass: the residual's gradient, the branch's in its dtype, dweight
        wg = weight is not None and need[2]
        g, gx, dw = k.add_rms_norm_mixed_backward(dy, dh, h, weight, rstd, ctx.x_dtype, wg)
        if ctx.x_dtype == torch.float32:
            gx = g
        if not wg:
            dw = None
    elif dh is not None:  # only h is used downstream: its gradient passes through
        g = dh
        gx = dh if ctx.x_dtype == dh.dtype else dh.to(ctx.x_dtype)
    else:
        return None, None, None, None, None
    return (gx if need[0] else None), (g if need[1] else None), dw, None, None


# -- cross-entropy: the forward saves the logits and the log-sum-exp ------------------------
class _NoDoubleBackward(torch.autograd.Function):
    """The gradient passed through; differentiating it again raises. The backwards of the
    row-wise operators are cupylab kernels, which have no graph of their own: without this a
    second differentiation (``create_graph=True``) would silently leave out their second
    derivatives."""

    @staticmethod
    def forward(ctx, g, name):
        ctx.name = name
        # the same memory, not an autograd view: the caller may modify the gradient in place
        return g.detach()

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError(f"cupylab {ctx.name}: its gradient cannot be differentiated again "
                           f"(no double backward); use torch's {ctx.name} where second-order "
                           "gradients are needed")


def no_double_backward(name, grads):
    """``grads`` (tensors or None) made to raise when differentiated again."""
    return tuple(g if g is None else _NoDoubleBackward.apply(g.detach().requires_grad_(), name)
                 for g in grads)


def _cross_entropy_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(output[1])
    ctx.ignore_index, ctx.reduction, ctx.label_smoothing = inputs[2], inputs[3], inputs[4]
    ctx.has_grad = bool(inputs[5])
    if ctx.has_grad:  # the logits (not a gradient written ahead) and the row statistics
        ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _cross_entropy_backward(k, ctx, dloss, _dlse):
    if dloss is None:
        return (None,) * 7
    if not ctx.has_grad:
        raise RuntimeError("cupylab::cross_entropy: the forward ran with compute_grad=False, "
                           "so no log-sum-exp was saved; call it with compute_grad=True "
                           "to differentiate it")
    logits, target, lse = ctx.saved_tensors
    # one pass over the logits: softmax - onehot from the saved log-sum-exp, times the loss's
    # gradient (read in float32, never rounded to the logits' 16-bit dtype first: GradScaler's
    # 65536 overflows float16, and a bf16 1/3 is 0.2 % off)
    dx = k.cross_entropy_backward(logits, target, lse, dloss, ctx.ignore_index, ctx.reduction,
                                  ctx.label_smoothing)
    if _grad_enabled():  # create_graph=True: a second differentiation must raise, not drop
        (dx,) = no_double_backward("cross_entropy", (dx,))
    return (dx, None, None, None, None, None, None)


# -- elementwise ------------------------------------------------------------------------------
def _reduce(g, like):
    """``g`` summed over the dims that ``like`` (shape, dtype) was broadcast along, in its
    dtype."""
    shape, dtype = like
    return g.sum_to_size(shape).to(dtype)


def _meta(t):
    return (t.shape, t.dtype)


def _binary_setup(ctx, inputs, output):
    a, b = inputs
    ctx.set_materialize_grads(False)
    ctx.metas = (_meta(a), _meta(b))


def _add_backward(k, ctx, g):
    if g is None:
        return None, None
    ma, mb = ctx.metas
    need = ctx.needs_input_grad
    return (_reduce(g, ma) if need[0] else None), (_reduce(g, mb) if need[1] else None)


def _subtract_backward(k, ctx, g):
    if g is None:
        return None, None
    ma, mb = ctx.metas
    need = ctx.needs_input_grad
    return (_reduce(g, ma) if need[0] else None), (_reduce(-g, mb) if need[1] else None)


def _multiply_setup(ctx, inputs, output):
    """``d(a) = g * b``, ``d(b) = g * a``: save each operand only if the other needs it."""
    a, b = inputs
    _binary_setup(ctx, inputs, output)
    need = ctx.needs_input_grad
    ctx.save_for_backward(a if need[1] else None, b if need[0] else None)


def _divide_setup(ctx, inputs, output):
    """``d(a) = g / b``, ``d(b) = -g * a / b**2``."""
    a, b = inputs
    _binary_setup(ctx, inputs, output)
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b)


def _multiply_backward(k, ctx, g):
    if g is None:
        return None, None
    a, b = ctx.saved_tensors
    ma, mb = ctx.metas
    need = ctx.needs_input_grad
    return ((_reduce(g * b.conj(), ma) if need[0] else None),
            (_reduce(g * a.conj(), mb) if need[1] else None))


def _divide_backward(k, ctx, g):
    if g is None:
        return None, None
    a, b = ctx.saved_tensors
    ma, mb = ctx.metas
    need = ctx.needs_input_grad
    ga = g / b.conj()
    gb = None
    if need[1]:
        gb = _reduce(-ga * (a / b).conj(), mb)
    return (_reduce(ga, ma) if need[0] else None), gb


def _fam_setup(ctx, inputs, output):
    """fused_add_mul with a tensor ``s``: ``d(a), d(b) = g * s``, ``d(s) = g * (a + b)``."""
    a, b, s = inputs
    ctx.set_materialize_grads(False)
    ctx.metas = (_meta(a), _meta(b), _meta(s))
    need = ctx.needs_input_grad
    keep_ab = need[2]
    ctx.save_for_backward(a if keep_ab else None, b if keep_ab else None,
                          s if need[0] or need[1] else None)


def _fam_backward(k, ctx, g):
    if g is None:
        return None, None, None
    a, b, s = ctx.saved_tensors
    ma, mb, ms = ctx.metas
    need = ctx.needs_input_grad
    gs = g * s.conj() if need[0] or need[1] else None
    return ((_reduce(gs, ma) if need[0] else None), (_reduce(gs, mb) if need[1] else None),
            (_reduce(g * (a + b).conj(), ms) if need[2] else None))


def _fam_scalar_setup(ctx, inputs, output):
    a, b, s = inputs
    ctx.set_materialize_grads(False)
    ctx.metas = (_meta(a), _meta(b))
    ctx.s = s


def _fam_scalar_backward(k, ctx, g):
    if g is None:
        return None, None, None
    ma, mb = ctx.metas
    need = ctx.needs_input_grad
    s = ctx.s
    gs = g * (s.conjugate() if type(s) is complex else s)  # torch's convention: g * conj(s)
    return (_reduce(gs, ma) if need[0] else None), (_reduce(gs, mb) if need[1] else None), None


#: operator name -> (setup_context, backward(k, ctx, *grads))
FORMULAS = {
    "softmax": (_softmax_setup, _softmax_backward),
    "log_softmax": (_softmax_setup, _log_softmax_backward),
    "rms_norm": (_rms_norm_setup, _rms_norm_backward),
    "layer_norm": (_layer_norm_setup, _layer_norm_backward),
    "add_rms_norm": (_add_rms_norm_setup, _add_rms_norm_backward),
    "add_rms_norm_mixed": (_add_rms_norm_mixed_setup, _add_rms_norm_mixed_backward),
    "cross_entropy": (_cross_entropy_setup, _cross_entropy_backward),
    "add": (_binary_setup, _add_backward),
    "subtract": (_binary_setup, _subtract_backward),
    "multiply": (_multiply_setup, _multiply_backward),
    "divide": (_divide_setup, _divide_backward),
    "fused_add_mul": (_fam_setup, _fam_backward),
    "fused_add_mul_scalar": (_fam_scalar_setup, _fam_scalar_backward),
}


#: operator name -> (outputs the eager Function returns, outputs of the kernel function): the
#: statistics (cross-entropy's log-sum-exp too) stay in the context
#: instead of being returned as non-differentiable outputs, which costs autograd an output
#: each
_EAGER_OUTPUTS = {"rms_norm": (1, 2), "layer_norm": (1, 3), "add_rms_norm": (2, 3),
                  "add_rms_norm_mixed": (2, 3),
                  "cross_entropy": (1, 2)}


#: operators whose backward formulas are torch operations on saved inputs: with
#: ``create_graph=True`` they run with grad mode on and give the true second derivatives
DIFFERENTIABLE_BACKWARD = ("add", "subtract", "multiply", "divide", "fused_add_mul",
                           "fused_add_mul_scalar")


def _function(name, setup, backward):
    """The eager ``torch.autograd.Function`` of operator ``name``: forward
    ``_kernels.<name>`` (looked up per call) and ``setup``; it returns the differentiable
    outputs (:data:`_EAGER_OUTPUTS`). Backward: ``backward`` with the kernels of
    :mod:`cupylab.torch._kernels`. When grad mode is on in the backward
    (``create_graph=True``), the elementwise formulas (:data:`DIFFERENTIABLE_BACKWARD`) are
    recorded by autograd as they run (double backward works), and the row-wise operators'
    gradients, made by kernels, raise when differentiated again (whether or not the incoming
    gradient requires grad: once_differentiable marks only results whose inputs do, which
    silently dropped the second derivative through saved inputs)."""
    n, total = _EAGER_OUTPUTS.get(name, (None, None))
    kern = functools.partial(backward, _kernels)
    # cross-entropy guards its own result; the elementwise formulas need no guard
    unguarded = name == "cross_entropy" or name in DIFFERENTIABLE_BACKWARD
    pad = () if n is None else (None,) * (total - n)

    def forward(ctx, *args):
        out = getattr(_kernels, name)(*args)
        setup(ctx, args, out)
        if n is None:
            return out
        return out[0] if n == 1 else out[:n]

    def bwd(ctx, *grads):
        if pad:
            grads += pad
        if _grad_enabled() and not unguarded:  # create_graph=True
            with torch.no_grad():
                r = kern(ctx, *grads)
            return no_double_backward(name, r if isinstance(r, tuple) else (r,))
        return kern(ctx, *grads)

    return type(f"{name}_function", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(bwd),
                 "__module__": __name__,
                 "__doc__": f"Eager autograd of cupylab's {name} (see {__name__})."})


#: operator name -> torch.autograd.Function class
FUNCTIONS = {name: _function(name, *f) for name, f in FORMULAS.items()}
