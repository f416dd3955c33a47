"""Bring your own kernel, without a GPU: signature scanning, scalar packing, argument checks
(with fake CUDA Array Interface / DLPack objects, never dereferenced), and compiling user
sources to cubin for sm_80 / sm_90 with NVRTC (which needs no GPU)."""
import ctypes
import struct
from pathlib import Path

import numpy as np
import pytest

from cupylab import CompileError, _compile, _kmodule, _runtime
from cupylab import kernels as K
from cupylab.kernels import ElementwiseKernel, KernelNotFoundError, load_kernels

from conftest import FakeCAI, FakeDLPack

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "scripts" / "examples"


class ReachedGPU(Exception):
    """Raised by the patched runtime: every argument check passed and the launch path went
    on to ask the GPU something."""


@pytest.fixture
def no_gpu(monkeypatch):
    def boom(*a, **k):
        raise ReachedGPU()

    monkeypatch.setattr(_runtime, "pointer_device", boom)
    monkeypatch.setattr(_runtime, "current_device", boom)
    monkeypatch.setattr(_runtime, "cupy", boom)


def mod(src, **kw):
    return load_kernels(source=src, **kw)


def f32(n=8, **kw):
    return FakeCAI((n,), "<f4", **kw)


# =============================================================================================
# scanning signatures
SEED = r'''
#include <cuda_runtime.h>
extern "C" {

__global__ void vector_add_kernel(
    const float* __restrict__ a,
    const float* __restrict__ b,
    float* __restrict__ c,
    int n
) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n) {
        c[idx] = a[idx] + b[idx];
    }
}

}
'''


def test_parse_seed_extern_c_block():
    k = mod(SEED)["vector_add_kernel"]
    assert str(k.signature) == ("vector_add_kernel(const float* a, const float* b, float* c, "
                                "int n)")
    a, b, c, n = k.signature.params
    assert a.pointer and a.const and a.dtype.name == "float32"
    assert c.pointer and not c.const
    assert not n.pointer and n.fmt == "i" and n.name == "n"
    assert k.signature.formats == ("Q", "Q", "Q", "i")


def test_parse_const_variants_and_restrict():
    src = r'''extern "C" __global__ void k(const float* a, float const* b, float* const c,
        const float* const d, float *__restrict__ e, const float *__restrict e2,
        float** pp, const float* const* cpp, double arr[], const int carr[4]) {}'''
    ps = {p.name: p for p in mod(src)["k"].signature.params}
    assert ps["a"].const and ps["b"].const and ps["d"].const and ps["e2"].const
    assert not ps["c"].const and not ps["e"].const  # const pointer to mutable data
    assert ps["pp"].pointer and ps["pp"].dtype is None and not ps["pp"].const
    assert ps["cpp"].const  # the pointers it points at are const
    assert ps["arr"].pointer and ps["arr"].dtype.name == "float64" and not ps["arr"].const
    assert ps["carr"].pointer and ps["carr"].const and ps["carr"].dtype.name == "int32"


def test_parse_comments_whitespace_and_preprocessor():
    src = r'''
    // __global__ void in_comment(int x) {}
    /* __global__ void in_block_comment(int x) {} */
    #define MAKE(T) __global__ void made_##T(T* x) {}
    #if 0
    #endif
    extern   "C"
    __global__
    void
    __launch_bounds__( 256 , 2 )
    spaced  (  float  *  /* the output */ out ,   // trailing
               unsigned   n  /* count */ ,
               const char* msg = "a, b // not a comment" )
    { }
    '''
    m = mod(src)
    assert m.names == ["spaced"]
    assert str(m["spaced"].signature) == "spaced(float* out, unsigned int n, const char* msg)"


def test_parse_scalar_type_spellings():
    src = r'''
    typedef long long index_t;
    using real_t = double;
    extern "C" __global__ void s(int a, unsigned b, unsigned int c, long d, long int e,
        long long f, unsigned long long g, short h, unsigned short i, char j, signed char k,
        unsigned char l, bool m, float n, double o, size_t p, ptrdiff_t q, int64_t r,
        std::uint32_t s_, __half t, half u, __nv_bfloat16 v, index_t w, real_t x,
        long unsigned int y, signed z) {}'''
    sig = mod(src)["s"].signature
    got = {p.name: (p.ctype, p.fmt) for p in sig.params}
    L = "l"
    assert got == {
        "a": ("int", "i"), "b": ("unsigned int", "I"), "c": ("unsigned int", "I"),
        "d": ("long", L), "e": ("long", L), "f": ("long long", "q"),
        "g": ("unsigned long long", "Q"), "h": ("short", "h"), "i": ("unsigned short", "H"),
        "j": ("char", "b"), "k": ("signed char", "b"), "l": ("unsigned char", "B"),
        "m": ("bool", "?"), "n": ("float", "f"), "o": ("double", "d"), "p": ("size_t", "N"),
        "q": ("ptrdiff_t", "n"), "r": ("int64_t", "q"), "s_": ("uint32_t", "I"),
        "t": ("__half", "H"), "u": ("half", "H"), "v": ("__nv_bfloat16", "H"),
        "w": ("long long", "q"), "x": ("double", "d"), "y": ("unsigned long", "L"),
        "z": ("int", "i"),
    }


def test_parse_templates_namespaces_and_instances():
    src = r'''
    namespace lib { namespace detail {
    template <typename T, int N = 4, typename Acc = float>
    __global__ void __launch_bounds__(256) scale(T* __restrict__ x, const T* y, T s, Acc a,
                                                 long long n) {}
    } }
    template <class T> __global__ void plain(T v, T* out);
    template <class T> __global__ void plain(T v, T* out) { *out = v; }
    '''
    m = mod(src, name_expressions=["lib::detail::scale<double>"])
    assert m.names == ["lib::detail::scale<typename T, int N = 4, typename Acc = float>",
                       "plain<class T>"]
    assert m.program.name_expressions == ("lib::detail::scale<double>",)
    k = m["scale<double>"]  # a unique unqualified name works
    assert k.name == "lib::detail::scale<double>"
    assert str(k.signature) == ("lib::detail::scale<double>(double* x, const double* y, "
                                "double s, float a, long long n)")
    k2 = m["lib::detail::scale<unsigned int, 8, double>"]
    assert [p.fmt for p in k2.signature.params] == ["Q", "Q", "I", "d", "q"]
    assert k2.signature.params[0].dtype.name == "uint32"
    # instances not listed get a program of their own
    assert k2._k.program is not m.program
    assert k2._k.program.name_expressions == ("lib::detail::scale<unsigned int, 8, double>",)
    assert k._k.program is m.program
    assert str(m["plain<__half>"].signature) == "plain<__half>(__half v, __half* out)"
    with pytest.raises(TypeError, match=r"is a template: name an instance, e\.g\. "
                                        r"module\['plain<float>'\]"):
        m["plain"]
    with pytest.raises(TypeError, match="not a template"):
        mod('extern "C" __global__ void f(int a) {}')["f<float>"]
    with pytest.raises(TypeError, match="3 template arguments"):
        m["plain<int, int, int>"]


def test_parse_forward_declaration_overloads_and_unnamed():
    src = r'''
    __global__ void fwd(float*, int);
    __global__ void fwd(float* x, int n) {}
    __global__ void ov(int a) {}
    __global__ void ov(float a) {}
    __global__ void decl_only(float* x);
    extern "C" __global__ void unnamed(const float*, int) {}
    '''
    m = mod(src)
    assert str(m["fwd"].signature) == "fwd(float* x, int n)"
    assert "decl_only" not in m.program.name_expressions  # no body: not instantiated
    assert "ov" not in m.program.name_expressions
    with pytest.raises(ValueError, match="overloaded"):
        m["ov"]
    k = m["unnamed"]
    assert str(k.signature) == "unnamed(const float*, int)"
    with pytest.raises(TypeError, match=r"parameter #1 \(int\)"):
        k.pack(f32(), 1.5)


def test_kernel_not_found_lists_names():
    m = mod(SEED + "\ntemplate <typename T> __global__ void other(T* x) {}\n",
            filename="seed.cu")
    with pytest.raises(KernelNotFoundError) as e:
        m["vector_add"]
    msg = str(e.value)
    assert "'vector_add' is not a __global__ function of seed.cu" in msg
    assert "found: vector_add_kernel, other<typename T>" in msg
    assert isinstance(e.value, KeyError)
    # at load time too, before anything is compiled
    with pytest.raises(KernelNotFoundError, match="found: vector_add_kernel"):
        mod(SEED, name_expressions=["scale<float>"])
    assert "vector_add_kernel" in m and "nope" not in m


def test_declared_signature_for_macro_kernels():
    src = r'''
    #define MAKE(T) extern "C" __global__ void fill_##T(T* x, T v, int n) { \
        int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = v; }
    MAKE(float)
    MAKE(double)
    '''
    m = mod(src, signatures={"fill_float": "(float* x, float v, int n)",
                             "fill_double": "__global__ void fill_double(double* x, double v, "
                                            "int n)"})
    assert m.names == []
    assert str(m["fill_double"].signature) == "fill_double(double* x, double v, int n)"
    assert m["fill_float"].signature.declared
    assert set(m.program.name_expressions) == {"fill_float", "fill_double"}
    with pytest.raises(KernelNotFoundError, match="declare them with signatures="):
        m["fill_int"]


def test_declared_signature_overrides_scanner():
    m = mod('extern "C" __global__ void f(void* p, int n) {}',
            signatures={"f": "(const float* p, int n)"})
    assert str(m["f"].signature) == "f(const float* p, int n)"


def test_structs_by_value():
    src = r'''
    struct Params { float a; int b; double c; };
    extern "C" __global__ void k(Params p, float4 v, int2 w, float* out) {}
    extern "C" __global__ void r(float& x) {}
    '''
    with pytest.raises(ValueError, match=r"'p' \(Params p\) is a Params passed by value.*"
                                         r"struct_formats="):
        mod(src)["k"]
    with pytest.raises(ValueError, match="is a reference"):
        mod(src)["r"]
    k = mod(src, struct_formats={"Params": "fid"})["k"]
    # Params: a @0, b @4, c @8 -> 16 bytes; float4 16 bytes; int2 8 bytes
    assert k.signature.formats == ("16s", "16s", "8s", "Q")
    buf = k.pack((1.5, -2, 0.25), (1, 2, 3, 4), (7, 8), 0x1000)
    o = k.param_offsets
    assert struct.unpack_from("<fi", buf, o[0]) == (1.5, -2)
    assert struct.unpack_from("<d", buf, o[0] + 8) == (0.25,)
    assert struct.unpack_from("<4f", buf, o[1]) == (1, 2, 3, 4)
    assert struct.unpack_from("<2i", buf, o[2]) == (7, 8)
    assert struct.unpack_from("<Q", buf, o[3]) == (0x1000,)
    with pytest.raises(TypeError, match="tuple of 3 values"):
        k.pack(1.5, (1, 2, 3, 4), (7, 8), 0)
    with pytest.raises(TypeError, match="cannot pack"):
        k.pack((1.5, 2**40, 0.0), (1, 2, 3, 4), (7, 8), 0)

    class CParams(ctypes.Structure):
        _fields_ = [("a", ctypes.c_float), ("b", ctypes.c_int), ("c", ctypes.c_double)]

    k2 = mod(src, struct_formats={"Params": CParams})["k"]
    buf2 = k2.pack(CParams(1.5, -2, 0.25), (1, 2, 3, 4), (7, 8), 0x1000)
    assert buf2 == buf
    with pytest.raises(TypeError, match="pass a CParams instance"):
        k2.pack((1.5, -2, 0.25), (1, 2, 3, 4), (7, 8), 0)


# =============================================================================================
# scalar packing
PACK = r'''
extern "C" __global__ void p(int a, double b, long long c, __half h, unsigned char u, float f,
                             __nv_bfloat16 bf, bool flag, unsigned int ui, float* out) {}
'''


def test_scalar_packing_widths_and_offsets():
    k = mod(PACK)["p"]
    assert k.signature.formats == ("i", "d", "q", "H", "B", "f", "H", "?", "I", "Q")
    # natural alignment of each C type: int @0, double @8, long long @16, half @24 ...
    assert k.param_offsets == (0, 8, 16, 24, 26, 28, 32, 34, 36, 40)
    buf = k.pack(-7, 2.5, -(2**40), 1.0, 255, 0.1, 1.0, True, 2**32 - 1, 0xABCD00)
    o = k.param_offsets
    assert len(buf) == 48
    assert struct.unpack_from("<i", buf, o[0]) == (-7,)
    assert buf[4:8] == bytes(4)  # nothing leaked past the 4-byte int
    assert struct.unpack_from("<d", buf, o[1]) == (2.5,)
    assert struct.unpack_from("<q", buf, o[2]) == (-(2**40),)
    assert struct.unpack_from("<H", buf, o[3]) == (0x3C00,)  # half 1.0
    assert buf[o[4]] == 255
    assert struct.unpack_from("<f", buf, o[5]) == (np.float32(0.1),)
    assert struct.unpack_from("<H", buf, o[6]) == (0x3F80,)  # bfloat16 1.0
    assert buf[o[7]] == 1
    assert struct.unpack_from("<I", buf, o[8]) == (2**32 - 1,)
    assert struct.unpack_from("<Q", buf, o[9]) == (0xABCD00,)


def test_python_int_to_int_param_does_not_shift_later_arguments():
    # CuPy's RawKernel would pass the int as 8 bytes and put 'b' 4 bytes too far.
    k = mod('extern "C" __global__ void f(int n, float b, const float* x) {}')["f"]
    buf = k.pack(3, 2.0, 0x5000)
    assert struct.unpack_from("<ifQ", buf, 0) == (3, 2.0, 0x5000)


def test_numpy_scalars_and_0d_arrays():
    k = mod(PACK)["p"]
    buf = k.pack(np.int8(-7), np.float32(2.5), np.int64(-(2**40)), np.float16(1.0),
                 np.uint8(255), np.array(0.1), np.float64(1.0), np.True_, np.uint32(7), None)
    o = k.param_offsets
    assert struct.unpack_from("<i", buf, o[0]) == (-7,)
    assert struct.unpack_from("<d", buf, o[1]) == (2.5,)
    assert struct.unpack_from("<H", buf, o[3]) == (0x3C00,)
    assert buf[o[7]] == 1
    assert struct.unpack_from("<Q", buf, o[9]) == (0,)  # None -> nullptr


ARGS = (-7, 2.5, 1, 1.0, 1, 0.1, 1.0, True, 1, 0)


def _with(i, v):
    a = list(ARGS)
    a[i] = v
    return a


@pytest.mark.parametrize("i, value, exc, match", [
    (0, 2**31, OverflowError, r"parameter 'a' \(int a\): 2147483648 does not fit the C type int"),
    (0, -(2**31) - 1, OverflowError, "does not fit the C type int"),
    (8, -1, OverflowError, r"'ui' \(unsigned int ui\): -1 does not fit"),
    (4, 256, OverflowError, "unsigned char"),
    (2, 2**63, OverflowError, "long long"),
    (0, 1.5, TypeError, r"'a' \(int a\) is an integer parameter \(int\) but got the float 1.5"),
    (0, 2.0, TypeError, "got the float 2.0"),
    (0, np.float32(1), TypeError, "got the float"),
    (0, "3", TypeError, "integer parameter"),
    (5, 1e39, OverflowError, r"'f' \(float f\): 1e\+39 is out of range for the C type float"),
    (3, 70000.0, OverflowError, "out of range for the C type __half"),
    (6, 1e39, OverflowError, "__nv_bfloat16"),
    (1, 10**400, OverflowError, "does not fit the C type double"),
    (1, 1j, TypeError, "complex"),
    (7, 2, TypeError, "bool parameter"),
    (0, f32(), TypeError, r"'a' \(int a\) is a scalar parameter \(int\) but got an array"),
    (1, np.zeros(3), TypeError, r"scalar parameter \(double\) but got an array of shape \(3,\)"),
    (1, [1.0], TypeError, "scalar parameter"),
])
def test_scalar_checks(i, value, exc, match):
    k = mod(PACK)["p"]
    with pytest.raises(exc, match=match):
        k.pack(*_with(i, value))


def test_float_specials_pass():
    k = mod(PACK)["p"]
    buf = k.pack(*_with(5, float("inf")))
    assert struct.unpack_from("<f", buf, k.param_offsets[5])[0] == float("inf")
    k.pack(*_with(3, float("nan")))
    k.pack(*_with(1, 10**300))  # an int that fits a double


# =============================================================================================
# pointer arguments
VADD = 'extern "C" __global__ void vadd(const float* x, const float* y, float* out, int n) {}'


def test_pointer_args_from_cai_addresses_and_none():
    k = mod(VADD)["vadd"]
    buf = k.pack(f32(ptr=0x7F0000000100), 0x7F0000000200, None, 8)
    assert struct.unpack_from("<QQQi", buf, 0) == (0x7F0000000100, 0x7F0000000200, 0, 8)
    with pytest.raises(OverflowError, match="64-bit"):
        k.pack(f32(), -1, f32(), 8)


def test_host_array_refused():
    k = mod(VADD)["vadd"]
    with pytest.raises(TypeError, match=r"vadd: parameter 'x' \(const float\* x\) must be a "
                                        r"CUDA device array .* got host data of type "
                                        r"numpy\.ndarray"):
        k.pack(np.zeros(8, np.float32), f32(), f32(), 8)
    with pytest.raises(TypeError, match="host data of type builtins.list"):
        k.pack(f32(), [1.0], f32(), 8)
    with pytest.raises(TypeError, match="host data of type builtins.float"):
        k.pack(f32(), 1.5, f32(), 8)


def test_dtype_must_match_pointee():
    k = mod(VADD)["vadd"]
    with pytest.raises(TypeError, match=r"parameter 'y' \(const float\* y\) needs float32 data "
                                        r"but got a float64"):
        k.pack(f32(), FakeCAI((8,), "<f8"), f32(), 8)
    anyp = mod('extern "C" __global__ void m(void* a, char* b, const unsigned char* c) {}')["m"]
    anyp.pack(FakeCAI((8,), "<f8"), FakeCAI((8,), "<i4"), FakeCAI((8,), "|u1"))
    h = mod('extern "C" __global__ void h(__half* a, long long* b, size_t* c, bool* d) {}')["h"]
    h.pack(FakeCAI((8,), "<f2"), FakeCAI((8,), "<i8"), FakeCAI((8,), "<u8"),
           FakeCAI((8,), "|b1"))
    with pytest.raises(TypeError, match="needs uint64 data but got a int64"):
        h.pack(FakeCAI((8,), "<f2"), FakeCAI((8,), "<i8"), FakeCAI((8,), "<i8"), None)
    # CUDA's complex types take complex arrays; float2 / double2 stay raw pairs in a Kernel
    c = mod('extern "C" __global__ void c(float2* a, const double2* b, cuComplex* z) {}')["c"]
    c.pack(FakeCAI((8,), "<c8"), FakeCAI((8,), "<c16"), FakeCAI((8,), "<c8"))
    c.pack(FakeCAI((8,), "<f4"), FakeCAI((8,), "<f8"), FakeCAI((8,), "<c8"))
    with pytest.raises(TypeError, match="needs complex64 data but got a float32"):
        c.pack(FakeCAI((8,), "<c8"), FakeCAI((8,), "<c16"), FakeCAI((8,), "<f4"))


def test_a_type_defined_by_preprocessor_branches_is_reported_not_guessed():
    """The scanner does not run the preprocessor: both branches of #ifdef define `real`, and
    the last one used to win (float, while -DUSE_DOUBLE compiled double): the kernel's use
    now says to declare the signature, and signatures= makes it usable."""
    src = ('#ifdef USE_DOUBLE\ntypedef double real;\n#else\ntypedef float real;\n#endif\n'
           'extern "C" __global__ void axpy(real* y, const real* x, real a, int n) {}\n')
    m = load_kernels(source=src, options=["-DUSE_DOUBLE"])
    with pytest.raises(ValueError, match=r"type .real. is defined more than once.*signatures="):
        m["axpy"].pack(FakeCAI((8,), "<f8"), FakeCAI((8,), "<f8"), 2.0, 8)
    k = load_kernels(source=src, options=["-DUSE_DOUBLE"],
                     signatures={"axpy": "(double* y, const double* x, double a, int n)"})["axpy"]
    k.pack(FakeCAI((8,), "<f8"), FakeCAI((8,), "<f8"), 2.0, 8)
    same = ('typedef float real;\ntypedef float real;\n'
            'extern "C" __global__ void s(real* y, int n) {}\n')
    load_kernels(source=same)["s"].pack(FakeCAI((8,), "<f4"), 8)  # a repeated equal alias


def test_a_type_defined_differently_by_two_headers_is_reported_not_guessed(tmp_path):
    """Headers included from the branches of an #ifdef each define `real`: the first header
    scanned used to win (double, while the build without -DUSE_DOUBLE compiled float, so the
    scalar was packed as 8 bytes); as within one file, the kernel's use says to declare the
    signature."""
    (tmp_path / "real_double.h").write_text("typedef double real;\n")
    (tmp_path / "real_float.h").write_text("typedef float real;\n")
    (tmp_path / "same.h").write_text("typedef float real;\n")
    cu = tmp_path / "k.cu"
    cu.write_text('#ifdef USE_DOUBLE\n#include "real_double.h"\n#else\n#include "real_float.h"\n'
                  '#endif\nextern "C" __global__ void axpy(real* x, real a, int n) {}\n')
    with pytest.raises(ValueError, match=r"type .real. is defined more than once.*signatures="):
        load_kernels(cu)["axpy"].pack(FakeCAI((8,), "<f4"), 2.0, 8)
    ok = tmp_path / "ok.cu"  # the same alias in a header and the file: no ambiguity
    ok.write_text('#include "same.h"\ntypedef float real;\n'
                  'extern "C" __global__ void s(real* y, int n) {}\n')
    load_kernels(ok)["s"].pack(FakeCAI((8,), "<f4"), 8)


def test_elementwise_kernel_refuses_pointers_it_cannot_count(sim):
    """ElementwiseKernel passes the arrays' element count: a pointee cupylab has no dtype for
    (float4, a struct, a pointer) would be indexed past the arrays' end."""
    m = mod('extern "C" __global__ void v4(float4* out, const float4* a, long long n) {}\n'
            'extern "C" __global__ void raw(void* out, const void* a, long long n) {}')
    e = ElementwiseKernel(m["v4"])
    with pytest.raises(TypeError, match=r"cannot tell how many float4 elements"):
        e(FakeCAI((8,), "<f4"), out=FakeCAI((8,), "<f4", ptr=0x7F00_0001_0000))
    p2 = load_kernels(source='extern "C" __global__ void p2(float2* o, const float2* a, '
                             'long long n) {}')
    with pytest.raises(TypeError, match=r"needs complex64 arrays \(one element a float2\)"):
        ElementwiseKernel(p2["p2"])(FakeCAI((8,), "<f4"),
                                    out=FakeCAI((8,), "<f4", ptr=0x7F00_0003_0000))
    assert sim["launches"] == []
    ElementwiseKernel(m["raw"])(FakeCAI((8,), "<f4"),
                                out=FakeCAI((8,), "<f4", ptr=0x7F00_0002_0000))
    assert len(sim["launches"]) == 1


def test_readonly_array_needs_const_pointer():
    k = mod(VADD)["vadd"]
    k.pack(f32(readonly=True), f32(readonly=True), f32(), 8)  # const inputs: fine
    with pytest.raises(ValueError, match=r"'out' \(float\* out\) is a non-const pointer.*"
                                         r"read-only cai array"):
        k.pack(f32(), f32(), f32(readonly=True), 8)
    ro = FakeDLPack((8,), flags=1)  # DLPack READ_ONLY
    with pytest.raises(ValueError, match="read-only dlpack array"):
        k.pack(f32(), f32(), ro, 8)
    k.pack(FakeDLPack((8,), flags=1), f32(), FakeDLPack((8,)), 8)


def test_wrong_argument_count():
    k = mod(VADD)["vadd"]
    with pytest.raises(TypeError, match=r"^vadd\(const float\* x, const float\* y, float\* out, "
                                        r"int n\) takes 4 arguments \(got 3\)$"):
        k(f32(), f32(), f32(), grid=1)


def test_checks_run_before_any_gpu_call(no_gpu):
    k = mod(VADD)["vadd"]
    # every failure above is raised before the runtime is touched ...
    with pytest.raises(TypeError, match="needs float32 data"):
        k(f32(), FakeCAI((8,), "<f8"), f32(), 8, grid=1)
    with pytest.raises(OverflowError):
        k.launch_1d(8, f32(), f32(), f32(), 2**31)
    # ... and a valid call goes on to the GPU
    with pytest.raises(ReachedGPU):
        k(f32(), f32(), f32(), 8, grid=1, block=256)
    with pytest.raises(ReachedGPU):
        k.launch_1d(8, f32(), f32(), f32(), 8)


def test_empty_launch_launches_nothing(no_gpu):
    k = mod(VADD)["vadd"]
    k(f32(0, ptr=0), f32(0, ptr=0), f32(0, ptr=0), 0, grid=0)
    k(f32(), f32(), f32(), 0, grid=(4, 0))
    k.launch_1d(0, f32(), f32(), f32(), 0)
    with pytest.raises(TypeError, match="needs float32 data"):  # still checked
        k.launch_1d(0, f32(), FakeCAI((8,), "<i4"), f32(), 0)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(grid=1, block=0), ValueError, "block dimensions must be >= 1"),
    (dict(grid=1, block=(32, 33)), ValueError, "1056 threads; CUDA allows at most 1024"),
    (dict(grid=-1), ValueError, "grid dimensions must be >= 0"),
    (dict(grid=(1, 70000)), ValueError, "exceeds CUDA's limits"),
    (dict(grid=1.5), TypeError, "grid must be an int or a tuple"),
    (dict(grid=(1, 2, 3, 4)), TypeError, "grid must be an int or a tuple"),
    (dict(grid=1, shared_mem=-1), ValueError, "shared_mem"),
])
def test_launch_configuration_checks(kw, exc, match):
    k = mod(VADD)["vadd"]
    with pytest.raises(exc, match=match):
        k(f32(), f32(), f32(), 8, **kw)


def test_launch_1d_checks():
    k = mod(VADD)["vadd"]
    with pytest.raises(ValueError, match="n must be a non-negative int"):
        k.launch_1d(-1, f32(), f32(), f32(), 8)
    with pytest.raises(ValueError, match="1-D block"):
        k.launch_1d(8, f32(), f32(), f32(), 8, block=(16, 16))


def test_grid_cap_constant():
    assert K.BLOCKS_PER_SM_1D == 32


# =============================================================================================
# ElementwiseKernel
FUSED = r'''
template <typename T>
__global__ void fam(T* out, const T* a, const T* b, T s, long long n) {}
extern "C" __global__ void addf(const float* x, const float* y, float* z, int n) {}
extern "C" __global__ void two_out(float* a, float* b, int n) {}
extern "C" __global__ void no_size(float* a, const float* b) {}
'''


def test_elementwise_layout_and_defaults():
    m = mod(FUSED)
    e = ElementwiseKernel(m, "fam<{T}>")
    assert e.name == "fam"
    assert e._out == 0 and e._size == 4 and e._operands == [1, 2, 3]
    e2 = ElementwiseKernel(m["addf"])
    assert e2._out == 2 and e2._size == 3 and e2._labels == ["x", "y"]
    with pytest.raises(ValueError, match="cannot tell which parameter is the output"):
        ElementwiseKernel(m["two_out"])
    assert ElementwiseKernel(m["two_out"], out="b")._operands == [0]
    with pytest.raises(ValueError, match="not an integer element count"):
        ElementwiseKernel(m["no_size"])
    with pytest.raises(ValueError, match="out='y' names const float\\* y, which is not a "
                                         "non-const pointer"):
        ElementwiseKernel(m["addf"], out="y")
    with pytest.raises(ValueError, match="size='q' is not a parameter"):
        ElementwiseKernel(m["addf"], size="q")
    with pytest.raises(TypeError, match="Kernel or KernelModule"):
        ElementwiseKernel(lambda x: x)


def test_elementwise_argument_checks(no_gpu):
    m = mod(FUSED)
    e = ElementwiseKernel(m, "fam<{T}>")
    with pytest.raises(TypeError, match=r"fam\(\) takes 3 operands \(a, b, s\) \(got 2\)"):
        e(f32(), f32())
    with pytest.raises(TypeError, match="host data"):
        e(np.zeros(8, np.float32), f32(), 1.0)
    with pytest.raises(TypeError, match="must be a GPU array"):
        e(f32(), 2.0, 1.0)
    with pytest.raises(TypeError, match="dtypes must match"):
        e(f32(), FakeCAI((8,), "<f8"), 1.0)
    with pytest.raises(TypeError, match=r"'s' \(int s\) is an integer parameter"):
        e(FakeCAI((8,), "<i4"), FakeCAI((8,), "<i4"), 1.5)  # picks fam<int>: s is an int
    with pytest.raises(TypeError, match="no C type for dtype complex64"):
        e(FakeCAI((8,), "<c8"), FakeCAI((8,), "<c8"), 1.0)
    with pytest.raises(ReachedGPU):
        e(f32(), f32(), 2.0)
    assert set(e._instances) == {"float32", "int32"}
    fixed = ElementwiseKernel(m["addf"])
    with pytest.raises(TypeError, match=r"'x' \(const float\* x\) needs float32 arrays but "
                                        r"the arrays are float64"):
        fixed(FakeCAI((8,), "<f8"), FakeCAI((8,), "<f8"))


# =============================================================================================
# compiling user sources (no GPU needed)
def test_compile_user_source_to_cubin(cache):
    src = SEED.replace("#include <cuda_runtime.h>\n", "") + r'''
    template <typename T> __global__ void scale(T* x, T s, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= s; }
    '''
    m = load_kernels(source=src, name_expressions=["scale<float>", "scale<double>"],
                     options=("-DUNUSED=1",))
    for cc in (80, 90):
        mapping = m.compile(cc=cc)
        assert mapping["vector_add_kernel"] == "vector_add_kernel"
        assert mapping["scale<float>"].startswith("_Z")
        binary, _, kind, _ = _compile.compile_program(m.program, cc)
        assert kind == "cubin" and binary[:4] == b"\x7fELF"


def test_examples_compile(cache, monkeypatch):
    # fresh modules: instances that earlier tests of this process asked for would be compiled too
    monkeypatch.setattr(_kmodule, "_modules", {})
    for cc in (80, 90):
        assert load_kernels(EXAMPLES / "vector_add.cu").compile(cc=cc) == {
            "vector_add": "vector_add"}
        fm = load_kernels(EXAMPLES / "fused.cu")
        fm["fused_add_mul<float>"], fm["fused_add_mul<double>"]
        assert set(fm.compile(cc=cc)) == {"fused_add_mul<float>", "fused_add_mul<double>"}
    sig = load_kernels(EXAMPLES / "fused.cu")["fused_add_mul<float>"].signature
    assert str(sig) == ("fused_add_mul<float>(float* out, const float* a, const float* b, "
                        "float s, long long n)")


def test_disk_cache_hit_and_header_change(cache, tmp_path):
    d = tmp_path / "proj"
    (d / "inc").mkdir(parents=True)
    hdr = d / "inc" / "ops.cuh"
    hdr.write_text("__device__ inline float op(float a) { return a * 2.0f; }\n")
    cu = d / "k.cu"
    cu.write_text('#include "ops.cuh"\n'
                  'extern "C" __global__ void k(float* x, int n) {\n'
                  '  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = op(x[i]);'
                  '\n}\n')
    s0 = dict(_compile.stats)
    load_kernels(cu, include_dirs=[d / "inc"]).compile(cc=90)
    assert _compile.stats["compiled"] == s0["compiled"] + 1
    _kmodule._modules.clear()  # as in a new process: new module objects, same disk cache
    load_kernels(cu, include_dirs=[d / "inc"]).compile(cc=90)
    assert _compile.stats["compiled"] == s0["compiled"] + 1
    assert _compile.stats["disk_hits"] == s0["disk_hits"] + 1
    assert len(list(cache.glob("*.clbin"))) == 1
    hdr.write_text("__device__ inline float op(float a) { return a * 3.0f; }\n")
    m = load_kernels(cu, include_dirs=[d / "inc"])  # the header changed: a new module
    m.compile(cc=90)
    assert _compile.stats["compiled"] == s0["compiled"] + 2
    assert len(list(cache.glob("*.clbin"))) == 2


def test_same_module_returned_while_nothing_changed(tmp_path):
    cu = tmp_path / "k.cu"
    cu.write_text(VADD)
    a = load_kernels(cu)
    assert load_kernels(cu) is a
    assert a["vadd"] is a["vadd"]
    cu.write_text(VADD + "\n// edited\n")
    assert load_kernels(cu) is not a


def test_compile_error_names_file_and_line(cache, tmp_path):
    cu = tmp_path / "broken.cu"
    cu.write_text('extern "C" __global__ void k(float* x) {\n'
                  '    x[0] = undefined_thing;\n'
                  '}\n')
    m = load_kernels(cu)
    with pytest.raises(CompileError) as e:
        m.compile(cc=90)
    assert f"{cu}(2): error" in str(e.value)
    assert "undefined_thing" in e.value.log
    assert e.value.filename == str(cu)
    m2 = load_kernels(source="extern \"C\" __global__ void k() { syntax error }",
                      filename="mine.cu")
    with pytest.raises(CompileError, match=r"mine\.cu\(1\): error"):
        m2.compile(cc=80)


def test_include_dirs_and_options(cache, tmp_path):
    inc = tmp_path / "include"
    inc.mkdir()
    (inc / "scale.cuh").write_text("#define SCALE 2\n"
                                   "template <typename T> __global__ void from_header(T* x) {}\n")
    m = load_kernels(source='#include "scale.cuh"\n'
                            'extern "C" __global__ void k(float* x) { x[0] = SCALE * FACTOR; }',
                     include_dirs=[inc], options=("-DFACTOR=3",),
                     name_expressions=["from_header<float>"])
    assert "from_header<typename T>" in m.names  # kernels in user headers are found too
    assert set(m.compile(cc=90)) == {"k", "from_header<float>"}
    m_bad = load_kernels(source='#include "scale.cuh"\n'
                                'extern "C" __global__ void k(float* x) { x[0] = FACTOR; }',
                         include_dirs=[inc])
    with pytest.raises(CompileError, match="FACTOR"):
        m_bad.compile(cc=90)


def test_cuda_headers_found_when_installed(cache):
    if K.cuda_include_dir() is None:
        pytest.skip("no CUDA toolkit headers (cuda_fp16.h) on this machine")
    m = load_kernels(source='#include <cuda_fp16.h>\n'
                            'extern "C" __global__ void h(__half* x, __half s) { x[0] = s; }')
    assert m.compile(cc=90) == {"h": "h"}
    assert m["h"].signature.formats == ("Q", "H")


def test_load_kernels_arguments(tmp_path):
    with pytest.raises(TypeError, match="either a path or source="):
        load_kernels()
    with pytest.raises(TypeError, match="either a path or source="):
        load_kernels(tmp_path / "x.cu", source="")
    with pytest.raises(FileNotFoundError):
        load_kernels(tmp_path / "missing.cu")
    cu = tmp_path / "v.cu"
    cu.write_text(VADD)
    assert load_kernels(str(cu)).filename == str(cu)


def test_parse_kernels_and_parse_signature_helpers():
    assert K.parse_kernels(SEED) == {
        "vector_add_kernel": "vector_add_kernel(const float* __restrict__ a, const float* "
                             "__restrict__ b, float* __restrict__ c, int n)"}
    s = K.parse_signature("(const float* x, float* y, unsigned n)", "f")
    assert s.formats == ("Q", "Q", "I") and str(s) == "f(const float* x, float* y, unsigned int n)"
    with pytest.raises(ValueError, match="parameter list"):
        K.parse_signature("const float* x", "f")


# =============================================================================================
# the launch path, with a simulated runtime: what would reach cuLaunchKernel
def test_simulated_launches(sim):
    k = mod(VADD)["vadd"]
    x, y, o = f32(ptr=0x1000), f32(ptr=0x2000), f32(ptr=0x3000, stream=0x99)
    k(x, y, o, 8, grid=(3, 2), block=(32, 4))
    k.launch_1d(10**8, x, y, o, 8, block=128)
    k.launch_1d(1000, x, y, o, 8, stream=0x42)
    L = sim["launches"]
    assert L[0] == dict(name="vadd", grid=(3, 2, 1), block=(32, 4, 1), stream=0x5700,
                        args=(0x1000, 0x2000, 0x3000, 8), smem=0)
    assert L[1]["grid"] == (132 * K.BLOCKS_PER_SM_1D, 1, 1)  # capped: grid-stride loop
    assert L[2]["grid"] == (4, 1, 1) and L[2]["stream"] == 0x42
    assert sim["waits"] == [(0x5700, 0x99), (0x5700, 0x99), (0x42, 0x99)]  # CAI v3 stream
    with pytest.raises(ValueError, match="exceeds the device's limit"):
        k(x, y, o, 8, grid=1, shared_mem=300 * 1024)


def test_simulated_dlpack_gets_launch_stream(sim):
    k = mod(VADD)["vadd"]
    d = FakeDLPack((8,), ptr=0x4000)
    k(d, f32(), f32(), 8, grid=1)
    assert d.asked_stream == 0x5700
    assert sim["launches"][-1]["args"][0] == 0x4000


def test_elementwise_kernel_waits_on_a_given_outs_producer_stream(sim):
    """A CUDA Array Interface v3 out's stream is waited on, like the inputs' (its pending
    work could overlap the launch's writes); the operators did, ElementwiseKernel did not."""
    e = ElementwiseKernel(mod(FUSED), "fam<{T}>")
    a = FakeCAI((4, 50), "<f8", ptr=0x1000, stream=0x1111)
    b = FakeCAI((4, 50), "<f8", ptr=0x2000)
    e(a, b, 0.5, out=FakeCAI((4, 50), "<f8", ptr=0x9000, stream=0x2222))
    assert sim["waits"] == [(0x5700, 0x1111), (0x5700, 0x2222)]


def test_simulated_elementwise(sim):
    m = mod(FUSED)
    e = ElementwiseKernel(m, "fam<{T}>", block=128)
    a, b = FakeCAI((4, 50), "<f8", ptr=0x1000), FakeCAI((4, 50), "<f8", ptr=0x2000)
    out = FakeCAI((4, 50), "<f8", ptr=0x9000)
    r = e(a, b, 0.5, out=out)
    assert r is out
    L = sim["launches"][-1]
    assert L["name"] == "fam<double>" and L["grid"] == (2, 1, 1) and L["block"] == (128, 1, 1)
    assert L["args"] == (0x9000, 0x1000, 0x2000, 0.5, 200) and L["stream"] == 0x5700
    with pytest.raises(ValueError, match="C-contiguous with the output's shape"):
        e(FakeCAI((4, 50), "<f8", strides=(8, 32)), b, 0.5, out=out)
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        e(a, b, 0.5, out=FakeCAI((4, 50), "<f8", ptr=0x9000, strides=(8, 32)))
    n = len(sim["launches"])
    e(FakeCAI((0, 3), "<f8", ptr=0), FakeCAI((0, 3), "<f8", ptr=0), 1.0,
      out=FakeCAI((0, 3), "<f8", ptr=0))
    assert len(sim["launches"]) == n  # empty: nothing launched
    addf = ElementwiseKernel(m["addf"])
    big = FakeCAI((2**31,), "<f4")
    with pytest.raises(OverflowError, match=r"'n' \(int n\): 2147483648 does not fit"):
        addf(big, big, out=FakeCAI((2**31,), "<f4", ptr=0x7F1000000000))
