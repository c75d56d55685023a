// int4 weights x int8 activations for prefill-sized inputs (AVX-512 VNNI): the GEMM form of the int4 GEMV.
//
// The GEMV (gemv.cpp) computes one output per (row, weight row) with a horizontal sum at the end and
// streams every weight once per eight rows, which is right for decode but leaves a 512-token prefill far below
// a bf16 GEMM. Here the weights are repacked once (int4_gemm_pack) so that one 64-byte vector holds 16 output
// columns x 4 consecutive k in each nibble plane: a dpbusd then adds, for 16 columns at once, four products
// of the weights with one broadcast dword of a row's int8 activations. Columns go 32 at a time and rows 4 at a
// time (8 int32 and 8 fp32 accumulators); per group (32 values, or 16) the int32 dots are converted and scaled
// by the weight scale x the activation scale, and the weight offset (zero - 8 scale) x the block's dx x sum(xq
// over the group) is added, the GEMV's arithmetic. A thread takes a range of column tiles and runs every row
// through each tile, so a tile's weights (K/2 bytes per column) stay in L1 while the activations come from L2.
// Activations are quantized as the GEMV quantizes them (quantize_rows.h): prefill and decode round alike.

#include <torch/extension.h>

#include "cpu_kernels.h"
#include "simd.h"
#include "vnni_gemm.h"

namespace {

#ifdef MCP_INT4_VNNI
// R rows x C column tiles of 16, groups of G (32 or 16) along K. wp: the first tile's packed weights (K/8
// vectors of VB bytes, the next tile tile_bytes further); so: its scales and offsets per group (vnni_gemm.h
// group_param16); xq: R rows of K int8; dx: their (row, 32-block) scales; dxs: (row, group) dx * sum(xq). out: R
// rows of stride N at the tile's first column. VB = 80: the block GEMM's 5-bit layout (block_gemm.cpp), each
// vector's nibbles followed by two 64-bit masks of fifth bits, added to the nibbles with one masked byte add
// each; VB = 96: its 6-bit layout, two more masks of sixth bits. L: the nibbles index kLevelValues (IQ4), looked
// up with one byte shuffle each. P: parts of so per group (2: scales, offsets; 1: scales, offsets -center x
// scale).
template <int R, int C, int VB, bool L, int G, typename S, typename O>
void gemm_tile(const uint8_t* wp, const S* so, int64_t P, const int8_t* xq, const float* dx, const float* dxs,
               int64_t K, const float* bias, O* out, int64_t N, bool stream) {
  static_assert(VB == 64 || VB == 80 || VB == 96, "nibble vectors, with their fifth (and sixth) bits");
  static_assert(!L || VB == 64, "level indices are plain nibbles");
  static_assert(G == 32 || G == 16, "groups of 32 or 16");
  constexpr int kVectors = G / 8;  // 64-byte nibble vectors (8 k each) per group
  const int64_t nblk = K / 32, ngrp = K / G, tile_bytes = (K / 8) * VB, tile_scales = tile_params<S>(K, G, P);
  const __m512 neg_center = _mm512_set1_ps(-value_center(L ? kLevelNibbles : VB == 96 ? 6 : VB == 80 ? 5 : 4));
  const __m512i nibble = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16), thirty_two = _mm512_set1_epi8(32);
  const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kLevelValues)));
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ngrp; ++g) {
    __m512i dot[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_si512();
    for (int j = 0; j < kVectors; ++j) {  // a group's G k: vectors of 8 k (low nibbles k..k+3, high k+4..k+7)
      __m512i lo[C], hi[C];
      for (int c = 0; c < C; ++c) {
        const uint8_t* src = wp + c * tile_bytes + (g * kVectors + j) * VB;
        if (stream) _mm_prefetch(reinterpret_cast<const char*>(src + kStreamAhead), _MM_HINT_NTA);
        const __m512i v = _mm512_loadu_si512(src);
        lo[c] = _mm512_and_si512(v, nibble);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        if constexpr (VB >= 80) {
          uint64_t fifth_lo, fifth_hi;
          std::memcpy(&fifth_lo, src + 64, 8);
          std::memcpy(&fifth_hi, src + 72, 8);
          lo[c] = _mm512_mask_add_epi8(lo[c], _cvtu64_mask64(fifth_lo), lo[c], sixteen);
          hi[c] = _mm512_mask_add_epi8(hi[c], _cvtu64_mask64(fifth_hi), hi[c], sixteen);
        }
        if constexpr (VB == 96) {
          uint64_t sixth_lo, sixth_hi;
          std::memcpy(&sixth_lo, src + 80, 8);
          std::memcpy(&sixth_hi, src + 88, 8);
          lo[c] = _mm512_mask_add_epi8(lo[c], _cvtu64_mask64(sixth_lo), lo[c], thirty_two);
          hi[c] = _mm512_mask_add_epi8(hi[c], _cvtu64_mask64(sixth_hi), hi[c], thirty_two);
        }
        if constexpr (L) {
          lo[c] = _mm512_shuffle_epi8(levels, lo[c]);
          hi[c] = _mm512_shuffle_epi8(levels, hi[c]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq + r * K + g * G + j * 8;
        const __m512i x_lo = broadcast_dword(x), x_hi = broadcast_dword(x + 4);
        for (int c = 0; c < C; ++c) {
          dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], lo[c], x_lo);
          dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], hi[c], x_hi);
        }
      }
    }
    const int64_t blk = g * G / 32;
    for (int c = 0; c < C; ++c) {
      const S* st = so + c * tile_scales;
      const __m512 s = group_param16(st, g, 0, P, G);
      const __m512 o = P == 2 ? group_param16(st, g, 1, P, G) : _mm512_mul_ps(s, neg_center);
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(dx[r * nblk + blk]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), scale, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(o, _mm512_set1_ps(dxs[r * ngrp + g]), acc[r][c]);
      }
    }
  }
  store_tile<R, C>(acc, bias, out, N);
}

// dxs: (row, group) dx * sum(xq) (groups of 32: the quantized rows' own sums).
template <int C, int VB, bool L, int G, typename S, typename O>
void gemm_rows(const uint8_t* wp, const S* so, int64_t P, const QuantizedRows& xr, const float* dxs, int64_t M,
               int64_t K, const float* bias, O* out, int64_t N) {
  const int64_t nblk = K / 32;
  for_row_tiles(M, [&](int64_t r0, auto rows) {
    gemm_tile<decltype(rows)::value, C, VB, L, G, S, O>(wp, so, P, xr.q.data() + r0 * K, xr.scale.data() + r0 * nblk,
                                                     dxs + r0 * (K / G), K, bias, out + r0 * N, N, M <= kGemmRows);
  });
}

template <int VB, bool L, int G, typename S, typename O>
void gemm_columns(const uint8_t* w, const S* s, int64_t P, const QuantizedRows& xr, const float* dxs, int64_t M,
                  int64_t K, const float* bias, O* out, int64_t N) {
  const int64_t tiles = N / kColTile, tile_bytes = (K / 8) * VB, tile_scales = tile_params<S>(K, G, P);
  for_column_tiles(tiles, M, [&](int64_t t, bool pair) {
    const uint8_t* wt = w + t * tile_bytes;
    const S* st = s + t * tile_scales;
    const float* bt = bias ? bias + t * kColTile : nullptr;
    if (pair)
      gemm_rows<2, VB, L, G>(wt, st, P, xr, dxs, M, K, bt, out + t * kColTile, N);
    else
      gemm_rows<1, VB, L, G>(wt, st, P, xr, dxs, M, K, bt, out + t * kColTile, N);
  });
}

// Groups of 16 (Q2_K, Q3_K, Q6_K and fusions with them), with their own group sums. Out of line: inlined, these
// instantiations reshaped the dispatch of groups of 32 (the default model's decode path), whose decode steps then
// ran slower under some address layouts.
template <typename S, typename O>
__attribute__((noinline)) void gemm_columns_16(const uint8_t* w, const S* s, int64_t P, const QuantizedRows& xr,
                                               int64_t M, int64_t K, const float* bias, O* out, int64_t N,
                                               int64_t VB) {
  const GroupSums sums = group_sums(xr, M, K, 16);
  if (VB == 64)
    gemm_columns<64, false, 16>(w, s, P, xr, sums.dxs.data(), M, K, bias, out, N);
  else if (VB == 80)
    gemm_columns<80, false, 16>(w, s, P, xr, sums.dxs.data(), M, K, bias, out, N);
  else
    gemm_columns<96, false, 16>(w, s, P, xr, sums.dxs.data(), M, K, bias, out, N);
}
#endif

}  // namespace

bool vnni_gemm_available() {
#ifdef MCP_INT4_VNNI
  return true;
#else
  return false;
#endif
}

// The GEMV layout (qs (N, K/32, 16) bytes: w[32b + i] in the low nibble of byte i, w[32b + 16 + i] in the high;
// sz (N, K/32, 2) fp16 scale and zero) -> the GEMM's: wp (N/16, K/8, 64) bytes, byte 4c + e of vector j of
// tile t holding w[16t + c][8j + e] (low nibble) and w[16t + c][8j + 4 + e] (high); so (N/16, K/32, 2, 16)
// fp32: per (tile, block) the 16 columns' scales, then their offsets (zero - 8 scale).
std::vector<torch::Tensor> int4_gemm_pack(const torch::Tensor& qs, const torch::Tensor& sz) {
  TORCH_CHECK(qs.scalar_type() == torch::kByte && qs.is_contiguous() && qs.dim() == 3 && qs.size(2) == 16,
              "qs must be contiguous uint8 (N, K/32, 16)");
  const int64_t N = qs.size(0), nblk = qs.size(1), K = nblk * 32;
  TORCH_CHECK(sz.scalar_type() == torch::kHalf && sz.is_contiguous() && sz.numel() == N * nblk * 2,
              "sz must be contiguous float16 (N, K/32, 2)");
  TORCH_CHECK(N % kColTile == 0, "N must be a multiple of 16");
  auto wp = torch::empty({N / kColTile, K / 8, 64}, qs.options());
  auto so = torch::empty({N / kColTile, nblk, 2, kColTile}, qs.options().dtype(torch::kFloat));
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const at::Half* s = sz.data_ptr<at::Half>();
  uint8_t* w = wp.data_ptr<uint8_t>();
  float* sop = so.data_ptr<float>();
  auto weight = [&](int64_t n, int64_t k) -> uint8_t {  // w[n][k] in 0..15 from the GEMV layout
    const uint8_t byte = q[(n * nblk + k / 32) * 16 + (k % 32) % 16];
    return (k % 32) < 16 ? (byte & 0x0F) : (byte >> 4);
  };
  at::parallel_for(0, N / kColTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < kColTile; ++c) {
        const int64_t n = t * kColTile + c;
        for (int64_t j = 0; j < K / 8; ++j)
          for (int64_t e = 0; e < 4; ++e)
            w[(t * (K / 8) + j) * 64 + 4 * c + e] =
                static_cast<uint8_t>(weight(n, 8 * j + e) | (weight(n, 8 * j + 4 + e) << 4));
        for (int64_t b = 0; b < nblk; ++b) {
          const float scale = static_cast<float>(s[(n * nblk + b) * 2]);
          const float zero = static_cast<float>(s[(n * nblk + b) * 2 + 1]);
          sop[((t * nblk + b) * 2) * kColTile + c] = scale;
          sop[((t * nblk + b) * 2 + 1) * kColTile + c] = zero - 8.f * scale;
        }
      }
  });
  return {wp, so};
}

torch::Tensor int4_gemm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so,
                        const c10::optional<torch::Tensor>& bias) {
  return int4_gemm_into(x, wp, so, bias, nullptr);
}

torch::Tensor int4_gemm_into(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so,
                             const c10::optional<torch::Tensor>& bias, torch::Tensor* slot) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x must be a CPU (M, K) tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
  const int64_t M = x.size(0), K = x.size(1), N = wp.size(0) * kColTile;
  const bool levels = wp.scalar_type() == torch::kChar;  // the block GEMM's IQ4 level indices
  const int64_t VB = wp.dim() == 3 ? wp.size(2) : 0;
  TORCH_CHECK((wp.scalar_type() == torch::kByte || levels) && wp.is_contiguous() && wp.dim() == 3 &&
                  wp.size(1) * 8 == K && (VB == 64 || ((VB == 80 || VB == 96) && !levels)),
              "wp must be int4_gemm_pack's (N/16, K/8, 64) uint8 for this K (or the block GEMM's 5-bit (N/16, K/8, 80) "
              "or 6-bit (N/16, K/8, 96), or its int8 level indices (N/16, K/8, 64))");
  const auto [P, G] = scale_shape(so, N, K);  // P 1: scales alone, offsets -8 (-16, -32, -128) x scale
  TORCH_CHECK(G == 32 || (G == 16 && !levels), "int4_gemm takes groups of 32 weights (or 16 without levels)");
#ifdef MCP_INT4_VNNI
  const auto xc = x.contiguous();
  QuantizedRows& xr = thread_rows();
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, xc.scalar_type(), "int4_gemm_q", [&] {
    quantize_rows_into<scalar_t>(xr, xc.data_ptr<scalar_t>(), M, K);
  });
  auto out = gemm_output(x, M, N, slot);
  const auto b = gemm_bias(bias, N);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const auto* w = static_cast<const uint8_t*>(wp.data_ptr());
  with_output(out, [&](auto* op) {
    with_scales(so, [&](const auto* s) {
      if (G == 32) {
        const float* dxs = xr.sum.data();  // groups of 32: the quantized rows' own block sums
        if (levels)
          gemm_columns<64, true, 32>(w, s, P, xr, dxs, M, K, bp, op, N);
        else if (VB == 64)
          gemm_columns<64, false, 32>(w, s, P, xr, dxs, M, K, bp, op, N);
        else if (VB == 80)
          gemm_columns<80, false, 32>(w, s, P, xr, dxs, M, K, bp, op, N);
        else
          gemm_columns<96, false, 32>(w, s, P, xr, dxs, M, K, bp, op, N);
      } else {
        gemm_columns_16(w, s, P, xr, M, K, bp, op, N, VB);
      }
    });
  });
  return out;
#else
  TORCH_CHECK(false, "int4_gemm needs AVX-512 VNNI (see vnni_gemm_available)");
  return x;
#endif
}
