// cupylab device helpers shared by every kernel: dtype traits, conversions, 16-byte vectors.
//
// Self-contained on purpose: no <cuda_fp16.h>/<cuda_bf16.h>, so NVRTC needs no CUDA include
// path (pip-installed CuPy may not have one). Half and bfloat16 are stored as 16-bit words and
// converted with PTX `cvt`, which is what the CUDA headers do underneath.
#pragma once

namespace cl {

typedef long long i64;
typedef unsigned long long u64;

// 16-bit float storage types. Layout matches torch.float16 / torch.bfloat16 / ml_dtypes.
struct __align__(2) half_t { unsigned short bits; };
struct __align__(2) bf16_t { unsigned short bits; };

// The type arithmetic is done in ("accumulator type"): 16-bit floats compute in float and
// round once when stored, which is never less accurate than the framework's own kernels.
template <typename T> struct Acc { typedef T type; };
template <> struct Acc<half_t> { typedef float type; };
template <> struct Acc<bf16_t> { typedef float type; };

template <typename T>
__device__ __forceinline__ typename Acc<T>::type to_acc(T v) { return v; }

template <>
__device__ __forceinline__ float to_acc<half_t>(half_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}

template <>
__device__ __forceinline__ float to_acc<bf16_t>(bf16_t v) {
    return __uint_as_float(((unsigned int)v.bits) << 16);
}

template <typename T>
__device__ __forceinline__ T from_acc(typename Acc<T>::type v) { return (T)v; }

template <>
__device__ __forceinline__ half_t from_acc<half_t>(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}

template <>
__device__ __forceinline__ bf16_t from_acc<bf16_t>(float f) {
    bf16_t h;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
#else
    // Round to nearest even by hand; NaN stays a (quiet) NaN.
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        h.bits = (unsigned short)(u >> 16);
    }
#endif
    return h;
}

// Integer arithmetic wraps modulo 2^bits like NumPy and torch (signed overflow is undefined
// in C++, so it is done on the unsigned twin).
template <typename T> struct Unsigned { typedef T type; };
template <> struct Unsigned<int> { typedef unsigned int type; };
template <> struct Unsigned<long long> { typedef unsigned long long type; };

template <typename T> struct IsInt { static constexpr bool value = false; };
template <> struct IsInt<int> { static constexpr bool value = true; };
template <> struct IsInt<long long> { static constexpr bool value = true; };

// N elements of T in one aligned word: a 16-byte vector when sizeof(T) * N == 16.
template <typename T, int N>
struct __align__(sizeof(T) * N) Vec { T v[N]; };

// ---------------------------------------------------------------------------------------------
// Every dtype NumPy's arithmetic takes: complex storage types, traits for all integer widths,
// and cvt<To>(from), NumPy's astype() for one value.

struct __align__(8) complex64_t { float re, im; };
struct __align__(16) complex128_t { double re, im; };

template <> struct Unsigned<signed char> { typedef unsigned char type; };
template <> struct Unsigned<short> { typedef unsigned short type; };
template <> struct IsInt<signed char> { static constexpr bool value = true; };
template <> struct IsInt<short> { static constexpr bool value = true; };
template <> struct IsInt<unsigned char> { static constexpr bool value = true; };
template <> struct IsInt<unsigned short> { static constexpr bool value = true; };
template <> struct IsInt<unsigned int> { static constexpr bool value = true; };
template <> struct IsInt<unsigned long long> { static constexpr bool value = true; };

template <typename T> struct IsSigned { static constexpr bool value = (T)-1 < (T)0; };
template <> struct IsSigned<half_t> { static constexpr bool value = true; };
template <> struct IsSigned<bf16_t> { static constexpr bool value = true; };
template <> struct IsSigned<complex64_t> { static constexpr bool value = true; };
template <> struct IsSigned<complex128_t> { static constexpr bool value = true; };

template <typename T> struct IsComplex { static constexpr bool value = false; };
template <> struct IsComplex<complex64_t> { static constexpr bool value = true; };
template <> struct IsComplex<complex128_t> { static constexpr bool value = true; };

template <typename A, typename B> struct IsSame { static constexpr bool value = false; };
template <typename A> struct IsSame<A, A> { static constexpr bool value = true; };

// widen: a value in a type C++ converts from (16-bit floats become float; the rest stay).
template <typename T> __device__ __forceinline__ T widen(T v) { return v; }
__device__ __forceinline__ float widen(half_t v) { return to_acc<half_t>(v); }
__device__ __forceinline__ float widen(bf16_t v) { return to_acc<bf16_t>(v); }

// double -> float rounded to odd, so that a second rounding (to bfloat16) is correct.
__device__ __forceinline__ float f32_round_odd(double d) {
    float f = __double2float_rz(d);
    if ((double)f != d && f == f) f = __uint_as_float(__float_as_uint(f) | 1u);
    return f;
}

template <typename W> __device__ __forceinline__ half_t half_from(W w) {
    return from_acc<half_t>((float)w);
}
__device__ __forceinline__ half_t half_from(double d) {
    half_t h;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h.bits) : "d"(d));
    return h;
}
__device__ __forceinline__ half_t half_from(long long w) { return half_from((double)w); }
__device__ __forceinline__ half_t half_from(unsigned long long w) { return half_from((double)w); }

template <typename W> __device__ __forceinline__ bf16_t bf16_from(W w) {
    return from_acc<bf16_t>((float)w);
}
__device__ __forceinline__ bf16_t bf16_from(double d) { return from_acc<bf16_t>(f32_round_odd(d)); }
__device__ __forceinline__ bf16_t bf16_from(int w) { return bf16_from((double)w); }
__device__ __forceinline__ bf16_t bf16_from(unsigned int w) { return bf16_from((double)w); }
__device__ __forceinline__ bf16_t bf16_from(long long w) { return bf16_from((double)w); }
__device__ __forceinline__ bf16_t bf16_from(unsigned long long w) { return bf16_from((double)w); }

// narrow: a widened value to the target storage type. Complex to real keeps the real part
// (NumPy's unsafe cast); complex to bool tests both parts.
// Floats to integers go through a 64-bit integer and wrap to the narrower type, as NumPy's C
// casts do on x86-64 for values inside the 64-bit range (a direct float -> int8 conversion on
// the GPU would saturate); beyond it the result is undefined in NumPy too.
template <typename To> struct Narrow {
    template <typename W> static __device__ __forceinline__ To run(W w) {
        if constexpr (IsInt<To>::value && !IsInt<W>::value && !IsSame<W, bool>::value) {
            if constexpr (sizeof(To) == 8 && !IsSigned<To>::value) {
                return w >= (W)9223372036854775808.0 ? (To)w : (To)(long long)w;
            } else {
                return (To)(long long)w;
            }
        } else {
            return (To)w;
        }
    }
    static __device__ __forceinline__ To run(complex64_t w) { return run(w.re); }
    static __device__ __forceinline__ To run(complex128_t w) { return run(w.re); }
};
template <> struct Narrow<bool> {
    template <typename W> static __device__ __forceinline__ bool run(W w) { return w != (W)0; }
    static __device__ __forceinline__ bool run(complex64_t w) { return w.re != 0 || w.im != 0; }
    static __device__ __forceinline__ bool run(complex128_t w) { return w.re != 0 || w.im != 0; }
};
template <> struct Narrow<half_t> {
    template <typename W> static __device__ __forceinline__ half_t run(W w) { return half_from(w); }
    static __device__ __forceinline__ half_t run(complex64_t w) { return half_from(w.re); }
    static __device__ __forceinline__ half_t run(complex128_t w) { return half_from(w.re); }
};
template <> struct Narrow<bf16_t> {
    template <typename W> static __device__ __forceinline__ bf16_t run(W w) { return bf16_from(w); }
    static __device__ __forceinline__ bf16_t run(complex64_t w) { return bf16_from(w.re); }
    static __device__ __forceinline__ bf16_t run(complex128_t w) { return bf16_from(w.re); }
};
template <> struct Narrow<complex64_t> {
    template <typename W> static __device__ __forceinline__ complex64_t run(W w) {
        return complex64_t{(float)w, 0.0f};
    }
    static __device__ __forceinline__ complex64_t run(complex64_t w) { return w; }
    static __device__ __forceinline__ complex64_t run(complex128_t w) {
        return complex64_t{(float)w.re, (float)w.im};
    }
};
template <> struct Narrow<complex128_t> {
    template <typename W> static __device__ __forceinline__ complex128_t run(W w) {
        return complex128_t{(double)w, 0.0};
    }
    static __device__ __forceinline__ complex128_t run(complex64_t w) {
        return complex128_t{(double)w.re, (double)w.im};
    }
    static __device__ __forceinline__ complex128_t run(complex128_t w) { return w; }
};

template <typename To, typename From>
__device__ __forceinline__ To cvt(From v) {
    if constexpr (IsSame<To, From>::value) {
        return v;
    } else {
        return Narrow<To>::run(widen(v));
    }
}

}  // namespace cl
