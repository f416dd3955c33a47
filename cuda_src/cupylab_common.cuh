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

}  // namespace cl
