"""``cupylab-bench``: correctness-checked benchmarks of every registered cupylab operator
against its peers (torch eager, torch.compile, CuPy, JAX), with the GPU's measured streaming
ceiling and launch floor, host overhead per call, and JSON/CSV/PNG results.

The command-line interface is :mod:`cupylab.bench.cli` (console script ``cupylab-bench``, or
``python -m cupylab.bench``). Importing this package imports neither CuPy, torch nor JAX; they
are loaded when a command that needs them runs.

Modules
-------
cli
    The click commands (``run``, ``list``, ``ceiling``, ``overhead``, ``plot``, ``show``).
_frameworks
    Lazy imports of torch / CuPy / JAX and what each can do on this machine.
_operands
    Random operands in pooled GPU storage, wrapped zero-copy for each framework, and reading
    samples of any framework's array back to the host in float64.
_timing
    GPU time by CUDA events (with a hold kernel so that host gaps are not counted) and wall
    clock timing.
_cases
    One benchmark case: reference check, cupylab timing, peers.
_ceiling
    Streaming bandwidth and launch floor of this GPU.
_overhead
    Host cost per call of tiny inputs.
_env
    The environment record (GPU, driver, versions, git revision, arguments).
_report
    The text table, JSON and CSV writers and the JSON schema check.
_plot
    Bandwidth-against-size plots from a result file (matplotlib).
"""

__all__ = ["main"]


def main(argv=None):
    """Run the ``cupylab-bench`` command line (see :func:`cupylab.bench.cli.main`)."""
    from .cli import main as _main  # noqa: PLC0415

    return _main(argv)
