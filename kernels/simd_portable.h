// The portable path of the kernels' vector layer (contract in simd.h): 8 fp32 lanes as a plain array
// in fixed-length loops, which the compiler vectorises for whatever it targets (SSE2 on any x86-64,
// NEON on aarch64). Built with no instruction-set flags, so it runs wherever the compiler's default
// target does. bf16 weights are widened by a shift, as on the AVX2 path.

#pragma once

#include <cmath>

namespace simd {

constexpr const char* ISA = "portable";
constexpr int W = 8;
constexpr int ROWS = 2;
constexpr int REGS = 16;
constexpr int64_t PART = 32;
// Bytes of weights prefetched ahead, as on the AVX2 path (simd_avx2.h says why).
constexpr int64_t PREFETCH = 4096;

struct Vec {
  float v[W];
};
using XB = float;

template <typename F>
inline Vec each(F f) {
  Vec r;
  for (int i = 0; i < W; ++i) r.v[i] = f(i);
  return r;
}

inline Vec zero() { return each([](int) { return 0.0f; }); }
inline Vec splat(float f) { return each([f](int) { return f; }); }
inline Vec load(const float* p) { return each([p](int i) { return p[i]; }); }
inline void store(float* p, Vec x) { std::memcpy(p, x.v, sizeof(x.v)); }
inline Vec add(Vec a, Vec b) { return each([&](int i) { return a.v[i] + b.v[i]; }); }
inline Vec sub(Vec a, Vec b) { return each([&](int i) { return a.v[i] - b.v[i]; }); }
inline Vec mul(Vec a, Vec b) { return each([&](int i) { return a.v[i] * b.v[i]; }); }
inline Vec div(Vec a, Vec b) { return each([&](int i) { return a.v[i] / b.v[i]; }); }
inline Vec max(Vec a, Vec b) { return each([&](int i) { return a.v[i] > b.v[i] ? a.v[i] : b.v[i]; }); }
inline Vec abs(Vec x) { return each([&](int i) { return std::fabs(x.v[i]); }); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return each([&](int i) { return a.v[i] * b.v[i] + c.v[i]; }); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return each([&](int i) { return c.v[i] - a.v[i] * b.v[i]; }); }
inline Vec round_int(Vec x) { return each([&](int i) { return std::nearbyint(x.v[i]); }); }
inline Vec scale_pow2(Vec p, Vec k) { return each([&](int i) { return std::ldexp(p.v[i], static_cast<int>(k.v[i])); }); }
inline Vec where_negative(Vec g, Vec a, Vec b) { return each([&](int i) { return g.v[i] < 0 ? a.v[i] : b.v[i]; }); }
inline float reduce(Vec x) {
  return ((x.v[0] + x.v[4]) + (x.v[2] + x.v[6])) + ((x.v[1] + x.v[5]) + (x.v[3] + x.v[7]));
}
inline Vec reduce_each(const Vec* x) { return each([x](int i) { return reduce(x[i]); }); }

inline void prepare_bf16(const float* x, XB* xb, int64_t n) {
  for (int64_t i = 0; i < n; ++i) xb[i] = from_bf16(to_bf16(x[i]));
}

// Lane l takes elements l and l + 8 of the part, in that order.
inline Vec madd(Vec acc, const bf16* w, const XB* x) {
  for (int c = 0; c < 16; c += W)
    for (int l = 0; l < W; ++l) acc.v[l] += from_bf16(w[c + l]) * x[c + l];
  return acc;
}
inline Vec madd(Vec acc, const float* w, const float* x) {
  for (int l = 0; l < W; ++l) acc.v[l] += w[l] * x[l];
  return acc;
}

}  // namespace simd
