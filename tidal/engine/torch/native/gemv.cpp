// One-row matmuls on bf16 weights (GEMV): y = x W^T (+ b), for the decode steps of a lone row
// (tidal/engine/torch/packed.py's `gemv_native`, fast_decode.py).
//
// A lone decode is bound by reading its weights: SmolLM2-135M's 269 MB a step. ATen's bf16 GEMV
// read them at 26-27 GB/s on the 2-core Zen 4 VM, where a large tensor's sum reads ~34: its rows
// (576 bf16, 1,152 B) are too short for the hardware prefetcher to run ahead, and each call starts
// cold. Here each thread takes a contiguous range of rows, 4 at a time (one x load serves 4 rows),
// asks for the next block of 4 rows' cache lines while it computes this one, and asks for its
// range's first block before it starts: 30 layers' GEMVs and the LM head 9.9 -> 8.1 ms (AVX-512
// build), 10.2 -> 9.0 ms (AVX2 build; docs/engine.md).
//
// Every output row is one thread's fixed-order sum (16 products per chunk, lanes summed pairwise,
// fp32), then + bias, rounded once to bf16: the same bits for any thread count; against ATen's
// GEMV, which sums in another order, the same to bf16 rounding.
#include <cstdint>
#include <cstring>

#include "vec.h"
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

constexpr int ROWS = 4;     // output rows computed together
constexpr int CHUNK = 16;   // input elements a row takes per step: n_in % CHUNK == 0
constexpr int U = CHUNK / LANES;  // vectors a row takes per step (1 on AVX-512, 2 on AVX2)
constexpr int64_t MAX_IN = 16384;  // x is widened to fp32 on the caller's stack (64 KiB)

typedef uint16_t vh __attribute__((vector_size(LANES * 2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

inline vf load_bf16(const uint16_t* p) {  // LANES bf16 -> fp32 (the high half of each word)
    vh h;
    std::memcpy(&h, p, sizeof h);
    const vu u = __builtin_convertvector(h, vu) << 16;
    return reinterpret_cast<const vf&>(u);
}

// ROWS rows from w (row-major, n_in apart) into y; `ahead` (or null) is the next block's start,
// whose 2 * 64 B a step (ROWS * CHUNK bf16) are asked for while this block computes.
inline void block(const float* xf, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                  int64_t n_in, const char* ahead) {
    vf acc[ROWS][U] = {};
    for (int64_t i = 0, step = 0; i < n_in; i += CHUNK, ++step) {
        if (ahead != nullptr) {
            const char* p = ahead + step * (ROWS * CHUNK * 2);
            __builtin_prefetch(p, 0, 0);
            __builtin_prefetch(p + 64, 0, 0);
        }
        for (int u = 0; u < U; ++u) {
            const vf xv = vload(xf + i + u * LANES);
            for (int r = 0; r < ROWS; ++r) acc[r][u] += load_bf16(w + r * n_in + i + u * LANES) * xv;
        }
    }
    for (int r = 0; r < ROWS; ++r) {
        vf a = acc[r][0];
        for (int u = 1; u < U; ++u) a += acc[r][u];
        y[r] = f2bf(lane_sum(a) + (bias != nullptr ? bf2f(bias[r]) : 0.f));
    }
}

inline void one_row(const float* xf, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                    int64_t n_in) {
    vf acc[U] = {};
    for (int64_t i = 0; i < n_in; i += CHUNK)
        for (int u = 0; u < U; ++u) acc[u] += load_bf16(w + i + u * LANES) * vload(xf + i + u * LANES);
    vf a = acc[0];
    for (int u = 1; u < U; ++u) a += acc[u];
    *y = f2bf(lane_sum(a) + (bias != nullptr ? bf2f(*bias) : 0.f));
}

}  // namespace

extern "C" {

// y (n_out) = x (n_in) @ W^T (+ bias), all bf16, W (n_out, n_in) row-major, bias null or
// (n_out); n_in a multiple of CHUNK, at most MAX_IN (else the caller runs ATen's GEMV). Rows are
// split over the calling thread's OpenMP team.
void tidal_gemv_bf16(const uint16_t* x, const uint16_t* W, const uint16_t* bias, uint16_t* y,
                     int64_t n_in, int64_t n_out) {
    float xf[MAX_IN] __attribute__((aligned(64)));
    for (int64_t i = 0; i < n_in; ++i) xf[i] = bf2f(x[i]);
    const int64_t blocks = n_out / ROWS;
#pragma omp parallel
    {
#ifdef _OPENMP
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
        const int64_t nt = 1, t = 0;
#endif
        const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        if (b1 > b0) {  // the range's first block, which no earlier block asks for
            const char* p = reinterpret_cast<const char*>(W + b0 * ROWS * n_in);
            for (int64_t off = 0; off < ROWS * n_in * 2; off += 64) __builtin_prefetch(p + off, 0, 0);
        }
        for (int64_t b = b0; b < b1; ++b) {
            const uint16_t* w = W + b * ROWS * n_in;
            const char* ahead = b + 1 < b1 ? reinterpret_cast<const char*>(w + ROWS * n_in) : nullptr;
            block(xf, w, bias != nullptr ? bias + b * ROWS : nullptr, y + b * ROWS, n_in, ahead);
        }
    }
    for (int64_t o = blocks * ROWS; o < n_out; ++o)
        one_row(xf, W + o * n_in, bias != nullptr ? bias + o : nullptr, y + o, n_in);
}

}  // extern "C"
