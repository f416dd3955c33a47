"""Bring your own kernel: users' CUDA kernels through cupylab's machinery.

What the seed did with a hand-written C extension and a torch build (``vector_add.cu`` bound
through the Python C-API) takes three lines here::

    mod = cupylab.load_kernels("vector_add.cu")          # parse, compile lazily, cache on disk
    k = mod["vector_add"]                                  # signature parsed from the source
    k.launch_1d(n, x, y, out, n)                           # any GPU arrays, caller's stream

The pieces are cupylab's own: :class:`cupylab._compile.Program` (NVRTC through CuPy, the
persistent binary cache keyed on source, included headers, options, arch and NVRTC version),
:func:`cupylab._arrays.as_view` (the zero-copy argument normaliser),
:class:`cupylab._launch.Kernel` (struct-packed arguments, ``cuLaunchKernel`` on the caller's
stream) and :func:`cupylab._elementwise_core.prepare_call` (NumPy-style operands and output
allocation in the caller's framework). This module adds what a *user's* kernel needs on top:

* a small C++ declaration scanner that finds ``__global__`` functions (``extern "C"``, in
  ``extern "C" { }`` blocks, in namespaces, templated) and reads their parameter lists, so that
  every scalar is packed at the width its C type needs — CuPy's ``RawKernel`` passes a Python
  ``int`` as 64 bits and checks nothing, which silently shifts every later argument;
* per-parameter checks: pointer parameters take GPU arrays whose dtype matches the pointee
  (``float*`` refuses a float64 array), read-only arrays (JAX) only go to ``const`` pointers,
  scalar parameters take range-checked Python/NumPy scalars, the argument count must match;
* :class:`ElementwiseKernel`, which turns a kernel of the form ``k(out, in..., n)`` into a
  NumPy-style function returning the caller's array type.

All argument checks run before any GPU call (they are CPU-testable with fake CUDA Array
Interface objects); nothing is launched when one fails.
"""
from __future__ import annotations

import ctypes
import importlib.util
import math
import numbers
import os
import re
import struct
import threading
from pathlib import Path

from . import _arrays, _compile, _dtypes, _launch, _runtime
from ._elementwise_core import c_strides, finish_output, prepare_call
from ._errors import CupylabError

__all__ = ["load_kernels", "KernelModule", "Kernel", "ElementwiseKernel", "Signature", "Param",
           "KernelNotFoundError", "parse_kernels", "parse_signature", "cuda_include_dir",
           "C_TYPE_NAMES", "BLOCKS_PER_SM_1D"]


class KernelNotFoundError(CupylabError, KeyError):
    """A kernel name that is not a ``__global__`` function of the source; the message lists
    the ones that are."""

    def __str__(self):  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


# =============================================================================================
# Scanning C++ source for __global__ functions
# =============================================================================================
_STRIP_RE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
_TOKEN_RE = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|[A-Za-z_]\w*|\d[\w.]*|::|\.\.\.'
                       r'|&&|\S')
_IDENT_RE = re.compile(r"[A-Za-z_]\w*\Z")

#: Words that qualify a type without changing what is passed.
_QUALIFIERS = frozenset({
    "const", "volatile", "__restrict__", "__restrict", "restrict", "register", "struct", "class",
    "union", "enum", "typename", "__grid_constant__"})
#: Words that build the builtin integer types.
_INT_WORDS = frozenset({"unsigned", "signed", "int", "long", "short", "char"})
_TYPE_WORDS = _INT_WORDS | {"bool", "float", "double", "void"}
#: Attribute-like words after ``__global__`` that take a parenthesised argument list.
_ATTR_CALLS = frozenset({"__launch_bounds__", "__attribute__", "__maxnreg__", "__cluster_dims__",
                         "__declspec", "alignas", "__align__"})


def _is_ident(t):
    return _IDENT_RE.match(t) is not None


def _strip_source(src: str) -> str:
    """Remove comments and preprocessor lines (with continuations); keep string literals and
    line count."""
    def repl(m):
        s = m.group(0)
        if s.startswith("//"):
            return " "
        if s.startswith("/*"):
            return " " + "\n" * s.count("\n")
        return s

    text = _STRIP_RE.sub(repl, src)
    out, cont = [], False
    for line in text.split("\n"):
        if cont or line.lstrip().startswith("#"):
            cont = line.rstrip().endswith("\\")
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def _tokenize(text: str):
    return _TOKEN_RE.findall(text)


def _skip_balanced(toks, i, open_, close):
    """``toks[i] == open_``; return the index just after its matching ``close``."""
    depth = 0
    n = len(toks)
    while i < n:
        t = toks[i]
        if t == open_:
            depth += 1
        elif t == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def _match_angle(toks, i):
    """``toks[i] == '<'``; index of the matching ``'>'`` (parentheses shield comparisons)."""
    depth = paren = 0
    for j in range(i, len(toks)):
        t = toks[j]
        if t in "([":
            paren += 1
        elif t in ")]":
            paren -= 1
        elif paren == 0 and t == "<":
            depth += 1
        elif paren == 0 and t == ">":
            depth -= 1
            if depth == 0:
                return j
    return len(toks)


def _split_top(toks):
    """Split a token list on commas outside (), [], {}, <>."""
    if not toks:
        return []
    parts, cur, depth = [], [], 0
    for t in toks:
        if t in ("(", "[", "{", "<"):
            depth += 1
        elif t in (")", "]", "}", ">"):
            depth -= 1
        if t == "," and depth == 0:
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    parts.append(cur)
    return parts


def _join(toks) -> str:
    """Tokens back to C++ text, spaced the way people write types (``cl::half_t``,
    ``Vec<float, 4>``, ``unsigned int``)."""
    s = " ".join(toks)
    s = re.sub(r"\s*(::|<|>)\s*", r"\1", s)
    s = re.sub(r"\s*,\s*", ", ", s)
    s = re.sub(r"\s*\*", "*", s)
    return s.strip()


class _TemplateParam:
    __slots__ = ("kind", "name", "default", "variadic", "text")

    def __init__(self, kind, name, default, variadic, text):
        self.kind, self.name, self.default, self.variadic, self.text = (
            kind, name, default, variadic, text)


def _parse_template_params(toks):
    out = []
    for p in _split_top(toks):
        if not p:
            continue
        eq = _top_index(p, "=")
        head, default = (p[:eq], p[eq + 1:]) if eq >= 0 else (p, None)
        variadic = "..." in head
        kind = "type" if head and head[0] in ("typename", "class", "template") else "value"
        idents = [t for t in head if _is_ident(t)]
        name = None
        if len(idents) >= 2 and idents[-1] not in _TYPE_WORDS | {"typename", "class"}:
            name = idents[-1]
        out.append(_TemplateParam(kind, name, default, variadic, _join(p)))
    return out


def _top_index(toks, tok):
    depth = 0
    for i, t in enumerate(toks):
        if t in ("(", "[", "{", "<"):
            depth += 1
        elif t in (")", "]", "}", ">"):
            depth -= 1
        elif t == tok and depth == 0:
            return i
    return -1


class _Decl:
    """One ``__global__`` function found in a source."""

    __slots__ = ("name", "template", "extern_c", "params", "defined", "overloaded", "source")

    def __init__(self, name, template, extern_c, params, defined, source):
        self.name = name              # qualified: "ns::f"
        self.template = template      # list of _TemplateParam, or None
        self.extern_c = extern_c
        self.params = params          # list of token lists
        self.defined = defined        # a body was seen
        self.overloaded = False
        self.source = source          # file it was found in (for messages)

    @property
    def display(self):
        if self.template is not None:
            return f"{self.name}<{', '.join(t.text for t in self.template)}>"
        return self.name


def _scan(source: str, filename="<string>"):
    """Find ``__global__`` functions and namespace-scope ``typedef``/``using`` aliases.

    Returns ``(decls, aliases)``: a list of :class:`_Decl` in source order and a dict
    alias name → type tokens.
    """
    toks = _tokenize(_strip_source(source))
    n = len(toks)
    decls, aliases, scopes = [], {}, []
    i = start = 0
    while i < n:
        t = toks[i]
        if t == "namespace":
            j, parts = i + 1, []
            while j < n and (toks[j] == "::" or _is_ident(toks[j])):
                if _is_ident(toks[j]) and toks[j] != "inline":
                    parts.append(toks[j])
                j += 1
            if j < n and toks[j] == "{":
                scopes.append(("ns", "::".join(parts)))
                i = start = j + 1
                continue
        elif t == "extern" and i + 2 < n and toks[i + 1] == '"C"' and toks[i + 2] == "{":
            scopes.append(("c", None))
            i = start = i + 3
            continue
        elif t == "{":
            i = start = _skip_balanced(toks, i, "{", "}")
            continue
        elif t == "}":
            if scopes:
                scopes.pop()
            i = start = i + 1
            continue
        elif t == ";":
            _alias(toks[start:i], aliases)
            i = start = i + 1
            continue
        elif t == "__global__":
            d, i = _parse_global(toks, start, i, scopes, filename)
            if d is not None:
                decls.append(d)
            start = i
            continue
        i += 1
    return decls, aliases


def _alias(stmt, aliases):
    """Record ``typedef <type> NAME`` and ``using NAME = <type>`` (simple aliases only)."""
    if not stmt or "(" in stmt or "{" in stmt:
        return
    if stmt[0] == "typedef" and len(stmt) >= 3 and _is_ident(stmt[-1]):
        aliases[stmt[-1]] = list(stmt[1:-1])
    elif (stmt[0] == "using" and len(stmt) >= 4 and _is_ident(stmt[1]) and stmt[2] == "="
          and stmt[1] != "namespace"):
        aliases[stmt[1]] = list(stmt[3:])


def _parse_global(toks, start, g, scopes, filename):
    n = len(toks)
    prefix = toks[start:g]
    extern_c = any(s[0] == "c" for s in scopes) or any(
        prefix[k] == "extern" and prefix[k + 1] == '"C"' for k in range(len(prefix) - 1))
    template = None
    if "template" in prefix:
        k = prefix.index("template")
        if k + 1 < len(prefix) and prefix[k + 1] == "<":
            end = _match_angle(prefix, k + 1)
            template = _parse_template_params(prefix[k + 2:end])
    j = g + 1
    name_parts = None
    while j < n:
        t = toks[j]
        if t in _ATTR_CALLS and j + 1 < n and toks[j + 1] == "(":
            j = _skip_balanced(toks, j + 1, "(", ")")
            continue
        if t == "[" and j + 1 < n and toks[j + 1] == "[":
            j = _skip_balanced(toks, j, "[", "]")
            continue
        if t in (";", "{", "}"):
            return None, j
        if _is_ident(t) or t == "::":
            # one (possibly qualified) name: ident (:: ident)*
            k = j + 1 if t == "::" else j
            parts = []
            while k < n and _is_ident(toks[k]):
                parts.append(toks[k])
                k += 1
                if k + 1 < n and toks[k] == "::" and _is_ident(toks[k + 1]):
                    k += 1
                    continue
                break
            if parts and k < n and toks[k] == "(" and parts[-1] not in _ATTR_CALLS:
                name_parts = parts
                j = k
                break
            j = max(k, j + 1)
            continue
        j += 1
    if name_parts is None:
        return None, j
    close = _skip_balanced(toks, j, "(", ")")
    inner = toks[j + 1:close - 1]
    params = [p for p in _split_top(inner)]
    if params == [["void"]] or params == [[]]:
        params = []
    k = close
    while k < n and toks[k] not in ("{", ";"):
        k += 1
    defined = k < n and toks[k] == "{"
    end = _skip_balanced(toks, k, "{", "}") if defined else min(k + 1, n)
    ns = [s[1] for s in scopes if s[0] == "ns" and s[1]]
    name = "::".join(ns + name_parts)
    return _Decl(name, template, extern_c, params, defined, filename), end


# =============================================================================================
# C types -> struct formats and converters
# =============================================================================================
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

    return conv


def _make_float_conv(ctype, dt):
    name = dt.name
    inf_bits = {"float16": (0x7C00, 0xFC00), "bfloat16": (0x7F80, 0xFF80)}.get(name)

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


# =============================================================================================
# Parameters and signatures
# =============================================================================================
class Param:
    """One kernel parameter, resolved to what is passed.

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


def parse_kernels(source, filename="<string>"):
    """List the ``__global__`` functions of a CUDA C++ source.

    A light scanner, not a compiler: it strips comments and preprocessor lines, tracks
    namespaces and ``extern "C"`` blocks, and reads each ``__global__`` declaration's
    template parameters and parameter list. Kernels produced by macros are not seen (declare
    them with ``signatures=``).

    Parameters
    ----------
    source : str
    filename : str
        For messages.

    Returns
    -------
    dict
        Qualified kernel name → a description string (``"scale<typename T>(T* x, T s, int
        n)"`` with the template parameters unresolved).
    """
    decls, _ = _scan(source, filename)
    out = {}
    for d in decls:
        out.setdefault(d.name, f"{d.display}({', '.join(_join(p) for p in d.params)})")
    return out


def _split_name_expr(expr):
    """``"ns::scale<float, 4>"`` → ``("ns::scale", [["float"], ["4"]])``; no ``<>`` → ``None``
    for the arguments."""
    toks = _tokenize(expr)
    if "<" not in toks:
        return _canon_name(toks), None
    k = toks.index("<")
    end = _match_angle(toks, k)
    if end != len(toks) - 1:
        raise ValueError(f"cannot read the name expression {expr!r}")
    return _canon_name(toks[:k]), _split_top(toks[k + 1:end])


def _canon_name(toks):
    s = "".join(toks)
    return s[2:] if s.startswith("::") else s


# =============================================================================================
# Modules
# =============================================================================================
_cuda_inc = [False, None]


def cuda_include_dir():
    """The CUDA toolkit's include directory (for ``<cuda_fp16.h>`` and friends), or ``None``.

    Looked for, in order, in the NVIDIA pip wheels next to the NVRTC in use
    (``nvidia/cu<major>/include``, ``nvidia/cuda_runtime/include``), ``$CUDA_PATH``,
    ``$CUDA_HOME`` and ``/usr/local/cuda``. NVRTC itself has no default include path.
    """
    if _cuda_inc[0]:
        return _cuda_inc[1]
    cands = []
    try:
        spec = importlib.util.find_spec("nvidia")
        locs = list(spec.submodule_search_locations or ()) if spec else []
    except (ImportError, ValueError):
        locs = []
    try:
        major = _compile.nvrtc_version()[0]
    except Exception:  # noqa: BLE001 - no NVRTC: nothing will compile anyway
        major = None
    for base in locs:
        if major is not None:
            cands.append(Path(base) / f"cu{major}" / "include")
        cands.append(Path(base) / "cuda_runtime" / "include")
    for env in ("CUDA_PATH", "CUDA_HOME"):
        v = os.environ.get(env)
        if v:
            cands.append(Path(v) / "include")
    cands.append(Path("/usr/local/cuda/include"))
    found = next((str(c) for c in cands if (c / "cuda_fp16.h").is_file()), None)
    _cuda_inc[:] = [True, found]
    return found


_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def _user_headers(source, here, include_dirs):
    """``(path, text)`` of every header reachable from ``source`` through the user's include
    directories (not the CUDA toolkit's), for the kernel scanner."""
    seen, out = set(), []

    def walk(text, cur):
        for inc in _INCLUDE_RE.findall(text):
            for d in ((cur,) if cur else ()) + tuple(include_dirs):
                p = Path(d) / inc
                if p.is_file():
                    rp = p.resolve()
                    if rp not in seen:
                        seen.add(rp)
                        body = p.read_text(errors="replace")
                        out.append((str(p), body))
                        walk(body, str(p.parent))
                    break

    walk(source, here)
    return out


class KernelModule:
    """The kernels of one CUDA source, ready to launch. Made by :func:`load_kernels`.

    ``module[name]`` returns a :class:`Kernel`. ``name`` is a kernel name (``"vector_add"``,
    ``"ns::f"``; a unique unqualified name also works) or, for templates, an instance
    (``"scale<float>"``). Instances listed in ``name_expressions`` are compiled together with
    every non-template kernel in one NVRTC program; any other instance is compiled on first
    launch as a program of its own (and cached on disk like the rest).

    Compilation is lazy: the first launch on a device compiles (or loads from the disk cache)
    and loads the module there. :meth:`compile` does it ahead of time.

    Attributes
    ----------
    filename : str
        Name NVRTC reports in messages (the path given to :func:`load_kernels`).
    source : str
    program : cupylab._compile.Program
        The main program (non-template kernels plus ``name_expressions``).
    """

    def __init__(self, source, filename, name_expressions=(), options=(), include_dirs=(),
                 signatures=None, struct_formats=None, here=None):
        self.source = source
        self.filename = filename
        self._options = tuple(options)
        inc = tuple(str(d) for d in include_dirs)
        user_dirs = ((here,) if here else ()) + inc
        cuda_inc = cuda_include_dir()
        self._include_dirs = user_dirs + ((cuda_inc,) if cuda_inc and cuda_inc not in
                                          user_dirs else ())
        self._struct_formats = dict(struct_formats or {})
        decls, aliases = _scan(source, filename)
        for hpath, htext in _user_headers(source, here, inc):
            hd, ha = _scan(htext, hpath)
            decls = hd + decls
            for k, v in ha.items():
                aliases.setdefault(k, v)
        self._aliases = aliases
        self._decls = {}
        for d in decls:
            prev = self._decls.get(d.name)
            if prev is None:
                self._decls[d.name] = d
                continue
            if _param_types(prev) != _param_types(d) or (prev.template is None) != (
                    d.template is None):
                prev.overloaded = True
            elif d.defined or not prev.defined:
                d.overloaded = prev.overloaded
                d.defined = d.defined or prev.defined
                self._decls[d.name] = d
        self._declared = {}
        for nm, text in (signatures or {}).items():
            self._declared[nm] = (parse_signature(text, nm, self._struct_formats)
                                  if isinstance(text, str) else _as_signature(text, nm))
        exprs = []
        for e in name_expressions:
            e = str(e)
            if e not in self._declared:
                e = self._resolve(e)[0]
            if e not in exprs:
                exprs.append(e)
        for d in self._decls.values():
            if d.template is None and d.defined and not d.overloaded and d.name not in exprs:
                exprs.append(d.name)
        for nm in self._declared:  # declared signatures name kernels that exist
            if nm not in exprs:
                exprs.append(nm)
        self.program = _compile.Program(source, filename, exprs, self._options,
                                        self._include_dirs)
        self._programs = {}
        self._kernels = {}
        self._lock = threading.Lock()

    # -- names ----------------------------------------------------------------------------------
    @property
    def names(self):
        """The ``__global__`` functions found (templates shown with their parameters)."""
        return [d.display for d in self._decls.values()]

    def _available(self):
        names = self.names + [n for n in self._declared if n not in self._decls]
        return ", ".join(names) if names else "(none)"

    def _not_found(self, key, base):
        hint = ""
        short = base.rsplit("::", 1)[-1]
        near = [d.display for d in self._decls.values()
                if d.name.rsplit("::", 1)[-1].lower() == short.lower()]
        if near:
            hint = f" (did you mean {', '.join(near)}?)"
        return KernelNotFoundError(
            f"kernel {key!r} is not a __global__ function of {self.filename}{hint}; found: "
            f"{self._available()}. Kernels made by macros are invisible to the scanner: "
            "declare them with signatures={name: '(const float* x, int n)'}")

    def _find_decl(self, base, key):
        d = self._decls.get(base)
        if d is None:
            cands = [x for x in self._decls.values() if x.name.rsplit("::", 1)[-1] == base]
            if len(cands) == 1:
                d = cands[0]
            elif len(cands) > 1:
                raise KernelNotFoundError(
                    f"kernel {key!r} is ambiguous in {self.filename}: "
                    f"{', '.join(c.name for c in cands)}; qualify the name")
        if d is None:
            raise self._not_found(key, base)
        return d

    def _resolve(self, key):
        """``key`` → ``(name expression, Signature)``."""
        if key in self._declared:
            return key, self._declared[key]
        try:
            base, targs = _split_name_expr(key)
        except ValueError as e:
            raise KernelNotFoundError(f"{e}; found: {self._available()}") from None
        d = self._find_decl(base, key)
        if d.overloaded:
            raise ValueError(
                f"kernel {d.name!r} in {self.filename} is overloaded (declared with different "
                "parameter lists); cupylab cannot tell the overloads apart: give them "
                "different names")
        subst = {}
        if d.template is not None:
            if targs is None:
                raise TypeError(
                    f"kernel {d.display} in {self.filename} is a template: name an instance, "
                    f"e.g. module[{_example_instance(d)!r}]")
            if len(targs) > len(d.template) and not any(t.variadic for t in d.template):
                raise TypeError(f"{key}: {len(targs)} template arguments for "
                                f"{d.display} (it takes {len(d.template)})")
            for i, tp in enumerate(d.template):
                if tp.variadic:
                    break
                if i < len(targs):
                    arg = targs[i]
                elif tp.default is not None:
                    arg = list(tp.default)
                else:
                    raise TypeError(f"{key}: missing template argument {tp.text!r} of "
                                    f"{d.display}")
                if tp.name:
                    subst[tp.name] = arg
            expr = d.name + "<" + ", ".join(_join(a) for a in targs) + ">"
        else:
            if targs is not None:
                raise TypeError(f"{key}: {d.name} is not a template; use module[{d.name!r}]")
            expr = d.name
        sig = _signature_from_tokens(expr, d.params, subst, self._aliases, self._struct_formats)
        return expr, sig

    # -- kernels --------------------------------------------------------------------------------
    def __getitem__(self, name) -> "Kernel":
        """The :class:`Kernel` for a kernel name or template instance (cached per name).

        Raises
        ------
        KernelNotFoundError
            No ``__global__`` function of that name (the message lists those found).
        TypeError
            A template named without its arguments, or a non-template given some.
        ValueError
            An overloaded kernel, or a parameter cupylab cannot pass (reference, by-value
            struct without ``struct_formats``).
        """
        k = self._kernels.get(name)
        if k is not None:
            return k
        if not isinstance(name, str):
            raise TypeError(f"kernel names are strings (got {name!r})")
        expr, sig = self._resolve(name)
        _check_problems(sig)
        with self._lock:
            k = self._kernels.get(name)
            if k is None:
                k = Kernel(self, expr, sig, self._program_for(expr))
                self._kernels[name] = k
        return k

    def __contains__(self, name):
        """Whether ``module[name]`` would find a kernel."""
        try:
            self._resolve(name)
        except (KeyError, TypeError, ValueError):
            return False
        return True

    def _program_for(self, expr):
        if expr in self.program.name_expressions:
            return self.program
        p = self._programs.get(expr)
        if p is None:
            p = self._programs[expr] = _compile.Program(
                self.source, self.filename, [expr], self._options, self._include_dirs)
        return p

    def compile(self, cc=None):
        """Compile now (or fetch from the disk cache) instead of at the first launch.

        Parameters
        ----------
        cc : int, optional
            Compute capability (``80``, ``90``). Default: the current device's. Compiling
            for an explicit ``cc`` needs no GPU.

        Returns
        -------
        dict
            Name expression → lowered (mangled) name, for every kernel compiled.

        Raises
        ------
        cupylab.CompileError
            With NVRTC's log: file name, line and message of each error.
        """
        if cc is None:
            cc = _runtime.device_info(_runtime.current_device()).cc
        mapping = {}
        for p in [self.program] + list(self._programs.values()):
            if not p.name_expressions:
                continue  # a source of templates only: nothing to instantiate yet
            mapping.update(_compile.compile_program(p, int(cc))[1])
        return mapping

    def __repr__(self):
        return f"<cupylab.KernelModule {self.filename!r}: {', '.join(self.names)}>"


def _param_types(d):
    out = []
    for t in d.params:
        toks = t[:_top_index(t, "=")] if _top_index(t, "=") >= 0 else t
        if len(toks) >= 2 and _is_ident(toks[-1]) and toks[-1] not in _TYPE_WORDS | _QUALIFIERS:
            rest = [x for x in toks[:-1] if x not in _QUALIFIERS]
            if rest:
                toks = toks[:-1]
        out.append(tuple(toks))
    return tuple(out)


def _example_instance(d):
    args = ["float" if t.kind == "type" else "1" for t in d.template if t.default is None
            and not t.variadic]
    return f"{d.name}<{', '.join(args)}>"


def _as_signature(obj, name):
    if isinstance(obj, Signature):
        return obj
    raise TypeError(f"signatures[{name!r}] must be a string like '(const float* x, int n)' "
                    f"(got {obj!r})")


# =============================================================================================
# Kernels
# =============================================================================================
_PENDING = object()
_MAX_GRID_X = 2**31 - 1
_MAX_GRID_YZ = 65535
_MAX_BLOCK = 1024
_MAX_BLOCK_Z = 64
_SMEM_DEFAULT_MAX = 48 * 1024  # above this, a kernel must opt in (cudaFuncSetAttribute)
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
#: launch_1d's grid cap, in blocks per SM. NVIDIA's grid-stride guidance ("CUDA Pro Tip: Write
#: Flexible Kernels with Grid-Stride Loops") launches 32 x numSMs blocks: with 256-thread blocks
#: that is 4 full waves on an SM holding 2048 threads, enough to hide memory latency, while
#: larger inputs make each thread loop instead of paying for more blocks.
BLOCKS_PER_SM_1D = 32


def _dims(v, what, lo):
    if isinstance(v, bool):
        raise TypeError(f"{what} must be an int or a tuple of 1-3 ints (got {v!r})")
    if isinstance(v, numbers.Integral):
        t = (int(v), 1, 1)
    elif isinstance(v, (tuple, list)) and 1 <= len(v) <= 3 and all(
            isinstance(e, numbers.Integral) and not isinstance(e, bool) for e in v):
        t = tuple(int(e) for e in v) + (1,) * (3 - len(v))
    else:
        raise TypeError(f"{what} must be an int or a tuple of 1-3 ints (got {v!r})")
    if any(e < lo for e in t):
        raise ValueError(f"{what} dimensions must be >= {lo} (got {v!r})")
    return t


def _grid(v, what="grid"):
    g = _dims(v, what, 0)
    if g[0] > _MAX_GRID_X or g[1] > _MAX_GRID_YZ or g[2] > _MAX_GRID_YZ:
        raise ValueError(f"{what}={v!r} exceeds CUDA's limits (x <= {_MAX_GRID_X}, y and z <= "
                         f"{_MAX_GRID_YZ})")
    return g


def _block(v):
    b = _dims(v, "block", 1)
    if b[0] * b[1] * b[2] > _MAX_BLOCK or b[2] > _MAX_BLOCK_Z:
        raise ValueError(f"block={v!r} has {b[0] * b[1] * b[2]} threads; CUDA allows at most "
                         f"{_MAX_BLOCK} per block (and z <= {_MAX_BLOCK_Z})")
    return b


def _smem(v):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ValueError(f"shared_mem must be a non-negative number of bytes (got {v!r})")
    return int(v)


class Kernel:
    """One kernel instance of a :class:`KernelModule`, launchable on any framework's arrays.

    Arguments follow the kernel's C signature, one per parameter:

    * pointer parameters take a GPU array — CuPy, torch, JAX (read-only: ``const`` pointers
      only), Numba, or any ``__cuda_array_interface__`` / DLPack object — zero-copy; or an
      ``int`` device address; or ``None`` (``nullptr``). The array's dtype must match the
      pointee (``float*`` takes float32, ``__half*`` float16, ``long long*`` int64 ...;
      ``void*`` and ``char*`` take any). A read-only array given to a non-``const`` pointer is
      refused. The kernel sees the data pointer only: it is the kernel's job to index
      strides/offsets correctly (pass contiguous arrays for linear indexing).
    * scalar parameters take Python or NumPy scalars, converted to the parameter's C type and
      packed at its width (``int`` 4 bytes, ``long long``/``size_t`` 8, ``__half`` and
      ``__nv_bfloat16`` 2, ``bool`` 1 ...). Out-of-range integers raise ``OverflowError``, a
      float given to an integer parameter raises ``TypeError``, values that would round to
      inf in a narrower float type raise ``OverflowError``.
    * CUDA vector types (``float4``, ``int2`` ...) and structs declared with
      ``struct_formats`` take a tuple of members (or a ctypes instance).

    Launches go on ``stream`` if given, else on the caller's current stream: torch's when any
    argument is a torch tensor, CuPy's otherwise. CUDA Array Interface producers that name a
    stream (v3) are waited on with an event (never a host block); DLPack producers are given
    the launch stream. The launch never blocks the host. All arrays must be on one GPU, which
    is made current for the launch. Every argument is referenced until the launch call has
    returned; the memory must then stay valid until the kernel has run, which the
    frameworks' stream-ordered allocators ensure for arrays the caller still holds.

    Attributes
    ----------
    name : str
        The name expression.
    signature : Signature
    module : KernelModule
    """

    __slots__ = ("name", "signature", "module", "_k", "_params", "_n", "_smem_set")

    def __init__(self, module, name_expression, signature, program):
        self.name = name_expression
        self.signature = signature
        self.module = module
        self._params = signature.params
        self._n = len(self._params)
        self._k = _launch.Kernel(program, name_expression, signature.formats)
        self._smem_set = {}

    def __repr__(self):
        return f"<cupylab.Kernel {self.signature}>"

    @property
    def param_offsets(self):
        """Byte offset of each parameter in the buffer :meth:`pack` returns."""
        return self._k._offsets

    # -- argument binding (no GPU call) -------------------------------------------------------
    def _bind(self, args):
        """Check and convert every argument that can be checked without the GPU.

        Returns ``(values, views, pending, torch_seen)``: ``values`` ready to pack except the
        DLPack/JAX pointers (``_PENDING``, listed in ``pending`` as ``(index, adapter)``),
        the views of the other arrays, and whether a torch tensor was among them.
        """
        params = self._params
        if len(args) != self._n:
            raise TypeError(f"{self.signature} takes {self._n} argument"
                            f"{'' if self._n == 1 else 's'} (got {len(args)})")
        values = [None] * self._n
        views = []
        pending = None
        torch_seen = False
        adapters = _arrays._ADAPTERS
        for i, (p, a) in enumerate(zip(params, args)):
            if not p.pointer:
                values[i] = p.convert(a, p.what)
                continue
            fn = adapters.get(type(a)) or _arrays.framework_of(a)
            if fn is None:
                values[i] = _address(p, a)
                continue
            if fn in _arrays.DEFERRED:
                if fn is _arrays._from_jax and not p.const:
                    raise ValueError(_readonly_msg(p, "jax"))
                values[i] = _PENDING
                if pending is None:
                    pending = []
                pending.append((i, fn, _arrays.deferred_device(a, fn, p.what)))
                continue
            v = fn(a, p.what, None)
            _check_view(p, v)
            if v.kind == "torch":
                torch_seen = True
            views.append(v)
            values[i] = v.ptr
        return values, views, pending, torch_seen

    def pack(self, *args):
        """The parameter buffer a launch with ``args`` would pass (a debugging aid).

        Runs every argument check; parameter ``i`` is at ``param_offsets[i]``. DLPack/JAX
        arrays are imported without a stream.

        Returns
        -------
        bytes
        """
        values, views, pending, _ = self._bind(args)
        for i, fn, _ in pending or ():
            p = self._params[i]
            v = _arrays.import_deferred(args[i], fn, p.what, None)
            _check_view(p, v)
            values[i] = v.ptr
        return self._k._struct.pack(*values)

    # -- launching ------------------------------------------------------------------------------
    def __call__(self, *args, grid, block=256, shared_mem=0, stream=None):
        """Launch with an explicit configuration: ``kernel<<<grid, block, shared_mem,
        stream>>>(*args)``.

        Parameters
        ----------
        *args
            One per kernel parameter (see the class docstring).
        grid : int or tuple of 1-3 ints
            Blocks per grid. A zero dimension launches nothing (the arguments are still
            checked).
        block : int or tuple of 1-3 ints
            Threads per block (at most 1024 in all).
        shared_mem : int
            Dynamic shared memory in bytes. Above 48 KiB the kernel's opt-in attribute is
            set for you (up to the device's limit).
        stream : optional
            A CuPy or torch stream, an int ``cudaStream_t``, or an object with
            ``__cuda_stream__``. Default: the caller's current stream.

        Raises
        ------
        TypeError
            Wrong argument count, host arrays, dtype not matching a pointer's type, an array
            or a float given to an integer parameter, bad grid/block types.
        ValueError
            A read-only array given to a non-const pointer, arrays on different GPUs, grid or
            block beyond CUDA's limits.
        OverflowError
            A scalar that does not fit its parameter's C type.
        cupylab.CompileError
            On the first launch, when NVRTC rejects the source.
        """
        g = _grid(grid)
        b = _block(block)
        self._launch(args, g, b, _smem(shared_mem), stream, None)

    def launch_1d(self, n, *args, block=256, shared_mem=0, stream=None):
        """Launch a 1-D grid-stride kernel over ``n`` elements.

        The grid is ``min(ceil(n / block), BLOCKS_PER_SM_1D * SM count)`` blocks, so the
        kernel must loop (``for (i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i +=
        gridDim.x * blockDim.x)``). Nothing is launched when ``n == 0``.

        Parameters
        ----------
        n : int
            Number of elements the grid covers (usually also passed as an argument).
        *args
            One per kernel parameter.
        block : int
            Threads per block.
        shared_mem : int
            Dynamic shared memory in bytes.
        stream : optional
            As for :meth:`__call__`.

        Raises
        ------
        Same as :meth:`__call__`; ``ValueError`` for a negative ``n``.
        """
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"{self.name}: n must be a non-negative int (got {n!r})")
        b = _block(block)
        if b[1] != 1 or b[2] != 1:
            raise ValueError(f"launch_1d takes a 1-D block (got {block!r})")
        self._launch(args, None, b, _smem(shared_mem), stream, int(n))

    def _launch(self, args, grid, block, smem, stream, n1d):
        values, views, pending, torch_seen = self._bind(args)
        empty = (n1d == 0) if n1d is not None else (0 in grid)
        if empty and pending is None:
            return
        device = None
        first = None
        for v in views:
            if v.device is None and not v.ptr:
                continue
            d = _arrays.resolve_device(v, None)
            if device is None:
                device, first = d, v
            elif d != device:
                raise ValueError(_device_msg(self, first, device, v, d))
        if device is None:
            if pending is not None:
                device = pending[0][2]
            else:
                device = _runtime.current_device()
        with _launch.ensure_device(device):
            if stream is None:
                s = _launch.current_stream("torch" if torch_seen else "cupy", device)
            else:
                s = _launch.resolve_stream(stream)
            if pending is not None:
                for i, fn, _ in pending:
                    p = self._params[i]
                    v = _arrays.import_deferred(args[i], fn, p.what, s)
                    _check_view(p, v)
                    if v.device is not None and v.device != device and v.ptr:
                        raise ValueError(_device_msg(self, first or v, device, v, v.device))
                    views.append(v)
                    values[i] = v.ptr
                if empty:
                    return
            for v in views:
                if v.stream is not None:
                    _launch.wait_for(s, v.stream, device)
            if n1d is not None:
                sm = _runtime.device_info(device).sm_count
                grid = (min(-(-n1d // block[0]), sm * BLOCKS_PER_SM_1D, _MAX_GRID_X), 1, 1)
            if smem > _SMEM_DEFAULT_MAX:
                self._opt_in_smem(device, smem)
            self._k.launch(device, grid[0], block[0], s, values, smem, grid[1:], block[1:])

    def _opt_in_smem(self, device, smem):
        if self._smem_set.get(device, 0) >= smem:
            return
        limit = _runtime.device_info(device).max_smem_optin
        if smem > limit:
            raise ValueError(f"{self.name}: shared_mem={smem} bytes exceeds the device's "
                             f"limit of {limit} bytes per block")
        from cupy_backends.cuda.api import driver  # noqa: PLC0415 - CuPy is loaded by now

        driver.funcSetAttribute(self._k.function(device),
                                _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        self._smem_set[device] = smem


def _address(p, a):
    if a is None:
        return 0
    if type(a) is int and 0 <= a < 1 << 64:
        return a
    if isinstance(a, numbers.Integral) and not isinstance(a, bool):
        a = int(a)
        if 0 <= a < 1 << 64:
            return a
        raise OverflowError(f"{p.what}: device address {a} is not a 64-bit pointer value")
    raise TypeError(
        f"{p.what} must be a CUDA device array (CuPy, torch, JAX, Numba, or an object with "
        f"__cuda_array_interface__ / __dlpack__), an int device address or None; got host "
        f"data of type {_arrays._what(a)}")


def _readonly_msg(p, kind):
    return (f"{p.what} is a non-const pointer, so the kernel may write through it, but the "
            f"argument is a read-only {kind} array (JAX arrays are immutable). Declare the "
            "parameter const if the kernel only reads it, or pass a writable array")


def _check_view(p, v):
    if p.dtype is not None and v.dtype is not p.dtype:
        raise TypeError(f"{p.what} needs {p.dtype.name} data but got a {v.dtype.name} "
                        f"{v.kind} array")
    if v.readonly and not p.const:
        raise ValueError(_readonly_msg(p, v.kind))


def _device_msg(k, a, da, b, db):
    return (f"{k.name}: arrays are on different GPUs (a {a.kind} array on cuda:{da}, a "
            f"{b.kind} array on cuda:{db}); move them to one device")


# =============================================================================================
# NumPy-style wrapper
# =============================================================================================
#: C spellings substituted for ``{T}`` in :class:`ElementwiseKernel` name patterns.
C_TYPE_NAMES = {
    "float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double",
    "int32": "int", "int64": "long long", "bool": "bool", "int8": "signed char",
    "int16": "short", "uint8": "unsigned char", "uint16": "unsigned short",
    "uint32": "unsigned int", "uint64": "unsigned long long",
}
_INT_FMTS = frozenset("bBhHiIlLqQnN")


class ElementwiseKernel:
    """Turn a user kernel of the form ``k(out, in..., n)`` into a NumPy-style function.

    The wrapped function takes the kernel's other parameters (arrays for pointer parameters,
    scalars for scalar ones) in signature order, allocates the output in the caller's
    framework (torch in → torch out, CuPy → CuPy, JAX → JAX, Numba → Numba; other CAI/DLPack
    → CuPy), or writes ``out=``, and launches ``ceil(n / block)`` blocks of ``block`` threads
    on the caller's stream — enough for both one-thread-per-element kernels (``if (i < n)``)
    and grid-stride loops.

    Rules: at least one array operand; all arrays and the output share one dtype (no
    promotion); every array has the output's shape and is C-contiguous, because the kernel
    indexes linearly (broadcast or strided views are refused with a hint, never copied); the
    size parameter receives the element count, range-checked for its C type (an ``int n``
    refuses more than 2**31 - 1 elements). A read-only (JAX) array cannot go to a non-const
    pointer; ``out=`` must be writable.

    Parameters
    ----------
    kernel : Kernel or KernelModule
        A kernel (one fixed instance), or a module together with ``name``.
    name : str, optional
        With a module: a kernel name, or a pattern with ``{T}`` (``"axpby<{T}>"``) that is
        instantiated per dtype with the C spelling from :data:`C_TYPE_NAMES` (float32 →
        ``float``, float16 → ``__half``, ...; ``type_names`` overrides).
    out : str, optional
        Name of the output pointer parameter. Default: the only non-const pointer parameter.
    size : str, optional
        Name of the element-count parameter. Default: the last parameter, if it is an integer.
    block : int
        Threads per block.
    type_names : dict, optional
        dtype name → C spelling for ``{T}`` (e.g. ``{"float16": "my_half"}``).

    Raises
    ------
    TypeError, ValueError
        At construction, when ``out``/``size`` cannot be determined or do not name suitable
        parameters. At call time, as documented for :meth:`__call__`.

    Examples
    --------
    >>> mod = cupylab.load_kernels("fused.cu")               # template <typename T> ...
    >>> fam = cupylab.ElementwiseKernel(mod, "fused_add_mul<{T}>")
    >>> d = fam(a, b, 3.0)                                     # torch in -> torch out
    """

    def __init__(self, kernel, name=None, *, out=None, size=None, block=256, type_names=None):
        if isinstance(kernel, Kernel):
            if name is not None:
                raise TypeError("ElementwiseKernel: give name= only together with a "
                                "KernelModule")
            self._module, self._pattern, proto = kernel.module, None, kernel
        elif isinstance(kernel, KernelModule):
            if not isinstance(name, str):
                raise TypeError("ElementwiseKernel(module, name): name must be a kernel name "
                                "or a pattern such as 'axpby<{T}>'")
            self._module = kernel
            if "{T}" in name:
                self._pattern = name
                proto = kernel[name.replace("{T}", "float")]
            else:
                self._pattern, proto = None, kernel[name]
        else:
            raise TypeError(f"ElementwiseKernel needs a cupylab Kernel or KernelModule (got "
                            f"{_arrays._what(kernel)})")
        self._fixed = proto if self._pattern is None else None
        self._names = dict(C_TYPE_NAMES, **(type_names or {}))
        self._instances = {}
        b = _block(block)
        if b[1] != 1 or b[2] != 1:
            raise ValueError(f"ElementwiseKernel takes a 1-D block (got {block!r})")
        self.block = b[0]
        params = proto.signature.params
        self.name = (self._pattern or proto.name).replace("<{T}>", "").replace("{T}", "")
        self._out = self._find(params, out, "out", lambda p: p.pointer and not p.const,
                               "a non-const pointer")
        self._size = self._find(params, size, "size",
                                lambda p: not p.pointer and p.fmt in _INT_FMTS,
                                "an integer scalar")
        if self._out == self._size:
            raise ValueError(f"{self.name}: out and size name the same parameter")
        self._operands = [p.index for p in params if p.index not in (self._out, self._size)]
        self._labels = [params[i].name or f"#{i}" for i in self._operands]
        self._ptr = [params[i].pointer for i in self._operands]
        self._nonconst_in = [params[i].pointer and not params[i].const for i in self._operands]
        self._nparams = len(params)
        self.__doc__ = (f"NumPy-style wrapper of {proto.signature}: call with "
                        f"({', '.join(self._labels)}, out=None, stream=None).")

    def _find(self, params, given, what, ok, kind):
        if given is not None:
            for p in params:
                if p.name == given:
                    if not ok(p):
                        raise ValueError(f"{self.name}: {what}={given!r} names {p.decl}, which "
                                         f"is not {kind}")
                    return p.index
            raise ValueError(f"{self.name}: {what}={given!r} is not a parameter of "
                             f"{self._module and self._example()}")
        if what == "out":
            cands = [p for p in params if ok(p)]
            if len(cands) != 1:
                raise ValueError(
                    f"{self.name}: cannot tell which parameter is the output ("
                    f"{len(cands)} non-const pointers); pass out='<parameter name>'")
            return cands[0].index
        if params and ok(params[-1]):
            return params[-1].index
        raise ValueError(f"{self.name}: the last parameter is not an integer element count; "
                         "pass size='<parameter name>'")

    def _example(self):
        return self._fixed.signature if self._fixed is not None else self._pattern

    def _instance(self, dt):
        k = self._fixed
        if k is None:
            k = self._instances.get(dt.name)
            if k is None:
                cname = self._names.get(dt.name)
                if cname is None:
                    raise TypeError(f"{self.name}: no C type for dtype {dt.name}; pass "
                                    f"type_names={{'{dt.name}': '<C type>'}}")
                k = self._instances[dt.name] = self._module[self._pattern.replace("{T}", cname)]
        for p in k.signature.params:
            if p.pointer and p.dtype is not None and p.dtype is not dt:
                raise TypeError(f"{p.what} needs {p.dtype.name} arrays but the arrays are "
                                f"{dt.name}")
        return k

    def __call__(self, *args, out=None, stream=None):
        """Run the kernel elementwise over its array operands.

        Parameters
        ----------
        *args
            The kernel's parameters other than the output and the size, in signature order:
            GPU arrays for pointers, Python/NumPy scalars for scalars.
        out : GPU array, optional
            Where to write: writable, C-contiguous, of the operands' shape and dtype; may be
            exactly one of the inputs.
        stream : optional
            Stream override (default: the caller's current stream).

        Returns
        -------
        array
            ``out`` if given, else a new array in the first array operand's framework.

        Raises
        ------
        TypeError
            Wrong operand count, host arrays, dtypes that differ or do not match the kernel's
            pointer types, scalar type errors.
        ValueError
            Shapes that differ, non-contiguous or broadcast operands, a read-only array for
            a non-const pointer, a bad ``out``, arrays on different GPUs.
        OverflowError
            A scalar, or the element count, out of range for its C type.
        """
        nop = len(self._operands)
        if len(args) != nop:
            raise TypeError(f"{self.name}() takes {nop} operand{'' if nop == 1 else 's'} "
                            f"({', '.join(self._labels)}) (got {len(args)})")
        arrays, anames, aidx, scal = [], [], [], []
        for j, a in enumerate(args):
            if self._ptr[j]:
                if self._nonconst_in[j] and _arrays.framework_of(a) is _arrays._from_jax:
                    raise ValueError(_readonly_msg(self._proto_param(j), "jax"))
                arrays.append(a)
                anames.append(self._labels[j])
                aidx.append(self._operands[j])
            else:
                scal.append((self._operands[j], a))
        chosen = []

        def dtype_check(dt):
            if dt is None:
                return
            k = self._instance(dt)
            ps = k.signature.params
            vals = [(i, ps[i].convert(a, ps[i].what)) for i, a in scal]
            chosen[:] = [k, vals]

        c = prepare_call(self.name, arrays, out=out, stream=stream, names=anames,
                         allow_scalars=[False] * len(arrays), dtype_check=dtype_check)
        k, svals = chosen
        shape = c.shape
        cs = c_strides(shape)
        for v, label, i in zip(c.views, anames, aidx):
            if not _c_contig(v, shape, cs):
                raise ValueError(
                    f"{self.name}: {label} has shape {v.shape} and strides {v.strides} "
                    f"(elements); this kernel indexes linearly, so every operand must be "
                    f"C-contiguous with the output's shape {shape}. Make it contiguous first "
                    "(tensor.contiguous(), cupy.ascontiguousarray, or broadcast explicitly)")
            if v.readonly and not k.signature.params[i].const:
                raise ValueError(_readonly_msg(k.signature.params[i], v.kind))
        if not _c_contig(c.out, shape, cs):
            raise ValueError(f"{self.name}: out must be C-contiguous (strides {c.out.strides})")
        n = c.size
        if n:
            ps = k.signature.params
            values = [None] * self._nparams
            values[self._out] = c.out.ptr
            for v, i in zip(c.views, aidx):
                values[i] = v.ptr
            for i, val in svals:
                values[i] = val
            values[self._size] = ps[self._size].convert(n, ps[self._size].what)
            grid = -(-n // self.block)
            if grid > _MAX_GRID_X:
                raise ValueError(f"{self.name}: {n} elements need more than {_MAX_GRID_X} "
                                 "blocks; use a larger block")
            with _launch.ensure_device(c.device):
                for v in c.views:
                    if v.stream is not None:
                        _launch.wait_for(c.stream, v.stream, c.device)
                k._k.launch(c.device, grid, self.block, c.stream, values)
        return finish_output(c.kind, c.out_obj, c.stream, c.device) if c.allocated else c.out_obj

    def _proto_param(self, j):
        proto = self._fixed or next(iter(self._instances.values()), None)
        if proto is None:
            proto = self._module[self._pattern.replace("{T}", "float")]
        return proto.signature.params[self._operands[j]]

    def __repr__(self):
        return f"<cupylab.ElementwiseKernel {self._example()}>"


def _c_contig(v, shape, cs):
    if v.shape != shape:
        return False
    if 0 in shape:  # nothing to index: any strides will do (CuPy reports zeros here)
        return True
    return all(s == e for s, e, n in zip(v.strides, cs, shape) if n > 1)


# =============================================================================================
# Entry point
# =============================================================================================
_modules: dict = {}
_modules_lock = threading.Lock()


def load_kernels(path=None, *, source=None, name_expressions=(), options=(), include_dirs=(),
                 filename=None, signatures=None, struct_formats=None):
    """Load a user's CUDA kernels from a ``.cu`` file or a source string.

    Parameters
    ----------
    path : str or os.PathLike, optional
        A ``.cu`` file. Its directory is searched first for ``#include "..."``.
    source : str, optional
        CUDA C++ source text (instead of ``path``).
    name_expressions : sequence of str
        Template instances to compile together with the non-template kernels
        (``["scale<float>", "scale<double>"]``). Non-template kernels need not be listed;
        instances not listed are compiled separately on first use.
    options : sequence of str
        Extra NVRTC options (``"-DBLOCK=256"``, ``"--use_fast_math"``). ``--std=c++17`` is
        always given.
    include_dirs : sequence of path
        Searched for ``#include`` after the file's own directory. The CUDA toolkit's include
        directory (:func:`cuda_include_dir`) is appended when one is found, so
        ``<cuda_fp16.h>`` works as in CuPy.
    filename : str, optional
        Name NVRTC uses in messages; default: ``path`` as given, or ``"<string>"``.
    signatures : dict, optional
        Kernel name (or instance) → declared signature (``"(const float* x, int n)"``),
        overriding the scanner — for kernels made by macros or declarations it cannot read.
    struct_formats : dict, optional
        By-value struct type name → its layout: a ``struct`` format of the members
        (``{"Params": "fid"}`` for ``struct Params {float a; int b; double c;}``; the
        argument is then a tuple) or a ``ctypes.Structure`` subclass (the argument is an
        instance).

    Returns
    -------
    KernelModule
        Index it with a kernel name: ``module["vector_add"]``, ``module["scale<float>"]``.
        Calling ``load_kernels`` again with the same source, headers and options returns the
        same module (compiled programs are reused).

    Raises
    ------
    KernelNotFoundError
        A name expression that names no ``__global__`` function in the source; the message
        lists those found.
    FileNotFoundError
        ``path`` does not exist.
    TypeError, ValueError
        Both or neither of ``path``/``source``; a bad template instance.

    Notes
    -----
    Compiled code is cached on disk (``$CUPYLAB_CACHE_DIR``) keyed by the source, every
    included header, the options, the GPU architecture and the NVRTC version: editing a
    header recompiles, nothing else does. A compile error raises
    :class:`cupylab.CompileError` with NVRTC's log (file name and line) at the first launch,
    or at :meth:`KernelModule.compile`.

    Examples
    --------
    >>> mod = cupylab.load_kernels("vector_add.cu")
    >>> mod["vector_add"].launch_1d(n, x, y, out, n)           # torch, CuPy, JAX, Numba ...
    """
    if (path is None) == (source is None):
        raise TypeError("load_kernels: give either a path or source=, not both or neither")
    here = None
    if path is not None:
        p = Path(os.fspath(path))
        source = p.read_text()
        here = str(p.resolve().parent)
        if filename is None:
            filename = os.fspath(path)
    elif not isinstance(source, str):
        raise TypeError(f"load_kernels: source must be a str (got {_arrays._what(source)})")
    if filename is None:
        filename = "<string>"
    name_expressions = tuple(str(e) for e in name_expressions)
    options = tuple(options)
    include_dirs = tuple(str(d) for d in include_dirs)
    sig_key = tuple(sorted((str(k), v) for k, v in (signatures or {}).items()))
    sf_key = tuple(sorted((str(k), v) for k, v in (struct_formats or {}).items()))
    probe = _compile.Program(source, filename, (), options,
                             ((here,) if here else ()) + include_dirs
                             + ((cuda_include_dir(),) if cuda_include_dir() else ()))
    key = (source, filename, name_expressions, options, include_dirs, here,
           probe.headers_digest(), sig_key, sf_key)
    try:
        m = _modules.get(key)
    except TypeError:  # unhashable signature/struct values: no in-process reuse
        key, m = None, None
    if m is not None:
        return m
    m = KernelModule(source, filename, name_expressions, options, include_dirs, signatures,
                     struct_formats, here)
    if key is not None:
        with _modules_lock:
            m = _modules.setdefault(key, m)
    return m
