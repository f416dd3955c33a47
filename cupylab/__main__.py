"""``python -m cupylab precompile``: fill the kernel cache ahead of time, without a GPU.

NVRTC needs no GPU, so a container build or a login node can compile the kernel instances a
job will use for the cluster's architecture into the cache directory (``$CUPYLAB_CACHE_DIR``;
nodes that share it then load instead of compiling)::

    python -m cupylab precompile --arch sm_90
    python -m cupylab precompile --arch sm_80 --ops add,divide --dtypes float32,float16,int64

It compiles, for each elementwise operator, every pair of the given dtypes (contiguous,
element-wise and strided variants; row and scalar variants too), as
:func:`cupylab.ops.elementwise.instances` lists them, and every program of the row-wise and
multi-tensor families (``--families`` picks), in parallel processes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _compile_one(args):
    from cupylab import _dtypes  # noqa: PLC0415
    from cupylab.ops import elementwise as ew  # noqa: PLC0415

    (variant, op, names, extra), cc = args
    types = tuple(_dtypes.from_name(n) for n in names)
    k = ew.kernel(variant, op, types, tuple(extra))
    return _counted(k.program, cc)


def _counted(program, cc):
    """``(compiled, compiled but not stored)`` for one program (0 or 1 each)."""
    from cupylab import _compile  # noqa: PLC0415

    before = dict(_compile.stats)
    _compile.compile_program(program, cc)
    return (_compile.stats["compiled"] - before["compiled"],
            _compile.stats["not_stored"] - before["not_stored"])


def _call(item):
    fn, args = item
    return fn(args)


def _compile_program(args):
    family, i, cc = args
    return _counted(_FAMILIES[family]()[i], cc)


def _rowwise_programs():
    from cupylab.ops import _rowcore  # noqa: PLC0415

    return _rowcore.all_programs()


def _multi_tensor_programs():
    from cupylab.ops import _mt_plan  # noqa: PLC0415

    return _mt_plan.all_programs()


def _resnorm_programs():
    from cupylab.ops import resnorm  # noqa: PLC0415

    return resnorm.all_programs()


#: Families whose programs are compiled whole (a few programs each), beside the elementwise
#: instances chosen by --ops/--dtypes.
_FAMILIES = {"rowwise": _rowwise_programs, "multi_tensor": _multi_tensor_programs,
             "resnorm": _resnorm_programs}


def _arch(text):
    t = text.lower().removeprefix("sm_").removeprefix("compute_")
    if not t.isdigit():
        raise argparse.ArgumentTypeError(f"--arch must look like sm_90 (got {text!r})")
    return int(t)


def _list(text):
    return [x.strip() for x in text.split(",") if x.strip()]


def precompile(argv):
    from cupylab import CompileError, _compile, _dtypes  # noqa: PLC0415
    from cupylab.ops import elementwise as ew  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="python -m cupylab precompile",
                                description="Compile kernel instances into the cache "
                                            "directory (no GPU needed).")
    p.add_argument("--arch", type=_arch, required=True, help="target, e.g. sm_90 or sm_80")
    p.add_argument("--ops", type=_list, default=[o for o in ew.PUBLIC_OPS if o != "true_divide"],
                   help=f"comma-separated operators (default: all of {', '.join(ew.PUBLIC_OPS)})")
    p.add_argument("--dtypes", type=_list, default=[d.name for d in _dtypes.ARITHMETIC],
                   help="comma-separated dtypes whose pairs are compiled (default: all 15)")
    p.add_argument("--rules", type=_list, default=["numpy"],
                   help="promotion rules to compile for: numpy, torch, jax (default: numpy)")
    p.add_argument("--no-scalars", action="store_true",
                   help="skip the variants with a Python scalar operand")
    p.add_argument("--families", type=_list, default=["elementwise", *_FAMILIES],
                   help="comma-separated families to compile: elementwise (the instances "
                        "chosen by --ops/--dtypes/--rules), rowwise, multi_tensor, resnorm "
                        "(default: all)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="parallel compiler processes (default: the CPU count)")
    a = p.parse_args(argv)
    for o in a.ops:
        if o not in ew.PUBLIC_OPS:
            p.error(f"--ops: unknown operator {o!r}; known: {', '.join(ew.PUBLIC_OPS)}")
    try:
        dtypes = [_dtypes.from_name(d).name for d in a.dtypes]
    except TypeError as e:
        p.error(f"--dtypes: {e}")
    for r in a.rules:
        if r not in ("numpy", "torch", "jax"):
            p.error(f"--rules: unknown rule {r!r}; known: numpy, torch, jax")
        if r != "numpy":
            mod = "torch" if r == "torch" else "jax"
            try:
                __import__(mod)
            except ImportError as e:
                p.error(f"--rules {r}: {mod} is not importable here ({e}); its promotion "
                        "rules come from its own result_type")
    # the cache the compiled kernels go to: enabled, creatable and trusted, or nothing to do
    if not _compile._cache_enabled():
        p.error("the kernel cache is disabled (CUPYLAB_CACHE_DISABLE): nothing would be kept")
    try:  # a GPU older than every arch this NVRTC targets: one clear line, not per worker
        _compile.target_for(a.arch)
    except CompileError as e:
        p.error(str(e))
    if _compile.trusted_cache_dir() is None:
        p.error(f"the kernel cache directory {_compile.cache_dir()} cannot be created or is "
                "not private to this user (see the warning above); set CUPYLAB_CACHE_DIR")
    for f in a.families:
        if f != "elementwise" and f not in _FAMILIES:
            p.error(f"--families: unknown family {f!r}; known: elementwise, "
                    f"{', '.join(_FAMILIES)}")
    todo = []
    if "elementwise" in a.families:
        todo = [(_compile_one, ((v, op, tuple(t.name for t in types), tuple(extra)), a.arch))
                for v, op, types, extra in ew.instances(a.ops, dtypes, a.rules,
                                                         not a.no_scalars)]
    for f in a.families:
        if f in _FAMILIES:
            todo += [(_compile_program, (f, i, a.arch)) for i in range(len(_FAMILIES[f]()))]
    t0 = time.perf_counter()
    if a.jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            counts = list(ex.map(_call, todo, chunksize=4))
    else:
        counts = [_call(x) for x in todo]
    compiled = sum(c for c, _ in counts)
    lost = sum(n for _, n in counts)
    dt = time.perf_counter() - t0
    print(f"cupylab precompile: {len(todo)} kernel instances for sm_{a.arch}: {compiled} "
          f"compiled, {len(todo) - compiled} already cached, {dt:.1f} s, into {_compile.cache_dir()}")
    if lost:
        print(f"cupylab precompile: {lost} of the {compiled} compiled could not be stored in "
              f"{_compile.cache_dir()} (no space or quota, a read-only or untrusted directory, "
              "or a header edited while compiling); they will be compiled again when used",
              file=sys.stderr)
        return 1
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] != "precompile":
        print(f"python -m cupylab: unknown command {argv[0]!r} (commands: precompile)",
              file=sys.stderr)
        return 2
    return precompile(argv[1:])


if __name__ == "__main__":
    import signal

    # a closed pipe (``python -m cupylab --help | head -1``) ends the process silently by
    # SIGPIPE, as it ends `cat`, not with a BrokenPipeError traceback
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
