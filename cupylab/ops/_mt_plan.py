"""The multi-tensor launcher's host side: programs and kernels, the device-side tensor table
(built once per list, reused), its cache, and the launch loop.

Table layout (see ``cuda_src/cupylab_multi_tensor.cuh``): per tensor ``NL`` data pointers
(0 for an absent slot) and ``n | ALIGNED_BIT``; per block an ``int2`` ``(tensor, chunk)``;
per tensor an ``int2`` ``[first block, end block)`` into the norm partials. Tensors are grouped
by their dtypes (one launch per group); one upload of one buffer per list and stream, on that
stream from pinned memory, without a host synchronisation (:func:`for_stream`: a plan is
launched only on the stream it was uploaded on, except into a CUDA graph captured elsewhere);
per call the host packs 15 numbers per group and launches.
:func:`repoint` patches one list's addresses into a copy of a table (an optimizer's new
gradient tensors). Chunks of ``chunk`` elements (a power of two between
:data:`MIN_CHUNK` and :data:`MAX_CHUNK`, chosen so that the launch has at least about 16
blocks per SM) make one block each, so a huge tensor and a thousand tiny ones spread over the
SMs alike. Element offsets are 64-bit.

Cache: keyed on the identity of the arrays (``id``) plus, for torch, their data pointers (a
tensor's storage can be swapped under the same object); each entry holds weak references to
its arrays whose callbacks drop the entry when any of them dies, so a key can never match a
dead array's recycled ``id``, and the cache owns no array. Bounded (LRU, :data:`CACHE_SIZE`);
a plan that a captured graph points into is kept past the bound (:func:`pin`).
"""
from __future__ import annotations

import collections
import ctypes
import itertools
import threading
import weakref

from .. import _compile, _dtypes, _launch, _runtime
from .._elementwise_core import allocate

BLOCK = 256
MIN_CHUNK = 2048
MAX_CHUNK = 65536
ALIGNED_BIT = 1 << 62
BLOCKS_PER_SM = 16  # aim for at least this many chunk blocks per SM (two waves of 8)
CACHE_SIZE = 64
MAX_SIBLINGS = 8  # copies of one list's table for other streams (for_stream)
ARGS_FMT = "8d4Q"  # struct Args { double s[8]; u64 p[4]; }
APPLY_FMTS = ("Q", "Q", "q", ARGS_FMT)
NO_ARGS = (0.0,) * 8 + (0,) * 4

FLOATS = ("float16", "bfloat16", "float32", "float64")
CT = {"float16": "cl::half_t", "bfloat16": "cl::bf16_t", "float32": "float", "float64": "double"}
EW = {"add": 0, "add_scalar": 1, "mul": 2, "mul_scalar": 3, "lerp": 4, "zero": 5}
# (param dtype, state dtype, master copy) combinations of the fused optimizers
OPTIM_COMBOS = (("float32", "float32", False), ("float64", "float64", False),
                ("bfloat16", "bfloat16", False), ("bfloat16", "float32", False),
                ("bfloat16", "float32", True), ("float16", "float16", False),
                ("float16", "float32", False), ("float16", "float32", True))


# -- name expressions and programs ------------------------------------------------------------
#: Vectors in flight per thread (``U`` of ``mt_apply``): foreach operators, optimizers. The
#: float32 Adam kernels are also built with every value of :data:`ADAM_U_CHOICES` (measured by
#: the bench's ``--adam-u`` comparison).
FOREACH_U = 2
OPTIM_U = 2
ADAM_U_CHOICES = (1, 2, 4)
#: The float32 Adam/AdamW kernels' ``U`` (float32 state, no master copy): U=1 stepped the
#: LLaMA-like list 2-4 % faster than U=2 on the H200 in three leases (docs/perf.md,
#: "Multi-tensor"); one of :data:`ADAM_U_CHOICES`.
ADAM_F32_U = 1


def _b(x):
    return "true" if x else "false"


def ew_name(op, dt, inplace):
    return f"cl::mt::mt_apply<cl::mt::Ew<{CT[dt]}, {EW[op]}, {_b(inplace)}>, {FOREACH_U}>"


def copy_name(dto, dti):
    return f"cl::mt::mt_apply<cl::mt::Copy<{CT[dto]}, {CT[dti]}>, {FOREACH_U}>"


def unscale_name(dt, check_only):
    return f"cl::mt::mt_apply<cl::mt::Unscale<{CT[dt]}, {_b(check_only)}>, {FOREACH_U}>"


def adam_name(p, s, master, adamw, u=None):
    if u is None:
        u = ADAM_F32_U if (p, s, master) == ("float32", "float32", False) else OPTIM_U
    return f"cl::mt::mt_apply<cl::mt::Adam<{CT[p]}, {CT[s]}, {_b(master)}, {_b(adamw)}>, {u}>"


def sgd_name(p, s, master, momentum):
    return (f"cl::mt::mt_apply<cl::mt::Sgd<{CT[p]}, {CT[s]}, {_b(master)}, {_b(momentum)}>, "
            f"{OPTIM_U}>")


def lion_name(p, s, master):
    return f"cl::mt::mt_apply<cl::mt::Lion<{CT[p]}, {CT[s]}, {_b(master)}>, {OPTIM_U}>"


def _foreach_names():
    names = []
    for dt in FLOATS:
        for op in EW:
            for inplace in ((True,) if op == "zero" else (True, False)):
                names.append(ew_name(op, dt, inplace))
        names += [unscale_name(dt, False), unscale_name(dt, True)]
        names += [copy_name(dt, di) for di in FLOATS]
    return names


def _norm_names():
    return ([f"cl::mt::mt_sumsq<{CT[dt]}>" for dt in FLOATS]
            + ["cl::mt::mt_norm_finish<float>", "cl::mt::mt_norm_finish<double>",
               "cl::mt::mt_step_inc"])


def _optim_names():
    names = []
    for p, s, m in OPTIM_COMBOS:
        names += [adam_name(p, s, m, False), adam_name(p, s, m, True),
                  sgd_name(p, s, m, False), sgd_name(p, s, m, True), lion_name(p, s, m)]
    for u in ADAM_U_CHOICES:
        if u != ADAM_F32_U:
            names += [adam_name("float32", "float32", False, w, u) for w in (False, True)]
    return names


_NAMES = {"foreach": _foreach_names, "norm": _norm_names, "optim": _optim_names}
_programs: dict = {}
_kernels: dict = {}


def program(which) -> _compile.Program:
    p = _programs.get(which)
    if p is None:
        p = _programs.setdefault(which, _compile.Program.from_file(
            _compile.cuda_src_dir() / "multi_tensor.cu", _NAMES[which](),
            options=(f"-DCL_MT_PROGRAM_{which.upper()}",)))
    return p


def all_programs():
    """Every multi-tensor program (CI compiles them all for sm_75, sm_80 and sm_90)."""
    return [program(w) for w in _NAMES]


def kernel(which, name, fmts=APPLY_FMTS) -> _launch.Kernel:
    k = _kernels.get(name)
    if k is None:
        k = _kernels.setdefault(name, _launch.Kernel(program(which), name, fmts))
    return k


# -- tables ------------------------------------------------------------------------------------
def choose_chunk(total_elements, sm_count):
    """Elements per block: the smallest power of two in [MIN_CHUNK, MAX_CHUNK] that keeps the
    launch near ``BLOCKS_PER_SM`` blocks per SM or fewer."""
    target = total_elements // max(1, sm_count * BLOCKS_PER_SM)
    c = MIN_CHUNK
    while c < target and c < MAX_CHUNK:
        c *= 2
    return c


def pack_group(ptrs, sizes, itemsizes, chunk):
    """The table of one dtype group (host side, NumPy).

    Parameters
    ----------
    ptrs : list of (sequence of int or None)
        Per list slot, the data pointers of the group's tensors (``None``: slot absent).
    sizes : sequence of int
        Elements per tensor.
    itemsizes : sequence of int
        Per slot, the element size (ignored for absent slots).
    chunk : int
        Elements per block (a multiple of 4).

    Returns
    -------
    tab : ndarray of int64, shape (n, NL + 1)
    bmap : ndarray of int32, shape (blocks, 2): (tensor, chunk)
    counts : ndarray of int64, shape (n,): blocks per tensor
    """
    import numpy as np  # noqa: PLC0415 - `import cupylab` does not import NumPy

    n = len(sizes)
    nl = len(ptrs)
    sz = np.asarray(sizes, dtype=np.int64).reshape(n)
    tab = np.zeros((n, nl + 1), dtype=np.int64)
    for k, pl in enumerate(ptrs):
        if pl is not None:
            tab[:, k] = np.asarray(pl, dtype=np.uint64).reshape(n).view(np.int64)
    tab[:, nl] = sz | _aligned_bits(np, tab, [None if pl is None else isz
                                              for pl, isz in zip(ptrs, itemsizes)])
    counts = -(-sz // chunk)
    nb = int(counts.sum())
    bmap = np.empty((nb, 2), dtype=np.int32)
    bmap[:, 0] = np.repeat(np.arange(n, dtype=np.int32), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    bmap[:, 1] = np.arange(nb, dtype=np.int64) - starts
    return tab, bmap, counts


class Group:
    """One dtype group of a plan: its signature, tensor indices, and device table."""

    __slots__ = ("sig", "index", "nblocks", "first", "tab_ptr", "map_ptr")


class Plan:
    """The packed, uploaded metadata of one call's lists (see the module docstring)."""

    __slots__ = ("device", "kind", "n", "sizes", "groups", "chunk", "nblocks", "tb_ptr", "buf",
                 "stream", "partial", "scratch", "refs", "upload", "layout", "siblings",
                 "captured", "pinned", "used", "kernels", "__weakref__")

    def workspace(self):
        """Device addresses ``(partials, scratch)``: one float64 per block for the norms, and
        16 bytes (the float64 clip factor), inside the plan's buffer."""
        return self.partial, self.scratch


def layout(slot_ptrs, sizes, slot_dtypes, chunk):
    """Group tensors by dtype signature and pack every group (no GPU).

    ``slot_ptrs``: per slot a list of pointers or None; ``slot_dtypes``: per slot a list of
    DTypes or None. Returns ``(groups, blob, tb)``: per group ``(sig, indices, tab offset,
    map offset, nblocks, first block)``, the whole table as bytes, the offset of ``tb``."""
    import numpy as np  # noqa: PLC0415

    n = len(sizes)
    order: dict = {}
    for i in range(n):
        sig = tuple(None if d is None else d[i].name for d in slot_dtypes)
        order.setdefault(sig, []).append(i)
    parts, groups, off, first = [], [], 0, 0
    tb = np.zeros((n, 2), dtype=np.int32)
    for sig, idx in order.items():
        ptrs = [None if pl is None else [pl[i] for i in idx] for pl in slot_ptrs]
        isz = [0 if d is None else slot_dtypes[k][idx[0]].itemsize for k, d in enumerate(sig)]
        tab, bmap, counts = pack_group(ptrs, [sizes[i] for i in idx], isz, chunk)
        ends = first + np.cumsum(counts)
        tb[idx, 0] = ends - counts
        tb[idx, 1] = ends
        tab_off = off
        off += tab.nbytes
        map_off = off
        off += bmap.nbytes
        parts += [tab.tobytes(), bmap.tobytes()]
        nb = bmap.shape[0]
        if nb > 2**31 - 1:
            raise ValueError("multi-tensor launch: more than 2^31 - 1 blocks")
        groups.append((sig, idx, tab_off, map_off, nb, first))
        first += nb
    tb_off = off
    parts.append(tb.tobytes())
    return groups, b"".join(parts), tb_off, first


class _Upload:
    """A table upload in flight: the pinned staging copy of the table (CuPy's pinned memory
    pool) and an event recorded on the upload stream after the copy. The staging memory goes
    back to the pool only once the event has completed, so it is never reused under a pending
    copy: a dead upload is parked in :data:`_parked` (no CUDA call in ``__del__``, which may
    run during someone's graph capture) and released by a later :meth:`start` that finds its
    event completed — never waited for."""

    __slots__ = ("event", "host", "rt", "captured")

    @classmethod
    def start(cls, cp, dst, blob, stream):
        """Copy ``blob`` to device address ``dst`` on ``stream`` without blocking the host."""
        rt = cp.cuda.runtime
        _release_parked()
        host = cp.cuda.alloc_pinned_memory(len(blob))
        ctypes.memmove(host.ptr, blob, len(blob))
        rt.memcpyAsync(dst, host.ptr, len(blob), 1, stream)  # 1: cudaMemcpyHostToDevice
        up = cls()
        up.rt, up.host, up.captured = rt, host, False
        up.event = rt.eventCreateWithFlags(rt.eventDisableTiming)
        rt.eventRecord(up.event, stream)
        return up

    def done(self):
        return _event_done(self.rt, self.event)

    def __del__(self):
        try:
            _parked.append((self.rt, self.event, self.host, self.captured))
        except Exception:  # noqa: BLE001 - a half-built upload, interpreter shutdown
            pass


# (runtime, event, pinned memory, captured) of dead uploads not yet seen complete. An event
# that a graph capture waits on (an external event node) is never destroyed: the graph may
# be replayed after the upload is gone. A deque: __del__ may append while _release_parked
# runs (another thread, or a garbage collection inside it), and an entry it dropped would
# hand pinned memory back to the pool under a pending copy.
_parked: collections.deque = collections.deque()
_EVENT_WAIT_EXTERNAL = 1  # cudaEventWaitExternal


def _event_done(rt, event):
    """Whether ``event`` has completed (a query: never waits)."""
    try:
        return rt.eventQuery(event) == 0
    except Exception:  # noqa: BLE001 - a CuPy that raises for "not ready"
        return False


def _release_parked():
    """Release the parked uploads seen complete; the others go back to the end (each entry
    is taken out and put back whole: entries appended meanwhile are never lost)."""
    for _ in range(len(_parked)):
        try:
            item = _parked.popleft()
        except IndexError:  # another thread released them
            return
        if _event_done(item[0], item[1]):
            if not item[3]:
                item[0].eventDestroy(item[1])
        else:
            _parked.append(item)


capturing = _launch.capturing  # (rt, stream): True also when the runtime refuses the question


_PER_THREAD = 2  # cudaStreamPerThread: each thread's own default stream under one handle


def stream_key(stream):
    """What tells streams apart for a plan: the handle, and for the per-thread default
    stream (one handle, a stream per thread) the handle with the thread."""
    return (_PER_THREAD, threading.get_ident()) if stream == _PER_THREAD else stream


def for_stream(plan, stream):
    """The plan to launch on ``stream``, given the plan a list was set up with.

    A plan is launched on the stream it was uploaded on (``plan.stream``, a
    :func:`stream_key`): its workspace is
    used by one stream at a time, and its memory, which came from the pool of that stream,
    goes back behind the stream's last launch. A list used on another stream gets a copy of
    its tables uploaded there, kept in ``plan.siblings`` (one per stream, the
    :data:`MAX_SIBLINGS` most recent; they die with ``plan``). During a CUDA graph capture on
    a stream without a copy (nothing can be uploaded then), the capture uses ``plan``.

    Until its upload is seen complete, a launch waits for it on the GPU (an event; during a
    capture an external event node, so every replay is ordered after it). On the upload's own
    stream that wait is already implied, unless the stream was destroyed and its handle handed
    to a new stream, which is not ordered after the old one's work. A plan launched during a
    capture is marked ``captured``: the graph points into it, so the caller keeps it alive as
    long as the list's arrays live (:func:`pin`). The host never waits."""
    rt = _runtime.cupy().cuda.runtime
    cap = capturing(rt, stream)
    key = stream_key(stream)
    if key != plan.stream:
        sib = plan.siblings.get(key)
        if sib is not None:
            plan = sib
        elif not cap:
            with _lock:  # threads on two new streams at once: each makes its own copy
                sibs = plan.siblings
                sib = sibs.get(key)
                if sib is None:
                    if len(sibs) >= MAX_SIBLINGS:  # a stream per step: the oldest copy goes
                        del sibs[next(iter(sibs))]  # (its memory back behind its stream)
                    groups, blob, tb_off = plan.layout
                    sib = sibs[key] = _upload_plan(plan.device, plan.kind, plan.sizes,
                                                      plan.chunk, groups, blob, tb_off,
                                                      plan.nblocks, stream)
            plan = sib
    up = plan.upload
    if up is not None:
        if cap:  # no event query during a capture
            rt.streamWaitEvent(stream, up.event, _EVENT_WAIT_EXTERNAL)
            up.captured = True
        elif up.done():
            plan.upload = None
        else:
            rt.streamWaitEvent(stream, up.event, 0)
    if cap:
        plan.captured = True
    return plan


def build(slot_views, sizes, device, kind, stream, chunk=None):
    """Pack and upload the tables for validated views (per slot a list of Views or None)."""
    if chunk is None:
        chunk = choose_chunk(sum(sizes), _runtime.device_info(device).sm_count)
    slot_ptrs = [None if vs is None else [v.ptr for v in vs] for vs in slot_views]
    slot_dt = [None if vs is None else [v.dtype for v in vs] for vs in slot_views]
    groups, blob, tb_off, nblocks = layout(slot_ptrs, sizes, slot_dt, chunk)
    return _upload_plan(device, kind, sizes, chunk, groups, blob, tb_off, nblocks, stream)


class _CaptureError(RuntimeError):
    """A table that would have to be uploaded during a CUDA graph capture."""


def _upload_plan(device, kind, sizes, chunk, groups, blob, tb_off, nblocks, stream):
    cp = _runtime.cupy()
    ws_off = -(-len(blob) // 16) * 16  # then the workspace: partials (float64) and scratch
    total = ws_off + 8 * max(nblocks, 1) + 16
    if capturing(cp.cuda.runtime, stream):
        raise _CaptureError(
            "cupylab multi-tensor call: a list seen for the first time cannot be set up during "
            "CUDA graph capture (its table is uploaded then); run the call once before "
            "capturing (a warm-up step)")
    with cp.cuda.Device(device):
        # the pool takes the memory back behind the work on ``stream``, which reads the table
        buf = allocate("cupy", (total,), _dtypes.from_name("uint8"), device, stream)
        up = _Upload.start(cp, buf.data.ptr, blob, stream) if blob else None
    base = buf.data.ptr
    plan = Plan()
    plan.device, plan.kind, plan.n, plan.sizes, plan.chunk = device, kind, len(sizes), sizes, chunk
    plan.nblocks, plan.buf, plan.tb_ptr = nblocks, buf, base + tb_off
    plan.stream = stream_key(stream)
    plan.partial, plan.scratch = base + ws_off, base + ws_off + 8 * max(nblocks, 1)
    plan.refs = None
    plan.upload = up
    plan.siblings, plan.captured, plan.pinned = {}, False, False
    plan.kernels = None  # the optimizers' kernels by group (cupylab.optim._kernels_for)
    plan.layout = (groups, blob, tb_off)
    plan.groups = []
    for sig, idx, toff, moff, nb, first in groups:
        g = Group()
        g.sig, g.index, g.nblocks, g.first = sig, idx, nb, first
        g.tab_ptr, g.map_ptr = base + toff, base + moff
        plan.groups.append(g)
    return plan


def _aligned_bits(np, tab, itemsizes):
    """The :data:`ALIGNED_BIT` of each row of a table: every present slot's address (column
    ``k``, element size ``itemsizes[k]``, None for an absent slot) a multiple of four
    elements (the kernels' 4-wide vector loads)."""
    aligned = np.ones(tab.shape[0], dtype=bool)
    for k, isz in enumerate(itemsizes):
        if isz is not None:
            aligned &= (tab[:, k].view(np.uint64) % np.uint64(4 * isz)) == 0
    return aligned.astype(np.int64) * np.int64(ALIGNED_BIT)


def patch(groups, blob, slot, ptrs):
    """``blob`` (the tables :func:`layout` packed for ``groups``) with the pointers of list
    ``slot`` replaced by ``ptrs`` (one per tensor, in list order) and the alignment bits
    recomputed: what :func:`layout` gives for the new pointers (no GPU)."""
    import numpy as np  # noqa: PLC0415

    blob = bytearray(blob)
    for sig, idx, toff, _, _, _ in groups:
        nl = len(sig)
        tab = np.frombuffer(blob, dtype=np.int64, count=len(idx) * (nl + 1),
                            offset=toff).reshape(len(idx), nl + 1)
        tab[:, slot] = np.array([ptrs[i] for i in idx], dtype=np.uint64).view(np.int64)
        tab[:, nl] = (tab[:, nl] & (ALIGNED_BIT - 1)) | _aligned_bits(
            np, tab, [None if name is None else _dtypes.DTYPES[name].itemsize for name in sig])
    return bytes(blob)


def repoint(plan, slot, ptrs, stream):
    """A plan for the same lists with the arrays of list ``slot`` replaced by arrays of the
    same shapes and dtypes at the addresses ``ptrs``: the host table patched (:func:`patch`)
    and uploaded as a new table on ``stream``; nothing is regrouped or validated here (the
    caller checks the new arrays). An optimizer's gradients are new tensors after every
    ``zero_grad(set_to_none=True)``: this keeps the step's host work small for them."""
    groups, blob, tb_off = plan.layout
    try:
        return _upload_plan(plan.device, plan.kind, plan.sizes, plan.chunk, groups,
                            patch(groups, blob, slot, ptrs), tb_off, plan.nblocks, stream)
    except _CaptureError:  # _upload_plan's own check, worded for the case that reaches it
        raise RuntimeError(
            "cupylab.torch.optim: the gradients are new tensors during a CUDA graph capture "
            "(zero_grad(set_to_none=True) before it), and the step's launch table cannot be "
            "re-pointed at them then (nothing can be uploaded during a capture). Keep the "
            "warm-up step's gradient tensors: zero them in place inside the captured region "
            "(optimizer.zero_grad(set_to_none=False) before backward)") from None


_recording = threading.local()


def run_kernel(k, plan, grid, block, stream, args):
    """Launch ``k`` for ``plan`` — or, while :func:`record` is active in this thread, note the
    launch (for :func:`cupylab.foreach.prepare`) without running it, and keep ``plan``: the
    arguments point into its tables and workspace, which must outlive every replay (a plan
    that is not cached, e.g. for JAX lists, is otherwise freed at once)."""
    log = getattr(_recording, "log", None)
    if log is not None:
        k.function(plan.device)  # compile and load now, not at the first replay
        log.append((k, plan.device, grid, block, args, plan.kind))
        if not any(q is plan for q in _recording.plans):
            _recording.plans.append(plan)
        return
    k.launch(plan.device, grid, block, stream, args)


class _Memset:
    """In a recorded launch list, stands where a kernel would: its ``launch`` zeroes
    ``args[1]`` bytes at ``args[0]`` with ``cudaMemsetAsync`` on the launch stream (which a
    CUDA graph capture records as a memset node). A replay calls only ``launch``."""

    def launch(self, device, grid, block, stream, args):
        _runtime.cupy().cuda.runtime.memsetAsync(args[0], 0, args[1], stream)


_MEMSET = _Memset()


def zero_fill(plan, ptr, nbytes, stream):
    """Zero ``nbytes`` at ``ptr`` on ``stream`` now and, while :func:`record` is active, note
    the memset too: every replay of the prepared call zeroes again before the launches
    recorded after it, as a new call would (the ``found_inf`` flag a call allocates)."""
    _MEMSET.launch(plan.device, 1, 1, stream, (ptr, nbytes))
    log = getattr(_recording, "log", None)
    if log is not None:
        log.append((_MEMSET, plan.device, 1, 1, (ptr, nbytes), plan.kind))


class record:
    """Context manager: the launches of the multi-tensor operators called inside are noted in
    ``.launches`` instead of run (the memsets of :func:`zero_fill` are run and noted), and
    the plans they use in ``.plans``."""

    def __enter__(self):
        if getattr(_recording, "log", None) is not None:
            raise RuntimeError("cupylab.foreach.prepare cannot be nested")
        self.launches = _recording.log = []
        self.plans = _recording.plans = []
        return self

    def __exit__(self, *exc):
        _recording.log = _recording.plans = None
        return False


def launch(plan, kernel_for, args, stream):
    """Launch ``kernel_for(group signature)`` once per non-empty group."""
    for g in plan.groups:
        if g.nblocks:
            run_kernel(kernel_for(g.sig), plan, g.nblocks, BLOCK, stream,
                       (g.tab_ptr, g.map_ptr, plan.chunk) + args)


# -- the cache ---------------------------------------------------------------------------------
# A plain dict: a hit hashes and compares its key once (an OrderedDict's move_to_end would do
# both again, a third of a hit's host time for a list of a thousand arrays). Recency is a
# counter stamped on the plan; the bound evicts the least recently used entry.
_cache: dict = {}
_lock = threading.RLock()  # a weakref callback may run inside a locked section
_clock = itertools.count()
stats = {"hits": 0, "misses": 0, "evicted_dead": 0}


# plans a CUDA graph points into, by cache key: kept past the LRU bound until an array of
# their list dies (a graph replayed after that would touch dead arrays anyway)
_pinned: dict = {}


def _evict(key):
    def cb(_ref, key=key):
        with _lock:
            _pinned.pop(key, None)
            if _cache.pop(key, None) is not None:
                stats["evicted_dead"] += 1
    return cb


def pin(key, plan):
    """Keep ``plan`` (launched during a capture, :func:`for_stream`) as long as the arrays of
    the cached list ``key`` live, whatever the LRU bound drops. The cached plan of ``key`` is
    kept with it when ``plan`` is one of its per-stream copies: its weak references to the
    arrays are what unpins them when one dies."""
    with _lock:
        base = _cache.get(key)
        if base is None:  # an array died already: nothing left to replay into
            return
        kept = _pinned.setdefault(key, [])
        for q in (base, plan):
            if not any(q is k for k in kept):
                kept.append(q)
        plan.pinned = True


def cache_get(key):
    with _lock:
        p = _cache.get(key)
        if p is not None:
            p.used = next(_clock)
            stats["hits"] += 1
        return p


def cache_put(key, plan, objects):
    """Store ``plan`` under ``key``; it is dropped as soon as any of ``objects`` dies."""
    cb = _evict(key)
    try:
        plan.refs = [weakref.ref(o, cb) for o in objects]
    except TypeError:  # an array type without weak references: not cached
        return
    with _lock:
        stats["misses"] += 1
        plan.used = next(_clock)
        _cache[key] = plan
        while len(_cache) > CACHE_SIZE:  # rare (a miss over the bound): a scan is cheap
            del _cache[min(_cache, key=lambda k: _cache[k].used)]


def cache_clear():
    with _lock:
        _cache.clear()
        _pinned.clear()


def cache_len():
    return len(_cache)
