"""cupylab's elementwise operators on Dask arrays: graph construction (shapes, chunks, dtype,
meta, broadcasting, bad input) with a stand-in chunk type, and the graph's wiring computed with
NumPy standing in for the per-chunk GPU call (no GPU needed)."""
import subprocess
import types
import sys

import numpy as np
import pytest

import cupylab
from cupylab import _dask
from conftest import FakeCAI

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")


class Chunk(np.ndarray):
    """A stand-in chunk type (a GPU array type in real use): the result's meta must keep it.
    It says it is on a CUDA device, as the GPU arrays it stands in for do (the graph's
    construction refuses host data beside Dask arrays); its data is never read there."""

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0


def chunked(a, chunks):
    return da.from_array(np.asarray(a).view(Chunk), chunks=chunks, asarray=False)


NUMPY = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
         "divide": np.divide, "floor_divide": np.floor_divide,
         "vector_add": np.add, "fused_add_mul": lambda a, b, s, **k: np.multiply(np.add(a, b), s)}


@pytest.fixture
def numpy_chunks(monkeypatch):
    """Each chunk computed by NumPy instead of a GPU kernel (same arguments)."""
    calls = []

    def chunk_call(fn, dtype, casting, *blocks):
        calls.append((fn.__name__, [b.shape if hasattr(b, "shape") else b for b in blocks]))
        blocks = [np.asarray(b) if isinstance(b, np.ndarray) else b for b in blocks]
        r = NUMPY[fn.__name__](*blocks)
        return np.asarray(r, dtype=dtype).view(Chunk) if dtype is not None else np.asarray(r).view(Chunk)

    monkeypatch.setattr(_dask, "_chunk_call", chunk_call)
    return calls


def test_import_cupylab_does_not_import_dask():
    code = "import sys, cupylab; print('dask' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_result_is_lazy_with_the_chunk_type_as_meta():
    x = chunked(np.ones((1000, 300), np.float32), (250, 100))
    y = chunked(np.ones((300,), np.float16), (150,))
    z = cupylab.add(x, y)
    assert isinstance(z, da.Array)
    assert z.shape == (1000, 300) and z.dtype == np.float32
    assert type(z._meta) is Chunk and z._meta.ndim == 2
    assert z.chunks == ((250,) * 4, (100, 50, 50, 100))  # unified by Dask


@pytest.mark.parametrize("op, a, b, want", [
    ("add", np.int32, np.float32, np.float64),
    ("divide", np.int32, np.int32, np.float64),
    ("floor_divide", np.int64, np.int32, np.int64),
    ("multiply", np.float16, np.float32, np.float32),
])
def test_result_dtype_is_numpys_rule(op, a, b, want):
    x = chunked(np.ones(10, a), 5)
    y = chunked(np.ones(10, b), 5)
    assert getattr(cupylab, op)(x, y).dtype == want


def test_python_scalars_are_weak_numpy_scalars_are_not():
    x = chunked(np.ones(10, np.float32), 5)
    assert cupylab.add(x, 2.5).dtype == np.float32
    assert cupylab.add(x, np.float64(2.5)).dtype == np.float64
    assert cupylab.multiply(3, x).dtype == np.float32


def test_dtype_keyword_sets_the_result_dtype():
    x = chunked(np.ones(10, np.float32), 5)
    assert cupylab.add(x, x, dtype="float64").dtype == np.float64


@pytest.mark.parametrize("op", ["add", "subtract", "multiply", "divide", "floor_divide"])
def test_computed_graph_matches_numpy_with_broadcast_and_misaligned_chunks(op, numpy_chunks):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((37, 29)).astype(np.float32) + 3
    b = rng.standard_normal((29,)).astype(np.float32) + 3
    c = rng.standard_normal((37, 1)).astype(np.float32) + 3
    x, y, w = chunked(a, (10, 8)), chunked(b, (7,)), chunked(c, (12, 1))
    f = getattr(cupylab, op)
    got = f(f(x, y), w).compute(scheduler="sync")
    ref = NUMPY[op](NUMPY[op](a, b), c)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6)
    assert numpy_chunks and all(n == op for n, _ in numpy_chunks)


def test_gpu_array_and_scalars_go_into_every_chunk(numpy_chunks):
    a = np.arange(60, dtype=np.float64).reshape(6, 10)
    bias = np.linspace(0, 1, 10).view(Chunk)  # not a Dask array: one chunk, aligned by Dask
    x = chunked(a, (2, 4))
    got = cupylab.fused_add_mul(x, bias, 0.5).compute(scheduler="sync")
    np.testing.assert_allclose(np.asarray(got), (a + np.asarray(bias)) * 0.5)


def test_bad_inputs_are_refused_before_any_graph_runs():
    x = chunked(np.ones((4, 6), np.float32), (2, 3))
    with pytest.raises(TypeError, match="add: out= is not supported with Dask arrays"):
        cupylab.add(x, x, out=x)
    with pytest.raises(TypeError, match="add: stream= is not supported with Dask arrays"):
        cupylab.add(x, x, stream=0)
    with pytest.raises(TypeError, match=r"vector_add: x2 must be a GPU array \(got a scalar 2.0\)"):
        cupylab.vector_add(x, 2.0)
    with pytest.raises(ValueError, match=r"add: shapes \(4, 6\) and \(5,\) cannot be broadcast"):
        cupylab.add(x, chunked(np.ones(5, np.float32), 5))
    with pytest.raises(TypeError, match="add: x2 must be a Dask array, a GPU array or a scalar"):
        cupylab.add(x, "a")
    with pytest.raises(TypeError, match="subtract: .*boolean"):
        cupylab.subtract(chunked(np.ones(3, bool), 3), chunked(np.ones(3, bool), 3))


def test_the_chunks_framework_picks_the_promotion_rule():
    def meta_of(module):
        return type("Meta", (), {"__module__": module})()

    assert _dask._kind(meta_of("torch")) == "torch"
    assert _dask._kind(meta_of("jaxlib._jax")) == "jax"
    assert _dask._kind(meta_of("jax._src.array")) == "jax"
    assert _dask._kind(meta_of("cupy")) == "cupy"
    assert _dask._kind(np.empty(0)) == "cupy"  # NumPy's rule


def test_host_arrays_beside_dask_arrays_are_refused_when_the_graph_is_built():
    """A NumPy array (or a torch tensor in host memory) given beside Dask arrays, as an operand
    or a weight, is refused by the call, with the eager operators' message, not later by
    the chunks' tasks at compute time."""
    x = chunked(np.ones((4, 6), np.float32), (2, 3))
    host = "must be a CUDA device array .*got host data of type numpy.ndarray"
    with pytest.raises(TypeError, match="add: x2 " + host):
        cupylab.add(x, np.ones(6, np.float32))
    with pytest.raises(TypeError, match="rms_norm: weight " + host):
        cupylab.rms_norm(x, np.ones(6, np.float32))
    with pytest.raises(TypeError, match="layer_norm: bias " + host):
        cupylab.layer_norm(x, np.ones(6, np.float32).view(Chunk), np.zeros(6, np.float32))
    with pytest.raises(TypeError, match="softmax_backward: dy " + host):
        cupylab.softmax_backward(x, np.ones((4, 6), np.float32))
    with pytest.raises(TypeError, match="rms_norm_backward: weight " + host):
        cupylab.rms_norm_backward(x, x, np.ones(6, np.float32), chunked(np.ones(4), 2))
    torch = sys.modules.get("torch")
    if torch is not None:
        with pytest.raises(TypeError, match="rms_norm: weight .*host data of type torch.Tensor"):
            cupylab.rms_norm(x, torch.ones(6))


# -- row-wise operators: whole rows per chunk ------------------------------------------------
def _np_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.fixture
def numpy_rows(monkeypatch):
    """Each chunk's row-wise call done by NumPy; records the blocks' shapes."""
    seen = []

    def rows_call(fn, axis, kwargs, *blocks):
        seen.append([b.shape for b in blocks])
        b = [np.asarray(x, np.float64) for x in blocks]
        if fn.__name__ == "softmax":
            r = _np_softmax(b[0], axis)
        elif fn.__name__ == "softmax_backward":
            r = b[0] * (b[1] - (b[0] * b[1]).sum(axis, keepdims=True))
        elif fn.__name__ == "rms_norm":
            w = np.asarray(kwargs.get("weight", 1.0), np.float64)
            r = b[0] / np.sqrt((b[0] ** 2).mean(-1, keepdims=True) + kwargs["eps"]) * w
        else:
            raise AssertionError(fn.__name__)
        return r.astype(blocks[0].dtype).view(Chunk)

    monkeypatch.setattr(_dask, "_rows_call", rows_call)
    return seen


@pytest.mark.parametrize("axis", [-1, 0])
def test_rowwise_rechunks_the_row_axis_and_keeps_the_others(axis, numpy_rows):
    a = np.random.default_rng(3).standard_normal((50, 40)).astype(np.float32)
    x = chunked(a, (20, 16))
    s = cupylab.softmax(x, axis=axis)
    assert type(s._meta) is Chunk and s.dtype == np.float32
    whole = axis % 2
    assert len(s.chunks[whole]) == 1 and s.chunks[1 - whole] == x.chunks[1 - whole]
    np.testing.assert_allclose(np.asarray(s.compute(scheduler="sync")), _np_softmax(a, axis),
                               rtol=1e-5)
    assert all(shape[whole] == a.shape[whole] for blocks in numpy_rows for shape in blocks)


@pytest.mark.parametrize("ychunks,dychunks", [
    ((5, 4), (7, 9)),  # three row blocks against two
    (((5, 8), (9,)), ((8, 5), (9,))),  # as many blocks, of other sizes
    (None, (7, 3)),  # y a plain array beside a Dask dy
])
def test_softmax_backward_aligns_the_rows_of_y_and_dy(ychunks, dychunks, numpy_rows):
    rng = np.random.default_rng(9)
    y = _np_softmax(rng.standard_normal((13, 9)), -1)
    dy = rng.standard_normal((13, 9))
    yy = y.view(Chunk) if ychunks is None else chunked(y, ychunks)
    dx = cupylab.softmax_backward(yy, chunked(dy, dychunks)).compute(scheduler="sync")
    np.testing.assert_allclose(np.asarray(dx), y * (dy - (y * dy).sum(-1, keepdims=True)),
                               rtol=1e-12)
    assert all(blocks[0] == blocks[1] for blocks in numpy_rows)  # the same rows in each task


class Unhashed(Chunk):
    """A GPU array stand-in that must not be hashed (a CuPy array's hash copies it to the host)."""


@pytest.fixture
def unhashed():
    """Dask's hashing of an :class:`Unhashed` fails the test, wherever it happens (arguments
    of a graph node, or arrays inside the node's function)."""
    from dask.base import normalize_token

    def refuse(a):
        raise AssertionError("Dask hashed a GPU array")

    normalize_token.register(Unhashed)(refuse)
    yield lambda a: np.asarray(a).view(Unhashed)
    normalize_token._lookup.pop(Unhashed, None)


def test_gpu_arrays_beside_dask_arrays_are_not_hashed(numpy_chunks, numpy_rows,
                                                      numpy_norm_bwd, unhashed):
    rng = np.random.default_rng(5)
    a, dy = rng.standard_normal((2, 6, 10))
    w, b = unhashed(np.linspace(0.5, 2, 10)), unhashed(np.linspace(-1, 1, 10))
    got = cupylab.fused_add_mul(chunked(a, (2, 4)), w, 0.5).compute(scheduler="sync")
    np.testing.assert_allclose(np.asarray(got), (a + np.asarray(w)) * 0.5)
    y = cupylab.rms_norm(chunked(a, (3, 10)), w, eps=1e-6).compute(scheduler="sync")
    ref = a / np.sqrt((a ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(w)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-12)
    assert cupylab.layer_norm(chunked(a, (3, 10)), w, b).shape == a.shape
    _, rstd = _np_norm(a, False)
    dx, dw = cupylab.rms_norm_backward(chunked(dy, (3, 10)), chunked(a, (3, 10)), w,
                                       chunked(rstd, 3))
    assert dx.shape == a.shape and dw.shape == (10,)
    dw.compute(scheduler="sync")


def test_rms_norm_sends_the_weight_to_every_chunk(numpy_rows):
    a = np.random.default_rng(4).standard_normal((30, 24))
    w = np.linspace(0.5, 2, 24).view(Chunk)  # a GPU weight in real use
    y = cupylab.rms_norm(chunked(a, (7, 24)), w, eps=1e-6).compute(scheduler="sync")
    ref = a / np.sqrt((a ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-12)
    assert len(numpy_rows) == 5


def test_rowwise_refusals():
    x = chunked(np.ones((8, 6), np.float32), (4, 3))
    with dask.config.set({"cupylab.rechunk": False}):
        with pytest.raises(ValueError, match=r"softmax: axis 1 of x is split into 2 chunks.*"
                                             r"x\.rechunk\(\{1: -1\}\)"):
            cupylab.softmax(x)
        cupylab.softmax(x.rechunk({1: -1}))  # whole rows: nothing to refuse
    with pytest.raises(TypeError, match="rms_norm: return_stats=True is not supported"):
        cupylab.rms_norm(x, return_stats=True)
    with pytest.raises(TypeError, match="rms_norm: weight must be a GPU array"):
        cupylab.rms_norm(x, chunked(np.ones(6, np.float32), 6))
    with pytest.raises(TypeError, match="add_rms_norm: inplace=True is not supported"):
        cupylab.add_rms_norm(x, x, None, inplace=True)
    with pytest.raises(TypeError, match="cross_entropy: return_grad=True is not supported"):
        cupylab.cross_entropy(x, chunked(np.zeros(8, np.int64), 4), return_grad=True)
    with pytest.raises(TypeError, match="softmax: out= is not supported"):
        cupylab.softmax(x, out=x)
    with pytest.raises(ValueError, match=r"add_rms_norm: residual must have the shape of x "
                                         r"\(8, 6\); got \(6,\)"):
        cupylab.add_rms_norm(x, chunked(np.ones(6, np.float32), 3), None)  # no broadcasting
    with pytest.raises(ValueError, match=r"softmax_backward: dy must have the shape of y "
                                         r"\(8, 6\); got \(8, 5\)"):
        cupylab.softmax_backward(x, chunked(np.ones((8, 5), np.float32), (4, 5)))


def test_operators_without_dask_support_say_so():
    x = chunked(np.ones((4, 6), np.float32), (2, 3))
    with pytest.raises(TypeError, match=r"foreach.add_: tensors\[0\] is a Dask array"):
        cupylab.foreach.add_([x], 1.0)


def test_add_rms_norm_returns_y_and_h(numpy_chunks, numpy_rows):
    rng = np.random.default_rng(5)
    a, r = rng.standard_normal((30, 24)), rng.standard_normal((30, 24))
    w = np.linspace(0.5, 2, 24).view(Chunk)  # a GPU weight in real use
    y, h = cupylab.add_rms_norm(chunked(a, (7, 12)), chunked(r, (10, 24)), w, eps=1e-6)
    assert type(y._meta) is Chunk and type(h._meta) is Chunk
    yv, hv = dask.compute(y, h, scheduler="sync")
    np.testing.assert_allclose(np.asarray(hv), a + r, rtol=1e-12)
    ref = (a + r) / np.sqrt(((a + r) ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(np.asarray(yv), ref, rtol=1e-12)
    with pytest.raises(TypeError, match=r"add_rms_norm: residual must have the dtype of x "
                                        r"\(float64\); got float32"):
        cupylab.add_rms_norm(chunked(a, 7), chunked(r.astype(np.float32), 7), w)
    # a float32 residual stream (GPU arrays only) and dtype= are refused by name
    with pytest.raises(TypeError, match=r"add_rms_norm: a residual of another dtype than x "
                                        r"\(a float32 residual stream\) is not supported with "
                                        r"Dask arrays"):
        cupylab.add_rms_norm(chunked(a.astype(np.float16), 7), chunked(r.astype(np.float32), 7),
                             w)
    with pytest.raises(TypeError, match=r"add_rms_norm: dtype= is not supported with Dask"):
        cupylab.add_rms_norm(chunked(a, 7), chunked(r, 7), w, dtype="float32")


@pytest.fixture
def numpy_ce(monkeypatch):
    """Each chunk's cross-entropy done by NumPy (per-row losses, as the GPU call returns)."""
    seen = []

    def ce_call(fn, ignore_index, label_smoothing, return_lse, logits, target):
        seen.append((logits.shape, target.shape))
        x, t = np.asarray(logits, np.float64), np.asarray(target)
        lse = np.log(np.exp(x).sum(-1))
        pick = np.take_along_axis(x, np.clip(t, 0, x.shape[-1] - 1)[..., None], -1)[..., 0]
        s = label_smoothing
        loss = (1 - s) * (lse - pick) + s * (lse - x.mean(-1))
        loss = np.where(t == ignore_index, 0.0, loss)
        out = np.stack([loss, lse], -1) if return_lse else loss
        return out.astype(np.float32).view(Chunk)

    monkeypatch.setattr(_dask, "_ce_call", ce_call)
    return seen


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_per_chunk_then_dask_reductions(numpy_ce, reduction):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 25, 33)).astype(np.float32)
    t = rng.integers(0, 33, (4, 25))
    t[0, :7] = -100
    got = cupylab.cross_entropy(chunked(x, (2, 10, 11)), chunked(t, (4, 5)), reduction=reduction,
                                label_smoothing=0.1)
    assert got.dtype == np.float32
    assert got.shape == ((4, 25) if reduction == "none" else ())
    if reduction == "none":  # (Dask's own reductions give a NumPy subclass a NumPy meta)
        assert type(got._meta) is Chunk
    x = x.astype(np.float64)
    lse = np.log(np.exp(x).sum(-1))
    row = 0.9 * (lse - np.take_along_axis(x, t.clip(0)[..., None], -1)[..., 0]) + 0.1 * (
        lse - x.mean(-1))
    row[t == -100] = 0
    want = {"none": row, "sum": row.sum(), "mean": row.sum() / (t != -100).sum()}[reduction]
    np.testing.assert_allclose(np.asarray(got.compute(scheduler="sync")), want, rtol=1e-5)
    assert all(xs[-1] == 33 and xs[:-1] == ts for xs, ts in numpy_ce)  # whole rows, aligned


def _ce_rows(x, t, s=0.0, ii=-100):
    """float64 per-row loss, lse and gradient (softmax - smoothed onehot, 0 where ignored)."""
    x = x.astype(np.float64)
    lse = np.log(np.exp(x).sum(-1))
    tc = np.clip(t, 0, x.shape[-1] - 1)
    row = (1 - s) * (lse - np.take_along_axis(x, tc[..., None], -1)[..., 0]) + s * (
        lse - x.mean(-1))
    g = np.exp(x - lse[..., None]) - s / x.shape[-1]
    np.put_along_axis(g, tc[..., None], np.take_along_axis(g, tc[..., None], -1) - (1 - s), -1)
    keep = t != ii
    return np.where(keep, row, 0.0), lse, g * keep[..., None]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_returns_the_lse_per_chunk(numpy_ce, reduction):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 9, 17)).astype(np.float32)
    t = rng.integers(0, 17, (6, 9))
    t[1, :3] = -100
    loss, lse = cupylab.cross_entropy(chunked(x, (4, 5, 9)), chunked(t, (3, 9)),
                                      reduction=reduction, return_lse=True)
    assert lse.shape == (6, 9) and lse.dtype == np.float32 and type(lse._meta) is Chunk
    row, want_lse, _ = _ce_rows(x, t)
    lv, sv = dask.compute(loss, lse, scheduler="sync")
    np.testing.assert_allclose(np.asarray(sv), want_lse, rtol=1e-5)
    want = row if reduction == "none" else row.sum() / (t != -100).sum()
    np.testing.assert_allclose(np.asarray(lv), want, rtol=1e-5)


@pytest.fixture
def numpy_ce_bwd(monkeypatch):
    """Each chunk's cross_entropy_backward done by NumPy, with the reduction and the loss
    gradient the chunk's call is given (recorded)."""
    seen = []

    def ceb_call(fn, ignore_index, label_smoothing, kw, logits, target, lse, *grad):
        g = grad[0] if grad else kw.get("grad_loss")
        seen.append((logits.shape, target.shape, lse.shape,
                     None if g is None else np.shape(g)))
        x, t = np.asarray(logits, np.float64), np.asarray(target)
        gr = np.exp(x - np.asarray(lse, np.float64)[..., None]) - label_smoothing / x.shape[-1]
        tc = np.clip(t, 0, x.shape[-1] - 1)
        np.put_along_axis(gr, tc[..., None], np.take_along_axis(gr, tc[..., None], -1)
                          - (1 - label_smoothing), -1)
        gv = 1.0 if g is None else np.asarray(g, np.float64)
        gr = gr * (t != ignore_index)[..., None] * (gv[..., None] if np.ndim(gv) else gv)
        return gr.astype(x.dtype if logits.dtype == np.float64 else np.float32).view(Chunk)

    monkeypatch.setattr(_dask, "_ceb_call", ceb_call)
    return seen


@pytest.mark.parametrize("reduction,grad", [("mean", None), ("mean", 2.5), ("sum", None),
                                            ("none", "rows"), ("mean", "dask0d")])
def test_cross_entropy_backward_on_chunks(numpy_ce_bwd, reduction, grad):
    """The gradient chunk by chunk of rows, the target, lse and a per-row loss gradient
    aligned with the logits' rows; for "mean" the loss gradient given to every chunk is
    times 1 / (Dask's count of the kept rows over all chunks)."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, 8, 13)).astype(np.float32)
    t = rng.integers(0, 13, (5, 8))
    t[2, :5] = -100
    _, lse, g = _ce_rows(x, t, 0.1)
    gl = {None: None, 2.5: 2.5, "rows": rng.standard_normal((5, 8)).astype(np.float32),
          "dask0d": np.float32(3.0)}[grad]
    arg = chunked(gl, (2, 3)) if grad == "rows" else (
        chunked(np.asarray(gl), ()) if grad == "dask0d" else gl)
    got = cupylab.cross_entropy_backward(
        chunked(x, (2, 4, 13)), chunked(t, (5, 8)), chunked(lse.astype(np.float32), (3, 8)),
        arg, label_smoothing=0.1, reduction=reduction)
    assert got.shape == x.shape and got.dtype == np.float32 and type(got._meta) is Chunk
    scale = 1.0 / (t != -100).sum() if reduction == "mean" else 1.0
    mult = (np.asarray(gl, np.float64)[..., None] if grad == "rows" else
            (1.0 if gl is None else float(gl)))
    np.testing.assert_allclose(np.asarray(got.compute(scheduler="sync")), g * scale * mult,
                               rtol=1e-5, atol=1e-7)
    # whole rows; the targets, lse and per-row gradients in the logits' row chunks
    assert all(xs[-1] == 13 and xs[:-1] == ts == ls for xs, ts, ls, _ in numpy_ce_bwd)
    if grad == "rows":
        assert all(gs == ts for _, ts, _, gs in numpy_ce_bwd)
    elif reduction == "mean" or grad is not None:
        assert all(gs in ((), None) for *_, gs in numpy_ce_bwd)


def test_cross_entropy_dask_errors():
    x = chunked(np.ones((4, 6), np.float32), (2, 3))
    with pytest.raises(ValueError, match=r"cross_entropy: target must have shape \(4,\)"):
        cupylab.cross_entropy(x, chunked(np.zeros(5, np.int64), 5))
    t = chunked(np.zeros(4, np.int64), 2)
    with pytest.raises(TypeError, match="cross_entropy: return_grad=True is not supported"):
        cupylab.cross_entropy(x, t, return_grad=True)
    lse = chunked(np.zeros(4, np.float32), 2)
    op = "cross_entropy_backward"
    with pytest.raises(TypeError, match=f"{op}: out= is not supported"):
        cupylab.cross_entropy_backward(x, t, lse, out=x)
    with pytest.raises(ValueError, match=rf"{op}: lse must have shape \(4,\)"):
        cupylab.cross_entropy_backward(x, t, chunked(np.zeros((2, 2), np.float32), 2))
    with pytest.raises(TypeError, match=f"{op}: lse must be float32"):
        cupylab.cross_entropy_backward(x, t, chunked(np.zeros(4, np.float64), 2))
    with pytest.raises(ValueError, match=rf"{op}: grad_loss must have shape \(\) for "
                                         "reduction='mean'"):
        cupylab.cross_entropy_backward(x, t, lse, chunked(np.ones(4, np.float32), 2))
    with pytest.raises(TypeError, match=f"{op}: grad_loss must be a real number"):
        cupylab.cross_entropy_backward(x, t, lse, True)
    with pytest.raises(TypeError, match="cross_entropy: stream= is not supported"):
        cupylab.cross_entropy(x, chunked(np.zeros(4, np.int64), 2), stream=0)


@pytest.fixture
def numpy_norm_bwd(monkeypatch):
    """Each chunk's norm backward done by NumPy (float64), in the chunk call's shapes."""
    seen = []

    def nb_call(fn, weight, acc, dy, x, *stats):
        if type(weight) is _dask._Float32:  # the chunk's task casts it (cupylab.add on a GPU)
            weight = np.asarray(weight.weight, np.float32).view(Chunk)
        seen.append((fn.__name__, acc, x.shape, [s.shape for s in stats],
                     None if weight is None else np.dtype(weight.dtype)))
        dy, x = np.asarray(dy, np.float64), np.asarray(x, np.float64)
        w = np.ones(x.shape[-1]) if weight is None else np.asarray(weight, np.float64)
        rstd = np.asarray(stats[-1], np.float64)[..., None]
        mean = np.asarray(stats[0], np.float64)[..., None] if len(stats) == 2 else 0.0
        xh = (x - mean) * rstd
        g = dy * w
        if len(stats) == 2:
            dx = rstd * (g - g.mean(-1, keepdims=True) - xh * (g * xh).mean(-1, keepdims=True))
        else:
            dx = rstd * (g - xh * (g * xh).mean(-1, keepdims=True))
        if acc is None:
            return dx.view(Chunk)
        red = tuple(range(x.ndim - 1))
        part = np.stack([(dy * xh).sum(red), dy.sum(red)][:len(stats)]).astype(acc)
        return part.reshape((1,) * (x.ndim - 1) + part.shape).view(Chunk)

    monkeypatch.setattr(_dask, "_nb_call", nb_call)
    return seen


def _np_norm(x, layer):
    mean = x.mean(-1) if layer else np.zeros(x.shape[:-1])
    xc = x - mean[..., None]
    rstd = 1 / np.sqrt((xc ** 2).mean(-1) + 1e-6)
    return mean, rstd


@pytest.mark.parametrize("layer", [False, True])
def test_norm_backward_on_chunks(numpy_norm_bwd, layer):
    rng = np.random.default_rng(7)
    x, dy = rng.standard_normal((3, 20, 16)), rng.standard_normal((3, 20, 16))
    w = np.linspace(0.5, 2, 16).view(Chunk)  # x's dtype, as the eager backward requires
    mean, rstd = _np_norm(x, layer)
    xd, dyd = chunked(x, (2, 7, 8)), chunked(dy, (3, 5, 16))
    if layer:
        dx, dw, db = cupylab.layer_norm_backward(dyd, xd, w, chunked(mean, (1, 20)),
                                                 chunked(rstd, (3, 9)))
    else:
        dx, dw = cupylab.rms_norm_backward(dyd, xd, w, chunked(rstd, (3, 9)))
    assert dx.shape == x.shape and dx.chunks[-1] == (16,) and type(dx._meta) is Chunk
    assert dw.shape == (16,) and dw.dtype == np.float64
    xh = (x - (mean[..., None] if layer else 0)) * rstd[..., None]
    # float64 x: the chunks' sums are added in float64, not rounded to float32 on the way
    np.testing.assert_allclose(np.asarray(dw.compute(scheduler="sync")),
                               (dy * xh).sum((0, 1)), rtol=1e-12)
    if layer:
        np.testing.assert_allclose(np.asarray(db.compute(scheduler="sync")), dy.sum((0, 1)),
                                   rtol=1e-12)
    dxv = np.asarray(dx.compute(scheduler="sync"))
    g = dy * w
    mg = g.mean(-1, keepdims=True) if layer else 0
    ref = rstd[..., None] * (g - mg - xh * (g * xh).mean(-1, keepdims=True))
    np.testing.assert_allclose(dxv, ref, rtol=1e-6)
    assert all(shape[-1] == 16 and [s for s in st] == [shape[:-1]] * len(st)
               for _, _, shape, st, _ in numpy_norm_bwd)  # whole rows, statistics aligned
    nogw = cupylab.rms_norm_backward(dyd, xd, None, chunked(rstd, 20))
    assert nogw[1] is None


def test_norm_backward_takes_the_chunks_of_the_first_dask_operand(numpy_norm_bwd):
    """dy is the first row operand: x given as a plain GPU array follows dy's chunks (it was
    the other way round, merging every chunk into one task)."""
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((12, 8)), rng.standard_normal((12, 8))
    _, rstd = _np_norm(x, False)
    dx, _ = cupylab.rms_norm_backward(chunked(dy, (4, 8)), x.view(Chunk), None, rstd.view(Chunk))
    assert dx.chunks == ((4, 4, 4), (8,))
    dx, _ = cupylab.rms_norm_backward(dy.view(Chunk), x.view(Chunk), None, chunked(rstd, 6))
    assert dx.chunks == ((6, 6), (8,))  # only the statistics are Dask arrays


def test_norm_backward_gives_16_bit_weights_to_the_chunks_as_float32(numpy_norm_bwd):
    """Each chunk's weight gradient comes back unrounded (float32) and the sum is rounded to
    the weight's dtype once; dx is computed with the weight as given. The cast is made in
    each chunk's task (it was made when the graph was built: on the builder's device and
    stream, with CuPy, which refused torch weights)."""
    x = np.ones((8, 4), np.float16)
    w = np.ones(4, np.float16).view(Chunk)
    r = np.ones(8, np.float32)
    dx, dw = cupylab.rms_norm_backward(chunked(x, (4, 4)), chunked(x, (4, 4)), w, chunked(r, 4))
    assert dw.dtype == np.float16 and dx.dtype == np.float16
    dw.compute(scheduler="sync")
    dx.compute(scheduler="sync")
    # dx with the float16 weight; the weight gradients with float32 weights, summed in float32
    calls = {(acc is None, None if acc is None else np.dtype(acc), wdt)
             for _, acc, _, _, wdt in numpy_norm_bwd}
    f16, f32 = np.dtype(np.float16), np.dtype(np.float32)
    assert calls == {(True, None, f16), (False, f32, f32)}


def test_a_bare_cuda_array_interface_row_operand_beside_dask_arrays(numpy_norm_bwd,
                                                                     monkeypatch):
    """A row operand given as a bare __cuda_array_interface__ object (no shape attribute) is
    wrapped as a CuPy array (zero-copy) for the graph, not read as if it had a shape."""
    from cupylab import _runtime

    wrapped = []

    def asarray(a):
        wrapped.append(a)
        return np.ones(a.__cuda_array_interface__["shape"], np.float32).view(Chunk)

    monkeypatch.setattr(_runtime, "cupy", lambda: types.SimpleNamespace(asarray=asarray))
    x = chunked(np.ones((8, 6), np.float32), (4, 6))
    rstd = FakeCAI((8,), "<f4")
    dx, _ = cupylab.rms_norm_backward(x, x, None, rstd)
    assert wrapped == [rstd] and dx.chunks == ((4, 4), (6,))


def test_norm_backward_dask_errors():
    x = chunked(np.ones((4, 6), np.float32), (2, 3))
    r = chunked(np.ones(4, np.float32), 2)
    with pytest.raises(ValueError, match=r"rms_norm_backward: rstd must have shape \(4,\)"):
        cupylab.rms_norm_backward(x, x, None, chunked(np.ones(5, np.float32), 5))
    with pytest.raises(TypeError, match="rms_norm_backward: weight must be a GPU array"):
        cupylab.rms_norm_backward(x, x, chunked(np.ones(6, np.float32), 3), r)
    with pytest.raises(ValueError, match=r"layer_norm_backward: dy must have the shape of x "
                                         r"\(4, 6\); got \(4, 5\)"):
        cupylab.layer_norm_backward(chunked(np.ones((4, 5), np.float32), 2), x, None, r, r)


# -- the eager operators' argument checks run when the Dask call is made, not at compute time --
@pytest.mark.parametrize("op, args, kw, exc", [
    ("add", ("f4", "f4"), {"casting": "bogus"}, ValueError),
    ("add", ("f4", "f4"), {"dtype": "bogus"}, TypeError),
    ("multiply", ("f4", 2.0), {"dtype": object}, TypeError),
    ("add", ("i1", 1000), {}, OverflowError),
    ("fused_add_mul", ("u1", "u1", -1), {}, OverflowError),
])
def test_elementwise_argument_checks_match_the_eager_op(op, args, kw, exc):
    f = getattr(cupylab, op)
    with pytest.raises(exc) as eager:  # the eager op checks these before touching a GPU
        f(*[FakeCAI((4, 6), np.dtype(a).str) if isinstance(a, str) else a for a in args], **kw)
    with pytest.raises(exc) as lazy:
        f(*[chunked(np.ones((4, 6), a), (2, 3)) if isinstance(a, str) else a for a in args],
          **kw)
    assert str(lazy.value) == str(eager.value)
    assert str(lazy.value).startswith(f"{op}: ")


def _x(shape=(8, 6), dtype=np.float32, chunks=4):
    return chunked(np.ones(shape, dtype), chunks)


def _w(n=6, dtype=np.float32):
    return np.ones(n, dtype).view(Chunk)


# (call, exception, message): the eager operator's own check and message (rowwise.py,
# cross_entropy.py, _rowcore.check_*), raised when the Dask call is made
ROW_CHECKS = {
    "softmax-int": (lambda: cupylab.softmax(_x(dtype=np.int32)), TypeError,
                    r"softmax: x must be float16, bfloat16, float32 or float64 \(got int32\)"),
    "log_softmax-float-axis": (lambda: cupylab.log_softmax(_x(), axis=1.0), TypeError,
                               r"log_softmax: axis must be an int \(got 1.0\)"),
    "softmax-bool-axis": (lambda: cupylab.softmax(_x(), axis=True), TypeError,
                          r"softmax: axis must be an int \(got True\)"),
    "rms_norm-eps": (lambda: cupylab.rms_norm(_x(), eps=-1e-6), ValueError,
                     r"rms_norm: eps must be a non-negative number \(got -1e-06\)"),
    "layer_norm-eps": (lambda: cupylab.layer_norm(_x(), eps="small"), TypeError,
                       r"layer_norm: eps must be a real number \(got 'small'\)"),
    "rms_norm-weight-shape": (lambda: cupylab.rms_norm(_x(), _w(5)), ValueError,
                              r"rms_norm: weight must have shape \(6,\) \(got \(5,\)\)"),
    "rms_norm-weight-strided": (lambda: cupylab.rms_norm(_x(), _w(12)[::2]), ValueError,
                                r"rms_norm: weight must be contiguous \(got stride 2\)"),
    "rms_norm-weight-dtype": (lambda: cupylab.rms_norm(_x(), _w(dtype=np.float64)), TypeError,
                              r"rms_norm: weight must be float32 \(got float64\)"),
    "layer_norm-16bit-weight-dtype": (
        lambda: cupylab.layer_norm(_x(dtype=np.float16), _w(dtype=np.float64)), TypeError,
        r"layer_norm: weight must be float16 or float32 \(got float64\)"),
    "layer_norm-weight-bias-dtypes": (
        lambda: cupylab.layer_norm(_x(dtype=np.float16), _w(), _w(dtype=np.float16)),
        TypeError, r"layer_norm: weight and bias must have one dtype \(got float32 and "
                   r"float16\)"),
    "layer_norm-bias-list": (lambda: cupylab.layer_norm(_x(), None, [0.0] * 6), TypeError,
                             r"layer_norm: bias must be a CUDA device array .*; got host data "
                             r"of type builtins.list"),
    "rms_norm-no-columns": (lambda: cupylab.rms_norm(_x((8, 0))), ValueError,
                            r"rms_norm: the last axis of x is empty \(shape \(8, 0\)\)"),
    "add_rms_norm-int": (lambda: cupylab.add_rms_norm(_x(dtype=np.int64), _x(dtype=np.int64),
                                                      None), TypeError,
                         r"add_rms_norm: x must be float16, bfloat16, float32 or float64 "
                         r"\(got int64\)"),
    "add_rms_norm-eps": (lambda: cupylab.add_rms_norm(_x(), _x(), None, eps=-1.0), ValueError,
                         r"add_rms_norm: eps must be a non-negative number \(got -1.0\)"),
    "add_rms_norm-weight-shape": (lambda: cupylab.add_rms_norm(_x(), _x(), _w(8)), ValueError,
                                  r"add_rms_norm: weight must have shape \(6,\)"),
    "softmax_backward-dtypes": (
        lambda: cupylab.softmax_backward(_x(), _x(dtype=np.float64)), TypeError,
        r"softmax_backward: dy must have the dtype of y \(float32\); got float64"),
    "log_softmax_backward-0d": (
        lambda: cupylab.log_softmax_backward(_x((), chunks=()), _x((), chunks=())), ValueError,
        r"log_softmax_backward: y must have at least one dimension \(got a 0-d array\)"),
    "cross_entropy-float-target": (
        lambda: cupylab.cross_entropy(_x(), _x(8, np.float32)), TypeError,
        r"cross_entropy: target must be int64 or int32 \(got float32\)"),
    "cross_entropy-int-logits": (
        lambda: cupylab.cross_entropy(_x(dtype=np.int64), _x(8, np.int64)), TypeError,
        r"cross_entropy: logits must be float16, bfloat16, float32 or float64 \(got int64\)"),
    "cross_entropy-no-classes": (
        lambda: cupylab.cross_entropy(_x((8, 0)), _x(8, np.int64)), ValueError,
        r"cross_entropy: logits has no classes \(shape \(8, 0\)\)"),
    "rms_norm_backward-int": (
        lambda: cupylab.rms_norm_backward(_x(dtype=np.int32), _x(dtype=np.int32), None, _x(8)),
        TypeError, r"rms_norm_backward: x must be float16, bfloat16, float32 or float64 "
                   r"\(got int32\)"),
    "rms_norm_backward-dy-dtype": (
        lambda: cupylab.rms_norm_backward(_x(dtype=np.float16), _x(), None, _x(8)), TypeError,
        r"rms_norm_backward: dy must have the dtype of x \(float32\); got float16"),
    "rms_norm_backward-weight-dtype": (
        lambda: cupylab.rms_norm_backward(_x(), _x(), _w(dtype=np.float64), _x(8)), TypeError,
        r"rms_norm_backward: weight must be float32 \(got float64\)"),
    "layer_norm_backward-weight-shape": (
        lambda: cupylab.layer_norm_backward(_x(), _x(), _w(4), _x(8), _x(8)), ValueError,
        r"layer_norm_backward: weight must have shape \(6,\) \(got \(4,\)\)"),
    "rms_norm_backward-no-rstd": (
        lambda: cupylab.rms_norm_backward(_x(), _x(), None, None), TypeError,
        r"rms_norm_backward: rstd is required \(the statistics the forward returned\)"),
    "layer_norm_backward-no-mean": (
        lambda: cupylab.layer_norm_backward(_x(), _x(), None, None, _x(8)), TypeError,
        r"layer_norm_backward: mean is required"),
    "rms_norm_backward-rstd-dtype": (
        lambda: cupylab.rms_norm_backward(_x(), _x(), None, _x(8, np.float16)), TypeError,
        r"rms_norm_backward: rstd must be float32 \(the statistics the forward returns\); "
        r"got float16"),
    "layer_norm_backward-mean-dtype": (
        lambda: cupylab.layer_norm_backward(_x(dtype=np.float64), _x(dtype=np.float64), None,
                                            _x(8), _x(8, np.float64)), TypeError,
        r"layer_norm_backward: mean must be float64 \(the statistics the forward returns\); "
        r"got float32"),
    "rms_norm_backward-no-columns": (
        lambda: cupylab.rms_norm_backward(_x((8, 0)), _x((8, 0)), None, _x(8)), ValueError,
        r"rms_norm_backward: the last axis of x is empty \(shape \(8, 0\)\)"),
}


@pytest.mark.parametrize("case", list(ROW_CHECKS))
def test_rowwise_argument_checks_at_call_time(case):
    call, exc, match = ROW_CHECKS[case]
    with pytest.raises(exc, match=match):
        call()  # building the graph, before anything is computed


def test_rowwise_checks_take_what_the_eager_op_takes():
    """A float32 weight with 16-bit x, a weight and bias of one dtype, int32 targets, no rows:
    no behaviour change for what the eager operators accept."""
    assert cupylab.rms_norm(_x(dtype=np.float16), _w()).dtype == np.float16
    assert cupylab.layer_norm(_x(), _w(), _w()).dtype == np.float32
    assert cupylab.softmax(_x((0, 6), chunks=(1, 6))).shape == (0, 6)
    assert cupylab.rms_norm(_x((0, 0), chunks=(1, 1))).shape == (0, 0)
    assert cupylab.cross_entropy(_x(), _x(8, np.int32)).shape == ()
    assert cupylab.rms_norm_backward(_x(dtype=np.float16), _x(dtype=np.float16), _w(),
                                     _x(8))[1].dtype == np.float32


def test_cuda_array_interface_weights_beside_dask_arrays():
    """A weight or bias given as a bare ``__cuda_array_interface__`` object (no ``shape`` or
    ``dtype`` attributes) is checked from its interface, as the eager operator reads it."""
    x = chunked(np.ones((8, 6), np.float32), (4, 6))
    assert cupylab.rms_norm(x, FakeCAI((6,), "<f4")).shape == (8, 6)
    assert cupylab.layer_norm(x, FakeCAI((6,), "<f4"), FakeCAI((6,), "<f4")).shape == (8, 6)
    with pytest.raises(ValueError, match=r"rms_norm: weight must have shape \(6,\)"):
        cupylab.rms_norm(x, FakeCAI((5,), "<f4"))
    with pytest.raises(TypeError, match="rms_norm: weight must be float32"):
        cupylab.rms_norm(x, FakeCAI((6,), "<f8"))


def test_a_bare_cuda_array_interface_weight_in_the_norm_backward(numpy_norm_bwd):
    """The weight's dtype is read from its view: a bare __cuda_array_interface__ weight has
    no .dtype (AttributeError while building the graph)."""
    x = chunked(np.ones((8, 6), np.float32), (4, 6))
    r = chunked(np.ones(8, np.float32), 4)
    dx, dw = cupylab.rms_norm_backward(x, x, FakeCAI((6,), "<f4"), r)
    assert dx.shape == (8, 6) and dw.shape == (6,) and dw.dtype == np.float32


def test_a_bare_cuda_array_interface_operand_beside_dask_arrays(numpy_chunks, monkeypatch):
    """The elementwise form takes a bare __cuda_array_interface__ operand as the eager
    operators do (it was refused: no shape attribute), also as add_rms_norm's residual."""
    from cupylab import _runtime

    def asarray(a):
        return np.full(a.__cuda_array_interface__["shape"], 2.0, np.float32).view(Chunk)

    monkeypatch.setattr(_runtime, "cupy", lambda: types.SimpleNamespace(asarray=asarray))
    x = chunked(np.ones((8, 6), np.float32), (4, 3))
    z = cupylab.add(x, FakeCAI((6,), "<f4"))
    assert z.shape == (8, 6) and z.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(z.compute(scheduler="sync")), np.full((8, 6), 3.0))
    y, h = cupylab.add_rms_norm(x, FakeCAI((8, 6), "<f4"), None)
    assert y.shape == h.shape == (8, 6)


class _CudaLike:
    """A torch.Tensor subclass whose instances say they live on the GPU (made lazily)."""
    cls = None

    @classmethod
    def make(cls, torch, t):
        if cls.cls is None:
            cls.cls = type("CudaLike", (torch.Tensor,), {"is_cuda": property(lambda s: True)})
        return t.as_subclass(cls.cls)


def test_a_torch_tensor_beside_dask_arrays_goes_to_the_chunks_as_it_is(numpy_chunks):
    """Dask's from_array cannot read a torch dtype (TypeError while building the graph): a
    CUDA tensor becomes a one-chunk Dask array declaring the NumPy dtype of the same name,
    handed to the chunk calls as it is (they check conj/neg bits and layout as the eager
    operators do; a bfloat16 tensor has no CuPy view); a host tensor or one that requires
    grad is refused at once, as the eager operators refuse it."""
    torch = pytest.importorskip("torch")
    t = _CudaLike.make(torch, torch.full((6,), 2.0))
    d = _dask._as_dask(t)
    assert d.dtype == np.float32 and d.chunks == ((6,),)
    (block,) = d.__dask_graph__().values()
    assert block is t
    x = chunked(np.ones((8, 6), np.float32), (4, 3))
    z = cupylab.add(x, t)
    assert z.shape == (8, 6) and z.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(z.compute(scheduler="sync")), np.full((8, 6), 3.0))
    assert _dask._as_dask(_CudaLike.make(torch, torch.ones(3, dtype=torch.bfloat16))
                          ).dtype.name == "bfloat16"
    with pytest.raises(TypeError, match="add: x2 must be a CUDA device array.*host data"):
        cupylab.add(x, torch.ones(6))
    with pytest.raises(TypeError, match="add: x2 is a torch tensor that requires grad"):
        cupylab.add(x, _CudaLike.make(torch, torch.ones(6, requires_grad=True)))


def test_torch_targets_beside_dask_logits_are_counted_by_dask(numpy_ce, monkeypatch):
    """"mean" counts the rows not ignored with Dask's own operations on the targets: a torch
    target goes in as a zero-copy CuPy view (Dask called Tensor.sum with NumPy arguments)."""
    torch = pytest.importorskip("torch")
    from cupylab import _runtime

    monkeypatch.setattr(_runtime, "cupy", lambda: types.SimpleNamespace(
        asarray=lambda a: np.asarray(a.detach().numpy()).view(Chunk)))
    rng = np.random.default_rng(6)
    x = rng.standard_normal((8, 5)).astype(np.float32)
    t = np.array([0, 1, -100, 3, 4, 0, 1, 2])
    got = cupylab.cross_entropy(chunked(x, (4, 5)), _CudaLike.make(torch, torch.from_numpy(t)))
    x64 = x.astype(np.float64)
    lse = np.log(np.exp(x64).sum(-1))
    row = lse - np.take_along_axis(x64, t.clip(0)[:, None], -1)[:, 0]
    row[t == -100] = 0
    np.testing.assert_allclose(np.asarray(got.compute(scheduler="sync")), row.sum() / 7,
                               rtol=1e-5)
