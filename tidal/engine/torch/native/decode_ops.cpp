// Small fused CPU kernels for the torch engine's decode steps (tidal/engine/fast_decode.py).
//
// At batch 1 a SmolLM2 layer is 4 GEMVs (gemv.cpp's at one row) and ~15 small
// torch ops (RMSNorm, RoPE, KV write, attention, SiLU*mul, residual adds), each costing 5-30 us of
// dispatch for microseconds of work; at batch 32 the same ops still cost their dispatch. These
// kernels do the small work in 4 calls a layer (3 where torch runs the attention).
// The norm, RoPE and SiLU kernels are single-threaded: their work is tiny. The attention splits
// its (row, KV head) pairs over the calling thread's OpenMP team: built with -fopenmp, this library
// needs libgomp.so.1, which in a process that loaded torch is torch's own copy, so the team is the
// one torch's GEMMs use on that thread (services/common/torch_threads.py), not a second runtime.
// Each pair is computed whole by one thread on its own scratch, so the result is the same bits
// for any thread count. bf16 values travel as uint16_t; every kernel computes in fp32 and rounds
// where the torch ops it replaces round, so results match them to bf16 rounding.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

inline float rb(float f) { return bf2f(f2bf(f)); }  // the value after a bf16 round trip

// The model dtype T (residual stream, norms, RoPE tables, KV cache): uint16_t for a bf16 model,
// float for an fp32 one. IO, the matmuls' inputs and outputs (h, delta, qkv, attention out):
// bf16 for a bf16 model and for an fp32 one whose small-row matmuls run on bf16 weight copies
// (llama.py's `use_bf16_weights`), float for an fp32 model's fp32 matmuls.
inline float ld(uint16_t u) { return bf2f(u); }
inline float ld(float f) { return f; }
template <typename T> inline T st(float f);
template <> inline uint16_t st<uint16_t>(float f) { return f2bf(f); }
template <> inline float st<float>(float f) { return f; }
template <typename T> inline float rnd(float f) { return ld(st<T>(f)); }  // as a T op rounds

// e^x, vectorisable where std::exp is not: 2^(x log2 e) split into an integer power and a
// degree-5 minimax polynomial on [0, 1), relative error ~2e-7 (below the bf16 rounding of
// SiLU's output and fp32 softmax's own rounding); x is clamped to [-87, 88].
inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float t = x * 1.44269504089f;
    const float fi = std::floor(t);
    const float f = t - fi;
    float p = 1.8775767e-3f;
    p = p * f + 8.9893397e-3f;
    p = p * f + 5.5826318e-2f;
    p = p * f + 2.4015361e-1f;
    p = p * f + 6.9315308e-1f;
    p = p * f + 9.9999994e-1f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fi) + 127) << 23;
    return p * __builtin_bit_cast(float, bits);
}

// How many tokens ahead the attention asks for a key's cache lines: a decode's KV is read once
// per step, from DRAM at any context past a few hundred tokens, in 128-512 B pieces (one KV head
// of one token) a block's stride apart, which the hardware prefetcher does not follow far.
constexpr int64_t PREFETCH_TOKENS = 4;

template <typename KV>
inline void prefetch_head(const KV* p, int64_t D) {
    const char* c = reinterpret_cast<const char*>(p);
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(KV)); b += 64) __builtin_prefetch(c + b);
}

// One query row's attention for its KV head kh (see tidal_decode_attention). DC > 0 fixes the
// head size at compile time, so the per-token loops over it unroll fully (2x faster at 64,
// measured); DC = 0 reads D, a multiple of LANES (`shapes_fit`). scores: G * T floats of scratch.
template <int DC, typename KV, typename IO>
void decode_attention_head(const IO* q, const KV* k_cache, const KV* v_cache,
                           const int64_t* slots, int64_t start, int64_t T, int64_t H, int64_t Hk,
                           int64_t D_, int64_t kh, float scale, float* scores, IO* out) {
    const int64_t D = DC > 0 ? DC : D_;
    const int64_t G = H / Hk;
    float qf[8][256];
    float kf[256];
    float acc[8][256];
    {
        for (int64_t g = 0; g < G; ++g)
            for (int64_t d = 0; d < D; ++d) qf[g][d] = ld(q[(kh * G + g) * D + d]) * scale;
        for (int64_t t = 0; t < T; ++t) {
            const int64_t s = slots != nullptr ? slots[t] : start + t;
            const KV* k = k_cache + (s * Hk + kh) * D;
            if (t + PREFETCH_TOKENS < T) {  // this key's successor, and this value (read below)
                const int64_t sn = slots != nullptr ? slots[t + PREFETCH_TOKENS] : s + PREFETCH_TOKENS;
                prefetch_head(k_cache + (sn * Hk + kh) * D, D);
            }
            prefetch_head(v_cache + (s * Hk + kh) * D, D);
            for (int64_t d = 0; d < D; ++d) kf[d] = ld(k[d]);
            for (int64_t g = 0; g < G; ++g) {
                vf dot = {};
                for (int64_t d = 0; d < D; d += LANES) dot += vload(qf[g] + d) * vload(kf + d);
                scores[g * T + t] = lane_sum(dot);
            }
        }
        float inv[8];
        for (int64_t g = 0; g < G; ++g) {
            float* sc = scores + g * T;
            float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
            for (int64_t t = 0; t < T; ++t) mx = sc[t] > mx ? sc[t] : mx;
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < T; ++t) {
                sc[t] = exp_approx(sc[t] - mx);
                sum += sc[t];
            }
            inv[g] = 1.f / sum;
            for (int64_t d = 0; d < D; ++d) acc[g][d] = 0.f;
        }
        for (int64_t t = 0; t < T; ++t) {
            const int64_t s = slots != nullptr ? slots[t] : start + t;
            const KV* v = v_cache + (s * Hk + kh) * D;
            for (int64_t d = 0; d < D; ++d) kf[d] = ld(v[d]);
            for (int64_t g = 0; g < G; ++g) {
                const float p = scores[g * T + t];
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) acc[g][d] += p * kf[d];
            }
        }
        for (int64_t g = 0; g < G; ++g)
            for (int64_t d = 0; d < D; ++d) out[(kh * G + g) * D + d] = st<IO>(acc[g][d] * inv[g]);
    }
}

// For each of `rows` rows of n: x += delta (rounded to T, as torch's add_), then
// h = rms_norm(x) * w computed in fp32 and rounded once to bf16 (as F.rms_norm, then the bf16
// matmul's input). delta may be null (no residual to add first). All three are (rows, n).
template <typename T, typename IO>
void add_rms_norm(T* x, const IO* delta, const T* w, IO* h, int64_t rows, int64_t n, float eps) {
    for (int64_t r = 0; r < rows; ++r, x += n, h += n) {
        if (delta != nullptr) {
            for (int64_t i = 0; i < n; ++i) x[i] = st<T>(ld(x[i]) + ld(delta[i]));
            delta += n;
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
            const float v = ld(x[i]);
            ss += v * v;
        }
        const float rs = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
        for (int64_t i = 0; i < n; ++i) h[i] = st<IO>(ld(x[i]) * rs * ld(w[i]));
    }
}

// RoPE in place on each row's q and k heads of the bf16 qkv, rounding as llama.py's torch ops
// do in T; k (rotated) and v go to the caches in T (see tidal_rope_kv_write).
template <typename T, typename IO>
void rope_kv_write(IO* qkv, int64_t stride, const T* cos_tab, const T* sin_tab,
                   const int64_t* positions, T* k_cache, T* v_cache, const int64_t* slots,
                   int64_t rows, int64_t H, int64_t Hk, int64_t D) {
    const int64_t half = D / 2;
    float tmp[512];
    for (int64_t r = 0; r < rows; ++r) {
        IO* row = qkv + r * stride;
        const T* cos = cos_tab + positions[r] * D;
        const T* sin_rot = sin_tab + positions[r] * D;
        T* k_out = k_cache + slots[r] * Hk * D;
        for (int64_t h = 0; h < H + Hk; ++h) {
            IO* p = row + h * D;
            for (int64_t d = 0; d < half; ++d)  // roll(p, D/2): the halves swap
                tmp[d] = rnd<T>(ld(p[d]) * ld(cos[d])) + ld(p[d + half]) * ld(sin_rot[d]);
            for (int64_t d = half; d < D; ++d)
                tmp[d] = rnd<T>(ld(p[d]) * ld(cos[d])) + ld(p[d - half]) * ld(sin_rot[d]);
            for (int64_t d = 0; d < D; ++d) p[d] = st<IO>(tmp[d]);
            if (h >= H)
                for (int64_t d = 0; d < D; ++d) k_out[(h - H) * D + d] = st<T>(tmp[d]);
        }
        const IO* v = row + (H + Hk) * D;
        T* v_out = v_cache + slots[r] * Hk * D;
        for (int64_t d = 0; d < Hk * D; ++d) v_out[d] = st<T>(ld(v[d]));
    }
}

template <typename T, typename IO>
void attention_head(const IO* q, const T* k_cache, const T* v_cache, const int64_t* slots,
                    int64_t start, int64_t T_, int64_t H, int64_t Hk, int64_t D, int64_t kh,
                    float scale, float* scores, IO* out) {
    if (D == 64)
        decode_attention_head<64, T, IO>(q, k_cache, v_cache, slots, start, T_, H, Hk, D, kh, scale, scores, out);
    else if (D == 128)
        decode_attention_head<128, T, IO>(q, k_cache, v_cache, slots, start, T_, H, Hk, D, kh, scale, scores, out);
    else
        decode_attention_head<0, T, IO>(q, k_cache, v_cache, slots, start, T_, H, Hk, D, kh, scale, scores, out);
}

// The threads to split `units` (row, KV head) pairs over: the calling thread's OpenMP team
// (torch's thread count on that thread), at most one per scratch block and per unit.
inline int team_size(int64_t units, int64_t n_scratch) {
#ifdef _OPENMP
    int64_t n = omp_get_max_threads();
    n = n < n_scratch ? n : n_scratch;
    return static_cast<int>(n < units ? (n < 1 ? 1 : n) : units);
#else
    (void)units;
    (void)n_scratch;
    return 1;
#endif
}

inline int thread_index() {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

// Decode attention for B rows, each over its own context: row r's q at q + r * q_stride, its
// lens[r] tokens at slots[r * Tmax + t] (padding past lens[r] is not read; lens == nullptr: Tmax
// tokens each, at start + t where slots == nullptr too), its output at out + r * H * D. The
// B * Hk (row, KV head) pairs are split over the OpenMP team, each thread scoring on its own
// block of `scores` (n_scratch blocks of G * Tmax floats).
template <typename T, typename IO>
void attention_rows(const IO* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                    const int64_t* slots, int64_t start, const int64_t* lens, int64_t Tmax,
                    int64_t B, int64_t H, int64_t Hk, int64_t D, float scale, float* scores,
                    int64_t n_scratch, IO* out) {
    const int64_t units = B * Hk;
    const int64_t block = (H / Hk) * Tmax;
    const int nt = team_size(units, n_scratch);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t u = 0; u < units; ++u) {
        const int64_t r = u / Hk, kh = u % Hk;
        attention_head<T, IO>(q + r * q_stride, k_cache, v_cache,
                              slots != nullptr ? slots + r * Tmax : nullptr, start,
                              lens != nullptr ? lens[r] : Tmax, H, Hk, D, kh, scale,
                              scores + thread_index() * block, out + r * H * D);
    }
}

// One row over T tokens (see tidal_decode_attention): its KV heads split over the team.
template <typename T, typename IO>
void attention(const IO* q, const T* k_cache, const T* v_cache, const int64_t* slots,
               int64_t start, int64_t T_, int64_t H, int64_t Hk, int64_t D, float scale,
               float* scores, int64_t n_scratch, IO* out) {
    attention_rows<T, IO>(q, 0, k_cache, v_cache, slots, start, nullptr, T_, 1, H, Hk, D, scale,
                          scores, n_scratch, out);
}

// out = IO(IO(silu(g)) * u) for each of `rows` rows gu = [g | u] (2 * n), as F.silu(g) * u
// rounds; out is (rows, n).
template <typename IO>
void silu_mul(const IO* gu, IO* out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
        const IO* __restrict g_row = gu + r * 2 * n;
        const IO* __restrict u_row = g_row + n;
        IO* __restrict o_row = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float g = ld(g_row[i]);
            const float s = rnd<IO>(g / (1.f + exp_approx(-g)));
            o_row[i] = st<IO>(s * ld(u_row[i]));
        }
    }
}

}  // namespace

extern "C" {

// Each kernel comes for a bf16 model (T = IO = bf16, as uint16_t); suffixed _f32, for an fp32
// model's rows on bf16 weight copies (T = float, IO = bf16); suffixed _f32io, for an fp32 model's
// rows on its fp32 matmuls (T = IO = float).

// For each of `rows` rows of n: x += delta (rounded to T, as torch's add_), then
// h = rms_norm(x) * w computed in fp32 and rounded once (as F.rms_norm). delta may be null (no
// residual to add first). All three are (rows, n) row-major.
void tidal_add_rms_norm(uint16_t* x, const uint16_t* delta, const uint16_t* w, uint16_t* h,
                        int64_t rows, int64_t n, float eps) {
    add_rms_norm<uint16_t, uint16_t>(x, delta, w, h, rows, n, eps);
}
void tidal_add_rms_norm_f32(float* x, const uint16_t* delta, const float* w, uint16_t* h,
                            int64_t rows, int64_t n, float eps) {
    add_rms_norm<float, uint16_t>(x, delta, w, h, rows, n, eps);
}

// For each of `rows` rows of the fused qkv (row r at qkv + r * stride: H + Hk heads of D, then
// Hk heads of v): RoPE on its q and k heads in place at position positions[r],
// qk = bf16(T(qk * cos) + roll(qk, D/2) * sin_rot) as llama.py's torch ops round (cos and
// sin_rot are (positions, D) tables); then its k and v go to the caches ((slots, Hk, D)) at
// slots[r].
void tidal_rope_kv_write(uint16_t* qkv, int64_t stride, const uint16_t* cos_tab,
                         const uint16_t* sin_tab, const int64_t* positions, uint16_t* k_cache,
                         uint16_t* v_cache, const int64_t* slots, int64_t rows, int64_t H,
                         int64_t Hk, int64_t D) {
    rope_kv_write<uint16_t, uint16_t>(qkv, stride, cos_tab, sin_tab, positions, k_cache, v_cache, slots,
                            rows, H, Hk, D);
}
void tidal_rope_kv_write_f32(uint16_t* qkv, int64_t stride, const float* cos_tab,
                             const float* sin_tab, const int64_t* positions, float* k_cache,
                             float* v_cache, const int64_t* slots, int64_t rows, int64_t H,
                             int64_t Hk, int64_t D) {
    rope_kv_write<float, uint16_t>(qkv, stride, cos_tab, sin_tab, positions, k_cache, v_cache, slots, rows,
                         H, Hk, D);
}

// One query row's attention over T cached tokens: slots[t] when slots is not null, else
// start + t. q (H, D) inside qkv; out (H, D). GQA: the G = H / Hk query heads of a KV head are
// scored together, so each K/V row is read once. fp32 scores and softmax, output rounded once
// (as SDPA's CPU kernel). scores: G * T floats of scratch.
void tidal_decode_attention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                            const int64_t* slots, int64_t start, int64_t T, int64_t H,
                            int64_t Hk, int64_t D, float scale, float* scores,
                            int64_t n_scratch, uint16_t* out) {
    attention<uint16_t, uint16_t>(q, k_cache, v_cache, slots, start, T, H, Hk, D, scale, scores,
                                  n_scratch, out);
}
void tidal_decode_attention_f32(const uint16_t* q, const float* k_cache, const float* v_cache,
                                const int64_t* slots, int64_t start, int64_t T, int64_t H,
                                int64_t Hk, int64_t D, float scale, float* scores,
                                int64_t n_scratch, uint16_t* out) {
    attention<float, uint16_t>(q, k_cache, v_cache, slots, start, T, H, Hk, D, scale, scores,
                               n_scratch, out);
}

// out = bf16(bf16(silu(g)) * u) for each of `rows` rows gu = [g | u] (2 * n), as
// F.silu(g) * u rounds; out is (rows, n).
void tidal_silu_mul(const uint16_t* gu, uint16_t* out, int64_t rows, int64_t n) {
    silu_mul<uint16_t>(gu, out, rows, n);
}

// B decode rows' attention, each over its own context (`attention_rows`): slots (B, Tmax),
// lens (B,); q rows q_stride apart (inside qkv), out (B, H * D).
void tidal_decode_attention_rows(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache,
                                 const uint16_t* v_cache, const int64_t* slots,
                                 const int64_t* lens, int64_t Tmax, int64_t B, int64_t H,
                                 int64_t Hk, int64_t D, float scale, float* scores,
                                 int64_t n_scratch, uint16_t* out) {
    attention_rows<uint16_t, uint16_t>(q, q_stride, k_cache, v_cache, slots, 0, lens, Tmax, B, H,
                                 Hk, D, scale, scores, n_scratch, out);
}
void tidal_decode_attention_rows_f32(const uint16_t* q, int64_t q_stride, const float* k_cache,
                                     const float* v_cache, const int64_t* slots,
                                     const int64_t* lens, int64_t Tmax, int64_t B, int64_t H,
                                     int64_t Hk, int64_t D, float scale, float* scores,
                                     int64_t n_scratch, uint16_t* out) {
    attention_rows<float, uint16_t>(q, q_stride, k_cache, v_cache, slots, 0, lens, Tmax, B, H,
                                 Hk, D, scale, scores, n_scratch, out);
}

// An fp32 model's fp32 matmuls (rows past its bf16 copies, or none): T and IO both float.
void tidal_add_rms_norm_f32io(float* x, const float* delta, const float* w, float* h,
                              int64_t rows, int64_t n, float eps) {
    add_rms_norm<float, float>(x, delta, w, h, rows, n, eps);
}
void tidal_rope_kv_write_f32io(float* qkv, int64_t stride, const float* cos_tab,
                               const float* sin_tab, const int64_t* positions, float* k_cache,
                               float* v_cache, const int64_t* slots, int64_t rows, int64_t H,
                               int64_t Hk, int64_t D) {
    rope_kv_write<float, float>(qkv, stride, cos_tab, sin_tab, positions, k_cache, v_cache, slots,
                                rows, H, Hk, D);
}
void tidal_decode_attention_f32io(const float* q, const float* k_cache, const float* v_cache,
                                  const int64_t* slots, int64_t start, int64_t T, int64_t H,
                                  int64_t Hk, int64_t D, float scale, float* scores,
                                  int64_t n_scratch, float* out) {
    attention<float, float>(q, k_cache, v_cache, slots, start, T, H, Hk, D, scale, scores,
                            n_scratch, out);
}
void tidal_decode_attention_rows_f32io(const float* q, int64_t q_stride, const float* k_cache,
                                       const float* v_cache, const int64_t* slots,
                                       const int64_t* lens, int64_t Tmax, int64_t B, int64_t H,
                                       int64_t Hk, int64_t D, float scale, float* scores,
                                       int64_t n_scratch, float* out) {
    attention_rows<float, float>(q, q_stride, k_cache, v_cache, slots, 0, lens, Tmax, B, H,
                                 Hk, D, scale, scores, n_scratch, out);
}
void tidal_silu_mul_f32io(const float* gu, float* out, int64_t rows, int64_t n) {
    silu_mul<float>(gu, out, rows, n);
}

}  // extern "C"
