// Fused CPU kernels for the decode step (built once per machine by mcp2026.kernels.cpu; see there).
//
// A batch-1 decode step of a small model is dominated by op count, not arithmetic: every torch op costs a few
// microseconds to dispatch, and a layer ran ~40 of them. These kernels replace the elementwise chains
// (residual add + RMSNorm, RoPE, SiLU * up) with one call each, and the paged decode attention (gather the
// live blocks, scores, softmax, weighted sum) with one call that reads the blocks where they lie.
// All arithmetic is float32; bf16 tensors are widened on load and rounded once on store.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quantize_rows.h"

namespace {

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

#if defined(__AVX2__)
// Eight bf16 values as floats: a bf16 is the high half of its float.
inline __m256 bf16x8_to_float(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

void check_cpu_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// ---- paged decode attention --------------------------------------------------------------------------
// q: (B, nh, hd), already scaled. k_cache, v_cache: (num_blocks, nkv, bs, hd) for one layer. tables: (B, nb)
// live block ids in position order; lengths: (B,) tokens to attend over those blocks (the last block may be
// partly filled). Grouped-query heads of one KV head share one pass over its keys and values. With mass
// (B, nkv, nb) given, each head's attention probabilities are added per block (H2O-style eviction scores).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MCP_ATTN_AVX2 1

inline float attn_hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline float attn_hmax(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// e^x for x <= 0 (softmax after subtracting the max): Cephes' expf scheme, x = n ln2 + r, e^r by a degree-6
// polynomial, 2^n through the exponent bits. Relative error ~2e-7; inputs below -87 give 0 (as e^x underflows).
inline __m256 attn_exp(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 is_tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(is_tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// n rows of hd values from the cache as floats: fp32 rows are used where they lie, 16-bit rows widened into buf.
template <typename KV>
inline const float* attn_rows(const KV* src, int64_t count, float* buf) {
  if constexpr (std::is_same_v<KV, float>) {
    return src;
  } else {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
      if constexpr (std::is_same_v<KV, at::BFloat16>)
        _mm256_storeu_ps(buf + i, bf16x8_to_float(src + i));
      else
        _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    }
    for (; i < count; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}
#endif

// ---- block sources: where the attention loops get one (block, KV head)'s rows as floats --------------------
// rows(block, n, buf) returns n rows of hd floats (in place or decoded into buf, bs * hd floats);
// prefetch(block, n, near) asks for the block's bytes ahead (near: into L1, else L2).
inline void prefetch_bytes(const void* p, int64_t bytes, bool near) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
    if (near)
      __builtin_prefetch(c + off, 0, 3);
    else
      __builtin_prefetch(c + off, 0, 2);
  }
}

// K or V stored as they are (fp32, bf16, fp16): (num_blocks, nkv, bs, hd).
template <typename KV>
struct RawSource {
  const KV* base;
  int64_t head_off, block_stride, hd;
  const KV* at(int64_t block) const { return base + block * block_stride + head_off; }
  const float* rows(int64_t block, int64_t n, float* buf) const {
#ifdef MCP_ATTN_AVX2
    return attn_rows(at(block), n * hd, buf);
#else
    if constexpr (std::is_same_v<KV, float>) return at(block);
    const KV* src = at(block);
    for (int64_t i = 0; i < n * hd; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
#endif
  }
  void prefetch(int64_t block, int64_t n, bool near) const {
    prefetch_bytes(at(block), n * hd * static_cast<int64_t>(sizeof(KV)), near);
  }
};

// n fp16 -> float, 8 at a time with F16C.
inline void halves_to_floats(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// out[d] = code[d] * s + z (uint8 codes, one affine per row): the int8 codec's rows.
inline void dequant_u8_row(const uint8_t* code, int64_t hd, float s, float z, float* out) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
  for (; d + 8 <= hd; d += 8) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code + d)));
    _mm256_storeu_ps(out + d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), sv, zv));
  }
#endif
  for (; d < hd; ++d) out[d] = static_cast<float>(code[d]) * s + z;
}

#if defined(__AVX2__) && defined(__FMA__)
// 32 packed nibbles (16 bytes; channel 2i in byte i's low nibble, 2i + 1 in its high one: the int4 codecs'
// packing) as four vectors of 8 floats, channels in order.
inline void unpack_u4x32(const uint8_t* packed, __m256 out[4]) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
  const __m128i lo = _mm_and_si128(p, low4), hi = _mm_and_si128(_mm_srli_epi16(p, 4), low4);
  const __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi);
  const __m128i parts[4] = {c0, _mm_srli_si128(c0, 8), c1, _mm_srli_si128(c1, 8)};
  for (int j = 0; j < 4; ++j) out[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
}
#endif

// out[d] = nibble[d] * s[d] + z[d], per-channel affines (int4 keys).
inline void dequant_u4_row(const uint8_t* packed, int64_t hd, const float* s, const float* z, float* out) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; d + 32 <= hd; d += 32) {
    __m256 c[4];
    unpack_u4x32(packed + d / 2, c);
    for (int j = 0; j < 4; ++j) {
      const int64_t e = d + 8 * j;
      _mm256_storeu_ps(out + e, _mm256_fmadd_ps(c[j], _mm256_loadu_ps(s + e), _mm256_loadu_ps(z + e)));
    }
  }
#endif
  for (; d < hd; d += 2) {
    const uint8_t b = packed[d / 2];
    out[d] = static_cast<float>(b & 15) * s[d] + z[d];
    out[d + 1] = static_cast<float>(b >> 4) * s[d + 1] + z[d + 1];
  }
}

// The same with one affine per group of `group` channels (int4 values; a power of two >= 8 on the vector path,
// so the group index is a shift).
inline void dequant_u4_row_groups(const uint8_t* packed, int64_t hd, int64_t group, const float* gs, const float* gz,
                                  float* out) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (group % 8 == 0 && (group & (group - 1)) == 0) {
    const int shift = __builtin_ctzll(static_cast<unsigned long long>(group));
    for (; d + 32 <= hd; d += 32) {
      __m256 c[4];
      unpack_u4x32(packed + d / 2, c);
      for (int j = 0; j < 4; ++j) {
        const int64_t e = d + 8 * j, gi = e >> shift;
        _mm256_storeu_ps(out + e, _mm256_fmadd_ps(c[j], _mm256_set1_ps(gs[gi]), _mm256_set1_ps(gz[gi])));
      }
    }
  }
#endif
  for (; d < hd; d += 2) {
    const uint8_t b = packed[d / 2];
    out[d] = static_cast<float>(b & 15) * gs[d / group] + gz[d / group];
    out[d + 1] = static_cast<float>(b >> 4) * gs[(d + 1) / group] + gz[(d + 1) / group];
  }
}

// The uint8-coded affines of kv/codecs.py (coded_affine_params): meta (zmin, dz, ds) fp16 per chunk.
struct ChunkMeta {
  float zmin, dz, ds;
  explicit ChunkMeta(const at::Half* meta)
      : zmin(static_cast<float>(meta[0])), dz(static_cast<float>(meta[1])), ds(static_cast<float>(meta[2])) {}
};

inline void coded_affines(const uint8_t* scale_code, const uint8_t* zero_code, const ChunkMeta& m, int64_t count,
                          float* s, float* z) {
  const float zmin = m.zmin, dz = m.dz, ds = m.ds;
  for (int64_t i = 0; i < count; ++i) {
    s[i] = static_cast<float>(scale_code[i]) * ds;
    z[i] = zmin + static_cast<float>(zero_code[i]) * dz;
  }
}

// A staged codec's blocks: ids >= num_blocks are staging entries (bf16 rows, (entries, nkv, bs, hd)).
struct StagedRows {
  RawSource<at::BFloat16> stage;
  int64_t num_blocks;
  bool has(int64_t block) const { return block >= num_blocks; }
};

// int8 per (token, head): q (num_blocks, nkv, bs, hd) uint8, scale and zero (num_blocks, nkv, bs) fp16.
struct Int8Source {
  const uint8_t* q;
  const at::Half* scale;
  const at::Half* zero;
  int64_t nkv, h, bs, hd;
  mutable std::vector<float> affine;  // the block's per-row scales and zero points as floats
  const float* rows(int64_t block, int64_t n, float* buf) const {
    const int64_t chunk = block * nkv + h;
    affine.resize(2 * bs);
    float *s = affine.data(), *z = s + bs;
    halves_to_floats(scale + chunk * bs, n, s);
    halves_to_floats(zero + chunk * bs, n, z);
    for (int64_t t = 0; t < n; ++t) dequant_u8_row(q + (chunk * bs + t) * hd, hd, s[t], z[t], buf + t * hd);
    return buf;
  }
  void prefetch(int64_t block, int64_t n, bool near) const {
    prefetch_bytes(q + (block * nkv + h) * bs * hd, n * hd, near);
  }
};

// e4m3 -> float via fp16 bits: sign up 8, exponent and mantissa up 7 (subnormals land on fp16 subnormals),
// then x 2^8 for the exponent biases (15 - 7). Exact for every finite code; NaN codes, which encode never writes
// for finite K/V, would read as 480.
inline uint16_t e4m3_as_fp16_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x80) << 8) | ((b & 0x7F) << 7));
}

// fp8 per (token, head): q (num_blocks, nkv, bs, hd) e4m3, scale (num_blocks, nkv, bs) fp16.
struct Fp8Source {
  const uint8_t* q;
  const at::Half* scale;
  int64_t nkv, h, bs, hd;
  const float* rows(int64_t block, int64_t n, float* buf) const {
    const int64_t chunk = block * nkv + h;
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* code = q + (chunk * bs + t) * hd;
      const float s = static_cast<float>(scale[chunk * bs + t]);
      float* out = buf + t * hd;
      int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
      // e4m3_as_fp16_bits, 8 at a time (F16C widens; 2.2x faster than a 256-entry table gather)
      const __m256 sv = _mm256_set1_ps(s * 256.f);
      const __m128i sign = _mm_set1_epi16(0x80), rest = _mm_set1_epi16(0x7F);
      for (; d + 8 <= hd; d += 8) {
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code + d)));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, sign), 8),
                                       _mm_slli_epi16(_mm_and_si128(b, rest), 7));
        _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtph_ps(h), sv));
      }
#endif
      for (; d < hd; ++d)
        out[d] = static_cast<float>(c10::Half(e4m3_as_fp16_bits(code[d]), c10::Half::from_bits())) * (s * 256.f);
    }
    return buf;
  }
  void prefetch(int64_t block, int64_t n, bool near) const {
    prefetch_bytes(q + (block * nkv + h) * bs * hd, n * hd, near);
  }
};

// int4 KIVI keys: q (num_blocks, nkv, bs, hd / 2) packed, per-channel codes (num_blocks, nkv, hd) uint8, meta
// (num_blocks, nkv, 3) fp16. Values: the same q, codes per (token, group) (num_blocks, nkv, bs, ng).
struct Int4Source {
  const uint8_t* q;
  const uint8_t* scale_code;
  const uint8_t* zero_code;
  const at::Half* meta;
  int64_t nkv, h, bs, hd, ng;  // ng = 0: per channel (keys); else groups per token (values)
  StagedRows staged;
  mutable std::vector<float> affine;  // keys: per-channel scale and zero of the block being decoded
  const float* rows(int64_t block, int64_t n, float* buf) const {
    if (staged.has(block)) return staged.stage.rows(block - staged.num_blocks, n, buf);
    const int64_t chunk = block * nkv + h;
    const uint8_t* qb = q + chunk * bs * (hd / 2);
    if (ng == 0) {
      affine.resize(2 * hd);
      float *s = affine.data(), *z = s + hd;
      coded_affines(scale_code + chunk * hd, zero_code + chunk * hd, ChunkMeta(meta + chunk * 3), hd, s, z);
      for (int64_t t = 0; t < n; ++t) dequant_u4_row(qb + t * (hd / 2), hd, s, z, buf + t * hd);
      return buf;
    }
    const int64_t group = hd / ng;
    float gs[64], gz[64];  // at most 64 groups, checked by the binding
    const ChunkMeta m(meta + chunk * 3);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = chunk * bs + t;
      coded_affines(scale_code + row * ng, zero_code + row * ng, m, ng, gs, gz);
      dequant_u4_row_groups(qb + t * (hd / 2), hd, group, gs, gz, buf + t * hd);
    }
    return buf;
  }
  void prefetch(int64_t block, int64_t n, bool near) const {
    if (!staged.has(block)) prefetch_bytes(q + (block * nkv + h) * bs * (hd / 2), n * hd / 2, near);
  }
};

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
      sj[t] = attn_hsum(_mm256_add_ps(a0, a1));
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
    float mx = attn_hmax(mv);
    for (; t < len; ++t) mx = std::max(mx, sj[t]);
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 sv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= len; t += 8) {
      const __m256 e = attn_exp(_mm256_sub_ps(_mm256_loadu_ps(sj + t), mxv));
      _mm256_storeu_ps(sj + t, e);
      sv = _mm256_add_ps(sv, e);
    }
    float sum = attn_hsum(sv);
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
                 int64_t hd, int64_t bs, float* scores, float* acc, float* buf, float* mass_row) {
  // A block is widened or decoded once and read by all g heads. Blocks lie anywhere in the pool, beyond the
  // hardware prefetcher's reach: the next block's keys are fetched ahead, and this block's values into L2 for
  // the second pass.
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    if (t0 + bs < len) ks.prefetch(table[t0 / bs + 1], std::min(bs, len - t0 - bs), true);
    vs.prefetch(table[t0 / bs], n, false);
    score_rows_avx2(qf, ks.rows(table[t0 / bs], n, buf), n, g, hd, len, scores + t0);
  }
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
  const float mx = attn_hmax(amax);
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
    cj[j] = attn_hsum(qz);
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
                 int64_t g, int64_t hd, int64_t bs, float* scores, float* acc, float* buf, float* mass_row) {
  if (hd % 64 != 0 || ks.ng != 0 || vs.ng < 1 || (hd / vs.ng) % 16 != 0) {
    attend_avx2<Int4Source, Int4Source>(qf, ks, vs, table, len, g, hd, bs, scores, acc, buf, mass_row);
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
                 int64_t g, int64_t hd, int64_t bs, float* scores, float* acc, float* buf, float* mass_row) {
  if (hd % 64 != 0 || hd > 128) {
    attend_avx2<Int8Source, Int8Source>(qf, ks, vs, table, len, g, hd, bs, scores, acc, buf, mass_row);
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
    w.q_sum[j] = attn_hsum(sum);
    w.q_scale[j] = round_to_int16(qj, hd, w.q16 + j * hd);
  }
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min(bs, len - t0);
    if (t0 + bs < len) ks.prefetch(table[t0 / bs + 1], std::min(bs, len - t0 - bs), true);
    vs.prefetch(table[t0 / bs], n, false);
    score_int8_keys(ks, table[t0 / bs], n, g, hd, len, scores + t0, w);
  }
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
                   int64_t hd, int64_t bs, float* scores, float* acc, float* buf, float* mass_row) {
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

// Every (sequence, KV head) of a decode batch; sources(h) gives that KV head's (key, value) sources.
template <typename T, typename Sources>
void decode_attention_run(const T* q, const int64_t* tables, const int64_t* lengths, T* out, float* mass,
                          int64_t B, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, int64_t nb, int64_t max_len,
                          const Sources& sources) {
  const int64_t g = nh / nkv;
  // Small problems run inline: waking the thread pool costs more than the work.
  const int64_t work = std::max<int64_t>(1, max_len * hd * g);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / work);
  at::parallel_for(0, B * nkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g * max_len), qf(g * hd), acc(g * hd), buf(bs * hd);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / nkv, h = item % nkv;
      const int64_t len = lengths[b];
      for (int64_t j = 0; j < g; ++j)
        for (int64_t d = 0; d < hd; ++d) qf[j * hd + d] = load(q, (b * nh + h * g + j) * hd + d);
      float* mass_row = mass == nullptr ? nullptr : mass + (b * nkv + h) * nb;
      const auto src = sources(h);
#ifdef MCP_ATTN_AVX2
      if (hd % 8 == 0)
        attend_avx2(qf.data(), src.first, src.second, tables + b * nb, len, g, hd, bs, scores.data(), acc.data(),
                    buf.data(), mass_row);
      else
#endif
        attend_scalar(qf.data(), src.first, src.second, tables + b * nb, len, g, hd, bs, scores.data(),
                      acc.data(), buf.data(), mass_row);
      for (int64_t j = 0; j < g; ++j)
        for (int64_t d = 0; d < hd; ++d)
          out[(b * nh + h * g + j) * hd + d] = static_cast<T>(acc[j * hd + d]);
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

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& tables,
                                     const torch::Tensor& lengths, const c10::optional<torch::Tensor>& mass) {
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
  auto out = torch::empty_like(qc);
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
                              mp, B, nh, nkv, hd, bs, nb, max_len, sources);
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

// ---- residual add + RMSNorm ------------------------------------------------------------------------------
// residual += x (in place, when x is given), then out = residual / rms(residual) * weight, in out_dtype.
// Elementwise kernels split rows across threads past this many (decode steps stay on the calling thread; a
// row's arithmetic is the same either way).
constexpr int64_t kParallelRows = 64;

template <typename T, typename R, typename O>
void add_rms_norm_impl(const T* x, R* res, const float* w, O* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, kParallelRows, [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    R* rr = res + r * hidden;
    float ss = 0.f;
    if (x != nullptr) {
      const T* xr = x + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        const float s = static_cast<float>(rr[i]) + static_cast<float>(xr[i]);
        rr[i] = static_cast<R>(s);
      }
    }
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < hidden; ++i) {
      const float s = static_cast<float>(rr[i]);
      ss += s * s;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
    O* orow = out + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) orow[i] = static_cast<O>(static_cast<float>(rr[i]) * inv * w[i]);
  }
  });
}

torch::Tensor add_rms_norm(const torch::Tensor& residual, const c10::optional<torch::Tensor>& x,
                           const torch::Tensor& weight, double eps, c10::ScalarType out_dtype) {
  check_cpu_float(residual, "residual");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be a contiguous (T, H) tensor");
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  torch::Tensor xc;
  if (x.has_value()) {
    check_cpu_float(*x, "x");
    TORCH_CHECK(x->sizes() == residual.sizes(), "x and residual must have one shape");
    xc = x->contiguous();
  }
  const auto wf = weight.to(torch::kFloat).contiguous();
  TORCH_CHECK(wf.numel() == hidden, "weight must have H elements");
  auto out = torch::empty({rows, hidden}, residual.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, residual.scalar_type(), "add_rms_norm_res", [&] {
    using R = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, out_dtype, "add_rms_norm_out", [&] {
      using O = scalar_t;
      if (!x.has_value()) {
        add_rms_norm_impl<float, R, O>(nullptr, residual.data_ptr<R>(), wf.data_ptr<float>(),
                                       out.data_ptr<O>(), rows, hidden, static_cast<float>(eps));
      } else if (xc.scalar_type() == torch::kFloat) {
        add_rms_norm_impl<float, R, O>(xc.data_ptr<float>(), residual.data_ptr<R>(), wf.data_ptr<float>(),
                                       out.data_ptr<O>(), rows, hidden, static_cast<float>(eps));
      } else {
        add_rms_norm_impl<at::BFloat16, R, O>(xc.data_ptr<at::BFloat16>(), residual.data_ptr<R>(),
                                              wf.data_ptr<float>(), out.data_ptr<O>(), rows, hidden,
                                              static_cast<float>(eps));
      }
    });
  });
  return out;
}

// ---- RoPE (rotate-half convention), in place --------------------------------------------------------------
// x: (T, heads, hd) with contiguous (heads, hd) rows (any row stride); cos, sin: (T, rot), float32 or x's dtype,
// rot <= hd: the first rot dims of each head rotate (pairs i, i + rot/2), the rest pass through (partial rotary).
template <typename T, typename C>
void rope_impl(T* x, int64_t row_stride, const C* cos, const C* sin, int64_t rows, int64_t heads, int64_t hd,
               int64_t rot) {
  const int64_t half = rot / 2;
  at::parallel_for(0, rows, kParallelRows, [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const C* c = cos + r * rot;
    const C* s = sin + r * rot;
    for (int64_t h = 0; h < heads; ++h) {
      T* p = x + r * row_stride + h * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = static_cast<float>(p[i]), b = static_cast<float>(p[i + half]);
        p[i] = static_cast<T>(a * static_cast<float>(c[i]) - b * static_cast<float>(s[i]));
        p[i + half] = static_cast<T>(b * static_cast<float>(c[i + half]) + a * static_cast<float>(s[i + half]));
      }
    }
  }
  });
}

void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_cpu_float(x, "x");
  check_cpu_float(cos, "cos");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be (T, heads, hd) rows");
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type(), "cos and sin must share a dtype");
  const auto cc = cos.contiguous(), sc = sin.contiguous();
  const int64_t rows = x.size(0), heads = x.size(1), hd = x.size(2);
  if (rows == 0) return;
  const int64_t rot = cc.numel() / rows;
  TORCH_CHECK(cc.numel() == rows * rot && sc.numel() == rows * rot && rot % 2 == 0 && rot <= hd,
              "cos/sin must be (T, rot) with rot even and <= hd");
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rope_x", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, cc.scalar_type(), "rope_cs", [&] {
      rope_impl<T, scalar_t>(x.data_ptr<T>(), x.stride(0), cc.data_ptr<scalar_t>(), sc.data_ptr<scalar_t>(), rows,
                             heads, hd, rot);
    });
  });
}

// ---- SiLU(gate) * up ---------------------------------------------------------------------------------------
// gate_up: (T, 2I) as [gate | up] -> (T, I) in out_dtype.
// SiLU(a) = a * sigmoid(a), sigmoid through e = exp(-|a|) (never overflows): 1 / (1 + e) for a >= 0, else
// e / (1 + e). fp32 rows take 8 lanes at a time with the attention's exp; other dtypes and the tail, std::exp.
inline float silu_scalar(float a) {
  const float e = std::exp(-std::fabs(a));
  return a * ((a >= 0.f ? 1.f : e) / (1.f + e));
}

template <typename T, typename O>
void silu_mul_impl(const T* gu, O* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kParallelRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      O* o = out + r * inter;
      int64_t i = 0;
#ifdef MCP_ATTN_AVX2
      if constexpr (std::is_same_v<T, float> && std::is_same_v<O, float>) {
        const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
        for (; i + 8 <= inter; i += 8) {
          const __m256 a = _mm256_loadu_ps(g + i);
          const __m256 e = attn_exp(_mm256_or_ps(a, sign));  // exp(-|a|)
          const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GE_OQ));
          const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(a, sig), _mm256_loadu_ps(u + i)));
        }
      }
#endif
      for (; i < inter; ++i) {
        const float a = static_cast<float>(g[i]);
        o[i] = static_cast<O>(silu_scalar(a) * static_cast<float>(u[i]));
      }
    }
  });
}

torch::Tensor silu_mul(const torch::Tensor& gate_up, c10::ScalarType out_dtype) {
  check_cpu_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be (T, 2I)");
  const auto gc = gate_up.contiguous();
  const int64_t rows = gc.size(0), inter = gc.size(1) / 2;
  auto out = torch::empty({rows, inter}, gc.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, gc.scalar_type(), "silu_mul_in", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, out_dtype, "silu_mul_out", [&] {
      silu_mul_impl<T, scalar_t>(gc.data_ptr<T>(), out.data_ptr<scalar_t>(), rows, inter);
    });
  });
  return out;
}

}  // namespace

// ---- int4 x int8 GEMV (decode-sized batches) ---------------------------------------------------------------
// Weights in 32-wide blocks: qs (N, K/32, 16) bytes, byte i holding w[32b + i] (low nibble) and w[32b + 16 + i]
// (high nibble); sz (N, K/32, 2) bf16 scale and zero, value = (q - 8) * scale + zero with q in 0..15 (the
// convention and the bf16 bits of torch's int4 kernel, so both compute from identical weights). Activations
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

inline float bf16_bits_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Eight blocks' bf16 (scale, zero) pairs as two float vectors: a pair is one 32-bit lane, scale in the low
// half, so shifting it up is the scale's float and masking the low half off is the zero's.
struct BlockScales {
  __m256 s, off;  // scale, zero - 8 * scale
};

inline BlockScales block_scales8(const uint16_t* sz) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz));
  const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
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
    const float s = bf16_bits_to_float(szn[2 * b]);
    const float off = bf16_bits_to_float(szn[2 * b + 1]) - 8.f * s;
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
    const __m512i raw = _mm512_loadu_si512(szn + 2 * b);
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);
    for (int i = 0; i < M; ++i) acc[i][0] = _mm512_fmadd_ps(off, _mm512_loadu_ps(xr.sum + i * nblk + b), acc[i][0]);
    for (int p = 0; p < 8; ++p)
      pair(b + 2 * p, _mm512_permutexvar_ps(_mm512_add_epi32(halves, _mm512_set1_epi32(2 * p)), s), p & 1);
  }
  for (; b < nblk; ++b) {
    const float s0 = bf16_bits_to_float(szn[2 * b]);
    const float off0 = bf16_bits_to_float(szn[2 * b + 1]) - 8.f * s0;
    for (int i = 0; i < M; ++i) tail[i] += off0 * xr.sum[i * nblk + b];
    if (b + 1 < nblk) {
      const float s1 = bf16_bits_to_float(szn[2 * b + 2]);
      const float off1 = bf16_bits_to_float(szn[2 * b + 3]) - 8.f * s1;
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
        const float s = bf16_bits_to_float(szn[2 * b]);
        const float off = bf16_bits_to_float(szn[2 * b + 1]) - 8.f * s;
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
  TORCH_CHECK(sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous() && sz.numel() == N * K / 16,
              "sz must be contiguous bfloat16 (N, K/32, 2)");
  const auto xc = x.contiguous();
  QuantizedRows xr;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, xc.scalar_type(), "int4_gemv_q", [&] {
    xr = quantize_rows<scalar_t>(xc.data_ptr<scalar_t>(), M, K);
  });
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
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
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
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
constexpr int64_t kDenseGemvMaxRows = 32;

namespace {
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) { return bf16x8_to_float(p); }

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
  at::parallel_for(0, (N + 2) / 3, 8, [&](int64_t t0, int64_t t1) {
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
#ifdef MCP_INT4_VNNI
// Sixteen floats to bf16, rounded as float8_to_bf16 below.
inline __m256i float16_to_bf16(__m512 f) {
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_cvtepi32_epi16(r);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Eight floats to bf16 as c10::BFloat16 rounds finite values (to nearest, ties to even), in integer arithmetic:
// a per-element conversion was most of a dequantization's time (0.55 ms of 576 -> 3072).
inline __m128i float8_to_bf16(__m256 f) {
  const __m256i bits = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
#endif

torch::Tensor int4_dequant(const torch::Tensor& qs, const torch::Tensor& sz, bool out_bf16,
                           const c10::optional<torch::Tensor>& out_buffer) {
  TORCH_CHECK(qs.scalar_type() == torch::kByte && qs.is_contiguous() && qs.dim() == 3 && qs.size(2) == 16,
              "qs must be contiguous uint8 (N, K/32, 16)");
  TORCH_CHECK(sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous() && sz.numel() == qs.numel() / 8,
              "sz must be contiguous bfloat16 (N, K/32, 2)");
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
  const auto* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  float* out_f32 = out_bf16 ? nullptr : out.data_ptr<float>();
  at::BFloat16* out_b16 = out_bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    alignas(64) float buf[32];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nblk; ++b) {
        const float s = bf16_bits_to_float(sp[(n * nblk + b) * 2]);
        const float off = bf16_bits_to_float(sp[(n * nblk + b) * 2 + 1]) - 8.f * s;
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
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(ob), float16_to_bf16(lo));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(ob + 16), float16_to_bf16(hi));
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
            _mm_storeu_si128(reinterpret_cast<__m128i*>(ob + k), float8_to_bf16(w));
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

// ---- K/V rows into the paged cache --------------------------------------------------------------------------
// k_dst, v_dst: one layer's planes viewed as (R, hd) rows, in float32, bfloat16 or float16; k, v: (T, nkv, hd)
// float32 or bfloat16 with contiguous head rows (any token and head strides); rows (T * nkv,): the destination
// row of (token, head) pair t * nkv + h. Narrowing rounds to nearest even, as Tensor.to does. One call for both:
// two index_copy_ calls cost ~15 us each at decode sizes, as much as the attention reading the rows.
template <typename S, typename D>
void write_rows_impl(D* kd, D* vd, const int64_t* rp, const S* ks, const S* vs, int64_t T, int64_t nkv,
                     int64_t hd, int64_t R, int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nkv; ++h) {
      const int64_t r = rp[t * nkv + h];
      TORCH_CHECK(r >= 0 && r < R, "row ", r, " out of range for ", R, " rows");
      const S* kr = ks + t * ks0 + h * ks1;
      const S* vr = vs + t * vs0 + h * vs1;
      D* ko = kd + r * hd;
      D* vo = vd + r * hd;
      if constexpr (std::is_same_v<S, D>) {
        std::memcpy(ko, kr, hd * sizeof(D));
        std::memcpy(vo, vr, hd * sizeof(D));
      } else {
        for (int64_t d = 0; d < hd; ++d) {
          ko[d] = static_cast<D>(static_cast<float>(kr[d]));
          vo[d] = static_cast<D>(static_cast<float>(vr[d]));
        }
      }
    }
}

void write_kv_rows(torch::Tensor& k_dst, torch::Tensor& v_dst, const torch::Tensor& rows, const torch::Tensor& k,
                   const torch::Tensor& v) {
  TORCH_CHECK(k_dst.device().is_cpu() && k_dst.is_contiguous() && v_dst.is_contiguous() &&
                  k_dst.sizes() == v_dst.sizes() && k_dst.dim() == 2 && k_dst.scalar_type() == v_dst.scalar_type(),
              "k_dst and v_dst must be contiguous CPU (R, hd) planes of one shape and dtype");
  check_cpu_float(k, "k");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "k and v must share a dtype");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.dim() == 1, "rows must be int64 (T * nkv,)");
  const int64_t hd = k_dst.size(1), R = k_dst.size(0);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(2) == hd && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be (T, nkv, hd) with contiguous head rows");
  const int64_t T = k.size(0), nkv = k.size(1);
  TORCH_CHECK(rows.size(0) == T * nkv, "rows must hold one entry per (token, head)");
  const auto rc = rows.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, k.scalar_type(), "write_kv_rows_src", [&] {
    using S = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, k_dst.scalar_type(),
                                    "write_kv_rows_dst", [&] {
      write_rows_impl<S, scalar_t>(k_dst.data_ptr<scalar_t>(), v_dst.data_ptr<scalar_t>(), rc.data_ptr<int64_t>(),
                                   k.data_ptr<S>(), v.data_ptr<S>(), T, nkv, hd, R, k.stride(0), k.stride(1),
                                   v.stride(0), v.stride(1));
    });
  });
}

// kv_write.cpp
void write_kv_rows_quantized(int64_t kind, const std::vector<torch::Tensor>& kp, const std::vector<torch::Tensor>& vp,
                             const torch::Tensor& rows, const torch::Tensor& k, const torch::Tensor& v);
bool seal_int4_blocks(const std::vector<torch::Tensor>& planes, const torch::Tensor& chunks, const torch::Tensor& x,
                      int64_t bs, int64_t group);
// staged_merge.cpp
torch::Tensor merge_own_blocks(const torch::Tensor& out_a, const torch::Tensor& lse_a, const torch::Tensor& q,
                               const torch::Tensor& ks, const torch::Tensor& vs, const torch::Tensor& no_sealed,
                               int64_t num_prior, int64_t bs);
// int4_gemm.cpp
bool vnni_gemm_available();
std::vector<torch::Tensor> int4_gemm_pack(const torch::Tensor& qs, const torch::Tensor& sz);
torch::Tensor int4_gemm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so);
// int8_gemm.cpp
torch::Tensor int8_gemm_pack(const torch::Tensor& w);
torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scales);
// block_gemm.cpp
torch::Tensor block_gemm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so);
torch::Tensor block_gemm_reference(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so);
torch::Tensor block_dequant(const torch::Tensor& wp, const torch::Tensor& so, int64_t K);
int64_t block_float_gemm_min_rows(int64_t n, int64_t k);

// ---- decode-sized decoder layers in two calls ------------------------------------------------------------
// A layer's ops between the attention reads, composed here from the kernels above, so a decode step pays one
// Python-to-C++ crossing per half-layer instead of ~25 dispatches (measured once with a throwaway script, fused on/off
// alternating in one process: a batch-1 int4 decode step 9-17% shorter). Each linear does exactly what its Python module does
// on a decode-sized input (same kernel, same casts, same order), so both paths give identical results.
struct FusedLinear {
  int64_t kind;  // 0: float weight through dense_linear; 1: int8 weight + fp32 scales; 2: int4 GEMV layout;
                 // 3: int4 GEMM layout (int4_gemm.cpp); 4: int8 GEMM layout (int8_gemm.cpp);
                 // 5: byte weights with group scales and offsets (block_gemm.cpp)
  torch::Tensor a, b;  // dense: (weight, unused); int8: (weight, scales); int4: (qs, sz); int4 GEMM: (wp, so);
                       // int8 GEMM: (wp, scales); block GEMM: (wp, so)
  c10::optional<torch::Tensor> bias, inv_scale;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == 0) return dense_linear(x, a, bias);
    const auto xs = inv_scale.has_value() ? x * *inv_scale : x;
    auto y = kind == 1   ? int8_gemv(xs, a, b)
             : kind == 2 ? int4_gemv(xs, a, b)
             : kind == 3 ? int4_gemm(xs, a, b)
             : kind == 4 ? int8_gemm(xs, a, b)
                         : block_gemm(xs, a, b);
    if (bias.has_value()) y = y + *bias;
    return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
  }
};

// residual (T, H) += x (x absent: residual is the stream already); h = RMSNorm(residual) * norm_w; qkv = h W;
// RoPE on the q and k heads in place (cos/sin (T, rot): partial rotary as in rope_). Returns views q (T, nh, hd),
// k (T, nkv, hd), v (T, nkv, hd).
std::vector<torch::Tensor> layer_attn_in(torch::Tensor& residual, const c10::optional<torch::Tensor>& x,
                                         const torch::Tensor& norm_w, double eps, const FusedLinear& qkv,
                                         const torch::Tensor& cos, const torch::Tensor& sin, int64_t nh,
                                         int64_t nkv, int64_t hd) {
  const auto h = add_rms_norm(residual, x, norm_w, eps, residual.scalar_type());
  const auto y = qkv(h);
  const int64_t T = y.size(0);
  TORCH_CHECK(y.dim() == 2 && y.size(1) == (nh + 2 * nkv) * hd && y.is_contiguous(), "qkv has the wrong shape");
  auto qk = y.narrow(1, 0, (nh + nkv) * hd).view({T, nh + nkv, hd});
  rope_(qk, cos, sin);
  return {qk.narrow(1, 0, nh), qk.narrow(1, nh, nkv), y.narrow(1, (nh + nkv) * hd, nkv * hd).view({T, nkv, hd})};
}

// attn (T, nh, hd) -> o projection; residual += it; h = RMSNorm(residual) * norm_w; down(SiLU(gate) * up).
torch::Tensor layer_attn_out_mlp(const torch::Tensor& attn, torch::Tensor& residual, const FusedLinear& o,
                                 const torch::Tensor& norm_w, double eps, const FusedLinear& gate_up,
                                 const FusedLinear& down) {
  const auto a = o(attn.reshape({attn.size(0), -1}));
  const auto h = add_rms_norm(residual, a, norm_w, eps, residual.scalar_type());
  const auto gu = gate_up(h);
  return down(silu_mul(gu, gu.scalar_type()));
}


// ---- prefill attention (AVX-512) --------------------------------------------------------------------------
// A prefill chunk's causal attention over its context: q (T, nh, hd) float32, pre-scaled, rows of nh * hd
// contiguous; k, v (nkv, S, hd) float32 or bf16, contiguous. Query i sits at key position offset + i and sees
// keys 0 .. offset + i (slot order: everything cached precedes the chunk). Flash-style, in fp32 throughout:
// per (KV head, tile of query positions) the g grouped heads' rows share each pass over a key tile; scores
// for kRows rows x 16 keys stay in registers (K transposed once per head, so each of the hd steps is one load
// and kRows broadcast FMAs), an online softmax per row, and the value sums for 6 rows at a time in registers.
// torch's CPU flash kernel (SDPA) reaches ~100 GFLOP/s here at 1024 tokens; fp32 throughout keeps the fp32
// model's arithmetic (only the summation order differs).
#if defined(__AVX512F__)
#define MCP_PREFILL_AVX512 1

inline __m512 exp16(__m512 x) {  // attn_exp in 16 lanes
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 is_tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~is_tiny), y, _mm512_castsi512_ps(e));
}

constexpr int64_t kKeyTile = 16;   // keys per score register
constexpr int64_t kKeyBlock = 64;  // keys per softmax update (4 tiles: one max, exp and sum pass per row)
constexpr int64_t kMaxRows = 12;  // score accumulators per key tile (query rows of one tile)
constexpr int64_t kPvRows = 6;    // rows whose value sums (hd / 16 registers each) stay in registers

// Value sums of rows r0 .. r0 + R - 1 over one key tile: acc[r] = acc[r] * rescale[r] + sum_j p[r][j] v[j].
template <int R, int H>  // H = hd / 16
inline void prefill_pv(float* acc, const float* p, const float* rescale, const float* v, int64_t nkeys,
                       int64_t hd) {
  __m512 a[R][H];
  for (int r = 0; r < R; ++r) {
    const __m512 sc = _mm512_set1_ps(rescale[r]);
    for (int h = 0; h < H; ++h) a[r][h] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * hd + 16 * h), sc);
  }
  for (int64_t j = 0; j < nkeys; ++j) {
    __m512 vj[H];
    for (int h = 0; h < H; ++h) vj[h] = _mm512_loadu_ps(v + j * hd + 16 * h);
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * kKeyBlock + j]);
      for (int h = 0; h < H; ++h) a[r][h] = _mm512_fmadd_ps(pr, vj[h], a[r][h]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < H; ++h) _mm512_storeu_ps(acc + r * hd + 16 * h, a[r][h]);
}

template <int H>
void prefill_pv_rows(float* acc, const float* p, const float* rescale, const float* v, int64_t nkeys,
                     int64_t hd, int64_t rows) {
  int64_t r = 0;
  for (; r + kPvRows <= rows; r += kPvRows)
    prefill_pv<kPvRows, H>(acc + r * hd, p + r * kKeyBlock, rescale + r, v, nkeys, hd);
  for (; r < rows; ++r) prefill_pv<1, H>(acc + r * hd, p + r * kKeyBlock, rescale + r, v, nkeys, hd);
}

// Scores of R query rows against one key tile (16 keys): K^T rows (hd, kt_stride) give each dimension's 16
// keys in one load; R accumulators in registers (R is a template argument so they stay there).
template <int R>
inline void prefill_scores(const float* qrows, int64_t hd, const float* ktile, int64_t kt_stride, float* out) {
  __m512 s[R];
  for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd; ++d) {
    const __m512 kd = _mm512_loadu_ps(ktile + d * kt_stride);
    for (int r = 0; r < R; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(qrows[r * hd + d]), kd, s[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kKeyBlock, s[r]);
}

inline void prefill_scores_rows(const float* qrows, int64_t hd, const float* ktile, int64_t kt_stride, float* out,
                                int64_t rows) {
  switch (rows) {
    case 12: prefill_scores<12>(qrows, hd, ktile, kt_stride, out); break;
    case 11: prefill_scores<11>(qrows, hd, ktile, kt_stride, out); break;
    case 10: prefill_scores<10>(qrows, hd, ktile, kt_stride, out); break;
    case 9: prefill_scores<9>(qrows, hd, ktile, kt_stride, out); break;
    case 8: prefill_scores<8>(qrows, hd, ktile, kt_stride, out); break;
    case 7: prefill_scores<7>(qrows, hd, ktile, kt_stride, out); break;
    case 6: prefill_scores<6>(qrows, hd, ktile, kt_stride, out); break;
    case 5: prefill_scores<5>(qrows, hd, ktile, kt_stride, out); break;
    case 4: prefill_scores<4>(qrows, hd, ktile, kt_stride, out); break;
    case 3: prefill_scores<3>(qrows, hd, ktile, kt_stride, out); break;
    case 2: prefill_scores<2>(qrows, hd, ktile, kt_stride, out); break;
    default: prefill_scores<1>(qrows, hd, ktile, kt_stride, out); break;
  }
}

// One (KV head, query tile): rows = positions x g heads, row r = (position r / g, head r % g).
template <int H>
void prefill_tile(const float* q, int64_t q_row_stride, const float* kt, int64_t kt_stride, const float* vf,
                  float* out, int64_t out_row_stride, int64_t i0, int64_t npos, int64_t g, int64_t offset) {
  constexpr int64_t hd = 16 * H;
  const int64_t rows = npos * g;
  alignas(64) float qrows[kMaxRows * hd];
  alignas(64) float p[kMaxRows * kKeyBlock];
  alignas(64) float acc[kMaxRows * hd];
  float m[kMaxRows], l[kMaxRows], rescale[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(qrows + r * hd, q + (i0 + r / g) * q_row_stride + (r % g) * hd, hd * sizeof(float));
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::memset(acc, 0, rows * hd * sizeof(float));
  const int64_t kend = offset + i0 + npos;  // keys the tile's last position sees
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j0 = 0; j0 < kend; j0 += kKeyBlock) {
    const int64_t nk = std::min(kKeyBlock, kend - j0);
    const int64_t ntiles = (nk + kKeyTile - 1) / kKeyTile;
    for (int64_t t = 0; t < ntiles; ++t)
      prefill_scores_rows(qrows, hd, kt + j0 + t * kKeyTile, kt_stride, p + t * kKeyTile, rows);
    for (int64_t r = 0; r < rows; ++r) {
      float* pr = p + r * kKeyBlock;
      const int64_t visible = std::min<int64_t>(nk, offset + i0 + r / g + 1 - j0);  // causal limit, >= 1
      __m512 mx = _mm512_set1_ps(neg_inf);
      for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t left = visible - t * kKeyTile;
        const __mmask16 live = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << std::max<int64_t>(left, 0)) - 1);
        mx = _mm512_mask_max_ps(mx, live, mx, _mm512_loadu_ps(pr + t * kKeyTile));
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(mx));
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t t = 0; t < ntiles; ++t) {
        const int64_t left = visible - t * kKeyTile;
        const __mmask16 live = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << std::max<int64_t>(left, 0)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(pr + t * kKeyTile), mv)));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(pr + t * kKeyTile, e);
      }
      rescale[r] = std::exp(m[r] - m_new);  // 0 on the first block (m = -inf)
      l[r] = l[r] * rescale[r] + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
    }
    prefill_pv_rows<H>(acc, p, rescale, vf + j0 * hd, nk, hd, rows);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (i0 + r / g) * out_row_stride + (r % g) * hd;
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int64_t h = 0; h < H; ++h)
      _mm512_storeu_ps(o + 16 * h, _mm512_mul_ps(_mm512_loadu_ps(acc + r * hd + 16 * h), inv));
  }
}

template <typename KV>
void prefill_attention_impl(const float* q, const KV* k, const KV* v, float* out, int64_t T, int64_t nh,
                            int64_t nkv, int64_t S, int64_t hd, int64_t offset) {
  const int64_t g = nh / nkv;
  const int64_t positions = std::max<int64_t>(1, kMaxRows / g);  // query positions per tile
  const int64_t num_tiles = (T + positions - 1) / positions;
  const int64_t s_pad = (S + kKeyTile - 1) / kKeyTile * kKeyTile;
  // Per KV head: K transposed to (hd, S_pad) and V as float (S, hd), built once, read by every query tile.
  std::vector<float> kt(nkv * hd * s_pad, 0.f), vf(nkv * S * hd);
  at::parallel_for(0, nkv * S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t h = idx / S, j = idx % S;
      const KV* krow = k + idx * hd;
      const KV* vrow = v + idx * hd;
      float* ktp = kt.data() + h * hd * s_pad;
      for (int64_t d = 0; d < hd; ++d) ktp[d * s_pad + j] = static_cast<float>(krow[d]);
      for (int64_t d = 0; d < hd; ++d) vf[idx * hd + d] = static_cast<float>(vrow[d]);
    }
  });
  // Later tiles see more keys: tiles are taken in the order 0, last, 1, last - 1, ... so that parallel_for's
  // contiguous ranges hold about equal work (in order, the second thread got ~3/4 of it).
  at::parallel_for(0, nkv * num_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t h = w % nkv, k = w / nkv;
      const int64_t tile = k % 2 == 0 ? k / 2 : num_tiles - 1 - k / 2;
      const int64_t i0 = tile * positions, npos = std::min(positions, T - i0);
      const float* qh = q + h * g * hd;
      float* oh = out + h * g * hd;
      const float* kth = kt.data() + h * hd * s_pad;
      const float* vfh = vf.data() + h * S * hd;
      switch (hd / 16) {
        case 2: prefill_tile<2>(qh, nh * hd, kth, s_pad, vfh, oh, nh * hd, i0, npos, g, offset); break;
        case 4: prefill_tile<4>(qh, nh * hd, kth, s_pad, vfh, oh, nh * hd, i0, npos, g, offset); break;
        case 8: prefill_tile<8>(qh, nh * hd, kth, s_pad, vfh, oh, nh * hd, i0, npos, g, offset); break;
        default: prefill_tile<16>(qh, nh * hd, kth, s_pad, vfh, oh, nh * hd, i0, npos, g, offset); break;
      }
    }
  });
}
#endif

bool prefill_attention_available() {
#ifdef MCP_PREFILL_AVX512
  return true;
#else
  return false;
#endif
}

torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                int64_t offset) {
#ifdef MCP_PREFILL_AVX512
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kFloat && q.dim() == 3, "q must be float32 (T, nh, hd)");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == v.scalar_type(),
              "k and v must be (nkv, S, hd) of one dtype");
  TORCH_CHECK(k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kBFloat16, "k and v: float32 or bfloat16");
  const int64_t T = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k.size(0), S = k.size(1);
  TORCH_CHECK(k.size(2) == hd && nh % nkv == 0, "head sizes do not match");
  TORCH_CHECK(hd % 16 == 0 && (hd == 32 || hd == 64 || hd == 128 || hd == 256), "hd must be 32, 64, 128 or 256");
  TORCH_CHECK(nh / nkv <= kMaxRows, "at most 12 query heads per KV head");
  TORCH_CHECK(offset >= 0 && offset + T <= S, "the chunk's keys must be in k: offset + T <= S");
  const auto qc = q.contiguous();
  const auto kc = k.contiguous(), vc = v.contiguous();
  auto out = torch::empty({T, nh, hd}, q.options());
  if (kc.scalar_type() == torch::kFloat)
    prefill_attention_impl<float>(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                                  out.data_ptr<float>(), T, nh, nkv, S, hd, offset);
  else
    prefill_attention_impl<at::BFloat16>(qc.data_ptr<float>(), kc.data_ptr<at::BFloat16>(),
                                         vc.data_ptr<at::BFloat16>(), out.data_ptr<float>(), T, nh, nkv, S, hd,
                                         offset);
  return out;
#else
  TORCH_CHECK(false, "prefill_attention needs AVX-512 (this build has none)");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention, "causal prefill attention over a chunk's context (AVX-512)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("offset"));
  m.def("prefill_attention_available", &prefill_attention_available, "whether this build has it");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged K/V blocks",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("lengths"),
        py::arg("mass") = py::none());
  m.def("paged_decode_attention_quantized", &paged_decode_attention_quantized,
        "decode attention over int8 / int4 / fp8 paged K/V blocks (and int4's staged bf16 tails)", py::arg("q"),
        py::arg("kind"), py::arg("k_planes"), py::arg("v_planes"), py::arg("stage_k"), py::arg("stage_v"),
        py::arg("tables"), py::arg("lengths"), py::arg("mass") = py::none());
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual) * weight");
  m.def("rope_", &rope_, "rotate-half RoPE in place");
  m.def("int4_gemv", &int4_gemv, "int4 weights x int8-quantized activations, decode-sized batches");
  m.def("int4_gemm", &int4_gemm, "int4 weights x int8-quantized activations, prefill-sized inputs (VNNI)");
  m.def("int4_gemm_pack", &int4_gemm_pack, "the int4 GEMV layout -> the GEMM's (weights, scales, offsets)");
  m.def("vnni_gemm_available", &vnni_gemm_available, "whether this build has the int4 and int8 GEMMs (VNNI)");
  m.def("int8_gemv", &int8_gemv, "int8 weights x float activations, decode-sized batches");
  m.def("int8_gemm", &int8_gemm, "int8 weights x int8-quantized activations, prefill-sized inputs (VNNI)");
  m.def("block_gemm", &block_gemm, "stored block quantization (scale * u + offset per group) x int8 activations");
  m.def("block_gemm_reference", &block_gemm_reference, "block_gemm as a portable scalar loop (for tests)");
  m.def("block_dequant", &block_dequant, "a block GEMM weight as fp32 (N, K)");
  m.def("block_float_gemm_min_rows", &block_float_gemm_min_rows,
        "rows from which block_gemm runs a float GEMM on the dequantized weight (0: never)");
  m.def("int8_gemm_pack", &int8_gemm_pack, "int8 (N, K) weights -> the int8 GEMM's column tiles (+128)");
  m.def("dense_linear", &dense_linear, "float weights: our GEMV for decode-sized inputs, else at::linear",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.attr("DENSE_GEMV_MAX_ROWS") = kDenseGemvMaxRows;
  m.def("int4_dequant", &int4_dequant, "the int4 GEMV layout back to float or bf16 (N, K)", py::arg("qs"),
        py::arg("sz"), py::arg("out_bf16") = false, py::arg("out") = py::none());
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
  py::class_<FusedLinear>(m, "FusedLinear")
      .def(py::init([](int64_t kind, torch::Tensor a, torch::Tensor b, c10::optional<torch::Tensor> bias,
                       c10::optional<torch::Tensor> inv_scale) {
             TORCH_CHECK(kind >= 0 && kind <= 5,
                         "kind must be 0 (dense), 1 (int8), 2 (int4), 3 (int4 GEMM), 4 (int8 GEMM) or 5 (block GEMM)");
             return FusedLinear{kind, std::move(a), std::move(b), std::move(bias), std::move(inv_scale)};
           }),
           py::arg("kind"), py::arg("a"), py::arg("b"), py::arg("bias") = py::none(),
           py::arg("inv_scale") = py::none())
      .def("__call__", &FusedLinear::operator());
  m.def("write_kv_rows", &write_kv_rows, "K and V rows into one layer's cache planes");
  m.def("write_kv_rows_quantized", &write_kv_rows_quantized,
        "K and V rows encoded with the int8 (kind 1) or fp8 (kind 3) KV codec into one layer's planes");
  m.def("merge_own_blocks", &merge_own_blocks,
        "a staged codec's prefill chunk: each query's own staged block merged into the sealed context's attention");
  m.def("seal_int4_blocks", &seal_int4_blocks,
        "whole blocks encoded with the int4 KV codec (keys: group 0, values: channels per group) into one layer's planes");
  m.def("layer_attn_in", &layer_attn_in, "residual add + RMSNorm + qkv projection + RoPE; returns q, k, v");
  m.def("layer_attn_out_mlp", &layer_attn_out_mlp, "o projection + residual add + RMSNorm + gated MLP");
}
