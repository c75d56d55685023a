// The helpers more than one kernel file uses, one definition each: an unfused float product, horizontal sums,
// the softmax / SiLU exponential (8 and 16 lanes from one scheme), and bf16 / fp16 widening.
#pragma once

#include <torch/extension.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace {

// a * b rounded to float, never fused into a following add (the build uses -ffp-contract=fast; torch computes
// a * b + c as two ops, two roundings, and the kernels that reproduce a torch formula bit for bit must too)
inline float mul_rounded(float a, float b) {
  float p = a * b;
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("" : "+x"(p));
#elif defined(__aarch64__)
  asm volatile("" : "+w"(p));
#else
  volatile float barrier = p;
  p = barrier;
#endif
  return p;
}

// A bf16 is the high half of its float.
inline float bf16_bits_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX2__)
// Eight bf16 values as floats.
inline __m256 bf16x8_to_float(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline float hmax(__m256 v) {
  __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}
#endif

#if defined(__AVX512F__)
// Sixteen bf16 values as floats.
inline __m512 bf16x16_to_float(const at::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// Eight (load8) or sixteen (load16) values as floats from fp32, bf16 or fp16 storage: the kernels templated on
// a storage type read through these.
#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) { return bf16x8_to_float(p); }
#if defined(__F16C__)
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif
#endif
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) { return bf16x16_to_float(p); }
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

// Eight (store8) or sixteen (store16) floats into fp32 or bf16 storage; bf16 rounded to nearest even as c10's
// float -> BFloat16 conversion rounds (NaN as 0x7FC0), so a kernel writing bf16 gives the bits of its fp32
// result converted afterwards.
#if defined(__AVX2__)
inline __m128i float8_to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), float8_to_bf16(v)); }
#endif
#if defined(__AVX512F__) && defined(__AVX2__)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {  // two halves: one rounding to keep in step with store8's
  store8(p, _mm512_castps512_ps256(v));
  store8(p + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

// One fp16, given as its bits, as a float.
inline float half_bits_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// n fp16 -> float, 8 at a time with F16C.
inline void halves_to_floats(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// ---- e^x for x <= 0, in 8 (AVX2) or 16 (AVX-512) lanes ---------------------------------------------------
// Cephes' expf scheme: x = n ln2 + r, e^r by a degree-6 polynomial, 2^n through the exponent bits. Relative
// error ~2e-7; inputs below -87 give 0 (as e^x underflows). FloatLanes<W> holds the few operations that differ
// between widths of W floats, so the scheme and its constants are written once.
template <int W>
struct FloatLanes;

#if defined(__AVX2__) && defined(__FMA__)
template <>
struct FloatLanes<8> {
  using V = __m256;
  using Mask = __m256;
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V floor(V x) { return _mm256_floor_ps(x); }
  static Mask less(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static V pow2(V n) {  // n integral
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static V mul_or_zero(Mask zero, V a, V b) { return _mm256_andnot_ps(zero, _mm256_mul_ps(a, b)); }
};
#endif

#if defined(__AVX512F__)
template <>
struct FloatLanes<16> {
  using V = __m512;
  using Mask = __mmask16;
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V floor(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static Mask less(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static V pow2(V n) {  // n integral
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static V mul_or_zero(Mask zero, V a, V b) { return _mm512_maskz_mul_ps(static_cast<__mmask16>(~zero), a, b); }
};
#endif

template <typename L>
inline typename L::V exp_nonpositive_lanes(typename L::V x) {
  using V = typename L::V;
  const V lo = L::set1(-87.3f);
  const typename L::Mask is_tiny = L::less(x, lo);
  x = L::max(x, lo);
  const V n = L::floor(L::fmadd(x, L::set1(1.44269504088896341f), L::set1(0.5f)));
  V r = L::fnmadd(n, L::set1(0.693359375f), x);
  r = L::fnmadd(n, L::set1(-2.12194440e-4f), r);
  V y = L::set1(1.9875691500e-4f);
  y = L::fmadd(y, r, L::set1(1.3981999507e-3f));
  y = L::fmadd(y, r, L::set1(8.3334519073e-3f));
  y = L::fmadd(y, r, L::set1(4.1665795894e-2f));
  y = L::fmadd(y, r, L::set1(1.6666665459e-1f));
  y = L::fmadd(y, r, L::set1(5.0000001201e-1f));
  y = L::fmadd(y, L::mul(r, r), L::add(r, L::set1(1.f)));
  return L::mul_or_zero(is_tiny, y, L::pow2(n));
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_nonpositive(__m256 x) { return exp_nonpositive_lanes<FloatLanes<8>>(x); }
#endif
#if defined(__AVX512F__)
inline __m512 exp_nonpositive(__m512 x) { return exp_nonpositive_lanes<FloatLanes<16>>(x); }
#endif

}  // namespace
