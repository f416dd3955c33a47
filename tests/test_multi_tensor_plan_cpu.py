"""Multi-tensor launch tables, host side (no GPU): table packing and chunking, re-pointing a
list, the plan cache (keys, LRU bound, weak references, pinned plans), the per-stream copies of
a table and their uploads, and the optimizers' kernels kept per plan."""
import collections
import gc
import threading
import weakref

import numpy as np
import pytest

from cupylab import _dtypes, foreach, optim
from cupylab.ops import _mt_core as C
from cupylab.ops import _mt_plan as P

from conftest import FakeCAI

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
