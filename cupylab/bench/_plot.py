"""Bandwidth against size, one panel per operator, from a result file (matplotlib, Agg)."""
from __future__ import annotations

import math

__all__ = ["plot", "MatplotlibMissing", "MISSING_MESSAGE"]

MISSING_MESSAGE = "cupylab-bench plot needs matplotlib: pip install cupylab[plot]"


class MatplotlibMissing(ImportError):
    """matplotlib is not installed."""


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError as e:
        raise MatplotlibMissing(MISSING_MESSAGE) from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def plot(doc, path, peers=("torch",), dpi=120) -> int:
    """Draw GB/s against the element count for every operator of ``doc``.

    One panel per operator; one solid line per (dtype, input framework) for cupylab, a dashed
    line of the same colour per listed peer (its GB/s counted with the operator's bytes), and
    the measured ceiling as a horizontal line.

    Parameters
    ----------
    doc : dict
        A validated result document (:func:`cupylab.bench._report.load`).
    path : str or Path
        Output image (the format follows the suffix: .png, .svg, .pdf).
    peers : sequence of str
        Peers to draw beside cupylab (those without times are left out).
    dpi : int

    Returns
    -------
    int
        Number of panels drawn.

    Raises
    ------
    MatplotlibMissing
        matplotlib is not installed.
    ValueError
        The document has no successful result.
    """
    ok = [r for r in doc.get("results") or () if r.get("status") == "ok" and r.get("gbps")]
    if not ok:
        raise ValueError("the result file has no successful results to plot")
    plt = _pyplot()
    ops = list(dict.fromkeys(r["op"] for r in ok))
    dtypes = list(dict.fromkeys(r["dtype"] for r in ok))
    frameworks = list(dict.fromkeys(r["framework"] for r in ok))
    colors = plt.rcParams["axes.prop_cycle"].by_key().get("color") or ["C0"]
    color = {d: colors[i % len(colors)] for i, d in enumerate(dtypes)}
    styles = ["--", ":", "-."]
    ncols = min(3, len(ops))
    nrows = math.ceil(len(ops) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.0 * ncols, 4.2 * nrows), squeeze=False)
    ceiling = (doc.get("ceiling") or {}).get("gbps")
    for k, op in enumerate(ops):
        ax = axes[k // ncols][k % ncols]
        rows = [r for r in ok if r["op"] == op]
        for dt in dtypes:
            for fw in frameworks:
                pts = sorted((r for r in rows if r["dtype"] == dt and r["framework"] == fw),
                             key=lambda r: r["n"])
                if not pts:
                    continue
                label = dt if len(frameworks) == 1 else f"{dt} ({fw})"
                ax.plot([r["n"] for r in pts], [r["gbps"] for r in pts], "-o", ms=3,
                        color=color[dt], label=f"cupylab {label}")
                for j, p in enumerate(peers):
                    pp = [(r["n"], r["bytes"] / (r["peers"][p]["us"] * 1e3)) for r in pts
                          if (r.get("peers") or {}).get(p) and r["peers"][p].get("us")
                          and r.get("bytes")]
                    if pp:
                        ax.plot([a for a, _ in pp], [b for _, b in pp], styles[j % len(styles)],
                                color=color[dt], lw=1, alpha=0.8, label=f"{p} {label}")
        if ceiling:
            ax.axhline(ceiling, color="black", lw=1, ls=":",
                       label=f"ceiling {ceiling:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("elements")
        ax.set_ylabel("GB/s (bytes the op must move)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="x-small", ncol=2)
    for k in range(len(ops), nrows * ncols):
        axes[k // ncols][k % ncols].set_visible(False)
    env = doc.get("env") or {}
    rev = (env.get("git_rev") or "")[:12]
    fig.suptitle(f"cupylab-bench: {env.get('gpu') or 'GPU'}, {env.get('timestamp') or ''}"
                 + (f", git {rev}" if rev else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return len(ops)
