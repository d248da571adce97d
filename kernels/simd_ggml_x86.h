// The AVX2 pieces of the kernels' vector layer (contract in simd.h) for GGUF's block formats Q4_0,
// Q4_1 and Q8_0: 256-bit integer dot products, one tile row per accumulator (the AVX-512 build takes
// two at once, simd_ggml_avx512.h).
//
// A GGUF block is 32 weights along a row with fp16 scales: Q4_0 w = d (q - 8), Q4_1 w = d q + m
// (q = 0 .. 15, elements 0-15 in the low nibbles of its 16 bytes, 16-31 in the high ones), Q8_0
// w = d q (q int8). Activations meet them as int8, one fp32 scale per 32 (the block), as llama.cpp's
// Q8_0/Q8_1 activations do. The 4-bit codes become 32 unsigned bytes in element order (a mask and a
// shift), so VPMADDUBSW and VPMADDWD leave in 32-bit lane l the exact integer sum over elements
// 4 l .. 4 l + 3; Q8_0's signed weights take the sign trick (|w| times x with w's sign). One fp32 FMA
// per lane then applies d x activation scale; Q4_0's -8 and Q4_1's m are added per block, not here
// (q_madd). The fp16 scales of a tile's four rows become fp32 in one VCVTPH2PS.

#pragma once

#include <immintrin.h>

#include <cstdint>

#include "simd_fp4_x86.h"
#include "simd_half_x86.h"

namespace simd {

constexpr int QJ = 1;  // tile rows per accumulator
using QAcc = __m256;
using QCodes = __m256i;  // one row's 32 codes of a block: unsigned (Q4_*) or signed (Q8_0) bytes

using QScale = __m256;  // a number in every lane

inline QAcc q_zero() { return _mm256_setzero_ps(); }
inline QScale q_row_scales(const float* s) { return _mm256_set1_ps(*s); }
// Q6_K's two scales of a sub-block, s[0] for elements 0-15 (lanes 0-3), s[1] for 16-31.
inline QScale q_half_scales(const float* s) { return _mm256_set_m128(_mm_set1_ps(s[1]), _mm_set1_ps(s[0])); }

// 16 bytes of nibbles -> [low nibbles (elements 0-15) | high nibbles (16-31)]: the bytes loaded into
// both halves, the upper half shifted by 4, one mask. Two vector operations where splitting and
// joining halves took four; a 4-row pass shares the decode, so it is 2 of the 18 a tile row's block
// costs there, and 2 of 6 at one row.
inline QCodes q4_decode(const uint8_t* qs) {
  const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}

// Q4_K: one nibble of 32 bytes (the high ones when `high`) -> 32 codes in element order; `stride`
// (bytes between tile rows) is for the AVX-512 form, which takes two rows.
inline QCodes q4k_decode(const uint8_t* qs, int64_t /*stride*/, bool high) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  return _mm256_and_si256(high ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
}

// Q6_K sub-block s (0 .. 7) of a row's 192 code bytes: 4 low bits from `ql` (bytes 0-127), 2 high from
// `qh` (128-191), as ggml lays them out -> 32 codes 0 .. 63 in element order.
inline QCodes q6k_decode(const uint8_t* codes, int64_t /*stride*/, int s) {
  const int half = s / 4, k = s % 4;
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + half * 64 + (k & 1) * 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 128 + half * 32));
  const __m256i low = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128((k >> 1) * 4)), _mm256_set1_epi8(0x0F));
  const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
  return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
}

inline QCodes q8_decode(const uint8_t* qs) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)); }

inline void q_store(int8_t* out, QCodes q, int /*row*/) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), q); }

// Lane l: the exact integer sum of w x over elements 4 l .. 4 l + 3 of a block; w unsigned (<= 63
// for Q4 and Q6_K, so a pair is at most 2 x 63 x 127, inside int16) or signed (Q8_0: |w| <= 128, a pair at
// most 2 x 128 x 127 = 32,512, inside int16 too).
template <bool SIGNED>
inline __m256i q_lanes(QCodes w, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i pairs = SIGNED ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                               : _mm256_maddubs_epi16(w, x);
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// acc + one row's block against int8 activations xq [32]: the exact integer sum over elements
// 4 l .. 4 l + 3 in lane l, times `scale` (d times the activations' scale, q_row_scales or
// q_half_scales of those products). A block's offset (Q4_0's 8, Q6_K's 32) or minimum (Q4_1, Q4_K)
// is the same for its 32 weights, so it meets the activations' block sum once per row, outside
// (cpu_decode.cpp, `BlockTerms`): 4 vector operations per row and block, against 6 for Q4_1 and 7
// for Q4_0 when they were added lane by lane here.
template <bool SIGNED>
inline QAcc q_madd(QAcc acc, QCodes w, QScale scale, const int8_t* xq) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q_lanes<SIGNED>(w, xq)), scale, acc);
}

inline float q_reduce(QAcc x, int /*row*/) { return fp4_reduce(x); }  // the same 8-lane tree

}  // namespace simd
