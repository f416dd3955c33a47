"""Prepared foreach calls: :func:`prepare` and :class:`PreparedForeach`.

A call of a foreach operator or of a :mod:`cupylab.optim` step validated, packed and
recorded once, then replayed as its bare launches. Both names are re-exported by
:mod:`cupylab.ops.multi_tensor`.
"""
from __future__ import annotations

from .. import _launch, _runtime
from . import _mt_plan as P


# -- prepared calls: the host work of a hot loop down to the launches -------------------------
class PreparedForeach:
    """A multi-tensor call validated, packed and frozen once (see :func:`prepare`).

    Calling it replays the recorded launches, with the same arguments, on the caller's current
    stream at call time (or the ``stream`` fixed at prepare time), and returns what the
    prepared call returned (its output arrays, norm, ``found_inf``...).

    Made only by :func:`prepare`; the constructor is internal. Calling it takes no
    arguments (see :meth:`__call__`).

    Attributes
    ----------
    result : object
        What the prepared call returned when it was prepared (``None`` for the in-place
        operators and the optimizer steps); every replay returns this same object.
    """

    __slots__ = ("_launches", "_stream", "result", "_keep")

    def __init__(self, launches, stream, result, keep):
        self._launches = tuple(launches)
        self._stream = stream
        self.result = result
        self._keep = keep

    def __call__(self):
        """Replay the recorded launches.

        They go to the ``stream`` fixed by :func:`prepare`, else to the current stream of the
        prepared arrays' framework on their GPU (made current for the launches). Nothing is
        checked or allocated, and the host is not synchronised.

        Returns
        -------
        object
            :attr:`result`: the same object at every replay (output lists, a norm array and
            ``found_inf`` are overwritten in place by each replay).
        """
        launches = self._launches
        if launches:
            _, device, _, _, _, kind = launches[0]
            with _launch.ensure_device(device):
                s = self._stream if self._stream is not None else _launch.current_stream(
                    kind, device)
                for k, dev, grid, block, args, _ in launches:
                    k.launch(dev, grid, block, s, args)
        return self.result

    def __repr__(self):
        return f"<cupylab prepared multi-tensor call, {len(self._launches)} launch(es)>"


#: What :func:`prepare` takes: the public operators of cupylab.foreach and the steps of
#: cupylab.optim, by module.
_PREPARABLE = (("foreach", ("add", "add_", "axpy_", "mul", "mul_", "scale_", "lerp", "lerp_",
                            "copy_", "zero_", "norm", "norms", "clip_by_global_norm_",
                            "nonfinite_check", "unscale_")),
               ("optim", ("adam_", "adamw_", "sgd_", "lion_", "increment_step_")))
_preparable_fns = None


def _preparable():
    """The functions of :data:`_PREPARABLE` (looked up at the first call:
    cupylab.ops.multi_tensor imports this module, and cupylab imports cupylab.foreach, which
    imports it, before cupylab.optim)."""
    global _preparable_fns
    if _preparable_fns is None:
        from .. import optim  # noqa: PLC0415
        from . import multi_tensor  # noqa: PLC0415

        mods = {"foreach": multi_tensor, "optim": optim}
        _preparable_fns = tuple(getattr(mods[m], n) for m, names in _PREPARABLE for n in names)
    return _preparable_fns


def prepare(fn, *args, stream=None, **kwargs):
    """Validate a foreach or optimizer call once; return a callable that only launches.

    ``call = cupylab.foreach.prepare(cupylab.foreach.add_, xs, ys, alpha=0.5)`` then
    ``call()`` in the loop: no per-array host work at all (one launch per dtype group; the
    host cost does not depend on the number of arrays). Everything is validated here, nothing
    runs here except allocations the call makes (outputs, a zeroed ``found_inf``) and the
    upload of the launch tables, which this function waits for (once, on the host), since the
    replays may run on any stream. A ``found_inf`` flag the call allocates is zeroed again at
    every replay, before the launches (see :func:`nonfinite_check`).

    Host scalars are frozen into the launch (``alpha``, ``lr``, an integer ``step``...): pass
    one-element float32 GPU arrays for values that change between calls (``lr``, ``step``,
    ``found_inf``, ``inv_scale``) and advance a device step with
    :func:`cupylab.optim.increment_step_` (which can be prepared too).

    Parameters
    ----------
    fn : callable
        A public function of :mod:`cupylab.foreach` (other than ``prepare``) or of
        :mod:`cupylab.optim`: ``add``, ``add_``, ``axpy_``, ``mul``, ``mul_``, ``scale_``,
        ``lerp``, ``lerp_``, ``copy_``, ``zero_``, ``norm``, ``norms``,
        ``clip_by_global_norm_``, ``nonfinite_check``, ``unscale_``, ``adam_``, ``adamw_``,
        ``sgd_``, ``lion_`` or ``increment_step_``.
    *args, **kwargs
        Its arguments (``stream`` excepted: pass it to ``prepare``). The arrays must stay
        alive and keep their storage while the prepared call is used (it holds references
        to them).
    stream : int or stream object, optional
        Fix the launch stream instead of following the caller's current one; the call is
        also prepared on it. The launch tables come from the memory pool of the stream the
        call is prepared on; a prepared call replayed on other streams must be dropped only
        once those replays have finished (after a synchronisation), or its tables' memory
        could be handed out again under them.

    Returns
    -------
    PreparedForeach
        Call it (no arguments) to replay; ``.result`` is what ``fn`` returned here.

    Raises
    ------
    TypeError
        ``fn`` is not one of those functions (decided by identity: a wrapper of one of them,
        a private helper or :class:`PreparedForeach` is refused).
    RuntimeError
        ``prepare`` called while another ``prepare`` runs in the same thread (from ``fn``).
    Exception
        Whatever ``fn`` raises for these arguments (nothing is then recorded).
    """
    if not any(fn is f for f in _preparable()):
        raise TypeError(f"prepare: {getattr(fn, '__name__', fn)!r} is not a cupylab.foreach "
                        "or cupylab.optim function that can be prepared (one of "
                        + ", ".join(f"{m}.{n}" for m, names in _PREPARABLE for n in names) + ")")
    with P.record() as rec:
        result = fn(*args, stream=stream, **kwargs)
    fixed = None
    if stream is not None:
        fixed = _launch.resolve_stream(stream)
    if rec.launches:
        # the call's tables were uploaded on its stream; the replays may run on another
        _, device, _, _, _, kind = rec.launches[0]
        with _launch.ensure_device(device):
            s = fixed if fixed is not None else _launch.current_stream(kind, device)
            _runtime.cupy().cuda.runtime.streamSynchronize(s)
    # the arrays, and the plans whose tables and workspace the recorded arguments point into
    return PreparedForeach(rec.launches, fixed, result, (args, kwargs, rec.plans))
