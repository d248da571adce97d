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

// acc[i] += c[i] k for i < 4: a block's offset or minimum of each of a tile's rows, times the
// activations' block sum.
inline void q_add_scaled(float* acc, const float* c, float k) {
  _mm_storeu_ps(acc, _mm_fmadd_ps(_mm_loadu_ps(c), _mm_set1_ps(k), _mm_loadu_ps(acc)));
}

}  // namespace simd
