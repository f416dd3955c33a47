"""The lean path of add_rms_norm over a float32 residual stream (cupylab.ops._resfast) without
a GPU, on the fake framework of test_rowfast_cpu.py: the arguments it launches are the general
path's (resnorm.layout and _pack on the same arrays), the backward's column sum, and what it
leaves to the general path."""
import numpy as np
import pytest

from cupylab import _arrays
from cupylab.ops import _resfast as RF, _rowcore as rc, resnorm as R

from test_rowfast_cpu import F16, F32, F64, Arr, fake  # noqa: F401 (fake: a fixture)


@pytest.fixture
def lean(fake, monkeypatch):
    monkeypatch.setattr(RF, "_plans", {})
    return fake


def _general_tail(shape, arrays, w=None):
    views = [None if a is None else _arrays.as_view(a, "t") for a in arrays]
    wv = None if w is None else _arrays.as_view(w, "t")
    lay = R.layout("t", shape, views, wv)
    assert lay.quad_ok
    return R._pack((0,) * 8, lay)[8:-1]


def test_forward_arguments_are_the_general_paths(lean):
    x, r, w = Arr((3, 5, 512), F16), Arr((3, 5, 512), F32), Arr((512,), F32)
    y, h, rstd = RF.forward(x, r, w, 1e-6, F16, True)
    assert y.dtype == F16 and h.dtype == F32 and rstd.shape == (3, 5) and rstd.dtype == F32
    name, grid, block, _, args, _ = lean[0]
    assert name == R.kernel_name("fwd", R.F16, R.F16, (256, 32, 4))
    assert (grid, block) == (2, 256)  # 15 rows, 8 a block
    assert args[:8] == (x.ptr, r.ptr, y.ptr, h.ptr, 0, w.ptr, rstd.ptr, 0)
    assert args[8:-1] == _general_tail(x.shape, [x, r, y, h]) and args[-1] == 1e-6
    # the plan is kept; without dtype= y is float32; no weight, no statistics
    y2, h2 = RF.forward(Arr((3, 5, 512), F16), Arr((3, 5, 512), F32), None, 0, None, False)
    assert y2.dtype == F32 and lean[1][4][5] == 0 and lean[1][4][6] == 0
    assert len(RF._plans) == 2


def test_backward_arguments_and_column_sum(lean):
    dy, h, dh = Arr((300, 512), F16), Arr((300, 512), F32), Arr((300, 512), F32)
    w, rstd = Arr((512,), F32), Arr((300,), F32)
    g, gx, dw = RF.backward(dy, h, w, rstd, dh, F16, True)
    assert g.dtype == F32 and gx.dtype == F16 and dw.shape == (512,)
    row, cs = lean
    assert row[0] == R.kernel_name("bwd", R.F16, R.F16, (256, 64, 2))
    assert row[1] == R.backward_grid(300, (256, 64, 2), 132) and row[2] == 256
    assert row[4][:7] == (dy.ptr, h.ptr, dh.ptr, g.ptr, gx.ptr, w.ptr, rstd.ptr) and row[4][7]
    assert row[4][8:-1] == _general_tail(h.shape, [dy, h, dh, g, gx])
    assert cs[0] == "cl::col_sum<float, float>" and cs[4] == (row[4][7], 0, row[1], 512,
                                                               dw.ptr, 0)
    # a float32 branch: dx is dresidual; no dh, no weight gradient: no partial sums
    g, gx, dw = RF.backward(Arr((300, 512), F32), h, w, rstd, None, None, False)
    assert gx is g and dw is None and len(lean) == 3
    assert lean[2][4][2] == 0 and lean[2][4][4] == 0 and lean[2][4][7] == 0
    assert lean[2][4][8:-1] == _general_tail(h.shape, [Arr((300, 512)), h, None, g, None])


@pytest.mark.parametrize("case", ["same dtype", "same dtype asked", "long rows", "odd rows",
                                  "misaligned", "strided", "float64 x", "16-bit weight",
                                  "dtype by name", "other device"])
def test_what_it_leaves_to_the_general_path(lean, case, monkeypatch):
    x, r, w, dt = Arr((4, 512), F16), Arr((4, 512), F32), Arr((512,), F32), F16
    if case == "same dtype":
        r, dt = Arr((4, 512), F16), None
    elif case == "same dtype asked":
        x, dt = Arr((4, 512), F32), F32
    elif case == "long rows":
        x, r = Arr((4, 8200), F16), Arr((4, 8200), F32)
        w = None
    elif case == "odd rows":
        x, r, w = Arr((4, 30), F16), Arr((4, 30), F32), None
    elif case == "misaligned":
        x = Arr((4, 512), F16, ptr=Arr((1,)).ptr + 8)
    elif case == "strided":
        x = Arr((4, 512), F16, contig=False)
    elif case == "float64 x":
        x = Arr((4, 512), F64)
    elif case == "16-bit weight":
        w = Arr((512,), F16)
    elif case == "dtype by name":
        dt = "float16"
    elif case == "other device":
        r = Arr((4, 512), F32, dev=1)
    assert RF.forward(x, r, w, 1e-6, dt, False) is RF.MISS
    assert not lean


def test_backward_misses(lean):
    h, rstd = Arr((4, 512), F32), Arr((4,), F32)
    assert RF.backward(Arr((4, 512), F16), Arr((4, 512), F16), None, rstd, None, F16,
                       True) is RF.MISS  # h not float32
    assert RF.backward(Arr((4, 512), F16), h, None, Arr((5,), F32), None, F16,
                       True) is RF.MISS  # rstd of another row count
    assert RF.backward(Arr((4, 512), F16), h, None, rstd, Arr((4, 512), F16), F16,
                       True) is RF.MISS  # a 16-bit dh
    assert RF.backward(Arr((4, 512), F16), h, None, rstd, None, "float16",
                       True) is RF.MISS  # a dtype by name
    assert not lean
