"""One user kernel instance: argument checks, packing and the launch (for
:mod:`cupylab.kernels`).

:class:`Kernel` checks every argument against the kernel's C signature
(:class:`cupylab._kparams.Param`) before any GPU call, packs the parameter buffer and launches
through :class:`cupylab._launch.Kernel` on the caller's stream. The launch-configuration checks
(grid, block, dynamic shared memory) live here too.
"""
from __future__ import annotations

import numbers

from . import _arrays, _kfast, _launch, _runtime

__all__ = ["Kernel", "BLOCKS_PER_SM_1D"]


_PENDING = object()
_UNSEEN = object()
_MAX_GRID_X = 2**31 - 1
_MAX_GRID_YZ = 65535
_MAX_BLOCK = 1024
_MAX_BLOCK_Z = 64
_SMEM_DEFAULT_MAX = 48 * 1024  # above this, a kernel must opt in (cudaFuncSetAttribute)
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
#: launch_1d's grid cap, in blocks per SM. NVIDIA's grid-stride guidance ("CUDA Pro Tip: Write
#: Flexible Kernels with Grid-Stride Loops") launches 32 x numSMs blocks: with 256-thread blocks
#: that is 4 full waves on an SM holding 2048 threads, enough to hide memory latency, while
#: larger inputs make each thread loop instead of paying for more blocks.
BLOCKS_PER_SM_1D = 32
#: device -> the largest grid of a launch_1d there (BLOCKS_PER_SM_1D blocks per SM)
_GRID_1D: dict = {}


def _dims(v, what, lo):
    if isinstance(v, bool):
        raise TypeError(f"{what} must be an int or a tuple of 1-3 ints (got {v!r})")
    if isinstance(v, numbers.Integral):
        t = (int(v), 1, 1)
    elif isinstance(v, (tuple, list)) and 1 <= len(v) <= 3 and all(
            isinstance(e, numbers.Integral) and not isinstance(e, bool) for e in v):
        t = tuple(int(e) for e in v) + (1,) * (3 - len(v))
    else:
        raise TypeError(f"{what} must be an int or a tuple of 1-3 ints (got {v!r})")
    if any(e < lo for e in t):
        raise ValueError(f"{what} dimensions must be >= {lo} (got {v!r})")
    return t


def _grid(v, what="grid"):
    g = _dims(v, what, 0)
    if g[0] > _MAX_GRID_X or g[1] > _MAX_GRID_YZ or g[2] > _MAX_GRID_YZ:
        raise ValueError(f"{what}={v!r} exceeds CUDA's limits (x <= {_MAX_GRID_X}, y and z <= "
                         f"{_MAX_GRID_YZ})")
    return g


def _block(v):
    b = _dims(v, "block", 1)
    if b[0] * b[1] * b[2] > _MAX_BLOCK or b[2] > _MAX_BLOCK_Z:
        raise ValueError(f"block={v!r} has {b[0] * b[1] * b[2]} threads; CUDA allows at most "
                         f"{_MAX_BLOCK} per block (and z <= {_MAX_BLOCK_Z})")
    return b


def _smem(v):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ValueError(f"shared_mem must be a non-negative number of bytes (got {v!r})")
    return int(v)


class Kernel:
    """One kernel instance of a :class:`KernelModule`, launchable on any framework's arrays.

    Arguments follow the kernel's C signature, one per parameter:

    * pointer parameters take a GPU array — CuPy, torch, JAX (read-only: ``const`` pointers
      only), Numba, or any ``__cuda_array_interface__`` / DLPack object — zero-copy; or an
      ``int`` device address; or ``None`` (``nullptr``). The array's dtype must match the
      pointee (``float*`` takes float32, ``__half*`` float16, ``long long*`` int64 ...;
      ``void*`` and ``char*`` take any). A read-only array given to a non-``const`` pointer is
      refused. The kernel sees the data pointer only: it is the kernel's job to index
      strides/offsets correctly (pass contiguous arrays for linear indexing).
    * scalar parameters take Python or NumPy scalars, converted to the parameter's C type and
      packed at its width (``int`` 4 bytes, ``long long``/``size_t`` 8, ``__half`` and
      ``__nv_bfloat16`` 2, ``bool`` 1 ...). Out-of-range integers raise ``OverflowError``, a
      float given to an integer parameter raises ``TypeError``, values that would round to
      inf in a narrower float type raise ``OverflowError``.
    * CUDA vector types (``float4``, ``int2`` ...) and structs declared with
      ``struct_formats`` take a tuple of members (or a ctypes instance).

    Launches go on ``stream`` if given, else on the caller's current stream: torch's when any
    argument is a torch tensor, CuPy's otherwise. CUDA Array Interface producers that name a
    stream (v3) are waited on with an event (never a host block); DLPack producers are given
    the launch stream. The launch never blocks the host. All arrays must be on one GPU, which
    is made current for the launch. Every argument is referenced until the launch call has
    returned; the memory must then stay valid until the kernel has run, which the
    frameworks' stream-ordered allocators ensure for arrays the caller still holds.

    Kernels are made by :meth:`KernelModule.__getitem__` (``module["name"]``); the
    constructor is internal. The launch parameters are those of :meth:`__call__` and
    :meth:`launch_1d`.

    Attributes
    ----------
    name : str
        The name expression.
    signature : Signature
    module : KernelModule
    """

    # __dict__: the binder's launch_1d is installed there (see _launch)
    __slots__ = ("name", "signature", "module", "_k", "_params", "_n", "_smem_set", "_binders",
                 "_lean", "__dict__")

    def __init__(self, module, name_expression, signature, program):
        self.name = name_expression
        self.signature = signature
        self.module = module
        self._params = signature.params
        self._n = len(self._params)
        self._k = _launch.Kernel(program, name_expression, signature.formats)
        self._smem_set = {}
        self._binders = {}  # tuple of argument types -> binder (cupylab._kfast), or None
        # the launcher of the binder used last (bind.go: checks, packs and launches in one
        # call), tried first, before the argument types are looked up
        self._lean = None

    def __repr__(self):
        return f"<cupylab.Kernel {self.signature}>"

    @property
    def param_offsets(self):
        """Byte offset of each parameter in the buffer :meth:`pack` returns."""
        return self._k._offsets

    # -- argument binding (no GPU call) -------------------------------------------------------
    def _bind(self, args):
        """Check and convert every argument that can be checked without the GPU.

        Returns ``(values, views, pending, torch_seen)``: ``values`` ready to pack except the
        DLPack/JAX pointers (``_PENDING``, listed in ``pending`` as ``(index, adapter)``),
        the views of the other arrays, and whether a torch tensor was among them.
        """
        params = self._params
        if len(args) != self._n:
            raise TypeError(f"{self.signature} takes {self._n} argument"
                            f"{'' if self._n == 1 else 's'} (got {len(args)})")
        values = [None] * self._n
        views = []
        pending = None
        torch_seen = False
        adapters = _arrays._ADAPTERS
        for i, (p, a) in enumerate(zip(params, args)):
            if not p.pointer:
                values[i] = p.convert(a, p.what)
                continue
            fn = adapters.get(type(a)) or _arrays.framework_of(a)
            if fn is None:
                values[i] = _address(p, a)
                continue
            if fn in _arrays.DEFERRED:
                if fn is _arrays._from_jax and not p.const:
                    raise ValueError(_readonly_msg(p, "jax"))
                values[i] = _PENDING
                if pending is None:
                    pending = []
                pending.append((i, fn, _arrays.deferred_device(a, fn, p.what)))
                continue
            v = fn(a, p.what, None)
            _check_view(p, v)
            if v.kind == "torch":
                torch_seen = True
            views.append(v)
            values[i] = v.ptr
        return values, views, pending, torch_seen

    def pack(self, *args):
        """The parameter buffer a launch with ``args`` would pass (a debugging aid).

        Runs every argument check; parameter ``i`` is at ``param_offsets[i]``. DLPack/JAX
        arrays are imported without a stream. Nothing is launched or compiled.

        Parameters
        ----------
        *args
            One per kernel parameter, as for :meth:`__call__`.

        Returns
        -------
        bytes
            The packed arguments, laid out as the kernel's C parameters.

        Raises
        ------
        TypeError, ValueError, OverflowError
            The argument errors of :meth:`__call__`.
        """
        values, views, pending, _ = self._bind(args)
        for i, fn, _ in pending or ():
            p = self._params[i]
            v = _arrays.import_deferred(args[i], fn, p.what, None)
            _check_view(p, v)
            values[i] = v.ptr
        return self._k._struct.pack(*values)

    # -- launching ------------------------------------------------------------------------------
    def __call__(self, *args, grid, block=256, shared_mem=0, stream=None):
        """Launch with an explicit configuration: ``kernel<<<grid, block, shared_mem,
        stream>>>(*args)``.

        Parameters
        ----------
        *args
            One per kernel parameter (see the class docstring).
        grid : int or tuple of 1-3 ints
            Blocks per grid. A zero dimension launches nothing (the arguments are still
            checked).
        block : int or tuple of 1-3 ints
            Threads per block (at most 1024 in all).
        shared_mem : int
            Dynamic shared memory in bytes. Above 48 KiB the kernel's opt-in attribute is
            set for you (up to the device's limit).
        stream : optional
            A CuPy or torch stream, an int ``cudaStream_t``, or an object with
            ``__cuda_stream__``. Default: the caller's current stream.

        Returns
        -------
        None
            The launch is queued on the stream; the host does not wait for it.

        Raises
        ------
        TypeError
            Wrong argument count, host arrays, dtype not matching a pointer's type, an array
            or a float given to an integer parameter, bad grid/block types.
        ValueError
            A read-only array given to a non-const pointer, arrays on different GPUs, grid or
            block beyond CUDA's limits.
        OverflowError
            A scalar that does not fit its parameter's C type.
        cupylab.CompileError
            On the first launch, when NVRTC rejects the source.
        """
        go = self._lean
        if (go is not None and type(grid) is int and 0 < grid <= _MAX_GRID_X
                and type(block) is int and 0 < block <= _MAX_BLOCK and type(shared_mem) is int
                and 0 <= shared_mem <= _SMEM_DEFAULT_MAX
                and go(args, stream, 0, grid, block, shared_mem)):  # the lean path: _kfast
            return
        g = (grid, 1, 1) if type(grid) is int and 0 < grid <= _MAX_GRID_X else _grid(grid)
        b = (block, 1, 1) if type(block) is int and 0 < block <= _MAX_BLOCK else _block(block)
        if type(shared_mem) is not int or shared_mem < 0:
            shared_mem = _smem(shared_mem)
        self._launch(args, g, b, shared_mem, stream, None)

    def launch_1d(self, n, *args, block=256, shared_mem=0, stream=None):
        """Launch a 1-D grid-stride kernel over ``n`` elements.

        The grid is ``min(ceil(n / block), BLOCKS_PER_SM_1D * SM count)`` blocks, so the
        kernel must loop (``for (i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i +=
        gridDim.x * blockDim.x)``). Nothing is launched when ``n == 0``.

        Parameters
        ----------
        n : int
            Number of elements the grid covers (usually also passed as an argument).
        *args
            One per kernel parameter.
        block : int
            Threads per block.
        shared_mem : int
            Dynamic shared memory in bytes.
        stream : optional
            As for :meth:`__call__`.

        Returns
        -------
        None
            The launch is queued on the stream; the host does not wait for it.

        Raises
        ------
        TypeError, ValueError, OverflowError, cupylab.CompileError
            As for :meth:`__call__`; also ``ValueError`` for an ``n`` that is not a
            non-negative integer, or a block that is not 1-D.
        """
        go = self._lean
        if (go is not None and type(n) is int and n > 0 and type(block) is int
                and 0 < block <= _MAX_BLOCK and type(shared_mem) is int
                and 0 <= shared_mem <= _SMEM_DEFAULT_MAX
                and go(args, stream, n, 0, block, shared_mem)):  # the lean path: _kfast
            return
        self._launch_1d_full(n, args, block, shared_mem, stream)

    def _launch_1d_slow(self, n, given, rest, block, shared_mem, stream):
        """``launch_1d`` for a call the installed binder did not take (see :meth:`_launch`):
        ``given`` holds one entry per parameter, :data:`cupylab._kfast.ABSENT` where the call
        gave none, ``rest`` the positional arguments beyond."""
        args = given + rest if given[-1] is not _kfast.ABSENT else tuple(
            a for a in given if a is not _kfast.ABSENT)
        self._launch_1d_full(n, args, block, shared_mem, stream)

    def _launch_1d_full(self, n, args, block, shared_mem, stream):
        if type(n) is not int or n < 0:
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
                raise ValueError(f"{self.name}: n must be a non-negative int (got {n!r})")
            n = int(n)
        if type(block) is int and 0 < block <= _MAX_BLOCK:
            b = (block, 1, 1)
        else:
            b = _block(block)
            if b[1] != 1 or b[2] != 1:
                raise ValueError(f"launch_1d takes a 1-D block (got {block!r})")
        if type(shared_mem) is not int or shared_mem < 0:
            shared_mem = _smem(shared_mem)
        self._launch(args, None, b, shared_mem, stream, n)

    def _launch(self, args, grid, block, smem, stream, n1d):
        key = tuple(map(type, args))
        binder = self._binders.get(key, _UNSEEN)
        if binder is _UNSEEN:
            self._launch_checked(args, grid, block, smem, stream, n1d)
            binder = self._binders[key] = _kfast.make_binder(
                self._params, args, self._k, _GRID_1D, self._launch_1d_slow,
                (_MAX_BLOCK, _SMEM_DEFAULT_MAX))
            if binder is not None:
                fn = binder.launch_1d  # what inspect and help() show of it: the method's
                fn.__doc__ = Kernel.launch_1d.__doc__
                fn.__qualname__ = "Kernel.launch_1d"
                fn.__signature__ = _launch_1d_signature()
                self._use(binder)
        elif binder is None or not self._launch_bound(binder, args, grid, block, smem, stream,
                                                      n1d):
            self._launch_checked(args, grid, block, smem, stream, n1d)
        else:
            self._use(binder)

    def _use(self, binder):
        """Make ``binder``'s pattern the one tried first: its ``go`` for :meth:`__call__`, and
        its ``launch_1d`` (one frame for the whole call) installed in place of the method,
        so that ``kernel.launch_1d(...)`` calls it directly; a call it does not take goes on
        to :meth:`_launch_1d_slow`."""
        self._lean = binder.go
        self.__dict__["launch_1d"] = binder.launch_1d

    def _launch_bound(self, binder, args, grid, block, smem, stream, n1d):
        """The lean path (:mod:`cupylab._kfast`): launch with a binder of this argument
        pattern and return True, or return False, having done nothing, for the full path."""
        if n1d == 0 or (n1d is None and 0 in grid):
            return False  # the full path checks, and launches nothing
        r = binder(args, stream)
        if r is None:
            return False
        values, device, s = r
        self._go(device, grid, block, smem, s, values, n1d)
        return True

    def _launch_checked(self, args, grid, block, smem, stream, n1d):
        """The full path: every check of :meth:`_bind`, devices, streams, DLPack imports."""
        values, views, pending, torch_seen = self._bind(args)
        empty = (n1d == 0) if n1d is not None else (0 in grid)
        if empty and pending is None:
            return
        device = None
        first = None
        for v in views:
            if v.device is None and not v.ptr:
                continue
            d = _arrays.resolve_device(v, None)
            if device is None:
                device, first = d, v
            elif d != device:
                raise ValueError(_device_msg(self, first, device, v, d))
        if device is None:
            if pending is not None:
                device = pending[0][2]
            else:
                device = _runtime.current_device()
        with _launch.ensure_device(device):
            if stream is None:
                s = _launch.current_stream("torch" if torch_seen else "cupy", device)
            else:
                s = _launch.resolve_stream(stream)
            if pending is not None:
                for i, fn, _ in pending:
                    p = self._params[i]
                    v = _arrays.import_deferred(args[i], fn, p.what, s)
                    _check_view(p, v)
                    if v.device is not None and v.device != device and v.ptr:
                        raise ValueError(_device_msg(self, first or v, device, v, v.device))
                    views.append(v)
                    values[i] = v.ptr
                if empty:
                    return
            for v in views:
                if v.stream is not None:
                    _launch.wait_for(s, v.stream, device)
            self._go(device, grid, block, smem, s, values, n1d)

    def _go(self, device, grid, block, smem, s, values, n1d):
        """The launch itself, arguments checked and packed values ready; ``device`` current."""
        if n1d is not None:
            most = _GRID_1D.get(device)
            if most is None:
                most = _GRID_1D.setdefault(device, min(
                    _runtime.device_info(device).sm_count * BLOCKS_PER_SM_1D, _MAX_GRID_X))
            grid = (min(-(-n1d // block[0]), most), 1, 1)
        if smem > _SMEM_DEFAULT_MAX:
            self._opt_in_smem(device, smem)
        self._k.launch(device, grid[0], block[0], s, values, smem, grid[1:], block[1:])

    def _opt_in_smem(self, device, smem):
        if self._smem_set.get(device, 0) >= smem:
            return
        limit = _runtime.device_info(device).max_smem_optin
        if smem > limit:
            raise ValueError(f"{self.name}: shared_mem={smem} bytes exceeds the device's "
                             f"limit of {limit} bytes per block")
        from cupy_backends.cuda.api import driver  # noqa: PLC0415 - CuPy is loaded by now

        driver.funcSetAttribute(self._k.function(device),
                                _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        self._smem_set[device] = smem


_signature = None


def _launch_1d_signature():
    """The signature of the bound method :meth:`Kernel.launch_1d` (``inspect`` is imported
    on the first call, not with the package)."""
    global _signature
    if _signature is None:
        import inspect  # noqa: PLC0415

        sig = inspect.signature(Kernel.launch_1d)
        _signature = sig.replace(parameters=list(sig.parameters.values())[1:])
    return _signature


def _address(p, a):
    if a is None:
        return 0
    if type(a) is int and 0 <= a < 1 << 64:
        return a
    if isinstance(a, numbers.Integral) and not isinstance(a, bool):
        a = int(a)
        if 0 <= a < 1 << 64:
            return a
        raise OverflowError(f"{p.what}: device address {a} is not a 64-bit pointer value")
    raise TypeError(
        f"{p.what} must be a CUDA device array (CuPy, torch, JAX, Numba, or an object with "
        f"__cuda_array_interface__ / __dlpack__), an int device address or None; got host "
        f"data of type {_arrays._what(a)}")


def _readonly_msg(p, kind):
    return (f"{p.what} is a non-const pointer, so the kernel may write through it, but the "
            f"argument is a read-only {kind} array (JAX arrays are immutable). Declare the "
            "parameter const if the kernel only reads it, or pass a writable array")


def _check_view(p, v):
    if p.dtype is not None and v.dtype is not p.dtype:
        raise TypeError(f"{p.what} needs {p.dtype.name} data but got a {v.dtype.name} "
                        f"{v.kind} array")
    if v.readonly and not p.const:
        raise ValueError(_readonly_msg(p, v.kind))


def _device_msg(k, a, da, b, db):
    return (f"{k.name}: arrays are on different GPUs (a {a.kind} array on cuda:{da}, a "
            f"{b.kind} array on cuda:{db}); move them to one device")
