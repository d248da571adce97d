// The portable path of the kernels' vector layer (contract in simd.h): 8 fp32 lanes as a plain array
// in fixed-length loops, which the compiler vectorises for whatever it targets (SSE2 on any x86-64,
// NEON on aarch64). Built with no instruction-set flags, so it runs wherever the compiler's default
// target does. bf16 weights are widened by a shift, as on the AVX2 path.

#pragma once

#include <algorithm>
#include <cmath>

namespace simd {

constexpr const char* ISA = "portable";
constexpr int W = 8;
constexpr int ROWS = 2;
constexpr int QROWS = 2;  // GGUF tiles, as ROWS
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

// NVFP4 as on x86 (simd_fp4_x86.h): codes as 12 + 2 x E2M1 in [evens | odds] order, exact integer sums
// per lane of 8 elements less the activations' share of the offset, one multiply-add per lane by
// block scale x activation scale.
struct Fp4 {
  uint8_t even[32], odd[32];  // 12 + 2 x E2M1 of elements 2 i and 2 i + 1
  float scale[W];             // lane l: the scale / 256 of block l / 2
};
struct Fp4Acc {
  float v[W];
};

inline Fp4Acc fp4_zero() { return {}; }

// E4M3 (sign 0) / 256 = the fp16 number with E4M3's bits shifted left by 7: 2^(e - 15) (1 + m / 8), or
// 2^-14 m / 8 for e = 0.
inline float e4m3_over_256(uint8_t b) {
  const int e = b >> 3, m = b & 7;
  return e ? std::ldexp(1.0f + m / 8.0f, e - 15) : std::ldexp(m / 8.0f, -14);
}

inline Fp4 fp4_decode(const uint8_t* codes, const uint8_t* scales) {
  static constexpr uint8_t table[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
  Fp4 w;
  for (int i = 0; i < 32; ++i) {
    w.even[i] = table[codes[i] & 0xF];
    w.odd[i] = table[codes[i] >> 4];
  }
  for (int l = 0; l < W; ++l) w.scale[l] = e4m3_over_256(scales[l / 2]);
  return w;
}

inline Fp4Acc fp4_madd(Fp4Acc acc, const Fp4& w, const int8_t* xq, const float* xs, const int32_t* xo) {
  for (int l = 0; l < W; ++l) {
    int32_t s = -xo[l];
    for (int i = 4 * l; i < 4 * l + 4; ++i) s += w.even[i] * xq[i] + w.odd[i] * xq[32 + i];
    acc.v[l] += static_cast<float>(s) * (w.scale[l] * xs[l]);
  }
  return acc;
}

inline float fp4_reduce(Fp4Acc x) {
  Vec v;
  std::memcpy(v.v, x.v, sizeof(v.v));
  return reduce(v);
}

// GGUF blocks as on x86 (simd_ggml_x86.h): codes in element order, exact integer sums per lane of 4
// elements, the offset or minimum through the activations' lane sums.
constexpr int QJ = 1;
using QAcc = Fp4Acc;
struct QCodes {
  int8_t q[32];  // Q4_*: 0 .. 15; Q8_0: as stored
};

struct QScale {
  float v[8];  // per lane
};

inline QAcc q_zero() { return {}; }
inline QScale q_row_scales(const float* s) {
  QScale r;
  for (float& v : r.v) v = *s;
  return r;
}
inline QScale q_half_scales(const float* s) {
  QScale r;
  for (int l = 0; l < 8; ++l) r.v[l] = s[l / 4];
  return r;
}

// fp16 -> fp32, exactly: normals and subnormals by their value, infinities and NaN kept.
inline float from_fp16(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const float magnitude = e == 0 ? std::ldexp(static_cast<float>(m), -24)
                          : e == 31 ? (m ? NAN : INFINITY)
                                    : std::ldexp(1.0f + m / 1024.0f, e - 15);
  return h & 0x8000 ? -magnitude : magnitude;
}

inline void q_scales(const uint8_t* half, float* out, int n) {
  for (int i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, half + 2 * i, 2);
    out[i] = from_fp16(h);
  }
}

inline void q_scaled(const float* d, float k, float* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = d[i] * k;
}

inline float q_quantize_block(const float* x, int8_t* q, int32_t* half_sums) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  half_sums[0] = half_sums[1] = 0;
  for (int i = 0; i < 32; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    half_sums[i / 16] += q[i];
  }
  return amax / 127.f;
}

inline float fp4_quantize_block(const float* x, int8_t* evens, int8_t* odds, int32_t* lane_sums) {
  float amax = 0.f;
  for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  lane_sums[0] = lane_sums[1] = 0;
  for (int i = 0; i < 16; ++i) {
    const int8_t q = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    (i % 2 ? odds : evens)[i / 2] = q;
    lane_sums[i / 8] += q;
  }
  return amax / 127.f;
}

inline void q_add_scaled(float* acc, const float* c, float k) {
  for (int i = 0; i < 4; ++i) acc[i] += c[i] * k;
}

inline QCodes q4_decode(const uint8_t* qs) {
  QCodes w;
  for (int i = 0; i < 16; ++i) {
    w.q[i] = static_cast<int8_t>(qs[i] & 0xF);
    w.q[i + 16] = static_cast<int8_t>(qs[i] >> 4);
  }
  return w;
}

inline QCodes q4k_decode(const uint8_t* qs, int64_t /*stride*/, bool high) {
  QCodes w;
  for (int i = 0; i < 32; ++i) w.q[i] = static_cast<int8_t>(high ? qs[i] >> 4 : qs[i] & 0xF);
  return w;
}

inline QCodes q6k_decode(const uint8_t* codes, int64_t /*stride*/, int s) {
  const int half = s / 4, k = s % 4;
  const uint8_t* ql = codes + half * 64 + (k & 1) * 32;
  const uint8_t* qh = codes + 128 + half * 32;
  QCodes w;
  for (int i = 0; i < 32; ++i)
    w.q[i] = static_cast<int8_t>(((ql[i] >> ((k >> 1) * 4)) & 0xF) | (((qh[i] >> (2 * k)) & 3) << 4));
  return w;
}

inline QCodes q8_decode(const uint8_t* qs) {
  QCodes w;
  std::memcpy(w.q, qs, 32);
  return w;
}

inline void q_store(int8_t* out, const QCodes& w, int /*row*/) { std::memcpy(out, w.q, 32); }

template <bool SIGNED>
inline QAcc q_madd(QAcc acc, const QCodes& w, QScale scale, const int8_t* xq) {
  for (int l = 0; l < 8; ++l) {
    int32_t s = 0;
    for (int i = 4 * l; i < 4 * l + 4; ++i) s += static_cast<int32_t>(w.q[i]) * xq[i];
    acc.v[l] += static_cast<float>(s) * scale.v[l];
  }
  return acc;
}

inline float q_reduce(QAcc x, int /*row*/) { return fp4_reduce(x); }

}  // namespace simd
