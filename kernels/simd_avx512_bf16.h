// The AVX-512 BF16 path of the kernels' vector layer (contract in simd.h): 16 fp32 lanes, bf16
// products by VDPBF16PS. Built with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mavx512vnni
// -mfma -mf16c (F16C for the NVFP4 and GGUF scales, simd_fp4_x86.h). GGUF and NVFP4 blocks take the
// AVX2 form (simd_ggml_x86.h, simd_fp4_x86.h), 256-bit, with VPDPBUSD (AVX-512 VNNI) for its sums.

#pragma once

#include <immintrin.h>

#include "simd_fp4_x86.h"
#include "simd_int8_x86.h"
#include "simd_ggml_x86.h"

namespace simd {

constexpr const char* ISA = "avx512_bf16";
constexpr int W = 16;
constexpr int ROWS = 4;  // 4 rows x 4 tile rows = 16 accumulators of the 32 registers
constexpr int QROWS = 8;  // GGUF tiles, as on AVX2
constexpr int FP4ROWS = 8;  // NVFP4 tiles, as on AVX2
constexpr int REGS = 32;
constexpr int64_t PART = 64;  // one register of weights
// Bytes of weights prefetched ahead of the tile being read, as on AVX2 (simd_avx2.h). SmolLM2's 211
// layer and head matrices (AMX Xeon, 2 threads, one call each) without / with it: bf16 12.16 / 10.85 ms
// at one row, 18.44 / 14.57 at four; NVFP4 5.40 / 3.25 and 10.28 / 7.88.
constexpr int64_t PREFETCH = 4096;

using Vec = __m512;
using XB = bf16;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec splat(float f) { return _mm512_set1_ps(f); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec abs(Vec x) { return _mm512_abs_ps(x); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
inline Vec round_int(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
inline Vec scale_pow2(Vec p, Vec k) { return _mm512_scalef_ps(p, k); }
inline Vec where_negative(Vec g, Vec a, Vec b) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), b, a);
}
inline float reduce(Vec x) { return _mm512_reduce_add_ps(x); }

// 15 adds and 30 shuffles where 16 separate horizontal sums cost about 100 instructions. The tree
// below leaves the sum of x[4 i + q] in lane 4 q + i; reading x[t(j)], t(4 i + q) = 4 q + i, instead
// of x[j] puts the sum of x[i] in lane i.
inline Vec reduce_each(const Vec* x) {
  auto t = [x](int j) { return x[4 * (j % 4) + j / 4]; };
  __m512 s[8], u[4], v[2];
  for (int i = 0; i < 8; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t(2 * i), t(2 * i + 1), 0x44),
                         _mm512_shuffle_f32x4(t(2 * i), t(2 * i + 1), 0xEE));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

// Round to nearest even, 16 at a time (VCVTNEPS2BF16); the layout is plain bf16.
inline void prepare_bf16(const float* x, XB* xb, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

inline Vec madd(Vec acc, const bf16* w, const XB* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_loadu_si512(x));
}
inline Vec madd(Vec acc, const float* w, const float* x) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_loadu_ps(x), acc);
}

}  // namespace simd
