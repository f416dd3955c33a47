"""Multi-tensor operators, host side (no GPU): argument errors raised before the GPU is
touched, aliasing rules, prepared calls, and NVRTC compilation of every multi-tensor kernel
instance (the launch tables, the plan cache and streams: test_multi_tensor_plan_cpu.py)."""
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from cupylab import _dtypes, foreach, optim
from cupylab._arrays import View
from cupylab.ops import _mt_core as C
from cupylab.ops import _mt_elementwise as E
from cupylab.ops import _mt_plan as P
from cupylab.ops import _mt_prepare as PR
from cupylab.ops import _mt_reduce as R

from conftest import FakeCAI, compile_every

REPO = Path(__file__).resolve().parent.parent
F32, BF16, F64 = (_dtypes.from_name(n) for n in ("float32", "bfloat16", "float64"))


def test_argument_errors_before_the_gpu():
    a, b = FakeCAI((3,)), FakeCAI((3,))
    with pytest.raises(TypeError, match="foreach.add_: tensors must be a list or tuple"):
        foreach.add_(a, [b])
    with pytest.raises(ValueError, match="other has 2 arrays but tensors has 1"):
        foreach.add_([a], [b, b])
    with pytest.raises(TypeError, match=r"foreach.add_: tensors\[0\] must be a CUDA device array"):
        foreach.add_([np.zeros(3)], [b])
    with pytest.raises(TypeError, match="other must be a list of GPU arrays or a Python number"):
        foreach.add_([a], "x")
    with pytest.raises(TypeError, match="weight must be a Python number"):
        foreach.lerp_([a], [b], [0.5])
    with pytest.raises(ValueError, match="momentum_buffers are required"):
        optim.sgd_([a], [b], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="nesterov needs momentum"):
        optim.sgd_([a], [b], [a], lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match="beta1 must be a finite number"):
        optim.adam_([a], [b], [a], [b], lr=0.1, step=1, beta1=-1)
    with pytest.raises(ValueError, match="beta1 must be a finite number"):  # not OverflowError
        optim.adam_([a], [b], [a], [b], lr=0.1, step=1, beta1=10**400)
    for bad in (float("nan"), float("inf"), 10**400):  # lr, scales: NaN made every param NaN
        with pytest.raises(ValueError, match="adam_: lr must be a finite number"):
            C._scalar_or_device("adam_", "lr", bad, None)


_NONE_LISTS = [  # (call with a required list None, "opname: name")
    (lambda a: foreach.add_(None, 1.0), "foreach.add_: tensors"),
    (lambda a: foreach.copy_(None, [a]), "foreach.copy_: dst"),
    (lambda a: foreach.copy_([a], None), "foreach.copy_: src"),
    (lambda a: foreach.zero_(None), "foreach.zero_: tensors"),
    (lambda a: foreach.lerp_([a], None, 0.5), "foreach.lerp_: ends"),
    (lambda a: foreach.norm(None), "foreach.norm: tensors"),
    (lambda a: foreach.norms(None), "foreach.norms: tensors"),
    (lambda a: foreach.clip_by_global_norm_(None, 1.0), "foreach.clip_by_global_norm_: tensors"),
    (lambda a: foreach.nonfinite_check(None), "foreach.nonfinite_check: tensors"),
    (lambda a: foreach.unscale_(None, a), "foreach.unscale_: tensors"),
    (lambda a: optim.adam_([a], None, [a], [a], lr=0.1, step=1), "adam_: grads"),
    (lambda a: optim.adam_(None, None, None, None, lr=0.1, step=1), "adam_: params"),
    (lambda a: optim.sgd_([a], None, lr=0.1), "sgd_: grads"),
    (lambda a: optim.lion_([a], [a], None, lr=0.1), "lion_: exp_avgs"),
]


@pytest.mark.parametrize("call,what", _NONE_LISTS, ids=[w for _, w in _NONE_LISTS])
def test_a_required_list_given_as_none_is_a_type_error(sim, call, what):
    """None for a required list raises (it was taken for an absent list, and the call did
    nothing, or said the list was empty); the optional ones (master_params, momentum_buffers
    without momentum) may still be None."""
    with pytest.raises(TypeError, match=f"^{what} must be a list or tuple of GPU arrays"):
        call(FakeCAI((3,)))
    assert sim["launches"] == []


def test_sparse_tensors_are_a_type_error():
    """A sparse torch tensor has no data pointer: the cache key's pointer read (RuntimeError)
    leaves it to the full path's documented TypeError."""
    torch = pytest.importorskip("torch")
    a = torch.zeros(3).to_sparse()
    with pytest.raises(TypeError, match=r"foreach\.add_: tensors\[0\]"):
        foreach.add_([a], [a])
    assert C.cache_key([[a], [a]], 1) is None


def test_mixed_frameworks_refused_before_the_gpu():
    from conftest import FakeDLPack

    with pytest.raises(TypeError, match=r"other\[0\] is a dlpack array but tensors\[0\] is a cai"):
        foreach.add_([FakeCAI((3,))], [FakeDLPack((3,))])


def _v(ptr, n, dt=F32):
    return View(ptr, (n,), (1,), dt, 0, False, None, "cupy", None)


def test_aliasing_rules():
    x, y = _v(4096, 100), _v(8192, 100)
    # the same array at the same position of two lists: in place, allowed
    C._check_aliasing("op", ["a", "b"], [[x, y], [x, y]], 1)
    # written array overlapping another position
    with pytest.raises(ValueError, match=r"b\[1\] and a\[0\] overlap"):
        C._check_aliasing("op", ["a", "b"], [[x, y], [y, x]], 1)
    # partial overlap
    with pytest.raises(ValueError, match="overlap in memory"):
        C._check_aliasing("op", ["a", "b"], [[x], [_v(4096 + 8, 10)]], 1)
    # the same array twice in a written list
    with pytest.raises(ValueError, match="overlap in memory"):
        C._check_aliasing("op", ["a"], [[x, x]], 1)
    # one array as two written results (adam_'s exp_avgs[i] is exp_avg_sqs[i])
    with pytest.raises(ValueError, match=r"b\[0\] and a\[0\] overlap|a\[0\] and b\[0\] overlap"):
        C._check_aliasing("op", ["a", "b"], [[x, y], [x, _v(16384, 100)]], 0b11)
    # reads may overlap freely; empty arrays never overlap
    C._check_aliasing("op", ["a", "b"], [[_v(0, 0)], [x]], 0)
    C._check_aliasing("op", ["a", "b", "c"], [[y], [x], [_v(4096 + 8, 10)]], 1)


def test_import_cupylab_imports_no_framework_and_not_cupylab_torch():
    code = ("import sys, cupylab, cupylab.foreach, cupylab.optim; "
            "print(sorted(m for m in ('torch', 'cupy', 'jax', 'numpy', 'cupylab.torch') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}).stdout.strip()
    assert out == "[]"


def test_name_expressions_cover_every_combination():
    names = P._foreach_names()
    assert len(names) == 4 * (5 * 2 + 1 + 2 + 4)
    assert len(P._optim_names()) == len(P.OPTIM_COMBOS) * 5 + 2 * (len(P.ADAM_U_CHOICES) - 1)
    assert len(set(names)) == len(names)


@pytest.mark.slow
@pytest.mark.parametrize("cc", [75, 80, 90])
def test_every_multi_tensor_kernel_compiles(cc, monkeypatch):
    monkeypatch.setenv("CUPYLAB_CACHE_DISABLE", "1")
    n = compile_every(P.all_programs(), cc)
    assert n == len(P._foreach_names()) + len(P._norm_names()) + len(P._optim_names())


def test_prepare_refuses_other_functions():
    import cupylab

    with pytest.raises(TypeError, match="is not a cupylab.foreach or cupylab.optim function"):
        foreach.prepare(cupylab.add, 1, 2)
    with pytest.raises(TypeError, match="is not a cupylab.foreach"):
        foreach.prepare(foreach.prepare, foreach.add_)


def test_prepared_call_keeps_the_plans_its_launches_point_into(sim, monkeypatch):
    # a prepared call replays arguments that point into a plan's tables and workspace; a plan
    # that is not cached (JAX lists) must live as long as the prepared call
    import types

    from cupylab import _runtime

    monkeypatch.setattr(_runtime, "cupy", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(streamSynchronize=lambda s: None))))
    replayed = []

    class K:
        def function(self, device):
            return None

        def launch(self, device, grid, block, stream, args):
            replayed.append((device, grid, stream, args))

    class Plan:  # stands for a built plan: device, kind, and memory that dies with it
        device, kind = 0, "cupy"

    def fake_op(*, stream=None):
        plan = Plan()  # built for this call only, as for JAX lists (never cached)
        P.run_kernel(K(), plan, 3, 128, stream, (id(plan), 1))
        P.run_kernel(K(), plan, 1, 32, stream, (id(plan), 2))
        return weakref.ref(plan)

    monkeypatch.setattr(PR, "_preparable", lambda: (fake_op,))  # prepare takes it
    call = foreach.prepare(fake_op)
    ref = call.result
    gc.collect()
    assert ref() is not None  # kept by the prepared call
    assert call() is ref and [r[1] for r in replayed] == [3, 1]
    assert replayed[0][3] == (id(ref()), 1)
    del call
    gc.collect()
    assert ref() is None  # and by nothing else


def test_host_dlpack_producer_is_a_type_error_before_any_gpu_call(monkeypatch):
    from cupylab import _runtime

    from conftest import FakeDLPack

    def no_gpu(*a, **k):
        raise AssertionError("the runtime was touched before the producer's device was checked")

    monkeypatch.setattr(_runtime, "cupy", no_gpu)
    with pytest.raises(TypeError, match=r"add_: tensors\[0\] must be a CUDA device array .*host data"):
        foreach.add_([FakeDLPack((4,), device_type=1)], 1.0)


def test_optimizer_argument_rules_found_by_review(monkeypatch):
    """SGD with master weights and no momentum (no state list) uses float32 states (it was
    refused); betas must be < 1 and lr >= 0 as torch requires (beta2 = 1 gave NaN); axpy_ with
    a number x adds alpha * x (alpha was dropped)."""
    import types

    from cupylab import optim as O

    plan = types.SimpleNamespace(groups=[types.SimpleNamespace(
        sig=("bfloat16", "bfloat16", None, "float32"))])
    assert list(O._check_combo("sgd_", plan, (2,), 3))[0][1:] == ("bfloat16", "float32", True)
    a, b = FakeCAI((3,)), FakeCAI((3,))
    with pytest.raises(ValueError, match="adam_: beta2 must be < 1"):
        optim.adam_([a], [b], [a], [b], lr=0.1, step=1, beta2=1.0)
    with pytest.raises(ValueError, match="lion_: beta1 must be < 1"):
        optim.lion_([a], [b], [a], lr=0.1, beta1=1.5)
    with pytest.raises(ValueError, match="sgd_: lr must be a finite number >= 0"):
        optim.sgd_([a], [b], lr=-0.1)
    seen = []
    monkeypatch.setattr(E, "_binary", lambda *args: seen.append(args))
    foreach.axpy_(2.0, 3.0, [a])
    foreach.axpy_(2.0, [b], [a])
    assert seen[0][2] == 6.0 and seen[1][2] == [b]


# -- review fixes ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["1e-8", None, True, np.float32(1e-8)])
def test_optimizer_hyper_parameters_of_a_wrong_type_are_type_errors(bad):
    a, b = FakeCAI((3,)), FakeCAI((3,))
    with pytest.raises(TypeError, match="adam_: eps must be a Python int or float"):
        optim.adam_([a], [b], [a], [b], lr=0.1, step=1, eps=bad)
    with pytest.raises(TypeError, match="adamw_: beta2 must be a Python int or float"):
        optim.adamw_([a], [b], [a], [b], lr=0.1, step=1, beta2=bad)
    with pytest.raises(TypeError, match="sgd_: momentum must be a Python int or float"):
        optim.sgd_([a], [b], lr=0.1, momentum=bad)
    with pytest.raises(TypeError, match="lion_: weight_decay must be a Python int or float"):
        optim.lion_([a], [b], [a], lr=0.1, weight_decay=bad)
    with pytest.raises(ValueError, match="adam_: eps must be a finite number >= 0"):
        optim.adam_([a], [b], [a], [b], lr=0.1, step=1, eps=-1e-8)  # a number out of range


def _plan_without_upload(views, sizes, device, kind, s):
    """A stand-in for ``_mt_plan.build``: the plan's fields that increment_step_ reads, with
    no table uploaded to a GPU."""
    import types

    return types.SimpleNamespace(device=device, kind=kind, sizes=sizes, groups=[
        types.SimpleNamespace(sig=(views[0][0].dtype.name,))])


@pytest.mark.parametrize("step", [True, False])
def test_a_bool_step_is_refused(sim, monkeypatch, step):
    """step=True was taken as 1 (and False gave a ValueError about its value)."""
    import types

    a, b, c, d = (FakeCAI((3,), ptr=0x7F0000000000 + k * 4096) for k in range(4))
    monkeypatch.setattr(C, "resolve", lambda *a, **k: (types.SimpleNamespace(device=0), 0x5700))
    with pytest.raises(TypeError, match="adam_: step must be a Python int or float or a "
                                        "one-element float32 GPU array"):
        optim.adam_([a], [b], [c], [d], lr=0.1, step=step)


def test_dlpack_inputs_read_again_are_asked_for_the_launch_stream(sim, monkeypatch):
    """The output allocation of the out-of-place operators and increment_step_'s pointer
    import DLPack producers a second time; they must be told the launch stream there too
    (they were told the legacy default stream)."""
    import types

    from conftest import FakeDLPack

    xs = [FakeDLPack((4,)), FakeDLPack((2, 3), ptr=0x7F0000002000)]
    made = []
    monkeypatch.setattr(C, "_new", lambda plan, shape, dt, s, stream: made.append((shape, s)))
    C._alloc_like("foreach.add", xs, types.SimpleNamespace(device=0, kind="dlpack"), 0x99, 0x99)
    assert made == [((4,), 0x99), ((2, 3), 0x99)]
    assert [x.asked_stream for x in xs] == [0x99, 0x99]

    monkeypatch.setattr(P, "build", _plan_without_upload)
    step = FakeDLPack((1,), ptr=0x7F0000003000)
    optim.increment_step_(step)
    assert step.asked_stream == 0x5700
    assert sim["launches"][-1]["name"] == "cl::mt::mt_step_inc"
    assert sim["launches"][-1]["stream"] == 0x5700


def test_the_pretend_gpu_leaves_no_function_in_the_librarys_kernels():
    """The library's kernel objects live as long as the process: a pretend CUfunction the
    ``sim`` fixture left in one was launched by a later GPU test in the same pytest worker
    (CUDA_ERROR_INVALID_HANDLE). What it stores, it takes out when the test ends."""
    from conftest import simulated_gpu

    k = P.kernel("norm", "cl::mt::mt_step_inc", ("Q", "i", "Q"))
    before = dict(k._fns)  # a real function for device 0 where a GPU test ran before
    mp = pytest.MonkeyPatch()
    mp.setattr(P, "build", _plan_without_upload)
    try:
        with simulated_gpu(mp) as rec:
            optim.increment_step_(FakeCAI((1,), ptr=0x7F0000003000))
            assert rec["launches"][-1]["name"] == "cl::mt::mt_step_inc"
            assert k._fns.get(0) == (before[0] if 0 in before else id(k))
        assert k._fns == before
    finally:
        mp.undo()


def test_lerp_with_empty_lists_returns_out_and_checks_the_lengths_as_add_does():
    a = FakeCAI((3,))
    for fn, args in ((foreach.lerp, ([], [], 0.5)), (foreach.add, ([], []))):
        out = []
        assert fn(*args, out=out) is out
        out = ()
        assert fn(*args, out=out) is out
    assert foreach.lerp([], [], 0.5) == []
    with pytest.raises(ValueError, match="foreach.lerp: tensors has 0 arrays but out has 1"):
        foreach.lerp([], [], 0.5, out=[a])
    with pytest.raises(ValueError, match="foreach.lerp: ends has 1 arrays but out has 0"):
        foreach.lerp([], [a], 0.5, out=[])
    with pytest.raises(TypeError, match="foreach.lerp: ends must be a list or tuple"):
        foreach.lerp([], a, 0.5, out=[])


@pytest.mark.parametrize("bad", ["2", True, None, np.float32(2.0), FakeCAI((1,))])
def test_alpha_must_be_a_python_number(bad, monkeypatch):
    """alpha went through float(): strings and bools passed, and a one-element device array
    was read back to the host (a hidden synchronisation)."""
    a, b = FakeCAI((3,)), FakeCAI((3,), ptr=0x7F0000100000)
    calls = [("foreach.add_", lambda: foreach.add_([a], [b], alpha=bad)),
             ("foreach.add_", lambda: foreach.add_([a], 1.0, alpha=bad)),
             ("foreach.add", lambda: foreach.add([a], [b], alpha=bad)),
             ("foreach.add", lambda: foreach.add([], [], alpha=bad)),
             ("foreach.axpy_", lambda: foreach.axpy_(bad, [b], [a])),
             ("foreach.axpy_", lambda: foreach.axpy_(bad, 3.0, [a]))]
    for name, call in calls:
        with pytest.raises(TypeError, match=f"{name}: alpha must be a Python number"):
            call()
    seen = []
    monkeypatch.setattr(E, "_binary", lambda *args, **kw: seen.append(args[7]))
    foreach.add_([a], [b], alpha=np.float64(0.5))  # a float subclass, as for lerp's weight
    foreach.axpy_(2, [b], [a])
    assert seen == [0.5, 2]


@pytest.mark.parametrize("eps,err", [("1e-6", TypeError), (None, TypeError), (True, TypeError),
                                     (np.float32(1e-6), TypeError), (-1e-6, ValueError),
                                     (float("nan"), ValueError), (float("inf"), ValueError),
                                     (10**400, ValueError)])
def test_clip_refuses_a_bad_eps_before_the_gpu(eps, err):
    with pytest.raises(err, match="foreach.clip_by_global_norm_: eps must be a"):
        foreach.clip_by_global_norm_([FakeCAI((3,))], 1.0, eps=eps)


def test_clip_takes_a_zero_or_integer_eps(monkeypatch):
    monkeypatch.setattr(R, "resolve", lambda *a, **k: (None, None))  # stops after the checks
    for eps in (0, 0.0, 1, np.float64(1e-6)):
        with pytest.raises(ValueError, match="tensors is empty"):
            foreach.clip_by_global_norm_([FakeCAI((3,))], 1.0, eps=eps)


@pytest.mark.parametrize("which", ["nonfinite_check", "unscale_"])
def test_a_prepared_check_zeroes_the_flag_it_made_at_every_replay(sim, monkeypatch, which):
    """The flag a call allocates is zeroed on the launch stream before the check at every
    replay (once an inf was seen, every later replay reported one); a flag passed in is never
    zeroed, prepared or not."""
    import types

    from cupylab import _runtime

    events = []
    rt = types.SimpleNamespace(
        memsetAsync=lambda ptr, value, n, s: events.append(("memset", ptr, value, n, s)),
        streamSynchronize=lambda s: None)
    monkeypatch.setattr(_runtime, "cupy", lambda: types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=rt)))

    class K:
        def function(self, device):
            return None

        def launch(self, device, grid, block, stream, args):
            events.append(("kernel", args[-2], stream))  # p[2]: the flag

    group = types.SimpleNamespace(sig=("float32",), nblocks=1, tab_ptr=0x100, map_ptr=0x200)
    plan = types.SimpleNamespace(device=0, kind="cupy", chunk=2048, groups=[group])
    monkeypatch.setattr(R, "resolve", lambda *a, **k: (plan, 0x5700))
    monkeypatch.setattr(R, "_new", lambda *a: FakeCAI((1,), ptr=0xF00))
    monkeypatch.setattr(P, "kernel", lambda *a, **k: K())
    fn = getattr(foreach, which)
    args = ([FakeCAI((3,))],) if which == "nonfinite_check" else ([FakeCAI((3,))], 0.5)
    call = foreach.prepare(fn, *args)
    assert events == [("memset", 0xF00, 0, 4, 0x5700)]  # zeroed when prepared; no launch
    events.clear()
    for _ in range(2):
        assert call() is call.result
    assert events == [("memset", 0xF00, 0, 4, 0x5700), ("kernel", 0xF00, 0x5700)] * 2
    events.clear()
    fn(*args)  # unprepared: the same order
    assert events == [("memset", 0xF00, 0, 4, 0x5700), ("kernel", 0xF00, 0x5700)]
    events.clear()
    mine = FakeCAI((1,), ptr=0xABC)
    call = foreach.prepare(fn, *args, found_inf=mine)
    call()
    call()
    fn(*args, found_inf=mine)
    assert call.result is mine and events == [("kernel", 0xABC, 0x5700)] * 3


def test_prepare_takes_only_the_public_foreach_and_optim_functions():
    """An explicit list: private helpers and the PreparedForeach class had passed a check by
    __module__ (and then failed on their arguments); it names every public function."""
    names = {m: set(ns) for m, ns in PR._PREPARABLE}
    assert names["foreach"] == set(foreach.__all__) - {"prepare", "PreparedForeach"}
    assert names["optim"] == set(optim.__all__)
    assert PR._preparable()[0] is foreach.add and PR._preparable()[-1] is optim.increment_step_
    for bad in (E._binary, C._alloc_like, C.resolve, C.device_scalar, foreach.PreparedForeach,
                optim.adam_launcher, optim._check_pos, print):
        with pytest.raises(TypeError, match=r"is not a cupylab.foreach or cupylab.optim "
                                            r"function that can be prepared \(one of "
                                            r"foreach.add, .*optim.increment_step_\)"):
            foreach.prepare(bad)
