"""cupylab.torch.optim's host logic without a GPU (wherever torch is installed): the launches
the SGD, Adam and Lion drop-ins make (recorded, not run) for momentum and dampening first steps,
per-parameter step counts, master weights loaded from torch checkpoints, the launch tables a
captured step points into, and the refusals that must leave every count and group untouched."""
import pytest

torch = pytest.importorskip("torch")

from cupylab.torch import _optim_core  # noqa: E402


# -- torch.optim.SGD host logic (the launches recorded, not run) -------------------------------
@pytest.fixture
def sgd_launches(monkeypatch):
    import contextlib

    from cupylab import _launch, optim as _optim
    from cupylab.torch import optim as O

    class Plan:
        device, captured, pinned = 0, False, False

    seen = []
    monkeypatch.setattr(_optim_core.F, "_validate", lambda *a, **k: (Plan(), 0))
    monkeypatch.setattr(_optim_core.P, "for_stream", lambda plan, s: plan)
    monkeypatch.setattr(_launch, "ensure_device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_launch, "current_stream", lambda kind, d: 0)
    # recorded when launched (after every group was checked), not when checked
    monkeypatch.setattr(_optim, "sgd_launcher", lambda name, plan, s, **kw: lambda: seen.append(kw))
    return O, seen


def test_sgd_momentum_without_dampening_takes_late_params_and_grad_scaler(sgd_launches):
    """Without dampening the first momentum step is the ordinary step on a zeroed buffer, so a
    parameter whose first gradient comes late joins its group's launch, and a first step may
    carry found_inf (torch.amp.GradScaler always passes it)."""
    O, seen = sgd_launches
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = O.SGD([a, b], lr=0.1, momentum=0.9)
    a.grad = torch.ones(3)
    opt.step(found_inf=torch.zeros(1))  # b has no gradient yet: left out
    b.grad = torch.ones(2)
    opt.step()
    assert [kw["first_step"] for kw in seen] == [False, False]
    assert torch.count_nonzero(opt.state[b]["momentum_buffer"]) == 0  # zeroed, not stale


def test_sgd_dampening_keeps_the_first_step_rules(sgd_launches):
    O, seen = sgd_launches
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = O.SGD([a, b], lr=0.1, momentum=0.9, dampening=0.5)
    a.grad = torch.ones(3)
    with pytest.raises(ValueError, match="with dampening, the first momentum step"):
        opt.step(found_inf=torch.zeros(1))
    opt.step()  # the refused step did not count: this one is still the first
    assert seen[-1]["first_step"] is True
    opt2 = O.SGD([a, b], lr=0.1, momentum=0.9, dampening=0.5)
    opt2.step()
    assert seen[-1]["first_step"] is True
    b.grad = torch.ones(2)
    with pytest.raises(ValueError, match="with dampening, some parameters"):
        opt2.step()


def test_optimizer_keeps_the_tables_a_captured_step_points_into(sgd_launches, monkeypatch):
    """A plan launched during a CUDA graph capture stays with the optimizer after its groups'
    tables are rebuilt (new parameters, a loaded state): the graph replays into it."""
    O, seen = sgd_launches
    captured = []

    def for_stream(plan, s):
        plan.captured = bool(captured)
        return plan

    monkeypatch.setattr(_optim_core.P, "for_stream", for_stream)
    a = torch.nn.Parameter(torch.ones(3))
    opt = O.SGD([a], lr=0.1)
    a.grad = torch.ones(3)
    opt.step()  # builds the table
    opt.step()
    assert opt._cl_captured == []
    captured.append(True)
    opt.step()  # "during a capture"
    opt.step()
    plan = opt._cl_plans[0][2][0][0]
    assert len(opt._cl_captured) == 1 and opt._cl_captured[0][0] is plan
    opt.load_state_dict(opt.state_dict())  # tables dropped and rebuilt later
    assert opt._cl_plans == {} and [c[0] for c in opt._cl_captured] == [plan]


# -- torch optimizers: checkpoints, late groups, late parameters (no launch) -------------------
def test_adam_keeps_master_weights_when_loading_a_torch_checkpoint(adam_launches):
    O, _ = adam_launches
    p = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
    ref = torch.optim.Adam([p], lr=1e-3)
    p.grad = torch.randn(8).to(torch.bfloat16)
    ref.step()  # torch's state: bf16 exp_avg / exp_avg_sq, no master copy
    opt = O.Adam([p], lr=1e-3, master_weights=True)
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["master_weights"] is True
    st = opt.state[p]
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
    torch.testing.assert_close(st["exp_avg"], ref.state[p]["exp_avg"].float())
    with torch.no_grad():
        p.add_(1.0)  # the model is loaded after the optimizer
    opt.step()  # the master copy is made from the parameter as it is at the step
    torch.testing.assert_close(st["master_param"], p.detach().float(), rtol=0, atol=0)


def test_a_loaded_master_copy_that_does_not_round_to_its_parameter_is_made_again(
        adam_launches):
    """cupylab -> torch -> cupylab: torch's steps move the bf16 parameter and carry the
    master copy along untouched; on the way back the stale copy must not win. The check
    is made at the first step after the load, against the parameter as it is then."""
    O, seen = adam_launches
    p = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
    ref = torch.optim.Adam([p], lr=1e-3)
    p.grad = torch.randn(8).to(torch.bfloat16)
    ref.step()
    sd = ref.state_dict()
    fresh = p.detach().float() + 2.0 ** -12 * p.detach().float()  # rounds to p: a true copy
    sd["state"][0]["master_param"] = fresh.clone()
    opt = O.Adam([p], lr=1e-3, master_weights=True)
    opt.load_state_dict(sd)
    opt.step()
    torch.testing.assert_close(opt.state[p]["master_param"], fresh, rtol=0, atol=0)
    sd["state"][0]["master_param"] = p.detach().float() + 1.0  # the parameter moved without it
    opt.load_state_dict(sd)
    opt.step()
    torch.testing.assert_close(opt.state[p]["master_param"], p.detach().float(), rtol=0, atol=0)
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert len(seen) == 2


def test_a_checkpoint_restored_optimizer_first_keeps_its_master_copies(adam_launches):
    """The usual restore order: fresh model, optimizer loaded, then the model. At the
    optimizer's load the parameter still holds its initial value; the trained master copy
    must survive (it rounds to the parameter once the model is loaded)."""
    O, _ = adam_launches
    trained = torch.randn(8) * 3
    p = torch.nn.Parameter(trained.to(torch.bfloat16))
    opt = O.Adam([p], lr=1e-3, master_weights=True)
    p.grad = torch.ones(8, dtype=torch.bfloat16)
    opt.step()
    opt.state[p]["master_param"] = trained.clone()  # as training leaves it
    ck_model, ck_opt = p.detach().clone(), opt.state_dict()

    q = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))  # a fresh model's init
    opt2 = O.Adam([q], lr=1e-3, master_weights=True)
    opt2.load_state_dict(ck_opt)
    with torch.no_grad():
        q.copy_(ck_model)  # model.load_state_dict
    q.grad = torch.ones(8, dtype=torch.bfloat16)
    opt2.step()
    torch.testing.assert_close(opt2.state[q]["master_param"], trained, rtol=0, atol=0)


def test_adam_refuses_amsgrad_added_or_loaded_later():
    from cupylab.torch import optim as O

    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    opt = O.Adam([a], lr=1e-3)
    with pytest.raises(ValueError, match="amsgrad is not supported"):
        opt.add_param_group({"params": [b], "amsgrad": True})
    assert len(opt.param_groups) == 1  # refused before it joined
    sd = torch.optim.Adam([a], lr=1e-3, amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="amsgrad is not supported"):
        opt.load_state_dict(sd)
    assert not opt.param_groups[0]["amsgrad"]


@pytest.fixture
def adam_launches(monkeypatch):
    """cupylab.torch.optim.Adam with the launches recorded: per launch the parameters of its
    plan and the step count it was given (no GPU)."""
    import contextlib

    from cupylab import _launch, optim as _optim
    from cupylab.torch import optim as O

    class Plan:
        device, captured, pinned = 0, False, False

    def validate(opname, names, lists, *a, **k):
        plan = Plan()
        plan.params = [p.data_ptr() for p in lists[0]]
        return plan, 0

    seen = []
    monkeypatch.setattr(_optim_core.F, "_validate", validate)
    monkeypatch.setattr(_optim_core.P, "for_stream", lambda plan, s: plan)
    monkeypatch.setattr(_launch, "ensure_device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_launch, "current_stream", lambda kind, d: 0)
    monkeypatch.setattr(_optim, "adam_launcher",  # recorded when launched
                        lambda name, plan, s, step, **k: lambda: seen.append((plan.params, step)))
    return O, seen


def test_adam_counts_steps_per_parameter_as_torch_does(adam_launches):
    """A parameter whose first gradient comes late, or that skips a step, keeps torch's count
    (its own cohort: one more launch while the counts differ); cohorts with equal counts share
    a counter again after a rebuild."""
    O, seen = adam_launches
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    opt = O.Adam([a, b], lr=1e-3)
    a.grad = torch.ones(3)
    opt.step()
    opt.step()
    assert seen == [([a.data_ptr()], 1.0), ([a.data_ptr()], 2.0)]
    b.grad = torch.ones(2)
    seen.clear()
    opt.step()  # a's third step, b's first: two cohorts
    assert sorted(seen, key=lambda r: r[1]) == [([b.data_ptr()], 1.0), ([a.data_ptr()], 3.0)]
    assert float(opt.state[a]["step"]) == 3.0 and float(opt.state[b]["step"]) == 1.0
    a.grad = None
    seen.clear()
    opt.step()  # a has no gradient: left out, its count stays 3
    assert seen == [([b.data_ptr()], 2.0)] and float(opt.state[a]["step"]) == 3.0
    a.grad = torch.ones(3)
    seen.clear()
    opt.step()  # a: 4, b: 3
    assert sorted(seen, key=lambda r: r[1]) == [([b.data_ptr()], 3.0), ([a.data_ptr()], 4.0)]
    sd = opt.state_dict()
    assert [float(sd["state"][i]["step"]) for i in (0, 1)] == [4.0, 3.0]
    sd["state"][1]["step"] = torch.tensor(4.0)  # counts that are equal share one counter
    opt.load_state_dict(sd)
    seen.clear()
    opt.step()
    assert seen == [([a.data_ptr(), b.data_ptr()], 5.0)]
    assert opt.state[a]["step"] is opt.state[b]["step"]


def test_adam_rebuild_keeps_the_counter_a_cohort_shares(adam_launches):
    """A rebuilt table keeps the counter tensor its cohort already shares (a captured graph
    may count in it); a parameter left out of the step gets a copy, its count staying."""
    O, seen = adam_launches
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    opt = O.Adam([a, b], lr=1e-3)
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    opt.step()
    c = opt.state[a]["step"]
    assert opt.state[b]["step"] is c
    a.grad = torch.ones(6)[::2]  # a gradient of another layout: the table is rebuilt
    opt.step()
    assert opt.state[a]["step"] is c and opt.state[b]["step"] is c and float(c) == 2.0
    b.grad = None
    opt.step()  # b left out: a counts on in c, b keeps its count in a copy
    assert opt.state[a]["step"] is c and float(c) == 3.0
    assert opt.state[b]["step"] is not c and float(opt.state[b]["step"]) == 2.0
    b.grad = torch.ones(2)
    opt.step()  # two cohorts again (a: 4, b: 3), each with its own counter
    assert float(opt.state[a]["step"]) == 4.0 and float(opt.state[b]["step"]) == 3.0


def test_adam_new_gradients_are_patched_into_each_cohorts_table(adam_launches, monkeypatch):
    """zero_grad(set_to_none=True) gives new gradient tensors every step: each cohort's table
    gets the addresses of its own parameters' gradients, in its order."""
    O, seen = adam_launches
    patched = []

    def repoint(plan, slot, ptrs, s):
        patched.append((plan.params, slot, list(ptrs)))
        return plan

    monkeypatch.setattr(_optim_core.P, "repoint", repoint)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (3, 2, 4)]
    opt = O.Adam(ps, lr=1e-3)
    ps[0].grad, ps[2].grad = torch.ones(3), torch.ones(4)
    opt.step()  # ps[1] has no gradient yet
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()  # two cohorts now: counts 1 (ps[0], ps[2]) and 0 (ps[1])
    assert patched == []
    for p in ps:
        p.grad = torch.ones_like(p)  # new tensors, same layout: repointed, not rebuilt
    opt.step()
    by_plan = {tuple(params): (slot, ptrs) for params, slot, ptrs in patched}
    ptr = [p.data_ptr() for p in ps]
    gptr = [p.grad.data_ptr() for p in ps]
    assert by_plan == {(ptr[0], ptr[2]): (1, [gptr[0], gptr[2]]), (ptr[1],): (1, [gptr[1]])}
    assert [float(opt.state[p]["step"]) for p in ps] == [3.0, 2.0, 3.0]


def test_adam_loads_a_torch_state_with_different_counts(adam_launches):
    O, seen = adam_launches
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))
    ref = torch.optim.Adam([a, b], lr=1e-3)
    a.grad = torch.ones(3)
    ref.step()
    b.grad = torch.ones(2)
    ref.step()
    opt = O.Adam([a, b], lr=1e-3)
    opt.load_state_dict(ref.state_dict())  # a counts 2, b counts 1: no longer refused
    opt.step()
    assert sorted(seen, key=lambda r: r[1]) == [([b.data_ptr()], 2.0), ([a.data_ptr()], 3.0)]


@pytest.mark.parametrize("name,keys,writes", [("Adam", ("exp_avg", "exp_avg_sq"), 0b1101),
                                               ("Lion", ("exp_avg",), 0b101)])
@pytest.mark.parametrize("master", [False, True])
def test_moment_optimizers_launch_lists(name, keys, writes, master):
    """The slots a step launches on: params, grads, the moments (made zero on the first step,
    float32 for master-weight params), the master copies; which of them are written."""
    from cupylab.torch import optim as O

    dt = torch.bfloat16 if master else torch.float32
    ps = [torch.nn.Parameter(torch.randn(n).to(dt)) for n in (3, 5)]
    gs = [torch.randn(n).to(dt) for n in (3, 5)]
    opt = getattr(O, name)(ps, lr=1e-3, master_weights=master)
    lists, names, w = opt._cl_lists(opt.param_groups[0], ps, gs)
    assert names == ["params", "grads", *(k + "s" for k in keys), "master_params"]
    nm = 2 + len(keys)
    assert w == writes | ((1 << nm) if master else 0)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(lists[0], ps))
    assert [a.data_ptr() for a in lists[1]] == [b.data_ptr() for b in gs]
    for j, k in enumerate(keys):
        assert [t is opt.state[p][k] for t, p in zip(lists[2 + j], ps)] == [True, True]
        assert all(t.dtype == (torch.float32 if master else dt) and not t.any()
                   for t in lists[2 + j])
    if master:
        assert [t is opt.state[p]["master_param"] for t, p in zip(lists[nm], ps)] == [True] * 2
        torch.testing.assert_close(lists[nm][1], ps[1].detach().float())
    else:
        assert lists[nm] is None


@pytest.mark.parametrize("name", ["Adam", "SGD", "Lion"])
def test_master_weights_group_mixing_dtypes_is_refused_clearly(name):
    from cupylab.torch import optim as O  # no launch: the refusal comes first

    a = torch.nn.Parameter(torch.randn(3))
    b = torch.nn.Parameter(torch.randn(3).to(torch.bfloat16))
    kw = dict(lr=1e-3, momentum=0.9) if name == "SGD" else dict(lr=1e-3)
    opt = getattr(O, name)([a, b], master_weights=True, **kw)
    a.grad, b.grad = torch.ones(3), torch.ones(3).to(torch.bfloat16)
    with pytest.raises(TypeError, match="float32 and 16-bit params in one group"):
        opt.step()


def test_sgd_refuses_a_first_dampened_step_with_found_inf_before_stepping_any_group(
        sgd_launches):
    """The refusal came after the groups before the offending one were stepped."""
    O, seen = sgd_launches
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = O.SGD([{"params": [a]}, {"params": [b], "dampening": 0.5}], lr=0.1, momentum=0.9)
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    with pytest.raises(ValueError, match="with dampening, the first momentum step"):
        opt.step(found_inf=torch.zeros(1))
    assert seen == []  # the first group was not stepped either
    opt.step()
    assert [kw["first_step"] for kw in seen] == [False, True]
    opt.step(found_inf=torch.zeros(1))  # b's buffers had their first step
    assert [kw["first_step"] for kw in seen[2:]] == [False, False]


# -- the torch optimizers with cupylab.optim's own launch checks (launches recorded) ---------
@pytest.fixture
def checked_launches(sim, monkeypatch):
    """cupylab.torch.optim with the real launch checks of cupylab.optim and no GPU: a plan of
    one dtype group per list (the dtypes of the lists' first tensors); the launches are
    recorded by ``sim``."""
    import types

    from cupylab.torch import optim as O

    def validate(opname, names, lists, *a, **k):
        sig = tuple(None if lst is None else str(lst[0].dtype).split(".")[1] for lst in lists)
        group = types.SimpleNamespace(sig=sig, nblocks=1, tab_ptr=0x100, map_ptr=0x200)
        return types.SimpleNamespace(device=0, kind="torch", chunk=2048, groups=[group],
                                     captured=False, pinned=False), 0x5700

    monkeypatch.setattr(_optim_core.F, "_validate", validate)
    monkeypatch.setattr(_optim_core.P, "for_stream", lambda plan, s: plan)
    return O, sim["launches"]


def _bias1(launch):  # Adam's first bias correction, s[5] of the launch's Args
    return launch["args"][3 + 5]


def test_an_adam_step_refused_by_its_checks_moves_no_count_and_steps_no_group(
        checked_launches):
    """The host step counter was advanced before the launch checks (a bad grad_scale raised
    after the count moved), and earlier groups were already stepped."""
    from conftest import FakeCAI

    O, launches = checked_launches
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = O.Adam([{"params": [a]}, {"params": [b]}], lr=1e-3)
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    with pytest.raises(TypeError, match=r"Adam.step: grad_scale must be a CUDA device array"):
        opt.step(grad_scale=torch.ones(1))  # host data

    def counts():
        return [float(opt.state[p].get("step", 0)) for p in (a, b)]

    assert launches == [] and counts() == [0.0, 0.0]
    opt.param_groups[1]["lr"] = FakeCAI((1,), typestr="<f8")  # a device lr, not float32
    with pytest.raises(TypeError, match="Adam.step: lr must be a one-element float32"):
        opt.step()  # the first group is checked and fine, the second is not
    assert launches == [] and counts() == [0.0, 0.0]
    opt.param_groups[1]["lr"] = 1e-3
    opt.step()
    assert counts() == [1.0, 1.0]
    assert len(launches) == 2 and [_bias1(x) for x in launches] == [pytest.approx(0.1)] * 2
    opt.step()
    assert [_bias1(x) for x in launches[2:]] == [pytest.approx(1 - 0.9 ** 2)] * 2


def test_the_next_count_of_a_host_counter_is_what_adding_one_gives():
    for v in (0.0, 1.0, 41.0, 2.0 ** 24 - 1, 2.0 ** 24, 2.0 ** 25):
        for dt in (torch.float32, torch.float64, torch.int64):
            st = torch.tensor(v, dtype=dt)
            nxt = _optim_core._next_count(st)
            assert float(st) == v  # unchanged
            st += 1
            assert nxt == float(st)  # float32 stays at 2 ** 24, as torch's own counter


def test_a_refused_sgd_step_keeps_the_first_step_of_new_dampened_buffers(checked_launches):
    """A first dampened momentum step refused by the launch checks (here a grad_scale on the
    host) is still the first at the next step: the buffers must be set to the gradient then
    (the flag was dropped before the checks)."""
    O, launches = checked_launches
    a = torch.nn.Parameter(torch.ones(3))
    opt = O.SGD([a], lr=0.1, momentum=0.9, dampening=0.5)
    a.grad = torch.ones(3)
    with pytest.raises(TypeError, match="SGD.step: grad_scale must be a CUDA device array"):
        opt.step(grad_scale=torch.ones(1))
    assert launches == []
    opt.step()
    opt.step()
    assert [x["args"][3 + 6] for x in launches] == [1.0, 0.0]  # first_step, s[6]


def test_a_lion_step_refused_by_its_checks_steps_no_group(checked_launches):
    from conftest import FakeCAI

    O, launches = checked_launches
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = O.Lion([{"params": [a]}, {"params": [b]}], lr=1e-4)
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    opt.param_groups[1]["lr"] = FakeCAI((2,))  # a device lr of two elements
    with pytest.raises(TypeError, match="Lion.step: lr must be a one-element float32"):
        opt.step()
    assert launches == []
    opt.param_groups[1]["lr"] = 1e-4
    opt.step()
    assert len(launches) == 2


def test_lion_checks_lr_and_weight_decay_as_torch_optimizers_do():
    """A negative weight_decay (or lr) was accepted, and reached the kernel unchecked."""
    from cupylab.torch import optim as O

    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    for kw, err, what in ((dict(weight_decay=-0.1), ValueError, "weight_decay must be a finite"),
                          (dict(weight_decay=float("nan")), ValueError, "weight_decay must be"),
                          (dict(weight_decay=None), TypeError, "weight_decay must be a Python"),
                          (dict(lr=-1e-4), ValueError, "lr must be a finite number >= 0"),
                          (dict(lr=float("inf")), ValueError, "lr must be a finite number"),
                          (dict(lr="1e-4"), TypeError, "lr must be a Python int or float"),
                          (dict(betas=(0.9, 1.0)), ValueError, r"betas must be in \[0, 1\)")):
        with pytest.raises(err, match=f"Lion: {what}"):
            O.Lion([p], **kw)
        with pytest.raises(err, match=f"Lion: {what}"):  # a group given to the constructor
            O.Lion([{"params": [p], **kw}])
    O.Lion([p], lr=torch.tensor(1e-4))  # a tensor lr is checked at the step
    opt = O.Lion([p], lr=1e-4)
    for bad in ({"lr": -1.0}, {"weight_decay": -1e-2}, {"betas": (1.5, 0.9)}):
        with pytest.raises(ValueError, match="Lion: "):
            opt.add_param_group({"params": [q], **bad})
        assert len(opt.param_groups) == 1  # refused before it joined
    opt.add_param_group({"params": [q], "lr": 1e-3})
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[1]["lr"] == 1e-3


# -- torch's step wrapper: hooks, the profiler range, no grad ----------------------------------
def test_step_runs_torchs_hooks_and_profiler_range_only_when_there_are_any(adam_launches,
                                                                          monkeypatch):
    """The drop-ins skip torch's step wrapper only when it would do nothing: the global and
    per-optimizer step hooks run (and may replace the arguments) and the profiler sees the
    ``Optimizer.step#<class>.step`` range, as for torch's optimizers; the step runs without
    grad either way, and torch does not wrap it a second time."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    O, seen = adam_launches
    a = torch.nn.Parameter(torch.ones(3))
    a.grad = torch.ones(3)
    opt = O.Adam([a], lr=0.1)
    assert type(opt).step.hooked is True and not hasattr(type(opt).step.__wrapped__, "hooked")
    modes, calls = [], []
    full = opt._cl_plan

    def plan(gi, group):
        modes.append(torch.is_grad_enabled())
        return full(gi, group)

    monkeypatch.setattr(opt, "_cl_plan", plan)
    ranges = []

    class Range(torch.autograd.profiler.record_function):  # counts the wrapper's ranges
        def __enter__(self):
            ranges.append(self.name)
            return super().__enter__()

    monkeypatch.setattr(torch.autograd.profiler, "record_function", Range)
    opt.step()  # no hook, no profiler: the direct call, no range opened
    assert modes == [False] and torch.is_grad_enabled() and len(seen) == 1 and not ranges
    h1 = opt.register_step_pre_hook(lambda o, args, kw: calls.append(("pre", o)))
    h2 = register_optimizer_step_post_hook(lambda o, args, kw: calls.append(("gpost", o)))
    try:
        opt.step()
    finally:
        h1.remove()
        h2.remove()
    assert calls == [("pre", opt), ("gpost", opt)] and modes == [False, False]
    assert ranges == ["Optimizer.step#Adam.step"]  # torch's wrapper, for the hooks
    h3 = register_optimizer_step_pre_hook(lambda o, args, kw: (args, {"closure": lambda: 7.0}))
    try:
        assert opt.step() == 7.0  # a pre-hook's new arguments are the step's
    finally:
        h3.remove()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert any(e.name == "Optimizer.step#Adam.step" for e in prof.events())
    opt.step()
    assert calls == [("pre", opt), ("gpost", opt)] and len(seen) == 5
    assert modes == [False] * 5 and torch.is_grad_enabled()


def test_step_restores_grad_mode_when_it_raises(adam_launches):
    O, _ = adam_launches
    a = torch.nn.Parameter(torch.ones(3))
    a.grad = torch.ones(3)
    opt = O.Adam([a], lr=0.1)

    def closure():
        raise KeyError("from the closure")

    with pytest.raises(KeyError, match="from the closure"):
        opt.step(closure)
    assert torch.is_grad_enabled()
    with torch.no_grad():
        opt.step()
        assert not torch.is_grad_enabled()
