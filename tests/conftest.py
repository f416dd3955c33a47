"""Shared test helpers: GPU detection (GPU tests are skipped with a visible reason when there
is none) and fake protocol objects that need no GPU."""
import contextlib
import ctypes
import os

import pytest


def _gpu_reason():
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        return f"CuPy is not importable ({e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        return f"no usable CUDA GPU ({e})"
    return None if n > 0 else "no CUDA GPU (0 devices)"


GPU_SKIP_REASON = _gpu_reason()
HAS_GPU = GPU_SKIP_REASON is None
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason=f"GPU test: {GPU_SKIP_REASON}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is not None and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {GPU_SKIP_REASON}"))


@pytest.fixture(scope="session", autouse=True)
def _session_cache_dir(tmp_path_factory):
    """Point the persistent kernel cache at a per-session directory unless the caller chose
    one, so tests never read or write the user's cache."""
    if "CUPYLAB_CACHE_DIR" not in os.environ:
        os.environ["CUPYLAB_CACHE_DIR"] = str(tmp_path_factory.mktemp("cupylab-cache"))
    yield


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, enabled kernel cache directory for one test."""
    d = tmp_path / "cache"
    monkeypatch.setenv("CUPYLAB_CACHE_DIR", str(d))
    monkeypatch.delenv("CUPYLAB_CACHE_DISABLE", raising=False)
    return d


class FakeCAI:
    """An object exporting a hand-written ``__cuda_array_interface__`` (never dereferenced)."""

    def __init__(self, shape, typestr="<f4", ptr=0x7F0000000000, strides=None, readonly=False,
                 version=3, stream=None, **extra):
        d = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, readonly),
             "version": version}
        if strides is not None:
            d["strides"] = tuple(strides)
        if stream is not None:
            d["stream"] = stream
        d.update(extra)
        self._cai = d

    @property
    def __cuda_array_interface__(self):
        return self._cai


class FakeDLPack:
    """A DLPack producer built with ctypes: a (versioned or legacy) managed tensor describing
    made-up device memory. Records how often its deleter ran and the stream it was asked for."""

    def __init__(self, shape, code=2, bits=32, device_type=2, device_id=0, ptr=0x7F0000001000,
                 strides=None, byte_offset=0, versioned=True, flags=0):
        import ctypes

        from cupylab import _arrays as A

        self.deleted = 0
        self.asked_stream = "unset"
        self._shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self._strides = ((ctypes.c_int64 * len(strides))(*strides) if strides is not None
                         else None)
        t = A._DLTensor()
        t.data = ptr
        t.device = A._DLDevice(device_type, device_id)
        t.ndim = len(shape)
        t.dtype = A._DLDataType(code, bits, 1)
        t.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = (ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
                     if strides is not None else None)
        t.byte_offset = byte_offset

        def deleter(addr):
            self.deleted += 1

        self._deleter = A._DELETER(deleter)
        if versioned:
            m = A._DLManagedTensorVersioned()
            m.version = A._DLPackVersion(1, 1)
            m.flags = flags
        else:
            m = A._DLManagedTensor()
        m.dl_tensor = t
        m.deleter = self._deleter
        self._managed = m
        self._name = b"dltensor_versioned" if versioned else b"dltensor"
        self._device = (device_type, device_id)

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        import ctypes

        self.asked_stream = stream
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._managed), self._name, None)


class _SimInfo:
    sm_count = 132
    max_smem_optin = 227 * 1024


@pytest.fixture
def sim(monkeypatch):
    """A pretend GPU 0 whose current stream is 0x5700; kernel launches are recorded (with the
    arguments packed as the real launch packs them), not run."""
    with simulated_gpu(monkeypatch) as rec:
        yield rec


@contextlib.contextmanager
def simulated_gpu(monkeypatch):
    """The ``sim`` fixture's pretend GPU, for ``monkeypatch`` (its patches end with it); on
    leaving, the pretend functions it stored in the library's kernels are taken out again."""
    import types

    from cupylab import _arrays, _kernel, _kfast, _launch, _runtime

    rec = {"launches": [], "waits": [], "direct": 0}  # direct: launches through the driver
    # the pretend streams are made-up numbers: never ask a real runtime about them (on a GPU
    # machine cudaStreamIsCapturing would dereference one)
    monkeypatch.setattr(_arrays, "_capturing", lambda stream: False)
    monkeypatch.setattr(_runtime, "pointer_device", lambda ptr: 0)
    monkeypatch.setattr(_runtime, "current_device", lambda: 0)
    monkeypatch.setattr(_runtime, "device_info", lambda d: _SimInfo())
    monkeypatch.setattr(_launch, "ensure_device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_launch, "current_stream", lambda kind, d: 0x5700)
    monkeypatch.setattr(_launch, "wait_for", lambda c, p, d: rec["waits"].append((c, p)))
    # the lean launch path's own runtime lookups, routed through the patched functions
    monkeypatch.setattr(_kfast, "_get_device", lambda: _runtime.current_device())
    monkeypatch.setattr(_kfast, "_torch_raw", lambda d: _launch.current_stream("torch", d))
    monkeypatch.setattr(_kfast, "_cupy_current", lambda device_id=-1: types.SimpleNamespace(
        ptr=_launch.current_stream("cupy", _runtime.current_device() if device_id < 0
                                   else device_id)))

    handles = {}  # pretend CUfunction -> the kernel
    planted = []  # (kernel, device) whose pretend function this fixture stored

    def launch(self, device, grid, block, stream, args, shared_mem=0, grid_yz=(1, 1),
               block_yz=(1, 1)):
        # the arguments as the real launch packs them (as the driver path reads them back)
        packed = self._struct.unpack(self._struct.pack(*args))
        rec["launches"].append(dict(name=self.name_expression, grid=(grid,) + tuple(grid_yz),
                                    block=(block,) + tuple(block_yz), stream=stream,
                                    args=packed, smem=shared_mem))
        # as the real launch leaves them: the kernel's function on the device and this
        # thread's parameter buffer (users' kernels then launch through the driver directly)
        handles[id(self)] = self
        if device not in self._fns:  # taken back at teardown (the kernels outlive the test)
            planted.append((self, device))
            self._fns[device] = id(self)
        if not hasattr(self._tls, "bp"):
            self._buffers()

    def driver_launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        """cuLaunchKernel: the arguments are read back from the kernel's parameter buffer."""
        k = handles[f]
        rec["direct"] += 1
        size = k._struct.size
        raw = ctypes.string_at(ctypes.c_void_p.from_address(params).value, size) if size else b""
        rec["launches"].append(dict(name=k.name_expression, grid=(gx, gy, gz),
                                    block=(bx, by, bz), stream=stream,
                                    args=k._struct.unpack(raw), smem=smem))

    monkeypatch.setattr(_launch.Kernel, "launch", launch)
    monkeypatch.setattr(_launch, "_driver_launch", driver_launch)
    monkeypatch.setattr(_kernel, "_GRID_1D", {})
    try:
        yield rec
    finally:
        # The kernel objects are the library's own, cached for the process: a pretend function
        # left in one would be launched by a later GPU test in the same worker (the driver
        # says CUDA_ERROR_INVALID_HANDLE), so each one stored here is taken out again.
        for k, device in planted:
            if k._fns.get(device) == id(k):
                del k._fns[device]


def compile_every(programs, cc):
    """Compile every program for compute capability ``cc`` through NVRTC (no GPU, no cache)
    and check each gives a cubin with all its instances; returns the number of instances."""
    from cupylab import _compile

    n = 0
    for prog in programs:
        binary, mapping, kind, _ = _compile.compile_program(prog, cc)
        assert kind == "cubin" and binary[:4] == b"\x7fELF"
        assert set(mapping) == set(prog.name_expressions)
        n += len(mapping)
    return n
