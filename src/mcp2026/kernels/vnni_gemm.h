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

// Group g's (scale, offset) for one column: sc points at the column's first scale in its tile, P parts a group
// (2: scale then offset; 1: the scale alone, the offset -value_center(bits) x it). The scalar paths' reading.
template <typename S>
inline std::pair<float, float> group_scale_offset(const S* sc, int64_t g, int64_t P, int bits) {
  const float scale = static_cast<float>(sc[g * P * kColTile]);
  return {scale, P == 2 ? static_cast<float>(sc[g * P * kColTile + kColTile]) : -value_center(bits) * scale};
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

// Calls fn with the scales tensor's data as const float* or const at::Half* (the block GEMMs take either).
template <typename F>
void with_scales(const torch::Tensor& so, const F& fn) {
  if (so.scalar_type() == torch::kHalf)
    fn(static_cast<const at::Half*>(so.data_ptr<at::Half>()));
  else
    fn(static_cast<const float*>(so.data_ptr<float>()));
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
