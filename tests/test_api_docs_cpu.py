"""The public API's docstrings keep their numpydoc sections (no GPU).

The rule, for every public name (``__all__``) of ``cupylab``, ``cupylab.foreach``,
``cupylab.optim`` and ``cupylab.kernels``, and, when torch is installed, of
``cupylab.torch.functional`` and ``cupylab.torch.optim``:

* a function has a ``Returns`` section, and, when it takes any parameter, a ``Parameters``
  section that names every parameter of its signature;
* a class (exception classes excepted) whose constructor takes parameters has a
  ``Parameters`` section naming each of them, in the class docstring or its own
  ``__init__`` docstring, unless its constructor is internal (:data:`INTERNAL_CONSTRUCTORS`,
  each with the reason and where its call parameters are documented instead). No
  ``Returns`` section is asked of a class;
* the public methods of those classes, and their ``__call__``, ``__getitem__`` and
  ``__contains__``, follow the function rule when cupylab defines them (methods inherited
  from torch keep torch's docstrings; properties are attributes, documented in the class's
  ``Attributes``).

A section is a title line underlined with as many dashes; a ``Parameters`` entry is a line
at the section's own indentation, ``name : type`` or ``name1, name2`` (``*args`` and
``**kwargs`` as written in the signature). Every entry must name identifiers only, so prose
that strays into the section is caught too.
"""
import importlib
import inspect
import re

import pytest

import cupylab
import cupylab.kernels as kernels
from cupylab import foreach, optim

MODULES = ["cupylab", "cupylab.foreach", "cupylab.optim", "cupylab.kernels"]
TORCH_MODULES = ["cupylab.torch.functional", "cupylab.torch.optim"]

#: Classes whose constructors users never call, with the reason. Their call parameters are
#: documented on the methods named in the reason, which the method rule checks.
INTERNAL_CONSTRUCTORS = {
    kernels.Kernel: "made by KernelModule.__getitem__ (module['name']) from the module's "
                    "internal Program; launch parameters are on __call__ and launch_1d",
    foreach.PreparedForeach: "made by cupylab.foreach.prepare from recorded launches; "
                             "__call__ takes no arguments",
}

#: Special methods that users call through syntax, documented like public methods.
CALL_METHODS = ("__call__", "__getitem__", "__contains__")

_ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_]\w*)(\s*,\s*\*{0,2}[A-Za-z_]\w*)*(\s+:(\s.*)?)?$")


def _sections(doc):
    """``{title: [lines]}`` of a dedented numpydoc docstring."""
    lines = doc.splitlines()
    heads = [i for i in range(len(lines) - 1)
             if lines[i].strip() and not lines[i].startswith(" ")
             and re.fullmatch(r"-+", lines[i + 1]) and len(lines[i + 1]) == len(lines[i])]
    out = {}
    for k, i in enumerate(heads):
        end = heads[k + 1] if k + 1 < len(heads) else len(lines)
        out[lines[i]] = lines[i + 2:end]
    return out


def _documented(section_lines):
    """The parameter names of a Parameters section, and its entry lines that are not
    ``name[, name...] [: type]``."""
    names, bad = set(), []
    for line in section_lines:
        if not line.strip() or line.startswith((" ", "\t")):
            continue
        if not _ENTRY.match(line):
            bad.append(line)
            continue
        head = re.split(r"\s+:(?:\s|$)", line, maxsplit=1)[0]
        names.update(n.strip().lstrip("*") for n in head.split(","))
    return names, bad


def _params(obj):
    sig = inspect.signature(obj)
    return [p for p in sig.parameters if p not in ("self", "cls")]


def _problems_callable(what, obj, doc, *, needs_returns):
    """What is wrong with ``doc`` for a callable taking ``_params(obj)``."""
    errs = []
    if not doc:
        return [f"{what}: no docstring"]
    secs = _sections(doc)
    if re.search(r"^\s*\{\w+\}\s*$", doc, re.M):
        errs.append(f"{what}: an unfilled docstring piece (a line holding only {{name}})")
    params = _params(obj)
    if params:
        if "Parameters" not in secs:
            errs.append(f"{what}: no Parameters section (it takes {', '.join(params)})")
        else:
            names, bad = _documented(secs["Parameters"])
            missing = [p for p in params if p not in names]
            if missing:
                errs.append(f"{what}: Parameters does not name {', '.join(missing)}")
            if bad:
                errs.append(f"{what}: Parameters entries that are not 'name : type': {bad}")
    if needs_returns and "Returns" not in secs:
        errs.append(f"{what}: no Returns section")
    return errs


def _methods(cls):
    """``(name, function)`` of the methods of ``cls`` that the rule covers."""
    for name in sorted(dir(cls)):
        if name.startswith("_") and name not in CALL_METHODS:
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, (staticmethod, classmethod)):
            attr = attr.__func__
        if not inspect.isfunction(attr):
            continue  # properties, data, slots, builtins
        if not (attr.__module__ or "").startswith("cupylab"):
            continue  # inherited from torch or object
        yield name, attr


def problems(qualname, obj):
    """Every rule violation of the public object ``obj`` (named ``qualname``)."""
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return []
        errs = []
        if obj not in INTERNAL_CONSTRUCTORS and _params(obj):
            doc = inspect.getdoc(obj) or ""
            own_init = vars(obj).get("__init__")
            if own_init is not None and own_init.__doc__:
                doc += "\n\n" + inspect.cleandoc(own_init.__doc__)
            errs += _problems_callable(qualname, obj, doc, needs_returns=False)
        elif not inspect.getdoc(obj):
            errs.append(f"{qualname}: no docstring")
        for name, fn in _methods(obj):
            errs += _problems_callable(f"{qualname}.{name}", fn, inspect.getdoc(fn),
                                       needs_returns=True)
        return errs
    if callable(obj):
        return _problems_callable(qualname, obj, inspect.getdoc(obj), needs_returns=True)
    return []  # data (cupylab.dtypes, C_TYPE_NAMES, ...) and submodules


def _public(modname):
    mod = importlib.import_module(modname)
    return [(f"{modname}.{n}", getattr(mod, n)) for n in mod.__all__]


_ITEMS = [item for m in MODULES for item in _public(m)]


@pytest.mark.parametrize("qualname,obj", _ITEMS, ids=[q for q, _ in _ITEMS])
def test_public_docstring_sections(qualname, obj):
    errs = problems(qualname, obj)
    assert not errs, "\n".join(errs)


@pytest.mark.parametrize("modname", TORCH_MODULES)
def test_torch_docstring_sections(modname):
    pytest.importorskip("torch")
    items = _public(modname)
    assert items
    errs = [e for q, obj in items for e in problems(q, obj)]
    assert not errs, "\n".join(errs)


def test_the_rule_covers_what_it_should():
    """The lists hold the functions the rule was written for, the exemptions are public
    classes whose constructors do take parameters, and methods are found."""
    names = {q for q, _ in _ITEMS}
    for q in ("cupylab.foreach.add_", "cupylab.foreach.prepare", "cupylab.optim.adamw_",
              "cupylab.optim.increment_step_", "cupylab.kernels.cuda_include_dir",
              "cupylab.Graph", "cupylab.kernels.Signature", "cupylab.kernels.Param"):
        assert q in names
    public = {id(o) for _, o in _ITEMS}
    for cls in INTERNAL_CONSTRUCTORS:
        assert id(cls) in public and _params(cls), cls
    assert {n for n, _ in _methods(kernels.Kernel)} >= {"__call__", "launch_1d", "pack"}
    assert {n for n, _ in _methods(kernels.KernelModule)} >= {"__getitem__", "__contains__",
                                                               "compile"}
    assert {n for n, _ in _methods(cupylab.Graph)} == {"capture", "replay"}
    assert "names" not in {n for n, _ in _methods(kernels.KernelModule)}  # a property


def _fake(doc, params="x, y"):
    ns = {}
    exec(f"def f({params}):\n    pass", ns)
    ns["f"].__doc__ = doc
    return ns["f"]


GOOD = """Summary.

Parameters
----------
x : int
    The x.
y
    The y.

Returns
-------
None
"""


def test_the_checker_catches_missing_pieces():
    assert problems("f", _fake(GOOD)) == []
    assert problems("f", _fake(GOOD.replace("y\n    The y.\n", ""))) == [
        "f: Parameters does not name y"]
    no_returns = GOOD[:GOOD.index("Returns")]
    assert problems("f", _fake(no_returns)) == ["f: no Returns section"]
    no_params = GOOD.replace("Parameters\n----------", "Parameters")
    assert "f: no Parameters section (it takes x, y)" in problems("f", _fake(no_params))
    assert problems("f", _fake(GOOD.replace("x : int", "x : int\nstray prose here.")))
    assert problems("f", _fake(GOOD + "\n{launch_notes}\n"))
    assert problems("f", _fake(GOOD, "x, y, *args, **kw")) == [
        "f: Parameters does not name args, kw"]
    assert problems("f", _fake(GOOD.replace("y\n", "y, *args, **kw\n"),
                               "x, y, *args, **kw")) == []
    assert problems("f", _fake(None)) == ["f: no docstring"]


def test_a_real_docstring_losing_a_section_fails(monkeypatch):
    for fn, title in ((foreach.zero_, "Returns"), (optim.lion_, "Parameters")):
        assert problems(fn.__name__, fn) == []
        broken = fn.__doc__.replace(f"\n    {title}\n    {'-' * len(title)}\n", "\n")
        assert broken != fn.__doc__
        monkeypatch.setattr(fn, "__doc__", broken)
        assert problems(fn.__name__, fn), title
