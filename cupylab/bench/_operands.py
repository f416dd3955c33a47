"""Benchmark operands.

Each case gets fresh random values (never zero: magnitudes in [0.5, 2) for floats and 1..100 for
integers, random signs, so that every operand is a valid divisor and integer products cannot
overflow) in one pooled CuPy allocation per operand. When one call's working set is smaller
than twice the L2 cache, the pool holds several *buffer sets* (256-byte aligned slices) that the
timing loop rotates through, so that what is measured is memory, not the cache.

The storage is typed as the dtype itself, or as ``int16`` for bfloat16 (CuPy has no bfloat16);
:meth:`OperandSets.inputs` wraps a set zero-copy for torch (DLPack, then ``view(bfloat16)``),
CuPy (``ml_dtypes.bfloat16``) or JAX (DLPack, then a bitcast for bfloat16).

:func:`sample_to_host` reads chosen elements of any framework's array back as float64 (int64
for integers): that is what the reference check compares.
"""
from __future__ import annotations

import math
import sys

import numpy as np

__all__ = ["ALIGN_BYTES", "MAX_SETS", "SAMPLE", "buffer_sets", "OperandSets", "fill_random",
           "sample_indices", "sample_rows", "sample_to_host", "compare", "dtype_name"]

#: Alignment of every buffer set (bytes): keeps the 16-byte vector paths of the kernels.
ALIGN_BYTES = 256
#: Most buffer sets one case rotates through.
MAX_SETS = 64
#: Elements checked at the start, at the end and at random places in between.
SAMPLE = 65536


def buffer_sets(working_set_bytes: int, l2_bytes: int, cap: int = MAX_SETS) -> int:
    """How many buffer sets make the rotation span at least twice the L2 cache.

    Parameters
    ----------
    working_set_bytes : int
        Bytes one call reads and writes.
    l2_bytes : int
        L2 cache size (0 when unknown: no rotation).
    cap : int
        Upper bound.

    Returns
    -------
    int
        1 when one call already streams past twice the L2 size.
    """
    if l2_bytes <= 0 or working_set_bytes <= 0:
        return 1
    need = 2 * l2_bytes
    if working_set_bytes >= need:
        return 1
    return int(max(1, min(cap, -(-need // working_set_bytes))))


def storage_dtype(dt):
    """NumPy dtype of the storage for cupylab dtype ``dt`` (int16 bits for bfloat16)."""
    return np.dtype(np.int16) if dt.name == "bfloat16" else np.dtype(dt.name)


def cupy_dtype(dt):
    """The dtype a CuPy array of ``dt`` has (``ml_dtypes.bfloat16`` for bfloat16)."""
    if dt.name == "bfloat16":
        try:
            import ml_dtypes  # noqa: PLC0415
        except ImportError:
            raise TypeError("bfloat16 CuPy arrays need the ml_dtypes package "
                            "(pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dt.name)


def fill_random(cp, pool, dt) -> None:
    """Fill the CuPy storage ``pool`` (typed by :func:`storage_dtype`) with random nonzero
    values of dtype ``dt``, on the GPU."""
    count = pool.size
    neg = cp.random.random(count, dtype=np.float32) < 0.5
    if dt.kind == "f":
        ft = np.float64 if dt.name == "float64" else np.float32
        v = cp.random.uniform(0.5, 2.0, count, dtype=ft)
        v = cp.where(neg, -v, v)
        if dt.name == "bfloat16":
            # truncate float32 to its top 16 bits: an exact bfloat16 of magnitude in [0.5, 2)
            bits = (v.view(np.uint32) >> 16).astype(np.uint16)
            pool[...] = bits.view(np.int16)
        else:
            pool[...] = v.astype(pool.dtype, copy=False)
    elif dt.kind == "i":
        v = cp.random.randint(1, 101, size=count)
        pool[...] = cp.where(neg, -v, v).astype(pool.dtype, copy=False)
    else:
        raise TypeError(f"cupylab-bench cannot make random {dt.name} operands")


class OperandSets:
    """Random inputs (and outputs) of one case in pooled storage, ``nsets`` rotated sets.

    Parameters
    ----------
    cp : module
        CuPy.
    dt : cupylab._dtypes.DType
    shape : tuple of int
    n_inputs : int
    nsets : int
    with_out : bool
        Also allocate an output per set (filled with 0xFF bytes: NaN for floats, -1 for ints,
        so that a kernel that writes nothing fails the check).
    in_dts : sequence of DType, optional
        Per input, its dtype when the inputs differ (a mixed-dtype case); ``dt`` is then the
        output's dtype.
    """

    def __init__(self, cp, dt, shape, n_inputs, nsets, with_out=True, in_dts=None):
        n = math.prod(shape)
        if n < 1:
            raise ValueError(f"cupylab-bench: shape {shape} has no elements")
        self.cp, self.dt, self.shape, self.n, self.nsets = cp, dt, tuple(shape), n, int(nsets)
        self.in_dts = list(in_dts) if in_dts is not None else [dt] * n_inputs
        align = max(1, ALIGN_BYTES // min(d.itemsize for d in self.in_dts + [dt]))
        self.stride = -(-n // align) * align
        total = self.nsets * self.stride
        self.pools = []
        self._pool_dt = {}
        for d in self.in_dts:
            p = cp.empty(total, dtype=storage_dtype(d))
            fill_random(cp, p, d)
            self.pools.append(p)
            self._pool_dt[id(p)] = d
        self.out_pool = None
        if with_out:
            self.out_pool = cp.empty(total, dtype=storage_dtype(dt))
            self._pool_dt[id(self.out_pool)] = dt
            cp.cuda.runtime.memsetAsync(self.out_pool.data.ptr, 0xFF, self.out_pool.nbytes,
                                        cp.cuda.get_current_stream().ptr)
        cp.cuda.runtime.deviceSynchronize()
        self._cache: dict = {}

    @property
    def nbytes(self) -> int:
        """Bytes held by the pools."""
        out = self.out_pool.nbytes if self.out_pool is not None else 0
        return sum(p.nbytes for p in self.pools) + out

    def _raw(self, pool, j, dtype):
        off = j * self.stride * self._pool_dt[id(pool)].itemsize
        return self.cp.ndarray(self.shape, dtype=dtype, memptr=pool.data + off)

    def _wrap(self, framework, pool, j):
        dt = self._pool_dt[id(pool)]
        if framework == "cupy":
            return self._raw(pool, j, cupy_dtype(dt))
        raw = self._raw(pool, j, storage_dtype(dt))
        if framework == "torch":
            torch = sys.modules["torch"]
            t = torch.from_dlpack(raw)
            return t.view(torch.bfloat16) if dt.name == "bfloat16" else t
        if framework == "jax":
            jax = sys.modules["jax"]
            a = jax.dlpack.from_dlpack(raw)
            if dt.name == "bfloat16":
                a = jax.lax.bitcast_convert_type(a, jax.numpy.bfloat16)
            return a
        raise ValueError(f"unknown framework {framework!r}")

    def inputs(self, framework: str, j: int) -> list:
        """Set ``j``'s inputs as ``framework`` arrays (zero-copy except JAX bfloat16)."""
        key = (framework, j)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = [self._wrap(framework, p, j) for p in self.pools]
        return got

    def out(self, framework: str, j: int):
        """Set ``j``'s output as a ``framework`` array (torch or CuPy)."""
        if self.out_pool is None:
            raise ValueError("these operand sets have no outputs")
        if framework == "jax":
            raise ValueError("JAX arrays are immutable: no out= buffer for JAX")
        key = (framework, j, "out")
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = self._wrap(framework, self.out_pool, j)
        return got

    def poison_out(self, j: int) -> None:
        """Refill set ``j``'s output with 0xFF bytes (before a peer writes it)."""
        cp, isz = self.cp, self.dt.itemsize
        cp.cuda.runtime.memsetAsync(self.out_pool.data.ptr + j * self.stride * isz, 0xFF,
                                    self.n * isz, cp.cuda.get_current_stream().ptr)

    def host_inputs(self, j: int, idx) -> list:
        """Set ``j``'s inputs at flat indices ``idx``, as float64/int64 NumPy arrays (read from
        the storage, so bfloat16 needs no ml_dtypes)."""
        cp = self.cp
        out = []
        for p in self.pools:
            d = self._pool_dt[id(p)]
            raw = self._raw(p, j, storage_dtype(d))
            host = cp.asnumpy(raw.reshape(-1)[cp.asarray(idx)])
            if d.name == "bfloat16":
                host = _bf16_bits_to_f32(host)
            out.append(host.astype(np.int64 if host.dtype.kind in "iu" else np.float64))
        return out

    def release(self) -> None:
        """Drop every wrapper and pool."""
        self._cache.clear()
        self.pools = []
        self.out_pool = None
        self._pool_dt = {}


def _bf16_bits_to_f32(bits):
    """bfloat16 bit patterns (any 16-bit integer dtype) -> float32 values (exact)."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def sample_indices(n: int, rng, k: int = SAMPLE):
    """Flat indices to check: everything up to ``3 k`` elements, else the first ``k``, the last
    ``k`` and up to ``k`` random ones in between (sorted)."""
    if n <= 3 * k:
        return np.arange(n, dtype=np.int64)
    mid = np.unique(rng.integers(k, n - k, size=k, dtype=np.int64))
    return np.concatenate([np.arange(k, dtype=np.int64), mid, np.arange(n - k, n, dtype=np.int64)])


def sample_rows(shape, rng, k: int = SAMPLE):
    """Flat indices of whole rows (last axis) to check, for row-wise operators: every row up
    to about ``3 k`` elements, else the first and last row and random rows in between, about
    ``3 k`` elements in all (at least the three rows). Sorted."""
    cols = int(shape[-1]) if shape else 1
    rows = int(math.prod(shape[:-1])) if len(shape) > 1 else 1
    want = max(3, (3 * k) // max(cols, 1))
    if rows <= want:
        sel = np.arange(rows, dtype=np.int64)
    else:
        mid = rng.choice(np.arange(1, rows - 1, dtype=np.int64), size=want - 2, replace=False)
        sel = np.unique(np.concatenate([[0, rows - 1], mid]).astype(np.int64))
    return (sel[:, None] * cols + np.arange(cols, dtype=np.int64)[None, :]).reshape(-1)


def dtype_name(obj) -> str:
    """The dtype of a torch / CuPy / JAX array as a plain name (``"bfloat16"``)."""
    s = str(getattr(obj, "dtype", None))
    return s[6:] if s.startswith("torch.") else s


def sample_to_host(obj, idx):
    """Elements ``idx`` of the flattened array ``obj`` (torch, CuPy or JAX) as a NumPy float64
    array (int64 for integer dtypes)."""
    top = type(obj).__module__.split(".", 1)[0]
    if top == "torch":
        torch = sys.modules["torch"]
        flat = obj.detach().reshape(-1)
        sel = flat.index_select(0, torch.as_tensor(idx, device=flat.device))
        if sel.dtype in (torch.bfloat16, torch.float16):
            sel = sel.float()
        host = sel.cpu().numpy()
    elif top == "cupy":
        cp = sys.modules["cupy"]
        if obj.dtype.name == "bfloat16":
            bits = cp.ndarray(obj.shape, dtype=np.uint16, memptr=obj.data, strides=obj.strides)
            host = _bf16_bits_to_f32(cp.asnumpy(bits.reshape(-1)[cp.asarray(idx)]))
        else:
            host = cp.asnumpy(obj.reshape(-1)[cp.asarray(idx)])
    elif top in ("jax", "jaxlib"):
        jnp = sys.modules["jax"].numpy
        sel = obj.reshape(-1)[jnp.asarray(idx)]
        if sel.dtype in (jnp.bfloat16, jnp.float16):
            sel = sel.astype(jnp.float32)
        host = np.asarray(sel)
    else:
        raise TypeError(f"cupylab-bench cannot read a {type(obj).__module__}."
                        f"{type(obj).__qualname__} result")
    return host.astype(np.int64 if host.dtype.kind in "iub" else np.float64)


#: The spacing of the smallest (subnormal) values of the 16-bit float dtypes
_SUBNORMAL_STEP = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133}


def compare(got, ref, idx, dt, rtol, atol, magnitude=None, normwise=False):
    """``None`` when ``got`` matches ``ref`` within ``rtol``/``atol`` (exactly for integers),
    else a one-line description of the mismatch. ``magnitude`` (same shape as ``ref``), where
    given, replaces ``|ref|`` in the relative term: the size of the terms the result was
    computed from, for results that cancel. ``normwise``: the checked elements must also agree
    as a whole, ``||got - ref|| <= rtol * ||size|| + floor``, without ``atol``: for results
    much smaller than ``atol`` (a softmax of a long row), which the element test alone would
    pass even if they were all zero. ``floor`` is the rounding of the output dtype's smallest
    step (its subnormal spacing, half of it per element) over the checked elements: a
    correctly rounded float16 result of values below 6e-5 errs by up to 3e-8 each."""
    got = np.asarray(got)
    ref = np.asarray(ref)
    if dt.kind == "i":
        bad = got != ref
    else:
        size = np.abs(ref) if magnitude is None else np.maximum(np.abs(ref), magnitude)
        with np.errstate(invalid="ignore", over="ignore"):
            bad = ~(np.abs(got - ref) <= atol + rtol * size)
    nbad = int(np.count_nonzero(bad))
    if not nbad:
        if normwise and dt.kind != "i":
            ok = np.isfinite(ref)
            err = float(np.linalg.norm((got - ref)[ok].astype(np.float64)))
            floor = 0.5 * _SUBNORMAL_STEP.get(dt.name, 0.0) * float(np.sqrt(np.count_nonzero(ok)))
            bound = rtol * float(np.linalg.norm(size[ok].astype(np.float64))) + floor
            if not err <= bound:
                return (f"wrong result: the checked elements differ as a whole: ||got - ref|| = "
                        f"{err:.3g} > {bound:.3g} (rtol={rtol:g} of their size, plus the "
                        f"rounding floor)")
        return None
    i = int(np.flatnonzero(bad)[0])
    tol = "exact" if dt.kind == "i" else f"rtol={rtol:g}, atol={atol:g}"
    if magnitude is not None and dt.kind != "i":
        tol += ", rtol of the terms' size"
    return (f"wrong result: {nbad} of {got.size} checked elements differ ({tol}); first at flat "
            f"index {int(idx[i])}: got {got[i].item()!r}, expected {ref[i].item()!r}")
