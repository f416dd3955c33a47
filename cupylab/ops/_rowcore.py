"""Shared machinery of the row-wise operators (:mod:`cupylab.ops.rowwise`): the row layout
(rows x columns over any leading shape), the choice of kernel per row length, programs and
launches over ``cuda_src/rowwise.cu`` (argument gathering and checks: :mod:`._rowargs`, whose
names are re-exported here).

Kernel choice (:func:`choose`): the register kernels hold a row in registers as 16-byte vectors
and read it once; they need the last axis contiguous and every row operand starting at the
same offset modulo 16 bytes in each row. The ladder below is tried from the smallest class up:
``(threads per block, threads per row, vectors per thread, cluster size)``; a class holds
``threads per row x vectors x cluster size`` 16-byte slots. Cluster classes (one row spread
over 2-8 blocks that meet in distributed shared memory) need compute capability 9.0. Anything
else (a strided last axis, mixed alignment, a longer row) goes to ``row_generic``: one block
per row that reads the row two or three times.
"""
from __future__ import annotations

import os
import struct

from .. import _compile, _dtypes, _launch, _runtime
# real_value: the operators check their scalar arguments with it through here
from .._elementwise_core import c_strides, coalesce, real_value  # noqa: F401
# the arguments' gathering and checks live in ._rowargs; the operators call them through here
from ._rowargs import (F32, FLAG_W_F32, FLOATS, Ctx, check_columns, check_eps,  # noqa: F401
                       check_float, check_not_0d, check_out, check_same, check_stats,
                       check_vector, check_vectors, disjoint, finish, gather, new_array,
                       overlap)

F64 = _dtypes.from_name("float64")
I32 = _dtypes.from_name("int32")
I64 = _dtypes.from_name("int64")

OP = {"softmax": 0, "log_softmax": 1, "rms_norm": 2, "layer_norm": 3, "add_rms_norm": 4,
      "cross_entropy": 5, "softmax_backward": 10, "log_softmax_backward": 11,
      "rms_norm_backward": 12, "layer_norm_backward": 13}
#: ops whose register kernel also accumulates weight/bias gradients (persistent grid)
BWD_W = (12, 13)

#: (threads, threads per row, 16-byte vectors per thread, cluster size), smallest first. The
#: 64-threads-a-row classes (two rows a block) keep rows between the 32- and 128-thread classes
#: from half-filling a 128-thread row: every thread computes all of its vectors, empty or not.
#: The cluster classes use 512-thread blocks up to 16,384 slots, so that two blocks (of two
#: rows) share an SM under the same 64-register cap: one block's loads go on while the
#: other waits at its cluster barrier.
FWD_LADDER = ((128, 4, 1, 1), (128, 32, 1, 1), (128, 32, 4, 1), (128, 64, 4, 1),
              (128, 128, 4, 1), (256, 256, 4, 1), (512, 512, 4, 1), (1024, 1024, 4, 1),
              (512, 512, 4, 4), (512, 512, 4, 8), (1024, 1024, 4, 8))
#: 16-bit and float32 softmax, log_softmax, rms_norm, layer_norm and cross-entropy hold a
#: cluster row in shared memory (row_smem_kernel): each block copies its whole segment with
#: cp.async at once and reads it back at every pass, so a block needs few registers and
#: 256-thread blocks of four clusters share an SM, one loading while the others reduce.
#: Against the register cluster classes (scripts/bench_ab.sh, docs/tuning.md "Long rows"):
#: bf16 (H100 for the four ops, H200 for softmax) 8192x128256 1.31-1.58x (cross-entropy 3.17
#: -> 2.05 ms), 4096x40000 1.14-1.63x, 1024x65536 1.07-1.49x; float32 (H200) 4096x128256
#: 1.39-2.20x, 4096x40000 1.46-1.69x, 1024x65536 1.03-1.47x. float64 rows and add_rms_norm
#: (two inputs) keep the register classes. The classes of 5 and 6 vectors a thread keep a row
#: between the 8-vector classes from being padded (with -inf or 0) to the next one, whose
#: padding costs instructions: Nsight Compute found these kernels issue-bound as much as
#: memory-bound (docs/tuning.md).
#: Two-block classes of 5 and 6 vectors (sm_90) do the same for rows between the 512- and
#: the 1,024-thread one-block classes (bf16 16,385-24,576 elements, float32 8,193-12,288),
#: which filled 50-75 % of the 1,024-thread class: cross-entropy and layer_norm there
#: 1.15-1.67x, softmax and log_softmax 0.94-1.15x (H100, docs/tuning.md). The kernels are
#: compiled for 5 (16-bit) or 6 (float32) resident blocks an SM, 3 for the 16-vector classes
#: (smem_min_blocks in rowwise.cu).
SMEM_OPS = (0, 1, 2, 3, 5)
SMEM_LADDER = tuple(c for c in FWD_LADDER if c[3] == 1 and c[0] < 1024) + (
    (256, 256, 5, 2), (256, 256, 6, 2), (1024, 1024, 4, 1),
    (256, 256, 5, 4), (256, 256, 6, 4), (256, 256, 8, 4),
    (256, 256, 5, 8), (256, 256, 6, 8), (256, 256, 8, 8), (256, 256, 16, 8))
#: backward: two rows (x and dy) in registers, so half the vectors per thread; no clusters
BWD_LADDER = ((128, 4, 1, 1), (128, 32, 1, 1), (128, 32, 2, 1), (128, 64, 2, 1),
              (128, 128, 2, 1), (256, 256, 2, 1), (512, 512, 2, 1), (1024, 1024, 2, 1))
#: 16-bit norm backwards: one vector a thread (8 columns) up to 512 slots (4,096 elements). Two
#: 16-bit vectors make 16 columns a thread whose weight- and bias-gradient sums spill under the
#: 64-register cap (scripts/ptxas_report.py); one vector does not.
_NV1_BWD = ((128, 4, 1, 1), (128, 32, 1, 1), (128, 64, 1, 1), (128, 128, 1, 1),
            (256, 256, 1, 1), (512, 512, 1, 1))
#: layer_norm_backward keeps one vector up to 1,024 slots (8,192 elements); longer rows two
LN16_BWD_LADDER = _NV1_BWD + ((1024, 1024, 1, 1), (1024, 1024, 2, 1))
#: rms_norm_backward (one gradient sum a column): at 8,192 two vectors on 512 threads measured
#: faster than one on 1,024 (H200: bf16 8192x8192 142 against 180 us, docs/perf.md)
RMS16_BWD_LADDER = _NV1_BWD + ((512, 512, 2, 1), (1024, 1024, 2, 1))
#: 16-bit softmax_backward and log_softmax_backward: beyond the rows their pipelined grid
#: holds at once (:func:`pipe_plan`), one block a row group with both rows staged in shared
#: memory (row_sbwd_kernel, 29-32 registers, 2,048 threads an SM) instead of the persistent
#: pipeline that holds them in registers (56, 1,024 threads): 1.01-1.11x at 4096 x 4096 to
#: 65536 x 4096, 32768 x 1024, 8192^2 and 4096 x 16384, the same at 1,024 rows of 4,096, and
#: 0.95-0.97x at 128 and 256 rows, which keep the pipeline (H100, docs/tuning.md). Rows of
#: 1,025-2,048 elements on 256 threads of one vector: 1.06x two vectors on 128.
#: log_softmax_backward stages only dy and reads y after the reduction: 1.00-1.05x more.
SBWD16_OPS = (10, 11)
#: float64 softmax_backward and log_softmax_backward: rows of 2,049-4,096 elements on 512
#: threads of four vectors (64 registers, no spill, two blocks an SM) instead of 1,024 of two
#: (one block an SM): the same resident threads, 256 rows of 4,096 in one wave of 132 SMs x 2
#: blocks instead of two, four loads of each row in flight a thread. H100 A/B: 1.10-1.51x up
#: to 1,024 rows of 4,096 and at 2,049 and 3,000 columns, 0.98-1.05x from 4,096 rows
#: (docs/tuning.md "float64 softmax backwards on 512 threads of four vectors").
F64_SBWD_LADDER = BWD_LADDER[:-1] + ((512, 512, 4, 1),)
SBWD16_LADDER = ((128, 4, 1, 1), (128, 32, 1, 1), (128, 32, 2, 1), (128, 64, 2, 1),
                 (256, 256, 1, 1), (256, 256, 2, 1), (512, 512, 2, 1), (1024, 1024, 2, 1))
GENERIC_THREADS = 512  # GT in cupylab_rowgeneric.cuh
COL_SUM_W = 32  # CS_W in cupylab_colsum.cuh: col_sum blocks of CS_W x CS_W threads, CS_W columns each
#: ops that use the persistent cp.async pipeline (row_pipe_kernel) for the non-cluster
#: classes, in 16-bit dtypes only: PIPE_STAGES rows of each input per block in shared memory.
#: (The float32 backwards measured 0.85-1.04x of the plain kernel on it, H200.)
#: float64 rows take none: the plain register kernels measured 1.03-1.21x the pipeline
#: from 1,024 rows of 4,096 and at 65536 x 1024 (log_softmax 4096 x 4096 114 -> 94 us, 78 ->
#: 94 % of the copy ceiling), ties at 256 rows, and for rms_norm 1.05-1.07x from 4,096 rows
#: but 0.97-0.98x at 256 and 1,024 (H100, docs/tuning.md "float64 rows without the pipeline").
#: float32 rows likewise: 1.06-1.18x from 4,096 rows of 4,096 and at 65536 x 1024 for all
#: five ops (the softmaxes and norms at 92-97 % of the copy ceiling; softmax 65536 x 1024
#: 200.7 -> 183.6 us, 0.92 -> 1.00x torch), 1.03-1.07x at 256 rows, 1.00-1.05x at 1,024 rows
#: but rms_norm there 0.955x (14.0 -> 14.7 us; the pipeline's rms_norm edge is 512-1,024 rows
#: of 4,096 only, it loses at 1024 x 2048 and 2048 x 2048), H100, docs/tuning.md "float32
#: rows without the pipeline".
PIPE_OPS = (0, 1, 2, 3, 4, 5, 10, 11, 12, 13)
#: 16-bit add_rms_norm (in PIPE_OPS) takes the pipelined kernel only while each SM gets at most one
#: block's rows: there it was 1.06-1.13x the plain kernel at 16 rows of 4,096 and 1.47-1.52x
#: at 128, and beyond 0.94-1.03x (2,048 and 8,192 rows of 4,096, 8192^2, 32768 x 1024,
#: 65536 x 256; H100, docs/tuning.md "Rows that fit one block, few of them")
PIPE16_FEW_OPS = (4,)
#: 16-bit layer_norm on classes of up to 128 threads (rows up to 4,096 elements) takes the
#: plain kernel beyond LN16_PIPE_UNITS row groups an SM. H100 A/B against the pipeline:
#: 1.06-1.09x at 4096 x 4096, 1.03-1.05x at 2048 x 2048, 1.01-1.06x at 768 and 1,024 rows of
#: 4,096, 0.99-1.04x at 16384 x 4096 and 32768 x 1024; the pipeline stays faster at 256 rows
#: of 4,096 (0.91-0.93x on the plain kernel) and at 8192 x 8192, a 256-thread class
#: (0.90-0.94x) (docs/tuning.md "16-bit layer_norm beyond a few rows an SM").
LN16_PLAIN_OPS = (3,)
LN16_PIPE_UNITS = 4
#: The forward softmaxes and norms at decoding shapes (row_few_kernel, :func:`few_class`): while
#: every row gets a block of its own and each SM one block at most, rows of 129 to 1,024
#: 16-byte slots (16-bit: 1,025 to 8,192 elements; float32 513 to 4,096) on the first class
#: of :data:`FEW_LADDER` that holds them (one row a block, two vectors a thread): the row
#: loaded straight into registers, the norms' weights beside it, one barrier a reduction.
#: Against the pipelined and plain kernels (H100, two rounds, 16 to 132 rows of 2,048 to
#: 8,192; docs/tuning.md "One row a block at decoding shapes"): layer_norm 1.06-1.28x
#: (bfloat16) and 1.00-1.10x (float32), rms_norm with a weight 1.02-1.13x (one 0.97x) and
#: 1.20-1.38x, layer_norm with weight and bias 1.10-1.38x and 1.23-1.52x: those take it at
#: every row count (:data:`FEW_WEIGHTED_OPS`). The softmaxes and the weightless rms_norm and
#: add_rms_norm gained 1.00-1.12x on 16-bit rows while the grid filled at most half the SMs
#: on classes of up to 256 threads (rows up to 4,096 elements), and lost 0.88-0.99x beyond
#: (128 and 132 rows, 8,192 elements) and on float32 rows: they take it there only
#: (add_rms_norm with a weight too: it was not measured apart). Rows that fill their class
#: exactly (:func:`few_full`) take its exact-fit form, for every op that has it, at every row
#: count up to the SMs: against the kernels they took before (H100, 16 to 132 rows of 2,048
#: to 8,192; docs/tuning.md "What the decoding kernel spends beyond a minimal one"), 16-bit
#: softmax 1.05-1.25x, log_softmax 1.08-1.31x, rms_norm 1.06-1.25x, add_rms_norm 1.07-1.39x,
#: float32 rms_norm without a weight 1.05-1.12x.
FEW_OPS = (0, 1, 2, 3, 4)
FEW_WEIGHTED_OPS = (2, 3)  # with a weight (layer_norm with or without): every row count
FEW_LADDER = ((128, 128, 2, 1), (256, 256, 2, 1), (512, 512, 2, 1))
FEW_MIN_SLOTS = 129
TWO_IN = (4, 10, 11, 12, 13)  # ops with two row operands (TWO_IN in rowwise.cu)
PIPE_STAGES = 3  # PIPE_STAGES in cupylab_rowwise.cuh
GROUPS = {"softmax": (0, 1), "norm": (2, 3, 4), "ce": (5,), "softmax_bwd": (10, 11),
          "norm_bwd": (12, 13)}
ARGS_FMT = "13Q5q12q2d"  # struct RowArgs
FLAG_TARGET_I32, FLAG_MEAN = 1, 2  # and FLAG_W_F32 (4, ._rowargs)
_INT32_MAX = 2**31 - 1


def ladder(op, dt):
    if smem_rows(op, dt):
        return SMEM_LADDER
    if dt.itemsize == 2 and op in SBWD16_OPS:
        return SBWD16_LADDER
    if dt.itemsize == 8 and op in SBWD16_OPS:
        return F64_SBWD_LADDER
    if dt.itemsize == 2 and op == 12:
        return RMS16_BWD_LADDER
    if dt.itemsize == 2 and op == 13:
        return LN16_BWD_LADDER
    return BWD_LADDER if op >= 10 else FWD_LADDER


def sbwd(op, dt, cls):
    """Whether class ``cls`` of ``op`` on ``dt`` has row_sbwd_kernel (16-bit
    softmax_backward and log_softmax_backward: both rows staged in shared memory,
    :data:`SBWD16_LADDER`) instead of the plain register kernel."""
    return op in SBWD16_OPS and dt.itemsize == 2 and cls is not None


def piped(op, dt):
    """Whether ``op`` on ``dt`` has the persistent pipelined kernels (row_pipe_kernel)."""
    # float32 and float64: the plain register kernels (see PIPE_OPS)
    return dt.itemsize == 2 and op in PIPE_OPS


def pipelined(op, dt, cls):
    """Whether class ``cls`` of ``op`` on ``dt`` has a persistent pipelined kernel: every
    one-block class of a :func:`piped` op (row_pipe_kernel). No cluster class has one: a
    persistent cluster pipeline measured slower than the plain cluster kernel on the 4- and
    8-block classes of every op (H100, 2026-12-05: bf16 1024x65536 and 8192x128256
    0.79-0.97x, float32 1024x65536 0.72-0.79x), and the two-block class it won on (16-bit,
    up to 65,536 elements) gave way to shared-memory rows (:data:`SMEM_LADDER`;
    docs/tuning.md, "Long rows")."""
    return cls[3] == 1 and piped(op, dt)


def smem_rows(op, dt):
    """Whether the cluster classes of ``op`` on ``dt`` hold their row in shared memory
    (row_smem_kernel, :data:`SMEM_LADDER`; :func:`row_smem_bytes`)."""
    return dt.itemsize in (2, 4) and op in SMEM_OPS


def row_smem_bytes(op, dt, cls):
    """The dynamic shared memory of a block of class ``cls`` that holds its segment of the row
    (``THREADS * NV`` 16-byte slots; twice that for :func:`sbwd`, which stages two rows), 0 for
    a class that keeps it in registers."""
    if sbwd(op, dt, cls):
        return 2 * cls[0] * cls[2] * 16
    return cls[0] * cls[2] * 16 if cls[3] > 1 and smem_rows(op, dt) else 0


def group_of(op):
    for g, ops in GROUPS.items():
        if op in ops:
            return g
    raise KeyError(op)


def acc_dtype(dt):
    """dtype of the statistics, losses and partial sums: float64 for float64, else float32."""
    return F64 if dt.name == "float64" else F32


def few_dtype(op, dt):
    """Whether ``op`` on ``dt`` has the decoding-shape kernels (row_few_kernel): every
    :data:`FEW_OPS` op on 16-bit rows, the :data:`FEW_WEIGHTED_OPS` on float32 rows."""
    return op in (FEW_OPS if dt.itemsize == 2 else FEW_WEIGHTED_OPS if dt.itemsize == 4 else ())


def few_class(op, dt, lay, sm_count, weighted=False):
    """The :data:`FEW_LADDER` class for ``lay`` when row_few_kernel applies, else None:
    ``rows <= sm_count``, rows of 129 to 1,024 16-byte slots, and either layer_norm, or
    rms_norm given a weight (``weighted``), or a 16-bit row on a grid of at most half the SMs
    and a class of at most 256 threads, or a row that fills its class exactly
    (:func:`few_full`: 16-bit rows of any op that has the kernel, float32 rms_norm); see
    :data:`FEW_OPS`. The ``CUPYLAB_ROWWISE_FEW=0`` switch turns it off."""
    if not few_dtype(op, dt) or not lay.vec_ok or lay.rows > sm_count:
        return None
    if os.environ.get("CUPYLAB_ROWWISE_FEW", "1") == "0":
        return None
    need = row_slots(dt, lay.cols, lay.head)
    if need < FEW_MIN_SLOTS:
        return None
    cls = next((c for c in FEW_LADDER if c[0] * c[2] >= need), None)
    if cls is None:
        return None
    if op in FEW_WEIGHTED_OPS and (weighted or op == 3):
        return cls
    if dt.itemsize == 2 and 2 * lay.rows <= sm_count and cls[0] <= 256:
        return cls
    if few_full(dt, lay, cls):  # (float32 here: rms_norm without a weight, see few_dtype)
        return cls  # the exact-fit form: every op that has it, at every row count up to the SMs
    return None


def few_full(dt, lay, cls):
    """Whether the decoding-shape kernel of class ``cls`` (:func:`few_class`) takes its
    exact-fit form for ``lay``: every row operand's rows start on a 16-byte boundary (head 0),
    the rows index with one stride (``n1 >= rows``: no two-level addressing) and a row is
    exactly the class's ``THREADS * NV`` 16-byte slots (16-bit: 2,048, 4,096 or 8,192
    elements; float32 half that). The kernel then knows the row's length, head and bounds at
    compile time and tests none of them (a weight's own alignment is still tested). Against
    the general form, three rounds at 1 to 132 rows of 2,048 to 8,192 (H100): 1.04-1.48x,
    1.01-1.32x and 1.05-1.42x where taken (docs/tuning.md, "What the decoding kernel spends
    beyond a minimal one")."""
    return (lay.head == 0 and lay.n1 >= lay.rows
            and lay.cols == cls[0] * cls[2] * (16 // dt.itemsize))


def kernel_name(op, dt, cls, pipe=False, wst=False, few=False, full=False):
    """The name expression of ``op``'s kernel for class ``cls`` (None: row_generic);
    ``pipe``: the pipelined kernel, ``wst``: its variant with staged weights (forward
    norms), ``few``: the decoding-shape kernel (a :data:`FEW_LADDER` class), ``full``: its
    exact-fit form (:func:`few_full`)."""
    if cls is None:
        return f"cl::row_generic<{dt.ctype}, {op}>"
    th, tpr, nv, c = cls
    if few:
        if not few_dtype(op, dt) or cls not in FEW_LADDER:
            raise ValueError(f"kernel_name: op {op} on {dt.name} has no decoding-shape kernel "
                             f"of class {cls} (see few_dtype, FEW_LADDER)")
        return f"cl::row_few_kernel<{dt.ctype}, {op}, {th}, {nv}, {'true' if full else 'false'}>"
    if pipe:
        if not pipelined(op, dt, cls):
            raise ValueError(f"kernel_name: op {op} on {dt.name} has no pipelined kernel for "
                             f"class {cls} (see pipelined)")
        if wst:
            if op not in NORM_FWD_OPS:
                raise ValueError(f"kernel_name: op {op} stages no weights (see NORM_FWD_OPS)")
            return f"cl::row_pipe_kernel<{dt.ctype}, {op}, {th}, {tpr}, {nv}, true>"
        return f"cl::row_pipe_kernel<{dt.ctype}, {op}, {th}, {tpr}, {nv}>"
    if sbwd(op, dt, cls):
        return f"cl::row_sbwd_kernel<{dt.ctype}, {op}, {th}, {tpr}, {nv}>"
    if row_smem_bytes(op, dt, cls):
        return f"cl::row_smem_kernel<{dt.ctype}, {op}, {th}, {nv}, {c}>"
    if c > 1:
        return f"cl::row_cluster_kernel<{dt.ctype}, {op}, {th}, {nv}, {c}>"
    return f"cl::row_kernel<{dt.ctype}, {op}, {th}, {tpr}, {nv}>"


def name_expressions(group, dt):
    names = []
    for op in GROUPS[group]:
        names += [kernel_name(op, dt, cls) for cls in ladder(op, dt)] + [kernel_name(op, dt, None)]
        names += [kernel_name(op, dt, cls, True, w) for cls in ladder(op, dt)
                  if pipelined(op, dt, cls) for w in (False, True)[:1 + (op in NORM_FWD_OPS)]]
        if few_dtype(op, dt):
            names += [kernel_name(op, dt, cls, few=True, full=f) for cls in FEW_LADDER
                      for f in (False, True)]
    a = acc_dtype(dt)
    if group == "ce":
        names += [f"cl::ce_aux<{a.ctype}>", f"cl::ce_backward<{dt.ctype}>"]
    if group == "norm_bwd":
        for w in {dt.name: dt, **({"float32": F32} if dt.itemsize == 2 else {})}.values():
            names.append(f"cl::col_sum<{a.ctype}, {w.ctype}>")
    return names


_programs: dict = {}
_kernels: dict = {}


def program(group, dt) -> _compile.Program:
    key = (group, dt.name)
    p = _programs.get(key)
    if p is None:
        p = _programs.setdefault(key, _compile.Program.from_file(
            _compile.cuda_src_dir() / "rowwise.cu", name_expressions(group, dt)))
    return p


def all_programs():
    """Every program this family can launch (CI compiles them for sm_75, sm_80 and sm_90)."""
    return [program(g, dt) for g in GROUPS for dt in FLOATS]


def kernel(group, dt, name, fmts=(ARGS_FMT,)):
    key = (group, dt.name, name)
    k = _kernels.get(key)
    if k is None:
        k = _kernels.setdefault(key, _launch.Kernel(program(group, dt), name, list(fmts)))
    return k


# --------------------------------------------------------------------------------------------
# kernel choice (pure: tested on the CPU)
def row_slots(dt, cols, head):
    """The 16-byte slots a row of ``cols`` elements of ``dt`` spans from its aligned base:
    with ``head`` elements before its first 16-byte boundary, or room for the worst case
    when ``head`` is None (rows whose heads differ)."""
    v = 16 // dt.itemsize
    return -(-(cols + (v - 1 if head is None else head)) // v)


def choose(op, dt, cols, vec_ok, head, cc):
    """The register class for a row of ``cols`` elements, or ``None`` for the generic kernel.

    ``head``: the elements before the first 16-byte boundary when it is the same in every
    row, else ``None`` (then room for the worst case is kept). ``vec_ok``: the last axis is
    contiguous and all row operands share their offset modulo 16 bytes in every row."""
    if not vec_ok or cols > _INT32_MAX // 2:
        return None
    if op in BWD_W and head is None:
        return None  # the per-column weight-gradient sums need a fixed column per register
    need = row_slots(dt, cols, head)
    for cls in ladder(op, dt):
        th, tpr, nv, c = cls
        if c > 1 and cc < 90:
            continue
        if cc < 80 and row_smem_bytes(op, dt, cls) > 48 * 1024:
            continue  # sm_75 opts in to 64 KiB a block, static shared memory included
        if tpr * nv * c >= need:
            return cls
    return None


def grid_for(op, cls, rows, sm_count):
    """``(grid, parts)``: blocks to launch and, for the weight-gradient ops, the rows of
    partial sums they write."""
    if cls is None:
        if op in BWD_W:
            g = max(1, min(rows, sm_count * 4))
            return g, g
        return max(1, min(rows, _INT32_MAX)), 0
    th, tpr, nv, c = cls
    rpb = th // tpr
    units = -(-rows // rpb)
    if op in BWD_W:
        g = max(1, min(units, sm_count * max(1, 1024 // th)))
        return g, g * rpb
    return max(1, min(units, _INT32_MAX // c)) * c, 0


class Layout:
    """Rows x columns of a set of operands: ``rows``, ``cols``, ``n1`` (inner leading extent),
    per operand slot (in0, in1, out0, out1) the outer/inner row strides and column stride,
    ``vec_ok`` and ``head`` (see :func:`choose`)."""

    __slots__ = ("rows", "cols", "n1", "so", "si", "cs", "vec_ok", "head", "lead_shape")


_layouts: dict = {}
_LAYOUT_CACHE_MAX = 512


def row_layout(opname, shape, slots, axis, extra=()):
    """:func:`make_layout`, memoised on everything the layout depends on (shape, axis, each
    operand's strides and address modulo 16): repeated calls on same-shaped arrays skip the
    dimension merging."""
    key = (opname, shape, axis, tuple((v.strides, v.ptr % 16, v.dtype.itemsize) if v is not None
                                      else None for v in slots),
           tuple(v.strides for v in extra))
    lay = _layouts.get(key)
    if lay is None:
        lay = make_layout(opname, shape, slots, axis, extra)
        if len(_layouts) >= _LAYOUT_CACHE_MAX:
            _layouts.clear()
        _layouts[key] = lay
    return lay


def merge_rows(opname, lead, lead_strides):
    """The leading dimensions ``lead`` of a set of operands (``lead_strides``: each one's
    strides over them) merged into at most two strided levels: ``(n1, strides)``, ``n1`` the
    inner level's extent (1 without leading dimensions) and per operand its merged strides
    (0, 1 or 2 of them, outer first). ValueError when they do not merge into two."""
    sh, sts = coalesce(lead, lead_strides) if lead else ((), [() for _ in lead_strides])
    if len(sh) > 2:
        raise ValueError(
            f"{opname}: the leading dimensions {lead} cannot be merged into two strided levels "
            "for these arrays; make them contiguous first")
    return (sh[-1] if sh else 1), sts


def split_row_strides(st):
    """``(outer, inner)`` row strides from an operand's merged strides (:func:`merge_rows`)."""
    if len(st) == 2:
        return st[0], st[1]
    return (0, st[0]) if st else (0, 0)


def make_layout(opname, shape, slots, axis, extra=()):
    """Layout of ``slots`` (4 Views or None, all of ``shape``) reduced along ``axis``;
    ``extra``: up to two Views of the leading shape only (the target, then cross-entropy
    backward's per-row loss gradient) sharing the row indexing, put in slots 1 and 3 (their
    column strides stay 0). Raises ValueError when the leading dims cannot be merged into
    two."""
    nd = len(shape)
    ax = axis % nd
    lead = tuple(e for i, e in enumerate(shape) if i != ax)
    cols = shape[ax]
    ops = [(i, v) for i, v in enumerate(slots) if v is not None]
    lead_strides = [tuple(s for j, s in enumerate(v.strides) if j != ax) for _, v in ops]
    lead_strides += [tuple(v.strides) for v in extra]
    n1, sts = merge_rows(opname, lead, lead_strides)
    lay = Layout()
    rows = 1
    for e in lead:
        rows *= e
    lay.rows, lay.cols, lay.lead_shape = rows, cols, lead
    lay.n1 = n1
    so, si, cs = [0] * 4, [0] * 4, [0] * 4
    for (i, v), st in zip(ops, sts):
        so[i], si[i] = split_row_strides(st)
        cs[i] = v.strides[ax] if cols > 1 else 1
    for i, st in zip((1, 3), sts[len(ops):]):
        so[i], si[i] = split_row_strides(st)
    lay.so, lay.si, lay.cs = so, si, cs
    isz = slots[0].dtype.itemsize
    vec = all(cs[i] == 1 for i, _ in ops)
    mods = {(v.ptr % 16, (so[i] * isz) % 16, (si[i] * isz) % 16) for i, v in ops}
    lay.vec_ok = vec and len(mods) == 1
    lay.head = None
    if lay.vec_ok:
        p, a, b = mods.pop()
        lay.head = p // isz if (a == 0 and b == 0) else None
    return lay


#: the address fields of RowArgs, first in the struct, in order
PTR_ORDER = ("out0", "out1", "in0", "in1", "w", "b", "st0", "st1", "part0", "part1", "target",
             "loss", "scale")


def pack(ptrs, lay, rows_override=None, ignore_index=0, flags=0, eps=0.0, smooth=0.0):
    """The RowArgs values: ``ptrs`` maps the names of :data:`PTR_ORDER` to addresses
    (missing: 0), then the layout's fields (:func:`pack_tail`), then ``eps`` and ``smooth``."""
    vals = [int(ptrs.get(k, 0) or 0) for k in PTR_ORDER]
    rows = lay.rows if rows_override is None else rows_override
    vals += [rows, lay.cols, max(1, lay.n1), int(ignore_index), int(flags)]
    vals += list(lay.so) + list(lay.si) + list(lay.cs)
    vals += [float(eps), float(smooth)]
    return tuple(vals)


def pack_tail(lay, flags=0):
    """The RowArgs values between the addresses and ``eps``/``smooth`` (rows, cols, n1,
    ignore_index 0, ``flags``, the strides): fixed for a layout, so the lean path
    (:mod:`cupylab.ops._rowfast`) packs them once per plan."""
    return pack({}, lay, flags=flags)[len(PTR_ORDER):-2]


#: bytes of struct RowArgs (32 fields of 8 bytes; pinned by a CPU test)
ARGS_SIZE = struct.calcsize("@" + ARGS_FMT)


#: the forward norms (rms_norm, layer_norm, add_rms_norm): their pipelined kernel has a variant
#: that stages the weight (and bias) in shared memory (:func:`stages_weights`)
NORM_FWD_OPS = (2, 3, 4)


def wstage_bytes(op, cols, wsize, narrays):
    """Dynamic shared memory for the ``narrays`` weight / bias arrays (``wsize`` bytes an
    element) that the pipelined kernel of a forward norm stages (each rounded up to 32
    bytes, as wstage_bytes in cupylab_rowwise.cuh); 0 for other ops."""
    if op not in NORM_FWD_OPS or not narrays:
        return 0
    return narrays * (-(-cols * wsize // 32) * 32)


def staged_weight_bytes(op, cols, weight, bias):
    """:func:`wstage_bytes` of a call's ``weight`` and ``bias`` (Views of one dtype, or None):
    what the general and the lean path pass to :func:`plan_rows`."""
    arrays = [a for a in (weight, bias) if a is not None]
    return wstage_bytes(op, cols, arrays[0].dtype.itemsize, len(arrays)) if arrays else 0


def stages_weights(op, cls, rows, sm_count, smem, wbytes, smem_optin):
    """Whether the pipelined kernel of a forward norm (``smem`` bytes of stages) takes the
    variant that stages the weights (``wbytes``, :func:`wstage_bytes`) in shared memory: at
    decoding shapes, while each SM gets at most one block's rows, where the weights' loads
    overlap the row's. Measured against the same tree with this returning False (H100,
    bfloat16, 16 to 128 rows of 2,048 to 8,192): 1.06-1.09x for rms_norm with a weight,
    1.11-1.27x for layer_norm with weight and bias; 1.00x at 1,024 x 4,096, where it stages
    nothing (docs/tuning.md, "Weights staged at decoding shapes")."""
    return (bool(wbytes) and op in NORM_FWD_OPS and smem + wbytes <= smem_optin
            and -(-rows // (cls[0] // cls[1])) <= sm_count)


def pipe_plan(op, dt, cls, rows, sm_count, smem_optin, cc):
    """``(grid, dynamic shared memory)`` of the persistent pipelined kernel for ``cls``, or
    None when it does not apply (other ops, compute capability below 8.0 (no ``cp.async``),
    too little shared memory, the ``CUPYLAB_ROWWISE_PIPELINE=0`` switch, classes without one:
    :func:`pipelined`; :data:`PIPE16_FEW_OPS` beyond one block's rows an SM;
    :data:`SBWD16_OPS` beyond the rows the grid holds at once; :data:`LN16_PLAIN_OPS` on
    classes of up to 128 threads beyond :data:`LN16_PIPE_UNITS` row groups an SM). Persistent
    grids never exceed what is resident at once (an SM's shared memory is the per-block
    opt-in maximum plus the 1 KiB the driver reserves: 228 KiB on sm_90, 164 KiB on sm_80)."""
    if cls is None or cc < 80 or not pipelined(op, dt, cls):
        return None
    if os.environ.get("CUPYLAB_ROWWISE_PIPELINE", "1") == "0":
        return None
    th, tpr, nv, _ = cls
    smem = PIPE_STAGES * (2 if op in TWO_IN else 1) * nv * th * 16
    if smem > smem_optin:
        return None
    per_sm = max(1, min(2048 // th, 65536 // (64 * th), (smem_optin + 1024) // (smem + 1024)))
    units = -(-rows // (th // tpr))
    if op in PIPE16_FEW_OPS and units > sm_count:
        return None
    if op in SBWD16_OPS and units > sm_count * per_sm:
        return None  # every row at once only: beyond, row_sbwd_kernel (SBWD16_LADDER)
    if op in LN16_PLAIN_OPS and th <= 128 and units > sm_count * LN16_PIPE_UNITS:
        return None
    return max(1, min(units, sm_count * per_sm)), smem


_smem_set: dict = {}
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _opt_in(k, device, smem):
    key = (id(k), device)
    if _smem_set.get(key, 0) >= smem:
        return
    from cupy_backends.cuda.api import driver  # noqa: PLC0415 - CuPy is loaded by now

    driver.funcSetAttribute(k.function(device), _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            smem)
    _smem_set[key] = smem


def plan_rows(op, dt, lay, device, wbytes=0):
    """The launch for ``lay`` on ``device``: ``(kernel, grid, block, dynamic shared memory,
    partial rows)``, the kernel chosen by row length (:func:`choose`), the persistent pipeline
    where it applies (:func:`pipe_plan`, shared memory opted in), else :func:`grid_for`, with
    the dynamic shared memory of a cluster row held there (:func:`row_smem_bytes`).
    ``wbytes``: the forward norms' weights to stage (:func:`wstage_bytes`)."""
    info = _runtime.device_info(device)
    few = few_class(op, dt, lay, info.sm_count, bool(wbytes))
    if few is not None:
        name = kernel_name(op, dt, few, few=True, full=few_full(dt, lay, few))
        return kernel(group_of(op), dt, name), max(1, lay.rows), few[0], 0, 0
    cls = choose(op, dt, lay.cols, lay.vec_ok, lay.head, info.cc)
    block = GENERIC_THREADS if cls is None else cls[0]
    pp = pipe_plan(op, dt, cls, lay.rows, info.sm_count, info.max_smem_optin, info.cc)
    if pp is not None:
        grid, smem = pp
        wst = stages_weights(op, cls, lay.rows, info.sm_count, smem, wbytes, info.max_smem_optin)
        if wst:
            smem += wbytes
        k = kernel(group_of(op), dt, kernel_name(op, dt, cls, True, wst))
        _opt_in(k, device, smem)  # beyond the 48 KiB default with the static reduce arrays
        return k, grid, block, smem, grid * (cls[0] // cls[1]) if op in BWD_W else 0
    grid, nparts = grid_for(op, cls, lay.rows, info.sm_count)
    k = kernel(group_of(op), dt, kernel_name(op, dt, cls))
    smem = 0 if cls is None else row_smem_bytes(op, dt, cls)
    if smem:
        _opt_in(k, device, smem)
    return k, grid, block, smem, nparts


def launch_rows(c, op, dt, lay, args_fn, parts_cb=None, wbytes=0):
    """Choose the kernel for ``lay`` (:func:`plan_rows`; ``wbytes``: the forward norms'
    weights to stage) and launch it on ``c.stream``. ``args_fn(parts_ptrs)`` returns the
    packed arguments given the partial-sum buffers (``parts_cb(nparts)`` makes them for the
    weight-gradient ops). Returns the partial rows."""
    k, grid, block, smem, nparts = plan_rows(op, dt, lay, c.device, wbytes)
    parts = parts_cb(nparts) if (parts_cb is not None and nparts) else {}
    k.launch(c.device, grid, block, c.stream, args_fn(parts), shared_mem=smem)
    return nparts


#: the argument formats of ``cl::col_sum`` (cupylab_colsum.cuh): part, part1, nparts, cols,
#: out, out1
COL_SUM_FMTS = ("Q", "Q", "q", "q", "Q", "Q")


def col_sum_kernel(dt, wdt):
    """The weight-gradient column sum for x of dtype ``dt`` and weights of ``wdt``."""
    a = acc_dtype(dt)
    return kernel("norm_bwd", dt, f"cl::col_sum<{a.ctype}, {wdt.ctype}>", COL_SUM_FMTS)


def launch_col_sum(k, device, stream, part, nparts, cols, out, part1=0, out1=0):
    """``out[c] = sum of the nparts rows of part[:, c]`` (deterministic) with ``k`` from
    :func:`col_sum_kernel`: blocks of COL_SUM_W x min(COL_SUM_W, nparts) threads, COL_SUM_W
    columns each; with ``out1`` the same of ``part1`` into ``out1`` in the same launch (a
    second row of blocks)."""
    k.launch(device, max(1, -(-cols // COL_SUM_W)), COL_SUM_W * min(COL_SUM_W, max(1, nparts)),
             stream, (part, part1, nparts, cols, out, out1), grid_yz=(2 if out1 else 1, 1))


def contiguous_1d(v):
    return all(s == st or e == 1 for e, s, st in zip(v.shape, v.strides, c_strides(v.shape)))
