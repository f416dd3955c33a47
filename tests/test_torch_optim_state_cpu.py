"""cupylab.torch.optim's launch tables against changes made between steps, without a GPU
(wherever torch is installed): a changed ``state`` (cleared, replaced, a parameter's entry or
one tensor of it swapped, the whole mapping assigned), a changed group setting the table's
lists depend on (SGD's momentum, master weights) and a parameter shrunk in place each make the
next step build its table again, so that no table points at memory the optimizer no longer
holds; steady steps build nothing. The tables are recorded (the addresses of every list), the
kernels are not run."""
import contextlib
import copy
import pickle
from collections import defaultdict

import pytest

torch = pytest.importorskip("torch")

from cupylab.torch import _optim_core, _optim_state  # noqa: E402


class Plan:
    device, captured, pinned = 0, False, False


@pytest.fixture
def rec(monkeypatch):
    """(cupylab.torch.optim, the tables built: per build the data pointers of each list, the
    launches: (table, launcher keywords))."""
    from cupylab import _launch, optim as _optim
    from cupylab.torch import optim as O

    builds, launches = [], []

    def validate(opname, names, lists, writes, *a, **k):
        plan = Plan()
        plan.lists = {n: None if lst is None else [t.data_ptr() for t in lst]
                      for n, lst in zip(names, lists)}
        builds.append(plan)
        return plan, 0

    def launcher(name, plan, s, **kw):
        return lambda: launches.append((plan, kw))

    monkeypatch.setattr(_optim_core.F, "_validate", validate)
    monkeypatch.setattr(_optim_core.P, "for_stream", lambda plan, s: plan)
    monkeypatch.setattr(_optim_core.P, "repoint", lambda plan, slot, ptrs, s: plan)
    monkeypatch.setattr(_launch, "ensure_device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_launch, "current_stream", lambda kind, d: 0)
    for name in ("adam_launcher", "sgd_launcher", "lion_launcher"):
        monkeypatch.setattr(_optim, name, launcher)
    return O, builds, launches


def _adam(O, n=2):
    ps = [torch.nn.Parameter(torch.randn(3 + i)) for i in range(n)]
    opt = O.Adam(ps, lr=1e-3)
    for p in ps:
        p.grad = torch.ones_like(p)
    return ps, opt


def test_steady_steps_build_nothing(rec):
    O, builds, launches = rec
    ps, opt = _adam(O)
    for _ in range(3):
        opt.step()
    assert len(builds) == 1 and len(launches) == 3
    assert type(opt.state) is _optim_state.State


@pytest.mark.parametrize("change", ["clear", "assign_mapping", "del_entry", "pop_entry",
                                    "assign_entry", "swap_tensor", "del_tensor"])
def test_a_changed_state_rebuilds_the_table_on_what_the_state_holds(rec, change):
    """The table held the addresses of the old state tensors: after the state is reset it
    pointed at freed memory (the step updated tensors the optimizer no longer held)."""
    O, builds, launches = rec
    ps, opt = _adam(O)
    opt.step()
    a = ps[0]
    if change == "clear":
        opt.state.clear()
    elif change == "assign_mapping":
        opt.state = defaultdict(dict)
    elif change == "del_entry":
        del opt.state[a]
    elif change == "pop_entry":
        opt.state.pop(a)
    elif change == "assign_entry":
        opt.state[a] = {"step": torch.tensor(5.0), "exp_avg": torch.zeros(3),
                        "exp_avg_sq": torch.zeros(3)}
    elif change == "swap_tensor":
        opt.state[a]["exp_avg"] = torch.zeros(3)
    else:
        del opt.state[a]["exp_avg"]
        del opt.state[a]["exp_avg_sq"]
    launches.clear()
    opt.step()
    n = len(builds)
    assert n >= 2  # (a reset entry counts from 0 again: its own step cohort, table)
    ptrs = {key: [] for key in ("exp_avgs", "exp_avg_sqs")}
    for plan, _ in launches:
        for key in ptrs:
            ptrs[key] += plan.lists[key]
    for key in ptrs:
        assert sorted(ptrs[key]) == sorted(opt.state[p][key[:-1]].data_ptr() for p in ps)
    assert type(opt.state) is _optim_state.State
    assert all(type(v) is _optim_state.ParamState for v in opt.state.values())
    opt.step()
    assert len(builds) == n  # steady again


def test_an_assigned_entry_counts_its_own_step(rec):
    O, builds, launches = rec
    ps, opt = _adam(O)
    opt.step()
    a, b = ps
    opt.state[a] = {"step": torch.tensor(5.0), "exp_avg": torch.zeros(3),
                    "exp_avg_sq": torch.zeros(3)}
    launches.clear()
    opt.step()  # a counts from 5, b from 1: two cohorts
    assert sorted(float(kw["step"]) for _, kw in launches) == [2.0, 6.0]
    assert float(opt.state[a]["step"]) == 6.0 and float(opt.state[b]["step"]) == 2.0


def test_in_place_state_updates_need_no_rebuild(rec):
    O, builds, _ = rec
    ps, opt = _adam(O)
    opt.step()
    for p in ps:
        opt.state[p]["exp_avg"].zero_()
        _ = opt.state[p]["exp_avg_sq"]  # reads count nothing
    _ = opt.state[torch.nn.Parameter(torch.ones(1))]  # an empty entry for an unknown param
    opt.step()
    assert len(builds) == 1


def test_sgd_momentum_switched_on_or_off_rebuilds_the_table(rec):
    """The table was built with or without momentum buffers and kept: momentum set after
    the first step was ignored (no buffer made); switched off, the step still took the
    momentum kernel with the old buffers."""
    O, builds, launches = rec
    a = torch.nn.Parameter(torch.randn(3))
    opt = O.SGD([a], lr=0.1, momentum=0.0)
    a.grad = torch.ones(3)
    opt.step()
    assert launches[-1][0].lists["momentum_buffers"] is None
    opt.param_groups[0]["momentum"] = 0.9
    opt.step()
    buf = opt.state[a]["momentum_buffer"]
    assert len(builds) == 2 and launches[-1][0].lists["momentum_buffers"] == [buf.data_ptr()]
    assert launches[-1][1]["momentum"] == 0.9
    opt.param_groups[0]["momentum"] = 0.0
    opt.step()
    assert len(builds) == 3 and launches[-1][0].lists["momentum_buffers"] is None


def test_master_weights_switched_on_rebuilds_the_table(rec):
    O, builds, launches = rec
    a = torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))
    opt = O.Adam([a], lr=1e-3)
    a.grad = torch.ones_like(a)
    opt.step()
    assert launches[-1][0].lists["master_params"] is None
    opt.param_groups[0]["master_weights"] = True
    opt.load_state_dict(opt.state_dict())  # float32 states for the master group
    opt.step()
    master = opt.state[a]["master_param"]
    assert len(builds) == 2 and launches[-1][0].lists["master_params"] == [master.data_ptr()]


def test_a_parameter_shrunk_in_place_with_new_gradients_rebuilds(rec):
    """``p.data = p.data[:k]`` keeps the address: the stored table (100 elements) was
    repointed to the new 10-element gradients, and the kernel read past their end."""
    O, builds, _ = rec
    a = torch.nn.Parameter(torch.randn(100))
    opt = O.SGD([a], lr=0.1)
    a.grad = torch.ones(100)
    opt.step()
    with torch.no_grad():
        a.data = a.data[:10]
    a.grad = torch.ones(10)
    opt.step()
    assert len(builds) == 2
    a.grad = torch.ones(10)  # new gradients of the same size: repointed, not rebuilt
    opt.step()
    assert len(builds) == 2


def test_the_counted_state_copies_and_pickles():
    st = _optim_state.tracked(defaultdict(dict))
    v = st._v
    key = torch.zeros(1)
    st[key]["m"] = torch.ones(2)
    n = v.n
    for other in (copy.deepcopy(st), pickle.loads(pickle.dumps(st))):
        assert type(other) is _optim_state.State and other._v is not v
        (inner,) = other.values()
        assert type(inner) is _optim_state.ParamState and inner._v is other._v
        inner["m"] = 0
        assert v.n == n  # the copy counts apart
    shallow = st.copy()
    assert shallow[key] is st[key]
    st[key].update(q=1)
    st[key].setdefault("r", 2)
    assert v.n == n + 2


def test_an_optimizer_deep_copied_steps_on_its_own_state(rec):
    O, builds, launches = rec
    ps, opt = _adam(O)
    opt.step()
    twin = copy.deepcopy(opt)
    assert type(twin.state) is _optim_state.State and twin.state._v is not opt.state._v
    opt.step()
    assert len(builds) == 1
    tp = list(twin.param_groups[0]["params"])
    for p in tp:
        p.grad = torch.ones_like(p)
    twin.step()  # torch's __getstate__ drops the tables: AttributeError on _cl_seen
    assert len(builds) == 2
    assert launches[-1][0].lists["params"] == [p.data_ptr() for p in tp]
    assert float(twin.state[tp[0]]["step"]) == 2.0 and float(opt.state[ps[0]]["step"]) == 2.0
    back = pickle.loads(pickle.dumps(twin))
    for p in back.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    back.step()
    assert len(builds) == 3


def test_sgd_deep_copied_keeps_its_first_step_rules(rec):
    O, builds, launches = rec
    a = torch.nn.Parameter(torch.ones(3))
    opt = O.SGD([a], lr=0.1, momentum=0.9, dampening=0.5)
    twin = copy.deepcopy(opt)
    for p in twin.param_groups[0]["params"]:
        p.grad = torch.ones(3)
    twin.step()
    assert launches[-1][1]["first_step"] is True


@pytest.mark.parametrize("how", ["copy.copy", "copy", "or", "ror"])
def test_copies_and_unions_of_the_state_count_as_the_state_does(rec, how):
    """copy.copy and | called State(default_factory, mapping) (an error); a copy assigned
    back to optimizer.state must still count a state tensor replaced later (a fresh counter
    for the copy missed the per-parameter dicts' changes, and the table kept the old
    tensor)."""
    O, builds, launches = rec
    ps, opt = _adam(O)
    opt.step()
    other = {"copy.copy": lambda: copy.copy(opt.state), "copy": lambda: opt.state.copy(),
             "or": lambda: opt.state | {}, "ror": lambda: {} | opt.state}[how]()
    assert type(other) is _optim_state.State and set(other) == set(opt.state)
    assert all(other[p] is opt.state[p] for p in ps)  # shallow: the same dicts
    opt.state = other
    opt.step()
    n = len(builds)
    new = torch.zeros(3)
    opt.state[ps[0]]["exp_avg"] = new
    opt.step()
    assert len(builds) > n and new.data_ptr() in launches[-1][0].lists["exp_avgs"]
    extra = torch.nn.Parameter(torch.ones(2))
    u = opt.state | {extra: {"step": torch.tensor(1.0)}}
    assert type(u[extra]) is _optim_state.ParamState and extra not in opt.state
