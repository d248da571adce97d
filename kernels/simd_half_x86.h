// fp16 -> fp32 of GGUF blocks' scales (F16C) for the x86 builds' GGUF pieces (simd_ggml_x86.h);
// contract in simd.h. Written out because GCC 12 turned the plain loop into scalar conversions.

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

}  // namespace simd
