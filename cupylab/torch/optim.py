"""Drop-in torch optimizers whose step is one cupylab multi-tensor launch per dtype group.

:class:`Adam`, :class:`AdamW` and :class:`SGD` subclass torch's own classes: same
constructor arguments, param groups, ``zero_grad``, and a ``state_dict`` that loads into
torch's optimizers and back. :class:`Lion` is a plain ``torch.optim.Optimizer``.

Differences from torch
----------------------
* Step counts as torch's (one per parameter), kept as one counter per *cohort*: the
  parameters of a group whose counts are equal share one counter tensor and one launch per
  dtype group. A parameter whose first gradient comes later, or that has no gradient for some
  steps (it is then left out, as torch leaves it), forms a cohort of its own: one more launch
  while the counts differ. ``state_dict()`` writes one count per parameter and any counts
  load.
* ``amsgrad`` is not supported (``ValueError``, also for groups added or loaded later).
* ``master_weights=True`` keeps float32 master copies (and float32 states) for bfloat16 /
  float16 parameters (state key ``"master_param"``). After ``load_state_dict``, the first
  step that updates a parameter checks its master copy against the parameter as it is then
  (so the model may be loaded before or after the optimizer): a missing copy (a state saved
  by a torch optimizer) is made from the parameter, and so is a loaded copy that does not
  round to the parameter, which is stale (the parameter was changed without it, e.g. by a
  torch optimizer that carried the state through a round trip).
* ``capturable=True`` keeps the step on the GPU: a whole training step can be captured in a
  CUDA graph once one eager step has built the launch tables. The gradients the captured
  step reads must be the tensors of that eager step: zero them in place inside the captured
  region (``zero_grad(set_to_none=False)`` before ``backward``), not with
  ``set_to_none=True`` before the capture as torch's whole-network recipe does (new gradient
  tensors during a capture raise ``RuntimeError``: the table cannot be re-pointed then). ``lr`` may be a one-element
  float32 CUDA tensor.
* ``step(found_inf=..., grad_scale=...)`` (or the attributes of the same names, set by
  ``torch.amp.GradScaler`` for optimizers with ``_step_supports_amp_scaling``): one-element
  float32 CUDA tensors; a nonzero ``found_inf`` skips the step on the device (the step counter
  then lives on the GPU). Unlike torch's fused optimizers, the step does not write the
  unscaled gradients back into ``p.grad``: after ``scaler.step(opt)`` they are still
  multiplied by the scale (call ``scaler.unscale_(opt)`` first to read true gradients).
* ``SGD`` with ``momentum`` and ``dampening`` cannot take its first step (which initialises
  the momentum buffers without dampening, a host decision) together with ``found_inf``:
  take one step without ``GradScaler`` first, or use ``dampening=0``.

Host work per step for an unchanged parameter list: reading ``p.grad`` and the data pointers
of params and grads (to detect reallocated gradients), then one launch per dtype group. The
step runs as torch's: without grad, its step pre- and post-hooks (global and per optimizer)
called, and the profiler's ``Optimizer.step#<class>.step`` range opened; when no hook is
registered and no profiler runs, torch's step wrapper, which would only open that range, is
left out (about half the host time of a small step).
The launch tables also hold the addresses of the state tensors: ``optimizer.state`` counts
its changes (a state cleared, deleted, assigned, one tensor of it replaced; a mapping
assigned to ``optimizer.state`` is taken over at the next step), and any change, or a change
of a setting the lists depend on (SGD's ``momentum`` switched on or off, ``master_weights``),
makes the next step build its tables again. Not seen: a state tensor whose storage is swapped
in place (``t.data = ...``, ``t.set_(...)``); update state tensors in place or replace them
in the state dict.
"""
from __future__ import annotations

import torch

from .. import optim as _optim
from ._optim_core import _check_master, _Fused, _next_count, lean_step
from ..ops._mt_core import _fill_doc


# Pieces of the step() docstrings (filled in by _step_doc, as cupylab.optim does)
_STEP_DOC = {
    "{step_closure}": """\
closure : callable, optional
    Re-evaluates the model and returns the loss; called first, with grad enabled.""",
    "{step_found_inf}": """\
found_inf : one-element float32 CUDA tensor, optional
    When it holds a nonzero value, the step leaves every parameter and state
    unchanged (decided on the device, no host synchronisation). Default: the
    optimizer's ``found_inf`` attribute, which ``torch.amp.GradScaler`` sets.""",
    "{step_grad_scale}": """\
grad_scale : one-element float32 CUDA tensor, optional
    The gradients are divided by it inside the step; ``p.grad`` itself is not
    written. Default: the optimizer's ``grad_scale`` attribute (GradScaler).""",
    "{step_returns}": """\
Returns
-------
object or None
    What ``closure`` returned, or ``None`` without a closure.""",
    "{step_checked_errors}": """\
TypeError
    A parameter or gradient that is not a CUDA tensor of a supported dtype (see
    :mod:`cupylab.optim`); a group with ``master_weights`` that mixes float32 and
    16-bit parameters; a ``found_inf``, ``grad_scale`` or CUDA tensor ``lr`` that is
    not a one-element float32 CUDA tensor.
ValueError
    The array errors of :mod:`cupylab.optim` (non-contiguous or overlapping
    tensors, parameters of one group on several GPUs, ...); a ``found_inf``,
    ``grad_scale`` or ``lr`` tensor on another GPU than the group's parameters.""",
    "{step_capture_error}": """\
RuntimeError
    Sparse gradients; new gradient tensors, or a parameter list seen for the first
    time, during a CUDA graph capture (take one eager step first and zero the
    gradients in place inside the captured region).""",
}


def _step_doc(f):
    return _fill_doc(f, _STEP_DOC)


__all__ = ["Adam", "AdamW", "SGD", "Lion"]


class _AdamBase(_Fused):
    _cl_state_keys = ("exp_avg", "exp_avg_sq")
    _cl_step_matters = True

    def _cl_check(self, groups=None):
        for g in self.param_groups if groups is None else groups:
            if g.get("amsgrad"):
                raise ValueError("cupylab.torch.optim: amsgrad is not supported")

    def _cl_check_group(self, group):
        self._cl_check([group])

    def load_state_dict(self, state_dict):
        """Load a state saved by this optimizer or by the matching torch optimizer.

        As torch's ``load_state_dict``, except that the states and master copies of
        master-weight groups stay float32, and that master copies are checked against the
        parameters at the next step that updates them (see the module docstring).

        Parameters
        ----------
        state_dict : dict
            What :meth:`state_dict` (or torch's) returned.

        Returns
        -------
        None

        Raises
        ------
        ValueError
            A group with ``amsgrad`` (checked before anything is loaded), and torch's own
            checks (group and parameter counts).
        """
        self._cl_check(state_dict.get("param_groups", ()))  # before anything is loaded
        super().load_state_dict(state_dict)

    @lean_step
    @_step_doc
    def step(self, closure=None, *, found_inf=None, grad_scale=None):
        """One fused Adam (AdamW) step over every param group.

        Parameters without a gradient are left out, as torch leaves them. One launch per
        dtype group and step cohort; each cohort's step counter is advanced first (on the
        device for ``capturable`` groups and when ``found_inf`` is given, which moves the
        counters to the GPU). Every group's arguments are checked before any counter is
        advanced or any kernel launched: a step they refuse leaves every parameter, state
        and count as it was (the states made for parameters stepped for the first time
        stay, zeroed, and a counter moved to the GPU stays there with its count).

        Parameters
        ----------
        {step_closure}
        found_inf : one-element float32 CUDA tensor, optional
            When it holds a nonzero value, the step leaves every parameter and state
            unchanged, step counts included (decided on the device, no host
            synchronisation). Default: the optimizer's ``found_inf`` attribute, which
            ``torch.amp.GradScaler`` sets.
        {step_grad_scale}

        {step_returns}

        Raises
        ------
        {step_checked_errors}
        {step_capture_error}
        """
        loss, found_inf, grad_scale = self._cl_begin(closure, found_inf, grad_scale)
        adamw = isinstance(self, torch.optim.AdamW)
        name = f"{type(self).__name__}.step"
        todo = []  # every group's launches checked before any count moves or kernel runs
        for gi, group in enumerate(self.param_groups):
            r = self._cl_plan(gi, group)
            if r is None:
                continue
            s, units = r
            cap = bool(group.get("capturable")) or found_inf is not None
            b1, b2 = group["betas"]
            decoupled = adamw or group.get("decoupled_weight_decay", False)
            for k, (plan, st) in enumerate(units):
                if cap and st.device.type == "cpu":
                    st = self._cl_device_step(gi, k)  # the same count, now on the GPU
                on_host = st.device.type == "cpu"
                launch = _optim.adam_launcher(
                    name, plan, s, lr=self._cl_lr(group), beta1=b1, beta2=b2, eps=group["eps"],
                    weight_decay=group["weight_decay"], step=_next_count(st) if on_host else st,
                    adamw=decoupled, maximize=group["maximize"], found_inf=found_inf,
                    grad_scale=grad_scale)
                todo.append((launch, st, on_host))
        self._cl_mark()
        for launch, st, on_host in todo:
            if on_host:
                st += 1
            else:
                _optim.increment_step_(st, found_inf)
            launch()
        return loss


class Adam(_AdamBase, torch.optim.Adam):
    """``torch.optim.Adam`` with a cupylab fused step (see the module docstring).

    Parameters
    ----------
    params : iterable of tensors or dicts
        The CUDA parameters, or param groups, as for ``torch.optim.Adam``.
    *args, **kwargs
        ``torch.optim.Adam``'s other arguments (``lr``, ``betas``, ``eps``,
        ``weight_decay``, ``amsgrad``, ``foreach``, ``maximize``, ``capturable``,
        ``differentiable``, ``fused``, ``decoupled_weight_decay`` where torch has it),
        passed to its constructor, which checks them. ``foreach``, ``fused`` and
        ``differentiable`` do not change the step; ``amsgrad=True`` raises;
        ``decoupled_weight_decay=True`` makes the step AdamW's. A one-element float32 CUDA
        tensor ``lr`` is read on the device at every step.
    master_weights : bool, default False
        Keep float32 master copies and float32 states for bfloat16 / float16 params
        (a param group may set its own ``"master_weights"``).

    Raises
    ------
    ValueError
        ``amsgrad=True``, and torch's own checks of the arguments.
    """

    def __init__(self, params, *args, master_weights=False, **kwargs):
        super().__init__(params, *args, **kwargs)
        self._cl_check()
        self._cl_setup(master_weights)


class AdamW(_AdamBase, torch.optim.AdamW):
    """``torch.optim.AdamW`` with a cupylab fused step (see the module docstring).

    The step is :func:`cupylab.optim.adamw_` over every param group: decoupled weight decay
    (``p *= 1 - lr * weight_decay``), then the Adam update.

    Parameters
    ----------
    params : iterable of tensors or dicts
        The CUDA parameters, or param groups, as for ``torch.optim.AdamW``.
    *args, **kwargs
        ``torch.optim.AdamW``'s other arguments (``lr``, ``betas``, ``eps``,
        ``weight_decay`` (default 1e-2), ``amsgrad``, ``maximize``, ``foreach``,
        ``capturable``, ``differentiable``, ``fused``), passed to its constructor, which
        checks them. ``foreach``, ``fused`` and ``differentiable`` do not change the step;
        ``amsgrad=True`` raises. A one-element float32 CUDA tensor ``lr`` is read on the
        device at every step.
    master_weights : bool, default False
        Keep float32 master copies and float32 states for bfloat16 / float16 params
        (a param group may set its own ``"master_weights"``).

    Raises
    ------
    ValueError
        ``amsgrad=True``, and torch's own checks of the arguments.
    """

    def __init__(self, params, *args, master_weights=False, **kwargs):
        super().__init__(params, *args, **kwargs)
        self._cl_check()
        self._cl_setup(master_weights)


class SGD(_Fused, torch.optim.SGD):
    """``torch.optim.SGD`` with a cupylab fused step (see the module docstring).

    The step is :func:`cupylab.optim.sgd_` over every param group: momentum, dampening,
    Nesterov, weight decay and maximize, with torch's math and first-step rule.

    Parameters
    ----------
    params : iterable of tensors or dicts
        The CUDA parameters, or param groups, as for ``torch.optim.SGD``.
    *args, **kwargs
        ``torch.optim.SGD``'s other arguments (``lr``, ``momentum``, ``dampening``,
        ``weight_decay``, ``nesterov``, ``maximize``, ``foreach``, ``differentiable``,
        ``fused``), passed to its constructor, which checks them. ``foreach``, ``fused``
        and ``differentiable`` do not change the step. A one-element float32 CUDA tensor
        ``lr`` is read on the device at every step.
    master_weights : bool, default False
        Keep float32 master copies and float32 momentum buffers for bfloat16 / float16
        params (a param group may set its own ``"master_weights"``).

    Raises
    ------
    ValueError
        torch's own checks of the arguments (e.g. ``nesterov`` without momentum, or with
        dampening).

    Notes
    -----
    With ``momentum`` and ``dampening``, a parameter's first momentum step (which sets the
    buffer to the gradient, a host decision) cannot be skipped on the device: it cannot
    take ``found_inf`` (``GradScaler``). Take one step without it first, or use
    ``dampening=0``.
    """

    _cl_state_keys = ("momentum_buffer",)

    def __init__(self, params, *args, master_weights=False, **kwargs):
        super().__init__(params, *args, **kwargs)
        self._cl_setup(master_weights)

    def _cl_fresh_own(self):
        self._cl_first = {}

    def _cl_layout(self, group):  # with momentum, the table holds the buffers
        return super()._cl_layout(group), group["momentum"] != 0

    def _cl_lists(self, group, params, grads):
        st = self.state
        mom = group["momentum"] != 0
        P, G, B, W = [], [], [], []
        fresh = []
        for p, g in zip(params, grads):
            s = st[p]
            master = self._cl_master(group, p)
            if master and "master_param" not in s:
                s["master_param"] = p.detach().float().clone()
            if mom:
                b = s.get("momentum_buffer")
                fresh.append(b is None)
                if b is None:
                    dt = torch.float32 if master else p.dtype
                    b = s["momentum_buffer"] = torch.zeros_like(
                        p, dtype=dt, memory_format=torch.preserve_format)
                B.append(b)
            P.append(p.detach())
            G.append(g.detach())
            W.append(s.get("master_param"))
        # The first momentum step sets buffer = gradient. Without dampening the ordinary step
        # on a zeroed buffer gives exactly that, so only dampening needs the first-step form
        # (one per launch: a group's buffers must then all be new, or none).
        damp = group["dampening"] != 0
        if damp and any(fresh) and not all(fresh):
            raise ValueError("cupylab.torch.optim.SGD: with dampening, some parameters of a "
                             "group have momentum buffers and some do not; step them in "
                             "separate groups")
        self._cl_first_pending = damp and bool(fresh) and all(fresh)
        anymaster = _check_master(W)
        return ([P, G, B if mom else None, W if anymaster else None],
                ["params", "grads", "momentum_buffers", "master_params"],
                0b1 | (0b100 if mom else 0) | (0b1000 if anymaster else 0))

    @lean_step
    @_step_doc
    def step(self, closure=None, *, found_inf=None, grad_scale=None):
        """One fused SGD step over every param group.

        One launch per dtype group of each param group. Parameters without a gradient are
        left out, as torch leaves them. Momentum buffers are made (zeroed) at a parameter's
        first momentum step; with ``dampening`` that first step sets them to the gradient,
        as torch does. Every group's arguments are checked before any kernel is launched:
        a step they refuse leaves every parameter and buffer as it was (buffers made for
        parameters stepped for the first time stay, zeroed, and their next step is still
        their first).

        Parameters
        ----------
        {step_closure}
        {step_found_inf}
        {step_grad_scale}

        {step_returns}

        Raises
        ------
        {step_checked_errors}
            With ``dampening``: a group in which some parameters have momentum buffers and
            some do not; a first momentum step together with ``found_inf`` (take one step
            without it first, or use ``dampening=0``).
        {step_capture_error}
        """
        loss, found_inf, grad_scale = self._cl_begin(closure, found_inf, grad_scale)
        todo = []  # every group's launch checked before any runs
        for gi, group in enumerate(self.param_groups):
            self._cl_first_pending = False
            r = self._cl_plan(gi, group)
            if r is None:
                continue
            s, ((plan, _),) = r
            if self._cl_first_pending:  # new buffers: the group's next launched step is first
                self._cl_first[gi] = True
            first = self._cl_first.get(gi, False)
            if first and found_inf is not None:
                raise ValueError("cupylab.torch.optim.SGD: with dampening, the first momentum "
                                 "step cannot be skipped on the device (found_inf, as "
                                 "GradScaler passes); take one step without it")
            todo.append((gi, _optim.sgd_launcher(
                "SGD.step", plan, s, lr=self._cl_lr(group), momentum=group["momentum"],
                dampening=group["dampening"], weight_decay=group["weight_decay"],
                nesterov=group["nesterov"], maximize=group["maximize"], first_step=first,
                found_inf=found_inf, grad_scale=grad_scale)))
        self._cl_mark()
        for gi, launch in todo:
            self._cl_first.pop(gi, None)
            launch()
        return loss

    def load_state_dict(self, state_dict):
        """Load a state saved by this optimizer or by ``torch.optim.SGD``.

        As torch's ``load_state_dict``, except that the momentum buffers and master copies
        of master-weight groups stay float32, and that master copies are checked against
        the parameters at the next step that updates them (see the module docstring).

        Parameters
        ----------
        state_dict : dict
            What :meth:`state_dict` (or torch's) returned.

        Returns
        -------
        None

        Raises
        ------
        ValueError
            torch's own checks (group and parameter counts).
        """
        super().load_state_dict(state_dict)
        self._cl_fresh_own()


class Lion(_Fused, torch.optim.Optimizer):
    """Lion (Chen et al., 2023) with a cupylab fused step.

    Parameters
    ----------
    params : iterable of tensors or param groups
        The CUDA parameters.
    lr : float or one-element float32 CUDA tensor, default 1e-4
        A Python number must be finite and >= 0. A tensor is not checked here: a CUDA
        tensor is read on the device at every step (which checks it is a one-element
        float32 tensor on the params' GPU).
    betas : (float, float), default (0.9, 0.99)
        ``beta1`` (the update's interpolation) and ``beta2`` (the momentum's decay), each
        in [0, 1).
    weight_decay : float, default 0.0
        Decoupled (``p *= 1 - lr * weight_decay``); a finite Python number >= 0.
    maximize : bool, default False
        Step along the gradient instead of against it.
    master_weights : bool, default False
        Keep float32 master copies and float32 states for bfloat16 / float16 params.

    Raises
    ------
    TypeError
        An ``lr`` that is neither a tensor nor a Python ``int`` or ``float``, or a
        ``weight_decay`` that is not a Python ``int`` or ``float`` (``bool`` included).
    ValueError
        A number ``lr`` or a ``weight_decay`` that is negative or not finite; a beta
        outside [0, 1). The same checks apply to the param groups given here or added
        later (:meth:`add_param_group`), for the values they set.
    """

    _cl_state_keys = ("exp_avg",)

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False,
                 master_weights=False):
        self._cl_check(dict(lr=lr, betas=betas, weight_decay=weight_decay))
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                                      maximize=maximize))
        self._cl_setup(master_weights)

    @staticmethod
    def _cl_check(hyper):
        """The hyper-parameters that ``hyper`` (the defaults, or a param group) sets."""
        lr = hyper.get("lr")
        if "lr" in hyper and not isinstance(lr, torch.Tensor):
            _optim._check_pos("Lion", lr=lr)
        if "weight_decay" in hyper:
            _optim._check_pos("Lion", weight_decay=hyper["weight_decay"])
        if "betas" in hyper:
            betas = hyper["betas"]
            if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
                raise ValueError(f"Lion: betas must be in [0, 1) (got {betas})")

    def _cl_check_group(self, group):
        self._cl_check(group)

    @lean_step
    @_step_doc
    def step(self, closure=None, *, found_inf=None, grad_scale=None):
        """One fused Lion step over every param group.

        One launch per dtype group of each param group. Parameters without a gradient are
        left out. The update is that of :func:`cupylab.optim.lion_`. Every group's
        arguments are checked before any kernel is launched: a step they refuse leaves
        every parameter and state as it was (the states made for parameters stepped for
        the first time stay, zeroed).

        Parameters
        ----------
        {step_closure}
        {step_found_inf}
        {step_grad_scale}

        {step_returns}

        Raises
        ------
        {step_checked_errors}
        {step_capture_error}
        """
        loss, found_inf, grad_scale = self._cl_begin(closure, found_inf, grad_scale)
        todo = []  # every group's launch checked before any runs
        for gi, group in enumerate(self.param_groups):
            r = self._cl_plan(gi, group)
            if r is None:
                continue
            s, ((plan, _),) = r
            b1, b2 = group["betas"]
            todo.append(_optim.lion_launcher(
                "Lion.step", plan, s, lr=self._cl_lr(group), beta1=b1, beta2=b2,
                weight_decay=group["weight_decay"], maximize=group["maximize"],
                found_inf=found_inf, grad_scale=grad_scale))
        self._cl_mark()
        for launch in todo:
            launch()
        return loss
