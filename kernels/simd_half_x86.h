// fp16 -> fp32 of GGUF blocks' scales (F16C), and the per-block arithmetic on a tile's four rows'
// scales, shared by the x86 builds' GGUF pieces (simd_ggml_x86.h, simd_ggml_avx512.h); contract in
// simd.h. Written out because GCC 12 turned the plain loops into scalar products and shuffles.

#pragma once

#include <immintrin.h>

#include <cstdint>

namespace simd {

// n (4 or 8) fp16 scales -> fp32, exactly.
inline void q_scales(const uint8_t* half, float* out, int n) {
  if (n == 8) {
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(half))));
  } else {
    _mm_storeu_ps(out, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(half))));
  }
}

// out[i] = d[i] k for i < n (4 or 8): a tile's rows' scales times an activation block's.
inline void q_scaled(const float* d, float k, float* out, int n) {
  if (n == 8) {
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_set1_ps(k)));
  } else {
    _mm_storeu_ps(out, _mm_mul_ps(_mm_loadu_ps(d), _mm_set1_ps(k)));
  }
}

// 32 activations -> int8 codes q = round(x (127 / amax)) (ties to even, as the portable path's
// std::nearbyint in the default rounding mode), their scale amax / 127 and the codes' sums over each
// half. Scalar code took 0.4 ms of a 3.9 ms one-row pass of SmolLM2 here (Zen 3), 1.5 of 10 at 4 rows.
inline float q_quantize_block(const float* x, int8_t* q, int32_t* half_sums) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i)
    n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (int h = 0; h < 2; ++h) {
    __m256i sum = _mm256_add_epi32(n[2 * h], n[2 * h + 1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    half_sums[h] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1))));
  }
  // int32 -> int8 in element order: the packs interleave 128-bit lanes, one permutation restores it
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return top / 127.f;
}

// acc[i] += c[i] k for i < 4: a block's offset or minimum of each of a tile's rows, times the
// activations' block sum.
inline void q_add_scaled(float* acc, const float* c, float k) {
  _mm_storeu_ps(acc, _mm_fmadd_ps(_mm_loadu_ps(c), _mm_set1_ps(k), _mm_loadu_ps(acc)));
}

}  // namespace simd
