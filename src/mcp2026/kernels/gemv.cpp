// Decode-sized GEMVs on the CPU (a few rows of x against the whole weight), one per weight format: int4 blocks
// with int8-quantized activations, int8 per output channel, float (fp32 / bf16); and the int4 layout back to
// float for prefill-sized inputs (dequantize + GEMM). The AVX-512 VNNI GEMMs for prefill-sized inputs are
// int4_gemm.cpp, int8_gemm.cpp and block_gemm.cpp.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_kernels.h"
#include "quantize_rows.h"
#include "simd.h"
#include "thread_team.h"

// ---- int4 x int8 GEMV (decode-sized batches) ---------------------------------------------------------------
// Weights in 32-wide blocks: qs (N, K/32, 16) bytes, byte i holding w[32b + i] (low nibble) and w[32b + 16 + i]
// (high nibble); sz (N, K/32, 2) fp16 scale and zero, value = (q - 8) * scale + zero with q in 0..15 (the
// convention of torch's int4 kernel; fp16 as GGUF's Q4_0 / Q4_1 store theirs, so a file's 4-bit grid is held
// exactly: bf16's 8-bit mantissa moved every weight of a group by its zero's rounding). Activations
// are quantized per 32-block to int8 at call time (as llama.cpp's Q8 activations), so one block's dot product
// is integer multiply-adds: u8 x s8 pairs (maddubs), widened to int32, then one float FMA with scale * dx; the
// (zero - 8 * scale) term needs only the block's sum of the quantized x. Rows are taken 8 at a time: each weight
// block is unpacked once per 8 rows, and a thread's slice of weights stays in cache while it walks the row
// tiles, so the weights are read from memory once per call (which row counts should come here is the caller's
// choice, from measurements: quant/linear.py).
namespace {

constexpr int64_t kRowTile = 8;

// Calls f with the row count (1..kRowTile) as a compile-time constant, so per-row accumulators of the
// GEMVs are fixed-size arrays the compiler keeps in registers.
template <typename F>
void with_row_count(int64_t M, F&& f) {
  switch (M) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

// QuantizedRows, quantize_rows and MCP_INT4_VNNI: quantize_rows.h (shared with int4_gemm.cpp).

#if defined(__AVX2__) && defined(__FMA__)
#if !defined(__F16C__)
#error "the int4 kernels widen fp16 scales with F16C, which every AVX2 CPU has; build with -march=native"
#endif
// Eight blocks' fp16 (scale, zero) pairs as two float vectors: a pair is one 32-bit lane, scale in the low
// half; the halves are split into two 8 x 16-bit runs (pack within 128-bit lanes, then order the quadwords)
// and widened with F16C.
struct BlockScales {
  __m256 s, off;  // scale, zero - 8 * scale
};

inline BlockScales block_scales8(const uint16_t* sz) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz));
  const __m256i low = _mm256_and_si256(raw, _mm256_set1_epi32(0xFFFF));
  const __m256i high = _mm256_srli_epi32(raw, 16);
  // packus: [low 0-3, high 0-3 | low 4-7, high 4-7] -> quadwords 0, 2, 1, 3: [low 0-7 | high 0-7]
  const __m256i split = _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0xD8);
  const __m256 s = _mm256_cvtph_ps(_mm256_castsi256_si128(split));
  const __m256 z = _mm256_cvtph_ps(_mm256_extracti128_si256(split, 1));
  return {s, _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s, z)};
}

inline __m256i unpack_block(const uint8_t* wq) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wq));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
}

inline __m256 dot_block(__m256i w, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

// Rows x one weight row, eight blocks at a time. Per eight blocks, their scales and offsets are two vector
// ops shared by all rows; per row, the combined scales (scale x dx) are one multiply, stored so each block
// broadcasts its own from memory (a load, no shuffle), and the offset term (offset x dx x sum of the quantized
// x) is one FMA. A group's eight products form their own FMA chain from zero, added to the row's total after,
// so one row's consecutive groups overlap in the pipeline. The leftover blocks (K/32 mod 8) do the same per
// block in scalar. One row or eight, every row's arithmetic is identical: a sequence decoded in a batch gets
// the same bits as alone.
template <int M>
inline void gemv_weight_row(const uint8_t* wq, const uint16_t* szn, const RowsView& xr, int64_t K, float* out,
                            int64_t stride) {
  const int64_t nblk = K / 32;
  __m256 acc[M];
  float tail[M];
  for (int i = 0; i < M; ++i) {
    acc[i] = _mm256_setzero_ps();
    tail[i] = 0.f;
  }
  alignas(32) float d[M][8];
  int64_t b = 0;
  for (; b + 8 <= nblk; b += 8) {
    const BlockScales bs = block_scales8(szn + 2 * b);
    for (int i = 0; i < M; ++i) {
      _mm256_store_ps(d[i], _mm256_mul_ps(bs.s, _mm256_loadu_ps(xr.scale + i * nblk + b)));
      acc[i] = _mm256_fmadd_ps(bs.off, _mm256_loadu_ps(xr.sum + i * nblk + b), acc[i]);
    }
    __m256 group[M];
    for (int i = 0; i < M; ++i) group[i] = _mm256_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      const __m256i w = unpack_block(wq + (b + j) * 16);
      for (int i = 0; i < M; ++i)
        group[i] = _mm256_fmadd_ps(dot_block(w, xr.q + i * K + (b + j) * 32), _mm256_broadcast_ss(&d[i][j]),
                                   group[i]);
    }
    for (int i = 0; i < M; ++i) acc[i] = _mm256_add_ps(acc[i], group[i]);
  }
  for (; b < nblk; ++b) {
    const float s = half_bits_to_float(szn[2 * b]);
    const float off = half_bits_to_float(szn[2 * b + 1]) - 8.f * s;
    const __m256i w = unpack_block(wq + b * 16);
    for (int i = 0; i < M; ++i) {
      acc[i] = _mm256_fmadd_ps(dot_block(w, xr.q + i * K + b * 32), _mm256_set1_ps(s * xr.scale[i * nblk + b]),
                               acc[i]);
      tail[i] += off * xr.sum[i * nblk + b];
    }
  }
  for (int i = 0; i < M; ++i) out[i * stride] = hsum(acc[i]) + tail[i];
}

#ifdef MCP_INT4_VNNI
// 64 weights of blocks b and b+1 (their 32 packed bytes) as u8 in the activations' byte order: 128-bit lanes
// [low nibbles of b | high nibbles of b | low of b+1 | high of b+1].
inline __m512i unpack_block_pair(const uint8_t* wq) {
  const __m512i p = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq)));
  const __m512i dup = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), p);
  return _mm512_and_si512(_mm512_mask_srli_epi32(dup, 0xF0F0, dup, 4), _mm512_set1_epi8(0x0F));
}

// The VNNI version of gemv_weight_row: per pair of blocks and row, dpbusd gives 16 int32 partial sums (8 per
// block), converted and scaled by (weight scale x dx) per lane in one FMA. Blocks go 16 at a time, so their 16
// (scale, zero) pairs are one load and the offset term (zero - 8 scale) x dx x sum(xq) is one FMA per row
// into the same accumulators; two accumulators per row (even and odd pairs) keep the FMA chain from bounding
// a single row. Leftover pairs and a last odd block take the same steps with scalar-built scales. One row or
// eight, every row's arithmetic is identical: a sequence decoded in a batch gets the same bits as alone.
template <int M>
inline void gemv_weight_row_vnni(const uint8_t* wq, const uint16_t* szn, const RowsView& xr, int64_t K,
                                 float* out, int64_t stride) {
  const int64_t nblk = K / 32, k4 = K / 4;
  __m512 acc[M][2];
  float tail[M];
  for (int i = 0; i < M; ++i) {
    acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    tail[i] = 0.f;
  }
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  auto pair = [&](int64_t b, __m512 ws, int slot) {
    const __m512i w = unpack_block_pair(wq + b * 16);
    for (int i = 0; i < M; ++i) {
      const __m512i x = _mm512_loadu_si512(xr.q + i * K + b * 32);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x));
      const __m512 d = _mm512_mul_ps(ws, _mm512_loadu_ps(xr.scale8 + i * k4 + b * 8));
      acc[i][slot] = _mm512_fmadd_ps(dot, d, acc[i][slot]);
    }
  };
  int64_t b = 0;
  for (; b + 16 <= nblk; b += 16) {
    const __m512i raw = _mm512_loadu_si512(szn + 2 * b);  // 16 (scale, zero) fp16 pairs, scale in the low half
    const __m512 s = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(raw));
    const __m512 z = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(raw, 16)));
    const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);
    for (int i = 0; i < M; ++i) acc[i][0] = _mm512_fmadd_ps(off, _mm512_loadu_ps(xr.sum + i * nblk + b), acc[i][0]);
    for (int p = 0; p < 8; ++p)
      pair(b + 2 * p, _mm512_permutexvar_ps(_mm512_add_epi32(halves, _mm512_set1_epi32(2 * p)), s), p & 1);
  }
  for (; b < nblk; ++b) {
    const float s0 = half_bits_to_float(szn[2 * b]);
    const float off0 = half_bits_to_float(szn[2 * b + 1]) - 8.f * s0;
    for (int i = 0; i < M; ++i) tail[i] += off0 * xr.sum[i * nblk + b];
    if (b + 1 < nblk) {
      const float s1 = half_bits_to_float(szn[2 * b + 2]);
      const float off1 = half_bits_to_float(szn[2 * b + 3]) - 8.f * s1;
      for (int i = 0; i < M; ++i) tail[i] += off1 * xr.sum[i * nblk + b + 1];
      pair(b, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0), _mm512_set1_ps(s1)), 0);
      ++b;
      continue;
    }
    const __m256i w = unpack_block(wq + b * 16);
    for (int i = 0; i < M; ++i) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q + i * K + b * 32));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x));
      tail[i] += s0 * xr.scale[i * nblk + b] * hsum(dot);
    }
  }
  for (int i = 0; i < M; ++i) out[i * stride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1])) + tail[i];
}
#endif

// The row count is a template parameter, so the per-row arrays are fixed-size (in registers up to ~6 rows;
// at 7-8 rows some accumulators spill, touched once per eight blocks).
template <int M>
void gemv_fixed_rows(const uint8_t* qs, const uint16_t* sz, const RowsView& xr, int64_t K, int64_t n0,
                     int64_t n1, float* out, int64_t N) {
  const int64_t nblk = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
#ifdef MCP_INT4_VNNI
    gemv_weight_row_vnni<M>(qs + n * nblk * 16, sz + n * nblk * 2, xr, K, out + n, N);
#else
    gemv_weight_row<M>(qs + n * nblk * 16, sz + n * nblk * 2, xr, K, out + n, N);
#endif
  }
}
#endif

void gemv_rows(const uint8_t* qs, const uint16_t* sz, const RowsView& xr, int64_t M, int64_t K, int64_t n0,
               int64_t n1, float* out, int64_t N) {
#if defined(__AVX2__) && defined(__FMA__)
  with_row_count(M, [&](auto rows) {
    gemv_fixed_rows<decltype(rows)::value>(qs, sz, xr, K, n0, n1, out, N);
  });
#else
  const int64_t nblk = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wq = qs + n * nblk * 16;
    const uint16_t* szn = sz + n * nblk * 2;
    for (int64_t i = 0; i < M; ++i) {
      float total = 0.f;
      for (int64_t b = 0; b < nblk; ++b) {
        const int8_t* xq = xr.q + i * K + b * 32;
        int32_t isum = 0;
        for (int k = 0; k < 16; ++k) {
          const uint8_t byte = wq[b * 16 + k];
          isum += static_cast<int32_t>(byte & 0x0F) * xq[k] + static_cast<int32_t>(byte >> 4) * xq[k + 16];
        }
        const float s = half_bits_to_float(szn[2 * b]);
        const float off = half_bits_to_float(szn[2 * b + 1]) - 8.f * s;
        total += s * xr.scale[i * nblk + b] * static_cast<float>(isum) + off * xr.sum[i * nblk + b];
      }
      out[i * N + n] = total;
    }
  }
#endif
}

}  // namespace

torch::Tensor int4_gemv(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sz) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(qs.scalar_type() == torch::kByte && qs.is_contiguous() && qs.numel() == N * K / 2,
              "qs must be contiguous uint8 (N, K/32, 16)");
  TORCH_CHECK(sz.scalar_type() == torch::kHalf && sz.is_contiguous() && sz.numel() == N * K / 16,
              "sz must be contiguous float16 (N, K/32, 2)");
  const auto xc = x.contiguous();
  QuantizedRows& xr = thread_rows();
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, xc.scalar_type(), "int4_gemv_q", [&] {
    quantize_rows_into<scalar_t>(xr, xc.data_ptr<scalar_t>(), M, K);
  });
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  team::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowTile)
      gemv_rows(qp, sp, rows_from(xr, r0, K), std::min(kRowTile, M - r0), K, n0, n1, op + r0 * N, N);
  });
  return x.scalar_type() == torch::kFloat ? out : out.to(x.scalar_type());
}

// ---- int8-weight GEMV (decode-sized batches) -------------------------------------------------------------
// Weights (N, K) int8 with one float scale per output channel; activations stay float (no activation
// quantization: int8 weights are the near-lossless format, and int8 activations measured +0.52% ΔPPL against
// +0.22% with bf16 activations). Widening 8 weights to floats costs a few instructions per FMA, but at
// decode-sized batches the loop waits on memory anyway (135 MB of weights per step for this model).
namespace {

template <int M>
void gemv_int8_rows(const int8_t* w, const float* ws, const float* x, int64_t K, int64_t n0, int64_t n1,
                    float* out, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc0[M], acc1[M];
    for (int i = 0; i < M; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + k));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
      for (int i = 0; i < M; ++i) {
        acc0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * K + k), acc0[i]);
        acc1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * K + k + 8), acc1[i]);
      }
    }
    for (int i = 0; i < M; ++i) {
      float total = hsum(_mm256_add_ps(acc0[i], acc1[i]));
      for (int64_t j = k; j < K; ++j) total += static_cast<float>(wn[j]) * x[i * K + j];
      out[i * N + n] = total * ws[n];
    }
#else
    for (int i = 0; i < M; ++i) {
      float total = 0.f;
      for (int64_t j = 0; j < K; ++j) total += static_cast<float>(wn[j]) * x[i * K + j];
      out[i * N + n] = total * ws[n];
    }
#endif
  }
}

void gemv_int8(const int8_t* w, const float* ws, const float* x, int64_t M, int64_t K, int64_t n0, int64_t n1,
               float* out, int64_t N) {
  with_row_count(M, [&](auto rows) { gemv_int8_rows<decltype(rows)::value>(w, ws, x, K, n0, n1, out, N); });
}

}  // namespace

torch::Tensor int8_gemv(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.is_contiguous() && w.dim() == 2 && w.size(1) == K,
              "w must be contiguous int8 (N, K)");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales must be contiguous float32 (N,)");
  const auto xf = x.to(torch::kFloat).contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  team::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowTile)
      gemv_int8(wp, sp, xp + r0 * K, std::min(kRowTile, M - r0), K, n0, n1, op + r0 * N, N);
  });
  return x.scalar_type() == torch::kFloat ? out : out.to(x.scalar_type());
}

// ---- float-weight GEMV (decode-sized batches) --------------------------------------------------------------
// y = x W^T for fp32 or bf16 weights (N, K) and a few float rows of x. MKL's sgemm is tuned for large batches;
// at 1-16 rows it ran 2-3x below this loop on an AVX2 machine and ~2x below on the 49152-wide lm_head up to 32
// rows (measured with a throwaway script, 2 threads: e.g. 576x3072 at 4 rows 0.86 vs 0.23 ms, lm_head at 32
// rows 48 vs 25 ms). Threads split the weight rows; each thread takes 3 weight rows at a time (kept in L1) past
// all of x in tiles of 4 rows: 12 accumulators, 7 loads per 12 FMAs. Every output is one FMA chain over k in
// order, then a horizontal sum, whatever the tile: a row gets the same bits in any batch.

namespace {
#if defined(__AVX2__) && defined(__FMA__)
// R rows of x by C weight rows: R * C dot products of length K (K % 8 == 0).
template <int R, int C, typename W>
inline void dense_tile(const float* x, const W* w, int64_t K, float* out, int64_t N) {
  __m256 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[C];
    for (int j = 0; j < C; ++j) wv[j] = load8(w + j * K + k);
    for (int i = 0; i < R; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < C; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) out[i * N + j] = hsum(acc[i][j]);
}

template <int C, typename W>
inline void dense_weight_rows(const float* x, const W* w, int64_t M, int64_t K, float* out, int64_t N) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) dense_tile<4, C>(x + i * K, w, K, out + i * N, N);
  switch (M - i) {
    case 3: dense_tile<3, C>(x + i * K, w, K, out + i * N, N); break;
    case 2: dense_tile<2, C>(x + i * K, w, K, out + i * N, N); break;
    case 1: dense_tile<1, C>(x + i * K, w, K, out + i * N, N); break;
    default: break;
  }
}

template <typename W>
void dense_gemv_impl(const float* x, const W* w, int64_t M, int64_t K, int64_t N, float* out) {
  team::parallel_for(0, (N + 2) / 3, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = 3 * t;
      if (n + 3 <= N) dense_weight_rows<3>(x, w + n * K, M, K, out + n, N);
      else if (n + 2 == N) dense_weight_rows<2>(x, w + n * K, M, K, out + n, N);
      else dense_weight_rows<1>(x, w + n * K, M, K, out + n, N);
    }
  });
}
#endif
}  // namespace

// x (M, K) float32/bfloat16, w (N, K) float32/bfloat16, optional bias (N,) -> (M, N) in x's dtype. Our GEMV for
// decode-sized inputs on AVX2 CPUs, at::linear otherwise: in fp32 for fp32 x (bf16 weights widened), else in
// w's dtype (x cast to it).
// Python's Linear modules and the fused decode layers both call this, so the two paths agree bit for bit.
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
#if defined(__AVX2__) && defined(__FMA__)
  const bool fits = x.dim() == 2 && x.size(0) <= kDenseGemvMaxRows && x.device().is_cpu() &&
                    (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
                    (w.scalar_type() == torch::kFloat || w.scalar_type() == torch::kBFloat16) && w.dim() == 2 &&
                    w.is_contiguous() && w.size(1) == x.size(1) && x.size(1) % 8 == 0;
  if (fits) {
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    const auto xf = x.to(torch::kFloat).contiguous();
    auto out = torch::empty({M, N}, xf.options());
    if (w.scalar_type() == torch::kFloat)
      dense_gemv_impl(xf.data_ptr<float>(), w.data_ptr<float>(), M, K, N, out.data_ptr<float>());
    else
      dense_gemv_impl(xf.data_ptr<float>(), w.data_ptr<at::BFloat16>(), M, K, N, out.data_ptr<float>());
    if (bias.has_value()) out.add_(*bias);
    return x.scalar_type() == torch::kFloat ? out : out.to(x.scalar_type());
  }
#endif
  if (x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kBFloat16) {
    // fp32 activations asked for: widen the weights (as int4 prefill dequantizes) rather than round x to bf16
    const auto b = bias.has_value() ? c10::optional<torch::Tensor>(bias->to(torch::kFloat)) : bias;
    return at::linear(x, w.to(torch::kFloat), b);
  }
  const auto xd = x.scalar_type() == w.scalar_type() ? x : x.to(w.scalar_type());
  const auto y = at::linear(xd, w, bias);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// ---- int4 dequantization (prefill) ----------------------------------------------------------------------------
// The GEMV layout back to float (N, K), for prefill-sized batches: a dequantize + GEMM beats torch's int4
// kernel there, in fp32 on AVX2 CPUs (no fast bf16) and in bf16 on AVX512-BF16 ones (out_bf16: each value
// rounded to nearest even, as Tensor.to does). Measured with a throwaway script on a 2-core AVX512-BF16 EPYC,
// 576 -> 3072 at 512 / 128 / 64 rows: dequantize + bf16 F.linear 5.7 / 1.8 / 1.0 ms, torch's int4 kernel
// 14.3 / 3.7 / 1.5 (the dequantization alone 0.46).
torch::Tensor int4_dequant(const torch::Tensor& qs, const torch::Tensor& sz, bool out_bf16,
                           const c10::optional<torch::Tensor>& out_buffer) {
  TORCH_CHECK(qs.scalar_type() == torch::kByte && qs.is_contiguous() && qs.dim() == 3 && qs.size(2) == 16,
              "qs must be contiguous uint8 (N, K/32, 16)");
  TORCH_CHECK(sz.scalar_type() == torch::kHalf && sz.is_contiguous() && sz.numel() == qs.numel() / 8,
              "sz must be contiguous float16 (N, K/32, 2)");
  const int64_t N = qs.size(0), nblk = qs.size(1), K = nblk * 32;
  const auto out_dtype = out_bf16 ? torch::kBFloat16 : torch::kFloat;
  torch::Tensor out;
  if (out_buffer.has_value()) {
    TORCH_CHECK(out_buffer->scalar_type() == out_dtype && out_buffer->is_contiguous() && out_buffer->is_cpu() &&
                    out_buffer->numel() == N * K,
                "out must be a contiguous CPU tensor of N * K elements in the output dtype");
    out = out_buffer->view({N, K});
  } else {
    out = torch::empty({N, K}, out_dtype);
  }
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::Half>());
  float* out_f32 = out_bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* out_b16 = out_bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  team::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    alignas(64) float buf[32];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nblk; ++b) {
        const float s = half_bits_to_float(sp[(n * nblk + b) * 2]);
        const float off = half_bits_to_float(sp[(n * nblk + b) * 2 + 1]) - 8.f * s;
        const uint8_t* q = qp + (n * nblk + b) * 16;
        float* o = out_bf16 ? buf : out_f32 + n * K + b * 32;
#ifdef MCP_INT4_VNNI
        // 16 weights per vector: low nibbles are weights 0..15, high nibbles 16..31; the same q * s + off FMA
        {
          const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
          const __m128i mask = _mm_set1_epi8(0x0F);
          const __m512 vs = _mm512_set1_ps(s), voff = _mm512_set1_ps(off);
          const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, mask))), vs, voff);
          const __m512 hi = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(packed, 4), mask))), vs, voff);
          if (out_bf16) {
            at::BFloat16* ob = out_b16 + n * K + b * 32;
            store16(ob, lo);
            store16(ob + 16, hi);
          } else {
            _mm512_storeu_ps(o, lo);
            _mm512_storeu_ps(o + 16, hi);
          }
          continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        // the 32 nibbles as bytes (unpack_block), widened 8 at a time: q * s + off, as the scalar loop computes
        alignas(32) uint8_t qb[32];
        _mm256_store_si256(reinterpret_cast<__m256i*>(qb), unpack_block(q));
        const __m256 vs = _mm256_set1_ps(s), voff = _mm256_set1_ps(off);
        at::BFloat16* ob = out_bf16 ? out_b16 + n * K + b * 32 : nullptr;
        for (int k = 0; k < 32; k += 8) {
          const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + k));
          const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)), vs, voff);
          if (ob != nullptr)
            store8(ob + k, w);
          else
            _mm256_storeu_ps(o + k, w);
        }
        continue;
#else
        for (int k = 0; k < 16; ++k) {
          o[k] = static_cast<float>(q[k] & 0x0F) * s + off;
          o[k + 16] = static_cast<float>(q[k] >> 4) * s + off;
        }
#endif
        if (out_bf16) {
          at::BFloat16* ob = out_b16 + n * K + b * 32;
          for (int k = 0; k < 32; ++k) ob[k] = at::BFloat16(buf[k]);  // rounds to nearest even
        }
      }
  });
  return out;
}
