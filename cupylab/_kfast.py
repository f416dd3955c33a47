"""The lean launch path of users' kernels: argument checks paid once per argument pattern.

A :class:`cupylab.kernels.Kernel` launch checks every argument against the C signature: the
adapter of each array, a :class:`cupylab._arrays.View` with shape and strides, dtype against
the pointee, read-only against ``const``, device and stream. Most of that depends only on the
argument *pattern* — the type of each argument, the dtype of each array, the parameter's
constness — not on the values. So after a launch through the full path succeeds, the kernel
keeps a :class:`Binder` for the pattern, keyed on the tuple of argument types. A binder holds,
per parameter, the few reads that cannot be cached:

* torch tensor: dtype identity (the one the full path accepted, or any supported dtype for
  ``void*``/``char*``), ``is_cuda``, ``requires_grad``, ``layout``, ``is_neg()`` (and
  ``is_conj()`` where the dtype may be complex), ``get_device()`` and ``data_ptr()``;
* CuPy array: dtype identity, contiguity (else the byte strides are checked as
  :func:`cupylab._arrays._from_cupy` does), ``data.device_id`` and ``data.ptr``;
* scalar: the parameter's converter (range checks included); ``None`` and ``int`` addresses
  for pointers.

The kernel then checks that every array is on one device, that it is the current one, and
looks the caller's stream up (torch's when a tensor is among the arguments, else CuPy's),
exactly as the full path does. Other producers (JAX, Numba, CAI, DLPack) are never bound this
way: their import needs the launch stream or a pointer lookup per call. Any surprise — a
different dtype, a CPU tensor, a tensor that requires grad, arrays on two devices, another
current device, an empty launch — makes :func:`bind` return ``None`` and the caller takes the
full path, which raises the documented errors. Nothing here raises.

:class:`EwPattern` does the same for :class:`cupylab.kernels.ElementwiseKernel` calls whose
array operands (and ``out``) are all torch tensors or all CuPy arrays: per pattern and dtype it
keeps the kernel instance and the scalar converters, and per call reads what
:mod:`cupylab.ops._fast` reads for the operators (dtype, shape, contiguity, device, grad/neg
flags, pointers), allocates the output like the full path and launches.
"""
from __future__ import annotations

import sys

from . import _arrays, _launch, _runtime

__all__ = ["Binder", "make_binder", "bind", "EwPattern", "MISS"]

MISS = object()
_ADDR_END = 1 << 64


def _addr(a, what):
    """An ``int`` device address for a pointer parameter (the full path explains errors)."""
    if 0 <= a < _ADDR_END:
        return a
    raise OverflowError(what)


class Binder:
    """The per-parameter readers of one argument pattern of one kernel.

    Attributes
    ----------
    n : int
        Number of parameters.
    torch : tuple of (index, dtype or None, accepted dtypes, may be complex)
        Pointer parameters given a torch tensor. ``dtype`` is the framework dtype the full
        path accepted (``None``: any dtype in ``accepted``, for untyped pointers).
    cupy : tuple of (index, dtype or None, accepted dtypes)
        The same for CuPy arrays.
    scalars : tuple of (index, converter, what)
        Scalar parameters (and ``int`` addresses for pointers): ``converter(value, what)``.
    """

    __slots__ = ("n", "torch", "cupy", "scalars")


def make_binder(params, args):
    """The :class:`Binder` for ``args``, which a full-path launch has just accepted, or
    ``None`` when the pattern is not one this path binds (JAX, Numba, CAI, DLPack arrays,
    host values that are no ``int`` address)."""
    torch, cupy, scalars = [], [], []
    for p, a in zip(params, args):
        if not p.pointer:
            scalars.append((p.index, p.convert, p.what))
            continue
        if a is None:
            continue  # values start as 0: nullptr
        if type(a) is int:
            scalars.append((p.index, _addr, p.what))
            continue
        fn = _arrays.framework_of(a)
        if fn is _arrays._from_torch:
            torch.append((p.index, a.dtype if p.dtype is not None else None,
                          _arrays._torch_dtypes, p.dtype is None or p.dtype.kind == "c"))
        elif fn is _arrays._from_cupy:
            cupy.append((p.index, a.dtype if p.dtype is not None else None, _arrays._np_dtypes))
        else:
            return None
    if not torch and not cupy:
        return None  # no array: the full path picks the current device
    b = Binder()
    b.n = len(params)
    b.torch, b.cupy, b.scalars = tuple(torch), tuple(cupy), tuple(scalars)
    return b


def bind(b, args, stream):
    """``(values, device, stream handle)`` for a launch of ``args`` with binder ``b``, or
    ``None`` to take the full path: ``values`` are ready for
    :meth:`cupylab._launch.Kernel.launch`, every array is on ``device``, which is current,
    and the stream is ``stream`` resolved or the caller's current one."""
    values = [0] * b.n
    dev = -1
    try:
        if b.torch:
            strided = _arrays._torch_strided
            for i, want, ok, cplx in b.torch:
                t = args[i]
                d = t.dtype
                if ((d is not want and (want is not None or d not in ok)) or not t.is_cuda
                        or t.requires_grad or t.layout is not strided or t.is_neg()
                        or (cplx and t.is_conj())):
                    return None
                g = t.get_device()
                if g != dev:
                    if dev >= 0:
                        return None
                    dev = g
                values[i] = t.data_ptr()
        for i, want, ok in b.cupy:
            a = args[i]
            d = a.dtype  # NumPy dtypes: equal ones need not be the same object
            if d is not want and (d not in ok if want is None else d != want):
                return None
            if not a._c_contiguous:
                isz = d.itemsize
                if any(s % isz for s in a.strides):
                    return None
            m = a.data
            g = m.device_id
            if g != dev:
                if dev >= 0:
                    return None
                dev = g
            values[i] = m.ptr
        for i, conv, what in b.scalars:
            values[i] = conv(args[i], what)
        if (_get_device or _init_device())() != dev:
            return None
        if stream is not None:
            s = _launch.resolve_stream(stream)
        elif b.torch:
            s = (_torch_raw or _init_torch())(dev)
        else:
            s = (_cupy_current or _init_cupy())().ptr
    except Exception:  # noqa: BLE001 - anything odd: the full path checks and explains
        return None
    return values, dev, s


# --------------------------------------------------------------------------------------------
# the runtime, looked up once (as cupylab.ops._fast does; tests with a simulated runtime set
# these to its functions)
_get_device = None        # () -> the current device (cupy.cuda.runtime.getDevice)
_torch_raw = None         # (device) -> torch's current stream handle on it
_torch_empty_like = None  # torch.empty_like
_cupy_current = None      # () -> CuPy's current stream object (.ptr is the handle)
_cupy_ndarray = None      # cupy.ndarray: what cupy.empty(shape, dtype) calls


def _init_device():
    global _get_device
    _get_device = _runtime.cupy().cuda.runtime.getDevice
    return _get_device


def _init_torch():
    global _torch_raw, _torch_empty_like
    torch = sys.modules["torch"]
    _torch_empty_like = torch.empty_like
    _torch_raw = torch._C._cuda_getCurrentRawStream
    return _torch_raw


def _init_cupy():
    global _cupy_current, _cupy_ndarray
    cp = _runtime.cupy()
    _cupy_ndarray = cp.ndarray
    _cupy_current = cp.cuda.get_current_stream
    return _cupy_current


# --------------------------------------------------------------------------------------------
# ElementwiseKernel
class EwPattern:
    """One argument pattern of an :class:`~cupylab.kernels.ElementwiseKernel`: which operands
    are arrays (all torch tensors or all CuPy arrays, ``out`` too when given) and, per
    framework dtype seen, the kernel instance and scalar converters.

    ``pattern.call(args, out, stream)`` returns the result, or :data:`MISS` to take the full
    path.
    """

    __slots__ = ("_ek", "_arrays", "_scalars", "_dtypes", "call")

    def __init__(self, ek, arrays, scalars, fw):
        self._ek = ek
        self._arrays = arrays    # ((operand position, parameter index), ...)
        self._scalars = scalars  # ((operand position, parameter index), ...)
        self._dtypes = {}        # framework dtype -> (launch kernel, parameter count,
        #                          scalar converters, most elements)
        self.call = self._torch if fw is _arrays._from_torch else self._cupy

    @classmethod
    def make(cls, ek, args, out):
        """The pattern of ``args``/``out`` (which the full path has just accepted) or ``None``
        when it is not one this path handles."""
        arrays, scalars, fw = [], [], None
        for j, a in enumerate(args):
            i = ek._operands[j]
            if not ek._ptr[j]:
                scalars.append((j, i))
                continue
            f = _arrays.framework_of(a)
            if f is not _arrays._from_torch and f is not _arrays._from_cupy or (
                    fw is not None and f is not fw):
                return None
            fw = f
            arrays.append((j, i))
        if fw is None or (out is not None and _arrays.framework_of(out) is not fw):
            return None
        return cls(ek, tuple(arrays), tuple(scalars), fw)

    def learn(self, kernel, args):
        """Remember ``kernel`` (the instance the full path chose) for the first array's
        dtype."""
        ek = self._ek
        ps = kernel.signature.params
        convs = tuple((j, i, ps[i].convert, ps[i].what) for j, i in self._scalars)
        # the element count must fit the size parameter's C type, and the grid CUDA's limit
        most = min(ps[ek._size].convert.range[1], ek._max_n)
        self._dtypes[args[self._arrays[0][0]].dtype] = (kernel._k, ek._nparams, convs, most)

    # _torch and _cupy have the same shape; each reads its framework's attributes inline (a
    # shared per-operand helper would cost a call per operand, as in cupylab.ops._fast).
    # ``out`` comes first so that the operand loop can refuse partial overlap with it.
    def _torch(self, args, out, stream):
        ek = self._ek
        try:
            x = args[self._arrays[0][0]]
            fdt = x.dtype
            info = self._dtypes.get(fdt)
            if info is None or not x.is_cuda:
                return MISS
            n = x.numel()
            if not 0 < n <= info[3]:
                return MISS
            shape = x.shape
            dev = x.get_device()
            if (_get_device or _init_device())() != dev:
                return MISS
            raw = _torch_raw or _init_torch()
            if out is None:
                s = raw(dev)
                if stream is not None and _launch.resolve_stream(stream) != s:
                    return MISS  # the full path records the allocation on that stream
                o = _torch_empty_like(x)
                nb = 0  # a new tensor overlaps nothing
            else:
                s = raw(dev) if stream is None else _launch.resolve_stream(stream)
                if (out.dtype is not fdt or out.requires_grad or not out.is_contiguous()
                        or out.is_neg() or not out.is_cuda or out.get_device() != dev
                        or out.shape != shape):
                    return MISS
                o = out
                nb = n * x.element_size()
            optr = o.data_ptr()
            values = _values(info, args, n, ek, optr)
            for j, i in self._arrays:
                a = args[j]
                if (a.requires_grad or not a.is_contiguous() or a.is_neg() or (a is not x and (
                        a.dtype is not fdt or not a.is_cuda or a.get_device() != dev
                        or a.shape != shape))):
                    return MISS
                p = a.data_ptr()
                if p != optr and -nb < p - optr < nb:
                    return MISS  # partial overlap with out: the full path refuses it
                values[i] = p
        except Exception:  # noqa: BLE001 - the full path checks and explains
            return MISS
        info[0].launch(dev, -(-n // ek.block), ek.block, s, values)
        return o

    def _cupy(self, args, out, stream):
        ek = self._ek
        try:
            x = args[self._arrays[0][0]]
            fdt = x.dtype
            info = self._dtypes.get(fdt)
            if info is None:
                return MISS
            n = x.size
            if not 0 < n <= info[3]:
                return MISS
            shape = x.shape
            dev = x.data.device_id
            if (_get_device or _init_device())() != dev:
                return MISS
            cur = _cupy_current or _init_cupy()
            s = cur().ptr if stream is None else _launch.resolve_stream(stream)
            if out is None:
                o = _cupy_ndarray(shape, fdt)
                nb = 0  # a new array overlaps nothing
            else:
                d = out.dtype
                if ((d is not fdt and d != fdt) or out.shape != shape or not out._c_contiguous
                        or out.data.device_id != dev):
                    return MISS
                o = out
                nb = n * fdt.itemsize
            optr = o.data.ptr
            values = _values(info, args, n, ek, optr)
            for j, i in self._arrays:
                a = args[j]
                d = a.dtype
                if (d is not fdt and d != fdt) or a.shape != shape or not a._c_contiguous:
                    return MISS
                m = a.data
                p = m.ptr
                if m.device_id != dev or (p != optr and -nb < p - optr < nb):
                    return MISS
                values[i] = p
        except Exception:  # noqa: BLE001 - the full path checks and explains
            return MISS
        info[0].launch(dev, -(-n // ek.block), ek.block, s, values)
        return o


def _values(info, args, n, ek, optr):
    """The launch values of an elementwise call with the output pointer, the scalars and the
    size filled in (the array operands' pointers follow)."""
    values = [0] * info[1]
    values[ek._out] = optr
    for j, i, conv, what in info[2]:
        values[i] = conv(args[j], what)
    values[ek._size] = n
    return values
