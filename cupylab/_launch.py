"""Launching: streams, devices, and one lean path from Python arguments to ``cuLaunchKernel``.

:class:`Kernel` is one kernel instance (a name expression in a :class:`~cupylab._compile.Program`)
with its parameter layout. Launching packs the arguments with a precompiled ``struct.Struct``
into a per-thread buffer whose parameter addresses were computed once, then calls CuPy's thin
``cuLaunchKernel`` binding with the cached ``CUfunction`` for the device. No per-call dicts,
NumPy scalars or CuPy objects.
"""
from __future__ import annotations

import ctypes
import struct
import sys
import threading
import warnings

from . import _compile, _runtime

__all__ = ["Kernel", "resolve_stream", "current_stream", "cupy_stream", "wait_for",
           "ensure_device", "streaming_smem"]


# --------------------------------------------------------------------------------------------
# streams
def resolve_stream(stream) -> int:
    """A stream handle from ``stream=``: an int (``cudaStream_t``; 0 = legacy default), a CuPy
    ``Stream`` (``.ptr``), a torch ``Stream`` (``.cuda_stream``), or any object with the
    ``__cuda_stream__`` protocol (``(version, handle)``)."""
    if isinstance(stream, int) and not isinstance(stream, bool):
        if stream < 0:
            raise ValueError(f"stream must be a non-negative stream handle (got {stream})")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    # objects that carry a handle but are not streams (events, memory pointers, bools)
    tname = type(stream).__qualname__
    if isinstance(stream, bool) or "Event" in tname or "Memory" in tname or "Pointer" in tname:
        raise TypeError(f"stream must be a stream (got {type(stream).__module__}.{tname})")
    for attr in ("cuda_stream", "ptr", "handle"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
        if v is not None and hasattr(v, "value"):  # numba's handle is a ctypes c_void_p
            return int(v.value or 0)
    raise TypeError(
        "stream must be an int handle, a CuPy or torch stream, or an object with "
        f"__cuda_stream__ (got {type(stream).__module__}.{type(stream).__qualname__})")


_cupy_streams: dict = {}


def cupy_stream(ptr: int, device: int):
    """A CuPy stream object for the raw handle ``ptr`` on ``device`` (-1: not said), e.g. to
    make it CuPy's current stream: an allocation then comes from the memory pool's free list
    for that stream, and its memory goes back there. The wrappers own nothing and are kept (a
    few per process)."""
    key = (ptr, device)
    st = _cupy_streams.get(key)
    if st is None:
        cp = _runtime.cupy()
        if len(_cupy_streams) > 64:
            _cupy_streams.clear()
        with warnings.catch_warnings():  # CuPy 14 deprecates the class, not what it does
            warnings.simplefilter("ignore", DeprecationWarning)
            st = _cupy_streams[key] = cp.cuda.ExternalStream(ptr, device)
    return st


_torch_streams: dict = {}


def torch_stream(ptr: int, device: int):
    """A ``torch.cuda.ExternalStream`` for the raw handle ``ptr`` on ``device``, e.g. to make
    it torch's current stream while allocating: the caching allocator then hands out memory
    that is free for work on that stream, and takes it back behind that stream's work. The
    wrappers own nothing and are kept (a few per process). Handle 0 is torch's default
    stream of ``device`` (``ExternalStream(0)`` would be a new stream from torch's pool: it
    takes a null pointer for "none given")."""
    key = (ptr, device)
    st = _torch_streams.get(key)
    if st is None:
        if len(_torch_streams) > 64:
            _torch_streams.clear()
        tc = sys.modules["torch"].cuda
        st = _torch_streams[key] = (tc.default_stream(device) if ptr == 0 else
                                    tc.ExternalStream(ptr, device=device))
    return st


_torch_raw_stream = None


def current_stream(kind: str, device: int) -> int:
    """The caller's current stream on ``device``: torch's for torch arrays, CuPy's otherwise.
    ``device`` must be the current device."""
    global _torch_raw_stream
    if kind == "torch":
        f = _torch_raw_stream
        if f is None:
            f = _torch_raw_stream = sys.modules["torch"]._C._cuda_getCurrentRawStream
        return f(device)
    return _runtime.cupy().cuda.get_current_stream().ptr


_tls_events = threading.local()


def wait_for(consumer: int, producer, device: int) -> None:
    """Make ``consumer`` wait for the work already queued on ``producer`` (a CAI v3 stream):
    an event recorded on the producer and waited on by the consumer — never a host block."""
    if producer is None or producer == consumer:
        return
    rt = _runtime.cupy().cuda.runtime
    if producer == 1:  # CAI/DLPack legacy default stream is handle 0 to the runtime
        producer = 0
        if consumer == 0:
            return
    if capturing(rt, consumer) and capturing(rt, producer, unknown=False) is not True:
        # a graph being captured cannot depend on work queued outside the capture (CUDA
        # refuses the wait and ends the capture; a query of the legacy stream during a
        # capture fails, and recording on it would end the capture too): the producer's
        # work must be finished before capturing, as for any input of a graph
        return
    evs = getattr(_tls_events, "d", None)
    if evs is None:
        evs = _tls_events.d = {}
    ev = evs.get(device)
    if ev is None:  # created on ``device`` (an event records only onto its device's streams)
        with ensure_device(device):
            ev = evs[device] = rt.eventCreateWithFlags(rt.eventDisableTiming)
    rt.eventRecord(ev, producer)
    rt.streamWaitEvent(consumer, ev, 0)


def capturing(rt, stream, unknown=True) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph; ``unknown`` when the runtime
    refuses the question (the legacy stream while a blocking stream captures)."""
    try:
        return rt.streamIsCapturing(stream) != 0
    except Exception:  # noqa: BLE001
        return unknown


def ensure_device(device: int):
    """Make ``device`` current if it is not; returns a context manager (a no-op when it is)."""
    cp = _runtime.cupy()
    if cp.cuda.runtime.getDevice() == device:
        return _NULL
    return cp.cuda.Device(device)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


_NULL = _Null()


# --------------------------------------------------------------------------------------------
# kernels
class Kernel:
    """One kernel instance with a fixed parameter layout.

    Parameters
    ----------
    program : cupylab._compile.Program
    name_expression : str
        The instance to launch, e.g. ``"cl::ew_contig<float, 0, 4>"``.
    param_formats : sequence of str
        One ``struct`` format per kernel parameter, in order: ``"Q"`` for pointers, ``"i"``
        ``"q"`` ``"f"`` ``"d"`` ``"H"`` for scalars, ``"8q"`` for a by-value array struct...
    """

    __slots__ = ("program", "name_expression", "_struct", "_offsets", "_size", "_tls", "_fns",
                 "_lock")

    def __init__(self, program, name_expression, param_formats):
        self.program = program
        self.name_expression = name_expression
        fmts = list(param_formats)
        self._struct = struct.Struct("@" + "".join(fmts))
        offs = []
        prefix = "@"
        for f in fmts:
            offs.append(struct.calcsize(prefix + f) - struct.calcsize("@" + f))
            prefix += f
        self._offsets = tuple(offs)
        self._size = max(self._struct.size, 8)
        self._tls = threading.local()
        self._fns = {}
        self._lock = threading.Lock()

    def function(self, device: int) -> int:
        """The ``CUfunction`` handle on ``device`` (compiling/loading on first use)."""
        f = self._fns.get(device)
        if f is None:
            _runtime.bind_thread_context()  # the module load is a driver call, like the launch
            mod = _compile.get_module(self.program, device)
            f = self._fns.setdefault(device, mod.function(self.name_expression).ptr)
        return f

    def _buffers(self):
        """This thread's parameter buffer, made on the thread's first launch of this kernel.
        That first launch also binds the current device's primary context to the thread:
        ``cuLaunchKernel`` is a driver call and needs one, which a thread that has made no
        runtime call yet (a Dask or thread-pool worker whose arrays came from a memory pool)
        does not have."""
        _runtime.bind_thread_context()
        buf = ctypes.create_string_buffer(self._size)
        base = ctypes.addressof(buf)
        params = (ctypes.c_void_p * max(len(self._offsets), 1))(*[base + o for o in self._offsets])
        bp = (buf, params, ctypes.addressof(params))
        self._tls.bp = bp
        return bp

    def launch(self, device: int, grid: int, block: int, stream: int, args, shared_mem: int = 0,
               grid_yz=(1, 1), block_yz=(1, 1)):
        """Launch on ``stream``. ``device`` must be current. ``args`` match ``param_formats``."""
        f = self._fns.get(device)
        if f is None:
            f = self.function(device)
        try:
            buf, _, params = self._tls.bp
        except AttributeError:
            buf, _, params = self._buffers()
        self._struct.pack_into(buf, 0, *args)
        (_driver_launch or _launch_kernel())(f, grid, grid_yz[0], grid_yz[1], block, block_yz[0],
                                             block_yz[1], shared_mem, stream, params, 0)


_driver_launch = None


# --------------------------------------------------------------------------------------------
# residency of large streaming launches
# blocks of 256 threads (2^18 16-byte vectors) from which it applies: above the 792 blocks that
# fit at 6 per SM on an H200, and measured faster from there on (docs/perf.md, "Resident blocks")
STREAM_MIN_GRID = 1024
_stream_smem: dict = {}  # device -> bytes of dynamic shared memory (0: none)


def streaming_smem(kernel, device: int) -> int:
    """Dynamic shared memory for a large one-vector-per-thread streaming launch of ``kernel``
    (256-thread blocks, at least :data:`STREAM_MIN_GRID` of them) on ``device``: an amount
    that leaves room for 6 resident blocks per SM instead of 8, or 0.

    On the H200, 6 blocks of 256 threads (75 % of the threads an SM can hold, torch's
    occupancy for these kernels) streamed 0.5-2 % faster than 8 in every lease measured, as
    long as the L1/shared split stayed at 196 KiB of shared memory; reserving more, so that the
    driver moves to 228 KiB, cost 3-4 % (docs/perf.md, "Resident blocks"). The amount is one
    seventh of the SM's shared memory less the per-block reservation, which cannot fit 7
    blocks and fits 6 in 196 KiB. Only for compute capability 9.x with 2,048 threads per SM,
    and only when the driver's occupancy calculator confirms 6 blocks for ``kernel``; 0
    elsewhere. The kernels use no shared memory: this only limits how many blocks share an SM.
    """
    s = _stream_smem.get(device)
    if s is None:
        s = _stream_smem.setdefault(device, _compute_streaming_smem(kernel, device))
    return s


def _compute_streaming_smem(kernel, device: int) -> int:
    rt = _runtime.cupy().cuda.runtime
    attr = rt.deviceGetAttribute
    # cudaDevAttr: 75 compute capability major, 39 max threads per SM, 81 shared memory per SM,
    # 111 reserved shared memory per block, 8 max shared memory per block (without opt-in)
    if attr(75, device) != 9 or attr(39, device) != 2048:
        return 0
    smem = attr(81, device) // 7 - attr(111, device)
    if not 0 < smem <= attr(8, device):
        return 0
    from cupy_backends.cuda.api import driver  # noqa: PLC0415

    blocks = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.function(device), 256, smem)
    return smem if blocks == 6 else 0


def _launch_kernel():
    """The launch function: CuPy's binding of ``cuLaunchKernel`` (``f(func, gx, gy, gz, bx,
    by, bz, smem, stream, params, extra)``; raises on failure). Measured against a ctypes
    call of the driver, it was the cheaper of the two (docs/perf.md)."""
    global _driver_launch
    if _driver_launch is None:
        _runtime.cupy()
        from cupy_backends.cuda.api import driver  # noqa: PLC0415

        _driver_launch = driver.launchKernel
    return _driver_launch


class PreparedLaunch:
    """A launch whose arguments were validated and packed once (see :func:`cupylab.prepare`).

    Calling it launches the kernel with the frozen arguments on the stream fixed at prepare
    time, or on the caller's current stream looked up per call, and returns the output.
    """

    __slots__ = ("_f", "_grid", "_grid_y", "_grid_z", "_block", "_buf", "_params",
                 "_params_addr", "_stream", "out", "device", "_keep", "_smem")

    def __init__(self, kernel, device, grid, block, args, stream, out, keep, shared_mem=0):
        self.out = out
        self._smem = shared_mem
        self.device = device
        self._keep = keep  # the operands: their memory must outlive the prepared call
        if type(grid) is tuple:
            grid, self._grid_y, self._grid_z = (tuple(grid) + (1, 1))[:3]
        else:
            self._grid_y = self._grid_z = 1
        self._grid, self._block, self._stream = grid, block, stream
        if kernel is None:  # empty work: nothing to launch
            self._f = None
            return
        self._f = kernel.function(device)
        _launch_kernel()
        self._buf = ctypes.create_string_buffer(kernel._size)
        kernel._struct.pack_into(self._buf, 0, *args)
        base = ctypes.addressof(self._buf)
        self._params = (ctypes.c_void_p * max(len(kernel._offsets), 1))(
            *[base + o for o in kernel._offsets])
        self._params_addr = ctypes.addressof(self._params)

    def __call__(self):
        f = self._f
        if f is not None:
            s = self._stream
            if not isinstance(s, int):
                s = s()
            _driver_launch(f, self._grid, self._grid_y, self._grid_z, self._block, 1, 1,
                           self._smem, s, self._params_addr, 0)
        return self.out

    def __repr__(self):
        return f"<cupylab prepared launch on cuda:{self.device}, grid={self._grid}>"
