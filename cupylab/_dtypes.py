"""The one place that knows every dtype cupylab handles.

Each :class:`DType` carries every spelling the code needs: the canonical name, the item size,
the C type used in kernel name expressions, the NumPy type string (CUDA Array Interface), the
DLPack ``(code, bits)`` pair, the ``struct`` format used to pack a scalar kernel argument, and
the names torch and NumPy/ml_dtypes give it. Nothing here imports CuPy, NumPy or torch.
"""
from __future__ import annotations

import math
import struct

__all__ = ["DType", "DTYPES", "from_name", "from_typestr", "from_dlpack", "resolve"]


class DType:
    """A dtype cupylab can move through kernels.

    Attributes
    ----------
    name : str
        Canonical name (``"float32"``, ``"bfloat16"`` ...).
    itemsize : int
        Bytes per element.
    ctype : str
        C++ spelling used in kernel template name expressions.
    kind : str
        ``"f"`` floating point, ``"i"`` signed integer, ``"b"`` boolean, ``"c"`` complex.
    typestr : str or None
        NumPy/CAI type string, ``None`` where none exists (bfloat16).
    dlpack : tuple
        ``(type code, bits)`` in DLPack.
    fmt : str
        ``struct`` format of one element (bit pattern for the 16-bit floats).
    """

    __slots__ = ("name", "itemsize", "ctype", "kind", "typestr", "dlpack", "fmt",
                 "_struct")

    def __init__(self, name, itemsize, ctype, kind, typestr, dlpack, fmt):
        self.name = name
        self.itemsize = itemsize
        self.ctype = ctype
        self.kind = kind
        self.typestr = typestr
        self.dlpack = dlpack
        self.fmt = fmt
        self._struct = struct.Struct("<" + fmt) if fmt else None

    def __repr__(self):
        return f"cupylab.dtype({self.name!r})"

    def __reduce__(self):
        return (from_name, (self.name,))

    # -- scalars ---------------------------------------------------------------------------
    def scalar_bits(self, value):
        """Convert a Python number to this dtype and return what a kernel parameter of this
        C type holds: an int bit pattern for the 16-bit floats, the packed bytes of the two
        parts for complex, a bool for bool, else the value itself.

        Follows NumPy's rule for converting a Python scalar to an array's dtype (NEP 50): an
        int that does not fit an integer dtype raises ``OverflowError``; floats round (to
        +-inf past the largest finite value).
        """
        k = self.kind
        if k == "i" or k == "u":
            v = int(value)
            bits = 8 * self.itemsize
            lo, hi = (-(1 << (bits - 1)), 1 << (bits - 1)) if k == "i" else (0, 1 << bits)
            if not lo <= v < hi:
                raise OverflowError(f"Python integer {v} out of bounds for {self.name}")
            return v
        if k == "b":
            return bool(value)
        if k == "c":
            z = complex(value)
            part = self.itemsize // 2
            if part == 4:
                return struct.pack("<ff", _round_f32(z.real), _round_f32(z.imag))
            return struct.pack("<dd", z.real, z.imag)
        v = float(value)
        if self.name == "float16":
            try:
                return struct.unpack("<H", struct.pack("<e", v))[0]
            except OverflowError:  # rounds past the largest half: +-inf, as NumPy gives
                return 0x7C00 if v > 0 else 0xFC00
        if self.name == "bfloat16":
            return _float_to_bf16_bits(v)
        if self.name == "float32":
            return _round_f32(v)
        return v


def _round_f32(v: float) -> float:
    """Round to float32 the way NumPy would (overflow to inf, not an error)."""
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _float_to_bf16_bits(v: float) -> int:
    """Round a Python float to bfloat16 (round to nearest even) and return its 16 bits."""
    if math.isnan(v):
        return 0x7FC0
    try:
        u = struct.unpack("<I", struct.pack("<f", v))[0]
    except OverflowError:
        return 0x7F80 if v > 0 else 0xFF80
    f = struct.unpack("<f", struct.pack("<I", u))[0]
    if f != v and not math.isinf(f):
        # Round-to-odd in the float32 step, so that rounding twice (double -> float32 ->
        # bfloat16) gives the correctly rounded result.
        if abs(f) > abs(v):
            u -= 1
        u |= 1
    u += 0x7FFF + ((u >> 16) & 1)
    return (u >> 16) & 0xFFFF


#: Every dtype cupylab understands; the arithmetic operators take them all.
DTYPES = {
    d.name: d
    for d in (
        DType("float16", 2, "cl::half_t", "f", "<f2", (2, 16), "H"),
        DType("bfloat16", 2, "cl::bf16_t", "f", None, (4, 16), "H"),
        DType("float32", 4, "float", "f", "<f4", (2, 32), "f"),
        DType("float64", 8, "double", "f", "<f8", (2, 64), "d"),
        DType("int32", 4, "int", "i", "<i4", (0, 32), "i"),
        DType("int64", 8, "long long", "i", "<i8", (0, 64), "q"),
        DType("bool", 1, "bool", "b", "|b1", (6, 8), "?"),
        DType("int8", 1, "signed char", "i", "|i1", (0, 8), "b"),
        DType("int16", 2, "short", "i", "<i2", (0, 16), "h"),
        DType("uint8", 1, "unsigned char", "u", "|u1", (1, 8), "B"),
        DType("uint16", 2, "unsigned short", "u", "<u2", (1, 16), "H"),
        DType("uint32", 4, "unsigned int", "u", "<u4", (1, 32), "I"),
        DType("uint64", 8, "unsigned long long", "u", "<u8", (1, 64), "Q"),
        DType("complex64", 8, "cl::complex64_t", "c", "<c8", (5, 64), "8s"),
        DType("complex128", 16, "cl::complex128_t", "c", "<c16", (5, 128), "16s"),
    )
}

#: The dtypes cupylab's arithmetic operators accept, in a stable order.
ARITHMETIC = tuple(DTYPES.values())

# -- casting (numpy.can_cast for these dtypes, with ml_dtypes' rules for bfloat16) ------------
_KIND_ORDER = {"b": 0, "u": 1, "i": 2, "f": 3, "c": 4}
# the smallest float / complex item size that holds every value of an integer of n bytes
_INT_TO_FLOAT = {1: 2, 2: 4, 4: 8, 8: 8}


def _safe(a: "DType", b: "DType") -> bool:
    if a is b or a.kind == "b":
        return True
    ka, kb = a.kind, b.kind
    if ka in "iu":
        if kb == "u":
            return ka == "u" and b.itemsize >= a.itemsize
        if kb == "i":
            return b.itemsize >= a.itemsize + (ka == "u")
        if kb == "f":
            if b.name == "bfloat16":
                return a.itemsize == 1  # 8 significant bits, like ml_dtypes says
            return b.itemsize >= _INT_TO_FLOAT[a.itemsize]
        return b.itemsize // 2 >= _INT_TO_FLOAT[a.itemsize]  # complex
    if ka == "f":
        if kb == "f":
            if a.itemsize == 2 and b.itemsize == 2:
                return False  # float16 and bfloat16 do not hold each other
            return b.itemsize >= a.itemsize
        return kb == "c" and b.itemsize // 2 >= a.itemsize
    return kb == "c" and b.itemsize >= a.itemsize


def can_cast(a: "DType", b: "DType", casting: str) -> bool:
    """Whether a cast from ``a`` to ``b`` is allowed under NumPy's ``casting`` rule
    (``"no"``, ``"equiv"``, ``"safe"``, ``"same_kind"``, ``"unsafe"``)."""
    if casting == "unsafe" or a is b:
        return True
    if casting in ("no", "equiv"):
        return False
    if _safe(a, b):
        return True
    return casting == "same_kind" and _KIND_ORDER[a.kind] <= _KIND_ORDER[b.kind]


CASTING = ("no", "equiv", "safe", "same_kind", "unsafe")

_BY_TYPESTR = {}
for _d in DTYPES.values():
    if _d.typestr:
        _BY_TYPESTR[_d.typestr] = _d
        _BY_TYPESTR[_d.typestr.replace("<", "=")] = _d
        if _d.itemsize == 1:
            _BY_TYPESTR[_d.typestr.replace("|", "<")] = _d
            _BY_TYPESTR[_d.typestr.replace("|", "=")] = _d
_BY_DLPACK = {d.dlpack: d for d in DTYPES.values()}
# "float" is NumPy's word for float64 (np.dtype("float"), dtype=float); C's float is "fp32"
_ALIASES = {"half": "float16", "float": "float64", "double": "float64", "bf16": "bfloat16",
            "fp16": "float16", "fp32": "float32", "fp64": "float64", "f16": "float16",
            "f32": "float32", "f64": "float64", "i32": "int32", "i64": "int64", "int": "int64"}


# torch's dtype aliases, which differ from NumPy's words ("torch.float" is float32,
# "torch.int" int32)
_TORCH_WORDS = {"float": "float32", "double": "float64", "half": "float16", "int": "int32",
                "long": "int64", "short": "int16", "cfloat": "complex64",
                "cdouble": "complex128"}


def from_name(name: str) -> DType:
    """Look a dtype up by canonical name or common alias (``"fp32"``, ``"bf16"``)."""
    key = _ALIASES.get(name, name)
    try:
        return DTYPES[key]
    except KeyError:
        raise TypeError(f"unknown dtype {name!r}; cupylab knows: {', '.join(DTYPES)}") from None


def from_typestr(typestr: str) -> DType:
    """Map a NumPy/CAI type string (``"<f4"``) to a :class:`DType`."""
    d = _BY_TYPESTR.get(typestr)
    if d is None:
        if typestr.startswith(">"):
            raise TypeError(f"big-endian data ({typestr!r}) is not supported")
        raise TypeError(f"unsupported CUDA Array Interface typestr {typestr!r}")
    return d


def from_dlpack(code: int, bits: int, lanes: int = 1) -> DType:
    """Map a DLPack ``(code, bits, lanes)`` triple to a :class:`DType`."""
    if lanes != 1:
        raise TypeError(f"DLPack vector dtypes (lanes={lanes}) are not supported")
    d = _BY_DLPACK.get((code, bits))
    if d is None:
        raise TypeError(f"unsupported DLPack dtype (code={code}, bits={bits})")
    return d


_PY_TYPES = {bool: "bool", int: "int64", float: "float64", complex: "complex128"}


def resolve(dtype) -> DType:
    """Accept a :class:`DType`, a name, a NumPy/ml_dtypes dtype or scalar type, a torch
    dtype, or a Python type (``float`` and ``"float"`` are float64, ``complex`` complex128,
    as in NumPy), and return the :class:`DType`. A string cupylab does not know is read by
    NumPy (``"f8"``, ``"d"``)."""
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, type) and dtype in _PY_TYPES:
        return DTYPES[_PY_TYPES[dtype]]
    if isinstance(dtype, str):
        if dtype.startswith("torch."):  # torch's own words: torch.float is float32
            name = _TORCH_WORDS.get(dtype[6:], dtype[6:])
        else:
            name = dtype
        if name not in DTYPES and name not in _ALIASES:
            try:
                import numpy as np  # noqa: PLC0415

                name = np.dtype(name).name
            except TypeError:
                pass
        return from_name(name)
    # torch.dtype prints as "torch.float32"; numpy dtypes and scalar types have .name or
    # __name__; ml_dtypes.bfloat16 is named "bfloat16".
    name = getattr(dtype, "name", None)
    if not isinstance(name, str):
        name = getattr(dtype, "__name__", None) or str(dtype)
    if name.startswith("torch."):
        name = name[6:]
    return from_name(name)
