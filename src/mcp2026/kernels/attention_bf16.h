// Paged decode attention over bf16 K/V blocks read in place with AVX-512 BF16 (decode_attention.cpp calls it
// for bf16 queries over a bf16 cache, the default serving layout).
//
// Scores: the query (bf16 already: rounding it back from the float it was widened to is exact) is dotted with
// each key row by VDPBF16PS, 32 channels an instruction, straight from the block: no widened copy of the keys,
// and the 16 rows of a pass are summed across lanes together (lane_sums16), not one horizontal sum per row.
// Products of two bf16 values are exact in float32 and the sums are float32, as on the AVX2 path; only the
// order of the additions differs (and float32 denormals are flushed by the instruction).
// Values: each row is widened in registers once and added, scaled by its probability, to all the KV head's
// query heads at once, their accumulators held in registers across the block.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "kv_blocks.h"
#include "simd.h"

namespace {

#if defined(MCP_ATTN_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define MCP_ATTN_BF16 1

constexpr int64_t kBf16MaxHeadDim = 256;
constexpr int64_t kBf16MaxGroup = 8;

// Lane r of the result: the sum of the 16 lanes of a[r].
inline __m512 lane_sums16(const __m512* a) {
  __m512 e[4];  // e[k]'s 128-bit lane L: rows 4k .. 4k + 3, each summed over its lane L
  for (int k = 0; k < 4; ++k) {
    const __m512* x = a + 4 * k;
    const __m512 c = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 d = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    const __m512d cd = _mm512_castps_pd(c), dd = _mm512_castps_pd(d);
    e[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(cd, dd)), _mm512_castpd_ps(_mm512_unpackhi_pd(cd, dd)));
  }
  const __m512 g01 = _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(e[0], e[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 g23 = _mm512_add_ps(_mm512_shuffle_f32x4(e[2], e[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(e[2], e[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(g01, g23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(g01, g23, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512bh load_bf16x32(const at::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// scores[j * len + t] = q_j . k_t over one block's n key rows (kb, hd bf16 each, hd % 32 == 0), 16 rows a pass.
// The rows are the inner loop: 16 independent sums, so the dot products overlap instead of each row waiting on
// its own chain of VDPBF16PS (each row's sum still adds its 32-channel pieces in channel order).
inline void score_block_bf16(const __m512bh* qv, const at::BFloat16* kb, int64_t n, int64_t g, int64_t hd,
                             int64_t len, float* scores) {
  const int64_t nc = hd / 32;
  for (int64_t r0 = 0; r0 < n; r0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - r0);
    const at::BFloat16* rows = kb + r0 * hd;
    for (int64_t j = 0; j < g; ++j) {
      __m512 a[16];
      for (int r = 0; r < 16; ++r) a[r] = _mm512_setzero_ps();
      if (m == 16) {
        for (int64_t c = 0; c < nc; ++c) {
          const __m512bh qc = qv[j * nc + c];
          for (int r = 0; r < 16; ++r) a[r] = _mm512_dpbf16_ps(a[r], qc, load_bf16x32(rows + r * hd + 32 * c));
        }
      } else {
        for (int64_t c = 0; c < nc; ++c)
          for (int64_t r = 0; r < m; ++r)
            a[r] = _mm512_dpbf16_ps(a[r], qv[j * nc + c], load_bf16x32(rows + r * hd + 32 * c));
      }
      _mm512_mask_storeu_ps(scores + j * len + r0, static_cast<__mmask16>((1u << m) - 1), lane_sums16(a));
    }
  }
}

// acc_j += sum_t p_jt v_t for G heads over one block's n value rows, 16 * CH channels a pass: each row's
// values are widened once and added to all G heads' accumulators, which stay in registers for the block.
template <int G, int CH>
inline void accumulate_block_bf16(const float* probs, int64_t len, const at::BFloat16* vb, int64_t n, int64_t hd,
                                  float* acc) {
  for (int64_t c0 = 0; c0 < hd; c0 += 16 * CH) {
    __m512 r[G][CH];
    for (int j = 0; j < G; ++j)
      for (int k = 0; k < CH; ++k) r[j][k] = _mm512_loadu_ps(acc + j * hd + c0 + 16 * k);
    for (int64_t t = 0; t < n; ++t) {
      __m512 v[CH];
      for (int k = 0; k < CH; ++k) v[k] = bf16x16_to_float(vb + t * hd + c0 + 16 * k);
      for (int j = 0; j < G; ++j) {
        const __m512 p = _mm512_set1_ps(probs[j * len + t]);
        for (int k = 0; k < CH; ++k) r[j][k] = _mm512_fmadd_ps(p, v[k], r[j][k]);
      }
    }
    for (int j = 0; j < G; ++j)
      for (int k = 0; k < CH; ++k) _mm512_storeu_ps(acc + j * hd + c0 + 16 * k, r[j][k]);
  }
}

template <int G>
inline void accumulate_bf16(const float* probs, int64_t len, const RawSource<at::BFloat16>& vs,
                            const int64_t* table, int64_t hd, int64_t bs, float* acc) {
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    if (t0 + bs < len) vs.prefetch(table[t0 / bs + 1], std::min(bs, len - t0 - bs), false);
    const at::BFloat16* vb = vs.at(table[t0 / bs]);
    if (G <= 6 && hd % 64 == 0)  // 4 vectors of each head's channels a pass: up to 24 accumulators
      accumulate_block_bf16<G, 4>(probs + t0, len, vb, n, hd, acc);
    else
      accumulate_block_bf16<G, 2>(probs + t0, len, vb, n, hd, acc);
  }
}

// Whether attend_bf16 takes a (sequence, KV head) of g query heads of hd channels.
inline bool bf16_attention_fits(int64_t g, int64_t hd) {
  return hd % 32 == 0 && hd <= kBf16MaxHeadDim && g >= 1 && g <= kBf16MaxGroup;
}

// One (sequence, KV head): its g query heads (qf: floats that are bf16 values) over len tokens of bf16 blocks;
// the same contract as attend_avx2 (scores: g * len floats, acc: g * hd, taps and skip likewise).
inline void attend_bf16(const float* qf, const RawSource<at::BFloat16>& ks, const RawSource<at::BFloat16>& vs,
                        const int64_t* table, int64_t len, int64_t g, int64_t hd, int64_t bs, float* scores,
                        float* acc, const SoftmaxTaps& taps, int64_t skip) {
  __m512bh qv[kBf16MaxGroup * kBf16MaxHeadDim / 32];
  const int64_t nc = hd / 32;
  for (int64_t j = 0; j < g; ++j)
    for (int64_t c = 0; c < nc; ++c) {
      const float* q = qf + j * hd + 32 * c;
      qv[j * nc + c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q));
    }
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    prefetch_key_pass(ks, vs, table, t0, len, bs);
    score_block_bf16(qv, ks.at(table[t0 / bs]), n, g, hd, len, scores + t0);
  }
  mask_front(scores, g, len, skip);
  softmax_heads_avx2(scores, g, len, bs, taps);
  std::fill(acc, acc + g * hd, 0.f);
  switch (g) {
    case 1: accumulate_bf16<1>(scores, len, vs, table, hd, bs, acc); break;
    case 2: accumulate_bf16<2>(scores, len, vs, table, hd, bs, acc); break;
    case 3: accumulate_bf16<3>(scores, len, vs, table, hd, bs, acc); break;
    case 4: accumulate_bf16<4>(scores, len, vs, table, hd, bs, acc); break;
    case 5: accumulate_bf16<5>(scores, len, vs, table, hd, bs, acc); break;
    case 6: accumulate_bf16<6>(scores, len, vs, table, hd, bs, acc); break;
    case 7: accumulate_bf16<7>(scores, len, vs, table, hd, bs, acc); break;
    default: accumulate_bf16<8>(scores, len, vs, table, hd, bs, acc); break;
  }
}

#endif  // AVX-512 BF16

}  // namespace
