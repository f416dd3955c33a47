"""Row-wise forwards at decoding shapes on the GPU: row_few_kernel (one row a block while the
rows fit one block an SM) in its general and its exact-fit form, against the float64
references (_rowcore.few_class, few_full)."""
import numpy as np
import pytest

import cupylab
from cupylab import reference as R

from gpu_util import cupy_from_host, np_dtype, to_host
from test_rowwise_gpu import _added, _check_add_rms_norm, check, make, place

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layout", ["contig", "offset"])
@pytest.mark.parametrize("cols", [1025, 2048, 4096, 8191])
def test_few_rows(cols, layout, dt):
    """Decoding shapes: while each row gets a block and each SM one block at most, rows of 129
    to 1,024 16-byte slots take row_few_kernel (one row a block, weights loaded beside the
    row, one barrier a reduction): layer_norm and rms_norm with a weight at 1 row and at as
    many rows as SMs, the other ops on 16-bit rows at 1 row, and at as many rows as SMs where
    a row fills its class exactly (2,048 and 4,096 elements; _rowcore.few_class); one
    row more than SMs takes the other kernels. Every forward softmax and norm, with weights
    (float32 weights for 16-bit rows too), the norms' statistics and add_rms_norm in place;
    offset views start each row one element in."""
    from cupylab import _arrays, _runtime  # noqa: PLC0415
    from cupylab.ops import _rowcore as rc  # noqa: PLC0415

    sms = _runtime.device_info(0).sm_count
    sdt = "float32"
    for rows in (1, sms, sms + 1):
        rng = np.random.default_rng(rows + cols)
        h, x = make(rng, "cupy", rows, cols, dt, layout)
        if layout == "contig":
            lay = rc.make_layout("rms_norm", (rows, cols), [_arrays.as_view(x), None, None, None],
                                 -1)
            cdt = rc.FLOATS[["float16", "bfloat16", "float32"].index(dt)]
            few = rows <= sms and 128 < rc.row_slots(cdt, cols, lay.head) <= 1024
            assert (rc.few_class(3, cdt, lay, sms) is not None) == few
            assert (rc.few_class(2, cdt, lay, sms, weighted=True) is not None) == few
            if few:  # rows that fill their class exactly take the exact-fit form
                cls = rc.few_class(3, cdt, lay, sms)
                assert rc.few_full(cdt, lay, cls) == (cols in (2048, 4096))
        check(cupylab.softmax(x), R.ROWWISE_REFERENCES["softmax"](h), dt, what="softmax")
        check(cupylab.log_softmax(x), R.ROWWISE_REFERENCES["log_softmax"](h), dt,
              what="log_softmax")
        if layout == "offset":  # outputs with x's head: the vector kernels on rows one element in
            o = place("cupy", np.zeros((rows, cols), np_dtype(dt)), layout)[1]
            lay = rc.make_layout("softmax", (rows, cols),
                                 [_arrays.as_view(x), None, _arrays.as_view(o), None], -1)
            assert lay.vec_ok
            check(cupylab.softmax(x, out=o), R.ROWWISE_REFERENCES["softmax"](h), dt,
                  what="softmax, offset out")
            w = (rng.standard_normal(cols) + 1).astype(np_dtype(dt))
            b = rng.standard_normal(cols).astype(np_dtype(dt))
            check(cupylab.layer_norm(x, cupy_from_host(w), cupy_from_host(b), out=o),
                  R.ROWWISE_REFERENCES["layer_norm"](h, w, b, 1e-5)[0], dt, 2,
                  "layer_norm, offset out")
        for wdt in (dt, "float32") if dt != "float32" else (dt,):
            w = (rng.standard_normal(cols) + 1).astype(np_dtype(wdt))
            b = rng.standard_normal(cols).astype(np_dtype(wdt))
            y, rstd = cupylab.rms_norm(x, cupy_from_host(w), eps=1e-6, return_stats=True)
            ref, rref = R.ROWWISE_REFERENCES["rms_norm"](h, w, 1e-6)
            check(y, ref, dt, 2, f"rms_norm {rows} rows, {wdt} weight")
            check(rstd, rref, sdt, 2, "rms rstd")
            check(cupylab.rms_norm(x), R.ROWWISE_REFERENCES["rms_norm"](h)[0], dt, 2, "rms_norm")
            for ww, bb in ((w, b), (None, b), (w, None), (None, None)):
                y, mean, rstd = cupylab.layer_norm(
                    x, None if ww is None else cupy_from_host(ww),
                    None if bb is None else cupy_from_host(bb), eps=1e-5, return_stats=True)
                ref, mref, rref = R.ROWWISE_REFERENCES["layer_norm"](h, ww, bb, 1e-5)
                check(y, ref, dt, 2, f"layer_norm {rows} rows, weight {ww is not None}, "
                      f"bias {bb is not None}")
                check(mean, mref, sdt, 10, "ln mean")
                check(rstd, rref, sdt, 10, "ln rstd")
            rh, r = make(rng, "cupy", rows, cols, dt, layout)
            _check_add_rms_norm(x, r, w, _added(h, rh, dt), dt)


@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
def test_few_rows_exact_fit_edges(dt):
    """row_few_kernel's exact-fit form (rows of exactly its class, no bounds tests) beyond
    plain contiguous rows: rows 64 elements further apart than their 4,096 (inputs and
    outputs: the gaps between output rows stay untouched), weights and biases one element
    into their allocation (their loads fall back to one element at a time; float32 ones under
    16-bit rows four and one element in), a 3-d input whose rows merge into one level; a 3-d
    slice with two levels of rows takes the general form; add_rms_norm in place on strided
    rows leaves the residual's gaps untouched."""
    from cupylab import _arrays, _runtime  # noqa: PLC0415
    from cupylab.ops import _rowcore as rc  # noqa: PLC0415

    sms = _runtime.device_info(0).sm_count
    cols, pad, rows = 4096, 64, 16
    cdt = rc.FLOATS[["float16", "bfloat16", "float32"].index(dt)]
    npd = np_dtype(dt)
    rng = np.random.default_rng(4096 + len(dt))

    def strided(h, fill=0.0):
        big = np.full((h.shape[0], cols + pad), fill, dtype=npd)
        big[:, :cols] = h
        d = cupy_from_host(big)
        return d, d[:, :cols]

    h = (rng.standard_normal((rows, cols)) * 4).astype(npd)
    _, x = strided(h)
    lay = rc.make_layout("layer_norm", x.shape, [_arrays.as_view(x), None, None, None], -1)
    cls = rc.few_class(3, cdt, lay, sms)
    assert cls is not None and rc.few_full(cdt, lay, cls)
    hw1 = (rng.standard_normal(cols + 1) + 1).astype(npd)
    hb1 = rng.standard_normal(cols + 1).astype(npd)
    w, b = cupy_from_host(hw1)[1:], cupy_from_host(hb1)[1:]
    hw, hb = hw1[1:], hb1[1:]
    for ww, bb in ((w, b), (None, None), (w, None)):
        ob, o = strided(np.zeros((rows, cols), npd), fill=7.0)
        ref = R.ROWWISE_REFERENCES["layer_norm"](h, None if ww is None else hw,
                                                  None if bb is None else hb, 1e-5)[0]
        check(cupylab.layer_norm(x, ww, bb, out=o), ref, dt, 2,
              f"layer_norm strided, weight {ww is not None}, bias {bb is not None}")
        assert (to_host(ob)[:, cols:] == 7.0).all(), "layer_norm wrote between output rows"
    ob, o = strided(np.zeros((rows, cols), npd), fill=7.0)
    check(cupylab.rms_norm(x, w, out=o), R.ROWWISE_REFERENCES["rms_norm"](h, hw, 1e-6)[0],
          dt, 2, "rms_norm strided, weight one element in")
    assert (to_host(ob)[:, cols:] == 7.0).all(), "rms_norm wrote between output rows"
    if dt != "float32":
        ob, o = strided(np.zeros((rows, cols), npd), fill=7.0)
        check(cupylab.softmax(x, out=o), R.ROWWISE_REFERENCES["softmax"](h), dt, what="softmax")
        assert (to_host(ob)[:, cols:] == 7.0).all(), "softmax wrote between output rows"
        hr = rng.standard_normal((rows, cols)).astype(npd)
        rb, r = strided(hr, fill=7.0)
        y, hh = cupylab.add_rms_norm(x, r, w, eps=1e-6, inplace=True)
        hsum = _added(h, hr, dt)
        check(r, hsum, dt, 0.01, "add_rms_norm in place, strided h")
        check(y, R.ROWWISE_REFERENCES["rms_norm"](hsum, hw, 1e-6)[0], dt, 2, "add_rms_norm y")
        assert (to_host(rb)[:, cols:] == 7.0).all(), "add_rms_norm wrote between residual rows"
        # float32 weight and bias under 16-bit rows, 16-byte aligned but not on their 32-byte
        # words (four elements in) and one element in: both take the element-by-element loads
        for skip in (4, 1):
            hwf = (rng.standard_normal(cols + skip) + 1).astype(np.float32)
            hbf = rng.standard_normal(cols + skip).astype(np.float32)
            wf, bf = cupy_from_host(hwf)[skip:], cupy_from_host(hbf)[skip:]
            check(cupylab.layer_norm(x, wf, bf),
                  R.ROWWISE_REFERENCES["layer_norm"](h, hwf[skip:], hbf[skip:], 1e-5)[0], dt, 2,
                  f"layer_norm, float32 weight and bias {skip} elements in")
            check(cupylab.rms_norm(x, wf),
                  R.ROWWISE_REFERENCES["rms_norm"](h, hwf[skip:], 1e-6)[0], dt, 2,
                  f"rms_norm, float32 weight {skip} elements in")
    # 3-d: (2, 12, cols) contiguous merges into one level; a slice of the middle axis keeps two
    h3 = (rng.standard_normal((2, 12, cols)) * 4).astype(npd)
    d3 = cupy_from_host(h3)
    for v, hv, one in ((d3, h3, True), (d3[:, :8], h3[:, :8], False)):
        lay = rc.make_layout("layer_norm", v.shape, [_arrays.as_view(v), None, None, None], -1)
        cls = rc.few_class(3, cdt, lay, sms)
        assert cls is not None and rc.few_full(cdt, lay, cls) == one
        ref = R.ROWWISE_REFERENCES["layer_norm"](hv.reshape(-1, cols), hw, hb, 1e-5)[0]
        check(cupylab.layer_norm(v, w, b).reshape(-1, cols), ref, dt, 2,
              f"layer_norm 3-d, one level of rows {one}")
