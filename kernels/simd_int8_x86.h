// Activations to int8 on x86, as the NVFP4 and GGUF matrix paths meet them (contract in simd.h),
// shared by the AVX2 and AVX-512 BF16 builds: per block, codes round(x (127 / amax)), ties to even
// (as the portable path's std::nearbyint in the default rounding mode: the same codes on every path),
// scale amax / 127, and the codes' sums per 16. Scalar, this took 0.4 ms of a 3.9 ms one-row
// pass of SmolLM2's GGUF layers here (Zen 3), and about 1.5 ms of a 10 ms 4-row one.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace simd {

inline float amax_of(const __m256* v, int n) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 top = _mm256_setzero_ps();
  for (int i = 0; i < n; ++i) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// v times 127 / amax, rounded to the nearest integer, ties to even (int32 lanes)
inline __m256i int8_codes(__m256 v, float amax) {
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline int32_t sum_of(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// int32 lanes (codes of 8 elements each) -> int8 in element order
inline __m128i to_bytes(__m256i a, __m256i b) {
  return _mm_packs_epi16(_mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)),
                         _mm_packs_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// GGUF: a block of 32 activations -> codes q [32] in order, the codes' sums over each 16.
inline float q_quantize_block(const float* x, int8_t* q, int32_t* half_sums) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const float amax = amax_of(v, 4);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) n[i] = int8_codes(v[i], amax);
  for (int h = 0; h < 2; ++h) half_sums[h] = sum_of(_mm256_add_epi32(n[2 * h], n[2 * h + 1]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), to_bytes(n[0], n[1]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), to_bytes(n[2], n[3]));
  return amax / 127.f;
}

// NVFP4: block l (0 .. 3) of a chunk's 64 activations, 16 at x -> its codes in the chunk's part order
// (simd_fp4_x86.h: element 4 k + b to chunk[16 k + 4 l + b]), the codes' sum to *sum.
inline float fp4_quantize_block(const float* x, int8_t* chunk, int l, int32_t* sum) {
  const __m256 v[2] = {_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)};
  const float amax = amax_of(v, 2);
  const __m256i n[2] = {int8_codes(v[0], amax), int8_codes(v[1], amax)};
  *sum = sum_of(_mm256_add_epi32(n[0], n[1]));
  alignas(16) int8_t codes[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(codes), to_bytes(n[0], n[1]));
  for (int k = 0; k < 4; ++k) std::memcpy(chunk + 16 * k + 4 * l, codes + 4 * k, 4);
  return amax / 127.f;
}

}  // namespace simd
