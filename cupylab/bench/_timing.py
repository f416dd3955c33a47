"""Timing: GPU time by CUDA events, wall clock for asynchronous frameworks.

GPU time
    After warm-up (every buffer set called once), one short batch estimates the GPU time and
    the host time of a call; the batch size ``K`` is chosen so that a batch lasts about
    :data:`TARGET_US` (between :data:`MIN_BATCH` and :data:`MAX_BATCH` calls). Each repetition
    records an event, runs ``K`` calls back to back (rotating through the buffer sets), records
    a second event and waits for it; the time per call is the elapsed time over ``K``. The
    report is the median and the 20th/80th percentiles over the repetitions.

    When a call costs the host about as much as the GPU (small inputs), a *hold kernel*
    (one thread spinning on ``%globaltimer``) is queued before the first event, long enough for
    the host to queue the whole batch behind it: the events then time the GPU work back to back
    and not the gaps between the host's launches (nvbench's "blocking kernel"). Host cost is
    measured separately (:mod:`cupylab.bench._overhead`).

    All events and launches are on the legacy default stream (handle 0), which is both CuPy's
    and torch's current stream unless a caller changes it.

Wall clock
    For frameworks that run on streams of their own (JAX): ``K`` calls, then a block on the
    last result, timed with :func:`time.perf_counter`.
"""
from __future__ import annotations

import math
import time

import numpy as np

__all__ = ["Stats", "Timer", "TARGET_US", "MIN_BATCH", "MAX_BATCH"]

#: Aim for batches that last about this long (µs).
TARGET_US = 2000.0
#: Fewest calls per timed batch (auto batch size).
MIN_BATCH = 10
#: Most calls per timed batch (auto batch size).
MAX_BATCH = 200
#: Longest hold (ns).
MAX_HOLD_NS = 200_000_000

_HOLD_SRC = r"""
extern "C" __global__ void cl_bench_hold(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""


class Stats:
    """Time per call over the repetitions (µs).

    Attributes
    ----------
    median, p20, p80 : float
    batch : int
        Calls per repetition.
    reps : int
        Repetitions.
    method : str
        ``"cuda-events"``, ``"cuda-events+hold"`` or ``"wall"``.
    samples : list of float
    """

    __slots__ = ("median", "p20", "p80", "batch", "reps", "method", "samples")

    def __init__(self, samples, batch, method):
        q = np.percentile(np.asarray(samples, dtype=np.float64), [20, 50, 80])
        self.p20, self.median, self.p80 = (float(v) for v in q)
        self.batch = int(batch)
        self.reps = len(samples)
        self.method = method
        self.samples = [float(s) for s in samples]

    def __repr__(self):
        return (f"Stats(median={self.median:.3f} us, p20={self.p20:.3f}, p80={self.p80:.3f}, "
                f"batch={self.batch}, reps={self.reps}, method={self.method!r})")


def _batch_for(per_call_us, batch):
    if batch:
        return int(batch)
    k = math.ceil(TARGET_US / max(per_call_us, 1e-3))
    return int(min(MAX_BATCH, max(MIN_BATCH, k)))


class Timer:
    """Times zero-argument callables on the GPU of CuPy's current device.

    Parameters
    ----------
    cp : module
        CuPy (a usable GPU).
    """

    def __init__(self, cp):
        self.cp = cp
        self.stream = cp.cuda.Stream.null
        self.start = cp.cuda.Event()
        self.end = cp.cuda.Event()
        self._hold = None
        self._i = 0

    def sync(self) -> None:
        """Wait for all work on the device."""
        self.cp.cuda.runtime.deviceSynchronize()

    def hold(self, ns: int) -> None:
        """Queue a one-thread kernel that spins for ``ns`` nanoseconds on the default stream."""
        if self._hold is None:
            self._hold = self.cp.RawKernel(_HOLD_SRC, "cl_bench_hold")
        with self.stream:
            self._hold((1,), (1,), (np.uint64(int(ns)),))

    def _run(self, fns, k):
        nf = len(fns)
        i = self._i
        for _ in range(k):
            fns[i % nf]()
            i += 1
        self._i = i

    def events(self, fns, reps: int, batch=None) -> Stats:
        """GPU time per call of ``fns`` (rotated), by CUDA events on the default stream.

        Parameters
        ----------
        fns : sequence of callable
            One zero-argument callable per buffer set; each must launch on the default stream.
        reps : int
            Repetitions (batches).
        batch : int, optional
            Calls per batch; chosen from a first estimate when omitted.

        Returns
        -------
        Stats
        """
        if not fns:
            raise ValueError("nothing to time")
        cp, s = self.cp, self.stream
        for f in fns:  # warm-up: compile, autotune, first touch of every buffer set
            f()
        self.sync()
        w = max(5, min(len(fns), MAX_BATCH))
        self.start.record(s)
        t0 = time.perf_counter()
        self._run(fns, w)
        host_us = (time.perf_counter() - t0) * 1e6 / w
        self.end.record(s)
        self.end.synchronize()
        gpu_us = cp.cuda.get_elapsed_time(self.start, self.end) * 1e3 / w
        k = _batch_for(gpu_us, batch)
        hold_ns = 0
        if gpu_us < 3.0 * host_us:  # launch-bound: hide the host gaps behind a hold kernel
            hold_ns = int(min(MAX_HOLD_NS, 2.0 * k * host_us * 1e3 + 20_000))
        samples = []
        for _ in range(max(1, int(reps))):
            if hold_ns:
                self.hold(hold_ns)
            self.start.record(s)
            self._run(fns, k)
            self.end.record(s)
            self.end.synchronize()
            samples.append(cp.cuda.get_elapsed_time(self.start, self.end) * 1e3 / k)
        return Stats(samples, k, "cuda-events+hold" if hold_ns else "cuda-events")

    def wall(self, fns, reps: int, batch=None, block=None) -> Stats:
        """Wall-clock time per call of ``fns`` (rotated): ``K`` calls then ``block(last
        result)`` (default: synchronize the device).

        Parameters
        ----------
        fns : sequence of callable
        reps : int
        batch : int, optional
        block : callable, optional
            Waits until a call's result is ready (``jax.block_until_ready``).

        Returns
        -------
        Stats
        """
        if not fns:
            raise ValueError("nothing to time")
        if block is None:
            def block(_r):
                self.sync()
        nf = len(fns)
        r = None
        for f in fns:
            r = f()
        block(r)
        w = max(5, min(nf, MAX_BATCH))
        t0 = time.perf_counter()
        for _ in range(w):
            r = fns[self._i % nf]()
            self._i += 1
        block(r)
        k = _batch_for((time.perf_counter() - t0) * 1e6 / w, batch)
        samples = []
        for _ in range(max(1, int(reps))):
            t0 = time.perf_counter()
            for _ in range(k):
                r = fns[self._i % nf]()
                self._i += 1
            block(r)
            samples.append((time.perf_counter() - t0) * 1e6 / k)
        return Stats(samples, k, "wall")


def torch_events_ms(torch, fn, n, reps=5):
    """Median milliseconds per call of ``fn``: ``reps`` batches of ``n`` back-to-back calls
    between two torch CUDA events on torch's current stream, after one warm-up call. No hold
    kernel, so only for calls whose GPU time is not below their host time (list-shaped
    optimizer steps, large copies) or where the host gaps are part of what is measured."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / n)
    ts.sort()
    return ts[len(ts) // 2] if len(ts) % 2 else (ts[len(ts) // 2 - 1] + ts[len(ts) // 2]) / 2
