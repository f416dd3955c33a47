"""One benchmark case: an operator (its :class:`~cupylab._registry.OpSpec`), a dtype and a
shape, with inputs of one framework.

A case

1. makes fresh random operands (:class:`~cupylab.bench._operands.OperandSets`), rotated among
   several buffer sets when one call's working set is smaller than twice the L2 cache;
2. calls the cupylab operator once (with ``out=`` for torch and CuPy inputs, except for the
   row-wise operators, below) and compares a
   sample of the result (the first and last 65,536 elements and 65,536 random ones, or all of
   them) with the float64 reference of :mod:`cupylab.reference` within
   :data:`cupylab.reference.TOLERANCES`. A wrong result is ``FAILED`` and is not timed; an
   exception is ``ERROR`` (the run goes on);
3. times it by CUDA events (:meth:`~cupylab.bench._timing.Timer.events`);
4. for each requested peer the operator registers: builds the peer on the same operands
   (converted zero-copy through DLPack), checks its result too (with 4x the tolerance: peers
   may round twice), and times it (JAX by wall clock, the others by CUDA events). A peer that is
   not installed or not registered for the operator is ``None`` ("n/a"). The elementwise peers
   that can (torch eager, CuPy) write into the same rotating ``out=`` buffers as cupylab, so
   both sides move the same bytes; JAX, torch.compile and every row-wise peer allocate their
   result (``"out": false`` in the JSON). An allocating peer gets its framework's cached block
   back on every call, an output that stays in L2 at medium sizes, which a rotating ``out=``
   does not. So that both sides of a row-wise case write their results the same way, cupylab
   allocates its row-wise results too (in the caller's framework, whose cache gives the same
   block back on every call; ``"out": false`` in the result): against a rotating ``out=`` the
   allocating peer gained up to 20 % at working sets of a few L2 sizes (H100, 16-bit
   ``log_softmax_backward`` 1024 x 4096: torch 9.8 µs allocating, 11.8 µs into rotating
   ``out=`` buffers; cupylab 10.0 and 12.0 µs; docs/tuning.md). Row-wise results are also
   compared as a whole (``normwise`` in :func:`cupylab.bench._operands.compare`).
"""
from __future__ import annotations

import gc
import math
import sys
import time
import traceback

import numpy as np

from . import _frameworks, _operands
from ._timing import Timer

__all__ = ["Session", "open_session", "run_case", "result_template", "PEER_TOL_SCALE"]

#: Peers are checked with this multiple of the dtype's tolerance.
PEER_TOL_SCALE = 4.0
#: Seconds a peer may spend building wrappers for further buffer sets (a peer whose factory
#: compiles for every new closure, e.g. ``jax.jit`` of a fresh lambda, gets fewer sets).
PEER_SETUP_BUDGET_S = 0.25


class Session:
    """What the cases of one process share: CuPy, the timer, the input framework, the peers,
    the measured ceiling.

    Parameters
    ----------
    cp : module
        CuPy, with a usable GPU.
    framework : str
        ``"torch"``, ``"cupy"`` or ``"jax"``: whose arrays the inputs are.
    peers : sequence of str
        Peer names to run (subset of :data:`cupylab.bench._frameworks.PEERS`).
    repeat : int
        Timed repetitions per implementation.
    batch : int or None
        Calls per timed repetition (``None``: chosen per case).
    verbose : bool
        Print tracebacks of errors to stderr.
    """

    def __init__(self, cp, framework, peers, repeat=7, batch=None, verbose=False):
        self.cp = cp
        self.timer = Timer(cp)
        self.device = int(cp.cuda.runtime.getDevice())
        props = cp.cuda.runtime.getDeviceProperties(self.device)
        self.l2_bytes = int(props.get("l2CacheSize", 0))
        self.framework = framework
        self.fw = _frameworks.load(framework)
        self.peers = tuple(peers)
        self.repeat = int(repeat)
        self.batch = batch
        self.verbose = verbose
        self.ceiling_gbps = None
        #: one line per peer that could not be used at all (not installed, no GPU backend)
        self.peer_notes: dict = {}
        self.rng = np.random.default_rng()

    def peer_module(self, peer):
        """The module a peer's factory gets, or ``None`` (reason in :attr:`peer_notes`)."""
        fw = _frameworks.PEER_FRAMEWORK[peer]
        try:
            return _frameworks.load(fw)
        except _frameworks.Unavailable as e:
            self.peer_notes.setdefault(peer, str(e))
            return None

    def trace(self):
        if self.verbose:
            traceback.print_exc(file=sys.stderr)


def open_session(cp, framework=None, peers=("torch", "cupy", "jax"), repeat=7, batch=None,
                 verbose=False) -> Session:
    """Make a :class:`Session`; ``framework=None`` picks torch when usable, else CuPy.

    Raises
    ------
    cupylab.bench._frameworks.Unavailable
        The framework asked for cannot be used.
    """
    fw = framework or _frameworks.default_framework()
    return Session(cp, fw, peers, repeat=repeat, batch=batch, verbose=verbose)


def result_template(op, dtype, shape, framework, nbytes, flops):
    """A result record with every field of the JSON schema (nothing measured yet)."""
    return {
        "op": op, "dtype": dtype, "shape": list(shape), "n": int(math.prod(shape)),
        "framework": framework, "status": "ok", "error": None,
        "us": None, "p20": None, "p80": None, "gbps": None, "pct_ceiling": None,
        "bytes": int(nbytes), "flops": int(flops), "buffer_sets": None, "batch": None,
        "reps": None, "timing": None, "out": None, "peers": {}, "notes": [],
    }


def _err(e) -> str:
    msg = str(e).strip() or repr(e)
    return f"{type(e).__name__}: {msg}"


def _check(obj, idx, ref, dt, shape, scale=1.0, magnitude=None, normwise=False):
    """``None`` when ``obj`` is a correct result, else why not (``normwise``: see
    :func:`cupylab.bench._operands.compare`)."""
    from ..reference import TOLERANCES  # noqa: PLC0415

    got_shape = tuple(getattr(obj, "shape", ()))
    if got_shape != tuple(shape):
        return f"wrong result: shape {got_shape}, expected {tuple(shape)}"
    got_dt = _operands.dtype_name(obj)
    if got_dt != dt.name:
        return f"wrong result: dtype {got_dt}, expected {dt.name}"
    rtol, atol = TOLERANCES[dt.name]
    return _operands.compare(_operands.sample_to_host(obj, idx), ref, idx, dt, rtol * scale,
                             atol * scale, magnitude, normwise)


def _free(session, big):
    if big:
        gc.collect()
        session.cp.get_default_memory_pool().free_all_blocks()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


#: The row length a 1-D ``--size`` gives the row-wise operators (a typical hidden size)
ROW = 4096


def row_shape(spec, shape):
    """The shape a case runs at: for a row-wise operator a 1-D size ``n`` that is a multiple
    of :data:`ROW` means ``n / ROW`` rows of ``ROW`` elements (one row of 2^26 elements is
    not what ``--size 2^26`` asks of a softmax); other shapes are kept as given."""
    if _rowwise(spec) and len(shape) == 1 and shape[0] % ROW == 0:
        return (shape[0] // ROW, ROW)
    return shape


#: Tolerance scale of the row-wise operators with float32/float64 results: they depend on a
#: reduction over the row, summed in another order than the float64 reference's (about
#: sqrt(row) roundings of the result's own dtype). 16-bit results are summed in float32 and
#: rounded once: their error is about one rounding of the output, so they get a margin of 2
#: (16 let a bfloat16 result 10 % off pass).
ROW_TOL_SCALE = 16.0
ROW_TOL_SCALE_16 = 2.0


def _rowwise(spec):
    return getattr(spec, "rowwise", False)


def _tol_scale(spec, dt):
    """The row-wise operators' results are also checked as a whole (``normwise``): their
    scaled ``atol`` exceeds a long row's softmax values."""
    if not _rowwise(spec):
        return 1.0
    return ROW_TOL_SCALE_16 if dt.itemsize == 2 else ROW_TOL_SCALE


def run_case(session: Session, spec, dtype: str, shape) -> dict:
    """Check and time one case; never raises for a failing operator or peer.

    Parameters
    ----------
    session : Session
    spec : cupylab._registry.OpSpec
    dtype : str
        Canonical dtype name, or ``a+b`` for a mixed-dtype case (the inputs' dtypes; the
        output's is NumPy's promotion of them).
    shape : tuple of int

    Returns
    -------
    dict
        The result record (see :func:`result_template`): ``status`` is ``"ok"``,
        ``"FAILED"`` (wrong result, not timed) or ``"ERROR"`` (an exception; ``error`` says
        which).
    """
    from .. import _dtypes  # noqa: PLC0415
    from ..reference import MAGNITUDES, reference  # noqa: PLC0415

    shape = row_shape(spec, tuple(int(e) for e in shape))
    n = math.prod(shape)
    in_dts = None
    if "+" in dtype:  # a mixed-dtype case: the inputs' dtypes, the output by NumPy's rule
        in_dts = _mixed_dtypes(spec, dtype)
        dt = _mixed_result(spec, in_dts)
        nbytes = n * (sum(d.itemsize for d in in_dts) + dt.itemsize)
    else:
        dt = _dtypes.from_name(dtype)
        nbytes = spec.bytes(n, dt.itemsize)
    res = result_template(spec.name, dtype if in_dts else dt.name, shape, session.framework,
                          nbytes, spec.flops(n))
    fw = session.framework
    rowwise = _rowwise(spec)
    # JAX (immutable arrays) and the row-wise operators (whose peers all allocate): cupylab
    # allocates the result and no out= buffers are made; otherwise cupylab and the peers that
    # take out= write the same rotating out= buffers
    res["out"] = fw != "jax" and not rowwise
    sets = None
    try:
        nsets = _operands.buffer_sets(nbytes, session.l2_bytes)
        sets = _operands.OperandSets(session.cp, dt, shape, spec.n_inputs, nsets,
                                     with_out=res["out"], in_dts=in_dts)
        res["buffer_sets"] = nsets
        # row-wise operators (spec.rowwise) are checked on whole rows (last axis)
        idx = (_operands.sample_rows(shape, session.rng) if rowwise
               else _operands.sample_indices(n, session.rng))
        host = sets.host_inputs(0, idx)
        if rowwise:
            host = [h.reshape(-1, shape[-1]) for h in host]
        ref = reference(spec.reference, *host, dtype=np.dtype(dt.name) if dt.kind == "i" else None)
        if rowwise:
            ref = np.asarray(ref).reshape(-1)
        mag = MAGNITUDES.get(spec.reference)
        if mag is not None:
            mag = np.asarray(mag(*host)).reshape(-1)
        calls = [_bind(spec.fn, sets.inputs(fw, j), sets.out(fw, j) if res["out"] else None)
                 for j in range(nsets)]
    except Exception as e:  # noqa: BLE001 - out of memory, missing ml_dtypes ...
        session.trace()
        res["status"], res["error"] = "ERROR", f"setup: {_err(e)}"
        _release(session, sets, nbytes)
        return res

    try:
        got = calls[0]()
        session.timer.sync()
        bad = _check(got, idx, ref, dt, shape, _tol_scale(spec, dt), mag, rowwise)
        del got
        if bad:
            res["status"], res["error"] = "FAILED", bad
            _release(session, sets, nbytes)
            return res
        st = session.timer.events(calls, session.repeat, session.batch)
    except Exception as e:  # noqa: BLE001 - the operator raised: report it, go on
        session.trace()
        res["status"], res["error"] = "ERROR", _err(e)
        _release(session, sets, nbytes)
        return res
    del calls
    res.update(us=st.median, p20=st.p20, p80=st.p80, batch=st.batch, reps=st.reps,
               timing=st.method)
    res["gbps"] = nbytes / (max(st.median, 1e-9) * 1e3)
    if session.ceiling_gbps:
        res["pct_ceiling"] = 100.0 * res["gbps"] / session.ceiling_gbps

    for peer in session.peers:
        res["peers"][peer] = _run_peer(session, spec, peer, sets, idx, ref, mag, dt, shape,
                                       st.median, res["notes"])
    _release(session, sets, nbytes)
    return res


def _mixed_dtypes(spec, dtype):
    """``a+b`` -> the inputs' DTypes (the last repeats for further inputs)."""
    from .. import _dtypes  # noqa: PLC0415

    ds = [_dtypes.from_name(p) for p in dtype.split("+")]
    if len(ds) > spec.n_inputs:
        raise ValueError(f"{spec.name} takes {spec.n_inputs} inputs; {dtype} names {len(ds)}")
    return ds + [ds[-1]] * (spec.n_inputs - len(ds))


def _mixed_result(spec, in_dts):
    """The output dtype of a mixed-dtype case: NumPy's promotion of the inputs."""
    from .. import _promotion  # noqa: PLC0415

    keys = tuple(("a", d.name, False) for d in in_dts)
    op = "fused_add_mul" if spec.n_inputs == 3 else "add"
    return _promotion.resolve("numpy", op, keys)[1]


def _bind(fn, ins, out):
    if out is None:
        return lambda: fn(*ins)
    return lambda: fn(*ins, out=out)


def _release(session, sets, nbytes):
    if sets is not None:
        sets.release()
    _free(session, nbytes >= 1 << 28)


def _run_peer(session, spec, peer, sets, idx, ref, mag, dt, shape, us, notes):
    factory = spec.peers.get(peer)
    if factory is None:
        return None
    mod = session.peer_module(peer)
    if mod is None:
        return None
    fw = _frameworks.PEER_FRAMEWORK[peer]
    fns = []
    t_start = None
    use_out = sets.out_pool is not None  # made where cupylab writes out= (not JAX, not rows)
    wrote_out = False
    if peer == "torch.compile":
        # every case compiles afresh, for its own static shape: without this, the second
        # shape of a bench run recompiles the peer's function with dynamic shapes (and past
        # Dynamo's recompile limit, falls back to eager)
        dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing compiled yet
        if dynamo is not None:
            dynamo.reset()
    try:
        for j in range(sets.nsets):
            kw = {"out": sets.out(fw, j)} if use_out else {}
            if use_out and j == 0:
                sets.poison_out(0)  # cupylab's result is there: the peer must write its own
            f = factory(mod, *sets.inputs(fw, j), **kw)
            r = f()
            if j == 0:
                _block(fw, mod, session, r)
                bad = _check(r, idx, ref, dt, shape, PEER_TOL_SCALE * _tol_scale(spec, dt), mag,
                             _rowwise(spec))
                if bad:
                    return {"us": None, "ratio": None, "error": bad}
                wrote_out = use_out and r is kw["out"]
                t_start = time.perf_counter()
            fns.append(f)
            del r
            if time.perf_counter() - t_start > PEER_SETUP_BUDGET_S:
                break
        if fw == "jax":
            st = session.timer.wall(fns, session.repeat, session.batch, block=mod.block_until_ready)
        else:
            st = session.timer.events(fns, session.repeat, session.batch)
    except TypeError as e:  # the peer does not take this dtype (CuPy and bfloat16 ...)
        session.trace()
        notes.append(f"{peer}: n/a ({_err(e)})")
        return None
    except Exception as e:  # noqa: BLE001 - a broken peer is reported, never fatal
        session.trace()
        return {"us": None, "ratio": None, "error": _err(e)}
    if len(fns) < sets.nsets:
        notes.append(f"{peer}: timed on fewer buffer sets than cupylab (its factory compiles "
                     "anew for each set; peers.{peer}.buffer_sets in the JSON says how many)"
                     .replace("{peer}", peer))
    return {"us": st.median, "p20": st.p20, "p80": st.p80, "ratio": st.median / max(us, 1e-9),
            "timing": st.method, "batch": st.batch, "buffer_sets": len(fns), "out": wrote_out}


def _block(fw, mod, session, r):
    if fw == "jax":
        mod.block_until_ready(r)
    else:
        session.timer.sync()
