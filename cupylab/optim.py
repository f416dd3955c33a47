"""Fused optimizer steps over lists of arrays from any framework (one launch per dtype group).

Functional, framework-neutral: the caller owns the parameters, gradients and state arrays
(``cupylab.torch.optim`` wraps these as drop-in ``torch.optim`` optimizers). Each function
updates ``params`` and the state lists in place with torch's fused-optimizer math in float32
(float64 for float64 params).

Common parameters
-----------------
lr : float or one-element float32 GPU array
    A device array is read by the kernel (CUDA-graph capturable, changeable without a new
    capture).
found_inf : one-element float32 GPU array, optional
    When nonzero, the kernels leave everything unchanged (mixed precision; no host sync).
grad_scale : one-element float32 GPU array, optional
    Gradients are divided by it on the fly (unscaling fused into the step).
master_params : list of float32 GPU arrays, optional
    fp32 master copies for bfloat16 / float16 params: the step updates the master copy and
    writes its rounding into the param.
stream : optional
    Launch stream (default: the caller's current stream).

dtypes: params and grads float32, float64, bfloat16 or float16 (grads of the params' dtype);
states of the params' dtype or float32 (float32 required with ``master_params``).

Raises
------
TypeError, ValueError
    As the foreach operators (:mod:`cupylab.ops.multi_tensor`), plus unsupported dtype
    combinations and bad hyper-parameters.
"""
from __future__ import annotations

import math

from . import _launch
from .ops import _mt_plan as P
from .ops import multi_tensor as F

__all__ = ["adam_", "adamw_", "sgd_", "lion_", "increment_step_"]

_COMBOS = {(p, s, m) for p, s, m in P.OPTIM_COMBOS}


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
    for k, v in kw.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not _finite(v) or v < 0:
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


def adam_launch(opname, plan, s, *, lr, beta1, beta2, eps, weight_decay, step, adamw,
                maximize, found_inf, grad_scale):
    """Launch the Adam kernels for a resolved plan (slots: param, grad, exp_avg, exp_avg_sq,
    master). ``step``: a number (this update's step, >= 1) or a device float32 array."""
    with _launch.ensure_device(plan.device):
        lr_v, lr_p, fi, gs = _opt(opname, plan, lr, found_inf, grad_scale, s)
        if isinstance(step, (int, float)):
            if not (_finite(step) and step >= 1):
                raise ValueError(f"{opname}: step must be a finite number >= 1 (got {step})")
            bc1, bc2s, st_p = 1.0 - beta1 ** step, math.sqrt(1.0 - beta2 ** step), 0
        else:
            bc1, bc2s, st_p = 1.0, 1.0, F.device_scalar(opname, "step", step, plan, stream=s)
        args = F._args((lr_v, beta1, beta2, eps, weight_decay, bc1, bc2s, 1.0 if maximize else 0.0),
                       (lr_p, st_p, fi, gs))
        kern = {}
        for g, p, st, m in _check_combo(opname, plan, (2, 3), 4):
            kern[g.sig] = P.kernel("optim", P.adam_name(p, st, m, adamw))
        P.launch(plan, kern.__getitem__, args, s)


def adam_(params, grads, exp_avgs, exp_avg_sqs, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8,
          weight_decay=0.0, maximize=False, master_params=None, found_inf=None,
          grad_scale=None, adamw=False, stream=None):
    """One Adam step (AdamW with ``adamw=True``) over lists, in place.

    Parameters
    ----------
    params, grads, exp_avgs, exp_avg_sqs : lists of GPU arrays
        Same length and shapes; ``params``, the two state lists (and ``master_params``) are
        written.
    lr : float or one-element float32 GPU array
    step : int or one-element float32 GPU array
        The number of this update (1 for the first), for the bias corrections. A device array
        is read by the kernel (capturable); :func:`increment_step_` advances it on the device.
    beta1, beta2, eps, weight_decay : float
        ``weight_decay`` is L2 (added to the gradient) for Adam, decoupled for AdamW.
    maximize : bool
    master_params, found_inf, grad_scale, stream
        See the module docstring.
    """
    name = "adamw_" if adamw else "adam_"
    _check_pos(name, eps=eps, weight_decay=weight_decay)
    _check_betas(name, beta1=beta1, beta2=beta2)
    _check_lr(name, lr)
    lists = [params, grads, exp_avgs, exp_avg_sqs, master_params]
    writes = 0b1101 | (0b10000 if master_params is not None else 0)
    plan, s = F.resolve(name, ["params", "grads", "exp_avgs", "exp_avg_sqs", "master_params"],
                        lists, writes, same_dtype=(1,), stream=stream)
    if plan is not None:
        adam_launch(name, plan, s, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    weight_decay=weight_decay, step=step, adamw=adamw, maximize=maximize,
                    found_inf=found_inf, grad_scale=grad_scale)


def adamw_(params, grads, exp_avgs, exp_avg_sqs, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-8,
           weight_decay=1e-2, maximize=False, master_params=None, found_inf=None,
           grad_scale=None, stream=None):
    """One AdamW step (decoupled weight decay: ``p *= 1 - lr * weight_decay``). See
    :func:`adam_`."""
    adam_(params, grads, exp_avgs, exp_avg_sqs, lr=lr, step=step, beta1=beta1, beta2=beta2,
          eps=eps, weight_decay=weight_decay, maximize=maximize, master_params=master_params,
          found_inf=found_inf, grad_scale=grad_scale, adamw=True, stream=stream)


def sgd_launch(opname, plan, s, *, lr, momentum, dampening, weight_decay, nesterov, maximize,
               first_step, found_inf, grad_scale):
    """Launch the SGD kernels for a resolved plan (slots: param, grad, buffer, master)."""
    with _launch.ensure_device(plan.device):
        lr_v, lr_p, fi, gs = _opt(opname, plan, lr, found_inf, grad_scale, s)
        args = F._args((lr_v, momentum, dampening, weight_decay, 1.0 if nesterov else 0.0,
                        1.0 if maximize else 0.0, 1.0 if first_step else 0.0), (lr_p, 0, fi, gs))
        kern = {}
        for g, p, st, m in _check_combo(opname, plan, (2,), 3):
            kern[g.sig] = P.kernel("optim", P.sgd_name(p, st, m, g.sig[2] is not None))
        P.launch(plan, kern.__getitem__, args, s)


def sgd_(params, grads, momentum_buffers=None, *, lr, momentum=0.0, dampening=0.0,
         weight_decay=0.0, nesterov=False, maximize=False, first_step=False,
         master_params=None, found_inf=None, grad_scale=None, stream=None):
    """One SGD step (torch.optim.SGD's math) over lists, in place.

    Parameters
    ----------
    params, grads : lists of GPU arrays
    momentum_buffers : list of GPU arrays, optional
        Required when ``momentum`` is nonzero; on the ``first_step`` they are set to the
        gradient (torch's first-step rule), later ``buf = momentum * buf + (1 - dampening) *
        grad``.
    lr : float or one-element float32 GPU array
    momentum, dampening, weight_decay : float
    nesterov, maximize, first_step : bool
    master_params, found_inf, grad_scale, stream
        See the module docstring.
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
                        writes, same_dtype=(1,), stream=stream)
    if plan is not None:
        sgd_launch("sgd_", plan, s, lr=lr, momentum=momentum, dampening=dampening,
                   weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                   first_step=first_step, found_inf=found_inf, grad_scale=grad_scale)


def lion_launch(opname, plan, s, *, lr, beta1, beta2, weight_decay, maximize, found_inf,
                grad_scale):
    with _launch.ensure_device(plan.device):
        lr_v, lr_p, fi, gs = _opt(opname, plan, lr, found_inf, grad_scale, s)
        args = F._args((lr_v, beta1, beta2, weight_decay, 1.0 if maximize else 0.0),
                       (lr_p, 0, fi, gs))
        kern = {}
        for g, p, st, m in _check_combo(opname, plan, (2,), 3):
            kern[g.sig] = P.kernel("optim", P.lion_name(p, st, m))
        P.launch(plan, kern.__getitem__, args, s)


def lion_(params, grads, exp_avgs, *, lr, beta1=0.9, beta2=0.99, weight_decay=0.0,
          maximize=False, master_params=None, found_inf=None, grad_scale=None, stream=None):
    """One Lion step (Chen et al., 2023: ``p -= lr * (sign(beta1 * m + (1 - beta1) * g) +
    weight_decay * p)``, then ``m = beta2 * m + (1 - beta2) * g``) over lists, in place.
    See the module docstring for the common parameters."""
    _check_pos("lion_", weight_decay=weight_decay)
    _check_betas("lion_", beta1=beta1, beta2=beta2)
    _check_lr("lion_", lr)
    lists = [params, grads, exp_avgs, master_params]
    writes = 0b101 | (0b1000 if master_params is not None else 0)
    plan, s = F.resolve("lion_", ["params", "grads", "exp_avgs", "master_params"], lists, writes,
                        same_dtype=(1,), stream=stream)
    if plan is not None:
        lion_launch("lion_", plan, s, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                    maximize=maximize, found_inf=found_inf, grad_scale=grad_scale)


def increment_step_(step, found_inf=None, *, stream=None):
    """``step += 1`` on the device unless ``found_inf`` is nonzero (capturable step counters).

    Parameters
    ----------
    step : float32 GPU array (any number of elements, contiguous)
    found_inf : one-element float32 GPU array, optional
    stream : optional
    """
    plan, s = F.resolve("increment_step_", ["step"], [[step]], 1, stream=stream)
    with _launch.ensure_device(plan.device):
        if plan.groups[0].sig[0] != "float32":
            raise TypeError(f"increment_step_: step must be float32 (got {plan.groups[0].sig[0]})")
        fi = (F.device_scalar("increment_step_", "found_inf", found_inf, plan, stream=s)
              if found_inf is not None else 0)
        from . import _arrays  # noqa: PLC0415

        ptr = _arrays.as_view(step).ptr
        k = P.kernel("norm", "cl::mt::mt_step_inc", ("Q", "i", "Q"))
        P.run_kernel(k, plan, 1, 32, s, (ptr, plan.sizes[0], fi))
