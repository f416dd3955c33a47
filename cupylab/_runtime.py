"""CuPy and the GPU, imported lazily: ``import cupylab`` touches neither.

Everything that needs the CUDA runtime goes through :func:`cupy` (the module) and
:func:`device_info`, so the "no GPU" case raises one clear :class:`NoGPUError` in one place.
"""
from __future__ import annotations

import threading

from ._errors import NoGPUError

_lock = threading.Lock()
_cupy = None
_gpu_checked = False
_device_info: dict = {}


def cupy():
    """Return the ``cupy`` module, checking once that a CUDA GPU is usable."""
    global _cupy, _gpu_checked
    if _gpu_checked:
        return _cupy
    with _lock:
        if _gpu_checked:
            return _cupy
        try:
            import cupy as cp  # noqa: PLC0415 - lazy on purpose
        except ImportError as e:  # pragma: no cover - depends on the install
            raise NoGPUError(
                "cupylab needs CuPy to run kernels: install it with "
                "`pip install cupylab[cuda12]` (CUDA 12) or `pip install cupylab[cuda13]` "
                f"(CUDA 13) ({e})") from e
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception as e:  # CUDARuntimeError: no driver, insufficient driver, ...
            raise NoGPUError(f"cupylab: no usable CUDA GPU on this machine ({e})") from None
        if n < 1:
            raise NoGPUError("cupylab: no usable CUDA GPU on this machine (0 devices found)")
        _cupy = cp
        _gpu_checked = True
        return cp


class DeviceInfo:
    """Properties of one GPU that launch configuration and compilation need."""

    __slots__ = ("index", "sm_count", "cc", "name", "max_smem_optin", "l2_bytes")

    def __init__(self, index):
        cp = cupy()
        attrs = cp.cuda.runtime.getDeviceProperties(index)
        self.index = index
        self.sm_count = int(attrs["multiProcessorCount"])
        self.cc = int(attrs["major"]) * 10 + int(attrs["minor"])
        name = attrs["name"]
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        self.max_smem_optin = int(attrs.get("sharedMemPerBlockOptin", 49152))
        self.l2_bytes = int(attrs.get("l2CacheSize", 0))


def device_info(index: int) -> DeviceInfo:
    info = _device_info.get(index)
    if info is None:
        info = _device_info.setdefault(index, DeviceInfo(index))
    return info


def current_device() -> int:
    return cupy().cuda.runtime.getDevice()


def bind_thread_context() -> None:
    """Make the current device's primary context current on this thread.

    Driver calls (``cuLaunchKernel``, module loads) need a current context; the runtime API
    binds one lazily, on a thread's first runtime call that needs it. A worker thread that
    only reads array attributes and takes memory from a pool may never make such a call, and
    its first launch then fails with ``CUDA_ERROR_INVALID_CONTEXT``. ``cudaSetDevice``
    initialises and binds the primary context (CUDA 12 and later); called once per thread and
    kernel, from the first launch. Nothing to do before :func:`cupy` has found a GPU.
    """
    cp = _cupy
    if cp is not None:
        rt = cp.cuda.runtime
        rt.setDevice(rt.getDevice())


def pointer_device(ptr: int) -> int:
    """The device that owns a device pointer (for CAI producers, which do not say)."""
    cp = cupy()
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(ptr)
    except Exception as e:
        raise ValueError(f"pointer 0x{ptr:x} is not a CUDA device pointer ({e})") from None
    # cudaMemoryTypeHost = 1: plain or pinned host memory is not something kernels should get.
    if attrs.type not in (2, 3):
        raise TypeError(
            f"pointer 0x{ptr:x} is host memory (cudaMemoryType {attrs.type}); cupylab needs "
            "device arrays")
    return attrs.device
