// The AVX2 + FMA path of the kernels' vector layer (contract in simd.h): 8 fp32 lanes; bf16 weights
// widened to fp32 by a shift and a mask, then fp32 FMA. Built with -mavx2 -mfma -mf16c.
//
// A 32-bit lane of a bf16 vector holds elements 2l (low half) and 2l + 1 (high half): `u << 16` is
// element 2l as fp32 and `u & 0xffff0000` element 2l + 1, two integer ops per 16 weights. The
// activations are prepared once per pass in that split order (`prepare_bf16`), so `madd` loads them
// as plain fp32. Lane l then adds the odd product before the even one, as VDPBF16PS does.

#pragma once

#include <immintrin.h>

#include "simd_fp4_x86.h"
#include "simd_int8_x86.h"
#include "simd_ggml_x86.h"

namespace simd {

constexpr const char* ISA = "avx2";
constexpr int W = 8;
constexpr int ROWS = 2;  // 2 rows x 4 tile rows = 8 accumulators of the 16 registers
// GGUF tiles: 8 accumulators beside a decoded block (measured against 4 with 4-row tiles; the 8-row Q4
// tile's decoded block takes 8 registers, so some spill: not tuned again, simd_ggml_x86.h)
constexpr int QROWS = 8;
constexpr int FP4ROWS = 8;  // NVFP4 tiles: 8 accumulators, a decoded pair of tile rows and its scales (simd_fp4_x86.h)
constexpr int REGS = 16;
// 32 bytes per `madd`, so 2 rows x 4 tile rows of accumulators, one part of each row's activations
// (4 registers) and the weight temporaries fit the 16 registers: with 64-byte parts the activations
// of a whole chunk (8 registers) were reloaded for every tile row. A 4-row verify pass of SmolLM2
// (300-token context) took 14.97 ms with 64-byte parts.
constexpr int64_t PART = 32;
// Bytes of weights prefetched ahead of the tile being read: the 120 layer matrices of SmolLM2 at one
// row (212 MB) streamed at 17.7 GB/s without, 23.0 with 4 KB (21.4-23.2 from 4 to 16 KB; Xeon Ice Lake,
// 2 threads, a standalone loop of this kernel), where the hardware prefetcher alone left gaps.
constexpr int64_t PREFETCH = 4096;

using Vec = __m256;
using XB = float;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec splat(float f) { return _mm256_set1_ps(f); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec abs(Vec x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec round_int(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^k built in the exponent field: k + 127 >= 1 for the k exp produces, so it is a normal float.
inline Vec scale_pow2(Vec p, Vec k) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline Vec where_negative(Vec g, Vec a, Vec b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ));
}
inline float reduce(Vec x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Two levels of pairwise adds leave [x0 x1 x2 x3 | x0 x1 x2 x3]'s sums of lanes 0-3 and 4-7 (and the
// same for x4..x7); adding the two halves puts the sum of x[i] in lane i: ((0+1)+(2+3))+((4+5)+(6+7)).
inline Vec reduce_each(const Vec* x) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 8 fp32 rounded to bf16 (nearest even), kept as fp32 with the low 16 bits clear; NaN stays NaN.
inline __m256 round_to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  const __m256 rounded = _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  return _mm256_blendv_ps(rounded, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// Each 16 elements become [evens | odds] (8 + 8 fp32), the order `madd` meets the weights in.
inline void prepare_bf16(const float* x, XB* xb, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m256 a = round_to_bf16(_mm256_loadu_ps(x + i)), b = round_to_bf16(_mm256_loadu_ps(x + i + 8));
    // shuffle_ps picks within 128-bit halves: [a0 a2 b0 b2 | a4 a6 b4 b6]; the permute orders the
    // 64-bit pairs as [a0 a2 a4 a6 b0 b2 b4 b6].
    const __m256 even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    _mm256_storeu_ps(xb + i, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xD8)));
    _mm256_storeu_ps(xb + i + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xD8)));
  }
}

inline Vec madd(Vec acc, const bf16* w, const XB* x) {
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xffff0000u)))),
                        _mm256_loadu_ps(x + 8), acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)), _mm256_loadu_ps(x), acc);
}
inline Vec madd(Vec acc, const float* w, const float* x) {
  return _mm256_fmadd_ps(_mm256_loadu_ps(w), _mm256_loadu_ps(x), acc);
}

}  // namespace simd
