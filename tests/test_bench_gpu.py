"""GPU tests of ``cupylab-bench``: the quick suite end to end, each command, every input
framework that is installed, and the FAILED / ERROR paths with real kernels.

Skipped with a visible reason on machines without a usable CUDA GPU. No timing is asserted:
only that every case is checked, timed, and written to valid result files.
"""
import copy
import importlib.util
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import cupylab
from cupylab._registry import OPS, OpSpec
from cupylab.bench import _report
from cupylab.bench.cli import cli

REPO = Path(__file__).resolve().parent.parent


def _has_gpu():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001
        return False


def _installed(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _has_gpu(),
                                 reason="GPU test: no usable CUDA GPU (or no CuPy)")]
needs_torch = pytest.mark.skipif(not _installed("torch"), reason="torch is not installed")
needs_jax = pytest.mark.skipif(not _installed("jax"), reason="jax is not installed")


def invoke(args):
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()
    r = runner.invoke(cli, [str(a) for a in args], prog_name="cupylab-bench",
                      obj={"argv": ["cupylab-bench", *map(str, args)]}, catch_exceptions=False)
    print(r.stdout)  # shown by pytest when a test fails
    print(r.stderr, file=sys.stderr)
    return r


def _ok(doc):
    bad = [(x["op"], x["dtype"], x["shape"], x["status"], x["error"]) for x in doc["results"]
           if x["status"] != "ok"]
    assert not bad, bad


def test_quick_suite_end_to_end(tmp_path):
    js, cs = tmp_path / "quick.json", tmp_path / "quick.csv"
    t0 = time.perf_counter()
    r = invoke(["--json", js, "--csv", cs])
    print(f"quick suite: {time.perf_counter() - t0:.1f} s")
    assert r.exit_code == 0
    doc = _report.load(js)
    _ok(doc)
    assert {x["op"] for x in doc["results"]} == set(OPS)
    assert {x["dtype"] for x in doc["results"]} == {"float32", "bfloat16"}
    assert {x["n"] for x in doc["results"]} == {2**20, 2**26}
    assert doc["ceiling"]["gbps"] > 0 and doc["ceiling"]["launch_gpu_us"] > 0
    assert doc["env"]["gpu"] and doc["env"]["driver"] and doc["env"]["cupy"]
    for x in doc["results"]:
        assert x["gbps"] > 0 and x["pct_ceiling"] > 0
        if _installed("torch"):
            assert x["framework"] == "torch"
            assert x["peers"]["torch"]["us"] > 0, x["peers"]["torch"]
    assert len(cs.read_text().splitlines()) == len(doc["results"]) + 1
    if _installed("matplotlib"):
        png = tmp_path / "quick.png"
        assert invoke(["plot", js, "-o", png]).exit_code == 0
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_cupy_inputs_every_dtype_and_odd_shapes(tmp_path):
    js = tmp_path / "cupy.json"
    r = invoke(["run", "add", "div", "fused_add_mul", "--dtype", "all", "--size",
                "2^12,1000,37x129", "--framework", "cupy", "--peers", "cupy,torch", "--repeat",
                "2", "--json", js])
    assert r.exit_code == 0
    doc = _report.load(js)
    _ok(doc)
    assert {x["framework"] for x in doc["results"]} == {"cupy"}
    assert len(doc["results"]) == 3 * 6 * 3


@needs_torch
def test_torch_inputs_rotate_buffers_and_compare_peers(tmp_path):
    js = tmp_path / "torch.json"
    r = invoke(["run", "vector_add", "fused_add_mul", "--dtype", "bfloat16,float64,int64",
                "--size", "2^16,2^22", "--framework", "torch", "--peers", "all", "--repeat", "3",
                "--json", js])
    assert r.exit_code == 0
    doc = _report.load(js)
    _ok(doc)
    small = [x for x in doc["results"] if x["n"] == 2**16]
    assert all(x["buffer_sets"] > 1 for x in small)  # fits in L2: rotated
    fam = [x for x in doc["results"] if x["op"] == "fused_add_mul" and x["dtype"] == "float64"]
    for x in fam:
        e = x["peers"]["torch.compile"]
        assert e is not None and e.get("us"), e


@needs_torch
def test_both_sides_write_their_results_the_same_way(tmp_path):
    """Elementwise: cupylab and torch write the rotating out= buffers; row-wise (torch's
    row-wise ops allocate): cupylab allocates too, so neither side alone gets its output
    block back from a cache, warm in L2, on every call."""
    js = tmp_path / "outs.json"
    r = invoke(["run", "add", "log_softmax_backward", "--dtype", "float32", "--size",
                "16x4096", "--framework", "torch", "--peers", "torch", "--repeat", "2",
                "--json", js])
    assert r.exit_code == 0
    doc = _report.load(js)
    _ok(doc)
    got = {x["op"]: (x["out"], x["peers"]["torch"]["out"]) for x in doc["results"]}
    assert got == {"add": (True, True), "log_softmax_backward": (False, False)}, got


@needs_jax
def test_jax_inputs(tmp_path):
    js = tmp_path / "jax.json"
    r = invoke(["run", "add", "fused_add_mul", "--dtype", "float32,bfloat16,int64", "--size",
                "2^16,2^20", "--framework", "jax", "--peers", "jax", "--repeat", "2", "--json", js])
    assert r.exit_code == 0
    doc = _report.load(js)
    _ok(doc)
    for x in doc["results"]:
        assert x["peers"]["jax"]["us"] > 0 and x["peers"]["jax"]["timing"] == "wall"


def test_wrong_result_is_failed_and_never_timed(monkeypatch, tmp_path):
    add = OPS["add"]
    monkeypatch.setitem(OPS, "wrong_add", OpSpec("wrong_add", cupylab.sub, 2, "add", add.dtypes,
                                                 add.bytes_per_element, 1, add.peers))

    def raises(x, y, out=None):
        raise RuntimeError("deliberate failure")

    bad = copy.copy(add)
    bad.name, bad.fn = "raises", raises
    monkeypatch.setitem(OPS, "raises", bad)
    js = tmp_path / "bad.json"
    r = invoke(["run", "wrong_add", "raises", "add", "--dtype", "float32,int32", "--size", "2^20",
                "--framework", "cupy", "--peers", "none", "--repeat", "2", "--json", js])
    assert r.exit_code == 1
    st = {(x["op"], x["dtype"]): x for x in _report.load(js)["results"]}
    for dt in ("float32", "int32"):
        assert st[("wrong_add", dt)]["status"] == "FAILED"
        assert st[("wrong_add", dt)]["us"] is None
        assert st[("raises", dt)]["status"] == "ERROR"
        assert "deliberate failure" in st[("raises", dt)]["error"]
        assert st[("add", dt)]["status"] == "ok"


def test_ceiling(tmp_path):
    js = tmp_path / "ceiling.json"
    r = invoke(["ceiling", "--json", js])
    assert r.exit_code == 0
    c = _report.load(js)["ceiling"]
    assert c["gbps"] == max(c["memcpy_gbps"], c["kernel_gbps"]) > 0
    assert c["launch_gpu_us"] > 0 and c["launch_host_us"] > 0


def test_overhead(tmp_path):
    js = tmp_path / "overhead.json"
    r = invoke(["overhead", "--calls", "300", "--rounds", "2", "--json", js])
    assert r.exit_code == 0
    rows = _report.load(js)["overhead"]
    assert {x["inputs"] for x in rows} == ({"torch", "cupy"} if _installed("torch") else {"cupy"})
    for x in rows:
        assert x["error"] is None and x["peer_error"] is None, x
        assert x["cupylab_us"] > 0 and x["peer_us"] > 0


def test_fresh_process_entry_points():
    p = subprocess.run([sys.executable, "-m", "cupylab.bench", "run", "vector_add", "--dtype",
                        "float32", "--size", "2^12", "--peers", "none", "--repeat", "2", "-q"],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 of 1 cases: 1 ok" in p.stdout
    exe = shutil.which("cupylab-bench")
    if exe:
        p = subprocess.run([exe, "list"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
