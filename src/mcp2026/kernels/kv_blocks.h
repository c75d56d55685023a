// Where the paged decode attention (decode_attention.cpp) gets one (block, KV head)'s rows as floats, for every
// K/V cache layout: stored as they are (fp32, bf16, fp16), int8 and fp8 per (token, head), int4 KIVI (with its
// staged bf16 blocks). Each source decodes a block into a row buffer; decode_attention.cpp also reads the int8
// and int4 layouts in registers where the shapes allow.
#pragma once

#include <torch/extension.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MCP_ATTN_AVX2 1

// n rows of hd values from the cache as floats: fp32 rows are used where they lie, 16-bit rows widened into buf.
template <typename KV>
inline const float* attn_rows(const KV* src, int64_t count, float* buf) {
  if constexpr (std::is_same_v<KV, float>) {
    return src;
  } else if constexpr (std::is_same_v<KV, at::BFloat16>) {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(buf + i, bf16x8_to_float(src + i));
    for (; i < count; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  } else if constexpr (std::is_same_v<KV, at::Half>) {
    halves_to_floats(src, count, buf);
    return buf;
  } else {  // float64, which the bindings refuse before any read
    for (int64_t i = 0; i < count; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}
#endif

// ---- block sources: where the attention loops get one (block, KV head)'s rows as floats --------------------
// rows(block, n, buf) returns n rows of hd floats (in place or decoded into buf, bs * hd floats);
// prefetch(block, n, near) asks for the block's bytes ahead (near: into L1, else L2).
// As asm on x86: GCC treats __builtin_prefetch as free of side effects and dropped these loops from the attention
// once they sat in a helper that does nothing but prefetch (prefetch_key_pass); asm volatile always stays.
inline void prefetch_bytes(const void* p, int64_t bytes, bool near) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) {
#if defined(__x86_64__)
    if (near)
      asm volatile("prefetcht0 %0" : : "m"(c[off]));
    else
      asm volatile("prefetcht1 %0" : : "m"(c[off]));
#else
    __builtin_prefetch(c + off, 0, near ? 3 : 2);
#endif
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

// The key pass's prefetches before it scores the block at t0 (of a range of len tokens in blocks of bs). Blocks
// lie anywhere in the pool, beyond the hardware prefetchers' reach, and scoring one block takes less time than
// a fetch from memory: fetched only one block ahead, each block's scoring waits on its keys. So the next block's
// keys are asked into L1 (from L2 by then), this block's values into L2 for the second pass, and the keys
// kKeysAhead blocks ahead into L2, in that order (the nearer fetches first).
constexpr int64_t kKeysAhead = 4;
template <typename KS, typename VS>
inline void prefetch_key_pass(const KS& ks, const VS& vs, const int64_t* table, int64_t t0, int64_t len, int64_t bs) {
  const int64_t i = t0 / bs;
  if (t0 + bs < len) ks.prefetch(table[i + 1], std::min(bs, len - t0 - bs), true);
  vs.prefetch(table[i], std::min(bs, len - t0), false);
  if (t0 + kKeysAhead * bs < len)
    ks.prefetch(table[i + kKeysAhead], std::min(bs, len - t0 - kKeysAhead * bs), false);
}

}  // namespace
