"""torch implementations of cupylab.torch._kernels for CPU tensors, and the ``cpu_kernels``
fixture that puts them in place (every call logged in ``CALLS``): what the torch CPU tests
(test_torch_cpu.py, test_torch_compile_cpu.py) run instead of the GPU kernels. Import it only
after ``pytest.importorskip("torch")``."""
import pytest
import torch

from cupylab.torch import _kernels

TF = torch.nn.functional


# Same signatures and the same output metadata as the cupylab kernels (C-contiguous outputs;
# the softmax gradient along another dim is a moved view), computed with torch.
def _acc(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _dd(t):
    return None if t is None else t.detach()


def _softmax_bwd(y, dy, dim, log):
    y, dy = y.detach(), dy.detach()
    dx = (dy - y.exp() * dy.sum(dim, keepdim=True)) if log else \
        y * (dy - (y * dy).sum(dim, keepdim=True))
    d = dim % y.dim()
    if d == y.dim() - 1:
        return dx.contiguous()
    return dx.movedim(d, -1).contiguous().movedim(-1, d)


def _norm_fwd(x, w, b, eps, ln):
    xf = x.detach().to(_acc(x))
    mean = xf.mean(-1) if ln else torch.zeros(x.shape[:-1], dtype=xf.dtype)
    xc = xf - mean[..., None]
    rstd = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    y = xc * rstd[..., None]
    if w is not None:
        y = y * w.detach().to(y.dtype)
    if b is not None:
        y = y + b.detach().to(y.dtype)
    return y.to(x.dtype).contiguous(), mean, rstd


def _norm_bwd(dy, x, w, mean, rstd, weight_grad=True):
    dy, x = dy.detach().to(_acc(x)), x.detach().to(_acc(x))
    xh = (x - (0 if mean is None else mean[..., None])) * rstd[..., None]
    g = dy * (1 if w is None else w.detach().to(dy.dtype))
    c = (g * xh).mean(-1, keepdim=True)
    dx = rstd[..., None] * (g - (0 if mean is None else g.mean(-1, keepdim=True)) - xh * c)
    lead = tuple(range(x.dim() - 1))
    dw = None if w is None or not weight_grad else (dy * xh).sum(lead).to(w.dtype)
    db = None if w is None or not weight_grad else dy.sum(lead).to(w.dtype)
    return (dx.to(dy.dtype if x.dtype == torch.float64 else x.dtype).contiguous(),
            x.new_empty((0,)) if dw is None else dw, x.new_empty((0,)) if db is None else db)


def _ce(logits, target, ii, red, ls, compute_grad, fp32_loss=False):
    """Cross-entropy and, with ``compute_grad``, the per-row log-sum-exp (a registered
    operator's implementation runs below autograd)."""
    x = logits.detach().to(_acc(logits))
    keep = target != ii
    t = torch.where(keep, target, torch.zeros_like(target)).long()
    lse = torch.logsumexp(x, -1)
    picked = x.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    rows = (1 - ls) * (lse - picked) + ls * (lse - x.mean(-1))
    rows = torch.where(keep, rows, torch.zeros_like(rows))
    count = keep.sum().to(x.dtype)
    loss = rows.sum() / count if red == "mean" else rows.sum() if red == "sum" else rows
    loss = loss.to(torch.float32 if fp32_loss else logits.dtype)
    return loss, (lse.contiguous() if compute_grad else logits.new_empty((0,)))


def _ce_bwd(logits, target, lse, dloss, ii, red, ls, refuse=False):
    """The gradient from the saved log-sum-exp, in float32 (float64) times the loss's gradient
    read in that precision, rounded once to the logits' dtype. ``refuse``: a tensor that
    requires grad raises, as ``cupylab.cross_entropy_backward`` does (the ``_kernels``
    function this stands in for detaches them)."""
    if refuse and (dloss.requires_grad or logits.requires_grad):
        raise TypeError("cross_entropy_backward: a torch tensor that requires grad")
    logits, dloss = logits.detach(), dloss.detach()
    x = logits.to(_acc(logits))
    n = x.shape[-1]
    keep = target != ii
    t = torch.where(keep, target, torch.zeros_like(target)).long()
    g = torch.exp(x - lse.unsqueeze(-1)) - (1 - ls) * TF.one_hot(t, n).to(x.dtype) - ls / n
    s = dloss.to(x.dtype)
    if red == "mean":
        count = keep.sum().to(x.dtype)
        s = s * torch.where(count > 0, 1 / count, torch.zeros_like(count))
    s = s.unsqueeze(-1) if s.dim() else s
    return (g * keep.unsqueeze(-1).to(x.dtype) * s).to(logits.dtype).contiguous()


CALLS = []  # (kernel name, args) of every reference kernel call


_REAL_CE_BWD = _kernels.cross_entropy_backward  # (a stand-in replaces it below)


def _log(name, fn):
    def f(*a):
        CALLS.append((name, a))
        return fn(*a)
    return f


REFS = {
    "softmax": lambda x, d: torch.softmax(x.detach(), d).contiguous(),
    "log_softmax": lambda x, d: torch.log_softmax(x.detach(), d).contiguous(),
    "softmax_backward": lambda y, dy, d: _softmax_bwd(y, dy, d, False),
    "log_softmax_backward": lambda y, dy, d: _softmax_bwd(y, dy, d, True),
    "rms_norm": lambda x, w, eps, stats=True: (
        (lambda r: (r[0], r[2]) if stats else r[0])(_norm_fwd(x, w, None, eps, False))),
    "rms_norm_backward": lambda dy, x, w, rstd, wg=True: _norm_bwd(dy, x, w, None, rstd,
                                                                   wg)[:2],
    "layer_norm": lambda x, w, b, eps, stats=True: (
        (lambda r: r if stats else r[0])(_norm_fwd(x, w, b, eps, True))),
    "layer_norm_backward": _norm_bwd,
    "add_rms_norm": lambda x, r, w, eps, stats=True: (
        (lambda h: (lambda o: (o[0], h, o[2]) if stats else (o[0], h))(
            _norm_fwd(h, w, None, eps, False)))((x.detach() + r.detach()).contiguous())),
    "add_rms_norm_": lambda x, r, w, eps: _norm_fwd(r.add_(x.detach()), w, None, eps,
                                                    False)[0],
    "cross_entropy": _ce,
    "cross_entropy_loss": lambda x, t, ii, red, ls, f32=False: _ce(x, t, ii, red, ls, False,
                                                                    f32)[0],
    "cross_entropy_backward": _ce_bwd,
    "add": lambda a, b: torch.add(_dd(a), _dd(b)).contiguous(),
    "subtract": lambda a, b: torch.sub(_dd(a), _dd(b)).contiguous(),
    "multiply": lambda a, b: torch.mul(_dd(a), _dd(b)).contiguous(),
    "divide": lambda a, b: torch.div(_dd(a), _dd(b)).contiguous(),
    "fused_add_mul": lambda a, b, s: ((_dd(a) + _dd(b)) * _dd(s)).contiguous(),
    "fused_add_mul_scalar": lambda a, b, s: ((_dd(a) + _dd(b)) * s).contiguous(),
}


@pytest.fixture
def cpu_kernels(monkeypatch):
    """cupylab.torch._kernels replaced by the torch implementations above (calls logged)."""
    CALLS.clear()
    for name, fn in REFS.items():
        monkeypatch.setattr(_kernels, name, _log(name, fn))
    yield CALLS
    CALLS.clear()


def _g(*shape, dtype=torch.float64, seed=0, grad=True, lo=None):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=dtype)
    if lo is not None:  # magnitudes away from zero (divisors)
        t = t.sign() * (t.abs() + lo)
    return t.requires_grad_(grad)
