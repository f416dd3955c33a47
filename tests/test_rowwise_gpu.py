"""Row-wise operators on the GPU against float64 references (cupylab.reference): every dtype,
row lengths across every kernel class (sub-warp, warp, block, cluster, generic), 0/1/199 rows,
contiguous / strided-row / offset / transposed views, CuPy and torch, poisoned outputs,
special values, backward against the analytic references, finite differences and torch
autograd."""
import os

import numpy as np
import pytest

import cupylab
from cupylab import reference as R

from gpu_util import FLOATS, cupy_from_host, from_host, host_data, np_dtype, to_host

pytestmark = pytest.mark.gpu

TOL = {"float16": (4e-3, 4e-3), "bfloat16": (2e-2, 2e-2), "float32": (2e-5, 2e-5),
       "float64": (1e-11, 1e-11)}

# (rows, cols): every class of the ladder, the generic fallback, empty
SHAPES = [(0, 33), (1, 1), (199, 1), (199, 3), (199, 31), (199, 32), (199, 33), (199, 127),
          (199, 1000), (99, 2000), (60, 4097), (3, 10000), (3, 12000), (3, 16000), (3, 20000),
          (3, 24000), (3, 30000), (7, 40000), (3, 45000), (2, 60000), (5, 65537), (2, 90000),
          (2, 262144)]
# 10000 to 90000: each shared-memory cluster class of 16-bit and float32 rows (5, 6 and 8
# vectors a thread in 2 blocks (float32 10000 and 12000, 16-bit 20000 and 24000), 4 blocks,
# then 8 blocks) and the 1,024-thread one-block class between them (float32 16000, 16-bit
# 30000); 12000: the 4-block cluster class of float64
SHAPES_BIG = [(1, 300000)]  # beyond every register class: the generic kernel


def _tol(dt, scale=1.0):
    r, a = TOL[dt]
    return r * scale, a * scale


def check(got, ref, dt, scale=1.0, what=""):
    got = to_host(got).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    r, a = _tol(dt, scale)
    np.testing.assert_allclose(got, ref, rtol=r, atol=a, equal_nan=True, err_msg=what)


def make(rng, fw, rows, cols, dt, layout="contig", scale=4.0):
    """Host data (rounded to dt) and a device view with the requested layout."""
    return place(fw, (rng.standard_normal((rows, cols)) * scale).astype(np_dtype(dt)), layout)


def place(fw, h, layout="contig"):
    """``(h, a device view of h with the requested layout)``."""
    rows, cols = h.shape
    if layout == "contig":
        return h, from_host(fw, h)
    if layout == "strided":  # rows further apart than their length
        big = np.zeros((rows, cols + 5), dtype=h.dtype)
        big[:, 2:cols + 2] = h
        return h, from_host(fw, big)[:, 2:cols + 2]
    if layout == "offset":  # start one element in: rows start at odd addresses
        big = np.zeros((rows + 1, cols + 1), dtype=h.dtype)
        big[1:, 1:] = h
        return h, from_host(fw, big)[1:, 1:]
    if layout == "transposed":  # columns contiguous, rows strided: the generic kernel
        dev = from_host(fw, np.ascontiguousarray(h.T))
        return h, dev.T
    raise ValueError(layout)


def _fw(name):
    if name == "torch":
        pytest.importorskip("torch")
    return name


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_forward(op, rows, cols, dt):
    rng = np.random.default_rng(rows * 7919 + cols)
    h, x = make(rng, "cupy", rows, cols, dt)
    out = cupy_from_host(np.full((rows, cols), np.nan).astype(np_dtype(dt)))
    got = getattr(cupylab, op)(x, out=out)
    assert got is out
    check(got, R.ROWWISE_REFERENCES[op](h), dt, what=op)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("layout", ["strided", "offset", "transposed"])
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("rows,cols", [(37, 5), (33, 1000), (9, 4097), (3, 40000)])
def test_layouts_and_frameworks(fw, layout, dt, rows, cols):
    fw = _fw(fw)
    rng = np.random.default_rng(cols)
    h, x = make(rng, fw, rows, cols, dt, layout)
    y = cupylab.softmax(x)
    assert type(y).__module__.split(".")[0] == fw
    check(y, R.ROWWISE_REFERENCES["softmax"](h), dt, what="softmax")
    w = host_data(rng, (cols,), dt)
    yn, rstd = cupylab.rms_norm(x, from_host(fw, w), eps=1e-6, return_stats=True)
    ref, rref = R.ROWWISE_REFERENCES["rms_norm"](h, w, 1e-6)
    check(yn, ref, dt, 2, "rms_norm")
    check(rstd, rref, "float32" if dt != "float64" else dt, 1, "rstd")
    b = host_data(rng, (cols,), dt)
    yl, mean, rs = cupylab.layer_norm(x, from_host(fw, w), from_host(fw, b), return_stats=True)
    ref, mref, rref = R.ROWWISE_REFERENCES["layer_norm"](h, w, b, 1e-5)
    check(yl, ref, dt, 2, "layer_norm")
    check(mean, mref, "float32" if dt != "float64" else dt, 10, "mean")


def test_softmax_other_axis():
    rng = np.random.default_rng(3)
    h = rng.standard_normal((5, 6, 7)).astype(np.float32)
    x = cupy_from_host(h)
    for ax in (0, 1, -2):
        hm = np.moveaxis(h, ax, -1)
        ref = np.moveaxis(R.ROWWISE_REFERENCES["softmax"](hm), -1, ax)
        check(cupylab.softmax(x, axis=ax), ref, "float32", what=f"axis {ax}")
        ref = np.moveaxis(R.ROWWISE_REFERENCES["log_softmax"](hm), -1, ax)
        check(cupylab.log_softmax(x, axis=ax), ref, "float32", what=f"axis {ax}")


def _added(h, rh, dt):
    """add_rms_norm's h on the host: x + r in float64, rounded to dt."""
    return (h.astype(np.float64) + rh.astype(np.float64)).astype(np_dtype(dt))


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("rows,cols", SHAPES + SHAPES_BIG)
@pytest.mark.parametrize("wdt", ["same", "float32", None])
def test_norms_forward(rows, cols, dt, wdt):
    if wdt == "float32" and dt in ("float32", "float64"):
        pytest.skip("float32 weights are the mixed-precision form of 16-bit inputs")
    rng = np.random.default_rng(rows + 31 * cols)
    h, x = make(rng, "cupy", rows, cols, dt)
    w = b = None
    if wdt is not None:
        wd = dt if wdt == "same" else wdt
        w = (rng.standard_normal(cols) + 1).astype(np_dtype(wd))
        b = rng.standard_normal(cols).astype(np_dtype(wd))
    dev = (lambda a: cupy_from_host(a) if a is not None else None)
    sdt = "float64" if dt == "float64" else "float32"
    y, rstd = cupylab.rms_norm(x, dev(w), eps=1e-6, return_stats=True)
    ref, rref = R.ROWWISE_REFERENCES["rms_norm"](h, w, 1e-6)
    check(y, ref, dt, 2, "rms_norm")
    check(rstd, rref, sdt, 2, "rms rstd")
    y, mean, rstd = cupylab.layer_norm(x, dev(w), dev(b), eps=1e-5, return_stats=True)
    ref, mref, rref = R.ROWWISE_REFERENCES["layer_norm"](h, w, b, 1e-5)
    check(y, ref, dt, 2, "layer_norm")
    check(mean, mref, sdt, 10, "ln mean")
    check(rstd, rref, sdt, 10, "ln rstd")
    # add + rms_norm, out of place and in place
    rh = (rng.standard_normal((rows, cols)) * 4).astype(np_dtype(dt))
    hsum = _added(h, rh, dt)
    if w is None:
        w = np.ones(cols, dtype=np_dtype(dt))
    _check_add_rms_norm(x, cupy_from_host(rh), w, hsum, dt)


def _check_add_rms_norm(x, r, w, hsum, dt):
    """add_rms_norm of device x and r with host weight w against the host sum hsum (x + r
    rounded to dt): out of place, then in place (h written into r)."""
    y, hh = cupylab.add_rms_norm(x, r, cupy_from_host(w), eps=1e-6)
    check(hh, hsum, dt, 0.01, "add h")
    check(y, R.ROWWISE_REFERENCES["rms_norm"](hsum, w, 1e-6)[0], dt, 2, "add y")
    y2, h2 = cupylab.add_rms_norm(x, r, cupy_from_host(w), eps=1e-6, inplace=True)
    assert h2 is r
    check(r, hsum, dt, 0.01, "inplace h")
    check(y2, R.ROWWISE_REFERENCES["rms_norm"](hsum, w, 1e-6)[0], dt, 2, "inplace y")


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("cols,rpb", [(4096, 1), (33, 4)])  # rows a block of the class chosen
def test_add_rms_norm_one_row_an_sm_boundary(dt, cols, rpb):
    """16-bit add_rms_norm takes the pipelined kernel (rows of 4,096: row_few_kernel's
    exact-fit form) while each SM gets at most one block's rows, the plain kernel beyond: both
    sides of the boundary give the reference."""
    from cupylab import _runtime  # noqa: PLC0415

    sms = _runtime.device_info(0).sm_count
    for rows in (sms * rpb, sms * rpb + 1):
        rng = np.random.default_rng(rows + cols)
        h, x = make(rng, "cupy", rows, cols, dt)
        rh = rng.standard_normal((rows, cols)).astype(np_dtype(dt))
        w = (rng.standard_normal(cols) + 1).astype(np_dtype(dt))
        hsum = _added(h, rh, dt)
        y, hh = cupylab.add_rms_norm(x, cupy_from_host(rh), cupy_from_host(w), eps=1e-6)
        check(hh, hsum, dt, 0.01, f"h, {rows} rows")
        check(y, R.ROWWISE_REFERENCES["rms_norm"](hsum, w, 1e-6)[0], dt, 2, f"y, {rows} rows")


def test_softmax_special_values():
    for dt, big in (("float32", 3e38), ("float16", 6e4), ("bfloat16", 3e38), ("float64", 1e300)):
        h = np.array([[0.0, -np.inf, 1.0, -np.inf],
                      [-np.inf] * 4,
                      [big, -big, big / 2, 0.0],
                      [-big, -big, -big, -big]]).astype(np_dtype(dt))
        x = cupy_from_host(h)
        ref = R.ROWWISE_REFERENCES["softmax"](h)
        got = to_host(cupylab.softmax(x)).astype(np.float64)
        assert np.all(np.isnan(got[1])), "all -inf rows give NaN (like torch)"
        np.testing.assert_allclose(got[[0, 2, 3]], ref[[0, 2, 3]], rtol=1e-2, atol=1e-3)
        got = to_host(cupylab.log_softmax(x)).astype(np.float64)
        assert np.all(np.isnan(got[1]))
        assert got[0, 1] == -np.inf and np.isfinite(got[0, 0])


@pytest.mark.parametrize("dt", ["float32", "bfloat16", "float16"])  # 16-bit: packed max
@pytest.mark.parametrize("cols", [40000, 3000])  # 4 or 8 blocks a row; one block
def test_cluster_rows_combine_max_and_sum_pairs(dt, cols):
    """Cluster rows (40,000 columns: 4 or 8 blocks a row) reduce (max, sum) pairs across the
    blocks in one step: a block whose part of the row is all -inf adds nothing, an all -inf
    row gives NaN (like torch), a NaN or +inf anywhere makes the row NaN, and the values,
    losses and gradients match float64 elsewhere. The same rows in one block (3,000 columns)
    behave the same. Softmax and cross-entropy keep each element's exp (relative to the
    block's own maximum across a cluster) for the output: the -inf parts must come out 0 and
    the NaN rows NaN in the gradient too."""
    rng = np.random.default_rng(11)
    big = cols * 3 // 4
    h = (rng.standard_normal((6, cols)) * 4).astype(np_dtype(dt))
    h[1, :cols // 2] = -np.inf  # the first blocks' parts: no finite value
    h[2, :] = -np.inf
    h[3, cols - 1] = np.nan
    h[4, 5] = np.inf
    h[5, big] = 80.0  # one large logit in a late block: it sets the row's maximum
    x = cupy_from_host(h)
    ok = [0, 1, 5]
    for op in ("softmax", "log_softmax"):
        got = to_host(getattr(cupylab, op)(x)).astype(np.float64)
        assert np.isnan(got[[2, 3, 4]]).all(), op
        check(got[ok], R.ROWWISE_REFERENCES[op](h[ok]), dt, what=op)
    t = np.array([7, cols * 5 // 8, 3, 4, big, big])
    loss, g = cupylab.cross_entropy(x, cupy_from_host(t), reduction="none", return_grad=True)
    loss, g = to_host(loss), to_host(g).astype(np.float64)
    assert np.isnan(loss[[2, 3, 4]]).all()
    assert np.isnan(g[[2, 3, 4]]).all()
    assert (g[1, :cols // 2] == 0).all()
    rl, _, rg = R.ROWWISE_REFERENCES["cross_entropy"](h[ok], t[ok])
    check(loss[ok], rl, "float32", 10, "ce loss")
    check(g[ok], rg, dt, 1, "ce grad")


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,cols", [(4, 1000), (1, 300000)])  # a register and the generic kernel
def test_rms_norm_keeps_negative_zero(rows, cols, dt):
    """x * rstd * w of a -0 element is -0 (as torch computes it) in every kernel class: the rms
    norms add no bias term, which would turn -0 into +0."""
    h = np.random.default_rng(cols).standard_normal((rows, cols)).astype(np_dtype(dt))
    h[:, ::7] = -0.0
    y = to_host(cupylab.rms_norm(cupy_from_host(h), eps=1e-6)).astype(np.float64)
    assert np.all(y[:, ::7] == 0) and np.all(np.signbit(y[:, ::7]))
    ref = R.ROWWISE_REFERENCES["rms_norm"](h, None, 1e-6)[0]
    check(y, ref, dt, 2, "rms_norm")


def test_layer_norm_without_a_bias_keeps_negative_zero():
    """No bias adds nothing (torch skips the add): a -0 result stays -0, in the register and
    generic kernels (a +0 bias made it +0)."""
    for dt in FLOATS:
        h = np.full((3, 1000), -0.0).astype(np_dtype(dt))
        for x in (cupy_from_host(h), cupy_from_host(np.repeat(h, 2, axis=1))[:, ::2]):
            y = to_host(cupylab.layer_norm(x)).astype(np.float64)
            assert np.all(y == 0) and np.all(np.signbit(y)), dt


@pytest.mark.parametrize("cols", [1000, 4097, 65536])
def test_layer_norm_constant_rows(cols):
    """A constant row normalises to exactly 0 (y = bias), as torch gives, whatever the
    constant: the mean is exact even where a sum of the row would round (123.456 x n is not
    a float), in the register, cluster and generic (strided) kernels; the mean statistic is
    the constant itself."""
    consts = np.array([3.25, 123.456, -7.1e-3, 1e4 / 3, 0.1])
    for dt in FLOATS:
        h = np.repeat(consts[:, None], cols, axis=1).astype(np_dtype(dt))
        b = (np.arange(cols) % 2048).astype(np_dtype(dt))  # float16 holds it (65504 max)
        want = np.broadcast_to(b.astype(np.float64), h.shape)
        y, mean, _ = cupylab.layer_norm(cupy_from_host(h), None, cupy_from_host(b),
                                        return_stats=True)
        np.testing.assert_array_equal(to_host(y).astype(np.float64), want)
        np.testing.assert_array_equal(to_host(mean), h[:, 0].astype(to_host(mean).dtype))
        wide = np.zeros((h.shape[0], 2 * cols), h.dtype)
        wide[:, ::2] = h  # a strided last axis: the generic kernel
        yg = cupylab.layer_norm(cupy_from_host(wide)[:, ::2], None, cupy_from_host(b))
        np.testing.assert_array_equal(to_host(yg).astype(np.float64), want)


@pytest.mark.parametrize("cols", [4096, 65536])
def test_layer_norm_with_an_outlier_first_element(cols):
    """The mean is shifted by the row's first element and then corrected: an outlier there
    (1e4 in a standard-normal row) must not cost the mean and y their float32 accuracy."""
    rng = np.random.default_rng(cols + 1)
    h = rng.standard_normal((3, cols)).astype(np.float32)
    h[:, 0] = 1e4
    # the register (or cluster) kernel, then the generic one (a strided last axis)
    for x in (cupy_from_host(h), cupy_from_host(np.repeat(h, 2, axis=1))[:, ::2]):
        y, mean, _ = cupylab.layer_norm(x, None, None, return_stats=True)
        ref_y, ref_mean, _ = R.ROWWISE_REFERENCES["layer_norm"](h, None, None, 1e-5)
        np.testing.assert_allclose(to_host(mean), ref_mean, rtol=1e-6, atol=1e-6)
        check(y, ref_y, "float32", 1, "layer_norm outlier")
    bad = h.copy()
    bad[1, 7] = np.nan
    _, _, rstd = cupylab.layer_norm(cupy_from_host(bad), None, None, return_stats=True)
    assert np.isnan(to_host(rstd)[1]) and np.isfinite(to_host(rstd)[[0, 2]]).all()


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "cross_entropy"])
def test_a_nan_early_in_a_row_makes_the_generic_kernels_row_nan(op):
    """The generic kernel's per-thread running sum was reset when its first value above -inf
    came after a NaN, so the NaN was lost (a NaN logit hidden from the loss). A strided last
    axis takes that kernel."""
    rng = np.random.default_rng(3)
    h = rng.standard_normal((2, 2048)).astype(np.float32)
    h[0, 0] = np.nan
    h[1, 0], h[1, 512] = -np.inf, np.nan
    x = cupy_from_host(np.repeat(h, 2, axis=1))[:, ::2]
    if op == "cross_entropy":
        loss = cupylab.cross_entropy(x, cupy_from_host(np.array([3, 7])), reduction="none")
        assert np.isnan(to_host(loss)).all()
    else:
        assert np.isnan(to_host(getattr(cupylab, op)(x))).all()


@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])  # register/cluster, generic
def test_cross_entropy_of_a_confident_row_keeps_its_digits(dt, layout):
    """The target's own term is left out of the sum and added after it: a target logit far
    above the rest (loss about 7e-7, the others' terms about 2e-11 each) came out exactly 0,
    or half its value, when the others were added to the target's 1 in float32. Also a
    target far below the max (its term underflows to 0: the loss stays finite), a target
    tied with another max, and label smoothing."""
    rng = np.random.default_rng(5)
    h = rng.standard_normal((5, 32000))
    t = np.array([11, 12, 13, 14, 15])
    h[np.arange(4), t[:4]] = 25.0
    h[2, 31999] = 25.0  # a tie with the target
    h[4, 7] = 30.0      # row 4: the target 120 below the max
    h[4, 15] = -90.0
    h = h.astype(dt)
    x = cupy_from_host(h if layout == "contiguous" else np.repeat(h, 2, axis=1))
    if layout == "strided":
        x = x[:, ::2]
    for smooth in (0.0, 0.1):
        got = to_host(cupylab.cross_entropy(x, cupy_from_host(t), label_smoothing=smooth,
                                            reduction="none"))
        ref = R.ROWWISE_REFERENCES["cross_entropy"](h, t, -100, smooth)[0]
        # (float64: the reference's lse - x_t cancels to ~5e-9 of a loss of 7e-7, the
        # kernel's log1p does not)
        np.testing.assert_allclose(got, ref, rtol=1e-4 if dt == "float32" else 2e-8)
        assert np.isfinite(ref[4]) and ref[4] > 100
        if smooth == 0:
            assert ref[0] < 1e-6


def test_leading_shapes_and_torch_stream():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    h = rng.standard_normal((4, 6, 300)).astype(np.float32)
    t = torch.from_numpy(h).cuda()
    v = t[:, 1:5]  # two strided leading levels
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = cupylab.softmax(v)
        yr, st = cupylab.rms_norm(v, return_stats=True)
    s.synchronize()
    assert isinstance(y, torch.Tensor) and y.shape == (4, 4, 300) and st.shape == (4, 4)
    check(y, R.ROWWISE_REFERENCES["softmax"](h[:, 1:5]), "float32")
    check(yr, R.ROWWISE_REFERENCES["rms_norm"](h[:, 1:5])[0], "float32")
    check(torch.softmax(v, -1), to_host(y).astype(np.float64), "float32", what="vs torch")


# ---- backward ----------------------------------------------------------------------------
# (4500, 1000): more rows than the norms' persistent backward grid holds at once (1,056 blocks
# on an H200), so its blocks walk several rows, not all the same number; (77, 500) and (4500,
# 1000): two rows a block (threads per row 64) for float32 and 16-bit rows respectively;
# (300, 3001): float64 softmax backwards on 512 threads of four vectors, more rows than one
# wave of SMs holds; (77, 500) and (33, 4100): a row of whole 16-byte words of float32 partial
# sums whose last 16-bit vector is half past the row end; (1, 1000), (1, 4096): one row, one
# block's partial sums
BWD_SHAPES = [(0, 8), (1, 1), (1, 1000), (1, 4096), (199, 3), (199, 33), (77, 500), (199, 1000),
              (4500, 1000), (300, 3001), (30, 4097), (33, 4100), (5, 9000), (3, 20000),
              (2, 70001)]


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("rows,cols", BWD_SHAPES)
def test_backward_analytic(rows, cols, dt):
    rng = np.random.default_rng(rows * 3 + cols)
    h, x = make(rng, "cupy", rows, cols, dt)
    dyh, dy = make(rng, "cupy", rows, cols, dt, scale=1.0)
    # softmax / log_softmax backward from their own forward outputs
    y = cupylab.softmax(x)
    yh = to_host(y)
    check(cupylab.softmax_backward(y, dy),
          R.ROWWISE_REFERENCES["softmax_backward"](yh, dyh), dt, 2, "softmax bwd")
    ly = cupylab.log_softmax(x)
    lyh = to_host(ly)
    check(cupylab.log_softmax_backward(ly, dy),
          R.ROWWISE_REFERENCES["log_softmax_backward"](lyh, dyh), dt, 4, "log_softmax bwd")
    for wdt in ([dt, "float32"] if dt in ("float16", "bfloat16") else [dt]):
        w = (rng.standard_normal(cols) + 1).astype(np_dtype(wdt))
        wd = cupy_from_host(w)
        _, mean, rstd = cupylab.layer_norm(x, wd, None, return_stats=True)
        dx, dw, db = cupylab.layer_norm_backward(dy, x, wd, mean, rstd)
        rdx, rdw, rdb = R.ROWWISE_REFERENCES["layer_norm_backward"](
            dyh, h, w, to_host(mean), to_host(rstd))
        check(dx, rdx, dt, 4, "ln dx")
        sc = 1.0 + rows ** 0.5 / 10  # dweight sums rows: its rounding grows with them
        check(dw, rdw, wdt, 2 * sc, "ln dw")
        check(db, rdb, wdt, 2 * sc, "ln db")
        assert to_host(dw).dtype == np_dtype(wdt)
        _, rstd = cupylab.rms_norm(x, wd, return_stats=True)
        dx, dw = cupylab.rms_norm_backward(dy, x, wd, rstd)
        rdx, rdw = R.ROWWISE_REFERENCES["rms_norm_backward"](dyh, h, w, to_host(rstd))
        check(dx, rdx, dt, 4, "rms dx")
        check(dw, rdw, wdt, 2 * sc, "rms dw")


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["contig", "offset"])
@pytest.mark.parametrize("cols", [31, 200, 500, 1000, 2000, 4097, 8000, 16000])
def test_softmax_backwards_both_sides_of_the_pipeline_boundary(cols, layout, dt):
    """16-bit softmax_backward and log_softmax_backward take the pipelined kernel while its
    grid holds every row at once and row_sbwd_kernel (both rows staged in shared memory)
    beyond: each class of the ladder, on both sides, with rows of one head (contig) and of
    varying heads (offset: partial 16-byte words at both ends; ``out=`` in the same layout,
    else the operands' heads differ and the call takes row_generic). The class is the one
    the call plans, from the operands' layout (:func:`_rowcore.make_layout`)."""
    from cupylab import _arrays, _runtime  # noqa: PLC0415
    from cupylab.ops import _rowcore as rc  # noqa: PLC0415

    info = _runtime.device_info(0)
    dtype = next(d for d in rc.FLOATS if d.name == dt)
    # beyond any pipelined grid: at most 1,024 / threads blocks an SM (the 64-register cap)
    # of threads / (threads a row) rows each, for the class of either head
    big = 1 + max(info.sm_count * max(1, 1024 // c[0]) * (c[0] // c[1])
                  for c in (rc.choose(10, dtype, cols, True, h, info.cc) for h in (0, None)))
    for rows in (3, big):
        rng = np.random.default_rng(rows + cols)
        h = rng.standard_normal((rows, cols)) * 4.0
        dyh, dy = make(rng, "cupy", rows, cols, dt, layout, scale=1.0)
        for op, fwd in (("softmax_backward", "softmax"), ("log_softmax_backward", "log_softmax")):
            yh, y = place("cupy", R.ROWWISE_REFERENCES[fwd](h).astype(np_dtype(dt)), layout)
            # contig: the new output the call allocates (C-contiguous, as y and dy)
            out = place("cupy", np.zeros((rows, cols), np_dtype(dt)), layout)[1]
            views = [_arrays.as_view(a) for a in (y, dy, out)]
            lay = rc.make_layout(op, (rows, cols), [*views, None], -1)
            cls = rc.choose(rc.OP[op], dtype, cols, lay.vec_ok, lay.head, info.cc)
            piped = rc.pipe_plan(rc.OP[op], dtype, cls, rows, info.sm_count,
                                 info.max_smem_optin, info.cc)
            if os.environ.get("CUPYLAB_ROWWISE_PIPELINE", "1") != "0":
                assert (piped is None) == (rows == big or info.cc < 80)
            got = getattr(cupylab, op)(y, dy, out=None if layout == "contig" else out)
            check(got, R.ROWWISE_REFERENCES[op](yh, dyh), dt, 4, f"{op}, {rows} rows")


def test_backward_deterministic_and_no_weight():
    rng = np.random.default_rng(11)
    h, x = make(rng, "cupy", 3000, 768, "bfloat16")
    _, dy = make(rng, "cupy", 3000, 768, "bfloat16")
    w = cupy_from_host(rng.standard_normal(768).astype(np.float32))
    _, mean, rstd = cupylab.layer_norm(x, w, None, return_stats=True)
    a = cupylab.layer_norm_backward(dy, x, w, mean, rstd)
    b = cupylab.layer_norm_backward(dy, x, w, mean, rstd)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(to_host(u), to_host(v))
    dx, dw, db = cupylab.layer_norm_backward(dy, x, None, mean, rstd)
    assert dw is None and db is None and dx.shape == (3000, 768)
    # weight_grad=False: the same dx (the weight still scales it), no weight gradients
    dx2, dw2, db2 = cupylab.layer_norm_backward(dy, x, w, mean, rstd, weight_grad=False)
    assert dw2 is None and db2 is None
    np.testing.assert_array_equal(to_host(dx2), to_host(a[0]))
    _, rs = cupylab.rms_norm(x, w, return_stats=True)
    import cupy  # noqa: PLC0415

    for stream in (None, cupy.cuda.Stream()):  # the lean path and the general path
        r1 = cupylab.rms_norm_backward(dy, x, w, rs, stream=stream)
        r2 = cupylab.rms_norm_backward(dy, x, w, rs, weight_grad=False, stream=stream)
        assert r2[1] is None
        np.testing.assert_array_equal(to_host(r2[0]), to_host(r1[0]))


def _fd(f, x, dy, eps=1e-6):
    """d/dx of sum(f(x) * dy) by central differences (float64 host arrays)."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = np.sum((f(xp) - f(xm)) * dy) / (2 * eps)
    return g


def test_backward_finite_differences_float64():
    rng = np.random.default_rng(2)
    h = rng.standard_normal((3, 7))
    dyh = rng.standard_normal((3, 7))
    w = rng.standard_normal(7) + 1
    dev = cupy_from_host
    fwd = {
        "softmax": lambda a: to_host(cupylab.softmax(dev(a))),
        "log_softmax": lambda a: to_host(cupylab.log_softmax(dev(a))),
        "layer_norm": lambda a: to_host(cupylab.layer_norm(dev(a), dev(w))),
        "rms_norm": lambda a: to_host(cupylab.rms_norm(dev(a), dev(w))),
    }
    y = cupylab.softmax(dev(h))
    np.testing.assert_allclose(to_host(cupylab.softmax_backward(y, dev(dyh))),
                               _fd(fwd["softmax"], h, dyh), rtol=1e-6, atol=1e-8)
    ly = cupylab.log_softmax(dev(h))
    np.testing.assert_allclose(to_host(cupylab.log_softmax_backward(ly, dev(dyh))),
                               _fd(fwd["log_softmax"], h, dyh), rtol=1e-6, atol=1e-8)
    _, m, r = cupylab.layer_norm(dev(h), dev(w), return_stats=True)
    dx, dw, db = cupylab.layer_norm_backward(dev(dyh), dev(h), dev(w), m, r)
    np.testing.assert_allclose(to_host(dx), _fd(fwd["layer_norm"], h, dyh), rtol=1e-6, atol=1e-8)
    fw_w = _fd(lambda ww: to_host(cupylab.layer_norm(dev(h), dev(ww))), w, dyh)
    np.testing.assert_allclose(to_host(dw), fw_w, rtol=1e-6, atol=1e-8)
    _, r = cupylab.rms_norm(dev(h), dev(w), return_stats=True)
    dx, dw = cupylab.rms_norm_backward(dev(dyh), dev(h), dev(w), r)
    np.testing.assert_allclose(to_host(dx), _fd(fwd["rms_norm"], h, dyh), rtol=1e-6, atol=1e-8)


def test_backward_vs_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    x = torch.tensor(rng.standard_normal((64, 1000)), dtype=torch.float32, device="cuda")
    dy = torch.tensor(rng.standard_normal((64, 1000)), dtype=torch.float32, device="cuda")
    w = torch.tensor(rng.standard_normal(1000) + 1, dtype=torch.float32, device="cuda")
    b = torch.zeros(1000, device="cuda")
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    torch.nn.functional.layer_norm(xr, (1000,), wr, br, 1e-5).backward(dy)
    _, m, r = cupylab.layer_norm(x, w, b, return_stats=True)
    dx, dw, db = cupylab.layer_norm_backward(dy, x, w, m, r)
    for got, ref in ((dx, xr.grad), (dw, wr.grad), (db, br.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    xr = x.clone().requires_grad_()
    torch.softmax(xr, -1).backward(dy)
    torch.testing.assert_close(cupylab.softmax_backward(cupylab.softmax(x), dy), xr.grad,
                               rtol=1e-4, atol=1e-5)


# ---- cross-entropy -----------------------------------------------------------------------
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("rows,cols", [(0, 10), (1, 1), (199, 3), (199, 33), (64, 1000),
                                       (9, 4097), (3, 65537), (2, 128256), (1, 300000)])
@pytest.mark.parametrize("smooth", [0.0, 0.1])
def test_cross_entropy(rows, cols, dt, smooth):
    rng = np.random.default_rng(rows + cols)
    h, x = make(rng, "cupy", rows, cols, dt, scale=2.0)
    t = rng.integers(0, cols, size=rows).astype(np.int64)
    if rows > 3:
        t[::4] = -100
    td = cupy_from_host(t)
    loss, lse, g = R.ROWWISE_REFERENCES["cross_entropy"](h, t, -100, smooth)
    n = max(1, int(np.sum(t != -100)))
    sdt = "float64" if dt == "float64" else "float32"
    for red in ("mean", "sum", "none"):
        out = cupylab.cross_entropy(x, td, label_smoothing=smooth, reduction=red,
                                    return_grad=True, return_lse=True)
        lo, gr, ls = out
        with np.errstate(invalid="ignore", divide="ignore"):
            ref_loss = {"none": loss, "sum": loss.sum(),
                        "mean": loss.sum() / np.sum(t != -100)}[red]
        scale = 1.0 / n if red == "mean" else 1.0
        check(lo, ref_loss, sdt, 10, f"loss {red}")
        check(ls, lse, sdt, 10, "lse")
        check(gr, g * scale, dt, 1, f"grad {red}")
    # in place: the gradient replaces the logits
    lo2, g2 = cupylab.cross_entropy(x, td, label_smoothing=smooth, grad_out=x)
    assert g2 is x
    check(x, g / n, dt, 1, "in-place grad")


def test_cross_entropy_bad_targets_and_int32():
    h = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32)
    t = np.array([3, 50, -1, -100], dtype=np.int32)
    loss, grad = cupylab.cross_entropy(cupy_from_host(h), cupy_from_host(t), reduction="none",
                                       return_grad=True)
    lo = to_host(loss)
    assert np.isfinite(lo[0]) and np.isnan(lo[1]) and np.isnan(lo[2]) and lo[3] == 0
    gh = to_host(grad)
    assert np.all(np.isnan(gh[1])) and np.all(gh[3] == 0)
    assert np.isnan(float(to_host(cupylab.cross_entropy(cupy_from_host(h), cupy_from_host(t)))))


def test_cross_entropy_vs_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    x = torch.tensor(rng.standard_normal((128, 5000)), dtype=torch.float32, device="cuda")
    t = torch.tensor(rng.integers(0, 5000, 128), device="cuda")
    t[::5] = -100
    xr = x.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xr, t, label_smoothing=0.1)
    ref.backward()
    loss, g = cupylab.cross_entropy(x, t, label_smoothing=0.1, return_grad=True)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, xr.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["contig", "offset"])
@pytest.mark.parametrize("wshift", [0, 1, 8])
@pytest.mark.parametrize("rows,cols", [(3000, 1000), (700, 4096), (1500, 8192), (20000, 33)])
def test_rms_weight_alignment(rows, cols, dt, layout, wshift):
    """The 16-bit rms norms load a row's weight slots ahead when a slot is whole and its
    16 bytes aligned, and one element at a time otherwise: weights that start 1 or 8
    elements into an allocation, rows whose heads differ (offset views), persistent grids."""
    rng = np.random.default_rng(cols + wshift)
    h, x = make(rng, "cupy", rows, cols, dt, layout)
    hw = (rng.standard_normal(cols + wshift) + 1).astype(np_dtype(dt))
    w = cupy_from_host(hw)[wshift:]
    hw = hw[wshift:]
    check(cupylab.rms_norm(x, w, eps=1e-6), R.ROWWISE_REFERENCES["rms_norm"](h, hw, 1e-6)[0],
          dt, 2, "rms_norm")
    hr = rng.standard_normal((rows, cols)).astype(np_dtype(dt))
    hsum = (h.astype(np.float64) + hr.astype(np.float64)).astype(np_dtype(dt))
    y, hh = cupylab.add_rms_norm(x, cupy_from_host(hr), w, eps=1e-6)
    check(hh, hsum, dt, 0.01, "add h")
    check(y, R.ROWWISE_REFERENCES["rms_norm"](hsum, hw, 1e-6)[0], dt, 2, "add y")


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("wdt", ["same", "float32"])
@pytest.mark.parametrize("wshift", [0, 1, 8])
@pytest.mark.parametrize("rows,cols", [(16, 4096), (5, 1001), (128, 33), (3, 8192), (900, 2048),
                                       (16, 16384)])
def test_staged_weights(rows, cols, dt, wdt, wshift):
    """The 16-bit forward norms' pipelined kernel copies the weight and bias into shared
    memory beside the first rows (where the grid keeps its size: the few rows here whose row
    length row_few_kernel leaves to it, 5 x 1001, 128 x 33 and 16 x 16384, and 900 x 2048;
    16 x 4096 and 3 x 8192 take row_few_kernel): aligned arrays by 16-byte words, arrays 1 or 8 elements into an allocation
    byte by byte, rows whose length leaves a partial last word, float32 weights; with a weight
    alone, a bias alone, and both."""
    rng = np.random.default_rng(cols + 7 * wshift + rows)
    h, x = make(rng, "cupy", rows, cols, dt)
    wd = np_dtype(dt) if wdt == "same" else np.float32
    hw = (rng.standard_normal(cols + wshift) + 1).astype(wd)
    hb = rng.standard_normal(cols + wshift).astype(wd)
    w, b = cupy_from_host(hw)[wshift:], cupy_from_host(hb)[wshift:]
    hw, hb = hw[wshift:], hb[wshift:]
    check(cupylab.rms_norm(x, w, eps=1e-6), R.ROWWISE_REFERENCES["rms_norm"](h, hw, 1e-6)[0],
          dt, 2, "rms_norm")
    for ww, bb in ((w, b), (w, None), (None, b)):
        ref = R.ROWWISE_REFERENCES["layer_norm"](h, None if ww is None else hw,
                                                  None if bb is None else hb, 1e-5)[0]
        check(cupylab.layer_norm(x, ww, bb), ref, dt, 2,
              f"layer_norm weight {ww is not None} bias {bb is not None}")
    hr = rng.standard_normal((rows, cols)).astype(np_dtype(dt))
    hsum = (h.astype(np.float64) + hr.astype(np.float64)).astype(np_dtype(dt))
    y, hh = cupylab.add_rms_norm(x, cupy_from_host(hr), w, eps=1e-6)
    check(hh, hsum, dt, 0.01, "add h")
    check(y, R.ROWWISE_REFERENCES["rms_norm"](hsum, hw, 1e-6)[0], dt, 2, "add y")


@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", ["contig", "offset"])
@pytest.mark.parametrize("rows,cols", [(20000, 33), (3000, 1000), (1500, 8192), (70001, 5),
                                       (300, 40000)])
def test_many_rows_per_block(rows, cols, dt, layout):
    """Persistent grids: each block (or cluster) walks several rows through the cp.async
    pipeline (16-bit layer_norm: the plain kernel at 20000 x 33 and 3000 x 1000, more row groups
    than LN16_PIPE_UNITS an SM); offset views give rows whose heads differ (partial 16-byte
    words). 300 x 40000:
    more cluster rows than fit on the GPU at once (16-bit rows on 4-block clusters held in
    shared memory, float32 rows on 8-block clusters)."""
    rng = np.random.default_rng(rows)
    h, x = make(rng, "cupy", rows, cols, dt, layout)
    check(cupylab.softmax(x), R.ROWWISE_REFERENCES["softmax"](h), dt, what="softmax")
    check(cupylab.log_softmax(x), R.ROWWISE_REFERENCES["log_softmax"](h), dt, what="log_softmax")
    y, mean, rstd = cupylab.layer_norm(x, return_stats=True)
    check(y, R.ROWWISE_REFERENCES["layer_norm"](h)[0], dt, 2, "layer_norm")
    check(cupylab.rms_norm(x), R.ROWWISE_REFERENCES["rms_norm"](h)[0], dt, 2, "rms_norm")
    t = rng.integers(0, cols, size=rows)
    loss, lse, g = R.ROWWISE_REFERENCES["cross_entropy"](h, t)
    lo, gr = cupylab.cross_entropy(x, cupy_from_host(t), reduction="none", return_grad=True)
    check(lo, loss, "float32", 10, "ce loss")
    check(gr, g, dt, 1, "ce grad")
