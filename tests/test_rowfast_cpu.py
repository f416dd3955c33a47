"""The row-wise lean path (cupylab.ops._rowfast) without a GPU: a fake framework (arrays that
describe made-up device memory, never dereferenced) in place of torch/CuPy, the launches
recorded instead of run. What it takes, what it leaves to the general path (MISS: nothing
launched, nothing kept), and that a stored plan is reused and keyed on input alignment."""
import itertools
import types

import numpy as np
import pytest

from cupylab import _launch, _runtime
from cupylab.ops import _rowcore as rc, _rowfast as rf

F16, F32, F64 = np.dtype("float16"), np.dtype("float32"), np.dtype("float64")
_ptrs = itertools.count(0x7F0000000000, 1 << 20)


class Arr:
    """A fake GPU array: dtype, shape, address, contiguity, device."""

    def __init__(self, shape, dtype=F32, ptr=None, contig=True, dev=0):
        self.shape, self.dtype, self.contig, self.dev = tuple(shape), np.dtype(dtype), contig, dev
        self.ptr = next(_ptrs) if ptr is None else ptr

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "version": 3}


def _probe(a):
    return (a.dtype, a.shape, a.ptr, a.dev) if a.contig else None


def _new(like, shape, fdt):
    o = Arr(like.shape if shape is None else shape, like.dtype if fdt is None else fdt)
    return o, o.ptr


@pytest.fixture
def fake(monkeypatch):
    """The fake framework registered, device 0 current (cc 9.0, 132 SMs), launches recorded."""
    acc = {F16: F32, F32: F32, F64: F64}
    monkeypatch.setitem(rf._frameworks, Arr, (_probe, _new, lambda dev: 0, acc))
    monkeypatch.setattr(rf, "_get_device", lambda: 0)
    monkeypatch.setattr(rf, "_plans", {})
    info = types.SimpleNamespace(cc=90, sm_count=132, max_smem_optin=232448)
    monkeypatch.setattr(_runtime, "device_info", lambda dev: info)
    monkeypatch.setattr(rc, "_opt_in", lambda *a: None)
    seen = []

    def launch(self, device, grid, block, stream, args, shared_mem=0, grid_yz=(1, 1), **kw):
        seen.append((self.name_expression, grid, block, shared_mem, tuple(args), grid_yz))

    monkeypatch.setattr(_launch.Kernel, "launch", launch)
    return seen


def test_softmax_takes_a_plain_array_and_reuses_its_plan(fake):
    x = Arr((4, 1000))
    y = rf.softmax("softmax", x, -1)
    assert isinstance(y, Arr) and y.shape == x.shape and y.dtype == F32
    (name, grid, block, smem, args, _), = fake
    assert name.startswith("cl::row_") and "<float, 0," in name
    assert args[0] == y.ptr and args[2] == x.ptr  # out0, in0
    assert args[13:16] == (4, 1000, 4)  # rows, cols, n1
    plan = rf._plans[("softmax", F32, (4, 1000), 0, 0)]
    rf.softmax("softmax", Arr((4, 1000)), 1)  # axis 1 of 2 is the last one
    assert len(rf._plans) == 1 and rf._plans[("softmax", F32, (4, 1000), 0, 0)] is plan
    assert fake[1][:4] == fake[0][:4]


def test_each_device_gets_its_own_plan(fake, monkeypatch):
    # a plan holds the first device's grid and shared-memory opt-in: a second device with the
    # same signature must plan (and opt in) for itself, not replay the first one's launch
    infos = {0: types.SimpleNamespace(cc=90, sm_count=132, max_smem_optin=232448),
             1: types.SimpleNamespace(cc=80, sm_count=108, max_smem_optin=166912)}
    monkeypatch.setattr(_runtime, "device_info", lambda dev: infos[dev])
    opted = []
    monkeypatch.setattr(rc, "_opt_in", lambda k, dev, smem: opted.append((dev, smem)))
    for dev in (0, 1):
        monkeypatch.setattr(rf, "_get_device", lambda dev=dev: dev)
        rf.softmax("softmax", Arr((50000, 2048), F16, dev=dev), -1)  # 16-bit: pipelined
    assert len(rf._plans) == 2
    assert fake[0][1] != fake[1][1]  # grids sized for 132 and 108 SMs
    assert [d for d, _ in opted] == [0, 1]


def test_an_address_off_16_bytes_gets_its_own_plan(fake):
    rf.softmax("softmax", Arr((4, 1000)), -1)
    rf.softmax("softmax", Arr((4, 1000), ptr=0x7F0000000004), -1)
    assert len(rf._plans) == 2
    assert fake[0][0] != fake[1][0]  # the register kernel, then the generic one
    assert fake[1][0].startswith("cl::row_generic")


def test_norm_results_and_arguments(fake):
    x, r = Arr((3, 5, 64), F16), Arr((3, 5, 64), F16)
    w = Arr((64,), F32)
    y, h, rstd = rf.norm("add_rms_norm", x, r, w, None, 1e-5, True, False)
    assert y.shape == h.shape == x.shape and rstd.shape == (3, 5) and rstd.dtype == F32
    args = fake[0][4]
    assert args[:8] == (y.ptr, h.ptr, x.ptr, r.ptr, w.ptr, 0, 0, rstd.ptr)
    assert args[17] == rc.FLAG_W_F32 and args[-2:] == (1e-5, 0.0)
    y2, h2 = rf.norm("add_rms_norm", x, r, None, None, 0, False, True)
    assert h2 is r  # in place
    y, mean, rstd = rf.norm("layer_norm", x, None, None, Arr((64,), F16), 1e-5, True, False)
    assert mean.shape == rstd.shape == (3, 5)
    assert fake[-1][4][5] != 0 and fake[-1][4][6] == mean.ptr  # bias, mean


def test_norm_backward_launches_the_column_sums(fake):
    """layer_norm_backward: the row kernel writes both partial-sum buffers, and one column-sum
    launch with two rows of blocks reduces them into dweight and dbias; rms_norm_backward: one
    row of blocks; no weight: no column sum."""
    x, dy = Arr((300, 512)), Arr((300, 512))
    w, rstd, mean = Arr((512,)), Arr((300,)), Arr((300,))
    dx, dw, db = rf.norm_backward("layer_norm_backward", dy, x, w, mean, rstd)
    assert dx.shape == x.shape and dw.shape == db.shape == (512,)
    row, cs = fake
    assert row[4][2:4] == (x.ptr, dy.ptr) and row[4][6:8] == (mean.ptr, rstd.ptr)
    assert row[4][8] and row[4][9]  # partial-sum buffers for dw and db
    assert cs[0].startswith("cl::col_sum") and cs[1] == 512 // rc.COL_SUM_W
    assert cs[4] == (row[4][8], row[4][9], cs[4][2], 512, dw.ptr, db.ptr) and cs[4][2] > 0
    assert cs[5] == (2, 1) and cs[2] == rc.COL_SUM_W * min(rc.COL_SUM_W, cs[4][2])
    dx, dw = rf.norm_backward("rms_norm_backward", dy, x, w, None, rstd)
    row, cs = fake[2:]
    assert cs[4] == (row[4][8], 0, cs[4][2], 512, dw.ptr, 0) and cs[5] == (1, 1)
    dx, dw = rf.norm_backward("rms_norm_backward", dy, x, None, None, rstd)
    assert dw is None and len(fake) == 5
    # two rows: one block's few partial rows, summed by a block of as many thread rows
    dx, dw = rf.norm_backward("rms_norm_backward", Arr((2, 512)), Arr((2, 512)), w, None,
                              Arr((2,)))
    row, cs = fake[5:]
    assert row[1] == 1 and 1 < cs[4][2] < rc.COL_SUM_W and cs[2] == rc.COL_SUM_W * cs[4][2]


def test_norm_backward_without_weight_gradients(fake):
    """weight_grad=False: the row kernel scales by the weight but writes no partial sums, and
    no column sum is launched."""
    x, dy = Arr((300, 512)), Arr((300, 512))
    w, rstd, mean = Arr((512,)), Arr((300,)), Arr((300,))
    dx, dw, db = rf.norm_backward("layer_norm_backward", dy, x, w, mean, rstd, False)
    assert dw is None and db is None and dx.shape == x.shape
    (row,) = fake
    assert row[4][4] == w.ptr and row[4][8] == row[4][9] == 0


@pytest.mark.parametrize("case", [
    "strided", "grad_dtype", "int", "empty_rows", "zero_cols", "0d", "other_device",
    "not_current", "eps_negative", "eps_bool", "weight_shape", "weight_dtype", "residual_shape",
    "mixed_types", "axis", "stats_dtype", "stats_size"])
def test_what_it_leaves_to_the_general_path(fake, case, monkeypatch):
    x = Arr((4, 8))
    w = Arr((8,))
    if case == "strided":
        r = rf.softmax("softmax", Arr((4, 8), contig=False), -1)
    elif case == "grad_dtype":
        r = rf.softmax_backward("softmax_backward", x, Arr((4, 8), F64))
    elif case == "int":
        r = rf.softmax("softmax", Arr((4, 8), "int32"), -1)
    elif case == "empty_rows":
        r = rf.norm("rms_norm", Arr((0, 8)), None, None, None, 1e-6, False, False)
    elif case == "zero_cols":
        r = rf.softmax("softmax", Arr((4, 0)), -1)
    elif case == "0d":
        r = rf.softmax("softmax", Arr(()), -1)
    elif case == "other_device":
        r = rf.norm("rms_norm", x, None, Arr((8,), dev=1), None, 1e-6, False, False)
    elif case == "not_current":
        monkeypatch.setattr(rf, "_get_device", lambda: 1)
        r = rf.softmax("softmax", x, -1)
    elif case == "eps_negative":
        r = rf.norm("rms_norm", x, None, w, None, -1.0, False, False)
    elif case == "eps_bool":
        r = rf.norm("rms_norm", x, None, w, None, True, False, False)
    elif case == "weight_shape":
        r = rf.norm("rms_norm", x, None, Arr((7,)), None, 1e-6, False, False)
    elif case == "weight_dtype":  # float32 weights go with 16-bit x only
        r = rf.norm("rms_norm", Arr((4, 8), F64), None, w, None, 1e-6, False, False)
    elif case == "residual_shape":
        r = rf.norm("add_rms_norm", x, Arr((4, 9)), None, None, 1e-6, False, False)
    elif case == "mixed_types":
        r = rf.norm("rms_norm", x, None, np.ones(8, np.float32), None, 1e-6, False, False)
    elif case == "axis":
        r = rf.softmax("softmax", x, 0)
    elif case == "stats_dtype":
        r = rf.norm_backward("rms_norm_backward", x, x, None, None, Arr((4,), F64))
    else:
        r = rf.norm_backward("rms_norm_backward", x, x, None, None, Arr((5,)))
    assert r is rf.MISS
    assert fake == [] and rf._plans == {}


def test_an_eps_the_general_path_refuses_is_left_to_it(fake):
    """eps=inf was launched (y all zeros) and an int eps past float's range raised
    OverflowError after the outputs were allocated; the general path refuses both
    (ValueError)."""
    x = Arr((4, 8))
    rf.norm("rms_norm", x, None, None, None, 1e-6, False, False)
    n = len(fake)
    for eps in (float("inf"), float("nan"), 10**400, True, -0.5):
        assert rf.norm("rms_norm", x, None, None, None, eps, False, False) is rf.MISS
    assert len(fake) == n
    rf.norm("rms_norm", x, None, None, None, 3, False, False)  # an int eps: taken, as float
    assert fake[-1][4][-2] == 3.0 and type(fake[-1][4][-2]) is float


def test_a_misaligned_weight_bias_or_statistics_is_left_to_the_general_path(fake):
    """Their addresses are not part of a plan's key: with a plan warm, a weight, bias or
    statistics array whose address is not a multiple of its item size (a byte-offset CuPy
    .view(), which the general path refuses) was launched on."""
    x = Arr((4, 8))
    rf.norm("layer_norm", x, None, Arr((8,)), Arr((8,)), 1e-6, False, False)
    rf.norm_backward("layer_norm_backward", x, x, Arr((8,)), Arr((4,)), Arr((4,)))
    n = len(fake)
    odd = next(_ptrs) + 2
    for r in (rf.norm("layer_norm", x, None, Arr((8,), ptr=odd), Arr((8,)), 1e-6, False, False),
              rf.norm("layer_norm", x, None, Arr((8,)), Arr((8,), ptr=odd), 1e-6, False, False),
              rf.norm_backward("layer_norm_backward", x, x, Arr((8,), ptr=odd), Arr((4,)),
                               Arr((4,))),
              rf.norm_backward("layer_norm_backward", x, x, Arr((8,)), Arr((4,), ptr=odd),
                               Arr((4,))),
              rf.norm_backward("layer_norm_backward", x, x, Arr((8,)), Arr((4,)),
                               Arr((4,), ptr=odd))):
        assert r is rf.MISS
    assert len(fake) == n


def test_an_inplace_residual_over_x_or_the_weight_is_left_to_the_general_path(fake):
    """h written into a residual that partly overlaps x or the weight is refused by the
    general path: the lean path must not launch it. An unaligned residual written in place
    is a planned operand, not a fresh output: it stays lean."""
    base = 0x7F10_0000_0000
    x, r = Arr((4, 64), ptr=base + 256), Arr((4, 64), ptr=base)
    assert rf.norm("add_rms_norm", x, r, None, None, 1e-6, False, True) is rf.MISS
    w = Arr((64,), ptr=base + 0x10000)
    r2 = Arr((4, 64), ptr=base + 0x10000 - 256)
    assert rf.norm("add_rms_norm", Arr((4, 64)), r2, w, None, 1e-6, False, True) is rf.MISS
    assert fake == []
    x3, r3 = Arr((4, 64)), Arr((4, 64), ptr=base + 0x20004)  # 4 bytes off 16
    y, h = rf.norm("add_rms_norm", x3, r3, None, None, 1e-6, False, True)
    assert h is r3 and len(fake) == 1
    y, h = rf.norm("add_rms_norm", x3, x3, None, None, 1e-6, False, True)  # exactly x: fine
    assert h is x3 and len(fake) == 2


def test_a_host_or_unknown_array_misses_without_a_gpu():
    assert rf.softmax("softmax", np.ones((2, 3), np.float32), -1) is rf.MISS
    assert rf.norm("rms_norm", [1.0, 2.0], None, None, None, 1e-6, False, False) is rf.MISS
