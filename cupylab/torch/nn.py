"""Drop-in ``torch.nn`` modules whose forward (and backward) run cupylab's row-wise kernels.

:class:`RMSNorm`, :class:`LayerNorm`, :class:`Softmax`, :class:`LogSoftmax` and
:class:`CrossEntropyLoss` subclass torch's own modules and override only ``forward``: the same
constructor arguments, attributes, parameter and buffer names, ``state_dict`` keys,
``extra_repr`` and ``isinstance`` checks as ``torch.nn``'s, so checkpoints load either way.
The forward calls :mod:`cupylab.torch.functional` (differentiable, usable under
``torch.compile(fullgraph=True)``).

:func:`swap_modules` turns the matching ``torch.nn`` modules of an existing model into these,
in place, keeping every parameter tensor.

When torch's own forward runs instead
---------------------------------------
Each module falls back to the ``torch.nn`` parent's forward (same result as torch, no error)
for what cupylab does not compute:

* inputs that are not on a CUDA device, or whose dtype is not float16, bfloat16, float32 or
  float64;
* ``RMSNorm`` / ``LayerNorm`` whose weight (or bias) dtype is not the input's (a float32
  weight with a float16 / bfloat16 input excepted), or whose weight and bias differ in dtype;
* ``Softmax(dim=None)`` / ``LogSoftmax(dim=None)`` (torch's legacy implicit dimension);
* ``CrossEntropyLoss`` with class weights (``weight=``) or targets other than int64 class
  indices (class probabilities).

Under autocast, torch's modules run ``layer_norm``, ``softmax``, ``log_softmax``,
``cross_entropy`` and (in recent versions) ``rms_norm`` in float32 (16-bit inputs are copied
to float32 first, and the outputs are float32); autocast does not cast cupylab's operators:
16-bit inputs are read as they are, accumulated in float32, and the outputs keep the input's
dtype (the cross-entropy loss excepted: float32, as torch's).

Tensor subclasses (DTensor, nested tensors, FakeTensor outside torch.compile) and
non-strided layouts run torch's own forward.
"""
from __future__ import annotations

import torch

from . import functional as _F

__all__ = ["RMSNorm", "LayerNorm", "Softmax", "LogSoftmax", "CrossEntropyLoss",
           "swap_modules"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STRIDED, _TENSOR = torch.strided, torch.Tensor
_compiling = torch.compiler.is_compiling


def _gpu_float(x):
    """True when ``x`` is a plain dense CUDA tensor of a dtype cupylab's row-wise kernels
    compute. In eager mode tensor subclasses (DTensor, FakeTensor, nested tensors) and other
    layouts run torch's own forward; while torch.compile traces, every tensor it traces is a
    subclass (FakeTensor, functional wrappers), so any CUDA tensor takes cupylab's op there
    (a DTensor model compiled with these modules gets no sharding rule for it)."""
    return ((type(x) is _TENSOR or (_compiling() and isinstance(x, _TENSOR)))
            and x.is_cuda and x.dtype in _FLOATS and x.layout is _STRIDED)


_HALVES = (torch.float16, torch.bfloat16)
# torch.nn.RMSNorm's eps=None: the machine epsilon of the computation (opmath) dtype
_EPS32 = torch.finfo(torch.float32).eps
_EPS64 = torch.finfo(torch.float64).eps


def _param_ok(p, x):
    """True for no parameter, one of the input's dtype, or float32 with a 16-bit input."""
    return p is None or p.dtype == x.dtype or (p.dtype == torch.float32 and x.dtype in _HALVES)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by cupylab (see the module docstring for the fallback).

    Parameters
    ----------
    normalized_shape : int or sequence of int
        The trailing shape normalised over.
    eps : float, optional
        Added to the mean square; ``None`` as ``torch.nn.RMSNorm``: the machine epsilon of the
        computation dtype, ``torch.finfo(torch.float32).eps`` for float16, bfloat16 and float32
        inputs, ``torch.finfo(torch.float64).eps`` for float64.
    elementwise_affine : bool
        With a learnable ``weight`` (initialised to ones) when True.
    device, dtype
        Of the weight, as torch's.

    Notes
    -----
    ``forward(x)`` returns ``cupylab.torch.functional.rms_norm(x, normalized_shape, weight,
    eps)`` for CUDA floating inputs (``eps=None`` resolved here, as above), else
    ``torch.nn.RMSNorm.forward(x)``. Differentiable in ``x`` and ``weight``.
    """

    def forward(self, x):
        """Normalise ``x`` over its trailing ``normalized_shape`` dimensions."""
        if not (_gpu_float(x) and _param_ok(self.weight, x)):
            return super().forward(x)
        eps = self.eps
        if eps is None:
            eps = _EPS64 if x.dtype == torch.float64 else _EPS32
        return _F.rms_norm(x, self.normalized_shape, self.weight, eps)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by cupylab (see the module docstring for the
    fallback).

    Parameters
    ----------
    normalized_shape : int or sequence of int
    eps : float
    elementwise_affine : bool
        With learnable ``weight`` (ones) and, when ``bias`` is True, ``bias`` (zeros).
    bias : bool
    device, dtype
        As ``torch.nn.LayerNorm``.

    Notes
    -----
    ``forward(x)`` returns ``cupylab.torch.functional.layer_norm(x, normalized_shape, weight,
    bias, eps)`` for CUDA floating inputs (biased variance, like torch), else
    ``torch.nn.LayerNorm.forward(x)``. Every ``elementwise_affine`` / ``bias`` combination
    runs on cupylab.
    """

    def forward(self, x):
        """Normalise ``x`` over its trailing ``normalized_shape`` dimensions."""
        w, b = self.weight, self.bias
        if not (_gpu_float(x) and _param_ok(w, x) and _param_ok(b, x)
                and (w is None or b is None or w.dtype == b.dtype)):
            return super().forward(x)
        return _F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class Softmax(torch.nn.Softmax):
    """``torch.nn.Softmax`` computed by cupylab.

    Parameters
    ----------
    dim : int or None
        The dimension softmax is taken over. ``None`` (torch's legacy implicit choice, with its
        deprecation warning) runs torch's own forward.
    """

    def forward(self, x):
        """Softmax of ``x`` along ``dim``."""
        if self.dim is None or not _gpu_float(x):
            return super().forward(x)
        return _F.softmax(x, self.dim)


class LogSoftmax(torch.nn.LogSoftmax):
    """``torch.nn.LogSoftmax`` computed by cupylab.

    Parameters
    ----------
    dim : int or None
        As :class:`Softmax`: ``None`` runs torch's own forward.
    """

    def forward(self, x):
        """Log-softmax of ``x`` along ``dim``."""
        if self.dim is None or not _gpu_float(x):
            return super().forward(x)
        return _F.log_softmax(x, self.dim)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` computed by cupylab for int64 class-index targets.

    Parameters
    ----------
    weight : tensor, optional
        Class weights: accepted (and kept as the ``weight`` buffer, as torch does), but then
        every call runs torch's own forward.
    size_average, reduce
        torch's deprecated arguments, turned into ``reduction`` by torch.
    ignore_index : int
    reduction : {"mean", "sum", "none"}
    label_smoothing : float in [0, 1]

    Notes
    -----
    ``forward(input, target)`` returns ``cupylab.torch.functional.cross_entropy(input, target,
    ignore_index, reduction, label_smoothing)`` for CUDA floating ``(C,)``, ``(N, C)`` or
    ``(N, C, d1, ...)`` inputs with int64 class indices of shape ``()``, ``(N,)`` or ``(N, d1,
    ...)`` and no class weights; anything else runs ``torch.nn.CrossEntropyLoss.forward``.
    ``(N, C)`` logits are read row by row, once (flatten ``(B, T, C)`` language-model logits
    to ``(B * T, C)``, a view); the class dimension of ``(N, C, d1, ...)`` inputs is strided.
    """

    def forward(self, input, target):  # noqa: A002 - torch's parameter name
        """The loss of ``input`` logits against ``target`` class indices."""
        if (not _gpu_float(input) or not isinstance(target, _TENSOR) or self.weight is not None
                or target.dtype != torch.int64 or target.dim() != input.dim() - 1):
            return super().forward(input, target)
        return _F.cross_entropy(input, target, ignore_index=self.ignore_index,
                                reduction=self.reduction, label_smoothing=self.label_smoothing)


_SWAPS = {torch.nn.RMSNorm: RMSNorm, torch.nn.LayerNorm: LayerNorm, torch.nn.Softmax: Softmax,
          torch.nn.LogSoftmax: LogSoftmax, torch.nn.CrossEntropyLoss: CrossEntropyLoss}


def swap_modules(model, types=None):
    """Make the ``torch.nn`` norm, softmax and cross-entropy modules of ``model`` cupylab's,
    in place.

    Every submodule (``model`` itself included) whose type is exactly ``torch.nn.RMSNorm``,
    ``LayerNorm``, ``Softmax``, ``LogSoftmax`` or ``CrossEntropyLoss`` gets the matching class
    of this module as its class. The module objects stay the same objects: their parameters
    and buffers (the same tensors, so an optimizer built before still updates them), hooks,
    attributes and references held elsewhere are untouched; only ``forward`` changes. The
    ``state_dict`` keys do not change.

    Parameters
    ----------
    model : torch.nn.Module
        Swap before ``torch.compile`` (a compiled module's graphs were traced with torch's
        forward).
    types : class or iterable of classes, optional
        Which ``torch.nn`` classes to swap (``torch.nn.LayerNorm`` or
        ``cupylab.torch.nn.LayerNorm`` name the same swap); default all five.

    Returns
    -------
    int
        How many modules were swapped. Subclasses of the ``torch.nn`` classes (a model's own
        ``LayerNorm`` subclass with its own forward) and modules already swapped are left
        alone and not counted.

    Raises
    ------
    TypeError
        ``model`` is not a ``torch.nn.Module``, or ``types`` names a class that is not one of
        the five.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"swap_modules: model must be a torch.nn.Module (got "
                        f"{type(model).__name__})")
    if types is None:
        table = _SWAPS
    else:
        if isinstance(types, type):
            types = (types,)
        table = {}
        for t in types:
            src = next((k for k, v in _SWAPS.items() if t is k or t is v), None)
            if src is None:
                names = ", ".join(f"torch.nn.{k.__name__}" for k in _SWAPS)
                raise TypeError(f"swap_modules: types must be among {names} (got {t!r})")
            table[src] = _SWAPS[src]
    n = 0
    for m in model.modules():
        new = table.get(type(m))
        if new is not None:
            m.__class__ = new
            n += 1
    return n
