"""The registered operators' direct path without a GPU (wherever torch is installed): a call
that records no graph, on plain tensors with nothing below autograd but the device kernel,
goes from the operator's autograd kernel straight to cupylab.torch._kernels; every other call
(a graph to record, fake or functional tensors, a dispatch mode, torch.compile's tracing)
takes torch's own autograd kernel and redispatch. The direct key is CUDA; here it is set to
CPU so that CPU tensors take it, with the kernels replaced by torch implementations
(torch_cpu_refs.py)."""
import pytest

torch = pytest.importorskip("torch")

from cupylab.torch import _kernels, _library  # noqa: E402
from cupylab.torch import functional as F  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch_cpu_refs import _g, cpu_kernels  # noqa: E402, F401 (cpu_kernels: a fixture)

OPS = torch.ops.cupylab
_BELOW = torch._C.DispatchKey.AutogradFunctionality


@pytest.fixture
def direct_cpu(cpu_kernels, monkeypatch):
    """The direct key set to CPU; each kernel call logged with whether it ran below autograd
    (torch's redispatch excludes the autograd keys; the direct path does not)."""
    below = []
    for name in ("rms_norm", "rms_norm_backward", "softmax", "layer_norm", "add",
                 "fused_add_mul_scalar", "cross_entropy"):
        fn = getattr(_kernels, name)

        def spy(*args, _fn=fn, _name=name):
            below.append((_name, torch._C._dispatch_tls_is_dispatch_key_excluded(_BELOW)))
            return _fn(*args)
        monkeypatch.setattr(_kernels, name, spy)
    _direct_key(monkeypatch, torch._C.DispatchKey.CPU)
    return below


def _direct_key(monkeypatch, key):
    monkeypatch.setattr(_library, "DIRECT_KEY", key)
    monkeypatch.setattr(_library, "_DIRECT_KEYSETS", {})  # the decisions made for another key


def _norm_args(grad=False):
    return _g(4, 6, grad=grad), _g(6, seed=1, grad=grad), 1e-6


def test_no_grad_call_goes_direct(direct_cpu):
    x, w, eps = _norm_args(grad=True)
    with torch.no_grad():
        y, rstd = OPS.rms_norm.default(x, w, eps)
    assert direct_cpu == [("rms_norm", False)]
    ref = x.detach() * torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + eps) * w.detach()
    torch.testing.assert_close(y, ref)
    assert y.grad_fn is None and not y.requires_grad


def test_grad_enabled_without_grad_inputs_goes_direct(direct_cpu):
    OPS.rms_norm.default(*_norm_args(grad=False))
    assert direct_cpu == [("rms_norm", False)]


def test_default_key_takes_torch_redispatch(direct_cpu, monkeypatch):
    _direct_key(monkeypatch, torch._C.DispatchKey.CUDA)
    with torch.no_grad():
        OPS.rms_norm.default(*_norm_args())
    assert direct_cpu == [("rms_norm", True)]


def test_a_graph_to_record_takes_torch_kernel(direct_cpu):
    x, w, eps = _norm_args(grad=True)
    y, _ = OPS.rms_norm.default(x, w, eps)
    assert direct_cpu == [("rms_norm", True)]
    assert type(y.grad_fn).__name__.startswith("GeneratedBackwardFor_cupylab_rms_norm")
    y.sum().backward()  # the registered backward operator, called with grad disabled: direct
    assert direct_cpu[1:] == [("rms_norm_backward", False)]
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize("call", [
    lambda x, w: OPS.rms_norm.default(x, w, 1e-6),
    lambda x, w: OPS.softmax.default(x, 0),
    lambda x, w: OPS.layer_norm.default(x, w, w, 1e-5),
    lambda x, w: OPS.add.default(x, w),
    lambda x, w: OPS.fused_add_mul_scalar.default(x, w, 0.25),
    lambda x, w: OPS.cross_entropy.default(x, torch.tensor([0, 5, 2, 1]), -100, "mean", 0.1,
                                           True),
    lambda x, w: OPS.rms_norm_backward.default(x, x, w, x[:, 0].float().abs() + 1),
])
def test_direct_and_redispatched_results_agree(direct_cpu, monkeypatch, call):
    x, w, _ = _norm_args()
    with torch.no_grad():
        got = call(x, w)
        _direct_key(monkeypatch, torch._C.DispatchKey.CUDA)
        want = call(x, w)
    assert [b for _, b in direct_cpu] == [False, True]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fake_tensors_never_reach_the_kernels(direct_cpu):
    with FakeTensorMode() as mode, torch.no_grad():
        x, w = mode.from_tensor(_g(4, 6)), mode.from_tensor(_g(6, seed=1))
        y, rstd = OPS.rms_norm.default(x, w, 1e-6)
    assert direct_cpu == []
    assert y.shape == (4, 6) and rstd.shape == (4,)


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_the_operator(direct_cpu):
    x, w, eps = _norm_args()
    with torch.no_grad():
        OPS.rms_norm.default(x, w, eps)  # the plain key set remembered as direct
        with _Seen() as seen:
            OPS.rms_norm.default(x, w, eps)
    assert "cupylab.rms_norm.default" in seen.ops
    assert direct_cpu == [("rms_norm", False), ("rms_norm", True)]


def _model(x, w, b):
    y, h = F.add_rms_norm(x, x * 0.5, w)
    z = F.layer_norm(y, y.shape[-1], w, b)
    return (F.softmax(z, -1) * F.rms_norm(h, h.shape[-1], w)).sum()


def test_compiled_graph_runs_the_operators_direct(direct_cpu):
    torch._dynamo.reset()
    x, w, _ = _norm_args(grad=True)
    b = _g(6, seed=2, grad=True)
    want = _model(x, w, b)
    want_grads = torch.autograd.grad(want, (x, w, b))
    compiled = torch.compile(_model, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        direct_cpu.clear()
        got = compiled(x, w, b)
        got_grads = torch.autograd.grad(got, (x, w, b))
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grads, want_grads)
    # the second call ran the compiled forward and backward only: every kernel call direct
    names = [n for n, _ in direct_cpu]
    assert {"rms_norm", "softmax", "layer_norm", "rms_norm_backward"} <= set(names)
    assert not any(b for _, b in direct_cpu), direct_cpu
