"""The array frameworks the benchmark makes inputs with and compares against.

Nothing is imported at module import: :func:`installed` and :func:`version` only look at the
installed distributions, :func:`load` imports a framework when a command needs it and checks
that it can use the GPU.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys

__all__ = ["FRAMEWORKS", "PEERS", "PEER_FRAMEWORK", "Unavailable", "installed", "version",
           "load", "default_framework"]

#: Frameworks whose arrays the inputs can be made of.
FRAMEWORKS = ("torch", "cupy", "jax")

#: Peer names, in table order (the keys of :attr:`cupylab._registry.OpSpec.peers`).
PEERS = ("torch", "torch.compile", "cupy", "jax")

#: The framework whose arrays (and module) each peer gets.
PEER_FRAMEWORK = {"torch": "torch", "torch.compile": "torch", "cupy": "cupy", "jax": "jax"}

# distributions that provide each module (CuPy ships under several names)
_DISTS = {
    "torch": ("torch",),
    "jax": ("jax",),
    "numpy": ("numpy",),
    "cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"),
    "matplotlib": ("matplotlib",),
    "ml_dtypes": ("ml_dtypes",),
}


class Unavailable(Exception):
    """A framework is not installed or cannot use the GPU; the message says which."""


def installed(name: str) -> bool:
    """Whether module ``name`` can be imported (without importing it)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def version(name: str):
    """The version of module ``name``: its ``__version__`` when already imported, else the
    installed distribution's version, else ``None``. Never imports ``name``."""
    mod = sys.modules.get(name)
    v = getattr(mod, "__version__", None) if mod is not None else None
    if isinstance(v, str):
        return v
    for dist in _DISTS.get(name, (name,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - broken metadata must not break a report
            return None
    return None


_loaded: dict = {}


def load(name: str):
    """Import framework ``name`` and check that it can run on the GPU.

    JAX is imported with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (unless set already), so that
    it does not take most of the GPU memory from the other frameworks, and with 64-bit types
    enabled, so that float64 and int64 cases keep their dtype.

    Parameters
    ----------
    name : {"torch", "cupy", "jax"}

    Returns
    -------
    module

    Raises
    ------
    Unavailable
        Not installed, failed to import, or has no GPU backend here.
    """
    got = _loaded.get(name)
    if got is not None:
        if isinstance(got, Unavailable):
            raise got
        return got
    try:
        mod = _load(name)
    except Unavailable as e:
        _loaded[name] = e
        raise
    _loaded[name] = mod
    return mod


def _load(name):
    if name not in FRAMEWORKS:
        raise Unavailable(f"unknown framework {name!r}; choose from {', '.join(FRAMEWORKS)}")
    if not installed(name):
        raise Unavailable(f"{name} is not installed")
    if name == "jax":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        raise Unavailable(f"{name} failed to import ({type(e).__name__}: {e})") from None
    if name == "torch":
        if not mod.cuda.is_available():
            raise Unavailable(f"torch {mod.__version__} cannot use a CUDA GPU here "
                              "(a CPU-only build, or no driver)")
    elif name == "jax":
        try:
            mod.config.update("jax_enable_x64", True)
            gpus = mod.devices("gpu")
        except Exception as e:  # noqa: BLE001 - RuntimeError: no GPU backend
            raise Unavailable(f"jax {mod.__version__} has no GPU backend here "
                              f"({type(e).__name__}: {e})") from None
        if not gpus:
            raise Unavailable(f"jax {mod.__version__} sees no GPU")
        importlib.import_module("jax.dlpack")  # make the submodule an attribute
    return mod


def default_framework() -> str:
    """``"torch"`` when torch is installed and can use the GPU, else ``"cupy"``."""
    if installed("torch"):
        try:
            load("torch")
            return "torch"
        except Unavailable:
            pass
    return "cupy"
