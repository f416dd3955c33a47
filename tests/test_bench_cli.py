"""CPU tests of ``cupylab-bench`` (click's test runner; no GPU needed).

Covers the help texts, ``list``, argument validation (exit code 2 with the valid names), the
no-GPU message, the JSON schema and CSV form of result files, ``show``, plotting from the stored
example result file, and the whole ``run`` / ``ceiling`` / ``overhead`` pipeline on a simulated
GPU: a small NumPy-backed stand-in for the part of CuPy the benchmark uses, with NumPy
implementations of the registered operators (plus one that computes the wrong thing and one
that raises). Timings on the stand-in are meaningless and never asserted.
"""
import copy
import ctypes
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import cupylab
from cupylab import _runtime
from cupylab._registry import OPS, OpSpec
from cupylab.bench import _frameworks, _report
from cupylab.bench.cli import cli, parse_sizes

DATA = Path(__file__).resolve().parent / "data"
EXAMPLE = DATA / "example_results.json"
REPO = Path(__file__).resolve().parent.parent


def _runner():
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()  # click >= 8.2 keeps stderr apart by itself


def invoke(args, **kw):
    return _runner().invoke(cli, list(args), obj={"argv": ["cupylab-bench", *args]},
                            prog_name="cupylab-bench", catch_exceptions=False, **kw)


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _has_gpu():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


# ---------------------------------------------------------------------------- help and list
def test_help_lists_commands_and_exit_codes():
    r = invoke(["--help"])
    assert r.exit_code == 0
    for word in ("run", "list", "ceiling", "overhead", "plot", "show", "Exit codes", "--json",
                 "--csv", "--repeat", "--framework", "--compile"):
        assert word in r.stdout


@pytest.mark.parametrize("cmd", ["run", "list", "ceiling", "overhead", "plot", "show"])
def test_subcommand_help(cmd):
    r = invoke([cmd, "--help"])
    assert r.exit_code == 0
    assert f"cupylab-bench {cmd}" in r.stdout


def test_run_help_documents_selection():
    r = invoke(["run", "--help"])
    for word in ("OPS", "--dtype", "--size", "--framework", "--peers", "--compile", "--repeat",
                 "--batch", "--json", "--csv", "2^10..2^28"):
        assert word in r.stdout


def test_version():
    r = invoke(["--version"])
    assert r.exit_code == 0
    assert cupylab.__version__ in r.stdout


def test_import_does_not_load_gpu_frameworks():
    code = ("import sys, cupylab.bench.cli; "
            "print(sorted(m for m in ('cupy', 'torch', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_list_shows_every_registered_case():
    r = invoke(["list"])
    assert r.exit_code == 0, r.output
    for name in OPS:
        assert name in r.stdout
    assert "2^20" in r.stdout and "2^26" in r.stdout
    assert "12.6 MB" in r.stdout  # add, float32, 2^20: 3 x 4 B x 2^20
    assert "torch" in r.stdout and "cupy" in r.stdout
    assert "\x1b" not in r.output


def test_list_selection():
    r = invoke(["list", "fused_add_mul", "--dtype", "bf16", "--size", "2^12,100x10"])
    assert r.exit_code == 0, r.output
    cases = r.stdout.split("cases for", 1)[1]
    assert "fused_add_mul" in cases and "vector_add" not in cases
    assert "bfloat16" in cases and "float32" not in cases
    assert "2^12" in cases and "100x10" in cases
    assert "torch.compile" in cases


def test_list_needs_no_gpu(monkeypatch):
    def no_gpu():
        raise cupylab.NoGPUError("cupylab: no usable CUDA GPU on this machine (simulated)")

    monkeypatch.setattr(_runtime, "cupy", no_gpu)
    assert invoke(["list"]).exit_code == 0


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("args, words", [
    (["run", "nosuchop"], ["unknown operator 'nosuchop'", "registered operators:", *OPS]),
    (["run", "--dtype", "float128"], ["unknown dtype 'float128'", "float16, bfloat16, float32, "
                                      "float64, int32, int64"]),
    (["--dtype", "complex64"], ["unknown dtype 'complex64'", "valid dtypes"]),
    (["run", "--size", "abc"], ["cannot read size 'abc'"]),
    (["run", "--size", "0"], ["has no elements"]),
    (["run", "--size", "2^10..2^4"], ["cannot read size"]),
    (["run", "--size", "2^0..2^300000"], ["cannot read size", "exponents up to 48"]),
    (["run", "--size", "2^49"], ["cannot read size"]),
    (["run", "--peers", "numpy"], ["unknown peer 'numpy'", "torch, torch.compile, cupy, jax"]),
    (["run", "--framework", "numpy"], ["numpy"]),
    (["run", "--repeat", "0"], ["0 is not in the range"]),
    (["list", "nosuchop"], ["unknown operator"]),
    (["run", "add", "--json", "/nonexistent-dir/x.json"], ["does not exist"]),
])
def test_bad_arguments_exit_2_with_valid_names(args, words):
    r = invoke(args)
    assert r.exit_code == 2
    for w in words:
        assert w in r.output


def test_parse_sizes():
    assert parse_sizes(["2^20"]) == [(1 << 20,)]
    assert parse_sizes(["1048576,2**10", "1e3"]) == [(1 << 20,), (1024,), (1000,)]
    assert parse_sizes(["4096x4096"]) == [(4096, 4096)]
    assert parse_sizes(["2^10..2^16:2"]) == [(1 << k,) for k in (10, 12, 14, 16)]
    assert parse_sizes(["2^10..2^12", "2^11"]) == [(1024,), (2048,), (4096,)]


# ---------------------------------------------------------------------------- no GPU
def _simulate_no_gpu(monkeypatch):
    def no_gpu():
        raise cupylab.NoGPUError("cupylab: no usable CUDA GPU on this machine (simulated failure)")

    monkeypatch.setattr(_runtime, "cupy", no_gpu)


@pytest.mark.parametrize("args", [[], ["run"], ["run", "add", "--dtype", "fp32"], ["ceiling"],
                                  ["overhead"], ["--repeat", "2"]])
def test_no_gpu_one_line_exit_2(monkeypatch, tmp_path, args):
    _simulate_no_gpu(monkeypatch)
    out = tmp_path / "r.json"
    r = invoke([*args, "--json", str(out)] if args[:1] != ["--repeat"] else args)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert lines == ["cupylab-bench: no usable CUDA GPU: simulated failure"]
    assert not out.exists()


def test_an_interrupt_outside_the_case_loop_exits_130(monkeypatch):
    """Ctrl-C during the ceiling's measurement (seconds) or while the results are written
    ended with click's "Aborted!" and status 1, which means "a case failed"."""
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(_runtime, "cupy", interrupted)
    r = invoke(["run", "add", "--dtype", "fp32"])
    assert r.exit_code == 130 and "interrupted" in r.stderr


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: the real no-GPU path cannot run")
def test_no_gpu_real_path_in_a_fresh_process():
    p = subprocess.run([sys.executable, "-m", "cupylab.bench", "run", "add"], capture_output=True,
                       text=True, cwd=REPO)
    assert p.returncode == 2
    assert p.stderr.startswith("cupylab-bench: no usable CUDA GPU: ")
    assert len(p.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------- result files
def test_example_result_file_matches_schema():
    doc = _report.load(EXAMPLE)
    assert doc["schema"] == "cupylab-bench/1"
    for key in ("gpu", "driver", "cuda_runtime", "cupy", "torch", "jax", "cupylab", "git_rev",
                "timestamp", "argv"):
        assert key in doc["env"]
    assert {r["status"] for r in doc["results"]} == {"ok", "FAILED", "ERROR"}


def _broken(mutate):
    doc = json.loads(EXAMPLE.read_text())
    mutate(doc)
    return doc


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.update(schema="other/2"), "schema"),
    (lambda d: d["env"].pop("git_rev"), "env.git_rev"),
    (lambda d: d["results"][0].update(status="maybe"), "status"),
    (lambda d: d["results"][0].pop("peers"), "lacks peers"),
    (lambda d: d["results"][0].update(p20=1e9), "p20 <= us <= p80"),
    (lambda d: d["results"][0].update(us=-1.0), "positive"),
    (lambda d: d["results"][-1].update(us=3.0), "must not be timed"),
    (lambda d: d["results"][-1].update(error=None), "must say why"),
    (lambda d: d["results"][0].update(n=3), "product is n"),
    (lambda d: d["results"][0]["peers"].update(torch={"us": None, "ratio": None}), "no time"),
    (lambda d: d.update(ceiling={"gbps": 0}), "ceiling"),
])
def test_schema_check_rejects(mutate, words):
    with pytest.raises(ValueError, match="not a valid cupylab-bench result file") as e:
        _report.validate(_broken(mutate))
    assert words in str(e.value)


def test_csv_flattens_peers(tmp_path):
    doc = _report.load(EXAMPLE)
    path = tmp_path / "r.csv"
    _report.write_csv(path, doc)
    import csv

    rows = list(csv.DictReader(path.open()))
    assert len(rows) == len(doc["results"])
    for col in ("op", "dtype", "shape", "us", "p20", "p80", "gbps", "pct_ceiling", "status",
                "torch_us", "torch_ratio", "torch_status", "cupy_us", "jax_status", "gpu",
                "driver", "cuda_runtime", "cupylab", "git_rev", "timestamp", "argv"):
        assert col in rows[0]
    assert rows[0]["torch_status"] == "ok" and float(rows[0]["torch_us"]) > 0
    assert rows[0]["jax_status"] == "n/a"
    assert rows[0]["argv"].startswith("cupylab-bench run")


def test_show_prints_tables(tmp_path):
    r = invoke(["show", str(EXAMPLE)])
    assert r.exit_code == 0, r.output
    assert "vector_add" in r.stdout and "FAILED" in r.stdout and "ERROR" in r.stdout
    assert "ceiling: 4231 GB/s" in r.stdout
    assert "\x1b" not in r.output
    md = invoke(["show", str(EXAMPLE), "--markdown"])
    assert md.exit_code == 0
    assert "| op | dtype | shape |" in md.stdout and "|---|" in md.stdout


def test_show_and_plot_reject_a_non_result_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "nope"}))
    for args in (["show", str(bad)], ["plot", str(bad), "-o", str(tmp_path / "x.png")]):
        r = invoke(args)
        assert r.exit_code == 2
        assert "not a valid cupylab-bench result file" in r.stderr


@pytest.mark.skipif(not _has_matplotlib(), reason="matplotlib is not installed "
                                                   "(pip install cupylab[plot])")
def test_plot_from_stored_result_file(tmp_path):
    out = tmp_path / "bw.png"
    r = invoke(["plot", str(EXAMPLE), "-o", str(out), "--peer", "torch", "--peer", "cupy"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 operators" in r.stdout


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    r = invoke(["plot", str(EXAMPLE), "-o", str(tmp_path / "x.png")])
    assert r.exit_code == 2
    assert r.stderr.strip() == "cupylab-bench plot needs matplotlib: pip install cupylab[plot]"


# ---------------------------------------------------------------------------- simulated GPU
def _root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class _Ptr:
    def __init__(self, root, off):
        self.root, self.off = root, off

    @property
    def ptr(self):
        return self.root.ctypes.data + self.off

    def __add__(self, nbytes):
        return _Ptr(self.root, self.off + int(nbytes))


class _FakeArray(np.ndarray):
    """A host array that looks like a CuPy array to the benchmark (``.data.ptr``, views made
    from a memory pointer, ``type(a).__module__ == 'cupy'``)."""

    def __new__(cls, shape, dtype=float, memptr=None, strides=None):
        if memptr is None:
            return np.zeros(shape, dtype).view(cls)
        buf = memptr.root.view(np.ndarray).reshape(-1).view(np.uint8)
        return np.ndarray.__new__(cls, shape, dtype, buffer=buf, offset=memptr.off,
                                  strides=strides)

    @property
    def data(self):
        r = _root(self)
        return _Ptr(r, self.ctypes.data - r.ctypes.data)


_FakeArray.__module__ = "cupy"


class _FakeStream:
    def __init__(self, non_blocking=False):
        self.ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


_FakeStream.null = _FakeStream()


class _FakeEvent:
    def __init__(self, *a, **k):
        self.t = 0.0

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


class _FakeKernel:
    def __init__(self, code="", name=""):
        self.name = name

    def __call__(self, grid, block, args, **kw):
        if self.name == "cl_bench_copy4":
            src, dst, n4 = args
            dst[: int(n4) * 16] = src[: int(n4) * 16]


class _FakeRandom:
    def __init__(self):
        self.g = np.random.default_rng(0)

    def random(self, size, dtype=float):
        return self.g.random(size, dtype=dtype).view(_FakeArray)

    def uniform(self, low, high, size, dtype=float):
        return self.g.uniform(low, high, size).astype(dtype).view(_FakeArray)

    def randint(self, low, high, size):
        return self.g.integers(low, high, size).view(_FakeArray)


def _fake_cupy():
    rt = types.SimpleNamespace(
        getDevice=lambda: 0, getDeviceCount=lambda: 1,
        getDeviceProperties=lambda d: {"name": b"Simulated GPU", "major": 9, "minor": 0,
                                       "multiProcessorCount": 2, "l2CacheSize": 1 << 18,
                                       "totalGlobalMem": 1 << 32},
        deviceSynchronize=lambda: None,
        memsetAsync=lambda ptr, v, n, s: ctypes.memset(ptr, v, n),
        memcpyAsync=lambda d, s, n, kind, st: ctypes.memmove(d, s, n),
        memcpyDeviceToDevice=3, memGetInfo=lambda: (24 << 20, 1 << 32),
        driverGetVersion=lambda: 13000, runtimeGetVersion=lambda: 13000)
    m = types.ModuleType("cupy")
    m.__version__ = "0.0+simulated"
    m.ndarray = _FakeArray
    m.float32 = np.float32
    m.empty = lambda shape, dtype=float: np.zeros(shape, dtype).view(_FakeArray)
    m.asnumpy = lambda a: np.array(np.asarray(a).view(np.ndarray))
    m.asarray = lambda a: np.asarray(a).view(_FakeArray)
    m.where = lambda c, a, b: np.where(c, a, b).view(_FakeArray)
    m.add, m.subtract, m.multiply, m.divide = np.add, np.subtract, np.multiply, np.divide
    m.floor_divide = np.floor_divide
    m.random = _FakeRandom()
    m.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    m.RawKernel = _FakeKernel
    m.RawModule = lambda code=None: types.SimpleNamespace(get_function=lambda n: _FakeKernel("", n))

    class ElementwiseKernel:
        def __init__(self, *a):
            pass

        def __call__(self, a, b, s):
            return (a + b) * s

    m.ElementwiseKernel = ElementwiseKernel
    m.cuda = types.SimpleNamespace(
        runtime=rt, Stream=_FakeStream, Event=_FakeEvent,
        get_elapsed_time=lambda a, b: max(b.t - a.t, 1e-7) * 1e3,
        get_current_stream=lambda: _FakeStream.null)
    return m


def _np_op(f):
    def fn(*args, out=None):
        r = f(*[np.asarray(a).view(np.ndarray) for a in args])
        if out is None:
            return np.asarray(r).view(_FakeArray)
        np.asarray(out).view(np.ndarray)[...] = r
        return out
    return fn


def _floor_or_true_div(x, y):
    return np.floor_divide(x, y) if x.dtype.kind == "i" else x / y


_IMPLS = {"vector_add": np.add, "add": np.add, "sub": np.subtract, "mul": np.multiply,
          "div": _floor_or_true_div, "fused_add_mul": lambda a, b, s: (a + b) * s}


@pytest.fixture
def simulated_gpu(monkeypatch):
    """CuPy replaced by the NumPy stand-in, the registered operators by NumPy versions, plus
    ``wrong_add`` (computes x - y against the add reference) and ``raises``."""
    fake = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_runtime, "cupy", lambda: fake)
    monkeypatch.setattr(_frameworks, "_loaded", {})
    for name, spec in list(OPS.items()):
        s = copy.copy(spec)
        s.fn = _np_op(_IMPLS.get(name, lambda *a: a[0]))
        monkeypatch.setitem(OPS, name, s)
    add = OPS["add"]
    monkeypatch.setitem(OPS, "wrong_add", OpSpec("wrong_add", _np_op(np.subtract), 2, "add",
                                                 add.dtypes, add.bytes_per_element, 1, add.peers))

    def raises(*a, out=None):
        raise RuntimeError("simulated operator failure")

    monkeypatch.setitem(OPS, "raises", OpSpec("raises", raises, 2, "add", ("float32",),
                                              add.bytes_per_element, 1, {}))
    return fake


def test_simulated_run_writes_valid_json_and_csv(simulated_gpu, tmp_path):
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    args = ["run", "add", "div", "fused_add_mul", "--dtype", "all", "--size", "2^10,1000,64x33",
            "--framework", "cupy", "--peers", "cupy", "--repeat", "2", "--json", str(js),
            "--csv", str(cs)]
    r = invoke(args)
    assert r.exit_code == 0, r.output
    assert "\x1b" not in r.output
    doc = _report.load(js)
    assert doc["env"]["gpu"] == "Simulated GPU"
    assert doc["env"]["argv"] == ["cupylab-bench", *args]
    assert doc["ceiling"]["gbps"] > 0
    assert len(doc["results"]) == 3 * 6 * 3
    assert all(x["status"] == "ok" for x in doc["results"])
    by = {(x["op"], x["dtype"], tuple(x["shape"])): x for x in doc["results"]}
    r0 = by[("add", "bfloat16", (1024,))]
    assert r0["buffer_sets"] > 1  # 6 KiB per call rotates through several sets of the 256 KiB L2
    assert r0["bytes"] == 3 * 2 * 1024 and r0["peers"]["cupy"]["ratio"] > 0
    # integer div is compared with the peers' floor division
    assert by[("div", "int32", (1000,))]["peers"]["cupy"]["ratio"] > 0
    header = cs.read_text().splitlines()[0].split(",")
    assert "cupy_us" in header and "cupy_ratio" in header and "torch_us" not in header


def test_simulated_failures_are_reported_and_exit_1(simulated_gpu, tmp_path):
    js = tmp_path / "r.json"
    r = invoke(["run", "wrong_add", "raises", "add", "--dtype", "float32,int32", "--size", "2^12",
                "--framework", "cupy", "--peers", "none", "--repeat", "2", "--json", str(js)])
    assert r.exit_code == 1
    doc = _report.load(js)
    st = {(x["op"], x["dtype"]): x for x in doc["results"]}
    for dt in ("float32", "int32"):
        failed = st[("wrong_add", dt)]
        assert failed["status"] == "FAILED" and failed["us"] is None
        assert failed["error"].startswith("wrong result")
        assert st[("add", dt)]["status"] == "ok"  # the run went on
    assert st[("raises", "float32")]["status"] == "ERROR"
    assert "simulated operator failure" in st[("raises", "float32")]["error"]
    assert "FAILED" in r.stdout and "ERROR" in r.stdout
    assert "skipped (dtype not registered for the operator): raises int32" in r.stdout
    assert "2 ok, 2 FAILED, 1 ERROR" in r.stdout


def test_simulated_quick_suite_uses_group_options(simulated_gpu, tmp_path):
    js = tmp_path / "q.json"
    r = invoke(["--framework", "cupy", "--peers", "none", "--repeat", "1", "--size", "2^10",
                "--json", str(js), "-q"])
    assert r.exit_code == 1, r.output  # wrong_add and raises are registered in this fixture
    doc = _report.load(js)
    assert doc["config"]["repeat"] == 1 and doc["config"]["dtypes"] == ["float32", "bfloat16"]
    assert {x["op"] for x in doc["results"]} == set(OPS)
    assert r.stderr == ""  # -q: no progress lines


def test_simulated_ceiling(simulated_gpu, tmp_path):
    js, cs = tmp_path / "c.json", tmp_path / "c.csv"
    r = invoke(["ceiling", "--mib", "4", "--repeat", "3", "--json", str(js), "--csv", str(cs)])
    assert r.exit_code == 0, r.output
    c = _report.load(js)["ceiling"]
    assert c["gbps"] == max(c["memcpy_gbps"], c["kernel_gbps"])
    assert c["launch_gpu_us"] > 0 and c["launch_host_us"] > 0
    assert "ceiling:" in r.stdout and "launch floor:" in r.stdout
    assert cs.read_text().startswith("gbps,source,")


def test_simulated_overhead_rows(simulated_gpu, tmp_path):
    # cupylab's own operators cannot run on the stand-in: every cupylab cell is an error, the
    # peers are timed, the file is still valid and the exit code says something failed
    js = tmp_path / "o.json"
    r = invoke(["overhead", "--framework", "cupy", "--calls", "100", "--rounds", "1",
                "--json", str(js)])
    assert r.exit_code == 1
    doc = _report.load(js)
    rows = doc["overhead"]
    assert [x["case"] for x in rows][:3] == ["add(x, y, out=z)", "add(x, y)",
                                             "fused_add_mul(a, b, s, out=d)"]
    assert rows[0]["peer_us"] > 0 and rows[0]["error"]
    assert "peer/cupylab" in r.stdout


# ---------------------------------------------------------------------------- helpers
def test_buffer_sets_span_twice_the_l2():
    from cupylab.bench._operands import MAX_SETS, buffer_sets

    l2 = 60 << 20
    assert buffer_sets(3 << 30, l2) == 1
    assert buffer_sets(120 << 20, l2) == 1
    assert buffer_sets(12 << 20, l2) == 10
    assert buffer_sets(1024, l2) == MAX_SETS
    assert buffer_sets(1024, 0) == 1


def test_sample_indices_and_compare():
    from cupylab import _dtypes
    from cupylab.bench._operands import SAMPLE, compare, sample_indices

    rng = np.random.default_rng(1)
    assert (sample_indices(1000, rng) == np.arange(1000)).all()
    idx = sample_indices(1 << 24, rng)
    assert idx[0] == 0 and idx[-1] == (1 << 24) - 1 and (np.diff(idx) > 0).all()
    assert 2 * SAMPLE < idx.size <= 3 * SAMPLE
    f32, i32 = _dtypes.from_name("float32"), _dtypes.from_name("int32")
    ref = np.array([1.0, 2.0, 3.0])
    assert compare(ref * (1 + 1e-7), ref, np.arange(3), f32, 1e-6, 1e-6) is None
    msg = compare(np.array([1.0, 2.5, np.nan]), ref, np.array([7, 8, 9]), f32, 1e-6, 1e-6)
    assert msg.startswith("wrong result: 2 of 3") and "flat index 8" in msg
    assert compare(np.array([1, 2]), np.array([1, 3]), np.arange(2), i32, 0, 0).startswith(
        "wrong result: 1 of 2 checked elements differ (exact)")


def test_installed_console_script_runs():
    """The `cupylab-bench` entry point of an installed cupylab (CI installs it) starts and lists
    the cases without a GPU."""
    import shutil

    exe = shutil.which("cupylab-bench")
    if exe is None:
        pytest.skip("cupylab is not installed in this environment (no cupylab-bench on PATH)")
    p = subprocess.run([exe, "list"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "vector_add" in p.stdout and "fused_add_mul" in p.stdout
    h = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert h.returncode == 0 and "ceiling" in h.stdout and "overhead" in h.stdout


def test_closed_pipe_ends_quietly_by_sigpipe_not_exit_1():
    """`cupylab-bench list | head -1`: exit 1 means "a case failed", so a reader that stops
    early must end the command the way it ends `cat` (SIGPIPE), with no traceback."""
    import signal

    p = subprocess.Popen([sys.executable, "-m", "cupylab.bench", "list"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=REPO)
    p.stdout.close()  # the reader is gone before the first line is written
    rc = p.wait(timeout=120)
    err = p.stderr.read().decode()
    p.stderr.close()
    assert rc == -signal.SIGPIPE, (rc, err)
    assert "Traceback" not in err and err.strip() == ""
