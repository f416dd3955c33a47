"""Row-wise kernel choice at decoding shapes without a GPU: which calls take row_few_kernel
(_rowcore.few_class), its exact-fit form (few_full) and their name expressions."""
import pytest

from cupylab import _dtypes
from cupylab.ops import _rowcore as rc

from test_rowwise_cpu import _V

BF16, F16, F32, F64 = (_dtypes.from_name(n) for n in ("bfloat16", "float16", "float32", "float64"))


def test_few_rows_take_the_decoding_shape_kernel(monkeypatch):
    from types import SimpleNamespace

    def lay(rows, cols, head=0, vec_ok=True, n1=None):
        return SimpleNamespace(rows=rows, cols=cols, head=head, vec_ok=vec_ok,
                               n1=rows if n1 is None else n1)

    monkeypatch.delenv("CUPYLAB_ROWWISE_FEW", raising=False)
    for dt in (BF16, F16):
        # layer_norm: rows of 1,025 to 8,192 elements (129 to 1,024 slots), two vectors a thread
        assert rc.few_class(3, dt, lay(16, 1024), 132) is None  # 128 slots: the other classes
        assert rc.few_class(3, dt, lay(16, 1025), 132) == (128, 128, 2, 1)
        assert rc.few_class(3, dt, lay(16, 2048), 132) == (128, 128, 2, 1)
        assert rc.few_class(3, dt, lay(16, 2048, head=1), 132) == (256, 256, 2, 1)
        assert rc.few_class(3, dt, lay(16, 4096), 132) == (256, 256, 2, 1)
        assert rc.few_class(3, dt, lay(16, 4089, head=None), 132) == (256, 256, 2, 1)
        assert rc.few_class(3, dt, lay(16, 4090, head=None), 132) == (512, 512, 2, 1)
        assert rc.few_class(3, dt, lay(132, 8192), 132) == (512, 512, 2, 1)
        assert rc.few_class(3, dt, lay(133, 8192), 132) is None  # more rows than SMs
        assert rc.few_class(3, dt, lay(16, 8193), 132) is None
        # rms_norm with a weight as layer_norm; without, as the softmaxes and add_rms_norm:
        # at most half the SMs, classes of up to 256 threads
        assert rc.few_class(2, dt, lay(132, 8192), 132, weighted=True) == (512, 512, 2, 1)
        for op in (0, 1, 2, 4):
            assert rc.few_class(op, dt, lay(66, 4096), 132) == (256, 256, 2, 1)
            assert rc.few_class(op, dt, lay(67, 4095), 132) is None
            assert rc.few_class(op, dt, lay(67, 4096, head=1), 132) is None
            assert rc.few_class(op, dt, lay(67, 4096, n1=33), 132) is None  # two levels
            assert rc.few_class(op, dt, lay(16, 4097), 132) is None  # a 512-thread class
            # rows that fill their class exactly (the exact-fit form): up to as many as SMs
            assert rc.few_class(op, dt, lay(67, 4096), 132) == (256, 256, 2, 1)
            assert rc.few_class(op, dt, lay(132, 8192), 132) == (512, 512, 2, 1)
            assert rc.few_class(op, dt, lay(133, 2048), 132) is None
        assert rc.few_class(4, dt, lay(67, 4095), 132, weighted=True) is None
    # float32: layer_norm and rms_norm with a weight only
    assert rc.few_class(3, F32, lay(1, 513), 132) == (128, 128, 2, 1)
    assert rc.few_class(3, F32, lay(132, 4096), 132) == (512, 512, 2, 1)
    assert rc.few_class(3, F32, lay(1, 4097), 132) is None
    assert rc.few_class(2, F32, lay(16, 4096), 132, weighted=True) == (512, 512, 2, 1)
    for op in (0, 1, 4):
        assert rc.few_class(op, F32, lay(16, 2048), 132, weighted=True) is None
    assert rc.few_class(2, F32, lay(16, 2047), 132) is None
    assert rc.few_class(2, F32, lay(132, 2048), 132) == (256, 256, 2, 1)  # exact fit
    assert rc.few_class(0, F32, lay(16, 2048), 132) is None  # no float32 softmax instances
    assert rc.few_class(5, BF16, lay(16, 4096), 132) is None  # cross-entropy
    assert rc.few_class(10, BF16, lay(16, 4096), 132) is None  # a backward
    assert rc.few_class(3, F64, lay(16, 4096), 132) is None
    assert rc.few_class(3, BF16, lay(16, 4096, head=None, vec_ok=False), 132) is None
    monkeypatch.setenv("CUPYLAB_ROWWISE_FEW", "0")
    assert rc.few_class(3, BF16, lay(16, 4096), 132) is None
    # compiled beside the others for the ops and dtypes that have them
    for dt, per in ((BF16, (0, 1, 2, 3, 4)), (F16, (0, 1, 2, 3, 4)), (F32, (2, 3))):
        for group, ops in (("softmax", (0, 1)), ("norm", (2, 3, 4))):
            names = [n for n in rc.name_expressions(group, dt) if "row_few_kernel" in n]
            assert len(names) == len(set(ops) & set(per)) * len(rc.FEW_LADDER) * 2
            assert sum(n.endswith(", true>") for n in names) == len(names) / 2
    assert not any("row_few_kernel" in n for g in rc.GROUPS for n in rc.name_expressions(g, F64))
    assert not any("row_few_kernel" in n for n in rc.name_expressions("ce", BF16))
    assert rc.kernel_name(3, BF16, (256, 256, 2, 1), few=True) == \
        "cl::row_few_kernel<cl::bf16_t, 3, 256, 2, false>"
    assert rc.kernel_name(3, BF16, (256, 256, 2, 1), few=True, full=True) == \
        "cl::row_few_kernel<cl::bf16_t, 3, 256, 2, true>"
    with pytest.raises(ValueError, match="no decoding-shape kernel"):
        rc.kernel_name(5, BF16, (256, 256, 2, 1), few=True)
    with pytest.raises(ValueError, match="no decoding-shape kernel"):
        rc.kernel_name(0, F32, (256, 256, 2, 1), few=True)
    with pytest.raises(ValueError, match="no decoding-shape kernel"):
        rc.kernel_name(2, BF16, (256, 256, 4, 1), few=True)


def test_few_rows_that_fill_the_class_take_its_exact_fit_form():
    """row_few_kernel's exact-fit form (no bounds tests): rows of exactly the class's
    THREADS x NV slots from 16-byte boundaries, one level of row strides; anything else keeps
    the general form (made from real layouts, as plan_rows sees them)."""
    def lay(shape, dt, strides=None, ptr=0):
        v = _V(0x1000 + ptr, shape, strides or rc.c_strides(shape), dt)
        return rc.make_layout("layer_norm", shape, [v, None, v, None], -1)

    for dt, cls, n in ((BF16, (256, 256, 2, 1), 4096), (F16, (128, 128, 2, 1), 2048),
                       (BF16, (512, 512, 2, 1), 8192), (F32, (512, 512, 2, 1), 4096),
                       (F32, (128, 128, 2, 1), 1024)):
        isz = dt.itemsize
        assert rc.few_full(dt, lay((16, n), dt), cls)
        assert rc.few_full(dt, lay((1, n), dt), cls)
        assert rc.few_full(dt, lay((n,), dt), cls)
        assert rc.few_full(dt, lay((2, 3, n), dt), cls)  # merged into one level
        # rows strided by a multiple of 16 bytes: still one level, head 0
        assert rc.few_full(dt, lay((16, n), dt, strides=(n + 64, 1)), cls)
        assert not rc.few_full(dt, lay((16, n - 1), dt), cls)  # not the whole class
        assert not rc.few_full(dt, lay((16, n), dt, ptr=isz), cls)  # head 1
        assert not rc.few_full(dt, lay((16, n), dt, strides=(n + 1, 1)), cls)  # heads differ
        # two levels of rows (a slice of the middle axis)
        two = lay((2, 3, n), dt, strides=(4 * n, n, 1))
        assert two.n1 == 3 and not rc.few_full(dt, two, cls)
