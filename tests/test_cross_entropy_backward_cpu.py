"""cupylab.cross_entropy_backward without a GPU: its argument checks (named function and
parameter, nothing launched on a refusal) and the launches it makes, recorded by the ``sim``
fixture's pretend GPU (arrays describe made-up memory, never dereferenced)."""
import numpy as np
import pytest

import cupylab
from cupylab import _arrays
from cupylab.ops import _rowcore as rc
from cupylab.ops import cross_entropy as xent

from conftest import FakeCAI

_PTR = iter(range(0x7F10_0000_0000, 0x7F20_0000_0000, 1 << 24))
OP = "cross_entropy_backward"


def arr(shape, typestr="<f4", **kw):
    return FakeCAI(shape, typestr=typestr, ptr=kw.pop("ptr", next(_PTR)), **kw)


def inputs(rows=4, cols=64, typestr="<f4", lse="<f4"):
    return arr((rows, cols), typestr), arr((rows,), "<i8"), arr((rows,), lse)


def test_exported_with_a_docstring():
    assert OP in cupylab.__all__ and cupylab.cross_entropy_backward is xent.cross_entropy_backward
    doc = cupylab.cross_entropy_backward.__doc__
    assert "Parameters" in doc and "Raises" in doc and "grad_loss" in doc


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing must be a number in"),
    (dict(ignore_index=True), TypeError, "ignore_index must be an int"),
    (dict(grad_loss=True), TypeError, "grad_loss must be a real number"),
    (dict(grad_loss=float("inf")), ValueError, "grad_loss must be a finite number"),
    (dict(grad_loss=np.ones(())), TypeError, "grad_loss must be a CUDA device array"),
])
def test_scalar_arguments_are_checked(sim, kwargs, err, msg):
    x, t, lse = inputs()
    with pytest.raises(err, match=f"^{OP}: {msg}"):
        cupylab.cross_entropy_backward(x, t, lse, **kwargs)
    assert sim["launches"] == []


def test_array_arguments_are_checked(sim):
    x, t, lse = inputs()
    bad = [
        (lambda: cupylab.cross_entropy_backward(x, t, None), TypeError, "lse must be a CUDA"),
        (lambda: cupylab.cross_entropy_backward(x, arr((4,), "<f4"), lse), TypeError,
         "target must be int64 or int32"),
        (lambda: cupylab.cross_entropy_backward(x, arr((5,), "<i8"), lse), ValueError,
         r"target must have shape \(4,\)"),
        (lambda: cupylab.cross_entropy_backward(x, t, arr((4,), "<f8")), TypeError,
         "lse must be float32"),
        (lambda: cupylab.cross_entropy_backward(x, t, arr((3,))), ValueError,
         r"lse must hold one value per row \(4\)"),
        (lambda: cupylab.cross_entropy_backward(x, t, arr((4,), strides=(8,))), ValueError,
         "lse must be contiguous"),
        (lambda: cupylab.cross_entropy_backward(x, t, lse, arr((4,)), reduction="sum"),
         ValueError, r"grad_loss must have shape \(\) for reduction='sum'; got \(4,\)"),
        (lambda: cupylab.cross_entropy_backward(x, t, lse, arr((3,)), reduction="none"),
         ValueError, r"grad_loss must have shape \(\) or \(4,\) for reduction='none'"),
        (lambda: cupylab.cross_entropy_backward(x, t, lse, arr((), "<f8")), TypeError,
         r"grad_loss must be float32 \(got float64\)"),
        (lambda: cupylab.cross_entropy_backward(arr((4, 8), "<f2"), t, lse, arr((), "<f8")),
         TypeError, r"grad_loss must be float16 or float32 \(got float64\)"),
        (lambda: cupylab.cross_entropy_backward(arr((4, 0)), t, lse), ValueError,
         "logits has no classes"),
        (lambda: cupylab.cross_entropy_backward(x, t, lse, out=arr((4, 63))), ValueError,
         r"out has shape \(4, 63\), expected \(4, 64\)"),
        (lambda: cupylab.cross_entropy_backward(x, t, lse, out=arr((4, 64), "<f2")), TypeError,
         "out has dtype float16, expected float32"),
    ]
    for call, err, msg in bad:
        with pytest.raises(err, match=f"^{OP}: {msg}"):
            call()
    assert sim["launches"] == []


def test_out_must_not_overlap_the_other_inputs(sim):
    base = 0x7F30_0000_0000
    x, t, lse = arr((4, 8), ptr=base), arr((4,), "<i8", ptr=base + 0x10000), arr((4,))
    with pytest.raises(ValueError, match=f"{OP}: out overlaps logits"):
        cupylab.cross_entropy_backward(x, t, lse, out=arr((4, 8), ptr=base + 4))
    with pytest.raises(ValueError, match=f"{OP}: out overlaps target"):
        cupylab.cross_entropy_backward(x, t, lse, out=arr((4, 8), ptr=base + 0x10000 - 16))
    assert sim["launches"] == []


def test_dask_arrays_build_a_lazy_gradient():
    """With a Dask array among the operands the result is lazy (built without a GPU; the
    graph's wiring is tested in test_dask_cpu.py); a bad number is refused when it is made."""
    da = pytest.importorskip("dask.array")
    x = da.zeros((4, 8), chunks=2, dtype="f4")
    t = da.zeros((4,), chunks=2, dtype="i8")
    g = cupylab.cross_entropy_backward(x, t, da.zeros((4,), chunks=2, dtype="f4"))
    assert isinstance(g, da.Array) and g.shape == (4, 8) and g.dtype == np.float32
    with pytest.raises(ValueError, match=f"^{OP}: grad_loss must be a finite number"):
        cupylab.cross_entropy_backward(x, t, x[:, 0], float("nan"))


def test_launch_arguments_sum_with_a_number(sim):
    x, t, lse = inputs(rows=6, cols=1000)
    out = arr((6, 1000))
    r = cupylab.cross_entropy_backward(x, t, lse, 2.5, ignore_index=7, label_smoothing=0.1,
                                       reduction="sum", out=out)
    assert r is out
    (k,) = sim["launches"]
    assert k["name"] == "cl::ce_backward<float>" and k["stream"] == 0x5700
    assert k["block"] == (xent.CEB_THREADS, 1, 1)
    assert k["grid"] == (6, 1, 1)  # 1000 floats: 250 slots, one tile a row
    a = dict(zip(rc.PTR_ORDER, k["args"]))
    ptr = lambda o: o.__cuda_array_interface__["data"][0]  # noqa: E731
    assert (a["in0"], a["out0"], a["target"], a["st0"]) == (ptr(x), ptr(out), ptr(t), ptr(lse))
    assert a["loss"] == 0 and a["scale"] == 0  # the number rides in eps; no mean scale
    tail = k["args"][len(rc.PTR_ORDER):]
    assert tail[:5] == (6, 1000, 6, 7, 0)  # rows, cols, n1, ignore_index, flags
    assert tail[-2:] == (2.5, 0.1)


def test_launch_arguments_none_with_per_row_gradients(sim):
    """A per-row loss gradient of the logits' dtype (flag 8) read through slot 3's strides: a
    broadcast one (stride 0, what ``loss.sum().backward()`` hands over) and int32 targets."""
    x, lse = arr((6, 4096), "<f2"), arr((6,))
    t = arr((6,), "<i4")
    g = arr((6,), "<f2", strides=(0,))
    cupylab.cross_entropy_backward(x, t, lse, g, reduction="none", out=arr((6, 4096), "<f2"))
    (k,) = sim["launches"]
    assert k["name"] == "cl::ce_backward<cl::half_t>"
    assert k["grid"] == (6, 1, 1)  # 512 slots of 8 halves
    a = dict(zip(rc.PTR_ORDER, k["args"]))
    assert a["loss"] == g.__cuda_array_interface__["data"][0]
    tail = k["args"][len(rc.PTR_ORDER):]
    assert tail[4] == rc.FLAG_TARGET_I32 | xent.FLAG_DLOSS_T
    so, si = tail[5:9], tail[9:13]
    assert (so[3], si[3]) == (0, 0) and si[1] == 1  # broadcast gradient, int32 targets
    g2 = arr((6,), "<f4", strides=(8,))  # float32 (the accumulation type): no flag
    cupylab.cross_entropy_backward(x, t, lse, g2, reduction="none", out=arr((6, 4096), "<f2"))
    tail = sim["launches"][1]["args"][len(rc.PTR_ORDER):]
    assert tail[4] == rc.FLAG_TARGET_I32 and tail[9 + 3] == 2


def test_mean_counts_the_rows_first_and_long_rows_take_tiles(sim, monkeypatch):
    made = []

    def new_array(c, shape, dt):
        o = arr(shape, dt.str if hasattr(dt, "str") else "<f4")
        made.append(o)
        return o, _arrays.as_view(o, "output")

    monkeypatch.setattr(rc, "new_array", new_array)
    x, t, lse = inputs(rows=3, cols=300000)
    out = arr((3, 300000))
    cupylab.cross_entropy_backward(x, t, lse, out=out)
    aux, k = sim["launches"]
    assert aux["name"] == "cl::ce_aux<float>" and aux["grid"] == (1, 1, 1)
    scale = made[0].__cuda_array_interface__["data"][0]
    assert dict(zip(rc.PTR_ORDER, aux["args"]))["scale"] == scale
    a = dict(zip(rc.PTR_ORDER, k["args"]))
    assert a["scale"] == scale and a["loss"] == 0
    assert k["args"][-2] == 1.0  # grad_loss None: 1
    assert k["grid"] == (3, -(-(300000 + 4) // (4 * xent.CEB_SLOTS)), 1)


def test_no_rows_launches_nothing(sim):
    x, t, lse = inputs(rows=0, cols=5)
    out = arr((0, 5))
    assert cupylab.cross_entropy_backward(x, t, lse, reduction="sum", out=out) is out
    assert sim["launches"] == []
