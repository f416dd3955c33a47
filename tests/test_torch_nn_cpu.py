"""cupylab.torch.nn without a GPU: the modules are torch.nn's (constructor arguments,
parameter names, state_dict keys, repr, checkpoints both ways), swap_modules swaps the right
modules and keeps their tensors, CPU inputs give torch's own result, and the forward hands the
right arguments to cupylab.torch.functional (checked with a recording functional, on tensors
the modules are told are on the GPU). Also the training example's model and loss check."""
import copy
import importlib
import inspect
import io
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent
TNN = ("RMSNorm", "LayerNorm", "Softmax", "LogSoftmax", "CrossEntropyLoss")


def _torch_impl():
    """torch implementations of cupylab.torch.functional's interface (test-only)."""
    tf = torch.nn.functional

    def add_rms_norm(x, residual, weight, eps=1e-6):
        h = x + residual
        return tf.rms_norm(h, (h.shape[-1],), weight, eps), h

    return dict(
        softmax=lambda x, dim=-1: tf.softmax(x, dim),
        log_softmax=lambda x, dim=-1: tf.log_softmax(x, dim),
        rms_norm=lambda x, ns, weight=None, eps=None: tf.rms_norm(x, ns, weight, eps),
        layer_norm=lambda x, ns, weight=None, bias=None, eps=1e-5: tf.layer_norm(
            x, ns, weight, bias, eps),
        add_rms_norm=add_rms_norm,
        cross_entropy=lambda input, target, ignore_index=-100, reduction="mean",
        label_smoothing=0.0: tf.cross_entropy(input, target, ignore_index=ignore_index,
                                              reduction=reduction,
                                              label_smoothing=label_smoothing))


@pytest.fixture(scope="module")
def cl():
    """cupylab.torch.nn, imported against the real cupylab.torch.functional when it exists,
    else (only inside this test module) against a torch-op stand-in of its interface."""
    added = False
    try:
        importlib.import_module("cupylab.torch.functional")
    except ModuleNotFoundError as e:
        if e.name != "cupylab.torch.functional":
            raise
        import cupylab.torch as pkg

        stub = types.ModuleType("cupylab.torch.functional")
        stub.__dict__.update(_torch_impl())
        sys.modules["cupylab.torch.functional"] = stub
        pkg.functional = stub
        sys.modules.pop("cupylab.torch.nn", None)
        added = True
    mod = importlib.import_module("cupylab.torch.nn")
    yield mod
    if added:
        import cupylab.torch as pkg

        for name in ("cupylab.torch.nn", "cupylab.torch.functional"):
            sys.modules.pop(name, None)
        for name in ("nn", "functional"):
            pkg.__dict__.pop(name, None)


class Recorder:
    """Stands in for cupylab.torch.functional: records each call, computes with torch ops."""

    def __init__(self):
        self.calls = []
        impl = _torch_impl()
        for name, fn in impl.items():
            setattr(self, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return fn(*args, **kwargs)
        return call


@pytest.fixture
def rec(cl, monkeypatch):
    """The modules' functional replaced by a Recorder, and every floating tensor treated as a
    GPU tensor, so the cupylab branch of each forward runs on the CPU."""
    r = Recorder()
    monkeypatch.setattr(cl, "_F", r)
    monkeypatch.setattr(cl, "_gpu_float", lambda x: x.dtype in cl._FLOATS)
    return r


@pytest.fixture
def no_functional(cl, monkeypatch):
    """The functional replaced by an object whose every use fails the test."""

    class Boom:
        def __getattr__(self, name):
            raise AssertionError(f"cupylab.torch.functional.{name} called on a CPU input")

    monkeypatch.setattr(cl, "_F", Boom())


# constructor arguments, reprs and state_dict keys ------------------------------------------
CONFIGS = [
    ("RMSNorm", (8,), {}),
    ("RMSNorm", ((4, 8),), dict(eps=1e-5, elementwise_affine=False)),
    ("RMSNorm", ([6],), dict(eps=1e-6, dtype=torch.float64)),
    ("LayerNorm", (8,), {}),
    ("LayerNorm", ((3, 8),), dict(eps=1e-6, bias=False)),
    ("LayerNorm", (8,), dict(elementwise_affine=False)),
    ("Softmax", (), dict(dim=1)),
    ("Softmax", (), {}),
    ("LogSoftmax", (-1,), {}),
    ("CrossEntropyLoss", (), {}),
    ("CrossEntropyLoss", (), dict(ignore_index=2, reduction="sum", label_smoothing=0.1)),
    ("CrossEntropyLoss", (), dict(weight=torch.linspace(0.5, 1.5, 5))),
    ("CrossEntropyLoss", (), dict(size_average=False)),
]


def _pair(cl, name, args, kw):
    torch.manual_seed(0)
    a = getattr(torch.nn, name)(*args, **kw)
    torch.manual_seed(0)
    b = getattr(cl, name)(*args, **kw)
    return a, b


def test_signatures_and_classes(cl):
    for name in TNN:
        ours, theirs = getattr(cl, name), getattr(torch.nn, name)
        assert issubclass(ours, theirs) and ours.__name__ == theirs.__name__
        assert inspect.signature(ours) == inspect.signature(theirs)
        assert ours.__doc__ and "Parameters" in ours.__doc__
    assert "Returns" in cl.swap_modules.__doc__


@pytest.mark.parametrize("name,args,kw", CONFIGS, ids=lambda v: str(v)[:30])
def test_same_module_as_torch(cl, name, args, kw):
    a, b = _pair(cl, name, args, kw)
    assert isinstance(b, getattr(torch.nn, name))
    assert repr(a) == repr(b)
    assert list(a.state_dict()) == list(b.state_dict())
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    assert [n for n, _ in a.named_buffers()] == [n for n, _ in b.named_buffers()]
    for k, v in a.__dict__.items():
        if not k.startswith("_"):
            assert b.__dict__[k] == v or (isinstance(v, torch.Tensor) and torch.equal(
                b.__dict__[k], v)), k
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q), n


@pytest.mark.parametrize("name,args,kw", [c for c in CONFIGS if c[0] in ("RMSNorm", "LayerNorm")
                                          or "weight" in c[2]], ids=lambda v: str(v)[:30])
def test_checkpoints_both_ways(cl, name, args, kw):
    a, b = _pair(cl, name, args, kw)
    with torch.no_grad():
        for t in (*a.parameters(), *a.buffers()):
            t.copy_(torch.randn_like(t))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf), strict=True)
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v), k
    with torch.no_grad():
        for t in (*b.parameters(), *b.buffers()):
            t.mul_(-2.0)
    fresh = getattr(torch.nn, name)(*args, **kw)
    fresh.load_state_dict(copy.deepcopy(b.state_dict()), strict=True)
    for k, v in b.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_whole_module_pickle_and_deepcopy(cl):
    m = torch.nn.Sequential(cl.LayerNorm(4), cl.Softmax(-1))
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    m2 = torch.load(buf, weights_only=False)
    assert type(m2[0]) is cl.LayerNorm and type(m2[1]) is cl.Softmax
    m3 = copy.deepcopy(m)
    assert type(m3[0]) is cl.LayerNorm and m3[0].weight is not m[0].weight


# CPU inputs: torch's own forward --------------------------------------------------------------
def _inputs(name, dtype=torch.float32, shape=(3, 5, 8)):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g, dtype=dtype)
    if name == "CrossEntropyLoss":
        x = torch.randn(7, 5, generator=g, dtype=dtype)
        t = torch.randint(0, 5, (7,), generator=g)
        t[1] = 2  # an ignored row where ignore_index=2
        return (x, t)
    return (x,)


@pytest.mark.parametrize("name,args,kw", CONFIGS, ids=lambda v: str(v)[:30])
def test_cpu_inputs_give_torchs_result(cl, no_functional, name, args, kw):
    a, b = _pair(cl, name, args, kw)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        if "dtype" in kw and dtype != kw["dtype"]:
            continue
        ns = tuple(getattr(a, "normalized_shape", (8,)))
        a.to(dtype), b.to(dtype)  # torch's CPU layer_norm wants one dtype
        ins = _inputs(name, dtype, (3, 5)[:3 - len(ns)] + ns)
        xa = ins[0].clone().requires_grad_()
        xb = ins[0].clone().requires_grad_()
        if name == "Softmax" and "dim" not in kw:
            with pytest.warns(UserWarning):
                ya = a(xa, *ins[1:])
            with pytest.warns(UserWarning):
                yb = b(xb, *ins[1:])
        else:
            ya, yb = a(xa, *ins[1:]), b(xb, *ins[1:])
        assert ya.dtype == yb.dtype and torch.equal(ya, yb)
        ya.sum().backward()
        yb.sum().backward()
        assert torch.equal(xa.grad, xb.grad)
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p.grad, q.grad)
            p.grad = q.grad = None


@pytest.mark.parametrize("bad", [None, [1.0, 2.0]], ids=["None", "list"])
@pytest.mark.parametrize("name,args,kw", CONFIGS, ids=lambda v: str(v)[:30])
def test_a_non_tensor_input_fails_as_torchs_module_does(cl, no_functional, name, args, kw, bad):
    """A drop-in raises what torch's module raises for an input that is not a tensor (it raised
    AttributeError from its own CUDA test instead), and for a target that is not one."""
    a, b = _pair(cl, name, args, kw)
    extra = (torch.zeros(3, dtype=torch.int64),) if name == "CrossEntropyLoss" else ()
    with pytest.raises(Exception) as ta:
        a(bad, *extra)
    with pytest.raises(Exception) as tb:
        b(bad, *extra)
    assert type(tb.value) is type(ta.value) and str(tb.value) == str(ta.value)
    if name == "CrossEntropyLoss":
        x = torch.randn(3, 5)
        with pytest.raises(Exception) as ta:
            a(x, bad)
        with pytest.raises(Exception) as tb:
            b(x, bad)
        assert type(tb.value) is type(ta.value) and str(tb.value) == str(ta.value)


# the cupylab branch: what the forward hands to cupylab.torch.functional ---------------------
def test_rms_norm_calls(cl, rec):
    m = cl.RMSNorm((5, 8), eps=1e-5)
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(m(x), torch.nn.functional.rms_norm(x, (5, 8), m.weight, 1e-5))
    (name, args, kw), = rec.calls
    assert name == "rms_norm" and args[0] is x and args[1] == (5, 8) and args[2] is m.weight
    assert args[3] == 1e-5 and not kw
    # eps=None is torch's: the float32 machine epsilon for 16-bit and float32 inputs
    for dtype, eps in ((torch.bfloat16, torch.finfo(torch.float32).eps),
                       (torch.float64, torch.finfo(torch.float64).eps)):
        m = cl.RMSNorm(8, elementwise_affine=False)
        x = torch.randn(2, 8, dtype=dtype) * 1e-3
        torch.testing.assert_close(m(x), torch.nn.RMSNorm(8, elementwise_affine=False)(x))
        assert rec.calls[-1][1][2] is None and rec.calls[-1][1][3] == eps
    rec.calls.clear()
    # a bfloat16 input with a float32 weight still goes to cupylab
    cl.RMSNorm(8)(torch.randn(2, 8, dtype=torch.bfloat16))
    assert len(rec.calls) == 1


def test_layer_norm_calls(cl, rec):
    x = torch.randn(4, 8)
    for kw in ({}, dict(bias=False), dict(elementwise_affine=False), dict(eps=1e-3)):
        m = cl.LayerNorm(8, **kw)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn_like(p))
        ref = torch.nn.LayerNorm(8, **kw)
        ref.load_state_dict(m.state_dict())
        torch.testing.assert_close(m(x), ref(x))
        name, args, _ = rec.calls[-1]
        assert name == "layer_norm" and args[1] == (8,) and args[2] is m.weight
        assert args[3] is m.bias and args[4] == m.eps
    assert len(rec.calls) == 4


def test_softmax_calls(cl, rec):
    x = torch.randn(3, 4, 5)
    for dim in (0, 1, -1):
        torch.testing.assert_close(cl.Softmax(dim)(x), torch.softmax(x, dim))
        torch.testing.assert_close(cl.LogSoftmax(dim)(x), torch.log_softmax(x, dim))
    assert [c[0] for c in rec.calls] == ["softmax", "log_softmax"] * 3
    assert [c[1][1] for c in rec.calls] == [0, 0, 1, 1, -1, -1]


def test_cross_entropy_calls(cl, rec):
    x, t = _inputs("CrossEntropyLoss")
    x3, t3 = torch.randn(2, 5, 4), torch.randint(0, 5, (2, 4))
    cases = [(x, t), (x3, t3), (x[0], t[0])]  # (N, C), (N, C, d), unbatched (C,)
    for kw in ({}, dict(ignore_index=2, reduction="sum", label_smoothing=0.1),
               dict(reduction="none"), dict(reduce=False)):
        m, ref = cl.CrossEntropyLoss(**kw), torch.nn.CrossEntropyLoss(**kw)
        for xx, tt in cases:
            torch.testing.assert_close(m(xx, tt), ref(xx, tt))
            name, args, ckw = rec.calls[-1]
            assert name == "cross_entropy" and args[0] is xx and args[1] is tt
            assert ckw == dict(ignore_index=m.ignore_index, reduction=m.reduction,
                               label_smoothing=m.label_smoothing)
    assert len(rec.calls) == 12


def test_what_stays_on_torch(cl, rec):
    """Cases the forward hands to torch even for (pretended) GPU tensors."""
    x = torch.randn(3, 5)
    t = torch.randint(0, 5, (3,))
    with pytest.warns(UserWarning):
        torch.testing.assert_close(cl.Softmax()(x), torch.nn.Softmax()(x))
    with pytest.warns(UserWarning):
        cl.LogSoftmax()(x)
    w = torch.rand(5)
    torch.testing.assert_close(cl.CrossEntropyLoss(weight=w)(x, t),
                               torch.nn.functional.cross_entropy(x, t, weight=w))
    probs = torch.softmax(torch.randn(3, 5), -1)
    cl.CrossEntropyLoss()(x, probs)  # class probabilities
    # weights of another dtype than the input's (but float32 weights with 16-bit inputs)
    cl.RMSNorm(5, dtype=torch.float64)(x.bfloat16())
    cl.RMSNorm(5, dtype=torch.bfloat16)(x)
    ln = cl.LayerNorm(5, dtype=torch.bfloat16)
    ln.bias.data = ln.bias.data.float()  # weight and bias of two dtypes
    with pytest.raises(RuntimeError):
        ln(x.bfloat16())  # torch's own CPU error
    with pytest.raises(RuntimeError, match="dtype"):
        cl.LayerNorm(5)(x.double())  # torch's own CPU error
    with pytest.raises(RuntimeError):
        cl.Softmax(-1)(torch.randint(0, 3, (2, 5)))  # torch's own error for integers
    with pytest.raises(RuntimeError):
        cl.CrossEntropyLoss()(x, t.int())  # torch's own error for int32 targets
    assert rec.calls == []
    cl.LayerNorm(5)(x.half())
    assert [c[0] for c in rec.calls] == ["layer_norm"]


# swap_modules ---------------------------------------------------------------------------------
class MyLN(torch.nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * 2


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = torch.nn.RMSNorm(8)
        self.lin = torch.nn.Linear(8, 8)
        self.seq = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Softmax(-1),
                                       torch.nn.LogSoftmax(1), MyLN(8))
        self.loss = torch.nn.CrossEntropyLoss(label_smoothing=0.05)

    def forward(self, x, t):
        return self.loss(self.seq(self.lin(self.n1(x))), t)


def test_swap_modules(cl, no_functional):
    torch.manual_seed(0)
    net = Net()
    x, t = torch.randn(6, 8), torch.randint(0, 8, (6,))
    ref = net(x, t)
    params = {n: (p, p.data_ptr()) for n, p in net.named_parameters()}
    mods = dict(net.named_modules())
    keys = list(net.state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert cl.swap_modules(net) == 5
    assert type(net.n1) is cl.RMSNorm and type(net.seq[0]) is cl.LayerNorm
    assert type(net.seq[1]) is cl.Softmax and type(net.seq[2]) is cl.LogSoftmax
    assert type(net.seq[3]) is MyLN and type(net.loss) is cl.CrossEntropyLoss
    assert type(net.lin) is torch.nn.Linear
    assert all(m is mods[n] for n, m in net.named_modules())  # the same module objects
    for n, p in net.named_parameters():
        assert p is params[n][0] and p.data_ptr() == params[n][1]
    assert list(net.state_dict()) == keys
    assert net.loss.label_smoothing == 0.05 and net.seq[1].dim == -1
    out = net(x, t)  # CPU: torch's forward
    assert torch.equal(out, ref)
    out.backward()
    opt.step()  # the optimizer built before the swap still steps the same tensors
    assert not torch.equal(net.n1.weight, torch.ones(8))
    assert cl.swap_modules(net) == 0


def test_swap_modules_types_and_root(cl):
    net = Net()
    assert cl.swap_modules(net, types=[torch.nn.LayerNorm, cl.Softmax]) == 2
    assert type(net.seq[0]) is cl.LayerNorm and type(net.seq[1]) is cl.Softmax
    assert type(net.n1) is torch.nn.RMSNorm and type(net.loss) is torch.nn.CrossEntropyLoss
    assert cl.swap_modules(net, types=torch.nn.RMSNorm) == 1 and type(net.n1) is cl.RMSNorm
    root = torch.nn.LayerNorm(4)
    assert cl.swap_modules(root) == 1 and type(root) is cl.LayerNorm
    with pytest.raises(TypeError, match="swap_modules: types must be among"):
        cl.swap_modules(Net(), types=[torch.nn.Linear])
    with pytest.raises(TypeError, match="swap_modules: model must be a torch.nn.Module"):
        cl.swap_modules([torch.nn.LayerNorm(3)])


def test_hooks_survive_swap(cl, no_functional):
    m = torch.nn.LayerNorm(4)
    seen = []
    h = m.register_forward_hook(lambda mod, i, o: seen.append(type(mod).__name__))
    cl.swap_modules(m)
    m(torch.randn(2, 4))
    assert seen == ["LayerNorm"] and type(m) is cl.LayerNorm
    h.remove()
    m(torch.randn(2, 4))
    assert len(seen) == 1


# the training example -------------------------------------------------------------------------
@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "examples"))
    sys.modules.pop("train_tiny_llm", None)
    mod = importlib.import_module("train_tiny_llm")
    yield mod
    sys.modules.pop("train_tiny_llm", None)


def test_example_model_swaps_and_runs_on_cpu(cl, example, no_functional):
    args = example.parse(["--d-model", "64", "--layers", "2", "--seq", "16", "--batch", "2",
                          "--vocab", "100", "--steps", "3", "--warmup", "1"])
    assert args.heads == 1 and args.modes == list(example.MODES)
    torch.manual_seed(0)
    model = example.build_model(args, "cpu")
    xs, ys = example.make_data(args.vocab, args.steps, args.batch, args.seq, 1, "cpu")
    assert xs.shape == ys.shape == (3, 2, 16) and xs.dtype == torch.int64
    assert torch.equal(xs[:, :, 1:], ys[:, :, :-1]) and int(xs.max()) < 100
    xs2, _ = example.make_data(args.vocab, args.steps, args.batch, args.seq, 1, "cpu")
    assert torch.equal(xs, xs2)  # seeded
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(xs[0], ys[0])
    assert cl.swap_modules(model) == 2 * args.layers + 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(xs[0], ys[0])
    assert torch.equal(out, ref) and abs(float(out.detach()) - 4.6) < 0.5  # about ln(100) at init
    out.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_example_check_logic(example):
    base = [10.0, 8.0, 6.0, 5.0]

    def recs(**curves):
        return {m: dict(mode=m, losses=v, swapped=0, loss_dtype="float32")
                for m, v in curves.items()}

    ok, lines, s = example.check(recs(torch=base, cupylab=[10.0, 8.01, 6.0, 5.05]), 0.02)
    assert ok and s["bound"] == 0.02 and s["pairs"][0]["rel"] == pytest.approx(0.01)
    assert s["pairs"][0]["abs"] == pytest.approx(0.05)
    ok, _, s = example.check(recs(torch=base, cupylab=[10.0, 8.0, 6.3, 5.0]), 0.02)
    assert not ok and s["pairs"][0]["rel"] == pytest.approx(0.05)
    # a larger measured floor widens the bound to twice the floor
    ok, _, s = example.check(recs(**{"torch": base, "torch-alt": [10.0, 8.0, 6.18, 5.0],
                                     "cupylab": [10.0, 8.0, 6.3, 5.0]}), 0.02)
    assert ok and s["floor"] == pytest.approx(0.03) and s["bound"] == pytest.approx(0.06)
    ok, lines, _ = example.check(recs(torch=base, cupylab=[10.0, float("nan"), 6.0, 5.0]), 0.02)
    assert not ok and any("non-finite" in ln for ln in lines)
    # compiled cupylab is compared with compiled torch
    ok, _, s = example.check(recs(**{"torch": base, "torch-compile": [10.0, 8.0, 6.6, 5.0],
                                     "cupylab-compile": [10.0, 8.0, 6.6, 5.0]}), 0.02)
    assert ok and s["pairs"][0]["peer"] == "torch-compile" and s["pairs"][0]["rel"] == 0


def test_example_arguments(example):
    with pytest.raises(SystemExit) as e:
        example.parse(["--modes", "torch,jax"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        example.parse(["--d-model", "100", "--heads", "3"])
    with pytest.raises(SystemExit):
        example.parse(["--steps", "5", "--warmup", "5"])
    a = example.parse(["--modes", "cupylab, torch", "--json", "x.json"])
    assert a.modes == ["cupylab", "torch"] and a.json == "x.json" and a.heads == 8
    assert a.compile_mode == "default"
    assert example.parse(["--compile-mode", "reduce-overhead"]).compile_mode == "reduce-overhead"
    with pytest.raises(SystemExit) as e:
        example.parse(["--compile-mode", "fast"])
    assert e.value.code == 2


def test_example_main_on_cpu(cl, example, no_functional, monkeypatch, tmp_path):
    """The whole script on the host (--device cpu): every mode but the compiled ones, with
    torch's AdamW standing in for cupylab's (which refuses host tensors)."""
    import cupylab.torch.optim as clo

    monkeypatch.setattr(clo, "AdamW", torch.optim.AdamW)
    out = tmp_path / "r.json"
    rc = example.main(["--device", "cpu", "--steps", "4", "--warmup", "1", "--d-model", "32",
                       "--layers", "1", "--seq", "16", "--batch", "2", "--vocab", "300",
                       "--modes", "torch,torch-alt,cupylab", "--json", str(out),
                       "--profile", str(tmp_path / "prof")])
    res = __import__("json").loads(out.read_text())
    for mode in ("torch", "cupylab"):  # --profile: a table per mode, and its totals
        text = (tmp_path / "prof" / f"{mode}.txt").read_text()
        assert text.startswith(f"{mode}: 3 steps, wall ") and "Self CPU" in text
        assert res["records"][mode]["profile"]["wall_ms"] > 0
    assert rc == 0 and res["ok"] and list(res["records"]) == ["torch", "torch-alt", "cupylab"]
    recs = res["records"]
    assert recs["cupylab"]["swapped"] == 4 and recs["torch"]["swapped"] == 0
    assert recs["torch"]["loss_dtype"] == "float32"  # autocast runs cross_entropy in float32
    assert all(len(r["losses"]) == 4 for r in recs.values())
    assert recs["cupylab"]["losses"][0] == recs["torch"]["losses"][0]  # same init, same data
    assert res["check"]["floor"] == recs["torch-alt"]["rel_dist"]
    assert [p["mode"] for p in res["check"]["pairs"]] == ["cupylab"]


def test_swapped_model_traces_in_one_graph(cl, monkeypatch):
    """torch.compile(fullgraph=True) traces a swapped model through cupylab.torch.functional
    into one graph of torch.ops.cupylab operators (traced on the CPU by a backend that records
    the graph and runs nothing; the modules are told the tensors are on the GPU)."""
    if getattr(cl._F, "__file__", None) is None:
        pytest.skip("cupylab.torch.functional is not in this tree (a test stand-in is used)")
    monkeypatch.setattr(cl, "_gpu_float", lambda x: x.dtype in cl._FLOATS)
    torch.manual_seed(0)
    net = Net()
    del net.seq[3]  # MyLN is not swapped: keep torch's ops out of the graph
    assert cl.swap_modules(net) == 5
    x, t = torch.randn(6, 8), torch.randint(0, 8, (6,))
    seen = []

    class Ran(Exception):
        pass

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")

        def run(*args):
            raise Ran
        return run

    torch._dynamo.reset()
    try:
        with pytest.raises(Ran):
            torch.compile(net, fullgraph=True, backend=backend)(x, t)
    finally:
        torch._dynamo.reset()
    ops = {s for s in seen if "cupylab" in s}
    assert {"cupylab.rms_norm", "cupylab.layer_norm", "cupylab.softmax", "cupylab.log_softmax",
            "cupylab.cross_entropy"} <= {s.rsplit(".default", 1)[0] for s in ops}, seen
    # nothing of torch's own norms, softmax or loss: only the Linear and tuple indexing
    assert {s for s in seen if "cupylab" not in s} <= {"<built-in function linear>",
                                                       "<built-in function getitem>"}, seen
