"""The lean launch path of users' kernels: argument checks paid once per argument pattern.

A :class:`cupylab.kernels.Kernel` launch checks every argument against the C signature: the
adapter of each array, a :class:`cupylab._arrays.View` with shape and strides, dtype against
the pointee, read-only against ``const``, device and stream. Most of that depends only on the
argument *pattern* — the type of each argument, the dtype of each array, the parameter's
constness — not on the values. So after a launch through the full path succeeds, the kernel
keeps a *binder* for the pattern (:func:`make_binder`), keyed on the tuple of argument types
and tried first while the pattern repeats. A binder is a function compiled for the pattern;
per parameter it does only the reads that cannot be cached:

* torch tensor: type and dtype identity (the dtype the full path accepted, or any supported
  one for ``void*``/``char*``), ``requires_grad``, ``is_neg()`` (and ``is_conj()`` where the
  dtype may be complex), ``get_device()`` and ``data_ptr()`` (a CPU tensor's device, -1, is
  never the current one, and ``data_ptr()`` raises for sparse layouts);
* CuPy array: type, dtype, contiguity (else the byte strides are checked as
  :func:`cupylab._arrays._from_cupy` does), ``data.device_id`` and ``data.ptr``;
* scalar: the parameter's converter (range checks included; an ``int`` for an integer
  parameter is range-checked inline); ``None`` and ``int`` addresses for pointers.

It then checks that every array is on one device, that it is the current one, and looks the
caller's stream up (torch's when a tensor is among the arguments, else CuPy's), as the full
path does. Other producers (JAX, Numba, CAI, DLPack) are never bound this way: their import
needs the launch stream or a pointer lookup per call. Any surprise — a different type or
dtype, a CPU tensor, a tensor that requires grad, arrays on two devices, another current
device, an out-of-range scalar — makes the binder return ``None`` and the caller takes the full
path, which raises the documented errors. Nothing here raises.

:class:`EwPattern` does the same for :class:`cupylab.kernels.ElementwiseKernel` calls whose
array operands (and ``out``) are all torch tensors or all CuPy arrays: per dtype it keeps the
kernel instance and the scalar converters, and per call reads what :mod:`cupylab.ops._fast`
reads for the operators (dtype, shape, contiguity, device, grad/neg flags, pointers),
allocates the output like the full path and launches.
"""
from __future__ import annotations

import sys

from . import _arrays, _launch, _runtime

__all__ = ["make_binder", "EwPattern", "MISS", "ABSENT"]

MISS = object()
#: a binder's ``launch_1d``: no argument given for this parameter
ABSENT = object()
_ADDR_END = 1 << 64


def make_binder(params, args, kernel, grid_1d, slow, limits):
    """The binder of the pattern of ``args``, which a full-path launch has just accepted: a
    function ``bind(args, stream)`` that returns ``(values, device, stream handle)`` for a
    launch of ``args``, or ``None`` to take the full path. ``None`` instead of a binder when
    the pattern is not one this path binds (JAX, Numba, CAI, DLPack arrays; no array at all).

    ``kernel`` is the :class:`cupylab._launch.Kernel` to launch and ``grid_1d`` maps a device
    to the largest grid of :meth:`~cupylab.kernels.Kernel.launch_1d` there. The binder also has
    ``bind.go(args, stream, n, grid, block, smem)``: the same checks, then the launch itself
    (``n > 0``: the grid of ``launch_1d`` for ``n`` elements; else ``grid``), packed into the
    kernel's parameter buffer and handed to the driver in the same function; it returns
    ``True``, or ``None``, having launched nothing, where ``bind`` would, or where the kernel
    has no function or parameter buffer yet on this device and thread (the full path makes
    them). One Python call per launch instead of three.

    The binder also has ``bind.launch_1d``, a function with
    :meth:`~cupylab.kernels.Kernel.launch_1d`'s signature that does the call's whole work in
    one frame: the launch configuration's checks (``n > 0``, ``block`` up to ``limits[0]``
    threads, ``shared_mem`` up to ``limits[1]`` bytes, one argument per parameter), the
    pattern's checks and the launch. Anything else goes to ``slow`` (the kernel's own
    ``launch_1d`` without the lean attempt), called as ``slow(n, given, rest, block,
    shared_mem, stream)`` with the positional arguments as given (``given``: one per
    parameter, :data:`ABSENT` where none was; ``rest``: those beyond). The kernel installs it
    as its ``launch_1d`` while the pattern repeats, saving the method's frame and the call of
    ``go``.

    The binder is compiled for the pattern: straight-line code with one block per parameter
    (no loop, no call per array), the pattern's types, dtypes and converters bound as
    constants. Its source is made of identifiers and numbers only; every value (types,
    dtypes, converters, message prefixes) is passed in its namespace.
    """
    env = {"_launch": _launch}
    body, values, devices, torch_seen = [], [], [], False
    for p, a in zip(params, args):
        i, v = p.index, f"a{p.index}"
        if not p.pointer:
            env[f"C{i}"], env[f"H{i}"] = p.convert, p.what
            rng = getattr(p.convert, "range", None)
            if rng is not None and type(a) is int:  # the usual int for an int: inline
                body.append(f"v{i} = {v} if type({v}) is int and {rng[0]} <= {v} <= {rng[1]} "
                            f"else C{i}({v}, H{i})")
            else:
                body.append(f"v{i} = C{i}({v}, H{i})")
            values.append(f"v{i}")
            continue
        if a is None:
            body.append(f"if {v} is not None: return None")
            values.append("0")
            continue
        if type(a) is int:
            body.append(f"if type({v}) is not int or not 0 <= {v} < {_ADDR_END}: return None")
            values.append(v)
            continue
        fn = _arrays.framework_of(a)
        if fn is not _arrays._from_torch and fn is not _arrays._from_cupy:
            return None
        env[f"T{i}"] = type(a)
        if p.dtype is not None:
            env[f"W{i}"] = a.dtype
        if fn is _arrays._from_torch:
            torch_seen = True
            env[f"A{i}"] = _arrays._torch_dtypes
            dt = f"{v}.dtype is not W{i}" if p.dtype is not None else f"{v}.dtype not in A{i}"
            conj = f" or {v}.is_conj()" if p.dtype is None or p.dtype.kind == "c" else ""
            # no is_cuda or layout reads: a CPU tensor's device is -1, never the current
            # one, and data_ptr() raises for the sparse layouts (the only others on a GPU)
            body += [f"if (type({v}) is not T{i} or {dt} or {v}.requires_grad",
                     f"        or {v}.is_neg(){conj}):",
                     "    return None",
                     f"d{i} = {v}.get_device()",
                     f"v{i} = {v}.data_ptr()"]
        else:
            env[f"A{i}"] = _arrays._np_dtypes  # NumPy dtypes: equal ones need not be identical
            dt = f"t is not W{i} and t != W{i}" if p.dtype is not None else f"t not in A{i}"
            # a fixed dtype's itemsize is a constant (W's: equal dtypes have equal itemsizes)
            isz = str(a.dtype.itemsize) if p.dtype is not None else "t.itemsize"
            body += [f"if type({v}) is not T{i}:",
                     "    return None",
                     f"t = {v}.dtype",
                     f"if {dt}:",
                     "    return None",
                     f"if not {v}._c_contiguous and any(b % {isz} for b in {v}.strides):",
                     "    return None",
                     f"m = {v}.data",
                     f"d{i} = m.device_id",
                     f"v{i} = m.ptr"]
            if isz != "1":
                body += [f"if v{i} % {isz}:",  # a byte-offset .view(): the full path refuses
                         "    return None"]
        values.append(f"v{i}")
        devices.append(f"d{i}")
    if not devices:
        return None  # no array: the full path picks the current device
    d0 = devices[0]
    if len(devices) > 1:
        body += [f"if {' or '.join(f'{d} != {d0}' for d in devices[1:])}:", "    return None"]
    _bind_runtime(env, torch_seen)
    body += [f"if GD() != {d0}:",
             "    return None",
             "if stream is not None:",
             "    s = _launch.resolve_stream(stream)",
             "else:",  # torch's current stream when a tensor is among the arguments
             f"    s = TS({d0})" if torch_seen else f"    s = CS({d0}).ptr"]
    head = f"        {''.join(f'a{p.index}, ' for p in params)}= args\n"
    checks = "".join(f"        {line}\n" for line in body)
    miss = ("    except Exception:  # anything odd: the full path checks and explains\n"
            "        return None\n")
    src = ("def bind(args, stream):\n    try:\n" + head + checks
           + f"        return ({', '.join(values)},), {d0}, s\n" + miss)
    # the launch outside the try: a driver error is the caller's, not a miss
    env.update(FN=kernel._fns, TLS=kernel._tls, PACK=kernel._struct.pack_into, G=grid_1d)
    src += ("def go(args, stream, n, grid, block, smem):\n    try:\n" + head + checks
            + f"        f = FN.get({d0})\n"
            + "        bp = TLS.bp\n"
            + f"        g = G.get({d0}) if n else grid\n"
            + miss
            + "    L = _launch._driver_launch\n"
            + "    if f is None or g is None or L is None:\n"
            + "        return None\n"
            + "    if n:\n"
            + "        q = -(-n // block)\n"
            + "        if q < g:\n"
            + "            g = q\n"
            + _launch_source("PACK", values, "g", "block", "smem")
            + "    return True\n")
    src += _launch_1d_source(params, body, values, d0, limits)
    env.update(SLOW=slow, ABSENT=ABSENT)
    exec(compile(src, "<cupylab._kfast binder>", "exec"), env)  # noqa: S102 - see docstring
    bind = env["bind"]
    bind.go = env["go"]
    bind.launch_1d = env["launch_1d"]
    return bind


def _launch_1d_source(params, body, values, d0, limits):
    """The source of a binder's ``launch_1d`` (see :func:`make_binder`): the pattern's checks
    (``body``, whose misses ``return None``) in a loop left by ``break`` on a miss, so that
    the full path is called outside the ``try`` (its errors, and a driver error, are the
    caller's)."""
    given = "".join(f"a{p.index}, " for p in params)
    last = f"a{params[-1].index}"
    cfg = (f"rest or {last} is ABSENT or type(n) is not int or n <= 0 or type(block) is not int "
           f"or not 0 < block <= {limits[0]} or type(shared_mem) is not int "
           f"or not 0 <= shared_mem <= {limits[1]}")
    checks = [f"if {cfg}:", "    break"]
    checks += [line.replace("return None", "break") for line in body]
    checks += [f"f = FN.get({d0})", "bp = TLS.bp", f"g = G.get({d0})",
               "ok = f is not None and g is not None", "break"]
    return (f"def launch_1d(n, {''.join(f'a{p.index}=ABSENT, ' for p in params)}/, *rest, "
            "block=256, shared_mem=0, stream=None):\n"
            "    ok = False\n"
            "    try:\n"
            "        while True:\n"
            + "".join(f"            {line}\n" for line in checks)
            + "    except Exception:  # anything odd: the full path checks and explains\n"
            "        ok = False\n"
            "    L = _launch._driver_launch\n"
            "    if not ok or L is None:\n"
            f"        return SLOW(n, ({given}), rest, block, shared_mem, stream)\n"
            "    q = -(-n // block)\n"
            + _launch_source("PACK", values, "q if q < g else g", "block", "shared_mem"))


def _launch_source(pack, values, grid, block, smem):
    """The inline launch every lean path ends with (:meth:`cupylab._launch.Kernel.launch`
    without its call): ``values`` packed by ``pack`` into this thread's parameter buffer
    ``bp``, then the driver call ``L`` of function ``f`` on stream ``s`` (names the generated
    code has bound); ``grid``, ``block`` and ``smem`` are source expressions."""
    return (f"    {pack}(bp[0], 0, {', '.join(values)})\n"
            f"    L(f, {grid}, 1, 1, {block}, 1, 1, {smem}, s, bp[2], 0)\n")


def _bind_runtime(env, torch):
    """Put the runtime functions a lean path calls into its namespace, looked up now (a
    full-path call has just run): ``GD()`` the current device, and ``TS(device)`` torch's
    current stream handle or ``CS(device)`` CuPy's current stream object (asked for the
    device already found, which ``get_current_stream()`` would look up again)."""
    env["GD"] = _get_device or _init_device()
    if torch:
        env["TS"] = _torch_raw or _init_torch()
    else:
        env["CS"] = _cupy_current or _init_cupy()


# --------------------------------------------------------------------------------------------
# the runtime, looked up once (as cupylab.ops._fast does; tests with a simulated runtime set
# these to its functions)
_get_device = None        # () -> the current device (cupy.cuda.runtime.getDevice)
_torch_raw = None         # (device) -> torch's current stream handle on it
_torch_empty_like = None  # torch.empty_like
_cupy_current = None      # (device_id=-1) -> CuPy's current stream object (.ptr is the handle)
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
    """The lean calls of an :class:`~cupylab.kernels.ElementwiseKernel` whose array operands
    (and ``out``, when given) are all of one type, torch ``Tensor`` or CuPy ``ndarray``:
    which operands are arrays is fixed by the kernel's signature, so one pattern per type.

    ``pattern.call(args, out, stream)`` returns the result, or :data:`MISS` to take the full
    path. It is compiled like :func:`make_binder`'s binders; per framework dtype the full path
    has accepted, :meth:`learn` keeps what the launch needs of the kernel instance (its
    packer, functions and parameter buffers), the scalar converters and the largest element
    count.
    """

    __slots__ = ("_ek", "_torch", "_dtypes", "call")

    def __init__(self, ek, tp, torch):
        self._ek, self._torch = ek, torch
        # framework dtype -> (the kernel's packer, converters, whats, most, itemsize,
        # complex, the kernel's functions by device, its thread-local buffers)
        self._dtypes = {}
        env = {"TT": tp, "D": self._dtypes, "MISS": MISS, "_k": sys.modules[__name__],
               "_launch": _launch, "B": ek.block}
        _bind_runtime(env, torch)
        exec(compile(_ew_source(ek, torch), "<cupylab._kfast elementwise>", "exec"), env)  # noqa: S102
        self.call = env["call"]

    @classmethod
    def make(cls, ek, args, out):
        """The pattern of ``args``/``out`` (which the full path has just accepted) or ``None``
        when it is not one this path handles."""
        tps = {type(a) for j, a in enumerate(args) if ek._ptr[j]}
        if out is not None:
            tps.add(type(out))
        if len(tps) != 1:
            return None
        tp = tps.pop()
        fw = _arrays.framework_of(args[ek._ptr.index(True)])
        if fw is not _arrays._from_torch and fw is not _arrays._from_cupy:
            return None
        return cls(ek, tp, fw is _arrays._from_torch)

    def learn(self, kernel, args):
        """Remember ``kernel`` (the instance the full path chose) for the arrays' dtype."""
        ek = self._ek
        ps = kernel.signature.params
        scal = [ek._operands[j] for j in range(len(args)) if not ek._ptr[j]]
        # the element count must fit the size parameter's C type, and the grid CUDA's limit
        most = min(ps[ek._size].convert.range[1], ek._max_n)
        x = args[ek._ptr.index(True)]
        k = kernel._k
        self._dtypes[x.dtype] = (k._struct.pack_into, tuple(ps[i].convert for i in scal),
                                 tuple(ps[i].what for i in scal), most,
                                 x.element_size() if self._torch else x.dtype.itemsize,
                                 self._torch and "complex" in str(x.dtype),  # conj bits to read
                                 k._fns, k._tls)  # the launch, inlined


def _ew_source(ek, torch):
    """The source of an :class:`EwPattern`'s ``call`` for ``ek``'s signature: the checks of
    :mod:`cupylab.ops._fast` (dtype, shape, C-contiguity, device, grad/neg flags), ``out``
    first so that every operand can refuse partial overlap with it, allocation like the full
    path, then the launch."""
    arrays = [j for j, p in enumerate(ek._ptr) if p]
    scalars = [j for j, p in enumerate(ek._ptr) if not p]
    x = f"a{arrays[0]}"
    if torch:
        # no is_cuda reads: a CPU tensor's device is -1, never the current one
        same = ("(type({a}) is not TT or {a}.dtype is not fdt or {a}.requires_grad "
                "or not {a}.is_contiguous() or {a}.is_neg() or (info[5] and {a}.is_conj()) "
                "or {a}.get_device() != dev or {a}.shape != shape)")
        head = [f"if type({x}) is not TT:", "    return MISS",
                f"fdt = {x}.dtype",
                "info = D.get(fdt)",
                "if info is None:", "    return MISS",
                f"n = {x}.numel()",
                f"shape = {x}.shape",
                f"dev = {x}.get_device()",
                f"if ({x}.requires_grad or not {x}.is_contiguous() or {x}.is_neg() "
                f"or (info[5] and {x}.is_conj())):",
                "    return MISS"]
        alloc = ["s = TS(dev)",
                 "if stream is not None and _launch.resolve_stream(stream) != s:",
                 "    return MISS",  # the full path records the allocation on that stream
                 f"o = _k._torch_empty_like({x})"]
        given = ["s = TS(dev) if stream is None else _launch.resolve_stream(stream)",
                 f"if {same.format(a='out')}:", "    return MISS",
                 "nb = n * info[4]"]
        ptr = "p{j} = {a}.data_ptr()"
        operand = [f"if {same}:", "    return MISS", ptr]
        first = [ptr]
    else:
        same = ("(type({a}) is not TT or ((t := {a}.dtype) is not fdt and t != fdt) "
                "or {a}.shape != shape or not {a}._c_contiguous)")
        head = [f"if type({x}) is not TT or not {x}._c_contiguous:", "    return MISS",
                f"fdt = {x}.dtype",
                "info = D.get(fdt)",
                "if info is None:", "    return MISS",
                f"n = {x}.size",
                f"shape = {x}.shape",
                f"m = {x}.data",
                "dev = m.device_id"]
        alloc = ["s = CS(dev).ptr",
                 "if stream is not None and _launch.resolve_stream(stream) != s:",
                 "    return MISS",  # the full path allocates from that stream's pool
                 "o = _k._cupy_ndarray(shape, fdt)"]
        given = ["s = CS(dev).ptr if stream is None else _launch.resolve_stream(stream)",
                 f"if {same.format(a='out')} or out.data.device_id != dev:", "    return MISS",
                 "nb = n * info[4]"]
        operand = [f"if {same}:", "    return MISS", "m = {a}.data",
                   "if m.device_id != dev:", "    return MISS", "p{j} = m.ptr",
                   "if p{j} % info[4]:", "    return MISS"]  # a byte-offset .view()
        first = ["p{j} = m.ptr", "if p{j} % info[4]:", "    return MISS"]
    body = head + ["if not 0 < n <= info[3]:", "    return MISS",
                   "if GD() != dev:", "    return MISS",
                   # the kernel's function here and this thread's parameter buffer (the full
                   # path makes them), read before anything is allocated
                   "f = info[6].get(dev)",
                   "bp = info[7].bp",
                   "L = _launch._driver_launch",
                   "if f is None or L is None:", "    return MISS",
                   "if out is None:"] + [f"    {line}" for line in alloc + ["nb = 0"]]
    body += ["else:"] + [f"    {line}" for line in given + ["o = out"]]
    body += ["optr = o.data_ptr()"] if torch else ["optr = o.data.ptr",
                                                   "if optr % info[4]:", "    return MISS"]
    for j in arrays:
        for line in first if j == arrays[0] else operand:
            body.append(line.format(a=f"a{j}", j=j))
        body += [f"if p{j} != optr and -nb < p{j} - optr < nb:", "    return MISS"]
    for k, j in enumerate(scalars):
        body.append(f"c{j} = info[1][{k}](a{j}, info[2][{k}])")
    values = []
    for i in range(ek._nparams):
        if i == ek._out:
            values.append("optr")
        elif i == ek._size:
            values.append("n")
        else:
            j = ek._operands.index(i)
            values.append(f"p{j}" if ek._ptr[j] else f"c{j}")
    return ("def call(args, out, stream):\n    try:\n"
            f"        {''.join(f'a{j}, ' for j in range(len(ek._ptr)))}= args\n"
            + "".join(f"        {line}\n" for line in body)
            + "    except Exception:  # anything odd: the full path checks and explains\n"
            + "        return MISS\n"
            + _launch_source("info[0]", values, "-(-n // B)", "B", "0")
            + "    return o\n")
