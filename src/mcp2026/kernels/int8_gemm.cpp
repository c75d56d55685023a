// int8 weights x int16-precision activations for any row count (AVX-512 VNNI): int4_gemm.cpp's structure for
// per-output-channel int8 weights (Int8Linear).
//
// The int8 GEMV (gemv.cpp, float activations) converts every weight to fp32 and runs far below the
// machine's integer throughput; above GEMV_BATCH_MAX_ROWS the layer used to dequantize the whole weight and call
// an fp32 GEMM (a prefill with int8 weights ran below one with fp32 weights). Here the weights are repacked once
// (int8_gemm_pack) so that one 64-byte vector holds 16 output columns x 4 consecutive k, stored as w + 128
// (dpbusd multiplies unsigned by signed bytes): a dpbusd adds, for 16 columns at once, four products with one
// broadcast dword of a row's activations. The activations are two int8 planes per 32-value block: q1 as the
// int4 kernels round them (amax / 127) and q2 the remainder at 1/256 of that step, so x ~= dx (q1 + q2 / 256)
// to within dx / 512 (the int4 kernels' single plane is ~0.5% off per output, which took int8 weights from
// +0.16% to +0.35% ΔPPL; two planes cost one more dpbusd per weight vector). Per block, 256 dot(w, q1) +
// dot(w, q2) stays in int32 and is scaled by dx / 256 into fp32 accumulators; the +128 is taken back once per
// row and the column's weight scale applied at the end. Columns go 32 at a time and rows 4 at a time; a thread
// takes a range of column tiles and runs every row through each tile, so its weights stay in L1/L2.

#include <torch/extension.h>

#include "cpu_kernels.h"
#include "simd.h"
#include "vnni_gemm.h"

namespace {

#ifdef MCP_INT4_VNNI
// Rows in two int8 planes per 32-value block (see the top): q1, q2 (M, K); step = dx / 256 (M, K/32);
// corr = 128 x sum over blocks of step x sum(256 q1 + q2), per row (the weights' +128).
struct TwoPlaneRows {
  std::vector<int8_t> q1, q2;
  std::vector<float> step, corr;
};

template <typename T>
TwoPlaneRows quantize_two_planes(const T* x, int64_t M, int64_t K) {
  const int64_t nblk = K / 32;
  TwoPlaneRows r{std::vector<int8_t>(M * K), std::vector<int8_t>(M * K), std::vector<float>(M * nblk),
                 std::vector<float>(M)};
  const __m512 lim = _mm512_set1_ps(127.f), neg = _mm512_set1_ps(-127.f), fine = _mm512_set1_ps(256.f);
  team::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float corr = 0.f;
      for (int64_t b = 0; b < nblk; ++b) {
        const T* xb = x + i * K + b * 32;
        const __m512 a = load16(xb), c = load16(xb + 16);
        __m512 inv;
        const float dx = block_step(a, c, &inv);
        int32_t sum = 0;
        for (int h = 0; h < 2; ++h) {
          const __m512 t = _mm512_mul_ps(h ? c : a, inv);  // |t| <= 127
          const __m512i q1 = _mm512_cvtps_epi32(t);          // round to nearest even
          // t - q1 is exact in fp32 and within [-1/2, 1/2]; 256 x it rounds to [-128, 128], clamped to 127
          const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(q1)), fine);
          const __m512i q2 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(f, neg), lim));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q1.data() + i * K + b * 32 + 16 * h), _mm512_cvtepi32_epi8(q1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(r.q2.data() + i * K + b * 32 + 16 * h), _mm512_cvtepi32_epi8(q2));
          sum += _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(q1, 8), q2));
        }
        r.step[i * nblk + b] = dx / 256.f;
        corr += dx / 256.f * static_cast<float>(sum);
      }
      r.corr[i] = 128.f * corr;
    }
  });
  return r;
}

// R rows x C column tiles of 16. wp: the first tile's packed weights (K/4 vectors of 64 bytes, the next tile
// tile_bytes further); scales: its 16 column scales (the next tile's 16 further); q1, q2: R rows of K int8;
// step: their (row, block) steps; corr: their corrections. out: R rows of stride N at the tile's first column.
template <int R, int C>
void gemm_tile(const uint8_t* wp, const float* scales, const int8_t* q1, const int8_t* q2, const float* step,
               const float* corr, int64_t K, float* out, int64_t N) {
  const int64_t nblk = K / 32, tile_bytes = K * kColTile;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblk; ++b) {
    __m512i hi[R][C], lo[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) hi[r][c] = lo[r][c] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {  // a block's 32 k: 8 vectors of 4 k each
      __m512i w[C];
      for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_si512(wp + c * tile_bytes + (b * 8 + j) * 64);
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * K + b * 32 + j * 4;
        const __m512i x1 = broadcast_dword(q1 + at), x2 = broadcast_dword(q2 + at);
        for (int c = 0; c < C; ++c) {
          hi[r][c] = _mm512_dpbusd_epi32(hi[r][c], w[c], x1);
          lo[r][c] = _mm512_dpbusd_epi32(lo[r][c], w[c], x2);
        }
      }
    }
    for (int r = 0; r < R; ++r) {  // |256 hi + lo| <= 257 x 255 x 127 x 32 < 2^31
      const __m512 s = _mm512_set1_ps(step[r * nblk + b]);
      for (int c = 0; c < C; ++c) {
        const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(hi[r][c], 8), lo[r][c]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 offset = _mm512_set1_ps(corr[r]);
    for (int c = 0; c < C; ++c) {
      const __m512 s = _mm512_loadu_ps(scales + c * kColTile);
      _mm512_storeu_ps(out + r * N + c * kColTile, _mm512_mul_ps(_mm512_sub_ps(acc[r][c], offset), s));
    }
  }
}

template <int C>
void gemm_rows(const uint8_t* wp, const float* scales, const TwoPlaneRows& xr, int64_t M, int64_t K, float* out,
               int64_t N) {
  const int64_t nblk = K / 32;
  for_row_tiles(M, [&](int64_t r0, auto rows) {
    gemm_tile<decltype(rows)::value, C>(wp, scales, xr.q1.data() + r0 * K, xr.q2.data() + r0 * K,
                                        xr.step.data() + r0 * nblk, xr.corr.data() + r0, K, out + r0 * N, N);
  });
}
#endif

}  // namespace

// w (N, K) int8 -> (N/16, K/4, 64) uint8: byte 4c + e of vector j of tile t holds w[16t + c][4j + e] + 128.
torch::Tensor int8_gemm_pack(const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.is_contiguous() && w.dim() == 2, "w must be contiguous int8 (N, K)");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kColTile == 0 && K % 32 == 0, "int8_gemm_pack needs N % 16 == 0 and K % 32 == 0");
  auto wp = torch::empty({N / kColTile, K / 4, 64}, w.options().dtype(torch::kByte));
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = wp.data_ptr<uint8_t>();
  team::parallel_for(0, N / kColTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < kColTile; ++c) {
        const int8_t* row = src + (t * kColTile + c) * K;
        for (int64_t j = 0; j < K / 4; ++j)
          for (int64_t e = 0; e < 4; ++e)
            dst[(t * (K / 4) + j) * 64 + 4 * c + e] = static_cast<uint8_t>(row[4 * j + e] + 128);
      }
  });
  return wp;
}

torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x must be a CPU (M, K) tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
  const int64_t M = x.size(0), K = x.size(1), N = wp.size(0) * kColTile;
  TORCH_CHECK(wp.scalar_type() == torch::kByte && wp.is_contiguous() && wp.size(1) * 4 == K && wp.size(2) == 64,
              "wp must be int8_gemm_pack's (N/16, K/4, 64) uint8 for this K");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales must be contiguous float32 (N,)");
#ifdef MCP_INT4_VNNI
  const auto xc = x.contiguous();
  TwoPlaneRows xr;
  if (xc.scalar_type() == torch::kFloat)
    xr = quantize_two_planes(xc.data_ptr<float>(), M, K);
  else
    xr = quantize_two_planes(xc.data_ptr<at::BFloat16>(), M, K);
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  const uint8_t* w = wp.data_ptr<uint8_t>();
  const float* s = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tiles = N / kColTile, tile_bytes = K * kColTile;
  for_column_tiles(tiles, M, [&](int64_t t, bool pair) {
    if (pair)
      gemm_rows<2>(w + t * tile_bytes, s + t * kColTile, xr, M, K, op + t * kColTile, N);
    else
      gemm_rows<1>(w + t * tile_bytes, s + t * kColTile, xr, M, K, op + t * kColTile, N);
  });
  return x.scalar_type() == torch::kFloat ? out : out.to(x.scalar_type());
#else
  TORCH_CHECK(false, "int8_gemm needs AVX-512 VNNI (see vnni_gemm_available)");
  return x;
#endif
}
