"""Type resolution for the arithmetic operators: which dtype a call computes in and returns.

The caller's framework decides, as it already decides the output's array type:

* ``"numpy"`` (CuPy, Numba, CUDA Array Interface and DLPack callers): NumPy 2's own ufunc type
  resolution, ``numpy.<ufunc>.resolve_dtypes`` (NEP 50: Python scalars are weak, NumPy scalars
  and 0-d arrays are not), with ``dtype=`` as the output signature and ``casting`` checked for
  the inputs and for ``out``. bfloat16 follows ml_dtypes' registered loops and casts.
* ``"torch"`` (the leading array is a torch tensor): ``torch.result_type`` (0-d tensors and
  Python numbers take part by category only), true division of integers and bools in
  ``torch.get_default_dtype()``, and torch's refusals (bool subtraction, floor division of bools
  and complex numbers).
* ``"jax"``: the dtype ``jax.eval_shape`` gives for the ``jax.numpy`` function (weak Python
  scalars, ``jax_enable_x64``).

Nothing here is a table of promotions written by cupylab: each answer is the framework's own,
computed once per combination of operator, operand dtypes (and scalar kinds), ``dtype=``,
``out`` dtype and ``casting``, and cached. An operand key is ``("a", dtype name, is 0-d)`` for
an array, ``("s", dtype name)`` for a NumPy scalar or 0-d host array, ``("w", "int" | "float" |
"complex" | "bool")`` for a Python scalar.
"""
from __future__ import annotations

import sys

from . import _dtypes

__all__ = ["resolve", "operand_key", "UFUNCS"]

#: cupylab operator -> the NumPy ufunc name that defines its types
UFUNCS = {"add": "add", "subtract": "subtract", "multiply": "multiply",
          "true_divide": "divide", "floor_divide": "floor_divide", "fused_add_mul": None}

_cache: dict = {}


_WEAK_KIND = {"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"}


def operand_key(v, view):
    """The cache key of one operand (see the module docstring). Subclasses of Python numbers
    (an IntEnum, a float subclass) are strong, as NumPy takes them: int64, float64,
    complex128."""
    if view is not None:
        if not view.shape and getattr(v, "weak_type", False) is True:
            # a weakly typed JAX scalar (jnp.asarray(2.0)) promotes like a Python number
            return ("w", _WEAK_KIND[view.dtype.kind])
        return ("a", view.dtype.name, not view.shape)
    t = type(v)
    if t is bool:
        return ("w", "bool")
    if t is int:
        return ("w", "int")
    if t is float:
        return ("w", "float")
    if t is complex:
        return ("w", "complex")
    dt = getattr(v, "dtype", None)
    if dt is None:
        for base, name in ((bool, "bool"), (int, "int64"), (float, "float64"),
                           (complex, "complex128")):
            if isinstance(v, base):
                return ("s", name)
        raise TypeError(f"{type(v).__module__}.{type(v).__qualname__} is not a number cupylab "
                        "can use (a Python or NumPy bool, int, float or complex)")
    return ("s", _dtypes.resolve(dt).name)  # NumPy scalar or 0-d host array


def resolve(rule, op, keys, dtype=None, out=None, casting="same_kind"):
    """``(computation dtype, result dtype)`` for ``op`` on operands with ``keys`` under the
    framework ``rule``; ``dtype`` and ``out`` are :class:`~cupylab._dtypes.DType` or None.

    Raises
    ------
    TypeError
        The framework refuses the combination (its message), or a cast that ``casting``
        forbids.
    """
    # torch's default dtype decides its results for integer true division and for Python
    # floats and complexes with integer tensors: part of every torch key
    ck = (rule, op, keys, dtype, out, casting, _torch_default() if rule == "torch" else
          _jax_mode() if rule == "jax" else None)
    r = _cache.get(ck)
    if r is None:
        try:
            r = _RULES[rule](op, keys, dtype, out, casting)
        except TypeError as e:  # the framework's refusal, kept for the next call too
            r = ("error", str(e))
        except Exception as e:  # noqa: BLE001 - e.g. torch's RuntimeError for uint promotion
            r = ("error", f"{type(e).__name__}: {e}")
        _cache[ck] = r
    if r[0] == "error":
        raise TypeError(r[1])
    return r


# -- NumPy ------------------------------------------------------------------------------------
def _np_dtype(np, name):
    if name == "bfloat16":
        try:
            import ml_dtypes  # noqa: PLC0415
        except ImportError:
            raise TypeError("bfloat16 under NumPy's rules needs the ml_dtypes package "
                            "(pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _dt(npdt):
    return _dtypes.resolve(npdt)


def _bf16_with_weak(keys):
    """bfloat16 operands (arrays or NumPy scalars) and Python bool/int/float scalars only."""
    seen = False
    for k in keys:
        if k[0] == "w":
            if k[1] == "complex":
                return False
        elif k[1] == "bfloat16":
            seen = True
        else:
            return False
    return seen


def _numpy(op, keys, dtype, out, casting):
    """NumPy's own answer: the ufunc evaluated once on one-element host operands of the same
    kinds (arrays, NumPy scalars, Python scalars), with ``dtype=`` and ``casting``; then
    ``out``'s cast checked as NumPy checks it. Evaluating (rather than asking
    ``resolve_dtypes``) follows what each NumPy / ml_dtypes version really does, e.g. for
    bfloat16 with Python floats."""
    import numpy as np  # noqa: PLC0415 - every caller of this rule has CuPy, hence NumPy

    weak = {"int": 1, "float": 1.0, "complex": 1j, "bool": True}

    def sample(k):
        if k[0] == "w":
            return weak[k[1]]
        d = _np_dtype(np, k[1])
        return np.ones(1, d) if k[0] == "a" else d.type(1)

    args = [sample(k) for k in keys]
    kw = {"casting": casting}
    if dtype is not None:
        kw["dtype"] = _np_dtype(np, dtype.name)
    with np.errstate(all="ignore"):
        if op == "fused_add_mul":  # (a + b) * s: NumPy's types for add, then for multiply
            r = np.multiply(np.add(args[0], args[1], casting=casting), args[2], **kw)
        else:
            r = getattr(np, UFUNCS[op])(args[0], args[1], **kw)
    ct = _dt(r.dtype)
    if dtype is None and _bf16_with_weak(keys):
        # NEP 50 for bfloat16, whatever the ml_dtypes version: a Python bool, int or float
        # does not widen the array (older ml_dtypes loops give float32, their result_type
        # float64; torch and JAX keep bfloat16)
        ct = _dtypes.from_name("bfloat16")
    if out is not None and not _dtypes.can_cast(ct, out, casting):
        name = UFUNCS[op] or "multiply"
        raise TypeError(f"Cannot cast ufunc '{name}' output from {_np_dtype(np, ct.name)!r} to "
                        f"{_np_dtype(np, out.name)!r} with casting rule '{casting}'")
    return ct, ct


def _jax_mode():
    """JAX's settings that change its answers: 64-bit types and the promotion mode."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    cfg = jax.config
    return (getattr(cfg, "jax_enable_x64", None),
            getattr(cfg, "jax_numpy_dtype_promotion", None))


# -- torch ------------------------------------------------------------------------------------
def _torch_default():
    torch = sys.modules.get("torch")
    return None if torch is None else torch.get_default_dtype()


def _torch(op, keys, dtype, out, casting):
    torch = sys.modules["torch"]
    sample = {"int": 1, "float": 1.0, "complex": 1j, "bool": True}

    def arg(k):
        if k[0] == "a":
            return torch.empty(() if k[2] else (1,), dtype=getattr(torch, k[1]))
        if k[0] == "w":
            return sample[k[1]]
        # torch treats NumPy scalars like Python numbers of their kind
        return sample[_WEAK_KIND[_dtypes.from_name(k[1]).kind]]

    args = [arg(k) for k in keys]
    r = torch.result_type(args[0], args[1])
    if op == "fused_add_mul":  # (a + b) is 0-d when a and b are: it then takes part in
        # the multiply by category only, as torch's own (a + b) * s
        zero_d = all(k[0] != "a" or k[2] for k in keys[:2])
        r = torch.result_type(torch.empty(() if zero_d else (1,), dtype=r), args[2])
    if r == getattr(torch, "complex32", None):
        raise TypeError("torch's result type is complex32 (ComplexHalf), which cupylab does not "
                        "compute; make an operand complex64 first")
    rt = _dtypes.resolve(r)
    if op == "true_divide" and rt.kind in "biu":
        rt = _dtypes.resolve(torch.get_default_dtype())
    ct = dtype or rt
    if op == "subtract" and (ct.kind == "b" or any(k[1] == "bool" for k in keys)):
        raise TypeError("Subtraction, the `-` operator, with a bool tensor is not supported "
                        "(torch's rule); use the `^` or logical_xor() operator instead")
    _refuse_kinds(op, ct)
    # 0-d tensors take part by category only (torch converts them like Python numbers)
    ins = [_dtypes.from_name(k[1]) for k in keys if k[0] == "a" and not k[2]]
    _check_scalar_kinds(op, keys, ct, casting)
    return _check_casts(ct, ins, out, casting, op)


# a scalar's kind against the computation dtype's: _dtypes._KIND_ORDER with signed and
# unsigned integers as one kind (a Python int into a uint8 computation is no truncation)
_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}
_PY_KIND = {"bool": "b", "int": "i", "float": "f", "complex": "c"}


def _refuse_kinds(op, ct):
    """The computation dtypes an operator has no meaning in (``dtype=`` may ask for them
    under the torch and JAX rules; NumPy's rule refuses them itself)."""
    if op == "floor_divide" and ct.kind in "bc":
        raise TypeError(f"floor_divide is not supported for {ct.name} (no floor of a "
                        f"{'complex number' if ct.kind == 'c' else 'bool'})")
    if op == "true_divide" and ct.kind in "biu":
        raise TypeError(f"true division cannot compute in {ct.name}; give dtype= a float or "
                        "complex dtype (floor_divide divides integers)")


def _check_scalar_kinds(op, keys, ct, casting):
    """A Python or NumPy scalar of a higher kind than the computation dtype would be
    truncated (2.5 into int32): refused unless ``casting="unsafe"``."""
    if casting == "unsafe":
        return
    for k in keys:
        if k[0] == "a" and not k[2]:  # 0-d tensors count like numbers (their cast is unchecked)
            continue
        kind = _PY_KIND[k[1]] if k[0] == "w" else _dtypes.from_name(k[1]).kind
        if _KIND_RANK[kind] > _KIND_RANK[ct.kind]:
            raise TypeError(f"Cannot cast ufunc '{op}' scalar of kind {k[1]} to {ct.name} with "
                            f"casting rule '{casting}'")


# -- JAX --------------------------------------------------------------------------------------
def _jax(op, keys, dtype, out, casting):
    import jax  # noqa: PLC0415 - only for JAX callers
    import jax.numpy as jnp  # noqa: PLC0415

    sample = {"int": 1, "float": 1.0, "complex": 1j, "bool": True}
    fn = {"add": jnp.add, "subtract": jnp.subtract, "multiply": jnp.multiply,
          "true_divide": jnp.true_divide, "floor_divide": jnp.floor_divide,
          "fused_add_mul": lambda a, b, s: (a + b) * s}[op]
    arrays, pos = [], []
    for i, k in enumerate(keys):
        if k[0] != "w":
            arrays.append(jax.ShapeDtypeStruct((), jnp.dtype(k[1])))
            pos.append(i)

    def f(*arrs):
        full = [sample[k[1]] if k[0] == "w" else None for k in keys]
        for i, a in zip(pos, arrs):
            full[i] = a
        return fn(*full)

    rt = _dtypes.resolve(jax.eval_shape(f, *arrays).dtype)
    ct = dtype or rt
    if op == "subtract" and ct.kind == "b":
        raise TypeError("subtract is not supported for bool (JAX's rule)")
    _refuse_kinds(op, ct)
    _check_scalar_kinds(op, keys, ct, casting)
    ins = [_dtypes.from_name(k[1]) for k in keys if k[0] != "w"]
    return _check_casts(ct, ins, out, casting, op)


def _check_casts(ct, ins, out, casting, op):
    """Input casts into ``ct`` and the output cast into ``out`` under ``casting`` (NumPy's
    words), for the rules that do not check casts themselves."""
    for i, d in enumerate(ins):
        if not _dtypes.can_cast(d, ct, casting):
            raise TypeError(f"Cannot cast ufunc '{op}' input {i} from {d.name} to {ct.name} "
                            f"with casting rule '{casting}'")
    if out is not None and not _dtypes.can_cast(ct, out, casting):
        raise TypeError(f"Cannot cast ufunc '{op}' output from {ct.name} to {out.name} with "
                        f"casting rule '{casting}'")
    return ct, ct


_RULES = {"numpy": _numpy, "torch": _torch, "jax": _jax}
