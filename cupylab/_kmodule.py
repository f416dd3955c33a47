"""User CUDA sources: ``load_kernels`` and :class:`KernelModule` (for :mod:`cupylab.kernels`).

A module scans its source (and the user headers it includes) for ``__global__`` functions,
resolves names and template instances to signatures, and compiles lazily through
:class:`cupylab._compile.Program` (NVRTC, cached on disk).
"""
from __future__ import annotations

import importlib.util
import os
import threading
from pathlib import Path

from . import _arrays, _compile, _runtime
from ._cparse import _example_instance, _join, _param_types, _scan, _split_name_expr
from ._errors import CupylabError
from ._kernel import Kernel
from ._kparams import _as_signature, _check_problems, _signature_from_tokens, parse_signature

__all__ = ["load_kernels", "KernelModule", "KernelNotFoundError", "cuda_include_dir"]


class KernelNotFoundError(CupylabError, KeyError):
    """A kernel name that is not a ``__global__`` function of the source; the message lists
    the ones that are."""

    def __str__(self):  # KeyError would print the message with quotes around it
        return str(self.args[0]) if self.args else ""


_cuda_inc = [False, None]


def cuda_include_dir():
    """The CUDA toolkit's include directory (for ``<cuda_fp16.h>`` and friends), or ``None``.

    Looked for, in order, in the NVIDIA pip wheels next to the NVRTC in use
    (``nvidia/cu<major>/include``, ``nvidia/cuda_runtime/include``), ``$CUDA_PATH``,
    ``$CUDA_HOME`` and ``/usr/local/cuda``. NVRTC itself has no default include path.
    :func:`load_kernels` appends this directory to every module's include path.

    Returns
    -------
    str or None
        The first candidate directory that holds ``cuda_fp16.h``, or ``None`` when none
        does.

    Notes
    -----
    The answer is computed on the first call and cached for the life of the process:
    later changes to the environment variables or to the installed wheels are not seen.
    Raises nothing: without a usable NVRTC the ``cu<major>`` wheel directory is skipped.
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


def _search_dirs(here, include_dirs):
    """``(include_dirs, system_dirs)`` of a module's programs: the file's own folder, the
    user's folders, then the CUDA toolkit's include folder (once), which is also the only
    system folder (see :func:`cupylab._compile.find_headers`)."""
    user = ((here,) if here else ()) + tuple(include_dirs)
    cuda_inc = cuda_include_dir()
    toolkit = (cuda_inc,) if cuda_inc else ()
    return user + (() if cuda_inc in user else toolkit), toolkit


class KernelModule:
    """The kernels of one CUDA source, ready to launch. Made by :func:`load_kernels`.

    ``module[name]`` returns a :class:`Kernel`. ``name`` is a kernel name (``"vector_add"``,
    ``"ns::f"``; a unique unqualified name also works) or, for templates, an instance
    (``"scale<float>"``). Instances listed in ``name_expressions`` are compiled together with
    every non-template kernel in one NVRTC program; any other instance is compiled on first
    launch as a program of its own (and cached on disk like the rest).

    Compilation is lazy: the first launch on a device compiles (or loads from the disk cache)
    and loads the module there. :meth:`compile` does it ahead of time.

    The usual way to get a module is :func:`load_kernels`, which checks its arguments and
    returns the module already made for the same source, headers and options; the
    constructor does neither (it parses the source and makes new programs; the disk cache
    of compiled code is shared all the same). The source and the user headers it includes
    are scanned here; nothing is compiled.

    Parameters
    ----------
    source : str
        The CUDA C++ source text.
    filename : str
        The name NVRTC reports in messages.
    name_expressions, options, include_dirs, signatures, struct_formats
        As for :func:`load_kernels`.
    here : str, optional
        The directory of the source file, searched first for ``#include "..."`` (what
        :func:`load_kernels` passes for a ``path``).

    Raises
    ------
    KernelNotFoundError
        A name expression that names no ``__global__`` function of the source.
    TypeError, ValueError
        A bad name expression (a template without arguments, a non-template with some, an
        overloaded kernel), a signature that is not a string, or one that cannot be
        parsed.

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
        self._include_dirs, self._system_dirs = _search_dirs(
            here, (str(d) for d in include_dirs))
        self._here = here
        self._struct_formats = dict(struct_formats or {})
        decls, aliases = _scan(source, filename)
        # the user's headers (not the toolkit's), found as NVRTC finds them
        for _, hpath, body, own in self._program(()).headers()[0]:
            if not own:
                continue
            hd, ha = _scan(body.decode("utf-8", "replace"), str(hpath))
            decls = hd + decls
            for k, v in ha.items():
                # defined differently in two files (headers behind #if branches, which the
                # scanner does not evaluate): None, reported when a kernel uses it, as
                # within one file (_cparse._alias)
                old = aliases.get(k, v)
                aliases[k] = v if old == v else None
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
        self.program = self._program(exprs)
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

        Parameters
        ----------
        name : str
            A kernel name (``"vector_add"``, ``"ns::f"``, a unique unqualified name), a
            template instance (``"scale<float>"``), or a name given in ``signatures=``.

        Returns
        -------
        Kernel
            The same object for the same ``name`` on later lookups. Nothing is compiled
            here: a template instance not listed in ``name_expressions`` is compiled as a
            program of its own at its first launch.

        Raises
        ------
        KernelNotFoundError
            No ``__global__`` function of that name (the message lists those found).
        TypeError
            A template named without its arguments, or a non-template given some.
        ValueError
            An overloaded kernel, or a parameter cupylab cannot pass (reference, by-value
            struct without ``struct_formats``).
        TypeError
            ``name`` is not a string.
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
        """Whether ``module[name]`` would find a kernel (``name in module``).

        Parameters
        ----------
        name : str
            As for :meth:`__getitem__`.

        Returns
        -------
        bool
            ``True`` when the name resolves to a kernel and a signature, ``False`` for
            anything else (a name not found, a template named without its arguments, an
            overloaded kernel, a name that is not a string). A kernel with a parameter
            cupylab cannot pass (a reference) is "in" the module, although looking it up
            raises ``ValueError``.
        """
        try:
            self._resolve(name)
        except (KeyError, TypeError, ValueError):
            return False
        return True

    def _program(self, exprs):
        """A program of this module's source for the name expressions ``exprs``."""
        return _compile.Program(self.source, self.filename, exprs, self._options,
                                self._include_dirs, source_dir=self._here,
                                system_dirs=self._system_dirs)

    def _program_for(self, expr):
        if expr in self.program.name_expressions:
            return self.program
        p = self._programs.get(expr)
        if p is None:
            p = self._programs[expr] = self._program([expr])
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
        Searched for ``#include`` after the including file's own folder (for quoted
        includes) and the folders ``-I`` options name, as NVRTC searches. The CUDA toolkit's
        include directory (:func:`cuda_include_dir`) is appended when one is found, so
        ``<cuda_fp16.h>`` works as in CuPy.
    filename : str, optional
        Name NVRTC uses in messages; default: ``path`` as given, or ``"<string>"``. For
        ``source=``, its folder (the working directory for a bare name) is the source's own
        folder, searched first for its quoted includes.
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
    for pname, v in (("name_expressions", name_expressions), ("options", options),
                     ("include_dirs", include_dirs)):
        if isinstance(v, (str, bytes)):  # a sequence of characters, not of items
            raise TypeError(f"load_kernels: {pname} must be a list or tuple of strings, not a "
                            f"single string (got {v!r}); write [{v!r}]")
    name_expressions = tuple(str(e) for e in name_expressions)
    options = tuple(options)
    include_dirs = tuple(str(d) for d in include_dirs)
    sig_key = tuple(sorted((str(k), v) for k, v in (signatures or {}).items()))
    sf_key = tuple(sorted((str(k), v) for k, v in (struct_formats or {}).items()))
    dirs, system = _search_dirs(here, include_dirs)
    probe = _compile.Program(source, filename, (), options, dirs, source_dir=here,
                             system_dirs=system)
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
