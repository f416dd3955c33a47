"""cupylab's operators registered as torch library operators in the ``cupylab`` namespace
(``torch.ops.cupylab.<name>``), so that torch.compile keeps them in one graph (no graph
break), traces their fake implementations for shapes, and differentiates them through their
registered autograd formulas.

Every operator has an explicit schema, its real implementation in
:mod:`cupylab.torch._kernels` (looked up per call), a fake implementation here giving the real
outputs' shapes, dtypes and strides, and, for the forward operators, the backward formula of
:mod:`cupylab.torch._autograd` with the backward operators registered here, so that the traced
backward is itself made of registered operators. The operators that mutate nothing are defined
through ``torch.library.Library`` (``define``, an ``impl`` for every device, ``register_fake``,
and the autograd kernel ``register_autograd`` would register, with a direct path in front of
it for calls that record no graph: :func:`_register_autograd`): a call costs less host time
than through ``torch.library.custom_op``, whose Python layer runs on every call (a trivial
operator, torch 2.13 on a CPU: 12.3 against 15.4 µs, 4.3 µs called directly). The one that
mutates its argument, ``add_rms_norm_``, stays a ``custom_op``, which also bumps the mutated
tensor's version counter and functionalizes it under torch.compile.

Operators (all over the last axis unless stated; every output a new C-contiguous tensor, except
where noted):

=============================  ====================================================================
``softmax(x, dim)``            ``y``; any ``dim``
``log_softmax(x, dim)``        ``y``
``softmax_backward``           ``(y, dy, dim) -> dx``; for a ``dim`` other than the last, ``dx`` is
                               ``empty(shape with dim moved last).movedim(-1, dim)``
``log_softmax_backward``       the same for log_softmax
``rms_norm``                   ``(x, weight?, eps) -> (y, rstd)``
``rms_norm_backward``          ``(dy, x, weight?, rstd, weight_grad=True) -> (dx, dweight)``
``layer_norm``                 ``(x, weight?, bias?, eps) -> (y, mean, rstd)``
``layer_norm_backward``        ``(dy, x, weight?, mean, rstd, weight_grad=True) ->
                               (dx, dweight, dbias)``
``add_rms_norm``               ``(x, residual, weight?, eps) -> (y, h, rstd)``
``add_rms_norm_``              ``(x, residual!, weight?, eps) -> y``; writes ``h`` into ``residual``
                               (mutates it; no autograd formula)
``add_rms_norm_mixed``         ``(x, residual, weight?, eps, out_dtype) -> (y, h, rstd)`` over a
                               float32 residual stream: ``h`` float32, ``y`` in ``out_dtype``
``add_rms_norm_mixed_backward`` ``(dy, dh?, h, weight?, rstd, x_dtype, weight_grad=True) ->
                               (dresidual, dx, dweight)``; ``dx`` (0,)-shaped for float32 ``x``
``cross_entropy``              ``(logits, target, ignore_index, reduction, label_smoothing,
                               compute_grad, fp32_loss=False) -> (loss, lse)``; class axis last;
                               ``loss`` in the logits' dtype (float32 with ``fp32_loss``); ``lse``
                               the per-row log-sum-exp, (0,)-shaped when ``compute_grad`` is false
``cross_entropy_backward``     ``(logits, target, lse, dloss, ignore_index, reduction,
                               label_smoothing) -> dlogits``: the loss's gradient times ``dloss``
                               in one pass over the logits
``add``, ``subtract``,         ``(a, b) -> out``: broadcasting, torch's type promotion
``multiply``, ``divide``
``fused_add_mul``              ``(a, b, s) -> (a + b) * s``; ``fused_add_mul_scalar`` takes a number
=============================  ====================================================================

Statistics are float32 (float64 for float64 inputs) of shape ``x.shape[:-1]``. A weight
gradient that does not exist (no weight) is a (0,)-shaped tensor: a registered operator
returns tensors only.
"""
import torch

from . import _autograd, _kernels

__all__ = ["NAMESPACE", "SCHEMAS", "OPS"]

NAMESPACE = "cupylab"

#: operator name -> (schema, mutated arguments)
SCHEMAS = {
    "softmax": ("(Tensor x, int dim) -> Tensor", ()),
    "log_softmax": ("(Tensor x, int dim) -> Tensor", ()),
    "softmax_backward": ("(Tensor y, Tensor dy, int dim) -> Tensor", ()),
    "log_softmax_backward": ("(Tensor y, Tensor dy, int dim) -> Tensor", ()),
    "rms_norm": ("(Tensor x, Tensor? weight, float eps) -> (Tensor, Tensor)", ()),
    "rms_norm_backward": ("(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, "
                          "bool weight_grad=True) -> (Tensor, Tensor)", ()),
    "layer_norm": ("(Tensor x, Tensor? weight, Tensor? bias, float eps) -> "
                   "(Tensor, Tensor, Tensor)", ()),
    "layer_norm_backward": ("(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, "
                            "bool weight_grad=True) -> (Tensor, Tensor, Tensor)", ()),
    "add_rms_norm": ("(Tensor x, Tensor residual, Tensor? weight, float eps) -> "
                     "(Tensor, Tensor, Tensor)", ()),
    "add_rms_norm_": ("(Tensor x, Tensor(a!) residual, Tensor? weight, float eps) -> Tensor",
                      ("residual",)),
    "add_rms_norm_mixed": ("(Tensor x, Tensor residual, Tensor? weight, float eps, "
                           "ScalarType out_dtype) -> (Tensor, Tensor, Tensor)", ()),
    "add_rms_norm_mixed_backward": ("(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, "
                                    "Tensor rstd, ScalarType x_dtype, bool weight_grad=True) -> "
                                    "(Tensor, Tensor, Tensor)", ()),
    "cross_entropy": ("(Tensor logits, Tensor target, int ignore_index, str reduction, "
                      "float label_smoothing, bool compute_grad, bool fp32_loss=False) -> "
                      "(Tensor, Tensor)", ()),
    "cross_entropy_backward": ("(Tensor logits, Tensor target, Tensor lse, Tensor dloss, "
                               "int ignore_index, str reduction, float label_smoothing) -> "
                               "Tensor", ()),
    "add": ("(Tensor a, Tensor b) -> Tensor", ()),
    "subtract": ("(Tensor a, Tensor b) -> Tensor", ()),
    "multiply": ("(Tensor a, Tensor b) -> Tensor", ()),
    "divide": ("(Tensor a, Tensor b) -> Tensor", ()),
    "fused_add_mul": ("(Tensor a, Tensor b, Tensor s) -> Tensor", ()),
    "fused_add_mul_scalar": ("(Tensor a, Tensor b, Scalar s) -> Tensor", ()),
}


# -- fake implementations: the real outputs' metadata -----------------------------------------
def _acc(x):
    return _kernels.acc_dtype(x.dtype)


def _same(x, *_):
    return x.new_empty(x.shape)


def _softmax_bwd_fake(y, dy, dim):
    nd = y.dim()
    dim = dim % nd
    if dim == nd - 1:
        return y.new_empty(y.shape)
    return y.new_empty(y.movedim(dim, -1).shape).movedim(-1, dim)


def _stats(x, n):
    lead = x.shape[:-1]
    return tuple(x.new_empty(lead, dtype=_acc(x)) for _ in range(n))


def _weight_grad(x, weight):
    return x.new_empty((0,)) if weight is None else weight.new_empty(weight.shape)


def _rms_norm_fake(x, weight, eps):
    return (x.new_empty(x.shape), *_stats(x, 1))


def _rms_norm_bwd_fake(dy, x, weight, rstd, weight_grad=True):
    return x.new_empty(x.shape), _weight_grad(x, weight if weight_grad else None)


def _layer_norm_fake(x, weight, bias, eps):
    return (x.new_empty(x.shape), *_stats(x, 2))


def _layer_norm_bwd_fake(dy, x, weight, mean, rstd, weight_grad=True):
    w = weight if weight_grad else None
    return x.new_empty(x.shape), _weight_grad(x, w), _weight_grad(x, w)


def _add_rms_norm_fake(x, residual, weight, eps):
    return (x.new_empty(x.shape), x.new_empty(x.shape), *_stats(x, 1))


def _add_rms_norm_mixed_fake(x, residual, weight, eps, out_dtype):
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=torch.float32),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


def _add_rms_norm_mixed_bwd_fake(dy, dh, h, weight, rstd, x_dtype, weight_grad=True):
    gx = (h.new_empty((0,)) if x_dtype == torch.float32
          else h.new_empty(h.shape, dtype=x_dtype))
    return h.new_empty(h.shape), gx, _weight_grad(h, weight if weight_grad else None)


def _cross_entropy_fake(logits, target, ignore_index, reduction, label_smoothing,
                        compute_grad, fp32_loss=False):
    loss = logits.new_empty(logits.shape[:-1] if reduction == "none" else (),
                            dtype=torch.float32 if fp32_loss else logits.dtype)
    if not compute_grad:
        return loss, logits.new_empty((0,))
    return loss, logits.new_empty(logits.shape[:-1], dtype=_acc(logits))


def _cross_entropy_bwd_fake(logits, target, lse, dloss, ignore_index, reduction,
                            label_smoothing):
    return logits.new_empty(logits.shape)


def result_dtype(name, a, b, s=None):
    """The dtype cupylab gives a torch caller (:mod:`cupylab._promotion`'s torch rule):
    ``torch.result_type``; true division of integers and bools in the default dtype;
    ``fused_add_mul`` promotes ``(a, b)`` first, then that dtype (as a tensor with
    dimensions) with ``s``."""
    r = torch.result_type(a, b)
    if name.startswith("fused_add_mul"):
        r = torch.result_type(torch.empty((1,), dtype=r, device="meta"), s)
    elif name == "divide" and not (r.is_floating_point or r.is_complex):
        r = torch.get_default_dtype()
    return r


def _binary_fake(name):
    def fake(a, b, s=None):
        shape = torch.broadcast_shapes(a.shape, b.shape) if s is None or not isinstance(
            s, torch.Tensor) else torch.broadcast_shapes(a.shape, b.shape, s.shape)
        return a.new_empty(shape, dtype=result_dtype(name, a, b, s))
    return fake


_FAKES = {
    "softmax": _same, "log_softmax": _same,
    "softmax_backward": _softmax_bwd_fake, "log_softmax_backward": _softmax_bwd_fake,
    "rms_norm": _rms_norm_fake, "rms_norm_backward": _rms_norm_bwd_fake,
    "layer_norm": _layer_norm_fake, "layer_norm_backward": _layer_norm_bwd_fake,
    "add_rms_norm": _add_rms_norm_fake, "add_rms_norm_": _same,
    "add_rms_norm_mixed": _add_rms_norm_mixed_fake,
    "add_rms_norm_mixed_backward": _add_rms_norm_mixed_bwd_fake,
    "cross_entropy": _cross_entropy_fake, "cross_entropy_backward": _cross_entropy_bwd_fake,
    **{n: _binary_fake(n) for n in ("add", "subtract", "multiply", "divide", "fused_add_mul",
                                    "fused_add_mul_scalar")},
}


# -- Inductor: the fallbacks made up front ----------------------------------------------------
_fallbacks_made = False


def inductor_fallbacks():
    """Make every cupylab operator an Inductor fallback kernel (a call of its real
    implementation, with the layout constraint Inductor would choose itself), once.

    Inductor makes that fallback on its own the first time it lowers an operator it has no
    lowering for, but before it does, torch 2.11 formats the operator's arguments for a log
    message whatever the log level (later versions format it lazily). An argument's text
    nests the text of every extern kernel it comes from; in a graph where cupylab operators
    feed each other through matrix multiplies and attention (the training example's stack of
    fused residual norms, 8 layers) that text grows exponentially with the depth, and Inductor
    spent minutes in it before compiling anything (H100, torch 2.11, batch 64, the graph's
    first cupylab cross-entropy). Called by the fake implementations, which run while
    torch.compile traces, before Inductor lowers; Inductor's own modules are imported then
    (they are being imported for the compilation anyway). Where these Inductor internals
    differ or are missing, nothing is done and Inductor's implicit fallback remains."""
    global _fallbacks_made
    if _fallbacks_made:
        return
    _fallbacks_made = True
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # no fake tensors made by the imports
            from torch._inductor import lowering
        for op in OPS.values():
            if op not in lowering.lowerings:
                tag = lowering.get_layout_constraint_tag(op, with_default=True)
                lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(
                    tag), warn=False)
    except Exception:  # noqa: BLE001 - private internals of another torch: Inductor's own way
        pass


def _fake_entry(fake):
    """``fake``, making the Inductor fallbacks first (:func:`inductor_fallbacks`)."""
    def entry(*args, **kwargs):
        if not _fallbacks_made:
            inductor_fallbacks()
        return fake(*args, **kwargs)
    entry.__name__ = entry.__qualname__ = fake.__name__
    return entry


# -- registration -----------------------------------------------------------------------------
def _impl(name):
    """The real implementation: ``_kernels.<name>``, looked up per call."""
    def impl(*args):
        return getattr(_kernels, name)(*args)
    impl.__name__ = impl.__qualname__ = name
    impl.__doc__ = getattr(_kernels, name).__doc__
    return impl


#: the library that defines the operators that mutate nothing (kept alive: dropping a
#: ``Library`` removes its registrations)
LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def _register(name):
    schema, mutates = SCHEMAS[name]
    qualname = f"{NAMESPACE}::{name}"
    formula = _autograd.FORMULAS.get(name)
    if mutates:  # no autograd formula: custom_op raises when it is differentiated
        torch.library.custom_op(qualname, _impl(name), mutates_args=mutates,
                                schema=schema).register_fake(_fake_entry(_FAKES[name]))
    else:
        LIBRARY.define(name + schema)
        LIBRARY.impl(name, _impl(name), "CompositeExplicitAutograd")
        torch.library.register_fake(qualname, _fake_entry(_FAKES[name]), lib=LIBRARY)
        # the traced backward calls the registered backward operators (torch.ops.cupylab); an
        # operator without a formula (the backwards) raises when differentiated, as a
        # custom_op does (without an autograd kernel torch would only warn and give none)
        setup, backward = formula if formula is not None else (_no_setup, _no_formula(qualname))
        _register_autograd(name, _bound(backward), setup)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


#: the dispatch key below autograd that the direct path takes: plain device tensors with
#: nothing else to run on the way to the kernel (the tests set it to CPU)
DIRECT_KEY = torch._C.DispatchKey.CUDA

#: dispatch key set (its raw value) -> whether a call with it takes the direct path (bounded)
_DIRECT_KEYSETS = {}


def _register_autograd(name, backward, setup):
    """``name``'s autograd kernel: torch's kernel for ``backward`` / ``setup`` (what
    ``torch.library.register_autograd`` registers), with a direct path in front of it.

    torch's kernel runs Python twice before the real implementation on every call, even one
    that needs no graph (a compiled graph calls the operators with grad disabled): itself,
    then, through the dispatcher's redispatch below autograd, the implementation's wrapper.
    The direct path calls :mod:`cupylab.torch._kernels` at once when no graph is to be
    recorded (grad disabled, or no input requiring grad) and nothing but the device kernel
    lies below autograd: no fake or functional tensors, no dispatch mode, no Python
    dispatcher (torch.compile's tracing), which would each put a key above :data:`DIRECT_KEY`.
    Anything else goes to torch's kernel. ``rms_norm`` over a trivial kernel with grad
    disabled, torch 2.11 on a 2-core CPU host: 18–23 µs a call through torch's kernel,
    6.7–8.0 µs direct.
    Where torch's internals for building its kernel differ or are missing, the public
    ``register_autograd`` is used as before."""
    qualname = f"{NAMESPACE}::{name}"
    try:
        from torch._library.autograd import Info, make_autograd_impl

        op = getattr(getattr(torch.ops, NAMESPACE), name).default
        general = make_autograd_impl(op, Info(backward, setup))
        after_autograd = torch._C._after_autograd_keyset
        grad_enabled, any_requires_grad = torch.is_grad_enabled, torch._C._any_requires_grad
    except Exception:  # noqa: BLE001 - private internals of another torch: the public way
        torch.library.register_autograd(qualname, backward, setup_context=setup, lib=LIBRARY)
        return

    def autograd_kernel(keyset, *args, **kwargs):
        if not (kwargs or grad_enabled() and any_requires_grad(*args)):
            raw = keyset.raw_repr()
            direct = _DIRECT_KEYSETS.get(raw)
            if direct is None:  # a key set not seen yet (comparing keys costs microseconds)
                direct = (keyset & after_autograd).highestPriorityTypeId() == DIRECT_KEY
                if len(_DIRECT_KEYSETS) < 64:
                    _DIRECT_KEYSETS[raw] = direct
            if direct:
                return getattr(_kernels, name)(*args)
        return general(keyset, *args, **kwargs)

    autograd_kernel.__name__ = autograd_kernel.__qualname__ = f"{name}_autograd"
    LIBRARY.impl(name, autograd_kernel, "Autograd", with_keyset=True)


def _no_setup(ctx, inputs, output):
    pass


def _no_formula(qualname):
    def backward(k, ctx, *grads):
        raise RuntimeError(f"{qualname} has no derivative: cupylab's backward operators cannot "
                           "be differentiated (no double backward)")
    backward.__name__ = "no_formula"
    return backward


def _bound(backward):
    def bwd(ctx, *grads):
        return backward(torch.ops.cupylab, ctx, *grads)
    bwd.__name__ = backward.__name__
    return bwd


#: operator name -> its ``torch.ops.cupylab.<name>.default`` overload
OPS = {name: _register(name) for name in SCHEMAS}
