// Activations quantized to int8 per 32-value block (llama.cpp's Q8 scheme), shared by the int4 GEMV
// (gemv.cpp) and the int4 GEMM (int4_gemm.cpp): both compute from the same quantized rows, so a prefill
// chunk and a decode step see the same activation rounding.
#pragma once

#include <torch/extension.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "thread_team.h"

namespace {

// AVX-512 VNNI (dpbusd: 64 u8 x s8 products summed in fours into int32 lanes, one instruction) takes two
// blocks per multiply-add where AVX2 needs three instructions per block. Measured on an AMX Xeon (2 threads,
// the int4 serving config, whole decode steps at ~550 tokens of context, throwaway script, before / after):
// 12.7 / 9.6 ms at one sequence, 30.5 / 22.5 ms at four.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define MCP_INT4_VNNI 1
#endif

struct QuantizedRows {
  std::vector<int8_t> q;      // (M, K)
  std::vector<float> scale;   // (M, K/32): dx
  std::vector<float> sum;     // (M, K/32): dx * sum of the quantized x over the block
  std::vector<float> scale8;  // (M, K/4): each block's dx 8 times, one per int32 lane of dpbusd (VNNI only)
};

// Rows r0.. of a QuantizedRows (one row tile).
struct RowsView {
  const int8_t* q;
  const float* scale;
  const float* sum;
  const float* scale8;
};

inline RowsView rows_from(const QuantizedRows& r, int64_t r0, int64_t K) {
  return {r.q.data() + r0 * K, r.scale.data() + r0 * (K / 32), r.sum.data() + r0 * (K / 32),
          r.scale8.empty() ? nullptr : r.scale8.data() + r0 * (K / 4)};
}

#ifdef MCP_INT4_VNNI
// A 32-value block's int8 step dx = max |x| / 127 (returned) and 1 / dx in every lane (0 for a zero block):
// every VNNI path rounds a block's first int8 plane from these, as the scalar loop below does.
inline float block_step(__m512 a, __m512 b, __m512* inv) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float dx = amax / 127.f;
  *inv = _mm512_set1_ps(dx > 0.f ? 1.f / dx : 0.f);
  return dx;
}

// One fp32 block as the scalar loop below quantizes it, bit for bit: the max of |x| is exact, x * inv is the same
// IEEE product, and the conversion rounds to nearest even as nearbyint does in the default rounding mode.
inline void quantize_block_avx512(const float* xb, int8_t* qb, float* dx_out, int32_t* qsum_out) {
  const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
  __m512 inv;
  const float dx = block_step(a, b, &inv);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb16 = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(qb16));
  *dx_out = dx;
  *qsum_out = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb16));
}
#endif

// x's M rows quantized into r, whose vectors keep their capacity from call to call (thread_rows below).
template <typename T>
void quantize_rows_into(QuantizedRows& r, const T* x, int64_t M, int64_t K) {
  const int64_t nblk = K / 32;
  r.q.resize(M * K);
  r.scale.resize(M * nblk);
  r.sum.resize(M * nblk);
#ifdef MCP_INT4_VNNI
  r.scale8.resize(M * nblk * 8);
#endif
  // Rows split across threads from 8192 values a share (a batched decode step's 32 rows; one row stays on the
  // calling thread): each row's blocks are quantized alike either way.
  team::parallel_for(0, M, std::max<int64_t>(1, 8192 / std::max<int64_t>(K, 1)), [&](int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t b = 0; b < nblk; ++b) {
      const T* xb = x + i * K + b * 32;
#ifdef MCP_INT4_VNNI
      float* s8 = r.scale8.data() + (i * nblk + b) * 8;
      if constexpr (std::is_same_v<T, float>) {
        int32_t qsum;
        quantize_block_avx512(xb, r.q.data() + i * K + b * 32, &r.scale[i * nblk + b], &qsum);
        r.sum[i * nblk + b] = r.scale[i * nblk + b] * static_cast<float>(qsum);
        std::fill(s8, s8 + 8, r.scale[i * nblk + b]);
        continue;
      }
#endif
      float amax = 0.f;
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(static_cast<float>(xb[k])));
      const float dx = amax / 127.f;
      const float inv = dx > 0.f ? 1.f / dx : 0.f;
      int8_t* qb = r.q.data() + i * K + b * 32;
      int32_t qsum = 0;
      for (int k = 0; k < 32; ++k) {
        qb[k] = static_cast<int8_t>(std::nearbyint(static_cast<float>(xb[k]) * inv));
        qsum += qb[k];
      }
      r.scale[i * nblk + b] = dx;
      // The offset term uses the quantized x too: the activation error then enters as w * (xq - x), smaller
      // than d * q * (xq - x) plus an exact offset * sum(x) (measured: 0.55% vs 0.9% relative output error).
      r.sum[i * nblk + b] = dx * static_cast<float>(qsum);
#ifdef MCP_INT4_VNNI
      std::fill(s8, s8 + 8, dx);
#endif
    }
  });
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t M, int64_t K) {
  QuantizedRows r;
  quantize_rows_into(r, x, M, K);
  return r;
}

// The calling thread's rows for quantize_rows_into, kept between calls (no allocations in a decode step). A GEMM
// takes this reference on its calling thread and its parallel loop uses the reference: a lambda that named a
// thread_local itself would read each worker thread's own copy.
inline QuantizedRows& thread_rows() {
  thread_local QuantizedRows rows;
  return rows;
}

}  // namespace
