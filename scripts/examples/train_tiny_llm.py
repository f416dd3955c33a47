#!/usr/bin/env python3
"""Train a small decoder-only transformer with torch and with cupylab, and compare.

The model is plain torch: token and position embeddings, pre-norm blocks of causal attention
(``torch.nn.functional.scaled_dot_product_attention``) and a GELU MLP, ``torch.nn.RMSNorm``
norms, an untied output head over a 32k vocabulary and a ``torch.nn.CrossEntropyLoss`` module;
bf16 autocast, float32 parameters. It trains on a fixed synthetic token stream (random
16-token phrases from a seeded phrase book, so the loss has something to learn) with AdamW,
from the same initial weights in every mode:

``torch``            all torch, eager, ``torch.optim.AdamW(fused=True)``
``torch-alt``        the same computation with other roundings: the loss is multiplied by 3
                     before ``backward`` (AdamW's update does not depend on the gradients'
                     scale, up to ``eps``; every bf16 rounding of the backward pass changes)
                     and ``torch.optim.AdamW(foreach=True)``. Its distance to ``torch`` is the
                     noise floor of bf16 training, against which cupylab's distance is read.
``cupylab``          the model's ``RMSNorm`` and ``CrossEntropyLoss`` modules swapped in place by
                     ``cupylab.torch.nn.swap_modules``, ``cupylab.torch.optim.AdamW``, eager;
                     each residual add and the RMSNorm after it made one kernel
                     (``cupylab.torch.functional.add_rms_norm`` over the float32 residual
                     stream, the norm written in bf16, what the next matrix multiply casts it
                     to), unless ``--no-fuse-residual``
``torch-compile``    ``torch`` under ``torch.compile(model, fullgraph=True)``
``cupylab-compile``  ``cupylab`` under ``torch.compile(model, fullgraph=True)``

``--compile-mode`` passes a ``mode`` to both compiled modes: ``reduce-overhead`` replays the
compiled forward and backward as CUDA graphs, which takes the host's per-call cost (torch's and
cupylab's alike) out of a host-bound step.

Reported per mode: the median step time (CUDA events around forward, backward and optimizer
step, after ``--warmup`` steps; compilation happens in the warm-up), the first step's wall
time, peak memory, the final loss and the loss curve's distance to ``torch``'s: max over steps
of ``|loss - loss_torch|`` and of ``|loss - loss_torch| / |loss_torch|``. The check: cupylab's
relative distance (``cupylab`` to ``torch``, ``cupylab-compile`` to ``torch-compile``) must stay
within ``max(--rtol, 2 * floor)``, ``floor`` being ``torch-alt``'s distance to ``torch`` when
that mode ran. ``--rtol`` defaults to 0.02 (five bf16 units in the last place, 2^-8 each); every
loss must be finite. Exit status 0 when the check holds, 1 when not, 2 for bad arguments or no
GPU.

Usage::

    python scripts/examples/train_tiny_llm.py                       # 200 steps, five modes
    python scripts/examples/train_tiny_llm.py --steps 8 --d-model 128 --layers 2 --seq 128 \\
        --batch 4 --modes torch,cupylab --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("torch", "torch-alt", "cupylab", "torch-compile", "cupylab-compile")
PHRASE = 16  # tokens per phrase of the synthetic stream


_fused_add_rms_norm = None  # cupylab.torch.functional.add_rms_norm, set by fuse_residual


def add_norm(norm, branch, x, fused_dtype=None):
    """``x + branch`` and its norm, ``(norm(x'), x')`` (``(norm(x), x)`` without a branch).
    With ``fused_dtype`` (the cupylab modes): one cupylab kernel adds and normalises over the
    float32 residual stream and writes the norm in ``fused_dtype``, the dtype the next matrix
    multiply casts it to under autocast (:func:`cupylab.torch.functional.add_rms_norm`)."""
    if branch is None:
        return norm(x), x
    if fused_dtype is not None:
        return _fused_add_rms_norm(branch, x, norm.weight, norm.eps, out_dtype=fused_dtype)
    x = x + branch
    return norm(x), x


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP.

    ``forward(x, branch)`` takes the residual stream ``x`` and the previous block's MLP output
    not yet added to it (the position embedding in the first block), and returns the stream
    and its own MLP output, not yet added: each residual add happens right before the norm that reads it (the
    same operations, in the same order, as ``x = x + mlp(...)`` at the end of the block), so
    that the cupylab modes can fuse the two."""

    def __init__(self, d_model, heads, eps):
        super().__init__()
        self.heads = heads
        self.fused_dtype = None
        self.norm1 = nn.RMSNorm(d_model, eps=eps)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.norm2 = nn.RMSNorm(d_model, eps=eps)
        self.fc1 = nn.Linear(d_model, 4 * d_model, bias=False)
        self.fc2 = nn.Linear(4 * d_model, d_model, bias=False)

    def forward(self, x, branch=None):
        b, t, d = x.shape
        n, x = add_norm(self.norm1, branch, x, self.fused_dtype)
        qkv = self.qkv(n).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        n, x = add_norm(self.norm2, self.proj(a.transpose(1, 2).reshape(b, t, d)), x,
                        self.fused_dtype)
        return x, self.fc2(F.gelu(self.fc1(n), approximate="tanh"))


class TinyLM(nn.Module):
    """Decoder-only language model; ``forward(idx, targets)`` returns the mean token loss."""

    def __init__(self, vocab, d_model, layers, heads, seq, eps=1e-6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, eps) for _ in range(layers))
        self.norm = nn.RMSNorm(d_model, eps=eps)
        self.fused_dtype = None
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.loss_fn = nn.CrossEntropyLoss()
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",
                                                                     "fc2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def fuse_residual(self, dtype):
        """Make every residual add and the RMSNorm after it one cupylab kernel writing the norm
        in ``dtype`` (None: back to torch's add and the norm module)."""
        global _fused_add_rms_norm
        if dtype is not None and _fused_add_rms_norm is None:
            from cupylab.torch.functional import add_rms_norm

            _fused_add_rms_norm = add_rms_norm
        self.fused_dtype = dtype
        for blk in self.blocks:
            blk.fused_dtype = dtype

    def forward(self, idx, targets):
        b, t = idx.shape
        # the position embedding is the first branch: it adds before the first norm, as the
        # other branches do (a broadcast view, batch stride 0)
        x, branch = self.tok(idx), self.pos.weight[:t].expand(b, t, -1)
        for blk in self.blocks:
            x, branch = blk(x, branch)
        n, _ = add_norm(self.norm, branch, x, self.fused_dtype)
        logits = self.head(n)
        return self.loss_fn(logits.view(b * t, -1), targets.reshape(b * t))


def make_data(vocab, steps, batch, seq, seed, device):
    """``(inputs, targets)``, each ``(steps, batch, seq)`` int64 on ``device``: windows of a
    seeded stream of random phrases (4,096 phrases of 16 tokens)."""
    g = torch.Generator().manual_seed(seed)
    n_phrases = min(4096, vocab)
    book = torch.randint(0, vocab, (n_phrases, PHRASE), generator=g)
    n_tok = max(1 << 20, 4 * (seq + 1))
    stream = book[torch.randint(0, n_phrases, (n_tok // PHRASE + 1,), generator=g)].reshape(-1)
    off = torch.randint(0, stream.numel() - seq - 1, (steps, batch, 1), generator=g)
    win = stream[off + torch.arange(seq + 1)]
    return win[..., :-1].contiguous().to(device), win[..., 1:].contiguous().to(device)


def build_model(args, device):
    return TinyLM(args.vocab, args.d_model, args.layers, args.heads, args.seq).to(device)


def run_mode(mode, args, init_state, data):
    """Train ``args.steps`` steps in ``mode`` from ``init_state``; returns the record."""
    device = data[0].device
    model = build_model(args, device)
    model.load_state_dict(init_state)
    swapped = 0
    kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if mode.startswith("cupylab"):
        from cupylab.torch.nn import swap_modules
        from cupylab.torch.optim import AdamW

        swapped = swap_modules(model)
        if args.fuse_residual and device.type == "cuda":  # a CUDA kernel: not on the host
            model.fuse_residual(torch.bfloat16)
        opt = AdamW(model.parameters(), **kw)
    elif mode == "torch-alt":
        opt = torch.optim.AdamW(model.parameters(), foreach=True, **kw)
    else:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)
    compiled = mode.endswith("compile")
    graphs = compiled and args.compile_mode == "reduce-overhead"
    fwd = (torch.compile(model, fullgraph=True,
                         mode=None if args.compile_mode == "default" else args.compile_mode)
           if compiled else model)
    scale = 3.0 if mode == "torch-alt" else None
    xs, ys = data
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(args.steps)]
        torch.cuda.reset_peak_memory_stats()
    else:  # --device cpu (a test of the script): host clock, no memory statistics
        ev = [[None, None] for _ in range(args.steps)]
    losses = []
    sync()
    first = loss_dtype = None
    def one_step(i):
        if graphs:  # a new iteration: the previous step's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = fwd(xs[i], ys[i])
        (loss if scale is None else loss * scale).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(args.steps):
        t0 = time.perf_counter()
        _mark(ev[i], 0, cuda)
        loss = one_step(i)
        _mark(ev[i], 1, cuda)
        # a copy (after the step's end event): under CUDA graphs the next replay overwrites
        # the loss tensor
        losses.append(loss.detach().float().clone())
        loss_dtype = str(loss.dtype).replace("torch.", "")
        if i == 0:
            sync()
            first = time.perf_counter() - t0
    sync()
    ms = [(a.elapsed_time(b) if cuda else (b - a) * 1e3) for a, b in ev[args.warmup:]]
    rec = dict(mode=mode, swapped=swapped, loss_dtype=loss_dtype,
               losses=torch.stack(losses).cpu().tolist(),
               first_step_s=first,
               peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan"),
               median_ms=statistics.median(ms) if ms else float("nan"),
               p10_ms=_quantile(ms, 0.1), p90_ms=_quantile(ms, 0.9))
    if args.profile:
        rec["profile"] = profile_steps(mode, one_step, args, cuda)
    fwd = model = opt = None  # the closure one_step holds them: release them here
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
    return rec


def profile_steps(mode, one_step, args, cuda, steps=3):
    """Run ``steps`` more training steps under ``torch.profiler`` and write the tables of the
    kernels by GPU time and the host operators by CPU time to ``args.profile/<mode>.txt``.
    Returns per-step totals: wall time, kernel time summed, and the host time spent in
    ``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` (a step that waits for the GPU
    cannot queue the next step's work while the previous one runs)."""
    import os  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for i in range(steps):
            one_step(i % args.steps)
        sync()
        wall = (time.perf_counter() - t) / steps
    ka = prof.key_averages()
    # the kernels' own rows (device type CUDA): an operator's row repeats its kernels' time
    dev_us = sum(e.self_device_time_total for e in ka
                 if str(getattr(e, "device_type", "")).endswith("CUDA")) / steps
    sync_us = sum(e.self_cpu_time_total for e in ka
                  if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                               "cudaEventSynchronize")) / steps
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, f"{mode}.txt"), "w") as f:
        f.write(f"{mode}: {steps} steps, wall {wall * 1e3:.3f} ms/step, GPU time "
                f"{dev_us / 1e3:.3f} ms/step, host synchronisation {sync_us / 1e3:.3f} "
                f"ms/step\n\n")
        if cuda:
            f.write(ka.table(sort_by="self_device_time_total", row_limit=30) + "\n\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
    return dict(wall_ms=wall * 1e3, gpu_ms=dev_us / 1e3, sync_ms=sync_us / 1e3)


def _mark(pair, k, cuda):
    """Record the start (k=0) or end (k=1) of a step: a CUDA event, or the host clock."""
    if cuda:
        pair[k].record()
    else:
        pair[k] = time.perf_counter()


def _quantile(v, q):
    if not v:
        return float("nan")
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def distance(a, b):
    """``(max |a - b|, max |a - b| / |b|)`` over the steps of two loss curves."""
    d = [abs(x - y) for x, y in zip(a, b)]
    r = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]
    return (max(d) if d else 0.0), (max(r) if r else 0.0)


def check(records, rtol):
    """Compare the loss curves. Returns ``(ok, lines, summary)``: the verdict, report lines,
    and a dict of the distances, the floor, the bound and the checked pairs."""
    lines, ok = [], True
    summary = dict(rtol=rtol, floor=None, pairs=[])
    for r in records.values():
        if not all(math.isfinite(v) for v in r["losses"]):
            ok = False
            lines.append(f"FAIL {r['mode']}: non-finite loss")
    ref = records.get("torch")
    if ref is not None:
        for r in records.values():
            r["abs_dist"], r["rel_dist"] = distance(r["losses"], ref["losses"])
    if ref is not None and "torch-alt" in records:
        summary["floor"] = records["torch-alt"]["rel_dist"]
    bound = max(rtol, 2 * summary["floor"]) if summary["floor"] is not None else rtol
    summary["bound"] = bound
    for mine, peers in (("cupylab", ("torch",)), ("cupylab-compile", ("torch-compile", "torch"))):
        peer = next((p for p in peers if p in records), None)
        if mine not in records or peer is None:
            continue
        da, dr = distance(records[mine]["losses"], records[peer]["losses"])
        good = dr <= bound
        ok &= good
        summary["pairs"].append(dict(mode=mine, peer=peer, abs=da, rel=dr, ok=good))
        lines.append(f"{'ok  ' if good else 'FAIL'} {mine} vs {peer}: max |dloss| {da:.3e}, "
                     f"max relative {dr:.3e} (bound {bound:.3e})")
    return ok, lines, summary


def report(records, args, ok, lines, summary):
    print(f"\nTinyLM d_model={args.d_model} layers={args.layers} heads={args.heads} "
          f"seq={args.seq} batch={args.batch} vocab={args.vocab}, {args.steps} steps "
          f"(median over steps {args.warmup}..{args.steps - 1}), bf16 autocast, "
          f"{_device_name(args)}")
    print(f"{'mode':16s} {'median ms':>9s} {'p10':>7s} {'p90':>7s} {'1st step s':>10s} "
          f"{'peak GB':>7s} {'loss[0]':>8s} {'loss[-1]':>8s} {'max|dl|':>9s} {'max rel':>9s}")
    for r in records.values():
        print(f"{r['mode']:16s} {r['median_ms']:9.3f} {r['p10_ms']:7.3f} {r['p90_ms']:7.3f} "
              f"{r['first_step_s']:10.2f} {r['peak_mem_gb']:7.2f} {r['losses'][0]:8.4f} "
              f"{r['losses'][-1]:8.4f} {r.get('abs_dist', float('nan')):9.2e} "
              f"{r.get('rel_dist', float('nan')):9.2e}")
    for mine, peer in (("cupylab", "torch"), ("cupylab-compile", "torch-compile")):
        if mine in records and peer in records:
            a, b = records[mine]["median_ms"], records[peer]["median_ms"]
            print(f"step time {mine} / {peer}: {a / b:.3f} ({b / a:.3f}x speed-up)")
    swapped = {r["mode"]: r["swapped"] for r in records.values() if r["swapped"]}
    if swapped:
        print(f"modules swapped to cupylab: {swapped} (expected {2 * args.layers + 2})")
    low = {r["mode"]: r["loss_dtype"] for r in records.values()
           if r["loss_dtype"] in ("bfloat16", "float16")}
    if low:
        print(f"losses returned in 16 bits (rounded to 8 or 11 significant bits): {low}")
    if summary["floor"] is not None:
        print(f"noise floor (torch-alt vs torch): max relative {summary['floor']:.3e}")
    for ln in lines:
        print(ln)
    print("check:", "PASS" if ok else "FAIL")


def _device_name(args):
    return torch.cuda.get_device_name() if args.device == "cuda" else "cpu"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=None, help="default d_model // 64")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " +
                   ", ".join(MODES))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    p.add_argument("--rtol", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the records and the check here")
    p.add_argument("--profile", metavar="DIR", help="after each mode's timed steps, profile "
                   "3 more with torch.profiler and write DIR/<mode>.txt (kernels by GPU time, "
                   "host operators by CPU time)")
    p.add_argument("--compile-mode", default="default",
                   choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
                   help="torch.compile's mode for the two compiled modes (reduce-overhead: CUDA "
                        "graphs)")
    p.add_argument("--no-fuse-residual", dest="fuse_residual", action="store_false",
                   help="in the cupylab modes, keep torch's residual adds beside the swapped "
                        "norms (by default each add and the RMSNorm after it are one cupylab "
                        "kernel over the float32 residual stream, writing the norm in bf16)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu runs the loop on the host, for testing this script: cupylab's "
                        "modules then run torch's forward and cupylab's optimizer refuses "
                        "host tensors, so only the torch modes run there")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes or len(set(args.modes)) != len(args.modes):
        p.error(f"--modes: each of {', '.join(MODES)} at most once (got {args.modes})")
    if args.heads is None:
        args.heads = max(1, args.d_model // 64)
    for name in ("steps", "d_model", "layers", "heads", "seq", "batch", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be in [0, --steps) (got {args.warmup})")
    return args


def main(argv=None):
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("train_tiny_llm: needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    init_state = {k: v.detach().clone() for k, v in build_model(args, device).state_dict().items()}
    data = make_data(args.vocab, args.steps, args.batch, args.seq, args.seed + 1, device)
    records = {}
    for mode in args.modes:
        t = time.perf_counter()
        records[mode] = run_mode(mode, args, init_state, data)
        print(f"[{mode}] {args.steps} steps in {time.perf_counter() - t:.1f} s, median "
              f"{records[mode]['median_ms']:.3f} ms/step, loss "
              f"{records[mode]['losses'][0]:.4f} -> {records[mode]['losses'][-1]:.4f}",
              flush=True)
    ok, lines, summary = check(records, args.rtol)
    report(records, args, ok, lines, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), device=_device_name(args),
                           torch=torch.__version__, records=records, check=summary, ok=ok),
                      f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
