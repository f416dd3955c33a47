"""Quick GPU smoke check: a handful of calls per framework, printed. Not the test suite
(that is scripts/gpu_check.sh); useful as a first look on a new machine."""
import sys
import time
import traceback

import numpy as np

import cupylab

results = []


def check(name, fn):
    try:
        fn()
        results.append((name, "ok", ""))
    except Exception as e:  # noqa: BLE001
        results.append((name, "FAIL", f"{type(e).__name__}: {e}"))
        traceback.print_exc()


def t_cupy():
    import cupy as cp
    x = cp.random.rand(1000003, dtype=cp.float32)
    y = cp.random.rand(1000003, dtype=cp.float32)
    z = cupylab.vector_add(x, y)
    assert isinstance(z, cp.ndarray)
    np.testing.assert_allclose(cp.asnumpy(z), cp.asnumpy(x) + cp.asnumpy(y), rtol=1e-6)
    z2 = cupylab.fused_add_mul(x[1:], y[1:], 3.0)
    np.testing.assert_allclose(cp.asnumpy(z2), (cp.asnumpy(x[1:]) + cp.asnumpy(y[1:])) * 3, rtol=1e-6)
    a = cp.arange(12, dtype=cp.int32).reshape(3, 4)
    b = cupylab.div(a[:, ::-1], 3)
    np.testing.assert_array_equal(cp.asnumpy(b), cp.asnumpy(a[:, ::-1]) // 3)


def t_torch():
    import torch
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64):
        x = (torch.randn(4097, device="cuda") * 10).to(dt)
        y = (torch.randn(4097, device="cuda") * 10).to(dt)
        z = cupylab.add(x, y)
        assert isinstance(z, torch.Tensor) and z.dtype == dt
        ref = x.double() + y.double()
        assert torch.allclose(z.double(), ref.to(dt).double(), rtol=1e-2, atol=1e-2), dt
    x = torch.randn(64, 33, device="cuda")
    y = torch.randn(33, device="cuda")
    z = cupylab.mul(x.t().contiguous().t(), y)
    assert torch.allclose(z, x * y)
    out = torch.empty_like(x)
    r = cupylab.sub(x, y, out=out)
    assert r is out and torch.allclose(out, x - y)


def t_jax():
    import jax.numpy as jnp
    import jax
    x = jnp.arange(1000, dtype=jnp.float32)
    z = cupylab.add(x, 1.5)
    assert isinstance(z, jax.Array), type(z)
    np.testing.assert_allclose(np.asarray(z), np.arange(1000) + 1.5)
    xb = jnp.arange(1000, dtype=jnp.bfloat16)
    zb = cupylab.mul(xb, 2.0)
    np.testing.assert_allclose(np.asarray(zb).astype(np.float64), np.asarray(xb).astype(np.float64) * 2)


def t_numba():
    from numba import cuda
    x = cuda.to_device(np.arange(100, dtype=np.float64))
    z = cupylab.add(x, x)
    np.testing.assert_allclose(z.copy_to_host(), np.arange(100) * 2.0)


def t_host_cost():
    import torch
    x = torch.randn(1024, device="cuda")
    y = torch.randn(1024, device="cuda")
    z = torch.empty_like(x)
    for label, f in (("torch.add(out=)", lambda: torch.add(x, y, out=z)),
                     ("cupylab.add(out=)", lambda: cupylab.add(x, y, out=z)),
                     ("x + y", lambda: x + y),
                     ("cupylab.add", lambda: cupylab.add(x, y))):
        for _ in range(200):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3000):
            f()
        torch.cuda.synchronize()
        print(f"host {label:24s} {(time.perf_counter() - t) / 3000 * 1e6:6.2f} us/call")


for name, fn in (("cupy", t_cupy), ("torch", t_torch), ("jax", t_jax), ("numba", t_numba),
                 ("host_cost", t_host_cost)):
    check(name, fn)
for r in results:
    print("SMOKE", *r)
sys.exit(any(r[1] != "ok" for r in results))
