"""``cupylab-bench run --dtype a+b``: mixed-dtype cases (inputs of their own dtypes, the output
by NumPy's promotion, bytes counted per operand) through the simulated GPU of
tests/test_bench_cli.py (NumPy stand-ins for CuPy and the operators; timings meaningless)."""
from cupylab.bench import _report

from test_bench_cli import invoke, simulated_gpu  # noqa: F401 - the fixture


def test_mixed_dtype_cases(simulated_gpu, tmp_path):  # noqa: F811
    js = tmp_path / "mixed.json"
    r = invoke(["run", "add", "fused_add_mul", "--dtype", "float32+float16,int64+int32,fp32",
                "--size", "1000", "--framework", "cupy", "--peers", "cupy", "--repeat", "2",
                "--json", str(js)])
    assert r.exit_code == 0, r.output
    doc = _report.load(js)
    by = {(x["op"], x["dtype"]): x for x in doc["results"]}
    assert set(by) == {(op, d) for op in ("add", "fused_add_mul")
                       for d in ("float32+float16", "int64+int32", "float32")}
    assert all(x["status"] == "ok" for x in doc["results"]), doc["results"]
    assert by[("add", "float32+float16")]["bytes"] == 1000 * (4 + 2 + 4)
    assert by[("add", "int64+int32")]["bytes"] == 1000 * (8 + 4 + 8)
    assert by[("fused_add_mul", "float32+float16")]["bytes"] == 1000 * (4 + 2 + 2 + 4)
    assert by[("add", "float32")]["bytes"] == 1000 * 12


def test_mixed_dtype_names_are_checked():
    r = invoke(["run", "add", "--dtype", "float32+float8", "--size", "1000"])
    assert r.exit_code == 2 and "unknown dtype 'float8'" in r.output
