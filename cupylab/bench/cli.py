"""``cupylab-bench``: benchmark every registered cupylab operator against its peers.

Commands
--------
(none)      the quick suite: every registered operator, float32 and bfloat16, 2^20 and 2^26
            elements, against torch / CuPy / JAX (those installed); one table.
run         chosen cases: ``run [OPS...] --dtype ... --size ... --framework ... --repeat N``.
list        the registered cases: operator, shapes, dtypes, bytes moved and FLOPs, peers.
ceiling     this GPU's streaming bandwidth and launch floor.
overhead    host cost per call of tiny inputs, cupylab beside the peers.
plot        bandwidth against size per operator from a result file (needs matplotlib).
show        print the table of a stored result file (plain text or Markdown).

Exit codes: 0 all cases correct, 1 a case FAILED (wrong result) or raised (ERROR), 2 bad
arguments or no usable CUDA GPU, 130 interrupted.

This module imports neither CuPy, torch nor JAX at import time (``--help`` and ``list`` work on
machines without a GPU); each command imports what it needs when it runs.
"""
from __future__ import annotations

import functools
import os
import re
import signal
import sys
import time

import click

__all__ = ["cli", "main", "parse_sizes", "QUICK_DTYPES", "QUICK_SIZES", "DEFAULT_PEERS"]

#: dtypes of the quick suite (and of ``run`` without ``--dtype``).
QUICK_DTYPES = ("float32", "bfloat16")
#: sizes of the quick suite (and of ``run`` without ``--size``).
QUICK_SIZES = ("2^20", "2^26")
#: peers run unless ``--peers`` says otherwise (``--compile`` adds ``torch.compile``).
DEFAULT_PEERS = ("torch", "cupy", "jax")
#: timed repetitions per implementation unless ``--repeat`` says otherwise.
DEFAULT_REPEAT = 7

_METHOD = ("each case checked against the float64 reference (first and last 65536 elements and "
           "65536 random ones, or all) before timing; cupylab called with out= (torch/CuPy "
           "inputs) except for the row-wise operators, whose peers allocate their results: "
           "there cupylab allocates too (\"out\": false); GPU time per call by CUDA events on "
           "the default stream over batches of K back-to-back calls after warm-up, behind a hold "
           "kernel when launch-bound; median and p20/p80 over the repetitions; inputs rotated "
           "among buffer sets spanning 2x L2 when one call's working set is smaller; JAX peers "
           "by wall clock with block_until_ready; GB/s from the bytes the operator must move "
           "(OpSpec.bytes)")

_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64",
          "int32": "i32", "int64": "i64"}

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


# ------------------------------------------------------------------------------ selection
def _registry() -> dict:
    """Every registered OpSpec (imports each module of :mod:`cupylab.ops`; no CuPy)."""
    import importlib  # noqa: PLC0415
    import pkgutil  # noqa: PLC0415

    import cupylab  # noqa: F401, PLC0415 - registers the built-in operators
    import cupylab.ops  # noqa: PLC0415
    from cupylab._registry import OPS  # noqa: PLC0415

    for m in pkgutil.iter_modules(cupylab.ops.__path__):
        name = f"cupylab.ops.{m.name}"
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - one broken module must not hide the rest
                click.echo(f"cupylab-bench: warning: {name} failed to import ({e})", err=True)
    return OPS


def _split(values):
    out = []
    for v in values or ():
        out += [t.strip() for t in str(v).split(",") if t.strip()]
    return out


def _select_ops(OPS, names):
    names = _split(names)
    valid = ", ".join(OPS)
    if not names or names == ["all"]:
        return list(OPS.values())
    out = []
    for n in names:
        if n not in OPS:
            raise click.BadParameter(f"unknown operator {n!r}; registered operators: {valid}",
                                     param_hint="OPS")
        if OPS[n] not in out:
            out.append(OPS[n])
    return out


def _all_dtypes(OPS):
    from cupylab import _dtypes  # noqa: PLC0415

    seen = {d for s in OPS.values() for d in s.dtypes}
    return [d for d in _dtypes.DTYPES if d in seen]


def _select_dtypes(OPS, names):
    """Canonical dtype names, or mixed-dtype cases written ``a+b`` (the inputs' dtypes in
    order; the last one repeats for further inputs), e.g. ``float32+float16``."""
    from cupylab import _dtypes  # noqa: PLC0415

    names = _split(names)
    valid = _all_dtypes(OPS)
    if names == ["all"]:
        return valid
    out = []
    for n in names:
        parts = []
        for part in n.split("+"):
            try:
                d = _dtypes.from_name(part.strip().lower()).name
            except TypeError:
                d = None
            if d not in valid:
                raise click.BadParameter(
                    f"unknown dtype {part!r}; valid dtypes: {', '.join(valid)} (or 'all'; "
                    "aliases such as fp32, bf16 are accepted; mixed inputs as a+b, e.g. "
                    "float32+float16)", param_hint="'--dtype'")
            parts.append(d)
        d = "+".join(parts)
        if d not in out:
            out.append(d)
    return out


def _takes(spec, d):
    """Whether the registered case ``spec`` runs dtype (or ``a+b`` dtype mix) ``d``."""
    return all(p in spec.dtypes for p in d.split("+"))


_POW = re.compile(r"^2(?:\^|\*\*)(\d+)$")
_RANGE = re.compile(r"^2(?:\^|\*\*)(\d+)\.\.2(?:\^|\*\*)(\d+)(?::(\d+))?$")


_MAX_EXP = 48  # 2^48 elements: far beyond any GPU's memory, and a bound on range lengths


def _exp(text):
    k = int(text)
    if k > _MAX_EXP:
        raise ValueError(text)
    return k


def _parse_int(tok):
    m = _POW.match(tok)
    if m:
        return 1 << _exp(m.group(1))
    t = tok.replace("_", "")
    if t.isdigit():
        return int(t)
    try:
        f = float(t)
    except ValueError:
        f = None
    if f is not None and f.is_integer() and f >= 0:
        return int(f)
    raise ValueError(tok)


def parse_sizes(values):
    """Parse ``--size`` values into shapes.

    Accepted: ``1048576``, ``2^20`` (or ``2**20``), ``1e6``, ``4096x4096`` (a 2-D shape),
    ``2^10..2^28`` (every power of two in between) and ``2^10..2^28:2`` (every second power),
    several separated by commas.

    Returns
    -------
    list of tuple of int

    Raises
    ------
    click.BadParameter
    """
    shapes = []
    for tok in _split(values):
        t = tok.lower().replace(" ", "")
        try:
            m = _RANGE.match(t)
            if m:
                a, b, step = _exp(m.group(1)), _exp(m.group(2)), int(m.group(3) or 1)
                if b < a or step < 1:
                    raise ValueError(tok)
                shapes += [(1 << k,) for k in range(a, b + 1, step)]
                continue
            dims = tuple(_parse_int(d) for d in t.split("x"))
        except ValueError:
            raise click.BadParameter(
                f"cannot read size {tok!r}; use e.g. 1048576, 2^20, 4096x4096, 2^10..2^28 or "
                f"2^10..2^28:2 (exponents up to {_MAX_EXP})", param_hint="'--size'") from None
        if not dims or any(d < 1 for d in dims):
            raise click.BadParameter(f"size {tok!r} has no elements", param_hint="'--size'")
        if dims not in shapes:
            shapes.append(dims)
    return shapes


def _select_peers(text, compile_):
    from ._frameworks import PEERS  # noqa: PLC0415

    names = _split([text]) if text is not None else list(DEFAULT_PEERS)
    if names == ["none"]:
        names = []
    elif names == ["all"]:
        names = list(PEERS)
    for n in names:
        if n not in PEERS:
            raise click.BadParameter(f"unknown peer {n!r}; peers: {', '.join(PEERS)} (or 'all', "
                                     "'none')", param_hint="'--peers'")
    if compile_ and "torch.compile" not in names:
        names.append("torch.compile")
    return [p for p in PEERS if p in names]


def _check_out_path(path, hint):
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise click.BadParameter(f"directory {parent} does not exist", param_hint=hint)


# ------------------------------------------------------------------------------ environment
def _no_gpu_detail(e) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    for prefix in ("cupylab: no usable CUDA GPU on this machine", "cupylab:"):
        if text.startswith(prefix):
            text = text[len(prefix):].strip()
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    return text or type(e).__name__


def _require_gpu(ctx):
    """CuPy with a usable GPU, or one line on stderr and exit code 2."""
    from cupylab import _runtime  # noqa: PLC0415

    try:
        cp = _runtime.cupy()
        cp.cuda.runtime.getDevice()
    except Exception as e:  # noqa: BLE001 - NoGPUError, a broken CuPy install, driver errors
        click.echo(f"cupylab-bench: no usable CUDA GPU: {_no_gpu_detail(e)}", err=True)
        ctx.exit(2)
    return cp


def _argv(ctx):
    obj = ctx.find_root().obj
    if isinstance(obj, dict) and obj.get("argv"):
        return list(obj["argv"])
    return ["cupylab-bench", *sys.argv[1:]]


def _group_opts(ctx):
    obj = ctx.find_root().obj
    return obj.get("group", {}) if isinstance(obj, dict) else {}


def _merged(ctx, name, value):
    if value not in (None, (), False):
        return value
    g = _group_opts(ctx).get(name)
    return g if g not in (None, ()) else value


class _Progress:
    """A click progress bar on stderr when it is a terminal; otherwise plain ``[i/N] case``
    lines (no control codes), at most one every ``every`` seconds (every case when verbose);
    nothing when disabled."""

    def __init__(self, total, enabled=True, label="cupylab-bench", every=5.0):
        self.total, self.enabled, self.label, self.every = total, enabled, label, every
        self.bar = None
        self.i = 0
        self.t0 = time.perf_counter()
        self.last = None

    def __enter__(self):
        if self.enabled and self.total > 1 and sys.stderr.isatty():
            self.bar = click.progressbar(length=self.total, label=self.label, file=sys.stderr,
                                         show_pos=True, update_min_steps=0,
                                         item_show_func=lambda s: s or "")
            self.bar.__enter__()
        return self

    def start(self, text):
        self.i += 1
        if self.bar is not None:
            self.bar.update(0, text)
            return
        now = time.perf_counter()
        if self.enabled and (self.last is None or now - self.last >= self.every
                             or self.i == self.total):
            self.last = now
            click.echo(f"[{self.i}/{self.total}] {text} ({now - self.t0:.0f} s)", err=True)

    def done(self):
        if self.bar is not None:
            self.bar.update(1)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)
        return False


def _write_outputs(doc, json_path, csv_path) -> bool:
    """Write the requested result files; ``False`` (after a message on stderr) when one could
    not be written or does not match the schema."""
    from . import _report  # noqa: PLC0415

    ok = True
    for path, fn in ((json_path, _report.write_json), (csv_path, _report.write_csv)):
        if path:
            try:
                fn(path, doc)
                click.echo(f"wrote {path}")
            except (OSError, ValueError) as e:
                click.echo(f"cupylab-bench: {path}: {e}", err=True)
                ok = False
    return ok


# ------------------------------------------------------------------------------ options
def _run_options(f):
    opts = [
        click.option("-d", "--dtype", "dtype", multiple=True, metavar="DTYPE",
                     help=f"dtype(s), repeatable or comma-separated, or 'all' "
                          f"[default: {','.join(QUICK_DTYPES)}]"),
        click.option("-s", "--size", "size", multiple=True, metavar="SIZE",
                     help="element count(s): 1048576, 2^20, 4096x4096, 2^10..2^28, 2^10..2^28:2 "
                          "(every second power); for row-wise operators a size n that is a "
                          "multiple of 4096 means n/4096 rows of 4096 "
                          f"[default: {','.join(QUICK_SIZES)}]"),
        click.option("-f", "--framework", type=click.Choice(["auto", "torch", "cupy", "jax"]),
                     default=None, help="whose arrays the inputs are [default: torch if it can "
                                        "use the GPU, else cupy]"),
        click.option("--peers", default=None, metavar="LIST",
                     help="peers to compare with, comma-separated: torch, torch.compile, cupy, "
                          f"jax, 'all' or 'none' [default: {','.join(DEFAULT_PEERS)}]"),
        click.option("--compile", "compile_", is_flag=True, default=False,
                     help="also compare with torch.compile where the operator registers it"),
        click.option("-r", "--repeat", type=click.IntRange(min=1), default=None,
                     help=f"timed repetitions per implementation [default: {DEFAULT_REPEAT}]"),
        click.option("--batch", type=click.IntRange(min=1), default=None,
                     help="back-to-back calls per repetition [default: about 2 ms of work, "
                          "10 to 200 calls]"),
        click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
                     help="write the results as JSON"),
        click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
                     help="write the results as CSV"),
        click.option("-q", "--quiet", is_flag=True, default=False, help="no progress output"),
        click.option("-v", "--verbose", is_flag=True, default=False,
                     help="print tracebacks of errors to stderr"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _out_options(f):
    f = click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None,
                     help="write the results as CSV")(f)
    f = click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
                     help="write the results as JSON")(f)
    return f


def _print_version(ctx, _param, value):
    if not value or ctx.resilient_parsing:
        return
    import cupylab  # noqa: PLC0415

    click.echo(f"cupylab-bench (cupylab {cupylab.__version__})")
    ctx.exit(0)


# ------------------------------------------------------------------------------ commands
@click.group(invoke_without_command=True, context_settings=_CONTEXT)
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_print_version, help="print the version and exit")
@_run_options
@click.pass_context
def cli(ctx, **opts):
    """Benchmark cupylab's operators against torch, CuPy and JAX on this GPU.

    With no command: the quick suite (every registered operator, float32 and bfloat16, 2^20
    and 2^26 elements, peers torch, CuPy and JAX where installed), one table. The options
    below apply to it (and are defaults for the commands).

    Every case is checked against the float64 reference before it is timed (a wrong result is
    FAILED and not timed). Times ("us": microseconds) are GPU time per call by CUDA events
    after warm-up (median of --repeat batches, p20-p80 spread), inputs rotated among buffer
    sets when they fit in L2;
    GB/s counts the bytes the operator must move; %ceil compares with the ceiling measured in
    the same process; a peer's "x" column is peer time / cupylab time (above 1: cupylab is
    faster).

    Exit codes: 0 all correct; 1 a case FAILED or raised; 2 bad arguments or no usable CUDA
    GPU; 130 interrupted.
    """
    ctx.ensure_object(dict)
    ctx.obj["group"] = opts
    if ctx.invoked_subcommand is None:
        ctx.invoke(run_cmd)


def _interrupt_exits_130(fn):
    """Ctrl-C anywhere in the command (the ceiling's measurement, writing the results) ends
    it with status 130, as an interrupted case loop does; click's own "Aborted!" exits 1,
    which this command reserves for a failed case."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo("\ncupylab-bench: interrupted", err=True)
            raise click.exceptions.Exit(130) from None
    return wrapper


@cli.command("run", context_settings=_CONTEXT)
@click.argument("ops", nargs=-1, metavar="[OPS]...")
@_run_options
@click.pass_context
@_interrupt_exits_130
def run_cmd(ctx, ops, dtype, size, framework, peers, compile_, repeat, batch, json_path,
            csv_path, quiet, verbose):
    """Check and time chosen cases.

    OPS are registered operator names (see `cupylab-bench list`; default: all). Each case is
    an operator x dtype x size, with inputs of one framework; every peer the operator
    registers (and that is installed) runs on the same inputs, converted zero-copy.

    \b
    Examples:
      cupylab-bench run vector_add fused_add_mul --dtype fp32,bf16 --size 2^24
      cupylab-bench run --dtype all --size 2^10..2^28:2 --json sweep.json --csv sweep.csv
      cupylab-bench run fused_add_mul --compile --size 2^26 --framework torch
    """
    dtype = _merged(ctx, "dtype", dtype)
    size = _merged(ctx, "size", size)
    framework = _merged(ctx, "framework", framework)
    peers = _merged(ctx, "peers", peers)
    compile_ = _merged(ctx, "compile_", compile_)
    repeat = _merged(ctx, "repeat", repeat) or DEFAULT_REPEAT
    batch = _merged(ctx, "batch", batch)
    json_path = _merged(ctx, "json_path", json_path)
    csv_path = _merged(ctx, "csv_path", csv_path)
    quiet = _merged(ctx, "quiet", quiet)
    verbose = _merged(ctx, "verbose", verbose)

    OPS = _registry()
    specs = _select_ops(OPS, ops)
    dtypes = _select_dtypes(OPS, dtype or QUICK_DTYPES)
    shapes = parse_sizes(size or QUICK_SIZES)
    peer_list = _select_peers(peers, compile_)
    _check_out_path(json_path, "'--json'")
    _check_out_path(csv_path, "'--csv'")
    cases = [(s, d, sh) for s in specs for d in dtypes if _takes(s, d) for sh in shapes]
    skipped = [(s.name, d) for s in specs for d in dtypes if not _takes(s, d)]
    if not cases:
        raise click.UsageError("no case to run: none of the chosen operators supports "
                               f"{', '.join(dtypes)}")

    cp = _require_gpu(ctx)
    from . import _cases, _ceiling, _env, _frameworks, _report  # noqa: PLC0415

    try:
        session = _cases.open_session(cp, None if framework in (None, "auto") else framework,
                                      peer_list, repeat=repeat, batch=batch, verbose=verbose)
    except _frameworks.Unavailable as e:
        click.echo(f"cupylab-bench: --framework {framework}: {e}", err=True)
        ctx.exit(2)
    t0 = time.perf_counter()
    env = _env.collect(cp, _argv(ctx))
    click.echo(_report.env_line(env))
    click.echo(f"inputs: {session.framework} arrays; peers: {', '.join(peer_list) or 'none'}; "
               f"{len(cases)} cases; GPU time per call by CUDA events, median of {repeat} "
               "batches (p20-p80)")
    ceiling, code = None, 0
    try:
        ceiling = _ceiling.measure(session)
        for line in _report.ceiling_lines(ceiling):
            click.echo(line)
    except Exception as e:  # noqa: BLE001 - report, run the cases without %ceil
        session.trace()
        click.echo(f"ceiling: measurement failed ({type(e).__name__}: {e}); %ceil left empty")
        code = 1

    results, interrupted = [], False
    with _Progress(len(cases), not quiet, every=0.0 if verbose else 5.0) as prog:
        try:
            for spec, d, sh in cases:
                prog.start(f"{spec.name} {d} {_report.shape_str(sh)}")
                results.append(_cases.run_case(session, spec, d, sh))
                prog.done()
        except KeyboardInterrupt:
            interrupted = True
    click.echo("")
    for line in _report.results_table(results):
        click.echo(line)
    extra = _report.notes_lines(results)
    extra += [f"peer {p}: n/a ({why})" for p, why in session.peer_notes.items()]
    timings = {e.get("timing") for r in results for e in (r.get("peers") or {}).values() if e}
    if "wall" in timings:
        extra.append("jax times are wall clock (K calls, then block_until_ready): at small sizes "
                     "they include the host's dispatch, which the CUDA-event times do not")
    if skipped:
        extra.append("skipped (dtype not registered for the operator): "
                     + ", ".join(f"{op} {d}" for op, d in skipped))
    if extra:
        click.echo("")
        for line in extra:
            click.echo(line)
    n_ok = sum(r["status"] == "ok" for r in results)
    n_failed = sum(r["status"] == "FAILED" for r in results)
    n_error = sum(r["status"] == "ERROR" for r in results)
    click.echo("")
    click.echo(f"{len(results)} of {len(cases)} cases: {n_ok} ok, {n_failed} FAILED, {n_error} "
               f"ERROR in {time.perf_counter() - t0:.1f} s"
               + (" (interrupted)" if interrupted else ""))
    config = {"ops": [s.name for s in specs], "dtypes": dtypes,
              "sizes": [list(s) for s in shapes], "framework": session.framework,
              "peers": peer_list, "repeat": repeat, "batch": batch,
              "l2_bytes": session.l2_bytes, "interrupted": interrupted,
              "method": _METHOD}
    doc = _report.build_doc("run", env, ceiling, results, (), config)
    if not _write_outputs(doc, json_path, csv_path):
        code = 1
    if interrupted:
        ctx.exit(130)
    ctx.exit(1 if (n_failed or n_error or code) else 0)


@cli.command("list", context_settings=_CONTEXT)
@click.argument("ops", nargs=-1, metavar="[OPS]...")
@click.option("-d", "--dtype", "dtype", multiple=True, metavar="DTYPE",
              help=f"dtype(s) or 'all' [default: {','.join(QUICK_DTYPES)}]")
@click.option("-s", "--size", "size", multiple=True, metavar="SIZE",
              help=f"size(s), as for run [default: {','.join(QUICK_SIZES)}]")
def list_cmd(ops, dtype, size):
    """List the registered operators and the cases a run would measure.

    Needs no GPU. Per case: operator, dtype, shape, the bytes the operator must move and the
    FLOPs it does, and the peers registered for it.
    """
    from cupylab import _dtypes  # noqa: PLC0415

    from . import _frameworks, _report  # noqa: PLC0415

    OPS = _registry()
    specs = _select_ops(OPS, ops)
    dtypes = _select_dtypes(OPS, dtype or QUICK_DTYPES)
    shapes = parse_sizes(size or QUICK_SIZES)

    def peers_of(spec):
        return [p for p in _frameworks.PEERS if spec.peers.get(p) is not None]

    click.echo(f"{len(OPS)} registered operators:")
    sizes = sorted({_dtypes.from_name(d).itemsize for s in specs for d in s.dtypes})
    rows = []
    for s in specs:
        per = "/".join(str(s.bytes_per_element(i)) for i in sizes)
        rows.append([s.name, str(s.n_inputs), per, str(s.flops_per_element),
                     ",".join(_SHORT.get(d, d) for d in s.dtypes), " ".join(peers_of(s)),
                     s.description])
    for line in _report.render(
            ["op", "inputs", f"bytes/elem ({'/'.join(f'{i}B' for i in sizes)} dtypes)",
             "FLOPs/elem", "dtypes", "peers", "what"],
            rows, [False, True, True, True, False, False, False]):
        click.echo("  " + line)

    click.echo("")
    click.echo(f"cases for dtypes {','.join(dtypes)} and sizes "
               f"{', '.join(_report.shape_str(s) for s in shapes)}:")
    rows = []
    for s in specs:
        for d in dtypes:
            if d not in s.dtypes:
                continue
            isz = _dtypes.from_name(d).itemsize
            for sh in shapes:
                n = 1
                for e in sh:
                    n *= e
                rows.append([s.name, d, _report.shape_str(sh), str(n),
                             _report.human_bytes(s.bytes(n, isz)), _report.human_count(s.flops(n)),
                             " ".join(peers_of(s))])
    for line in _report.render(["op", "dtype", "shape", "elements", "moves", "FLOPs", "peers"],
                               rows, [False, False, False, True, True, True, False]):
        click.echo("  " + line)
    click.echo("")
    have, missing = [], []
    for fw in _frameworks.FRAMEWORKS:
        v = _frameworks.version(fw) if _frameworks.installed(fw) else None
        (have if v or _frameworks.installed(fw) else missing).append(f"{fw} {v or ''}".strip())
    click.echo(f"frameworks installed: {', '.join(have) or 'none'}"
               + (f"; not installed (their peers show n/a): {', '.join(missing)}"
                  if missing else ""))
    click.echo("torch.compile peers run only with --compile. "
               "`cupylab-bench` with no command runs the cases listed with no options.")


@cli.command("ceiling", context_settings=_CONTEXT)
@click.option("-r", "--repeat", type=click.IntRange(min=1), default=None,
              help=f"timed repetitions [default: {DEFAULT_REPEAT}]")
@click.option("--mib", type=click.IntRange(min=1), default=1024, show_default=True,
              help="size of each buffer, MiB")
@_out_options
@click.option("-v", "--verbose", is_flag=True, default=False, help="print tracebacks")
@click.pass_context
def ceiling_cmd(ctx, repeat, mib, json_path, csv_path, verbose):
    """Measure this GPU's streaming bandwidth and launch floor.

    Bandwidth (bytes read + written per second): the best of a device-to-device memcpy and a
    float4 grid-stride copy kernel at several grid sizes. Launch floor: GPU time per empty
    kernel launched back to back, and host time per launch.
    """
    repeat = _merged(ctx, "repeat", repeat) or DEFAULT_REPEAT
    json_path = _merged(ctx, "json_path", json_path)
    csv_path = _merged(ctx, "csv_path", csv_path)
    _check_out_path(json_path, "'--json'")
    _check_out_path(csv_path, "'--csv'")
    cp = _require_gpu(ctx)
    from . import _cases, _ceiling, _env, _report  # noqa: PLC0415

    session = _cases.Session(cp, "cupy", (), repeat=repeat, verbose=verbose)
    env = _env.collect(cp, _argv(ctx))
    click.echo(_report.env_line(env))
    try:
        ceiling = _ceiling.measure(session, nbytes=mib << 20)
    except Exception as e:  # noqa: BLE001
        session.trace()
        click.echo(f"cupylab-bench: ceiling measurement failed: {type(e).__name__}: {e}", err=True)
        ctx.exit(1)
    for line in _report.ceiling_lines(ceiling):
        click.echo(line)
    doc = _report.build_doc("ceiling", env, ceiling, (), (), {"repeat": repeat, "mib": mib})
    ctx.exit(0 if _write_outputs(doc, json_path, csv_path) else 1)


@cli.command("overhead", context_settings=_CONTEXT)
@click.option("-f", "--framework", "frameworks", multiple=True,
              type=click.Choice(["torch", "cupy"]),
              help="input framework(s) [default: torch (if installed) and cupy]")
@click.option("--calls", type=click.IntRange(min=100), default=3000, show_default=True,
              help="back-to-back calls per round")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="rounds per callable (median reported)")
@_out_options
@click.option("-q", "--quiet", is_flag=True, default=False, help="no progress output")
@click.option("-v", "--verbose", is_flag=True, default=False, help="print tracebacks")
@click.pass_context
def overhead_cmd(ctx, frameworks, calls, rounds, json_path, csv_path, quiet, verbose):
    """Host cost per call for tiny inputs (1024 float32), cupylab beside the peers.

    Wall clock over --calls back-to-back calls ending in a synchronize, after warm-up; cupylab
    and the peer alternate over --rounds rounds. Rows: add with and without out=,
    fused_add_mul, cupylab.prepare (when it exists), one add replayed in a CUDA graph of 100;
    for torch and CuPy inputs.
    """
    json_path = _merged(ctx, "json_path", json_path)
    csv_path = _merged(ctx, "csv_path", csv_path)
    quiet = _merged(ctx, "quiet", quiet)
    _check_out_path(json_path, "'--json'")
    _check_out_path(csv_path, "'--csv'")
    cp = _require_gpu(ctx)
    from . import _cases, _ceiling, _env, _frameworks, _overhead, _report  # noqa: PLC0415

    if not frameworks:
        frameworks = (("torch",) if _frameworks.installed("torch") else ()) + ("cupy",)
    env = _env.collect(cp, _argv(ctx))
    click.echo(_report.env_line(env))
    session = _cases.Session(cp, "cupy", (), verbose=verbose)
    ceiling = None
    try:
        ceiling = _ceiling.measure(session)
        click.echo(_report.ceiling_lines(ceiling)[1])
    except Exception as e:  # noqa: BLE001 - the overhead rows do not need it
        click.echo(f"launch floor: measurement failed ({type(e).__name__}: {e})")
    click.echo(f"host cost per call, {_overhead.N} float32 elements unless the row names its "
               f"size: wall clock over {calls} "
               f"back-to-back calls ending in a synchronize, median of {rounds} rounds (us)")

    def progress(text):
        if not quiet:
            click.echo(f"  {text}", err=True)

    rows = _overhead.measure(cp, frameworks, calls=calls, rounds=rounds, progress=progress)
    click.echo("")
    for line in _report.overhead_table(rows):
        click.echo(line)
    doc = _report.build_doc("overhead", env, ceiling, (), rows,
                            {"frameworks": list(frameworks), "calls": calls, "rounds": rounds,
                             "n": _overhead.N})
    written = _write_outputs(doc, json_path, csv_path)
    ctx.exit(1 if not written or any(r.get("error") for r in rows) else 0)


@cli.command("plot", context_settings=_CONTEXT)
@click.argument("results", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="image to write (.png, .svg, .pdf)")
@click.option("--peer", "peers", multiple=True, default=("torch",), show_default=True,
              help="peer(s) to draw beside cupylab (dashed)")
@click.pass_context
def plot_cmd(ctx, results, output, peers):
    """Draw GB/s against size per operator from RESULTS (a --json file), with the ceiling.

    Needs matplotlib (pip install cupylab[plot]).
    """
    from . import _plot, _report  # noqa: PLC0415

    _check_out_path(output, "'--output'")
    try:
        doc = _report.load(results)
    except (ValueError, OSError) as e:
        click.echo(f"cupylab-bench plot: {e}", err=True)
        ctx.exit(2)
    try:
        n = _plot.plot(doc, output, peers=peers)
    except _plot.MatplotlibMissing:
        click.echo(_plot.MISSING_MESSAGE, err=True)
        ctx.exit(2)
    except ValueError as e:
        click.echo(f"cupylab-bench plot: {results}: {e}", err=True)
        ctx.exit(2)
    click.echo(f"wrote {output} ({n} operators)")


@cli.command("show", context_settings=_CONTEXT)
@click.argument("results", type=click.Path(exists=True, dir_okay=False))
@click.option("--markdown", is_flag=True, default=False, help="Markdown tables")
@click.pass_context
def show_cmd(ctx, results, markdown):
    """Print the tables of a stored result file (RESULTS, from --json)."""
    import shlex  # noqa: PLC0415

    from . import _report  # noqa: PLC0415

    try:
        doc = _report.load(results)
    except (ValueError, OSError) as e:
        click.echo(f"cupylab-bench show: {e}", err=True)
        ctx.exit(2)
    env = doc["env"]
    click.echo(_report.env_line(env))
    click.echo(f"command: {shlex.join(env.get('argv') or [])}")
    if doc.get("ceiling"):
        for line in _report.ceiling_lines(doc["ceiling"]):
            click.echo(line)
    if doc["results"]:
        click.echo("")
        for line in _report.results_table(doc["results"], markdown=markdown):
            click.echo(line)
        notes = _report.notes_lines(doc["results"])
        if notes:
            click.echo("")
            for line in notes:
                click.echo(("- " if markdown else "") + line)
    if doc["overhead"]:
        click.echo("")
        for line in _report.overhead_table(doc["overhead"], markdown=markdown):
            click.echo(line)


def main(argv=None):
    """Entry point of the ``cupylab-bench`` console script.

    Parameters
    ----------
    argv : list of str, optional
        Arguments without the program name (default ``sys.argv[1:]``); recorded in the
        result files.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    # A closed pipe (``cupylab-bench list | head -1``) ends the process the way it ends `cat` or
    # `ls`: by SIGPIPE, silently (exit status 141 in the shell), not click's exit 1, which this
    # command reserves for "a case failed". Only when run as the program (argv None): a
    # caller's own main([...]) keeps its process's signal handling.
    if argv is None and hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    return cli.main(args=args, prog_name="cupylab-bench", obj={"argv": ["cupylab-bench", *args]})


if __name__ == "__main__":  # pragma: no cover
    main()
