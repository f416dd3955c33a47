"""cupylab.torch.functional and torch.ops.cupylab on the GPU: gradcheck in float64 of every
operator through the eager autograd.Function and through the registered operator, forward
values and gradients against torch's own operators in float32 / bfloat16 (and float32 weights
with bfloat16 activations), torch.library.opcheck with the real kernels, torch.compile
(fullgraph, no graph break, no recompilation, dynamic batch), torch.cuda.graph capture and
replay (forward, and forward + backward), mode="reduce-overhead" replays, and the no-grad
path."""
import pytest

torch = pytest.importorskip("torch")

from cupylab.torch import _kernels  # noqa: E402
from cupylab.torch import functional as CF  # noqa: E402

pytestmark = pytest.mark.gpu
TF = torch.nn.functional
DEV = "cuda"
TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float64: 1e-9}


def _r(*shape, dtype=torch.float32, seed=0, grad=False, lo=None, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    t = torch.randn(*shape, generator=g, device=DEV, dtype=torch.float32) * scale
    if lo is not None:
        t = t.sign() * (t.abs() + lo)
    return t.to(dtype).requires_grad_(grad)


def _close(got, ref, dtype, what=""):
    """max |got - ref| <= tol * (1 + max |ref|), in float64."""
    got, ref = got.detach().double(), ref.detach().double()
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    tol = TOL[dtype]
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    bound = tol * (1 + (ref.abs().max().item() if ref.numel() else 0.0))
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


def _grads(fn, inputs, seed=7):
    """Forward value and the input gradients for a random output gradient."""
    ins = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*ins)
    out = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    gos = [torch.randn(o.shape, generator=gen, device=DEV).to(o.dtype) for o in out]
    torch.autograd.backward(out, gos)
    return [o.detach() for o in out], [t.grad for t in ins if t.requires_grad]


def _compare(mine, ref, inputs, dtype, what):
    """``mine`` against torch's ``ref`` run on float64 copies of the inputs."""
    out, grads = _grads(mine, inputs)
    ref_in = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    rout, rgrads = _grads(ref, ref_in)
    assert len(out) == len(rout) and len(grads) == len(rgrads)
    for i, (a, b) in enumerate(zip(out, rout)):
        _close(a, b, dtype, f"{what} output {i}")
    for i, (a, b, t) in enumerate(zip(grads, rgrads, [t for t in inputs if t.requires_grad])):
        assert a.dtype == t.dtype, (what, i, a.dtype, t.dtype)
        _close(a, b, dtype, f"{what} grad {i}")


# -- float64 gradcheck through both paths ------------------------------------------------------
def _gradcheck_cases():
    d = torch.float64
    x = _r(4, 7, dtype=d, grad=True)
    x3 = _r(2, 3, 5, dtype=d, seed=1, grad=True)
    r = _r(4, 7, dtype=d, seed=2, grad=True)
    w, b = _r(7, dtype=d, seed=3, grad=True), _r(7, dtype=d, seed=4, grad=True)
    t = torch.tensor([1, 6, -100, 0], device=DEV)
    t3 = torch.tensor([[0, 2, 1, 2, 0], [1, 1, -100, 2, 2]], device=DEV)
    return {
        "softmax": (lambda x: CF.softmax(x, -1), (x,)),
        "softmax_dim1": (lambda x: CF.softmax(x, 1), (x3,)),
        "log_softmax": (lambda x: CF.log_softmax(x, -1), (x,)),
        "log_softmax_dim0": (lambda x: CF.log_softmax(x, 0), (x3,)),
        "rms_norm": (lambda x, w: CF.rms_norm(x, 7, w, 1e-5), (x, w)),
        "rms_norm_noweight": (lambda x: CF.rms_norm(x, (7,)), (x,)),
        "rms_norm_2d_shape": (lambda x, w: CF.rms_norm(x, (3, 5), w),
                              (x3, _r(3, 5, dtype=d, seed=5, grad=True))),
        "layer_norm": (lambda x, w, b: CF.layer_norm(x, 7, w, b), (x, w, b)),
        "layer_norm_noaffine": (lambda x: CF.layer_norm(x, (3, 5)), (x3,)),
        "layer_norm_bias_only": (lambda x, b: CF.layer_norm(x, 7, None, b), (x, b)),
        "add_rms_norm": (lambda x, r, w: CF.add_rms_norm(x, r, w), (x, r, w)),
        "ce_mean": (lambda x: CF.cross_entropy(x, t), (x,)),
        "ce_sum_smooth": (lambda x: CF.cross_entropy(x, t, reduction="sum",
                                                     label_smoothing=0.1), (x,)),
        "ce_none": (lambda x: CF.cross_entropy(x, t, reduction="none"), (x,)),
        "ce_kdim": (lambda x: CF.cross_entropy(x, t3, reduction="none"), (x3,)),
        "add": (CF.add, (x, _r(1, 7, dtype=d, seed=6, grad=True))),
        "subtract": (CF.subtract, (_r(4, 1, dtype=d, seed=7, grad=True), x)),
        "multiply": (CF.multiply, (x, _r(7, dtype=d, seed=8, grad=True))),
        "divide": (CF.divide, (x, _r(4, 1, dtype=d, seed=9, grad=True, lo=0.5))),
        "fused_add_mul": (CF.fused_add_mul, (x, r, _r(4, 1, dtype=d, seed=10, grad=True))),
        "fused_add_mul_scalar": (lambda a, b: CF.fused_add_mul(a, b, 0.75), (x, r)),
    }


GRADCHECK_CASES = [
    "softmax", "softmax_dim1", "log_softmax", "log_softmax_dim0", "rms_norm",
    "rms_norm_noweight", "rms_norm_2d_shape", "layer_norm", "layer_norm_noaffine",
    "layer_norm_bias_only", "add_rms_norm", "ce_mean", "ce_sum_smooth", "ce_none", "ce_kdim",
    "add", "subtract", "multiply", "divide", "fused_add_mul", "fused_add_mul_scalar"]


def test_gradcheck_cases_listed():
    assert sorted(GRADCHECK_CASES) == sorted(_gradcheck_cases())


@pytest.mark.parametrize("registered", [False, True], ids=["function", "registered"])
@pytest.mark.parametrize("case", GRADCHECK_CASES)
def test_gradcheck_float64(case, registered, monkeypatch):
    if registered:  # what torch.compile calls: torch.ops.cupylab.* with its autograd formula
        monkeypatch.setattr(CF, "_compiling", lambda: True)
    fn, args = _gradcheck_cases()[case]
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-6)


# -- against torch's own operators -------------------------------------------------------------
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((37, 1000), -1), ((5, 6, 129), 1), ((3, 4096), 0)])
def test_softmax_vs_torch(dtype, shape, dim):
    x = _r(*shape, dtype=dtype, grad=True, scale=3)
    _compare(lambda x: CF.softmax(x, dim), lambda x: torch.softmax(x, dim), [x], dtype,
             "softmax")
    _compare(lambda x: CF.log_softmax(x, dim), lambda x: torch.log_softmax(x, dim), [x],
             dtype, "log_softmax")


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32),
                                          (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32),
                                          (torch.float16, torch.float32)])
@pytest.mark.parametrize("shape,ns", [((64, 4096), (4096,)), ((3, 5, 33), (33,)),
                                      ((6, 4, 96), (4, 96))])
def test_norms_vs_torch(dtype, wdtype, shape, ns):
    x = _r(*shape, dtype=dtype, grad=True, scale=2)
    w = _r(*ns, dtype=wdtype, seed=1, grad=True)
    b = _r(*ns, dtype=wdtype, seed=2, grad=True)

    def ref_rms(x, w):
        return TF.rms_norm(x, ns, w, 1e-6)

    def ref_ln(x, w, b):
        return TF.layer_norm(x, ns, w, b, 1e-5)

    _compare(lambda x, w: CF.rms_norm(x, ns, w, 1e-6), ref_rms, [x, w], dtype, "rms_norm")
    _compare(lambda x, w, b: CF.layer_norm(x, ns, w, b, 1e-5), ref_ln, [x, w, b], dtype,
             "layer_norm")
    _compare(lambda x: CF.rms_norm(x, ns), lambda x: TF.rms_norm(
        x, ns, None, torch.finfo(dtype).eps), [x], dtype, "rms_norm default eps")


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_vs_torch(dtype):
    x = _r(50, 768, dtype=dtype, grad=True)
    r = _r(50, 768, dtype=dtype, seed=1, grad=True)
    w = _r(768, dtype=dtype, seed=2, grad=True)

    def ref(x, r, w):
        h = (x + r).to(dtype).to(x.dtype)  # h rounded to the activation dtype
        return TF.rms_norm(h, (768,), w, 1e-6), h

    _compare(lambda x, r, w: CF.add_rms_norm(x, r, w, 1e-6), ref, [x, r, w], dtype,
             "add_rms_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smooth", [0.0, 0.1])
def test_cross_entropy_vs_torch(dtype, reduction, smooth):
    x = _r(37, 1003, dtype=dtype, grad=True, scale=3)
    g = torch.Generator(device=DEV).manual_seed(3)
    t = torch.randint(0, 1003, (37,), generator=g, device=DEV)
    t[::5] = -100

    def ref(x):
        return TF.cross_entropy(x, t, reduction=reduction, label_smoothing=smooth)

    _compare(lambda x: CF.cross_entropy(x, t, reduction=reduction, label_smoothing=smooth), ref,
             [x], dtype, "ce")
    assert CF.cross_entropy(x, t, reduction=reduction).dtype == dtype  # torch's loss dtype


@pytest.mark.parametrize("scale", [1024.0, 65536.0])
def test_cross_entropy_float16_autocast_gradient_with_a_loss_scale(scale):
    """float16 logits under autocast, mean over 4096 rows of 8192 classes, GradScaler's
    scales: the gradients stay finite and match torch's float32 cross-entropy (none flushed
    to zero before the scale, no overflow of the scale in float16)."""
    g = torch.Generator(device=DEV).manual_seed(6)
    base = torch.randn(4096, 8192, generator=g, device=DEV)
    t = torch.randint(0, 8192, (4096,), generator=g, device=DEV)
    t[::97] = -100
    ref = base.half().requires_grad_()
    x = base.half().requires_grad_()
    with torch.autocast("cuda", dtype=torch.float16):
        loss_ref = TF.cross_entropy(ref, t)
        loss = CF.cross_entropy(x, t)
    assert loss.dtype == loss_ref.dtype == torch.float32
    (loss_ref * scale).backward()
    (loss * scale).backward()
    assert torch.isfinite(x.grad).all()
    # against the float64 gradient (torch's own float16 gradient at scale 65536 is off by up
    # to 4.4e-3, median 1.8e-3, on an H100; cupylab's median 2.7e-4): one float16 rounding,
    # and the forward's float16 store of the gradient of the sum (subnormal below 6e-5)
    xd = base.half().double()
    kept = t != -100
    exact = torch.softmax(xd, -1) - TF.one_hot(t.clamp(min=0), 8192).double()
    exact = exact * kept[:, None] * (scale / int(kept.sum()))
    torch.testing.assert_close(x.grad.double(), exact, rtol=4e-3, atol=1e-6)
    nz = ref.grad != 0
    assert (x.grad[nz] != 0).float().mean() > 0.999


def test_cross_entropy_class_dim_1_and_int32_targets():
    x = _r(4, 9, 6, grad=True)
    t = torch.randint(0, 9, (4, 6), device=DEV)
    _compare(lambda x: CF.cross_entropy(x, t.int()), lambda x: TF.cross_entropy(x, t), [x],
             torch.float32, "ce (N, C, d)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_vs_torch(dtype):
    a = _r(33, 65, dtype=dtype, grad=True)
    b = _r(65, dtype=dtype, seed=1, grad=True, lo=0.5)
    c = _r(33, 1, dtype=torch.float32, seed=2, grad=True, lo=0.5)
    for name, mine, ref in [("add", CF.add, torch.add), ("subtract", CF.subtract, torch.sub),
                            ("multiply", CF.multiply, torch.mul),
                            ("divide", CF.divide, torch.div)]:
        _compare(mine, ref, [a, b], dtype, name)
        _compare(mine, ref, [a, c], dtype, name + " mixed dtypes")
        assert mine(a, c).dtype == ref(a, c).dtype and mine(a, b).dtype == ref(a, b).dtype
    _compare(CF.fused_add_mul, lambda a, b, c: (a + b) * c, [a, b, c], dtype, "fused_add_mul")
    _compare(lambda a, b: CF.fused_add_mul(a, b, 1.5), lambda a, b: (a + b) * 1.5, [a, b],
             dtype, "fused_add_mul scalar")


def _through_view(fn, ref, base, view):
    """``fn(view(base))`` against ``ref`` on a float64 copy of ``base``: outputs and the
    gradient reaching ``base`` through the view."""
    a = base.detach().clone().requires_grad_()
    b = base.detach().double().requires_grad_()
    ya, yb = fn(view(a)), ref(view(b))
    go = torch.randn(ya.shape, device=DEV)
    ya.backward(go.to(ya.dtype))
    yb.backward(go.double())
    _close(ya, yb, torch.float32, "output")
    _close(a.grad, b.grad, torch.float32, "grad")


def test_strided_and_4d_inputs():
    base = _r(6, 10, 70)

    def rows(t):  # strided rows, offset start
        v = t[:, 1:9, 3:67]
        assert not v.is_contiguous()
        return v

    _through_view(lambda x: CF.rms_norm(x, 64), lambda x: TF.rms_norm(x, (64,), None, 1e-6),
                  base, rows)
    _through_view(lambda x: CF.add_rms_norm(x, x * 1, None)[0],
                  lambda x: TF.rms_norm(2 * x, (64,), None, 1e-6), base, rows)
    base4 = _r(3, 5, 4, 64, seed=1)

    def tr(t):  # 4-d and not contiguous: made contiguous before the row kernels
        return t.transpose(1, 2)

    _through_view(lambda x: CF.layer_norm(x, 64), lambda x: TF.layer_norm(x, (64,)), base4, tr)
    _through_view(lambda x: CF.softmax(x, 2), lambda x: torch.softmax(x, 2), base4, tr)
    _through_view(lambda x: CF.log_softmax(x, 0), lambda x: torch.log_softmax(x, 0), base4, tr)


# -- the no-grad path --------------------------------------------------------------------------
def test_no_grad_path_calls_kernels_directly(monkeypatch):
    import cupylab

    x = _r(16, 4096, dtype=torch.bfloat16, grad=True)
    w = torch.nn.Parameter(_r(4096, dtype=torch.bfloat16, seed=1))
    seen = []
    real = _kernels.rms_norm
    monkeypatch.setattr(_kernels, "rms_norm", lambda *a: seen.append(a) or real(*a))
    with torch.no_grad():
        y = CF.rms_norm(x, 4096, w, 1e-6)
    assert y.grad_fn is None and not y.requires_grad
    assert len(seen) == 1 and seen[0][3] is False  # no statistics
    assert torch.equal(y, cupylab.rms_norm(x.detach(), w.detach(), 1e-6))
    with torch.inference_mode():
        y = CF.softmax(x)
    assert y.grad_fn is None
    y = CF.rms_norm(x, 4096, w, 1e-6)
    assert type(y.grad_fn).__name__ == "rms_norm_functionBackward"


def test_add_rms_norm_inplace_gpu():
    x, r0 = _r(8, 256, dtype=torch.bfloat16), _r(8, 256, dtype=torch.bfloat16, seed=1)
    w = _r(256, dtype=torch.float32, seed=2)
    r = r0.clone()
    with torch.no_grad():
        y = CF.add_rms_norm_(x, r, w)
    y2, h = CF.add_rms_norm(x, r0, w)
    assert torch.equal(r, h) and torch.equal(y, y2)


# -- torch.library.opcheck with the real kernels -----------------------------------------------
def test_opcheck_real_kernels():
    x = _r(6, 40, grad=True)
    w = _r(40, seed=1, grad=True)
    x3 = _r(3, 4, 40, seed=2, grad=True)
    t = torch.randint(0, 40, (6,), device=DEV)
    ops = torch.ops.cupylab
    cases = [
        (ops.softmax.default, (x, -1)), (ops.log_softmax.default, (x3, 1)),
        (ops.softmax_backward.default, (x3.detach(), x3.detach(), 1)),
        (ops.rms_norm.default, (x, w, 1e-6)), (ops.layer_norm.default, (x, w, w, 1e-5)),
        (ops.add_rms_norm.default, (x, x.detach().clone(), w, 1e-6)),
        (ops.cross_entropy.default, (x, t, -100, "mean", 0.1, True)),
        (ops.cross_entropy.default, (x.detach(), t, -100, "none", 0.0, False)),
        (ops.add.default, (x, w)), (ops.divide.default, (x, w.detach() + 3)),
        (ops.fused_add_mul.default, (x, w, x[:, :1].detach())),
        (ops.fused_add_mul_scalar.default, (x, w, 2.5)),
        (ops.add_rms_norm_.default, (x.detach(), x.detach().clone(), w.detach(), 1e-6)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=(
            "test_schema", "test_autograd_registration", "test_faketensor",
            "test_aot_dispatch_dynamic"))


# -- torch.compile -----------------------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, d=64, v=50):
        super().__init__()
        self.d = d
        self.w = torch.nn.Parameter(torch.randn(d) * 0.1 + 1)
        self.b = torch.nn.Parameter(torch.randn(d) * 0.1)
        self.proj = torch.nn.Linear(d, v)

    def forward(self, x, r, t):
        y, h = CF.add_rms_norm(x, r, self.w)
        y = CF.layer_norm(y, self.d, self.w, self.b)
        z = CF.fused_add_mul(y, h, 0.5)
        z = CF.add(CF.multiply(z, self.w), CF.divide(z, self.b.abs() + 1))
        logits = self.proj(CF.subtract(z, h))
        p = CF.softmax(logits, -1)
        q = CF.log_softmax(logits, -1)
        return CF.cross_entropy(logits, t) + (p * q).mean() + CF.rms_norm(z, self.d).mean()


def _inputs(batch, seed, d=64, v=50):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(batch, d, generator=g, device=DEV)
    r = torch.randn(batch, d, generator=g, device=DEV)
    return x, r, torch.randint(0, v, (batch,), generator=g, device=DEV)


def _step(model, x, r, t):
    for p in model.parameters():
        p.grad = None
    loss = model(x, r, t)
    loss.backward()
    return loss.detach().clone(), [p.grad.detach().clone() for p in model.parameters()]


def _check_step(a, b, tol=1e-4):
    torch.testing.assert_close(a[0], b[0], rtol=tol, atol=tol)
    for ga, gb in zip(a[1], b[1]):
        torch.testing.assert_close(ga, gb, rtol=tol, atol=tol)


def _fresh():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    return torch._dynamo.utils.counters


def test_compile_fullgraph_no_break_no_recompile():
    counters = _fresh()
    torch.manual_seed(0)
    model = Block().to(DEV)
    compiled = torch.compile(model, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in range(3):
            x, r, t = _inputs(32, seed)
            _check_step(_step(compiled, x, r, t), _step(model, x, r, t))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compile_explain_sees_one_graph():
    _fresh()
    model = Block().to(DEV)
    ex = torch._dynamo.explain(model)(*_inputs(16, 0))
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex


@pytest.mark.parametrize("how", ["dynamic", "mark_dynamic"])
def test_compile_dynamic_batch(how):
    counters = _fresh()
    torch.manual_seed(0)
    model = Block().to(DEV)
    compiled = torch.compile(model, fullgraph=True, dynamic=True if how == "dynamic" else None)
    for i, batch in enumerate((8, 12, 20, 33)):
        x, r, t = _inputs(batch, i)
        if how == "mark_dynamic":
            for a in (x, r, t):
                torch._dynamo.mark_dynamic(a, 0)
        _check_step(_step(compiled, x, r, t), _step(model, x, r, t))
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compile_reduce_overhead_training_replays():
    counters = _fresh()
    torch.manual_seed(0)
    model = Block().to(DEV)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for seed in range(5):  # warm-up, recording, then replays with new data
        x, r, t = _inputs(24, seed)
        _check_step(_step(compiled, x, r, t), _step(model, x, r, t))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_compile_reduce_overhead_inference_replays():
    counters = _fresh()
    w = _r(128, dtype=torch.float32, seed=1)

    def f(x, r, t):
        res = r * 1.0  # an intermediate (a mutated graph input would disable cudagraphs)
        y = CF.add_rms_norm_(x, res, w)  # the mutating operator: h written into res
        p = CF.softmax(CF.layer_norm(y, 128, w, None), -1)
        return (CF.cross_entropy(y, t, reduction="none") + p.sum(-1), CF.rms_norm(res, 128, w),
                CF.fused_add_mul(x, res, 2.0))

    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for seed in range(5):
            x = _r(16, 128, seed=10 + seed)
            r = _r(16, 128, seed=20 + seed)
            t = torch.randint(0, 128, (16,), device=DEV)
            got = [o.clone() for o in compiled(x, r, t)]
            for a, b in zip(got, f(x, r, t)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


# -- torch.cuda.graph ----------------------------------------------------------------------------
def _warm(fn, n=3):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def test_cuda_graph_forward_capture_replay():
    d = 256
    x, r = _r(32, d), _r(32, d, seed=1)
    w = _r(d, seed=2)
    t = torch.randint(0, d, (32,), device=DEV)

    def fwd():
        with torch.no_grad():
            y, h = CF.add_rms_norm(x, r, w)
            return (CF.softmax(y, -1), CF.log_softmax(h, 0), CF.layer_norm(h, d, w, w),
                    CF.cross_entropy(y, t), CF.fused_add_mul(x, r, w), CF.divide(x, w))

    _warm(fwd)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = fwd()
    for seed in range(3):
        x.copy_(_r(32, d, seed=100 + seed))
        r.copy_(_r(32, d, seed=200 + seed))
        g.replay()
        want = fwd()
        for a, b in zip(outs, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_cuda_graph_forward_backward_capture_replay():
    torch.manual_seed(0)
    model = Block().to(DEV)
    x, r, t = _inputs(16, 0)
    x.requires_grad_()

    def step():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        loss = model(x, r, t)
        loss.backward()
        return loss

    _warm(step)
    g = torch.cuda.CUDAGraph()
    step_out = None
    for p in model.parameters():
        p.grad = None
    x.grad = None
    with torch.cuda.graph(g):
        step_out = model(x, r, t)
        step_out.backward()
    grads = [p.grad for p in model.parameters()] + [x.grad]
    eager = Block().to(DEV)
    eager.load_state_dict(model.state_dict())
    for seed in range(1, 4):
        xn, rn, tn = _inputs(16, seed)
        with torch.no_grad():
            x.copy_(xn)
            r.copy_(rn)
            t.copy_(tn)
        g.replay()
        xe = xn.clone().requires_grad_()
        loss = eager(xe, rn, tn)
        loss.backward()
        want = [p.grad for p in eager.parameters()] + [xe.grad]
        torch.testing.assert_close(step_out, loss, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for p in eager.parameters():
            p.grad = None
