// The vector layer the CPU decode kernels (`cpu_decode.cpp`) are written against, one header per
// instruction set, chosen when the module is built: `-DSPECLOOP_AVX512_BF16`, `-DSPECLOOP_AVX2`, or
// neither for the portable path (plain C++ the compiler vectorises; aarch64 included).
//
// Every header defines, in namespace `simd`:
//   ISA                      the path's name, as `kernels/cpu_features.py` spells it
//   W                        fp32 lanes per `Vec`
//   ROWS                     rows of activations a weight tile is read against at once (registers)
//   QROWS                    the same for GGUF block tiles (at most 8)
//   FP4ROWS                  the same for NVFP4 tiles (at most 8)
//   REGS                     vector registers the compiler has (for blocking choices)
//   PREFETCH                 bytes of weights to prefetch ahead of the matrix tile being read (0: none)
//   Vec                      W fp32 lanes
//   zero, splat, load, store, add, sub, mul, div, max, abs, fmadd (a b + c), fnmadd (c - a b)
//   round_int(x)             nearest integer, ties to even
//   scale_pow2(p, k)         p 2^k for integral k in [-126, 0] (exp's last step)
//   where_negative(g, a, b)  a where g < 0, else b, per lane
//   reduce(x)                the sum of x's lanes, always by the same tree
//   reduce_each(x[W])        a Vec whose lane i is reduce(x[i]), by the same tree whatever the others hold
//   XB                       the element type bf16 weights meet: activations rounded to bf16, laid out
//                            as `madd` reads them
//   prepare_bf16(x, xb, n)   fp32 rows [n] (n a multiple of 32) rounded to nearest even bf16 into XB
//   PART                     bytes of a weight row one `madd` takes (64 or a divisor of it)
//   madd(acc, w, x)          acc + PART bytes of a weight row times the matching activations (PART / 2
//                            bf16 weights against as many XB, or PART / 4 fp32 against fp32); the lanes
//                            a product lands in and the order it is added depend only on its index
//   Fp4Pair, Fp4Acc          two rows' 64 NVFP4 weights of a tile chunk (a pair), decoded; an
//                            accumulator of 8 fp32 lanes for them, one per (row, block of 16)
//                            (simd_fp4_x86.h says how x86 does it and how the codes are ordered)
//   fp4_pair_decode(codes, s)  a pair's 64 code bytes in part order and 8 E4M3 block scales -> Fp4Pair:
//                            values as 12 + 2 x E2M1 integers, scales as E4M3 / 256
//   fp4_pair_madd(acc, w, xq, xs, xo)  acc + the pair's products with one activation row's chunk: int8
//                            xq [64] in part order, block scales xs [4], xo [4] 12 times each block's
//                            activation sum: lane 4 r + l adds the exact integer sum over row r's block l
//                            (offset removed) times its scale times xs[l]
//   fp4_zero, fp4_pair_reduce(acc, r)  an empty accumulator; row r's four lanes added by a fixed tree
//   QBlock                   a 4-row GGUF tile's codes of one 32-weight block (Q8_0; K-quants: sub-block),
//                            decoded from the tile's interleaved bytes (cpu_decode.cpp, "GGUF block rows")
//   q8_block(qs)             a Q8_0 tile block's 128 int8 -> QBlock
//   q4k_block(qs, high)      Q4_K: the low or high nibbles of the tile's 128 bytes at qs (32 per row)
//   q6k_block(codes, s)      Q6_K: sub-block s of a tile's 768 code bytes -> codes 0 .. 63
//   q_store(out, w)          row r's 32 codes to out[32 r ..] in element order (for tests)
//   QAcc, QScale             8 fp32 lanes: two per row of a 4-row tile (lanes 2r, 2r + 1), one per row of
//                            an 8-row tile
//   q_scales(h, out, n)      n (4 or 8) fp16 scales -> fp32, exactly
//   q_rows(s), q_first(s)    QScale of 4 rows' numbers s[r] in both lanes of row r; in the first only
//   q_times(s, k)            s k in every lane
//   q_madd<C, FIRST, N>(acc, w, scale, xq)  acc + the 4 rows' products of the block's elements
//                            8 FIRST .. 8 (FIRST + N) - 1 with int8 activations xq [32] (the block's):
//                            lane 2r adds the exact integer sum over elements 0-3 of each eight, lane
//                            2r + 1 over 4-7, times its lane of `scale`; C (QCodesKind) bounds the codes (Q4: 0 .. 15,
//                            Q6: 0 .. 63, Q8: signed); offsets and minima are the caller's
//   q_add_scaled(acc, c, k)  acc + c k, per lane: a block's offset or minimum times the activations' sum
//   q_zero, q_reduce(acc, r) an empty accumulator; row r's two lanes added
//   Q4Wide                   an 8-row Q4_0 or Q4_1 tile's codes of one block (0 .. 15), from its 128
//                            interleaved bytes by q4_wide_block(qs); q4_wide_store(out, w) as q_store
//   q_half8(h)               a QScale whose lane r is 8 rows' fp16 number h[r] (d or m), exactly
//   q4_wide_madd<G>(acc, w, scale, xq)  acc + per row r, in lane r, the exact integer sum of the block's
//                            32 products with int8 activations xq [32] times lane r of `scale`; G, the
//                            activation rows meeting the block, may choose how (never the result)
//   q_lane(acc, r)           lane r: row r's total of an 8-row tile
//   q_quantize_block(x, q, half_sums)  32 fp32 activations -> int8 codes round(x (127 / amax)), ties
//                            to even; the codes' sums over each 16 in half_sums; returns amax / 127
//   fp4_quantize_block(x, chunk, l, sum)  the same for 16 activations, block l of a chunk: codes to
//                            chunk [64] in part order, their sum to *sum
//
// What stays the same on every path: products of bf16 weights and bf16-rounded activations are exact
// in fp32 and summed in fp32; each output is summed by one fixed order whatever the number of rows,
// so a token's result does not depend on what else is in its pass. What differs: W, so sums of the
// same numbers are grouped differently and paths agree only to rounding.

#pragma once

#include <cstdint>
#include <cstring>

namespace simd {

using bf16 = uint16_t;

inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<bf16>(u >> 16);
}

inline float from_bf16(bf16 b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace simd

#if defined(SPECLOOP_AVX512_BF16)
#include "simd_avx512_bf16.h"
#elif defined(SPECLOOP_AVX2)
#include "simd_avx2.h"
#else
#include "simd_portable.h"
#endif
