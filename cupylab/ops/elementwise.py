"""Elementwise arithmetic as a NumPy drop-in: ``add``, ``subtract``, ``multiply``, ``divide``
(= ``true_divide``), ``floor_divide`` (aliases ``sub``, ``mul``, ``div``), ``vector_add`` and the
fused ``fused_add_mul`` — the public wrappers (built from one table), type resolution, dispatch
and launch over ``cuda_src/elementwise.cu``.

Types: the caller's framework decides (:mod:`cupylab._promotion`); operands are read in their
own dtypes and converted in registers, the result is computed in the resolved dtype and cast
into ``out`` under ``casting``.

Dispatch (the seed's "kernel choice by shape"):

* every operand (and ``out``) C-contiguous over the broadcast shape → ``ew_contig``, with V
  elements per thread (V x the widest item size = 16 bytes) when every pointer sits at the
  same element offset modulo V (the head before the first aligned vector and the tail are
  peeled), else one element per access;
* a 2-D view whose rows are slices or broadcasts of vector-aligned rows → ``ew_rows``;
* anything else (non-contiguous, negative or zero strides, broadcasting) → ``ew_strided``, with
  32-bit index arithmetic while every offset fits, 64-bit otherwise (2^31 elements and up);
* nothing is launched for empty outputs.

Every kernel instance (operator x dtypes x variant) is a program of its own, compiled on first
use and cached on disk (:func:`kernel`); ``python -m cupylab precompile`` fills the cache ahead
of time. The instances' parameter formats come from the C signatures in the source, read by
:class:`cupylab.kernels.KernelModule`.
"""
from __future__ import annotations

import struct

from .. import _compile, _dask, _dtypes, _launch, _promotion, _runtime
from .._arrays import as_view
from .._elementwise_core import (Call, allocate, broadcast_strides, c_strides, coalesce,
                                 finish_output, prepare_call, wait_producers)
from . import _fast

__all__ = ["add", "subtract", "multiply", "divide", "true_divide", "floor_divide", "sub", "mul",
           "div", "vector_add", "fused_add_mul", "prepare"]

#: Operator codes: the one definition (passed to the kernels as -DCL_OP_<NAME>=<code>).
OPS = {"add": 0, "subtract": 1, "multiply": 2, "true_divide": 3, "floor_divide": 4,
       "fused_add_mul": 5, "copy": 6}
MAXD = 8  # dimensions of the strided kernel after merging (passed as -DCL_MAXD)
DEFINES = tuple(f"-DCL_OP_{k.upper()}={v}" for k, v in OPS.items()) + (f"-DCL_MAXD={MAXD}",)
#: By-value structs in the kernels' signatures, for reading their parameter formats.
STRUCTS = {"cl::complex64_t": "ff", "cl::complex128_t": "dd", "Dims<int>": f"{MAXD}i",
           "Dims<long long>": f"{MAXD}q"}
BLOCK = 256  # threads per block (__launch_bounds__ in the kernels)
STRIDED_WAVES = 16  # strided grid: blocks per SM before threads loop (grid-stride)
_INT32_MAX = 2**31 - 1
_ADD_MUL, _COPY, _FLOORDIV = OPS["fused_add_mul"], OPS["copy"], OPS["floor_divide"]
_NAMES = {v: k for k, v in OPS.items()}

_kmod = None
_kernels: dict = {}
_streaming: set = set()  # the ew_contig kernels that take the residency cap (streaming_smem_for)


def reads(op):
    """How many operands ``op`` reads."""
    return 1 if op == _COPY else (3 if op == _ADD_MUL else 2)


def source_module():
    """The :class:`cupylab.kernels.KernelModule` of ``elementwise.cu`` (one per process): it
    reads each instance's parameter formats from the C signature and gives each instance a
    program of its own."""
    global _kmod
    if _kmod is None:
        from ..kernels import KernelModule  # noqa: PLC0415

        src = _compile.cuda_src_dir() / "elementwise.cu"
        _kmod = KernelModule(src.read_text(), "elementwise.cu", options=DEFINES,
                             here=str(src.parent), struct_formats=STRUCTS)
    return _kmod


def name_expression(variant, op, types, extra=()):
    """``cl::ew_<variant><TO, TA, TB, TC, CT, OP, ...>`` for ``types`` = (out, a, b, c,
    computation) :class:`~cupylab._dtypes.DType` and the variant's own parameters
    (``contig``: V, ARR; ``rows``: V; ``strided``: the index type)."""
    targs = [t.ctype for t in types] + [str(op)] + [
        ("true" if e else "false") if isinstance(e, bool) else str(e) for e in extra]
    return f"cl::ew_{variant}<{', '.join(targs)}>"


def _caps_residency(op, types):
    """Whether a vectorised ``ew_contig`` instance takes the residency cap (6 blocks per SM
    instead of 8 for large launches; :func:`streaming_smem_for`): when the output and every
    operand it reads have one item size, so that every access is a whole 16-byte vector.
    Left out, keeping 8 blocks (docs/perf.md, "Resident blocks"):

    * mixed item sizes (``int32 + float32`` into float64, ``uint8 + float32``): the narrower
      operands' loads are 4 or 8 bytes, and with fewer warps in flight they hide less of the
      memory latency (``int32 + float32`` at 2^26: 90.9 % of the ceiling capped, 97.7 % not);
    * integer floor division, which is compute-bound: under the cap it lost 2-5 %."""
    if op == _FLOORDIV and types[4].kind in "iu":
        return False
    return len({t.itemsize for t in types[:1 + reads(op)]}) == 1


def kernel(variant, op, types, extra=()):
    """The :class:`cupylab._launch.Kernel` of one instance (compiled on its first launch)."""
    key = (variant, op, types, extra)
    k = _kernels.get(key)
    if k is None:
        bk = source_module()[name_expression(variant, op, types, extra)]
        k = _kernels.setdefault(key, bk._k)
        if variant == "contig" and extra[0] > 1 and _caps_residency(op, types):
            _streaming.add(k)
    return k


def _kernel(op, dt, variant):
    """The same-dtype contiguous instances the lean path uses: ``vec_arrays``, ``vec``,
    ``scalar``."""
    t = (dt,) * 5
    if variant == "scalar":
        return kernel("contig", op, t, (1, False))
    return kernel("contig", op, t, (16 // dt.itemsize, variant == "vec_arrays"))


def representative_names():
    """Name expressions covering every template, operator and dtype (as the computation
    dtype, as an input and as the output) and the mixed-dtype vector shapes, compiled by CI
    as one program (the full cross product would be tens of thousands of instances)."""
    D = _dtypes.DTYPES
    names = []
    for op in OPS.values():
        for ct in _dtypes.ARITHMETIC:
            t = (ct,) * 5
            names.append(name_expression("contig", op, t, (16 // ct.itemsize, True)))
        for ct in (D["float16"], D["int64"], D["complex64"], D["bool"]):
            t = (ct,) * 5
            names.append(name_expression("rows", op, t, (16 // ct.itemsize,)))
            names.append(name_expression("strided", op, t, ("int",)))
            names.append(name_expression("strided", op, t, ("long long",)))
            names.append(name_expression("contig", op, t, (1, False)))
    f16, bf, f32, f64 = D["float16"], D["bfloat16"], D["float32"], D["float64"]
    i8, u8, i32, i64, u64 = D["int8"], D["uint8"], D["int32"], D["int64"], D["uint64"]
    c64, c128, b = D["complex64"], D["complex128"], D["bool"]
    for types in ((f32, f32, f16, f32, f32), (f32, bf, f32, f32, f32), (i64, i64, i32, i64, i64),
                  (f64, i32, f32, f64, f64), (c128, c64, f64, c128, c128),
                  (f16, f32, f32, f32, f32), (i8, b, u8, i8, i8), (f64, u64, i64, f64, f64),
                  (u8, f64, f64, f64, f64), (b, c128, c128, c128, c128)):
        v = 16 // max(t.itemsize for t in types)
        names.append(name_expression("contig", OPS["add"], types, (v, False)))
        names.append(name_expression("contig", OPS["true_divide"], types, (v, True)))
        names.append(name_expression("rows", OPS["fused_add_mul"], types, (v,)))
        names.append(name_expression("strided", OPS["multiply"], types, ("int",)))
    return list(dict.fromkeys(names))


#: public operator name -> kernel operator (for precompile and messages)
PUBLIC_OPS = {"add": "add", "subtract": "subtract", "multiply": "multiply",
              "divide": "true_divide", "true_divide": "true_divide",
              "floor_divide": "floor_divide", "fused_add_mul": "fused_add_mul"}


def instances(ops, dtypes, rules=("numpy",), scalars=True):
    """The kernel instances calls on contiguous (and, for one dtype, row-broadcast and
    strided) operands of ``dtypes`` need: every pair of array dtypes for each operator in
    ``ops`` (public names), and with ``scalars`` a Python int or float on either side, under
    each framework rule in ``rules``. Yields ``(variant, op, types, extra)`` for
    :func:`kernel` (what ``python -m cupylab precompile`` compiles)."""
    seen = set()
    D = [_dtypes.resolve(d) for d in dtypes]

    def vw(types):
        return 16 // max(t.itemsize for t in types)

    def emit(*inst):
        if inst not in seen:
            seen.add(inst)
            return [inst]
        return []

    out = []
    for name in ops:
        kop = PUBLIC_OPS[name]
        code = OPS[kop]
        for rule in rules:
            for a in D:
                pairs = [a] if kop == "fused_add_mul" else D
                for b in pairs:
                    keys = (("a", a.name, False), ("a", b.name, False))
                    if kop == "fused_add_mul":
                        keys += (("a", a.name, False),)
                    try:
                        ct = _promotion.resolve(rule, kop, keys)[0]
                    except TypeError:
                        continue
                    t = (ct, a, b, a if kop == "fused_add_mul" else ct, ct)
                    out += emit("contig", code, t, (vw(t), True))
                    out += emit("contig", code, t, (1, False))
                    out += emit("strided", code, t, ("int",))
                    if a is b:
                        out += emit("contig", code, t, (vw(t), False))
                        out += emit("rows", code, t, (vw(t),))
                if not scalars or kop == "fused_add_mul":
                    continue
                for kind in ("int", "float"):
                    for keys in ((("a", a.name, False), ("w", kind)),
                                 (("w", kind), ("a", a.name, False))):
                        try:
                            ct = _promotion.resolve(rule, kop, keys)[0]
                        except TypeError:
                            continue
                        t = (ct, a if keys[0][0] == "a" else ct, a if keys[1][0] == "a" else ct,
                             ct, ct)
                        out += emit("contig", code, t, (vw(t), False))
    return out


def representative_program() -> _compile.Program:
    """One program holding :func:`representative_names` (for CI's compile test)."""
    mod = source_module()
    for n in representative_names():
        mod[n]  # noqa: B018 - checks that every parameter format can be read
    return _compile.Program.from_file(_compile.cuda_src_dir() / "elementwise.cu",
                                      representative_names(), DEFINES)


def all_programs():
    """The programs CI compiles for sm_75, sm_80 and sm_90 (a representative set of instances)."""
    return [representative_program()]


def streaming_smem_for(k, grid, device):
    """Dynamic shared memory for launching ``k`` over ``grid`` blocks: the residency cap of
    :func:`cupylab._launch.streaming_smem` for a large launch of a vectorised ``ew_contig``
    kernel that takes it (one item size throughout, not integer floor division:
    :func:`_caps_residency`), else 0. Every launch path calls this: the general
    path, :func:`prepare`, and the lean path (``_fast._launch``, for grids of at least
    ``STREAM_MIN_GRID`` blocks)."""
    if type(grid) is int and grid >= _launch.STREAM_MIN_GRID and k in _streaming:
        return _launch.streaming_smem(k, device)
    return 0


def same_dtype_result(op, dt):
    """Whether ``op`` on arrays of one dtype ``dt`` (and Python scalars that keep it) computes
    in and returns ``dt`` under NumPy's and torch's rules alike — the lean path's condition.
    Not for bool subtract / floor_divide / true_divide, integer true division, complex floor
    division."""
    if dt.kind == "b":
        return op in (OPS["add"], OPS["multiply"], _ADD_MUL)
    if dt.kind in "iu":
        return op != OPS["true_divide"]
    if dt.kind == "c":
        return op != _FLOORDIV
    return True


# -- the general path ------------------------------------------------------------------------
def _resolve_dtype(name, dtype):
    try:
        return _dtypes.resolve(dtype)
    except TypeError:
        raise TypeError(f"{name}: dtype must be one of {', '.join(_dtypes.DTYPES)} (got "
                        f"{dtype!r})") from None


def check_casting_dtype(name, casting, dtype):
    """``casting`` one of NumPy's names, and ``dtype`` (None or a dtype) resolved: the checks
    of the elementwise operators' keywords (the Dask form makes them too)."""
    if casting not in _dtypes.CASTING:
        raise ValueError(f"{name}: casting must be one of {', '.join(map(repr, _dtypes.CASTING))}"
                         f" (got {casting!r})")
    return None if dtype is None else _resolve_dtype(name, dtype)


def _promoter(name, kop, dtype, casting):
    def promote(rule, keys, out_dt):
        try:
            return _promotion.resolve(rule, kop, keys, dtype, out_dt, casting)
        except TypeError as e:
            raise TypeError(f"{name}: {e}") from None
    return promote


def _call(name, kop, operands, names, out, dtype, casting, stream, allow):
    """Validate a call (everything but the launch): ``(Call or None, dtype)``."""
    if type(out) is tuple:
        if len(out) != 1:
            raise ValueError(f"{name}: out must be an array or a tuple of one array (got a "
                             f"tuple of {len(out)})")
        out = out[0]
    dt = check_casting_dtype(name, casting, dtype)
    c = prepare_call(name, operands, out=out, stream=stream, names=names, allow_scalars=allow,
                     promote=_promoter(name, _NAMES[kop], dt, casting))
    return c, dt


def _run(name, kop, operands, names, out, dtype, casting, stream, allow):
    """The general path: full validation, every layout and dtype combination, the documented
    errors. The public operators try the lean path (:mod:`cupylab.ops._fast`) first. Dask
    arrays among the operands make a lazy Dask array instead (:mod:`cupylab._dask`)."""
    if _dask.any_dask(operands):
        return _dask.elementwise(name, _NAMES[kop], globals()[name], operands, names, out,
                                 dtype, casting, stream, allow)
    c, dt = _call(name, kop, operands, names, out, dtype, casting, stream, allow)
    if c is None:
        return _host_scalars(name, kop, operands, dt, casting)
    if c.size:
        with _launch.ensure_device(c.device):
            wait_producers(c)
            if c.overlap:
                _through_temporary(kop, c)
            else:
                _launch_plan(plan(kop, c), c)
    return finish_output(c.kind, c.out_obj, c.stream, c.device) if c.allocated else c.out_obj


def _launch_plan(kga, c):
    k, grid, args = kga
    if type(grid) is tuple:
        k.launch(c.device, grid[0], BLOCK, c.stream, args, grid_yz=grid[1:])
    else:
        k.launch(c.device, grid, BLOCK, c.stream, args,
                 shared_mem=streaming_smem_for(k, grid, c.device))


def _through_temporary(kop, c):
    """``out`` partially overlaps an input: compute into a temporary of ``out``'s dtype, then
    copy it into ``out`` (NumPy's answer), both on the call's stream."""
    final = c.out
    tmp = allocate("torch" if c.kind == "torch" else "cupy", c.shape, final.dtype, c.device,
                   c.stream)
    tv = as_view(tmp, "temporary")
    c.out = tv
    _launch_plan(plan(kop, c), c)
    cp = Call()
    cp.views, cp.scalars, cp.dtype, cp.shape, cp.out = [tv], [0], final.dtype, c.shape, final
    cp.device, cp.stream, cp.size = c.device, c.stream, c.size
    _launch_plan(plan(_COPY, cp), cp)
    c.out = final
    del tmp  # the stream-ordered pools reuse it only after the copy


def _host_scalars(name, kop, operands, dt, casting):
    """Every operand a scalar and no ``out``: NumPy computes it, the result is a 0-d CuPy
    array (as ``cupy.add(2, 2.0)`` gives)."""
    import numpy as np  # noqa: PLC0415

    uf = getattr(np, _promotion.UFUNCS[_NAMES[kop]])
    kw = {"casting": casting}
    if dt is not None:
        kw["dtype"] = _promotion._np_dtype(np, dt.name)
    try:
        with np.errstate(all="ignore"):
            r = uf(*operands, **kw)
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None
    return _runtime.cupy().asarray(r)


def _types(op, c, views):
    """(out, a, b, c, computation) dtypes of a call; scalar and unused operands take the
    computation dtype."""
    ct = c.dtype
    return (c.out.dtype,) + tuple(v.dtype if v is not None else ct for v in views) + (ct,)


def contiguous_plan(op, types, n, ptrs):
    """Kernel, grid and pointer/size arguments for C-contiguous operands (``types``: the
    (out, a, b, c, computation) dtypes, or one dtype for all; ``ptrs``: output, then three
    inputs, 0 for a scalar or a missing operand). The vector path when every pointer sits at
    the same element offset modulo V (V x the widest item size = 16 bytes): ``head`` elements
    before the first aligned vector and ``tail`` after the last whole one are peeled, and the
    pointers passed are those of the aligned body. Otherwise one element per access. Returns
    ``(kernel, grid, (out, a, b, c), (nvec, head, tail))``."""
    if isinstance(types, _dtypes.DType):
        types = (types,) * 5
    used = [i for i in range(4) if ptrs[i]]
    V = 16 // max([types[4].itemsize] + [types[i].itemsize for i in used])
    offs = {(ptrs[i] // types[i].itemsize) % V for i in used}
    if len(offs) <= 1 and all(ptrs[i] % types[i].itemsize == 0 for i in used):
        e = offs.pop() if offs else 0
        head = min(n, (V - e) % V)
        nvec = (n - head) // V
        arr = all(ptrs[1:1 + reads(op)])
        k = kernel("contig", op, types, (V, arr))
    else:
        V, head, nvec = 1, 0, n
        k = kernel("contig", op, types, (1, False))
    tail = n - head - nvec * V
    grid = max(1, -(-(nvec + head + tail) // BLOCK))
    if grid > _INT32_MAX:
        raise ValueError(f"{_NAMES[op]}: {n} elements is more than one launch can cover")
    bp = tuple(p + head * types[i].itemsize if p else 0 for i, p in enumerate(ptrs))
    return k, grid, bp, (nvec, head, tail)


def plan(op, c):
    """Choose the kernel variant for a validated :class:`Call` and build its arguments.
    Returns ``(kernel, grid, args)``."""
    shape, n = c.shape, c.size
    views = list(c.views) + [None] * (3 - len(c.views))
    zero = c.dtype.scalar_bits(0)
    scal = [s if v is None else zero for s, v in zip(list(c.scalars) + [0] * 3, views)]
    scal = [s if s != 0 or not isinstance(zero, bytes) else zero for s in scal]
    ptrs = [v.ptr if v is not None else 0 for v in views]
    types = _types(op, c, views)
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
        k, grid, bp, sizes = contiguous_plan(op, types, n, [o.ptr] + ptrs)
        return k, grid, bp + tuple(scal) + sizes
    head_args = (o.ptr, ptrs[0], ptrs[1], ptrs[2], scal[0], scal[1], scal[2])
    r = _rows_plan(op, types, sh, sts, [o] + views)
    if r is not None:
        k, grid, tail_args = r
        return k, grid, head_args + tail_args
    if len(sh) > MAXD:
        raise ValueError(f"{_NAMES[op]}: more than {MAXD} dimensions that cannot be merged "
                         f"(shape {shape}); make the arrays contiguous first")
    sm = _runtime.device_info(c.device).sm_count
    grid = max(1, min(-(-n // BLOCK), sm * STRIDED_WAVES))
    # 64-bit indices when an index, an offset or the loop's last i + step (up to n - 1 + the
    # grid's threads) passes int32
    big = n + grid * BLOCK > _INT32_MAX or any(
        sum(abs(s) * (e - 1) for s, e in zip(st, sh)) > _INT32_MAX for st in sts)
    k = kernel("strided", op, types, ("long long" if big else "int",))
    dims = struct.Struct(f"{MAXD}{'q' if big else 'i'}")
    pad = (0,) * (MAXD - len(sh))
    args = list(head_args) + [n, len(sh), dims.pack(*(sh + pad))]
    args += [dims.pack(*(st + pad)) for st in sts]
    return k, grid, tuple(args)


ROWS_MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (and z): rows = grid y x grid z


def _rows_plan(op, types, sh, sts, views):
    """The row kernel when the merged view is 1-D or 2-D, every array operand's inner stride
    is 1 or 0 (the output's 1), the row length is a multiple of the vector width V, every
    row start is aligned to V elements and rows are long enough to fill a warp with vectors.
    Returns ``(kernel, (grid_x, grid_y, grid_z), tail args)`` or None."""
    if len(sh) == 1:
        sh, sts = (1,) + sh, [(0,) + st for st in sts]
    if len(sh) != 2:
        return None
    rows, cols = sh
    used = [i for i, v in enumerate(views) if v is not None]
    V = 16 // max([types[4].itemsize] + [types[i].itemsize for i in used])
    if cols % V or cols // V < 32 or sts[0][1] != 1:
        return None
    inner = 0
    for i in used:
        st, v = sts[i], views[i]
        if st[1] not in (0, 1):
            return None
        if st[1] == 1:
            if v.ptr % (V * types[i].itemsize) or st[0] % V:
                return None
            if i:
                inner |= 1 << (i - 1)
    cvec = cols // V
    gx, gy = -(-cvec // BLOCK), min(rows, ROWS_MAX_GRID_Y)
    gz = -(-rows // gy)
    if gx > _INT32_MAX or gz > ROWS_MAX_GRID_Y:
        return None
    return (kernel("rows", op, types, (V,)), (gx, gy, gz),
            (rows, cols, sts[0][0], sts[1][0], sts[2][0], sts[3][0], inner))


def prepare(fn, *args, out=None, dtype=None, casting="same_kind", stream=None):
    """Validate a call once and return a :class:`PreparedCall` that replays the launch.

    For hot loops over the same arrays: ``call = cupylab.prepare(cupylab.fused_add_mul, a,
    b, s, out=d)`` then ``call()``. Everything is checked here; ``call()`` only launches (the
    arguments are frozen into the call's own parameter buffer), on the caller's current
    stream at call time (torch's for torch arrays, CuPy's otherwise) or on ``stream`` if given
    here. The arrays must stay alive and keep their storage while the prepared call is used;
    new values written into them are of course seen. Call it with the arrays' device current
    (``call.device``): to stay as cheap as a bare launch, ``call()`` does not switch devices,
    and it does not wait on the streams CUDA Array Interface v3 producers name (an operator
    call does): order such producers' work before the call's stream yourself.

    Parameters
    ----------
    fn : cupylab elementwise operator (``cupylab.add`` ...)
    *args : its operands
    out : GPU array, optional
        Without it, an output is allocated once here and every ``call()`` writes it.
    dtype, casting :
        As for the operator.
    stream : optional
        Fix the stream instead of following the current one.

    Returns
    -------
    PreparedCall
        ``call()`` launches and returns the output; ``call.out`` is the output.

    Raises
    ------
    TypeError, ValueError
        As the operator would; also an operator that cannot be prepared, a wrong operand
        count, an all-scalar call, and an ``out`` that partially overlaps an input.
    """
    spec = _PREPARABLE.get(fn)
    if spec is None:
        raise TypeError(f"prepare: {getattr(fn, '__name__', fn)!r} is not a cupylab operator "
                        f"that can be prepared (these can: "
                        f"{', '.join(sorted({f.__name__ for f in _PREPARABLE}))})")
    name, kop, names, allow = spec
    if len(args) != len(names):
        raise TypeError(f"prepare: {name} takes {len(names)} operands ({', '.join(names)}), "
                        f"got {len(args)}")
    c, _ = _call(name, kop, args, names, out, dtype, casting, stream, allow)
    if c is None:
        raise TypeError(f"prepare: {name} needs at least one GPU array (all operands are "
                        "scalars)")
    if c.overlap:
        raise ValueError(f"prepare: {name}: out overlaps an input without being exactly the "
                         "same view; a prepared call does not compute through a temporary")
    result = finish_output(c.kind, c.out_obj, c.stream, c.device) if c.allocated else c.out_obj
    if not c.size:
        return _launch.PreparedLaunch(None, c.device, 0, BLOCK, None, None, result, args)
    with _launch.ensure_device(c.device):
        k, grid, kargs = plan(kop, c)
        smem = streaming_smem_for(k, grid, c.device)
    fixed = None if stream is None else c.stream
    getter = (lambda d=c.device, kind=c.kind: _launch.current_stream(kind, d))
    return _launch.PreparedLaunch(k, c.device, grid, BLOCK, kargs, fixed if fixed is not None
                                  else getter, result, (args, c), shared_mem=smem)


# -- the public operators, built from one table ----------------------------------------------
_COMMON_DOC = """
    Parameters
    ----------
    {params}
    out : GPU array or tuple of one, optional
        Where to write; any dtype the result can be cast to under ``casting``. It may be one
        of the inputs exactly (in place); a partial overlap with an input is computed through
        a temporary, as NumPy does.
    dtype : dtype, optional
        The dtype to compute in and return (NumPy's ``dtype=``: the output signature).
    casting : {{"same_kind", "safe", "unsafe", "equiv", "no"}}
        NumPy's rule for the casts of the inputs to the computation dtype and of the result
        into ``out``.
    stream : stream, optional
        Launch on this stream (int handle, CuPy or torch stream, ``__cuda_stream__``) instead
        of the caller's current one.

    Notes
    -----
    Accepts CuPy arrays, torch tensors, JAX arrays, Numba device arrays and any object with
    ``__cuda_array_interface__`` (v2/v3) or ``__dlpack__``, without copying; Python scalars,
    NumPy scalars and 0-d NumPy arrays. Operands broadcast like NumPy (the strided kernel
    takes up to {maxd} dimensions after merging contiguous ones). dtypes: bool, int8-int64,
    uint8-uint64, float16, bfloat16, float32, float64, complex64, complex128, mixed freely:
    each operand is read in its own dtype and converted in registers (no temporaries).

    The result dtype follows the leading array's framework: NumPy 2's type resolution (NEP
    50: Python scalars are weak) for CuPy, Numba, CAI and DLPack arrays, ``torch.result_type``
    for torch tensors (true division of integers in the default float dtype), JAX's for JAX
    arrays. Integers wrap; integer division by zero gives 0 (no warning from the GPU).
    16-bit floats compute in float32 and round once.

    Runs on the caller's current stream (torch's for torch inputs, CuPy's otherwise) or on
    ``stream``; never blocks the host; works under CUDA graph capture.

    Returns
    -------
    array
        ``out`` when given; else a new array in the framework of the first array argument
        (torch → torch tensor, CuPy → CuPy array, JAX → JAX array, Numba → Numba device
        array, other CAI/DLPack objects → CuPy array). Every operand a scalar: a 0-d CuPy
        array (as ``cupy.add``).

    Raises
    ------
    TypeError
        Host arrays, combinations the framework refuses (bool subtract, complex floor
        division ...), casts that ``casting`` forbids, tensors requiring grad, conj/neg views.
    OverflowError
        A Python int that does not fit the computation dtype (NumPy's rule).
    ValueError
        Shapes that do not broadcast, a bad ``out`` (shape, read-only, broadcast, a tuple of
        more than one), an unknown ``casting``, arrays on different GPUs.
    cupylab.NoGPUError
        No usable CUDA GPU.
"""

# public name, kernel operator, operand names, scalars allowed (None: everywhere), summary
_TABLE = (
    ("add", "add", ("x1", "x2"), None, "Elementwise ``x1 + x2`` (``numpy.add``). "
     "Booleans: logical or."),
    ("subtract", "subtract", ("x1", "x2"), None, "Elementwise ``x1 - x2`` "
     "(``numpy.subtract``). Booleans are refused, as NumPy and torch refuse them."),
    ("multiply", "multiply", ("x1", "x2"), None, "Elementwise ``x1 * x2`` "
     "(``numpy.multiply``). Booleans: logical and."),
    ("divide", "true_divide", ("x1", "x2"), None, "Elementwise true division ``x1 / x2`` "
     "(``numpy.divide``, ``numpy.true_divide``, ``torch.div``): integers and booleans divide "
     "in float64 (NumPy, CuPy) or torch's default float dtype (torch); IEEE results for "
     "x / 0; complex division as NumPy computes it (Smith's method)."),
    ("floor_divide", "floor_divide", ("x1", "x2"), None, "Elementwise floor division "
     "``x1 // x2`` (``numpy.floor_divide``): rounds toward -inf for integers and floats; "
     "integer ``x // 0`` is 0 and ``MIN // -1`` wraps to ``MIN``; float ``x // 0`` is "
     "``x / 0`` (inf or nan), as NumPy. Complex numbers are refused."),
    ("vector_add", "add", ("x1", "x2"), (False, False), "The seed's example: ``x1 + x2`` for "
     "two GPU arrays (no scalars)."),
    ("fused_add_mul", "fused_add_mul", ("a", "b", "s"), (False, False, True),
     "``(a + b) * s`` in one pass: reads a, b (and s) once, writes once. The dtype is "
     "NumPy's (or the framework's) for ``multiply(add(a, b), s)``; the sum is computed in "
     "that dtype too (no intermediate rounding to the sum's own dtype)."),
)
_PARAMS = {2: "x1, x2 : GPU array or scalar", 3: "a, b : GPU array\n    s : GPU array or scalar"}

# The lean path (plain contiguous torch or CuPy arrays of one dtype, no dtype=/stream=): the
# handler for the first operand's type, called with the operator's code, so a hit costs one
# Python frame beyond the operator's own, as before the operators were built from a table.
_lean_get, _lean_new, _ABSENT, _MISS = _fast._handlers.get, _fast.handler, _fast.ABSENT, _fast.MISS


_SK = "same_kind"  # the default casting: an identity test on the lean path (other spellings of
# the same string are still correct, through the general path)


def _make(name, kop, names, allow, summary):
    code = OPS[kop]
    if len(names) == 2:
        def f(x1, x2, /, out=None, *, dtype=None, casting=_SK, stream=None):
            if stream is None and dtype is None and casting is _SK:
                r = (_lean_get(type(x1)) or _lean_new(type(x1)))(code, x1, x2, _ABSENT, out, allow)
                if r is not _MISS:
                    return r
            return _run(name, code, (x1, x2), names, out, dtype, casting, stream, allow)
    else:
        def f(a, b, s, /, out=None, *, dtype=None, casting=_SK, stream=None):
            if stream is None and dtype is None and casting is _SK:
                r = (_lean_get(type(a)) or _lean_new(type(a)))(code, a, b, s, out, allow)
                if r is not _MISS:
                    return r
            return _run(name, code, (a, b, s), names, out, dtype, casting, stream, allow)
    f.__name__ = f.__qualname__ = name
    f.__module__ = "cupylab"
    sig = f"{name}({', '.join(names)}, /, out=None, *, dtype=None, casting='same_kind', " \
          "stream=None)"
    f.__doc__ = f"{sig}\n\n    {summary}\n" + _COMMON_DOC.format(params=_PARAMS[len(names)],
                                                                  maxd=MAXD)
    return f


_PREPARABLE = {}
for _row in _TABLE:
    _f = _make(*_row)
    globals()[_row[0]] = _f
    _PREPARABLE[_f] = (_row[0], OPS[_row[1]], _row[2], _row[3])
del _row, _f
true_divide = divide  # noqa: F821 - numpy.true_divide is numpy.divide
sub, mul, div = subtract, multiply, divide  # noqa: F821 - aliases with NumPy's meaning


# -- registry entries (tests and cupylab-bench; the peers live in the bench) -------------------
def _bench_divide(x, y, out=None):
    """The bench's ``div`` case: true division for floats, floor division for integers
    (so that the output keeps the operands' dtype)."""
    f = _BENCH_DIV.get(x.dtype)
    if f is None:
        f = _BENCH_DIV.setdefault(x.dtype, floor_divide if "int" in str(x.dtype)  # noqa: F821
                                  else divide)  # noqa: F821
    return f(x, y, out=out)


_BENCH_DIV: dict = {}


def _register():
    from .._registry import OpSpec, register  # noqa: PLC0415
    from ..bench._elementwise_peers import PEERS  # noqa: PLC0415 - no heavy imports

    dtypes = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
    sym = {"add": "+", "vector_add": "+", "sub": "-", "mul": "*", "div": "/"}
    for name, fn in (("vector_add", vector_add), ("add", add), ("sub", subtract),  # noqa: F821
                     ("mul", multiply), ("div", _bench_divide)):  # noqa: F821
        register(OpSpec(name, fn, 2, name, dtypes, bytes_per_element=lambda isz: 3 * isz,
                        flops_per_element=1, peers=PEERS[name],
                        description=f"out = x {sym[name]} y" + (
                            " (integers: floor division)" if name == "div" else "")))
    register(OpSpec("fused_add_mul", fused_add_mul, 3, "fused_add_mul", dtypes,  # noqa: F821
                    bytes_per_element=lambda isz: 4 * isz, flops_per_element=2,
                    peers=PEERS["fused_add_mul"], description="out = (a + b) * s in one pass"))


_register()
_fast.bind(_kernel, BLOCK, streaming_smem_for, len(OPS), _ADD_MUL, same_dtype_result)
_fast.bind_mixed(kernel, [_NAMES[i] for i in range(len(OPS))])
