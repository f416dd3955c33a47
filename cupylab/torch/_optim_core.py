"""The machinery shared by the optimizers of :mod:`cupylab.torch.optim`.

:class:`_Fused`, the mixin under Adam, AdamW, SGD and Lion: per param group a cached launch
plan keyed on the data pointers of the params and grads (re-pointed when only the gradient
tensors are new), the step cohorts and their step counters (moved to the GPU for capturable
steps), the state lists and float32 master copies, the plans a CUDA graph captured (kept
alive), and ``load_state_dict`` / ``state_dict``; with the helpers it uses. The user-facing
rules are in the docstring of :mod:`cupylab.torch.optim`.
"""
from __future__ import annotations

import functools
import operator
import struct

import torch
from torch.optim import optimizer as _torch_optimizer

from .. import _launch
from ..ops import _mt_core as F, _mt_plan as P
from ._optim_state import State, tracked

_GRAD = operator.attrgetter("grad")
_F32 = struct.Struct("f")
_PTR = torch.Tensor.data_ptr
_STRIDED = torch.strided
_NO_SUBCLASS_FN = torch._C.DisableTorchFunctionSubclass


# torch's step wrapper (Optimizer.profile_hook_step) reads these: the hooks every optimizer runs
_GLOBAL_PRE = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
_GLOBAL_POST = getattr(_torch_optimizer, "_global_optimizer_post_hooks", None)
_profiling = torch._C._autograd._profiler_enabled
_set_grad = torch._C._set_grad_enabled
_grad_on = torch.is_grad_enabled


def lean_step(func):
    """The ``step`` method ``func`` as torch's optimizers run theirs, at less host cost.

    torch runs every optimizer's ``step`` without grad, inside a wrapper that opens the
    profiler range ``Optimizer.step#<class>.step`` and calls the global and the optimizer's
    own step pre- and post-hooks (``register_step_pre_hook``...). The returned method does
    exactly that whenever a hook is registered or a profiler is running, through torch's own
    wrapper; otherwise, when that wrapper would only open a range nobody records, it calls
    ``func`` directly without grad. That skips about half of a small step's host time (CPU,
    one parameter: 37 against 19 µs). Marked ``hooked``, so that ``torch.optim.Optimizer``
    does not wrap it a second time."""
    @functools.wraps(func)
    def nograd(*args, **kwargs):
        prev = _grad_on()
        _set_grad(False)
        try:
            return func(*args, **kwargs)
        finally:
            _set_grad(prev)

    full = torch.optim.Optimizer.profile_hook_step(nograd)
    if _GLOBAL_PRE is None or _GLOBAL_POST is None:  # not the torch this was written for
        full.hooked = True
        return full

    @functools.wraps(func)
    def step(self, *args, **kwargs):
        if (_GLOBAL_PRE or _GLOBAL_POST or self._optimizer_step_pre_hooks
                or self._optimizer_step_post_hooks or _profiling()):
            return full(self, *args, **kwargs)
        return nograd(self, *args, **kwargs)

    step.hooked = True
    return step


def _same_layout(params, grads, kp, kg, sizes):
    """Whether ``grads`` can replace the gradients of a stored plan for ``params`` without a
    full validation: each a plain dense CUDA tensor of its param's shape, dtype and device
    and of the element count the plan was built with (a param shrunk in place keeps its
    address), contiguous, with no lazy conj/neg bit and not a param itself. Anything else
    takes the full path, which raises the documented errors."""
    if not set(kg).isdisjoint(kp):
        return False
    for p, g, n in zip(params, grads, sizes):
        if (g.dtype != p.dtype or g.shape != p.shape or g.numel() != n
                or g.layout is not _STRIDED
                or not g.is_contiguous() or g.get_device() != p.get_device() or g.is_neg()
                or g.is_conj()):
            return False
    return True


def _next_count(st):
    """The value ``st += 1`` will give a CPU step counter, without changing it."""
    if st.dtype == torch.float32:  # the counters made here: float64 sum rounded as float32's
        return _F32.unpack(_F32.pack(float(st) + 1.0))[0]
    return float(st + 1)  # a loaded counter of another dtype


def _check_master(masters):
    """Whether a group's params have master copies: all or none (TypeError for a mix)."""
    anymaster = any(w is not None for w in masters)
    if anymaster and any(w is None for w in masters):
        raise TypeError("cupylab.torch.optim: master_weights with float32 and 16-bit params "
                        "in one group; put them in separate param groups")
    return anymaster


class _Fused:
    """Shared machinery: per group a cached launch plan keyed on the data pointers of the
    params and grads."""

    _step_supports_amp_scaling = True
    _cl_state_keys: tuple = ()
    _cl_name = "optim"
    _cl_step_matters = False  # the update depends on the step count (bias correction)

    def _cl_setup(self, master_weights):
        self._cl_fresh()
        self.defaults["master_weights"] = bool(master_weights)
        for g in self.param_groups:
            g.setdefault("master_weights", bool(master_weights))

    def __setstate__(self, state):
        """Unpickled or deep-copied (torch's ``__getstate__`` keeps only the defaults, state
        and groups): the launch tables and step bookkeeping start empty, the state counted.
        (torch's ``load_state_dict`` calls this too, on a live optimizer: nothing is reset
        then, the tables a captured graph points into stay kept.)"""
        super().__setstate__(state)
        if not hasattr(self, "_cl_plans"):
            self._cl_fresh()

    def _cl_fresh(self):
        """Empty launch tables and step bookkeeping over the state as it is (counted)."""
        # per group (param pointers, grad pointers, units, layout, element counts)
        self._cl_plans = {}
        self.state = tracked(self.state)
        self._cl_seen = None  # the state's (Version, count) when the tables were last right
        # (plan, step counter) that CUDA graphs point into (P.for_stream), kept alive
        self._cl_captured = []
        # params whose loaded master copies are not yet checked (at their next step, as
        # after load_state_dict; none for a new optimizer)
        self._cl_unsettled = {p for p, st in self.state.items() if st}
        self._cl_fresh_own()

    def _cl_fresh_own(self):
        """An optimizer's own bookkeeping, empty (none here; SGD's first steps)."""

    def _cl_check_group(self, group):
        """Refuse a param group (a dict) before it joins: the optimizer's own checks of the
        hyper-parameters it sets (none here; Adam's amsgrad, Lion's values)."""

    def add_param_group(self, param_group):
        """Add a param group, as torch's ``add_param_group``.

        Parameters
        ----------
        param_group : dict
            As for torch (``"params"`` and any of the optimizer's hyper-parameters); it may
            also set its own ``"master_weights"``, else it gets the optimizer's.

        Returns
        -------
        None

        Raises
        ------
        TypeError, ValueError
            The optimizer's own checks of the hyper-parameters the group sets, made before
            the group joins (Adam and AdamW: ``amsgrad`` set; Lion: an ``lr``, ``betas`` or
            ``weight_decay`` its constructor would refuse); torch's own checks of the group
            (e.g. a parameter that is already in another group).
        """
        if isinstance(param_group, dict):  # refused before it joins (torch checks the rest)
            self._cl_check_group(param_group)
        super().add_param_group(param_group)
        if hasattr(self, "_cl_plans"):
            self.param_groups[-1].setdefault("master_weights", self.defaults["master_weights"])

    # -- state ------------------------------------------------------------------------------
    def _cl_master(self, group, p):
        return group.get("master_weights", False) and p.dtype in (torch.bfloat16, torch.float16)

    def _cl_lists(self, group, params, grads):
        """The launch lists of moment-based optimizers (Adam, Lion): params, grads, one list
        per state in :attr:`_cl_state_keys` (zeros on a parameter's first step, float32 for
        master-weight parameters), master copies or None; their names; the written slots."""
        st = self.state
        keys = self._cl_state_keys
        cols = [[] for _ in range(2 + len(keys))]
        masters = []
        for p, g in zip(params, grads):
            s = st[p]
            if keys[0] not in s:
                master = self._cl_master(group, p)
                dt = torch.float32 if master else p.dtype
                for k in keys:
                    s[k] = torch.zeros_like(p, dtype=dt, memory_format=torch.preserve_format)
                if master:
                    s["master_param"] = p.detach().float().clone()
            cols[0].append(p.detach())
            cols[1].append(g.detach())
            for j, k in enumerate(keys):
                cols[2 + j].append(s[k])
            masters.append(s.get("master_param"))
        anymaster = _check_master(masters)
        writes = 1 | sum(1 << (2 + j) for j in range(len(keys)))  # params and states
        if anymaster:
            writes |= 1 << len(cols)
        return (cols + [masters if anymaster else None],
                ["params", "grads", *(k + "s" for k in keys), "master_params"], writes)

    def _cl_cohorts(self, params):
        """Index lists of ``params`` by step count: one list when the update ignores the count
        (``[None]``: all of them), else one per distinct count (a new parameter counts 0)."""
        if not self._cl_step_matters:
            return [None]
        by_count: dict = {}
        for i, p in enumerate(params):
            st = self.state[p].get("step") if p in self.state else None
            by_count.setdefault(0.0 if st is None else float(st), []).append(i)
        return list(by_count.items())

    def _cl_layout(self, group):
        """The group settings a launch table's lists depend on (a change rebuilds it)."""
        return bool(group.get("master_weights", False))

    def _cl_plan(self, gi, group):
        """``(stream, units)`` for the group's params with gradients, or None. ``units``: per
        step cohort ``(plan, step)``, ``step`` the cohort's counter (None for optimizers whose
        update ignores the count)."""
        params = group["params"]
        # the O(len(params)) reads of every step (and, for new gradient tensors, their layout
        # check), without the __torch_function__ lookup that Parameter (a tensor subclass)
        # costs on each attribute read: 30 % faster per tensor
        with _NO_SUBCLASS_FN():
            grads = list(map(_GRAD, params))
            try:
                kg = tuple(map(_PTR, grads))
            except TypeError:  # a param without a gradient (None): left out of the step
                kg = None
            if kg is None:
                pg = [(p, g) for p, g in zip(params, grads) if g is not None]
                if not pg:
                    return None
                params, grads = [a for a, _ in pg], [b for _, b in pg]
                kg = tuple(map(_PTR, grads))
            kp = tuple(map(_PTR, params))
            hit = self._cl_plans.get(gi)
            if hit is not None and not (hit[0] == kp and hit[3] == self._cl_layout(group) and (
                    hit[1] == kg or _same_layout(params, grads, kp, kg, hit[4]))):
                hit = None
        if hit is None:
            return self._cl_build(gi, group, params, grads, kp, kg)
        units = hit[2]
        dev = units[0][0].device
        out = []
        with _launch.ensure_device(dev):
            s = _launch.current_stream("torch", dev)
            if hit[1] != kg:  # new gradient tensors (zero_grad(set_to_none=True)): repoint
                units = [(P.repoint(plan, 1, kg if idx is None else [kg[i] for i in idx], s),
                          idx, ps, st) for plan, idx, ps, st in units]
                self._cl_plans[gi] = (kp, kg, units, hit[3], hit[4])
            for plan, _, _, st in units:
                plan = P.for_stream(plan, s)
                if plan.captured and not plan.pinned:  # a graph points into it: keep it
                    plan.pinned = True
                    self._cl_captured.append((plan, st))
                out.append((plan, st))
        return s, out

    def _cl_build(self, gi, group, params, grads, kp, kg):
        """The miss path of :meth:`_cl_plan`: states made, lists validated, one plan per step
        cohort. Each cohort gets a counter of its own (a CPU tensor until a capturable step
        moves it), shared by its parameters' states; parameters left out of this step keep
        theirs, so their counts stay as torch's."""
        for p, g in zip(params, grads):
            if g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        if self._cl_unsettled:
            self._cl_settle(group, params)
        units, s = [], None
        for cohort in self._cl_cohorts(params):
            if cohort is None:
                idx, ps, gs, st = None, params, grads, None
            else:
                count, idx = cohort
                ps, gs = [params[i] for i in idx], [grads[i] for i in idx]
                st = self._cl_counter(ps, count)
            lists, names, writes = self._cl_lists(group, ps, gs)
            plan, s = F._validate(f"{type(self).__name__}.step", names, lists, writes,
                                  (1,), None, ())
            if st is not None:
                for p in ps:
                    self.state[p]["step"] = st
            units.append((plan, idx if idx is None or len(idx) < len(params) else None, ps, st))
        self._cl_plans[gi] = (kp, kg, units, self._cl_layout(group),
                              tuple(p.numel() for p in params))
        return s, [(plan, st) for plan, _, _, st in units]

    def _cl_counter(self, ps, count):
        """The step counter of a cohort: the one its params already share, if they do (a
        captured graph may point into it and count in it), params outside the cohort that
        shared it getting a copy of their own (their count stays); else a new CPU tensor
        holding ``count``."""
        st = self.state[ps[0]].get("step")
        if not (isinstance(st, torch.Tensor) and all(self.state[p].get("step") is st
                                                     for p in ps)):
            return torch.tensor(count, dtype=torch.float32)
        members = set(ps)
        for p, s in self.state.items():
            if s.get("step") is st and p not in members:
                s["step"] = st.clone()
        return st

    def _cl_device_step(self, gi, k):
        """Cohort ``k``'s counter moved to its plan's GPU (a capturable step, or
        ``found_inf``)."""
        units = self._cl_plans[gi][2]
        plan, idx, ps, st = units[k]
        dst = st.to(plan.device)
        for p in ps:
            self.state[p]["step"] = dst
        units[k] = (plan, idx, ps, dst)
        return dst

    def _cl_begin(self, closure, found_inf, grad_scale):
        """The start of every ``step``: ``(loss, found_inf, grad_scale)``, the loss from
        ``closure`` run with grad enabled (None without a closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        st = self.state
        if type(st) is not State:  # assigned since the last step
            st = self.state = tracked(st)
        seen = self._cl_seen
        if seen is None or seen[0] is not st._v or seen[1] != st._v.n:
            self._cl_plans = {}  # the state changed: no table may point at what it held
        if found_inf is None:  # torch.amp.GradScaler sets these attributes
            found_inf = getattr(self, "found_inf", None)
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        return loss, found_inf, grad_scale

    def _cl_mark(self):
        """Called once a step's tables are built and its counters placed (the optimizer's own
        state writes done): the state as the tables now see it."""
        self._cl_seen = (self.state._v, self.state._v.n)

    def _cl_lr(self, group):
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            return lr if lr.is_cuda else float(lr)
        return lr

    def load_state_dict(self, state_dict):
        """Load a state saved by :meth:`state_dict` (or by the torch optimizer it replaces).

        As torch's ``load_state_dict``, except that the states and master copies of
        master-weight groups stay float32 (torch casts every state to its param's dtype).
        The master copies are checked against the parameters at the next step that updates
        them, not here (a checkpoint may restore the model after the optimizer): a missing
        copy, or one that does not round to its parameter, is then made from the
        parameter.

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
        # torch casts every loaded state to the param's dtype: keep float32 states and master
        # copies float32 for master-weight groups.
        saved = {k: dict(v) for k, v in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        self._cl_plans = {}
        for g in self.param_groups:  # a torch optimizer's groups have no master_weights key
            g.setdefault("master_weights", self.defaults["master_weights"])
        ids = [p for g in self.param_groups for p in g["params"]]
        for idx, sv in saved.items():
            if not isinstance(idx, int) or idx >= len(ids):
                continue
            p = ids[idx]
            st = self.state[p]
            if "master_param" in sv:
                for k in (*self._cl_state_keys, "master_param"):
                    v = sv.get(k)
                    if isinstance(v, torch.Tensor):
                        st[k] = v.to(device=p.device, dtype=torch.float32).clone()
        for g in self.param_groups:  # master groups loaded from a state without master copies
            for p in g["params"]:
                st = self.state.get(p)
                if st and self._cl_master(g, p) and "master_param" not in st:
                    for k in self._cl_state_keys:
                        if isinstance(st.get(k), torch.Tensor):
                            st[k] = st[k].to(torch.float32)
        # the master copies are checked against the parameters at the next step, not now: a
        # checkpoint is often restored optimizer first, model second
        self._cl_unsettled = {p for p, st in self.state.items() if st}
        self.state = tracked(self.state)  # torch's load assigned a plain defaultdict

    def _cl_settle(self, group, params):
        """Master copies of ``params`` loaded since their last step, made consistent with the
        parameters as they are now (the miss path of the first step after a load). Every step
        writes a parameter from its master copy, so a loaded copy that does not round to the
        parameter is stale (the parameter moved without it: steps of a torch optimizer that
        carried the state along, an assignment) and is made again from the parameter, as is
        the missing copy of a master-weight parameter loaded from a state without one."""
        pending = self._cl_unsettled
        for p in params:
            if p not in pending:
                continue
            pending.discard(p)
            st = self.state.get(p)
            m = st.get("master_param") if st else None
            if m is None:
                if st and self._cl_master(group, p):
                    st["master_param"] = p.detach().float().clone()
            elif not torch.equal(m.to(p.dtype), p.detach()):
                st["master_param"] = p.detach().float().clone()

    def state_dict(self):
        """The optimizer's state, as torch's ``state_dict``, loadable into torch's optimizers.

        Parameters that share a step counter (one per step cohort) get a copy each, so
        the dict holds one count per parameter, as torch's does.

        Returns
        -------
        dict
            ``{"state": ..., "param_groups": ...}``; master-weight parameters also hold
            ``"master_param"`` (float32) in their state.
        """
        sd = super().state_dict()
        sd["state"] = {k: ({**v, "step": v["step"].clone()} if "step" in v else dict(v))
                       for k, v in sd["state"].items()}
        return sd
