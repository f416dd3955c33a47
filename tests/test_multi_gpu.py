"""Several GPUs in one process: every family runs on the device its inputs live on (not the
current one), allocates its outputs there, leaves the current device as it was, and refuses
inputs on two devices. Skipped with a reason on a machine with fewer than two GPUs."""
import numpy as np
import pytest

import cupylab
from cupylab import foreach

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _gpus():
    try:
        return cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver: the gpu marker skips the test anyway
        return 0


@pytest.fixture(autouse=True)
def two_gpus():
    if _gpus() < 2:
        pytest.skip(f"needs two GPUs ({_gpus()} here)")
    cp.cuda.Device(0).use()
    yield
    assert cp.cuda.runtime.getDevice() == 0, "an operator left another device current"


def _on(dev, f):
    with cp.cuda.Device(dev):
        return f()


def test_elementwise_on_the_second_gpu_twice():
    rng = np.random.default_rng(3)
    ha, hb = rng.standard_normal(4099).astype(np.float32), rng.integers(1, 9, 4099, np.int32)
    a, b = _on(1, lambda: cp.asarray(ha)), _on(1, lambda: cp.asarray(hb))
    for _ in range(2):  # the second call tries the lean path, which must not launch on cuda:0
        r = cupylab.add(a, b)
        f = cupylab.fused_add_mul(a, a, 0.5)
        q = cupylab.floor_divide(b[::-1], 3)
        assert r.device.id == f.device.id == q.device.id == 1
    np.testing.assert_allclose(cp.asnumpy(r), ha + hb, rtol=1e-6)
    np.testing.assert_allclose(cp.asnumpy(f), ha, rtol=1e-6)
    np.testing.assert_array_equal(cp.asnumpy(q), hb[::-1] // 3)
    out = _on(1, lambda: cp.empty(4099, cp.float64))
    assert cupylab.add(a, b, out=out) is out


def test_rowwise_and_cross_entropy_on_the_second_gpu():
    rng = np.random.default_rng(4)
    hx = rng.standard_normal((33, 1000)).astype(np.float32)
    hw = rng.standard_normal(1000).astype(np.float32)
    ht = rng.integers(0, 1000, 33).astype(np.int64)
    x, w, t = (_on(1, lambda h=h: cp.asarray(h)) for h in (hx, hw, ht))
    y = cupylab.rms_norm(x, w, eps=1e-6)
    s = cupylab.softmax(x)
    loss = cupylab.cross_entropy(x, t)
    assert y.device.id == s.device.id == loss.device.id == 1
    ref = hx / np.sqrt((hx.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * hw
    np.testing.assert_allclose(cp.asnumpy(y), ref, rtol=1e-5, atol=1e-5)
    e = np.exp(hx - hx.max(-1, keepdims=True))
    np.testing.assert_allclose(cp.asnumpy(s), e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)
    lse = np.log(np.exp(hx.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(float(loss), (lse - hx[np.arange(33), ht]).mean(), rtol=1e-5)


def test_foreach_and_optimizer_lists_on_the_second_gpu():
    xs = [_on(1, lambda n=n: cp.full(n, 2.0, cp.float32)) for n in (1, 300, 5000)]
    for _ in range(2):
        foreach.add_(xs, 1.0)
    assert all(float(x[0]) == 4.0 and x.device.id == 1 for x in xs)
    n = foreach.norm(xs)
    assert n.device.id == 1
    np.testing.assert_allclose(float(n), 4.0 * np.sqrt(5301), rtol=1e-6)
    mixed = xs[:2] + [cp.ones(3, cp.float32)]  # one array on cuda:0
    with pytest.raises(ValueError, match="GPU|device"):
        foreach.add_(mixed, 1.0)


def test_user_kernel_on_the_second_gpu():
    k = cupylab.load_kernels(source=(
        'extern "C" __global__ void twice(const float* a, float* b, int n) {'
        ' int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) b[i] = 2 * a[i]; }'))["twice"]
    a = _on(1, lambda: cp.arange(1000, dtype=cp.float32))
    b = _on(1, lambda: cp.zeros(1000, cp.float32))
    for _ in range(2):
        k.launch_1d(1000, a, b, 1000)
    _on(1, lambda: cp.cuda.Device().synchronize())
    np.testing.assert_array_equal(cp.asnumpy(b), 2 * np.arange(1000, dtype=np.float32))
    c = cp.zeros(1000, cp.float32)  # cuda:0
    with pytest.raises(ValueError, match="different GPUs"):
        k.launch_1d(1000, a, c, 1000)


def test_torch_tensors_on_the_second_gpu():
    torch = pytest.importorskip("torch")
    x = torch.randn(4096, device="cuda:1")
    w = torch.randn(64, device="cuda:1")
    for _ in range(2):
        r = cupylab.multiply(x, 3.0)
        y = cupylab.rms_norm(x.view(64, 64), w)
    assert r.device == y.device == torch.device("cuda:1")
    torch.testing.assert_close(r, x * 3.0)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x.view(64, 64), (64,), w, 1e-6),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="different GPUs"):
        cupylab.add(x, torch.ones(4096, device="cuda:0"))
