"""Regenerate the tables of docs/perf.md and docs/tuning.md from the stored result files in
docs/perf/.

Every table of the two pages sits between two marker comments (each table once, on either
page)::

    <!-- table:NAME -->
    ...generated lines...
    <!-- /table -->

This script rewrites the lines between the markers from the ``cupylab-bench`` JSON files
(``sweep.json``, ``sweep_h100.json``, ``sweep_rowwise_h100.json``, ``fusion.json``,
``overhead.json``, ``overhead_h100.json``, ``medium.json``,
``large16.json``, ``mixed.json``, ``rowwise_<x>.json`` (table ``rowwise-<x>``), the A/B pairs
``<x>_before.json`` / ``<x>_after.json`` (table ``rowwise-<x>-ab``; underscores in ``<x>`` as
dashes in both), the Dask example's ``dask.json``, the
training example's ``train_tiny_llm.json``, ``train_tiny_llm_b64.json``,
``train_tiny_llm_b64_h100.json`` and the fused residual norm's
``train_tiny_llm_b64_fused_h100.json``, ``train_tiny_llm_b16_fused_h100.json``,
``train_tiny_llm_b16_ro_h100.json`` and ``train_tiny_llm_b64_ro_h100.json``,
the multi-tensor bench's ``multi_tensor.json`` and the command file, and leaves every other
line (the prose) alone. The per-case tables are formatted by :mod:`cupylab.bench._report`, the
same code that prints them on the command line.

Usage (from the repository root; needs no GPU)::

    python scripts/make_perf_md.py            # rewrite the tables of the two pages
    python scripts/make_perf_md.py --check    # exit 1 if a page is stale

Exit codes: 0 up to date (or rewritten), 1 stale (``--check``), 2 a marker or file problem.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the checkout's cupylab, installed or not
    sys.path.insert(0, str(ROOT))

from cupylab.bench import _report  # noqa: E402

BEGIN = re.compile(r"^<!-- table:([a-z0-9-]+) -->$")
END = "<!-- /table -->"
PEER = "torch"  # the ratio columns of the summaries: torch eager time / cupylab time
FLOATS = ("float16", "bfloat16", "float32", "float64")
DTYPES = FLOATS + ("int32", "int64")
LARGE = 1 << 24
COMMANDS = "sweep_commands.txt"
FILES = {  # stored file -> what it holds
    "sweep.json": "every operator x dtype x power of two 2^10..2^28, peers torch eager and CuPy",
    "sweep_h100.json": "the sweep again on an H100, every second power of two, peers JAX too, "
                       "the tree of 2026-12-06 (29425b8)",
    "sweep_rowwise_h100.json": "the row-wise operators of that sweep again with the "
                               "cross-entropy backward, both sides allocating their results "
                               "(the tree of e5847bb)",
    "fusion.json": "fused_add_mul against torch eager, torch.compile and CuPy",
    "overhead.json": "host cost per call and graph replay",
    "overhead_h100.json": "the same on an H100 (a slower host), with cupy.RawKernel given the "
                          "tensors' data_ptr() per call (the tree of 15faf7c, installed)",
    "medium.json": "float dtypes at 2^20..2^23, 7 repetitions (a second look at medium sizes)",
    "large16.json": "16-bit dtypes at 2^24..2^28, 9 repetitions (a second look at the ties)",
    "mixed.json": "add with operands of different dtypes (NumPy promotion), peers torch and CuPy",
    "rowwise_bf16.json": "row-wise forwards, bfloat16, beside torch eager and torch.compile",
    "rowwise_fp32.json": "row-wise forwards, float32, beside torch eager and torch.compile",
    "rowwise_bwd.json": "row-wise backwards beside torch eager and torch.compile",
    "rowwise_small.json": "row-wise forwards at decoding shapes (16 and 128 rows)",
    "rowwise_ce.json": "cross-entropy with its gradient, 128k vocabulary",
    "rowwise_ce_h100.json": "the same on an H100, the kernels of 2026-12-06 (ed7de5e)",
    "rowwise_ce_bwd.json": "cross-entropy's forward (loss and log-sum-exp) and its one-pass "
                           "backward beside torch eager and torch.compile (H100, fcf81fa)",
    "rowwise_small_h100.json": "decoding shapes again on an H100, with the weighted norms, "
                               "2026-12-07 (0051128: row_few_kernel's exact-fit form)",
    "groups_after.json": "row-wise ops at the row lengths the two-rows-a-block classes serve",
    "groups_before.json": "the same cases in the same session, before those classes (1913d9a)",
    "bwd16_after.json": "row-wise backwards with the 16-bit pipeline and one-vector classes",
    "bwd16_before.json": "the same cases in the same session, before them (719585f)",
    "fwdlean_after.json": "16-bit row-wise forwards, the rms norms without a bias (aa6062e)",
    "fwdlean_before.json": "the same cases in the same session, before it (2f72e91)",
    "cluster_bf16_after.json": "long bfloat16 rows on the reworked cluster kernels (H100)",
    "cluster_bf16_before.json": "the same cases in the same run, before them (59dde87)",
    "cluster_rms16_after.json": "16-bit rms_norm on the reworked cluster kernels (H100)",
    "cluster_rms16_before.json": "the same cases in the same run, before them (59dde87)",
    "cluster_fp32_after.json": "float32 rows on the reworked cluster kernels (H100)",
    "cluster_fp32_before.json": "the same cases in the same run, before them (59dde87)",
    "kexp16_after.json": "16-bit softmax of one-block rows keeping its exps (H100)",
    "kexp16_before.json": "the same cases in the same run, before it (a392f87)",
    "ckexp_after.json": "softmax of cluster rows keeping its exps (H100)",
    "ckexp_before.json": "the same cases in the same run, before it (3adb1f4)",
    "celaunder_after.json": "long 16-bit rows, cross-entropy's cluster kernels without spills (H100)",
    "celaunder_before.json": "the same cases in the same run, before it (816b484)",
    "cekeep_after.json": "float32 cross-entropy keeping its exps (H100)",
    "cekeep_before.json": "the same cases in the same run, before it (816b484 + celaunder)",
    "cluster16_after.json": "16-bit forwards on two piped 1,024-thread blocks up to 65,536 (H100)",
    "cluster16_before.json": "the same cases in the same run, before it (celaunder + cekeep)",
    "smem16_after.json": "long 16-bit rows held in shared memory across their cluster (H100)",
    "smem16_before.json": "the same cases in the same run, before it (bb196a1)",
    "smem16soft_after.json": "long 16-bit softmax rows held in shared memory (H200)",
    "smem16soft_before.json": "the same cases in the same run, before it (bb196a1)",
    "smem32_after.json": "long float32 rows held in shared memory across their cluster (H200)",
    "smem32_before.json": "the same cases in the same run, the register classes (eaadb78)",
    "smem32b_after.json": "float32 rows in shared memory, two more shapes (H200)",
    "smem32b_before.json": "the same cases in the same run, the register classes (bb196a1)",
    "pmax16_after.json": "16-bit softmax-family maximum on packed words (H200)",
    "pmax16_before.json": "the same cases in the same run, before it (52588ef)",
    "celean_after.json": "16-bit exps as one ex2, cross-entropy rows without per-element selects (H100)",
    "celean_before.json": "the same cases in the same run, before it (e5ba5b4)",
    "fit_after.json": "shared-memory cluster classes of 5 and 6 vectors a thread (H100)",
    "fit_before.json": "the same cases in the same run, before them (c503b24)",
    "blkmax_after.json": "softmax-family cluster rows: block maximum first, (max, sum) pairs (H100)",
    "blkmax_before.json": "the same cases in the same run, before it (f29b560)",
    "smempipe_after.json": "double-buffered shared-memory rows, persistent grid, not landed (H100)",
    "smempipe_before.json": "the same cases in the same run, the landed kernels (b069045)",
    "fit2_after.json": "two-block shared-memory classes of 5 and 6 vectors a thread (H100)",
    "fit2_before.json": "the same cases in the same run, before them (ac2d0f1)",
    "occ_after.json": "shared-memory rows compiled for 5-6 blocks an SM (H100)",
    "occ_before.json": "the same cases in the same run, before it (f510931)",
    "fit2occ_after.json": "both changes together, second of two rounds (H100)",
    "fit2occ_before.json": "the same cases in the same round, before both (ac2d0f1)",
    "few_after.json": "16-bit add_rms_norm piped up to one block's rows an SM, 2nd round (H100)",
    "few_before.json": "the same cases in the same round, before it (ed7de5e)",
    "lnx0_after.json": "layer_norm loading its shift x[0] before the row's wait, 2nd round (H100)",
    "lnx0_before.json": "the same cases in the same round, before it (3322ab5)",
    "sbwd_after.json": "16-bit softmax backwards, both rows in shared memory, 2nd round (H100)",
    "sbwd_before.json": "the same cases in the same round, before it (de99e23)",
    "lsmy_after.json": "16-bit log_softmax_backward reading y after the reduction, 2nd round (H100)",
    "lsmy_before.json": "the same cases in the same round, before it (626c253)",
    "f64plain_after.json": "float64 row-wise forwards on the plain register kernels, "
                           "CUPYLAB_ROWWISE_PIPELINE=0 on d0ac6e9, 2nd round (H100)",
    "f64plain_before.json": "the same cases in the same round, on the pipeline (d0ac6e9)",
    "f32plain_after.json": "float32 row-wise forwards on the plain register kernels, "
                           "branch commit f06ee06 (squashed into main), 2nd round (H100)",
    "f32plain_before.json": "the same cases in the same round, on the pipeline (5462ced)",
    "f64sbwd_after.json": "float64 softmax backwards on 512 threads of four vectors, "
                          "branch commit a379f1a (squashed into 8385c83), 2nd round (H100)",
    "f64sbwd_before.json": "the same cases in the same round, before it (8bafa72)",
    "ln16plain_after.json": "16-bit layer_norm on the plain kernel beyond 4 row groups an SM, "
                            "branch commit 8802f5d (squashed into c6328e6), 1st round (H100)",
    "ln16plain_before.json": "the same cases in the same round, before it (899c832)",
    "colsum_after.json": "norm backwards without weight (dx alone) on the tree of one "
                         "column-sum launch and 16-byte partial stores, committed as 60adeef "
                         "(recorded f466c80+colsum), 2nd round (H100)",
    "colsum_before.json": "the same cases in the same round, before it (f466c80)",
    "wstage_after.json": "16-bit forward norms with their weights staged in shared memory at "
                         "decoding shapes (ef188c9), 1st round (H100)",
    "wstage_before.json": "the same cases in the same round, the same tree with the staging "
                          "off (ef188c9, stages_weights returning False)",
    "onerow_all_after.json": "row_few_kernel at every decoding shape it holds (branch commit "
                             "0017055, recorded f2cff3b+dirty), 2nd round (H100)",
    "onerow_all_before.json": "the same cases in the same round, the same tree with "
                              "CUPYLAB_ROWWISE_FEW=0",
    "onerow_after.json": "row_few_kernel where it is taken (main 5ec18a4, installed), 2nd "
                         "round (H100)",
    "onerow_before.json": "the same cases in the same round, the same install with "
                          "CUPYLAB_ROWWISE_FEW=0",
    "fewfull_after.json": "row_few_kernel's exact-fit form (branch commit 0051128), 3rd "
                          "round (H100)",
    "fewfull_before.json": "the same cases in the same round, before it (main 557597a)",
    "fewrelax_after.json": "row_few_kernel's exact-fit form for every op that has it up to as "
                           "many rows as SMs (tree 4d8868b: that selection, committed as "
                           "262c519, and the aligned-weight condition not kept), one round "
                           "(H100)",
    "fewrelax_before.json": "the same cases in the same round, before it (main 6cac2d4)",
    "wread_after.json": "row_few_kernel's weights read ahead as loaded and converted where "
                        "used (branch commit f39acfe), one round (H100)",
    "wread_before.json": "the same cases in the same round, before it (main a1fef71)",
}


class DocError(Exception):
    """A marker or result-file problem (exit code 2)."""


# ----------------------------------------------------------------------------- helpers
def _n(r) -> int:
    return int(r["n"])


def _pow(n) -> str:
    return _report.shape_str([n])


def _ratio(r, peer=PEER):
    e = (r.get("peers") or {}).get(peer)
    return None if not e else e.get("ratio")


def _ok(doc):
    return [r for r in doc["results"] if r["status"] == "ok"]


def _rng(values, fmt="{:.1f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return ""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _table(headers, rows, right):
    return _report.render(headers, rows, right, markdown=True)


def _drop_empty_last(lines):
    """Drop the last column of a Markdown table when it is empty in every row (the ``note``
    column of a run where every case passed)."""
    cells = [ln[2:-2].split(" | ") for ln in lines]
    if len(lines) > 2 and all(not c[-1].strip() for c in cells[2:]):
        rule = lines[1].strip("|").split("|")[:-1]
        return (["| " + " | ".join(cells[0][:-1]) + " |", "|" + "|".join(rule) + "|"]
                + ["| " + " | ".join(c[:-1]) + " |" for c in cells[2:]])
    return lines


def _r3(v) -> str:
    """A ratio to 3 decimals, or 4 where 3 would round a loss up to 1.000."""
    return f"{v:.4f}" if v < 1 and f"{v:.3f}" == "1.000" else f"{v:.3f}"


def _command(argv) -> str:
    """The recorded command line, with the device's output paths cut to file names."""
    return shlex.join(Path(a).name if a.startswith("/") else a for a in argv)


# ----------------------------------------------------------------------------- the tables
def t_env(data):
    e = data["sweep.json"]["env"]
    c = data["sweep.json"]["ceiling"]
    gpu = (f"{e['gpu']} (compute capability {e['gpu_cc']}, {e['gpu_sms']} SMs, "
           f"{e['gpu_l2_bytes'] / (1 << 20):.0f} MiB L2, "
           f"{e['gpu_memory_bytes'] / (1 << 30):.0f} GiB)")
    rows = [["GPU", gpu],
            ["driver (CUDA version it supports) / CUDA runtime",
             f"{e['driver']} / {e['cuda_runtime']}"],
            ["Python / NumPy", f"{e['python']} / {e['numpy']}"],
            ["CuPy / torch / JAX", f"{e['cupy']} / {e['torch']} / {e['jax']}"],
            *(ln.split(": ", 1) for ln in _report.ceiling_lines(c))]
    return _table(["what", "value"], rows, [False, False])


def t_sources(data):
    rows = []
    for name, what in FILES.items():
        e = data[name]["env"]
        rows.append([f"`{name}`", what, f"`{_command(e['argv'])}`", e["timestamp"][:16] + "Z",
                     f"{data[name]['ceiling']['gbps']:,.0f}"])
    plot = [ln[2:].strip() for ln in data[COMMANDS] if " plot " in ln]
    if plot:
        rows.append(["`sweep.png`", "the plot below, from sweep.json",
                     f"`{_command(shlex.split(plot[0]))}`", "", ""])
    return _table(["file", "holds", "command", "date (UTC)", "ceiling GB/s"], rows,
                  [False, False, False, False, True])


def t_sweep_sizes(data):
    res = _ok(data["sweep.json"])
    rows = []
    for n in sorted({_n(r) for r in res}):
        at = [r for r in res if _n(r) == n and _ratio(r) is not None]
        low = min(at, key=_ratio)
        ratios = [_ratio(r) for r in at]
        pct = [r["pct_ceiling"] for r in at if r["dtype"] in FLOATS]
        rows.append([_pow(n), str(len(at)), f"{min(ratios):.3f} ({low['op']} {low['dtype']})",
                     f"{statistics.median(ratios):.3f}", f"{max(ratios):.2f}",
                     str(sum(x < 1 for x in ratios)), _rng(pct)])
    return _table(["n", "cases", "torch / cupylab: min (case)", "median", "max", "under 1",
                   "% of ceiling, float dtypes"], rows,
                  [False, True, False, True, True, True, False])


def t_sweep_large(data):
    res = [r for r in _ok(data["sweep.json"]) if _n(r) >= LARGE]
    rows = []
    for dt in DTYPES:
        at = [r for r in res if r["dtype"] == dt and _ratio(r) is not None]
        if not at:
            continue
        ratios = [_ratio(r) for r in at]
        cupy = [_ratio(r, "cupy") for r in at]
        under = [f"{r['op']} {_pow(_n(r))} ({_r3(_ratio(r))})" for r in at if _ratio(r) < 1]
        rows.append([dt, str(len(at)), _rng([r["pct_ceiling"] for r in at]),
                     _rng(ratios, "{:.3f}"), f"{statistics.median(ratios):.3f}",
                     ", ".join(under) or "none",
                     f"{statistics.median([x for x in cupy if x is not None]):.2f}"])
    return _table(["dtype", "cases", "% of ceiling", "torch / cupylab", "median",
                   "under 1", "CuPy / cupylab, median"], rows,
                  [False, True, True, True, True, False, True])


def t_sweep_ops(data):
    keep = [r for r in data["sweep.json"]["results"]
            if r["dtype"] in ("float32", "bfloat16") and _n(r) in (1 << 20, 1 << 26)]
    return _drop_empty_last(_report.results_table(keep, markdown=True))


def _sweep_per_op(name):
    """Per operator: the cases, % of the ceiling at n >= 2^24, torch eager's ratio (least,
    median, how many under 1) and CuPy's median, of the sweep stored as ``name``."""
    return lambda data: _per_op(_ok(data[name]))


def _per_op(res):
    rows = []
    for op in dict.fromkeys(r["op"] for r in res):
        at = [r for r in res if r["op"] == op]
        timed = [r for r in at if _ratio(r) is not None]
        low = min(timed, key=_ratio)
        ratios = [_ratio(r) for r in timed]
        cupy = [x for x in (_ratio(r, "cupy") for r in at) if x is not None]
        rows.append([op, str(len(at)), _rng([r["pct_ceiling"] for r in at if _n(r) >= LARGE]),
                     f"{_ratio(low):.2f} ({low['dtype']} {_report.shape_str(low['shape'])})",
                     f"{statistics.median(ratios):.2f}", str(sum(x < 1 for x in ratios)),
                     f"{statistics.median(cupy):.2f}" if cupy else ""])
    return _table(["op", "cases", "% of ceiling, n >= 2^24", "torch / cupylab: min (case)",
                   "median", "under 1", "CuPy / cupylab, median"], rows,
                  [False, True, True, False, True, True, True])


def t_sweep_rowwise_under(data):
    """The rows of the row-wise H100 sweep under torch eager, least ratio first."""
    res = [r for r in _ok(data["sweep_rowwise_h100.json"])
           if _ratio(r) is not None and _ratio(r) < 1]
    rows = [[r["op"], r["dtype"], _report.shape_str(r["shape"]), f"{r['us']:.2f}",
             f"{r['peers'][PEER]['us']:.2f}", f"{_ratio(r):.3f}", f"{r['pct_ceiling']:.1f}"]
            for r in sorted(res, key=_ratio)]
    return _table(["op", "dtype", "shape", "cupylab us", "torch us", "torch / cupylab",
                   "% of ceiling"], rows, [False, False, False, True, True, True, True])


def _results(name):
    return lambda data: _drop_empty_last(_report.results_table(data[name]["results"],
                                                               markdown=True))


t_fusion = _results("fusion.json")
t_mixed = _results("mixed.json")
# rowwise_<x>.json of FILES -> table rowwise-<x>
ROWWISE = tuple(f[len("rowwise_"):-len(".json")] for f in FILES if f.startswith("rowwise_"))
# <x>_after.json of FILES (with its <x>_before.json) -> table rowwise-<x>-ab
AB = tuple(f[:-len("_after.json")] for f in FILES if f.endswith("_after.json"))


def _ab(before, after):
    """A before/after table of two stored runs: the same cases, same GPU, same session."""
    def table(data):
        new = {(r["op"], r["dtype"], tuple(r["shape"])): r for r in _ok(data[after])}
        rows = []
        for b in _ok(data[before]):
            a = new.get((b["op"], b["dtype"], tuple(b["shape"])))
            if a is None:
                continue
            t = ((a.get("peers") or {}).get(PEER) or {}).get("us")
            rows.append([b["op"], b["dtype"], _report.shape_str(b["shape"]), f"{b['us']:.1f}",
                         f"{a['us']:.1f}", f"{b['us'] / a['us']:.2f}", f"{a['pct_ceiling']:.1f}",
                         "" if t is None else f"{t:.1f}", "" if t is None else f"{t / a['us']:.2f}"])
        return _table(["op", "dtype", "shape", "before us", "after us", "speedup",
                       "% ceiling after", f"{PEER} us", f"{PEER} / after"], rows,
                      [False, False, False, True, True, True, True, True, True])
    return table


def t_repeats(data):
    rows = []
    for name in ("medium.json", "large16.json"):
        res = _ok(data[name])
        sizes = sorted({_n(r) for r in res})
        for dt in DTYPES:
            at = [r for r in res if r["dtype"] == dt and _ratio(r) is not None]
            if not at:
                continue
            ratios = [_ratio(r) for r in at]
            under = [f"{r['op']} {_pow(_n(r))} ({_r3(_ratio(r))})" for r in at if _ratio(r) < 1]
            rows.append([f"`{name}`", dt, f"{_pow(sizes[0])}..{_pow(sizes[-1])}", str(len(at)),
                         _rng(ratios, "{:.3f}"), f"{statistics.median(ratios):.3f}",
                         ", ".join(under) or "none"])
    return _table(["file", "dtype", "sizes", "cases", "torch / cupylab", "median", "under 1"],
                  rows, [False, False, False, True, True, True, False])


def _overhead(data, graphs, name="overhead.json"):
    rows = [r for r in data[name]["overhead"]
            if ("graph" in r["case"].lower()) == graphs]
    return _drop_empty_last(_report.overhead_table(rows, markdown=True))


def t_host(data):
    return _overhead(data, graphs=False)


def t_host_h100(data):
    return _overhead(data, graphs=False, name="overhead_h100.json")


def t_graphs(data):
    return _overhead(data, graphs=True)


def t_dask(data):
    d = data[DASK]
    rows = [[r["what"], f"{r['ms']:.2f}", f"{r['gbps_of_x']:.0f}"] for r in d["results"]]
    head = (f"`{d['command']}` on {d['gpu']} (cupylab {d['versions']['cupylab']}, CuPy "
            f"{d['versions']['cupy']}, Dask {d['versions']['dask']}): {d['rows']} x {d['cols']} "
            f"float32 ({d['gb']:.2f} GB) in chunks of {d['chunk_rows']} rows, cluster "
            f"`{d['cluster']}`, median of {d['repeats']}, wall clock; Dask's result against "
            f"a float64 reference: relative difference {d['relative_difference']:.1e}.")
    return [head, ""] + _table(["what", "ms", "GB/s of x"], rows, [False, True, True])


DASK = "dask.json"  # scripts/examples/dask_chain.py --json (its own schema)
# scripts/examples/train_tiny_llm.py --json: the default (host-bound) batch and a GPU-bound one
TRAIN = "train_tiny_llm.json"
TRAIN_B64 = "train_tiny_llm_b64.json"
TRAIN_B64_H100 = "train_tiny_llm_b64_h100.json"  # the same at batch 64 on an H100, fcf81fa
# the fused residual norms (e5847bb, H100): batch 64 and batch 16, default compile mode and
# --compile-mode reduce-overhead
TRAIN_FUSED = {"train-fused-b64-h100": "train_tiny_llm_b64_fused_h100.json",
               "train-fused-b16-h100": "train_tiny_llm_b16_fused_h100.json",
               "train-ro-b16-h100": "train_tiny_llm_b16_ro_h100.json",
               "train-ro-b64-h100": "train_tiny_llm_b64_ro_h100.json"}
MT = "multi_tensor.json"  # python -m cupylab.bench.multi_tensor --json (its own schema)
MT_SCHEMA = "cupylab-multi-tensor/1"


def _train(name):
    def table(data):
        d = data[name]
        a = d["args"]
        cm = a.get("compile_mode", "default")
        head = (f"`python scripts/examples/train_tiny_llm.py --steps {a['steps']} --batch "
                f"{a['batch']}{'' if cm == 'default' else ' --compile-mode ' + cm}` on "
                f"{d['device']} (torch {d['torch']}): d_model {a['d_model']}, {a['layers']} "
                f"layers, seq {a['seq']}, batch {a['batch']}, vocab {a['vocab']}, bf16 "
                f"autocast; step time by CUDA events, median over the steps after the first "
                f"{a['warmup']}; loss distance to the torch mode of the same kind (eager or "
                f"compiled), bound {d['check']['bound']:g} relative (noise floor "
                f"{d['check']['floor']:.1e}).")
        peer = {"cupylab": "torch", "cupylab-compile": "torch-compile"}
        recs = d["records"]
        rows = []
        for m, r in recs.items():
            ratio = (f"{recs[peer[m]]['median_ms'] / r['median_ms']:.2f}" if m in peer else "")
            rows.append([m, f"{r['median_ms']:.2f}", f"{r['p10_ms']:.2f}-{r['p90_ms']:.2f}",
                         f"{r['first_step_s']:.1f}", f"{r['peak_mem_gb']:.2f}",
                         f"{r['rel_dist']:.1e}", ratio])
        return [head, ""] + _table(["mode", "ms/step", "p10-p90", "1st step s", "peak GB",
                                    "max rel loss dist", "torch / cupylab"], rows,
                                   [False, True, True, True, True, True, True])
    return table


def t_mt(data):
    d = data[MT]
    e = d["env"]
    argv = list(e["argv"])
    if argv and argv[0].endswith("multi_tensor.py"):  # run as python -m cupylab.bench.multi_tensor
        argv[:1] = ["python", "-m", "cupylab.bench.multi_tensor"]
    head = (f"`{_command(argv)}` on {e['gpu']} (torch {e['torch']}, CuPy {e['cupy']}, "
            f"{e['timestamp'][:16]}Z). `adam_1000x4096` and `foreach_add` are wall clock per "
            f"call with the host included (calls back to back, then one synchronisation; "
            f"median of 5); `adam_llama` and `clip_llama` are GPU time by CUDA events, with "
            f"the bandwidth on the bytes a parameter must move and its share of a "
            f"device-to-device copy measured in the same run. The last column is the speed-up "
            f"over the torch row of the same case.")
    rows = []
    for r in d["rows"]:
        if r["case"] == "ceiling":
            continue
        ms = next(r[k] for k in ("ms_per_step_wall", "ms_per_call_wall", "ms_per_step_gpu",
                                 "ms_per_call_gpu") if k in r)
        kind = "wall" if any(k.endswith("_wall") for k in r) else "GPU"
        x = r.get("speedup_vs_torch_fused", r.get("speedup_vs_torch"))
        rows.append([r["case"], r["impl"], f"{ms:.4g} ({kind})",
                     f"{r['GB/s']:,}" if "GB/s" in r else "",
                     f"{r['pct_of_copy_ceiling']:.1f}" if "pct_of_copy_ceiling" in r else "",
                     f"{x:.2f}"])
    ceil = next((r["GB/s"] for r in d["rows"] if r["case"] == "ceiling"), None)
    tail = [] if ceil is None else ["", f"Copy ceiling in this run: {ceil:,} GB/s."]
    return [head, ""] + _table(["case", "implementation", "ms", "GB/s", "% of copy",
                                "x torch"], rows,
                               [False, False, True, True, True, True]) + tail


TABLES = {"env": t_env, "sources": t_sources, "sweep-sizes": t_sweep_sizes,
          "sweep-large": t_sweep_large, "sweep-ops": t_sweep_ops,
          "sweep-h100": _sweep_per_op("sweep_h100.json"),
          "sweep-rowwise-h100": _sweep_per_op("sweep_rowwise_h100.json"),
          "sweep-rowwise-h100-under": t_sweep_rowwise_under,
          "fusion": t_fusion,
          "repeats": t_repeats, "host": t_host, "host-h100": t_host_h100, "graphs": t_graphs,
          "mixed": t_mixed,
          "dask": t_dask, "train": _train(TRAIN),
          **{f"rowwise-{x.replace('_', '-')}-ab": _ab(f"{x}_before.json", f"{x}_after.json")
             for x in AB},
          "train-b64": _train(TRAIN_B64), "train-b64-h100": _train(TRAIN_B64_H100),
          **{k: _train(v) for k, v in TRAIN_FUSED.items()},
          "multi-tensor": t_mt,
          **{f"rowwise-{x.replace('_', '-')}": _results(f"rowwise_{x}.json") for x in ROWWISE}}


# ----------------------------------------------------------------------------- the page
def load_data(data_dir: Path) -> dict:
    data = {}
    try:
        data[DASK] = json.loads((data_dir / DASK).read_text(encoding="utf-8"))
        if data[DASK].get("schema") != "cupylab-dask-example/1":
            raise ValueError("not schema cupylab-dask-example/1")
    except (OSError, ValueError) as e:
        raise DocError(f"{data_dir / DASK}: {e}") from None
    for name in (TRAIN, TRAIN_B64, TRAIN_B64_H100, *TRAIN_FUSED.values(), MT):
        try:
            data[name] = json.loads((data_dir / name).read_text(encoding="utf-8"))
            if name == MT and data[name].get("schema") != MT_SCHEMA:
                raise ValueError(f"not schema {MT_SCHEMA}")
        except (OSError, ValueError) as e:
            raise DocError(f"{data_dir / name}: {e}") from None
    for name in FILES:
        try:
            data[name] = _report.load(data_dir / name)
        except (OSError, ValueError) as e:
            raise DocError(f"{data_dir / name}: {e}") from None
    try:
        data[COMMANDS] = (data_dir / COMMANDS).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DocError(f"{data_dir / COMMANDS}: {e}") from None
    return data


DOCS = ("perf.md", "tuning.md")  # the pages, in the --docs folder


def render_doc(text: str, data: dict) -> tuple:
    """``(new text, names of the tables that changed, names of the tables it holds)``; each
    table at most once, between its two markers (that every table of TABLES appears on some
    page is checked by :func:`render_pages`)."""
    lines = text.split("\n")
    out, changed, seen = [], [], []
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        out.append(lines[i])
        i += 1
        if not m:
            continue
        name = m.group(1)
        if name not in TABLES:
            raise DocError(f"unknown table {name!r} (known: {', '.join(TABLES)})")
        if name in seen:
            raise DocError(f"table {name!r} appears twice")
        seen.append(name)
        try:
            end = lines.index(END, i)
        except ValueError:
            raise DocError(f"table {name!r}: no {END} after its marker") from None
        if any(BEGIN.match(ln) for ln in lines[i:end]):
            raise DocError(f"table {name!r}: a marker inside it")
        new = TABLES[name](data)
        if lines[i:end] != new:
            changed.append(name)
        out += new
        out.append(END)
        i = end + 1
    return "\n".join(out), changed, seen


def render_pages(texts: dict, data: dict) -> dict:
    """``{page: (new text, changed tables)}`` for ``texts`` (``{page: text}``): every table of
    TABLES exactly once across the pages."""
    out, where = {}, {}
    for page, text in texts.items():
        try:
            new, changed, seen = render_doc(text, data)
        except DocError as e:
            raise DocError(f"{page}: {e}") from None
        for name in seen:
            if name in where:
                raise DocError(f"table {name!r} appears twice ({where[name]}, {page})")
            where[name] = page
        out[page] = (new, changed)
    missing = [n for n in TABLES if n not in where]
    if missing:
        raise DocError(f"no marker for table(s) {', '.join(missing)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a table differs from the stored results")
    ap.add_argument("--docs", type=Path, default=ROOT / "docs",
                    help=f"the folder of the pages ({', '.join(DOCS)})")
    ap.add_argument("--data", type=Path, default=None,
                    help="directory of the result files (default: perf/ in --docs)")
    a = ap.parse_args(argv)
    data_dir = a.data if a.data is not None else a.docs / "perf"
    pages = [a.docs / name for name in DOCS]
    try:
        texts = {p: p.read_text(encoding="utf-8") for p in pages}
        result = render_pages(texts, load_data(data_dir))
    except (DocError, OSError) as e:
        print(f"make_perf_md: {e}", file=sys.stderr)
        return 2
    stale = {p: r for p, r in result.items() if r[1]}
    if not stale:
        print(f"make_perf_md: {', '.join(map(str, pages))} up to date ({len(TABLES)} tables)")
        return 0
    if a.check:
        for p, (_, changed) in stale.items():
            print(f"make_perf_md: {p} is stale: table(s) {', '.join(changed)} differ from "
                  f"{data_dir}; run python scripts/make_perf_md.py", file=sys.stderr)
        return 1
    for p, (new, changed) in stale.items():
        p.write_text(new, encoding="utf-8")
        print(f"make_perf_md: rewrote table(s) {', '.join(changed)} in {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
