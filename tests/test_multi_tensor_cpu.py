"""Multi-tensor launcher, host side (no GPU): table packing and chunking, the plan cache,
argument errors raised before the GPU is touched, aliasing rules, and NVRTC compilation of
every multi-tensor kernel instance."""
import collections
import gc
import os
import subprocess
import sys
import threading
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


def test_pack_group_chunks_and_alignment():
    ptrs = [[4096, 8192 + 4, 16384, 32768], [65536, 70000, 0, 81920]]
    sizes = [5, 9000, 0, 2048]
    tab, bmap, counts = P.pack_group(ptrs, sizes, [4, 4], 4096)
    assert counts.tolist() == [1, 3, 0, 1]
    assert bmap.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [3, 0]]
    n = tab[:, 2] & (P.ALIGNED_BIT - 1)
    assert n.tolist() == sizes
    aligned = (tab[:, 2] >> 62).tolist()
    # tensor 1: 8196 is not 16-byte aligned; tensor 2: 70000 % 16 == 0 but 16384 ok -> both
    assert aligned == [1, 0, 1, 1]
    assert tab[:, 0].tolist() == ptrs[0] and tab[:, 1].tolist() == ptrs[1]


def test_pack_group_absent_slot_and_16bit_alignment():
    tab, _, _ = P.pack_group([[8], None], [4], [2, 0], 2048)
    assert tab[0, 1] == 0 and tab[0, 2] >> 62 == 1  # 8 % (4 * 2) == 0


def test_pack_group_more_than_2_31_elements():
    n = 2**31 + 5
    tab, bmap, counts = P.pack_group([[0x10000]], [n], [2], 65536)
    assert counts[0] == -(-n // 65536)
    assert bmap[-1].tolist() == [0, counts[0] - 1]
    assert (tab[0, 1] & (P.ALIGNED_BIT - 1)) == n


def test_layout_groups_by_dtype_and_block_ranges():
    sizes = [10, 5000, 0, 3]
    groups, blob, tb_off, nblocks = P.layout([[16, 64, 128, 256]], sizes,
                                             [[F32, BF16, F32, F32]], 2048)
    assert [(g[0], g[1]) for g in groups] == [(("float32",), [0, 2, 3]), (("bfloat16",), [1])]
    assert nblocks == 1 + 0 + 1 + 3
    tb = np.frombuffer(blob[tb_off:], dtype=np.int32).reshape(-1, 2)
    assert tb.tolist() == [[0, 1], [2, 5], [1, 1], [1, 2]]


@pytest.mark.parametrize("total,sms,expect", [(4096 * 1000, 132, 2048), (10, 132, 2048),
                                              (1_340_000_000, 132, 65536), (2**24, 132, 8192)])
def test_choose_chunk(total, sms, expect):
    c = P.choose_chunk(total, sms)
    assert c == expect and c % 4 == 0


class _Obj:
    pass


def test_cache_evicts_when_an_array_dies_and_is_bounded():
    P.cache_clear()
    objs = [_Obj() for _ in range(3)]
    plan = P.Plan()
    P.cache_put(("k",), plan, objs)
    assert P.cache_get(("k",)) is plan
    del objs[1]
    gc.collect()
    assert P.cache_get(("k",)) is None and P.cache_len() == 0
    keep = [_Obj() for _ in range(P.CACHE_SIZE + 10)]
    for i, o in enumerate(keep):
        P.cache_put(("b", i), P.Plan(), [o])
    assert P.cache_len() == P.CACHE_SIZE
    assert P.cache_get(("b", 0)) is None and P.cache_get(("b", len(keep) - 1)) is not None
    P.cache_clear()


def test_cache_bound_drops_the_least_recently_used_plan():
    P.cache_clear()
    keep = [_Obj() for _ in range(P.CACHE_SIZE + 1)]
    first = P.Plan()
    P.cache_put(("old",), first, [keep[0]])
    for i in range(1, P.CACHE_SIZE):
        P.cache_put(("n", i), P.Plan(), [keep[i]])
    assert P.cache_get(("old",)) is first  # used again: now the most recent
    P.cache_put(("n", P.CACHE_SIZE), P.Plan(), [keep[-1]])
    assert P.cache_len() == P.CACHE_SIZE
    assert P.cache_get(("old",)) is first
    assert P.cache_get(("n", 1)) is None  # the least recently used went
    assert all(P.cache_get(("n", i)) is not None for i in range(2, P.CACHE_SIZE + 1))
    P.cache_clear()


def test_cache_owns_no_array():
    P.cache_clear()
    o = _Obj()
    r = weakref.ref(o)
    P.cache_put(("own",), P.Plan(), [o])
    del o
    gc.collect()
    assert r() is None and P.cache_len() == 0


def test_cache_key_only_for_cupy_and_torch():
    assert C.cache_key([[FakeCAI((3,))]], 1) is None
    assert C.cache_key([[]], 1) is None
    assert C.cache_key([np.zeros(3)], 1) is None  # not a list of arrays


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


@pytest.mark.parametrize("slot", [0, 1])
def test_patch_gives_the_table_of_the_new_pointers(slot):
    """Repointing one list (an optimizer's new gradients) patches the packed table into
    exactly what packing the new pointers gives: pointers and alignment bits, per dtype
    group, other lists untouched."""
    f32, bf16 = _dtypes.from_name("float32"), _dtypes.from_name("bfloat16")
    dts = [f32, bf16, f32, bf16, f32]
    sizes = [5, 4097, 1, 70001, 64]
    base = 0x7F0000000000
    old = [[base + (k << 24) + (i << 20) for i in range(5)] for k in range(3)]
    new_ptrs = [base + (9 << 24) + (i << 20) + (8 if i in (1, 2) else 0) for i in range(5)]
    slot_dt = [dts, dts, dts]
    groups, blob, _, _ = P.layout(old, sizes, slot_dt, 2048)
    want = [list(p) for p in old]
    want[slot] = new_ptrs
    groups2, blob2, _, _ = P.layout(want, sizes, slot_dt, 2048)
    assert groups2 == groups
    assert P.patch(groups, blob, slot, new_ptrs) == blob2
    assert P.patch(groups, blob, slot, old[slot]) == blob


def test_dead_uploads_are_released_once_complete_and_captured_events_kept(monkeypatch):
    """A dead table upload keeps its pinned staging memory until its event is seen complete
    (never waited for); an event a graph capture waits on is never destroyed."""
    class RT:
        destroyed = []

        def __init__(self, done):
            self.done = done

        def eventQuery(self, ev):
            return 0 if ev in self.done else 600  # cudaErrorNotReady

        def eventDestroy(self, ev):
            RT.destroyed.append(ev)

    rt = RT({1, 3})
    monkeypatch.setattr(P, "_parked", collections.deque(
        [(rt, 1, "pinned1", False), (rt, 2, "pinned2", False), (rt, 3, "pinned3", True)]))
    P._release_parked()
    assert [item[1] for item in P._parked] == [2]  # 1 and 3 released, 2 still in flight
    assert RT.destroyed == [1]  # 3 was captured: its event stays
    up = P._Upload()
    up.rt, up.event, up.host, up.captured = rt, 7, "pinned7", False
    del up
    assert P._parked[-1] == (rt, 7, "pinned7", False)


def test_an_upload_parked_while_others_are_released_is_kept(monkeypatch):
    """An upload that dies while _release_parked runs (another thread, or a garbage
    collection during its runtime calls) stays parked: dropping it would hand its pinned
    memory back to the pool under a pending copy."""
    class RT:
        def eventQuery(self, ev):
            if ev == 1:  # a dead upload parks itself in the middle of the release
                up = P._Upload()
                up.rt, up.event, up.host, up.captured = self, 9, "pinned9", False
                del up
            return 0 if ev == 1 else 600

        def eventDestroy(self, ev):
            pass

    rt = RT()
    monkeypatch.setattr(P, "_parked", collections.deque(
        [(rt, 1, "pinned1", False), (rt, 2, "pinned2", False)]))
    P._release_parked()
    assert sorted(item[1] for item in P._parked) == [2, 9]


@pytest.fixture
def streams(monkeypatch):
    """Stand-ins for for_stream: which streams capture, the event waits asked for, and the
    uploads made (each a new plan for its stream)."""
    import types

    from cupylab import _runtime

    st = types.SimpleNamespace(capturing=set(), waits=[], uploads=[], done=set())
    rt = types.SimpleNamespace(streamWaitEvent=lambda s, ev, flags: st.waits.append((s, ev, flags)),
                               eventQuery=lambda ev: 0 if ev in st.done else 600,
                               eventDestroy=lambda ev: None)
    # the pretend uploads park here when they die, not among the real ones, which a later GPU
    # test in the same process releases with the real runtime
    monkeypatch.setattr(P, "_parked", collections.deque())
    monkeypatch.setattr(_runtime, "cupy", lambda: types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=rt)))
    monkeypatch.setattr(P, "capturing", lambda r, s: s in st.capturing)

    def upload(device, kind, sizes, chunk, groups, blob, tb_off, nblocks, stream):
        st.uploads.append((stream, blob))
        return _plan(stream, rt)

    monkeypatch.setattr(P, "_upload_plan", upload)
    st.rt = rt
    yield st
    gc.collect()  # plans kept by a cycle park their pretend uploads before _parked is restored


def _plan(stream, rt=None):
    plan = P.Plan()
    plan.device, plan.kind, plan.sizes, plan.chunk, plan.nblocks = 0, "torch", [5], 2048, 1
    plan.layout, plan.stream, plan.siblings, plan.captured = ((), b"tables", 0), stream, {}, False
    plan.pinned = False
    plan.upload = None
    if rt is not None:
        plan.upload = P._Upload.__new__(P._Upload)
        plan.upload.rt, plan.upload.event, plan.upload.host = rt, ("ev", stream), None
        plan.upload.captured = False
    return plan


def test_a_plan_is_launched_on_its_own_stream_and_copied_for_another(streams):
    """Eager launches use a table uploaded on their own stream (its workspace is one stream's,
    and its memory goes back behind that stream), one copy per stream, kept with the plan."""
    plan = _plan(0xA, streams.rt)
    streams.done = {("ev", 0xA)}
    assert P.for_stream(plan, 0xA) is plan and streams.uploads == [] and plan.upload is None
    b = P.for_stream(plan, 0xB)
    assert b is not plan and b.stream == 0xB and streams.uploads == [(0xB, b"tables")]
    streams.done.add(("ev", 0xB))
    assert P.for_stream(plan, 0xB) is b and P.for_stream(plan, 0xA) is plan
    assert len(streams.uploads) == 1 and plan.siblings == {0xB: b} and b.siblings == {}
    assert streams.waits == [(0xB, ("ev", 0xB), 0)]  # b's first launch, its upload pending
    assert not plan.captured and not b.captured
    for k in range(P.MAX_SIBLINGS):  # a new stream every step: the oldest copies go
        P.for_stream(plan, 0x100 + k)
    assert len(plan.siblings) == P.MAX_SIBLINGS and 0xB not in plan.siblings
    assert 0x100 in plan.siblings


def test_the_per_thread_default_stream_is_a_stream_per_thread(streams):
    """cudaStreamPerThread (handle 2) is another stream in every thread: each thread gets its
    own copy of the table, and a thread's calls keep using its own."""
    plan = _plan(0xA, streams.rt)
    mine = P.for_stream(plan, 2)
    assert mine is not plan and P.for_stream(plan, 2) is mine
    got = []
    t = threading.Thread(target=lambda: got.append(P.for_stream(plan, 2)))
    t.start()
    t.join()
    assert got[0] is not mine and got[0] is not plan
    assert len(streams.uploads) == 2 and all(u[0] == 2 for u in streams.uploads)
    assert P.stream_key(0xA) == 0xA and P.stream_key(2) == (2, threading.get_ident())


def test_a_pending_upload_is_waited_for_on_the_gpu_until_seen_complete(streams):
    """A stream handle can be recycled (a destroyed stream's handle given to a new one, not
    ordered after the old one's work): until the table's upload is seen complete, every launch
    waits for its event on the GPU; then the query stops."""
    plan = _plan(0xA, streams.rt)
    P.for_stream(plan, 0xA)
    P.for_stream(plan, 0xA)
    assert streams.waits == [(0xA, ("ev", 0xA), 0)] * 2 and plan.upload is not None
    streams.done.add(("ev", 0xA))
    P.for_stream(plan, 0xA)
    P.for_stream(plan, 0xA)
    assert len(streams.waits) == 2 and plan.upload is None


def test_a_capture_elsewhere_waits_for_the_upload_and_marks_the_plan(streams):
    """Nothing can be uploaded during a capture: a capture on a stream without a copy uses
    the plan, waiting for its upload through an external event node (every replay does), and
    no event is queried during a capture."""
    plan = _plan(0xA, streams.rt)
    streams.capturing = {0xC, 0xA}
    streams.done = {("ev", 0xA)}  # complete, but not asked during the capture
    assert P.for_stream(plan, 0xC) is plan and streams.uploads == []
    assert streams.waits == [(0xC, ("ev", 0xA), P._EVENT_WAIT_EXTERNAL)]
    assert plan.captured and plan.upload.captured  # the event is never destroyed
    fresh = _plan(0xA)  # its upload seen complete before the capture
    assert P.for_stream(fresh, 0xA) is fresh and fresh.captured  # capture on its own stream
    assert len(streams.waits) == 1


def test_new_gradients_during_a_capture_are_refused_with_the_remedy(streams, monkeypatch):
    """Re-pointing a table uploads it, which a capture cannot do: the message names the
    cause (new gradient tensors) and the in-place zeroing that avoids it."""
    plan = _plan(0xA, streams.rt)

    def upload(*a):
        raise P._CaptureError("cannot be set up during CUDA graph capture")

    monkeypatch.setattr(P, "_upload_plan", upload)
    monkeypatch.setattr(P, "patch", lambda groups, blob, slot, ptrs: blob)
    with pytest.raises(RuntimeError, match=r"new tensors during a CUDA graph capture.*"
                                           r"zero_grad\(set_to_none=False\) before backward"):
        P.repoint(plan, 1, [0x1000], 0xA)


def test_pinned_plans_outlive_the_lru_bound_but_not_their_arrays():
    """A plan a captured graph points into stays alive when the LRU bound drops its entry,
    and goes when an array of its list dies."""
    P.cache_clear()
    mine = [_Obj(), _Obj()]
    plan = P.Plan()
    P.cache_put(("pin",), plan, mine)
    ref = weakref.ref(plan)
    P.pin(("pin",), plan)
    assert P._pinned[("pin",)] == [plan] and plan.pinned
    others = [_Obj() for _ in range(P.CACHE_SIZE + 1)]
    for i, o in enumerate(others):
        P.cache_put(("other", i), P.Plan(), [o])
    del plan
    gc.collect()
    assert P.cache_get(("pin",)) is None and ref() is not None  # out of the cache, kept
    del mine[0]
    gc.collect()
    assert ref() is None and ("pin",) not in P._pinned
    gone = P.Plan()
    P.pin(("gone",), gone)  # a list no longer cached: nothing to keep
    assert ("gone",) not in P._pinned
    P.cache_clear()


def test_a_pinned_per_stream_copy_goes_when_its_arrays_die():
    """A graph captured on a stream with its own copy of the table pins that copy, which has
    no weak references of its own: the cached plan is kept with it, so that an array's death
    still unpins both after the LRU bound dropped the entry."""
    P.cache_clear()
    mine = [_Obj(), _Obj()]
    base, copy = P.Plan(), P.Plan()
    P.cache_put(("pin",), base, mine)
    ref = weakref.ref(copy)
    P.pin(("pin",), copy)
    assert P._pinned[("pin",)] == [base, copy] and copy.pinned
    P.pin(("pin",), copy)  # pinned once
    assert len(P._pinned[("pin",)]) == 2
    others = [_Obj() for _ in range(P.CACHE_SIZE + 1)]
    for i, o in enumerate(others):
        P.cache_put(("other", i), P.Plan(), [o])
    del base, copy
    gc.collect()
    assert P.cache_get(("pin",)) is None and ref() is not None
    del mine[0]
    gc.collect()
    assert ref() is None and ("pin",) not in P._pinned
    P.cache_clear()


def test_a_stream_argument_uses_the_cache_too(monkeypatch):
    """A list called with stream= is cached like any other (its table per stream), so a
    stream= call on an unchanged list does no per-tensor work either."""
    import contextlib

    from cupylab import _launch

    P.cache_clear()
    objs = [_Obj(), _Obj()]
    built, streams = [], []

    def validate(opname, names, lists, writes, same, stream, pairs, free):
        plan = _plan(0x99 if stream is not None else 0x5700)
        built.append(stream)
        return plan, plan.stream

    def for_stream(plan, s):
        streams.append(s)
        return plan

    monkeypatch.setattr(C, "cache_key", lambda lists, w: ("k", tuple(map(id, lists[0]))))
    monkeypatch.setattr(C, "_validate", validate)
    monkeypatch.setattr(P, "for_stream", for_stream)
    monkeypatch.setattr(_launch, "ensure_device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_launch, "current_stream", lambda kind, d: 0x5700)
    first, s = C.resolve("foreach.scale_", ["tensors"], [objs], 1, stream=0x99)
    assert built == [0x99] and s == 0x99
    again, s = C.resolve("foreach.scale_", ["tensors"], [objs], 1, stream=0x99)
    assert again is first and s == 0x99 and built == [0x99] and streams == [0x99]
    _, s = C.resolve("foreach.scale_", ["tensors"], [objs], 1)
    assert s == 0x5700 and streams == [0x99, 0x5700] and built == [0x99]
    P.cache_clear()


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

    def build(views, sizes, device, kind, s):
        return types.SimpleNamespace(device=device, kind=kind, sizes=sizes, groups=[
            types.SimpleNamespace(sig=(views[0][0].dtype.name,))])

    monkeypatch.setattr(P, "build", build)
    step = FakeDLPack((1,), ptr=0x7F0000003000)
    optim.increment_step_(step)
    assert step.asked_stream == 0x5700
    assert sim["launches"][-1]["name"] == "cl::mt::mt_step_inc"
    assert sim["launches"][-1]["stream"] == 0x5700


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


def test_call_key_is_the_key_a_call_looks_its_plan_up_with(monkeypatch):
    """The multi-tensor bench times ``cache_get(call_key(lists, writes))`` as the per-call
    floor of a foreach call: it must be the very lookup the call makes."""
    seen = []
    monkeypatch.setattr(C, "cache_key", lambda lists, w: ("k", tuple(map(id, lists[0])), w))
    monkeypatch.setattr(P, "cache_get", lambda key: seen.append(key))
    monkeypatch.setattr(C, "_validate", lambda *args: None)  # stop after the lookup
    xs, ys = [_Obj(), _Obj()], [_Obj(), _Obj()]
    foreach.add_(xs, ys)
    foreach.scale_(xs, 2.0)
    assert seen == [C.call_key([xs, ys], 1), C.call_key([xs], 1)]
    assert seen[0] != C.call_key([xs, ys], 0)


def test_an_optimizer_plan_checks_and_names_its_kernels_once_per_variant(monkeypatch):
    """A step over an unchanged list reuses the kernels found for its plan; another variant
    (AdamW, another unroll) finds its own, and a refused dtype combination is refused every
    time (nothing kept)."""
    plan = P.Plan()
    g = P.Group()
    g.sig = ("float32",) * 4 + (None,)
    plan.groups = [g]
    checks = []
    real = optim._check_combo

    def check(*a):
        checks.append(a[0])
        return real(*a)

    monkeypatch.setattr(optim, "_check_combo", check)
    adam = lambda adamw: optim._kernels_for(  # noqa: E731
        "adam_", plan, (2, 3), 4, ("adam", adamw, P.ADAM_F32_U, P.OPTIM_U),
        lambda g, p, st, m: P.adam_name(p, st, m, adamw))
    k1 = adam(False)
    assert adam(False) is k1 and len(checks) == 1
    assert k1[g.sig].name_expression == P.adam_name("float32", "float32", False, False)
    k2 = adam(True)
    assert k2 is not k1 and len(checks) == 2
    assert k2[g.sig].name_expression == P.adam_name("float32", "float32", False, True)
    monkeypatch.setattr(P, "ADAM_F32_U", P.ADAM_F32_U + 1)
    assert adam(False) is not k1 and len(checks) == 3
    bad = P.Plan()
    h = P.Group()
    h.sig = ("float32", "float32", "float16", "float32", None)
    bad.groups = [h]
    for _ in range(2):
        with pytest.raises(TypeError, match="different dtypes"):
            optim._kernels_for("adam_", bad, (2, 3), 4, ("adam", False), lambda *a: "")
    assert bad.kernels == {}
