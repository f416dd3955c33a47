"""The peers the elementwise benchmark cases compare cupylab with (torch eager, torch.compile,
CuPy, JAX), per registered case. Imports nothing heavy: each factory receives the framework's
module.

Peers write into ``out`` when the bench gives one (the same rotating buffers cupylab writes),
so both sides stream the same bytes; JAX and torch.compile allocate. The ``div`` case divides
integers with floor division (cupylab's bench ``div`` does too, so that the output keeps the
operands' dtype) and floats with true division.
"""
from __future__ import annotations

__all__ = ["PEERS"]


def _is_int(x):
    return str(getattr(x, "dtype", "")).split(".")[-1].startswith("int")


def _binary(torch_name, cupy_name, jax_name):
    return {
        "torch": lambda torch, x, y, out=None: (
            lambda f=getattr(torch, torch_name): f(x, y, out=out)),
        "torch.compile": None,  # one kernel already: nothing for Inductor to fuse
        "cupy": lambda cp, x, y, out=None: (
            lambda f=getattr(cp, cupy_name): f(x, y, out=out)),
        "jax": lambda jax, x, y, out=None: (
            lambda f=jax.jit(getattr(jax.numpy, jax_name)): f(x, y)),
    }


_DIV = {
    "torch": lambda torch, x, y, out=None: (
        (lambda: torch.div(x, y, rounding_mode="floor", out=out)) if _is_int(x)
        else (lambda: torch.div(x, y, out=out))),
    "torch.compile": None,
    "cupy": lambda cp, x, y, out=None: (
        lambda f=cp.floor_divide if _is_int(x) else cp.divide: f(x, y, out=out)),
    "jax": lambda jax, x, y, out=None: (
        lambda f=jax.jit(jax.numpy.floor_divide if _is_int(x)
                         else jax.numpy.divide): f(x, y)),
}


def _torch_fam(torch, a, b, s, out=None):
    if out is None:
        return lambda: (a + b) * s
    return lambda: torch.mul(torch.add(a, b), s, out=out)


def _torch_compile_fam(torch, a, b, s, out=None):
    f = torch.compile(lambda a, b, s: (a + b) * s)
    return lambda: f(a, b, s)


def _cupy_fam(cp, a, b, s, out=None):
    k = cp.ElementwiseKernel("T a, T b, T s", "T o", "o = (a + b) * s", "cupylab_peer_fam")
    return (lambda: k(a, b, s)) if out is None else (lambda: k(a, b, s, out))


def _fam(a, b, s):
    return (a + b) * s


def _jax_fam(jax, a, b, s, out=None):
    # one function for every buffer set: jax.jit caches its compilations per function object,
    # so a new lambda per set was traced and compiled again each time
    f = jax.jit(_fam)
    return lambda: f(a, b, s)


#: registered case name -> {peer name: factory(framework module, *inputs, out=None)}
PEERS = {
    "vector_add": _binary("add", "add", "add"),
    "add": _binary("add", "add", "add"),
    "sub": _binary("sub", "subtract", "subtract"),
    "mul": _binary("mul", "multiply", "multiply"),
    "div": _DIV,
    "fused_add_mul": {"torch": _torch_fam, "torch.compile": _torch_compile_fam,
                      "cupy": _cupy_fam, "jax": _jax_fam},
}
