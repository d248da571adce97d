// The x86 pieces of the kernels' vector layer (contract in simd.h) for GGUF's block formats: 256-bit
// integer dot products of a tile's rows at once. The AVX2 and the AVX-512 builds both use them; the
// AVX-512 build (VNNI) sums each part by one VPDPBUSD where AVX2 takes VPMADDUBSW, int16 adds and a
// VPMADDWD. Both sums are exact integers, so the two builds give every output bit for bit (tested).
// On a Zen 4 (AVX-512, `benchmarks/verify_pass.py --weights gguf --baseline-rev`) the fused layers'
// passes of 2 to 32 rows took 0.88-0.94x the AVX2 form's time at 300 cached tokens (0.94-0.99x at
// 1,000), one row 0.98x.
//
// A GGUF block is 32 weights along a row with fp16 scales: Q4_0 w = d (q - 8), Q4_1 w = d q + m
// (q = 0 .. 15, elements 0-15 in the low nibbles of its 16 bytes, 16-31 in the high ones), Q8_0
// w = d q (q int8); the K-quants' sub-blocks of 32 read the same way (simd.h).
//
// Q4_0 and Q4_1 tiles are 8 rows high (`Q4Wide`): `pack_ggml` interleaves their rows' code bytes four
// at a time, so one 32-byte load holds bytes 4k .. 4k + 3 of every row, whose low nibbles are
// elements 4k .. 4k + 3 and high nibbles 16 + 4k .. 19 + 4k. Each of a block's 8 parts meets its 4
// activations broadcast to all 8 rows; the 8 VPMADDUBSW are added in int16 (8 x 2 x 15 x 127 =
// 30,480) and one VPMADDWD leaves each row's exact block sum in its own int32 lane. Per (activation
// row, tile, block) that is 8 VPMADDUBSW, 7 VPADDW, 1 VPMADDWD, 1 conversion, 1 multiply and 2 FMAs
// for 8 x 32 weights, where a 4-row tile (below) takes 12 operations for 4 x 32. Single-threaded on
// a Zen 3, tiles hot in L2: 3.90 against 5.00 cycles per (activation row, 128 weights) at 8 rows,
// 5.76 against 8.40 at one.
//
// Q8_0 and the K-quants' tiles are 4 rows high: `pack_ggml` interleaves a tile's four rows' code
// bytes eight at a time, so one 32-byte load holds the same eight code bytes of every row: [row 0 |
// row 1 | row 2 | row 3]. Decoded (a mask, a shift), each load is a `QPart`, the four rows' codes of
// eight consecutive elements, and meets those eight activations broadcast to all four rows:
// VPMADDUBSW leaves per row four int16 pairs, the parts of a block are added in int16 while they
// cannot overflow (Q4_K: all four; Q6_K: two), and one VPMADDWD makes per row two int32 lanes
// (elements 4-7 of each eight apart from 0-3), exact. One fp32 FMA then applies each row's d times
// the activations' scale to its two lanes. Q8_0's signed codes take the sign trick (|w| times x with
// w's sign), and their pairs fill int16, so each part has its own VPMADDWD.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "simd_half_x86.h"

namespace simd {

using QPart = __m256i;  // 4 tile rows' codes of 8 consecutive elements, row r's in bytes 8r .. 8r + 7
struct QBlock {
  QPart part[4];  // elements 8k .. 8k + 7 in part k
};
using QAcc = __m256;    // 4-row tiles: lanes 2r, 2r + 1 tile row r's; 8-row tiles: lane r
using QScale = __m256;  // a number per tile row, in each of its lanes

inline QAcc q_zero() { return _mm256_setzero_ps(); }

// 4 rows' numbers s[0 .. 3] -> [s0 s0 s1 s1 s2 s2 s3 s3] (q_rows), or [s0 0 s1 0 s2 0 s3 0] (q_first).
inline QScale q_rows(const float* s) {
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(s)), _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0));
}
inline QScale q_first(const float* s) { return _mm256_blend_ps(q_rows(s), _mm256_setzero_ps(), 0xAA); }
inline QScale q_times(QScale s, float k) { return _mm256_mul_ps(s, _mm256_set1_ps(k)); }

// acc + c k: what a block adds to every weight (an offset or minimum, c = q_first of the rows'),
// times the activations' block sum k.
inline QAcc q_add_scaled(QAcc acc, QScale c, float k) { return _mm256_fmadd_ps(c, _mm256_set1_ps(k), acc); }

// Four loads of the interleaved tile at p (32 bytes each), shifted right by `shift` bits and masked.
inline QBlock q_parts(const uint8_t* p, int shift, uint8_t mask) {
  QBlock w;
  for (int k = 0; k < 4; ++k)
    w.part[k] = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * k)), shift),
                                 _mm256_set1_epi8(static_cast<char>(mask)));
  return w;
}

// Q8_0: a tile block's 128 code bytes, signed.
inline QBlock q8_block(const uint8_t* qs) { return q_parts(qs, 0, 0xFF); }

// Q4_K: 128 interleaved bytes (each row's 32 bytes of one pair of sub-blocks), their low or high nibbles.
inline QBlock q4k_block(const uint8_t* qs, bool high) { return q_parts(qs, high ? 4 : 0, 0x0F); }

// Q6_K sub-block s (0 .. 7) of a tile's 768 interleaved code bytes (each row's 128 of low nibbles, then
// 64 of high 2-bit pairs, as ggml lays them out) -> codes 0 .. 63.
inline QBlock q6k_block(const uint8_t* codes, int s) {
  const int half = s / 4, k = s % 4;
  const QBlock low = q_parts(codes + 4 * (half * 64 + (k & 1) * 32), (k >> 1) * 4, 0x0F);
  const QBlock high = q_parts(codes + 4 * (128 + half * 32), 2 * k, 3);
  QBlock w;
  for (int p = 0; p < 4; ++p) w.part[p] = _mm256_or_si256(low.part[p], _mm256_slli_epi16(high.part[p], 4));
  return w;
}

// A tile block's ROWS parts (part k: 32 / ROWS consecutive elements of every row, row r's in bytes
// 32 / ROWS r ..) -> row r's 32 codes at out[32 r .. 32 r + 31], in element order (for tests).
template <int ROWS>
inline void q_store_parts(int8_t* out, const __m256i (&parts)[ROWS]) {
  constexpr int RUN = 32 / ROWS;
  alignas(32) int8_t part[32];
  for (int k = 0; k < ROWS; ++k) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(part), parts[k]);
    for (int r = 0; r < ROWS; ++r) std::memcpy(out + 32 * r + RUN * k, part + RUN * r, RUN);
  }
}

inline void q_store(int8_t* out, const QBlock& w) { q_store_parts(out, w.part); }

// The 8 activations at xq in every row's 8 bytes.
inline __m256i q_broadcast8(const int8_t* xq) {
  int64_t v;
  std::memcpy(&v, xq, 8);
  return _mm256_set1_epi64x(v);
}

// How a block's codes are bounded: unsigned 0 .. 15 (Q4_*), 0 .. 63 (Q6_K), or signed (Q8_0).
enum class QCodesKind { Q4, Q6, Q8 };

// acc + parts FIRST .. FIRST + N - 1 of a tile block against int8 activations xq [32] (the block's):
// per row, the exact integer sums over elements 0-3 and 4-7 of each eight (lanes 2r and 2r + 1),
// times `scale` (q_times of the rows' d by the activations' scale). |x| <= 127, so a VPMADDUBSW pair
// is at most 2 x 15 x 127 (Q4), 2 x 63 x 127 (Q6_K) or 2 x 128 x 127 = 32,512 (Q8_0): int16 holds
// four parts' of Q4 (15,240) and two of Q6_K (32,004), one of Q8_0.
template <QCodesKind C, int FIRST, int N>
inline QAcc q_madd(QAcc acc, const QBlock& w, QScale scale, const int8_t* xq) {
  __m256i sums = _mm256_setzero_si256();
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // VPDPBUSD adds each lane's four products into it in int32: the same exact sums, one instruction a part.
  for (int k = FIRST; k < FIRST + N; ++k) {
    const __m256i x = q_broadcast8(xq + 8 * k);
    const __m256i u = C == QCodesKind::Q8 ? _mm256_sign_epi8(w.part[k], w.part[k]) : w.part[k];
    sums = _mm256_dpbusd_epi32(sums, u, C == QCodesKind::Q8 ? _mm256_sign_epi8(x, w.part[k]) : x);
  }
#else
  constexpr int GROUP = C == QCodesKind::Q4 ? 4 : C == QCodesKind::Q6 ? 2 : 1;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int k0 = FIRST; k0 < FIRST + N; k0 += GROUP) {
    __m256i pairs = _mm256_setzero_si256();
    for (int k = k0; k < k0 + GROUP && k < FIRST + N; ++k) {
      const __m256i x = q_broadcast8(xq + 8 * k);
      const __m256i p = C == QCodesKind::Q8 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w.part[k], w.part[k]),
                                                                   _mm256_sign_epi8(x, w.part[k]))
                                            : _mm256_maddubs_epi16(w.part[k], x);
      pairs = k == k0 ? p : _mm256_add_epi16(pairs, p);
    }
    sums = k0 == FIRST ? _mm256_madd_epi16(pairs, ones) : _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
  }
#endif
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
}

// Q4_0 and Q4_1: an 8-row tile's block, part p = elements 4p .. 4p + 3, row r's in bytes 4r .. 4r + 3.
struct Q4Wide {
  __m256i part[8];
};

// An 8-row tile block's 128 code bytes: load k holds each row's bytes 4k .. 4k + 3, whose low nibbles
// are part k and high nibbles part 4 + k.
inline Q4Wide q4_wide_block(const uint8_t* qs) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  Q4Wide w;
  for (int k = 0; k < 4; ++k) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * k));
    w.part[k] = _mm256_and_si256(b, nibble);
    w.part[4 + k] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
  }
  return w;
}

inline void q4_wide_store(int8_t* out, const Q4Wide& w) { q_store_parts(out, w.part); }

// 8 rows' fp16 numbers (d or m) -> lane r, exactly.
inline QScale q_half8(const uint8_t* half) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(half)));
}

// acc + each row's exact integer sum over the block's 32 products with int8 activations xq [32]
// (|x| <= 127), in lane r, times lane r of `scale`. G: how many activation rows meet the block.
template <int G>
inline QAcc q4_wide_madd(QAcc acc, const Q4Wide& w, QScale scale, const int8_t* xq) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // VPDPBUSD chains (4 cycles' latency a step): one for one or two activation rows, two (added after)
  // for more. Measured on a Zen 4, SmolLM2's Q4_1 matrices, 2 threads, against the AVX2 form: two
  // chains throughout took 0.97x / 1.10x / 0.93x at 1 / 2 / 8 rows, this choice 0.89x / 0.92x / 0.94x
  // (one chain throughout was slower at 8 and more). Why two chains lose at two rows is not known.
  constexpr int CHAINS = G <= 2 ? 1 : 2;
  __m256i sums[CHAINS] = {};
  for (int p = 0; p < 8; ++p) {
    int32_t x;
    std::memcpy(&x, xq + 4 * p, 4);
    sums[p % CHAINS] = _mm256_dpbusd_epi32(sums[p % CHAINS], w.part[p], _mm256_set1_epi32(x));
  }
  __m256i total = sums[0];
  for (int c = 1; c < CHAINS; ++c) total = _mm256_add_epi32(total, sums[c]);
#else
  __m256i pairs = _mm256_setzero_si256();
  for (int p = 0; p < 8; ++p) {
    int32_t x;
    std::memcpy(&x, xq + 4 * p, 4);
    const __m256i product = _mm256_maddubs_epi16(w.part[p], _mm256_set1_epi32(x));
    pairs = p == 0 ? product : _mm256_add_epi16(pairs, product);
  }
  const __m256i total = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, acc);
}

// Lane r of an accumulator: row r's total of an 8-row tile.
inline float q_lane(QAcc acc, int r) {
  alignas(32) float v[8];
  _mm256_store_ps(v, acc);
  return v[r];
}

// Tile row r's total (4-row tiles): its two lanes added.
inline float q_reduce(QAcc acc, int r) {
  alignas(32) float v[8];
  _mm256_store_ps(v, acc);
  return v[2 * r] + v[2 * r + 1];
}

}  // namespace simd
