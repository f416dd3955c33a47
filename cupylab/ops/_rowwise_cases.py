"""The row-wise family's cases for the tests and ``cupylab-bench`` (:mod:`cupylab._registry`):
each operator with its inputs' byte and FLOP counts, its float64 reference
(``rows:<name>`` in :mod:`cupylab.reference`) and its torch eager and torch.compile peers.
Registered when :mod:`cupylab.ops.rowwise` is imported."""
import sys
import weakref

from .._registry import OpSpec
from .._registry import register as _add
from . import cross_entropy as xent
from . import rowwise as rw  # the operators looked up when a case runs (tests patch them)

__all__ = ["register"]


def register():
    """Register the row-wise cases (one per operator) with :mod:`cupylab._registry`."""

    floats = ("float16", "bfloat16", "float32", "float64")

    def prepared_peers(prep, pick, first=False):
        """Peers running ``pick(torch)`` (a function of the arrays) on the inputs and on
        ``prep(torch, *inputs)`` (the forward's statistics): those are made once per buffer set
        when the bench builds the peer, not in the timed calls. ``first``: the function
        returns a tuple, the checked result first, then outputs the peer must also produce
        (so that torch.compile cannot leave them out)."""
        def timed(f, a, extra):
            return (lambda: f(*a, *extra)[0]) if first else (lambda: f(*a, *extra))

        def eager(torch, *a, out=None):
            return timed(pick(torch), a, prep(torch, *a))

        def compiled(torch, *a, out=None):
            return timed(torch.compile(pick(torch)), a, prep(torch, *a))

        return {"torch": eager, "torch.compile": compiled}

    def peers(torch_fn, first=False):
        """Peers running ``torch_fn(torch, *inputs)``, eager and compiled."""
        return prepared_peers(lambda torch, *a: (), lambda torch: (lambda *b: torch_fn(torch, *b)),
                              first)

    def per_input(make):
        """``get(x)`` -> ``make(x)``, computed on the first call for the array object ``x`` and
        reused while it lives (its entry goes with it). The bench calls an operator on the
        same input objects every time (checked once, warmed up once per buffer set, then
        timed), so what the backward cases need from their inputs (the forward's statistics,
        the cross-entropy targets) is made before the timed calls, never in them."""
        cache = {}

        def get(x):
            key = id(x)
            hit = cache.get(key)
            if hit is not None and hit[0]() is x:
                return hit[1]

            def drop(ref):  # x is gone, and so is what was made from it
                if cache.get(key, (None,))[0] is ref:
                    del cache[key]

            try:
                ref = weakref.ref(x, drop)
            except TypeError:
                raise TypeError(f"cupylab-bench: cannot keep what a {type(x).__name__} input "
                                "needs across calls (no weak references to it)") from None
            val = make(x)
            cache[key] = (ref, val)
            return val

        return get

    def row_classes(x):
        """The cross-entropy cases' targets: per row, how many logits have their sign bit set,
        modulo the row length. Taken from the row's own values so that the float64 reference
        of the sampled rows ("rows:cross_entropy" in cupylab.reference) finds the same class.
        Accepts torch, JAX or CuPy arrays; returns one of the same framework (int64, int32
        for JAX without x64)."""
        cols = x.shape[-1]
        top = type(x).__module__.split(".", 1)[0]
        if top == "torch":
            torch = sys.modules["torch"]
            ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
            return (x.view(ints) < 0).sum(-1) % cols
        if top in ("jax", "jaxlib"):
            return sys.modules["jax"].numpy.signbit(x).sum(-1) % cols
        return (x.view(f"i{x.dtype.itemsize}") < 0).sum(-1, dtype="int64") % cols  # CuPy

    def vector_like(x, bias=False):
        """The weighted norm cases' weight or bias (:func:`cupylab.reference.bench_vector`)
        as an array of x's framework, dtype and device."""
        from .. import reference  # noqa: PLC0415

        h = reference.bench_vector(x.shape[-1], bias)
        top = type(x).__module__.split(".", 1)[0]
        if top == "torch":
            return sys.modules["torch"].from_numpy(h).to(device=x.device, dtype=x.dtype)
        if top in ("jax", "jaxlib"):
            return sys.modules["jax"].numpy.asarray(h).astype(x.dtype)
        return sys.modules["cupy"].asarray(h).astype(x.dtype)

    weights = per_input(vector_like)
    biases = per_input(lambda x: vector_like(x, True))

    def _rms(torch, x):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, 1e-6)

    def _rms_w(torch):
        return lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)

    def _ln_wb(torch):
        return lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5)

    def _ln(torch, x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), None, None, 1e-5)

    def _add_rms(torch, x, r):
        # (y, h): h = x + r is an output, as cupylab's is (a transformer's residual stream);
        # returning y alone let torch.compile skip writing h, a quarter of the bytes
        h = x + r
        return torch.nn.functional.rms_norm(h, (x.shape[-1],), None, 1e-6), h

    def _sm_bwd(torch, y, dy):
        return torch._softmax_backward_data(dy, y, -1, y.dtype)

    def _lsm_bwd(torch, y, dy):
        return torch._log_softmax_backward_data(dy, y, -1, y.dtype)

    # -- backward of the norms: dx from dy, x and the forward's statistics (no weight) --------
    rms_stats = per_input(lambda x: (rw.rms_norm(x, None, 1e-6, return_stats=True)[1],))
    ln_stats = per_input(lambda x: rw.layer_norm(x, None, None, 1e-5, return_stats=True)[1:])

    def rms_bwd(dy, x, out=None):  # the backward has no out=: dx is allocated
        return rw.rms_norm_backward(dy, x, None, *rms_stats(x))[0]

    def ln_bwd(dy, x, out=None):  # the backward has no out=: dx is allocated
        return rw.layer_norm_backward(dy, x, None, *ln_stats(x))[0]

    def _rms_prep(torch, dy, x):  # rstd as torch's forward has it: (rows, 1), float32/64
        a = torch.float64 if x.dtype == torch.float64 else torch.float32
        return (torch.rsqrt(x.to(a).square().mean(-1, keepdim=True) + 1e-6),)

    def _rms_bwd(torch):
        if hasattr(torch.ops.aten, "_fused_rms_norm_backward"):  # torch >= 2.9: its kernel
            def f(dy, x, rstd):
                return torch.ops.aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd, None,
                                                               [True, False])[0]
        else:  # older torch: the formula, in rstd's dtype
            def f(dy, x, rstd):
                g, xh = dy.to(rstd.dtype), x.to(rstd.dtype) * rstd
                return (rstd * (g - xh * (g * xh).mean(-1, keepdim=True))).to(x.dtype)
        return f

    def _ln_prep(torch, dy, x):  # mean, rstd: (rows, 1), float32/64
        return torch.ops.aten.native_layer_norm(x, [x.shape[-1]], None, None, 1e-5)[1:]

    def _ln_bwd(torch):
        def f(dy, x, mean, rstd):
            return torch.ops.aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean, rstd,
                                                             None, None, [True, False, False])[0]
        return f

    # -- cross-entropy with its gradient: dlogits written by the forward ----------------------
    # reduction="sum": the gradient is softmax - onehot, what the reference of the sampled rows
    # can compute ("mean" scales it by 1 / rows, which they do not know, and adds a small kernel
    # that counts the rows first)
    ce_targets = per_input(row_classes)

    def ce(x, out=None):
        return xent.cross_entropy(x, ce_targets(x), reduction="sum", return_grad=True,
                                  grad_out=out)[1]

    def ce_peer(compiled):
        """What training runs: ``F.cross_entropy`` (compiled or not), then autograd's
        backward; the targets are made when the peer is built."""
        def factory(torch, x, out=None):
            t = row_classes(x)

            def loss(a, b):
                return torch.nn.functional.cross_entropy(a, b, reduction="sum")

            f = torch.compile(loss) if compiled else loss

            def run():
                xr = x.detach().requires_grad_()
                return torch.autograd.grad(f(xr, t), xr)[0]

            return run

        return factory

    # -- cross-entropy backward from the forward's log-sum-exp (made once, untimed) ----------
    ce_lse = per_input(lambda x: xent.cross_entropy(x, ce_targets(x), reduction="sum",
                                                    return_lse=True)[1])

    def ce_bwd(x, out=None):
        return xent.cross_entropy_backward(x, ce_targets(x), ce_lse(x), reduction="sum",
                                           out=out)

    def ce_bwd_eager(torch, x, out=None):
        """torch's eager backward of ``F.cross_entropy(reduction="sum")``: nll_loss's
        gradient (zeros, -1 at the target), then log_softmax's backward from its saved
        output (made once, untimed)."""
        t = row_classes(x).unsqueeze(-1)
        lsm = torch.log_softmax(x, -1)

        def run():
            g = torch.zeros_like(lsm).scatter_(-1, t, -1.0)
            return torch._log_softmax_backward_data(g, lsm, -1, x.dtype)

        return run

    def ce_bwd_compiled(torch, x, out=None):
        """The same gradient as torch.compile's backward computes it: one fused kernel from
        the logits and the float32 log-sum-exp (made once, untimed)."""
        t = row_classes(x)
        lse = torch.logsumexp(x.to(torch.float64 if x.dtype == torch.float64
                                   else torch.float32), -1)

        def grad(a, b, s):
            p = torch.exp(a.to(s.dtype) - s.unsqueeze(-1))
            hit = torch.arange(a.shape[-1], device=a.device) == b.unsqueeze(-1)
            return (p - hit.to(s.dtype)).to(a.dtype)

        f = torch.compile(grad)
        return lambda: f(x, t, lse)

    specs = [
        ("softmax", rw.softmax, 1, lambda i: 2 * i, 5, peers(lambda t, x: t.softmax(x, -1)),
         "softmax over the last axis"),
        ("log_softmax", rw.log_softmax, 1, lambda i: 2 * i, 5,
         peers(lambda t, x: t.log_softmax(x, -1)), "log_softmax over the last axis"),
        ("rms_norm", lambda x, out=None: rw.rms_norm(x, None, 1e-6, out=out), 1, lambda i: 2 * i,
         4, peers(_rms), "rms_norm over the last axis (no weight)"),
        ("layer_norm", lambda x, out=None: rw.layer_norm(x, None, None, 1e-5, out=out), 1,
         lambda i: 2 * i, 6, peers(_ln), "layer_norm over the last axis (no weight)"),
        # the weight (and bias) made once per input (reference.bench_vector), untimed; their
        # reads are not counted in the bytes (one row's worth, cached after the first row)
        ("rms_norm_w", lambda x, out=None: rw.rms_norm(x, weights(x), 1e-6, out=out), 1,
         lambda i: 2 * i, 5, prepared_peers(lambda torch, x: (weights(x),), _rms_w),
         "rms_norm over the last axis with a weight (x's dtype)"),
        ("layer_norm_wb", lambda x, out=None: rw.layer_norm(x, weights(x), biases(x), 1e-5,
                                                         out=out), 1,
         lambda i: 2 * i, 8, prepared_peers(lambda torch, x: (weights(x), biases(x)), _ln_wb),
         "layer_norm over the last axis with a weight and a bias (x's dtype)"),
        ("add_rms_norm", lambda x, r, out=None: rw.add_rms_norm(x, r, None, 1e-6, out=out)[0], 2,
         lambda i: 4 * i, 5, peers(_add_rms, first=True), "h = x + r; y = rms_norm(h); x, r "
         "read, y, h written (by the peers too)"),
        ("softmax_backward", lambda y, dy, out=None: rw.softmax_backward(y, dy, out=out), 2,
         lambda i: 3 * i, 3, peers(_sm_bwd), "dx = y * (dy - sum(y * dy))"),
        ("log_softmax_backward", lambda y, dy, out=None: rw.log_softmax_backward(y, dy, out=out),
         2, lambda i: 3 * i, 3, peers(_lsm_bwd), "dx = dy - exp(y) * sum(dy)"),
        # peers: aten._fused_rms_norm_backward (the formula before torch 2.9), eager / compiled
        ("rms_norm_backward", rms_bwd, 2, lambda i: 3 * i, 6,
         prepared_peers(_rms_prep, _rms_bwd), "dx of rms_norm (no weight) from dy, x and the "
         "forward's rstd (made once, untimed); dx allocated"),
        # peers: aten.native_layer_norm_backward with mask (dx only), eager / compiled
        ("layer_norm_backward", ln_bwd, 2, lambda i: 3 * i, 8,
         prepared_peers(_ln_prep, _ln_bwd), "dx of layer_norm (no weight) from dy, x and the "
         "forward's mean, rstd (made once, untimed); dx allocated"),
        # peers: F.cross_entropy then torch.autograd.grad, eager / with the loss compiled
        ("cross_entropy", ce, 1, lambda i: 2 * i, 7,
         {"torch": ce_peer(False), "torch.compile": ce_peer(True)},
         "loss and dlogits in one pass (reduction='sum'; targets made once, untimed)"),
        # peers: torch's eager backward (nll_loss then log_softmax), torch.compile's formula
        ("cross_entropy_backward", ce_bwd, 1, lambda i: 2 * i, 5,
         {"torch": ce_bwd_eager, "torch.compile": ce_bwd_compiled},
         "dlogits of reduction='sum' from the logits and the forward's log-sum-exp (made "
         "once, untimed): one read, one write"),
    ]
    for name, fn, nin, bpe, flops, pe, desc in specs:
        spec = _add(OpSpec(name, fn, nin, f"rows:{name}", floats, bytes_per_element=bpe,
                               flops_per_element=flops, peers=pe, description=desc))
        spec.rowwise = True  # the bench checks whole rows
