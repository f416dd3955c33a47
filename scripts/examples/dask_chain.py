"""cupylab on a Dask array of CuPy chunks: a chain of cupylab operators and a Dask reduction
on a ``dask.distributed`` local cluster, checked against the same chain on one CuPy array, and
timed against that single-GPU chain and against the same Dask graph built with CuPy's own
operators.

    python scripts/examples/dask_chain.py                       # 4 GiB of float32, local cluster
    python scripts/examples/dask_chain.py --rows 4096 --cols 512 --chunk-rows 1024   # small
    python scripts/examples/dask_chain.py --cluster cuda        # dask-cuda: one worker per GPU

The chain is ``y = rms_norm((x + b) * 0.5, w)`` followed by ``y.sum()``. Needs CuPy, Dask and,
for ``--cluster local`` or ``cuda``, ``distributed`` (and ``dask-cuda`` for ``cuda``).
"""
import argparse
import time

import cupy as cp
import dask.array as da
import numpy as np

import cupylab


def chain_cupylab(x, b, w):
    return cupylab.rms_norm(cupylab.multiply(cupylab.add(x, b), 0.5), w, eps=1e-6)


def chain_cupy(x, b, w):
    h = (x + b) * 0.5
    return h / ((h * h).mean(axis=-1, keepdims=True) + 1e-6) ** 0.5 * w


def random_chunks(rows, cols, chunk_rows):
    """A Dask array of float32 CuPy chunks, each made on the GPU by the worker that holds it."""
    def block(block_info=None):
        info = block_info[None]
        rng = cp.random.default_rng(info["array-location"][0][0])
        return rng.standard_normal(info["chunk-shape"], dtype=cp.float32)

    n = -(-rows // chunk_rows)
    sizes = (chunk_rows,) * (n - 1) + (rows - chunk_rows * (n - 1),)
    return da.map_blocks(block, chunks=(sizes, (cols,)), dtype=np.float32,
                         meta=cp.empty((0, 0), cp.float32))


def timed(f, repeats):
    f()  # warm-up: kernels compiled or loaded, workers started
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        cp.cuda.Device().synchronize()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--chunk-rows", type=int, default=16384)
    p.add_argument("--cluster", choices=("local", "cuda", "threads"), default="local")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="also write the table as JSON (schema "
                   "cupylab-dask-example/1; docs/perf/dask.json is one)")
    a = p.parse_args(argv)

    client = None
    if a.cluster != "threads":
        import distributed

        if a.cluster == "cuda":
            from dask_cuda import LocalCUDACluster

            cluster = LocalCUDACluster()
        else:
            cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=4,
                                               processes=False, dashboard_address=None)
        client = distributed.Client(cluster)
    rng = cp.random.default_rng(1)
    b = rng.standard_normal(a.cols, dtype=cp.float32)
    w = rng.standard_normal(a.cols, dtype=cp.float32)
    x = random_chunks(a.rows, a.cols, a.chunk_rows).persist()
    one = x.compute()  # the same data as one CuPy array
    gb = one.nbytes / 1e9

    got = float(chain_cupylab(x, b, w).sum().compute())
    ref = float(chain_cupylab(one, b, w).sum())
    want = float(chain_cupy(one.astype(cp.float64), b, w).sum())
    rel = abs(got - want) / max(abs(want), 1e-30)
    print(f"check: Dask + cupylab sum {got:.6e}, one CuPy array + cupylab {ref:.6e}, float64 "
          f"reference {want:.6e} (relative difference {rel:.1e})")
    if not rel < 1e-3:
        raise SystemExit("dask_chain: the Dask result differs from the reference")

    rows = [("one CuPy array, cupylab chain", lambda: chain_cupylab(one, b, w).sum()),
            ("one CuPy array, CuPy chain", lambda: chain_cupy(one, b, w).sum()),
            ("Dask, cupylab chain", lambda: chain_cupylab(x, b, w).sum().compute()),
            ("Dask, CuPy chain", lambda: chain_cupy(x, b, w).sum().compute())]
    print(f"{a.rows} x {a.cols} float32 ({gb:.2f} GB) in chunks of {a.chunk_rows} rows, "
          f"cluster: {a.cluster}; median of {a.repeats}, wall clock")
    print(f"{'what':34} {'ms':>9} {'GB/s of x':>10}")
    table = []
    for name, f in rows:
        t = timed(f, a.repeats)
        print(f"{name:34} {t * 1e3:9.2f} {gb / t:10.0f}")
        table.append({"what": name, "ms": t * 1e3, "gbps_of_x": gb / t})
    if client is not None:
        client.close()
    if a.json:
        import json
        import sys

        import dask

        doc = {"schema": "cupylab-dask-example/1",
               "command": "python scripts/examples/dask_chain.py " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
               "versions": {"cupylab": cupylab.__version__, "cupy": cp.__version__,
                            "dask": dask.__version__},
               "rows": a.rows, "cols": a.cols, "chunk_rows": a.chunk_rows,
               "cluster": a.cluster, "repeats": a.repeats, "gb": gb,
               "relative_difference": rel, "results": table}
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
