"""Scanning CUDA C++ source for ``__global__`` functions (for :mod:`cupylab.kernels`).

A light declaration scanner, not a compiler: it strips comments and preprocessor lines,
tokenizes, tracks namespaces and ``extern "C"`` blocks, and reads each ``__global__``
declaration's template parameters and parameter list as token lists. :mod:`cupylab._kparams`
turns those tokens into typed parameters.
"""
from __future__ import annotations

import re

__all__ = ["parse_kernels"]

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
    """Record ``typedef <type> NAME`` and ``using NAME = <type>`` (simple aliases only). A
    name defined twice with different types (branches of ``#if``, other namespaces: the
    scanner evaluates neither) is recorded as ``None``: a parameter of that type is then
    reported instead of guessed."""
    if not stmt or "(" in stmt or "{" in stmt:
        return
    if stmt[0] == "typedef" and len(stmt) >= 3 and _is_ident(stmt[-1]):
        name, target = stmt[-1], list(stmt[1:-1])
    elif (stmt[0] == "using" and len(stmt) >= 4 and _is_ident(stmt[1]) and stmt[2] == "="
          and stmt[1] != "namespace"):
        name, target = stmt[1], list(stmt[3:])
    else:
        return
    old = aliases.get(name, target)
    aliases[name] = target if old == target else None


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
