"""The normaliser against real protocol objects made in the test (no GPU needed)."""
import gc
import types

import numpy as np
import pytest

from cupylab import _arrays, _dtypes, _runtime
from cupylab._arrays import as_view, view_from_cai

from conftest import FakeCAI, FakeDLPack


# -- CUDA Array Interface ------------------------------------------------------------------
def test_cai_v2_contiguous_defaults():
    v = as_view(FakeCAI((3, 4), "<f4", version=2))
    assert v.shape == (3, 4)
    assert v.strides == (4, 1)  # C-contiguous when strides are absent
    assert v.dtype.name == "float32"
    assert v.readonly is False and v.stream is None and v.device is None
    assert v.kind == "cai" and v.ptr == 0x7F0000000000


def test_cai_byte_strides_become_element_strides():
    v = as_view(FakeCAI((5, 3), "<f8", strides=(8, 40)))
    assert v.strides == (1, 5)  # a transposed (5, 3) float64 view


def test_cai_negative_and_zero_strides_kept():
    v = as_view(FakeCAI((4, 6), "<i4", strides=(0, -4)))
    assert v.strides == (0, -1)


def test_cai_strides_not_multiple_of_itemsize_rejected():
    with pytest.raises(ValueError, match=r"byte strides \(6,\) are not multiples of the item size 4"):
        as_view(FakeCAI((3,), "<f4", strides=(6,)))


def test_cai_v3_stream_kept_and_zero_read_as_the_legacy_stream():
    """Stream 0 is forbidden by the spec, but Numba exports its default stream as 0 (it was
    refused with ValueError): read as the legacy default stream, as CuPy and Numba read it."""
    assert as_view(FakeCAI((2,), stream=12345)).stream == 12345
    assert as_view(FakeCAI((2,), stream=12345, version=2)).stream is None  # v2 has no stream
    assert as_view(FakeCAI((2,), stream=0)).stream == 1


def test_a_dlpack_copy_is_not_written_into():
    """A producer that exported a copy (IS_COPIED) would lose what is written into it: the
    view is read-only, so out= refuses it."""
    v = as_view(FakeDLPack((4,), flags=_arrays.DLPACK_FLAG_IS_COPIED))
    assert v.readonly is True
    assert as_view(FakeDLPack((4,))).readonly is False


def test_torch_subclasses_defined_anywhere_take_the_torch_adapter():
    """A torch.Tensor subclass defined outside the torch package went through the CUDA Array
    Interface: conj/neg views read raw, requires_grad raised torch's RuntimeError, a CPU
    subclass torch's AttributeError; a wrapper subclass without storage (DTensor) is a
    TypeError, not data_ptr()'s RuntimeError."""
    torch = pytest.importorskip("torch")

    class Mine(torch.Tensor):
        pass

    t = torch.ones(3).as_subclass(Mine)
    assert _arrays.framework_of(t) is _arrays._from_torch
    with pytest.raises(TypeError, match="host data"):
        as_view(t)


def test_cai_readonly_flag():
    assert as_view(FakeCAI((2,), readonly=True)).readonly is True


def test_cai_mask_rejected():
    with pytest.raises(TypeError, match="masked CUDA arrays"):
        as_view(FakeCAI((2,), mask=object()))


def test_cai_misaligned_pointer_rejected():
    with pytest.raises(ValueError, match="not aligned to its item size 4"):
        as_view(FakeCAI((2,), "<f4", ptr=0x7F0000000002))


def test_cai_zero_size_pointer_zero():
    v = as_view(FakeCAI((0, 3), "<f2", ptr=0))
    assert v.ptr == 0 and v.size == 0


def test_cai_malformed_and_unknown_typestr():
    with pytest.raises(TypeError, match="malformed __cuda_array_interface__"):
        view_from_cai({"shape": (2,)}, None)
    with pytest.raises(TypeError, match="unsupported CUDA Array Interface typestr '<V2'"):
        as_view(FakeCAI((2,), "<V2"))
    with pytest.raises(TypeError, match="big-endian"):
        as_view(FakeCAI((2,), ">f4"))


@pytest.mark.parametrize("typestr,name", [("<f2", "float16"), ("<f4", "float32"),
                                          ("<f8", "float64"), ("<i4", "int32"), ("<i8", "int64"),
                                          ("|b1", "bool"), ("<c8", "complex64")])
def test_cai_dtypes(typestr, name):
    assert as_view(FakeCAI((2,), typestr)).dtype.name == name


# -- DLPack ----------------------------------------------------------------------------------
def test_dlpack_versioned_basic_and_stream_passed(monkeypatch):
    monkeypatch.setattr(_arrays, "_capturing", lambda stream: False)  # 77 is a made-up stream
    p = FakeDLPack((2, 3), code=2, bits=32)
    v = as_view(p, stream=77)
    assert p.asked_stream == 77
    assert v.shape == (2, 3) and v.strides == (3, 1) and v.dtype.name == "float32"
    assert v.device == 0 and v.kind == "dlpack" and v.readonly is False


def test_dlpack_legacy_stream_zero_becomes_one():
    p = FakeDLPack((4,), versioned=False)
    as_view(p, stream=0)
    assert p.asked_stream == 1  # 0 is forbidden in DLPack; the legacy default stream is 1


@pytest.mark.parametrize("capturing, asked", [({77}, -1), (set(), 77), (None, 77)])
def test_dlpack_capturing_stream_asks_for_no_synchronization(monkeypatch, capturing, asked):
    """A launch stream being captured into a CUDA graph is passed on as -1 (DLPack's "no
    synchronization"): the producer's event wait would end the capture. None: the runtime
    cannot answer (no GPU), so the stream is passed as it is."""
    def is_capturing(s):
        if capturing is None:
            raise RuntimeError("no GPU")
        return int(s in capturing)

    rt = types.SimpleNamespace(streamIsCapturing=is_capturing)
    monkeypatch.setattr(_runtime, "cupy",
                        lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt)))
    p = FakeDLPack((4,))
    as_view(p, stream=77)
    assert p.asked_stream == asked
    q = FakeDLPack((4,))
    as_view(q, stream=None)
    assert q.asked_stream == 1  # the legacy default stream is never asked about


@pytest.mark.parametrize("capturing, asked", [(True, None), (False, 77)])
def test_jax_is_asked_for_no_stream_while_capturing(monkeypatch, capturing, asked):
    """JAX takes -1 for a stream handle and fails; while the launch stream is captured it is
    given None instead (it then waits on the host and puts nothing on a stream)."""
    monkeypatch.setattr(_arrays, "_capturing", lambda stream: capturing)
    p = FakeDLPack((4,))
    v = _arrays._from_dlpack(p, "f: x", 77, "jax")
    assert p.asked_stream == asked and v.kind == "jax"
    q = FakeDLPack((4,))
    _arrays._from_dlpack(q, "f: x", 77)
    assert q.asked_stream == (-1 if capturing else 77)  # other producers get DLPack's -1


def test_dlpack_bfloat16_strides_offset_readonly():
    p = FakeDLPack((3, 2), code=4, bits=16, strides=(1, 3), byte_offset=8,
                   flags=_arrays.DLPACK_FLAG_READ_ONLY, device_id=1)
    v = as_view(p)
    assert v.dtype.name == "bfloat16"
    assert v.strides == (1, 3)  # DLPack strides are already in elements
    assert v.ptr == 0x7F0000001000 + 8
    assert v.readonly is True and v.device == 1


def test_dlpack_deleter_runs_once_when_view_dropped():
    p = FakeDLPack((4,))
    v = as_view(p)
    assert p.deleted == 0
    del v
    gc.collect()
    assert p.deleted == 1


def test_dlpack_host_device_rejected():
    with pytest.raises(TypeError, match="must be a CUDA device array"):
        as_view(FakeDLPack((4,), device_type=1))


def test_dlpack_bool_and_unknown_codes():
    assert as_view(FakeDLPack((4,), code=6, bits=8)).dtype.name == "bool"
    with pytest.raises(TypeError, match=r"unsupported DLPack dtype \(code=7, bits=8\)"):
        as_view(FakeDLPack((4,), code=7, bits=8))


# -- host data and junk ----------------------------------------------------------------------
@pytest.mark.parametrize("obj", [np.zeros(3, np.float32), [1.0, 2.0], np.float32(1.0).reshape(())])
def test_host_data_rejected(obj):
    with pytest.raises(TypeError, match="must be a CUDA device array .* got host data of type"):
        as_view(obj, "add: x")


def test_numpy_dlpack_is_host():
    # NumPy arrays speak DLPack too, with a CPU device: still host data.
    with pytest.raises(TypeError, match="host data of type numpy.ndarray"):
        as_view(np.arange(3.0), "x")


def test_adapter_cached_per_type():
    a = FakeCAI((2,))
    as_view(a)
    assert _arrays._ADAPTERS[FakeCAI] is _arrays._from_cai


# -- dtypes ----------------------------------------------------------------------------------
def test_dtype_table_and_aliases():
    assert [d.name for d in _dtypes.ARITHMETIC] == [
        "float16", "bfloat16", "float32", "float64", "int32", "int64", "bool", "int8", "int16",
        "uint8", "uint16", "uint32", "uint64", "complex64", "complex128"]
    assert _dtypes.from_name("bf16").name == "bfloat16"
    assert _dtypes.resolve(np.dtype("float16")).name == "float16"
    assert _dtypes.resolve("torch.int64").name == "int64"
    with pytest.raises(TypeError, match="unknown dtype 'float8'"):
        _dtypes.from_name("float8")


@pytest.mark.parametrize("v", [0.1, -3.75, 65504.0, 7e4, -1e9, 1e-8, 6.1e-5, float("inf")])
def test_half_scalar_bits_match_numpy(v):
    with np.errstate(over="ignore"):
        expect = int(np.array(v, np.float16).view(np.uint16))
    assert _dtypes.DTYPES["float16"].scalar_bits(v) == expect


def test_bf16_scalar_bits_round_to_nearest_even():
    bits = _dtypes.DTYPES["bfloat16"].scalar_bits
    assert bits(1.0) == 0x3F80
    assert bits(1.0 + 2**-8) == 0x3F80  # exactly half way to the next bf16: even wins
    assert bits(1.0 + 2**-8 + 2**-30) == 0x3F81  # just above half way (double rounding case)
    assert bits(float("nan")) == 0x7FC0
    assert bits(1e39) == 0x7F80
    ml = pytest.importorskip("ml_dtypes")
    for v in np.random.default_rng(0).standard_normal(1000) * 100:
        assert bits(float(v)) == int(np.array(v).astype(ml.bfloat16).view(np.uint16))


def test_int_scalar_range():
    with pytest.raises(OverflowError, match="out of bounds for int32"):
        _dtypes.DTYPES["int32"].scalar_bits(2**31)
    assert _dtypes.DTYPES["int64"].scalar_bits(-(2**63)) == -(2**63)


# -- errors a newcomer meets (no GPU: they must come before any device or stream lookup) -------
@pytest.mark.parametrize("device_type", [1, 3])  # kDLCPU, kDLCUDAHost
def test_host_dlpack_producer_is_a_type_error_before_any_gpu_call(device_type, monkeypatch):
    import cupylab
    from cupylab import _runtime

    def no_gpu(*a, **k):  # any runtime call here would be the bug
        raise AssertionError("the runtime was touched before the producer's device was checked")

    monkeypatch.setattr(_runtime, "cupy", no_gpu)
    host = FakeDLPack((4,), device_type=device_type)
    with pytest.raises(TypeError, match=r"add: x1 must be a CUDA device array .* got host data"):
        cupylab.add(host, host)
    k = cupylab.load_kernels(source='extern "C" __global__ void f(const float* a, int n) {}')["f"]
    with pytest.raises(TypeError, match=r"a.* got host data"):
        k(host, 4, grid=1)
    assert host.asked_stream == "unset"  # never imported


@pytest.mark.parametrize("bad, shown", [(None, "NoneType"), ("a", "str"), (object(), "object")])
def test_non_arrays_are_named_not_arrays(bad, shown):
    import cupylab

    with pytest.raises(TypeError, match=rf"add: x1 must be a CUDA device array .*got builtins\.{shown}, "
                                        r"which is not an array"):
        cupylab.add(bad, FakeCAI((2,)))


def test_numpy_data_is_called_host_data():
    import cupylab

    with pytest.raises(TypeError, match=r"got host data of type numpy\.ndarray"):
        cupylab.add(np.ones(2, np.float32), FakeCAI((2,)))
