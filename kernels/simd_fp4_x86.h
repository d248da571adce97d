// The x86 NVFP4 pieces of the kernels' vector layer (contract in simd.h), shared by the AVX2 and the
// AVX-512 BF16 builds: 256-bit integer dot products, which both have (the AVX-512 build adds -mf16c).
//
// A row's 64 codes of a tile chunk (32 bytes, even elements in the low nibbles) become two vectors
// of 32 bytes by one 16-entry byte shuffle each: [evens | odds], 12 + the code's value times 2 (2 x
// E2M1 is 0, 1, 2, 3, 4, 6, 8, 12 and negatives), unsigned and exact. Activations are int8 in the same
// split order, so VPMADDUBSW (unsigned times signed bytes) and VPMADDWD leave in each 32-bit lane l
// the exact integer sum over elements 8 l .. 8 l + 7, all in block l / 2, plus 12 times the sum of
// those activations, which the activations bring precomputed; one fp32 FMA per lane then applies
// block scale x activation scale. The offset of 12 saves the two sign operations per row that
// VPMADDUBSW's unsigned operand would cost otherwise. The four E4M3 block scales become fp16 by a shift of 7 bits
// (value / 256, subnormals included, since both formats have 3 mantissa bits and E4M3's sign is 0
// here) and fp32 by VCVTPH2PS. Against decoding every weight to fp32 (a permute, sign bits and a
// multiply per 8 weights) this does one shuffle per 32 weights and reads nothing but codes and scales.
// On AVX-512 a 512-bit form with VPDPBUSD would take two tile rows at once; it is not written, since
// no machine here runs that build to measure or test it.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace simd {

struct Fp4 {
  __m256i even, odd;  // 12 + 2 x E2M1 of elements 2 i and 2 i + 1, i = 0 .. 31
  __m256 scale;       // lane l: the scale / 256 of block l / 2
};
using Fp4Acc = __m256;

inline Fp4Acc fp4_zero() { return _mm256_setzero_ps(); }

inline Fp4 fp4_decode(const uint8_t* codes, const uint8_t* scales) {
  const __m256i table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  Fp4 w;
  w.even = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, nibble));
  w.odd = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble));
  uint32_t four;
  std::memcpy(&four, scales, 4);
  // Each scale byte twice, zero-extended to 16 bits: [s0 s0 s1 s1 s2 s2 s3 s3].
  const __m128i pairs = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(four)),
                                         _mm_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1));
  w.scale = _mm256_cvtph_ps(_mm_slli_epi16(pairs, 7));
  return w;
}

// acc + one row's 64 products: xq [32 evens | 32 odds] int8, xs [8] the activation scale of each lane,
// xo [8] 12 times the sum of each lane's activations.
inline Fp4Acc fp4_madd(Fp4Acc acc, const Fp4& w, const int8_t* xq, const float* xs, const int32_t* xo) {
  const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
  // w + 12 <= 24 and |x| <= 127: a pair is at most 6096 and four 12192, inside int16 (no saturation).
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w.even, even), _mm256_maddubs_epi16(w.odd, odd));
  const __m256i sums = _mm256_sub_epi32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)),
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xo)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(w.scale, _mm256_loadu_ps(xs)), acc);
}

inline float fp4_reduce(Fp4Acc x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

}  // namespace simd
