"""CUDA graph capture of cupylab calls, for CuPy and torch arrays alike.

torch users can also use ``torch.cuda.graph`` directly and CuPy users
``Stream.begin_capture()``: cupylab operators launch on the current stream of the array's
framework, so they are captured like native operations. :class:`Graph` is the
framework-neutral helper: it captures on a private non-blocking stream that it makes current
for CuPy *and* (when torch is loaded) for torch, so every cupylab call inside is captured,
whatever arrays it gets.
"""
from __future__ import annotations

import contextlib
import sys

from . import _launch, _runtime

__all__ = ["Graph"]


class Graph:
    """Record GPU work once, replay it with one launch.

    ``Graph()`` takes no arguments: :meth:`capture` records, :meth:`replay` launches (its
    ``stream`` is the only parameter). Capturing again replaces the graph.

    Examples
    --------
    >>> d = torch.empty_like(a)
    >>> cupylab.fused_add_mul(a, b, 2.0, out=d)      # warm up: compile and load first
    >>> g = cupylab.Graph()
    >>> with g.capture():
    ...     cupylab.fused_add_mul(a, b, 2.0, out=d)
    ...     cupylab.add(d, a, out=d)
    >>> g.replay()                                  # reruns both kernels on the current data

    Notes
    -----
    * Run each operator once before capturing: the first call compiles or loads its module,
      which must not happen inside a capture.
    * Inside the capture pass ``out=`` arrays allocated beforehand: neither CuPy's nor torch's
      allocator may call ``cudaMalloc`` while a stream is capturing (use ``torch.cuda.graph``
      if you want torch to manage graph memory).
    * The graph reads and writes the same addresses every replay: keep the arrays alive.
    """

    def __init__(self):
        self._graph = None
        self._stream = None

    @contextlib.contextmanager
    def capture(self):
        """Context manager: everything launched inside (on the current CuPy/torch stream) is
        recorded instead of run. The capture stream first waits for work already queued on
        the current streams, so the graph sees the data as it is at capture time.

        The capture runs on a new non-blocking CuPy stream of the current CuPy device,
        made CuPy's current stream inside the block, and torch's too when torch's CUDA is
        initialised.

        Returns
        -------
        context manager
            ``with g.capture() as same_g:`` binds this Graph. A body that raises ends the
            capture and leaves nothing to replay (the exception propagates).

        Raises
        ------
        cupylab.NoGPUError
            CuPy cannot be imported, or it finds no usable CUDA GPU.
        """
        cp = _runtime.cupy()
        dev = cp.cuda.runtime.getDevice()
        s = cp.cuda.Stream(non_blocking=True)
        _launch.wait_for(s.ptr, cp.cuda.get_current_stream().ptr or 1, dev)
        torch = sys.modules.get("torch")
        tctx = contextlib.nullcontext()
        if torch is not None and torch.cuda.is_initialized():
            _launch.wait_for(s.ptr, torch._C._cuda_getCurrentRawStream(dev) or 1, dev)
            tctx = torch.cuda.stream(_launch.torch_stream(s.ptr, dev))
        with s, tctx:
            s.begin_capture()
            ok = False
            try:
                yield self
                ok = True
            finally:
                # a body that raised leaves nothing to replay (not a half-captured graph,
                # nor an earlier one the caller meant to replace), nor does a capture that
                # CUDA invalidated (end_capture raises then)
                self._graph = None
                try:
                    graph = s.end_capture()  # always ends the capture
                except Exception:  # noqa: BLE001
                    if ok:
                        raise
                    graph = None  # the body's own exception propagates, not this one
                self._graph = graph if ok else None
        self._stream = s

    def replay(self, stream=None):
        """Launch the captured graph on ``stream`` (default: CuPy's current stream, which is
        the same legacy default stream torch uses unless you changed either).

        Parameters
        ----------
        stream : int or stream object, optional
            A ``cudaStream_t`` handle, a CuPy or torch stream, or an object with
            ``__cuda_stream__``.

        Returns
        -------
        None
            The replay is queued; the host does not wait for it.

        Raises
        ------
        RuntimeError
            Nothing has been captured (or the last capture's body raised).
        TypeError, ValueError
            A ``stream`` that is not a stream, or a negative handle.
        """
        if self._graph is None:
            raise RuntimeError("Graph.replay: nothing captured yet (use `with g.capture():`)")
        if stream is None:
            self._graph.launch()
        else:
            self._graph.launch(_launch.cupy_stream(_launch.resolve_stream(stream), -1))
