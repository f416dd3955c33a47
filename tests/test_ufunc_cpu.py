"""The NumPy drop-in's logic without a GPU: type resolution against NumPy's own results for every
dtype pair and scalar kind, and the planning decisions (kernel instance, vector width, rows
kernel, temporaries, argument packing) through a simulated runtime whose launches are recorded
(fake CUDA Array Interface operands, nothing compiled or run)."""
import struct
import types

import numpy as np
import pytest

import cupylab
from cupylab import _dtypes, _launch, _promotion, _runtime
from cupylab.ops import _fast, elementwise as ew

from conftest import FakeCAI

ml_dtypes = pytest.importorskip("ml_dtypes")
NAMES = [d.name for d in _dtypes.ARITHMETIC]
UFUNCS = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
          "true_divide": np.divide, "floor_divide": np.floor_divide}


def npdt(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def numpy_result(uf, *operands, **kw):
    """What NumPy itself computes (dtype) for these operands, or the exception type."""
    try:
        with np.errstate(all="ignore"):
            return uf(*operands, **kw).dtype.name
    except TypeError:
        return "TypeError"
    except OverflowError:
        return "OverflowError"


def ours(op, keys, **kw):
    try:
        return _promotion.resolve("numpy", op, keys, **kw)[1].name
    except (TypeError, OverflowError) as e:
        return type(e).__name__


# -- type resolution --------------------------------------------------------------------------
@pytest.mark.parametrize("op", list(UFUNCS))
def test_numpy_rule_every_dtype_pair(op):
    """Every pair of the 15 dtypes: the result dtype NumPy computes on real arrays (or its
    refusal) is the one cupylab resolves."""
    bad = []
    for a in NAMES:
        for b in NAMES:
            want = numpy_result(UFUNCS[op], np.ones(2, npdt(a)), np.ones(2, npdt(b)))
            got = ours(op, (("a", a, False), ("a", b, False)))
            if want != got:
                bad.append((a, b, want, got))
    assert not bad


@pytest.mark.parametrize("op", list(UFUNCS))
def test_numpy_rule_scalars_on_either_side(op):
    """Python scalars are weak (NEP 50), NumPy scalars and 0-d arrays are not."""
    bad = []
    for a in NAMES:
        arr = np.ones(2, npdt(a))
        for s, key in ((True, ("w", "bool")), (3, ("w", "int")), (2.5, ("w", "float")),
                       (1j, ("w", "complex")), (np.float32(2), ("s", "float32")),
                       (np.int64(3), ("s", "int64")), (np.array(2.0), ("s", "float64")),
                       (np.uint8(1), ("s", "uint8"))):
            for order in (0, 1):
                args = (arr, s) if order == 0 else (s, arr)
                keys = (("a", a, False), key) if order == 0 else (key, ("a", a, False))
                want = numpy_result(UFUNCS[op], *args)
                if a == "bfloat16" and key[0] == "w" and key[1] != "complex":
                    # cupylab's documented NEP 50 reading for bfloat16 (ml_dtypes versions
                    # differ: 0.7 keeps bfloat16, others give float32)
                    want = "bfloat16"
                got = ours(op, keys)
                if want != got:
                    bad.append((a, s, order, want, got))
    assert not bad


def test_numpy_rule_dtype_and_out_casting():
    f32, f64, i32 = ("a", "float32", False), ("a", "float64", False), ("a", "int32", False)
    D = _dtypes.DTYPES
    assert ours("add", (f64, f64), dtype=D["float32"]) == "float32"
    assert ours("add", (i32, i32), dtype=D["float64"]) == "float64"
    assert ours("add", (f64, f64), dtype=D["int32"]) == "TypeError"  # input cast refused
    assert ours("add", (f64, f64), dtype=D["int32"], casting="unsafe") == "int32"
    for out in NAMES:
        for casting in _dtypes.CASTING:
            want = numpy_result(np.add, np.ones(2, np.float32), np.ones(2, np.int32),
                                out=np.ones(2, npdt(out)), casting=casting)
            got = ours("add", (f32, i32), out=D[out], casting=casting)
            want = "float64" if want not in ("TypeError", "OverflowError") else want
            assert got == want, (out, casting)


def test_results_are_cached_per_combination(monkeypatch):
    keys = (("a", "int16", False), ("w", "float"))
    _promotion.resolve("numpy", "multiply", keys)
    monkeypatch.setattr(_promotion, "_RULES", {})  # a second lookup must not need the rule
    assert _promotion.resolve("numpy", "multiply", keys)[1].name == "float64"


def test_torch_rule():
    torch = pytest.importorskip("torch")
    keys = (("a", "int32", False), ("a", "int32", False))
    assert _promotion.resolve("torch", "true_divide", keys)[1].name == str(
        torch.get_default_dtype()).split(".")[1]
    zero_d = (("a", "float32", False), ("a", "float64", True))  # 0-d tensors: category only
    assert _promotion.resolve("torch", "add", zero_d)[1].name == "float32"
    with pytest.raises(TypeError, match="with a bool tensor is not supported"):
        _promotion.resolve("torch", "subtract", (("a", "bool", False), ("a", "bool", False)))


# -- planning through a simulated runtime ------------------------------------------------------
class Sim:
    def __init__(self, monkeypatch):
        self.calls = []
        self.allocated = []
        self.alloc_streams = []
        monkeypatch.setattr(_runtime, "pointer_device", lambda p: 0)
        monkeypatch.setattr(_runtime, "current_device", lambda: 0)
        monkeypatch.setattr(_runtime, "device_info",
                            lambda d: types.SimpleNamespace(sm_count=132, cc=90))
        monkeypatch.setattr(_launch, "ensure_device", lambda d: _launch._NULL)
        monkeypatch.setattr(_launch, "current_stream", lambda kind, d: 7)
        monkeypatch.setattr(_launch, "streaming_smem", lambda k, d: 0)
        monkeypatch.setattr(_launch.Kernel, "function", lambda self, d: id(self))
        monkeypatch.setattr(_launch, "_driver_launch", self._record)
        monkeypatch.setattr(ew, "allocate", self._allocate)

    def _record(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        # a kernel launched on a real GPU earlier in the session keeps its CUfunction handle
        k = next(k for k in ew._kernels.values() if id(k) == f or f in k._fns.values())
        args = struct.unpack_from(k._struct.format, k._tls.bp[0])
        self.calls.append((k.name_expression, (gx, gy, gz), stream, args))

    def _allocate(self, kind, shape, dt, device, stream=None):
        a = FakeCAI(shape, dt.typestr, ptr=0x7E0000000000 + 4096 * len(self.allocated))
        self.allocated.append(a)
        self.alloc_streams.append(stream)
        return a


@pytest.fixture
def sim(monkeypatch):
    return Sim(monkeypatch)


def cai(shape, typestr, ptr, strides=None):
    return FakeCAI(shape, typestr, ptr=ptr, strides=strides)


BASE = 0x7F0000000000


def test_mixed_dtypes_one_vectorised_pass(sim):
    """float32 + float16 -> float32: one ew_contig instance reading each operand in its own
    dtype, 4 elements per thread (16 bytes of float32, 8 of float16)."""
    x, y, o = cai((1000,), "<f4", BASE), cai((1000,), "<f2", BASE + 8192), cai((1000,), "<f4", BASE + 16384)
    assert cupylab.add(x, y, out=o) is o
    ((name, grid, stream, args),) = sim.calls
    assert name == "cl::ew_contig<float, float, cl::half_t, float, float, 0, 4, true>"
    assert grid == (1, 1, 1) and stream == 7
    assert args[:4] == (BASE + 16384, BASE, BASE + 8192, 0) and args[-3:] == (250, 0, 0)


def test_mixed_alignment_offsets_peel_a_common_head(sim):
    """int64 + int32 with both operands one element past a vector boundary: the head of 1
    element is peeled, pointers advance by their own item sizes."""
    x = cai((99,), "<i8", BASE + 8)
    y = cai((99,), "<i4", BASE + 8192 + 4)
    o = cai((99,), "<i8", BASE + 16384 + 8)
    cupylab.add(x, y, out=o)
    ((name, _, _, args),) = sim.calls
    assert name == "cl::ew_contig<long long, long long, int, long long, long long, 0, 2, true>"
    assert args[:3] == (BASE + 16384 + 16, BASE + 16, BASE + 8192 + 8)
    assert args[-3:] == (49, 1, 0)
    sim.calls.clear()
    cupylab.add(x, cai((99,), "<i4", BASE + 8192), out=o)  # offsets differ: element-wise
    assert sim.calls[0][0].endswith(", 0, 1, false>")


def test_int_array_float_scalar_promotes_to_float64(sim):
    o = cai((10,), "<f8", BASE + 4096)
    cupylab.multiply(cai((10,), "<i4", BASE), 0.5, out=o)
    ((name, _, _, args),) = sim.calls
    assert name == "cl::ew_contig<double, int, double, double, double, 2, 2, false>"
    assert args[4:7] == (0.0, 0.5, 0.0)


def test_out_cast_and_dtype_keyword(sim):
    x = cai((64,), "<f8", BASE)
    cupylab.add(x, x, out=cai((64,), "<f4", BASE + 4096))  # float64 computed, cast to float32
    assert sim.calls[-1][0] == "cl::ew_contig<float, double, double, double, double, 0, 2, true>"
    cupylab.add(x, x, out=cai((64,), "<f2", BASE + 8192), dtype="float32")
    assert sim.calls[-1][0] == ("cl::ew_contig<cl::half_t, double, double, float, float, 0, 2, "
                                "true>")
    cupylab.subtract(x, 1, out=(cai((64,), "<f8", BASE + 16384),))  # a 1-tuple out
    assert sim.calls[-1][0].startswith("cl::ew_contig<double, double, double, double, double, 1")


def test_complex_scalar_is_packed_as_two_parts(sim):
    o = cai((16,), "<c8", BASE + 4096)
    cupylab.add(cai((16,), "<c8", BASE), 1.5 - 2j, out=o)
    args = sim.calls[-1][3]
    assert struct.unpack("<ff", args[5]) == (1.5, -2.0) and args[4] == bytes(8)


def test_partial_overlap_computes_through_a_temporary(sim):
    """out = x shifted by one element: compute into a temporary of out's dtype, then a copy
    kernel writes out (NumPy's answer); both on the call's stream."""
    x = cai((100,), "<f4", BASE)
    y = cai((99,), "<f4", BASE + 8192)
    out = cai((99,), "<f4", BASE + 4)
    cupylab.add(cai((99,), "<f4", BASE), y, out=out)
    assert len(sim.allocated) == 1 and len(sim.calls) == 2
    # the temporary is dropped when the call returns: its memory goes back behind the
    # call's stream (allocate's stream), not under the two kernels still queued there
    assert sim.alloc_streams == [7]
    (n1, _, s1, a1), (n2, _, s2, a2) = sim.calls
    tmp = sim.allocated[0].__cuda_array_interface__["data"][0]
    assert ", 0, " in n1 and a1[0] == tmp
    assert n2 == "cl::ew_contig<float, float, float, float, float, 6, 1, false>"
    assert a2[:2] == (BASE + 4, tmp) and s1 == s2 == 7
    del x
    sim.calls.clear()
    xx = cai((99,), "<f4", BASE)
    cupylab.add(xx, y, out=xx)  # exactly in place: no temporary
    assert len(sim.calls) == 1 and len(sim.allocated) == 1


def test_all_scalar_operands(sim, monkeypatch):
    monkeypatch.setattr(_runtime, "cupy", lambda: types.SimpleNamespace(asarray=np.asarray))
    r = cupylab.add(2, 2.0)
    assert r.shape == () and r.dtype == np.float64 and r == 4.0
    assert cupylab.floor_divide(7, -2) == -4 and cupylab.divide(1, 4).dtype == np.float64
    assert cupylab.add(np.float32(1), 2.0).dtype == np.float32  # strong NumPy scalar
    with pytest.raises(TypeError, match="subtract: numpy boolean subtract"):
        cupylab.subtract(True, False)
    o = cai((5, 3), "<f4", BASE)
    cupylab.add(2, 3, out=o)  # scalars broadcast to out: one launch, no array read
    ((name, _, _, args),) = sim.calls
    assert name.startswith("cl::ew_contig<float, long long, long long") or ", false>" in name
    assert args[1:4] == (0, 0, 0)


@pytest.mark.parametrize("other_shape,strides,expect", [
    ((256,), None, "rows"), ((300, 1), None, "rows"), ((300, 256), (2048, 4), "rows"),
])
def test_rows_kernel_chosen_for_bias_shapes(sim, other_shape, strides, expect):
    x = cai((300, 256), "<f4", BASE)
    o = cai((300, 256), "<f4", BASE + (1 << 24))
    cupylab.add(x, cai(other_shape, "<f4", BASE + (1 << 26), strides=strides), out=o)
    name, grid, _, _ = sim.calls[-1]
    assert name.startswith("cl::ew_rows<") and grid[1] * grid[2] >= 300


def test_odd_rows_take_the_strided_kernel(sim):
    y = cai((300, 257), "<f4", BASE)
    cupylab.add(y, cai((257,), "<f4", BASE + (1 << 24)), out=cai((300, 257), "<f4", BASE + (1 << 26)))
    assert sim.calls[-1][0] == "cl::ew_strided<float, float, float, float, float, 0, int>"


def test_rows_kernel_mixed_dtypes_and_more_rows_than_grid_y(sim):
    rows = 70001
    x = cai((rows, 128), "<f2", BASE)
    bias = cai((128,), "<f4", BASE + (1 << 30))
    cupylab.add(x, bias, out=cai((rows, 128), "<f4", BASE + (1 << 31)))
    name, grid, _, args = sim.calls[-1]
    assert name == "cl::ew_rows<float, cl::half_t, float, float, float, 0, 4>"
    assert grid[1] * grid[2] >= rows and grid[2] > 1


def test_strided_kernel_packs_dims(sim):
    x = cai((8, 9, 10), "<f8", BASE, strides=(8, 64 * 10, 64))  # a transposed view
    o = cai((8, 9, 10), "<f8", BASE + (1 << 24))
    cupylab.multiply(x, 2, out=o)
    name, _, _, args = sim.calls[-1]
    assert name == "cl::ew_strided<double, double, double, double, double, 2, int>"
    assert args[7:9] == (720, 2) and struct.unpack("8i", args[9])[:2] == (8, 90)


def test_prepare_argument_errors(sim):
    a = cai((10,), "<f4", BASE)
    with pytest.raises(TypeError, match="prepare: 'sum' is not a cupylab operator"):
        cupylab.prepare(sum, a)
    with pytest.raises(TypeError, match=r"prepare: fused_add_mul takes 3 operands \(a, b, s\), "
                                        "got 2"):
        cupylab.prepare(cupylab.fused_add_mul, a, a)
    with pytest.raises(ValueError, match="out has shape"):
        cupylab.prepare(cupylab.add, a, a, out=cai((9,), "<f4", BASE + 4096))
    with pytest.raises(ValueError, match="prepare: add: out overlaps an input"):
        cupylab.prepare(cupylab.add, a, a, out=cai((10,), "<f4", BASE + 4))
    call = cupylab.prepare(cupylab.add, a, cai((10,), "<f2", BASE + 8192),
                           out=cai((10,), "<f4", BASE + 4096))
    assert "grid=1" in repr(call) and not sim.calls  # nothing launched until called


def test_lean_path_only_where_the_dtype_is_kept():
    """The lean path takes same-dtype calls whose result keeps the dtype; the rest (integer
    true division, bool subtract, complex floor division) go to the general path."""
    ok = ew.same_dtype_result
    D = _dtypes.DTYPES
    assert ok(ew.OPS["true_divide"], D["float16"]) and not ok(ew.OPS["true_divide"], D["int32"])
    assert not ok(ew.OPS["subtract"], D["bool"]) and ok(ew.OPS["add"], D["bool"])
    assert not ok(ew.OPS["floor_divide"], D["complex64"]) and ok(ew.OPS["floor_divide"], D["uint8"])
    i32 = D["int32"]
    assert _fast._scalar(2, 1, None, i32) == 2 and _fast._scalar(2.5, 1, None, i32) is None
    assert _fast._scalar(True, 1, None, i32) is None and _fast._scalar(1, 1, None, D["bool"]) is None
    assert _fast._scalar(2**40, 1, None, i32) is None  # out of range: the general path raises
    assert _fast._overlaps(1000, 40, ((1004, 40),)) and not _fast._overlaps(1000, 40, ((1000, 40),))
    assert _fast._overlaps(1000, 40, ((1000, 20),)) and not _fast._overlaps(1000, 40, ((1040, 8),))


def test_kernel_formats_come_from_the_c_signatures():
    D = _dtypes.DTYPES
    t = (D["complex128"], D["float64"], D["complex64"], D["complex128"], D["complex128"])
    k = ew.kernel("contig", ew.OPS["add"], t, (1, False))
    assert k._struct.format == "@QQQQ16s16s16sqqq"
    k = ew.kernel("strided", ew.OPS["add"], (D["bfloat16"],) * 5, ("long long",))
    assert k._struct.format == f"@QQQQHHHqi{8 * ew.MAXD}s{8 * ew.MAXD}s{8 * ew.MAXD}s" \
                               f"{8 * ew.MAXD}s{8 * ew.MAXD}s"
    assert f"-DCL_MAXD={ew.MAXD}" in k.program.options
    assert "-DCL_OP_FLOOR_DIVIDE=4" in k.program.options
    assert k.program.name_expressions == (k.name_expression,)  # one instance per program


def test_lean_mixed_launch_matches_contiguous_plan(monkeypatch):
    """The lean path's mixed-dtype launch packs the same kernel, grid and arguments as
    elementwise.contiguous_plan for every alignment mix (no GPU: the driver call is
    recorded)."""
    calls = []
    monkeypatch.setattr(_launch, "_driver_launch", lambda *a: calls.append(a))
    D = _dtypes.DTYPES
    base = 1 << 24
    for ta, tb, to in (("float32", "float16", "float32"), ("int64", "int32", "int64"),
                       ("uint8", "float32", "float32"), ("bfloat16", "float64", "float64")):
        a, b, o = D[ta], D[tb], D[to]
        types = (o, a, b, o, o)
        V = 16 // max(t.itemsize for t in types)
        karr = ew.kernel("contig", 0, types, (V, True))
        kscal = ew.kernel("contig", 0, types, (1, False))
        for h, k in enumerate((karr, kscal), 1):
            monkeypatch.setitem(k._fns, 0, h)
        info = (types, karr, kscal, V, tuple(t.itemsize for t in types[:4]), 0, None)
        ft = (o, a, b, a, o)  # fused_add_mul with s of a's dtype
        fkarr = ew.kernel("contig", 5, ft, (V, True))
        fkscal = ew.kernel("contig", 5, ft, (1, False))
        for h, k in enumerate((fkarr, fkscal), 3):
            monkeypatch.setitem(k._fns, 0, h)
        finfo = (ft, fkarr, fkscal, V, tuple(t.itemsize for t in ft[:4]), 0, None)
        for n in (1, 3, 7, 100, 1001):
            for eo in range(3):
                for ea in range(3):
                    ptrs = [base + eo * o.itemsize, base + (1 << 20) + ea * a.itemsize,
                            base + (2 << 20) + eo * b.itemsize, 0]
                    fptrs = ptrs[:3] + [base + (3 << 20) + eo * a.itemsize]
                    k, grid, bp, sizes = ew.contiguous_plan(5, ft, n, fptrs)
                    calls.clear()
                    _fast._launch_mixed(finfo, n, *fptrs, 0, 0)
                    (f, gx, *_), = calls
                    got = struct.unpack_from(k._struct.format, k._tls.bp[0])
                    assert f == k._fns[0] and gx == grid and got[:4] == bp
                    assert got[-3:] == sizes
                    k, grid, bp, sizes = ew.contiguous_plan(0, types, n, ptrs)
                    calls.clear()
                    _fast._launch_mixed(info, n, ptrs[0], ptrs[1], ptrs[2], 0, 0, 0)
                    (f, gx, *_), = calls
                    got = struct.unpack_from(k._struct.format, k._tls.bp[0])
                    where = f"{ta}+{tb} n {n} offsets {eo} {ea}"
                    assert f == k._fns[0] and gx == grid, where
                    assert got[:4] == bp and got[-3:] == sizes, where


def test_precompile_cli_fills_the_cache_without_a_gpu(tmp_path):
    """python -m cupylab precompile: the instances of every dtype pair compile into the cache
    (NVRTC only); a second run finds them all cached; bad arguments exit 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo), "CUPYLAB_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "cupylab", "precompile", "--arch", "sm_90", "--ops", "add",
           "--dtypes", "float32,float16", "--no-scalars", "--families", "elementwise",
           "--jobs", "2"]
    want = len(ew.instances(["add"], ["float32", "float16"], scalars=False))
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    assert f"{want} kernel instances for sm_90: {want} compiled, 0 already cached" in first
    assert len(list(tmp_path.glob("*.clbin"))) == want
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    assert f"0 compiled, {want} already cached" in again
    bad = subprocess.run(cmd[:6] + ["--ops", "power"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unknown operator 'power'" in bad.stderr
    bad = subprocess.run(cmd[:6] + ["--families", "fft"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unknown family 'fft'" in bad.stderr
    # nowhere to keep the kernels: exit 2 with the reason, not "N compiled ... into DIR"
    off = subprocess.run(cmd, capture_output=True, text=True,
                         env={**env, "CUPYLAB_CACHE_DISABLE": "1"})
    assert off.returncode == 2 and "the kernel cache is disabled" in off.stderr
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    untrusted = subprocess.run(cmd, capture_output=True, text=True,
                               env={**env, "CUPYLAB_CACHE_DIR": str(shared)})
    assert untrusted.returncode == 2 and "not private to this user" in untrusted.stderr


class FakeDeviceMemory:
    """Real ``cupy.ndarray`` objects over made-up device addresses (never dereferenced), so
    that the lean path's CuPy handlers run without a GPU; launches are recorded."""

    def __init__(self, monkeypatch):
        self.cp = pytest.importorskip("cupy")
        self.next = 0x7F0000000000
        self.calls = []
        monkeypatch.setattr(_fast, "_get_device", lambda: 0)
        monkeypatch.setattr(_fast, "_cupy_stream", lambda: types.SimpleNamespace(ptr=7))
        monkeypatch.setattr(_fast, "_cupy_ndarray", lambda shape, dt: self.array(shape, dt))
        monkeypatch.setattr(_launch.Kernel, "function", lambda self_, d: id(self_))
        monkeypatch.setattr(_launch, "streaming_smem", lambda k, d: 0)
        monkeypatch.setattr(_launch, "_driver_launch", self._record)

        def no_general(*a, **k):
            raise AssertionError("took the general path")

        monkeypatch.setattr(ew, "_run", no_general)

    def array(self, shape, dtype, offset=0):
        cp = self.cp
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        mem = cp.cuda.UnownedMemory(self.next, n + 4096, None, device_id=0)
        self.next += -(-(n + 4096) // (1 << 16)) * (1 << 16)  # 64 KiB-aligned bases
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, offset))

    def _record(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        k = next(k for k in ew._kernels.values() if id(k) == f or f in k._fns.values())
        self.calls.append((k.name_expression, struct.unpack_from(k._struct.format, k._tls.bp[0])))


def test_lean_cupy_path_takes_mixed_dtypes(monkeypatch):
    """Contiguous CuPy arrays of different dtypes (or an out of another dtype, or integer true
    division) launch from the lean path, reading each operand in its own dtype; a partial
    overlap, a scalar with mixed arrays or a refused combination go to the general path."""
    fm = FakeDeviceMemory(monkeypatch)
    x, y, o = fm.array((1000,), np.float32), fm.array((1000,), np.float16), fm.array((1000,), np.float32)
    assert cupylab.add(x, y, out=o) is o
    name, args = fm.calls[-1]
    assert name == "cl::ew_contig<float, float, cl::half_t, float, float, 0, 4, true>"
    assert args[:3] == (o.data.ptr, x.data.ptr, y.data.ptr) and args[-3:] == (250, 0, 0)
    r = cupylab.divide(fm.array((10,), np.int32), fm.array((10,), np.int32))
    assert r.dtype == np.float64 and fm.calls[-1][0] == (
        "cl::ew_contig<double, int, int, double, double, 3, 2, true>")
    o64 = fm.array((1000,), np.float64)
    cupylab.add(x, x, out=o64)  # same dtypes, an out of another dtype
    # NumPy computes float32 + float32 in float32, then casts into the float64 out
    assert fm.calls[-1][0] == "cl::ew_contig<double, float, float, float, float, 0, 2, true>"
    cupylab.fused_add_mul(x, y, y, out=o)
    assert fm.calls[-1][0] == "cl::ew_contig<float, float, cl::half_t, cl::half_t, float, 5, 4, true>"
    x1 = fm.array((999,), np.float32, offset=4)  # one element past the vector boundary
    y1 = fm.array((999,), np.float16, offset=2)
    o1 = fm.array((999,), np.float32, offset=4)
    cupylab.add(x1, y1, out=o1)
    name, args = fm.calls[-1]
    assert name.endswith(", 4, true>") and args[-3:] == (249, 3, 0)
    assert args[:3] == (o1.data.ptr + 12, x1.data.ptr + 12, y1.data.ptr + 6)
    cupylab.add(x, x, out=o)  # same dtype: the lean same-dtype path
    assert fm.calls[-1][0] == "cl::ew_contig<float, float, float, float, float, 0, 4, true>"
    general = []
    monkeypatch.setattr(ew, "_run", lambda *a, **k: general.append(a[0]) or "general")
    assert cupylab.add(x, y, out=x) is x  # exactly in place: lean
    big = fm.array((2000,), np.float32)
    assert cupylab.add(big[1:1001], y, out=big[:1000]) == "general"  # partial overlap
    assert cupylab.add(x, 2.0j) == "general"  # a complex scalar
    b = fm.array((10,), np.bool_)
    assert cupylab.subtract(b, b) == "general"  # refused: the general path raises
    assert general == ["add", "add", "subtract"]


def test_bfloat16_with_python_scalars_stays_bfloat16():
    pytest.importorskip("ml_dtypes")
    bf = ("a", "bfloat16", False)
    for w in ("bool", "int", "float"):
        for op in ("add", "subtract", "multiply", "true_divide", "floor_divide"):
            if op == "subtract" and w == "bool":
                continue
            assert _promotion.resolve("numpy", op, (bf, ("w", w)))[1].name == "bfloat16"
            assert _promotion.resolve("numpy", op, (("w", w), bf))[1].name == "bfloat16"
    assert _promotion.resolve("numpy", "add", (bf, ("w", "complex")))[1].name == "complex64"
    assert _promotion.resolve("numpy", "add", (bf, ("a", "float32", False)))[1].name == "float32"


def test_a_misaligned_cupy_view_is_refused_like_other_adapters():
    """A byte-offset view of another dtype (cp.zeros(64, uint8)[1:33].view(int32)) is not
    aligned to its item size: refused with the other adapters' ValueError, not launched into
    a misaligned-address fault."""
    cp = pytest.importorskip("cupy")
    from cupylab import _arrays

    mem = cp.cuda.UnownedMemory(0x7F0000000000, 4096, None, device_id=0)
    a = cp.ndarray((8,), np.int32, cp.cuda.MemoryPointer(mem, 1))
    with pytest.raises(ValueError, match="not aligned to its item size"):
        _arrays.as_view(a, "add: x1")
    ok = cp.ndarray((8,), np.int32, cp.cuda.MemoryPointer(mem, 4))
    assert _arrays.as_view(ok, "add: x1").ptr == 0x7F0000000004
