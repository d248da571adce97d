// Small-batch forward passes (bf16, fp32, NVFP4 or GGUF block weights) of the Llama-family decoder on
// the CPU, one C++ call per pass, written once against the vector layer in simd.h and built once per instruction set
// (AVX-512 BF16, AVX2 + FMA, portable); `kernels/cpu_decode.py` picks the build this CPU can run.
//
// Why it exists (SmolLM2-135M, 2 cores, one-token decode): the weights are read once per token and
// the eager path spends its time around them, not in them. Per step the eager path measured
// 11.7 ms in oneDNN matrix-vector products (18 GB/s of weights), 1.7 ms in the LM head and about
// 8.7 ms in 40-odd small ops per layer (norms, RoPE, cache writes, casts, attention), each a few
// microseconds of dispatch. Here the layer matrices take about 7.3 ms and the glue is plain loops:
// a bf16 decode step fell from 22-26 ms to 8.5-10.5 ms (AVX-512 BF16).
//
// What it is: `linear` (y = x W^T + b for up to a few dozen rows), `linear_nvfp4` (the same from NVFP4
// weights, kernels/nvfp4.py, with int8 activations: see "NVFP4 matrix rows"), `linear_ggml` (from a GGUF
// file's own Q4_0, Q4_1 and Q8_0 blocks: "GGUF block rows") and `Decoder`, which holds one model's
// weights and runs rows of tokens through every layer against the model's fp32 KV cache.
// A DFlash drafter's layers are such a model too: `forward(..., block=true)` runs a draft block and
// `context` writes the keys/values of its context features.
// What it is not: prefill of long prompts (oneDNN's blocked GEMM wins there), training (no autograd),
// or anything off the CPU. The Python side (`engine/fused_decode.py`) decides when it applies.
//
// Numerics: products of bf16 weights and bf16-rounded inputs are exact in fp32 and summed in fp32
// (VDPBF16PS, or a widening shift and FMA); sums, norms, RoPE, softmax and the residual stream are
// fp32; inputs to each matrix are rounded to bf16 as the eager path does (to int8 per 16 values, with
// an fp32 scale, for NVFP4 matrices, whose block sums are then exact integers). Every row is computed the
// same way whatever the number of rows, so a token's logits do not depend on what else is in the
// batch (greedy speculation stays token-identical to plain decoding), on every path.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using simd::bf16;
using simd::Vec;
using simd::W;

// exp for x <= 0 (softmax and SiLU both arrange that), W lanes: 2^k * p(r) with the Cephes expf
// polynomial; the reference tests bound the error it adds.
inline Vec exp_neg(Vec x) {
  using namespace simd;
  x = max(x, splat(-87.0f));
  const Vec k = round_int(mul(x, splat(1.44269504f)));
  Vec r = fnmadd(k, splat(0.693359375f), x);
  r = fnmadd(k, splat(-2.12194440e-4f), r);
  Vec p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  p = fmadd(mul(p, r), r, add(r, splat(1.0f)));
  return scale_pow2(p, k);
}

float exp_scalar(float x) {
  alignas(64) float v[W];
  simd::store(v, exp_neg(simd::splat(x)));
  return v[0];
}

// ---- matrix rows: y[m, o] = sum_i x[m, i] * w[o, i] -------------------------------------------
//
// Weights are packed once into tiles of 4 output rows laid side by side, 64 bytes of each row at a
// time: `pack` turns [out, in] into [ceil(out / 4), in / V, 4, V] (V = 32 bf16 or 16 fp32, rows past
// `out` zero), the same layout on every path. A tile is then one sequential read, and each
// activation chunk loaded serves four weight rows. Measured on SmolLM2's 120 layer matrices (2 cores,
// bf16, AVX-512 BF16), against row-major weights read one row at a time: 7.5 vs 8.6 ms at 4 rows,
// 9.5 vs 15.9 ms at 8, and about the same (7.0-7.6 ms) at 1 row, where both are bound by memory.

constexpr int64_t TILE = 4;

// NVFP4 tiles: a 4-row tile is two pairs of rows, one after the other; a pair is, per 64-column chunk,
// its two rows' 32 code bytes each in part order (simd_fp4_x86.h), [A 0-15 | B 0-15 | A 16-31 | B
// 16-31], then row A's 4 E4M3 block scales and row B's: one sequential read of 72 bytes per chunk
// (4.5 bits per weight). `FP4_TILE_BYTES` is a tile's bytes per chunk.
constexpr int64_t FP4_CHUNK = 64, FP4_CODES = FP4_CHUNK / 2, FP4_SCALES = FP4_CHUNK / 16;
constexpr int64_t FP4_PAIR_BYTES = 2 * (FP4_CODES + FP4_SCALES), FP4_TILE_BYTES = TILE / 2 * FP4_PAIR_BYTES;
// The kernel's integers are 2 x E2M1 and its scales E4M3 / 256 (simd.h): 256 / 2 brings them back.
constexpr float FP4_UNIT = 128.f;

// The activations a weight of element type T meets: prepared bf16 for bf16 weights, fp32 for fp32.
template <typename T>
using Activation = std::conditional_t<std::is_same_v<T, bf16>, simd::XB, float>;

// G rows of x against one tile. One accumulator per (row, output), summed over the chunks in order,
// so each output is formed the same way whatever G is: a token's result does not depend on what
// else is in its pass.
template <int G, typename T>
void tile_rows(const T* tile, const Activation<T>* x, float* y, int64_t in, int64_t out, int64_t first) {
  constexpr int64_t V = 64 / sizeof(T), P = simd::PART / sizeof(T);  // elements per chunk, per madd
  Vec acc[G][TILE];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < TILE; ++j) acc[g][j] = simd::zero();
  for (int64_t c = 0; c < in / V; ++c) {
    const T* wc = tile + c * TILE * V;
    if constexpr (simd::PREFETCH > 0)
      for (int64_t line = 0; line < TILE * 64; line += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(wc) + simd::PREFETCH + line);
    for (int64_t p = 0; p < V; p += P)
      for (int g = 0; g < G; ++g) {
        const Activation<T>* xc = x + g * in + c * V + p;
        for (int j = 0; j < TILE; ++j) acc[g][j] = simd::madd(acc[g][j], wc + j * V + p, xc);
      }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < TILE && first + j < out; ++j) y[g * out + first + j] = simd::reduce(acc[g][j]);
}

// Calls f(std::integral_constant<int, G>{}) with G = n (1 <= n <= MAX): a pass's activation rows
// against a tile as a template argument, so each G compiles its own loop with its accumulators in
// registers.
template <int MAX, typename F>
void with_rows(int64_t n, F&& f) {
  static_assert(MAX >= 1 && MAX <= 8);
  if constexpr (MAX > 1) {
    if (n < MAX) return with_rows<MAX - 1>(n, f);
  }
  f(std::integral_constant<int, MAX>{});
}

// x [M, in] (prepared for the weight's element type) times packed w -> y [M, out] fp32; both threads
// split the tiles, so each weight is read from memory once per call.
template <typename T>
void matmul_rows(const Activation<T>* x, const T* w, const float* bias, float* y, int64_t M, int64_t in, int64_t out) {
  const int64_t tiles = (out + TILE - 1) / TILE;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* tile = w + t * TILE * in;
      for (int64_t m = 0; m < M; m += simd::ROWS) {
        const Activation<T>* xm = x + m * in;
        float* ym = y + m * out;
        with_rows<simd::ROWS>(M - m, [&](auto g) { tile_rows<decltype(g)::value>(tile, xm, ym, in, out, t * TILE); });
      }
    }
    if (bias != nullptr)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t o = t0 * TILE; o < std::min(out, t1 * TILE); ++o) y[m * out + o] += bias[o];
  });
}

void check_matrix(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16) && t.dim() == 2 &&
                  t.is_contiguous() && t.size(1) % 32 == 0,
              name, ": expected a contiguous bf16 or fp32 matrix (the model's dtype) with a multiple of 32 columns");
}

// The formats of GGUF blocks the kernel reads as they are (simd_ggml_x86.h), numbered as ggml's
// `ggml_type` does, so the Python side passes a GGUF tensor's type id unchanged.
enum class Ggml : int64_t { NONE = -1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
constexpr int64_t Q_BLOCK = 32;  // weights per GGUF block (per K-quant sub-block), along a row
constexpr int64_t K_BLOCK = 256, K_SUB = K_BLOCK / Q_BLOCK;  // a K-quant super-block: 8 sub-blocks of 32
constexpr bool k_quant(Ggml t) { return t == Ggml::Q4_K || t == Ggml::Q6_K; }

// Per row and block (K-quants: super-block): weights, bytes of codes (Q6_K: 128 of low nibbles, then
// 64 of high 2-bit pairs), of sub-block scales (Q4_K: 12 of 6-bit scales and minima; Q6_K: 16 int8)
// and of fp16 scales (d; d and m for Q4_1; d and dmin for Q4_K), as the file stores them. A block
// stores the fp16 scales first, then the sub-block scales, then the codes; Q6_K the other way round.
constexpr int64_t q_block_weights(Ggml t) { return k_quant(t) ? K_BLOCK : Q_BLOCK; }
constexpr int64_t q_code_bytes(Ggml t) {
  return t == Ggml::Q6_K ? 192 : t == Ggml::Q4_K ? 128 : t == Ggml::Q8_0 ? 32 : 16;
}
constexpr int64_t q_sub_scale_bytes(Ggml t) { return t == Ggml::Q6_K ? 16 : t == Ggml::Q4_K ? 12 : 0; }
constexpr int64_t q_scale_bytes(Ggml t) { return t == Ggml::Q4_1 || t == Ggml::Q4_K ? 4 : 2; }
constexpr int64_t q_block_bytes(Ggml t) { return q_code_bytes(t) + q_sub_scale_bytes(t) + q_scale_bytes(t); }
// Q4_0 and Q4_1 tiles are 8 rows high: one register holds 4 codes of each of 8 rows, so a block's
// sum per row is formed in int16 and converted once (simd_ggml_x86.h); the other formats' are 4 rows.
constexpr int64_t q_tile_rows(Ggml t) { return t == Ggml::Q4_0 || t == Ggml::Q4_1 ? 2 * TILE : TILE; }
constexpr int64_t q_tile_bytes(Ggml t) { return q_tile_rows(t) * q_block_bytes(t); }

// A weight packed by `pack` (bf16 or fp32), `pack_nvfp4` or `pack_ggml` (uint8), with its true number
// of output rows and, for NVFP4, its tensor scale, for GGUF blocks their format.
struct Packed {
  at::Tensor tiles;  // [ceil(out / 4), in / V, 4, V], NVFP4 [ceil(out / 4), in / 64, FP4_TILE_BYTES],
                     // GGUF [ceil(out / q_tile_rows), in / q_block_weights, q_tile_bytes]
  int64_t out = 0;
  float tensor_scale = 0.f;
  Ggml ggml = Ggml::NONE;
  bool quantized() const { return tiles.scalar_type() == at::kByte; }
  bool fp4() const { return quantized() && ggml == Ggml::NONE; }
  int64_t tile_rows() const { return ggml == Ggml::NONE ? TILE : q_tile_rows(ggml); }
  int64_t in() const {
    if (!quantized()) return tiles.size(1) * tiles.size(3);
    return tiles.size(1) * (fp4() ? FP4_CHUNK : q_block_weights(ggml));
  }
};

Packed pack_matrix(const at::Tensor& w) {
  check_matrix(w, w.scalar_type(), "weight");
  const int64_t out = w.size(0), in = w.size(1), v = 64 / w.element_size();
  const int64_t tiles = (out + TILE - 1) / TILE;
  auto padded = at::zeros({tiles * TILE, in}, w.options());
  padded.narrow(0, 0, out).copy_(w);
  return {padded.view({tiles, TILE, in / v, v}).transpose(1, 2).contiguous(), out};
}

// ---- NVFP4 matrix rows ------------------------------------------------------------------------
//
// Activations meet NVFP4 weights as int8, one fp32 scale per 16 (the weights' block size): x = q s,
// s = amax / 127, q rounded to nearest even. The relative error this adds to a product is about
// 2^-9, under the weights' own (SQNR about 20 dB, kernels/nvfp4.py), and it lets the kernel form
// each 16-element block's sum exactly in integers. Rows are quantized alone, so a token's result
// does not depend on what else is in its pass.

// Activations of NVFP4 passes: per row and 64-column chunk, the 64 elements as int8 in part order
// (simd_fp4_x86.h), and per block of 16 its scale and 12 times its codes' sum (the weights' offset).
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> scales;
  std::vector<int32_t> offsets;
};

void prepare_q8(const float* x, int64_t M, int64_t in, Quantized& out) {
  out.q.resize(M * in);
  out.scales.resize(M * in / 16);
  out.offsets.resize(M * in / 16);
  for (int64_t c = 0; c < M * in / FP4_CHUNK; ++c)
    for (int l = 0; l < FP4_SCALES; ++l) {
      const int64_t b = c * FP4_SCALES + l;
      int32_t sum;
      out.scales[b] = simd::fp4_quantize_block(x + 16 * b, out.q.data() + c * FP4_CHUNK, l, &sum);
      out.offsets[b] = 12 * sum;
    }
}

// G rows of quantized activations against one pair of an NVFP4 tile's rows: each chunk is decoded
// once and serves the G rows. One accumulator per (activation row, pair), summed over the chunks in
// order, as `tile_rows` does, so each output is formed the same way whatever G is.
template <int G>
void fp4_pair_rows(const uint8_t* pair, const int8_t* xq, const float* xs, const int32_t* xo, float* y, int64_t in,
                   int64_t out, int64_t first, float unit) {
  simd::Fp4Acc acc[G];
  for (int g = 0; g < G; ++g) acc[g] = simd::fp4_zero();
  for (int64_t c = 0; c < in / FP4_CHUNK; ++c) {
    const uint8_t* wc = pair + c * FP4_PAIR_BYTES;
    if constexpr (simd::PREFETCH > 0)
      for (int64_t line = 0; line < FP4_PAIR_BYTES; line += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(wc) + simd::PREFETCH + line);
    const simd::Fp4Pair w = simd::fp4_pair_decode(wc, wc + 2 * FP4_CODES);
    for (int g = 0; g < G; ++g)
      acc[g] = simd::fp4_pair_madd(acc[g], w, xq + g * in + c * FP4_CHUNK, xs + g * in / 16 + c * FP4_SCALES,
                                   xo + g * in / 16 + c * FP4_SCALES);
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < 2 && first + r < out; ++r) y[g * out + first + r] = simd::fp4_pair_reduce(acc[g], r) * unit;
}

void matmul_fp4(const float* x, const Packed& w, const float* bias, float* y, int64_t M, Quantized& xq) {
  const int64_t in = w.in(), out = w.out, tiles = (out + TILE - 1) / TILE, pair_bytes = in / FP4_CHUNK * FP4_PAIR_BYTES;
  prepare_q8(x, M, in, xq);
  const uint8_t* base = w.tiles.data_ptr<uint8_t>();
  const float unit = w.tensor_scale * FP4_UNIT;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t p = 0; p < TILE / 2 && t * TILE + 2 * p < out; ++p) {
        const uint8_t* pair = base + (2 * t + p) * pair_bytes;
        for (int64_t m = 0; m < M; m += simd::FP4ROWS) {
          const int8_t* q = xq.q.data() + m * in;
          const float* s = xq.scales.data() + m * in / 16;
          const int32_t* o = xq.offsets.data() + m * in / 16;
          float* ym = y + m * out;
          const int64_t first = t * TILE + 2 * p;
          with_rows<simd::FP4ROWS>(M - m, [&](auto g) {
            fp4_pair_rows<decltype(g)::value>(pair, q, s, o, ym, in, out, first, unit);
          });
        }
      }
    if (bias != nullptr)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t o = t0 * TILE; o < std::min(out, t1 * TILE); ++o) y[m * out + o] += bias[o];
  });
}

// NVFP4 codes uint8 [out, in / 2] and E4M3 block scales (as uint8) [out, in / 16] -> tiles.
Packed pack_fp4_matrix(const at::Tensor& codes, const at::Tensor& scales, double tensor_scale) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) % FP4_CODES == 0,
              "codes: expected contiguous uint8 [out, in / 2] with in a multiple of ", FP4_CHUNK);
  const int64_t out = codes.size(0), chunks = codes.size(1) / FP4_CODES;
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == out && scales.size(1) == chunks * FP4_SCALES,
              "block_scale: expected contiguous E4M3 bytes [out, in / 16]");
  TORCH_CHECK(std::isfinite(tensor_scale) && tensor_scale > 0, "tensor_scale: expected a positive number");
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  for (int64_t i = 0; i < scales.numel(); ++i)
    TORCH_CHECK(sp[i] < 0x7F, "block_scale: E4M3 scales must be non-negative and not NaN");
  const int64_t tiles = (out + TILE - 1) / TILE;
  // Each row's chunk in part order: element 16 l + 8 m + 4 h + b (block l) to nibble h of byte 16 m + 4 l + b.
  const auto elements = at::stack({codes.bitwise_and(0x0F), codes.bitwise_right_shift(4)}, -1);
  const auto split = elements.view({out, chunks, 4, 2, 2, 4}).permute({0, 1, 3, 2, 5, 4});  // [out, chunk, m, l, b, h]
  const auto ordered = split.select(-1, 0).bitwise_or(split.select(-1, 1).bitwise_left_shift(4));
  auto padded_codes = at::zeros({tiles * TILE, chunks, 2, 16}, codes.options());
  auto padded_scales = at::zeros({tiles * TILE, chunks, FP4_SCALES}, codes.options());
  padded_codes.narrow(0, 0, out).copy_(ordered.reshape({out, chunks, 2, 16}));
  padded_scales.narrow(0, 0, out).copy_(scales.view({out, chunks, FP4_SCALES}));
  // [tiles, pair, chunks, m x (A, B) x 16 codes | (A, B) x 4 scales], read as [tiles, chunks, FP4_TILE_BYTES]
  auto c = padded_codes.view({tiles, 2, 2, chunks, 2, 16}).permute({0, 1, 3, 4, 2, 5}).reshape({tiles, 2, chunks, 64});
  auto s = padded_scales.view({tiles, 2, 2, chunks, FP4_SCALES}).permute({0, 1, 3, 2, 4}).reshape({tiles, 2, chunks, 8});
  return {at::cat({c, s}, 3).contiguous().view({tiles, chunks, FP4_TILE_BYTES}), out, static_cast<float>(tensor_scale)};
}

// ---- GGUF block rows ---------------------------------------------------------------------------
//
// Activations meet GGUF blocks as int8, one fp32 scale per block of 32 (amax / 127, rounded to
// nearest even); each block's products are then an exact integer sum (simd_ggml_x86.h). What a
// block adds to every weight (Q4_0's -8 d, Q4_1's m; the K-quants' per sub-block) meets the
// activations' block sum once per tile row and block, apart from the products. Rows are quantized
// alone, so a token's result does not depend on what else is in its pass.
//
// Tiles (`q_tile_rows`: 8 rows for Q4_0 and Q4_1, 4 for the others): per tile and block, the rows'
// codes interleaved 32 / rows bytes at a time (8 rows: row 0's bytes 0-3, row 1's 0-3, .., row 7's,
// then each row's 4-7, ..; 4 rows: eight bytes at a time), so that one 32-byte load holds the same
// bytes of every row, then the rows' sub-block scales (K-quants, one row after another), then their
// fp16 scales (Q4_1: the rows' d, then their m; Q4_K: d, then dmin). A tile's block is one
// sequential read of 144 (Q4_0), 160 (Q4_1), 136 (Q8_0), 576 (Q4_K) or 840 (Q6_K) bytes: 4.5, 5, 8.5,
// 4.5 and 6.56 bits per weight, the file's own bytes.

struct QuantizedQ8 {
  std::vector<int8_t> q;        // [M, in]
  std::vector<float> scales;    // [M, in / 32]
  std::vector<float> sum32;     // [M, in / 32]: the block's activations summed, times its scale
  std::vector<float> sum16;     // [M, in / 16]: the same per half block (Q6_K's scales are per 16)
};

void prepare_q8_blocks(const float* x, int64_t M, int64_t in, QuantizedQ8& out) {
  out.q.resize(M * in);
  out.scales.resize(M * in / Q_BLOCK);
  out.sum32.resize(M * in / Q_BLOCK);
  out.sum16.resize(2 * M * in / Q_BLOCK);
  for (int64_t b = 0; b < M * in / Q_BLOCK; ++b) {
    int32_t half[2];
    const float scale = simd::q_quantize_block(x + b * Q_BLOCK, out.q.data() + b * Q_BLOCK, half);
    out.scales[b] = scale;
    out.sum32[b] = static_cast<float>(half[0] + half[1]) * scale;
    for (int h = 0; h < 2; ++h) out.sum16[2 * b + h] = static_cast<float>(half[h]) * scale;
  }
}

// Weights ahead of the tile block being read. simd::PREFETCH ahead: SmolLM2's 211 Q4_1 and Q8_0
// matrices (96 MB) at one row took 12.45 ms without it and 5.60 ms with 4 KB (AVX-512 build, AMX
// Xeon, 2 threads).
template <int64_t BYTES>
inline void prefetch_ahead(const uint8_t* block) {
  if constexpr (simd::PREFETCH > 0)
    for (int64_t line = 0; line < BYTES; line += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(block) + simd::PREFETCH + line);
}

// The G rows' outputs of a tile from their accumulators.
template <int G>
void store_tile(const simd::QAcc (&acc)[G], float* y, int64_t out, int64_t first) {
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < TILE && first + j < out; ++j) y[g * out + first + j] = simd::q_reduce(acc[g], j);
}

// G rows of quantized activations against one Q4_0, Q4_1 (8-row) or Q8_0 (4-row) tile, block by block:
// the rows' codes and scales are decoded once for the G rows, one accumulator per activation row (a
// lane per tile row, or two: simd.h) summed over the blocks in order, so each output is formed the
// same way whatever G is. A Q4 block adds d times its exact integer sum, then its offset (Q4_0: -8 d;
// Q4_1: m) times the activations' block sum.
template <Ggml T, int G>
void ggml_tile_rows(const uint8_t* tile, const QuantizedQ8& x, int64_t m0, float* y, int64_t in, int64_t out,
                    int64_t first) {
  constexpr bool Q8 = T == Ggml::Q8_0, MIN = T == Ggml::Q4_1;
  constexpr int64_t ROWS = q_tile_rows(T), CODES = ROWS * q_code_bytes(T), BYTES = q_tile_bytes(T);
  static_assert(ROWS == (Q8 ? TILE : 2 * TILE));
  const int64_t blocks = in / Q_BLOCK;
  simd::QAcc acc[G];
  for (int g = 0; g < G; ++g) acc[g] = simd::q_zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wc = tile + b * BYTES;
    prefetch_ahead<BYTES>(wc);
    if constexpr (Q8) {
      alignas(32) float dm[TILE];
      simd::q_scales(wc + CODES, dm, TILE);
      const simd::QScale d = simd::q_rows(dm);
      const simd::QBlock w = simd::q8_block(wc);
      for (int g = 0; g < G; ++g) {
        const int64_t xb = (m0 + g) * blocks + b;
        acc[g] = simd::q_madd<simd::QCodesKind::Q8, 0, 4>(acc[g], w, simd::q_times(d, x.scales[xb]),
                                                           x.q.data() + xb * Q_BLOCK);
      }
    } else {
      const simd::QScale d = simd::q_half8(wc + CODES);
      const simd::QScale offset = MIN ? simd::q_half8(wc + CODES + 2 * ROWS) : d;
      const simd::Q4Wide w = simd::q4_wide_block(wc);
      for (int g = 0; g < G; ++g) {
        const int64_t xb = (m0 + g) * blocks + b;
        acc[g] = simd::q4_wide_madd<G>(acc[g], w, simd::q_times(d, x.scales[xb]), x.q.data() + xb * Q_BLOCK);
        acc[g] = simd::q_add_scaled(acc[g], offset, MIN ? x.sum32[xb] : -8.f * x.sum32[xb]);
      }
    }
  }
  if constexpr (Q8) {
    store_tile(acc, y, out, first);
  } else {
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < ROWS && first + j < out; ++j) y[g * out + first + j] = simd::q_lane(acc[g], j);
  }
}

// A Q4_K row's 8 sub-block scales and minima from its 12 bytes of 6-bit values (ggml's
// get_scale_min_k4) and its fp16 d and dmin: w = d sc q - dmin mn, so the sub-block's d is d sc (in
// both halves, as Q6_K has two) and its m (as Q4_1's, added) is -(dmin mn), each one fp32 product
// as ggml forms them; sub-block s's lands at ds[s * ds_stride] (and + half_stride), ms[s * ms_stride].
void q4k_sub_scales(const uint8_t* q, float d, float dmin, float* ds, int64_t ds_stride, int64_t half_stride,
                    float* ms, int64_t ms_stride) {
  for (int j = 0; j < K_SUB; ++j) {
    const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    const int mn = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    ds[j * ds_stride] = ds[j * ds_stride + half_stride] = d * static_cast<float>(sc);
    ms[j * ms_stride] = -(dmin * static_cast<float>(mn));
  }
}

// A Q6_K row's 16 int8 scales (one per 16 weights) times its fp16 d, as ggml forms them: sub-block s
// of 32 takes ds[s * stride] for its first half, ds[s * stride + half_stride] for its second.
void q6k_sub_scales(const uint8_t* q, float d, float* ds, int64_t stride, int64_t half_stride) {
  for (int j = 0; j < K_SUB; ++j)
    for (int h = 0; h < 2; ++h)
      ds[j * stride + h * half_stride] = d * static_cast<float>(static_cast<int8_t>(q[2 * j + h]));
}

// A K-quant tile's super-block: every row's sub-block scales ([sub-block][half][row]) and minima
// (Q4_K; [sub-block][row]), unpacked once for all the rows of activations that meet it.
struct KScales {
  alignas(32) float ds[K_SUB][2][TILE];
  alignas(32) float ms[K_SUB][TILE];
};

template <Ggml T>
void k_scales(const uint8_t* wc, KScales& k) {
  constexpr bool Q4K = T == Ggml::Q4_K;
  constexpr int64_t CODES = q_code_bytes(T), SUB = q_sub_scale_bytes(T);
  alignas(32) float dm[2 * TILE];
  simd::q_scales(wc + TILE * (CODES + SUB), dm, Q4K ? 2 * TILE : TILE);
  for (int j = 0; j < TILE; ++j) {
    if constexpr (Q4K) {
      q4k_sub_scales(wc + TILE * CODES + j * SUB, dm[j], dm[TILE + j], &k.ds[0][0][j], 2 * TILE, TILE, &k.ms[0][j],
                     TILE);
    } else {
      q6k_sub_scales(wc + TILE * CODES + j * SUB, dm[j], &k.ds[0][0][j], 2 * TILE, TILE);
    }
  }
}

// The tile's four rows' codes of sub-block s: Q4_K's one nibble of 32 bytes a row (sub-block 2 i:
// the low nibbles of bytes 32 i .. 32 i + 31; 2 i + 1: their high nibbles); Q6_K's 4 low bits from
// `ql` and 2 high from `qh`. Row byte b of a tile is at 4 b (pack_ggml interleaves by eight).
template <Ggml T>
simd::QBlock k_decode(const uint8_t* codes, int s) {
  if constexpr (T == Ggml::Q4_K) {
    return simd::q4k_block(codes + TILE * (s / 2 * 32), s % 2);
  } else {
    return simd::q6k_block(codes, s);
  }
}

// `ggml_tile_rows` for K-quant tiles: per super-block, each row's 8 sub-block scales are unpacked once
// (`k_scales`), then each sub-block of 32 meets the activations as a block of 32 does: Q4_K's as a Q4_1
// block of those scales, Q6_K's (codes 0 .. 63 less 32) each half (parts 0-1, 2-3) with its scale.
template <Ggml T, int G>
void k_tile_rows(const uint8_t* tile, const QuantizedQ8& x, int64_t m0, float* y, int64_t in, int64_t out,
                 int64_t first) {
  using simd::QCodesKind;
  constexpr int64_t BYTES = q_tile_bytes(T);
  const int64_t supers = in / K_BLOCK, blocks = in / Q_BLOCK;
  simd::QAcc acc[G];
  for (int g = 0; g < G; ++g) acc[g] = simd::q_zero();
  KScales k;
  for (int64_t c = 0; c < supers; ++c) {
    const uint8_t* wc = tile + c * BYTES;
    prefetch_ahead<BYTES>(wc);
    k_scales<T>(wc, k);
    for (int s = 0; s < K_SUB; ++s) {
      // The sub-block's decoded codes, each half's d and its offset (Q4_K: its minimum), for all G rows.
      const simd::QBlock w = k_decode<T>(wc, s);
      const simd::QScale d0 = simd::q_rows(k.ds[s][0]), d1 = simd::q_rows(k.ds[s][1]);
      const simd::QScale off0 = simd::q_first(T == Ggml::Q4_K ? k.ms[s] : k.ds[s][0]), off1 = simd::q_first(k.ds[s][1]);
      for (int g = 0; g < G; ++g) {
        const int64_t xb = (m0 + g) * blocks + c * K_SUB + s;
        const int8_t* xq = x.q.data() + xb * Q_BLOCK;
        if constexpr (T == Ggml::Q4_K) {
          acc[g] = simd::q_madd<QCodesKind::Q4, 0, 4>(acc[g], w, simd::q_times(d0, x.scales[xb]), xq);
          acc[g] = simd::q_add_scaled(acc[g], off0, x.sum32[xb]);
        } else {
          acc[g] = simd::q_madd<QCodesKind::Q6, 0, 2>(acc[g], w, simd::q_times(d0, x.scales[xb]), xq);
          acc[g] = simd::q_madd<QCodesKind::Q6, 2, 2>(acc[g], w, simd::q_times(d1, x.scales[xb]), xq);
          acc[g] = simd::q_add_scaled(acc[g], off0, -32.f * x.sum16[2 * xb]);
          acc[g] = simd::q_add_scaled(acc[g], off1, -32.f * x.sum16[2 * xb + 1]);
        }
      }
    }
  }
  store_tile(acc, y, out, first);
}

template <Ggml T, int G>
void tile_rows_of(const uint8_t* tile, const QuantizedQ8& x, int64_t m0, float* y, int64_t in, int64_t out,
                  int64_t first) {
  if constexpr (k_quant(T)) {
    k_tile_rows<T, G>(tile, x, m0, y, in, out, first);
  } else {
    ggml_tile_rows<T, G>(tile, x, m0, y, in, out, first);
  }
}

template <Ggml T>
void matmul_ggml_as(const float* x, const Packed& w, const float* bias, float* y, int64_t M, QuantizedQ8& xq) {
  constexpr int64_t ROWS = q_tile_rows(T);
  const int64_t in = w.in(), out = w.out, tiles = (out + ROWS - 1) / ROWS;
  const int64_t bytes = (in / q_block_weights(T)) * q_tile_bytes(T);
  prepare_q8_blocks(x, M, in, xq);
  const uint8_t* base = w.tiles.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m = 0; m < M; m += simd::QROWS) {
        float* ym = y + m * out;
        with_rows<simd::QROWS>(M - m, [&](auto g) {
          tile_rows_of<T, decltype(g)::value>(base + t * bytes, xq, m, ym, in, out, t * ROWS);
        });
      }
    }
    if (bias != nullptr)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t o = t0 * ROWS; o < std::min(out, t1 * ROWS); ++o) y[m * out + o] += bias[o];
  });
}

void matmul_ggml(const float* x, const Packed& w, const float* bias, float* y, int64_t M, QuantizedQ8& xq) {
  switch (w.ggml) {
    case Ggml::Q4_0: return matmul_ggml_as<Ggml::Q4_0>(x, w, bias, y, M, xq);
    case Ggml::Q4_1: return matmul_ggml_as<Ggml::Q4_1>(x, w, bias, y, M, xq);
    case Ggml::Q8_0: return matmul_ggml_as<Ggml::Q8_0>(x, w, bias, y, M, xq);
    case Ggml::Q4_K: return matmul_ggml_as<Ggml::Q4_K>(x, w, bias, y, M, xq);
    case Ggml::Q6_K: return matmul_ggml_as<Ggml::Q6_K>(x, w, bias, y, M, xq);
    case Ggml::NONE: break;
  }
  TORCH_CHECK(false, "not a GGUF block format");
}

Ggml ggml_format(int64_t type) {
  TORCH_CHECK(type == int64_t(Ggml::Q4_0) || type == int64_t(Ggml::Q4_1) || type == int64_t(Ggml::Q8_0) ||
                  type == int64_t(Ggml::Q4_K) || type == int64_t(Ggml::Q6_K),
              "ggml_type: ", type,
              " is not a block format the kernel reads (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14)");
  return static_cast<Ggml>(type);
}

// A GGUF tensor's rows as the file stores them, uint8 [out, blocks x block bytes] -> tiles.
Packed pack_ggml_matrix(const at::Tensor& raw, int64_t type) {
  const Ggml t = ggml_format(type);
  const int64_t codes = q_code_bytes(t), scales = q_scale_bytes(t), sub = q_sub_scale_bytes(t);
  const int64_t block = q_block_bytes(t);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous() && raw.size(0) > 0 &&
                  raw.size(1) > 0 && raw.size(1) % block == 0,
              "raw: expected contiguous uint8 [out, in / ", q_block_weights(t), " x ", block, "], whole blocks of ",
              block, " bytes");
  const int64_t blocks = raw.size(1) / block;
  // Rows per tile, and the run of each row's code bytes one 32-byte load holds (simd_ggml_x86.h).
  const int64_t rows = q_tile_rows(t), run = 32 / rows;
  const int64_t out = raw.size(0), tiles = (out + rows - 1) / rows;
  auto padded = at::zeros({tiles * rows, blocks, block}, raw.options());  // rows past `out`: scale 0
  padded.narrow(0, 0, out).copy_(raw.view({out, blocks, block}));
  auto by_tile = padded.view({tiles, rows, blocks, block}).transpose(1, 2);  // [tiles, blocks, rows, block]
  const bool last = t == Ggml::Q6_K;  // codes, sub-block scales, then d; else d (m, dmin) first
  auto c = by_tile.narrow(3, last ? 0 : scales + sub, codes)
               .reshape({tiles, blocks, rows, codes / run, run}).transpose(2, 3)
               .reshape({tiles, blocks, rows * codes});  // each row's bytes run i .. run (i + 1) - 1, row after row
  auto k = by_tile.narrow(3, last ? codes : scales, sub).reshape({tiles, blocks, rows * sub});
  auto s = by_tile.narrow(3, last ? codes + sub : 0, scales).reshape({tiles, blocks, rows, scales / 2, 2}).transpose(2, 3)
               .reshape({tiles, blocks, rows * scales});  // [d0 .. d(rows - 1) (m0 .. m(rows - 1))]
  return {at::cat({c, k, s}, 2).contiguous(), out, 0.f, t};
}

// What a pass keeps of its rounded activations between matrices.
struct Rounded {
  std::vector<simd::XB> bf16;
  Quantized int8;
  QuantizedQ8 q8;
};

// fp32 activations x [M, in] against a packed weight. For bf16 weights x is rounded to bf16 first,
// where the eager path's activations are bf16 too; for NVFP4 and GGUF weights it is quantized to int8.
void matmul(const float* x, const Packed& w, const float* bias, float* y, int64_t M, Rounded& r) {
  const int64_t in = w.in();
  if (w.fp4()) return matmul_fp4(x, w, bias, y, M, r.int8);
  if (w.quantized()) return matmul_ggml(x, w, bias, y, M, r.q8);
  if (w.tiles.scalar_type() == at::kFloat) return matmul_rows(x, w.tiles.data_ptr<float>(), bias, y, M, in, w.out);
  r.bf16.resize(M * in);
  simd::prepare_bf16(x, r.bf16.data(), M * in);
  matmul_rows(r.bf16.data(), reinterpret_cast<const bf16*>(w.tiles.data_ptr()), bias, y, M, in, w.out);
}

// ---- the pieces of one layer, all on fp32 rows ------------------------------------------------

// Without -ffast-math the compiler keeps a float sum in order, one lane at a time. Written out in W
// lanes, a SmolLM2 decode step over a 300-token context fell from 10.7 to 9.5 ms at one sequence and
// from 30.6 to 24.0 ms at eight (AVX-512).
float dot(const float* a, const float* b, int64_t n) {
  Vec acc = simd::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = simd::fmadd(simd::load(a + i), simd::load(b + i), acc);
  float s = simd::reduce(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// out [n] = x / rms(x) * w (out may be x)
void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// Rotate-half RoPE of one head `x` [D] with this position's tables [D].
void rope_head(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

// One query row of `attend_rows`: its vector [D], how many keys it sees, and where its output [D] goes.
struct QueryRow {
  const float* q;
  int64_t len;
  float* out;
};

// Query rows that share one key/value head (a sequence's block of tokens times the query heads of
// its GQA group) against keys/values [len, D] (fp32, contiguous, D = W DV). Tiles of 4 rows x W/4
// keys keep W dot products in registers and sum them together (`reduce_each`), and every key and
// value is loaded once per tile of rows instead of once per row and head. Each (row, key) product is
// formed the same way whatever else is in the pass, so a token's result does not depend on its
// block. Measured on SmolLM2 (2 cores, bf16, AVX-512 BF16, benchmarks/verify_pass.py), against one
// (row, head) at a time with a horizontal sum per key: a 4-token verify pass 10.05 -> 7.54 ms at a
// 300-token context and 15.01 -> 10.36 ms at 1,000; a decode step 6.71 -> 5.46 and 8.44 -> 7.00 ms.
template <int DV>
void attend_rows(const std::vector<QueryRow>& rows, const float* keys, const float* values, float scale,
                 std::vector<float>& scores) {
  constexpr int64_t D = W * DV, KT = W / 4;  // a tile: 4 rows x KT keys, W accumulators
  constexpr int64_t RC = std::max<int64_t>(1, simd::REGS / 2 / DV);  // rows of DV accumulators in half the registers
  alignas(64) static const float zeros[D] = {};
  const int64_t R = rows.size();
  int64_t L = 0;
  for (const auto& r : rows) L = std::max(L, r.len);
  const int64_t Lp = (L + 15) / 16 * 16;
  scores.assign(((R + 3) / 4 * 4) * Lp, 0.f);
  alignas(64) float tile[W];
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const float* q[4];
    for (int r = 0; r < 4; ++r) q[r] = r0 + r < R ? rows[r0 + r].q : zeros;
    for (int64_t t = 0; t < L; t += KT) {
      const float* k[KT];
      for (int c = 0; c < KT; ++c) k[c] = t + c < L ? keys + (t + c) * D : zeros;
      Vec acc[W];
      for (int i = 0; i < W; ++i) acc[i] = simd::zero();
      for (int dv = 0; dv < DV; ++dv)
        for (int c = 0; c < KT; ++c) {
          const Vec kv = simd::load(k[c] + W * dv);
          for (int r = 0; r < 4; ++r) acc[KT * r + c] = simd::fmadd(simd::load(q[r] + W * dv), kv, acc[KT * r + c]);
        }
      simd::store(tile, simd::mul(simd::reduce_each(acc), simd::splat(scale)));  // lane KT r + c
      for (int r = 0; r < 4; ++r) std::memcpy(scores.data() + (r0 + r) * Lp + t, tile + KT * r, KT * sizeof(float));
    }
  }
  // Softmax of each row over its own keys; the padding after them becomes probability 0.
  for (int64_t r = 0; r < R; ++r) {
    float* sc = scores.data() + r * Lp;
    const int64_t len = rows[r].len;
    float top = -INFINITY;
    for (int64_t t = 0; t < len; ++t) top = std::max(top, sc[t]);
    float total = 0.f;
    int64_t t = 0;
    for (; t + W <= len; t += W) {
      const Vec e = exp_neg(simd::sub(simd::load(sc + t), simd::splat(top)));
      simd::store(sc + t, e);
      total += simd::reduce(e);
    }
    for (; t < len; ++t) total += sc[t] = exp_scalar(sc[t] - top);
    for (t = 0; t < len; ++t) sc[t] /= total;
    std::fill(sc + len, sc + Lp, 0.f);
  }
  // Rows shorter than the longest in their tile add probability 0 times the values past their end:
  // those are this pass's own later tokens, written above, so finite, and the sum is unchanged.
  for (int64_t r0 = 0; r0 < R; r0 += RC) {
    const int64_t rc = std::min(RC, R - r0);
    int64_t len = 0;
    for (int64_t r = r0; r < r0 + rc; ++r) len = std::max(len, rows[r].len);
    Vec acc[RC][DV];
    for (int r = 0; r < RC; ++r)
      for (int dv = 0; dv < DV; ++dv) acc[r][dv] = simd::zero();
    for (int64_t t = 0; t < len; ++t) {
      Vec v[DV];
      for (int dv = 0; dv < DV; ++dv) v[dv] = simd::load(values + t * D + W * dv);
      for (int r = 0; r < rc; ++r) {
        const Vec p = simd::splat(scores[(r0 + r) * Lp + t]);
        for (int dv = 0; dv < DV; ++dv) acc[r][dv] = simd::fmadd(p, v[dv], acc[r][dv]);
      }
    }
    for (int r = 0; r < rc; ++r)
      for (int dv = 0; dv < DV; ++dv) simd::store(rows[r0 + r].out + W * dv, acc[r][dv]);
  }
}

// `attend_rows` for this head size (D = W DV; the decoder checks D % 16 == 0 and D <= 128).
template <int DV = 1>
void attend(const std::vector<QueryRow>& rows, const float* keys, const float* values, int64_t D, float scale,
            std::vector<float>& scores) {
  if constexpr (DV * W < 128) {
    if (D != DV * W) return attend<DV + 1>(rows, keys, values, D, scale, scores);
  }
  attend_rows<DV>(rows, keys, values, scale, scores);
}

// out [n] = silu(gate) * up
void silu_mul(const float* gate, const float* up, int64_t n, float* out) {
  using namespace simd;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const Vec g = load(gate + i);
    // silu(g) = g / (1 + e^-g), with e^-|g| so the exponent never overflows.
    const Vec e = exp_neg(sub(zero(), simd::abs(g)));
    const Vec one = splat(1.0f);
    const Vec sig = div(where_negative(g, e, one), add(one, e));  // e / (1 + e) below zero, 1 / (1 + e) above
    store(out + i, mul(mul(g, sig), load(up + i)));
  }
  for (; i < n; ++i) {
    const float g = gate[i];
    const float e = exp_scalar(-std::fabs(g));
    const float sig = g >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
    out[i] = g * sig * up[i];
  }
}

const float* f32(const at::Tensor& t) { return t.data_ptr<float>(); }

struct Layer {
  at::Tensor input_norm, qkv_bias, q_norm, k_norm, post_norm;  // fp32; bias and QK-norms may be undefined
  Packed qkv, o, gate_up, down;
};

}  // namespace

// `pack` for Python: the tiles of w [out, in]; `linear` needs them and `out`.
at::Tensor pack(const at::Tensor& w) { return pack_matrix(w).tiles; }

// `pack_nvfp4` for Python: the tiles of an NVFP4 weight; `linear_nvfp4` needs them, `out` and its tensor scale.
at::Tensor pack_nvfp4(const at::Tensor& codes, const at::Tensor& block_scale) {
  return pack_fp4_matrix(codes, block_scale, 1.0).tiles;
}

// `pack_ggml` for Python: the tiles of a GGUF tensor's rows as stored (uint8 [out, row bytes]) of
// ggml type `type`; `linear_ggml` needs them, `out` and the type.
at::Tensor pack_ggml(const at::Tensor& raw, int64_t type) { return pack_ggml_matrix(raw, type).tiles; }

namespace {

void check_ggml_tiles(const at::Tensor& tiles, int64_t out, Ggml t) {
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 3 && tiles.size(2) == q_tile_bytes(t) &&
                  tiles.is_contiguous() && tiles.size(0) == (out + q_tile_rows(t) - 1) / q_tile_rows(t) &&
                  tiles.size(1) > 0 && out > 0,
              "tiles: expected the output of pack_ggml() for a weight of this type with `out` rows");
}

}  // namespace

namespace {

// Each of the first `rows` rows of one tile's block (K-quants: super-block), decoded by the kernel's
// own code, by sub-block of 32: f(row, sub-block, its 32 codes, d of each half, m), with m zero but
// for Q4_1 and Q4_K (Q4_K: d = d sc and m = -(dmin mn); Q6_K: d sc of each 16; as the kernel reads them).
template <typename F>
void each_block(const uint8_t* wc, Ggml t, int64_t rows, F f) {
  alignas(64) int8_t q[2 * TILE][Q_BLOCK];
  if (k_quant(t)) {
    KScales k;
    t == Ggml::Q4_K ? k_scales<Ggml::Q4_K>(wc, k) : k_scales<Ggml::Q6_K>(wc, k);
    for (int s = 0; s < K_SUB; ++s) {
      simd::q_store(&q[0][0], t == Ggml::Q4_K ? k_decode<Ggml::Q4_K>(wc, s) : k_decode<Ggml::Q6_K>(wc, s));
      for (int64_t j = 0; j < rows; ++j) {
        const float d[2] = {k.ds[s][0][j], k.ds[s][1][j]};
        f(j, s, q[j], d, t == Ggml::Q4_K ? k.ms[s][j] : 0.f);
      }
    }
    return;
  }
  const int64_t n = q_tile_rows(t);
  alignas(32) float dm[4 * TILE] = {};
  simd::q_scales(wc + n * q_code_bytes(t), dm, n);
  if (t == Ggml::Q4_1) simd::q_scales(wc + n * q_code_bytes(t) + 2 * n, dm + n, n);  // the rows' m
  if (t == Ggml::Q8_0) {
    simd::q_store(&q[0][0], simd::q8_block(wc));
  } else {
    simd::q4_wide_store(&q[0][0], simd::q4_wide_block(wc));
  }
  for (int64_t j = 0; j < rows; ++j) {
    const float both[2] = {dm[j], dm[j]};
    f(j, 0, q[j], both, t == Ggml::Q4_1 ? dm[n + j] : 0.f);
  }
}

// One sub-block of dense weights from its codes, formed as ggml forms them (Q4_1 and Q4_K: d q,
// rounded, then + m, rounded; no fused multiply-add), so that fp32 is the gguf package's bit for bit.
template <typename T>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void dequantize_block(const int8_t* q, const float* d16, float m, Ggml t, T* w) {
  for (int64_t i = 0; i < Q_BLOCK; ++i) {
    const float code = static_cast<float>(q[i]), d = d16[i / 16];
    const float v = t == Ggml::Q4_0   ? d * (code - 8.f)
                    : t == Ggml::Q6_K ? d * (code - 32.f)
                    : t == Ggml::Q8_0 ? d * code
                                      : d * code + m;
    if constexpr (std::is_same_v<T, bf16>) {
      w[i] = simd::to_bf16(v);
    } else {
      w[i] = v;
    }
  }
}

template <typename T>
void dequantize_tiles(const at::Tensor& tiles, int64_t out, Ggml t, T* w) {
  const int64_t chunks = tiles.size(1), bytes = q_tile_bytes(t), per = q_block_weights(t), in = chunks * per;
  const uint8_t* base = tiles.data_ptr<uint8_t>();
  const int64_t rows = q_tile_rows(t);
  at::parallel_for(0, tiles.size(0), 8, [&](int64_t t0, int64_t t1) {
    for (int64_t tile = t0; tile < t1; ++tile)
      for (int64_t c = 0; c < chunks; ++c)
        each_block(base + (tile * chunks + c) * bytes, t, std::min(rows, out - tile * rows),
                   [&](int64_t j, int s, const int8_t* q, const float* d, float m) {
                     dequantize_block(q, d, m, t, w + (tile * rows + j) * in + c * per + s * Q_BLOCK);
                   });
  });
}

}  // namespace

// What the tiles hold, decoded by the kernel's own code: the codes int8 [out, in] (Q4_*: 0 .. 15 as
// stored; Q6_K: 0 .. 63; Q8_0: signed) and each 16 weights' d and m fp32 [out, in / 16] (m zero but
// for Q4_1, and Q4_K's -(dmin mn)). Tests rebuild the weights from them as ggml does (d (q - 8),
// d q + m, d q, d (q - 32)) and compare bit for bit.
std::tuple<at::Tensor, at::Tensor, at::Tensor> unpack_ggml(const at::Tensor& tiles, int64_t out, int64_t type) {
  const Ggml t = ggml_format(type);
  check_ggml_tiles(tiles, out, t);
  const int64_t chunks = tiles.size(1), bytes = q_tile_bytes(t), per = q_block_weights(t), in = chunks * per;
  auto q = at::empty({out, in}, tiles.options().dtype(at::kChar));
  auto d = at::zeros({out, in / 16}, tiles.options().dtype(at::kFloat));
  auto m = at::zeros({out, in / 16}, tiles.options().dtype(at::kFloat));
  const uint8_t* base = tiles.data_ptr<uint8_t>();
  const int64_t rows = q_tile_rows(t);
  for (int64_t tile = 0; tile < tiles.size(0); ++tile)
    for (int64_t c = 0; c < chunks; ++c)
      each_block(base + (tile * chunks + c) * bytes, t, std::min(rows, out - tile * rows),
                 [&](int64_t j, int s, const int8_t* codes, const float* dj, float mj) {
                   const int64_t row = tile * rows + j, block = c * (per / Q_BLOCK) + s;
                   std::memcpy(q.data_ptr<int8_t>() + row * in + block * Q_BLOCK, codes, Q_BLOCK);
                   for (int h = 0; h < 2; ++h) {
                     d.data_ptr<float>()[row * (in / 16) + 2 * block + h] = dj[h];
                     m.data_ptr<float>()[row * (in / 16) + 2 * block + h] = mj;
                   }
                 });
  return {q, d, m};
}

// The dense weight [out, in] (fp32 or bf16) that `pack_ggml`'s tiles stand for, made in one parallel
// pass: what a pass of many rows multiplies by (prefill chunks; oneDNN's GEMM reuses each weight
// across rows, where the kernel's int8 products cost per row). fp32 equals the gguf package's
// dequantization bit for bit; bf16 is that rounded to nearest even.
at::Tensor dequantize_ggml(const at::Tensor& tiles, int64_t out, int64_t type, bool bfloat16) {
  const Ggml t = ggml_format(type);
  check_ggml_tiles(tiles, out, t);
  const at::ScalarType dtype = bfloat16 ? at::kBFloat16 : at::kFloat;
  auto w = at::empty({out, tiles.size(1) * q_block_weights(t)}, tiles.options().dtype(dtype));
  pybind11::gil_scoped_release nogil;
  if (dtype == at::kFloat) {
    dequantize_tiles(tiles, out, t, w.data_ptr<float>());
  } else {
    dequantize_tiles(tiles, out, t, reinterpret_cast<bf16*>(w.data_ptr()));
  }
  return w;
}

namespace {

// y [..., out] = x w^T + b in x's dtype, computed in fp32 against a packed weight.
at::Tensor apply_packed(const at::Tensor& x, const Packed& w, const c10::optional<at::Tensor>& bias) {
  const int64_t out = w.out;
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.numel() / w.in();
  at::Tensor b32;
  if (bias.has_value()) b32 = bias->to(at::kFloat).contiguous();
  auto y = at::empty({M, out}, x.options().dtype(at::kFloat));
  {
    pybind11::gil_scoped_release nogil;
    Rounded rounded;
    matmul(f32(xf), w, bias.has_value() ? f32(b32) : nullptr, y.data_ptr<float>(), M, rounded);
  }
  auto shape = x.sizes().vec();
  shape.back() = out;
  return y.to(x.scalar_type()).view(shape);
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& tiles, int64_t out, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(2) == TILE && tiles.size(3) * tiles.element_size() == 64 &&
                  tiles.is_contiguous() && tiles.size(0) == (out + TILE - 1) / TILE,
              "tiles: expected the output of pack() for a weight with `out` rows");
  const Packed w{tiles, out};
  TORCH_CHECK(x.scalar_type() == tiles.scalar_type() && x.size(-1) == w.in(),
              "x: expected [..., in] in the weight's dtype");
  return apply_packed(x, w, bias);
}

at::Tensor linear_nvfp4(const at::Tensor& x, const at::Tensor& tiles, int64_t out, double tensor_scale,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 3 && tiles.size(2) == FP4_TILE_BYTES &&
                  tiles.is_contiguous() && tiles.size(0) == (out + TILE - 1) / TILE,
              "tiles: expected the output of pack_nvfp4() for a weight with `out` rows");
  const Packed w{tiles, out, static_cast<float>(tensor_scale)};
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.size(-1) == w.in(),
              "x: expected bf16 or fp32 [..., in]");
  return apply_packed(x, w, bias);
}

at::Tensor linear_ggml(const at::Tensor& x, const at::Tensor& tiles, int64_t out, int64_t type,
                       const c10::optional<at::Tensor>& bias) {
  const Ggml t = ggml_format(type);
  check_ggml_tiles(tiles, out, t);
  const Packed w{tiles, out, 0.f, t};
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.size(-1) == w.in(),
              "x: expected bf16 or fp32 [..., in]");
  TORCH_CHECK(!bias.has_value() || bias->numel() == out, "bias: expected `out` values");
  return apply_packed(x, w, bias);
}

class Decoder {
 public:
  // `layers`: per layer input norm, qkv, qkv bias, q norm, k norm, o, post norm, gate_up, down; a matrix
  // is dense in the model's dtype, or uint8: NVFP4 codes [out, in / 2] whose block scales (E4M3 as
  // uint8 [out, in / 16]) and tensor scale (fp32, 0-dim) are that layer's pair in `quantized`, or the
  // tiles `pack_ggml` made of a GGUF tensor, whose pair is (its rows, its ggml type), int64 0-dims,
  // shared, not copied; in the order qkv, o, gate_up, down (8 tensors per layer, empty ones for dense
  // matrices; no list: all dense).
  Decoder(std::vector<std::vector<at::Tensor>> layers, at::Tensor final_norm, at::Tensor rope_cos,
          at::Tensor rope_sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
          std::vector<std::vector<at::Tensor>> quantized)
      : final_norm_(final_norm.to(at::kFloat).contiguous()), cos_(rope_cos.contiguous()),
        sin_(rope_sin.contiguous()), dtype_(final_norm.scalar_type()), hq_(num_heads), hkv_(num_kv_heads),
        d_(head_dim), eps_(eps) {
    TORCH_CHECK(cos_.scalar_type() == at::kFloat && cos_.size(1) == d_, "rope tables: expected fp32 [T, D]");
    TORCH_CHECK(hq_ % hkv_ == 0, "heads: bad GQA shape");
    TORCH_CHECK(d_ % 16 == 0 && d_ <= 128, "head_dim: the attention tiles take multiples of 16 up to 128");
    TORCH_CHECK(quantized.empty() || quantized.size() == layers.size(),
                "quantized: expected one list per layer, or none");
    for (size_t li = 0; li < layers.size(); ++li) {
      const auto& t = layers[li];
      TORCH_CHECK(t.size() == 9, "a layer is 9 tensors");
      TORCH_CHECK(quantized.empty() || quantized[li].size() == 8, "quantized: a layer's list is 8 tensors");
      // An empty tensor stands for an absent one (no QKV bias, no QK-norm).
      auto f = [](const at::Tensor& x) { return x.numel() > 0 ? x.to(at::kFloat).contiguous() : at::Tensor(); };
      auto matrix = [&](int slot, int k) {
        if (t[slot].scalar_type() != at::kByte) {
          check_matrix(t[slot], dtype_, "layer matrix");
          return pack_matrix(t[slot]);
        }
        TORCH_CHECK(!quantized.empty() && quantized[li][2 * k + 1].numel() == 1,
                    "quantized: a uint8 matrix without its scales or format");
        const at::Tensor& second = quantized[li][2 * k + 1];
        if (second.scalar_type() == at::kLong) {
          const int64_t out = quantized[li][2 * k].item<int64_t>();
          const Ggml type = ggml_format(second.item<int64_t>());
          check_ggml_tiles(t[slot], out, type);
          return Packed{t[slot], out, 0.f, type};
        }
        return pack_fp4_matrix(t[slot], quantized[li][2 * k], second.item<double>());
      };
      layers_.push_back({f(t[0]), f(t[2]), f(t[3]), f(t[4]), f(t[6]), matrix(1, 0), matrix(5, 1), matrix(7, 2),
                         matrix(8, 3)});
    }
    hidden_ = final_norm_.size(0);
    inter_ = layers_[0].down.in();
    TORCH_CHECK(layers_[0].qkv.out == (hq_ + 2 * hkv_) * d_, "qkv: rows != (Hq + 2 Hkv) D");
  }

  // x [M, H] (the model's dtype): token embeddings of rows m = b * n + j (n tokens per sequence).
  // Row m writes its key/value at (slots[b], positions[b, j]) and attends to positions <= its own
  // in that slot. Returns the final-normed hidden states [M, H] and the outputs of the layers in
  // `taps`, in the model's dtype.
  //
  // With `block`, each sequence's n rows are one block at consecutive positions p .. p+n-1 (a DFlash
  // draft): every row sees the cached positions < p and all n rows of its block, both ways, and the
  // cache is only read (its rows from p on may hold context that a later pass reads).
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward(const at::Tensor& x, const at::Tensor& slots,
                                                          const at::Tensor& positions, at::Tensor k_cache,
                                                          at::Tensor v_cache, std::vector<int64_t> taps,
                                                          bool block) {
    const auto [slot, pos] = places(x, slots, positions, k_cache, v_cache);
    const int64_t M = x.size(0), n = positions.size(1);
    for (int64_t m = 0; m < M; ++m)
      TORCH_CHECK(!block || pos[m] == pos[m / n * n] + m % n, "block: positions must be consecutive");
    auto resid = x.to(at::kFloat, false, /*copy=*/true).contiguous();  // [M, H] fp32, updated in place
    auto out = at::empty({M, hidden_}, resid.options());
    std::vector<at::Tensor> tapped;
    {
      pybind11::gil_scoped_release nogil;
      Scratch s(M, hidden_, (hq_ + 2 * hkv_) * d_, hq_ * d_, inter_);
      for (int64_t li = 0; li < (int64_t)layers_.size(); ++li) {
        attention_block(layers_[li], li, resid.data_ptr<float>(), M, n, slot, pos, k_cache, v_cache, block, s);
        mlp_block(layers_[li], resid.data_ptr<float>(), M, s);
        if (std::find(taps.begin(), taps.end(), li) != taps.end())
          tapped.push_back(resid.to(dtype_, false, /*copy=*/true));
      }
      float* r = resid.data_ptr<float>();
      float* o = out.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) rms_norm(r + m * hidden_, f32(final_norm_), eps_, hidden_, o + m * hidden_);
    }
    return {out.to(dtype_), tapped};
  }

  // A DFlash drafter's context: x [M, H] (the model's dtype) holds fused target features of rows
  // m = b * n + j. Each layer's key (QK-normed, rotated) and value of each row go into the cache at
  // (slots[b], positions[b, j]); nothing else is computed (no queries, no attention).
  void context(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& positions, at::Tensor k_cache,
               at::Tensor v_cache) {
    const auto [slot, pos] = places(x, slots, positions, k_cache, v_cache);
    const int64_t M = x.size(0), S = k_cache.size(1), T = k_cache.size(3);
    const int64_t kv_size = hkv_ * d_;
    const auto xf = x.to(at::kFloat).contiguous();
    std::vector<float> kv(M * 2 * kv_size);
    Rounded rounded;
    pybind11::gil_scoped_release nogil;
    for (int64_t li = 0; li < (int64_t)layers_.size(); ++li) {
      const Layer& l = layers_[li];
      // The key and value rows of the packed [q | k | v] matrix: whole tiles, since the q rows fill whole
      // tiles (of 4 or 8 rows: D is a multiple of 16, checked when the decoder was made).
      const int64_t q_tiles = hq_ * d_ / l.qkv.tile_rows();
      const Packed w{l.qkv.tiles.narrow(0, q_tiles, l.qkv.tiles.size(0) - q_tiles), 2 * kv_size, l.qkv.tensor_scale,
                     l.qkv.ggml};
      matmul(f32(xf), w, l.qkv_bias.defined() ? f32(l.qkv_bias) + hq_ * d_ : nullptr, kv.data(), M, rounded);
      float* kbase = k_cache.data_ptr<float>() + li * S * hkv_ * T * d_;
      float* vbase = v_cache.data_ptr<float>() + li * S * hkv_ * T * d_;
      for (int64_t m = 0; m < M; ++m) {
        float* row = kv.data() + m * 2 * kv_size;
        for (int64_t g = 0; g < hkv_; ++g) {
          float* head = row + g * d_;
          if (l.k_norm.defined()) rms_norm(head, f32(l.k_norm), eps_, d_, head);
          rope_head(head, f32(cos_) + pos[m] * d_, f32(sin_) + pos[m] * d_, d_);
          const int64_t at = ((slot[m] * hkv_ + g) * T + pos[m]) * d_;
          std::memcpy(kbase + at, head, d_ * sizeof(float));
          std::memcpy(vbase + at, row + kv_size + g * d_, d_ * sizeof(float));
        }
      }
    }
  }

 private:
  // Checks a pass's arguments (x [M, H], positions [B, n] with B n = M, the fp32 cache) and returns
  // each row's slot and position, before anything is written.
  std::pair<std::vector<int64_t>, std::vector<int64_t>> places(const at::Tensor& x, const at::Tensor& slots,
                                                               const at::Tensor& positions, const at::Tensor& k_cache,
                                                               const at::Tensor& v_cache) const {
    TORCH_CHECK(x.scalar_type() == dtype_ && x.dim() == 2 && x.size(1) == hidden_,
                "x: expected [M, H] in the model's dtype");
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    k_cache.dim() == 5 && k_cache.size(0) == (int64_t)layers_.size() && k_cache.size(2) == hkv_ &&
                    k_cache.size(4) == d_ && k_cache.sizes() == v_cache.sizes(),
                "cache: expected fp32 [L, S, Hkv, T, D]");
    const int64_t M = x.size(0), B = slots.size(0);
    TORCH_CHECK(positions.dim() == 2 && positions.size(0) == B && B * positions.size(1) == M, "positions: [B, n]");
    const auto slot_a = slots.to(at::kLong).contiguous();
    const auto pos_a = positions.to(at::kLong).contiguous();
    const int64_t n = positions.size(1), T = k_cache.size(3);
    std::vector<int64_t> slot(M), pos(M);
    for (int64_t m = 0; m < M; ++m) {
      slot[m] = slot_a.data_ptr<int64_t>()[m / n];
      pos[m] = pos_a.data_ptr<int64_t>()[m];
      TORCH_CHECK(pos[m] >= 0 && pos[m] < T && pos[m] < cos_.size(0), "position out of range");
      TORCH_CHECK(slot[m] >= 0 && slot[m] < k_cache.size(1), "slot out of range");
    }
    return {slot, pos};
  }

  struct Scratch {
    std::vector<float> normed, qkv, attn, proj, gate_up, act;
    Rounded rounded;
    Scratch(int64_t M, int64_t H, int64_t qkv_rows, int64_t q_size, int64_t inter)
        : normed(M * H), qkv(M * qkv_rows), attn(M * q_size), proj(M * H), gate_up(M * 2 * inter), act(M * inter) {}
  };

  // Rows m = b * n + j: n tokens of each sequence b, all in slot[b * n]. `block`: see `forward`.
  void attention_block(const Layer& l, int64_t li, float* resid, int64_t M, int64_t n, const std::vector<int64_t>& slot,
                       const std::vector<int64_t>& pos, at::Tensor& kc, at::Tensor& vc, bool block, Scratch& s) {
    const int64_t H = hidden_, rows = (hq_ + 2 * hkv_) * d_, q_size = hq_ * d_, kv_size = hkv_ * d_;
    for (int64_t m = 0; m < M; ++m) rms_norm(resid + m * H, f32(l.input_norm), eps_, H, s.normed.data() + m * H);
    matmul(s.normed.data(), l.qkv, l.qkv_bias.defined() ? f32(l.qkv_bias) : nullptr, s.qkv.data(), M, s.rounded);
    const int64_t S = kc.size(1), T = kc.size(3);
    float* kbase = kc.data_ptr<float>() + li * S * hkv_ * T * d_;
    float* vbase = vc.data_ptr<float>() + li * S * hkv_ * T * d_;
    // Queries and keys: rows [q heads | k heads | v heads] of `qkv`, normed (Qwen3) and rotated in place;
    // then every row's key and value goes into the cache before any row attends (not for a block).
    for (int64_t m = 0; m < M; ++m) {
      float* row = s.qkv.data() + m * rows;
      const float* c = f32(cos_) + pos[m] * d_;
      const float* sn = f32(sin_) + pos[m] * d_;
      for (int64_t h = 0; h < hq_ + hkv_; ++h) {
        float* head = row + h * d_;
        if (l.q_norm.defined()) rms_norm(head, f32(h < hq_ ? l.q_norm : l.k_norm), eps_, d_, head);
        rope_head(head, c, sn, d_);
      }
      for (int64_t g = 0; g < hkv_ && !block; ++g) {
        const int64_t at = ((slot[m] * hkv_ + g) * T + pos[m]) * d_;
        std::memcpy(kbase + at, row + q_size + g * d_, d_ * sizeof(float));
        std::memcpy(vbase + at, row + q_size + kv_size + g * d_, d_ * sizeof(float));
      }
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(d_));
    const int64_t group = hq_ / hkv_;
    // A task per (sequence, KV head): its block's rows times the group's query heads share each key
    // and value load. Where there are fewer than two such per thread (one sequence has SmolLM2's 3 KV
    // heads for 2 threads, so one thread idled a third of the attention), each one's query rows are
    // split into `parts` tasks, which read its keys and values again (from cache). A row's result does
    // not depend on the rows beside it in `attend`, so neither on the split.
    const int64_t heads = (M / n) * hkv_, per_head = n * group;
    const int64_t parts = std::clamp<int64_t>((2 * at::get_num_threads() + heads - 1) / heads, 1, per_head);
    at::parallel_for(0, heads * parts, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> scores, keys, values;
      std::vector<QueryRow> qrows;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / parts / hkv_, g = t / parts % hkv_, part = t % parts;
        const int64_t first = part * per_head / parts, last = (part + 1) * per_head / parts;  // of j group + h
        const int64_t base = (slot[b * n] * hkv_ + g) * T * d_;
        const float* k = kbase + base;
        const float* v = vbase + base;
        if (block) {
          // The cached context then the block's own rows, contiguous as `attend` reads them: a copy
          // of the context (128 KB at 500 positions) instead of writing into the cache.
          const int64_t ctx = pos[b * n];
          keys.resize((ctx + n) * d_);
          values.resize((ctx + n) * d_);
          std::memcpy(keys.data(), k, ctx * d_ * sizeof(float));
          std::memcpy(values.data(), v, ctx * d_ * sizeof(float));
          for (int64_t j = 0; j < n; ++j) {
            const float* row = s.qkv.data() + (b * n + j) * rows + q_size + g * d_;
            std::memcpy(keys.data() + (ctx + j) * d_, row, d_ * sizeof(float));
            std::memcpy(values.data() + (ctx + j) * d_, row + kv_size, d_ * sizeof(float));
          }
          k = keys.data();
          v = values.data();
        }
        qrows.clear();
        for (int64_t i = first; i < last; ++i) {
          const int64_t j = i / group, h = g * group + i % group, m = b * n + j;
          const int64_t len = block ? pos[b * n] + n : pos[m] + 1;
          qrows.push_back({s.qkv.data() + m * rows + h * d_, len, s.attn.data() + m * q_size + h * d_});
        }
        attend(qrows, k, v, d_, scale, scores);
      }
    });
    matmul(s.attn.data(), l.o, nullptr, s.proj.data(), M, s.rounded);
    for (int64_t i = 0; i < M * H; ++i) resid[i] += s.proj[i];
  }

  void mlp_block(const Layer& l, float* resid, int64_t M, Scratch& s) {
    const int64_t H = hidden_, I = inter_;
    for (int64_t m = 0; m < M; ++m) rms_norm(resid + m * H, f32(l.post_norm), eps_, H, s.normed.data() + m * H);
    matmul(s.normed.data(), l.gate_up, nullptr, s.gate_up.data(), M, s.rounded);
    for (int64_t m = 0; m < M; ++m)
      silu_mul(s.gate_up.data() + m * 2 * I, s.gate_up.data() + m * 2 * I + I, I, s.act.data() + m * I);
    matmul(s.act.data(), l.down, nullptr, s.proj.data(), M, s.rounded);
    for (int64_t i = 0; i < M * H; ++i) resid[i] += s.proj[i];
  }

  std::vector<Layer> layers_;
  at::Tensor final_norm_, cos_, sin_;
  at::ScalarType dtype_;  // the model's: of its hidden states, norms and dense matrices
  int64_t hq_, hkv_, d_, hidden_ = 0, inter_ = 0;
  float eps_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("isa") = simd::ISA;  // the instruction set this build runs on (`kernels/cpu_features.py`)
  m.def("pack", &pack, "w [out, in] -> tiles for linear()", pybind11::arg("w"));
  m.def("pack_nvfp4", &pack_nvfp4, "NVFP4 codes [out, in / 2] and E4M3 scales as uint8 [out, in / 16] -> tiles",
        pybind11::arg("codes"), pybind11::arg("block_scale"));
  m.def("linear_nvfp4", &linear_nvfp4, "y = x w^T + b for a few rows, w given as pack_nvfp4(w), out, tensor scale",
        pybind11::arg("x"), pybind11::arg("tiles"), pybind11::arg("out"), pybind11::arg("tensor_scale"),
        pybind11::arg("bias") = pybind11::none());
  m.def("pack_ggml", &pack_ggml, "a GGUF tensor's rows as stored, uint8 [out, row bytes], of ggml type `type` -> tiles",
        pybind11::arg("raw"), pybind11::arg("type"));
  m.def("linear_ggml", &linear_ggml, "y = x w^T + b for a few rows, w given as pack_ggml(w), out, its ggml type",
        pybind11::arg("x"), pybind11::arg("tiles"), pybind11::arg("out"), pybind11::arg("type"),
        pybind11::arg("bias") = pybind11::none());
  m.def("dequantize_ggml", &dequantize_ggml, "pack_ggml's tiles as the dense weight [out, in], fp32 or bf16",
        pybind11::arg("tiles"), pybind11::arg("out"), pybind11::arg("type"), pybind11::arg("bfloat16"));
  m.def("unpack_ggml", &unpack_ggml, "pack_ggml's tiles decoded: codes int8 [out, in], d and m fp32 [out, in / 32]",
        pybind11::arg("tiles"), pybind11::arg("out"), pybind11::arg("type"));
  m.def("linear", &linear, "y = x w^T + b for a few rows, w given as pack(w) and out", pybind11::arg("x"),
        pybind11::arg("tiles"), pybind11::arg("out"), pybind11::arg("bias") = pybind11::none());
  // module_local: every build defines its own `Decoder`, and two builds may be loaded in one process.
  pybind11::class_<Decoder>(m, "Decoder", pybind11::module_local())
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t,
                          int64_t, double, std::vector<std::vector<at::Tensor>>>(),
           pybind11::arg("layers"), pybind11::arg("final_norm"), pybind11::arg("rope_cos"), pybind11::arg("rope_sin"),
           pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"),
           pybind11::arg("quantized") = std::vector<std::vector<at::Tensor>>())
      .def("forward", &Decoder::forward, pybind11::arg("x"), pybind11::arg("slots"), pybind11::arg("positions"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("taps"), pybind11::arg("block") = false)
      .def("context", &Decoder::context);
}
