"""On the GPU: memory cupylab allocates for a ``stream=`` launch comes from CuPy's pool for
that stream, so once dropped it is handed out again only to work ordered behind the stream
(an allocation on another stream never gets it while the kernel may still run), and the
results are right on a busy side stream."""
import numpy as np
import pytest

import cupylab
from cupylab import foreach

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _reused_elsewhere(make, nbytes):
    """Run ``make(stream)`` on a new non-blocking stream, drop what it returned, and say
    whether an allocation of the same size on the legacy default stream gets its memory."""
    side = cp.cuda.Stream(non_blocking=True)
    out = make(side)
    ptrs = {o.data.ptr for o in (out if isinstance(out, list) else [out])}
    del out
    with cp.cuda.Stream.null:
        again = [cp.empty(nbytes, dtype=cp.uint8) for _ in range(len(ptrs))]
    side.synchronize()
    return bool(ptrs & {a.data.ptr for a in again})


@pytest.mark.parametrize("op", ["add", "softmax", "foreach.add", "foreach.norm"])
def test_memory_for_a_stream_argument_stays_with_that_stream(op):
    rng = np.random.default_rng(7)
    n = 3 * 2**18 + 5
    x = cp.asarray(rng.standard_normal(n, dtype=np.float32))
    y = cp.asarray(rng.standard_normal(n, dtype=np.float32))
    cp.cuda.Device().synchronize()
    makes = {
        "add": (lambda s: cupylab.add(x, y, stream=s), 4 * n),
        "softmax": (lambda s: cupylab.softmax(x.reshape(1, n), stream=s), 4 * n),
        "foreach.add": (lambda s: foreach.add([x, y], [y, x], stream=s), 4 * n),
        "foreach.norm": (lambda s: foreach.norm([x, y], stream=s), 4),
    }
    make, nbytes = makes[op]
    cp.get_default_memory_pool().free_all_blocks()
    assert not _reused_elsewhere(make, nbytes)


def test_a_fresh_flag_is_zeroed_on_the_launch_stream():
    """nonfinite_check(stream=side) allocates its flag, zeroes it, and the check sets it. With
    CuPy's current stream busy and the side stream idle, a zero queued on the current stream
    would land after the check's write and lose it; on the side stream it comes first."""
    rng = np.random.default_rng(8)
    x = cp.asarray(rng.standard_normal(4097, dtype=np.float32))
    x[17] = cp.inf
    big = cp.asarray(rng.standard_normal(2**26, dtype=np.float32))
    foreach.nonfinite_check([x])  # kernels loaded, table built, outside the timing
    cp.cuda.Device().synchronize()
    side, busy = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with busy:
        for _ in range(20):  # about 10 ms of work ahead of anything queued on busy
            big *= 1.0
        flag = foreach.nonfinite_check([x], stream=side)
        total = foreach.norm([x[:17]], stream=side)
    side.synchronize()
    busy.synchronize()
    assert float(flag[0]) == 1.0
    np.testing.assert_allclose(float(total), np.linalg.norm(cp.asnumpy(x[:17])), rtol=1e-5)


def test_a_torch_result_for_a_stream_argument_is_not_memory_the_current_stream_still_uses():
    """torch's caching allocator hands a block freed on the current stream straight back out
    for work on that stream, while its queued kernels may still write it. A result allocated
    for a launch on another stream must come from that stream's free memory instead."""
    torch = pytest.importorskip("torch")
    n = 2**24 + 3
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(n, device="cuda", generator=gen)
    y = torch.randn(n, device="cuda", generator=gen)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    b = torch.full((n,), 7.0, device="cuda")
    for _ in range(40):  # queued on the current stream, still writing b after the host drops it
        b.mul_(1.0)
    ptr = b.data_ptr()
    del b
    r = cupylab.add(x, y, stream=side)
    assert r.data_ptr() != ptr
    side.synchronize()
    torch.cuda.synchronize()
    torch.testing.assert_close(r, x + y, rtol=0, atol=0)
