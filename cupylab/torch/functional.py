"""cupylab's kernels as differentiable, torch.compile-friendly torch functions.

``import cupylab.torch.functional`` registers the operators ``torch.ops.cupylab.*``
(:mod:`cupylab.torch._library`) and provides functions shaped like
``torch.nn.functional``'s: :func:`softmax`, :func:`log_softmax`, :func:`rms_norm`,
:func:`layer_norm`, :func:`add_rms_norm`, :func:`add_rms_norm_`, :func:`cross_entropy`,
:func:`add`, :func:`subtract`, :func:`multiply`, :func:`divide`, :func:`fused_add_mul`.

Every function picks one of three paths per call:

1. ``torch.compiler.is_compiling()`` (torch.compile / export is tracing): the registered
   operator ``torch.ops.cupylab.<name>``, whose fake implementation gives the shapes and whose
   registered autograd formula gives the backward: no graph break;
2. else, grad mode on and an input that requires grad: a ``torch.autograd.Function`` that runs
   the same forward kernels and the same backward formula without the dispatcher;
3. else (``torch.no_grad()``, ``torch.inference_mode()``, inputs without grad): the cupylab
   kernel called directly, with no autograd bookkeeping and no statistics saved.

Tensors are passed to the kernels zero-copy (detached views when they require grad); kernels
run on torch's current stream and outputs are allocated by torch's caching allocator, so the
functions work inside ``torch.cuda.graph`` capture and under ``mode="reduce-overhead"``; nothing
synchronises the host. Backward kernels are cupylab's (``softmax_backward``,
``log_softmax_backward``, ``rms_norm_backward``, ``layer_norm_backward``); cross-entropy writes
its gradient during the forward pass, so its backward is one multiplication by the output
gradient. Elementwise gradients are torch operations, so they can be differentiated again
(``create_graph=True``); the row-wise and cross-entropy gradients can be taken with
``create_graph=True`` (and modified in place), but differentiating them again raises
``RuntimeError`` (no double backward) rather than leaving out the second derivatives.

dtypes: float16, bfloat16, float32, float64 (float64 for gradcheck); norm weights may be
float32 with 16-bit activations (their gradients are then float32). Errors name
``cupylab.torch.functional.<function>`` and the parameter; errors found by a kernel name the
cupylab operator.
"""
import math
import numbers

import torch

from . import _autograd, _kernels
from . import _library  # noqa: F401 - registers torch.ops.cupylab.*

__all__ = ["softmax", "log_softmax", "rms_norm", "layer_norm", "add_rms_norm",
           "add_rms_norm_", "cross_entropy", "add", "subtract", "multiply", "divide",
           "fused_add_mul"]

_F = _autograd.FUNCTIONS
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor
_REDUCTIONS = ("mean", "sum", "none")


def _name(fn):
    return f"cupylab.torch.functional.{fn}"


def _tensor(fn, param, t):
    if not isinstance(t, _Tensor):
        raise TypeError(f"{_name(fn)}: {param} must be a torch.Tensor (got "
                        f"{type(t).__name__})")


def _wants_grad(*ts):
    """Grad mode on and one of ``ts`` (tensors or None) requires grad."""
    if not _grad_enabled():
        return False
    for t in ts:
        if t is not None and t.requires_grad:
            return True
    return False


# -- softmax ----------------------------------------------------------------------------------
def _dim(fn, dim, nd):
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{_name(fn)}: dim must be an int (got {dim!r})")
    n = max(nd, 1)
    if not -n <= dim < n:
        raise IndexError(f"{_name(fn)}: dim {dim} is out of range for a tensor of {nd} "
                         f"dimension(s) (expected an int in [{-n}, {n - 1}])")
    return dim % n


def softmax(x, dim=-1):
    """Softmax of ``x`` along ``dim``, like ``torch.softmax(x, dim)``.

    Parameters
    ----------
    x : torch.Tensor
        CUDA tensor, float16 / bfloat16 / float32 / float64, any strides.
    dim : int
        The last dim is the fast path (rows read once); another dim goes through cupylab's
        strided kernel.

    Returns
    -------
    torch.Tensor
        New C-contiguous tensor of ``x``'s shape and dtype; differentiable (backward:
        ``cupylab.softmax_backward`` on the saved output).

    Raises
    ------
    TypeError
        ``x`` not a tensor, ``dim`` not an int, unsupported dtype, a CPU tensor.
    IndexError
        ``dim`` out of range.
    """
    return _softmax_like("softmax", x, dim)


def _softmax_like(name, x, dim):
    """:func:`softmax` / :func:`log_softmax` through this module's dispatch rule."""
    _tensor(name, "x", x)
    d = _dim(name, dim, x.dim())
    if x.dim() == 0:
        return _softmax_like(name, x.reshape(1), 0).reshape(())
    if _compiling():
        return getattr(torch.ops.cupylab, name)(x, d)
    if x.requires_grad and _grad_enabled():
        return _F[name].apply(x, d)
    return getattr(_kernels, name)(x, d)


def log_softmax(x, dim=-1):
    """Log-softmax of ``x`` along ``dim``, like ``torch.log_softmax(x, dim)``.

    Parameters
    ----------
    x : torch.Tensor
        CUDA tensor, float16 / bfloat16 / float32 / float64.
    dim : int

    Returns
    -------
    torch.Tensor
        New C-contiguous tensor; differentiable (backward: ``cupylab.log_softmax_backward``).

    Raises
    ------
    TypeError, IndexError
        As :func:`softmax`.
    """
    return _softmax_like("log_softmax", x, dim)


# -- norms ------------------------------------------------------------------------------------
def _normalized_shape(fn, ns):
    if isinstance(ns, int) and not isinstance(ns, bool):
        ns = (ns,)
    elif isinstance(ns, (tuple, list, torch.Size)) and all(
            isinstance(e, int) and not isinstance(e, bool) for e in ns):
        ns = tuple(ns)
    else:
        raise TypeError(f"{_name(fn)}: normalized_shape must be an int or a sequence of ints "
                        f"(got {ns!r})")
    if not ns or any(e < 0 for e in ns):
        raise ValueError(f"{_name(fn)}: normalized_shape must be non-empty with non-negative "
                         f"sizes (got {ns})")
    return ns


def _one_dim(ns):
    """The size when ``normalized_shape`` is one int (or a 1-sequence of one), else None."""
    t = type(ns)
    if t is int:
        return ns
    if (t is tuple or t is torch.Size or t is list) and len(ns) == 1 and type(ns[0]) is int:
        return ns[0]
    return None


def _vec_ok(v, n):
    return v is None or (isinstance(v, _Tensor) and v.dim() == 1 and v.shape[0] == n)


def _flatten(fn, x, normalized_shape, weight, bias=None):
    """``(x, weight, bias)`` with the ``normalized_shape`` dims of ``x`` flattened into one (a
    view when possible) and the weight and bias (None or tensors) flattened to match."""
    n = _one_dim(normalized_shape)
    if (n is not None and isinstance(x, _Tensor) and x.dim() >= 1 and x.shape[-1] == n
            and _vec_ok(weight, n) and _vec_ok(bias, n)):
        return x, weight, bias  # the common case, checked cheaply
    _tensor(fn, "x", x)
    ns = _normalized_shape(fn, normalized_shape)
    k = len(ns)
    nd = x.dim()
    if nd < k or x.shape[nd - k:] != ns:
        raise ValueError(f"{_name(fn)}: normalized_shape {ns} must match the trailing "
                         f"dimensions of x (shape {tuple(x.shape)})")
    out = []
    for param, v in (("weight", weight), ("bias", bias)):
        if v is not None:
            _tensor(fn, param, v)
            if v.shape != ns:
                raise ValueError(f"{_name(fn)}: {param} must have shape {ns} "
                                 f"(normalized_shape); got {tuple(v.shape)}")
            if k != 1:
                v = v.reshape(math.prod(ns))
        out.append(v)
    if k != 1:
        x = x.reshape(*x.shape[:nd - k], math.prod(ns))
    return x, out[0], out[1]


def _eps(fn, eps, x):
    if type(eps) is float and eps >= 0:
        return eps
    if eps is None:
        if not x.is_floating_point():
            raise TypeError(f"{_name(fn)}: x must be a floating-point tensor (got {x.dtype})")
        # torch (>= 2.7) uses float32's machine epsilon for 16-bit inputs
        return torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"{_name(fn)}: eps must be a non-negative number (got {eps!r})")
    return float(eps)


def rms_norm(x, normalized_shape, weight=None, eps=None):
    """Root-mean-square normalisation over the trailing ``normalized_shape`` dims, like
    ``torch.nn.functional.rms_norm``: ``x / sqrt(mean(x**2) + eps) * weight``.

    Parameters
    ----------
    x : torch.Tensor
        CUDA tensor, float16 / bfloat16 / float32 / float64, shape ``(..., *normalized_shape)``.
    normalized_shape : int or sequence of ints
        The trailing dims normalised together (several dims are flattened into one: a view
        when ``x``'s strides allow, else a copy).
    weight : torch.Tensor, optional
        Shape ``normalized_shape``; ``x``'s dtype, or float32 with 16-bit ``x``.
    eps : float, optional
        Default: the machine epsilon of float32 (of float64 for float64 ``x``), as torch
        (>= 2.7) computes it for 16-bit inputs too.

    Returns
    -------
    torch.Tensor
        New contiguous tensor of ``x``'s shape and dtype. With grad, the float32 ``rstd`` per
        row is saved (not the output); backward: ``cupylab.rms_norm_backward`` (deterministic
        weight gradient).

    Raises
    ------
    TypeError
        Non-tensors, a bad ``normalized_shape`` type, unsupported dtypes or a weight dtype that
        does not fit, CPU tensors.
    ValueError
        ``normalized_shape`` not matching ``x``'s trailing dims, a weight of another shape, a
        negative ``eps``.
    """
    x2, w2, _ = _flatten("rms_norm", x, normalized_shape, weight)
    eps = _eps("rms_norm", eps, x)
    if _compiling():
        y = torch.ops.cupylab.rms_norm(x2, w2, eps)[0]
    elif _wants_grad(x, weight):
        y = _F["rms_norm"].apply(x2, w2, eps)
    else:
        y = _kernels.rms_norm(x2, w2, eps, False)
    return y if x2 is x else y.view(x.shape)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Layer normalisation over the trailing ``normalized_shape`` dims, like
    ``torch.nn.functional.layer_norm`` (biased variance).

    Parameters
    ----------
    x : torch.Tensor
        CUDA tensor, float16 / bfloat16 / float32 / float64.
    normalized_shape : int or sequence of ints
        As :func:`rms_norm`.
    weight, bias : torch.Tensor, optional
        Shape ``normalized_shape``, one dtype: ``x``'s, or float32 with 16-bit ``x``.
    eps : float

    Returns
    -------
    torch.Tensor
        New contiguous tensor of ``x``'s shape and dtype. With grad, ``mean`` and ``rstd``
        per row are saved; backward: ``cupylab.layer_norm_backward``.

    Raises
    ------
    TypeError, ValueError
        As :func:`rms_norm` (also for ``bias``).
    """
    x2, w2, b2 = _flatten("layer_norm", x, normalized_shape, weight, bias)
    eps = _eps("layer_norm", eps, x)
    if _compiling():
        y = torch.ops.cupylab.layer_norm(x2, w2, b2, eps)[0]
    elif _wants_grad(x, weight, bias):
        y = _F["layer_norm"].apply(x2, w2, b2, eps)
    else:
        y = _kernels.layer_norm(x2, w2, b2, eps, False)
    return y if x2 is x else y.view(x.shape)


def _add_rms_args(fn, x, residual, weight, eps):
    _tensor(fn, "x", x)
    _tensor(fn, "residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"{_name(fn)}: residual must have the shape of x {tuple(x.shape)} "
                         f"(got {tuple(residual.shape)})")
    if x.dim() == 0:
        raise ValueError(f"{_name(fn)}: x must have at least one dimension (got a 0-d tensor)")
    if weight is not None:
        _tensor(fn, "weight", weight)
        if weight.shape != x.shape[-1:]:
            raise ValueError(f"{_name(fn)}: weight must have shape ({x.shape[-1]},) (got "
                             f"{tuple(weight.shape)})")
    return _eps(fn, eps, x)


def add_rms_norm(x, residual, weight, eps=1e-6, *, out_dtype=None):
    """``h = x + residual`` and ``y = rms_norm(h, weight, eps)`` over the last dim in one
    pass (the pre-norm transformer block's residual update).

    Parameters
    ----------
    x, residual : torch.Tensor
        CUDA tensors of one shape: of one dtype (float16 / bfloat16 / float32 / float64), or a
        float32 ``residual`` (the float32 residual stream of mixed-precision training) under a
        float16 / bfloat16 / float32 ``x`` (the branch, e.g. a matrix multiply's output under
        autocast).
    weight : torch.Tensor or None
        Shape ``(x.shape[-1],)``; ``x``'s dtype or float32 with 16-bit ``x``; float32 over a
        float32 residual stream.
    eps : float
    out_dtype : torch.dtype, optional
        The dtype of ``y`` (float16, bfloat16 or float32), written once in the normalising
        pass: the dtype its consumer wants, e.g. ``torch.get_autocast_dtype("cuda")`` when
        the next matrix multiply runs under autocast, which would otherwise cast a float32
        ``y`` in a kernel of its own. Default: ``h``'s dtype. Needs a float32 ``residual``
        unless it is ``x``'s dtype.

    Returns
    -------
    (y, h) : tuple of torch.Tensor
        New contiguous tensors. With one dtype, ``h`` is rounded to it before it is
        normalised; over a float32 residual stream ``h`` is float32 (``x`` widened, never
        rounded) and ``y`` is ``out_dtype``. Both are differentiable (the gradient reaching
        ``h`` adds to that from ``y``; over a float32 stream in the same pass, which also
        writes the gradient of ``x`` in its dtype); with grad, ``h`` (an output) and ``rstd``
        are saved.

    Raises
    ------
    TypeError
        Non-tensors, unsupported or mismatched dtypes, CPU tensors.
    ValueError
        Shapes that do not match, a 0-d ``x``, a negative ``eps``.
    """
    eps = _add_rms_args("add_rms_norm", x, residual, weight, eps)
    if residual.dtype != x.dtype or (out_dtype is not None and out_dtype != x.dtype):
        od = _mixed_dtypes(x, residual, weight, out_dtype)
        if _compiling():
            y, h, _ = torch.ops.cupylab.add_rms_norm_mixed(x, residual, weight, eps, od)
            return y, h
        if _wants_grad(x, residual, weight):
            y, h = _F["add_rms_norm_mixed"].apply(x, residual, weight, eps, od)
            return y, h
        return _kernels.add_rms_norm_mixed(x, residual, weight, eps, od, False)
    if _compiling():
        y, h, _ = torch.ops.cupylab.add_rms_norm(x, residual, weight, eps)
        return y, h
    if _wants_grad(x, residual, weight):
        y, h = _F["add_rms_norm"].apply(x, residual, weight, eps)
        return y, h
    return _kernels.add_rms_norm(x, residual, weight, eps, False)


_STREAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _mixed_dtypes(x, residual, weight, out_dtype):
    """The dtype of ``y`` over a float32 residual stream, after checking the dtypes."""
    fn = "add_rms_norm"
    if residual.dtype != torch.float32:
        raise TypeError(f"{_name(fn)}: residual must have x's dtype ({x.dtype}), or be "
                        f"torch.float32 (a float32 residual stream); got {residual.dtype}")
    if x.dtype not in _STREAM_DTYPES:
        raise TypeError(f"{_name(fn)}: x must be float16, bfloat16 or float32 over a float32 "
                        f"residual (got {x.dtype})")
    if weight is not None and weight.dtype != torch.float32:
        raise TypeError(f"{_name(fn)}: weight must be float32 over a float32 residual (got "
                        f"{weight.dtype})")
    od = torch.float32 if out_dtype is None else out_dtype
    if od not in _STREAM_DTYPES:
        raise TypeError(f"{_name(fn)}: out_dtype must be torch.float16, torch.bfloat16 or "
                        f"torch.float32 (got {out_dtype!r})")
    return od


def add_rms_norm_(x, residual, weight, eps=1e-6):
    """:func:`add_rms_norm` writing ``h`` into ``residual`` in place; returns ``y``.

    Without grad (``torch.no_grad()``, inference mode, or no input requiring grad) one kernel
    reads ``x`` and ``residual`` and writes ``y`` and ``h`` (into ``residual``; its version
    counter is bumped); under torch.compile this is the registered operator
    ``torch.ops.cupylab.add_rms_norm_``, which declares that it mutates ``residual``. With
    grad, ``h`` is computed out of place and copied into ``residual`` with
    ``residual.copy_(h)``, so autograd sees an ordinary in-place update (one extra pass;
    a leaf ``residual`` that requires grad is refused by torch, as for any in-place op).

    Parameters
    ----------
    x : torch.Tensor
    residual : torch.Tensor
        Of ``x``'s shape and dtype; written. A tensor of more than three dims must be
        contiguous.
    weight : torch.Tensor or None
    eps : float

    Returns
    -------
    torch.Tensor
        ``y``.

    Raises
    ------
    TypeError, ValueError
        As :func:`add_rms_norm`; also a residual that cannot be written (a broadcast view, one
        overlapping ``x`` or the weight).
    RuntimeError
        An inference tensor as ``residual`` outside ``torch.inference_mode()`` (as torch's
        in-place operations).
    """
    eps = _add_rms_args("add_rms_norm_", x, residual, weight, eps)
    if _wants_grad(x, residual, weight):
        y, h = add_rms_norm(x, residual, weight, eps)
        residual.copy_(h)
        return y
    if _compiling():
        return torch.ops.cupylab.add_rms_norm_(x, residual, weight, eps)
    if residual.is_inference():
        if not torch.is_inference_mode_enabled():  # torch's rule for in-place updates
            raise RuntimeError("add_rms_norm_: residual is an inference tensor; it can be "
                               "updated in place only inside torch.inference_mode()")
        return _kernels.add_rms_norm_(x, residual, weight, eps)
    y = _kernels.add_rms_norm_(x, residual, weight, eps)
    torch.autograd.graph.increment_version(residual)
    return y


# -- cross-entropy ----------------------------------------------------------------------------
def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    """Softmax cross-entropy against class indices, like ``torch.nn.functional.cross_entropy``
    (same parameters in the same order; no class weights).

    When ``input`` requires grad, the forward reads the logits once and keeps the per-row
    log-sum-exp beside them (cupylab's ``cross_entropy(..., return_lse=True)``); the backward
    computes the gradient times the output gradient in one pass over the saved logits
    (``cupylab.cross_entropy_backward``): three passes over logits-sized memory in all.

    Parameters
    ----------
    input : torch.Tensor
        Logits, CUDA, float16 / bfloat16 / float32 / float64: shape ``(C,)``, ``(N, C)``, or
        ``(N, C, d1, ...)`` (classes in dim 1, as torch; that layout goes through cupylab's
        strided kernel). For language models pass ``(N, C)``
        (``logits.view(-1, vocab)``).
    target : torch.Tensor
        Class indices, int64 or int32: shape ``()``, ``(N,)`` or ``(N, d1, ...)``. Indices out
        of range (other than ``ignore_index``) give NaN (not checked on the host).
    weight : None
        Class weights are not supported; anything but None raises ``ValueError``.
    size_average, reduce : None
        torch's deprecated forms of ``reduction``; anything but None raises ``ValueError``.
    ignore_index : int
        Rows with this target count neither in the loss nor in the mean's denominator.
    reduction : {"mean", "sum", "none"}
        ``"mean"`` over no counted row is NaN, as torch.
    label_smoothing : float in [0, 1]

    Returns
    -------
    torch.Tensor
        0-d for ``"mean"`` / ``"sum"``, ``target``'s shape for ``"none"``; in ``input``'s dtype
        (computed in float32, float64 for float64), or float32 for 16-bit ``input`` under
        CUDA autocast (as torch, which autocasts cross-entropy to float32).

    Raises
    ------
    TypeError
        Non-tensors, a floating-point ``target`` (class probabilities are not supported),
        ``ignore_index`` not an int, unsupported dtypes, CPU tensors.
    ValueError
        ``weight``, ``size_average`` or ``reduce`` given, an unknown ``reduction``,
        ``label_smoothing`` outside [0, 1], ``target`` of the wrong shape, a 0-d ``input``.
    """
    fn = "cross_entropy"
    if weight is not None:
        raise ValueError(f"{_name(fn)}: weight (class weights) is not supported; use "
                         "torch.nn.functional.cross_entropy for weighted losses")
    if size_average is not None or reduce is not None:
        raise ValueError(f"{_name(fn)}: size_average and reduce (deprecated in torch) are not "
                         "supported; use reduction")
    _tensor(fn, "input", input)
    _tensor(fn, "target", target)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{_name(fn)}: reduction must be one of {_REDUCTIONS} (got "
                         f"{reduction!r})")
    if (not isinstance(label_smoothing, numbers.Real) or isinstance(label_smoothing, bool)
            or not 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"{_name(fn)}: label_smoothing must be a number in [0, 1] (got "
                         f"{label_smoothing!r})")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"{_name(fn)}: ignore_index must be an int (got {ignore_index!r})")
    if target.dtype != torch.int64 and target.dtype != torch.int32:
        raise TypeError(f"{_name(fn)}: target must hold class indices (int64 or int32; class "
                        f"probabilities are not supported); got {target.dtype}")
    nd = input.dim()
    if nd == 0:
        raise ValueError(f"{_name(fn)}: input must have at least one dimension (got a 0-d "
                         "tensor)")
    logits = input.movedim(1, -1) if nd > 2 else input
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"{_name(fn)}: target must have shape {tuple(logits.shape[:-1])} for "
                         f"input of shape {tuple(input.shape)} (got {tuple(target.shape)})")
    ls = float(label_smoothing)
    # under autocast torch computes cross-entropy in float32 and returns a float32 loss; the
    # kernel reads 16-bit logits as they are and accumulates in float32 anyway
    f32 = (logits.dtype in (torch.float16, torch.bfloat16)
           and torch.is_autocast_enabled("cuda"))
    if _compiling():
        need = input.requires_grad and _grad_enabled()
        return torch.ops.cupylab.cross_entropy(logits, target, ignore_index, reduction, ls,
                                               need, f32)[0]
    if input.requires_grad and _grad_enabled():
        return _F["cross_entropy"].apply(logits, target, ignore_index, reduction, ls, True,
                                         f32)
    return _kernels.cross_entropy_loss(logits, target, ignore_index, reduction, ls, f32)


# -- elementwise ------------------------------------------------------------------------------
def _binary_args(fn, a, b):
    _tensor(fn, "input", a)
    _tensor(fn, "other", b)


_BINARY_DOC = """``{expr}`` for two CUDA tensors, like ``torch.{torch_name}(input, other)``:
    broadcasting, torch's type promotion{extra}, any strides (cupylab's elementwise kernels).

    Parameters
    ----------
    input, other : torch.Tensor
        CUDA tensors of any cupylab dtype (0-d tensors take part in promotion by category, as
        in torch; they must be on the GPU too).

    Returns
    -------
    torch.Tensor
        New C-contiguous tensor of the broadcast shape. Differentiable for floating-point
        inputs (gradients summed over broadcast dims and cast to each input's dtype).

    Raises
    ------
    TypeError
        Non-tensor operands (use a 0-d CUDA tensor for a scalar), combinations torch refuses,
        CPU tensors.
    ValueError
        Shapes that do not broadcast.
"""


def _binary(name, expr, extra=""):
    """The public function of the binary operator ``name`` (the dispatch rule of this
    module: registered operator while compiling, autograd Function with grad, else the
    kernel)."""
    def f(input, other):
        _binary_args(name, input, other)
        if _compiling():
            return getattr(torch.ops.cupylab, name)(input, other)
        if _wants_grad(input, other):
            return _F[name].apply(input, other)
        return getattr(_kernels, name)(input, other)

    f.__name__ = f.__qualname__ = name
    f.__doc__ = _BINARY_DOC.format(expr=expr, torch_name=name, extra=extra)
    return f


add = _binary("add", "input + other")
subtract = _binary("subtract", "input - other", " (bool tensors refused, as torch)")
multiply = _binary("multiply", "input * other")
divide = _binary("divide", "input / other",
                 " (true division: integers give the default float dtype)")


def fused_add_mul(a, b, s):
    """``(a + b) * s`` in one pass (cupylab's ``fused_add_mul``).

    Parameters
    ----------
    a, b : torch.Tensor
        CUDA tensors, broadcast together.
    s : torch.Tensor or number
        A tensor (broadcast with ``a`` and ``b``) or a Python number.

    Returns
    -------
    torch.Tensor
        New C-contiguous tensor of the broadcast shape, in the dtype torch gives
        ``(a + b) * s`` (``a + b`` promoted first, then with ``s``); the sum is computed in
        that dtype. Differentiable for floating-point inputs: ``d(a) = d(b) = g * s`` and
        ``d(s) = g * (a + b)`` (recomputed from the saved ``a`` and ``b``).

    Raises
    ------
    TypeError
        ``a`` or ``b`` not tensors, ``s`` neither a tensor nor a number, CPU tensors.
    ValueError
        Shapes that do not broadcast.
    """
    _tensor("fused_add_mul", "a", a)
    _tensor("fused_add_mul", "b", b)
    if isinstance(s, _Tensor):
        if _compiling():
            return torch.ops.cupylab.fused_add_mul(a, b, s)
        if _wants_grad(a, b, s):
            return _F["fused_add_mul"].apply(a, b, s)
        return _kernels.fused_add_mul(a, b, s)
    if not isinstance(s, numbers.Number):
        raise TypeError(f"{_name('fused_add_mul')}: s must be a torch.Tensor or a number (got "
                        f"{type(s).__name__})")
    if _compiling():
        return torch.ops.cupylab.fused_add_mul_scalar(a, b, s)
    if _wants_grad(a, b):
        return _F["fused_add_mul_scalar"].apply(a, b, s)
    return _kernels.fused_add_mul_scalar(a, b, s)
