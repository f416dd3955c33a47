"""cupylab.torch.optim against torch's own optimizers: 100 steps with reallocated gradients
(fp32 and bf16 params, every option), state_dict round trips both ways, CUDA graph capture of
a capturable step, found_inf, and a 10,000-step loop with flat memory."""
import copy
import gc

import pytest

torch = pytest.importorskip("torch")

from cupylab.ops import _mt_plan as P  # noqa: E402

pytestmark = pytest.mark.gpu
SHAPES = [(1,), (0,), (33,), (17, 5), (4099,), (3, 1000)]


def _params(dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g, device="cuda").to(dtype))
            for s in SHAPES]


def _clone(ps):
    return [torch.nn.Parameter(p.detach().clone()) for p in ps]


def _set_grads(gen, a, b, dtype):
    for x, y in zip(a, b):
        gr = torch.randn(x.shape, generator=gen, device="cuda").to(dtype)
        x.grad = gr.clone()  # a new tensor every step (set_to_none style)
        y.grad = gr.clone()


def _compare(mine, ref, dtype, rtol, atol):
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=rtol, atol=atol)


def _clo():
    from cupylab.torch import optim

    return optim


ADAM_CASES = [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, maximize=True),
              dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6), dict(lr=1e-2, capturable=True)]
SGD_CASES = [dict(lr=0.1), dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.9,
                                                             dampening=0.2),
             dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
             dict(lr=0.05, momentum=0.5, maximize=True, weight_decay=0.1)]


def _run(mine_cls, ref_cls, kw, dtype, steps=100, ref_kw=None, tol=(1e-5, 1e-5)):
    a = _params(dtype)
    b = _clone(a)
    o1 = mine_cls(a, **kw)
    o2 = ref_cls(b, **(ref_kw if ref_kw is not None else kw))
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        _set_grads(gen, a, b, dtype)
        o1.step()
        o2.step()
    _compare(a, b, dtype, *tol)
    return o1, o2, a, b


@pytest.mark.parametrize("capturable", [False, True])
def test_adam_late_and_skipping_parameters_match_torch(capturable):
    """Per-parameter step counts: parameter 2 gets its first gradient at step 6, parameter 4
    has none at steps 10-12; torch's bias correction for each (cupylab: one launch per step
    cohort)."""
    a = _params(torch.float32)
    b = _clone(a)
    o1 = _clo().Adam(a, lr=1e-2, capturable=capturable)
    o2 = torch.optim.Adam(b, lr=1e-2, capturable=capturable)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for step in range(1, 31):
        _set_grads(gen, a, b, torch.float32)
        for ps in (a, b):
            if step < 6:
                ps[2].grad = None
            if 10 <= step <= 12:
                ps[4].grad = None
        o1.step()
        o2.step()
    _compare(a, b, torch.float32, 1e-5, 1e-5)
    assert [float(o1.state[p]["step"]) for p in a] == [float(o2.state[p]["step"]) for p in b]


@pytest.mark.parametrize("kw", ADAM_CASES)
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_fp32_100_steps_match_torch(name, kw):
    _run(getattr(_clo(), name), getattr(torch.optim, name), kw, torch.float32)


@pytest.mark.parametrize("kw", SGD_CASES)
def test_sgd_fp32_100_steps_match_torch(kw):
    _run(_clo().SGD, torch.optim.SGD, kw, torch.float32)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_bf16_matches_torch_fused(name):
    kw = dict(lr=1e-2, weight_decay=0.05)
    _run(getattr(_clo(), name), getattr(torch.optim, name), kw, torch.bfloat16,
         ref_kw=dict(kw, fused=True), tol=(1.6e-2, 1.6e-2))


def test_sgd_bf16_matches_torch_fused():
    kw = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    # 100 momentum steps in bf16: an element that rounds differently once drifts by a few
    # bf16 ulps (seen: 0.045 on one of 3,000 elements), hence the absolute tolerance
    _run(_clo().SGD, torch.optim.SGD, kw, torch.bfloat16, ref_kw=dict(kw, fused=True),
         tol=(1.6e-2, 6e-2))


def test_bf16_master_weights_track_fp32_training():
    a = _params(torch.bfloat16)
    b = [torch.nn.Parameter(p.detach().float()) for p in a]
    o1 = _clo().AdamW(a, lr=1e-2, weight_decay=0.1, master_weights=True)
    o2 = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(50):
        for x, y in zip(a, b):
            gr = torch.randn(x.shape, generator=gen, device="cuda").to(torch.bfloat16)
            x.grad, y.grad = gr, gr.float()
        o1.step()
        o2.step()
    for x, y in zip(a, b):
        m = o1.state[x]["master_param"]
        torch.testing.assert_close(m, y.detach(), rtol=1e-5, atol=1e-5)
        assert torch.equal(x.detach(), m.to(torch.bfloat16))
        assert o1.state[x]["exp_avg"].dtype == torch.float32


def test_lion_matches_reference():
    import numpy as np

    from cupylab import reference as R

    a = _params(torch.float32)
    o = _clo().Lion(a, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99))
    ref = [(p.detach().double().cpu().numpy(), np.zeros(p.shape)) for p in a]
    gen = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(20):
        gs = [torch.randn(p.shape, generator=gen, device="cuda") for p in a]
        for p, g in zip(a, gs):
            p.grad = g
        o.step()
        ref = [R.lion_step(x, g.double().cpu().numpy(), m, lr=1e-3, weight_decay=0.1)
               for (x, m), g in zip(ref, gs)]
    for p, (x, _) in zip(a, ref):
        np.testing.assert_allclose(p.detach().cpu().numpy(), x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("direction", ["mine_to_torch", "torch_to_mine"])
@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_state_dict_round_trip(name, direction):
    kw = dict(lr=1e-2, momentum=0.9) if name == "SGD" else dict(lr=1e-2, weight_decay=0.1)
    mine_cls, ref_cls = getattr(_clo(), name), getattr(torch.optim, name)
    first, second = (mine_cls, ref_cls) if direction == "mine_to_torch" else (ref_cls, mine_cls)
    a = _params(torch.float32)
    o1 = first(a, **kw)
    gen = torch.Generator(device="cuda").manual_seed(4)
    for _ in range(5):
        _set_grads(gen, a, _clone(a), torch.float32)
        o1.step()
    b = _clone(a)
    o2 = second(b, **kw)
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))  # as torch.save / torch.load would
    for _ in range(5):
        _set_grads(gen, a, b, torch.float32)
        o1.step()
        o2.step()
    _compare(a, b, torch.float32, 1e-5, 1e-5)
    # and the loaded state has one step per param, not shared
    if name != "SGD":
        sd = o2.state_dict()
        steps = [s["step"] for s in sd["state"].values()]
        assert len({id(s) for s in steps}) == len(steps) and float(steps[0]) == 10.0


def test_cuda_graph_capture_of_a_capturable_step():
    a = _params(torch.float32)
    b = _clone(a)
    lr = torch.tensor(1e-2, device="cuda")
    o1 = _clo().Adam(a, lr=lr, capturable=True)
    o2 = torch.optim.Adam(b, lr=1e-2, capturable=True)
    for p in a:
        p.grad = torch.zeros_like(p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o1.step()  # eager warm-up: builds the launch tables and the state
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o1.step()
    for p in b:
        p.grad = torch.zeros_like(p)
    o2.step()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(10):
        for x, y in zip(a, b):
            gr = torch.randn(x.shape, generator=gen, device="cuda")
            x.grad.copy_(gr)
            y.grad = gr.clone()
        graph.replay()
        o2.step()
    _compare(a, b, torch.float32, 1e-5, 1e-5)
    assert float(o1.state[a[0]]["step"]) == 11.0


def test_a_captured_step_keeps_counting_after_the_table_is_rebuilt():
    """The graph's step points into its cohort's counter: an eager step that rebuilds the
    table (one parameter without a gradient) keeps that counter for the parameters it
    steps, so later replays count in the state torch's state_dict reads."""
    a = _params(torch.float32)
    lr = torch.tensor(1e-2, device="cuda")
    opt = _clo().Adam(a, lr=lr, capturable=True)
    for p in a:
        p.grad = torch.zeros_like(p)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    graph.replay()
    counter = opt.state[a[1]]["step"]
    g0, a[0].grad = a[0].grad, None
    opt.step()  # eager, a[0] left out: the table is rebuilt
    a[0].grad = g0
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(opt.state[p]["step"] is counter for p in a[1:])
    assert float(counter) == 6.0  # warm-up 1, replay 2, eager 3, three replays 6


def test_whole_network_capture_with_gradients_zeroed_in_place():
    """The capture recipe the docs give: warm-up step on a side stream, then forward,
    backward and step captured with the gradients zeroed in place inside the graph; replays
    match torch's AdamW stepping eagerly on the same batches."""
    torch.manual_seed(0)
    m1 = torch.nn.Linear(33, 7).cuda()
    m2 = copy.deepcopy(m1)
    o1 = _clo().AdamW(m1.parameters(), lr=torch.tensor(1e-2, device="cuda"), capturable=True)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    x = torch.randn(16, 33, device="cuda")

    def step(m, o):
        o.zero_grad(set_to_none=False)
        m(x).square().mean().backward()
        o.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(m1, o1)  # warm-up: the gradient tensors, the states and the launch tables
    torch.cuda.current_stream().wait_stream(side)
    step(m2, o2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(m1, o1)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(5):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        graph.replay()
        step(m2, o2)
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert float(o1.state[m1.weight]["step"]) == 6.0


def test_found_inf_skips_on_device():
    a = _params(torch.float32)
    o = _clo().Adam(a, lr=1e-2)
    for p in a:
        p.grad = torch.ones_like(p)
    o.step()
    before = [p.detach().clone() for p in a]
    fi = torch.ones(1, device="cuda")
    o.step(found_inf=fi)
    assert all(torch.equal(x, y) for x, y in zip(a, before))
    assert float(o.state[a[0]]["step"]) == 1.0
    o.step(found_inf=torch.zeros(1, device="cuda"))
    assert float(o.state[a[0]]["step"]) == 2.0
    assert not torch.equal(a[2].detach(), before[2])


def test_param_groups_and_zero_grad():
    a = _params(torch.float32)
    b = _clone(a)
    o1 = _clo().Adam([{"params": a[:3]}, {"params": a[3:], "lr": 1e-3}], lr=1e-2)
    o2 = torch.optim.Adam([{"params": b[:3]}, {"params": b[3:], "lr": 1e-3}], lr=1e-2)
    gen = torch.Generator(device="cuda").manual_seed(6)
    for _ in range(10):
        _set_grads(gen, a, b, torch.float32)
        a[1].grad = b[1].grad = None  # a param without gradient is skipped
        o1.step()
        o2.step()
        o1.zero_grad()
        assert all(p.grad is None for p in a)
    _compare(a, b, torch.float32, 1e-5, 1e-5)


def test_leak_10000_steps_with_reallocated_grads():
    import tracemalloc

    a = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in [(64,), (7, 9), (1000,)]]
    o = _clo().AdamW(a, lr=1e-3)

    def steps(n):
        for _ in range(n):
            for p in a:
                p.grad = torch.randn_like(p)
            o.step()
            o.zero_grad(set_to_none=True)

    steps(100)
    torch.cuda.synchronize()
    gc.collect()
    dev0 = torch.cuda.memory_allocated()
    tracemalloc.start()
    h0 = tracemalloc.get_traced_memory()[0]
    steps(10_000)
    torch.cuda.synchronize()
    gc.collect()
    h1 = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert torch.cuda.memory_allocated() == dev0
    assert h1 - h0 < 256 * 1024, f"host memory grew by {h1 - h0} bytes over 10,000 steps"
    assert P.cache_len() <= P.CACHE_SIZE


def test_a_step_with_new_gradients_does_not_wait_for_the_gpu():
    """zero_grad(set_to_none=True) gives new gradient tensors every step, so each step may set
    up a new launch table; the step still returns while the GPU is busy (no host sync), and
    matches torch's."""
    a = _params(torch.float32)
    b = _clone(a)
    # the kernel compiled and loaded first, on other params: a cold cache's NVRTC compile in
    # the first step could outlast the queued GPU work (what is tested is the step, not that)
    warm = _clone(a)
    for p in warm:
        p.grad = torch.zeros_like(p)
    _clo().AdamW(warm, lr=1e-2).step()
    torch.cuda.synchronize()
    o1, o2 = _clo().AdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2)
    gen = torch.Generator(device="cuda").manual_seed(9)
    s = torch.cuda.current_stream()
    for _ in range(3):
        _set_grads(gen, a, b, torch.float32)
        torch.cuda._sleep(400_000_000)  # about 0.2 s of GPU work queued first
        o1.step()
        assert not s.query()  # the step was queued behind it, the host did not wait
        o2.step()
        o1.zero_grad(set_to_none=True)
        o2.zero_grad(set_to_none=True)
    _compare(a, b, torch.float32, 1e-5, 1e-6)


def test_a_step_refused_by_its_checks_changes_nothing():
    """Every group's arguments are checked before any counter moves or any group is stepped:
    a float64 grad_scale (host and device counters) or a bad lr in the second group left the
    first group stepped and the counts advanced."""
    a = _params(torch.float32)
    o = _clo().Adam([{"params": a[:3]}, {"params": a[3:], "lr": 1e-3}], lr=1e-2)
    for p in a:
        p.grad = torch.ones_like(p)
    o.step()  # host counters
    fi = torch.zeros(1, device="cuda")
    bad_scale = torch.ones(1, device="cuda", dtype=torch.float64)

    def snapshot():
        return ([p.detach().clone() for p in a],
                [o.state[p]["exp_avg"].clone() for p in a],
                [float(o.state[p]["step"]) for p in a])

    def same(x, y):
        return all(torch.equal(u, v) for u, v in zip(x[0] + x[1], y[0] + y[1])) and x[2] == y[2]

    before = snapshot()
    with pytest.raises(TypeError, match="Adam.step: grad_scale must be a one-element float32"):
        o.step(grad_scale=bad_scale)
    assert same(snapshot(), before) and before[2] == [1.0] * len(a)
    o.step(found_inf=fi)  # the counters move to the GPU
    before = snapshot()
    with pytest.raises(TypeError, match="Adam.step: grad_scale must be a one-element float32"):
        o.step(found_inf=fi, grad_scale=bad_scale)
    o.param_groups[1]["lr"] = torch.ones(2, device="cuda")
    with pytest.raises(TypeError, match="Adam.step: lr must be a one-element float32"):
        o.step(found_inf=fi)
    assert same(snapshot(), before) and before[2] == [2.0] * len(a)
    o.param_groups[1]["lr"] = 1e-3
    o.step(found_inf=fi)
    assert [float(o.state[p]["step"]) for p in a] == [3.0] * len(a)

    b = _params(torch.float32, seed=2)
    ref = _clone(b)

    def groups(ps):  # the second group's first step is a dampened first momentum step
        return [{"params": ps[:3]}, {"params": ps[3:], "dampening": 0.5}]

    o = _clo().SGD(groups(b), lr=0.1, momentum=0.9)
    o_ref = torch.optim.SGD(groups(ref), lr=0.1, momentum=0.9)
    gen = torch.Generator(device="cuda").manual_seed(3)
    _set_grads(gen, b, ref, torch.float32)
    start = [p.detach().clone() for p in b]
    with pytest.raises(ValueError, match="the first momentum step cannot be skipped"):
        o.step(found_inf=fi)
    assert all(torch.equal(p, q) for p, q in zip(b, start))  # the first group too
    for _ in range(3):
        o.step()
        o_ref.step()
        _set_grads(gen, b, ref, torch.float32)
    _compare(b, ref, torch.float32, 1e-5, 1e-5)

    c = _params(torch.float32, seed=4)
    o = _clo().Lion([{"params": c[:3]}, {"params": c[3:]}], lr=1e-4)
    for p in c:
        p.grad = torch.ones_like(p)
    start = [p.detach().clone() for p in c]
    o.param_groups[1]["lr"] = torch.full((1,), 1e-4, device="cuda", dtype=torch.float64)
    with pytest.raises(TypeError, match="Lion.step: lr must be a one-element float32"):
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(c, start))
