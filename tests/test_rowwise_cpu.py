"""Row-wise operators without a GPU: kernel choice per row length, row layouts, argument
errors, the RowArgs layout, the float64 references, and NVRTC compilation of every template
for sm_75, sm_80 and sm_90."""
import numpy as np
import pytest

import cupylab
from cupylab import _dtypes
from cupylab import reference as R
from cupylab.ops import _rowcore as rc

from conftest import FakeCAI, compile_every

BF16, F16, F32, F64 = (_dtypes.from_name(n) for n in ("bfloat16", "float16", "float32", "float64"))
#: the family's kernel instances: 744, and row_few_kernel's (3 classes of 5 ops on the two
#: 16-bit dtypes and of 2 ops on float32, each in its general and its exact-fit form)
N_INSTANCES = 744 + 3 * (5 * 2 + 2) * 2


def test_public_names_exported():
    for n in ("softmax", "log_softmax", "layer_norm", "rms_norm", "add_rms_norm",
              "cross_entropy", "softmax_backward", "log_softmax_backward",
              "layer_norm_backward", "rms_norm_backward"):
        assert n in cupylab.__all__ and callable(getattr(cupylab, n))
        assert getattr(cupylab, n).__doc__ and "Raises" in getattr(cupylab, n).__doc__


def test_args_struct_size():
    assert rc.ARGS_SIZE == 32 * 8  # struct RowArgs in rowwise.cu: 32 fields of 8 bytes


@pytest.mark.parametrize("cols,head,cc,expect", [
    (1, 0, 90, (128, 4, 1, 1)), (32, 0, 90, (128, 4, 1, 1)), (33, 0, 90, (128, 32, 1, 1)),
    (1000, 0, 90, (128, 32, 4, 1)), (1024, 0, 90, (128, 32, 4, 1)),
    (1025, 0, 90, (128, 64, 4, 1)), (2048, 0, 90, (128, 64, 4, 1)),
    (2049, 0, 90, (128, 128, 4, 1)), (8192, 0, 90, (256, 256, 4, 1)),
    (16384, 0, 90, (512, 512, 4, 1)), (16385, 0, 90, (256, 256, 5, 2)),
    (20480, 0, 90, (256, 256, 5, 2)), (20481, 0, 90, (256, 256, 6, 2)),
    (24576, 0, 90, (256, 256, 6, 2)), (24577, 0, 90, (1024, 1024, 4, 1)),
    (20000, 0, 80, (1024, 1024, 4, 1)),  # before sm_90: no clusters, the one-block class
    (32768, 0, 90, (1024, 1024, 4, 1)), (32769, 0, 90, (256, 256, 5, 4)),
    (40960, 0, 90, (256, 256, 5, 4)), (40961, 0, 90, (256, 256, 6, 4)),
    (49153, 0, 90, (256, 256, 8, 4)), (65536, 0, 90, (256, 256, 8, 4)),
    (65537, 0, 90, (256, 256, 5, 8)), (81921, 0, 90, (256, 256, 6, 8)),
    (98305, 0, 90, (256, 256, 8, 8)), (128256, 0, 90, (256, 256, 8, 8)),
    (131072, 0, 90, (256, 256, 8, 8)), (131073, 0, 90, (256, 256, 16, 8)),
    (262144, 0, 90, (256, 256, 16, 8)),
    (262144, 1, 90, None), (262144, None, 90, None), (65536, 0, 80, None),
    (1024, None, 90, (128, 64, 4, 1)),  # rows with varying heads need room for V - 1 more
])
def test_choose_forward_bf16(cols, head, cc, expect):
    assert rc.choose(0, BF16, cols, True, head, cc) == expect


def test_choose_shared_memory_cluster_rows():
    # 16-bit and float32 softmax, log_softmax, rms_norm, layer_norm and cross-entropy hold a
    # cluster row in shared memory (256-thread blocks); add_rms_norm and float64 rows keep the
    # register cluster classes
    for dts, cases in (((BF16, F16), ((20000, (256, 256, 5, 2)), (24000, (256, 256, 6, 2)),
                                      (32769, (256, 256, 5, 4)), (45000, (256, 256, 6, 4)),
                                      (65536, (256, 256, 8, 4)), (65537, (256, 256, 5, 8)),
                                      (90000, (256, 256, 6, 8)), (131072, (256, 256, 8, 8)),
                                      (262144, (256, 256, 16, 8)))),
                       ((F32,), ((10000, (256, 256, 5, 2)), (12000, (256, 256, 6, 2)),
                                 (16385, (256, 256, 5, 4)), (24000, (256, 256, 6, 4)),
                                 (32768, (256, 256, 8, 4)), (32769, (256, 256, 5, 8)),
                                 (45000, (256, 256, 6, 8)), (65536, (256, 256, 8, 8)),
                                 (65537, (256, 256, 16, 8)), (131072, (256, 256, 16, 8))))):
        for cols, cls in cases:
            for op in (0, 1, 2, 3, 5):
                for dt in dts:
                    assert rc.choose(op, dt, cols, True, 0, 90) == cls
                    assert rc.smem_rows(op, dt) and not rc.pipelined(op, dt, cls)
                    assert rc.kernel_name(op, dt, cls).startswith("cl::row_smem_kernel<")
                    assert rc.row_smem_bytes(op, dt, cls) == cls[0] * cls[2] * 16
    assert rc.choose(4, BF16, 65536, True, 0, 90) == (512, 512, 4, 4)
    assert rc.choose(4, F32, 32768, True, 0, 90) == (512, 512, 4, 4)
    assert rc.choose(0, F64, 16384, True, 0, 90) == (512, 512, 4, 4)
    # the two-block classes are for the ops that hold a cluster row in shared memory; the
    # others keep the one-block class there
    assert rc.choose(4, BF16, 20000, True, 0, 90) == (1024, 1024, 4, 1)
    assert rc.choose(0, F64, 5000, True, 0, 90) == (1024, 1024, 4, 1)
    assert not rc.smem_rows(4, BF16) and not rc.smem_rows(4, F32) and not rc.smem_rows(0, F64)
    assert rc.row_smem_bytes(0, F64, (512, 512, 4, 4)) == 0
    assert rc.row_smem_bytes(0, F32, (1024, 1024, 4, 1)) == 0  # one block: registers
    assert rc.kernel_name(0, F64, (512, 512, 4, 4)).startswith("cl::row_cluster_kernel<")
    names = rc.name_expressions("norm", BF16)
    assert "cl::row_smem_kernel<cl::bf16_t, 2, 256, 8, 4>" in names
    assert "cl::row_cluster_kernel<cl::bf16_t, 4, 512, 4, 4>" in names
    assert "cl::row_cluster_kernel<cl::bf16_t, 2, 512, 4, 4>" not in names
    assert not any("row_cluster_pipe_kernel" in n for p in rc.all_programs()
                   for n in p.name_expressions)


def test_choose_generic_cases():
    assert rc.choose(0, BF16, 100, False, 0, 90) is None  # strided last axis
    assert rc.choose(0, F32, 65536, True, 0, 90) == (256, 256, 8, 8)
    assert rc.choose(0, F32, 131072, True, 0, 90) == (256, 256, 16, 8)
    assert rc.choose(0, F32, 131073, True, 0, 90) is None
    assert rc.choose(0, F64, 65536, True, 0, 90) == (1024, 1024, 4, 8)
    # backward: no clusters; weight-gradient ops need fixed heads
    assert rc.choose(10, BF16, 16384, True, 0, 90) == (1024, 1024, 2, 1)
    assert rc.choose(10, BF16, 16385, True, 0, 90) is None
    assert rc.choose(12, BF16, 1000, True, None, 90) is None
    # two rows of 64 threads a block: a 16-bit row of 1,024 fills its slots (128 x 2 half-fills)
    assert rc.choose(10, BF16, 1000, True, 3, 90) == (128, 64, 2, 1)
    assert rc.choose(10, BF16, 1024, True, 0, 90) == (128, 64, 2, 1)
    assert rc.choose(10, F32, 1025, True, 0, 90) == (256, 256, 2, 1)
    assert rc.choose(10, BF16, 1025, True, 0, 90) == (256, 256, 1, 1)  # SBWD16_LADDER
    # the 16-bit norm backwards: one vector a thread (their gradient sums spill with two)
    assert rc.choose(12, BF16, 1000, True, 3, 90) == (128, 128, 1, 1)
    assert rc.choose(13, BF16, 8192, True, 0, 90) == (1024, 1024, 1, 1)
    assert rc.choose(13, BF16, 8193, True, 0, 90) == (1024, 1024, 2, 1)
    # rms_norm_backward: one vector up to 4,096, then two on 512 threads (measured faster)
    assert rc.choose(12, BF16, 4096, True, 0, 90) == (512, 512, 1, 1)
    assert rc.choose(12, BF16, 4097, True, 0, 90) == (512, 512, 2, 1)
    assert rc.choose(12, BF16, 8192, True, 0, 90) == (512, 512, 2, 1)
    assert rc.choose(13, F32, 1000, True, 0, 90) == (128, 128, 2, 1)
    assert rc.choose(0, F32, 1024, True, 0, 90) == (128, 64, 4, 1)
    assert rc.choose(0, F32, 1025, True, 0, 90) == (128, 128, 4, 1)


def test_grid_for():
    assert rc.grid_for(0, (128, 4, 1, 1), 199, 132) == (7, 0)  # 32 rows per block
    assert rc.grid_for(0, (1024, 1024, 4, 8), 3, 132) == (24, 0)  # one cluster per row
    assert rc.grid_for(5, (512, 512, 4, 4), 8192, 132) == (32768, 0)
    assert rc.grid_for(0, None, 5, 132) == (5, 0)
    g, parts = rc.grid_for(13, (128, 32, 2, 1), 100000, 132)
    assert g == 132 * 8 and parts == g * 4
    assert rc.grid_for(13, None, 3, 132) == (3, 3)
    g, parts = rc.grid_for(12, (128, 64, 2, 1), 32768, 132)
    assert g == 132 * 8 and parts == g * 2  # a partial row for each of a block's two groups


def test_float64_softmax_backwards_take_512_threads_of_four_vectors_to_4096_columns():
    for op in (10, 11):
        assert rc.ladder(op, F64) == rc.F64_SBWD_LADDER
        assert rc.choose(op, F64, 2048, True, 0, 90) == (512, 512, 2, 1)
        for cols in (2049, 3001, 4096):
            assert rc.choose(op, F64, cols, True, 0, 90) == (512, 512, 4, 1)
        assert rc.choose(op, F64, 4097, True, 0, 90) is None
        assert not rc.sbwd(op, F64, (512, 512, 4, 1))
    for op in (12, 13):  # the norm backwards keep 1,024 threads (four vectors would spill)
        assert rc.ladder(op, F64) == rc.BWD_LADDER
        assert rc.choose(op, F64, 4096, True, 0, 90) == (1024, 1024, 2, 1)


def test_softmax_backwards_16bit_stage_both_rows_in_shared_memory():
    for op in (10, 11):
        for dt in (BF16, F16):
            assert rc.ladder(op, dt) == rc.SBWD16_LADDER
            for cls in rc.SBWD16_LADDER:
                assert rc.sbwd(op, dt, cls) and rc.pipelined(op, dt, cls)
                assert rc.kernel_name(op, dt, cls).startswith("cl::row_sbwd_kernel<")
                assert rc.row_smem_bytes(op, dt, cls) == 2 * cls[0] * cls[2] * 16
            assert not rc.sbwd(op, dt, None)
        for dt in (F32, F64):  # the register kernels
            assert not rc.sbwd(op, dt, (256, 256, 2, 1))
            assert rc.kernel_name(op, dt, (256, 256, 2, 1)).startswith("cl::row_kernel<")
            assert rc.row_smem_bytes(op, dt, (256, 256, 2, 1)) == 0
    assert not rc.sbwd(12, BF16, (256, 256, 1, 1))
    # rows of 1,025-2,048 elements on 256 threads of one vector
    assert rc.choose(11, BF16, 2048, True, 0, 90) == (256, 256, 1, 1)
    assert rc.choose(11, BF16, 1024, True, 0, 90) == (128, 64, 2, 1)
    assert rc.choose(10, F16, 4096, True, 0, 90) == (256, 256, 2, 1)
    # below sm_80 a block opts in to 64 KiB at most, static shared memory included: the
    # 1,024-thread class (64 KiB of rows) is skipped, and those rows go to row_generic
    assert rc.choose(10, BF16, 16384, True, 0, 80) == (1024, 1024, 2, 1)
    assert rc.choose(10, BF16, 16384, True, 0, 75) is None
    assert rc.choose(10, BF16, 8192, True, 0, 75) == (512, 512, 2, 1)
    names = rc.name_expressions("softmax_bwd", BF16)
    assert "cl::row_sbwd_kernel<cl::bf16_t, 11, 256, 256, 1>" in names
    assert not any(n.startswith("cl::row_kernel<") for n in names)
    assert any(n.startswith("cl::row_kernel<") for n in rc.name_expressions("softmax_bwd", F32))


def test_16bit_layer_norm_leaves_the_pipeline_beyond_a_few_row_groups_an_sm():
    # 128-thread classes: the pipeline up to LN16_PIPE_UNITS row groups an SM, then plain
    units = 132 * rc.LN16_PIPE_UNITS
    for dt in (BF16, F16):
        assert rc.pipe_plan(3, dt, (128, 128, 4, 1), units, 132, 232448, 90) is not None
        assert rc.pipe_plan(3, dt, (128, 128, 4, 1), units + 1, 132, 232448, 90) is None
        assert rc.pipe_plan(3, dt, (128, 32, 4, 1), 4 * units, 132, 232448, 90) is not None
        assert rc.pipe_plan(3, dt, (128, 32, 4, 1), 4 * units + 1, 132, 232448, 90) is None
        # 256-thread classes and the other ops keep it
        assert rc.pipe_plan(3, dt, (256, 256, 4, 1), 8192, 132, 232448, 90) is not None
        for op in (0, 1, 2):
            assert rc.pipe_plan(op, dt, (128, 128, 4, 1), 8192, 132, 232448, 90) is not None


def test_the_norms_stage_their_weights_at_decoding_shapes():
    # bytes of the staged arrays: each rounded up to 32, forward norms only
    assert rc.wstage_bytes(2, 4096, 2, 1) == 8192
    assert rc.wstage_bytes(3, 1001, 2, 2) == 2 * 2016
    assert rc.wstage_bytes(3, 1001, 4, 1) == 4032
    assert rc.wstage_bytes(0, 4096, 2, 1) == 0 and rc.wstage_bytes(12, 4096, 2, 1) == 0
    assert rc.wstage_bytes(2, 4096, 2, 0) == 0
    # while each SM gets at most one block's rows, with room: a block a row of 4,096, four
    # rows of 1,024 a block
    assert rc.stages_weights(2, (128, 128, 4, 1), 132, 132, 24576, 8192, 232448)
    assert not rc.stages_weights(2, (128, 128, 4, 1), 133, 132, 24576, 8192, 232448)
    assert rc.stages_weights(3, (128, 32, 4, 1), 528, 132, 24576, 4096, 232448)
    assert not rc.stages_weights(3, (128, 32, 4, 1), 529, 132, 24576, 4096, 232448)
    assert not rc.stages_weights(4, (1024, 1024, 4, 1), 16, 132, 196608, 65536, 232448)
    assert not rc.stages_weights(2, (128, 128, 4, 1), 16, 132, 24576, 0, 232448)
    assert not rc.stages_weights(0, (128, 128, 4, 1), 16, 132, 24576, 8192, 232448)
    # the staged variants are compiled beside the others, for the forward norms only
    for dt in (BF16, F16):
        names = rc.name_expressions("norm", dt)
        pipes = [n for n in names if n.startswith("cl::row_pipe_kernel<")]
        staged = [n for n in pipes if n.endswith(", true>")]
        assert staged
        assert len(staged) == len(pipes) / 2
        assert not any(n.startswith("cl::row_pipe_kernel<") and n.endswith(", true>")
                       for n in rc.name_expressions("softmax", dt))
    with pytest.raises(ValueError, match="stages no weights"):
        rc.kernel_name(0, BF16, (128, 128, 4, 1), True, True)


def test_pipe_plan(monkeypatch):
    assert rc.pipe_plan(0, BF16, (256, 256, 4, 1), 8192, 132, 232448, 90) == (528, 49152)
    assert rc.pipe_plan(1, BF16, (128, 32, 4, 1), 32768, 132, 232448, 90) == (1056, 24576)
    assert rc.pipe_plan(3, F16, (1024, 1024, 4, 1), 100, 132, 232448, 90) == (100, 196608)
    assert rc.pipe_plan(3, F16, (1024, 1024, 4, 1), 1000, 132, 232448, 90) == (132, 196608)
    assert rc.pipe_plan(4, F32, (256, 256, 4, 1), 8192, 132, 232448, 90) is None  # add_rms_norm
    # ... whose 16-bit kernels are piped while each SM gets at most one block's rows
    assert rc.pipe_plan(4, F32, (128, 128, 4, 1), 16, 132, 232448, 90) is None
    assert rc.pipe_plan(4, BF16, (128, 128, 4, 1), 128, 132, 232448, 90) == (128, 49152)
    assert rc.pipe_plan(4, BF16, (128, 128, 4, 1), 132, 132, 232448, 90) == (132, 49152)
    assert rc.pipe_plan(4, BF16, (128, 128, 4, 1), 133, 132, 232448, 90) is None
    assert rc.pipe_plan(4, BF16, (128, 32, 4, 1), 528, 132, 232448, 90) == (132, 49152)
    assert rc.pipe_plan(4, BF16, (128, 32, 4, 1), 529, 132, 232448, 90) is None
    # the backwards stage both row operands: twice the shared memory of a one-input op
    assert rc.pipe_plan(12, BF16, (128, 64, 2, 1), 32768, 132, 232448, 90) == (1056, 24576)
    assert rc.pipe_plan(10, BF16, (1024, 1024, 2, 1), 50, 132, 232448, 90) == (50, 196608)
    # ... the 16-bit softmax backwards only while the grid holds every row at once (beyond:
    # row_sbwd_kernel); four 256-thread blocks an SM under their 48 KiB of stages
    assert rc.pipe_plan(10, BF16, (1024, 1024, 2, 1), 132, 132, 232448, 90) == (132, 196608)
    assert rc.pipe_plan(10, BF16, (1024, 1024, 2, 1), 133, 132, 232448, 90) is None
    assert rc.pipe_plan(11, F16, (256, 256, 2, 1), 528, 132, 232448, 90) == (528, 49152)
    assert rc.pipe_plan(11, F16, (256, 256, 2, 1), 529, 132, 232448, 90) is None
    assert rc.pipe_plan(12, BF16, (256, 256, 1, 1), 529, 132, 232448, 90) == (528, 24576)
    # ... for 16-bit dtypes only (float32 backwards measured slower piped)
    assert rc.pipe_plan(12, F32, (128, 64, 2, 1), 32768, 132, 232448, 90) is None
    assert rc.pipe_plan(11, F32, (1024, 1024, 2, 1), 50, 132, 232448, 90) is None
    assert rc.piped(13, BF16) and rc.piped(0, F16) and not rc.piped(13, F32)
    # float32 and float64 rows: the plain register kernels
    assert not any(rc.piped(op, dt) for op in rc.PIPE_OPS for dt in (F32, F64))
    assert rc.pipe_plan(0, F32, (256, 256, 4, 1), 8192, 132, 232448, 90) is None
    # no cp.async below compute capability 8.0: the plain register kernels
    assert rc.pipe_plan(0, BF16, (256, 256, 4, 1), 8192, 40, 65536, 75) is None
    assert rc.pipe_plan(0, BF16, (256, 256, 4, 1), 8192, 108, 166912, 80) == (324, 49152)
    # cluster rows take the plain cluster kernel (one cluster a row)
    assert rc.pipe_plan(0, F32, (512, 512, 4, 4), 8192, 132, 232448, 90) is None
    assert rc.pipe_plan(5, BF16, (512, 512, 4, 8), 3, 132, 232448, 90) is None
    assert rc.pipe_plan(2, BF16, (256, 256, 8, 4), 1024, 132, 232448, 90) is None
    assert rc.pipe_plan(2, F32, (512, 512, 4, 4), 1024, 132, 232448, 90) is None
    with pytest.raises(ValueError, match="no pipelined kernel"):
        rc.kernel_name(0, BF16, (512, 512, 4, 4), True)
    assert rc.pipe_plan(0, BF16, (1024, 1024, 4, 1), 8, 132, 101376, 90) is None  # too little smem
    monkeypatch.setenv("CUPYLAB_ROWWISE_PIPELINE", "0")
    assert rc.pipe_plan(0, BF16, (256, 256, 4, 1), 8192, 132, 232448, 90) is None


class _V:
    def __init__(self, ptr, shape, strides, dt=BF16):
        self.ptr, self.shape, self.strides, self.dtype = ptr, shape, strides, dt
        self.size = int(np.prod(shape))


def test_row_layout():
    x = _V(0x1000, (4, 6, 300), (3000, 300, 1))
    lay = rc.row_layout("t", x.shape, [x, None, _V(0x2000, x.shape, (1800, 300, 1)), None], -1)
    assert (lay.rows, lay.cols, lay.n1) == (24, 300, 6) and lay.vec_ok
    assert lay.si[0] == 300 and lay.so[0] == 3000 and lay.head is None  # 600-byte rows
    v = _V(0x1000 + 600, (4, 4, 256), (3000 * 2, 256, 1))
    lay = rc.row_layout("t", v.shape, [v, None, _V(0x3000, v.shape, (1024, 256, 1)), None], -1)
    assert lay.n1 == 4 and lay.so[0] == 6000 and lay.si[0] == 256 and lay.so[2] == 1024
    assert not lay.vec_ok  # 0x1258 and 0x3000 differ modulo 16
    t = _V(0x1000, (5, 6, 7), (42, 7, 1), F32)
    lay = rc.row_layout("t", t.shape, [t, None, t, None], 0)
    assert (lay.rows, lay.cols, lay.cs[0]) == (42, 5, 42) and not lay.vec_ok
    w = _V(0x1000, (2, 3, 4, 5), (200, 60, 10, 1), F32)  # three unmergeable leading levels
    with pytest.raises(ValueError, match="leading dimensions"):
        rc.row_layout("t", w.shape, [w, None, _V(0x0, w.shape, (60, 20, 5, 1), F32), None], -1)


def test_layout_cache_keys_on_alignment_and_strides():
    x = _V(0x1000, (8, 64), (64, 1))
    o = _V(0x2000, (8, 64), (64, 1))
    a = rc.row_layout("t", x.shape, [x, None, o, None], -1)
    assert rc.row_layout("t", x.shape, [_V(0x3000, (8, 64), (64, 1)), None, o, None], -1) is a
    b = rc.row_layout("t", x.shape, [_V(0x3002, (8, 64), (64, 1)), None, o, None], -1)
    assert b is not a and not b.vec_ok  # another offset modulo 16: not the same plan
    c = rc.row_layout("t", x.shape, [_V(0x1000, (8, 64), (128, 1)), None, o, None], -1)
    assert c is not a and c.si[0] == 128


def test_name_expressions_cover_ladders():
    names = rc.name_expressions("norm_bwd", BF16)
    assert "cl::col_sum<float, float>" in names and "cl::col_sum<float, cl::bf16_t>" in names
    assert "cl::row_generic<cl::bf16_t, 13>" in names
    assert "cl::ce_aux<double>" in rc.name_expressions("ce", F64)
    assert sum(len(p.name_expressions) for p in rc.all_programs()) == N_INSTANCES


def test_errors_need_no_gpu():
    x = FakeCAI((4, 8), typestr="<i4")
    with pytest.raises(TypeError, match="softmax: x must be a CUDA device array"):
        cupylab.softmax(np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match="cross_entropy: reduction"):
        cupylab.cross_entropy(x, x, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        cupylab.cross_entropy(x, x, label_smoothing=2.0)


_NONE_CALLS = [  # (call with one required array None, the operand it must name)
    (lambda x: cupylab.softmax(None), "softmax: x"),
    (lambda x: cupylab.log_softmax(None), "log_softmax: x"),
    (lambda x: cupylab.rms_norm(None, x), "rms_norm: x"),
    (lambda x: cupylab.layer_norm(None), "layer_norm: x"),
    (lambda x: cupylab.add_rms_norm(None, x, None), "add_rms_norm: x"),
    (lambda x: cupylab.cross_entropy(None, x), "cross_entropy: logits"),
    (lambda x: cupylab.cross_entropy(x, None), "cross_entropy: target"),
    (lambda x: cupylab.softmax_backward(None, x), "softmax_backward: y"),
    (lambda x: cupylab.log_softmax_backward(x, None), "log_softmax_backward: dy"),
    (lambda x: cupylab.rms_norm_backward(None, x, None, x), "rms_norm_backward: dy"),
    (lambda x: cupylab.layer_norm_backward(x, None, None, x, x), "layer_norm_backward: x"),
]


@pytest.mark.parametrize("call,what", _NONE_CALLS, ids=[w for _, w in _NONE_CALLS])
def test_a_required_array_given_as_none_is_named(sim, call, what):
    """None for a required array is "not an array" (it used to escape as an IndexError or a
    KeyError from the argument gathering); optional arrays (weight, bias, out) may be None."""
    with pytest.raises(TypeError, match=f"^{what} must be a CUDA device array.*NoneType, "
                                        "which is not an array"):
        call(FakeCAI((4, 64)))
    assert sim["launches"] == []


def test_the_first_bad_array_is_the_one_named():
    with pytest.raises(TypeError, match="cross_entropy: logits .* host data"):
        cupylab.cross_entropy(np.zeros((2, 3), np.float32), None)
    with pytest.raises(TypeError, match="log_softmax_backward: y .* not an array"):
        cupylab.log_softmax_backward(1, None)


def test_backward_statistics_and_empty_classes_are_checked_before_any_allocation(sim):
    """The norm backwards check their statistics (present, one float32 value a row) and
    cross-entropy its class count before allocating an output: on a GPU a refused call made
    a dx (or dlogits) first, and without one the error was NoGPUError."""
    x, dy = FakeCAI((4, 8)), FakeCAI((4, 8))
    with pytest.raises(TypeError, match="rms_norm_backward: rstd is required"):
        cupylab.rms_norm_backward(dy, x, None, None)
    with pytest.raises(ValueError, match=r"rms_norm_backward: rstd must hold one value per row "
                                         r"\(4\); got shape \(5,\)"):
        cupylab.rms_norm_backward(dy, x, None, FakeCAI((5,)))
    with pytest.raises(TypeError, match="layer_norm_backward: mean must be float32"):
        cupylab.layer_norm_backward(dy, x, None, FakeCAI((4,), typestr="<f8"), FakeCAI((4,)))
    with pytest.raises(ValueError, match="cross_entropy: logits has no classes"):
        cupylab.cross_entropy(FakeCAI((4, 0)), FakeCAI((4,), typestr="<i8"), return_grad=True)
    assert sim["launches"] == []


def test_add_rms_norm_needs_a_residual(sim):
    with pytest.raises(TypeError, match="add_rms_norm: residual is required"):
        cupylab.add_rms_norm(FakeCAI((4, 64)), None, None)
    assert sim["launches"] == []


def test_an_inplace_residual_is_checked_as_an_output(sim):
    """h is written into the residual with inplace=True: the rules of out= apply to it (no
    partial overlap with x or the weight, no broadcast), and to every output no view whose
    elements share addresses."""
    base = 0x7F00_F000_0000
    x, r = FakeCAI((4, 64), ptr=base + 256), FakeCAI((4, 64), ptr=base)
    with pytest.raises(ValueError, match="add_rms_norm: residual overlaps x"):
        cupylab.add_rms_norm(x, r, None, inplace=True)
    rb = FakeCAI((4, 64), ptr=base + 0x100000, strides=(0, 4))
    with pytest.raises(ValueError, match="residual has zero strides"):
        cupylab.add_rms_norm(FakeCAI((4, 64), ptr=base + 0x200000), rb, None, inplace=True)
    w = FakeCAI((64,), ptr=base + 0x300000)
    r2 = FakeCAI((4, 64), ptr=base + 0x300000 - 256)
    with pytest.raises(ValueError, match="residual overlaps weight"):
        cupylab.add_rms_norm(FakeCAI((4, 64), ptr=base + 0x400000), r2, w, inplace=True)
    tight = FakeCAI((4, 64), ptr=base + 0x500000, strides=(128, 4))  # rows 32 apart
    with pytest.raises(ValueError, match="rms_norm: out overlaps itself"):
        cupylab.rms_norm(FakeCAI((4, 64), ptr=base + 0x600000), out=tight)
    with pytest.raises(ValueError, match="add: out overlaps itself"):
        cupylab.add(FakeCAI((4, 64), ptr=base + 0x700000), 1.0, out=tight)
    assert sim["launches"] == []


def test_weights_and_targets_share_no_byte_with_an_output(sim):
    """A one-row residual at the weight's address (inplace=True: h is stored before the
    weight is read) and a target array partly inside grad_out (broadcast to the logits'
    shape, only the target's first entry was compared) are refused."""
    base = 0x7F01_F000_0000
    w = FakeCAI((64,), ptr=base)
    with pytest.raises(ValueError, match="add_rms_norm: residual overlaps weight"):
        cupylab.add_rms_norm(FakeCAI((1, 64), ptr=base + 0x1000), FakeCAI((1, 64), ptr=base),
                             w, inplace=True)
    g = FakeCAI((4, 8), ptr=base + 0x10000)
    t = FakeCAI((4,), typestr="<i8", ptr=base + 0x10000 - 16)  # entries 2, 3 in g's row 0
    with pytest.raises(ValueError, match="cross_entropy: grad_out overlaps target"):
        cupylab.cross_entropy(FakeCAI((4, 8), ptr=base + 0x20000), t, grad_out=g)
    assert sim["launches"] == []


def test_overlaps_itself():
    from cupylab._elementwise_core import overlaps_itself

    assert not overlaps_itself((4, 64), (64, 1))
    assert not overlaps_itself((4, 64), (1, 4))  # Fortran order
    assert not overlaps_itself((4, 64), (-64, 1))  # reversed rows
    assert not overlaps_itself((3, 1, 5), (5, 0, 1))  # a length-1 axis of stride 0
    assert not overlaps_itself((0, 4), (0, 0))
    assert overlaps_itself((4, 64), (32, 1))
    assert overlaps_itself((4, 64), (0, 1))
    assert overlaps_itself((2, 2), (1, 1))
    assert not overlaps_itself((3, 3), (2, 3))  # interleaved, 9 distinct addresses
    assert overlaps_itself((3, 3), (1, 1))


def test_numeric_arguments_take_numpy_scalars_and_refuse_non_numbers(sim):
    x = FakeCAI((4, 64))
    for bad, err, msg in [("a", TypeError, "eps must be a real number"),
                          (True, TypeError, "eps must be a real number"),
                          (np.bool_(True), TypeError, "eps must be a real number"),
                          (2**1100, ValueError, "eps must be a non-negative number"),
                          (float("nan"), ValueError, "eps must be a non-negative number"),
                          (-1e-6, ValueError, "eps must be a non-negative number")]:
        with pytest.raises(err, match=f"rms_norm: {msg}"):
            cupylab.rms_norm(x, None, bad)
    t = FakeCAI((4,), typestr="<i8")
    with pytest.raises(TypeError, match="label_smoothing must be a real number"):
        cupylab.cross_entropy(x, t, label_smoothing="0.1")
    with pytest.raises(ValueError, match="label_smoothing must be a number in"):
        cupylab.cross_entropy(x, t, label_smoothing=np.float32(1.5))
    with pytest.raises(ValueError, match="ignore_index must fit in 64 bits"):
        cupylab.cross_entropy(x, t, ignore_index=2**63)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        cupylab.cross_entropy(x, t, ignore_index=np.bool_(False))
    assert sim["launches"] == []
    from cupylab.ops import _rowcore

    assert _rowcore.real_value("f", "eps", np.float32(1e-6), "") == pytest.approx(1e-6)
    assert _rowcore.real_value("f", "eps", np.int64(3), "") == 3.0


def test_check_stats_layout():
    a = F32
    rc.check_stats("op", "mean", _V(0x0, (0,), (0,), a), 0, a)  # empty: any strides
    rc.check_stats("op", "mean", _V(0x100, (3, 1, 2), (2, 7, 1), a), 6, a)  # elements
    with pytest.raises(ValueError, match="op: mean must be contiguous"):
        rc.check_stats("op", "mean", _V(0x100, (3, 2), (4, 1), a), 6, a)
    with pytest.raises(ValueError, match="one value per row"):
        rc.check_stats("op", "rstd", _V(0x100, (5,), (4,), a), 6, a)
    with pytest.raises(TypeError, match="rstd must be float32"):
        rc.check_stats("op", "rstd", _V(0x100, (6,), (1,), BF16), 6, a)


@pytest.mark.parametrize("op", ["softmax_backward", "log_softmax_backward"])
def test_bench_tolerance_follows_the_terms_size(op):
    """A float32 softmax backward of random rows differs from the float64 reference by a few
    roundings of its terms (dy - sum(y * dy) cancels), not of its result: the bench checks
    it against MAGNITUDES, and still rejects a result off by one part in a thousand."""
    from cupylab.bench._cases import ROW_TOL_SCALE
    from cupylab.bench._operands import compare

    rng = np.random.default_rng(5)
    y, dy = (rng.standard_normal((8, 4096)).astype(np.float32) for _ in range(2))
    ref = R.REFERENCES[f"rows:{op}"](y, dy).reshape(-1)
    if op == "softmax_backward":
        s = np.sum(y * dy, axis=-1, keepdims=True, dtype=np.float32)
        got = y * (dy - s)
    else:
        got = dy - np.exp(y) * np.sum(dy, axis=-1, keepdims=True, dtype=np.float32)
    got = got.astype(np.float32).reshape(-1)
    mag = R.MAGNITUDES[f"rows:{op}"](y, dy).reshape(-1)
    idx = np.arange(ref.size)
    tol = (1e-6 * ROW_TOL_SCALE,) * 2
    assert compare(got, ref, idx, F32, *tol, mag) is None
    assert compare(got * np.float32(1.001), ref, idx, F32, *tol, mag) is not None


def test_references():
    x = np.array([[1.0, 2.0, 3.0], [-np.inf, -np.inf, -np.inf]])
    s = R.ROWWISE_REFERENCES["softmax"](x)
    np.testing.assert_allclose(s[0], np.exp([1, 2, 3]) / np.exp([1, 2, 3]).sum())
    assert np.isnan(s[1]).all()
    loss, lse, g = R.ROWWISE_REFERENCES["cross_entropy"](x[:1], np.array([2]))
    np.testing.assert_allclose(loss[0], lse[0] - 3.0)
    np.testing.assert_allclose(g[0], s[0] - [0, 0, 1])
    y, m, r = R.ROWWISE_REFERENCES["layer_norm"](np.full((2, 4), 3.0))
    assert np.all(y == 0) and np.all(m == 3.0)
    # -inf logits with a finite target: a finite loss without smoothing, as torch gives (the
    # smoothing term's 0 * inf made it NaN)
    row = np.array([[-np.inf, 0.0, 1.0]])
    loss = R.ROWWISE_REFERENCES["cross_entropy"](row, np.array([2]))[0]
    np.testing.assert_allclose(loss[0], np.log(1 + np.e) - 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("cc", [75, 80, 90])
def test_every_rowwise_instance_compiles(cc, monkeypatch):
    monkeypatch.setenv("CUPYLAB_CACHE_DISABLE", "1")
    n = compile_every(rc.all_programs(), cc)
    assert n == N_INSTANCES


def test_bench_sizes_mean_rows_of_4096_for_rowwise_ops():
    from cupylab._registry import OPS
    from cupylab.bench._cases import row_shape

    assert row_shape(OPS["softmax"], (1 << 26,)) == (1 << 14, 4096)
    assert row_shape(OPS["softmax_backward"], (1 << 20,)) == (256, 4096)
    assert row_shape(OPS["softmax"], (8192, 8192)) == (8192, 8192)
    assert row_shape(OPS["rms_norm"], (1000,)) == (1000,)  # not a multiple: one row, as given
    assert row_shape(OPS["add"], (1 << 26,)) == (1 << 26,)


_NEW_BENCH_CASES = {"rms_norm_backward": 2, "layer_norm_backward": 2, "cross_entropy": 1,
                    "cross_entropy_backward": 1}


def test_bench_cases_of_the_backwards_and_cross_entropy():
    from cupylab._registry import OPS

    for name, nin in _NEW_BENCH_CASES.items():
        spec = OPS[name]
        assert spec.rowwise and spec.n_inputs == nin
        assert spec.reference == f"rows:{name}" and spec.reference in R.REFERENCES
        assert spec.dtypes == ("float16", "bfloat16", "float32", "float64")
        assert set(spec.peers) == {"torch", "torch.compile"}
    # inputs read once, the one output written once (the statistics and targets: per row)
    assert OPS["rms_norm_backward"].bytes_per_element(2) == 6
    assert OPS["layer_norm_backward"].bytes_per_element(4) == 12
    assert OPS["cross_entropy"].bytes_per_element(2) == 4
    assert OPS["cross_entropy_backward"].bytes_per_element(2) == 4


def test_bench_references_of_the_backwards_and_cross_entropy():
    rng = np.random.default_rng(3)
    dy, x = rng.standard_normal((2, 5, 37))
    _, rstd = R.ROWWISE_REFERENCES["rms_norm"](x)
    np.testing.assert_allclose(R.REFERENCES["rows:rms_norm_backward"](dy, x),
                               R.ROWWISE_REFERENCES["rms_norm_backward"](dy, x, None, rstd)[0],
                               rtol=1e-15, atol=1e-15)
    _, mean, rstd = R.ROWWISE_REFERENCES["layer_norm"](x, eps=1e-5)
    np.testing.assert_allclose(
        R.REFERENCES["rows:layer_norm_backward"](dy, x),
        R.ROWWISE_REFERENCES["layer_norm_backward"](dy, x, None, mean, rstd)[0],
        rtol=1e-15, atol=1e-15)
    # the cross-entropy case: the gradient of the summed loss, a row's target being how many
    # of its logits are negative, modulo the row length
    t = np.sum(x < 0, axis=-1) % x.shape[-1]
    g = R.REFERENCES["rows:cross_entropy"](x)
    np.testing.assert_allclose(g, R.ROWWISE_REFERENCES["cross_entropy"](x, t)[2])
    np.testing.assert_allclose(g.sum(axis=-1), 0.0, atol=1e-12)  # softmax - onehot
    assert np.all(g[np.arange(5), t] < 0)


def test_bench_cases_of_the_weighted_norms():
    from cupylab._registry import OPS

    for name in ("rms_norm_w", "layer_norm_wb"):
        spec = OPS[name]
        assert spec.rowwise and spec.n_inputs == 1
        assert spec.reference == f"rows:{name}" and spec.reference in R.REFERENCES
        assert set(spec.peers) == {"torch", "torch.compile"}
        assert spec.bytes_per_element(2) == 4
    # the vectors: exact in bfloat16 (8 significant bits), within the documented ranges
    for bias, lo, hi in ((False, 0.5, 1.5), (True, -0.625, 0.625)):
        v = R.bench_vector(1000, bias)
        assert v.min() == lo and v.max() == hi
        assert np.all(v * 256 == np.round(v * 256))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 37))
    w, b = R.bench_vector(37), R.bench_vector(37, True)
    np.testing.assert_allclose(R.REFERENCES["rows:rms_norm_w"](x),
                               R.ROWWISE_REFERENCES["rms_norm"](x, w, 1e-6)[0], rtol=1e-15)
    np.testing.assert_allclose(R.REFERENCES["rows:layer_norm_wb"](x),
                               R.ROWWISE_REFERENCES["layer_norm"](x, w, b, 1e-5)[0], rtol=1e-15)


def test_bench_backward_cases_make_their_inputs_once(monkeypatch):
    """The bench functions of the three cases, with NumPy stand-ins for the kernels: the
    forward's statistics and the cross-entropy targets are made on the first call for an
    input and reused by the next (timed) calls; the results are the bench references'."""
    import cupylab.ops.cross_entropy as ce_mod
    import cupylab.ops.rowwise as rw
    from cupylab._registry import OPS

    made = []

    def rms_norm(x, weight, eps, return_stats=False):
        made.append("rms")
        return R.ROWWISE_REFERENCES["rms_norm"](x, weight, eps)

    def layer_norm(x, weight, bias, eps, return_stats=False):
        made.append("ln")
        return R.ROWWISE_REFERENCES["layer_norm"](x, weight, bias, eps)

    def cross_entropy(logits, target, reduction="mean", return_grad=False, grad_out=None,
                      return_lse=False):
        assert reduction == "sum" and (return_grad or return_lse) and target.dtype == np.int64
        made.append("ce")
        loss, lse, g = R.ROWWISE_REFERENCES["cross_entropy"](logits, target)
        if return_lse:
            return loss.sum(), lse
        if grad_out is None:
            return loss.sum(), g
        grad_out[...] = g
        return loss.sum(), grad_out

    monkeypatch.setattr(rw, "rms_norm", rms_norm)
    monkeypatch.setattr(rw, "layer_norm", layer_norm)
    monkeypatch.setattr(rw, "rms_norm_backward", R.ROWWISE_REFERENCES["rms_norm_backward"])
    monkeypatch.setattr(rw, "layer_norm_backward", R.ROWWISE_REFERENCES["layer_norm_backward"])
    def cross_entropy_backward(logits, target, lse, reduction="mean", out=None):
        assert reduction == "sum" and target.dtype == np.int64
        made.append("ce_bwd")
        ref = R.ROWWISE_REFERENCES["cross_entropy"](logits, target)
        np.testing.assert_allclose(lse, ref[1])  # the forward's, kept for this input
        if out is None:
            return ref[2]
        out[...] = ref[2]
        return out

    monkeypatch.setattr(ce_mod, "cross_entropy", cross_entropy)
    monkeypatch.setattr(ce_mod, "cross_entropy_backward", cross_entropy_backward)
    rng = np.random.default_rng(4)
    dy, x, x2 = rng.standard_normal((3, 6, 50))
    for name, tag in (("rms_norm_backward", "rms"), ("layer_norm_backward", "ln")):
        fn = OPS[name].fn
        want = R.REFERENCES[f"rows:{name}"](dy, x)
        for _ in range(3):
            np.testing.assert_allclose(fn(dy, x, out=np.empty_like(x)), want, rtol=1e-14)
        assert made.count(tag) == 1
        np.testing.assert_allclose(fn(dy, x2), R.REFERENCES[f"rows:{name}"](dy, x2), rtol=1e-14)
        assert made.count(tag) == 2  # another input: its own statistics
    fn = OPS["cross_entropy"].fn
    for xs in (x, x.astype(np.float16), x.astype(np.float32)):
        out = np.empty_like(xs)
        assert fn(xs, out=out) is out and fn(xs) is not out
        # a wrong target would be off by 1 somewhere; float16 rounds the gradient
        np.testing.assert_allclose(out, R.REFERENCES["rows:cross_entropy"](xs), rtol=1e-3,
                                   atol=1e-5)
    assert made.count("ce") == 6
    fn = OPS["cross_entropy_backward"].fn
    for xs in (x, x.astype(np.float32)):
        for _ in range(3):
            out = np.empty_like(xs)
            assert fn(xs, out=out) is out
            np.testing.assert_allclose(out, R.REFERENCES["rows:cross_entropy_backward"](xs),
                                       rtol=1e-5, atol=1e-7)
    assert made.count("ce") == 8 and made.count("ce_bwd") == 6  # one lse per input
    with pytest.raises(TypeError, match="no weak references"):
        OPS["rms_norm_backward"].fn(dy, x.tolist())


def test_bench_add_rms_norm_peers_produce_h_too():
    """The add_rms_norm peers (torch eager and compiled) compute h = x + r as an output, as
    cupylab does: with y alone as the compiled function's result, Inductor need not write h.
    A NumPy stand-in for torch records what the compiled function returns."""
    from types import SimpleNamespace

    from cupylab._registry import OPS

    def rms_norm(h, shape, weight, eps):
        return R.ROWWISE_REFERENCES["rms_norm"](h, weight, eps)[0]

    returned = []

    def compile(fn):
        def run(*a):
            returned.append(fn(*a))
            return returned[-1]
        return run

    fake = SimpleNamespace(nn=SimpleNamespace(functional=SimpleNamespace(rms_norm=rms_norm)),
                           compile=compile)
    rng = np.random.default_rng(11)
    x, r = rng.standard_normal((2, 3, 40))
    ref = R.REFERENCES["rows:add_rms_norm"](x, r)
    peers = OPS["add_rms_norm"].peers
    np.testing.assert_allclose(peers["torch"](fake, x, r)(), ref, rtol=1e-12)
    np.testing.assert_allclose(peers["torch.compile"](fake, x, r)(), ref, rtol=1e-12)
    y, h = returned[-1]
    np.testing.assert_allclose(h, x + r)


def _bf16(a):
    """``a`` rounded to bfloat16 (nearest even), as float64."""
    u = np.asarray(a, np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def test_bench_rowwise_check_catches_results_below_atol():
    """The bench's row-wise check: the scaled atol of bfloat16 (0.016, peers 0.064) is far
    above a 4,096-column softmax's values (about 2e-4), so the element test alone passes an
    all-zero result; the whole-sample test refuses it and passes a correctly rounded one.
    A result 10 % off is refused (the 16-bit scale was 16, which passed it)."""
    from cupylab import _dtypes
    from cupylab.bench._cases import PEER_TOL_SCALE, ROW_TOL_SCALE_16 as ROW_TOL_SCALE
    from cupylab.bench._operands import compare

    rng = np.random.default_rng(12)
    x, dy = rng.standard_normal((2, 8, 4096))
    dt = _dtypes.resolve("bfloat16")
    rtol, atol = R.TOLERANCES["bfloat16"]
    y = R.ROWWISE_REFERENCES["softmax"](x).ravel()
    dx = R.REFERENCES["rows:softmax_backward"](_bf16(y).reshape(x.shape), dy).ravel()
    mag = R.MAGNITUDES["rows:softmax_backward"](_bf16(y).reshape(x.shape), dy).ravel()
    idx = np.arange(y.size)
    for s in (ROW_TOL_SCALE, ROW_TOL_SCALE * PEER_TOL_SCALE):
        assert compare(_bf16(y), y, idx, dt, rtol * s, atol * s, normwise=True) is None
        assert compare(_bf16(dx), dx, idx, dt, rtol * s, atol * s, mag, normwise=True) is None
        zeros = np.zeros_like(y)
        assert compare(zeros, y, idx, dt, rtol * s, atol * s) is None  # the gap closed below
        assert "as a whole" in compare(zeros, y, idx, dt, rtol * s, atol * s, normwise=True)
        assert "as a whole" in compare(zeros, dx, idx, dt, rtol * s, atol * s, mag,
                                       normwise=True)
        assert compare(_bf16(y * 1.1), y, idx, dt, rtol * s, atol * s, normwise=True)
    # float16: a correctly rounded softmax of a long row (values below float16's normal range,
    # stored in steps of 6e-8) passes; zeros do not
    f16 = _dtypes.resolve("float16")
    rtol, atol = R.TOLERANCES["float16"]
    u = rng.uniform(0.5, 2.0, 1 << 21) * rng.choice([-1, 1], 1 << 21)
    y = R.ROWWISE_REFERENCES["softmax"](u[None, :]).ravel()
    idx = np.arange(y.size)
    for s in (ROW_TOL_SCALE, ROW_TOL_SCALE * PEER_TOL_SCALE):
        got = y.astype(np.float16).astype(np.float64)
        assert compare(got, y, idx, f16, rtol * s, atol * s, normwise=True) is None
        assert "as a whole" in compare(np.zeros_like(y), y, idx, f16, rtol * s, atol * s,
                                       normwise=True)


def test_norm_rows_of_no_element_are_refused_before_any_allocation(sim, monkeypatch):
    """rms_norm of (4, 0) allocated its outputs first: without a GPU the error was
    NoGPUError, not the argument's ValueError."""
    from cupylab.ops import _rowcore as rc

    monkeypatch.setattr(rc, "new_array", lambda *a: pytest.fail("allocated before checking"))
    for f in (cupylab.rms_norm, cupylab.layer_norm):
        with pytest.raises(ValueError, match="the last axis of x is empty"):
            f(FakeCAI((4, 0)), return_stats=True)
