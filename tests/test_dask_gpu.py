"""cupylab operators on Dask arrays of CuPy chunks, computed on the GPU (threaded scheduler and,
where ``distributed`` is installed, a local cluster), against the same chain on one CuPy array;
and operators running on the device their inputs live on (two GPUs)."""
import pytest

import cupylab

pytestmark = pytest.mark.gpu
da = pytest.importorskip("dask.array")
cp = pytest.importorskip("cupy")


def _chain(x, b, w):
    return cupylab.rms_norm(cupylab.multiply(cupylab.add(x, b), 0.5), w)


def _data(shape=(1000, 257)):
    rng = cp.random.default_rng(11)
    a = rng.standard_normal(shape, dtype=cp.float32)
    b = rng.standard_normal(shape[-1:], dtype=cp.float32)
    w = rng.standard_normal(shape[-1:], dtype=cp.float32)
    return a, b, w


def test_chain_on_cupy_chunks_matches_one_array():
    a, b, w = _data()
    x = da.from_array(a, chunks=(300, 100), asarray=False)
    z = _chain(x, b, w)
    assert isinstance(z._meta, cp.ndarray)
    got = z.compute(scheduler="threads")
    assert isinstance(got, cp.ndarray)
    cp.testing.assert_allclose(got, _chain(a, b, w), rtol=1e-5, atol=1e-6)
    s = cupylab.softmax(x, axis=0).compute(scheduler="threads")
    cp.testing.assert_allclose(s, cupylab.softmax(a, axis=0), rtol=1e-5, atol=1e-7)


def test_mixed_dtypes_and_scalars_on_chunks():
    a = cp.arange(60, dtype=cp.int32).reshape(6, 10)
    x = da.from_array(a, chunks=(4, 3), asarray=False)
    got = cupylab.divide(x, 4).compute(scheduler="threads")
    assert got.dtype == cp.float64
    cp.testing.assert_allclose(got, a / 4)


def test_jax_chunks_follow_jaxs_promotion():
    """Dask arrays of JAX chunks declare the dtype JAX's rule gives, which is what the chunk
    calls return (int32 / a Python float: float32 in JAX's default 32-bit mode, where NumPy's
    rule gives float64)."""
    jnp = pytest.importorskip("jax.numpy")
    a = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    x = da.from_array(a, chunks=(2, 3), asarray=False)
    z = cupylab.multiply(x, 1.5)
    want = jnp.multiply(a, 1.5)
    assert z.dtype == want.dtype
    got = z.compute(scheduler="sync")
    assert got.dtype == want.dtype
    cp.testing.assert_allclose(cp.asarray(got), cp.asarray(want))


def test_add_rms_norm_and_cross_entropy_on_chunks():
    a, b, w = _data((1000, 257))
    r = cp.random.default_rng(12).standard_normal(a.shape, dtype=cp.float32)
    x = da.from_array(a, chunks=(300, 100), asarray=False)
    y, h = cupylab.add_rms_norm(x, da.from_array(r, chunks=(250, 257), asarray=False), w)
    y, h = da.compute(y, h, scheduler="threads")
    y1, h1 = cupylab.add_rms_norm(a, r, w)
    cp.testing.assert_allclose(h, h1, rtol=1e-6)
    cp.testing.assert_allclose(y, y1, rtol=1e-5, atol=1e-5)
    t = cp.random.default_rng(13).integers(0, 257, 1000).astype(cp.int64)
    t[::7] = -100
    td = da.from_array(t, chunks=400, asarray=False)
    for red in ("mean", "sum", "none"):
        got = cupylab.cross_entropy(x, td, reduction=red, label_smoothing=0.1)
        assert isinstance(got._meta, cp.ndarray)
        got = got.compute(scheduler="threads")
        assert isinstance(got, cp.ndarray) and got.dtype == cp.float32
        cp.testing.assert_allclose(got, cupylab.cross_entropy(a, t, reduction=red,
                                                              label_smoothing=0.1), rtol=1e-5)


def test_cross_entropy_lse_and_backward_on_chunks():
    """return_lse on chunks, then the backward from it: the same gradients as one array's,
    for the three reductions (the mean's count over every chunk) and a per-row gradient."""
    a, _, _ = _data((1000, 257))
    t = cp.random.default_rng(15).integers(0, 257, 1000).astype(cp.int64)
    t[::7] = -100
    x = da.from_array(a, chunks=(300, 100), asarray=False)
    td = da.from_array(t, chunks=400, asarray=False)
    loss, lse = cupylab.cross_entropy(x, td, label_smoothing=0.1, return_lse=True)
    loss1, lse1 = cupylab.cross_entropy(a, t, label_smoothing=0.1, return_lse=True)
    got_loss, got_lse = da.compute(loss, lse, scheduler="threads")
    cp.testing.assert_allclose(got_lse, lse1, rtol=1e-6)
    cp.testing.assert_allclose(got_loss, loss1, rtol=1e-5)
    gr = cp.random.default_rng(16).standard_normal(1000, dtype=cp.float32)
    for red, g in (("mean", None), ("mean", 2.0), ("sum", None),
                   ("none", da.from_array(gr, chunks=500, asarray=False))):
        got = cupylab.cross_entropy_backward(x, td, lse, g, label_smoothing=0.1, reduction=red)
        assert isinstance(got._meta, cp.ndarray)
        got = got.compute(scheduler="threads")
        want = cupylab.cross_entropy_backward(a, t, lse1, gr if red == "none" else g,
                                              label_smoothing=0.1, reduction=red)
        cp.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


def test_norm_backward_on_chunks():
    a, _, w = _data((1000, 257))
    dy = cp.random.default_rng(14).standard_normal(a.shape, dtype=cp.float32)
    y, mean, rstd = cupylab.layer_norm(a, w, None, 1e-5, return_stats=True)
    want = cupylab.layer_norm_backward(dy, a, w, mean, rstd)
    x = da.from_array(a, chunks=(300, 100), asarray=False)
    got = cupylab.layer_norm_backward(da.from_array(dy, chunks=(250, 257), asarray=False), x, w,
                                      mean, rstd)
    got = da.compute(*got, scheduler="threads")
    cp.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    cp.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-3)
    cp.testing.assert_allclose(got[2], want[2], rtol=1e-4, atol=1e-3)


def test_local_cluster():
    distributed = pytest.importorskip("distributed")
    a, b, w = _data((512, 128))
    x = da.from_array(a, chunks=(128, 128), asarray=False)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster):
        got = _chain(x, b, w).sum().compute()
    cp.testing.assert_allclose(got, _chain(a, b, w).sum(), rtol=1e-4)


def _gpus():
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver: the gpu marker skips the test anyway
        return 0


def test_operators_run_on_the_device_of_their_inputs():
    if _gpus() < 2:
        pytest.skip(f"needs two GPUs ({_gpus()} here)")
    with cp.cuda.Device(1):
        a = cp.arange(1 << 12, dtype=cp.float32)
    assert cp.cuda.runtime.getDevice() == 0
    r = cupylab.add(a, a)
    assert r.device.id == 1
    cp.testing.assert_allclose(r, a * 2)
    s = cupylab.softmax(a.reshape(64, 64))
    assert s.device.id == 1
    with cp.cuda.Device(0):
        b = cp.ones(1 << 12, dtype=cp.float32)
    with pytest.raises(ValueError, match="different GPUs"):
        cupylab.add(a, b)


def test_example_script_small(tmp_path):
    """scripts/examples/dask_chain.py runs and checks itself (a small size, no cluster)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "examples" / "dask_chain.py"
    r = subprocess.run([sys.executable, str(script), "--rows", "3000", "--cols", "256",
                        "--chunk-rows", "700", "--cluster", "threads", "--repeats", "2"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check:" in r.stdout and "Dask, cupylab chain" in r.stdout
