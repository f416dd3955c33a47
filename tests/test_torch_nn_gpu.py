"""cupylab.torch.nn on the GPU: forward and backward of each module against torch's module run
in float64 on the same values (float32 and bfloat16, float32 weights with bfloat16 inputs),
output dtypes as torch's, the no-grad path, a model with swap_modules under bf16 autocast and
under torch.compile(fullgraph=True) (cupylab's ops in the traced graph), and a short run of
scripts/examples/train_tiny_llm.py (finite losses that agree with torch's)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="GPU test: torch has no CUDA device")]
REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "scripts" / "examples" / "train_tiny_llm.py"
DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (output rtol, atol; normwise relative bound for gradients) per input dtype
TOL = {torch.float32: (2e-5, 2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1.6e-2, 1e-2)}


@pytest.fixture(scope="module")
def cl():
    from cupylab.torch import nn

    return nn


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _normwise(a, ref):
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def _randomise(m, seed):
    g = _gen(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.5 + 1.0)


def _compare(mine, ref64, xdt, args, grad_seed=3):
    """Run ``mine`` (a cupylab module) and ``ref64`` (torch's, float64) on the same input
    values; compare outputs and the gradients of input and parameters."""
    rt, at, nb = TOL[xdt]
    x = args[0]
    xm = x.detach().clone().requires_grad_()
    xr = x.detach().double().requires_grad_()
    ym = mine(xm, *args[1:])
    yr = ref64(xr, *args[1:])
    assert ym.shape == yr.shape
    torch.testing.assert_close(ym.double(), yr, rtol=rt, atol=at)
    dy = torch.randn(yr.shape, generator=_gen(grad_seed), device="cuda", dtype=torch.float64)
    (ym.double() * dy).sum().backward()
    (yr * dy).sum().backward()
    assert xm.grad.dtype == x.dtype
    assert _normwise(xm.grad, xr.grad) <= nb
    for (n, p), (_, q) in zip(mine.named_parameters(), ref64.named_parameters()):
        assert p.grad is not None and p.grad.dtype == p.dtype, n
        assert _normwise(p.grad, q.grad) <= nb, n


NORMS = [("RMSNorm", (768,), {}), ("RMSNorm", (1000,), dict(elementwise_affine=False)),
         ("RMSNorm", ((4, 96),), dict(eps=1e-5)), ("LayerNorm", (768,), {}),
         ("LayerNorm", (1000,), dict(bias=False)),
         ("LayerNorm", (4099,), dict(elementwise_affine=False, eps=1e-6))]


@pytest.mark.parametrize("wdt", ["same", "float32"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,args,kw", NORMS, ids=lambda v: str(v)[:24])
def test_norms(cl, name, args, kw, dtype, wdt):
    xdt = DT[dtype]
    if wdt == "float32" and xdt == torch.float32:
        pytest.skip("same as wdt=same")
    mine = getattr(cl, name)(*args, **kw, device="cuda",
                             dtype=xdt if wdt == "same" else torch.float32)
    _randomise(mine, 1)
    ref = getattr(torch.nn, name)(*args, **kw, device="cuda", dtype=torch.float64)
    ref.load_state_dict(mine.state_dict())
    ns = tuple(mine.normalized_shape)
    for lead in ((2, 37), (1,), (259,)):
        x = torch.randn(lead + ns, generator=_gen(2), device="cuda").to(xdt) * 2 + 0.5
        for p in mine.parameters():
            p.grad = None
        for p in ref.parameters():
            p.grad = None
        _compare(mine, ref, xdt, (x,))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("name", ["Softmax", "LogSoftmax"])
def test_softmax(cl, name, dim, dtype):
    xdt = DT[dtype]
    x = (torch.randn(3, 37, 1000, generator=_gen(4), device="cuda") * 3).to(xdt)
    _compare(getattr(cl, name)(dim), getattr(torch.nn, name)(dim), xdt, (x,))


CE = [{}, dict(ignore_index=3, label_smoothing=0.1), dict(reduction="sum"),
      dict(reduction="none", ignore_index=3), dict(label_smoothing=0.2, reduction="sum")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kw", CE, ids=str)
@pytest.mark.parametrize("n,c", [(257, 1000), (64, 32000), (1, 7)])
def test_cross_entropy(cl, kw, dtype, n, c):
    xdt = DT[dtype]
    x = (torch.randn(n, c, generator=_gen(5), device="cuda") * 2).to(xdt)
    t = torch.randint(0, c, (n,), generator=_gen(6), device="cuda")
    if n > 1:
        t[::5] = 3  # ignored rows where ignore_index=3 (not every row: a mean over none is NaN)
    mine, ref = cl.CrossEntropyLoss(**kw), torch.nn.CrossEntropyLoss(**kw)
    xm = x.detach().clone().requires_grad_()
    xr = x.detach().double().requires_grad_()
    lm, lr = mine(xm, t), ref(xr, t)
    assert lm.shape == lr.shape and lm.dtype == ref(x, t).dtype
    # the logits are the same values in both: the float32 accumulation sets the tolerance
    torch.testing.assert_close(lm.double(), lr, rtol=2e-5 if lm.dtype == torch.float32
                               else 1e-2, atol=1e-5)
    dy = torch.rand(lr.shape, generator=_gen(7), device="cuda", dtype=torch.float64) + 0.5
    (lm.double() * dy).sum().backward()
    (lr * dy).sum().backward()
    assert xm.grad.dtype == x.dtype
    assert _normwise(xm.grad, xr.grad) <= TOL[xdt][2]
    if kw.get("ignore_index") == 3 and n > 1:
        assert float(xm.grad[::5].abs().max()) == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(9, 50, 3, 4), (50,)])
def test_cross_entropy_other_layouts(cl, shape, dtype):
    """(N, C, d1, d2) logits (classes strided) and unbatched (C,) logits."""
    xdt = DT[dtype]
    x = (torch.randn(shape, generator=_gen(12), device="cuda") * 2).to(xdt)
    tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    t = torch.randint(0, shape[0 if len(shape) == 1 else 1], tshape, generator=_gen(13),
                      device="cuda")
    for kw in ({}, dict(reduction="none", label_smoothing=0.1)):
        mine, ref = cl.CrossEntropyLoss(**kw), torch.nn.CrossEntropyLoss(**kw)
        xm = x.detach().clone().requires_grad_()
        xr = x.detach().double().requires_grad_()
        lm, lr = mine(xm, t), ref(xr, t)
        assert lm.shape == lr.shape and lm.dtype == ref(x, t).dtype
        torch.testing.assert_close(lm.double(), lr, rtol=2e-5 if xdt == torch.float32
                                   else 1e-2, atol=1e-5)
        lm.double().sum().backward()
        lr.sum().backward()
        assert xm.grad.shape == x.shape
        assert _normwise(xm.grad, xr.grad) <= TOL[xdt][2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_rms_norm_default_eps_as_torch(cl, dtype):
    """RMSNorm(eps=None) on rows whose mean square (1e-6) is near the default eps: the
    output shows which eps was used (torch: float32's for 16-bit and float32 inputs)."""
    xdt = getattr(torch, dtype)
    x = (torch.randn(16, 256, generator=_gen(11), device="cuda") * 1e-3).to(xdt)
    wdts = {xdt, torch.float32} if xdt in (torch.bfloat16, torch.float16) else {xdt}
    for wdt in wdts:
        a = torch.nn.RMSNorm(256, device="cuda", dtype=wdt)
        b = cl.RMSNorm(256, device="cuda", dtype=wdt)
        ya, yb = a(x), b(x)
        assert ya.dtype == yb.dtype
        torch.testing.assert_close(yb.float(), ya.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_output_dtypes_match_torch(cl, dtype):
    """What a drop-in returns, in the dtypes torch returns (no autocast)."""
    xdt = getattr(torch, dtype)
    x = torch.randn(4, 64, device="cuda").to(xdt)
    for name, args in (("RMSNorm", (64,)), ("LayerNorm", (64,)), ("Softmax", (-1,)),
                       ("LogSoftmax", (-1,))):
        for pdt in ({xdt, torch.float32} if args[0] == 64 else {None}):
            kw = {} if pdt is None else dict(device="cuda", dtype=pdt)
            a, b = getattr(torch.nn, name)(*args, **kw), getattr(cl, name)(*args, **kw)
            try:
                want = a(x).dtype
            except RuntimeError:  # torch's LayerNorm refuses float32 params with 16-bit x
                want = xdt        # cupylab computes that mixed-precision form
            assert b(x).dtype == want, (name, pdt)


def test_autocast_output_dtypes(cl):
    """Under bf16 autocast: the norms and softmaxes keep a 16-bit input's dtype (torch's
    modules return float32 there; see cupylab.torch.nn's docstring), and the loss is float32
    as torch's, not rounded to bfloat16."""
    x = torch.randn(4, 64, device="cuda").bfloat16()
    t = torch.randint(0, 64, (4,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for m in (cl.RMSNorm(64, device="cuda"), cl.LayerNorm(64, device="cuda"),
                  cl.Softmax(-1), cl.LogSoftmax(-1)):
            assert m(x).dtype == torch.bfloat16, type(m).__name__
        loss, ref = cl.CrossEntropyLoss()(x, t), torch.nn.CrossEntropyLoss()(x, t)
    assert ref.dtype == torch.float32
    assert loss.dtype == torch.float32
    # torch's autocast loss carries bfloat16 roundings (on the H200: 3.83203 where the float64
    # loss of the same logits is 3.82858); cupylab's is that loss to float32 precision
    exact = torch.nn.functional.cross_entropy(x.double(), t).float()
    torch.testing.assert_close(loss, exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=1e-2)


def test_tensor_subclasses_run_torchs_forward(cl, monkeypatch):
    """A tensor subclass (DTensor, a user's) is not a plain CUDA tensor: the module runs
    torch's forward, which the subclass's own dispatch understands."""
    from cupylab.torch import functional

    class Sub(torch.Tensor):
        pass

    def refuse(*a, **k):
        raise AssertionError("cupylab's kernel was called for a tensor subclass")

    monkeypatch.setattr(functional, "rms_norm", refuse)
    monkeypatch.setattr(functional, "softmax", refuse)
    x = torch.randn(4, 64, device="cuda").as_subclass(Sub)
    m = cl.RMSNorm(64, device="cuda")
    torch.testing.assert_close(m(x), torch.nn.functional.rms_norm(x, (64,), m.weight))
    torch.testing.assert_close(cl.Softmax(-1)(x), torch.softmax(x, -1))


def test_no_grad_path_matches(cl):
    g = _gen(8)
    x = torch.randn(33, 512, generator=g, device="cuda").bfloat16()
    t = torch.randint(0, 512, (33,), generator=g, device="cuda")
    for m, args in ((cl.RMSNorm(512, device="cuda"), (x,)),
                    (cl.LayerNorm(512, device="cuda"), (x,)), (cl.Softmax(-1), (x,)),
                    (cl.LogSoftmax(-1), (x,)), (cl.CrossEntropyLoss(), (x, t))):
        xg = x.clone().requires_grad_()
        with_grad = m(xg, *args[1:])
        with torch.no_grad():
            without = m(x, *args[1:])
        assert not without.requires_grad and with_grad.requires_grad
        torch.testing.assert_close(without, with_grad.detach())


class Net(torch.nn.Module):
    def __init__(self, d=256, v=1000):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.n1 = torch.nn.RMSNorm(d, eps=1e-6)
        self.mid = torch.nn.Linear(d, d)
        self.n2 = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, v)
        self.loss = torch.nn.CrossEntropyLoss(label_smoothing=0.1)

    def forward(self, x, t):
        h = self.n1(x + self.inp(x))
        h = self.n2(h + torch.nn.functional.gelu(self.mid(h)))
        return self.loss(self.head(h).view(-1, self.head.out_features), t.view(-1))


def _net_grads(net, x, t, fwd=None):
    net.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = (net if fwd is None else fwd)(x, t)  # a compiled module has no truth value
    loss.backward()
    return loss.detach().float(), {n: p.grad.clone() for n, p in net.named_parameters()}


def test_swapped_model_under_autocast_and_compile(cl):
    torch.manual_seed(0)
    net = Net().cuda()
    x = torch.randn(8, 64, 256, generator=_gen(9), device="cuda")
    t = torch.randint(0, 1000, (8, 64), generator=_gen(10), device="cuda")
    l_ref, g_ref = _net_grads(net, x, t)
    assert cl.swap_modules(net) == 3
    l_cl, g_cl = _net_grads(net, x, t)
    torch.testing.assert_close(l_cl, l_ref, rtol=1e-3, atol=1e-3)
    for n in g_ref:
        assert _normwise(g_cl[n], g_ref[n]) <= 2e-2, n

    seen = []

    def record(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    _net_grads(net, x, t, torch.compile(net, fullgraph=True, backend=record))
    assert any("cupylab" in s for s in seen), seen  # cupylab's ops, not torch's, were traced
    torch._dynamo.reset()
    l_c, g_c = _net_grads(net, x, t, torch.compile(net, fullgraph=True))
    torch._dynamo.reset()
    torch.testing.assert_close(l_c, l_ref, rtol=1e-3, atol=1e-3)
    for n in g_ref:
        assert _normwise(g_c[n], g_ref[n]) <= 2e-2, n


def _example(tmp_path, *extra):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "8", "--warmup", "2",
                        "--d-model", "128", "--layers", "2", "--seq", "128", "--batch", "4",
                        "--vocab", "32000", "--json", str(out), *extra],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "check: PASS" in r.stdout
    return json.loads(out.read_text())


def _check_records(res, modes):
    recs = res["records"]
    assert list(recs) == modes and res["ok"]
    for m in modes:
        ls = recs[m]["losses"]
        assert len(ls) == 8 and all(math.isfinite(v) for v in ls), m
        assert abs(ls[0] - math.log(32000)) < 0.5, m  # a fresh model predicts ~uniformly
        assert recs[m]["median_ms"] > 0
        assert recs[m]["swapped"] == (6 if m.startswith("cupylab") else 0)
    for p in res["check"]["pairs"]:
        assert p["ok"] and p["rel"] <= res["check"]["bound"]


def test_example_eager(tmp_path):
    res = _example(tmp_path, "--modes", "torch,torch-alt,cupylab")
    _check_records(res, ["torch", "torch-alt", "cupylab"])
    assert [p["mode"] for p in res["check"]["pairs"]] == ["cupylab"]
    assert res["records"]["torch"]["losses"] != res["records"]["torch-alt"]["losses"]


def test_example_compiled(tmp_path):
    res = _example(tmp_path, "--modes", "torch-compile,cupylab-compile")
    _check_records(res, ["torch-compile", "cupylab-compile"])
    assert [(p["mode"], p["peer"]) for p in res["check"]["pairs"]] == [
        ("cupylab-compile", "torch-compile")]


def test_example_compiled_cuda_graphs(tmp_path):
    """--compile-mode reduce-overhead: both compiled modes replay CUDA graphs (cupylab's
    operators launching on the capturing stream); every step's loss is its own value, copied
    before the next replay overwrites the graph's output."""
    res = _example(tmp_path, "--modes", "torch-compile,cupylab-compile", "--compile-mode",
                   "reduce-overhead")
    assert res["args"]["compile_mode"] == "reduce-overhead"
    _check_records(res, ["torch-compile", "cupylab-compile"])
    for m in ("torch-compile", "cupylab-compile"):
        assert len(set(res["records"][m]["losses"])) > 4, m
