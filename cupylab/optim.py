"""Fused optimizer steps over lists of arrays from any framework (one launch per dtype group).

Functional, framework-neutral: the caller owns the parameters, gradients and state arrays
(``cupylab.torch.optim`` wraps these as drop-in ``torch.optim`` optimizers). Each function
updates ``params`` and the state lists in place with torch's fused-optimizer math, computed
in float32 (float64 for float64 params), and returns ``None``.

The lists follow the rules of :mod:`cupylab.ops.multi_tensor` (one framework, one GPU,
C-contiguous, the arrays at one position of the same shape; written arrays must not overlap
any other array). Supported dtypes, per position:

===========  =====================  ==========================================
params       states                 ``master_params``
===========  =====================  ==========================================
float32      float32                not allowed
float64      float64                not allowed
bfloat16     bfloat16 or float32    float32, only with float32 states
float16      float16 or float32     float32, only with float32 states
===========  =====================  ==========================================

Gradients have their param's dtype; the state arrays of one position share one dtype.

Host scalars and device scalars: ``lr`` (and Adam's ``step``) may be Python numbers or
one-element float32 GPU arrays that the kernel reads, which keeps a step capturable in a CUDA
graph with values that change between replays; ``found_inf`` and ``grad_scale`` are always
device arrays. Nothing synchronises the host.
"""
from __future__ import annotations

import math

from . import _launch
from .ops import _mt_core as F
from .ops import _mt_plan as P

__all__ = ["adam_", "adamw_", "sgd_", "lion_", "increment_step_"]

_COMBOS = {(p, s, m) for p, s, m in P.OPTIM_COMBOS}


# Docstring pieces of the optimizer steps (with those of the foreach operators, in _mt_core).
_DOC_PIECES = {**F._DOC_PIECES, **{
    "{lr_param}": """\
lr : int, float or one-element float32 GPU array
    The learning rate. A Python number must be finite and >= 0. A device array (on the
    params' GPU, any framework) is read by the kernel: not checked, capturable, and free
    to change between CUDA graph replays.""",
    "{tail_params}": """\
maximize : bool, default False
    Step along the gradient instead of against it (the gradient is negated first).
master_params : list or tuple of float32 GPU arrays, optional
    Written: one float32 master copy per param, for bfloat16 / float16 params with float32
    states. The step updates the master copy and writes its rounding to the param (the
    param's old value is not read).
found_inf : one-element float32 GPU array, optional
    Read by the kernels: when it holds a nonzero value, they leave every array unchanged
    (a skipped mixed-precision step, decided on the device).
grad_scale : one-element float32 GPU array, optional
    Read by the kernels: every gradient is divided by it on the fly (unscaling fused into
    the step; the ``grads`` arrays are not written). A value of 0 means no scaling.""",
    "{optim_type_errors}": """\
``grads[i]`` of another dtype than ``params[i]``; state arrays of one position with
different dtypes; a dtype combination outside the table of :mod:`cupylab.optim`
(``master_params`` not float32, or given for float32 / float64 params or 16-bit
states); a device ``lr``, ``found_inf`` or ``grad_scale`` (or Adam's device ``step``)
that is not a one-element float32 GPU array, or an ``lr`` that is neither a Python
number nor a GPU array (``bool``, NumPy scalars other than ``numpy.float64``).""",
    "{adam_list_params}": """\
params : list or tuple of GPU arrays
    Written in place: float16, bfloat16, float32 or float64, C-contiguous.
grads : list or tuple of GPU arrays
    Read: ``grads[i]`` of the shape and dtype of ``params[i]``.
exp_avgs, exp_avg_sqs : list or tuple of GPU arrays
    Written: the first and second moments, of the params' shapes; at one position both
    of one dtype from the table of :mod:`cupylab.optim`.""",
    "{step_param}": """\
step : int, float or one-element float32 GPU array
    The number of this update, 1 for the first, for the bias corrections. A Python number
    (not a ``bool``) must be finite and >= 1; the corrections are then computed on the
    host in float64. A device array (on the params' GPU) is read by the kernel, which
    computes the corrections from it in float64: not checked, capturable, advanced on the
    device by :func:`increment_step_`.""",
    "{beta_params}": """\
beta1 : float, default 0.9
    Decay of the first moment; a finite Python number in [0, 1).
beta2 : float, default 0.999
    Decay of the second moment; a finite Python number in [0, 1).""",
    "{adam_raises}": """\
TypeError
    ``eps``, ``weight_decay``, ``beta1`` or ``beta2`` not a Python ``int`` or ``float``
    (``bool`` included; checked before the lists); a ``bool`` ``step`` (checked only
    when the lists are not empty).
    {optim_type_errors}
    {list_type_errors}
ValueError
    ``eps`` or ``weight_decay`` below 0 or not finite, ``beta1`` or ``beta2`` outside
    [0, 1) or not finite (checked before the lists); a number ``lr`` that is negative or
    not finite; a number ``step`` below 1 or not finite (checked only when the lists are
    not empty).
    {optim_value_errors}
    {list_value_errors}
{runtime_errors}""",
    "{optim_value_errors}": """\
A device ``lr``, ``found_inf``, ``grad_scale`` or ``step`` on another GPU than the
lists.""",
    "{optim_notes}": """\
The hyper-parameters are checked before the lists, even when the lists are empty (then
nothing else happens); the device scalars are checked only when there is something to
update. Launches go to ``stream``, one per group of positions with the same dtypes, and
nothing synchronises the host. As for :mod:`cupylab.foreach`, CuPy and torch lists are
checked and packed on the first call and found in a cache afterwards (by the identity of
the arrays and, for torch, their data pointers): new gradient arrays at every step mean
a new check and table upload at every step. :func:`cupylab.foreach.prepare` can freeze
a step (Python-number hyper-parameters, a number ``step`` included, are then frozen
too).""",
}}


def _doc(f):
    return F._fill_doc(f, _DOC_PIECES)


def _check_combo(opname, plan, state_slots, master_slot):
    for g in plan.groups:
        p = g.sig[0]
        states = {g.sig[k] for k in state_slots if g.sig[k] is not None}
        if len(states) > 1:
            raise TypeError(f"{opname}: the state arrays of one parameter have different "
                            f"dtypes {sorted(states)}")
        m = g.sig[master_slot] is not None
        # no state list (SGD without momentum): the kernel's state type is float32 with
        # master copies, else the param's
        s = states.pop() if states else ("float32" if m else p)
        if m and g.sig[master_slot] != "float32":
            raise TypeError(f"{opname}: master_params must be float32 (got {g.sig[master_slot]})")
        if (p, s, m) not in _COMBOS:
            raise TypeError(
                f"{opname}: unsupported dtypes: params {p}, states {s}"
                f"{', with master copies' if m else ''}; supported (params, states, master): "
                + ", ".join(f"({a}, {b}, {c})" for a, b, c in P.OPTIM_COMBOS))
        g_state = s
        yield g, p, g_state, m


def _kernels_for(opname, plan, state_slots, master_slot, key, name_of):
    """``{group signature: kernel}`` of a plan's step (:func:`_check_combo` first; ``name_of(g,
    param dtype, state dtype, master)`` names a group's kernel), kept on the plan under
    ``key`` (the kernel family and every setting its names depend on): a plan's groups do not
    change, so a step over an unchanged list checks and names them once."""
    memo = getattr(plan, "kernels", None)
    if memo is None:
        memo = plan.kernels = {}
    kern = memo.get(key)
    if kern is None:
        kern = {g.sig: P.kernel("optim", name_of(g, p, st, m))
                for g, p, st, m in _check_combo(opname, plan, state_slots, master_slot)}
        memo[key] = kern
    return kern


def _opt(opname, plan, lr, found_inf, grad_scale, s):
    lr_v, lr_p = F._scalar_or_device(opname, "lr", lr, plan, s)
    fi = (F.device_scalar(opname, "found_inf", found_inf, plan, stream=s)
          if found_inf is not None else 0)
    gs = (F.device_scalar(opname, "grad_scale", grad_scale, plan, stream=s)
          if grad_scale is not None else 0)
    return lr_v, lr_p, fi, gs


def _finite(v):
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _check_pos(opname, **kw):
    """Python numbers, finite and >= 0: TypeError for anything else than an ``int`` or
    ``float`` (``bool`` included), ValueError for a number out of range."""
    for k, v in kw.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{opname}: {k} must be a Python int or float (got {v!r})")
        if not _finite(v) or v < 0:
            raise ValueError(f"{opname}: {k} must be a finite number >= 0 (got {v!r})")


def _check_betas(opname, **kw):
    """Betas in [0, 1), as torch requires (beta2 = 1 makes every Adam update 0/0)."""
    _check_pos(opname, **kw)
    for k, v in kw.items():
        if not v < 1:
            raise ValueError(f"{opname}: {k} must be < 1 (got {v!r})")


def _check_lr(opname, lr):
    """A number lr: finite and >= 0 (torch refuses a negative one); a device array is read by
    the kernel as it is."""
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        _check_pos(opname, lr=lr)


def _launcher(plan, kernel_for, args, s):
    """The launches of a checked step, as a function of no arguments."""
    def launch():
        with _launch.ensure_device(plan.device):
            P.launch(plan, kernel_for, args, s)
    return launch


def adam_launcher(opname, plan, s, *, lr, beta1, beta2, eps, weight_decay, step, adamw,
                  maximize, found_inf, grad_scale):
    """Check an Adam step for a resolved plan (slots: param, grad, exp_avg, exp_avg_sq,
    master) and return a function of no arguments that launches its kernels. Nothing is
    launched or changed before that function is called, so a caller can check several steps
    (every param group of an optimizer) before launching any. ``step``: a number (this
    update's step, >= 1) or a device float32 array."""
    with _launch.ensure_device(plan.device):
        lr_v, lr_p, fi, gs = _opt(opname, plan, lr, found_inf, grad_scale, s)
        if isinstance(step, bool):
            raise TypeError(f"{opname}: step must be a Python int or float or a one-element "
                            f"float32 GPU array (got {step!r})")
        if isinstance(step, (int, float)):
            if not (_finite(step) and step >= 1):
                raise ValueError(f"{opname}: step must be a finite number >= 1 (got {step})")
            bc1, bc2s, st_p = 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step), 0
        else:
            bc1, bc2s, st_p = 1.0, 1.0, F.device_scalar(opname, "step", step, plan, stream=s)
        args = F._args((lr_v, beta1, beta2, eps, weight_decay, bc1, bc2s, 1.0 if maximize else 0.0),
                       (lr_p, st_p, fi, gs))
        kern = _kernels_for(opname, plan, (2, 3), 4, ("adam", adamw, P.ADAM_F32_U, P.OPTIM_U),
                            lambda g, p, st, m: P.adam_name(p, st, m, adamw))
    return _launcher(plan, kern.__getitem__, args, s)


@_doc
def adam_(params, grads, exp_avgs, exp_avg_sqs, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8,
          weight_decay=0.0, maximize=False, master_params=None, found_inf=None,
          grad_scale=None, adamw=False, stream=None):
    """One Adam step over lists, in place (AdamW with ``adamw=True``).

    Per element, as ``torch.optim.Adam(fused=True)``: ``g = grad / grad_scale`` (when
    given), negated with ``maximize``; ``g += weight_decay * p`` (L2; with ``adamw=True``
    instead ``p -= lr * weight_decay * p``); ``m = beta1 * m + (1 - beta1) * g``;
    ``v = beta2 * v + (1 - beta2) * g * g``; ``p -= lr / (1 - beta1 ** step) * m /
    (sqrt(v) / sqrt(1 - beta2 ** step) + eps)``.

    Parameters
    ----------
    {adam_list_params}
    {lr_param}
    {step_param}
    {beta_params}
    eps : float, default 1e-8
        Added to the denominator; a finite Python number >= 0.
    weight_decay : float, default 0.0
        L2 penalty added to the gradient (decoupled, as AdamW, with ``adamw=True``); a
        finite Python number >= 0.
    {tail_params}
    adamw : bool, default False
        Decoupled weight decay (AdamW): what :func:`adamw_` passes.
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    {adam_raises}

    Notes
    -----
    {optim_notes}
    """
    name = "adamw_" if adamw else "adam_"
    _check_pos(name, eps=eps, weight_decay=weight_decay)
    _check_betas(name, beta1=beta1, beta2=beta2)
    _check_lr(name, lr)
    lists = [params, grads, exp_avgs, exp_avg_sqs, master_params]
    writes = 0b1101 | (0b10000 if master_params is not None else 0)
    plan, s = F.resolve(name, ["params", "grads", "exp_avgs", "exp_avg_sqs", "master_params"],
                        lists, writes, same_dtype=(1,), stream=stream, optional=(4,))
    if plan is not None:
        adam_launcher(name, plan, s, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      weight_decay=weight_decay, step=step, adamw=adamw, maximize=maximize,
                      found_inf=found_inf, grad_scale=grad_scale)()


@_doc
def adamw_(params, grads, exp_avgs, exp_avg_sqs, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8,
           weight_decay=1e-2, maximize=False, master_params=None, found_inf=None,
           grad_scale=None, stream=None):
    """One AdamW step over lists, in place: Adam with decoupled weight decay.

    Per element, as ``torch.optim.AdamW(fused=True)``: ``g = grad / grad_scale`` (when
    given), negated with ``maximize``; ``p *= 1 - lr * weight_decay``;
    ``m = beta1 * m + (1 - beta1) * g``; ``v = beta2 * v + (1 - beta2) * g * g``;
    ``p -= lr / (1 - beta1 ** step) * m / (sqrt(v) / sqrt(1 - beta2 ** step) + eps)``.
    The same as ``adam_(..., adamw=True)``, with AdamW's default ``weight_decay``.

    Parameters
    ----------
    {adam_list_params}
    {lr_param}
    {step_param}
    {beta_params}
    eps : float, default 1e-8
        Added to the denominator; a finite Python number >= 0.
    weight_decay : float, default 1e-2
        Decoupled weight decay (the param shrinks by ``lr * weight_decay`` of itself before
        the Adam update); a finite Python number >= 0.
    {tail_params}
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    {adam_raises}

    Notes
    -----
    {optim_notes}
    """
    adam_(params, grads, exp_avgs, exp_avg_sqs, lr=lr, step=step, beta1=beta1, beta2=beta2,
          eps=eps, weight_decay=weight_decay, maximize=maximize, master_params=master_params,
          found_inf=found_inf, grad_scale=grad_scale, adamw=True, stream=stream)


def sgd_launcher(opname, plan, s, *, lr, momentum, dampening, weight_decay, nesterov, maximize,
                 first_step, found_inf, grad_scale):
    """Check an SGD step for a resolved plan (slots: param, grad, buffer, master) and return
    a function of no arguments that launches its kernels (as :func:`adam_launcher`)."""
    with _launch.ensure_device(plan.device):
        lr_v, lr_p, fi, gs = _opt(opname, plan, lr, found_inf, grad_scale, s)
        args = F._args((lr_v, momentum, dampening, weight_decay, 1.0 if nesterov else 0.0,
                        1.0 if maximize else 0.0, 1.0 if first_step else 0.0), (lr_p, 0, fi, gs))
        kern = _kernels_for(opname, plan, (2,), 3, ("sgd", P.OPTIM_U),
                            lambda g, p, st, m: P.sgd_name(p, st, m, g.sig[2] is not None))
    return _launcher(plan, kern.__getitem__, args, s)


@_doc
def sgd_(params, grads, momentum_buffers=None, *, lr, momentum=0.0, dampening=0.0,
         weight_decay=0.0, nesterov=False, maximize=False, first_step=False,
         master_params=None, found_inf=None, grad_scale=None, stream=None):
    """One SGD step over lists, in place, with torch.optim.SGD's math.

    Per element: ``g = grad / grad_scale`` (when given), negated with ``maximize``;
    ``g += weight_decay * p``; with momentum, ``buf = g`` on the first step and
    ``buf = momentum * buf + (1 - dampening) * g`` afterwards, then ``g = g + momentum *
    buf`` (Nesterov) or ``g = buf``; finally ``p -= lr * g``.

    Parameters
    ----------
    params : list or tuple of GPU arrays
        Written in place: float16, bfloat16, float32 or float64, C-contiguous.
    grads : list or tuple of GPU arrays
        Read: ``grads[i]`` of the shape and dtype of ``params[i]``.
    momentum_buffers : list or tuple of GPU arrays, optional
        Written: the momentum buffers, of the params' shapes, in a dtype of the table of
        :mod:`cupylab.optim`. Required when ``momentum`` is nonzero, ignored (not even
        checked) when it is 0.
    {lr_param}
    momentum : float, default 0.0
        A finite Python number >= 0 (not limited to below 1).
    dampening : float, default 0.0
        Scales the gradient's share of the buffer by ``1 - dampening`` (not on the first
        step); a finite Python number >= 0.
    weight_decay : float, default 0.0
        L2 penalty added to the gradient; a finite Python number >= 0.
    nesterov : bool, default False
        Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``.
    maximize : bool, default False
        Step along the gradient instead of against it.
    first_step : bool, default False
        The buffers' first step: set them to the gradient instead of updating them
        (torch's rule for new buffers). With ``dampening == 0`` a zeroed buffer gives the
        same result either way.
    master_params : list or tuple of float32 GPU arrays, optional
        Written: one float32 master copy per param, for bfloat16 / float16 params (with
        float32 momentum buffers when there are any). The step updates the master copy
        and writes its rounding to the param.
    found_inf : one-element float32 GPU array, optional
        Read by the kernels: when it holds a nonzero value, they leave every array
        unchanged.
    grad_scale : one-element float32 GPU array, optional
        Read by the kernels: every gradient is divided by it on the fly (the ``grads``
        arrays are not written). A value of 0 means no scaling.
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    TypeError
        ``momentum``, ``dampening`` or ``weight_decay`` not a Python ``int`` or ``float``
        (``bool`` included; checked before the lists).
        {optim_type_errors}
        {list_type_errors}
    ValueError
        ``momentum``, ``dampening`` or ``weight_decay`` below 0 or not finite; a number
        ``lr`` that is negative or not finite; a nonzero ``momentum`` without
        ``momentum_buffers``; ``nesterov`` with ``momentum <= 0`` or ``dampening != 0``.
        {optim_value_errors}
        {list_value_errors}
    {runtime_errors}

    Notes
    -----
    {optim_notes}
    """
    _check_pos("sgd_", momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    _check_lr("sgd_", lr)
    if momentum and momentum_buffers is None:
        raise ValueError("sgd_: momentum_buffers are required when momentum is nonzero")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("sgd_: nesterov needs momentum > 0 and dampening 0")
    bufs = momentum_buffers if momentum else None
    lists = [params, grads, bufs, master_params]
    writes = 0b1 | (0b100 if bufs is not None else 0) | (0b1000 if master_params is not None else 0)
    plan, s = F.resolve("sgd_", ["params", "grads", "momentum_buffers", "master_params"], lists,
                        writes, same_dtype=(1,), stream=stream, optional=(2, 3))
    if plan is not None:
        sgd_launcher("sgd_", plan, s, lr=lr, momentum=momentum, dampening=dampening,
                     weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                     first_step=first_step, found_inf=found_inf, grad_scale=grad_scale)()


def lion_launcher(opname, plan, s, *, lr, beta1, beta2, weight_decay, maximize, found_inf,
                  grad_scale):
    """Check a Lion step for a resolved plan (slots: param, grad, exp_avg, master) and return
    a function of no arguments that launches its kernels (as :func:`adam_launcher`)."""
    with _launch.ensure_device(plan.device):
        lr_v, lr_p, fi, gs = _opt(opname, plan, lr, found_inf, grad_scale, s)
        args = F._args((lr_v, beta1, beta2, weight_decay, 1.0 if maximize else 0.0),
                       (lr_p, 0, fi, gs))
        kern = _kernels_for(opname, plan, (2,), 3, ("lion", P.OPTIM_U),
                            lambda g, p, st, m: P.lion_name(p, st, m))
    return _launcher(plan, kern.__getitem__, args, s)


@_doc
def lion_(params, grads, exp_avgs, *, lr, beta1=0.9, beta2=0.99, weight_decay=0.0,
          maximize=False, master_params=None, found_inf=None, grad_scale=None, stream=None):
    """One Lion step over lists, in place (Chen et al., 2023).

    Per element: ``g = grad / grad_scale`` (when given), negated with ``maximize``;
    ``p = p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)``; then
    ``m = beta2 * m + (1 - beta2) * g``.

    Parameters
    ----------
    params : list or tuple of GPU arrays
        Written in place: float16, bfloat16, float32 or float64, C-contiguous.
    grads : list or tuple of GPU arrays
        Read: ``grads[i]`` of the shape and dtype of ``params[i]``.
    exp_avgs : list or tuple of GPU arrays
        Written: the momentum ``m``, of the params' shapes, in a dtype of the table of
        :mod:`cupylab.optim`.
    {lr_param}
    beta1 : float, default 0.9
        Interpolation between momentum and gradient for the update's sign; a finite Python
        number in [0, 1).
    beta2 : float, default 0.99
        Decay of the momentum; a finite Python number in [0, 1).
    weight_decay : float, default 0.0
        Decoupled weight decay; a finite Python number >= 0.
    {tail_params}
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    TypeError
        ``weight_decay``, ``beta1`` or ``beta2`` not a Python ``int`` or ``float``
        (``bool`` included; checked before the lists).
        {optim_type_errors}
        {list_type_errors}
    ValueError
        ``weight_decay`` below 0 or not finite; ``beta1`` or ``beta2`` outside [0, 1) or
        not finite; a number ``lr`` that is negative or not finite.
        {optim_value_errors}
        {list_value_errors}
    {runtime_errors}

    Notes
    -----
    {optim_notes}
    """
    _check_pos("lion_", weight_decay=weight_decay)
    _check_betas("lion_", beta1=beta1, beta2=beta2)
    _check_lr("lion_", lr)
    lists = [params, grads, exp_avgs, master_params]
    writes = 0b101 | (0b1000 if master_params is not None else 0)
    plan, s = F.resolve("lion_", ["params", "grads", "exp_avgs", "master_params"], lists, writes,
                        same_dtype=(1,), stream=stream, optional=(3,))
    if plan is not None:
        lion_launcher("lion_", plan, s, lr=lr, beta1=beta1, beta2=beta2,
                      weight_decay=weight_decay, maximize=maximize, found_inf=found_inf,
                      grad_scale=grad_scale)()


@_doc
def increment_step_(step, found_inf=None, *, stream=None):
    """Add 1 to a step counter on the device, unless ``found_inf`` is nonzero.

    The capturable companion of :func:`adam_`'s device ``step``: call it before each step
    (torch's order: the first update sees ``step == 1``). The kernel reads ``found_inf``,
    so a skipped mixed-precision step does not count, without a host synchronisation.

    Parameters
    ----------
    step : float32 GPU array
        Written in place: every element is incremented. Any number of elements,
        C-contiguous, writable (not a JAX array), any framework.
    found_inf : one-element float32 GPU array, optional
        On ``step``'s GPU; when it holds a nonzero value, ``step`` is left unchanged.
    {stream_param}

    Returns
    -------
    None

    Raises
    ------
    TypeError
        ``step`` not a GPU array, or not float32; a ``found_inf`` that is not a
        one-element float32 GPU array; a ``stream`` that is neither an int nor a stream.
    ValueError
        ``step`` not C-contiguous or read-only; ``found_inf`` on another GPU; a negative
        ``stream`` handle.
    {runtime_errors}

    Notes
    -----
    One launch of one block; nothing synchronises the host. It can be prepared
    (:func:`cupylab.foreach.prepare`) and captured in a CUDA graph once ``step`` has been
    used outside the capture.
    """
    plan, s = F.resolve("increment_step_", ["step"], [[step]], 1, stream=stream)
    with _launch.ensure_device(plan.device):
        if plan.groups[0].sig[0] != "float32":
            raise TypeError(f"increment_step_: step must be float32 (got {plan.groups[0].sig[0]})")
        fi = (F.device_scalar("increment_step_", "found_inf", found_inf, plan, stream=s)
              if found_inf is not None else 0)
        from . import _arrays  # noqa: PLC0415

        ptr = _arrays.as_view(step, "increment_step_: step", s).ptr  # for the launch stream
        k = P.kernel("norm", "cl::mt::mt_step_inc", ("Q", "i", "Q"))
        P.run_kernel(k, plan, 1, 32, s, (ptr, plan.sizes[0], fi))
