// What the AVX-512 VNNI GEMMs (int4_gemm.cpp, int8_gemm.cpp) share: the tile shape, the activation broadcast
// and how threads split the output columns. Each GEMM keeps its own weight layout and micro-tile.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#include "cpu_kernels.h"
#include "quantize_rows.h"
#include "simd.h"
#include "thread_team.h"

namespace {

constexpr int64_t kColTile = 16;   // output columns per 64-byte weight vector
constexpr int64_t kGemmRows = 4;   // rows per micro-tile
// A decode-sized call (one row tile) reads each weight once: the int4 and block GEMMs prefetch its weights this
// far ahead as non-temporal, so streaming the model does not evict from the caches what the rest of the step
// works on (the activations, the KV blocks, the interpreter's objects between calls). A prefill reuses each tile
// for every row tile and keeps the hardware's normal caching. 8 KiB: far enough ahead of one sequential stream
// per thread to cover the memory latency (shorter distances left whole decode steps slower, longer gained nothing).
constexpr int64_t kStreamAhead = 8192;

// A weight's scales (part 0) and offsets (part 1; P = 1: none, each offset -value_center(bits) x its scale), in
// one of two layouts, a tile's after another's:
// - per group, S = float or at::Half: (N/16, K/G, P, 16), group g's part p of column c at (g P + p) 16 + c;
// - per super-block, S = int8_t (quant/super_blocks.py): (N/16, K/256, P, 16 (4 + 256/G)) bytes, per super-block
//   and part the 16 columns' fp32 factors, then per group their int8 integers; the value is factor x integer,
//   exact in fp32 (the factors have at most 16 significant bits), so both layouts give the same floats.
constexpr int64_t kSuperBlock = 256;

template <typename S>
inline int64_t tile_params(int64_t K, int64_t G, int64_t P) {  // elements of S per tile
  if constexpr (std::is_same_v<S, int8_t>)
    return (K / kSuperBlock) * P * kColTile * (4 + kSuperBlock / G);
  else
    return (K / G) * P * kColTile;
}

// The bytes of group g's part p in its super-block: 16 fp32 factors, then (at group_integers) 16 int8.
inline const int8_t* super_block_part(const int8_t* st, int64_t g, int64_t p, int64_t P, int64_t G) {
  const int64_t per = kSuperBlock / G;
  return st + ((g / per) * P + p) * kColTile * (4 + per);
}
inline const int8_t* group_integers(const int8_t* part, int64_t g, int64_t G) {
  return part + kColTile * (4 + g % (kSuperBlock / G));
}

// Column c's part p of group g, st: its tile's first parameter. The scalar paths' reading.
template <typename S>
inline float group_param(const S* st, int64_t c, int64_t g, int64_t p, int64_t P, int64_t G) {
  if constexpr (std::is_same_v<S, int8_t>) {
    const int8_t* part = super_block_part(st, g, p, P, G);
    float factor;
    std::memcpy(&factor, part + 4 * c, sizeof factor);
    return factor * static_cast<float>(group_integers(part, g, G)[c]);
  } else {
    return static_cast<float>(st[(g * P + p) * kColTile + c]);
  }
}

// Group g's (scale, offset) for column c of a tile.
template <typename S>
inline std::pair<float, float> group_scale_offset(const S* st, int64_t c, int64_t g, int64_t P, int64_t G, int bits) {
  const float scale = group_param(st, c, g, 0, P, G);
  return {scale, P == 2 ? group_param(st, c, g, 1, P, G) : -value_center(bits) * scale};
}

#if defined(__AVX512F__)
// The 16 columns' part p of group g.
template <typename S>
inline __m512 group_param16(const S* st, int64_t g, int64_t p, int64_t P, int64_t G) {
  if constexpr (std::is_same_v<S, int8_t>) {
    const int8_t* part = super_block_part(st, g, p, P, G);
    const __m128i integers = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group_integers(part, g, G)));
    return _mm512_mul_ps(_mm512_loadu_ps(part), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(integers)));
  } else {
    return load16(st + (g * P + p) * kColTile);
  }
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
// Columns 8h .. 8h + 7's part p of group g.
template <typename S>
inline __m256 group_param8(const S* st, int64_t g, int64_t p, int64_t P, int64_t G, int h) {
  if constexpr (std::is_same_v<S, int8_t>) {
    const int8_t* part = super_block_part(st, g, p, P, G);
    const __m128i integers = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(group_integers(part, g, G) + 8 * h));
    return _mm256_mul_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(part) + 8 * h),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(integers)));
  } else {
    return load8(st + (g * P + p) * kColTile + 8 * h);
  }
}
#endif

// Per (row, group): the int sum of the row's int8 values over the group, and dx times it.
struct GroupSums {
  std::vector<int32_t> isum;
  std::vector<float> dxs;
};

inline GroupSums group_sums(const QuantizedRows& xr, int64_t M, int64_t K, int64_t G) {
  const int64_t ngrp = K / G;
  GroupSums gs{std::vector<int32_t>(M * ngrp), std::vector<float>(M * ngrp)};
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < ngrp; ++g) {
      const int8_t* q = xr.q.data() + r * K + g * G;
      int32_t sum = 0;
      for (int64_t k = 0; k < G; ++k) sum += q[k];
      gs.isum[r * ngrp + g] = sum;
      gs.dxs[r * ngrp + g] = xr.scale[r * (K / 32) + g * G / 32] * static_cast<float>(sum);
    }
  return gs;
}

#ifdef MCP_INT4_VNNI
// One dword (4 consecutive int8 activations) in every lane: dpbusd's signed operand for 16 columns at once.
inline __m512i broadcast_dword(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}
#endif

// The output of a VNNI GEMM on x: bf16 for bf16 activations (the kernels write it directly), else fp32.
inline torch::Tensor gemm_output(const torch::Tensor& x, int64_t M, int64_t N, torch::Tensor* slot = nullptr) {
  return slot_or_empty(slot, {M, N},
                       x.options().dtype(x.scalar_type() == torch::kBFloat16 ? torch::kBFloat16 : torch::kFloat));
}

// A GEMM's bias as contiguous fp32 (undefined without one): added to the fp32 results before they are stored, so
// a bf16 output is rounded once, as (fp32 result + bias) converted afterwards would be.
inline torch::Tensor gemm_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias must be (N,) for the weight's N outputs");
  return bias->to(torch::kFloat).contiguous();
}

#ifdef MCP_INT4_VNNI
// A micro-tile's R x C accumulators (plus the tile's bias, if any) into R output rows of stride N.
template <int R, int C, typename O>
inline void store_tile(__m512 (&acc)[R][C], const float* bias, O* out, int64_t N) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      store16(out + r * N + c * kColTile,
              bias ? _mm512_add_ps(acc[r][c], _mm512_loadu_ps(bias + c * kColTile)) : acc[r][c]);
}
#endif

// Calls fn with the output's data as float* or at::BFloat16*.
template <typename F>
void with_output(torch::Tensor& out, const F& fn) {
  if (out.scalar_type() == torch::kBFloat16)
    fn(out.data_ptr<at::BFloat16>());
  else
    fn(out.data_ptr<float>());
}

// Calls fn with the scales tensor's data as const float*, const at::Half* or (per super-block) const int8_t*.
template <typename F>
void with_scales(const torch::Tensor& so, const F& fn) {
  if (so.scalar_type() == torch::kHalf)
    fn(static_cast<const at::Half*>(so.data_ptr<at::Half>()));
  else if (so.scalar_type() == torch::kChar)
    fn(static_cast<const int8_t*>(so.data_ptr<int8_t>()));
  else
    fn(static_cast<const float*>(so.data_ptr<float>()));
}

// A scales tensor's parts per group (P) and group size (G), checked against the weight's N and K.
struct ScaleShape {
  int64_t P, G;
};
inline ScaleShape scale_shape(const torch::Tensor& so, int64_t N, int64_t K) {
  const auto type = so.scalar_type();
  TORCH_CHECK((type == torch::kFloat || type == torch::kHalf || type == torch::kChar) && so.is_contiguous() &&
                  so.dim() == 4 && so.size(0) * kColTile == N && (so.size(2) == 1 || so.size(2) == 2),
              "so must be (N/16, K/G, 1 or 2, 16) fp32 or fp16, or (N/16, K/256, 1 or 2, 16 (4 + 256/G)) int8");
  if (type != torch::kChar) {
    TORCH_CHECK(so.size(3) == kColTile && so.size(1) > 0 && K % so.size(1) == 0, "so must be (N/16, K/G, P, 16)");
    return {so.size(2), K / so.size(1)};
  }
  const int64_t per = so.size(3) / kColTile - 4;
  TORCH_CHECK(K % kSuperBlock == 0 && so.size(1) * kSuperBlock == K && so.size(3) % kColTile == 0 &&
                  (per == 8 || per == 16),
              "super-block scales must be (N/16, K/256, P, 16 (4 + 256/G)) int8 with groups of 32 or 16");
  return {so.size(2), kSuperBlock / per};
}

// Rows in micro-tiles of kGemmRows (a shorter last one): fn(first row, std::integral_constant<int, rows>), so a
// GEMM's micro-tile gets its row count as a template argument.
template <typename F>
void for_row_tiles(int64_t M, const F& fn) {
  for (int64_t r0 = 0; r0 < M; r0 += kGemmRows) {
    switch (std::min(kGemmRows, M - r0)) {
      case 1: fn(r0, std::integral_constant<int, 1>{}); break;
      case 2: fn(r0, std::integral_constant<int, 2>{}); break;
      case 3: fn(r0, std::integral_constant<int, 3>{}); break;
      default: fn(r0, std::integral_constant<int, 4>{}); break;
    }
  }
}

// Threads take the column tiles in pairs (a last single tile when the count is odd), each running every row
// through its tiles so their weights stay in cache: fn(first tile, whether a second follows). A one-row call
// (a batch-1 decode step) reuses no weight across rows: there each tile goes alone, so that a thread reads one
// sequential stream of weights instead of two interleaved ones.
template <typename F>
void for_column_tiles(int64_t tiles, int64_t M, const F& fn) {
  if (M == 1) {
    team::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) fn(t, false);
    });
    return;
  }
  team::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) fn(2 * p, 2 * p + 1 < tiles);
  });
}

}  // namespace
