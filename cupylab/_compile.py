"""NVRTC compilation, the persistent binary cache, and per-device modules.

Pipeline for one *program* (a source text, its name expressions and options):

1. ``key`` = SHA-256 over the source text, the text of every header it includes (recursively,
   from its own directory and the include directories), the options, the target arch, the
   name expressions and the NVRTC version.
2. In-process: one loaded module per (key, device), built under a per-key lock, so two threads
   making the first call at once compile once and nobody sees a half-built module.
3. On disk (``$CUPYLAB_CACHE_DIR``, default ``~/.cache/cupylab``): ``<key>.clbin`` holds a
   header, the lowered names, the cubin (or PTX) and a SHA-256 of all of it. A truncated or
   corrupt file fails the check and is rebuilt, never loaded. Writers write a temporary file
   in the same directory and ``os.replace`` it into place, so readers never see a partial file.
   The directory is created private to the user (0700); a directory or entry that another
   user owns or could write is never read or written (one warning, then compile instead).
4. Miss: NVRTC (through CuPy's ``cupy_backends`` binding) compiles the name expressions to a
   cubin for the device's arch, records each lowered name, stores the entry, and the module is
   loaded from memory (``cuModuleLoadData``) with CuPy's ``Module``.

CuPy's own ``RawModule`` disk cache is not used because it is skipped for modules built with
name expressions (cupy/cupy#9667).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import tempfile
import threading
import warnings
from pathlib import Path

from ._errors import CompileError

__all__ = ["Program", "cuda_src_dir", "cache_dir", "compile_program", "nvrtc_version"]

_FORMAT = 2  # bump when the entry layout changes (2: the key stored in the entry)
_MAGIC = b"CLBIN\x00"
_HEADER = struct.Struct("<6sHI")  # magic, format, metadata length
_DEFAULT_OPTIONS = ("--std=c++17",)

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
# an include named by a macro (#include CFG): which file it is depends on the options and
# the preprocessor, so no key can name it; such a program is not kept in the disk cache
# the same for #include_next, whose file the search below does not follow; in the CUDA
# toolkit's headers neither makes a program unkeyable (see find_headers)
_OPAQUE_INCLUDE_RE = re.compile(r'^\s*#\s*include(?:_next\b|\s+[A-Za-z_])', re.M)


def option_paths(options):
    """``(include folders, pre-included headers)`` named in NVRTC ``options`` (``-I``,
    ``--include-path``, ``-include``, ``--pre-include``, joined or as the next option)."""
    dirs, pre = [], []
    opts = list(options)
    for i, o in enumerate(opts):
        nxt = opts[i + 1] if i + 1 < len(opts) else None
        for flags, out in ((("-I", "--include-path"), dirs), (("-include", "--pre-include"),
                                                              pre)):
            for flag in flags:
                if o == flag and nxt is not None:
                    out.append(nxt)
                elif o.startswith(flag + "=") or (flag == "-I" and o.startswith("-I")
                                                  and len(o) > 2):
                    out.append(o[len(flag) + (1 if o.startswith(flag + "=") else 0):])
    return tuple(dirs), tuple(pre)


def find_headers(source, source_dir, dirs, pre=(), system_dirs=()):
    """The headers NVRTC reads for ``source``, found as it finds them: ``#include "x"`` in the
    including file's own folder first (``source_dir`` for the source itself), then in
    ``dirs`` in command-line order; ``#include <x>`` in ``dirs`` only; a pre-included
    header (``-include x``) in the working directory, then ``dirs``. Returns ``(headers,
    opaque)``: ``headers`` a list of ``(name as included, Path, bytes, own)``, each file once,
    in the order met, ``own`` False for those in ``system_dirs`` (the CUDA toolkit's folder,
    whose headers change with the toolkit only); ``opaque`` is True when some ``#include`` in
    the source or an own header names its file through a macro (thrust's do, which is why
    the toolkit's are exempt). Headers found in none of these folders (those NVRTC supplies)
    are left out."""
    seen, out = set(), []
    opaque = False
    system = tuple(str(Path(d).resolve()) for d in system_dirs)

    def walk(text, here, own):
        nonlocal opaque
        if own and _OPAQUE_INCLUDE_RE.search(text):
            opaque = True
        for kind, inc in _INCLUDE_RE.findall(text):
            find(inc, here if kind == '"' else None)

    def find(inc, here):
        for d in ((here,) if here is not None else ()) + tuple(dirs):
            p = Path(d) / inc
            if p.is_file():
                rp = p.resolve()
                if rp not in seen:
                    seen.add(rp)
                    body = p.read_bytes()
                    own = not any(str(rp).startswith(sd + os.sep) for sd in system)
                    out.append((inc, p, body, own))
                    walk(body.decode("utf-8", "replace"), str(p.parent), own)
                return

    for inc in pre:
        find(inc, ".")
    walk(source, source_dir, True)
    return out, opaque


def cuda_src_dir() -> Path:
    """Directory holding cupylab's ``.cu`` sources: inside the installed package
    (``cupylab/cuda_src``, as the wheel ships it) or, in a source checkout, ``<repo>/cuda_src``."""
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda_src", here.parent / "cuda_src"):
        if (cand / "cupylab_common.cuh").is_file():
            return cand
    raise FileNotFoundError(
        f"cupylab's CUDA sources were not found next to {here} (looked in cupylab/cuda_src and "
        "../cuda_src); the installation is incomplete")


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$CUPYLAB_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/cupylab``, else ``~/.cache/cupylab``."""
    d = os.environ.get("CUPYLAB_CACHE_DIR")
    if d:
        return Path(d).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cupylab"


def _cache_enabled() -> bool:
    return os.environ.get("CUPYLAB_CACHE_DISABLE", "") not in ("1", "true", "yes")


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415 - lazy, heavy

    return nvrtc


def nvrtc_version() -> tuple:
    return tuple(_nvrtc().getVersion())


def supported_archs() -> tuple:
    return tuple(_nvrtc().getSupportedArchs())


def target_for(cc: int) -> tuple:
    """``(option, kind)`` for a device of compute capability ``cc`` (e.g. 90): a cubin for the
    exact arch when this NVRTC knows it, else PTX for the newest arch it knows (the driver
    compiles PTX for newer GPUs)."""
    archs = supported_archs()
    if cc in archs:
        return f"-arch=sm_{cc}", "cubin"
    older = [a for a in archs if a <= cc]
    if not older:  # PTX for a newer arch would not load on this GPU
        v = ".".join(map(str, nvrtc_version()))
        raise CompileError(
            f"this NVRTC ({v}) cannot compile for compute capability {cc // 10}.{cc % 10}: the "
            f"oldest architecture it targets is sm_{min(archs)}; install the NVRTC of an older "
            "CUDA (the cuda12 extra for GPUs older than sm_75)", log="", filename="")
    return f"-arch=compute_{max(older)}", "ptx"


class Program:
    """A compilable unit: source text + name expressions + options + include directories.

    Parameters
    ----------
    source : str
        CUDA C++ source.
    filename : str
        Name used in NVRTC messages (``elementwise.cu``).
    name_expressions : sequence of str
        Kernels to instantiate (``"cl::ew_contig<float, 0, 4>"``) or ``extern "C"`` names.
    options : sequence of str
        Extra NVRTC options (``--std=c++17`` is always added first).
    include_dirs : sequence of path
        Directories searched for ``#include`` (``-I``, after those ``options`` name).
    source_dir : path, optional
        The source's own folder, searched first for its ``#include "..."``: the program is
        named ``source_dir/basename(filename)`` for NVRTC. Default: ``filename``'s folder
        as NVRTC takes it (the working directory for a bare name such as ``"<string>"``).
        Each header's own folder is searched first for the quoted includes it makes.
    """

    def __init__(self, source, filename, name_expressions, options=(), include_dirs=(),
                 source_dir=None, system_dirs=()):
        self.source = source
        self.filename = filename
        self.name_expressions = tuple(name_expressions)
        self.options = _DEFAULT_OPTIONS + tuple(o for o in options if o not in _DEFAULT_OPTIONS)
        self.include_dirs = tuple(str(Path(d)) for d in include_dirs)
        # the name NVRTC is given: its folder is where it looks first for the source's
        # quoted includes (and what __FILE__ says)
        self.nvrtc_name = (os.path.join(str(source_dir), os.path.basename(filename))
                           if source_dir is not None else filename)
        self.system_dirs = tuple(str(d) for d in system_dirs)

    @classmethod
    def from_file(cls, path, name_expressions, options=(), include_dirs=()):
        path = Path(path)
        return cls(path.read_text(), path.name, name_expressions, options,
                   (str(path.parent),) + tuple(include_dirs), source_dir=str(path.parent))

    def _include_options(self):
        return tuple(f"-I{d}" for d in self.include_dirs)

    def headers(self):
        """``(headers, opaque)`` of :func:`find_headers` for this program, in NVRTC's search
        order: the source's folder, the folders the options name, then ``include_dirs``."""
        opt_dirs, pre = option_paths(self.options)
        return find_headers(self.source, os.path.dirname(self.nvrtc_name) or ".",
                            opt_dirs + self.include_dirs, pre, self.system_dirs)

    def headers_digest(self) -> str:
        """SHA-256 over every header reachable through ``#include`` from the source (and the
        headers the options pre-include), as NVRTC finds them (:meth:`headers`): the name
        each is included by and its bytes as stored (not where it lies: a tree installed or
        checked out in two places keys alike). Read again for each key, so that a header edited between two compiles is
        never stored under its old contents' key. Headers NVRTC supplies itself, e.g.
        ``<cuda_fp16.h>`` from the toolkit, are keyed through the NVRTC version instead.
        ``""`` when an include is named by a macro (no key can name its file)."""
        found, opaque = self.headers()
        if opaque:
            return ""
        h = hashlib.sha256()
        for inc, _, body, _ in found:
            h.update(inc.encode() + b"\0" + body + b"\0")
        return h.hexdigest()

    def key(self, arch_option: str, nvrtc_ver: tuple):
        """The disk cache key, or None when the program cannot be keyed (an include named
        by a macro): it is then compiled every time."""
        digest = self.headers_digest()
        if not digest:
            return None
        h = hashlib.sha256()
        # the program's file name, not its folder (which headers are found is in the digest)
        for part in (str(_FORMAT), self.source, os.path.basename(self.nvrtc_name), digest,
                     "\0".join(self.options), arch_option,
                     "\0".join(self.name_expressions), repr(nvrtc_ver)):
            h.update(part.encode())
            h.update(b"\x1f")
        return h.hexdigest()

    def compile(self, arch_option: str, kind: str):
        """Run NVRTC. Returns ``(binary bytes, {name expression: lowered name})``.

        Raises
        ------
        CompileError
            With the NVRTC log, which names the file and line of each error.
        """
        def take(nvrtc, prog):
            mapping = {n: nvrtc.getLoweredName(prog, n) for n in self.name_expressions}
            binary = nvrtc.getCUBIN(prog) if kind == "cubin" else nvrtc.getPTX(prog)
            if isinstance(binary, str):
                binary = binary.encode()
            binary = bytes(binary)
            return (complete_elf(binary) if kind == "cubin" else binary), mapping

        return self.run_nvrtc([arch_option], take)

    def run_nvrtc(self, extra_options, take):
        """Compile with NVRTC (the program's options and include directories, then
        ``extra_options``) and return ``take(nvrtc, prog)``, called on the compiled program
        before it is destroyed (``scripts/ptxas_report.py`` reads the log this way).

        Raises
        ------
        CompileError
            With the NVRTC log, which names the file and line of each error.
        """
        nvrtc = _nvrtc()
        prog = nvrtc.createProgram(self.source, self.nvrtc_name, (), ())
        try:
            for n in self.name_expressions:
                nvrtc.addNameExpression(prog, n)
            opts = list(self.options) + list(self._include_options()) + list(extra_options)
            try:
                nvrtc.compileProgram(prog, opts)
            except nvrtc.NVRTCError as e:
                log = nvrtc.getProgramLog(prog)
                raise CompileError(
                    f"NVRTC failed to compile {self.filename} ({e}):\n{log.strip()}",
                    log=log, filename=self.filename) from None
            return take(nvrtc, prog)
        finally:
            nvrtc.destroyProgram(prog)


def complete_elf(b: bytes) -> bytes:
    """Restore the length an ELF image declares in its own header.

    CuPy's ``nvrtc.getCUBIN`` binding returns one byte less than NVRTC's cubin (the last byte
    of the program-header table, seen with cupy 14.2 and NVRTC 12.9): the driver loads it
    anyway, but ``nvdisasm``/``cuobjdump`` reject it. Zero-padding to the declared end gives
    back the missing byte, which is the top byte of a segment alignment and always 0."""
    if len(b) < 64 or b[:5] != b"\x7fELF\x02":
        return b
    phoff, shoff = struct.unpack_from("<QQ", b, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", b, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    if len(b) < end <= len(b) + 64:
        b += b"\0" * (end - len(b))
    return b


# -- the disk cache ---------------------------------------------------------------------------
# A cubin in the cache is code this process will run, so the cache is trusted only when nobody
# else can write it: the directory is created private to the user (0700), and a directory or
# entry owned by another user, or writable by group or others, is never read or written
# (warned about once per path; the kernel is compiled instead). The directory is checked
# through an open descriptor and entries are opened relative to it, never through a symlink
# and only as regular files, so a path swapped after the check is never what is read.
_warned: set = set()


def _trusted(st) -> bool:
    if not hasattr(os, "geteuid"):  # no POSIX ownership to check
        return True
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _distrust(path, st, what):
    if str(path) not in _warned:
        _warned.add(str(path))
        warnings.warn(
            f"cupylab: not using the kernel cache {what} {path}: it is owned by uid {st.st_uid} "
            f"with mode {stat.filemode(st.st_mode)}, so another user could write code into it; "
            "kernels are compiled instead. Point CUPYLAB_CACHE_DIR at a directory only you can "
            "write (or fix its owner and mode)", RuntimeWarning, stacklevel=4)


def trusted_cache_dir():
    """The cache directory, created private (mode 0700) when missing; ``None`` when it cannot
    be created or is not trusted (see above)."""
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = d.stat()
    except OSError:
        return None
    if not _trusted(st):
        _distrust(d, st, "directory")
        return None
    return d


def _entry_path(key: str, d=None) -> Path:
    return (cache_dir() if d is None else d) / f"{key}.clbin"


def _pack_entry(binary: bytes, mapping: dict, kind: str, key: str = "") -> bytes:
    # the key is stored too: an entry moved or linked to another key's name is not loaded
    meta = json.dumps({"kind": kind, "mapping": mapping, "key": key}, sort_keys=True).encode()
    body = _HEADER.pack(_MAGIC, _FORMAT, len(meta)) + meta + binary
    return body + hashlib.sha256(body).digest()


def _unpack_entry(blob: bytes, key: str = ""):
    """Return ``(binary, mapping, kind)`` or ``None`` for anything malformed, corrupt or
    stored under another key."""
    if len(blob) < _HEADER.size + 32:
        return None
    body, digest = blob[:-32], blob[-32:]
    if hashlib.sha256(body).digest() != digest:
        return None
    magic, fmt, mlen = _HEADER.unpack_from(body)
    if magic != _MAGIC or fmt != _FORMAT or _HEADER.size + mlen > len(body):
        return None
    try:
        meta = json.loads(body[_HEADER.size:_HEADER.size + mlen])
        if meta.get("key", "") != key:
            return None
        return body[_HEADER.size + mlen:], dict(meta["mapping"]), meta["kind"]
    except (ValueError, KeyError, TypeError):
        return None


_POSIX_FDS = (os.name == "posix" and os.open in os.supports_dir_fd
              and os.rename in os.supports_dir_fd and os.unlink in os.supports_dir_fd
              and all(hasattr(os, f) for f in ("O_DIRECTORY", "O_NOFOLLOW", "O_NONBLOCK")))


def _open_dir(d):
    """A file descriptor of the cache directory ``d``, checked through the descriptor (so
    that a path swapped after the check is never what is read or written); None when it is
    not trusted (warned once)."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    st = os.fstat(fd)
    if not _trusted(st):
        os.close(fd)
        _distrust(d, st, "directory")
        return None
    return fd


def load_entry(key: str):
    """Read a cache entry; ``None`` when absent, truncated, corrupt or not trusted. The
    entry is opened relative to the checked directory, without following a symlink and
    without blocking (a FIFO in its place), and read only when it is a regular file that
    nobody else can write."""
    d = trusted_cache_dir()
    if d is None:
        return None
    name = _entry_path(key, d).name
    try:
        if not _POSIX_FDS:
            fd = os.open(d / name, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        else:
            dfd = _open_dir(d)
            if dfd is None:
                return None
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            finally:
                os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None
            if not _trusted(st):
                _distrust(d / name, st, "entry")
                return None
            blob = f.read()
    except OSError:
        return None
    return _unpack_entry(blob, key)


def store_entry(key: str, binary: bytes, mapping: dict, kind: str) -> bool:
    """Write an entry atomically (a new private file in the checked directory, then rename);
    True when stored. Failure to write (read-only home, full disk, an untrusted directory)
    only costs a recompile next time."""
    d = trusted_cache_dir()
    if d is None:
        return False
    name = _entry_path(key, d).name
    blob = _pack_entry(binary, mapping, kind, key)
    try:
        if not _POSIX_FDS:
            fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=d)
            _write_and_rename(fd, blob, tmp, d / name, None)
            return True
        dfd = _open_dir(d)
        if dfd is None:
            return False
        try:
            tmp = f".{key[:16]}.{os.getpid()}.{threading.get_ident()}.{os.urandom(4).hex()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                         dir_fd=dfd)
            _write_and_rename(fd, blob, tmp, name, dfd)
        finally:
            os.close(dfd)
        return True
    except OSError:
        return False


def _write_and_rename(fd, blob, tmp, dst, dir_fd):
    """Write ``blob`` through ``fd`` (the new file ``tmp``), flush it to disk and rename it to
    ``dst`` (both relative to ``dir_fd`` when given); the file is removed on failure."""
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


#: Counters for tests and the bench CLI: how programs were obtained in this process.
stats = {"compiled": 0, "disk_hits": 0, "memory_hits": 0, "not_stored": 0}


def compile_program(program: Program, cc: int):
    """Compile (or fetch from the disk cache) ``program`` for compute capability ``cc``.

    Returns ``(binary, mapping, kind, key)``. Needs no GPU: CI uses it to compile every
    kernel instance for sm_75, sm_80 and sm_90.
    """
    arch_option, kind = target_for(cc)
    nv = nvrtc_version()
    key = program.key(arch_option, nv)
    cached = _cache_enabled() and key is not None
    if cached:
        hit = load_entry(key)
        if hit is not None and set(hit[1]) == set(program.name_expressions):
            stats["disk_hits"] += 1
            return hit[0], hit[1], hit[2], key
    binary, mapping = program.compile(arch_option, kind)
    stats["compiled"] += 1
    if cached:
        # the headers are read again: one edited while NVRTC compiled (a checkout, an editor)
        # may be what this binary holds, so it is not stored under the old contents' key
        if program.key(arch_option, nv) != key or not store_entry(key, binary, mapping, kind):
            stats["not_stored"] += 1
    return binary, mapping, kind, key


# -- loaded modules, per device ---------------------------------------------------------------
class LoadedModule:
    """A module loaded on one device: ``function(name_expression)`` gives the CUfunction
    handle (an int) and the CuPy ``Function`` object that owns it."""

    __slots__ = ("module", "mapping", "device", "_functions")

    def __init__(self, module, mapping, device):
        self.module = module
        self.mapping = mapping
        self.device = device
        self._functions = {}

    def function(self, name_expression):
        f = self._functions.get(name_expression)
        if f is None:
            try:
                lowered = self.mapping[name_expression]
            except KeyError:
                raise KeyError(
                    f"kernel {name_expression!r} is not in this module; it has: "
                    f"{', '.join(sorted(self.mapping))}") from None
            f = self._functions.setdefault(name_expression, self.module.get_function(lowered))
        return f


_modules: dict = {}
_key_locks: dict = {}
_locks_guard = threading.Lock()


def _lock_for(k):
    with _locks_guard:
        lk = _key_locks.get(k)
        if lk is None:
            lk = _key_locks[k] = threading.Lock()
        return lk


def get_module(program: Program, device: int) -> LoadedModule:
    """The program's module on ``device``, compiled/loaded at most once per process.

    Thread-safe: concurrent first calls wait on one lock per (program, device) and the
    module is published only once it is fully loaded.
    """
    mkey = (id(program), device)
    m = _modules.get(mkey)
    if m is not None:
        stats["memory_hits"] += 1
        return m
    with _lock_for(mkey):
        m = _modules.get(mkey)
        if m is not None:
            return m
        from . import _runtime  # noqa: PLC0415

        cp = _runtime.cupy()
        info = _runtime.device_info(device)
        binary, mapping, kind, _ = compile_program(program, info.cc)
        if kind == "ptx" and not binary.endswith(b"\0"):
            binary += b"\0"  # cuModuleLoadData reads PTX as a C string
        with cp.cuda.Device(device):
            mod = cp.cuda.function.Module()
            mod.load(binary)
        m = LoadedModule(mod, mapping, device)
        # Programs are module-level singletons; keep them alive so id() stays unique.
        _keepalive.append(program)
        _modules[mkey] = m
        return m


_keepalive: list = []
