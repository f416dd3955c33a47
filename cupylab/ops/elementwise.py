"""Elementwise arithmetic: ``add``, ``sub``, ``mul``, ``div``, ``vector_add`` and the fused
``fused_add_mul`` — wrappers, dispatch and launch over ``cuda_src/elementwise.cu``.

Dispatch (the seed's "kernel choice by shape"):

* every operand (and ``out``) C-contiguous over the broadcast shape → ``ew_contig``:
  16-byte vectors when all pointers share their offset modulo 16 (the head before the first
  16-byte boundary and the tail are peeled), else one element per access;
* anything else (non-contiguous, negative or zero strides, broadcasting) → ``ew_strided``, with
  32-bit index arithmetic while every offset fits, 64-bit otherwise (2^31 elements and up);
* nothing is launched for empty outputs.
"""
from __future__ import annotations

from .. import _compile, _dtypes, _launch, _runtime
from . import _fast
from .._elementwise_core import broadcast_strides, c_strides, coalesce, finish_output, prepare_call

__all__ = ["add", "sub", "mul", "div", "vector_add", "fused_add_mul", "prepare"]

OPS = {"add": 0, "sub": 1, "mul": 2, "div": 3, "fused_add_mul": 4}
MAXD = 8  # CL_MAXD in elementwise.cu
BLOCK = 256  # threads per block (__launch_bounds__ in the kernels)
STRIDED_WAVES = 16  # strided grid: blocks per SM before threads loop (grid-stride)
_INT32_MAX = 2**31 - 1

_programs: dict = {}
_kernels: dict = {}
_streaming: set = set()  # the ew_contig kernels that take the residency cap (streaming_smem_for)


def vector_width(dt) -> int:
    return 16 // dt.itemsize


def name_expressions(dt):
    """Every kernel instance for one dtype (one NVRTC program per dtype keeps a cold compile
    around a second)."""
    names = []
    for op in OPS.values():
        names += [f"cl::ew_contig<{dt.ctype}, {op}, {vector_width(dt)}, true>",
                  f"cl::ew_contig<{dt.ctype}, {op}, {vector_width(dt)}, false>",
                  f"cl::ew_contig<{dt.ctype}, {op}, 1, false>",
                  f"cl::ew_rows<{dt.ctype}, {op}>",
                  f"cl::ew_strided<{dt.ctype}, {op}, int>",
                  f"cl::ew_strided<{dt.ctype}, {op}, long long>"]
    return names


def program(dt) -> _compile.Program:
    p = _programs.get(dt.name)
    if p is None:
        p = _programs.setdefault(dt.name, _compile.Program.from_file(
            _compile.cuda_src_dir() / "elementwise.cu", name_expressions(dt)))
    return p


def all_programs():
    """Every program this module can launch (CI compiles them all for sm_80 and sm_90)."""
    return [program(dt) for dt in _dtypes.ARITHMETIC]


def _kernel(op, dt, variant):
    key = (op, dt.name, variant)
    k = _kernels.get(key)
    if k is None:
        t = dt.fmt
        if variant == "vec_arrays":  # every operand an array
            name, fmts = f"cl::ew_contig<{dt.ctype}, {op}, {vector_width(dt)}, true>", None
        elif variant == "vec":
            name, fmts = f"cl::ew_contig<{dt.ctype}, {op}, {vector_width(dt)}, false>", None
        elif variant == "scalar":
            name, fmts = f"cl::ew_contig<{dt.ctype}, {op}, 1, false>", None
        elif variant == "rows":
            name = f"cl::ew_rows<{dt.ctype}, {op}>"
            fmts = ["Q", "Q", "Q", "Q", t, t, t, "q", "q", "q", "q", "q", "q", "i"]
        else:
            it = "int" if variant == "strided32" else "long long"
            name = f"cl::ew_strided<{dt.ctype}, {op}, {it}>"
            i = "i" if variant == "strided32" else "q"
            fmts = ["Q", "Q", "Q", "Q", t, t, t, i, "i"] + [f"{MAXD}{i}"] * 5
        if fmts is None:
            fmts = ["Q", "Q", "Q", "Q", t, t, t, "q", "q", "q"]
        k = _kernels.setdefault(key, _launch.Kernel(program(dt), name, fmts))
        if variant in ("vec_arrays", "vec") and not (op == OPS["div"] and dt.kind == "i"):
            # integer floor division is compute-bound: with fewer resident warps it hides
            # less latency and lost 2-5 % (docs/perf.md, "Resident blocks"), so it keeps 8
            _streaming.add(k)
    return k


def streaming_smem_for(k, grid, device):
    """Dynamic shared memory for launching ``k`` over ``grid`` blocks: the residency cap of
    :func:`cupylab._launch.streaming_smem` for a large launch of a 16-byte-vector ``ew_contig``
    kernel (except integer ``div``), else 0. Every launch path calls this: the general path,
    :func:`prepare`, and the lean path (``_fast._launch``, for grids of at least
    ``STREAM_MIN_GRID`` blocks)."""
    if type(grid) is int and grid >= _launch.STREAM_MIN_GRID and k in _streaming:
        return _launch.streaming_smem(k, device)
    return 0


def _check_arith(opname):
    def check(dt):
        if not dt.arithmetic:
            raise TypeError(
                f"{opname}: unsupported dtype {dt.name}; supported: "
                f"{', '.join(d.name for d in _dtypes.ARITHMETIC)}")
    return check


def _run(opname, operands, names, out, stream, allow_scalars, kernel_op=None):
    """The general path: full validation, every layout, the documented errors. The public
    operators try :func:`cupylab.ops._fast.run` first."""
    op = OPS[kernel_op or opname]
    c = prepare_call(opname, operands, out=out, stream=stream, names=names,
                     allow_scalars=allow_scalars, dtype_check=_check_arith(opname))
    if c.size:
        with _launch.ensure_device(c.device):
            _wait_producers(c)
            k, grid, args = plan(op, c)
            if type(grid) is tuple:
                k.launch(c.device, grid[0], BLOCK, c.stream, args, grid_yz=grid[1:])
            else:
                k.launch(c.device, grid, BLOCK, c.stream, args,
                         shared_mem=streaming_smem_for(k, grid, c.device))
    return finish_output(c.kind, c.out_obj, c.stream, c.device) if c.allocated else c.out_obj


def _wait_producers(c):
    """Order the launch after producers that told us their stream (CAI v3)."""
    for v in c.views:
        if v is not None and v.stream is not None:
            _launch.wait_for(c.stream, v.stream, c.device)


def contiguous_plan(op, dt, n, ptrs):
    """Kernel, grid and pointer/size arguments for C-contiguous operands (``ptrs``: output,
    then three inputs, 0 for a scalar or a missing operand). The 16-byte vector path when every
    pointer has the same offset modulo 16: ``head`` elements before the first 16-byte boundary
    and ``tail`` after the last whole vector are peeled, and the pointers passed are those of
    the aligned body. Otherwise one element per access. Returns ``(kernel, grid, (out, a, b,
    c), (nvec, head, tail))``."""
    isz = dt.itemsize
    mod = ptrs[0] % 16
    if mod % isz == 0 and all(p % 16 == mod for p in ptrs if p):
        vw = 16 // isz
        head = min(n, ((16 - mod) % 16) // isz)
        nvec = (n - head) // vw
        used = ptrs[1:4] if op == OPS["fused_add_mul"] else ptrs[1:3]
        k = _kernel(op, dt, "vec_arrays" if all(used) else "vec")
    else:
        vw, head, nvec = 1, 0, n
        k = _kernel(op, dt, "scalar")
    tail = n - head - nvec * vw
    grid = max(1, -(-(nvec + head + tail) // BLOCK))
    if grid > _INT32_MAX:
        raise ValueError(f"{list(OPS)[op]}: {n} elements is more than one launch can cover")
    off = head * isz
    return k, grid, tuple(p + off if p else 0 for p in ptrs), (nvec, head, tail)


def plan(op, c):
    """Choose the kernel variant for a validated :class:`Call` and build its arguments.
    Returns ``(kernel, grid, args)``."""
    dt, shape, n = c.dtype, c.shape, c.size
    views = list(c.views) + [None] * (3 - len(c.views))
    scal = list(c.scalars) + [0] * (3 - len(c.scalars))
    ptrs = [v.ptr if v is not None else 0 for v in views]
    o = c.out
    cs = c_strides(shape)
    contiguous = o.strides == cs and all(
        v is None or (v.shape == shape and v.strides == cs) for v in views)
    sh = sts = None
    if not contiguous:
        all_strides = [o.strides] + [broadcast_strides(v, shape) if v is not None
                                     else (0,) * len(shape) for v in views]
        sh, sts = coalesce(shape, all_strides)
        # contiguous after merging dims (size-1 dims with odd strides, C-order views)
        contiguous = len(sh) <= 1 and all(
            st == (1,) or not st for st, v in zip(sts, [o] + views) if v is not None)
    if contiguous:
        k, grid, bp, sizes = contiguous_plan(op, dt, n, [o.ptr] + ptrs)
        return k, grid, bp + (scal[0], scal[1], scal[2]) + sizes
    head_args = (o.ptr, ptrs[0], ptrs[1], ptrs[2], scal[0], scal[1], scal[2])
    r = _rows_plan(op, dt, sh, sts, [o] + views)
    if r is not None:
        k, grid, tail_args = r
        return k, grid, head_args + tail_args
    if len(sh) > MAXD:
        raise ValueError(f"{list(OPS)[op]}: more than {MAXD} dimensions that cannot be merged "
                         f"(shape {shape}); make the arrays contiguous first")
    big = n > _INT32_MAX or any(
        sum(abs(s) * (e - 1) for s, e in zip(st, sh)) > _INT32_MAX for st in sts)
    k = _kernel(op, dt, "strided64" if big else "strided32")
    pad = (0,) * (MAXD - len(sh))
    sm = _runtime.device_info(c.device).sm_count
    grid = max(1, min(-(-n // BLOCK), sm * STRIDED_WAVES))
    args = [o.ptr, ptrs[0], ptrs[1], ptrs[2], scal[0], scal[1], scal[2], n, len(sh)]
    args += sh + pad
    for st in sts:
        args += st + pad
    return k, grid, tuple(args)


ROWS_MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (and z): rows = grid y x grid z


def _rows_plan(op, dt, sh, sts, views):
    """The 16-byte row kernel when the merged view is 1-D or 2-D, every array operand's inner
    stride is 1 or 0 (the output's 1), the row length is a multiple of the vector width, every
    row start is 16-byte aligned and rows are long enough to fill a warp with vectors.
    Returns ``(kernel, (grid_x, grid_y), tail args)`` or None."""
    if len(sh) == 1:
        sh, sts = (1,) + sh, [(0,) + st for st in sts]
    if len(sh) != 2:
        return None
    rows, cols = sh
    V = 16 // dt.itemsize
    if cols % V or cols // V < 32 or sts[0][1] != 1:
        return None
    isz = dt.itemsize
    inner = 0
    for i, (st, v) in enumerate(zip(sts, views)):
        if v is None:
            continue
        if st[1] not in (0, 1):
            return None
        if st[1] == 1:
            if v.ptr % 16 or (st[0] * isz) % 16:
                return None
            if i:
                inner |= 1 << (i - 1)
    cvec = cols // V
    gx, gy = -(-cvec // BLOCK), min(rows, ROWS_MAX_GRID_Y)
    gz = -(-rows // gy)
    if gx > _INT32_MAX or gz > ROWS_MAX_GRID_Y:
        return None
    grid = (gx, gy, gz)
    return (_kernel(op, dt, "rows"), grid,
            (rows, cols, sts[0][0], sts[1][0], sts[2][0], sts[3][0], inner))


def prepare(fn, *args, out=None, stream=None):
    """Validate a call once and return a :class:`PreparedCall` that replays the launch.

    For hot loops over the same arrays: ``call = cupylab.prepare(cupylab.fused_add_mul, a,
    b, s, out=d)`` then ``call()``. Everything is checked here; ``call()`` only packs nothing
    and launches (the arguments are frozen into the call's own parameter buffer), on the
    caller's current stream at call time (torch's for torch arrays, CuPy's otherwise) or on
    ``stream`` if given here. The arrays must stay alive and keep their storage while the
    prepared call is used; new values written into them are of course seen.

    Parameters
    ----------
    fn : cupylab elementwise operator (``cupylab.add`` ...)
    *args : its operands
    out : GPU array, optional
        Without it, an output is allocated once here and every ``call()`` writes it.
    stream : optional
        Fix the stream instead of following the current one.

    Returns
    -------
    PreparedCall
        ``call()`` launches and returns the output; ``call.out`` is the output.
    """
    spec = _PREPARABLE.get(fn)
    if spec is None:
        raise TypeError(f"prepare: {getattr(fn, '__name__', fn)!r} is not a cupylab operator "
                        f"that can be prepared (these can: {', '.join(f.__name__ for f in _PREPARABLE)})")
    opname, names, allow, kop = spec
    if len(args) != len(names):
        raise TypeError(f"prepare: {opname} takes {len(names)} operands ({', '.join(names)}), "
                        f"got {len(args)}")
    c = prepare_call(opname, args, out=out, stream=stream, names=names, allow_scalars=allow,
                     dtype_check=_check_arith(opname))
    result = finish_output(c.kind, c.out_obj, c.stream, c.device) if c.allocated else c.out_obj
    if not c.size:
        return _launch.PreparedLaunch(None, c.device, 0, BLOCK, None, None, result, args)
    with _launch.ensure_device(c.device):
        k, grid, kargs = plan(OPS[kop], c)
        smem = streaming_smem_for(k, grid, c.device)
    fixed = None if stream is None else c.stream
    getter = (lambda d=c.device, kind=c.kind: _launch.current_stream(kind, d))
    return _launch.PreparedLaunch(k, c.device, grid, BLOCK, kargs, fixed if fixed is not None
                                  else getter, result, (args, c), shared_mem=smem)


_COMMON_DOC = """
    Accepts CuPy arrays, torch tensors, JAX arrays, Numba device arrays and any object with
    ``__cuda_array_interface__`` (v2/v3) or ``__dlpack__``, without copying. Operands broadcast
    like NumPy. dtypes: float16, bfloat16, float32, float64, int32, int64; array operands must
    share one dtype (no promotion between arrays); a Python scalar takes the arrays' dtype
    (NumPy's rule for Python scalars), a float scalar with integer arrays is refused.

    Runs on the caller's current stream (torch's for torch inputs, CuPy's otherwise) or on
    ``stream``; never blocks the host; works under CUDA graph capture.

    Returns
    -------
    array
        ``out`` when given; else a new array in the framework of the first array argument
        (torch → torch tensor, CuPy → CuPy array, JAX → JAX array, Numba → Numba device
        array, other CAI/DLPack objects → CuPy array).

    Raises
    ------
    TypeError
        Host arrays, unsupported or mismatched dtypes, tensors requiring grad, conj/neg views.
    ValueError
        Shapes that do not broadcast, a bad ``out`` (shape, read-only, broadcast, partial
        overlap with an input), arrays on different GPUs.
    cupylab.NoGPUError
        No usable CUDA GPU.
"""


def _doc(f, text):
    f.__doc__ = text + _COMMON_DOC
    return f


# Each operator tries the lean path first (plain contiguous torch or CuPy arrays, no
# stream=): the handler for the first operand's type, called with the operator's index, so a
# hit costs one Python frame beyond this one.
_lean_get, _lean_new, _ABSENT, _MISS = _fast._handlers.get, _fast.handler, _fast.ABSENT, _fast.MISS
_ADD, _SUB, _MUL, _DIV, _ADD_MUL = (OPS[k] for k in ("add", "sub", "mul", "div", "fused_add_mul"))
_NO_SCALARS2, _S_SCALAR3 = (False, False), (False, False, True)


def add(x, y, out=None, *, stream=None):
    if stream is None:
        r = (_lean_get(type(x)) or _lean_new(type(x)))(_ADD, x, y, _ABSENT, out, None)
        if r is not _MISS:
            return r
    return _run("add", (x, y), ("x", "y"), out, stream, None)


def sub(x, y, out=None, *, stream=None):
    if stream is None:
        r = (_lean_get(type(x)) or _lean_new(type(x)))(_SUB, x, y, _ABSENT, out, None)
        if r is not _MISS:
            return r
    return _run("sub", (x, y), ("x", "y"), out, stream, None)


def mul(x, y, out=None, *, stream=None):
    if stream is None:
        r = (_lean_get(type(x)) or _lean_new(type(x)))(_MUL, x, y, _ABSENT, out, None)
        if r is not _MISS:
            return r
    return _run("mul", (x, y), ("x", "y"), out, stream, None)


def div(x, y, out=None, *, stream=None):
    if stream is None:
        r = (_lean_get(type(x)) or _lean_new(type(x)))(_DIV, x, y, _ABSENT, out, None)
        if r is not _MISS:
            return r
    return _run("div", (x, y), ("x", "y"), out, stream, None)


def vector_add(x, y, out=None, *, stream=None):
    if stream is None:
        r = (_lean_get(type(x)) or _lean_new(type(x)))(_ADD, x, y, _ABSENT, out, _NO_SCALARS2)
        if r is not _MISS:
            return r
    return _run("vector_add", (x, y), ("x", "y"), out, stream, _NO_SCALARS2, "add")


def fused_add_mul(a, b, s, out=None, *, stream=None):
    if stream is None:
        r = (_lean_get(type(a)) or _lean_new(type(a)))(_ADD_MUL, a, b, s, out, _S_SCALAR3)
        if r is not _MISS:
            return r
    return _run("fused_add_mul", (a, b, s), ("a", "b", "s"), out, stream, _S_SCALAR3)


_doc(add, """Elementwise ``x + y``.

    Parameters
    ----------
    x, y : GPU array or scalar
    out : GPU array, optional
    stream : stream, optional
""")
_doc(sub, """Elementwise ``x - y``.

    Parameters
    ----------
    x, y : GPU array or scalar
    out : GPU array, optional
    stream : stream, optional
""")
_doc(mul, """Elementwise ``x * y``.

    Parameters
    ----------
    x, y : GPU array or scalar
    out : GPU array, optional
    stream : stream, optional
""")
_doc(div, """Elementwise division.

    Floating point: true division ``x / y`` (IEEE: x/0 is ±inf or nan). Integers: floor
    division like Python's ``//`` and ``numpy.floor_divide`` (rounds toward -inf); ``x // 0`` is
    0 (NumPy's result, without its warning) and ``MIN // -1`` wraps to ``MIN``.

    Parameters
    ----------
    x, y : GPU array or scalar
    out : GPU array, optional
    stream : stream, optional
""")
_doc(vector_add, """The seed's example: ``x + y`` for two GPU arrays (no scalars).

    Parameters
    ----------
    x, y : GPU array
    out : GPU array, optional
    stream : stream, optional
""")
_doc(fused_add_mul, """``(a + b) * s`` in one pass: reads a, b (and s) once, writes once.

    16-bit floats are computed in float32 and rounded once (torch's two-kernel version rounds
    ``a + b`` too). Integers wrap.

    Parameters
    ----------
    a, b : GPU array
    s : GPU array or scalar
    out : GPU array, optional
    stream : stream, optional
""")


# -- registry entries (tests and cupylab-bench) -----------------------------------------------
def _register():
    from .._registry import OpSpec, register  # noqa: PLC0415

    dtypes = tuple(d.name for d in _dtypes.ARITHMETIC)

    def _is_int(x):
        return str(getattr(x, "dtype", "")).split(".")[-1].startswith("int")

    # Peers write into ``out`` when the bench gives one (the same rotating buffers cupylab
    # writes), so both sides stream the same bytes; JAX and torch.compile allocate.
    def binary_peers(torch_name, cupy_name, jax_name):
        if torch_name == "div":  # cupylab's integer div is floor division: compare like with like
            return {
                "torch": lambda torch, x, y, out=None: (
                    (lambda: torch.div(x, y, rounding_mode="floor", out=out)) if _is_int(x)
                    else (lambda: torch.div(x, y, out=out))),
                "torch.compile": None,
                "cupy": lambda cp, x, y, out=None: (
                    lambda f=cp.floor_divide if _is_int(x) else cp.divide: f(x, y, out=out)),
                "jax": lambda jax, x, y, out=None: (
                    lambda f=jax.jit(jax.numpy.floor_divide if _is_int(x)
                                     else jax.numpy.divide): f(x, y)),
            }
        return {
            "torch": lambda torch, x, y, out=None: (
                lambda f=getattr(torch, torch_name): f(x, y, out=out)),
            "torch.compile": None,  # one kernel already: nothing for Inductor to fuse
            "cupy": lambda cp, x, y, out=None: (
                lambda f=getattr(cp, cupy_name): f(x, y, out=out)),
            "jax": lambda jax, x, y, out=None: (
                lambda f=jax.jit(getattr(jax.numpy, jax_name)): f(x, y)),
        }

    for name, (tn, cn, jn) in {"vector_add": ("add", "add", "add"), "add": ("add", "add", "add"),
                               "sub": ("sub", "subtract", "subtract"),
                               "mul": ("mul", "multiply", "multiply"),
                               "div": ("div", "divide", "divide")}.items():
        register(OpSpec(
            name, globals()[name], 2, name, dtypes,
            bytes_per_element=lambda isz: 3 * isz, flops_per_element=1,
            peers=binary_peers(tn, cn, jn),
            description=f"out = x {'+' if 'add' in name else {'sub': '-', 'mul': '*', 'div': '/'}[name]} y"))

    def _torch_fam(torch, a, b, s, out=None):
        if out is None:
            return lambda: (a + b) * s
        return lambda: torch.mul(torch.add(a, b), s, out=out)

    def _torch_compile_fam(torch, a, b, s, out=None):
        f = torch.compile(lambda a, b, s: (a + b) * s)
        return lambda: f(a, b, s)

    def _cupy_fam(cp, a, b, s, out=None):
        k = cp.ElementwiseKernel("T a, T b, T s", "T o", "o = (a + b) * s", "cupylab_peer_fam")
        return (lambda: k(a, b, s)) if out is None else (lambda: k(a, b, s, out))

    def _jax_fam(jax, a, b, s, out=None):
        f = jax.jit(lambda a, b, s: (a + b) * s)
        return lambda: f(a, b, s)

    register(OpSpec(
        "fused_add_mul", fused_add_mul, 3, "fused_add_mul", dtypes,
        bytes_per_element=lambda isz: 4 * isz, flops_per_element=2,
        peers={"torch": _torch_fam, "torch.compile": _torch_compile_fam, "cupy": _cupy_fam,
               "jax": _jax_fam},
        description="out = (a + b) * s in one pass"))


_register()

# operator -> (name, operand names, scalars allowed, kernel op): for prepare() and the fast path
_PREPARABLE = {
    add: ("add", ("x", "y"), None, "add"),
    sub: ("sub", ("x", "y"), None, "sub"),
    mul: ("mul", ("x", "y"), None, "mul"),
    div: ("div", ("x", "y"), None, "div"),
    vector_add: ("vector_add", ("x", "y"), (False, False), "add"),
    fused_add_mul: ("fused_add_mul", ("a", "b", "s"), (False, False, True), "fused_add_mul"),
}
_fast.bind(_kernel, BLOCK, streaming_smem_for)
