// Paged decode attention on the CPU: per (sequence, KV head), gather the live blocks, scores, softmax and the
// weighted sum of values in one call that reads the blocks where they lie (kv_blocks.h decodes each layout).
//
// q: (B, nh, hd), already scaled. k_cache, v_cache: (num_blocks, nkv, bs, hd) for one layer. tables: (B, nb)
// live block ids in position order; lengths: (B,) tokens to attend over those blocks (the last block may be
// partly filled). Grouped-query heads of one KV head share one pass over its keys and values. With mass
// (B, nkv, nb) given, each head's attention probabilities are added per block (H2O-style eviction scores).
// All arithmetic is float32; bf16 tensors are widened on load and rounded once on store.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "kv_blocks.h"
#include "simd.h"
#include "thread_team.h"

namespace {

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// A sliding window's first block may start before the window: its first skip positions get no attention
// (their scores -inf, which the softmax turns into 0).
inline void mask_front(float* scores, int64_t g, int64_t len, int64_t skip) {
  for (int64_t j = 0; j < g && skip > 0; ++j)
    std::fill(scores + j * len, scores + j * len + skip, -std::numeric_limits<float>::infinity());
}

#ifdef MCP_ATTN_AVX2
// scores[j * len + t] = q_j . k_t over one block's n rows of hd floats (kb); scores points at the block's first.
inline void score_rows_avx2(const float* qf, const float* kb, int64_t n, int64_t g, int64_t hd, int64_t len,
                            float* scores) {
  for (int64_t j = 0; j < g; ++j) {
    const float* qj = qf + j * hd;
    float* sj = scores + j * len;
    for (int64_t t = 0; t < n; ++t) {
      const float* kr = kb + t * hd;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int64_t c = 0;
      for (; c + 16 <= hd; c += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c), _mm256_loadu_ps(kr + c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c + 8), _mm256_loadu_ps(kr + c + 8), a1);
      }
      if (c < hd) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c), _mm256_loadu_ps(kr + c), a0);
      sj[t] = hsum(_mm256_add_ps(a0, a1));
    }
  }
}

// Each head's len scores -> probabilities, in place; with mass_row, each head's attention per block is added
// (eviction scores: one writer per (sequence, KV head)).
inline void softmax_heads_avx2(float* scores, int64_t g, int64_t len, int64_t bs, float* mass_row) {
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * len;
    __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sj + t));
    float mx = hmax(mv);
    for (; t < len; ++t) mx = std::max(mx, sj[t]);
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= len; t += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sj + t), mxv));
      _mm256_storeu_ps(sj + t, e);
      sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum(sv);
    for (; t < len; ++t) {
      sj[t] = std::exp(sj[t] - mx);
      sum += sj[t];
    }
    const float inv = 1.f / sum;
    const __m256 invv = _mm256_set1_ps(inv);
    for (t = 0; t + 8 <= len; t += 8) _mm256_storeu_ps(sj + t, _mm256_mul_ps(_mm256_loadu_ps(sj + t), invv));
    for (; t < len; ++t) sj[t] *= inv;
    if (mass_row != nullptr)
      for (t = 0; t < len; ++t) mass_row[t / bs] += sj[t];
  }
}

// acc_j += sum_t p_jt v_t over one block's n rows of hd floats (vb), p_jt = probs[j * len + t]; 32 output
// values per pass (four independent FMA chains).
inline void accumulate_rows_avx2(const float* probs, int64_t len, const float* vb, int64_t n, int64_t g,
                                 int64_t hd, float* acc) {
  for (int64_t j = 0; j < g; ++j) {
    const float* pj = probs + j * len;
    float* aj = acc + j * hd;
    int64_t c = 0;
    for (; c + 32 <= hd; c += 32) {
      __m256 r0 = _mm256_loadu_ps(aj + c), r1 = _mm256_loadu_ps(aj + c + 8);
      __m256 r2 = _mm256_loadu_ps(aj + c + 16), r3 = _mm256_loadu_ps(aj + c + 24);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 p = _mm256_set1_ps(pj[t]);
        const float* vr = vb + t * hd + c;
        r0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr), r0);
        r1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8), r1);
        r2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 16), r2);
        r3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 24), r3);
      }
      _mm256_storeu_ps(aj + c, r0);
      _mm256_storeu_ps(aj + c + 8, r1);
      _mm256_storeu_ps(aj + c + 16, r2);
      _mm256_storeu_ps(aj + c + 24, r3);
    }
    for (; c < hd; c += 8) {
      __m256 r0 = _mm256_loadu_ps(aj + c);
      for (int64_t t = 0; t < n; ++t) r0 = _mm256_fmadd_ps(_mm256_set1_ps(pj[t]), _mm256_loadu_ps(vb + t * hd + c), r0);
      _mm256_storeu_ps(aj + c, r0);
    }
  }
}

// One (sequence, KV head): its g query heads over len tokens. hd % 8 == 0.
template <typename KS, typename VS>
void attend_avx2(const float* qf, const KS& ks, const VS& vs, const int64_t* table, int64_t len, int64_t g,
                 int64_t hd, int64_t bs, float* scores, float* acc, float* buf, float* mass_row,
                 int64_t skip) {
  // A block is widened or decoded once and read by all g heads. Blocks lie anywhere in the pool, beyond the
  // hardware prefetcher's reach: the next block's keys are fetched ahead, and this block's values into L2 for
  // the second pass.
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    if (t0 + bs < len) ks.prefetch(table[t0 / bs + 1], std::min(bs, len - t0 - bs), true);
    vs.prefetch(table[t0 / bs], n, false);
    score_rows_avx2(qf, ks.rows(table[t0 / bs], n, buf), n, g, hd, len, scores + t0);
  }
  mask_front(scores, g, len, skip);
  softmax_heads_avx2(scores, g, len, bs, mass_row);
  std::fill(acc, acc + g * hd, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    accumulate_rows_avx2(scores + t0, len, vs.rows(table[t0 / bs], n, buf), n, g, hd, acc);
  }
}

// ---- int4 blocks read in registers, not decoded into a row buffer ------------------------------------
// Keys: k_c = s_c n_c + z_c per channel, so q . k = sum_c (q_c s_c) n_c + q . z. Per block and head the folded
// query q_c s_c is rounded to int16 with one scale (error <= 2^-16 of its largest entry, far below the 4-bit
// codes' own), the codes are widened to int16 and multiplied with madd: exact int32 sums, 16 products an
// instruction, no float rows written and read back. Values: each row is widened and scaled in registers and
// added to all the KV head's query heads at once. Measured (one layer, 4096 tokens, 9 query / 3 KV heads, a
// throwaway micro-benchmark): 325 -> 218 us with the pool in cache; 30 layers' pools in turn (out of cache):
// 12.5 -> ~10 ms per step, int8's 9.9.

// 64 nibble codes (32 packed bytes) as four vectors of 16 int16, channels in order.
inline void unpack_u4x64_i16(const uint8_t* packed, __m256i out[4]) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + 16 * h));
    const __m128i lo = _mm_and_si128(p, low4), hi = _mm_and_si128(_mm_srli_epi16(p, 4), low4);
    out[2 * h] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(lo, hi));
    out[2 * h + 1] = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(lo, hi));
  }
}

// The eight lane sums of v[0..7], in order.
inline __m256i hsum8_epi32(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The first m (<= 8) lanes of v to out.
inline void store_scores(__m256 v, int64_t m, float* out) {
  if (m == 8) {
    _mm256_storeu_ps(out, v);
  } else {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    std::copy(lanes, lanes + m, out);
  }
}

// x (n floats, a multiple of 16) rounded to int16 with one scale, returned: amax / 32767 (0 for all zeros).
inline float round_to_int16(const float* x, int64_t n, int16_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t c = 0; c < n; c += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + c)));
  const float mx = hmax(amax);
  const __m256 inv = _mm256_set1_ps(mx > 0.f ? 32767.f / mx : 0.f);
  for (int64_t c = 0; c < n; c += 16) {  // round to nearest, pack (lane-wise) and put the lanes back in order
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + c), inv));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + c + 8), inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8));
  }
  return mx / 32767.f;
}

// dots[j * 8 + r]: the int32 partial sums of row r (< m <= 8; later rows zero) times head j's int16 query
// (g heads, hd channels each), 64 channels a pass; widen(row, c, out) gives a row's 64 codes from channel c as
// four vectors of 16 int16.
template <typename Widen>
inline void int16_dots_8rows(const uint8_t* first_row, int64_t row_bytes, int64_t m, int64_t hd, int64_t g,
                             const int16_t* q16, __m256i* dots, Widen widen) {
  for (int64_t r = 0; r < 8; ++r) {
    for (int64_t j = 0; j < g; ++j) dots[j * 8 + r] = _mm256_setzero_si256();
    if (r >= m) continue;
    const uint8_t* row = first_row + r * row_bytes;
    for (int64_t c = 0; c < hd; c += 64) {
      __m256i codes[4];
      widen(row, c, codes);
      for (int64_t j = 0; j < g; ++j) {
        const __m256i* qv = reinterpret_cast<const __m256i*>(q16 + j * hd + c);
        const __m256i d01 = _mm256_add_epi32(_mm256_madd_epi16(codes[0], _mm256_loadu_si256(qv)),
                                             _mm256_madd_epi16(codes[1], _mm256_loadu_si256(qv + 1)));
        const __m256i d23 = _mm256_add_epi32(_mm256_madd_epi16(codes[2], _mm256_loadu_si256(qv + 2)),
                                             _mm256_madd_epi16(codes[3], _mm256_loadu_si256(qv + 3)));
        dots[j * 8 + r] = _mm256_add_epi32(dots[j * 8 + r], _mm256_add_epi32(d01, d23));
      }
    }
  }
}

// coded_affines, 8 at a time (float32 products and sums as kv/codecs.py's decode_affine_params).
inline void coded_affines_avx2(const uint8_t* scale_code, const uint8_t* zero_code, const ChunkMeta& m,
                               int64_t count, float* s, float* z) {
  const __m256 ds = _mm256_set1_ps(m.ds), dz = _mm256_set1_ps(m.dz), zmin = _mm256_set1_ps(m.zmin);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const auto codes = [](const uint8_t* p) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    };
    _mm256_storeu_ps(s + i, _mm256_mul_ps(codes(scale_code + i), ds));
    _mm256_storeu_ps(z + i, _mm256_add_ps(zmin, _mm256_mul_ps(codes(zero_code + i), dz)));
  }
  if (i < count) coded_affines(scale_code + i, zero_code + i, m, count - i, s + i, z + i);
}

// Scratch of the integer key paths (int8 and int4), per thread and reused: the vectors grow to the largest
// shapes seen. take() sizes them and returns their data.
struct IntKeyScratch {
  std::vector<float> floats;
  std::vector<int16_t> q16;
  std::vector<__m256i> dots;
  void take(int64_t num_floats, int64_t g, int64_t hd, float** f, int16_t** q, __m256i** d) {
    floats.resize(num_floats);
    q16.resize(g * hd);
    dots.resize(g * 8);
    *f = floats.data();
    *q = q16.data();
    *d = dots.data();
  }
};

thread_local IntKeyScratch int_key_scratch;

// Views of the scratch for one call (plain pointers: __m256i stores may alias anything, so the loops must not
// reach the buffers through a struct they could be reloaded from).
struct Int4Work {
  float *s, *z, *fold, *sq, *cj;  // a key block's affines; per head the folded query, its scale, q . z
  int16_t* q16;                   // per head the folded query in int16
  __m256i* dots;                  // per head, 8 rows' int32 partial sums
  float *gs, *gz;                 // a value block's group affines (bs, ng)
};

// scores[j * len + t] for one coded key block: n rows of hd / 2 packed bytes from qb.
inline void score_int4_keys(const float* qf, const Int4Source& ks, int64_t block, int64_t n, int64_t g,
                            int64_t hd, int64_t len, float* scores, const Int4Work& w) {
  const int64_t chunk = block * ks.nkv + ks.h;
  float *s = w.s, *z = w.z, *fold = w.fold, *sq = w.sq, *cj = w.cj;
  int16_t* q16 = w.q16;
  __m256i* dots = w.dots;
  coded_affines_avx2(ks.scale_code + chunk * hd, ks.zero_code + chunk * hd, ChunkMeta(ks.meta + chunk * 3), hd, s, z);
  for (int64_t j = 0; j < g; ++j) {
    const float* qj = qf + j * hd;
    float* fj = fold + j * hd;
    __m256 qz = _mm256_setzero_ps();
    for (int64_t c = 0; c < hd; c += 8) {
      const __m256 q = _mm256_loadu_ps(qj + c);
      _mm256_storeu_ps(fj + c, _mm256_mul_ps(q, _mm256_loadu_ps(s + c)));
      qz = _mm256_fmadd_ps(q, _mm256_loadu_ps(z + c), qz);
    }
    cj[j] = hsum(qz);
    sq[j] = round_to_int16(fj, hd, q16 + j * hd);
  }
  const uint8_t* qb = ks.q + chunk * ks.bs * (hd / 2);
  const auto widen = [](const uint8_t* row, int64_t c, __m256i out[4]) { unpack_u4x64_i16(row + c / 2, out); };
  for (int64_t r0 = 0; r0 < n; r0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - r0);
    int16_dots_8rows(qb + r0 * (hd / 2), hd / 2, m, hd, g, q16, dots, widen);
    for (int64_t j = 0; j < g; ++j) {
      const __m256 d = _mm256_cvtepi32_ps(hsum8_epi32(dots + j * 8));
      store_scores(_mm256_fmadd_ps(d, _mm256_set1_ps(sq[j]), _mm256_set1_ps(cj[j])), m, scores + j * len + r0);
    }
  }
}

// acc_j += sum_t p_jt v_t for heads j0 .. j0 + G - 1 over one coded value block, 16 channels a pass (one group:
// the group size is a multiple of 16): each row's codes are widened and scaled once, in registers, for all G heads.
template <int G>
inline void accumulate_int4_heads(const uint8_t* qb, int64_t n, int64_t hd, int64_t group, int64_t ng,
                                  const float* gs, const float* gz, const float* probs, int64_t len, int64_t j0,
                                  float* acc) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t c = 0; c < hd; c += 16) {
    const int64_t gi = c / group;
    __m256 a[G][2];
    for (int jj = 0; jj < G; ++jj) {
      a[jj][0] = _mm256_loadu_ps(acc + (j0 + jj) * hd + c);
      a[jj][1] = _mm256_loadu_ps(acc + (j0 + jj) * hd + c + 8);
    }
    for (int64_t t = 0; t < n; ++t) {
      const __m128i p = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + t * (hd / 2) + c / 2));
      const __m128i x = _mm_unpacklo_epi8(_mm_and_si128(p, low4), _mm_and_si128(_mm_srli_epi16(p, 4), low4));
      const __m256 s = _mm256_broadcast_ss(gs + t * ng + gi), z = _mm256_broadcast_ss(gz + t * ng + gi);
      const __m256 v0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)), s, z);
      const __m256 v1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(x, 8))), s, z);
      for (int jj = 0; jj < G; ++jj) {
        const __m256 pv = _mm256_broadcast_ss(probs + (j0 + jj) * len + t);
        a[jj][0] = _mm256_fmadd_ps(pv, v0, a[jj][0]);
        a[jj][1] = _mm256_fmadd_ps(pv, v1, a[jj][1]);
      }
    }
    for (int jj = 0; jj < G; ++jj) {
      _mm256_storeu_ps(acc + (j0 + jj) * hd + c, a[jj][0]);
      _mm256_storeu_ps(acc + (j0 + jj) * hd + c + 8, a[jj][1]);
    }
  }
}

inline void accumulate_int4_values(const float* probs, int64_t len, const Int4Source& vs, int64_t block, int64_t n,
                                   int64_t g, int64_t hd, float* acc, const Int4Work& w) {
  const int64_t chunk = block * vs.nkv + vs.h, ng = vs.ng, bs = vs.bs;
  float *gs = w.gs, *gz = w.gz;
  coded_affines_avx2(vs.scale_code + chunk * bs * ng, vs.zero_code + chunk * bs * ng, ChunkMeta(vs.meta + chunk * 3),
                     n * ng, gs, gz);
  const uint8_t* qb = vs.q + chunk * bs * (hd / 2);
  const int64_t group = hd / ng;
  int64_t j0 = 0;
  for (; j0 + 4 <= g; j0 += 4) accumulate_int4_heads<4>(qb, n, hd, group, ng, gs, gz, probs, len, j0, acc);
  switch (g - j0) {
    case 3: accumulate_int4_heads<3>(qb, n, hd, group, ng, gs, gz, probs, len, j0, acc); break;
    case 2: accumulate_int4_heads<2>(qb, n, hd, group, ng, gs, gz, probs, len, j0, acc); break;
    case 1: accumulate_int4_heads<1>(qb, n, hd, group, ng, gs, gz, probs, len, j0, acc); break;
    default: break;
  }
}

// int4 K and V: coded blocks as above, staged (bf16) ones as any raw rows. Other shapes (head sizes not a
// multiple of 64, value groups not a multiple of 16): the generic loop over decoded rows.
void attend_avx2(const float* qf, const Int4Source& ks, const Int4Source& vs, const int64_t* table, int64_t len,
                 int64_t g, int64_t hd, int64_t bs, float* scores, float* acc, float* buf, float* mass_row,
                 int64_t skip) {
  if (hd % 64 != 0 || ks.ng != 0 || vs.ng < 1 || (hd / vs.ng) % 16 != 0) {
    attend_avx2<Int4Source, Int4Source>(qf, ks, vs, table, len, g, hd, bs, scores, acc, buf, mass_row, skip);
    return;
  }
  const int64_t ng = vs.ng;
  const int64_t sizes[] = {hd, hd, g * hd, g, g, bs * ng, bs * ng};
  int64_t total = 0;
  for (int64_t size : sizes) total += size;
  float* base;
  int16_t* q16;
  __m256i* dots;
  int_key_scratch.take(total, g, hd, &base, &q16, &dots);
  float* f[7];
  for (int i = 0, off = 0; i < 7; off += sizes[i++]) f[i] = base + off;
  const Int4Work w{f[0], f[1], f[2], f[3], f[4], q16, dots, f[5], f[6]};
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0), block = table[t0 / bs];
    if (t0 + bs < len) ks.prefetch(table[t0 / bs + 1], std::min(bs, len - t0 - bs), true);
    vs.prefetch(block, n, false);
    if (ks.staged.has(block))
      score_rows_avx2(qf, ks.rows(block, n, buf), n, g, hd, len, scores + t0);
    else
      score_int4_keys(qf, ks, block, n, g, hd, len, scores + t0, w);
  }
  mask_front(scores, g, len, skip);
  softmax_heads_avx2(scores, g, len, bs, mass_row);
  std::fill(acc, acc + g * hd, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0), block = table[t0 / bs];
    if (vs.staged.has(block))
      accumulate_rows_avx2(scores + t0, len, vs.rows(block, n, buf), n, g, hd, acc);
    else
      accumulate_int4_values(scores + t0, len, vs, block, n, g, hd, acc, w);
  }
}

// ---- int8 keys scored by integer dot products -----------------------------------------------------------
// k_tc = s_t n_tc + z_t per row, so q . k_t = s_t (q . n_t) + z_t sum_c q_c. The query is rounded to int16 once
// per (sequence, KV head), one scale per query head (error <= 2^-16 of its largest entry), and multiplied with
// the widened codes by madd (exact int32 sums while hd <= 128). Values keep the row buffer: widening 8 codes
// and one FMA per 8 values is all the buffer costs there. Measured with the int4 path's micro-benchmark: see
// docs/kv-cache.md.

// 64 uint8 codes as four vectors of 16 int16, channels in order.
inline void widen_u8x64_i16(const uint8_t* codes, __m256i out[4]) {
  for (int i = 0; i < 4; ++i)
    out[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i)));
}

struct Int8Work {
  float *q_scale, *q_sum, *s, *z;  // per head the query's int16 scale and its sum; a block's row affines
  int16_t* q16;                    // per head the query in int16
  __m256i* dots;                   // per head, 8 rows' int32 sums
};

inline void score_int8_keys(const Int8Source& ks, int64_t block, int64_t n, int64_t g, int64_t hd, int64_t len,
                            float* scores, const Int8Work& w) {
  const int64_t chunk = block * ks.nkv + ks.h;
  float *s = w.s, *z = w.z;
  const int16_t* q16 = w.q16;
  __m256i* dots = w.dots;
  halves_to_floats(ks.scale + chunk * ks.bs, n, s);
  halves_to_floats(ks.zero + chunk * ks.bs, n, z);
  const uint8_t* qb = ks.q + chunk * ks.bs * hd;
  const auto widen = [](const uint8_t* row, int64_t c, __m256i out[4]) { widen_u8x64_i16(row + c, out); };
  for (int64_t r0 = 0; r0 < n; r0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - r0);
    int16_dots_8rows(qb + r0 * hd, hd, m, hd, g, q16, dots, widen);
    alignas(32) float sr[8] = {}, zr[8] = {};
    std::copy(s + r0, s + r0 + m, sr);
    std::copy(z + r0, z + r0 + m, zr);
    for (int64_t j = 0; j < g; ++j) {
      const __m256 d = _mm256_cvtepi32_ps(hsum8_epi32(dots + j * 8));
      const __m256 sc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(w.q_scale[j])), _mm256_load_ps(sr),
                                        _mm256_mul_ps(_mm256_load_ps(zr), _mm256_set1_ps(w.q_sum[j])));
      store_scores(sc, m, scores + j * len + r0);
    }
  }
}

// int8 K and V: keys as above (head sizes 64 and 128; others take the generic loop), values through the buffer.
void attend_avx2(const float* qf, const Int8Source& ks, const Int8Source& vs, const int64_t* table, int64_t len,
                 int64_t g, int64_t hd, int64_t bs, float* scores, float* acc, float* buf, float* mass_row,
                 int64_t skip) {
  if (hd % 64 != 0 || hd > 128) {
    attend_avx2<Int8Source, Int8Source>(qf, ks, vs, table, len, g, hd, bs, scores, acc, buf, mass_row, skip);
    return;
  }
  float* f;
  int16_t* q16;
  __m256i* dots;
  int_key_scratch.take(2 * g + 2 * bs, g, hd, &f, &q16, &dots);
  const Int8Work w{f, f + g, f + 2 * g, f + 2 * g + bs, q16, dots};
  for (int64_t j = 0; j < g; ++j) {
    const float* qj = qf + j * hd;
    __m256 sum = _mm256_setzero_ps();
    for (int64_t c = 0; c < hd; c += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(qj + c));
    w.q_sum[j] = hsum(sum);
    w.q_scale[j] = round_to_int16(qj, hd, w.q16 + j * hd);
  }
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    if (t0 + bs < len) ks.prefetch(table[t0 / bs + 1], std::min(bs, len - t0 - bs), true);
    vs.prefetch(table[t0 / bs], n, false);
    score_int8_keys(ks, table[t0 / bs], n, g, hd, len, scores + t0, w);
  }
  mask_front(scores, g, len, skip);
  softmax_heads_avx2(scores, g, len, bs, mass_row);
  std::fill(acc, acc + g * hd, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    accumulate_rows_avx2(scores + t0, len, vs.rows(table[t0 / bs], n, buf), n, g, hd, acc);
  }
}
#endif

// Portable version of the same: one (sequence, KV head).
template <typename KS, typename VS>
void attend_scalar(const float* qf, const KS& ks, const VS& vs, const int64_t* table, int64_t len, int64_t g,
                   int64_t hd, int64_t bs, float* scores, float* acc, float* buf, float* mass_row,
                   int64_t skip) {
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    const float* kb = ks.rows(table[t0 / bs], n, buf);
    for (int64_t t = 0; t < n; ++t) {
      const float* kr = kb + t * hd;
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = qf + j * hd;
        float s = 0.f;
        for (int64_t d = 0; d < hd; ++d) s += qj[d] * kr[d];
        scores[j * len + t0 + t] = s;
      }
    }
  }
  mask_front(scores, g, len, skip);
  for (int64_t j = 0; j < g; ++j) {
    float* sj = scores + j * len;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sj[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sj[t] = std::exp(sj[t] - mx);
      sum += sj[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sj[t] *= inv;
    if (mass_row != nullptr)
      for (int64_t t = 0; t < len; ++t) mass_row[t / bs] += sj[t];
  }
  std::fill(acc, acc + g * hd, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    const float* vb = vs.rows(table[t0 / bs], n, buf);
    for (int64_t t = 0; t < n; ++t) {
      const float* vr = vb + t * hd;
      for (int64_t j = 0; j < g; ++j) {
        const float p = scores[j * len + t0 + t];
        float* aj = acc + j * hd;
        for (int64_t d = 0; d < hd; ++d) aj[d] += p * vr[d];
      }
    }
  }
}

}  // namespace

// The AVX-512 BF16 path for bf16 blocks (it uses mask_front and softmax_heads_avx2 above).
#include "attention_bf16.h"

namespace {

// Whether the AVX-512 BF16 path takes these queries and sources: bf16 queries over bf16 blocks (a float query
// would be rounded to bf16 there).
template <typename T, typename KS, typename VS>
constexpr bool bf16_blocks() {
  return std::is_same_v<T, at::BFloat16> && std::is_same_v<KS, RawSource<at::BFloat16>> &&
         std::is_same_v<VS, RawSource<at::BFloat16>>;
}

// One (sequence, KV head)'s query heads j0 .. j0 + g - 1 (of the head's nh / nkv): their queries in, their
// outputs out. A query head's result does not depend on which other heads of its KV head are computed beside it.
template <typename T, typename KS, typename VS>
void attend_heads(const T* q, const KS& ks, const VS& vs, const int64_t* table, int64_t len, int64_t first_head,
                  int64_t g, int64_t hd, int64_t bs, float* scores, float* qf, float* acc, float* buf,
                  float* mass_row, int64_t skip, T* out) {
  for (int64_t j = 0; j < g; ++j)
    for (int64_t d = 0; d < hd; ++d) qf[j * hd + d] = load(q, (first_head + j) * hd + d);
  bool done = false;
#ifdef MCP_ATTN_BF16
  if constexpr (bf16_blocks<T, KS, VS>()) {
    if (bf16_attention_fits(g, hd)) {
      attend_bf16(qf, ks, vs, table, len, g, hd, bs, scores, acc, mass_row, skip);
      done = true;
    }
  }
#endif
#ifdef MCP_ATTN_AVX2
  if (!done && hd % 8 == 0) {
    attend_avx2(qf, ks, vs, table, len, g, hd, bs, scores, acc, buf, mass_row, skip);
    done = true;
  }
#endif
  if (!done) attend_scalar(qf, ks, vs, table, len, g, hd, bs, scores, acc, buf, mass_row, skip);
  for (int64_t j = 0; j < g; ++j)
    for (int64_t d = 0; d < hd; ++d) out[(first_head + j) * hd + d] = static_cast<T>(acc[j * hd + d]);
}

// Every (sequence, KV head) of a decode batch; sources(h) gives that KV head's (key, value) sources. starts
// (a sliding window's first position per sequence, or null: 0): the blocks before the one holding it are not
// read, and its positions before it get no attention.
template <typename T, typename Sources>
void decode_attention_run(const T* q, const int64_t* tables, const int64_t* lengths, T* out, float* mass,
                          int64_t B, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, int64_t nb, int64_t max_len,
                          const Sources& sources, const int64_t* starts = nullptr) {
  const int64_t g = nh / nkv;
  // Threads take (sequence, KV head) pairs: a unit of g query heads. With fewer pairs than two per thread (a
  // batch-1 step: 3 KV heads on 2 threads is 2 : 1) they take single query heads instead, a KV head whose heads
  // land on two threads being read by both; with attention mass recorded (eviction scores) each KV head's row
  // stays on one thread.
  const int64_t threads = team::current != nullptr ? team::current->size : at::get_num_threads();
  const int64_t unit = (mass == nullptr && B * nkv < 2 * threads) ? 1 : g;
  // Small problems run inline: handing out work costs more than it saves. Inside a decode stack's thread team a
  // hand-off is a spinning handshake, not an OpenMP fork and join, so far smaller problems are worth splitting.
  const int64_t min_task = team::current != nullptr ? (1 << 12) : (1 << 16);
  const int64_t grain = std::max<int64_t>(1, min_task / std::max<int64_t>(1, max_len * hd * unit));
  team::parallel_for(0, B * nh / unit, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g * max_len), qf(g * hd), acc(g * hd), buf(bs * hd);
    for (int64_t head = begin * unit; head < end * unit;) {  // query heads, a KV head's run at a time
      const int64_t b = head / nh, h = (head % nh) / g, j0 = head % g;
      const int64_t heads = std::min(g - j0, end * unit - head);
      float* mass_row = mass == nullptr ? nullptr : mass + (b * nkv + h) * nb;
      const auto src = sources(h);
      const int64_t first_block = starts == nullptr ? 0 : starts[b] / bs;
      const int64_t skip = starts == nullptr ? 0 : starts[b] - first_block * bs;
      attend_heads(q + b * nh * hd, src.first, src.second, tables + b * nb + first_block,
                   lengths[b] - first_block * bs, h * g + j0, heads, hd, bs, scores.data(), qf.data(), acc.data(),
                   buf.data(), mass_row, skip, out + b * nh * hd);
      head += heads;
    }
  });
}

// Checks shared by both bindings; returns max_len. num_ids: the ids a table may name.
int64_t check_decode_batch(const torch::Tensor& tc, const torch::Tensor& lc, int64_t B, int64_t bs, int64_t num_ids) {
  TORCH_CHECK(tc.scalar_type() == torch::kLong && lc.scalar_type() == torch::kLong, "tables and lengths must be int64");
  TORCH_CHECK(tc.dim() == 2 && tc.size(0) == B && lc.size(0) == B, "tables/lengths need one row per sequence");
  const int64_t nb = tc.size(1);
  const int64_t* lp = lc.data_ptr<int64_t>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= nb * bs, "length out of range for the block table");
    for (int64_t i = 0; i < (lp[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tp[b * nb + i] >= 0 && tp[b * nb + i] < num_ids, "block id out of range");
    max_len = std::max(max_len, lp[b]);
  }
  return max_len;
}

float* check_mass(const c10::optional<torch::Tensor>& mass, int64_t B, int64_t nkv, int64_t nb) {
  if (!mass.has_value()) return nullptr;
  TORCH_CHECK(mass->scalar_type() == torch::kFloat && mass->is_contiguous() && mass->dim() == 3 &&
                  mass->size(0) == B && mass->size(1) == nkv && mass->size(2) == nb,
              "mass must be a contiguous float32 (B, nkv, nb) tensor");
  return mass->data_ptr<float>();
}

// starts (B,) int64, each 0 <= start < its length, or none; a window ranks no blocks for eviction.
const int64_t* check_starts(const c10::optional<torch::Tensor>& starts, const torch::Tensor& lc, int64_t B,
                            bool with_mass) {
  if (!starts.has_value()) return nullptr;
  TORCH_CHECK(!with_mass, "a sliding window's starts and attention mass (eviction scores) do not combine");
  TORCH_CHECK(starts->scalar_type() == torch::kLong && starts->is_contiguous() && starts->dim() == 1 &&
                  starts->size(0) == B,
              "starts must be a contiguous int64 (B,) tensor");
  const int64_t* sp = starts->data_ptr<int64_t>();
  const int64_t* lp = lc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sp[b] >= 0 && sp[b] < lp[b], "a window start must lie before its length");
  return sp;
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& tables,
                                     const torch::Tensor& lengths, const c10::optional<torch::Tensor>& mass,
                                     const c10::optional<torch::Tensor>& starts) {
  return paged_decode_attention_into(q, k_cache, v_cache, tables, lengths, mass, nullptr, starts);
}

torch::Tensor paged_decode_attention_into(const torch::Tensor& q, const torch::Tensor& k_cache,
                                          const torch::Tensor& v_cache, const torch::Tensor& tables,
                                          const torch::Tensor& lengths, const c10::optional<torch::Tensor>& mass,
                                          torch::Tensor* slot, const c10::optional<torch::Tensor>& starts) {
  check_cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "q must be (B, nh, hd), caches 4-D");
  // The caches may be narrower than q (bf16 / fp16 K/V with fp32 activations: half the bytes to read, the
  // decode step's dominant traffic at long contexts) or wider (fp32 K/V with bf16 activations); values are
  // read as float either way.
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat || k_cache.scalar_type() == torch::kBFloat16 ||
                  k_cache.scalar_type() == torch::kHalf,
              "the caches must be float32, bfloat16 or float16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous and of one shape");
  const auto qc = q.contiguous();
  const auto tc = tables.contiguous();
  const auto lc = lengths.contiguous();
  const int64_t B = qc.size(0), nh = qc.size(1), hd = qc.size(2);
  const int64_t nkv = k_cache.size(1), bs = k_cache.size(2), nb = tc.size(1);
  TORCH_CHECK(k_cache.size(3) == hd && nh % nkv == 0, "head sizes do not match");
  const int64_t max_len = check_decode_batch(tc, lc, B, bs, k_cache.size(0));
  float* mp = check_mass(mass, B, nkv, nb);
  const int64_t* sp = check_starts(starts, lc, B, mp != nullptr);
  auto out = slot_or_empty(slot, qc.sizes(), qc.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, qc.scalar_type(), "paged_decode_attention", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, k_cache.scalar_type(),
                                    "paged_decode_attention_kv", [&] {
      using KV = scalar_t;
      const KV* kp = k_cache.data_ptr<KV>();
      const KV* vp = v_cache.data_ptr<KV>();
      const int64_t block_stride = nkv * bs * hd;
      auto sources = [&](int64_t h) {
        return std::make_pair(RawSource<KV>{kp, h * bs * hd, block_stride, hd},
                              RawSource<KV>{vp, h * bs * hd, block_stride, hd});
      };
      decode_attention_run<T>(qc.data_ptr<T>(), tc.data_ptr<int64_t>(), lc.data_ptr<int64_t>(), out.data_ptr<T>(),
                              mp, B, nh, nkv, hd, bs, nb, max_len, sources, sp);
    });
  });
  return out;
}

// Decode attention straight from a quantized pool: kind 1 = int8 per (token, head) K and V (planes q, scale,
// zero), kind 2 = int4 KIVI (keys q, per-channel scale and zero codes, meta; values q, per-(token, group)
// codes, meta), kind 3 = fp8 e4m3 per (token, head) (planes q, scale). int4's staged blocks (ids >= num_blocks)
// come from stage_k / stage_v, bf16 (entries, nkv, bs, hd).
// Decoding a block costs about what widening a bf16 one does, and reads 2-4x fewer bytes.
torch::Tensor paged_decode_attention_quantized(const torch::Tensor& q, int64_t kind, const std::vector<torch::Tensor>& kp,
                                               const std::vector<torch::Tensor>& vp, const torch::Tensor& stage_k,
                                               const torch::Tensor& stage_v, const torch::Tensor& tables,
                                               const torch::Tensor& lengths, const c10::optional<torch::Tensor>& mass) {
  check_cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 3, "q must be (B, nh, hd)");
  TORCH_CHECK(kind >= 1 && kind <= 3, "kind must be 1 (int8), 2 (int4) or 3 (fp8)");
  const size_t num_planes = kind == 1 ? 3 : kind == 2 ? 4 : 2;
  TORCH_CHECK(kp.size() == num_planes && vp.size() == num_planes, "kind ", kind, " takes ", num_planes,
              " planes for K and for V");
  for (const auto* planes : {&kp, &vp})
    for (const auto& p : *planes) TORCH_CHECK(p.device().is_cpu() && p.is_contiguous(), "planes must be contiguous CPU tensors");
  const auto qc = q.contiguous();
  const auto tc = tables.contiguous();
  const auto lc = lengths.contiguous();
  const int64_t B = qc.size(0), nh = qc.size(1), hd = qc.size(2);
  TORCH_CHECK(kp[0].dim() == 4 && kp[0].sizes() == vp[0].sizes(), "K and V data planes must be (num_blocks, nkv, bs, *)");
  const int64_t num_blocks = kp[0].size(0), nkv = kp[0].size(1), bs = kp[0].size(2), nb = tc.size(1);
  TORCH_CHECK(nh % nkv == 0, "query heads must be a multiple of KV heads");
  const auto data_type = kind == 3 ? at::ScalarType::Float8_e4m3fn : torch::kByte;
  TORCH_CHECK(kp[0].scalar_type() == data_type && vp[0].scalar_type() == data_type,
              "data planes must be uint8 (int8, int4) or float8_e4m3fn (fp8)");
  TORCH_CHECK(kp[0].size(3) == (kind == 2 ? hd / 2 : hd) && (kind != 2 || hd % 2 == 0), "head sizes do not match");
  int64_t num_stage = 0;
  if (stage_k.numel() > 0) {
    TORCH_CHECK(stage_k.scalar_type() == torch::kBFloat16 && stage_v.scalar_type() == torch::kBFloat16 &&
                    stage_k.is_contiguous() && stage_v.is_contiguous() && stage_k.sizes() == stage_v.sizes() &&
                    stage_k.dim() == 4 && stage_k.size(1) == nkv && stage_k.size(2) == bs && stage_k.size(3) == hd,
                "stage_k / stage_v must be contiguous bf16 (entries, nkv, bs, hd)");
    num_stage = stage_k.size(0);
  }
  const int64_t max_len = check_decode_batch(tc, lc, B, bs, num_blocks + num_stage);
  float* mp = check_mass(mass, B, nkv, nb);
  const at::BFloat16* skp = num_stage ? stage_k.data_ptr<at::BFloat16>() : nullptr;
  const at::BFloat16* svp = num_stage ? stage_v.data_ptr<at::BFloat16>() : nullptr;
  auto staged = [&](const at::BFloat16* base, int64_t h) {
    return StagedRows{RawSource<at::BFloat16>{base, h * bs * hd, nkv * bs * hd, hd}, num_blocks};
  };
  auto out = torch::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, qc.scalar_type(), "paged_decode_attention_quantized", [&] {
    using T = scalar_t;
    TORCH_CHECK(kind == 2 || num_stage == 0, "only int4 is a staged codec");
    if (kind == 1) {
      for (const auto* planes : {&kp, &vp})
        TORCH_CHECK((*planes)[1].scalar_type() == torch::kHalf && (*planes)[2].scalar_type() == torch::kHalf &&
                        (*planes)[1].numel() == num_blocks * nkv * bs && (*planes)[2].numel() == num_blocks * nkv * bs,
                    "int8 scale and zero planes must be fp16 (num_blocks, nkv, bs)");
      auto sources = [&](int64_t h) {
        return std::make_pair(
            Int8Source{kp[0].data_ptr<uint8_t>(), kp[1].data_ptr<at::Half>(), kp[2].data_ptr<at::Half>(), nkv, h, bs,
                       hd},
            Int8Source{vp[0].data_ptr<uint8_t>(), vp[1].data_ptr<at::Half>(), vp[2].data_ptr<at::Half>(), nkv, h, bs,
                       hd});
      };
      decode_attention_run<T>(qc.data_ptr<T>(), tc.data_ptr<int64_t>(), lc.data_ptr<int64_t>(), out.data_ptr<T>(),
                              mp, B, nh, nkv, hd, bs, nb, max_len, sources);
    } else if (kind == 3) {
      for (const auto* planes : {&kp, &vp})
        TORCH_CHECK((*planes)[1].scalar_type() == torch::kHalf && (*planes)[1].numel() == num_blocks * nkv * bs,
                    "fp8 scale planes must be fp16 (num_blocks, nkv, bs)");
      auto sources = [&](int64_t h) {
        return std::make_pair(
            Fp8Source{static_cast<const uint8_t*>(kp[0].data_ptr()), kp[1].data_ptr<at::Half>(), nkv, h, bs, hd},
            Fp8Source{static_cast<const uint8_t*>(vp[0].data_ptr()), vp[1].data_ptr<at::Half>(), nkv, h, bs, hd});
      };
      decode_attention_run<T>(qc.data_ptr<T>(), tc.data_ptr<int64_t>(), lc.data_ptr<int64_t>(), out.data_ptr<T>(),
                              mp, B, nh, nkv, hd, bs, nb, max_len, sources);
    } else {
      const int64_t ng = vp[1].numel() / std::max<int64_t>(1, num_blocks * nkv * bs);
      TORCH_CHECK(kp[1].numel() == num_blocks * nkv * hd && kp[2].numel() == kp[1].numel(),
                  "int4 key codes must be (num_blocks, nkv, hd)");
      TORCH_CHECK(ng >= 1 && ng <= 64 && hd % ng == 0 && vp[1].numel() == num_blocks * nkv * bs * ng &&
                      vp[2].numel() == vp[1].numel(),
                  "int4 value codes must be (num_blocks, nkv, bs, groups), at most 64 groups");
      for (const auto* planes : {&kp, &vp})
        TORCH_CHECK((*planes)[1].scalar_type() == torch::kByte && (*planes)[2].scalar_type() == torch::kByte &&
                        (*planes)[3].scalar_type() == torch::kHalf && (*planes)[3].numel() == num_blocks * nkv * 3,
                    "int4 codes must be uint8 and meta fp16 (num_blocks, nkv, 3)");
      auto sources = [&](int64_t h) {
        return std::make_pair(
            Int4Source{kp[0].data_ptr<uint8_t>(), kp[1].data_ptr<uint8_t>(), kp[2].data_ptr<uint8_t>(),
                       kp[3].data_ptr<at::Half>(), nkv, h, bs, hd, 0, staged(skp, h), {}},
            Int4Source{vp[0].data_ptr<uint8_t>(), vp[1].data_ptr<uint8_t>(), vp[2].data_ptr<uint8_t>(),
                       vp[3].data_ptr<at::Half>(), nkv, h, bs, hd, ng, staged(svp, h), {}});
      };
      decode_attention_run<T>(qc.data_ptr<T>(), tc.data_ptr<int64_t>(), lc.data_ptr<int64_t>(), out.data_ptr<T>(),
                              mp, B, nh, nkv, hd, bs, nb, max_len, sources);
    }
  });
  return out;
}
