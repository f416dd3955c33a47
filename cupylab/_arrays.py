"""Foreign GPU arrays in, a small view record out — and results back in the caller's type.

This is cupylab's argument unpacker (the seed's ``THPVariable_unpack``). :func:`as_view` turns
a CuPy array, torch tensor, JAX array, Numba device array, or any object speaking the CUDA Array
Interface (v2/v3) or DLPack into a :class:`View`: pointer, shape, strides in *elements*, dtype,
device, read-only flag, the producer's stream, the framework it came from, and the object that
keeps the memory alive. Nothing is copied and no GPU call is made, except that a CAI producer
does not say which device its pointer is on (that is looked up when the op runs).

Per-framework adapters are chosen by ``type(obj)`` and cached, so the hot path is one dict
lookup plus the adapter. torch and CuPy have fast paths that build no dict and no DLPack capsule
(torch's ``__cuda_array_interface__`` costs microseconds and fails for bfloat16).
"""
from __future__ import annotations

import ctypes
import sys

from . import _dtypes

__all__ = ["View", "as_view", "framework_of", "DEFERRED", "deferred_device", "import_deferred",
           "resolve_device"]


class View:
    """What cupylab needs to know about one GPU array.

    Attributes
    ----------
    ptr : int
        Address of the first element (offsets already applied); 0 for empty arrays.
    shape : tuple of int
    strides : tuple of int
        In elements (not bytes). May be negative or zero.
    dtype : cupylab._dtypes.DType
    device : int or None
        CUDA device ordinal; ``None`` until resolved for CAI producers.
    readonly : bool
        True for JAX arrays, DLPack READ_ONLY and CAI ``data[1] == True``: never written.
    stream : int or None
        The stream the producer says its pending work is on (CAI v3), else ``None``.
    kind : str
        ``"torch"``, ``"cupy"``, ``"jax"``, ``"numba"``, ``"cai"`` or ``"dlpack"``; ``"dask"``
        for the address-less views the Dask form builds for the eager checks (``ptr`` 0).
    obj : object
        The original object.
    owner : object
        Whatever must stay alive while a kernel may read the memory.
    """

    __slots__ = ("ptr", "shape", "strides", "dtype", "device", "readonly", "stream", "kind",
                 "obj", "owner")

    def __init__(self, ptr, shape, strides, dtype, device, readonly, stream, kind, obj,
                 owner=None):
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.device = device
        self.readonly = readonly
        self.stream = stream
        self.kind = kind
        self.obj = obj
        self.owner = obj if owner is None else owner

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __repr__(self):
        return (f"View(kind={self.kind!r}, ptr=0x{self.ptr:x}, shape={self.shape}, "
                f"strides={self.strides}, dtype={self.dtype.name}, device={self.device}, "
                f"readonly={self.readonly}, stream={self.stream})")


def _what(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


_EXPECTED = ("a CUDA device array (CuPy, torch, JAX, Numba, or an object with "
             "__cuda_array_interface__ / __dlpack__)")


def _looks_like_host_array(obj):
    """Data that lives in host memory (NumPy arrays and scalars, CPU tensors, host DLPack
    producers, buffers, sequences), as opposed to something that is no array at all."""
    tp = type(obj)
    if tp in (list, tuple, memoryview, bytes, bytearray):
        return True
    return any(hasattr(tp, a) for a in ("__array__", "__array_interface__", "__dlpack__",
                                        "__cuda_array_interface__", "__buffer__"))


def _host_error(what, obj):
    if (type(obj).__module__ or "").startswith("dask."):
        return TypeError(f"{what} is a Dask array, which this operator does not take (the "
                         "elementwise and row-wise operators do); pass a GPU array, e.g. one "
                         "chunk, or map the operator over the chunks with map_blocks")
    if _looks_like_host_array(obj):
        return TypeError(f"{what} must be {_EXPECTED}; got host data of type {_what(obj)}")
    return TypeError(f"{what} must be {_EXPECTED}; got {_what(obj)}, which is not an array")


# --------------------------------------------------------------------------------------------
# torch
_torch_dtypes: dict = {}
_torch_strided = None


def _init_torch():
    global _torch_strided
    torch = sys.modules["torch"]
    for d in _dtypes.DTYPES.values():
        td = getattr(torch, d.name, None)
        if td is not None:
            _torch_dtypes[td] = d
    _torch_strided = torch.strided


def _from_torch(t, what, stream):
    if not t.is_cuda:
        raise _host_error(what, t)
    if t.requires_grad:
        raise TypeError(
            f"{what} is a torch tensor that requires grad; cupylab kernels are not recorded by "
            "autograd. Pass tensor.detach() (or run under torch.no_grad())")
    if t.layout is not _torch_strided:
        raise TypeError(f"{what} has layout {t.layout}; only strided (dense) tensors are supported")
    if t.is_conj() or t.is_neg():
        raise TypeError(
            f"{what} is a torch view with a lazy conj/neg bit; materialise it first with "
            ".resolve_conj() / .resolve_neg()")
    try:
        dt = _torch_dtypes[t.dtype]
    except KeyError:
        raise TypeError(f"{what} has unsupported dtype {t.dtype}") from None
    try:
        ptr = t.data_ptr()
    except RuntimeError:  # a wrapper subclass with no storage of its own (DTensor, FakeTensor)
        raise TypeError(f"{what} is a {_what(t)} with no storage of its own (a wrapper tensor "
                        "subclass); pass a plain tensor (e.g. DTensor.to_local())") from None
    return View(ptr, tuple(t.shape), tuple(t.stride()), dt, t.get_device(), False,
                None, "torch", t)


# --------------------------------------------------------------------------------------------
# CuPy
_np_dtypes: dict = {}


def _dtype_from_numpy(npdt, what):
    d = _np_dtypes.get(npdt)
    if d is None:
        try:
            d = _dtypes.from_name(npdt.name)
        except TypeError:
            raise TypeError(f"{what} has unsupported dtype {npdt}") from None
        if npdt.byteorder == ">":
            raise TypeError(f"{what} is big-endian ({npdt}); not supported")
        _np_dtypes[npdt] = d
    return d


def _from_cupy(a, what, stream):
    d = _dtype_from_numpy(a.dtype, what)
    isz = d.itemsize
    strides = a.strides
    el = tuple(s // isz for s in strides)
    if any(e * isz != s for e, s in zip(el, strides)):
        raise ValueError(f"{what}: byte strides {strides} are not multiples of the item size {isz}")
    ptr = a.data.ptr
    if ptr % isz and a.size:  # a byte-offset .view() of another dtype, as the other adapters
        raise ValueError(f"{what}: data pointer 0x{ptr:x} is not aligned to its item size")
    return View(ptr, a.shape, el, d, a.device.id, False, None, "cupy", a)


# --------------------------------------------------------------------------------------------
# CUDA Array Interface (v2 / v3): Numba and anything else that speaks it
def view_from_cai(iface: dict, obj, what="array", kind="cai") -> View:
    """Build a :class:`View` from a ``__cuda_array_interface__`` dict (no GPU call).

    Validates the required keys, rejects masks and byte strides that are not a multiple of
    the item size, and keeps the v3 ``stream`` (``0`` is forbidden by the spec).
    """
    try:
        shape = tuple(int(s) for s in iface["shape"])
        typestr = iface["typestr"]
        ptr, ro = iface["data"]
        version = int(iface.get("version", 0))
    except (KeyError, TypeError, ValueError) as e:
        raise TypeError(f"{what}: malformed __cuda_array_interface__ ({e!r})") from None
    if iface.get("mask") is not None:
        raise TypeError(f"{what}: masked CUDA arrays (CAI 'mask') are not supported")
    if any(s < 0 for s in shape):
        raise ValueError(f"{what}: negative extent in shape {shape}")
    d = _dtypes.from_typestr(typestr)
    isz = d.itemsize
    bstrides = iface.get("strides")
    if bstrides is None:
        el, acc = [], 1
        for s in reversed(shape):
            el.append(acc)
            acc *= s
        strides = tuple(reversed(el))
    else:
        if len(bstrides) != len(shape):
            raise ValueError(f"{what}: CAI strides {tuple(bstrides)} do not match shape {shape}")
        strides = tuple(int(s) // isz for s in bstrides)
        if any(e * isz != int(s) for e, s in zip(strides, bstrides)):
            raise ValueError(
                f"{what}: CAI byte strides {tuple(bstrides)} are not multiples of the item size "
                f"{isz} ({d.name})")
    stream = iface.get("stream") if version >= 3 else None
    if stream is not None:
        stream = int(stream)
        if stream == 0:  # forbidden by the spec, but Numba exports its default stream so:
            stream = 1   # the legacy default stream, as CuPy and Numba read it
    ptr = int(ptr or 0)
    if ptr % isz and 0 not in shape:
        raise ValueError(f"{what}: data pointer 0x{ptr:x} is not aligned to its item size {isz}")
    return View(ptr, shape, strides, d, None, bool(ro), stream, kind, obj)


def _from_cai(obj, what, stream, kind="cai"):
    return view_from_cai(obj.__cuda_array_interface__, obj, what, kind)


def _from_numba(obj, what, stream):
    return view_from_cai(obj.__cuda_array_interface__, obj, what, "numba")


# --------------------------------------------------------------------------------------------
# DLPack
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


DLPACK_FLAG_READ_ONLY = 1
DLPACK_FLAG_IS_COPIED = 2  # the producer exported a copy (DLPack 1.0)
DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 2, 3, 13

_PyCapsule_GetName = ctypes.pythonapi.PyCapsule_GetName
_PyCapsule_GetName.restype = ctypes.c_char_p
_PyCapsule_GetName.argtypes = [ctypes.py_object]
_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_PyCapsule_SetName = ctypes.pythonapi.PyCapsule_SetName
_PyCapsule_SetName.restype = ctypes.c_int
_PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
# Module-level so the C strings outlive every capsule renamed with them.
_USED_NAMES = {b"dltensor": b"used_dltensor", b"dltensor_versioned": b"used_dltensor_versioned"}


class _DLPackOwner:
    """Owns a consumed DLPack tensor: calls the producer's deleter once, when dropped."""

    __slots__ = ("_managed", "_producer", "__weakref__")

    def __init__(self, managed, producer):
        self._managed = managed
        self._producer = producer  # keep the exporting object alive as well

    def __del__(self):
        m = self._managed
        self._managed = None
        if m is not None and m.deleter:
            m.deleter(ctypes.addressof(m))


def view_from_capsule(capsule, obj, what="array") -> View:
    """Consume a DLPack capsule (``dltensor`` or ``dltensor_versioned``) into a :class:`View`.

    The capsule is renamed ``used_*`` as the protocol requires; the returned view's ``owner``
    calls the producer's deleter when it is garbage collected.
    """
    name = _PyCapsule_GetName(capsule)
    if name not in _USED_NAMES:
        raise TypeError(f"{what}: __dlpack__ returned a capsule named {name!r}, not a DLPack tensor")
    addr = _PyCapsule_GetPointer(capsule, name)
    if not addr:
        raise TypeError(f"{what}: empty DLPack capsule")
    if name == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(addr)
        if managed.version.major != 1:
            raise TypeError(f"{what}: DLPack major version {managed.version.major} not supported")
        # a copy the producer made (IS_COPIED): writing into it would be lost, so it is
        # taken as read-only (refused as an output)
        readonly = bool(managed.flags & (DLPACK_FLAG_READ_ONLY | DLPACK_FLAG_IS_COPIED))
    else:
        managed = _DLManagedTensor.from_address(addr)
        readonly = False
    _PyCapsule_SetName(capsule, _USED_NAMES[name])
    owner = _DLPackOwner(managed, obj)
    t = managed.dl_tensor
    dev_type, dev_id = t.device.device_type, t.device.device_id
    if dev_type not in (DL_CUDA, DL_CUDA_MANAGED):
        raise _host_error(what, obj)
    d = _dtypes.from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    ndim = t.ndim
    shape = tuple(t.shape[i] for i in range(ndim))
    if t.strides:
        strides = tuple(t.strides[i] for i in range(ndim))
    else:
        el, acc = [], 1
        for s in reversed(shape):
            el.append(acc)
            acc *= s
        strides = tuple(reversed(el))
    ptr = (t.data or 0) + t.byte_offset
    if ptr % d.itemsize and 0 not in shape:
        raise ValueError(f"{what}: data pointer 0x{ptr:x} is not aligned to its item size")
    return View(ptr, shape, strides, d, dev_id, readonly, None, "dlpack", obj, owner)


# What a producer is asked for while the launch stream is being captured, where it is not
# DLPack's -1: JAX takes any stream it is given as a handle to wait on (-1 fails with "invalid
# resource handle"); given None it waits on the host until the buffer is ready and puts
# nothing on a stream, which leaves the capture intact.
_CAPTURE_STREAM_ARG = {"jax": None}


def _dlpack_stream_arg(stream, kind):
    # The consumer passes the stream it will use; 0 is forbidden in DLPack (legacy is 1). A
    # stream being captured into a CUDA graph gets -1, "no synchronization": the producer's
    # wait (an event of its own stream) cannot be part of the graph and would end the capture;
    # its work must be finished before capturing, as for a CAI v3 producer (README, "Streams").
    if stream is None or stream == 0:
        return 1
    if stream != 1 and _capturing(stream):
        return _CAPTURE_STREAM_ARG.get(kind, -1)
    return stream


def _capturing(stream) -> bool:
    """Whether ``stream`` is being captured (False when the runtime cannot say)."""
    from . import _launch, _runtime  # noqa: PLC0415 - only the DLPack path asks

    try:
        rt = _runtime.cupy().cuda.runtime
    except Exception:  # noqa: BLE001 - no usable GPU: nothing is being captured
        return False
    return _launch.capturing(rt, stream, unknown=False)


def _from_dlpack(obj, what, stream, kind="dlpack"):
    dev = obj.__dlpack_device__()
    if int(dev[0]) not in (DL_CUDA, DL_CUDA_MANAGED):
        raise _host_error(what, obj)
    s = _dlpack_stream_arg(stream, kind)
    try:
        cap = obj.__dlpack__(stream=s, max_version=(1, 1))
    except TypeError:  # a producer from before DLPack 1.0 knows no max_version
        cap = obj.__dlpack__(stream=s)
    v = view_from_capsule(cap, obj, what)
    v.kind = kind
    return v


def _check_jax_single(obj, what):
    if getattr(obj, "is_fully_addressable", True) is False or len(obj.devices()) != 1:
        raise TypeError(f"{what}: sharded JAX arrays are not supported; pass a single-device array")


def _from_jax(obj, what, stream):
    # JAX arrays are immutable: whatever the capsule says, never write into them.
    _check_jax_single(obj, what)
    v = _from_dlpack(obj, what, stream, "jax")
    v.readonly = True
    return v


# --------------------------------------------------------------------------------------------
# adapter selection, cached per type
_ADAPTERS: dict = {}


def _classify(tp):
    mod = tp.__module__ or ""
    top = mod.split(".", 1)[0]
    torch = sys.modules.get("torch")
    # any torch.Tensor subclass, wherever defined (a user's or a library's: through the CUDA
    # Array Interface it would lose the conj/neg, grad and stream checks)
    if torch is not None and issubclass(tp, torch.Tensor):
        if not _torch_dtypes:
            _init_torch()
        return _from_torch
    if top == "cupy":
        cp = sys.modules.get("cupy")
        if cp is not None and issubclass(tp, cp.ndarray):
            return _from_cupy
    if top in ("jax", "jaxlib"):
        if hasattr(tp, "__dlpack__"):
            return _from_jax
    if top in ("numba", "numba_cuda") and hasattr(tp, "__cuda_array_interface__"):
        return _from_numba
    if top == "numpy" or tp in (list, tuple, memoryview, bytes, bytearray):
        return None
    if hasattr(tp, "__cuda_array_interface__"):
        return _from_cai
    if hasattr(tp, "__dlpack__") and hasattr(tp, "__dlpack_device__"):
        return _from_dlpack
    return None


def framework_of(obj):
    """The adapter for ``obj`` (cached per type) or ``None`` when it is not a GPU array.

    A type whose instances carry the protocol as an instance attribute (``self.__cuda_array_
    interface__ = {...}``) is recognised per object, uncached."""
    tp = type(obj)
    try:
        fn = _ADAPTERS[tp]
    except KeyError:
        fn = _ADAPTERS.setdefault(tp, _classify(tp))
    if fn is None and tp.__module__.split(".", 1)[0] != "numpy":
        if hasattr(obj, "__cuda_array_interface__"):
            return _from_cai
        if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
            return _from_dlpack
    return fn


def as_view(obj, what="array", stream=None) -> View:
    """Normalise one GPU array into a :class:`View` (zero-copy).

    Parameters
    ----------
    obj : array-like
        CuPy array, torch tensor, JAX array, Numba device array, CAI or DLPack object.
    what : str
        Name used in error messages (``"vector_add: x"``).
    stream : int, optional
        The stream the consumer will launch on; passed to DLPack producers so they order
        their pending work before it.

    Raises
    ------
    TypeError
        Host data (NumPy, lists, CPU tensors), unsupported dtypes, tensors that require grad,
        conj/neg views, sparse layouts, masked CAI arrays.
    ValueError
        Byte strides that are not a multiple of the item size, misaligned pointers, CAI
        stream 0.
    """
    fn = _ADAPTERS.get(type(obj)) or framework_of(obj)
    if fn is None:
        raise _host_error(what, obj)
    return fn(obj, what, stream)


# --------------------------------------------------------------------------------------------
# producers imported through DLPack: they need the consumer's stream before the import
#: Adapters whose import must wait until the launch stream is known (DLPack asks the consumer
#: for its stream so the producer can order its pending work before it).
DEFERRED = frozenset({_from_jax, _from_dlpack})


def deferred_device(obj, fn, what) -> int:
    """The CUDA device of a producer that :data:`DEFERRED` adapter ``fn`` will import later.

    Called when the arguments are bound, before any device or stream is resolved, so that a
    host DLPack producer (or a JAX CPU array, or a sharded JAX array) raises the documented
    ``TypeError`` instead of failing later in the runtime. Makes no GPU call.
    """
    if fn is _from_jax:
        _check_jax_single(obj, what)
    dev = obj.__dlpack_device__()
    if int(dev[0]) not in (DL_CUDA, DL_CUDA_MANAGED):
        raise _host_error(what, obj)
    return int(dev[1])


def import_deferred(obj, fn, what, stream) -> View:
    """Import a deferred producer now that the launch ``stream`` is known."""
    return fn(obj, what, stream)


def resolve_device(v: View, default: int) -> int:
    """``v``'s device, looked up from its pointer for CAI producers (which do not say), or
    ``default`` for an empty array (null pointer)."""
    if v.device is None:
        from . import _runtime  # noqa: PLC0415 - the runtime is only needed here

        v.device = _runtime.pointer_device(v.ptr) if v.ptr else default
    return v.device
