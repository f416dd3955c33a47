"""cupylab.cross_entropy_backward on the GPU against the float64 reference: every dtype, row
lengths from 1 to 300,000, contiguous / strided / offset / transposed logits, outputs whose
alignment differs from the logits' (the element-by-element path), in place, the three
reductions with every form of the loss gradient, ignored and bad targets, and torch
autograd."""
import numpy as np
import pytest

import cupylab
from cupylab import reference as R

from gpu_util import FLOATS, cupy_from_host, from_host, np_dtype, to_host
from test_rowwise_gpu import check, place

pytestmark = pytest.mark.gpu

SHAPES = [(0, 10), (1, 1), (199, 3), (199, 33), (64, 1000), (9, 4097), (3, 65537),
          (2, 128256), (1, 300000)]


def _setup(rows, cols, dt, layout, smooth, seed=0):
    rng = np.random.default_rng(rows * 7 + cols + seed)
    h = (rng.standard_normal((rows, cols)) * 2.0).astype(np_dtype(dt))
    h, x = place("cupy", h, layout)
    t = rng.integers(0, cols, size=rows).astype(np.int64)
    if rows > 3:
        t[::4] = -100
    td = cupy_from_host(t)
    _, lse = cupylab.cross_entropy(x, td, label_smoothing=smooth, return_lse=True)
    grad = R.ROWWISE_REFERENCES["cross_entropy"](h, t, -100, smooth)[2]
    return rng, h, x, t, td, lse, grad


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("layout", ["contig", "strided", "offset", "transposed"])
def test_reductions_and_loss_gradients(rows, cols, dt, layout):
    smooth = 0.1 if cols % 2 else 0.0
    rng, h, x, t, td, lse, grad = _setup(rows, cols, dt, layout, smooth)
    n = max(1, int(np.sum(t != -100)))
    sdt = "float64" if dt == "float64" else "float32"
    kw = dict(label_smoothing=smooth)
    # mean, the loss gradient a 0-d array of the accumulation type
    g0 = cupy_from_host(np.array(3.0, dtype=np_dtype(sdt)))
    got = cupylab.cross_entropy_backward(x, td, lse, g0, reduction="mean", **kw)
    check(got, grad * (3.0 / n), dt, 1, "mean")
    # sum, no loss gradient (1)
    check(cupylab.cross_entropy_backward(x, td, lse, reduction="sum", **kw), grad, dt, 1, "sum")
    # none, one loss gradient a row (of the logits' dtype)
    gr = rng.standard_normal(rows).astype(np_dtype(dt))
    got = cupylab.cross_entropy_backward(x, td, lse, cupy_from_host(gr), reduction="none", **kw)
    check(got, grad * gr.astype(np.float64)[:, None], dt, 1, "none")


@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("rows,cols", [(9, 4097), (3, 32000), (2, 65536)])
def test_an_output_of_another_alignment_and_in_place(rows, cols, dt):
    """out starting one element into its buffer (its 16-byte words are not the logits'): the
    element-by-element path; out = logits: the gradient replaces them."""
    rng, h, x, t, td, lse, grad = _setup(rows, cols, dt, "contig", 0.0, seed=1)
    import cupy as cp

    buf = cp.full((rows * cols + 1,), np.nan, dtype=x.dtype)
    out = buf[1:].reshape(rows, cols)
    r = cupylab.cross_entropy_backward(x, td, lse, 0.5, reduction="sum", out=out)
    assert r is out
    check(out, grad * 0.5, dt, 1, "offset out")
    assert np.isnan(to_host(buf[:1]).astype(np.float64)).all()  # the element before untouched
    n = max(1, int(np.sum(t != -100)))
    assert cupylab.cross_entropy_backward(x, td, lse, out=x) is x
    check(x, grad / n, dt, 1, "in place")


def test_broadcast_loss_gradient_and_a_python_number():
    """reduction='none' with the loss gradient of ``loss.sum()`` (one value broadcast to every
    row, stride 0) and with a 0-d array; a NumPy scalar as the loss gradient."""
    import cupy as cp

    rng, h, x, t, td, lse, grad = _setup(50, 1000, "float32", "contig", 0.0, seed=2)
    g = cp.broadcast_to(cp.asarray(np.float32(2.0)), (50,))
    check(cupylab.cross_entropy_backward(x, td, lse, g, reduction="none"), grad * 2, "float32")
    g0 = cp.asarray(np.float32(-1.5))
    check(cupylab.cross_entropy_backward(x, td, lse, g0, reduction="none"), grad * -1.5,
          "float32")
    check(cupylab.cross_entropy_backward(x, td, lse, np.float32(4.0), reduction="sum"),
          grad * 4, "float32")


def test_ignored_and_bad_targets_int32_and_no_counted_row():
    h = np.random.default_rng(3).standard_normal((4, 50)).astype(np.float32)
    x = cupy_from_host(h)
    t = np.array([3, 50, -1, -100], dtype=np.int32)
    td = cupy_from_host(t)
    _, lse = cupylab.cross_entropy(x, td, reduction="none", return_lse=True)
    g = to_host(cupylab.cross_entropy_backward(x, td, lse, reduction="sum"))
    ref = R.ROWWISE_REFERENCES["cross_entropy"](h, t.astype(np.int64))[2]
    np.testing.assert_allclose(g[0], ref[0], rtol=1e-5, atol=1e-7)
    assert np.isnan(g[1]).all() and np.isnan(g[2]).all() and (g[3] == 0).all()
    # every row ignored: the mean's scale is 0, the gradient 0 (torch's)
    ti = cupy_from_host(np.full(4, -100, dtype=np.int64))
    assert (to_host(cupylab.cross_entropy_backward(x, ti, lse)) == 0).all()


def test_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    for dt, tol in ((torch.float32, (1e-5, 1e-7)), (torch.bfloat16, (2e-2, 1e-5))):
        x = torch.tensor(rng.standard_normal((128, 5000)), dtype=dt, device="cuda")
        t = torch.tensor(rng.integers(0, 5000, 128), device="cuda")
        t[::5] = -100
        xr = x.clone().requires_grad_()
        loss = torch.nn.functional.cross_entropy(xr.float(), t, label_smoothing=0.1)
        (loss * 7.0).backward()
        _, lse = cupylab.cross_entropy(x, t, label_smoothing=0.1, return_lse=True)
        g = cupylab.cross_entropy_backward(x, t, lse, torch.tensor(7.0, device="cuda"),
                                           label_smoothing=0.1)
        assert isinstance(g, torch.Tensor) and g.dtype == dt
        torch.testing.assert_close(g.float(), xr.grad.float(), rtol=tol[0], atol=tol[1])


def test_on_a_torch_stream():
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    rng = np.random.default_rng(9)
    h = rng.standard_normal((64, 3000)).astype(np.float32)
    t = rng.integers(0, 3000, 64)
    with torch.cuda.stream(s):
        x = from_host("torch", h)
        td = torch.tensor(t, device="cuda")
        _, lse = cupylab.cross_entropy(x, td, return_lse=True)
        g = cupylab.cross_entropy_backward(x, td, lse, reduction="sum")
    s.synchronize()
    ref = R.ROWWISE_REFERENCES["cross_entropy"](h, t)[2]
    np.testing.assert_allclose(g.cpu().numpy(), ref, rtol=1e-5, atol=1e-7)
