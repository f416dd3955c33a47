"""foreach operators and the functional optimizers on the GPU, against float64 references:
lists of 1 to 5,000 arrays, sizes 0, 1 and odd, every float dtype, CuPy and torch, unaligned
views, one tensor of more than 2^31 elements, the cache (no leaks), errors."""
import gc
import weakref

import numpy as np
import pytest

from cupylab import foreach, optim, reference as R
from cupylab.ops import _mt_plan as P

from gpu_util import FLOATS, from_host, hold, host_data, to_host, empty_poisoned

pytestmark = pytest.mark.gpu
TOL = {"float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2), "float32": (2e-6, 2e-6),
       "float64": (1e-13, 1e-13)}


def _fw(fw):
    if fw == "torch":
        pytest.importorskip("torch")
    return fw


def _sizes(n, rng):
    base = [0, 1, 3, 4097, 70001]
    return [base[i] if i < len(base) else int(rng.integers(1, 300)) for i in range(n)]


def _lists(fw, dt, sizes, rng, count=2):
    hs = [[host_data(rng, (s,), dt) for s in sizes] for _ in range(count)]
    return hs, [[from_host(fw, h) for h in hl] for hl in hs]


def _close(got, want, dt):
    rtol, atol = TOL[dt]
    np.testing.assert_allclose(np.asarray(to_host(got), dtype=np.float64), want, rtol=rtol,
                               atol=atol)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("n", [1, 7, 300])
def test_binary_ops(fw, dt, n):
    _fw(fw)
    rng = np.random.default_rng(n)
    sizes = _sizes(n, rng)
    (hx, hy), (xs, ys) = _lists(fw, dt, sizes, rng)
    outs = [empty_poisoned(fw, (s,), dt) for s in sizes]
    foreach.add(xs, ys, alpha=0.5, out=outs)
    for o, w in zip(outs, R.foreach_add(hx, hy, 0.5)):
        _close(o, w, dt)
    for o, w in zip(foreach.mul(xs, ys), R.foreach_mul(hx, hy)):
        _close(o, w, dt)
    for o, w in zip(foreach.lerp(xs, ys, 0.3), R.foreach_lerp(hx, hy, 0.3)):
        _close(o, w, dt)
    foreach.add_(xs, 2.0)
    for x, w in zip(xs, R.foreach_add(hx, 2.0)):
        _close(x, w, dt)
    foreach.axpy_(-1.0, xs, ys)  # y -= x + 2  (x now holds hx + 2)
    hx2 = [h.astype(np.float64) + 2.0 for h in hx]
    for y, h, x2 in zip(ys, hy, hx2):
        _close(y, h.astype(np.float64) - np.asarray(to_host(from_host(fw, x2.astype(h.dtype))),
                                                       np.float64), dt)
    foreach.scale_(xs, 0.25)
    foreach.zero_(ys)
    assert all(not np.any(np.asarray(to_host(y), np.float64)) for y in ys)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_5000_small_tensors_mixed_dtypes_and_unaligned(fw):
    _fw(fw)
    rng = np.random.default_rng(5)
    sizes = [int(s) for s in rng.integers(0, 40, size=5000)]
    dts = [FLOATS[i % 4] for i in range(5000)]
    hx = [host_data(rng, (s + 1,), d) for s, d in zip(sizes, dts)]
    hy = [host_data(rng, (s + 1,), d) for s, d in zip(sizes, dts)]
    # offset-by-one views: not 16-byte aligned, so the scalar path runs
    xs = [from_host(fw, h)[1:] for h in hx]
    ys = [from_host(fw, h)[1:] for h in hy]
    foreach.add_(xs, ys, alpha=3.0)
    for x, a, b, d in zip(xs, hx, hy, dts):
        _close(x, a[1:].astype(np.float64) + 3.0 * b[1:].astype(np.float64), d)
    nr = foreach.norms(ys)
    want = R.per_tensor_norms([h[1:] for h in hy])
    np.testing.assert_allclose(np.asarray(to_host(nr), np.float64), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("dt", FLOATS)
def test_copy_converts(fw, dt):
    _fw(fw)
    rng = np.random.default_rng(1)
    src = [host_data(rng, (s,), "float32") for s in (0, 1, 33, 9000)]
    dst = [empty_poisoned(fw, (s,), dt) for s in (0, 1, 33, 9000)]
    foreach.copy_(dst, [from_host(fw, h) for h in src])
    for d, h in zip(dst, src):
        _close(d, h.astype(np.float64), dt)  # one rounding to dt: within dt's tolerance


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("dt", ["float32", "bfloat16", "float64"])
def test_norms_and_clip(fw, dt):
    _fw(fw)
    rng = np.random.default_rng(2)
    sizes = _sizes(40, rng)
    (hx,), (xs,) = _lists(fw, dt, sizes, rng, 1)
    tol = 1e-12 if dt == "float64" else 2e-5
    total = foreach.norm(xs)
    np.testing.assert_allclose(float(to_host(total)), R.global_norm(hx), rtol=tol)
    per = foreach.norms(xs)
    np.testing.assert_allclose(np.asarray(to_host(per), np.float64), R.per_tensor_norms(hx),
                               rtol=tol, atol=1e-30)
    again = foreach.norm(xs)  # deterministic
    assert float(to_host(again)) == float(to_host(total))
    clipped, t = R.clip_by_global_norm(hx, 1.5)
    got = foreach.clip_by_global_norm_(xs, 1.5)
    np.testing.assert_allclose(float(to_host(got)), t, rtol=tol)
    for x, w in zip(xs, clipped):
        _close(x, w, dt)
    before = [np.asarray(to_host(x), np.float64) for x in xs]
    foreach.clip_by_global_norm_(xs, 1e9)  # factor 1: nothing changes
    for x, b in zip(xs, before):
        np.testing.assert_array_equal(np.asarray(to_host(x), np.float64), b)


@pytest.mark.parametrize("dt", FLOATS)
def test_unscale_and_nonfinite(dt):
    import cupy as cp

    rng = np.random.default_rng(3)
    hx = [host_data(rng, (s,), dt) for s in (5, 0, 1000)]
    xs = [from_host("cupy", h) for h in hx]
    fi = foreach.unscale_(xs, 0.5)
    assert float(fi[0]) == 0.0
    for x, w in zip(xs, R.unscale(hx, 0.5)[0]):
        _close(x, w, dt)
    bad = hx[2].copy()
    bad[7] = np.inf
    xs[2] = from_host("cupy", bad)
    inv = cp.full((1,), 2.0, dtype=cp.float32)
    fi2 = cp.zeros(1, dtype=cp.float32)
    foreach.unscale_(xs, inv, fi2)
    assert float(fi2[0]) == 1.0
    assert float(foreach.nonfinite_check(xs[:2])[0]) == 0.0
    assert float(foreach.nonfinite_check(xs)[0]) == 1.0


def test_errors_on_gpu():
    import cupy as cp

    a = [cp.ones(4, cp.float32), cp.ones(5, cp.float32)]
    with pytest.raises(ValueError, match=r"other\[1\] has shape \(6,\) but tensors\[1\] has shape"):
        foreach.add_(a, [cp.ones(4, cp.float32), cp.ones(6, cp.float32)])
    with pytest.raises(TypeError, match=r"other\[0\] has dtype float64 but tensors\[0\]"):
        foreach.add_(a, [cp.ones(4), cp.ones(5, cp.float32)])
    with pytest.raises(ValueError, match="overlap in memory"):
        foreach.add_(a, [a[1][:4], a[0][:5] if False else cp.ones(5, cp.float32)])
    with pytest.raises(ValueError, match="not C-contiguous"):
        foreach.zero_([cp.ones((4, 4), cp.float32).T])
    with pytest.raises(TypeError, match="supported: float16"):
        foreach.zero_([cp.ones(3, cp.int32)])
    with pytest.raises(TypeError, match="one-element float32"):
        foreach.scale_(a, cp.ones(2, cp.float32))


def test_mixed_frameworks_refused():
    torch = pytest.importorskip("torch")
    import cupy as cp

    with pytest.raises(TypeError, match="one call takes arrays of one framework"):
        foreach.add_([torch.ones(3, device="cuda")], [cp.ones(3, cp.float32)])


def test_jax_inputs_read_only():
    jax = pytest.importorskip("jax")
    import cupy as cp

    x = jax.numpy.ones(5, dtype=jax.numpy.float32)
    with pytest.raises(ValueError, match="read-only"):
        foreach.zero_([x])
    out = foreach.add([x], [x])
    assert type(out[0]).__module__.startswith("jax")
    assert float(foreach.norm([x])) == pytest.approx(5 ** 0.5, rel=1e-6)
    del cp


def test_cache_hits_and_no_leak():
    import cupy as cp

    warm = [cp.ones(10, cp.float32)]  # CuPy's and cupylab's first-use work, outside the check
    foreach.add_(warm, 1.0)
    P.cache_clear()
    xs = [cp.ones(10, cp.float32) for _ in range(3)]
    h0 = P.stats["hits"]
    foreach.add_(xs, 1.0)
    foreach.add_(xs, 1.0)
    assert P.stats["hits"] == h0 + 1, (P.stats, h0)
    # the cache holds no reference to the arrays ...
    holders = [type(r).__name__ for x in xs for r in gc.get_referrers(x)
               if isinstance(r, (P.Plan, P.Group)) or r is P._cache]
    assert not holders, holders
    refs = [weakref.ref(x) for x in xs]
    del xs
    gc.collect()
    gc.collect()
    # ... so they die, and their entry goes with them
    alive = [r() for r in refs if r() is not None]
    assert not alive, [type(o).__name__ for a in alive for o in gc.get_referrers(a)]
    assert P.cache_len() == 0, P.cache_len()
    for _ in range(3 * P.CACHE_SIZE):
        ys = [cp.ones(3, cp.float32)]
        foreach.add_(ys, 1.0)
        keep = ys  # noqa: F841 - alive until the next round
    assert P.cache_len() <= P.CACHE_SIZE


def test_reallocated_array_at_same_id_rebuilds():
    torch = pytest.importorskip("torch")
    x = torch.zeros(8, device="cuda")
    foreach.add_([x], 1.0)
    x.data = torch.zeros(16, device="cuda")  # same object, new storage
    foreach.add_([x], 1.0)
    assert torch.equal(x, torch.ones(16, device="cuda"))


def test_large_more_than_2_31_elements():
    import cupy as cp

    n = 2**31 + 9
    x = cp.zeros(n, dtype=cp.float16)
    foreach.add_([x, cp.zeros(3, cp.float16)], 1.0)
    for i in (0, 2**31 - 1, 2**31, n - 1):
        assert float(x[i]) == 1.0
    assert float(foreach.norm([x])) == pytest.approx(n ** 0.5, rel=1e-5)
    del x


# -- functional optimizers against float64 references ------------------------------------------
@pytest.mark.parametrize("adamw", [False, True])
@pytest.mark.parametrize("combo", [("float32", "float32", False), ("bfloat16", "float32", True),
                                   ("float64", "float64", False)])
def test_adam_functional(adamw, combo):
    import cupy as cp

    pd, sd, master = combo
    rng = np.random.default_rng(7)
    sizes = [1, 0, 33, 4099]
    hp = [host_data(rng, (s,), "float32") for s in sizes]
    p = [from_host("cupy", h.astype(np.float64)).astype(pd if pd != "bfloat16" else "float32")
         for h in hp]
    if pd == "bfloat16":
        import ml_dtypes

        p = [from_host("cupy", h.astype(ml_dtypes.bfloat16)) for h in hp]
    mp = [cp.asarray(np.asarray(to_host(x), np.float32)) for x in p] if master else None
    m = [cp.zeros(s, sd) for s in sizes]
    v = [cp.zeros(s, sd) for s in sizes]
    ref = [(np.asarray(to_host(x), np.float64), np.zeros(s), np.zeros(s)) for x, s in zip(p, sizes)]
    lr = cp.full((1,), 1e-2, cp.float32)
    for step in range(1, 6):
        hg = [host_data(rng, (s,), "float32").astype(np.float64) for s in sizes]
        g = [from_host("cupy", h).astype("float32" if pd == "bfloat16" else pd) for h in hg]
        if pd == "bfloat16":
            import ml_dtypes

            g = [from_host("cupy", h.astype(ml_dtypes.bfloat16)) for h in hg]
            hg = [h.astype(ml_dtypes.bfloat16).astype(np.float64) for h in hg]
        optim.adam_(p, g, m, v, lr=lr if step % 2 else 1e-2, step=step, weight_decay=0.1,
                    adamw=adamw, master_params=mp)
        ref = [R.adam_step(a, b, c, d, lr=1e-2, step=step, weight_decay=0.1, adamw=adamw)
               for (a, c, d), b in zip(ref, hg)]
    tol = 1e-9 if pd == "float64" else 1e-5  # the device lr is a float32
    for i, (a, _, _) in enumerate(ref):
        got = mp[i] if master else p[i]
        np.testing.assert_allclose(np.asarray(to_host(got), np.float64), a, rtol=tol, atol=tol)


@pytest.mark.parametrize("opts", [dict(momentum=0.0), dict(momentum=0.9, dampening=0.1),
                                  dict(momentum=0.9, nesterov=True, weight_decay=0.01),
                                  dict(momentum=0.5, maximize=True)])
def test_sgd_functional(opts):
    import cupy as cp

    rng = np.random.default_rng(8)
    sizes = [5, 0, 1031]
    hp = [host_data(rng, (s,), "float32") for s in sizes]
    p = [cp.asarray(h) for h in hp]
    bufs = [cp.zeros(s, cp.float32) for s in sizes]
    ref = [(h.astype(np.float64), None) for h in hp]
    for step in range(4):
        hg = [host_data(rng, (s,), "float32") for s in sizes]
        optim.sgd_(p, [cp.asarray(h) for h in hg], bufs, lr=0.1, first_step=step == 0, **opts)
        ref = [R.sgd_step(a, g, b, lr=0.1, first_step=step == 0, **opts)
               for (a, b), g in zip(ref, hg)]
    for x, (a, _) in zip(p, ref):
        np.testing.assert_allclose(cp.asnumpy(x), a, rtol=1e-5, atol=1e-5)


def test_lion_functional_and_found_inf():
    import cupy as cp

    rng = np.random.default_rng(9)
    sizes = [7, 2050]
    p = [cp.asarray(host_data(rng, (s,), "float32")) for s in sizes]
    m = [cp.zeros(s, cp.float32) for s in sizes]
    ref = [(cp.asnumpy(x).astype(np.float64), np.zeros(s)) for x, s in zip(p, sizes)]
    for _ in range(5):
        hg = [host_data(rng, (s,), "float32") for s in sizes]
        optim.lion_(p, [cp.asarray(h) for h in hg], m, lr=1e-3, weight_decay=0.1)
        ref = [R.lion_step(a, g, b, lr=1e-3, weight_decay=0.1) for (a, b), g in zip(ref, hg)]
    for x, (a, _) in zip(p, ref):
        np.testing.assert_allclose(cp.asnumpy(x), a, rtol=1e-5, atol=1e-6)
    before = [x.copy() for x in p]
    fi = cp.ones(1, cp.float32)
    step = cp.full(1, 3.0, cp.float32)
    optim.lion_(p, [cp.ones(s, cp.float32) for s in sizes], m, lr=1.0, found_inf=fi)
    optim.increment_step_(step, fi)
    assert all(bool((a == b).all()) for a, b in zip(p, before)) and float(step[0]) == 3.0
    optim.increment_step_(step)
    assert float(step[0]) == 4.0
    # a NaN gradient makes the parameter NaN (sign of NaN is NaN, as torch.sign and np.sign)
    q, mq = [cp.ones(5, cp.float32)], [cp.zeros(5, cp.float32)]
    gq = cp.asarray(np.array([np.nan, 1.0, -1.0, 0.0, np.nan], np.float32))
    optim.lion_(q, [gq], mq, lr=0.5)
    want = R.lion_step(np.ones(5), cp.asnumpy(gq), np.zeros(5), lr=0.5)[0]
    np.testing.assert_array_equal(cp.asnumpy(q[0]), want)
    assert np.isnan(want[0]) and want[3] == 1.0


def test_clip_is_captured_in_a_cuda_graph():
    """A host synchronisation inside capture fails it: clip_by_global_norm_ has none."""
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(s, generator=g, device="cuda") for s in (3, 5000, 0, 70001)]
    want = [x.double() for x in xs]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        foreach.clip_by_global_norm_(xs, 1e9)  # builds the table outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total = foreach.clip_by_global_norm_(xs, 1.0)
    graph.replay()
    norm = float(torch.sqrt(sum((w ** 2).sum() for w in want)))
    assert float(total) == pytest.approx(norm, rel=1e-5)
    for x, w in zip(xs, want):
        torch.testing.assert_close(x.double(), w * (1.0 / (norm + 1e-6)), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("u", P.ADAM_U_CHOICES)
def test_adam_fp32_every_vector_count(u, monkeypatch):
    """Every built U (vectors in flight per thread) of the float32 Adam kernel is correct,
    including the remainder loop (vector counts that are not a multiple of U * 256)."""
    import cupy as cp

    monkeypatch.setattr(P, "ADAM_F32_U", u)
    rng = np.random.default_rng(11)
    sizes = [4096 * 3 + 4 * 257 + 3, 5, 65536 + 12]
    hp = [host_data(rng, (s,), "float32") for s in sizes]
    hg = [host_data(rng, (s,), "float32") for s in sizes]
    p = [cp.asarray(h) for h in hp]
    m = [cp.zeros(s, cp.float32) for s in sizes]
    v = [cp.zeros(s, cp.float32) for s in sizes]
    optim.adamw_(p, [cp.asarray(h) for h in hg], m, v, lr=1e-2, step=1)
    for x, a, g in zip(p, hp, hg):
        want = R.adam_step(a, g, np.zeros(a.shape), np.zeros(a.shape), lr=1e-2, step=1,
                           weight_decay=1e-2, adamw=True)[0]
        np.testing.assert_allclose(cp.asnumpy(x), want, rtol=1e-5, atol=1e-6)


def test_prepared_calls_replay_on_device_values():
    import cupy as cp

    rng = np.random.default_rng(12)
    sizes = [3, 0, 5000, 17]
    xs = [cp.asarray(host_data(rng, (s,), "float32")) for s in sizes]
    ys = [cp.asarray(host_data(rng, (s,), "float32")) for s in sizes]
    want = [cp.asnumpy(x).astype(np.float64) for x in xs]
    call = foreach.prepare(foreach.add_, xs, ys, alpha=0.5)
    for x, w in zip(xs, want):  # prepare itself runs nothing
        np.testing.assert_array_equal(cp.asnumpy(x), w.astype(np.float32))
    for _ in range(3):
        call()
    for x, y, w in zip(xs, ys, want):
        np.testing.assert_allclose(cp.asnumpy(x), w + 1.5 * cp.asnumpy(y), rtol=1e-5, atol=1e-5)
    before = R.global_norm([cp.asnumpy(y) for y in ys])
    clip = foreach.prepare(foreach.clip_by_global_norm_, ys, 1.0)
    total = clip()
    assert total is clip.result and float(total) == pytest.approx(before, rel=1e-5)
    np.testing.assert_allclose(float(foreach.norm(ys)), min(1.0, before), rtol=1e-5)
    # a prepared Adam step with the step counter on the device
    p = [cp.asarray(host_data(rng, (s,), "float32")) for s in sizes]
    g = [cp.asarray(host_data(rng, (s,), "float32")) for s in sizes]
    m = [cp.zeros(s, cp.float32) for s in sizes]
    v = [cp.zeros(s, cp.float32) for s in sizes]
    ref = [(cp.asnumpy(a).astype(np.float64), np.zeros(s), np.zeros(s)) for a, s in zip(p, sizes)]
    step = cp.zeros(1, cp.float32)
    inc = foreach.prepare(optim.increment_step_, step)
    adam = foreach.prepare(optim.adam_, p, g, m, v, lr=1e-2, step=step)
    for k in range(1, 4):
        inc()
        adam()
        ref = [R.adam_step(a, cp.asnumpy(gg), b, c, lr=1e-2, step=k)
               for (a, b, c), gg in zip(ref, g)]
    assert float(step[0]) == 3.0
    for a, (w, _, _) in zip(p, ref):
        np.testing.assert_allclose(cp.asnumpy(a), w, rtol=1e-5, atol=1e-6)


class _CAI:
    """A bare __cuda_array_interface__ producer around a CuPy array (the generic CAI path)."""

    def __init__(self, a):
        self._a = a

    @property
    def __cuda_array_interface__(self):
        return self._a.__cuda_array_interface__


def test_cai_and_numba_lists():
    import cupy as cp

    rng = np.random.default_rng(13)
    hx = [host_data(rng, (s,), "float32") for s in (1, 0, 999)]
    hy = [host_data(rng, (s,), "float32") for s in (1, 0, 999)]
    xs = [cp.asarray(h) for h in hx]
    foreach.add_([_CAI(x) for x in xs], [_CAI(cp.asarray(h)) for h in hy], alpha=2.0)
    for x, a, b in zip(xs, hx, hy):
        np.testing.assert_allclose(cp.asnumpy(x), a.astype(np.float64) + 2.0 * b, rtol=1e-6)
    numba_cuda = pytest.importorskip("numba.cuda")
    nx = [numba_cuda.as_cuda_array(x) for x in xs]
    out = foreach.mul(nx, nx)
    assert all(type(o).__module__.split(".")[0] in ("numba", "numba_cuda") for o in out)
    for o, x in zip(out, xs):
        np.testing.assert_allclose(o.copy_to_host(), cp.asnumpy(x).astype(np.float64) ** 2,
                                   rtol=1e-6)
    with pytest.raises(TypeError, match="one call takes arrays of one framework"):
        foreach.add_(nx, [_CAI(x) for x in xs])


def test_a_new_list_is_set_up_without_a_host_synchronisation():
    """The table of a list seen for the first time is uploaded behind the stream's queued work
    and the call returns at once (the host does not wait for the GPU)."""
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    ys = [torch.ones(n, device="cuda") for n in (5, 4097, 1)]
    foreach.scale_([torch.ones(7, device="cuda")], 1.0)  # the kernel compiled and loaded first
    torch.cuda.synchronize()
    with hold(s.cuda_stream):  # s spins until the block ends
        with torch.cuda.stream(s):
            foreach.scale_(ys, 3.0)
        assert not s.query()  # returned while the spinning kernel still runs: no host sync
    torch.cuda.synchronize()
    assert all(bool((y == 3).all()) for y in ys)


def test_another_stream_gets_its_own_table():
    """A list set up on stream a and used on stream b gets a copy of its table uploaded on b:
    b's work does not wait for a (where a spinning kernel holds the first upload back), the
    host never waits, and each stream keeps its own table (one workspace per stream; memory
    that goes back behind the stream that used it)."""
    torch = pytest.importorskip("torch")
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    ys = [torch.ones(n, device="cuda") for n in (7, 3000)]
    zs = [torch.zeros(n, device="cuda") for n in (7, 3000)]
    foreach.norm(zs)  # the kernels compiled and loaded first (a module load may synchronise)
    torch.cuda.synchronize()
    P.cache_clear()  # no table of another test's stream with a recycled handle
    with hold(a.cuda_stream):  # a spins until the block ends
        with torch.cuda.stream(a):
            foreach.norm(ys)  # a new list: its table is uploaded on a, behind the spin
        plan = next(p for p in list(P._cache.values()) if p.stream == a.cuda_stream)
        with torch.cuda.stream(b):
            total = foreach.norm(ys)  # the same list on b
        assert set(plan.siblings) == {b.cuda_stream}
        b.synchronize()  # done while a still spins: b waited for nothing on a
        assert not a.query()
    assert float(total) == pytest.approx(3007 ** 0.5, rel=1e-6)
    with torch.cuda.stream(b):
        foreach.norm(ys)
    assert set(plan.siblings) == {b.cuda_stream}  # no new copy
    torch.cuda.synchronize()


def test_a_captured_plan_outlives_the_cache_bound():
    """A graph captured on a stream the list was never used on eagerly points into the
    list's first table: it stays alive however many other lists push it out of the cache,
    and the replays stay right."""
    torch = pytest.importorskip("torch")
    xs = [torch.full((n,), 2.0, device="cuda") for n in (5, 70001)]
    foreach.scale_(xs, 1.0)  # set up eagerly, on the current stream
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        foreach.scale_(xs, 0.5)
    assert any(p.captured for kept in P._pinned.values() for p in kept)
    others = [[torch.ones(3, device="cuda")] for _ in range(P.CACHE_SIZE + 5)]
    for o in others:
        foreach.scale_(o, 1.0)  # the list's entry leaves the LRU cache
    for x in xs:
        x.fill_(8.0)
    graph.replay()
    torch.cuda.synchronize()
    assert all(bool((x == 4.0).all()) for x in xs)


def test_a_new_list_during_capture_is_refused_clearly():
    cp = pytest.importorskip("cupy")
    xs = [cp.ones(n, dtype=cp.float32) for n in (3, 1000)]
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        try:
            with pytest.raises(RuntimeError, match="warm-up"):
                foreach.scale_(xs, 2.0)
        finally:
            s.end_capture()
    foreach.scale_(xs, 2.0)  # outside capture it is set up as usual
    assert all(bool((x == 2).all()) for x in xs)


def test_lerp_copy_and_unscale_round_as_the_references_do():
    """lerp switches formula on |weight| < 0.5 as torch (it tested weight < 0.5: 1 ulp off for
    negative weights, -inf for NaN at lerp(1, inf, -1)); copy_ from float64 to 16 bits rounds
    once, as NumPy (it went through float32); the optimizers divide by grad_scale (a
    multiplication by its reciprocal is 1 ulp off for scales that are not powers of two)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(21)
    x = torch.randn(100_003, generator=g, device="cuda")
    y = torch.randn(100_003, generator=g, device="cuda")
    for w in (-2.5, -0.4, 0.3, 0.7):
        out = foreach.lerp([x], [y], w)[0]
        assert torch.equal(out, torch.lerp(x, y, w)), w
    h = np.array([1.0004882812509095, 1.0039062500009095, -3.14159265358979, 65519.9999],
                 dtype=np.float64)
    # float16: NumPy rounds float64 once; bfloat16: the nearest values, by hand (torch and
    # a cast through float32 give 1.0 for the second, which lies just above a midpoint)
    bf16 = torch.tensor([1.0, 1.0078125, -3.140625, 65536.0], dtype=torch.bfloat16)
    for name, want in (("float16", torch.from_numpy(h.astype(np.float16))), ("bfloat16", bf16)):
        dst = torch.empty(4, device="cuda", dtype=getattr(torch, name))
        foreach.copy_([dst], [torch.from_numpy(h).cuda()])
        assert torch.equal(dst.cpu(), want), name
    # p = 0, lr = 1: the step leaves exactly -(grad / grad_scale) in p (the reference divides
    # in NumPy: torch's CUDA tensor / scalar multiplies by the rounded reciprocal)
    p = torch.zeros(4099, device="cuda")
    gr = torch.randn(4099, generator=g, device="cuda") * 3
    optim.sgd_([p], [gr], lr=1.0, grad_scale=torch.tensor([3.0], device="cuda"))
    want = -(gr.cpu().numpy() / np.float32(3.0))
    assert want.dtype == np.float32 and np.array_equal(p.cpu().numpy(), want)


@pytest.mark.parametrize("which", ["nonfinite_check", "unscale_"])
def test_a_prepared_check_reports_each_replay_on_its_own(which):
    """The flag a prepared call allocated was zeroed only when it was prepared: once a replay
    had seen an inf, every later replay reported one. It is zeroed at every replay, in a
    captured graph too; a flag passed in keeps accumulating, as across calls."""
    import cupy as cp

    xs = [cp.ones(5, cp.float32), cp.ones(70001, cp.float32)]
    fn = getattr(foreach, which)
    args = (xs,) if which == "nonfinite_check" else (xs, 1.0)
    call = foreach.prepare(fn, *args)
    fi = call.result
    assert float(fi[0]) == 0.0
    seen = []
    for bad in (False, True, False, True, False):
        xs[1][7] = cp.inf if bad else 1.0
        assert call() is fi
        seen.append(float(fi[0]))
    assert seen == [0.0, 1.0, 0.0, 1.0, 0.0]
    s = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with s:
        s.begin_capture()
        call()
        graph = s.end_capture()
    seen = []
    for bad in (True, False, True):
        xs[1][7] = cp.inf if bad else 1.0  # on the null stream, which s does not wait for
        cp.cuda.Device().synchronize()
        graph.launch(s)
        s.synchronize()
        seen.append(float(fi[0]))
    assert seen == [1.0, 0.0, 1.0]
    mine = cp.zeros(1, cp.float32)
    acc = foreach.prepare(fn, *args, found_inf=mine)
    for bad in (True, False):
        xs[1][7] = cp.inf if bad else 1.0
        acc()
    assert acc.result is mine and float(mine[0]) == 1.0
    assert all(bool((x == 1).all()) for x in xs)  # unscaled by 1.0, or only read
