"""torch.compile over cupylab's registered operators without a GPU (wherever torch is
installed): a small model traced with ``fullgraph=True`` (aot_eager: the fake implementations
and the registered autograd; no graph break, no recompilation, one graph for a dynamic batch),
Inductor lowering the operators where a C++ compiler and Python's headers exist, the mutating
operator under inference, and ``torch.library.opcheck`` of the schemas and autograd
registration. The kernels are replaced by torch implementations (torch_cpu_refs.py)."""
import os
import shutil
import sysconfig

import pytest

torch = pytest.importorskip("torch")

from cupylab.torch import functional as F  # noqa: E402
from torch_cpu_refs import TF, _g, cpu_kernels  # noqa: E402, F401 (cpu_kernels: a fixture)


class _Block(torch.nn.Module):
    def __init__(self, d=16, v=11):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d))
        self.b = torch.nn.Parameter(torch.randn(d))
        self.proj = torch.nn.Linear(d, v)

    def forward(self, x, r, t):
        y, h = F.add_rms_norm(x, r, self.w)
        y = F.layer_norm(y, y.shape[-1], self.w, self.b)
        z = F.fused_add_mul(y, h, 0.5)
        z = F.add(F.multiply(z, self.w), F.divide(z, self.b.abs() + 1))
        logits = self.proj(F.subtract(z, h))
        p = F.softmax(logits, -1) + F.log_softmax(logits, -1)
        return F.cross_entropy(logits, t) + p.mean() + F.rms_norm(z, z.shape[-1]).mean()


def _run_block(model, x, r, t):
    for p in model.parameters():
        p.grad = None
    loss = model(x, r, t)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _aot_block(dynamic):
    """A fresh :class:`_Block`, its ``fullgraph`` aot_eager compilation, and dynamo's counters
    (cleared)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Block()
    counters = torch._dynamo.utils.counters
    counters.clear()
    return model, torch.compile(model, backend="aot_eager", fullgraph=True,
                                dynamic=dynamic), counters


def test_compile_fullgraph_no_graph_break_no_recompile(cpu_kernels):
    model, compiled, counters = _aot_block(dynamic=False)
    for batch in (8, 8, 8):
        x, r = torch.randn(batch, 16), torch.randn(batch, 16)
        t = torch.randint(0, 11, (batch,))
        got = _run_block(compiled, x, r, t)
        want = _run_block(model, x, r, t)
        torch.testing.assert_close(got[0], want[0])
        for a, b in zip(got[1], want[1]):
            torch.testing.assert_close(a, b)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    names = {c[0] for c in cpu_kernels}
    assert {"softmax_backward", "rms_norm_backward", "layer_norm_backward"} <= names


def _can_build_cpp():
    """Inductor on the CPU compiles C++ against Python's headers."""
    have_cxx = shutil.which("c++") is not None or shutil.which("g++") is not None
    return have_cxx and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


@pytest.mark.skipif(not _can_build_cpp(), reason="Inductor on the CPU needs a C++ compiler and "
                    "Python's headers")
def test_compile_inductor_lowers_the_registered_operators(cpu_kernels):
    """Inductor, not only AOT autograd, takes a block of every registered row-wise and
    elementwise operator (each a fallback kernel around torch's own generated code), forward
    and backward, with the results and gradients of eager mode."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Block()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    x, r = torch.randn(8, 16), torch.randn(8, 16)
    t = torch.randint(0, 11, (8,))
    got = _run_block(compiled, x, r, t)
    want = _run_block(model, x, r, t)
    torch.testing.assert_close(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)
    names = {c[0] for c in cpu_kernels}
    assert {"cross_entropy", "softmax_backward", "rms_norm_backward",
            "layer_norm_backward"} <= names


def test_inductor_fallbacks_made_before_lowering(cpu_kernels, monkeypatch):
    """Once a fake implementation has run (torch.compile's tracing), every cupylab operator
    is an Inductor fallback, so Inductor never takes its implicit-fallback path for one: on
    torch 2.11 that path formats the operator's arguments for a log message first, text that
    grows exponentially along a chain of cupylab operators (the training example)."""
    from torch._inductor import exc, lowering
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cupylab.torch import _library

    with FakeTensorMode():
        torch.ops.cupylab.softmax(torch.empty(2, 3), -1)
    assert all(op in lowering.lowerings for op in _library.OPS.values())
    if not _can_build_cpp():
        return
    seen = []
    real = exc.OperatorIssue.operator_str
    monkeypatch.setattr(exc.OperatorIssue, "operator_str", staticmethod(
        lambda t, a, k: seen.append(str(t)) or real(t, a, k)))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Block()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    x, r = torch.randn(8, 16), torch.randn(8, 16)
    _run_block(compiled, x, r, torch.randint(0, 11, (8,)))
    assert not [t for t in seen if "cupylab" in t]


def test_compile_dynamic_batch_one_graph(cpu_kernels):
    model, compiled, counters = _aot_block(dynamic=True)
    for batch in (5, 9, 17):
        x, r = torch.randn(batch, 16), torch.randn(batch, 16)
        t = torch.randint(0, 11, (batch,))
        torch.testing.assert_close(_run_block(compiled, x, r, t)[0],
                                   _run_block(model, x, r, t)[0])
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compile_inference_uses_mutating_op(cpu_kernels):
    torch._dynamo.reset()

    def f(x, r, w):
        return F.add_rms_norm_(x, r, w) * 2

    x, r0, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    r = r0.clone()
    with torch.no_grad():
        y = torch.compile(f, backend="aot_eager", fullgraph=True)(x, r, w)
    torch.testing.assert_close(r, x + r0)
    torch.testing.assert_close(y, 2 * TF.rms_norm(x + r0, (8,), w, 1e-6))


def test_opcheck_schema_and_autograd_registration(cpu_kernels):
    """torch.library.opcheck's schema, autograd-registration and fake-vs-real checks (the
    real kernels here are the CPU references, which share the cupylab kernels' metadata)."""
    x, w = _g(3, 5, dtype=torch.float32), _g(5, dtype=torch.float32, seed=1)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    for op, args in [
        (torch.ops.cupylab.rms_norm.default, (x, w, 1e-6)),
        (torch.ops.cupylab.layer_norm.default, (x, w, None, 1e-5)),
        (torch.ops.cupylab.softmax.default, (x, 0)),
        (torch.ops.cupylab.add.default, (x, w)),
        (torch.ops.cupylab.fused_add_mul_scalar.default, (x, w, 3)),
        (torch.ops.cupylab.cross_entropy.default, (x, torch.tensor([0, 1, 4]), -100, "mean",
                                                   0.0, True)),
        (torch.ops.cupylab.add_rms_norm_.default, (x.detach(), x.detach().clone(), w.detach(),
                                                   1e-6)),
    ]:
        torch.library.opcheck(op, args, test_utils=tests)
