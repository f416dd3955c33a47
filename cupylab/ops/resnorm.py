"""``add_rms_norm`` over a float32 residual stream, the pre-norm block of mixed-precision
training (``cuda_src/resnorm.cu``): the branch ``x`` (16-bit out of a matrix multiply, or
float32) adds to a float32 ``residual``; ``h`` stays float32; ``y`` is written once in the dtype
its consumer wants (the next 16-bit matrix multiply's), so no separate add or cast kernel runs.
The backward adds the residual's own gradient and writes the branch's gradient in its dtype in
the same pass.

:func:`cupylab.add_rms_norm` comes here when ``residual``'s dtype differs from ``x``'s or
``dtype=`` asks for a ``y`` of another dtype; :func:`add_rms_norm_backward` is public.
"""
from __future__ import annotations

import math

from .. import _compile, _dtypes, _launch, _runtime
from . import _rowcore as rc

__all__ = ["add_rms_norm_mixed", "add_rms_norm_backward", "all_programs"]

F16 = _dtypes.from_name("float16")
BF16 = _dtypes.from_name("bfloat16")
F32 = rc.F32
#: the dtypes of x (the branch) and y / dy; residual, h, the gradients' float32 side, rstd and
#: the weight are float32
TYPES = (F16, BF16, F32)
#: register classes ``(threads, threads per row, quads a thread)``, smallest first: a class
#: holds ``threads per row x quads x 4`` elements. Forward: 64, 256, 512, 2,048, 8,192.
FWD_CLASSES = ((256, 8, 2), (256, 32, 2), (256, 32, 4), (256, 128, 4), (512, 512, 4))
#: the backward holds dy, h, dh and its weight-gradient sums: two quads a thread (four spill
#: under the 64-register cap that lets four 256-thread blocks share an SM; ptxas, sm_90):
#: 64, 256, 512, 2,048, 4,096, 8,192
BWD_CLASSES = ((256, 8, 2), (256, 32, 2), (256, 64, 2), (256, 256, 2), (512, 512, 2),
               (1024, 1024, 2))
CLASSES = {"fwd": FWD_CLASSES, "bwd": BWD_CLASSES}
GENERIC_THREADS = 256  # RG in resnorm.cu
ARGS_FMT = "8Q3q15qd"  # struct ResArgs


def kernel_name(kind, tx, ty, cls):
    """``kind``: "fwd" or "bwd"; ``cls`` from :data:`CLASSES`, or None for the generic one."""
    if cls is None:
        return f"cl::resnorm_{kind}_generic<{tx.ctype}, {ty.ctype}>"
    th, tpr, nv = cls
    return f"cl::resnorm_{kind}<{tx.ctype}, {ty.ctype}, {th}, {tpr}, {nv}>"


def name_expressions(tx):
    names = [kernel_name(kind, tx, ty, cls) for ty in TYPES for kind in ("fwd", "bwd")
             for cls in CLASSES[kind] + (None,)]
    return names + ["cl::col_sum<float, float>"]


_programs: dict = {}
_kernels: dict = {}


def program(tx) -> _compile.Program:
    """One program per branch dtype: every y dtype, both directions, the column sum."""
    p = _programs.get(tx.name)
    if p is None:
        p = _programs.setdefault(tx.name, _compile.Program.from_file(
            _compile.cuda_src_dir() / "resnorm.cu", name_expressions(tx)))
    return p


def all_programs():
    """Every program of this family (CI compiles them for sm_75, sm_80 and sm_90)."""
    return [program(t) for t in TYPES]


def _kernel(tx, name, fmts=(ARGS_FMT,)):
    key = (tx.name, name)
    k = _kernels.get(key)
    if k is None:
        k = _kernels.setdefault(key, _launch.Kernel(program(tx), name, list(fmts)))
    return k


def choose(kind, cols, quad_ok):
    """The register class of ``kind`` ("fwd", "bwd") for rows of ``cols`` elements, or None
    (the generic kernel): ``quad_ok`` says every row operand has a contiguous last axis and
    quad-aligned rows."""
    if not quad_ok or cols % 4:
        return None
    nq = cols // 4
    for cls in CLASSES[kind]:
        if cls[1] * cls[2] >= nq:
            return cls
    return None


def forward_grid(rows, cls):
    """Blocks of the forward: a register class's row groups, the generic kernel's rows (both
    grid-stride past 2^31 - 1)."""
    return min(rows if cls is None else -(-rows // (cls[0] // cls[1])), rc._INT32_MAX)


def backward_grid(rows, cls, sm_count):
    """Blocks of the persistent backward (each writes one row of partial weight sums): a
    register class's row groups up to four 256-thread blocks' worth an SM (the 64-register
    cap), the generic kernel's rows up to 8 blocks an SM."""
    if cls is None:
        return max(1, min(rows, sm_count * 8))
    return max(1, min(-(-rows // (cls[0] // cls[1])), sm_count * (1024 // cls[0])))


def col_sum(tx):
    """The weight gradient's column sum (``cl::col_sum<float, float>``, in ``tx``'s
    program)."""
    return _kernel(tx, "cl::col_sum<float, float>", rc.COL_SUM_FMTS)


class _Layout:
    __slots__ = ("rows", "cols", "n1", "so", "si", "cs", "quad_ok", "lead")


def layout(opname, shape, views, weight=None):
    """Rows x columns of the row operands ``views`` (up to 5 Views of ``shape`` or None) over
    the last axis: the leading dimensions merged into at most two strided levels (ValueError
    otherwise), per operand the two row strides and the column stride, and ``quad_ok``."""
    lead, cols = shape[:-1], shape[-1]
    ops = [(i, v) for i, v in enumerate(views) if v is not None]
    n1, sts = rc.merge_rows(opname, lead, [tuple(v.strides[:-1]) for _, v in ops])
    lay = _Layout()
    lay.rows, lay.cols, lay.lead, lay.n1 = math.prod(lead), cols, lead, n1
    lay.so, lay.si, lay.cs = [0] * 5, [0] * 5, [0] * 5
    ok = cols % 4 == 0 and (weight is None or weight.ptr % 16 == 0)
    for (i, v), st in zip(ops, sts):
        lay.so[i], lay.si[i] = rc.split_row_strides(st)
        lay.cs[i] = v.strides[-1] if cols > 1 else 1
        q = 4 * v.dtype.itemsize  # a quad's bytes
        ok = ok and lay.cs[i] == 1 and not (v.ptr % q or (lay.so[i] * v.dtype.itemsize) % q
                                           or (lay.si[i] * v.dtype.itemsize) % q)
    lay.quad_ok = ok
    return lay


def _pack(ptrs, lay, eps=0.0):
    return (*[int(p or 0) for p in ptrs], lay.rows, lay.cols, max(1, lay.n1),
            *lay.so, *lay.si, *lay.cs, float(eps))


def same_dtype(dtype, dt):
    """Whether ``dtype`` (anything :func:`cupylab._dtypes.resolve` reads) names ``dt``."""
    try:
        return _dtypes.resolve(dtype) is dt
    except TypeError:
        return False


def resolve_dtype(opname, name, dtype):
    """``dtype`` as a DType of :data:`TYPES` (TypeError naming ``name`` otherwise)."""
    try:
        dt = _dtypes.resolve(dtype)
    except TypeError:
        dt = None
    if dt not in TYPES:
        raise TypeError(f"{opname}: {name} must be float16, bfloat16 or float32 (got {dtype!r})")
    return dt


def _check_branch(opname, name, v):
    if v.dtype not in TYPES:
        raise TypeError(f"{opname}: {name} must be float16, bfloat16 or float32 over a float32 "
                        f"residual (got {v.dtype.name})")


def _check_f32(opname, name, v, shape, what):
    if v.dtype is not F32:
        raise TypeError(f"{opname}: {name} must be float32 ({what}); got {v.dtype.name}")
    if v.shape != shape:
        raise ValueError(f"{opname}: {name} must have the shape {shape}; got {v.shape}")


def _check_weight(opname, v, cols):
    if v.shape != (cols,):
        raise ValueError(f"{opname}: weight must have shape ({cols},) (got {v.shape})")
    if cols > 1 and v.strides[0] != 1:
        raise ValueError(f"{opname}: weight must be contiguous (got stride {v.strides[0]})")
    if v.dtype is not F32:
        raise TypeError(f"{opname}: weight must be float32 over a float32 residual (got "
                        f"{v.dtype.name})")


def add_rms_norm_mixed(c, opname, residual, eps, inplace, out, dtype, return_stats):
    """The mixed-precision ``add_rms_norm`` on the gathered arguments ``c`` (views "x",
    "residual", and "weight", "out" when given; ``residual`` the caller's object, returned as
    ``h`` with ``inplace``): see :func:`cupylab.add_rms_norm`."""
    v = c.views
    xv, rv = v["x"], v["residual"]
    _check_branch(opname, "x", xv)
    rc.check_not_0d(opname, "x", xv)
    if rv.dtype is not F32:
        raise TypeError(f"{opname}: residual must have x's dtype ({xv.dtype.name}), or be "
                        f"float32 (a float32 residual stream); got {rv.dtype.name}")
    if rv.shape != xv.shape:
        raise ValueError(f"{opname}: residual must have the shape of x {xv.shape}; got "
                         f"{rv.shape}")
    ydt = F32 if dtype is None else resolve_dtype(opname, "dtype", dtype)
    rc.check_eps(opname, eps)
    shape, cols = xv.shape, xv.shape[-1]
    wv = v.get("weight")
    if wv is not None:
        _check_weight(opname, wv, cols)
    rc.check_columns(opname, shape)
    if inplace:
        if rv.readonly:
            raise ValueError(f"{opname}: residual is read-only ({rv.kind}); inplace=True needs "
                             "a writable residual")
        rc.check_out(opname, "residual", rv, shape, F32)
        rc.disjoint(opname, rv, "residual", [("x", xv), ("weight", wv)])
    if out is not None:
        ov = v["out"]
        rc.check_out(opname, "out", ov, shape, ydt)
        rc.overlap(opname, ov, "out", [("x", xv), ("residual", rv)])
        rc.disjoint(opname, ov, "out", [("weight", wv)])
        if inplace and ov.ptr == rv.ptr and ov.size:
            raise ValueError(f"{opname}: out cannot be the residual when inplace=True")
        yobj = out
    else:
        yobj, ov = rc.new_array(c, shape, ydt)
    if inplace:
        hobj, hv = residual, rv
    else:
        hobj, hv = rc.new_array(c, shape, F32)
    lay = layout(opname, shape, [xv, rv, ov, hv], wv)
    sobj = sv = None
    if return_stats:
        sobj, sv = rc.new_array(c, lay.lead, F32)
    if lay.rows:
        cls = choose("fwd", cols, lay.quad_ok)
        k = _kernel(xv.dtype, kernel_name("fwd", xv.dtype, ydt, cls))
        block = GENERIC_THREADS if cls is None else cls[0]
        grid = forward_grid(lay.rows, cls)
        args = _pack((xv.ptr, rv.ptr, ov.ptr, hv.ptr, 0, wv.ptr if wv is not None else 0,
                      sv.ptr if sv is not None else 0, 0), lay, eps)
        with _launch.ensure_device(c.device):
            k.launch(c.device, grid, block, c.stream, args)
    res = [yobj if out is not None else rc.finish(c, yobj),
           hobj if inplace else rc.finish(c, hobj)]
    if return_stats:
        res.append(rc.finish(c, sobj))
    return tuple(res)


def add_rms_norm_backward(dy, h, weight, rstd, dh=None, *, x_dtype=None, weight_grad=True,
                          stream=None):
    """Gradients of the mixed-precision :func:`cupylab.add_rms_norm` (float32 ``residual``
    and ``h``) in one pass: with ``g = dy * weight``,
    ``dresidual = rstd * (g - h * rstd**2 * mean(g * h)) + dh`` (float32),
    ``dx = dresidual`` rounded to ``x_dtype`` and ``dweight = sum over rows of dy * h * rstd``
    (float32 partial sums per block, then a column-sum kernel: deterministic).

    Parameters
    ----------
    dy : GPU array, float16 / bfloat16 / float32
        The gradient of ``y``, of ``h``'s shape.
    h : GPU array, float32
        The forward's ``h`` (``x + residual``).
    weight : GPU array or None
        The forward's weight: float32, shape ``(n,)``, contiguous.
    rstd : GPU array, float32
        The forward's ``rstd`` (``return_stats=True``): one value a row, contiguous.
    dh : GPU array, optional
        float32, ``h``'s shape: the gradient reaching ``h`` itself (the next residual), added
        to ``dresidual``.
    x_dtype : dtype, optional
        The dtype of ``x`` (float16, bfloat16 or float32; default float32).
    weight_grad : bool
        Compute ``dweight`` (with a weight).
    stream : stream, optional

    Returns
    -------
    (dresidual, dx, dweight)
        ``dresidual`` float32 of ``h``'s shape; ``dx`` the same values in ``x_dtype``, written
        in the same pass, and ``dresidual`` itself when ``x_dtype`` is float32; ``dweight``
        float32 of shape ``(n,)``, or None without a weight or with ``weight_grad=False``.

    Arrays may come from CuPy, torch, JAX, Numba or anything with
    ``__cuda_array_interface__`` / ``__dlpack__``, used without copying; leading dimensions
    may be strided (merging into at most two levels). Runs on the caller's current stream or
    ``stream``; new arrays are of ``dy``'s framework.

    Raises
    ------
    TypeError
        Arrays that are not GPU arrays, dtypes other than those above, a missing ``rstd``.
    ValueError
        Mismatched shapes, a non-contiguous ``rstd`` or weight, leading dimensions that
        cannot be merged, arrays on different GPUs.
    """
    opname = "add_rms_norm_backward"
    if stream is None:
        r = _resfast.backward(dy, h, weight, rstd, dh, x_dtype, weight_grad)
        if r is not _resfast.MISS:
            return r
    c = rc.gather(opname, {"dy": dy, "h": h, "weight": weight, "rstd": rstd, "dh": dh},
                  stream, required=2)
    v = c.views
    dv, hv = v["dy"], v["h"]
    _check_branch(opname, "dy", dv)
    rc.check_not_0d(opname, "h", hv)
    _check_f32(opname, "h", hv, hv.shape, "the forward's h")
    if dv.shape != hv.shape:
        raise ValueError(f"{opname}: dy must have the shape of h {hv.shape}; got {dv.shape}")
    shape, cols = hv.shape, hv.shape[-1]
    rows = math.prod(shape[:-1])
    dhv = v.get("dh")
    if dhv is not None:
        _check_f32(opname, "dh", dhv, shape, "the gradient reaching h")
    if "rstd" not in v:
        raise TypeError(f"{opname}: rstd is required (the statistics the forward returned)")
    rc.check_stats(opname, "rstd", v["rstd"], rows, F32)
    wv = v.get("weight")
    if wv is not None:
        _check_weight(opname, wv, cols)
    xdt = F32 if x_dtype is None else resolve_dtype(opname, "x_dtype", x_dtype)
    rc.check_columns(opname, shape, "the last axis of h is empty")
    gobj, gv = rc.new_array(c, shape, F32)
    gxobj = gxv = None
    if xdt is not F32:
        gxobj, gxv = rc.new_array(c, shape, xdt)
    dwobj = dwv = None
    if wv is not None and weight_grad:
        dwobj, dwv = rc.new_array(c, (cols,), F32)
    lay = layout(opname, shape, [dv, hv, dhv, gv, gxv], wv)
    cls = choose("bwd", cols, lay.quad_ok)
    block = GENERIC_THREADS if cls is None else cls[0]
    grid = backward_grid(lay.rows, cls, _runtime.device_info(c.device).sm_count)
    part = pv = None
    if dwv is not None and lay.rows:
        part, pv = rc.new_array(c, (grid, cols), F32)
    with _launch.ensure_device(c.device):
        if lay.rows:
            k = _kernel(xdt, kernel_name("bwd", xdt, dv.dtype, cls))
            args = _pack((dv.ptr, hv.ptr, dhv.ptr if dhv is not None else 0, gv.ptr,
                          gxv.ptr if gxv is not None else 0, wv.ptr if wv is not None else 0,
                          v["rstd"].ptr, pv.ptr if pv is not None else 0), lay)
            k.launch(c.device, grid, block, c.stream, args)
        if dwv is not None:
            rc.launch_col_sum(col_sum(xdt), c.device, c.stream, pv.ptr if pv is not None else 0,
                              grid if lay.rows else 0, cols, dwv.ptr)
    g = rc.finish(c, gobj)
    return (g, g if gxobj is None else rc.finish(c, gxobj),
            None if dwobj is None else rc.finish(c, dwobj))


# the lean path (it imports this module, so it is imported once this one is complete)
from . import _resfast  # noqa: E402
