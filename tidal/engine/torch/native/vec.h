// What the native kernels share (decode_ops.cpp, gemv.cpp): bf16 <-> fp32 conversions, and
// float vectors of the CPU's width with a fixed-order sum.
#pragma once
#include <cstdint>
#include <cstring>

namespace {

inline float bf2f(uint16_t u) { return __builtin_bit_cast(float, static_cast<uint32_t>(u) << 16); }

inline uint16_t f2bf(float f) {  // round to nearest even, as torch's bf16 conversion
    const uint32_t b = __builtin_bit_cast(uint32_t, f);
    const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    const uint32_t nan = (b >> 16) | 0x40u;  // quiet NaN, never rounded into infinity
    return static_cast<uint16_t>((b & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// Dot products on vectors of the CPU's width (GCC vector extensions): 16 floats where AVX-512 is
// on, else 8 (AVX2's registers; two NEON ones), summed at the end in a fixed pairwise order. An
// `omp simd` reduction summed its lanes one by one (a chain of 8-16 scalar adds per score);
// wider vectors than the ISA's are split by the compiler without fused multiply-adds.
#ifdef __AVX512F__
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));

inline vf vload(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline float lane_sum(vf v) {
    float s[LANES];
    std::memcpy(s, &v, sizeof s);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) s[l] += s[l + w];
    return s[0];
}

}  // namespace
