"""GPU timing shared by the scripts: CUDA events around batches of calls, after warm-up."""
import torch


def gpu_us(f, reps=9, inner=20):
    """Median GPU time of one call of ``f`` in µs: ``reps`` batches of ``inner`` calls timed
    with CUDA events on torch's current stream, after one warm-up call."""
    f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(inner):
            f()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / inner)
    return sorted(ts)[reps // 2]
