"""Memory that cupylab allocates for a launch on a stream other than the framework's current
one (a ``stream=`` argument; the multi-tensor tables; temporaries dropped when the call
returns) is allocated from, and goes back to, that stream's free memory, and flags are zeroed
on the launch stream (no GPU: the frameworks are stand-ins that record what they were asked)."""
import types
import warnings
from contextlib import contextmanager, nullcontext

import pytest

from cupylab import _dtypes, _elementwise_core as core, _launch, _runtime
from cupylab.ops import _mt_reduce as R

F32 = _dtypes.from_name("float32")


class FakeCupy:
    """CuPy's current stream, a pool that notes the current stream of each allocation, and a
    runtime that notes memsets."""

    def __init__(self, current=0x10):
        self.current = current
        self.allocs, self.memsets = [], []
        fake = self

        class Stream:
            def __init__(self, ptr):
                self.ptr = ptr

        def get_current_stream():
            return Stream(fake.current)

        def memset_async(ptr, value, size, stream):
            fake.memsets.append((ptr, value, size, stream))

        self.cuda = types.SimpleNamespace(
            get_current_stream=get_current_stream,
            runtime=types.SimpleNamespace(memsetAsync=memset_async, getDevice=lambda: 0),
            Device=lambda d: nullcontext())

    def empty(self, shape, dtype=None):
        self.allocs.append((shape, self.current))
        return types.SimpleNamespace(shape=shape, dtype=dtype)


@pytest.fixture
def fake_cupy(monkeypatch):
    cp = FakeCupy()
    monkeypatch.setattr(_runtime, "cupy", lambda: cp)
    monkeypatch.setattr(_runtime, "current_device", lambda: 0)
    monkeypatch.setattr(_launch, "ensure_device", lambda d: nullcontext())

    @contextmanager
    def as_current(ptr, device):  # what `with cupy_stream(ptr, device):` does to CuPy
        old, cp.current = cp.current, ptr
        try:
            yield
        finally:
            cp.current = old

    monkeypatch.setattr(_launch, "cupy_stream", as_current)
    return cp


def test_cupy_allocation_for_another_stream_comes_from_that_streams_pool(fake_cupy):
    core.allocate("cupy", (4,), F32, 0)  # the current stream's
    core.allocate("cupy", (5,), F32, 0, 0x10)  # that is the current stream: nothing to do
    core.allocate("cupy", (6,), F32, 0, 0x99)  # a stream= argument
    core.allocate("jax", (7,), F32, 0, 0x0)  # other callers get CuPy memory: the same rule
    assert fake_cupy.allocs == [((4,), 0x10), ((5,), 0x10), ((6,), 0x99), ((7,), 0x0)]
    assert fake_cupy.current == 0x10  # restored


def test_torch_allocation_for_another_stream_is_made_while_it_is_current(monkeypatch):
    """torch's caching allocator hands out a block freed on the current stream at once for
    work on that stream; a kernel on another stream is not ordered after that work, so the
    allocation must be made while the launch stream is current (its own free list)."""
    state = {"current": 0x5700}
    allocs = []

    @contextmanager
    def stream_ctx(ext):  # what torch.cuda.stream(s) does to the allocator's stream
        old, state["current"] = state["current"], ext[1]
        try:
            yield
        finally:
            state["current"] = old

    recorded = []

    class T:
        def record_stream(self, s):
            recorded.append(s)

    def empty(shape, dtype=None, device=None):
        allocs.append((shape, device, state["current"]))
        return T()

    torch = types.SimpleNamespace(
        float32="f32", device=lambda kind, i: (kind, i), empty=empty,
        cuda=types.SimpleNamespace(ExternalStream=lambda ptr, device: ("ext", ptr, device),
                                   stream=stream_ctx))
    monkeypatch.setitem(core.sys.modules, "torch", torch)
    monkeypatch.setattr(core, "_torch_dt", {})
    monkeypatch.setattr(core, "_torch_dev", {})
    monkeypatch.setattr(_launch, "_torch_streams", {})
    monkeypatch.setattr(_launch, "current_stream", lambda kind, d: state["current"])
    core.allocate("torch", (3,), F32, 0)
    core.allocate("torch", (4,), F32, 0, 0x5700)
    core.allocate("torch", (5,), F32, 1, 0x99)
    assert allocs == [((3,), ("cuda", 0), 0x5700), ((4,), ("cuda", 0), 0x5700),
                      ((5,), ("cuda", 1), 0x99)]
    assert state["current"] == 0x5700  # restored
    # used on by the caller's current stream too: freed behind it as well
    assert recorded == [("ext", 0x5700, 1)]
    assert _launch.torch_stream(0x99, 1) is _launch.torch_stream(0x99, 1)  # kept


def test_torch_handle_0_is_the_default_stream_not_a_new_one(monkeypatch):
    """torch.cuda.ExternalStream(0) is a new stream from torch's pool (a null pointer means
    "none given"): the result of a stream= call made while torch's default stream is current
    was record_stream'd on that unrelated stream, not the caller's."""
    made = []
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        ExternalStream=lambda ptr, device: made.append(("ext", ptr, device)) or made[-1],
        default_stream=lambda device: made.append(("default", device)) or made[-1]))
    monkeypatch.setitem(_launch.sys.modules, "torch", torch)
    monkeypatch.setattr(_launch, "_torch_streams", {})
    assert _launch.torch_stream(0, 1) == ("default", 1)
    assert _launch.torch_stream(0x99, 1) == ("ext", 0x99, 1)
    assert made == [("default", 1), ("ext", 0x99, 1)]


def test_cupy_stream_wrappers_are_kept_and_cupys_deprecation_stays_quiet(monkeypatch):
    made = []

    class ExternalStream:
        def __init__(self, ptr, device_id):
            warnings.warn("ExternalStream is deprecated", DeprecationWarning, stacklevel=2)
            made.append((ptr, device_id))

    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(ExternalStream=ExternalStream))
    monkeypatch.setattr(_runtime, "cupy", lambda: cp)
    monkeypatch.setattr(_launch, "_cupy_streams", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = _launch.cupy_stream(0x99, 0)
        assert _launch.cupy_stream(0x99, 0) is a
        assert _launch.cupy_stream(0x99, 1) is not a
    assert made == [(0x99, 0), (0x99, 1)]


@pytest.mark.parametrize("stream", [None, 0x99])
def test_a_new_found_inf_is_zeroed_on_the_launch_stream(fake_cupy, monkeypatch, stream):
    """The flag the kernel sets must be zeroed before it, on the same stream (zeroing it on
    the framework's current stream could land after the kernel's write)."""
    monkeypatch.setattr(R._arrays, "as_view", lambda a, what="": types.SimpleNamespace(ptr=0xF00))
    plan = types.SimpleNamespace(kind="cupy", device=0)
    s = 0x10 if stream is None else stream
    flag, ptr = R._found_inf("foreach.unscale_", plan, None, s, stream)
    assert ptr == 0xF00 and fake_cupy.memsets == [(0xF00, 0, 4, s)]
    assert fake_cupy.allocs == [((1,), s)]


def test_a_given_found_inf_is_not_touched(fake_cupy, monkeypatch):
    plan = types.SimpleNamespace(kind="cupy", device=0)
    monkeypatch.setattr(R, "device_scalar", lambda *a, **k: 0xABC)
    given = object()
    assert R._found_inf("foreach.unscale_", plan, given, 0x99, 0x99) == (given, 0xABC)
    assert fake_cupy.memsets == [] and fake_cupy.allocs == []


def test_a_lists_table_comes_from_the_pool_of_its_launch_stream(fake_cupy, monkeypatch):
    """The table is read by the kernels on the call's stream and freed when its list dies,
    possibly while they run: its memory must go back behind that stream."""
    from cupylab.ops import _mt_plan as P

    monkeypatch.setattr(P, "capturing", lambda rt, s: False)
    uploads = []
    monkeypatch.setattr(P._Upload, "start", classmethod(
        lambda cls, cp, dst, blob, s: uploads.append(s)))
    monkeypatch.setattr(core, "_np_dtype_for", lambda dt: dt.name)

    class Buf:  # what the plan reads of the array: its address
        data = types.SimpleNamespace(ptr=0x1000)

    fake_cupy.empty = lambda shape, dtype=None: (fake_cupy.allocs.append(
        (shape, fake_cupy.current)), Buf())[1]
    groups, blob, tb_off, nb = P.layout([[0x2000, 0x3000]], [10, 20], [[F32, F32]], 2048)
    P._upload_plan(0, "torch", [10, 20], 2048, groups, blob, tb_off, nb, 0x99)
    assert fake_cupy.allocs[-1][1] == 0x99 and uploads == [0x99]
