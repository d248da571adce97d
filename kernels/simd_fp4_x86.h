// The x86 NVFP4 pieces of the kernels' vector layer (contract in simd.h), shared by the AVX2 and the
// AVX-512 BF16 builds: 256-bit integer dot products, which both have (the AVX-512 build adds -mf16c).
//
// A register holds two tile rows (a pair): its low 128 bits row A's part of a 64-column chunk, its
// high 128 bits row B's. `pack_fp4_matrix` orders each row's 32 code bytes so that the low nibbles of
// bytes 0-15, their high nibbles, the low nibbles of bytes 16-31 and their high nibbles are four
// parts k = 0 .. 3 in which byte 4 l + b holds element 4 k + b of block l (16 elements a block): one
// 16-entry byte shuffle per part makes the codes 12 + 2 x E2M1 (0, 1, 2, 3, 4, 6, 8, 12 and
// negatives, unsigned and exact). The activations come as int8 in the same part order, each 16-byte
// part broadcast to both halves, so four VPMADDUBSW added in int16 and one VPMADDWD leave in 32-bit
// lane l of each half the exact integer sum over block l of that row, plus 12 times the activations'
// block sum, which they bring precomputed. One fp32 FMA then applies block scale x activation scale:
// per (activation row, pair, chunk) 4 VPMADDUBSW, 3 VPADDW, 1 VPMADDWD, a subtraction, a conversion,
// a multiply and an FMA for 128 weights, where one row's chunk at a time took 2 VPMADDUBSW, a VPADDW, a
// VPMADDWD, a subtraction, a conversion, a multiply and an FMA for each 64 (the whole-pass figures in
// docs/performance.md). The offset of 12 saves the two sign operations per row that VPMADDUBSW's
// unsigned operand would cost otherwise. The pair's eight E4M3 block scales become fp16 by a shift of
// 7 bits (value / 256, subnormals included, since both formats have 3 mantissa bits and E4M3's sign is
// 0 here) and fp32 by VCVTPH2PS. The AVX-512 build (VNNI) adds the four parts by VPDPBUSD, starting
// from the offsets negated: the same exact sums (tested bit for bit against AVX2); on a Zen 4 its fused
// NVFP4 passes of 4 to 16 rows took 0.92-0.95x the time (`benchmarks/verify_pass.py --weights nvfp4`).
// A 512-bit form taking both pairs of a tile at once is not written: Zen 4 runs 512-bit integer
// operations as two 256-bit halves, so it would save instructions, not cycles, there.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace simd {

struct Fp4Pair {
  __m256i part[4];  // 12 + 2 x E2M1; half h (row A, B), byte 4 l + b of part k: block l's element 4 k + b
  __m256 scale;     // lane 4 h + l: the scale / 256 of the row's block l
};
using Fp4Acc = __m256;  // lanes 0-3: row A's blocks, 4-7: row B's

inline Fp4Acc fp4_zero() { return _mm256_setzero_ps(); }

// A pair's 64 code bytes (two loads of [row A's 16 | row B's 16]) and 8 E4M3 scales (row A's 4, row B's 4).
inline Fp4Pair fp4_pair_decode(const uint8_t* codes, const uint8_t* scales) {
  const __m256i table = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                         12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  Fp4Pair w;
  for (int m = 0; m < 2; ++m) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * m));
    w.part[2 * m] = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, nibble));
    w.part[2 * m + 1] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble));
  }
  uint64_t eight;
  std::memcpy(&eight, scales, 8);
  const __m128i wide = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<int64_t>(eight)));
  w.scale = _mm256_cvtph_ps(_mm_slli_epi16(wide, 7));
  return w;
}

// 16 bytes of the activations (a part, or 4 int32) in both halves.
inline __m256i fp4_broadcast16(const void* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// acc + the pair's products with one activation row's chunk: xq [64] int8 in part order, xs [4] the
// activations' block scales, xo [4] 12 times their block sums.
inline Fp4Acc fp4_pair_madd(Fp4Acc acc, const Fp4Pair& w, const int8_t* xq, const float* xs, const int32_t* xo) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // VPDPBUSD adds each lane's four products in int32, starting from the offsets negated: the same sums.
  __m256i sums = _mm256_sub_epi32(_mm256_setzero_si256(), fp4_broadcast16(xo));
  for (int k = 0; k < 4; ++k) sums = _mm256_dpbusd_epi32(sums, w.part[k], fp4_broadcast16(xq + 16 * k));
#else
  // w + 12 <= 24 and |x| <= 127: a VPMADDUBSW pair is at most 6096 and four parts' 24,384, inside int16.
  __m256i pairs = _mm256_maddubs_epi16(w.part[0], fp4_broadcast16(xq));
  for (int k = 1; k < 4; ++k) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w.part[k], fp4_broadcast16(xq + 16 * k)));
  const __m256i sums = _mm256_sub_epi32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)), fp4_broadcast16(xo));
#endif
  const __m256 scale = _mm256_mul_ps(w.scale, _mm256_broadcast_ps(reinterpret_cast<const __m128*>(xs)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
}

// Row r's (0: A, 1: B) total: (lane 0 + lane 1) + (lane 2 + lane 3) of its half.
inline float fp4_pair_reduce(Fp4Acc x, int r) {
  const __m128 h = r == 0 ? _mm256_castps256_ps128(x) : _mm256_extractf128_ps(x, 1);
  const __m128 s = _mm_add_ps(h, _mm_movehdup_ps(h));  // lanes 0, 2: l0 + l1, l2 + l3
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehl_ps(s, s)));
}

}  // namespace simd
