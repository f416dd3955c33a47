"""The environment record written with every result: GPU, driver, CUDA runtime, versions,
cupylab's git revision, timestamp and the exact command line."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

from . import _frameworks

__all__ = ["collect", "cuda_version_str", "git_revision"]


def cuda_version_str(v):
    """``13000`` -> ``"13.0"``, ``12080`` -> ``"12.8"``; ``None`` stays ``None``."""
    if v is None:
        return None
    v = int(v)
    return f"{v // 1000}.{(v % 1000) // 10}"


def _git(root, *args):
    p = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                       timeout=10)
    return p.stdout.strip() if p.returncode == 0 else None


def _checkout_rev(root):
    """``(rev, dirty)`` when ``root`` is the top of a git checkout of cupylab, else ``None``."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if not top or not (Path(top) / "cupylab" / "__init__.py").is_file():
        return None
    rev = _git(top, "rev-parse", "HEAD")
    if not rev:
        return None
    st = _git(top, "status", "--porcelain", "--untracked-files=no")
    return rev, (bool(st) if st is not None else None)


def git_revision():
    """``(revision, dirty)`` of cupylab's source.

    The git checkout cupylab is imported from; for an installed copy, the checkout in the
    current directory when it is one of cupylab (the usual ``pip install .`` then run); the
    ``CUPYLAB_GIT_REV`` environment variable when set; else ``(None, None)`` (also for a copy
    of the sources lying inside another checkout, which is not that checkout's revision).
    """
    env = os.environ.get("CUPYLAB_GIT_REV")
    if env:
        return env, None
    import cupylab  # noqa: PLC0415

    pkg_root = Path(cupylab.__file__).resolve().parent.parent
    try:
        got = _checkout_rev(pkg_root)
        top = _git(pkg_root, "rev-parse", "--show-toplevel") if got is not None else None
        if top and Path(top).resolve() == pkg_root:
            return got
        if top and pkg_root.name not in ("site-packages", "dist-packages"):
            # a copy of the sources inside another checkout (a tree exported for an A/B):
            # the checkout around it is not its revision
            return None, None
        got = _checkout_rev(Path.cwd())
        if got is not None:
            return got
    except (OSError, subprocess.SubprocessError):
        pass
    return None, None


def _gpu_fields(cp):
    out = {"gpu": None, "gpu_index": None, "gpu_cc": None, "gpu_sms": None,
           "gpu_l2_bytes": None, "gpu_memory_bytes": None, "driver": None, "cuda_runtime": None}
    if cp is None:
        return out
    rt = cp.cuda.runtime
    try:
        dev = int(rt.getDevice())
        p = rt.getDeviceProperties(dev)
        name = p["name"]
        out.update(
            gpu=name.decode() if isinstance(name, bytes) else str(name), gpu_index=dev,
            gpu_cc=f"{p['major']}.{p['minor']}", gpu_sms=int(p["multiProcessorCount"]),
            gpu_l2_bytes=int(p.get("l2CacheSize", 0)), gpu_memory_bytes=int(p["totalGlobalMem"]))
    except Exception:  # noqa: BLE001 - a report without the GPU's name is still a report
        pass
    for key, fn in (("driver", "driverGetVersion"), ("cuda_runtime", "runtimeGetVersion")):
        try:
            out[key] = cuda_version_str(getattr(rt, fn)())
        except Exception:  # noqa: BLE001
            pass
    return out


def collect(cp=None, argv=None) -> dict:
    """The ``env`` record of a result file.

    Parameters
    ----------
    cp : module, optional
        CuPy with a usable GPU (``None``: the GPU fields are ``None``).
    argv : list of str, optional
        The command line (default ``sys.argv``).

    Returns
    -------
    dict
        ``gpu`` (name), ``gpu_index``, ``gpu_cc``, ``gpu_sms``, ``gpu_l2_bytes``,
        ``gpu_memory_bytes``, ``driver`` and ``cuda_runtime`` (``"13.0"``), ``cupy``,
        ``torch``, ``jax``, ``numpy``, ``python``, ``cupylab`` (versions; ``None`` when not
        installed), ``git_rev``, ``git_dirty``, ``timestamp`` (UTC, ISO 8601), ``host``,
        ``argv``, ``cwd``.
    """
    import cupylab  # noqa: PLC0415

    env = _gpu_fields(cp)
    rev, dirty = git_revision()
    env.update(
        cupy=getattr(cp, "__version__", None) if cp is not None else _frameworks.version("cupy"),
        torch=_frameworks.version("torch"),
        jax=_frameworks.version("jax"),
        numpy=_frameworks.version("numpy"),
        python=platform.python_version(),
        cupylab=getattr(cupylab, "__version__", None),
        git_rev=rev,
        git_dirty=dirty,
        timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node() or None,
        argv=list(sys.argv if argv is None else argv),
        cwd=os.getcwd(),
    )
    return env
