// Paged decode attention over integer-coded blocks read in place (decode_attention.cpp includes it for the
// int4 and int8 pools): int4 keys and values widened in registers, int8 keys scored by integer dot products. It
// uses that file's generic AVX2 loops (attend_avx2, score_rows_avx2, softmax_heads_avx2, accumulate_rows_avx2,
// softmax_then_row_values_avx2) for the shapes and staged blocks it does not take.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kv_blocks.h"
#include "simd.h"

namespace {

#ifdef MCP_ATTN_AVX2
// ---- int4 blocks read in registers, not decoded into a row buffer ------------------------------------
// Keys: k_c = s_c n_c + z_c per channel, so q . k = sum_c (q_c s_c) n_c + q . z. Per block and head the folded
// query q_c s_c is rounded to int16 with one scale (error <= 2^-16 of its largest entry, far below the 4-bit
// codes' own), the codes are widened to int16 and multiplied with madd: exact int32 sums, 16 products an
// instruction, no float rows written and read back. Values: each row is widened and scaled in registers and
// added to all the KV head's query heads at once.

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
                 int64_t g, int64_t hd, int64_t bs, float* scores, float* acc, float* buf, const SoftmaxTaps& taps,
                 int64_t skip) {
  if (hd % 64 != 0 || ks.ng != 0 || vs.ng < 1 || (hd / vs.ng) % 16 != 0) {
    attend_avx2<Int4Source, Int4Source>(qf, ks, vs, table, len, g, hd, bs, scores, acc, buf, taps, skip);
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
    prefetch_key_pass(ks, vs, table, t0, len, bs);
    if (ks.staged.has(block))
      score_rows_avx2(qf, ks.rows(block, n, buf), n, g, hd, len, scores + t0);
    else
      score_int4_keys(qf, ks, block, n, g, hd, len, scores + t0, w);
  }
  mask_front(scores, g, len, skip);
  softmax_heads_avx2(scores, g, len, bs, taps);
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
// and one FMA per 8 values is all the buffer costs there.

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
                 int64_t g, int64_t hd, int64_t bs, float* scores, float* acc, float* buf, const SoftmaxTaps& taps,
                 int64_t skip) {
  if (hd % 64 != 0 || hd > 128) {
    attend_avx2<Int8Source, Int8Source>(qf, ks, vs, table, len, g, hd, bs, scores, acc, buf, taps, skip);
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
    prefetch_key_pass(ks, vs, table, t0, len, bs);
    score_int8_keys(ks, table[t0 / bs], n, g, hd, len, scores + t0, w);
  }
  softmax_then_row_values_avx2(scores, vs, table, len, g, hd, bs, acc, buf, taps, skip);
}

#endif  // MCP_ATTN_AVX2

}  // namespace
