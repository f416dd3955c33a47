"""cupylab.torch.functional and the torch.ops.cupylab operators without a GPU (wherever torch
is installed): fake implementations' shapes, dtypes and strides under FakeTensorMode, the
dispatch rule (compiling -> registered operator, grad -> autograd.Function, else direct), the
autograd formulas and their wiring (gradcheck in float64 through both the eager Function and
the registered operator, with the kernels replaced by torch implementations on the CPU:
torch_cpu_refs.py), argument errors, and that ``import cupylab`` does not import torch
(torch.compile: test_torch_compile_cpu.py)."""
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from cupylab.torch import _autograd, _kernels, _library  # noqa: E402
from cupylab.torch import functional as F  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch_cpu_refs import TF, _REAL_CE_BWD, _g, cpu_kernels  # noqa: E402, F401 (a fixture)


# -- import hygiene ---------------------------------------------------------------------------
def test_import_cupylab_does_not_import_torch():
    code = ("import sys, cupylab, cupylab.torch; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "import cupylab.torch.functional as F, torch; "
            "assert hasattr(torch.ops.cupylab, 'rms_norm'); print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def test_every_operator_registered_with_schema():
    for name, (schema, mutates) in _library.SCHEMAS.items():
        op = getattr(torch.ops.cupylab, name).default
        s = op._schema
        assert [a.name for a in s.arguments] == [
            p.split()[-1].split("=")[0] for p in schema[1:schema.index(") ->")].split(", ")]
        assert {a.name for a in s.arguments if a.alias_info is not None
                and a.alias_info.is_write} == set(mutates)
    # the forward operators have autograd formulas; the mutating one cannot
    assert set(_autograd.FORMULAS) == set(_library.SCHEMAS) - {
        "softmax_backward", "log_softmax_backward", "rms_norm_backward",
        "layer_norm_backward", "cross_entropy_backward", "add_rms_norm_",
        "add_rms_norm_mixed_backward"}


def test_public_functions_documented():
    for name in F.__all__:
        doc = getattr(F, name).__doc__
        assert doc and "Returns" in doc and "Raises" in doc and "Parameters" in doc, name


# -- fake implementations ---------------------------------------------------------------------
def _fake(shape, dtype=torch.bfloat16, **kw):
    return torch.empty(shape, dtype=dtype, device="cuda", **kw)


def _meta(t):
    return tuple(t.shape), t.dtype, tuple(t.stride()), t.device.type


def _contig(shape, dtype):
    return (tuple(shape), dtype, tuple(torch.empty(shape, device="meta").stride()), "cuda")


def test_fake_add_rms_norm_mixed():
    ops = torch.ops.cupylab
    with FakeTensorMode():
        x = _fake((3, 5, 8))
        r = _fake((3, 5, 8), torch.float32)
        w = _fake((8,), torch.float32)
        y, h, rstd = ops.add_rms_norm_mixed(x, r, w, 1e-6, torch.bfloat16)
        assert _meta(y) == _contig((3, 5, 8), torch.bfloat16)
        assert _meta(h) == _contig((3, 5, 8), torch.float32)
        assert _meta(rstd) == _contig((3, 5), torch.float32)
        y, _, _ = ops.add_rms_norm_mixed(x, r, None, 1e-6, torch.float16)
        assert y.dtype == torch.float16
        g, gx, dw = ops.add_rms_norm_mixed_backward(y, r, h, w, rstd, torch.bfloat16)
        assert _meta(g) == _contig((3, 5, 8), torch.float32)
        assert _meta(gx) == _contig((3, 5, 8), torch.bfloat16) and _meta(dw) == _contig(
            (8,), torch.float32)
        # a float32 branch: its gradient is dresidual itself, returned once (outputs of a
        # registered operator may not alias); no weight, or weight_grad=False: (0,)-shaped
        g, gx, dw = ops.add_rms_norm_mixed_backward(y, None, h, None, rstd, torch.float32)
        assert gx.shape == (0,) and dw.shape == (0,) and g.dtype == torch.float32
        assert ops.add_rms_norm_mixed_backward(y, None, h, w, rstd, torch.bfloat16,
                                               False)[2].shape == (0,)


def test_functional_add_rms_norm_mixed_refuses_bad_dtypes():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    r = torch.zeros(2, 8)
    with pytest.raises(TypeError, match=r"add_rms_norm: residual must have x's dtype"):
        F.add_rms_norm(x, r.half(), None)
    with pytest.raises(TypeError, match=r"add_rms_norm: x must be float16, bfloat16 or "
                                        r"float32 over a float32 residual"):
        F.add_rms_norm(x.double(), r, None)
    with pytest.raises(TypeError, match=r"add_rms_norm: weight must be float32"):
        F.add_rms_norm(x, r, torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"add_rms_norm: out_dtype must be"):
        F.add_rms_norm(x, r, None, out_dtype=torch.float64)
    with pytest.raises(TypeError, match=r"add_rms_norm: out_dtype must be"):
        F.add_rms_norm(x, r, None, out_dtype="bfloat16")


def test_fake_rowwise_shapes_dtypes_strides():
    ops = torch.ops.cupylab
    with FakeTensorMode():
        x = _fake((3, 5, 7))
        xt = _fake((7, 5, 3)).transpose(0, 2)  # non-contiguous input: outputs are contiguous
        w32 = _fake((7,), torch.float32)
        for inp in (x, xt):
            assert _meta(ops.softmax(inp, -1)) == _contig((3, 5, 7), torch.bfloat16)
            assert _meta(ops.log_softmax(inp, 1)) == _contig((3, 5, 7), torch.bfloat16)
            y, rstd = ops.rms_norm(inp, w32, 1e-6)
            assert _meta(y) == _contig((3, 5, 7), torch.bfloat16)
            assert _meta(rstd) == _contig((3, 5), torch.float32)
            y, mean, rstd = ops.layer_norm(inp, w32, w32, 1e-5)
            assert _meta(mean) == _meta(rstd) == _contig((3, 5), torch.float32)
        y64, r64 = ops.rms_norm(_fake((4, 6), torch.float64), None, 1e-6)
        assert r64.dtype == torch.float64
        dx, dw = ops.rms_norm_backward(x, x, w32, rstd)
        assert _meta(dx) == _contig((3, 5, 7), torch.bfloat16)
        assert _meta(dw) == _contig((7,), torch.float32)
        dx, dw, db = ops.layer_norm_backward(x, x, None, rstd, rstd)
        assert dw.shape == db.shape == (0,)
        # softmax gradient along a middle dim: a moved view of a contiguous tensor
        dx = ops.softmax_backward(x, x, 1)
        assert _meta(dx) == ((3, 5, 7), torch.bfloat16, (35, 1, 5), "cuda")
        assert _meta(ops.log_softmax_backward(x, x, -1)) == _contig((3, 5, 7), torch.bfloat16)
        y, h, rstd = ops.add_rms_norm(x, x, None, 1e-6)
        assert _meta(y) == _meta(h) == _contig((3, 5, 7), torch.bfloat16)
        assert _meta(rstd) == _contig((3, 5), torch.float32)
        assert _meta(ops.add_rms_norm_(x, _fake((3, 5, 7)), w32, 1e-6)) == _meta(y)


@pytest.mark.parametrize("red,grad", [("mean", True), ("sum", False), ("none", True)])
def test_fake_cross_entropy(red, grad):
    with FakeTensorMode():
        x = _fake((6, 11), torch.float16)
        t = torch.empty(6, dtype=torch.int64, device="cuda")
        loss, lse = torch.ops.cupylab.cross_entropy(x, t, -100, red, 0.1, grad)
        assert _meta(loss) == _contig((6,) if red == "none" else (), torch.float16)
        assert _meta(lse) == (_contig((6,), torch.float32) if grad
                              else _contig((0,), torch.float16))
        dx = torch.ops.cupylab.cross_entropy_backward(x, t, lse, loss, -100, red, 0.1)
        assert _meta(dx) == _contig((6, 11), torch.float16)


@pytest.mark.parametrize("a,b,name,dt", [
    (((4, 1), torch.bfloat16), ((3,), torch.float32), "add", torch.float32),
    (((2, 3), torch.float16), ((), torch.float64), "multiply", torch.float16),  # 0-d: category
    (((2, 3), torch.int32), ((2, 3), torch.int64), "divide", torch.float32),  # true division
    (((2, 3), torch.int32), ((2, 1), torch.int64), "subtract", torch.int64),
])
def test_fake_elementwise(a, b, name, dt):
    with FakeTensorMode():
        x, y = _fake(*a), _fake(*b)
        out = getattr(torch.ops.cupylab, name)(x, y)
        shape = torch.broadcast_shapes(a[0], b[0])
        assert _meta(out) == _contig(shape, dt)
        assert out.dtype == (torch.div(x, y) if name == "divide" else
                             getattr(torch, name)(x, y)).dtype
        s = _fake((4, 1, 1), torch.float64)
        assert _meta(torch.ops.cupylab.fused_add_mul(x, y, s)) == _contig(
            torch.broadcast_shapes(a[0], b[0], (4, 1, 1)), torch.float64)
        r = torch.ops.cupylab.fused_add_mul_scalar(x, y, 2)
        assert r.dtype == ((x + y) * 2).dtype and r.shape == shape


def test_fake_promotion_matches_cupylab_rule():
    """The fake's dtype is what cupylab's torch promotion rule resolves."""
    from cupylab import _dtypes, _promotion

    combos = [("bfloat16", True, "float32", False), ("float16", False, "float64", True),
              ("int32", False, "int64", False), ("int64", False, "float16", True),
              ("bool", False, "int8", False)]
    for da, za, db, zb in combos:
        a = torch.empty(() if za else (2,), dtype=getattr(torch, da))
        b = torch.empty(() if zb else (2,), dtype=getattr(torch, db))
        for name, op in (("add", "add"), ("multiply", "multiply"), ("divide", "true_divide")):
            keys = (("a", da, za), ("a", db, zb))
            want = _promotion.resolve("torch", op, keys)[1]
            assert _dtypes.resolve(_library.result_dtype(name, a, b)) is want, (name, da, db)
        keys = (("a", da, za), ("a", db, zb), ("w", "float"))
        want = _promotion.resolve("torch", "fused_add_mul", keys)[1]
        assert _dtypes.resolve(_library.result_dtype("fused_add_mul", a, b, 1.5)) is want


# -- dispatch ---------------------------------------------------------------------------------
def _bwd_name(t):
    return type(t.grad_fn).__name__ if t.grad_fn is not None else None


def test_dispatch_three_paths(cpu_kernels, monkeypatch):
    x = _g(4, 8, dtype=torch.float32)
    w = _g(8, dtype=torch.float32, seed=1)
    # 1. grad -> the eager autograd.Function
    y = F.rms_norm(x, 8, w, 1e-6)
    assert _bwd_name(y) == "rms_norm_functionBackward"
    assert cpu_kernels[-1][0] == "rms_norm" and len(cpu_kernels[-1][1]) == 3  # with stats
    # 2. no grad -> the kernel directly, without statistics
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            y = F.rms_norm(x, 8, w, 1e-6)
        assert y.grad_fn is None and not y.requires_grad
        name, args = cpu_kernels[-1]
        assert name == "rms_norm" and args[3] is False
    y = F.rms_norm(x.detach(), 8, None, 1e-6)
    assert y.grad_fn is None and cpu_kernels[-1][1][3] is False
    # 3. compiling -> the registered operator (its autograd formula)
    monkeypatch.setattr(F, "_compiling", lambda: True)
    y = F.rms_norm(x, 8, w, 1e-6)
    assert _bwd_name(y).startswith("GeneratedBackwardFor_cupylab_rms_norm")
    with torch.no_grad():
        y = F.rms_norm(x, 8, w, 1e-6)
    assert y.grad_fn is None and cpu_kernels[-1][0] == "rms_norm"


@pytest.mark.parametrize("compiling", [False, True])
def test_dispatch_every_function(cpu_kernels, monkeypatch, compiling):
    monkeypatch.setattr(F, "_compiling", lambda: compiling)
    x, r = _g(3, 5), _g(3, 5, seed=1)
    w, b = _g(5, seed=2), _g(5, seed=3)
    t = torch.tensor([0, 4, 2])
    calls = {
        "softmax": lambda: F.softmax(x, 0),
        "log_softmax": lambda: F.log_softmax(x),
        "rms_norm": lambda: F.rms_norm(x, (5,), w),
        "layer_norm": lambda: F.layer_norm(x, [5], w, b),
        "add_rms_norm": lambda: F.add_rms_norm(x, r, w)[0],
        "cross_entropy": lambda: F.cross_entropy(x, t),
        "add": lambda: F.add(x, r), "subtract": lambda: F.subtract(x, r),
        "multiply": lambda: F.multiply(x, r), "divide": lambda: F.divide(x, r),
        "fused_add_mul": lambda: F.fused_add_mul(x, r, b),
        "fused_add_mul_scalar": lambda: F.fused_add_mul(x, r, 0.5),
    }
    for name, call in calls.items():
        y = call()
        expect = (f"GeneratedBackwardFor_cupylab_{name}_defaultBackward" if compiling
                  else f"{name}_functionBackward")
        assert _bwd_name(y) == expect, name
        with torch.no_grad():
            y = call()
        assert y.grad_fn is None, name
        if not compiling:
            direct = "cross_entropy_loss" if name == "cross_entropy" else name
            assert cpu_kernels[-1][0] == direct, name


def test_add_rms_norm_inplace_inference_tensors(cpu_kernels):
    """An inference tensor is updated in place inside inference mode only, as torch's
    in-place operations: outside it the call raises before anything is written."""
    x, w = _g(3, 6, grad=False), _g(6, seed=2, grad=False)
    with torch.inference_mode():
        r = _g(3, 6, seed=1, grad=False).clone()
        r0 = r.clone()
        F.add_rms_norm_(x, r, w)
        torch.testing.assert_close(r, x + r0)
    before = r.clone()
    n = len(cpu_kernels)
    with pytest.raises(RuntimeError, match="add_rms_norm_: residual is an inference tensor"):
        F.add_rms_norm_(x, r, w)
    assert len(cpu_kernels) == n and torch.equal(r, before)


def test_add_rms_norm_inplace_paths(cpu_kernels, monkeypatch):
    x, r0, w = _g(3, 6, grad=False), _g(3, 6, seed=1, grad=False), _g(6, seed=2, grad=False)
    r = r0.clone()
    v = r._version
    y = F.add_rms_norm_(x, r, w)
    assert cpu_kernels[-1][0] == "add_rms_norm_" and r._version > v
    torch.testing.assert_close(r, x + r0)
    torch.testing.assert_close(y, TF.rms_norm(x + r0, (6,), w, 1e-6))
    # compiling without grad: the mutating registered operator
    monkeypatch.setattr(F, "_compiling", lambda: True)
    r = r0.clone()
    y = F.add_rms_norm_(x, r, w)
    torch.testing.assert_close(r, x + r0)
    monkeypatch.setattr(F, "_compiling", lambda: False)
    # with grad: out of place, then residual.copy_(h): autograd sees the in-place update
    xg = x.clone().requires_grad_()
    rg = r0.clone().requires_grad_()
    res = rg * 1.0
    y = F.add_rms_norm_(xg, res, w)
    torch.testing.assert_close(res, x + r0)
    (y.sum() + (res * res).sum()).backward()
    xr, rr = x.clone().requires_grad_(), r0.clone().requires_grad_()
    h = xr + rr
    (TF.rms_norm(h, (6,), w, 1e-6).sum() + (h * h).sum()).backward()
    torch.testing.assert_close(xg.grad, xr.grad)
    torch.testing.assert_close(rg.grad, rr.grad)


# -- autograd formulas: gradcheck in float64 through both paths -------------------------------
def _cases():
    x = _g(4, 6)
    x3 = _g(2, 3, 5, seed=4)
    r = _g(4, 6, seed=1)
    w, b = _g(6, seed=2), _g(6, seed=3)
    t = torch.tensor([1, 5, -100, 0])
    return {
        "softmax": (lambda x: F.softmax(x, -1), (x,)),
        "softmax_dim1": (lambda x: F.softmax(x, 1), (x3,)),
        "log_softmax_dim0": (lambda x: F.log_softmax(x, 0), (x3,)),
        "rms_norm": (lambda x, w: F.rms_norm(x, (6,), w, 1e-5), (x, w)),
        "rms_norm_noweight": (lambda x: F.rms_norm(x, 6), (x,)),
        "rms_norm_2d_shape": (lambda x, w: F.rms_norm(x, (3, 5), w), (x3, _g(3, 5, seed=5))),
        "layer_norm": (lambda x, w, b: F.layer_norm(x, 6, w, b), (x, w, b)),
        "layer_norm_bias_only": (lambda x, b: F.layer_norm(x, 6, None, b), (x, b)),
        "layer_norm_noaffine": (lambda x: F.layer_norm(x, (2, 3, 5)), (x3,)),
        "add_rms_norm": (lambda x, r, w: F.add_rms_norm(x, r, w), (x, r, w)),
        "add_rms_norm_h_only": (lambda x, r: F.add_rms_norm(x, r, None)[1] ** 2, (x, r)),
        "ce_mean": (lambda x: F.cross_entropy(x, t), (x,)),
        "ce_sum_ls": (lambda x: F.cross_entropy(x, t, reduction="sum", label_smoothing=0.2),
                      (x,)),
        "ce_none": (lambda x: F.cross_entropy(x, t, reduction="none"), (x,)),
        "ce_kdim": (lambda x: F.cross_entropy(x, torch.tensor([[0, 2, 1, 2, 0], [1, 1, 0, 2, 2]]),
                                              reduction="none"), (x3,)),
        "add_bcast": (F.add, (x, _g(1, 6, seed=6))),
        "subtract_bcast": (F.subtract, (_g(4, 1, seed=7), x)),
        "multiply_bcast": (F.multiply, (x, _g(6, seed=8))),
        "divide_bcast": (F.divide, (x, _g(4, 1, seed=9, lo=0.5))),
        "fused_add_mul": (F.fused_add_mul, (x, r, _g(4, 1, seed=10))),
        "fused_add_mul_scalar": (lambda a, b: F.fused_add_mul(a, b, -1.5), (x, r)),
    }


CASES = sorted(_cases())


@pytest.mark.parametrize("compiling", [False, True], ids=["function", "registered"])
@pytest.mark.parametrize("case", CASES)
def test_gradcheck_formulas(cpu_kernels, monkeypatch, case, compiling):
    monkeypatch.setattr(F, "_compiling", lambda: compiling)
    fn, args = _cases()[case]
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradients_mixed_dtypes(cpu_kernels):
    """Gradients come back in each input's dtype, summed over broadcast dims."""
    a = torch.randn(3, 4, dtype=torch.float32, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    F.multiply(a, b).sum().backward()
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float64
    torch.testing.assert_close(b.grad, a.detach().double().sum(0))
    x = torch.randn(5, 8).bfloat16().requires_grad_()
    w = torch.randn(8, requires_grad=True)
    F.rms_norm(x, 8, w).float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


def test_saved_tensors_are_minimal(cpu_kernels):
    """rms_norm saves x, the weight and rstd; softmax its output; cross-entropy its gradient."""
    x = _g(4, 6, dtype=torch.float32)
    w = _g(6, dtype=torch.float32, seed=1)
    y = F.rms_norm(x, 6, w)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 3 and saved[0] is x and saved[1] is w
    assert saved[2].shape == (4,) and saved[2].dtype == torch.float32
    y = F.softmax(x)
    assert [s.shape for s in y.grad_fn.saved_tensors] == [(4, 6)]
    loss = F.cross_entropy(x, torch.tensor([0, 1, 2, 3]))  # logits, target, log-sum-exp
    assert [s.shape for s in loss.grad_fn.saved_tensors] == [(4, 6), (4,), (4,)]
    y = F.add(x, x)
    assert y.grad_fn.saved_tensors == ()


def test_cross_entropy_without_compute_grad_refuses_backward(cpu_kernels):
    x = _g(3, 4, dtype=torch.float32)
    loss, _ = torch.ops.cupylab.cross_entropy(x, torch.tensor([0, 1, 2]), -100, "mean", 0.0,
                                              False)
    with pytest.raises(RuntimeError, match="compute_grad=False"):
        loss.backward()


# -- argument errors --------------------------------------------------------------------------
@pytest.mark.parametrize("call,exc,words", [
    (lambda x: F.softmax(x, 2), IndexError, ["softmax", "dim 2"]),
    (lambda x: F.log_softmax(x, 1.0), TypeError, ["log_softmax", "dim"]),
    (lambda x: F.softmax([1.0]), TypeError, ["softmax", "x must be a torch.Tensor"]),
    (lambda x: F.rms_norm(x, (3,)), ValueError, ["rms_norm", "normalized_shape"]),
    (lambda x: F.rms_norm(x, ()), ValueError, ["rms_norm", "normalized_shape"]),
    (lambda x: F.rms_norm(x, "5"), TypeError, ["rms_norm", "normalized_shape"]),
    (lambda x: F.rms_norm(x, (3, 5)), ValueError, ["rms_norm", "normalized_shape"]),
    (lambda x: F.rms_norm(x, 5, torch.ones(4)), ValueError, ["rms_norm", "weight"]),
    (lambda x: F.rms_norm(x, 5, eps=-1.0), ValueError, ["rms_norm", "eps"]),
    (lambda x: F.rms_norm(x.long(), 5), TypeError, ["rms_norm", "floating-point"]),
    (lambda x: F.layer_norm(x, 5, None, torch.ones(5, 1)), ValueError, ["layer_norm", "bias"]),
    (lambda x: F.add_rms_norm(x, x[:1], None), ValueError, ["add_rms_norm", "residual"]),
    (lambda x: F.add_rms_norm_(x, x, torch.ones(3)), ValueError, ["add_rms_norm_", "weight"]),
    (lambda x: F.cross_entropy(x, torch.tensor([0, 1]), torch.ones(5)), ValueError,
     ["cross_entropy", "weight"]),  # torch's third positional parameter is weight
    (lambda x: F.cross_entropy(x, torch.tensor([0, 1]), size_average=False), ValueError,
     ["cross_entropy", "size_average", "reduction"]),
    (lambda x: F.cross_entropy(x, torch.tensor([0, 1]), weight=torch.ones(5)), ValueError,
     ["cross_entropy", "weight"]),
    (lambda x: F.cross_entropy(x, torch.tensor([0, 1, 2])), ValueError,
     ["cross_entropy", "target must have shape (2,)"]),
    (lambda x: F.cross_entropy(x, torch.rand(2, 5)), TypeError, ["cross_entropy", "target"]),
    (lambda x: F.cross_entropy(x, torch.tensor([0, 1]), reduction="avg"), ValueError,
     ["cross_entropy", "reduction"]),
    (lambda x: F.cross_entropy(x, torch.tensor([0, 1]), label_smoothing=1.5), ValueError,
     ["cross_entropy", "label_smoothing"]),
    (lambda x: F.cross_entropy(x, torch.tensor([0, 1]), ignore_index=1.0), TypeError,
     ["cross_entropy", "ignore_index"]),
    (lambda x: F.add(x, 1.0), TypeError, ["add", "other must be a torch.Tensor"]),
    (lambda x: F.divide(2, x), TypeError, ["divide", "input"]),
    (lambda x: F.fused_add_mul(x, x, "2"), TypeError, ["fused_add_mul", "s must be"]),
])
def test_argument_errors(call, exc, words):
    x = torch.randn(2, 5)
    with pytest.raises(exc) as ei:
        call(x)
    msg = str(ei.value)
    assert msg.startswith("cupylab.torch.functional."), msg
    for w in words:
        assert w in msg, (w, msg)


def test_cpu_tensors_reach_cupylab_errors():
    """Without the CPU references, the real kernels refuse host tensors with cupylab's error
    naming the operator (nothing is launched)."""
    with pytest.raises(TypeError, match="rms_norm"):
        F.rms_norm(torch.randn(2, 4), 4)
    with pytest.raises(TypeError, match="add"):
        F.add(torch.randn(2), torch.randn(2))


def test_normalized_shape_flattening_is_a_view(cpu_kernels):
    x = _g(2, 3, 4, dtype=torch.float32, grad=False)
    w = _g(3, 4, dtype=torch.float32, seed=1, grad=False)
    y = F.rms_norm(x, (3, 4), w, 1e-6)
    args = cpu_kernels[-1][1]
    assert args[0].shape == (2, 12) and args[0].data_ptr() == x.data_ptr()  # a view
    assert args[1].shape == (12,)
    torch.testing.assert_close(y, TF.rms_norm(x, (3, 4), w, 1e-6))
    y = F.layer_norm(x, x.shape[1:], w, w)
    torch.testing.assert_close(y, TF.layer_norm(x, (3, 4), w, w))
    assert F.rms_norm(x, 4).shape == x.shape
    assert torch.allclose(F.softmax(torch.tensor(3.0)), torch.tensor(1.0))


def test_eager_functions_return_the_differentiable_outputs_only(cpu_kernels, monkeypatch):
    """The eager autograd Functions of the norms and cross-entropy return only what is
    differentiable (statistics and the forward's gradient stay in the context), and their
    gradients equal those of the registered operators' path."""
    x = _g(4, 6, dtype=torch.float64)
    w = _g(6, dtype=torch.float64, seed=1)
    r = _g(4, 6, dtype=torch.float64, seed=2)
    t = torch.tensor([0, 1, 2, 3])
    fn = _autograd.FUNCTIONS
    assert isinstance(fn["rms_norm"].apply(x, w, 1e-6), torch.Tensor)
    assert isinstance(fn["layer_norm"].apply(x, w, None, 1e-5), torch.Tensor)
    y, h = fn["add_rms_norm"].apply(x, r, w, 1e-6)
    assert y.shape == h.shape == x.shape
    loss = fn["cross_entropy"].apply(x, t, -100, "mean", 0.0, True)
    assert isinstance(loss, torch.Tensor) and loss.shape == ()

    def grads(compiling):
        monkeypatch.setattr(F, "_compiling", lambda: compiling)
        y, h = F.add_rms_norm(x, r, w)
        z = F.layer_norm(y, 6, w) + F.rms_norm(h, 6, w)
        (z.pow(2).sum() + 2 * h.sum() + F.cross_entropy(z, t)).backward()
        out = [v.grad.clone() for v in (x, r, w)]
        for v in (x, r, w):
            v.grad = None
        return out

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax", "log_softmax"])
@pytest.mark.parametrize("dy_grad", [True, False])
def test_eager_row_wise_backward_raises_when_differentiated_again(cpu_kernels, op, dy_grad):
    """With create_graph=True the row-wise backward still runs, and a second differentiation
    through it raises, also when the incoming gradient is a constant (y.sum(): the gradient
    still depends on x and w through the saved tensors, so a silent None would drop the
    second derivative, as once_differentiable did)."""
    x = _g(4, 6, dtype=torch.float64)
    w = _g(6, dtype=torch.float64, seed=1)
    fwd = {"rms_norm": lambda: F.rms_norm(x, 6, w), "layer_norm": lambda: F.layer_norm(x, 6, w),
           "softmax": lambda: F.softmax(x, -1), "log_softmax": lambda: F.log_softmax(x, -1)}[op]
    loss = (lambda y: y.pow(2).sum()) if dy_grad else (lambda y: (y * 3.0).sum())
    (gx,) = torch.autograd.grad(loss(fwd()), x, create_graph=True)
    (ref,) = torch.autograd.grad(loss(fwd()), x)
    torch.testing.assert_close(gx.detach(), ref)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match=f"cupylab {op}: its gradient cannot be "
                                           "differentiated again"):
        gx.pow(2).sum().backward()


@pytest.mark.parametrize("op", ["softmax_backward", "log_softmax_backward", "rms_norm_backward",
                                "layer_norm_backward"])
def test_registered_backward_operators_raise_when_differentiated(cpu_kernels, op):
    """The registered backward operators have no derivative: differentiating through one
    raises (torch would otherwise only warn and give no gradient)."""
    x = _g(4, 6, dtype=torch.float64)
    dy = _g(4, 6, dtype=torch.float64, seed=2)
    w = _g(6, dtype=torch.float64, seed=1)
    st = torch.ones(4, dtype=torch.float64)
    args = {"softmax_backward": (torch.softmax(x, -1), dy, -1),
            "log_softmax_backward": (torch.log_softmax(x, -1), dy, -1),
            "rms_norm_backward": (dy, x, w, st),
            "layer_norm_backward": (dy, x, w, st * 0, st)}[op]
    out = getattr(torch.ops.cupylab, op)(*args)
    first = out[0] if isinstance(out, (tuple, list)) else out
    assert first.requires_grad
    with pytest.raises(RuntimeError, match=f"cupylab::{op} has no derivative"):
        first.sum().backward()


@pytest.mark.parametrize("op", ["add", "subtract", "multiply", "divide", "fused_add_mul",
                                "fused_add_mul_scalar"])
def test_eager_elementwise_double_backward_matches_torch(cpu_kernels, op):
    """The elementwise backward formulas are torch operations: with create_graph=True they
    are recorded, and a gradient penalty differentiates through them as torch's ops do."""
    a = _g(4, 5, dtype=torch.float64, lo=0.5)
    b = _g(5, dtype=torch.float64, seed=1, lo=0.5)
    s = _g(4, 5, dtype=torch.float64, seed=2, lo=0.5)
    mine = {"add": F.add, "subtract": F.subtract, "multiply": F.multiply, "divide": F.divide,
            "fused_add_mul": lambda a, b: F.fused_add_mul(a, b, s),
            "fused_add_mul_scalar": lambda a, b: F.fused_add_mul(a, b, 0.7)}[op]
    ref = {"add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "divide": torch.div,
           "fused_add_mul": lambda a, b: (a + b) * s,
           "fused_add_mul_scalar": lambda a, b: (a + b) * 0.7}[op]

    def penalty(f):
        y = f(a, b)
        ga, gb = torch.autograd.grad((y * y).sum(), (a, b), create_graph=True)
        return torch.autograd.grad(ga.pow(2).sum() + gb.pow(3).sum(), (a, b, s),
                                   allow_unused=True)

    for got, want in zip(penalty(mine), penalty(ref)):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("path", ["functional", "registered"])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "add_rms_norm"])
def test_a_frozen_norm_weight_gets_no_weight_gradient_computed(cpu_kernels, path, op,
                                                             monkeypatch):
    """A weight that does not require grad (a frozen norm, LoRA) or gradients taken with
    respect to x alone: the backward kernel is asked for dx only."""
    if path == "registered":
        monkeypatch.setattr(F, "_compiling", lambda: True)
    x = _g(4, 6, dtype=torch.float64)
    w = _g(6, dtype=torch.float64, seed=1, grad=False)
    b = _g(6, dtype=torch.float64, seed=2, grad=False)
    fwd = {"rms_norm": lambda: F.rms_norm(x, 6, w),
           "layer_norm": lambda: F.layer_norm(x, 6, w, b),
           "add_rms_norm": lambda: F.add_rms_norm(x, x * 0.5, w)[0]}[op]
    fwd().pow(2).sum().backward()
    bwd = [args for name, args in cpu_kernels if name.endswith("norm_backward")]
    assert bwd and all(args[-1] is False for args in bwd)
    assert w.grad is None and x.grad is not None
    ref = x.detach().clone().requires_grad_()
    if op == "rms_norm":
        TF.rms_norm(ref, (6,), w).pow(2).sum().backward()
    elif op == "layer_norm":
        TF.layer_norm(ref, (6,), w, b).pow(2).sum().backward()
    else:
        TF.rms_norm(ref + ref * 0.5, (6,), w, 1e-6).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


def test_frozen_parameters_reach_the_kernels_as_plain_tensors():
    """A frozen Parameter (requires_grad=False) is detached to a plain tensor like a trained
    one: the lean launch paths take plain tensors only (a Parameter made every call take the
    fully validating path)."""
    w = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    assert type(_kernels._vec(w)) is torch.Tensor and type(_kernels._d(w)) is torch.Tensor
    t = torch.ones(3)
    assert _kernels._vec(t) is t and _kernels._d(t) is t  # plain tensors as they are


@pytest.mark.parametrize("path", ["functional", "registered"])
def test_cross_entropy_double_backward_raises(cpu_kernels, path):
    """cross_entropy's backward is a kernel with no graph of its own: with create_graph=True
    the first gradient is right, and differentiating it again raises instead of silently
    leaving out the loss's Hessian (the second derivative torch would give)."""
    x = _g(5, 7, dtype=torch.float64)
    t = torch.tensor([0, 3, 6, 2, 1])
    if path == "functional":
        loss = F.cross_entropy(x, t)
    else:
        loss = torch.ops.cupylab.cross_entropy(x, t, -100, "mean", 0.0, True)[0]
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    torch.testing.assert_close(gx.detach(), torch.autograd.grad(
        torch.nn.functional.cross_entropy(x, t), x)[0])
    with pytest.raises(RuntimeError, match="no double backward"):
        gx.pow(2).sum().backward()


@pytest.mark.parametrize("how", ["grad_outputs", "create_graph"])
def test_cross_entropy_backward_takes_an_incoming_gradient_that_requires_grad(
        cpu_kernels, monkeypatch, how):
    """The incoming gradient (float32 or float64) was handed to a cupylab kernel still
    requiring grad, which cupylab refuses (TypeError): per-row loss weights that require
    grad, or create_graph with a learned loss scale, failed the first backward (torch's
    cross-entropy takes both)."""
    import cupylab

    from torch_cpu_refs import _ce_bwd

    def backward(x, t, lse, dloss, ii, ls, red):  # refuses what the real kernel refuses
        return _ce_bwd(x, t, lse, dloss, ii, red, ls, refuse=True)

    monkeypatch.setattr(_kernels, "cross_entropy_backward", _REAL_CE_BWD)
    monkeypatch.setattr(cupylab, "cross_entropy_backward", backward)
    x = _g(5, 7, dtype=torch.float64)
    t = torch.tensor([0, 3, 6, 2, 1])
    ref = torch.nn.functional.cross_entropy
    if how == "grad_outputs":
        go = torch.rand(5, dtype=torch.float64, requires_grad=True)
        (gx,) = torch.autograd.grad(F.cross_entropy(x, t, reduction="none"), x, go)
        (want,) = torch.autograd.grad(ref(x, t, reduction="none"), x, go)
    else:
        lam = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
        (gx,) = torch.autograd.grad(F.cross_entropy(x, t) * lam, x, create_graph=True)
        (want,) = torch.autograd.grad(ref(x, t) * lam, x)
    torch.testing.assert_close(gx.detach(), want)


def test_a_row_wise_gradient_made_with_create_graph_can_be_modified_in_place(cpu_kernels):
    """The guard against a second differentiation returned an autograd view of the gradient,
    which refused an in-place update ("a view ... is being modified inplace")."""
    x = _g(4, 6, dtype=torch.float64)
    w = _g(6, dtype=torch.float64, seed=1)
    (gx,) = torch.autograd.grad(F.rms_norm(x, 6, w).pow(2).sum(), x, create_graph=True)
    want = gx.detach().clone()
    gx.mul_(2)
    torch.testing.assert_close(gx.detach(), want * 2)


def _ce_call(path, x, t, red="mean"):
    if path == "functional":
        return _autograd.FUNCTIONS["cross_entropy"].apply(x, t, -100, red, 0.0, True, True)
    return torch.ops.cupylab.cross_entropy(x, t, -100, red, 0.0, True, True)[0]


@pytest.mark.parametrize("path", ["functional", "registered"])
def test_cross_entropy_float16_gradient_survives_loss_scaling(cpu_kernels, path):
    """float16 logits, mean over many rows, GradScaler's scales: each gradient of order
    1/(rows x classes) must neither vanish below float16's range before the scale is applied
    nor overflow with the scale (65536 > float16's max), as torch's float32 cross-entropy
    under autocast gives."""
    g = torch.Generator().manual_seed(4)
    rows, classes = 2048, 512
    base = torch.randn(rows, classes, generator=g)
    t = torch.randint(0, classes, (rows,), generator=g)
    t[:7] = -100
    for scale in (1024.0, 65536.0):
        ref = base.half().requires_grad_()
        (TF.cross_entropy(ref.float(), t) * scale).backward()
        x = base.half().requires_grad_()
        loss = _ce_call(path, x, t)
        assert loss.dtype == torch.float32
        (loss * scale).backward()
        assert torch.isfinite(x.grad).all()
        torch.testing.assert_close(x.grad.float(), ref.grad.float(), rtol=4e-3, atol=2e-6)
        nz = ref.grad != 0
        assert (x.grad[nz] != 0).float().mean() > 0.999  # nothing flushed to zero


@pytest.mark.parametrize("path", ["functional", "registered"])
def test_cross_entropy_loss_gradient_is_not_rounded_to_bfloat16(cpu_kernels, path):
    """The loss's gradient multiplies in float32: a bf16 1/3 would bias every gradient by
    0.2 %."""
    g = torch.Generator().manual_seed(5)
    base = torch.randn(64, 10, generator=g)
    t = torch.randint(0, 10, (64,), generator=g)
    x = base.bfloat16().requires_grad_()
    (_ce_call(path, x, t) / 3).backward()
    ref = torch.func.grad(lambda z: TF.cross_entropy(z, t) / 3)(base.bfloat16().double())
    ratio = (x.grad.double() * ref).sum() / (ref * ref).sum()
    assert abs(ratio.item() - 1) < 5e-4


@pytest.mark.parametrize("path", ["functional", "registered"])
def test_cross_entropy_float16_all_ignored(cpu_kernels, path):
    """Every row ignored: the mean loss is NaN and the gradient 0, as torch gives."""
    x = torch.randn(4, 6).half().requires_grad_()
    t = torch.full((4,), -100)
    loss = _ce_call(path, x, t)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x.grad))


def test_fused_add_mul_complex_scalar_gradient_is_conjugated(cpu_kernels):
    """With a complex Python scalar s, d(a) = g * conj(s), as torch's autograd gives."""
    a = torch.randn(6, dtype=torch.complex128, requires_grad=True)
    b = torch.randn(6, dtype=torch.complex128, requires_grad=True)
    g = torch.randn(6, dtype=torch.complex128)
    F.fused_add_mul(a, b, 0.5 + 2j).backward(g)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ((a2 + b2) * (0.5 + 2j)).backward(g)
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)
