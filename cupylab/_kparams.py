"""C parameter types to what a launch passes (for :mod:`cupylab.kernels`).

Each parameter of a user's kernel becomes a :class:`Param`: its ``struct`` format in the launch
buffer (every scalar at the width its C type needs), the array dtype a pointer requires, and a
converter that checks and converts a Python/NumPy scalar (range-checked integers, floats that
must not round to inf, by-value structs and CUDA vector types). :func:`parse_signature` reads a
declared signature; :mod:`cupylab._kmodule` builds signatures from the scanner's tokens.
"""
from __future__ import annotations

import ctypes
import math
import numbers
import struct

from . import _arrays, _dtypes
from ._cparse import (_INT_WORDS, _QUALIFIERS, _TYPE_WORDS, _is_ident, _join, _skip_balanced,
                      _split_top, _strip_source, _tokenize, _top_index)

__all__ = ["Param", "Signature", "parse_signature"]


def _ibits(fmt):
    return 8 * struct.calcsize("@" + fmt)


# Native ("@") struct formats: CUDA device code follows the host ABI, so 'l' (long) and 'N'
# (size_t) have the host's widths (8 bytes on Linux x86-64 / aarch64).
_INT_TYPES = {  # canonical C spelling -> (struct format, signed)
    "char": ("b", True), "signed char": ("b", True), "unsigned char": ("B", False),
    "short": ("h", True), "unsigned short": ("H", False),
    "int": ("i", True), "unsigned int": ("I", False),
    "long": ("l", True), "unsigned long": ("L", False),
    "long long": ("q", True), "unsigned long long": ("Q", False),
    "int8_t": ("b", True), "uint8_t": ("B", False), "int16_t": ("h", True),
    "uint16_t": ("H", False), "int32_t": ("i", True), "uint32_t": ("I", False),
    "int64_t": ("q", True), "uint64_t": ("Q", False),
    "size_t": ("N", False), "ssize_t": ("n", True), "ptrdiff_t": ("n", True),
    "intptr_t": ("n", True), "uintptr_t": ("N", False),
}
_FLOAT_TYPES = {  # canonical C spelling -> dtype name
    "float": "float32", "double": "float64",
    "__half": "float16", "half": "float16", "__nv_half": "float16", "cl::half_t": "float16",
    "__nv_bfloat16": "bfloat16", "nv_bfloat16": "bfloat16", "cl::bf16_t": "bfloat16",
}
#: Pointee types whose pointers take any array (raw bytes / untyped memory).
_BYTE_POINTEES = frozenset({"void", "char", "unsigned char", "signed char"})
#: CUDA's complex types: their pointers take complex arrays.
_COMPLEX_POINTEES = {"cuComplex": "complex64", "cuFloatComplex": "complex64",
                     "cuDoubleComplex": "complex128"}
#: Pairs of floats: a Kernel takes any array for them (a float32 array read two floats at a
#: time is common); ElementwiseKernel, which counts elements, takes the complex dtype of the
#: same layout.
PAIR_POINTEES = {"float2": "complex64", "double2": "complex128", **_COMPLEX_POINTEES}
#: CUDA's builtin vector types, passed by value as a sequence of components.
_VECTOR_TYPES = {}
for _b, _c in (("char", "b"), ("uchar", "B"), ("short", "h"), ("ushort", "H"), ("int", "i"),
               ("uint", "I"), ("long", "l"), ("ulong", "L"), ("longlong", "q"),
               ("ulonglong", "Q"), ("float", "f"), ("double", "d")):
    for _k in (1, 2, 3, 4):
        _VECTOR_TYPES[f"{_b}{_k}"] = f"{_k}{_c}"
del _b, _c, _k


def _int_dtype(fmt, signed):
    bits = _ibits(fmt)
    return _dtypes.DTYPES[f"{'' if signed else 'u'}int{bits}"]


def _canon(words) -> str:
    """Canonical spelling of a base type given as tokens (qualifiers already removed)."""
    if not words:
        return ""
    if all(w in _INT_WORDS for w in words):
        uns = "unsigned" in words
        longs = words.count("long")
        if "char" in words:
            return "unsigned char" if uns else ("signed char" if "signed" in words else "char")
        base = "short" if "short" in words else (
            "long long" if longs >= 2 else ("long" if longs == 1 else "int"))
        return ("unsigned " + base) if uns else base
    s = _join(words)
    for p in ("::", "cuda::std::", "std::"):
        if s.startswith(p):
            s = s[len(p):]
    return s


def _host_scalar(v, what, ctype):
    """NumPy scalars/0-d arrays -> Python scalars; refuse arrays of any kind."""
    if _arrays.framework_of(v) is not None:
        raise TypeError(
            f"{what} is a scalar parameter ({ctype}) but got an array "
            f"({_arrays._what(v)}); pass a Python or NumPy scalar")
    nd = getattr(v, "ndim", None)
    if nd is not None and type(v).__module__.split(".", 1)[0] == "numpy":
        if nd == 0:
            return v.item()
        raise TypeError(
            f"{what} is a scalar parameter ({ctype}) but got an array of shape "
            f"{tuple(v.shape)}; pass a Python or NumPy scalar")
    if isinstance(v, (list, tuple, bytes, bytearray, memoryview)) or hasattr(v, "__array__"):
        raise TypeError(
            f"{what} is a scalar parameter ({ctype}) but got {_arrays._what(v)}; pass a Python "
            "or NumPy scalar")
    return v


def _make_int_conv(ctype, fmt, signed):
    bits = _ibits(fmt)
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)

    def slow(v, what):
        v = _host_scalar(v, what, ctype)
        if isinstance(v, bool):
            v = int(v)
        elif isinstance(v, numbers.Integral):
            v = int(v)
        elif isinstance(v, numbers.Real):
            raise TypeError(
                f"{what} is an integer parameter ({ctype}) but got the float {v!r}; pass an int "
                "(cupylab does not truncate)")
        else:
            raise TypeError(
                f"{what} is an integer parameter ({ctype}) but got {_arrays._what(v)}")
        return conv(v, what)

    def conv(v, what):
        if type(v) is int:
            if lo <= v <= hi:
                return v
            raise OverflowError(
                f"{what}: {v} does not fit the C type {ctype} (range [{lo}, {hi}])")
        return slow(v, what)

    conv.range = (lo, hi)
    return conv


#: Doubles below this magnitude round to a finite float32 (2**128 less half a float32 ulp at
#: the top: from there on, round-to-nearest-even gives inf).
_F32_FINITE = 2.0**128 - 2.0**103


def _make_float_conv(ctype, dt):
    name = dt.name
    inf_bits = {"float16": (0x7C00, 0xFC00), "bfloat16": (0x7F80, 0xFF80)}.get(name)
    f32 = name == "float32"

    def real(v, what):
        v = _host_scalar(v, what, ctype)
        if isinstance(v, numbers.Real):
            return v
        if isinstance(v, numbers.Complex):
            raise TypeError(f"{what} is a real parameter ({ctype}) but got the complex {v!r}")
        raise TypeError(f"{what} is a floating-point parameter ({ctype}) but got "
                        f"{_arrays._what(v)}")

    def conv(v, what):
        t = type(v)
        if t is float and f32 and -_F32_FINITE < v < _F32_FINITE:
            return v  # packed as "f", which rounds it exactly as scalar_bits would
        if t is not float and t is not int:
            v = real(v, what)
        try:
            x = float(v)
        except OverflowError:
            raise OverflowError(f"{what}: {v} does not fit the C type {ctype}") from None
        if name == "float64":
            return x
        bits = dt.scalar_bits(x)
        if not math.isinf(x) and (bits in inf_bits if inf_bits else math.isinf(bits)):
            raise OverflowError(
                f"{what}: {v!r} is out of range for the C type {ctype} (it would round to inf)")
        return bits

    return conv


def _bool_conv(v, what):
    if v is True or v is False:
        return v
    v = _host_scalar(v, what, "bool")
    if isinstance(v, bool):
        return v
    if isinstance(v, numbers.Integral) and int(v) in (0, 1):
        return bool(v)
    raise TypeError(f"{what} is a bool parameter but got {v!r}; pass True/False (or 0/1)")


def _make_aggregate(ctype, spec):
    """By-value struct/vector parameter: a ``struct`` format (the argument is a sequence of
    the members) or a ctypes type (the argument is an instance). Packed to bytes at bind time;
    the launch buffer holds them as ``"<size>s"`` (cuLaunchKernel copies each parameter from
    its own address, so only the member layout and the size have to be right)."""
    if isinstance(spec, str):
        fmt = spec.replace(" ", "")
        try:
            st = struct.Struct("@" + fmt)
        except struct.error as e:
            raise ValueError(f"struct format {spec!r} for {ctype} is invalid ({e})") from None
        # Trailing padding: C rounds sizeof up to the largest member alignment (<= 8 here).
        codes = [c for c in fmt if c.isalpha() and c not in "xsp"]
        align = max((struct.calcsize("@" + c) for c in codes), default=1)
        size = -(-st.size // align) * align
        nitems = len(st.unpack(bytes(st.size)))
        pad = bytes(size - st.size)

        def conv(v, what):
            if _arrays.framework_of(v) is not None or not isinstance(v, (tuple, list)):
                raise TypeError(
                    f"{what} is a by-value {ctype} (struct format {spec!r}); pass a tuple of "
                    f"{nitems} values (got {_arrays._what(v)})")
            if len(v) != nitems:
                raise TypeError(f"{what} is a by-value {ctype} of {nitems} values "
                                f"(format {spec!r}); got {len(v)}")
            try:
                return st.pack(*v) + pad
            except struct.error as e:
                raise TypeError(f"{what}: cannot pack {tuple(v)!r} as {ctype} "
                                f"(format {spec!r}): {e}") from None
        return f"{size}s", conv
    if isinstance(spec, type) and issubclass(spec, (ctypes.Structure, ctypes.Union,
                                                    ctypes.Array)):
        size = ctypes.sizeof(spec)

        def conv(v, what):
            if isinstance(v, spec):
                return bytes(v)
            if isinstance(v, (bytes, bytearray)) and len(v) == size:
                return bytes(v)
            raise TypeError(f"{what} is a by-value {ctype}; pass a {spec.__name__} instance "
                            f"(or {size} bytes), got {_arrays._what(v)}")
        return f"{size}s", conv
    raise TypeError(f"struct_formats[{ctype!r}] must be a struct format string or a ctypes "
                    f"Structure/Union/Array type (got {spec!r})")


# --------------------------------------------------------------------------------------------
# parameters and signatures
class Param:
    """One kernel parameter, resolved to what is passed.

    Made by the signature scanner and :func:`parse_signature` (``Param()`` takes no
    arguments; the parser fills the attributes); read them from
    :attr:`Signature.params`.

    Attributes
    ----------
    index : int
        Position in the parameter list.
    name : str or None
        The C name (``None`` for unnamed parameters).
    ctype : str
        Canonical base type (``"float"``, ``"unsigned int"``, ``"__half"``); the pointee for
        pointers.
    pointer : bool
        Passed as a device address (``T*``, ``T**``, ``T[]``).
    const : bool
        For pointers: the pointee is ``const`` (the kernel promises not to write it).
    dtype : cupylab._dtypes.DType or None
        Pointers: the array dtype the pointee requires (``None``: any, e.g. ``void*``).
        Scalars: the dtype whose conversion is used, when there is one.
    fmt : str
        ``struct`` format of the parameter in the launch buffer.
    decl : str
        Normalised declaration for messages (``"const float* x"``).
    """

    __slots__ = ("index", "name", "ctype", "pointer", "const", "dtype", "fmt", "decl",
                 "convert", "what", "problem")

    def __repr__(self):
        return f"Param({self.decl!r}, fmt={self.fmt!r})"


class Signature:
    """The parameter list of one kernel instance.

    Usually made by :func:`parse_signature` or read from :attr:`Kernel.signature`; a
    Signature may also be given as a value of ``signatures=`` in :func:`load_kernels`.

    Parameters
    ----------
    name : str
        The name expression, used in messages.
    params : iterable of Param
        The parameters in order (stored as a tuple); :class:`Param` objects come from the
        parser.
    declared : bool, default False
        Whether the signature was declared by the user rather than scanned from the
        source.

    Attributes
    ----------
    name : str
        The name expression (``"vector_add"``, ``"scale<float>"``).
    params : tuple of Param
    declared : bool
        True when it came from ``signatures=`` rather than from the source.
    """

    __slots__ = ("name", "params", "declared")

    def __init__(self, name, params, declared=False):
        self.name = name
        self.params = tuple(params)
        self.declared = declared

    def __str__(self):
        return f"{self.name}({', '.join(p.decl for p in self.params)})"

    def __repr__(self):
        return f"Signature({str(self)!r})"

    @property
    def formats(self):
        """The ``struct`` format of each parameter, in order."""
        return tuple(p.fmt for p in self.params)


def _make_param(index, toks, subst, aliases, struct_formats, kname):
    p = Param()
    p.index = index
    p.problem = None
    p.convert = None
    raw = _join(toks)
    eq = _top_index(toks, "=")
    if eq >= 0:
        toks = toks[:eq]
    # template arguments and typedefs
    for _ in range(8):  # aliases of aliases, bounded
        new = []
        changed = False
        for t in toks:
            rep = subst.get(t) if subst else None
            if rep is None and t in aliases:
                rep = aliases[t]
                if rep is None:  # defined twice with different types
                    p.fmt = "Q"
                    p.name = None
                    p.ctype = p.decl = t
                    p.pointer, p.const, p.dtype = False, False, None
                    p.what = f"{kname}: parameter #{index} ({raw})"
                    p.problem = (f"parameter #{index} ({raw}): type {t!r} is defined more than "
                                 "once with different types (#if branches or namespaces, which "
                                 "the signature scanner does not evaluate); declare the "
                                 f"signature with signatures={{'{kname}': '(...)'}}")
                    return p
            if rep is not None:
                new.extend(rep)
                changed = True
            else:
                new.append(t)
        toks = new
        if not changed:
            break
    array = False
    if "[" in toks:
        array = True
        toks = toks[:toks.index("[")]
    name = None
    if len(toks) >= 2 and _is_ident(toks[-1]) and toks[-1] not in _TYPE_WORDS \
            and toks[-1] not in _QUALIFIERS and toks[-2] != "::":
        rest = [t for t in toks[:-1] if t not in _QUALIFIERS]
        if rest:
            name, toks = toks[-1], toks[:-1]
    p.name = name
    label = f"'{name}'" if name else f"#{index}"
    stars = [k for k, t in enumerate(toks) if t == "*"]
    first = stars[0] if stars else len(toks)
    base = [t for t in toks[:first] if t not in _QUALIFIERS]
    ctype = _canon(base)
    p.ctype = ctype
    levels = len(stars) + (1 if array else 0)
    p.pointer = levels > 0
    if stars:
        seg = toks[(stars[-2] + 1 if len(stars) > 1 else 0):stars[-1]]
    else:
        seg = toks
    p.const = p.pointer and "const" in seg
    decl = ("const " if p.const else "") + ctype + "*" * levels + (f" {name}" if name else "")
    p.decl = decl
    p.what = f"{kname}: parameter {label} ({decl})"
    p.dtype = None
    if "&" in toks or "&&" in toks:
        p.fmt = "Q"
        p.problem = (f"parameter {label} ({raw}) is a reference; __global__ functions take "
                     "parameters by value")
        return p
    if "..." in toks:
        p.fmt = "Q"
        p.problem = f"parameter {label} ({raw}) is a variadic pack; declare the instance's " \
                    "signature with signatures={name: '(...)'}"
        return p
    if p.pointer:
        p.fmt = "Q"
        if levels == 1 and ctype not in _BYTE_POINTEES:
            if ctype in _INT_TYPES:
                p.dtype = _int_dtype(*_INT_TYPES[ctype])
            elif ctype in _FLOAT_TYPES:
                p.dtype = _dtypes.DTYPES[_FLOAT_TYPES[ctype]]
            elif ctype == "bool":
                p.dtype = _dtypes.DTYPES["bool"]
            elif ctype in _COMPLEX_POINTEES:
                p.dtype = _dtypes.DTYPES[_COMPLEX_POINTEES[ctype]]
        return p
    if ctype in _INT_TYPES:
        fmt, signed = _INT_TYPES[ctype]
        p.fmt = fmt
        p.dtype = _int_dtype(fmt, signed)
        p.convert = _make_int_conv(ctype, fmt, signed)
    elif ctype in _FLOAT_TYPES:
        p.dtype = _dtypes.DTYPES[_FLOAT_TYPES[ctype]]
        p.fmt = {"float32": "f", "float64": "d"}.get(p.dtype.name, "H")
        p.convert = _make_float_conv(ctype, p.dtype)
    elif ctype == "bool":
        p.fmt = "?"
        p.dtype = _dtypes.DTYPES["bool"]
        p.convert = _bool_conv
    elif struct_formats and ctype in struct_formats:
        p.fmt, p.convert = _make_aggregate(ctype, struct_formats[ctype])
    elif ctype in _VECTOR_TYPES:
        p.fmt, p.convert = _make_aggregate(ctype, _VECTOR_TYPES[ctype])
    else:
        p.fmt = "Q"
        what = "has no type" if not ctype else f"is a {ctype} passed by value"
        p.problem = (
            f"parameter {label} ({raw}) {what}; cupylab packs builtin scalars, pointers and "
            "CUDA vector types itself. For a struct, give its layout: "
            f"struct_formats={{{ctype or 'T'!r}: 'fi'}} (a struct format) or a ctypes.Structure")
    return p


def _signature_from_tokens(name, param_toks, subst, aliases, struct_formats, declared=False):
    params = [_make_param(i, t, subst, aliases, struct_formats, name)
              for i, t in enumerate(param_toks)]
    return Signature(name, params, declared)


def parse_signature(text, name="kernel", struct_formats=None):
    """Parse a declared signature.

    Parameters
    ----------
    text : str
        ``"(const float* x, float* y, int n)"``, or a full declaration
        (``"__global__ void f(const float* x, float* y, int n)"``). Concrete types only (no
        template parameters).
    name : str
        The kernel name used in messages.
    struct_formats : dict, optional
        Layouts of by-value struct types (see :func:`load_kernels`).

    Returns
    -------
    Signature

    Raises
    ------
    ValueError
        Text without a parenthesised parameter list, or a parameter cupylab cannot pass
        (reference, unknown by-value struct without a layout).
    """
    toks = _tokenize(_strip_source(text))
    if "(" not in toks:
        raise ValueError(f"signature for {name}: expected a parameter list in parentheses, got "
                         f"{text!r}")
    j = toks.index("(")
    close = _skip_balanced(toks, j, "(", ")")
    inner = toks[j + 1:close - 1]
    pt = _split_top(inner)
    if pt == [["void"]] or pt == [[]]:
        pt = []
    sig = _signature_from_tokens(name, pt, None, {}, struct_formats, declared=True)
    _check_problems(sig)
    return sig


def _check_problems(sig):
    for p in sig.params:
        if p.problem:
            raise ValueError(f"{sig.name}: {p.problem}")


def _as_signature(obj, name):
    if isinstance(obj, Signature):
        return obj
    raise TypeError(f"signatures[{name!r}] must be a string like '(const float* x, int n)' "
                    f"(got {obj!r})")
