// Stored block quantization x int8 activations: w = scale * u + offset per group of 16 or 32 weights along K,
// u unsigned, scale and offset per group in fp32 or fp16 (fp16 where that holds a weight's every one exactly:
// Q4_0, Q4_1 and Q8_0 store fp16), or per super-block as a K-quant stores them (vnni_gemm.h tile_params). This
// holds GGUF's block formats exactly (Q4_0/Q4_1/Q4_K: u the nibble; Q2_K/Q3_K: their 2- and 3-bit values as
// nibbles; Q8_0: u = q + 128, offset -128 d; Q5_0/Q5_1/Q5_K: the 5-bit value; Q6_K: the 6-bit value in groups
// of 16; IQ4_NL/IQ4_XS: one of 16 levels plus 128), so a GGUF file runs on its stored values instead of a float
// copy.
//
// Four layouts of u, all in tiles of 16 output columns (a fifth: the nibble layout typed int8, whose nibbles
// index kLevelValues, IQ4's levels): nibbles (N/16, K/8, 64), the int4 GEMM's (byte 4c + e
// of vector j holds column c's k = 8j + e in its low nibble and 8j + 4 + e in its high one); 5-bit values
// (N/16, K/8, 80), each vector's 64 bytes of nibbles followed by two 64-bit masks of the fifth bits (bit 4c + e
// of the first: the low nibble's value of byte 4c + e is 16 more; of the second: the high nibble's), so
// Q5_0 / Q5_1 / Q5_K read 5 bits a weight, not 8; 6-bit values (N/16, K/8, 96), the 5-bit vector followed by two
// masks of sixth bits (32 more), for Q6_K; and bytes (N/16, K/4, 64) (byte 4c + e of vector j is column c's
// k = 4j + e). Groups are 32 or 16 weights in every layout but the levels' (32).
// Activations are quantized per 32 values as every other int8 path quantizes them (quantize_rows.h). Per group
// the int32 dot of u with the row's int8 values is scaled by scale x the block's dx, and offset x dx x sum(xq over
// the group) is added: the same arithmetic on every ISA, so AVX-512 VNNI (dpbusd), AVX2 (maddubs) and the scalar
// loop differ only in the order of float additions.

#include <torch/extension.h>

#include "cpu_kernels.h"
#include "simd.h"
#include "vnni_gemm.h"

// Rows from which CPUs without VNNI run a float GEMM on the dequantized weight instead (block_gemm), for weights
// up to kDequantMaxElements: a vocabulary projection stays on the int8 path rather than hold a float copy of
// itself (a thread's buffer keeps the largest weight it dequantized).
constexpr int64_t kDequantMinRows = 32;
constexpr int64_t kDequantMaxElements = int64_t{1} << 22;

namespace {

#ifdef MCP_INT4_VNNI
// R rows x C column tiles of 16, groups of G. wp: the first tile's packed weights (K/4 vectors of 64 bytes, the
// next tile tile_bytes further); so: the tile's scales and offsets (P = 2; P = 1: no offsets, each -128 x its
// scale; vnni_gemm.h group_param16); xq: R rows of K int8;
// dx: (row, 32-block) steps; dxs: (row, group) dx * sum(xq). out: R rows of stride N at the tile's first column.
template <int R, int C, int G, typename S, typename O>
void block_tile(const uint8_t* wp, const S* so, int64_t P, const int8_t* xq, const float* dx, const float* dxs,
                int64_t K, const float* bias, O* out, int64_t N, bool stream) {
  constexpr int kVectors = G / 4;  // 64-byte vectors per group
  const int64_t ngrp = K / G, nblk = K / 32, tile_bytes = (K / 4) * 64, tile_scales = tile_params<S>(K, G, P);
  const __m512 neg_center = _mm512_set1_ps(-value_center(8));
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ngrp; ++g) {
    __m512i dot[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dot[r][c] = _mm512_setzero_si512();
    for (int j = 0; j < kVectors; ++j) {
      __m512i w[C];
      for (int c = 0; c < C; ++c) {
        const uint8_t* src = wp + c * tile_bytes + (g * kVectors + j) * 64;
        if (stream) _mm_prefetch(reinterpret_cast<const char*>(src + kStreamAhead), _MM_HINT_NTA);
        w[c] = _mm512_loadu_si512(src);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i x = broadcast_dword(xq + r * K + g * G + j * 4);
        for (int c = 0; c < C; ++c) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], w[c], x);
      }
    }
    const int64_t blk = g * G / 32;
    for (int c = 0; c < C; ++c) {
      const S* st = so + c * tile_scales;
      const __m512 s = group_param16(st, g, 0, P, G);
      const __m512 o = P == 2 ? group_param16(st, g, 1, P, G) : _mm512_mul_ps(s, neg_center);
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(dx[r * nblk + blk]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), scale, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(o, _mm512_set1_ps(dxs[r * ngrp + g]), acc[r][c]);
      }
    }
  }
  store_tile<R, C>(acc, bias, out, N);
}

template <int C, int G, typename S, typename O>
void block_rows(const uint8_t* wp, const S* so, int64_t P, const QuantizedRows& xr, const float* dxs, int64_t M,
                int64_t K, const float* bias, O* out, int64_t N) {
  const int64_t nblk = K / 32, ngrp = K / G;
  for_row_tiles(M, [&](int64_t r0, auto rows) {
    block_tile<decltype(rows)::value, C, G, S, O>(wp, so, P, xr.q.data() + r0 * K, xr.scale.data() + r0 * nblk,
                                               dxs + r0 * ngrp, K, bias, out + r0 * N, N, M <= kGemmRows);
  });
}

template <int G, typename S, typename O>
void block_gemm_run(const QuantizedRows& xr, const float* dxs, const uint8_t* w, const S* s, int64_t P, int64_t M,
                    int64_t K, const float* bias, O* out, int64_t N) {
  const int64_t tiles = N / kColTile, tile_bytes = (K / 4) * 64, tile_scales = tile_params<S>(K, G, P);
  for_column_tiles(tiles, M, [&](int64_t t, bool pair) {
    const auto* wt = w + t * tile_bytes;
    const S* st = s + t * tile_scales;
    const float* bt = bias ? bias + t * kColTile : nullptr;
    if (pair)
      block_rows<2, G, S, O>(wt, st, P, xr, dxs, M, K, bt, out + t * kColTile, N);
    else
      block_rows<1, G, S, O>(wt, st, P, xr, dxs, M, K, bt, out + t * kColTile, N);
  });
}
#endif

// The values' width from the packed layout: nibbles (N/16, K/8, 64), 5-bit (N/16, K/8, 80), 6-bit (N/16, K/8, 96),
// bytes (N/16, K/4, 64); kLevelNibbles: int8 (N/16, K/8, 64).
inline int packed_bits(const torch::Tensor& wp, int64_t K) {
  const bool levels = wp.scalar_type() == torch::kChar;
  TORCH_CHECK((wp.scalar_type() == torch::kByte || levels) && wp.is_contiguous() && wp.dim() == 3,
              "wp must be contiguous uint8 (N/16, *, *), or int8 level indices");
  if (wp.size(1) * 8 == K && wp.size(2) == 64) return levels ? kLevelNibbles : 4;
  TORCH_CHECK(!levels, "int8 level indices must be (N/16, K/8, 64) for this K");
  if (wp.size(1) * 8 == K && wp.size(2) == 80) return 5;
  if (wp.size(1) * 8 == K && wp.size(2) == 96) return 6;
  TORCH_CHECK(wp.size(1) * 4 == K && wp.size(2) == 64,
              "wp must be (N/16, K/8, 64) nibbles, (N/16, K/8, 80) 5-bit or (N/16, K/8, 96) 6-bit values or "
              "(N/16, K/4, 64) bytes for this K");
  return 8;
}

// Bytes per vector of 8 k in a nibble layout: the nibbles, then two 64-bit masks per bit above the fourth.
constexpr int nibble_vector_bytes(int bits) { return bits == 6 ? 96 : bits == 5 ? 80 : 64; }

// u[n][k] from any layout (the scalar path and nothing hot).
inline int32_t stored_value(const uint8_t* w, int bits, int64_t n, int64_t k, int64_t K) {
  const int64_t t = n / kColTile, c = n % kColTile;
  if (bits != 8) {
    const int64_t vector_bytes = nibble_vector_bytes(bits), i = 4 * c + (k % 4);
    const uint8_t* v = w + (t * (K / 8) + k / 8) * vector_bytes;
    const bool low = (k % 8) < 4;
    const int32_t nib = low ? (v[i] & 0x0F) : (v[i] >> 4);
    if (bits == kLevelNibbles) return kLevelValues[nib];
    if (bits == 4) return nib;
    const uint8_t* fifth = v + (low ? 64 : 72);
    const int32_t u = nib | (((fifth[i / 8] >> (i % 8)) & 1) << 4);
    if (bits == 5) return u;
    const uint8_t* sixth = v + (low ? 80 : 88);
    return u | (((sixth[i / 8] >> (i % 8)) & 1) << 5);
  }
  return w[(t * (K / 4) + k / 4) * 64 + 4 * c + (k % 4)];
}

template <typename S>
void scalar_gemm(const uint8_t* w, const S* so, int64_t P, int bits, int64_t G, const QuantizedRows& xr,
                 const GroupSums& gs, int64_t M, int64_t K, int64_t N, float* out) {
  const int64_t ngrp = K / G, nblk = K / 32;
  team::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const S* st = so + (n / kColTile) * tile_params<S>(K, G, P);
      for (int64_t r = 0; r < M; ++r) {
        float acc = 0.f;
        for (int64_t g = 0; g < ngrp; ++g) {
          int32_t dot = 0;
          for (int64_t k = g * G; k < (g + 1) * G; ++k) dot += stored_value(w, bits, n, k, K) * xr.q[r * K + k];
          const auto [scale, offset] = group_scale_offset(st, n % kColTile, g, P, G, bits);
          acc += static_cast<float>(dot) * (scale * xr.scale[r * nblk + g * G / 32]) + offset * gs.dxs[r * ngrp + g];
        }
        out[r * N + n] = acc;
      }
    }
  });
}

// The whole weight as fp32 (N, K): scale * u + offset, tile by tile (reads the packed bytes in order).
template <typename S>
void dequantize_tiles(const uint8_t* w, const S* so, int64_t P, int bits, int64_t G, int64_t K, int64_t N,
                      float* out) {
  const int64_t tile_scales = tile_params<S>(K, G, P);
  auto group = [&](const S* st, int64_t c, int64_t g) { return group_scale_offset(st, c, g, P, G, bits); };
  if (bits == 5 || bits == 6) {  // not on a hot path of VNNI CPUs; the value lookup is the scalar GEMM's
    team::parallel_for(0, N, kColTile, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const S* st = so + (n / kColTile) * tile_scales;
        for (int64_t k = 0; k < K; ++k) {
          const auto [scale, offset] = group(st, n % kColTile, k / G);
          out[n * K + k] = scale * static_cast<float>(stored_value(w, bits, n, k, K)) + offset;
        }
      }
    });
    return;
  }
  const int64_t per_vector = bits == 8 ? 4 : 8, vectors = K / per_vector;
  team::parallel_for(0, N / kColTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* wt = w + t * vectors * 64;
      const S* st = so + t * tile_scales;
      for (int64_t j = 0; j < vectors; ++j)
        for (int64_t c = 0; c < kColTile; ++c) {
          float* row = out + (t * kColTile + c) * K;
          for (int64_t e = 0; e < 4; ++e) {
            const uint8_t byte = wt[j * 64 + 4 * c + e];
            const int64_t k = j * per_vector + e;
            const auto [s0, o0] = group(st, c, k / G);
            if (bits != 8) {
              const auto [s1, o1] = group(st, c, (k + 4) / G);
              const int lo = byte & 0x0F, hi = byte >> 4;
              const bool levels = bits == kLevelNibbles;
              row[k] = s0 * static_cast<float>(levels ? kLevelValues[lo] : lo) + o0;
              row[k + 4] = s1 * static_cast<float>(levels ? kLevelValues[hi] : hi) + o1;
            } else {
              row[k] = s0 * static_cast<float>(byte) + o0;
            }
          }
        }
    }
  });
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256i splat_dword(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// Rows R of one 8-column half of a 16-column tile (half h: bytes 32h.. of each 64-byte vector; one half at a
// time keeps R int32 dots and R float sums in registers). maddubs takes u8 x s8 pairs into int16: nibbles
// (<= 15) never saturate; bytes (u up to 255) could, so they are multiplied as signed q = u - 128 (|q| <= 128,
// the sign moved onto x) and 128 x sum(xq) is added back: the same int32 dot of u as dpbusd computes.
// The fifth (sixth) bits of 32 bytes (bit i of m for byte i) as 16 (32) in those bytes, 0 elsewhere.
inline __m256i high_bits(uint32_t m, int8_t value) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                          3, 3, 3, 3, 3, 3, 3);
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(m)), spread);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(value));
}

template <int R, int BITS, int G, typename S>
void avx2_half(const uint8_t* wt, const S* st, int64_t P, const QuantizedRows& xr, const GroupSums& gs, int64_t r0,
               int h, int64_t K, float* out, int64_t N) {
  constexpr int kPerVector = BITS == 8 ? 4 : 8, kVectors = G / kPerVector;
  constexpr int kVectorBytes = nibble_vector_bytes(BITS);
  // bytes, and level indices looked up as bytes: signed q = u - 128 in maddubs, 128 x sum(xq) added back
  constexpr bool kSigned = BITS == 8 || BITS == kLevelNibbles;
  const int64_t ngrp = K / G, nblk = K / 32;
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(-128);
  const __m256i levels =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kLevelValues)));
  const __m256 neg_center = _mm256_set1_ps(-value_center(BITS));
  const int8_t* xrow[R];
  for (int r = 0; r < R; ++r) xrow[r] = xr.q.data() + (r0 + r) * K;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ngrp; ++g) {
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    for (int j = 0; j < kVectors; ++j) {
      const uint8_t* vec = wt + (g * kVectors + j) * kVectorBytes;
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vec + 32 * h));
      const int64_t k = g * G + j * kPerVector;
      if constexpr (BITS == kLevelNibbles) {  // each nibble plane's levels as signed bytes, as the byte path below
        const __m256i lo = _mm256_and_si256(w, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
        const __m256i ql = _mm256_xor_si256(_mm256_shuffle_epi8(levels, lo), flip);
        const __m256i qh = _mm256_xor_si256(_mm256_shuffle_epi8(levels, hi), flip);
        const __m256i ml = _mm256_abs_epi8(ql), mh = _mm256_abs_epi8(qh);
        for (int r = 0; r < R; ++r) {
          const __m256i xl = _mm256_sign_epi8(splat_dword(xrow[r] + k), ql);
          const __m256i xh = _mm256_sign_epi8(splat_dword(xrow[r] + k + 4), qh);
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ml, xl), ones));
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mh, xh), ones));
        }
      } else if constexpr (BITS != 8) {  // nibbles (<= 15; with fifth and sixth bits <= 63): maddubs never saturates
        __m256i lo = _mm256_and_si256(w, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
        for (int plane = 0; plane < BITS - 4; ++plane) {  // the fifth (and sixth) bits' masks
          uint32_t mask_lo, mask_hi;
          std::memcpy(&mask_lo, vec + 64 + 16 * plane + 4 * h, 4);
          std::memcpy(&mask_hi, vec + 72 + 16 * plane + 4 * h, 4);
          lo = _mm256_or_si256(lo, high_bits(mask_lo, static_cast<int8_t>(16 << plane)));
          hi = _mm256_or_si256(hi, high_bits(mask_hi, static_cast<int8_t>(16 << plane)));
        }
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, splat_dword(xrow[r] + k)),
                                             _mm256_maddubs_epi16(hi, splat_dword(xrow[r] + k + 4)));
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(p, ones));
        }
      } else {
        const __m256i q = _mm256_xor_si256(w, flip), mag = _mm256_abs_epi8(q);
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_sign_epi8(splat_dword(xrow[r] + k), q);
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, x), ones));
        }
      }
    }
    const __m256 s = group_param8(st, g, 0, P, G, h);
    const __m256 o = P == 2 ? group_param8(st, g, 1, P, G, h) : _mm256_mul_ps(s, neg_center);
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      __m256i d = dot[r];
      if constexpr (kSigned) d = _mm256_add_epi32(d, _mm256_set1_epi32(128 * gs.isum[row * ngrp + g]));
      const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(xr.scale[row * nblk + g * G / 32]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(gs.dxs[row * ngrp + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + (r0 + r) * N + 8 * h, acc[r]);
}

template <int BITS, int G, typename S>
void avx2_gemm(const uint8_t* w, const S* so, int64_t P, const QuantizedRows& xr, const GroupSums& gs, int64_t M,
               int64_t K, int64_t N, float* out) {
  const int64_t tile_bytes = BITS == 8 ? (K / 4) * 64 : (K / 8) * nibble_vector_bytes(BITS);
  const int64_t tile_scales = tile_params<S>(K, G, P);
  team::parallel_for(0, N / kColTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int h = 0; h < 2; ++h)
        for_row_tiles(M, [&](int64_t r0, auto rows) {
          avx2_half<decltype(rows)::value, BITS, G, S>(w + t * tile_bytes, so + t * tile_scales, P, xr, gs, r0, h,
                                                    K, out + t * kColTile, N);
        });
  });
}
#endif

}  // namespace

// x (M, K) fp32/bf16; wp: u in the nibble (N/16, K/8, 64), 5-bit (N/16, K/8, 80) or byte (N/16, K/4, 64) layout; so
// fp32 or fp16. -> (M, N) in x's dtype. On AVX-512 VNNI, nibbles and 5-bit values go through int4_gemm (the same
// arithmetic).
torch::Tensor block_gemm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so,
                         const c10::optional<torch::Tensor>& bias) {
  return block_gemm_into(x, wp, so, bias, nullptr);
}

torch::Tensor block_gemm_into(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so,
                              const c10::optional<torch::Tensor>& bias, torch::Tensor* slot) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "x must be a CPU (M, K) tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
  const int64_t M = x.size(0), K = x.size(1), N = wp.size(0) * kColTile;
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  const int bits = packed_bits(wp, K);
  const auto [P, G] = scale_shape(so, N, K);
  TORCH_CHECK(G == 32 || (G == 16 && bits != kLevelNibbles), "groups must be 32 or 16 weights (levels: 32)");
#ifdef MCP_INT4_VNNI
  if (bits != 8) return int4_gemm_into(x, wp, so, bias, slot);  // its micro-tile reads every nibble layout
#else
  // Without VNNI the int8 dot products cost several instructions per 32 values, and from a few dozen rows a
  // float GEMM over the weight dequantized once per call is faster (a prefill chunk, a large batch): both the
  // fused and the per-op paths come through here, so a row's result depends only on its step's row count.
  if (M >= kDequantMinRows && N * K <= kDequantMaxElements && x.scalar_type() == torch::kFloat) {
    thread_local torch::Tensor buffer;
    if (!buffer.defined() || buffer.numel() < N * K) buffer = torch::empty({N * K}, x.options());
    auto w = buffer.narrow(0, 0, N * K).view({N, K});
    with_scales(so, [&](const auto* s) {
      dequantize_tiles(static_cast<const uint8_t*>(wp.data_ptr()), s, P, bits, G, K, N, w.data_ptr<float>());
    });
    auto out = at::matmul(x, w.t());
    return bias.has_value() ? out.add_(*bias) : out;
  }
#endif
  const auto xc = x.contiguous();
  QuantizedRows& xr = thread_rows();
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, xc.scalar_type(), "block_gemm_q", [&] {
    quantize_rows_into<scalar_t>(xr, xc.data_ptr<scalar_t>(), M, K);
  });
  const auto* w = static_cast<const uint8_t*>(wp.data_ptr());
#ifdef MCP_INT4_VNNI
  auto out = gemm_output(x, M, N, slot);
  const auto b = gemm_bias(bias, N);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  with_output(out, [&](auto* op) {
    with_scales(so, [&](const auto* s) {
      using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
      using O = std::remove_pointer_t<decltype(op)>;
      if (G == 32) {
        block_gemm_run<32, S, O>(xr, xr.sum.data(), w, s, P, M, K, bp, op, N);
      } else {
        const GroupSums gs = group_sums(xr, M, K, 16);
        block_gemm_run<16, S, O>(xr, gs.dxs.data(), w, s, P, M, K, bp, op, N);
      }
    });
  });
  return out;
#else
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  float* op = out.data_ptr<float>();
  with_scales(so, [&](const auto* s) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
    const GroupSums gs = group_sums(xr, M, K, G);
#if defined(__AVX2__) && defined(__FMA__)
    auto by_bits = [&](auto group) {
      constexpr int kG = decltype(group)::value;
      if (bits == 4)
        avx2_gemm<4, kG, S>(w, s, P, xr, gs, M, K, N, op);
      else if (bits == 5)
        avx2_gemm<5, kG, S>(w, s, P, xr, gs, M, K, N, op);
      else if (bits == 6)
        avx2_gemm<6, kG, S>(w, s, P, xr, gs, M, K, N, op);
      else
        avx2_gemm<8, kG, S>(w, s, P, xr, gs, M, K, N, op);
    };
    if (bits == kLevelNibbles)
      avx2_gemm<kLevelNibbles, 32, S>(w, s, P, xr, gs, M, K, N, op);
    else if (G == 32)
      by_bits(std::integral_constant<int, 32>{});
    else
      by_bits(std::integral_constant<int, 16>{});
#else
    scalar_gemm(w, s, P, bits, G, xr, gs, M, K, N, op);
#endif
  });
  if (bias.has_value()) out.add_(*bias);
  return x.scalar_type() == torch::kFloat ? out : out.to(x.scalar_type());
#endif
}

// The row count from which block_gemm runs the float GEMM (0: never, on VNNI builds) for a weight of n x k.
int64_t block_float_gemm_min_rows(int64_t n, int64_t k) {
#ifdef MCP_INT4_VNNI
  return 0;
#else
  return n * k <= kDequantMaxElements ? kDequantMinRows : 0;
#endif
}

// The weight as the kernel holds it, fp32 (N, K) (tests; the float GEMM path of CPUs without VNNI).
torch::Tensor block_dequant(const torch::Tensor& wp, const torch::Tensor& so, int64_t K) {
  const int64_t N = wp.size(0) * kColTile;
  const int bits = packed_bits(wp, K);
  const auto [P, G] = scale_shape(so, N, K);
  auto out = torch::empty({N, K}, so.options().dtype(torch::kFloat));
  with_scales(so, [&](const auto* s) {
    dequantize_tiles(static_cast<const uint8_t*>(wp.data_ptr()), s, P, bits, G, K, N, out.data_ptr<float>());
  });
  return out;
}

// The portable loop over the same layouts, on any CPU (tests hold the SIMD paths against it).
torch::Tensor block_gemm_reference(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so) {
  const int64_t M = x.size(0), K = x.size(1), N = wp.size(0) * kColTile;
  const int bits = packed_bits(wp, K);
  const auto [P, G] = scale_shape(so, N, K);
  const auto xc = x.contiguous().to(torch::kFloat);
  const QuantizedRows xr = quantize_rows<float>(xc.data_ptr<float>(), M, K);
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  with_scales(so, [&](const auto* s) {
    scalar_gemm(static_cast<const uint8_t*>(wp.data_ptr()), s, P, bits, G, xr, group_sums(xr, M, K, G), M, K, N,
                out.data_ptr<float>());
  });
  return out;
}

// Rows ids of a block weight as fp32 (T, K): scale * u + offset, the product rounded before the add, as
// BlockLinear.dequantize_rows computes it (a token embedding reads its table this way: one row a decode step).
torch::Tensor block_weight_rows(const torch::Tensor& wp, const torch::Tensor& so, int64_t K, const torch::Tensor& ids) {
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "ids must be a 1-D int64 tensor");
  const int64_t N = wp.size(0) * kColTile;
  const auto [P, G] = scale_shape(so, N, K);
  const int bits = packed_bits(wp, K);
  const auto ic = ids.contiguous();
  const int64_t T = ic.size(0);
  const int64_t* id = ic.data_ptr<int64_t>();
  for (int64_t r = 0; r < T; ++r)
    TORCH_CHECK_INDEX(id[r] >= 0 && id[r] < N, "token id out of range for a ", N, "-token vocabulary");
  auto out = torch::empty({T, K}, so.options().dtype(torch::kFloat));
  const auto* w = static_cast<const uint8_t*>(wp.data_ptr());
  float* op = out.data_ptr<float>();
  with_scales(so, [&](const auto* s) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(s)>>;
    const int64_t tile_scales = tile_params<S>(K, G, P);
    for (int64_t r = 0; r < T; ++r) {
      const int64_t n = id[r], t = n / kColTile, c = n % kColTile;
      const S* st = s + t * tile_scales;
      for (int64_t k = 0; k < K; ++k) {
        const auto [scale, offset] = group_scale_offset(st, c, k / G, P, G, bits);
        op[r * K + k] = mul_rounded(static_cast<float>(stored_value(w, bits, n, k, K)), scale) + offset;
      }
    }
  });
  return out;
}
