// The AVX-512 pieces of the kernels' vector layer (contract in simd.h) for GGUF's block formats Q4_0,
// Q4_1 and Q8_0: the AVX2 scheme (simd_ggml_x86.h) on 512-bit registers holding two tile rows at
// once, the block's activations in both halves, and VPDPBUSD (AVX-512 VNNI, which every CPU with
// AVX-512 BF16 has) summing each lane's four byte products in one instruction. Lanes 0-7 belong to
// the first row, 8-15 to the second; each lane's sum is exact and is scaled and added in the same
// order as on AVX2, so one accumulator per (activation row, row pair) keeps every output's order
// fixed whatever the number of rows.

#pragma once

#include <immintrin.h>

#include <cstdint>

#include "simd_fp4_x86.h"
#include "simd_half_x86.h"

namespace simd {

constexpr int QJ = 2;  // tile rows per accumulator
using QAcc = __m512;
using QCodes = __m512i;  // two rows' 32 codes of a block, row j in the low half

inline QAcc q_zero() { return _mm512_setzero_ps(); }

// Two consecutive rows' 16 bytes of nibbles -> [row j: low nibbles, high nibbles | row j + 1: ...].
inline QCodes q4_decode(const uint8_t* qs) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, nibble)),
                                          _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble), 1);
  // 128-bit lanes [low j, low j+1, high j, high j+1] -> [low j, high j, low j+1, high j+1]
  return _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
}

// Q4_K: one nibble of 32 bytes of each of two rows `stride` bytes apart -> [row j | row j + 1].
inline QCodes q4k_decode(const uint8_t* qs, int64_t stride, bool high) {
  const __m512i raw = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + stride)), 1);
  return _mm512_and_si512(high ? _mm512_srli_epi16(raw, 4) : raw, _mm512_set1_epi8(0x0F));
}

// Q6_K sub-block s of two rows' 192 code bytes, `stride` bytes apart (simd_ggml_x86.h's layout).
inline QCodes q6k_decode(const uint8_t* codes, int64_t stride, int s) {
  const int half = s / 4, k = s % 4;
  const uint8_t* ql = codes + half * 64 + (k & 1) * 32;
  const uint8_t* qh = codes + 128 + half * 32;
  auto two = [stride](const uint8_t* p) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + stride)), 1);
  };
  const __m512i low = _mm512_and_si512(_mm512_srl_epi16(two(ql), _mm_cvtsi32_si128((k >> 1) * 4)), _mm512_set1_epi8(0x0F));
  const __m512i high = _mm512_and_si512(_mm512_srl_epi16(two(qh), _mm_cvtsi32_si128(2 * k)), _mm512_set1_epi8(3));
  return _mm512_or_si512(low, _mm512_slli_epi16(high, 4));
}

inline QCodes q8_decode(const uint8_t* qs) { return _mm512_loadu_si512(qs); }

inline void q_store(int8_t* out, QCodes q, int row) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), row ? _mm512_extracti64x4_epi64(q, 1)
                                                            : _mm512_extracti64x4_epi64(q, 0));
}

using QScale = __m512;  // a number per row's lanes: [row j x 8 | row j + 1 x 8], or one number in all

// The two rows' scales s[0], s[1] as [s0 x 8 | s1 x 8].
inline QScale q_row_scales(const float* s) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(s[0])), _mm256_set1_ps(s[1]), 1);
}
// Q6_K's scales of a sub-block's halves for two rows, s = [j: first, second | j + 1: first, second].
inline QScale q_half_scales(const float* s) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                               _mm512_castps128_ps512(_mm_loadu_ps(s)));
}

inline __m512i q_twice(const void* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// acc + two rows' block against the activations (as simd_ggml_x86.h's q_madd, per row).
template <bool SIGNED>
inline QAcc q_madd(QAcc acc, QCodes w, QScale scale, const int8_t* xq) {
  __m512i x = q_twice(xq);
  if constexpr (SIGNED) {
    // |w| (-128 stays 0x80, 128 unsigned) times x with w's sign: |x| <= 127, so -x fits.
    x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    w = _mm512_abs_epi8(w);
  }
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x)), scale, acc);
}

inline float q_reduce(QAcc x, int row) {
  const __m512d p = _mm512_castps_pd(x);
  return fp4_reduce(_mm256_castpd_ps(row ? _mm512_extractf64x4_pd(p, 1) : _mm512_extractf64x4_pd(p, 0)));
}

}  // namespace simd
