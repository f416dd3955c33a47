"""Operator argument handling that needs no GPU: broadcasting, the dtype rule, scalars,
``out=`` checks and error messages (pinned), the no-GPU error, and the import contract."""
import subprocess
import sys

import numpy as np
import pytest

import cupylab
from cupylab._arrays import View, as_view
from cupylab._dtypes import DTYPES
from cupylab._elementwise_core import (broadcast_shapes, broadcast_strides, c_strides,
                                       check_overlap, coalesce)

from conftest import HAS_GPU, FakeCAI

F32 = DTYPES["float32"]


# -- pure helpers ------------------------------------------------------------------------------
def test_broadcast_shapes_numpy_rules():
    assert broadcast_shapes([(3, 1), (4,)]) == (3, 4)
    assert broadcast_shapes([(), (2, 3)]) == (2, 3)
    assert broadcast_shapes([(0, 1), (1, 5)]) == (0, 5)
    for shapes in ([(3, 1), (4,)], [(2, 1, 5), (7, 1)], [(1,), (0,)]):
        assert broadcast_shapes(shapes) == np.broadcast_shapes(*shapes)
    with pytest.raises(ValueError, match=r"add: shapes \(3,\) and \(4,\) cannot be broadcast"):
        broadcast_shapes([(3,), (4,)], "add")


def test_broadcast_strides_zero_where_stretched():
    v = View(0, (1, 5), (5, 1), F32, 0, False, None, "cai", None)
    assert broadcast_strides(v, (4, 1, 5)) == (0, 0, 1)


def test_coalesce_merges_contiguous_dims_only():
    shape = (4, 5, 6)
    assert coalesce(shape, [c_strides(shape)]) == ((120,), [(1,)])
    # a column slice x[:, :3] of a (4, 6) array: rows cannot merge
    assert coalesce((4, 3), [(6, 1)]) == ((4, 3), [(6, 1)])
    # extent-1 dims vanish whatever their stride
    assert coalesce((1, 7, 1), [(99, 1, 42)]) == ((7,), [(1,)])
    # broadcast operand: its zero strides merge with each other
    assert coalesce((4, 5), [(5, 1), (0, 0)]) == ((20,), [(1,), (0,)])


def test_overlap_rules():
    o = View(1000, (10,), (1,), F32, 0, False, None, "cai", None)
    same = View(1000, (10,), (1,), F32, 0, False, None, "cai", None)
    shifted = View(1004, (10,), (1,), F32, 0, False, None, "cai", None)
    apart = View(1040, (10,), (1,), F32, 0, False, None, "cai", None)
    reversed_ = View(1036, (10,), (-1,), F32, 0, False, None, "cai", None)
    check_overlap("add", o, (10,), [same, apart], ["x", "y"])  # exact in-place is fine
    with pytest.raises(ValueError, match="add: out overlaps x without being exactly the same view"):
        check_overlap("add", o, (10,), [shifted], ["x"])
    with pytest.raises(ValueError, match="out overlaps y"):
        check_overlap("add", o, (10,), [same, reversed_], ["x", "y"])
    # the same address and element strides but another item size: not the same elements
    wide = View(1000, (10,), (1,), DTYPES["float64"], 0, False, None, "cai", None)
    with pytest.raises(ValueError, match="out overlaps x"):
        check_overlap("add", o, (10,), [wide], ["x"])


# -- operator argument errors (pinned messages, before any GPU call) -------------------------
def f32(shape, **kw):
    return FakeCAI(shape, "<f4", **kw)


def test_host_array_refused():
    with pytest.raises(TypeError, match=r"add: x2 must be a CUDA device array .*numpy\.ndarray"):
        cupylab.add(f32((3,)), np.ones(3, np.float32))


def test_vector_add_refuses_scalars():
    with pytest.raises(TypeError, match=r"vector_add: x2 must be a GPU array \(got a scalar 2.0\)"):
        cupylab.vector_add(f32((3,)), 2.0)


def test_fused_add_mul_names_what_s_may_be():
    with pytest.raises(TypeError, match=r"fused_add_mul: s must be a GPU array or a Python "
                                        r"scalar \(got builtins.NoneType\)"):
        cupylab.fused_add_mul(f32((3,)), f32((3,)), None)


def test_numpy_refusals_are_the_operators_errors():
    b = FakeCAI((3,), "|b1")
    with pytest.raises(TypeError, match="subtract: numpy boolean subtract"):
        cupylab.subtract(b, b)
    with pytest.raises(TypeError, match="floor_divide: ufunc 'floor_divide' not supported"):
        cupylab.floor_divide(FakeCAI((3,), "<c8"), FakeCAI((3,), "<c8"))


def test_shape_mismatch_refused():
    with pytest.raises(ValueError, match=r"divide: shapes \(3,\) and \(4,\) cannot be broadcast"):
        cupylab.div(f32((3,)), f32((4,)))


def test_python_int_out_of_range_for_the_computation_dtype():
    with pytest.raises(OverflowError, match="add: x2: Python integer 300 out of bounds for int8"):
        cupylab.add(FakeCAI((3,), "|i1"), 300)
    with pytest.raises(OverflowError, match="add: x1: Python integer -1 out of bounds for uint8"):
        cupylab.add(-1, FakeCAI((3,), "|u1"))


def test_out_checks():
    x = f32((3, 4))
    with pytest.raises(ValueError, match=r"add: out has shape \(4, 3\), expected \(3, 4\)"):
        cupylab.add(x, x, out=f32((4, 3)))
    with pytest.raises(TypeError, match=r"add: Cannot cast ufunc 'add' output from "
                                        r"dtype\('float32'\) to dtype\('int32'\) with casting "
                                        r"rule 'same_kind'"):
        cupylab.add(x, x, out=FakeCAI((3, 4), "<i4"))
    with pytest.raises(TypeError, match=r"output from dtype\('float32'\) to dtype\('float16'\) "
                                        r"with casting rule 'safe'"):
        cupylab.add(x, x, out=FakeCAI((3, 4), "<f2"), casting="safe")
    with pytest.raises(ValueError, match=r"add: out is read-only \(cai array\)"):
        cupylab.add(x, x, out=f32((3, 4), readonly=True))
    with pytest.raises(ValueError, match="add: out has zero strides"):
        cupylab.add(x, x, out=f32((3, 4), strides=(0, 4)))
    with pytest.raises(TypeError, match="add: out must be a CUDA device array"):
        cupylab.add(x, x, out=np.empty((3, 4), np.float32))
    with pytest.raises(ValueError, match="add: out must be an array or a tuple of one array "
                                         r"\(got a tuple of 2\)"):
        cupylab.add(x, x, out=(x, x))
    with pytest.raises(ValueError, match="add: casting must be one of 'no', 'equiv', 'safe', "
                                         "'same_kind', 'unsafe' \\(got 'bogus'\\)"):
        cupylab.add(x, x, casting="bogus")
    with pytest.raises(TypeError, match="add: dtype must be one of"):
        cupylab.add(x, x, dtype="float8")
    with pytest.raises(TypeError, match=r"input 0 from dtype\('float32'\) to dtype\('int32'\)"):
        cupylab.add(x, x, dtype="int32")


@pytest.mark.skipif(HAS_GPU, reason="checks the error raised on a machine without a GPU")
def test_no_gpu_is_one_clear_error():
    with pytest.raises(cupylab.NoGPUError, match="no usable CUDA GPU"):
        cupylab.add(f32((3,)), f32((3,)))


def test_import_is_light():
    # A fresh interpreter: importing cupylab pulls in neither CuPy, NumPy, torch nor JAX.
    code = ("import sys, time; t = time.perf_counter(); import cupylab; "
            "dt = time.perf_counter() - t; "
            "print(sorted(m for m in ('cupy', 'numpy', 'torch', 'jax') if m in sys.modules)); "
            "print(dt)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    mods, secs = out.stdout.split("\n")[:2]
    assert mods == "[]"
    print(f"import cupylab took {float(secs) * 1e3:.1f} ms")  # shown with -s; never asserted


def test_public_api():
    for name in ("add", "subtract", "multiply", "divide", "true_divide", "floor_divide", "sub",
                 "mul", "div", "vector_add", "fused_add_mul", "NoGPUError", "CompileError"):
        assert name in cupylab.__all__ and hasattr(cupylab, name)
    for f in (cupylab.add, cupylab.fused_add_mul, cupylab.divide, cupylab.floor_divide):
        assert "Returns" in f.__doc__ and "Raises" in f.__doc__ and "casting" in f.__doc__
        assert f.__doc__.startswith(f"{f.__name__}(")
    assert cupylab.sub is cupylab.subtract and cupylab.mul is cupylab.multiply
    assert cupylab.div is cupylab.divide is cupylab.true_divide
    import inspect

    assert str(inspect.signature(cupylab.add)) == (
        "(x1, x2, /, out=None, *, dtype=None, casting='same_kind', stream=None)")
    assert len(cupylab.dtypes) == 15 and "complex128" in cupylab.dtypes


def test_view_record_repr():
    v = as_view(f32((2, 2)))
    assert "float32" in repr(v) and "(2, 2)" in repr(v)


def test_contiguous_plan_peels_head_and_tail_and_picks_the_variant():
    """The vector path: pointers advanced to the first 16-byte boundary, head/tail counted,
    the no-scalar instance when every operand the op reads is an array; mixed alignments take
    the one-element-per-access instance."""
    from cupylab.ops import elementwise as ew

    f32 = DTYPES["float32"]
    F4 = "cl::ew_contig<float, float, float, float, float, "
    base = 1 << 20
    k, grid, ptrs, sizes = ew.contiguous_plan(0, f32, 10, [base + 4, base + 260, base + 516, 0])
    assert k.name_expression == "cl::ew_contig<float, float, float, float, float, 0, 4, true>"
    assert sizes == (1, 3, 3)  # head 3 elements to the boundary, 1 vector, 3 left over
    assert ptrs == (base + 16, base + 272, base + 528, 0) and grid == 1
    k, _, ptrs, sizes = ew.contiguous_plan(0, f32, 1000, [base, base + 256, 0, 0])  # y a scalar
    assert k.name_expression == F4 + "0, 4, false>" and sizes == (250, 0, 0)
    k, _, _, _ = ew.contiguous_plan(5, f32, 1000, [base, base + 256, base + 512, 0])  # s scalar
    assert k.name_expression == F4 + "5, 4, false>"
    k, grid, ptrs, sizes = ew.contiguous_plan(0, f32, 1000, [base, base + 4, base + 8, 0])
    assert k.name_expression == F4 + "0, 1, false>"
    assert sizes == (1000, 0, 0) and ptrs == (base, base + 4, base + 8, 0) and grid == 4
    k, grid, _, sizes = ew.contiguous_plan(0, DTYPES["float16"], 5, [base + 2] * 3 + [0])
    assert sizes == (0, 5, 0) and grid == 1  # shorter than the way to the boundary: all head


def test_lean_launch_matches_contiguous_plan(monkeypatch):
    """ops/_fast's inlined launch packs the same kernel, grid and arguments as
    elementwise.contiguous_plan for every alignment mix and size (no GPU: the driver call
    is recorded)."""
    import struct

    from cupylab import _launch
    from cupylab.ops import _fast, elementwise as ew

    calls = []
    monkeypatch.setattr(_launch, "_driver_launch", lambda *a: calls.append(a))
    base = 1 << 24
    for name in ("float16", "float32", "float64"):
        dt = DTYPES[name]
        for op in (0, 5):
            ks = {v: ew._kernel(op, dt, v) for v in ("vec_arrays", "vec", "scalar")}
            for h, k in enumerate(ks.values(), 1):
                monkeypatch.setitem(k._fns, 0, h)  # a CUfunction handle: nothing compiles
            info = (dt, ks["vec_arrays"], ks["vec"], ks["scalar"], 16 // dt.itemsize, op == 5,
                    dt.itemsize, 0)
            for n in (1, 2, 3, 7, 8, 9, 100, 1001):
                for offs in ((0, 0, 0, 0), (4, 4, 4, 4), (2, 2, 2, 2), (8, 8, 0, 8), (0, 4, 8, 0),
                             (12, 12, 12, 12), (6, 6, 6, 6), (0, 0, 0, None), (4, 4, None, 4)):
                    ptrs = [0 if o is None else base + (i << 16) + o for i, o in enumerate(offs)]
                    if op == 0:
                        ptrs[3] = 0
                    k, grid, bp, sizes = ew.contiguous_plan(op, dt, n, ptrs)
                    calls.clear()
                    _fast._launch(info, n, ptrs[0], ptrs[1], ptrs[2], ptrs[3], 0, 0, 0, 0)
                    (f, gx, gy, gz, bx, *_rest), = calls
                    buf = k._tls.bp[0]
                    got = struct.unpack_from(k._struct.format, buf)
                    where = f"{name} op {op} n {n} offsets {offs}"
                    assert f == k._fns[0] and (gx, gy, gz, bx) == (grid, 1, 1, ew.BLOCK), where
                    assert got[:4] == bp and got[7:] == sizes, where
                    assert _rest[3] == 0, where  # small launches: no residency cap


def test_public_operators_try_the_lean_handler_with_their_operator(monkeypatch):
    """Each public operator calls the lean-path handler for its first operand's type with the
    operator's kernel index and its operands (no GPU: a recording handler answers); a MISS goes
    on to the general path, and stream= skips the lean path."""
    import cupylab
    from cupylab.ops import _fast, elementwise as ew

    class Fake:
        pass

    seen = []

    def record(op, x, y, z, out, allow):
        seen.append((op, x, y, z, out, allow))
        return "lean result"

    monkeypatch.setitem(_fast._handlers, Fake, record)
    a, b, c, o = Fake(), Fake(), Fake(), Fake()
    for name, kop, args, allow in (
            ("add", "add", (a, b), None), ("sub", "subtract", (a, b), None),
            ("mul", "multiply", (a, b), None), ("div", "true_divide", (a, b), None),
            ("floor_divide", "floor_divide", (a, b), None),
            ("vector_add", "add", (a, b), (False, False)),
            ("fused_add_mul", "fused_add_mul", (a, b, c), (False, False, True))):
        seen.clear()
        assert getattr(cupylab, name)(*args, out=o) == "lean result"
        op = ew.OPS[kop]
        z = args[2] if len(args) == 3 else _fast.ABSENT
        assert seen == [(op, args[0], args[1], z, o, allow)], name
    seen.clear()
    general = []
    monkeypatch.setattr(ew, "_run", lambda *a, **k: general.append(a) or "general")
    assert cupylab.add(a, b, stream=0) == "general" and not seen
    assert cupylab.add(a, b, dtype="float32") == "general" and not seen
    assert cupylab.add(a, b, casting="unsafe") == "general" and not seen
    monkeypatch.setitem(_fast._handlers, Fake, lambda *a: _fast.MISS)
    assert cupylab.mul(a, b) == "general" and general[-1][0] == "multiply"


def test_cupy_keeps_the_contiguity_attribute_the_lean_path_reads():
    """The lean path reads ``ndarray._c_contiguous`` (what ``flags.c_contiguous`` reports) and
    allocates with ``cupy.ndarray(shape, dtype)`` (what ``cupy.empty`` calls); if a CuPy release
    drops either, every call would silently take the slower general path."""
    cp = pytest.importorskip("cupy")
    assert hasattr(cp.ndarray, "_c_contiguous")
    import inspect

    assert "ndarray(shape, dtype" in inspect.getsource(cp.empty)


def test_large_vector_launches_get_the_residency_cap_on_both_paths(monkeypatch):
    """From STREAM_MIN_GRID blocks on, the 16-byte-vector ew_contig launches carry the dynamic
    shared memory of _launch.streaming_smem (the lean path and the general path's choice
    agree); scalar (mixed-alignment) launches, smaller grids and integer div carry none."""
    from cupylab import _launch
    from cupylab.ops import _fast, elementwise as ew

    calls = []
    monkeypatch.setattr(_launch, "_driver_launch", lambda *a: calls.append(a))
    monkeypatch.setitem(_launch._stream_smem, 0, 32329)
    base = 1 << 30
    seen_capped = set()
    for name in ("bfloat16", "float32", "float64", "int32", "int64"):
        dt = DTYPES[name]
        vw = 16 // dt.itemsize
        for op in (ew.OPS["add"], ew.OPS["floor_divide"]):
            ks = {v: ew._kernel(op, dt, v) for v in ("vec_arrays", "vec", "scalar")}
            for h, k in enumerate(ks.values(), 1):
                monkeypatch.setitem(k._fns, 0, h)
            info = (dt, ks["vec_arrays"], ks["vec"], ks["scalar"], vw, False, dt.itemsize, 0)
            capped = not (op == ew.OPS["floor_divide"] and dt.kind == "i")
            edge = _launch.STREAM_MIN_GRID * ew.BLOCK * vw
            seen_big = set()
            for n, offs in ((edge, (0, 0, 0)), (edge - ew.BLOCK * vw, (0, 0, 0)),
                            (edge + 3, (4, 4, 4)), (edge, (0, 0, None)), (edge, (0, 4, 8))):
                ptrs = [0 if o is None else base + (i << 28) + o for i, o in enumerate(offs)]
                ptrs.append(0)
                k, grid, _, _ = ew.contiguous_plan(op, dt, n, ptrs)
                calls.clear()
                _fast._launch(info, n, ptrs[0], ptrs[1], ptrs[2], 0, 0, 0, 0, 0)
                (call,) = calls
                want = ew.streaming_smem_for(k, grid, 0)
                where = f"{name} op {op} n {n} offsets {offs}"
                assert call[7] == want, where
                big = grid >= _launch.STREAM_MIN_GRID and k is not ks["scalar"]
                assert want == (32329 if big and capped else 0), where
                seen_big.add(big)
            assert seen_big == {True, False}
            seen_capped.add(capped)
    assert seen_capped == {True, False}


def test_residency_cap_only_for_one_item_size(monkeypatch):
    """Vectorised instances whose output and operands share one item size take the residency
    cap; mixed item sizes (narrower loads, measured faster with 8 blocks per SM) and integer
    floor division keep 8, scalar-operand instances included."""
    from cupylab import _launch
    from cupylab.ops import elementwise as ew

    monkeypatch.setitem(_launch._stream_smem, 0, 32329)
    D = DTYPES
    f16, bf, f32, f64 = D["float16"], D["bfloat16"], D["float32"], D["float64"]
    i32, i64, u8 = D["int32"], D["int64"], D["uint8"]
    add, fdiv, fam = ew.OPS["add"], ew.OPS["floor_divide"], ew.OPS["fused_add_mul"]
    grid = _launch.STREAM_MIN_GRID
    for op, types, capped in (
            (add, (f32,) * 5, True), (add, (bf,) * 5, True),
            (add, (f32, i32, f32, f32, f32), True),     # torch's int32 + float32: all 4 bytes
            (add, (f64, i32, f32, f64, f64), False),    # NumPy's: a float64 result
            (add, (f32, f32, f16, f32, f32), False), (add, (f32, u8, f32, f32, f32), False),
            (add, (i64, i64, i32, i64, i64), False), (add, (f64, i32, f64, f64, f64), False),
            (fam, (bf, bf, bf, f32, f32), False), (fam, (f32, f32, f32, f32, f32), True),
            (fdiv, (i32,) * 5, False), (fdiv, (f32,) * 5, True)):
        v = 16 // max(t.itemsize for t in types)
        k = ew.kernel("contig", op, types, (v, True))
        want = 32329 if capped else 0
        assert ew.streaming_smem_for(k, grid, 0) == want, (op, types)
        assert ew.streaming_smem_for(k, grid - 1, 0) == 0


def test_streaming_smem_only_where_the_occupancy_calculator_confirms_six_blocks(monkeypatch):
    """_launch.streaming_smem: one seventh of the SM's shared memory less the per-block
    reservation on compute capability 9.x with 2,048 threads per SM, when the occupancy API
    then reports 6 blocks of 256; 0 otherwise (no GPU: the attributes are faked)."""
    import types

    from cupy_backends.cuda.api import driver

    from cupylab import _launch, _runtime

    h200 = {75: 9, 39: 2048, 81: 233472, 111: 1024, 8: 49152}
    blocks = {}

    def fake(attrs):
        rt = types.SimpleNamespace(deviceGetAttribute=lambda a, d: attrs[a])
        return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt))

    monkeypatch.setattr(driver, "occupancyMaxActiveBlocksPerMultiprocessor",
                        lambda f, b, smem: blocks.setdefault((f, b, smem), 6))
    kern = types.SimpleNamespace(function=lambda d: 77)
    for attrs, answer, want in ((h200, 6, 233472 // 7 - 1024), (h200, 7, 0),
                                ({**h200, 75: 8}, 6, 0), ({**h200, 39: 1536}, 6, 0),
                                ({**h200, 8: 16384}, 6, 0)):
        monkeypatch.setattr(_runtime, "cupy", lambda attrs=attrs: fake(attrs))
        monkeypatch.setattr(_launch, "_stream_smem", {})
        blocks.clear()
        blocks[(77, 256, 233472 // 7 - 1024)] = answer
        assert _launch.streaming_smem(kern, 0) == want, (attrs, answer)
        assert _launch._stream_smem == {0: want}  # computed once per device


class _Devices:
    """A fake current device (``cur[0]``) and CuPy's ``Device`` context manager over it."""

    def __init__(self):
        self.cur = [0]

    def __call__(self, d):
        import contextlib

        @contextlib.contextmanager
        def scope():
            old, self.cur[0] = self.cur[0], d
            try:
                yield
            finally:
                self.cur[0] = old
        return scope()


def test_allocate_makes_the_array_on_the_given_device(monkeypatch):
    # CuPy allocates on the current device; the row-wise and cross-entropy paths allocate
    # their outputs before making the inputs' device current, so allocate must switch itself
    import types

    from cupylab import _elementwise_core as core, _runtime

    dev = _Devices()
    made = []
    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=dev),
        empty=lambda shape, dtype: made.append((dev.cur[0], shape, np.dtype(dtype))))
    monkeypatch.setattr(_runtime, "cupy", lambda: fake)
    monkeypatch.setattr(_runtime, "current_device", lambda: dev.cur[0])
    core.allocate("cupy", (3, 4), F32, 1)
    core.allocate("jax", (5,), F32, 0)
    assert made == [(1, (3, 4), np.dtype("float32")), (0, (5,), np.dtype("float32"))]
    assert dev.cur == [0]  # the caller's current device is left as it was


def test_wait_for_makes_its_event_on_the_given_device(monkeypatch):
    # the per-thread event of device d must be created on d even when another device is
    # current (callers order JAX/Numba outputs after leaving the launch's device scope)
    import types

    from cupylab import _launch, _runtime

    dev = _Devices()
    log = []
    rt = types.SimpleNamespace(
        eventDisableTiming=2, getDevice=lambda: dev.cur[0],
        eventCreateWithFlags=lambda f: log.append(("create", dev.cur[0])) or f"ev{dev.cur[0]}",
        eventRecord=lambda ev, s: log.append(("record", ev, s)),
        streamWaitEvent=lambda s, ev, f: log.append(("wait", s, ev)),
        streamIsCapturing=lambda s: int(s in capturing))
    capturing = set()
    monkeypatch.setattr(_runtime, "cupy", lambda: types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=rt, Device=dev)))
    monkeypatch.setattr(_launch._tls_events, "d", {}, raising=False)
    _launch.wait_for(0x10, 0x20, 1)
    _launch.wait_for(0x11, 0x21, 1)  # the event is made once per thread and device
    assert log == [("create", 1), ("record", "ev1", 0x20), ("wait", 0x10, "ev1"),
                   ("record", "ev1", 0x21), ("wait", 0x11, "ev1")]
    assert dev.cur == [0]
    # a capturing consumer cannot wait on work outside the capture (CUDA would end the
    # capture): skipped; a producer inside the same capture (a forked stream) is waited on
    log.clear()
    capturing.add(0x10)
    _launch.wait_for(0x10, 0x20, 1)
    assert log == []
    capturing.add(0x20)
    _launch.wait_for(0x10, 0x20, 1)
    assert log == [("record", "ev1", 0x20), ("wait", 0x10, "ev1")]


def test_strided_kernel_uses_64_bit_indices_when_the_loop_would_pass_int32(sim):
    """The strided kernel's grid-stride loop reaches i + grid x 256 past the last element:
    with n just under 2^31 that passes int32 (a wrapped, negative index), so the 64-bit
    instance is chosen although n itself fits."""
    n = 2**31 - 100
    x = FakeCAI((n,), typestr="|i1", ptr=0x7F00_0000_0000 + n - 1, strides=(-1,))
    o = FakeCAI((n,), typestr="|i1", ptr=0x7F10_0000_0000)
    cupylab.add(x, 1, out=o)
    (launch,) = sim["launches"]
    assert "ew_strided" in launch["name"] and "long long>" in launch["name"]
    small = FakeCAI((1000,), typestr="|i1", ptr=0x7F20_0000_0000 + 999, strides=(-1,))
    cupylab.add(small, 1, out=FakeCAI((1000,), typestr="|i1", ptr=0x7F30_0000_0000))
    assert sim["launches"][-1]["name"].endswith("int>")


def test_dtype_keyword_reads_python_types_and_numpy_spellings_as_numpy_does():
    """dtype=float is float64 (NumPy's meaning of the Python type; it computed in float32),
    complex is complex128, and NumPy's spellings ("f8", "d") resolve."""
    from cupylab import _dtypes

    assert _dtypes.resolve(float).name == "float64"
    assert _dtypes.resolve(complex).name == "complex128"
    assert _dtypes.resolve(int).name == "int64" and _dtypes.resolve(bool).name == "bool"
    assert _dtypes.resolve("f8").name == _dtypes.resolve("d").name == "float64"
    assert _dtypes.resolve("float").name == "float64"  # np.dtype("float"); it was float32
    assert _dtypes.resolve("torch.float").name == "float32"  # torch's words are torch's
    assert _dtypes.resolve("torch.int").name == "int32"
    assert _dtypes.resolve("torch.long").name == "int64"
    assert _dtypes.resolve("i4").name == "int32"
    with pytest.raises(TypeError, match="unknown dtype 'nonsense'"):
        _dtypes.resolve("nonsense")


def test_a_capture_whose_body_raises_leaves_nothing_to_replay(monkeypatch):
    """The capture is ended either way, but a body that raised keeps no half-captured graph:
    replay then says nothing was captured (it replayed the partial work)."""
    import types

    from cupylab import _graph, _launch, _runtime

    ended = []

    class Stream:
        ptr = 0x99

        def __init__(self, non_blocking=False):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def begin_capture(self):
            pass

        def end_capture(self):
            ended.append(True)
            return types.SimpleNamespace(launch=lambda *a: None)

    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0), Stream=Stream,
        get_current_stream=lambda: types.SimpleNamespace(ptr=0)))
    monkeypatch.setattr(_runtime, "cupy", lambda: cp)
    monkeypatch.setattr(_launch, "wait_for", lambda *a: None)
    g = _graph.Graph()
    with g.capture():
        pass
    assert g._graph is not None
    with pytest.raises(ValueError, match="half-way"), g.capture():
        raise ValueError("half-way")
    assert ended == [True, True]
    with pytest.raises(RuntimeError, match="nothing captured"):
        g.replay()
    # a capture CUDA invalidated: end_capture raises. The body's own error propagates (not
    # end_capture's), and the earlier graph is not left to replay
    with g.capture():
        pass
    Stream.end_capture = lambda self: (_ for _ in ()).throw(RuntimeError("invalidated"))
    with pytest.raises(ValueError, match="the body's"), g.capture():
        raise ValueError("the body's")
    assert g._graph is None
    Stream.end_capture = lambda self: types.SimpleNamespace(launch=lambda *a: None)
    with g.capture():
        pass
    Stream.end_capture = lambda self: (_ for _ in ()).throw(RuntimeError("invalidated"))
    with pytest.raises(RuntimeError, match="invalidated"), g.capture():
        pass  # the body did nothing wrong: the capture's own error
    assert g._graph is None


def test_load_kernels_refuses_a_single_string_where_a_list_is_meant():
    for kw in ({"options": "-DK=4"}, {"include_dirs": "/tmp"}, {"name_expressions": "k<float>"}):
        name = next(iter(kw))
        with pytest.raises(TypeError, match=f"load_kernels: {name} must be a list or tuple"):
            cupylab.load_kernels(source='extern "C" __global__ void k(float* x) {}', **kw)


def test_a_given_out_is_ordered_after_its_producer_like_the_inputs(sim):
    """out= is written by the launch: a CAI v3 out's stream is waited on, and a DLPack out is
    asked to order its work before the launch stream (it was imported for the legacy
    stream), as the inputs are."""
    from conftest import FakeDLPack

    x = f32((4,), ptr=0x7F00_0000_1000)
    o = f32((4,), ptr=0x7F00_0000_2000, stream=0x77)
    cupylab.add(x, 1.0, out=o)
    assert (0x5700, 0x77) in sim["waits"]
    d = FakeDLPack((4,), ptr=0x7F00_0000_3000)
    cupylab.add(x, 1.0, out=d)
    assert d.asked_stream == 0x5700
    with pytest.raises(TypeError, match="Cannot cast ufunc 'add' output from"):
        cupylab.add(x, x, out=FakeCAI((4,), "<i4", ptr=0x7F00_0000_4000))


def test_device_scalars_are_ordered_after_their_producers(sim):
    """lr, step, found_inf, scales: imported for the launch stream and waited on like the
    lists' arrays (a found_inf still being written on its producer's stream was read early)."""
    import types

    from conftest import FakeDLPack
    from cupylab.ops import multi_tensor as F

    plan = types.SimpleNamespace(device=0)
    cai = FakeCAI((1,), "<f4", ptr=0x7F00_0000_5000, stream=0x77)
    assert F.device_scalar("op", "found_inf", cai, plan, stream=0x5700) == 0x7F00_0000_5000
    assert (0x5700, 0x77) in sim["waits"]
    d = FakeDLPack((1,), ptr=0x7F00_0000_6000)
    F.device_scalar("op", "lr", d, plan, stream=0x5700)
    assert d.asked_stream == 0x5700
    with pytest.raises(TypeError, match="op: lr must be a one-element float32 GPU array"):
        F.device_scalar("op", "lr", FakeCAI((2,), "<f4"), plan, stream=0x5700)


def test_stream_argument_refuses_objects_that_are_not_streams():
    from cupylab import _launch

    class Event:
        ptr = 0x1234

    class MemoryPointer:
        ptr = 0x7F00_0000_0000

    for bad in (True, Event(), MemoryPointer()):
        with pytest.raises(TypeError, match="stream must be a stream"):
            _launch.resolve_stream(bad)
    assert _launch.resolve_stream(7) == 7


def test_weakly_typed_jax_scalars_promote_like_python_numbers():
    """jnp.asarray(2.0) is weakly typed: JAX promotes it like a Python float (a bfloat16
    array stays bfloat16); its key must say so, not 'a 0-d float32 array'."""
    from cupylab import _dtypes, _promotion

    class WeakScalar:
        weak_type = True

    class StrongScalar:
        weak_type = False

    v = View(0x1000, (), (), _dtypes.from_name("float32"), 0, True, None, "jax", None)
    assert _promotion.operand_key(WeakScalar(), v) == ("w", "float")
    assert _promotion.operand_key(StrongScalar(), v) == ("a", "float32", True)
    vi = View(0x1000, (), (), _dtypes.from_name("int32"), 0, True, None, "jax", None)
    assert _promotion.operand_key(WeakScalar(), vi) == ("w", "int")


def test_subclasses_of_python_numbers_are_taken_as_operands(sim):
    """An IntEnum member or a float subclass is a strong int64 / float64 scalar (as NumPy
    takes it): its value was read with .item(), which they lack (AttributeError)."""
    import enum

    class Level(enum.IntEnum):
        HIGH = 3

    class Meters(float):
        pass

    x = FakeCAI((4,), typestr="<f8")
    o = FakeCAI((4,), typestr="<f8", ptr=0x7F10_0000_0000)
    cupylab.add(x, Meters(2.5), out=o)
    cupylab.multiply(x, Level.HIGH, out=o)
    a, b = sim["launches"]
    assert 2.5 in a["args"] and 3.0 in b["args"]
