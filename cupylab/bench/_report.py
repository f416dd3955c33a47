"""Reports: the plain-text (or Markdown) tables, the JSON result file and its schema check, and
the CSV file.

JSON schema ``cupylab-bench/1``::

    {
      "schema": "cupylab-bench/1",
      "command": "run" | "ceiling" | "overhead",
      "config": {...},                       # the selection and timing settings used
      "env": {"gpu", "gpu_cc", "gpu_sms", "gpu_l2_bytes", "gpu_memory_bytes", "driver",
              "cuda_runtime", "cupy", "torch", "jax", "numpy", "python", "cupylab", "git_rev",
              "git_dirty", "timestamp", "host", "argv", "cwd"},
      "ceiling": {"gbps", "source", "memcpy_gbps", "kernel_gbps", "kernel_grid",
                  "kernel_block", "bytes", "launch_gpu_us", "launch_host_us", "method"} | null,
      "results": [{"op", "dtype", "shape", "n", "framework", "status": "ok"|"FAILED"|"ERROR",
                   "error", "us", "p20", "p80", "gbps", "pct_ceiling", "bytes", "flops",
                   "buffer_sets", "batch", "reps", "timing", "out" (optional: whether
                   cupylab wrote into out= buffers),
                   "peers": {name: null | {"us", "ratio", ...} | {"us": null, "ratio": null,
                                                                  "error"}},
                   "notes": [str]}],
      "overhead": [{"inputs", "case", "cupylab_us", "cupylab_min", "cupylab_max", "peer",
                    "peer_us", "ratio", "error", "peer_error", "calls", "rounds", "per"}]
    }

Times are µs per call (GPU time, median over repetitions; p20/p80 the 20th/80th
percentiles); ``gbps`` counts the bytes the operator must move (its ``OpSpec``); ``ratio`` is
peer time / cupylab time (above 1: cupylab is faster). A peer that is not installed or not
registered for the operator is ``null``.
"""
from __future__ import annotations

import csv
import json
import math
import numbers
import shlex

from ._frameworks import PEERS

__all__ = ["SCHEMA", "build_doc", "validate", "load", "write_json", "write_csv",
           "results_table", "overhead_table", "notes_lines", "ceiling_lines", "env_line",
           "shape_str", "human_bytes", "human_count"]

SCHEMA = "cupylab-bench/1"
STATUSES = ("ok", "FAILED", "ERROR")
ENV_KEYS = ("gpu", "driver", "cuda_runtime", "cupy", "torch", "jax", "numpy", "cupylab",
            "git_rev", "timestamp", "argv")
RESULT_KEYS = ("op", "dtype", "shape", "n", "framework", "us", "p20", "p80", "gbps",
               "pct_ceiling", "status", "error", "peers")
OVERHEAD_KEYS = ("inputs", "case", "cupylab_us", "peer", "peer_us", "ratio", "error")
PEER_LABEL = {"torch": "torch", "torch.compile": "compile", "cupy": "cupy", "jax": "jax"}


# -------------------------------------------------------------------------------- formatting
def shape_str(shape) -> str:
    """``(1048576,)`` -> ``"2^20"``; ``(1000,)`` -> ``"1000"``; ``(64, 32)`` -> ``"64x32"``."""
    shape = [int(e) for e in shape]
    if len(shape) == 1:
        n = shape[0]
        if n >= 1024 and n & (n - 1) == 0:
            return f"2^{n.bit_length() - 1}"
        return str(n)
    return "x".join(str(e) for e in shape) or "()"


def _scaled(v, units, last):
    v = float(v)
    for unit in units:
        if abs(v) < 1000:
            return f"{v:.3g}{unit}"
        v /= 1000
    return f"{v:.3g}{last}"


def human_bytes(b) -> str:
    """``12582912`` -> ``"12.6 MB"`` (decimal units)."""
    return _scaled(b, (" B", " kB", " MB", " GB"), " TB")


def human_count(c) -> str:
    """``1048576`` -> ``"1.05 M"``."""
    return _scaled(c, ("", " k", " M", " G"), " T")


def _us(v) -> str:
    if v is None:
        return ""
    if v < 10:
        return f"{v:.2f}"
    if v < 1000:
        return f"{v:.1f}"
    return f"{v:.0f}"


def _gbps(v) -> str:
    if v is None:
        return ""
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _pct(v) -> str:
    return "" if v is None else f"{v:.1f}"


def _ratio(v) -> str:
    return "" if v is None else f"{v:.2f}"


def _short(text, width=70) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def render(headers, rows, right, markdown=False) -> list:
    """Fixed-width text table (or a Markdown table). ``right``: per column, right-align."""
    if markdown:
        esc = [[str(c).replace("|", "\\|") for c in row] for row in rows]
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---:" if r else "---" for r in right) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in esc]
        return lines
    widths = [len(h) for h in headers]
    for row in rows:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def line(cells):
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "  ".join(parts).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _peers_present(results):
    seen = set()
    for r in results:
        seen.update(r.get("peers") or {})
    return [p for p in PEERS if p in seen] + sorted(seen.difference(PEERS))


def _peer_cells(entry, present):
    if not present:
        return ["-", ""]
    if entry is None:
        return ["n/a", ""]
    if entry.get("error"):
        return ["wrong" if str(entry["error"]).startswith("wrong result") else "err", ""]
    return [_us(entry.get("us")), _ratio(entry.get("ratio"))]


def results_table(results, markdown=False) -> list:
    """Lines of the results table: op, dtype, shape, µs (median, p20-p80), GB/s, % of the
    ceiling, and per peer its µs and peer/cupylab ratio; errors in a last column."""
    peers = _peers_present(results)
    headers = ["op", "dtype", "shape", "us", "p20-p80", "GB/s", "%ceil"]
    right = [False, False, False, True, True, True, True]
    for p in peers:
        lab = PEER_LABEL.get(p, p)
        headers += [f"{lab} us", f"{lab} x"]
        right += [True, True]
    headers.append("note")
    right.append(False)
    rows = []
    for r in results:
        ok = r.get("status") == "ok"
        row = [str(r.get("op")), str(r.get("dtype")), shape_str(r.get("shape") or [r.get("n")])]
        if ok:
            row += [_us(r.get("us")), f"{_us(r.get('p20'))}-{_us(r.get('p80'))}",
                    _gbps(r.get("gbps")), _pct(r.get("pct_ceiling"))]
        else:
            row += [str(r.get("status")), "", "", ""]
        ps = r.get("peers") or {}
        for p in peers:
            row += _peer_cells(ps.get(p), p in ps) if ok else ["", ""]
        row.append("" if ok else _short(r.get("error") or ""))
        rows.append(row)
    return render(headers, rows, right, markdown)


def notes_lines(results) -> list:
    """Full error messages and notes after the table, one line each; a message that several
    cases share is printed once with the cases it applies to."""
    by_msg: dict = {}
    for r in results:
        where = f"{r.get('op')} {r.get('dtype')} {shape_str(r.get('shape') or [r.get('n')])}"
        if r.get("status") != "ok":
            by_msg.setdefault(f"{r.get('status')}: {r.get('error')}", []).append(where)
            continue
        for p, e in (r.get("peers") or {}).items():
            if e is not None and e.get("error"):
                by_msg.setdefault(f"peer {p}: {e['error']}", []).append(where)
        for note in r.get("notes") or ():
            by_msg.setdefault(str(note), []).append(where)
    out = []
    for msg, wheres in by_msg.items():
        if len(wheres) == 1:
            out.append(f"{wheres[0]}: {msg}")
        else:
            more = f" and {len(wheres) - 4} more" if len(wheres) > 4 else ""
            shown = ", ".join(wheres[:4]) + more
            out.append(f"{msg} [{len(wheres)} cases: {shown}]")
    return out


def env_line(env) -> str:
    """One line naming the GPU, driver, CUDA and versions."""
    e = env or {}
    gpu = e.get("gpu") or "no GPU"
    bits = []
    if e.get("gpu_cc"):
        bits.append(f"cc {e['gpu_cc']}")
    if e.get("gpu_sms"):
        bits.append(f"{e['gpu_sms']} SMs")
    if e.get("gpu_l2_bytes"):
        bits.append(f"{e['gpu_l2_bytes'] / (1 << 20):.0f} MiB L2")
    if bits:
        gpu += f" ({', '.join(bits)})"
    rev = e.get("git_rev")
    cl = f"cupylab {e.get('cupylab')}"
    if rev:
        cl += f" (git {rev[:12]}{'+dirty' if e.get('git_dirty') else ''})"
    vers = ", ".join(f"{name} {e[key]}" for name, key in (
        ("CuPy", "cupy"), ("torch", "torch"), ("JAX", "jax"), ("NumPy", "numpy")) if e.get(key))
    return (f"{cl} | {gpu} | driver {e.get('driver')}, CUDA runtime {e.get('cuda_runtime')} | "
            f"{vers} | {e.get('timestamp')}")


def ceiling_lines(c) -> list:
    """The ceiling and launch floor in words."""
    if not c:
        return ["ceiling: not measured"]
    return [
        f"ceiling: {c['gbps']:.0f} GB/s streaming, read+write (best of memcpy D2D "
        f"{c['memcpy_gbps']:.0f} GB/s and a float4 copy kernel {c['kernel_gbps']:.0f} GB/s "
        f"at grid {c.get('kernel_grid')}x{c.get('kernel_block')}, "
        f"{human_bytes(c['bytes'])} buffers)",
        f"launch floor: {c['launch_gpu_us']:.2f} us GPU time per empty kernel back to back, "
        f"{c['launch_host_us']:.2f} us host time per CuPy launch",
    ]


def overhead_table(rows, markdown=False) -> list:
    """Lines of the host-overhead table."""
    headers = ["inputs", "cupylab call", "us", "peer", "peer us", "peer/cupylab", "note"]
    right = [False, False, True, False, True, True, False]
    body = []
    for r in rows:
        note = "; ".join(f"{w}: {_short(e, 60)}" for w, e in (("cupylab", r.get("error")),
                                                             ("peer", r.get("peer_error"))) if e)
        body.append([str(r.get("inputs")), str(r.get("case")), _us(r.get("cupylab_us")),
                     str(r.get("peer") or ""), _us(r.get("peer_us")), _ratio(r.get("ratio")),
                     note])
    return render(headers, body, right, markdown)


# -------------------------------------------------------------------------------- files
def build_doc(command, env, ceiling=None, results=(), overhead=(), config=None) -> dict:
    """The result document (see the module docstring)."""
    return {"schema": SCHEMA, "command": command, "config": dict(config or {}),
            "env": dict(env or {}), "ceiling": ceiling, "results": list(results),
            "overhead": list(overhead)}


def _num(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def validate(doc) -> None:
    """Check a result document against schema ``cupylab-bench/1``.

    Raises
    ------
    ValueError
        Listing every problem found.
    """
    p = []
    if not isinstance(doc, dict):
        raise ValueError("result file: the top level must be a JSON object")
    if doc.get("schema") != SCHEMA:
        p.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    if not isinstance(doc.get("command"), str):
        p.append("command must be a string")
    env = doc.get("env")
    if not isinstance(env, dict):
        p.append("env must be an object")
    else:
        for k in ENV_KEYS:
            if k not in env:
                p.append(f"env.{k} is missing")
        if not isinstance(env.get("timestamp"), str):
            p.append("env.timestamp must be a string")
        if not isinstance(env.get("argv"), list):
            p.append("env.argv must be a list")
    c = doc.get("ceiling")
    if c is not None:
        if not isinstance(c, dict) or not _num(c.get("gbps")) or c["gbps"] <= 0:
            p.append("ceiling must be null or an object with a positive gbps")
    for key in ("results", "overhead"):
        if not isinstance(doc.get(key), list):
            p.append(f"{key} must be a list")
    for i, r in enumerate(doc.get("results") or ()):
        where = f"results[{i}]"
        if not isinstance(r, dict):
            p.append(f"{where} must be an object")
            continue
        missing = [k for k in RESULT_KEYS if k not in r]
        if missing:
            p.append(f"{where} lacks {', '.join(missing)}")
            continue
        if r["status"] not in STATUSES:
            p.append(f"{where}.status is {r['status']!r}, expected one of {STATUSES}")
        shape = r["shape"]
        if (not isinstance(shape, list) or not all(isinstance(e, int) for e in shape)
                or math.prod(shape) != r["n"]):
            p.append(f"{where}.shape must be a list of ints whose product is n")
        if r["status"] == "ok":
            for k in ("us", "p20", "p80", "gbps"):
                if not _num(r[k]) or r[k] <= 0:
                    p.append(f"{where}.{k} must be a positive number")
            if all(_num(r[k]) for k in ("us", "p20", "p80")) and not (
                    r["p20"] <= r["us"] * (1 + 1e-9) and r["us"] <= r["p80"] * (1 + 1e-9)):
                p.append(f"{where}: p20 <= us <= p80 does not hold")
        else:
            if r["us"] is not None:
                p.append(f"{where}: a {r['status']} case must not be timed (us must be null)")
            if not isinstance(r["error"], str) or not r["error"]:
                p.append(f"{where}: a {r['status']} case must say why (error)")
        if not isinstance(r["peers"], dict):
            p.append(f"{where}.peers must be an object")
            continue
        for name, e in r["peers"].items():
            if e is None:
                continue
            if not isinstance(e, dict) or "us" not in e or "ratio" not in e:
                p.append(f"{where}.peers.{name} must be null or an object with us and ratio")
            elif e["us"] is None and not e.get("error"):
                p.append(f"{where}.peers.{name}: no time and no error")
    for i, r in enumerate(doc.get("overhead") or ()):
        if not isinstance(r, dict) or any(k not in r for k in OVERHEAD_KEYS):
            p.append(f"overhead[{i}] must be an object with {', '.join(OVERHEAD_KEYS)}")
    if p:
        raise ValueError("not a valid cupylab-bench result file:\n  " + "\n  ".join(p))


def load(path) -> dict:
    """Read and validate a result file.

    Raises
    ------
    ValueError
        Not JSON, or not schema ``cupylab-bench/1``.
    OSError
        Unreadable.
    """
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    validate(doc)
    return doc


def _plain(v):
    """``v`` with NumPy scalars made Python numbers and non-finite floats made ``None``
    (strict JSON has no NaN or Infinity)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        try:
            v = v.item()
        except (TypeError, ValueError):
            return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def write_json(path, doc) -> None:
    """Write ``doc`` as indented JSON.

    Raises
    ------
    ValueError
        ``doc`` does not match the schema (the file is written all the same, so that a long
        run's measurements are never lost).
    """
    doc = _plain(doc)
    try:
        validate(doc)
    finally:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
            f.write("\n")


_ENV_CSV = ("gpu", "driver", "cuda_runtime", "cupy", "torch", "jax", "numpy", "cupylab",
            "git_rev", "timestamp")
_RESULT_CSV = ("op", "dtype", "shape", "n", "framework", "status", "us", "p20", "p80", "gbps",
               "pct_ceiling", "bytes", "flops", "buffer_sets", "batch", "reps", "timing", "error")
_PEER_CSV = ("us", "p20", "p80", "ratio", "status", "error")
_OVERHEAD_CSV = ("inputs", "case", "cupylab_us", "cupylab_min", "cupylab_max", "peer",
                 "peer_us", "ratio", "error", "peer_error", "calls", "rounds", "per")
_CEILING_CSV = ("gbps", "source", "memcpy_gbps", "kernel_gbps", "kernel_grid", "kernel_block",
                "bytes", "launch_gpu_us", "launch_host_us")


def _peer_status(entry):
    if entry is None:
        return "n/a"
    if entry.get("error"):
        return "wrong" if str(entry["error"]).startswith("wrong result") else "error"
    return "ok"


def csv_rows(doc):
    """``(header, rows)`` of the CSV form: one row per result (peers flattened to
    ``<peer>_us``, ``<peer>_ratio`` ... columns), else per overhead row, else the ceiling;
    every row ends with the environment and the ceiling."""
    env = doc.get("env") or {}
    ceil = doc.get("ceiling") or {}
    tail_h = list(_ENV_CSV) + ["ceiling_gbps", "argv"]
    tail = [env.get(k) for k in _ENV_CSV] + [ceil.get("gbps"), shlex.join(env.get("argv") or [])]
    results = doc.get("results") or []
    if results:
        peers = _peers_present(results)
        header = list(_RESULT_CSV) + [f"{p}_{k}" for p in peers for k in _PEER_CSV]
        rows = []
        for r in results:
            row = [r.get(k) for k in _RESULT_CSV]
            row[2] = "x".join(str(e) for e in r.get("shape") or [])
            for p in peers:
                ps = r.get("peers") or {}
                if p not in ps:
                    row += [None] * len(_PEER_CSV)
                    continue
                e = ps[p]
                row += [None if e is None else e.get(k) for k in _PEER_CSV[:4]]
                row += [_peer_status(e), None if e is None else e.get("error")]
            rows.append(row + tail)
        return header + tail_h, rows
    if doc.get("overhead"):
        return (list(_OVERHEAD_CSV) + tail_h,
                [[r.get(k) for k in _OVERHEAD_CSV] + tail for r in doc["overhead"]])
    return list(_CEILING_CSV) + tail_h, [[ceil.get(k) for k in _CEILING_CSV] + tail]


def write_csv(path, doc) -> None:
    """Write the CSV form of ``doc`` (see :func:`csv_rows`)."""
    header, rows = csv_rows(doc)
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for row in rows:
            w.writerow(["" if v is None else v for v in row])
