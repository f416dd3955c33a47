"""The float32-residual-stream add_rms_norm (cupylab/ops/resnorm.py) without a GPU: kernel
classes, the row layout and its quad test, the argument struct, and every kernel instance
compiled through NVRTC."""
import struct

import pytest

from cupylab import _dtypes
from cupylab.ops import resnorm as R

from conftest import compile_every

F32 = _dtypes.from_name("float32")
BF16 = _dtypes.from_name("bfloat16")


class _V:
    """A stand-in View: shape, strides (elements), dtype, address."""

    def __init__(self, shape, strides, dt=F32, ptr=4096):
        self.shape, self.strides, self.dtype, self.ptr = shape, strides, dt, ptr
        self.ndim = len(shape)


def test_classes_cover_rows_smallest_first():
    assert R.choose("fwd", 64, True) == (256, 8, 2)
    assert R.choose("fwd", 68, True) == (256, 32, 2)
    assert R.choose("fwd", 512, True) == (256, 32, 4)
    assert R.choose("fwd", 8192, True) == (512, 512, 4)
    assert R.choose("bwd", 512, True) == (256, 64, 2)
    assert R.choose("bwd", 8192, True) == (1024, 1024, 2)
    for kind in ("fwd", "bwd"):
        assert R.choose(kind, 8196, True) is None  # past every class: generic
        assert R.choose(kind, 30, True) is None  # not whole quads
        assert R.choose(kind, 512, False) is None
        sizes = [tpr * nv * 4 for _, tpr, nv in R.CLASSES[kind]]
        assert sizes == sorted(sizes)
        assert all(th % tpr == 0 and th <= 1024 for th, tpr, _ in R.CLASSES[kind])


def test_layout_quads_and_strides():
    x = _V((4, 6, 512), (3072, 512, 1), BF16)
    r = _V((4, 6, 512), (3072, 512, 1))
    lay = R.layout("t", x.shape, [x, r, None, None])
    assert (lay.rows, lay.cols, lay.n1) == (24, 512, 24) and lay.quad_ok
    assert lay.si[:2] == [512, 512] and lay.cs[:2] == [1, 1]
    # a row pitch that is not whole quads of one operand, an odd address, a column stride,
    # a weight off 16 bytes: the generic kernel
    assert not R.layout("t", (4, 512), [_V((4, 512), (514, 1), BF16), r]).quad_ok
    assert not R.layout("t", (4, 512), [_V((4, 512), (512, 1), BF16, 4098), r]).quad_ok
    assert not R.layout("t", (4, 512), [_V((4, 512), (1, 4), BF16), r]).quad_ok
    assert not R.layout("t", (4, 512), [x, r], _V((512,), (1,), F32, 4100)).quad_ok
    # two strided levels: outer and inner row strides
    y = _V((3, 5, 8), (100, 16, 1))
    lay = R.layout("t", y.shape, [y])
    assert (lay.n1, lay.so[0], lay.si[0]) == (5, 100, 16)
    with pytest.raises(ValueError, match="t: the leading dimensions"):
        z = _V((3, 5, 7, 8), (1000, 150, 20, 1))
        R.layout("t", z.shape, [z])


def test_args_struct_and_names():
    assert struct.calcsize("@" + R.ARGS_FMT) == 27 * 8  # 8 addresses, 18 ints, eps
    args = R._pack((1, 2, 3, 4, 5, 6, 7, 8), R.layout("t", (2, 8), [_V((2, 8), (8, 1))]), 0.5)
    assert len(args) == len(struct.unpack("@" + R.ARGS_FMT, struct.pack("@" + R.ARGS_FMT,
                                                                         *args)))
    names = R.name_expressions(BF16)
    assert len(names) == len(set(names)) == 3 * (len(R.FWD_CLASSES) + len(R.BWD_CLASSES) + 2) + 1
    assert "cl::resnorm_fwd<cl::bf16_t, cl::half_t, 256, 32, 4>" in names
    assert names[-1] == "cl::col_sum<float, float>"


def test_dtype_words():
    assert R.same_dtype("bfloat16", BF16) and not R.same_dtype("float32", BF16)
    assert not R.same_dtype(object(), BF16)
    assert R.resolve_dtype("f", "dtype", "float16").name == "float16"
    with pytest.raises(TypeError, match="f: dtype must be float16, bfloat16 or float32"):
        R.resolve_dtype("f", "dtype", "float64")
    with pytest.raises(TypeError, match="f: x_dtype must be"):
        R.resolve_dtype("f", "x_dtype", "no such dtype")


@pytest.mark.slow
@pytest.mark.parametrize("cc", [75, 80, 90])
def test_every_resnorm_instance_compiles(cc, monkeypatch):
    monkeypatch.setenv("CUPYLAB_CACHE_DISABLE", "1")
    assert compile_every(R.all_programs(), cc) == 3 * len(R.name_expressions(F32))
