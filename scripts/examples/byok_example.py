"""Bring your own kernel: the seed's ``vector_add.cu`` and a user's fused kernel, on torch and
CuPy arrays (whichever are installed), checked against NumPy.

The seed needed a header, a host launcher, a Python C-API module and a torch extension build
for this. With cupylab it is::

    mod = cupylab.load_kernels("vector_add.cu")
    mod["vector_add"].launch_1d(n, a, b, c, n)

Run from the repository root: ``python scripts/examples/byok_example.py`` (the GPU tests do,
so this file cannot go stale). Exit status 0: every check passed; 2: no CUDA GPU to run on.
"""
import sys
from pathlib import Path

import numpy as np

import cupylab

HERE = Path(__file__).resolve().parent


def frameworks():
    """``(name, to_device, to_host, empty_like, to_float64)`` for each usable framework."""
    out = []
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() > 0:
            out.append(("cupy", cp.asarray, cp.asnumpy, cp.empty_like,
                        lambda x: x.astype(cp.float64)))
    except Exception:  # noqa: BLE001 - not installed, or no driver/GPU
        pass
    try:
        import torch

        if torch.cuda.is_available():
            out.append(("torch", lambda h: torch.from_numpy(h).to("cuda"),
                        lambda t: t.cpu().numpy(), torch.empty_like, lambda t: t.double()))
    except Exception:  # noqa: BLE001
        pass
    return out


def main():
    fws = frameworks()
    if not fws:
        print("byok_example: no CUDA GPU through CuPy or torch; nothing to run")
        return 2

    # 1. The seed's example: an extern "C" kernel, its signature read from the source.
    vector_add = cupylab.load_kernels(HERE / "vector_add.cu")["vector_add"]
    print("loaded", vector_add)

    # 2. A templated fused kernel as a NumPy-style function (output in the caller's type);
    #    one instance per dtype, compiled on first use and cached on disk.
    fused = cupylab.ElementwiseKernel(cupylab.load_kernels(HERE / "fused.cu"),
                                      "fused_add_mul<{T}>")
    print("wrapped", fused)

    rng = np.random.default_rng(0)
    n = 1_000_003  # odd on purpose: the grid does not divide it
    a_h = rng.standard_normal(n, dtype=np.float32)
    b_h = rng.standard_normal(n, dtype=np.float32)

    for name, to_dev, to_host, empty_like, f64 in fws:
        a, b = to_dev(a_h), to_dev(b_h)

        c = empty_like(a)
        vector_add.launch_1d(n, a, b, c, n)                        # grid from the SM count
        np.testing.assert_allclose(to_host(c), a_h + b_h, rtol=1e-6)

        c2 = empty_like(a)
        vector_add(a, b, c2, n, grid=(n + 255) // 256, block=256)  # explicit configuration
        np.testing.assert_allclose(to_host(c2), a_h + b_h, rtol=1e-6)

        d = fused(a, b, 3.0)
        if type(d) is not type(a):
            raise AssertionError(f"{name}: fused returned {type(d)}, expected {type(a)}")
        np.testing.assert_allclose(to_host(d), (a_h + b_h) * np.float32(3.0), rtol=1e-6)

        d64 = fused(f64(a), f64(b), 0.5)                            # float64 instance
        np.testing.assert_allclose(to_host(d64), (a_h.astype(np.float64) + b_h) * 0.5,
                                   rtol=1e-12)

        # What CuPy's RawKernel would have launched anyway, cupylab refuses before launching.
        try:
            vector_add.launch_1d(n, f64(a), b, c, n)
        except TypeError as e:
            print(f"{name}: refused as expected: {e}")
        else:
            raise AssertionError(f"{name}: a float64 array was accepted for const float* a")

        print(f"{name}: vector_add OK, fused_add_mul float32/float64 OK "
              f"(returns {type(d).__module__}.{type(d).__name__})")
    print("byok_example: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
