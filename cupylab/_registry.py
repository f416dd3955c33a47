"""Operator registry shared by the tests and ``cupylab-bench``.

Each operator registers one :class:`OpSpec` next to its wrapper: how to call it, which
operands it takes, its float64 reference (from :mod:`cupylab.reference`), how many bytes and
FLOPs one call must move/do, and the peer implementations to compare against. Adding a
benchmark case for a new operator is one ``register(OpSpec(...))`` call.
"""
from __future__ import annotations

__all__ = ["OpSpec", "register", "OPS", "get"]


class OpSpec:
    """Description of one operator for tests and benchmarks.

    Parameters
    ----------
    name : str
        Public name (``"fused_add_mul"``).
    fn : callable
        The cupylab function; called as ``fn(*arrays, out=out)``.
    n_inputs : int
        Number of array inputs (all of the output's shape in benchmark cases).
    reference : str
        Key in :data:`cupylab.reference.REFERENCES`.
    dtypes : tuple of str
        Supported dtypes.
    bytes_per_element : callable(itemsize) -> int
        Minimum bytes one output element costs (each input read once, output written once).
    flops_per_element : int
        Arithmetic operations per output element.
    peers : dict
        ``{peer name: factory}``; ``factory(framework_module, *inputs, out=None)`` returns a
        zero-argument callable computing the same result with that framework, written into
        ``out`` when given and the framework can (``None`` if not applicable).
        Peer names used by the bench: ``"torch"``, ``"torch.compile"``, ``"cupy"``, ``"jax"``.
    """

    def __init__(self, name, fn, n_inputs, reference, dtypes, bytes_per_element,
                 flops_per_element, peers, description=""):
        self.name = name
        self.fn = fn
        self.n_inputs = n_inputs
        self.reference = reference
        self.dtypes = tuple(dtypes)
        self.bytes_per_element = bytes_per_element
        self.flops_per_element = flops_per_element
        self.peers = dict(peers)
        self.description = description

    def bytes(self, n, itemsize):
        return n * self.bytes_per_element(itemsize)

    def flops(self, n):
        return n * self.flops_per_element

    def __repr__(self):
        return f"OpSpec({self.name!r})"


OPS: dict = {}


def register(spec: OpSpec) -> OpSpec:
    OPS[spec.name] = spec
    return spec


def get(name) -> OpSpec:
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown operator {name!r}; registered: {', '.join(sorted(OPS))}") from None
