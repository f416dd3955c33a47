"""NVRTC compilation and the persistent binary cache (NVRTC needs no GPU)."""
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

import cupylab
from cupylab import CompileError, _compile
from cupylab.ops import elementwise
from conftest import compile_every

REPO = Path(__file__).resolve().parent.parent

SRC = r'''
#include "helper.cuh"
template <typename T>
__global__ void twice(T* out, const T* x, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = helper_scale<T>() * x[i];
}
'''


@pytest.fixture
def program(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "helper.cuh").write_text("template <typename T> __device__ T helper_scale() { return T(2); }\n")
    return lambda: _compile.Program(SRC, "twice.cu", ["twice<float>", "twice<double>"],
                                    include_dirs=[inc]), inc


def _entries(d):
    return sorted(p for p in d.glob("*.clbin"))


def test_compile_produces_cubin_and_lowered_names(cache, program):
    make, _ = program
    binary, mapping, kind, key = _compile.compile_program(make(), 90)
    assert kind == "cubin" and binary[:4] == b"\x7fELF"
    assert set(mapping) == {"twice<float>", "twice<double>"}
    assert all(v.startswith("_Z") for v in mapping.values())


@pytest.mark.parametrize("fds", [True, False])
def test_cache_hit_in_new_program_object(cache, program, monkeypatch, fds):
    """Stored and found again, through the directory's descriptor (POSIX) or by path (a
    system without the *at calls)."""
    monkeypatch.setattr(_compile, "_POSIX_FDS", fds and _compile._POSIX_FDS)
    make, _ = program
    before = dict(_compile.stats)
    _compile.compile_program(make(), 90)
    _compile.compile_program(make(), 90)
    assert _compile.stats["compiled"] - before["compiled"] == 1
    assert _compile.stats["disk_hits"] - before["disk_hits"] == 1
    assert len(_entries(cache)) == 1


def _key(p, cc=90):
    """``p``'s disk cache key for ``cc`` (None: the program cannot be keyed)."""
    return p.key(_compile.target_for(cc)[0], _compile.nvrtc_version())


def test_cache_keys(cache, program):
    make, inc = program
    k = _key
    base = k(make())
    assert k(make(), 80) != base  # arch
    p = make()
    p.options += ("-DEXTRA=1",)
    assert k(p) != base  # options
    (inc / "helper.cuh").write_text("template <typename T> __device__ T helper_scale() { return T(3); }\n")
    assert k(make()) != base  # an included header changed
    other = _compile.Program(SRC + "\n// edit\n", "twice.cu", ["twice<float>", "twice<double>"],
                             include_dirs=[inc])
    assert k(other) != k(make())  # the source changed


def test_header_change_recompiles(cache, program):
    make, inc = program
    _compile.compile_program(make(), 90)
    (inc / "helper.cuh").write_text("template <typename T> __device__ T helper_scale() { return T(5); }\n")
    before = _compile.stats["compiled"]
    _compile.compile_program(make(), 90)
    assert _compile.stats["compiled"] == before + 1
    assert len(_entries(cache)) == 2


def test_the_key_follows_every_header_nvrtc_can_read(cache, program, tmp_path, monkeypatch):
    """Headers reached through -I / --include-path options and pre-included ones are hashed;
    a header edited after a program's first key changes its next key (it was kept); a
    string source's own folder is the working directory, as NVRTC takes it, and a header
    found there is hashed too."""
    make, inc = program
    k = _key
    p = make()
    first = k(p)
    (inc / "helper.cuh").write_text("template <typename T> __device__ T helper_scale() { return T(7); }\n")
    assert k(p) != first  # the same Program object, the header edited in between
    other = tmp_path / "other"
    other.mkdir()
    (other / "helper.cuh").write_text("template <typename T> __device__ T helper_scale() { return T(4); }\n")
    for opts in ([f"-I{other}"], ["-I", str(other)], [f"--include-path={other}"]):
        q = _compile.Program(SRC, "twice.cu", ["twice<float>"], opts)
        before = k(q)
        (other / "helper.cuh").write_text("template <typename T> __device__ T helper_scale() { return T(6); }\n")
        assert k(q) != before, opts
        (other / "helper.cuh").write_text("template <typename T> __device__ T helper_scale() { return T(4); }\n")
    (other / "pre.h").write_text("#define PRE 1\n")
    q = _compile.Program("extern \"C\" __global__ void k(int* x) { x[0] = PRE; }", "k.cu", ["k"],
                         ["-include", "pre.h", f"-I{other}"])
    before = k(q)
    (other / "pre.h").write_text("#define PRE 2\n")
    assert k(q) != before
    monkeypatch.chdir(inc)  # helper.cuh in the working directory only
    q = _compile.Program(SRC, "<string>", ["twice<float>"])
    _compile.compile_program(q, 90)
    before = k(q)
    (inc / "helper.cuh").write_text("template <typename T> __device__ T helper_scale() { return T(5); }\n")
    assert k(q) != before


def _tree(root, files):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return root


def _assert_key_follows(p, ignored, read):
    """Editing ``ignored`` (path, text: a header NVRTC does not read for ``p``) keeps ``p``'s
    key; editing ``read`` (the one it reads) changes it."""
    before = _key(p)
    ignored[0].write_text(ignored[1])
    assert _key(p) == before
    read[0].write_text(read[1])
    assert _key(p) != before


def test_a_header_includes_one_beside_it_as_nvrtc_finds_it(cache, tmp_path):
    """#include "b.h" in lib/a.h finds lib/b.h (the includer's folder first, as NVRTC looks
    by default; --no-source-include had turned that off: "cannot open source file"), before
    a b.h in an include folder, and the key follows the file NVRTC reads."""
    from cupylab.kernels import load_kernels

    root = _tree(tmp_path, {
        "proj/k.cu": '#include "lib/a.h"\nextern "C" __global__ void k(int* x) { x[0] = B; }\n',
        "proj/lib/a.h": '#include "b.h"\n',
        "proj/lib/b.h": "constexpr int B = 1;\n",
        "inc/b.h": 'static_assert(false, "the include folder\'s b.h");\n'})
    m = load_kernels(root / "proj" / "k.cu", include_dirs=[root / "inc"])
    m.compile(90)
    p = _compile.Program.from_file(root / "proj" / "k.cu", ["k"], include_dirs=[root / "inc"])
    _assert_key_follows(p, (root / "inc" / "b.h", "constexpr int B = 3;\n"),  # not NVRTC's
                        (root / "proj" / "lib" / "b.h", "constexpr int B = 2;\n"))


def test_the_key_searches_option_folders_before_include_dirs(cache, tmp_path):
    """NVRTC searches the folders -I options name before include_dirs (they follow the
    options on its command line): the key hashed include_dirs' copy first, so an edit of the
    header NVRTC compiled kept the old key and loaded the old binary."""
    root = _tree(tmp_path, {"opt/cfg.h": "constexpr int V = 1;\n",
                            "dirs/cfg.h": "constexpr int V = 100;\n"})
    src = '#include <cfg.h>\nextern "C" __global__ void k(int* x) { x[0] = V; }\n'
    p = _compile.Program(src, "k.cu", ["k"], [f"-I{root / 'opt'}"], [root / "dirs"])
    _assert_key_follows(p, (root / "dirs" / "cfg.h", "constexpr int V = 200;\n"),
                        (root / "opt" / "cfg.h", "constexpr int V = 2;\n"))


def test_headers_are_hashed_as_bytes_and_macro_includes_are_not_cached(cache, tmp_path):
    """A header edited between two non-UTF-8 characters kept its key (the text was decoded
    with replacement characters); an #include named by a macro cannot be keyed, so that
    program is compiled every time and never stored."""
    root = _tree(tmp_path, {"inc/l1.h": b"// caf\xe9\nconstexpr int L = 1;\n",
                            "inc/cfg.h": "constexpr int V = 1;\n"})
    src = '#include "l1.h"\nextern "C" __global__ void k(int* x) { x[0] = L; }\n'
    p = _compile.Program(src, "k.cu", ["k"], include_dirs=[root / "inc"])
    k = _key
    before = k(p)
    (root / "inc" / "l1.h").write_bytes(b"// caf\xe8\nconstexpr int L = 1;\n")
    assert k(p) != before
    msrc = '#include CFG\nextern "C" __global__ void k(int* x) { x[0] = V; }\n'
    q = _compile.Program(msrc, "k.cu", ["k"], ['-DCFG="cfg.h"'], [root / "inc"])
    assert k(q) is None
    n = dict(_compile.stats)
    _compile.compile_program(q, 90)
    _compile.compile_program(q, 90)
    assert _compile.stats["compiled"] - n["compiled"] == 2 and _entries(cache) == []


def test_a_header_edited_while_nvrtc_compiles_is_not_stored_under_the_old_key(
        cache, program, monkeypatch):
    make, inc = program
    p = make()
    real = _compile.Program.compile

    def compile_while_editing(self, *a):
        r = real(self, *a)
        (inc / "helper.cuh").write_text(
            "template <typename T> __device__ T helper_scale() { return T(9); }\n")
        return r

    monkeypatch.setattr(_compile.Program, "compile", compile_while_editing)
    n = dict(_compile.stats)
    _compile.compile_program(p, 90)
    assert _entries(cache) == [] and _compile.stats["not_stored"] == n["not_stored"] + 1


def test_a_gpu_older_than_every_arch_nvrtc_knows_is_a_clear_error(monkeypatch):
    """PTX for the oldest arch NVRTC knows would not load on an older GPU (a driver error
    at load): the compile says which NVRTC is needed."""
    monkeypatch.setattr(_compile, "supported_archs", lambda: (75, 80, 90))
    with pytest.raises(CompileError, match="cannot compile for compute capability 7.0"):
        _compile.target_for(70)
    assert _compile.target_for(87) == ("-arch=compute_80", "ptx")


def test_an_entry_under_another_keys_name_is_not_loaded(cache, program):
    """An entry renamed or linked to another key's file name (someone who can write a parent
    folder swapping entries) is refused: the entry carries its own key."""
    make, _ = program
    _, _, _, key = _compile.compile_program(make(), 90)
    other = "0" * len(key)
    (cache / f"{other}.clbin").write_bytes((cache / f"{key}.clbin").read_bytes())
    assert _compile.load_entry(key) is not None
    assert _compile.load_entry(other) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_corrupt_entry_is_rebuilt_not_loaded(cache, program, damage):
    make, _ = program
    good, mapping, _, key = _compile.compile_program(make(), 90)
    path = cache / f"{key}.clbin"
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        b = bytearray(blob)
        b[len(b) // 3] ^= 0xFF
        path.write_bytes(bytes(b))
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(os.urandom(len(blob)))
    assert _compile.load_entry(key) is None
    before = _compile.stats["compiled"]
    again, mapping2, _, _ = _compile.compile_program(make(), 90)
    assert _compile.stats["compiled"] == before + 1  # rebuilt
    assert mapping2 == mapping and again == good
    assert _compile.load_entry(key) is not None  # and the entry is good again


def test_concurrent_writers_never_leave_partial_files(cache):
    key = "k" * 64
    payloads = [bytes([i]) * (200_000 + i) for i in range(8)]
    errors = []

    def writer(i):
        for _ in range(10):
            _compile.store_entry(key, payloads[i], {"f": f"_Z{i}"}, "cubin")

    def reader():
        for _ in range(200):
            e = _compile.load_entry(key)
            if e is not None and e[0] not in payloads:
                errors.append("torn read")

    ts = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    ts += [threading.Thread(target=reader) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    binary, mapping, kind = _compile.load_entry(key)
    i = binary[0]
    assert binary == payloads[i] and mapping == {"f": f"_Z{i}"}
    assert not list(cache.glob("*.tmp"))  # no temporary files left behind


def test_concurrent_writer_processes(cache):
    code = ("import sys; from cupylab import _compile\n"
            "i = int(sys.argv[1])\n"
            "for _ in range(20): _compile.store_entry('p' * 64, bytes([i]) * 300000, {}, 'cubin')\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}) for i in range(4)]
    assert all(p.wait() == 0 for p in procs)
    binary, _, _ = _compile.load_entry("p" * 64)
    assert len(set(binary)) == 1 and len(binary) == 300000


def test_cache_location_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPYLAB_CACHE_DIR", str(tmp_path / "x"))
    assert _compile.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("CUPYLAB_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _compile.cache_dir() == tmp_path / "xdg" / "cupylab"


def test_cache_disable(cache, program, monkeypatch):
    monkeypatch.setenv("CUPYLAB_CACHE_DISABLE", "1")
    make, _ = program
    _compile.compile_program(make(), 90)
    assert not cache.exists() or not _entries(cache)


def test_compile_error_has_log_file_and_line(cache, tmp_path):
    src = tmp_path / "broken.cu"
    src.write_text('extern "C" __global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n')
    p = _compile.Program.from_file(src, ["k"])
    with pytest.raises(CompileError) as ei:
        _compile.compile_program(p, 90)
    msg = str(ei.value)
    assert "broken.cu(2)" in msg and "undefined_name" in msg
    assert ei.value.filename == "broken.cu" and "error" in ei.value.log


def test_newer_arch_than_nvrtc_falls_back_to_ptx():
    newest = max(_compile.supported_archs())
    opt, kind = _compile.target_for(newest + 1000)
    assert kind == "ptx" and opt == f"-arch=compute_{newest}"
    assert _compile.target_for(90) == ("-arch=sm_90", "cubin")


def test_cuda_src_found():
    d = _compile.cuda_src_dir()
    assert (d / "elementwise.cu").is_file() and (d / "cupylab_common.cuh").is_file()


# -- every kernel instance, for the three archs CI promises ----------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("cc", [75, 80, 90])
def test_every_kernel_template_compiles(cc, tmp_path, monkeypatch):
    """Every template of elementwise.cu, every operator and every dtype (as the computation
    dtype, an input and the output) and the mixed-dtype vector shapes: a representative set
    of instances in one NVRTC program (the cross product is tens of thousands)."""
    monkeypatch.setenv("CUPYLAB_CACHE_DISABLE", "1")
    n = compile_every(elementwise.all_programs(), cc)
    names = elementwise.representative_names()
    assert n == len(set(names)) > 200
    for d in cupylab.dtypes:  # each dtype appears as an instance's computation dtype
        ct = cupylab._dtypes.DTYPES[d].ctype
        assert any(nm.split("<", 1)[1].split(", ")[4] == ct for nm in names), d
    for t in ("ew_contig", "ew_rows", "ew_strided"):
        assert any(nm.startswith(f"cl::{t}<") for nm in names)


# -- the wheel ships the .cu sources and finds them once installed --------------------------
@pytest.mark.slow
def test_wheel_ships_and_finds_cuda_sources(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheel_dir), str(REPO)], check=True, cwd=tmp_path)
    (whl,) = wheel_dir.glob("cupylab-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "cupylab/cuda_src/elementwise.cu" in names
    assert "cupylab/cuda_src/cupylab_common.cuh" in names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(site), str(whl)], check=True, cwd=tmp_path)
    code = ("import cupylab, cupylab._compile as c; print(cupylab.__file__); "
            "print(c.cuda_src_dir())")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=tmp_path, env=env).stdout.split("\n")
    assert out[0].startswith(str(site))
    assert out[1] == str(site / "cupylab" / "cuda_src")


def test_ptxas_report_counts_registers_and_spills():
    """scripts/ptxas_report.py (cited by docs/perf.md): registers and spill bytes per instance,
    read from NVRTC's ptxas log; a kernel capped at 32 registers that needs more spills."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "scripts" / "ptxas_report.py"
    spec = importlib.util.spec_from_file_location("ptxas_report", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = r"""
    template <int N> __global__ void __launch_bounds__(1024, 2) hold(float* p) {
        float r[N];
    #pragma unroll
        for (int i = 0; i < N; ++i) r[i] = p[threadIdx.x + i * 1024];
        float s = 0.f;
    #pragma unroll
        for (int i = 0; i < N; ++i) s += r[i] * r[(i * 7) % N];
    #pragma unroll
        for (int i = 0; i < N; ++i) p[threadIdx.x + i * 1024] = r[i] + s;
    }
    """
    prog = _compile.Program(src, "hold.cu", ["hold<2>", "hold<96>"])
    rows = {n: (regs, st, ld) for n, regs, st, ld in mod.report(prog, "sm_90")}
    assert set(rows) == {"hold<2>", "hold<96>"}
    assert 0 < rows["hold<2>"][0] <= 32 and rows["hold<2>"][1:] == (0, 0)
    assert rows["hold<96>"][0] <= 32 and rows["hold<96>"][1] > 0 and rows["hold<96>"][2] > 0
    assert [r[0] for r in mod.report(prog, "sm_90", match=r"<2>")] == ["hold<2>"]
    broken = _compile.Program(src.replace("s += ", "s += undeclared + "), "hold.cu", ["hold<2>"])
    with pytest.raises(CompileError, match=r"hold\.cu\(\d+\).*undeclared"):
        mod.report(broken, "sm_90")


def test_the_signature_scanner_reads_the_headers_nvrtc_compiles(cache, tmp_path, monkeypatch):
    """A source string named kern/k.cu: NVRTC looks in kern/ first for its quoted includes,
    and so does the scanner (it read ./types.h: the scalar was packed as a double for a
    kernel compiled with float)."""
    from conftest import FakeCAI
    from cupylab.kernels import load_kernels

    _tree(tmp_path, {"kern/types.h": "typedef float real;\n",
                     "types.h": "typedef double real;\n"})
    monkeypatch.chdir(tmp_path)
    src = '#include "types.h"\nextern "C" __global__ void k(real* x, real a, int n) {}\n'
    m = load_kernels(source=src, filename="kern/k.cu")
    assert m["k"].signature.params[1].dtype.name == "float32"
    m["k"].pack(FakeCAI((8,), "<f4"), 2.0, 8)


def test_keys_do_not_depend_on_where_the_tree_lies(cache, tmp_path):
    """The same sources and headers in two folders (two venvs, two cluster nodes sharing a
    cache) key alike: the key holds each header's include name and bytes and the program's
    file name, not their folders."""
    files = {"k.cu": '#include "lib/a.h"\nextern "C" __global__ void k(int* x) { x[0] = A; }\n',
             "lib/a.h": "constexpr int A = 1;\n"}
    keys = []
    for where in ("one", "two"):
        root = _tree(tmp_path / where, files)
        p = _compile.Program.from_file(root / "k.cu", ["k"])
        keys.append(_key(p))
    assert keys[0] == keys[1]


def test_pre_included_headers_are_found_where_nvrtc_finds_them(cache, tmp_path, monkeypatch):
    """-include pre.h: NVRTC looks in the working directory, then the -I folders, never in the
    source's folder; the key hashed the source folder's pre.h while NVRTC compiled another."""
    root = _tree(tmp_path, {"src/k.cu": 'extern "C" __global__ void k(int* x) { x[0] = PRE; }\n',
                            "src/pre.h": "#define PRE 1\n", "inc/pre.h": "#define PRE 2\n"})
    monkeypatch.chdir(root)
    p = _compile.Program.from_file(root / "src" / "k.cu", ["k"],
                                   ["-include", "pre.h", f"-I{root / 'inc'}"])
    _assert_key_follows(p, (root / "src" / "pre.h", "#define PRE 3\n"),
                        (root / "inc" / "pre.h", "#define PRE 4\n"))


def test_macro_includes_in_the_toolkits_headers_keep_a_program_cached(cache, tmp_path):
    """thrust names its includes through macros: headers found in the CUDA toolkit's folder
    (system_dirs) are hashed but do not make the program unkeyable (every program including
    cub or thrust was compiled in every process); the user's own macro include does."""
    root = _tree(tmp_path, {"cuda/include/thr.h": "#include THRUST_DETAIL(x)\n#include_next <y>\n",
                            "inc/mine.h": "#include CFG\n"})
    sysd = root / "cuda" / "include"
    src = '#include <thr.h>\nextern "C" __global__ void k(int* x) {}\n'
    p = _compile.Program(src, "k.cu", ["k"], include_dirs=[sysd], system_dirs=[sysd])
    assert _key(p) is not None
    q = _compile.Program('#include "mine.h"\n', "k.cu", [], include_dirs=[root / "inc"])
    assert _key(q) is None
    # #include_next in the user's own header: its file is not followed, so not keyable
    (root / "inc" / "next.h").write_text("#include_next <next.h>\n")
    r = _compile.Program('#include "next.h"\n', "k.cu", [], include_dirs=[root / "inc"])
    assert _key(r) is None


def test_precompile_for_an_arch_older_than_nvrtc_targets_is_one_clear_error(cache, monkeypatch,
                                                                           capsys):
    from cupylab import __main__ as cli

    monkeypatch.setattr(_compile, "supported_archs", lambda: (75, 80, 90))
    with pytest.raises(SystemExit) as e:
        cli.main(["precompile", "--arch", "sm_70", "--jobs", "1"])
    assert e.value.code == 2
    assert "cannot compile for compute capability 7.0" in capsys.readouterr().err
