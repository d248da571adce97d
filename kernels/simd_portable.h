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
constexpr int FP4ROWS = 2;  // NVFP4 pairs, as ROWS
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

// NVFP4 as on x86 (simd_fp4_x86.h): a pair of tile rows' codes as 12 + 2 x E2M1 in part order, per
// (row, block) one exact integer sum less the activations' share of the offset, one multiply-add per
// lane by block scale x activation scale.
struct Fp4Pair {
  uint8_t part[4][32];  // half h (row A, B), byte 16 h + 4 l + b of part k: block l's element 4 k + b
  float scale[8];       // lane 4 h + l: the scale / 256 of the row's block l
};
struct Fp4Acc {
  float v[8];  // lanes 0-3: row A's blocks, 4-7: row B's
};

inline Fp4Acc fp4_zero() { return {}; }

// E4M3 (sign 0) / 256 = the fp16 number with E4M3's bits shifted left by 7: 2^(e - 15) (1 + m / 8), or
// 2^-14 m / 8 for e = 0.
inline float e4m3_over_256(uint8_t b) {
  const int e = b >> 3, m = b & 7;
  return e ? std::ldexp(1.0f + m / 8.0f, e - 15) : std::ldexp(m / 8.0f, -14);
}

inline Fp4Pair fp4_pair_decode(const uint8_t* codes, const uint8_t* scales) {
  static constexpr uint8_t table[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
  Fp4Pair w;
  for (int m = 0; m < 2; ++m)
    for (int i = 0; i < 32; ++i) {
      w.part[2 * m][i] = table[codes[32 * m + i] & 0xF];
      w.part[2 * m + 1][i] = table[codes[32 * m + i] >> 4];
    }
  for (int l = 0; l < 8; ++l) w.scale[l] = e4m3_over_256(scales[l]);
  return w;
}

inline Fp4Acc fp4_pair_madd(Fp4Acc acc, const Fp4Pair& w, const int8_t* xq, const float* xs, const int32_t* xo) {
  for (int lane = 0; lane < 8; ++lane) {
    const int h = lane / 4, l = lane % 4;
    int32_t s = -xo[l];
    for (int k = 0; k < 4; ++k)
      for (int b = 0; b < 4; ++b) s += w.part[k][16 * h + 4 * l + b] * xq[16 * k + 4 * l + b];
    acc.v[lane] += static_cast<float>(s) * (w.scale[lane] * xs[l]);
  }
  return acc;
}

inline float fp4_pair_reduce(Fp4Acc x, int r) {
  const float* v = x.v + 4 * r;
  return (v[0] + v[1]) + (v[2] + v[3]);
}

// GGUF blocks as on x86 (simd_ggml_x86.h): a 4-row tile (Q8_0, K-quants) per row in two lanes of
// exact integer sums (elements 0-3 and 4-7 of each eight), an 8-row tile (Q4_0, Q4_1) per row in one
// lane of its block's exact sum, each scaled by the row's number and added in the same order.
struct QBlock {
  int8_t q[4][32];  // [tile row][element]: Q4_K: 0 .. 15; Q6_K: 0 .. 63; Q8_0: as stored
};
struct QAcc {
  float v[8];  // 4-row tiles: lanes 2r, 2r + 1 tile row r's; 8-row tiles: lane r
};
using QScale = QAcc;

inline QAcc q_zero() { return {}; }
inline QScale q_rows(const float* s) {
  QScale r;
  for (int l = 0; l < 8; ++l) r.v[l] = s[l / 2];
  return r;
}
inline QScale q_first(const float* s) {
  QScale r;
  for (int l = 0; l < 8; ++l) r.v[l] = l % 2 ? 0.f : s[l / 2];
  return r;
}
inline QScale q_times(QScale s, float k) {
  for (float& v : s.v) v *= k;
  return s;
}
inline QAcc q_add_scaled(QAcc acc, QScale c, float k) {
  for (int l = 0; l < 8; ++l) acc.v[l] += c.v[l] * k;
  return acc;
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

inline float fp4_quantize_block(const float* x, int8_t* chunk, int l, int32_t* sum) {
  float amax = 0.f;
  for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  *sum = 0;
  for (int i = 0; i < 16; ++i) {
    const int8_t q = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    chunk[16 * (i / 4) + 4 * l + i % 4] = q;
    *sum += q;
  }
  return amax / 127.f;
}

// Row r's byte b of a tile whose four rows' bytes are interleaved eight at a time (pack_ggml).
inline uint8_t q_byte(const uint8_t* tile, int r, int b) { return tile[b / 8 * 32 + 8 * r + b % 8]; }

inline QBlock q8_block(const uint8_t* qs) {
  QBlock w;
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 32; ++i) w.q[r][i] = static_cast<int8_t>(q_byte(qs, r, i));
  return w;
}

inline QBlock q4k_block(const uint8_t* qs, bool high) {
  QBlock w;
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 32; ++i) w.q[r][i] = static_cast<int8_t>(high ? q_byte(qs, r, i) >> 4 : q_byte(qs, r, i) & 0xF);
  return w;
}

inline QBlock q6k_block(const uint8_t* codes, int s) {
  const int half = s / 4, k = s % 4, ql = half * 64 + (k & 1) * 32, qh = 128 + half * 32;
  QBlock w;
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < 32; ++i)
      w.q[r][i] = static_cast<int8_t>(((q_byte(codes, r, ql + i) >> ((k >> 1) * 4)) & 0xF) |
                                      (((q_byte(codes, r, qh + i) >> (2 * k)) & 3) << 4));
  return w;
}

inline void q_store(int8_t* out, const QBlock& w) { std::memcpy(out, w.q, sizeof(w.q)); }

struct Q4Wide {
  int8_t q[8][32];  // [tile row][element], 0 .. 15
};

// Row r's byte b of an 8-row Q4 tile, whose rows' bytes are interleaved four at a time (pack_ggml).
inline Q4Wide q4_wide_block(const uint8_t* qs) {
  Q4Wide w;
  for (int r = 0; r < 8; ++r)
    for (int b = 0; b < 16; ++b) {
      const uint8_t byte = qs[b / 4 * 32 + 4 * r + b % 4];
      w.q[r][b] = static_cast<int8_t>(byte & 0xF);
      w.q[r][b + 16] = static_cast<int8_t>(byte >> 4);
    }
  return w;
}

inline void q4_wide_store(int8_t* out, const Q4Wide& w) { std::memcpy(out, w.q, sizeof(w.q)); }

inline QScale q_half8(const uint8_t* half) {
  QScale r;
  q_scales(half, r.v, 8);
  return r;
}

template <int G>
inline QAcc q4_wide_madd(QAcc acc, const Q4Wide& w, QScale scale, const int8_t* xq) {
  for (int r = 0; r < 8; ++r) {
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) s += static_cast<int32_t>(w.q[r][i]) * xq[i];
    acc.v[r] += static_cast<float>(s) * scale.v[r];
  }
  return acc;
}

inline float q_lane(QAcc acc, int r) { return acc.v[r]; }

enum class QCodesKind { Q4, Q6, Q8 };

template <QCodesKind C, int FIRST, int N>
inline QAcc q_madd(QAcc acc, const QBlock& w, QScale scale, const int8_t* xq) {
  for (int l = 0; l < 8; ++l) {
    const int r = l / 2, h = l % 2;
    int32_t s = 0;
    for (int k = FIRST; k < FIRST + N; ++k)
      for (int i = 8 * k + 4 * h; i < 8 * k + 4 * h + 4; ++i) s += static_cast<int32_t>(w.q[r][i]) * xq[i];
    acc.v[l] += static_cast<float>(s) * scale.v[l];
  }
  return acc;
}

inline float q_reduce(QAcc acc, int r) { return acc.v[2 * r] + acc.v[2 * r + 1]; }

}  // namespace simd
