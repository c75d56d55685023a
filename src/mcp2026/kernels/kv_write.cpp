// K/V rows into one layer's paged cache planes, one call per layer: as they are (fp32, bf16, fp16), encoded with
// a per-token codec (int8, fp8 e4m3), or whole blocks sealed with the int4 (KIVI) codec.
//
// Through torch ops, encoding one decode step's K and V rows costs ~20 dispatches per plane and layer (aminmax,
// the fp16 rounding of scale and zero, divide, round, clamp, casts, index_copy_): ~7 ms of a ~25 ms step for
// SmolLM2 at 4k context, more than the int8 cache saves on the attention reads. This does the same arithmetic
// per (token, head) row and writes the codes, scales and zero points straight into the pool rows.
//
// The bytes must be exactly what kv/codecs.py's encoders store (a prefix-cache hit of a block written here has
// to equal a fresh prefill's; tests compare bit for bit): the same float32 operations in the same order, fp16
// rounded to nearest even then nudged one fp16 step (torch.nextafter) where it landed on the wrong side, true
// division (not a reciprocal), round half to even, and torch's own float -> e4m3 conversion.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "simd.h"
#include "thread_team.h"

namespace {

// ---- rows as they are -----------------------------------------------------------------------------------------
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

}  // namespace

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

namespace {

constexpr float kFp16Tiny = 6.103515625e-05f;  // 2^-14, the smallest normal fp16: the floor of every scale

// One fp16 step from h towards +inf (up) or -inf, as torch.nextafter on float16 (finite h).
uint16_t fp16_step(uint16_t h, bool up) {
  const bool negative = h & 0x8000;
  if ((h & 0x7FFF) == 0) return up ? 0x0001 : 0x8001;  // +-0 -> the smallest subnormal of that direction
  return (negative != up) ? h + 1 : h - 1;              // away from zero: magnitude + 1; towards it: - 1
}

// kv/codecs.py _round_fp16: the nearest fp16 at or above (up) / at or below x, as float.
float round_fp16(float x, bool up) {
  uint16_t h = c10::Half(x).x;
  const float back = static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  if (up ? back < x : back > x) h = fp16_step(h, up);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// exact: already an fp16 value; NaN as the torch encoders store it (torch 2.13 on x86: 0x7FFF)
uint16_t fp16_bits(float exact) { return std::isnan(exact) ? 0x7FFF : c10::Half(exact).x; }

template <typename S>
void widen(const S* src, int64_t hd, float* dst) {
  for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<float>(src[d]);
}

// Int8PerToken.encode for one row: (scale, zero) from its min and max, codes round((x - zero) / scale).
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A NaN anywhere makes a row's statistics NaN, as torch's aminmax / amax do (std::min / max would skip it).
void encode_int8_row(const float* x, int64_t hd, uint8_t* q, uint16_t* scale_out, uint16_t* zero_out) {
  float lo = x[0], hi = x[0];
  bool nan = false;
  for (int64_t d = 0; d < hd; ++d) {
    lo = std::min(lo, x[d]);
    hi = std::max(hi, x[d]);
    nan |= std::isnan(x[d]);
  }
  if (nan) lo = hi = kNaN;
  const float zero = round_fp16(lo, false) + 0.f;  // -0 -> +0 (codecs.py too): min's pick among zeros varies
  const float scale = round_fp16(std::max((hi - zero) / 255.f, kFp16Tiny), true);
  int64_t d = 0;
#if defined(__AVX2__)
  const __m256 zv = _mm256_set1_ps(zero), sv = _mm256_set1_ps(scale);
  const __m256 lim = _mm256_set1_ps(255.f), nil = _mm256_setzero_ps();
  alignas(32) int32_t codes[8];
  for (; d + 8 <= hd; d += 8) {
    __m256 c = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + d), zv), sv);
    c = _mm256_round_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm256_min_ps(_mm256_max_ps(c, nil), lim);
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes), _mm256_cvtps_epi32(c));
    for (int j = 0; j < 8; ++j) q[d + j] = static_cast<uint8_t>(codes[j]);
  }
#endif
  for (; d < hd; ++d) {
    const float c = std::nearbyint((x[d] - zero) / scale);
    q[d] = static_cast<uint8_t>(c > 0.f ? (c < 255.f ? c : 255.f) : 0.f);  // NaN -> 0, as the vector path
  }
  *scale_out = fp16_bits(scale);
  *zero_out = fp16_bits(zero);
}

// Fp8PerToken.encode for one row: scale maps max |x| to 448 (rounded up to fp16), codes e4m3(x / scale).
void encode_fp8_row(const float* x, int64_t hd, uint8_t* q, uint16_t* scale_out) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t d = 0; d < hd; ++d) {
    amax = std::max(amax, std::fabs(x[d]));
    nan |= std::isnan(x[d]);
  }
  if (nan) amax = kNaN;
  const float scale = round_fp16(std::max(amax / 448.f, kFp16Tiny), true);
  for (int64_t d = 0; d < hd; ++d) q[d] = c10::detail::fp8e4m3fn_from_fp32_value(x[d] / scale);
  *scale_out = fp16_bits(scale);
}

struct RowPlanes {  // one tensor's destination planes for a layer, as R rows of hd codes / R scales
  uint8_t* q;
  uint16_t* scale;
  uint16_t* zero;  // int8 only
};

RowPlanes row_planes(int64_t kind, const std::vector<torch::Tensor>& planes, int64_t hd, const char* name) {
  const size_t expected = kind == 1 ? 3 : 2;
  TORCH_CHECK(planes.size() == expected, name, ": kind ", kind, " takes ", expected, " planes");
  for (const auto& p : planes) TORCH_CHECK(p.device().is_cpu() && p.is_contiguous(), name, " planes must be contiguous CPU tensors");
  const auto data_type = kind == 3 ? at::ScalarType::Float8_e4m3fn : torch::kByte;
  TORCH_CHECK(planes[0].scalar_type() == data_type, name, " codes must be ", data_type, ", got ", planes[0].scalar_type());
  TORCH_CHECK(planes[0].dim() >= 2 && planes[0].size(-1) == hd, name, " codes must be (..., ", hd, ")");
  const int64_t R = planes[0].numel() / hd;
  for (size_t i = 1; i < planes.size(); ++i)
    TORCH_CHECK(planes[i].scalar_type() == torch::kHalf && planes[i].numel() == R, name,
                " scales and zero points must be fp16, one per row");
  return RowPlanes{static_cast<uint8_t*>(planes[0].data_ptr()), reinterpret_cast<uint16_t*>(planes[1].data_ptr()),
                   kind == 1 ? reinterpret_cast<uint16_t*>(planes[2].data_ptr()) : nullptr};
}

// Rows i of src[0] (K) and src[1] (V) into row rp[i] of dst[0] / dst[1].
template <typename S>
void encode_rows(int64_t kind, const S* const src[2], const RowPlanes dst[2], const int64_t* rp, int64_t n, int64_t hd) {
  team::parallel_for(0, n, std::max<int64_t>(1, 4096 / hd), [&](int64_t begin, int64_t end) {
    std::vector<float> x(hd);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = rp[i];
      for (int which = 0; which < 2; ++which) {
        const RowPlanes& p = dst[which];
        const float* row = x.data();
        if constexpr (std::is_same_v<S, float>)
          row = src[which] + i * hd;
        else
          widen(src[which] + i * hd, hd, x.data());
        if (kind == 1)
          encode_int8_row(row, hd, p.q + r * hd, p.scale + r, p.zero + r);
        else
          encode_fp8_row(row, hd, p.q + r * hd, p.scale + r);
      }
    }
  });
}

}  // namespace

// k, v: (T, nkv, hd) float32 or bf16; rows: (T * nkv,) destination row of each (token, head), token-major, in
// planes of R rows: kind 1 (q uint8 (..., hd), scale fp16, zero fp16, R each), kind 3 (q float8_e4m3fn (..., hd),
// scale fp16): one layer's pool planes as kv/paged_cache.py holds them, (num_blocks, nkv, bs[, hd]).
void write_kv_rows_quantized(int64_t kind, const std::vector<torch::Tensor>& kp, const std::vector<torch::Tensor>& vp,
                             const torch::Tensor& rows, const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(kind == 1 || kind == 3, "kind must be 1 (int8) or 3 (fp8)");
  TORCH_CHECK(k.device().is_cpu() && (k.scalar_type() == torch::kFloat || k.scalar_type() == torch::kBFloat16),
              "k must be float32 or bfloat16 on the CPU, got ", k.scalar_type());
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k.dim() == 3 && k.sizes() == v.sizes(),
              "k and v must be (T, nkv, hd) of one dtype");
  const int64_t T = k.size(0), nkv = k.size(1), hd = k.size(2);
  TORCH_CHECK(hd >= 1, "head_dim must be >= 1");
  const RowPlanes kd = row_planes(kind, kp, hd, "K"), vd = row_planes(kind, vp, hd, "V");
  const int64_t R = kp[0].numel() / hd;
  TORCH_CHECK(vp[0].numel() / hd == R, "K and V planes must hold the same rows");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.dim() == 1 && rows.size(0) == T * nkv,
              "rows must be int64 (T * nkv,)");
  const auto rc = rows.contiguous();
  const int64_t* rp = rc.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * nkv; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < R, "row ", rp[i], " is outside the pool's ", R);
  const auto kc = k.contiguous(), vc = v.contiguous();
  const RowPlanes dst[2] = {kd, vd};
  if (kc.scalar_type() == torch::kFloat) {
    const float* const src[2] = {kc.data_ptr<float>(), vc.data_ptr<float>()};
    encode_rows(kind, src, dst, rp, T * nkv, hd);
  } else {
    const at::BFloat16* const src[2] = {kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>()};
    encode_rows(kind, src, dst, rp, T * nkv, hd);
  }
}

// ---- int4 (KIVI) block seals ---------------------------------------------------------------------------------
// Int4PerChannel / Int4PerTokenGroup.encode for whole blocks, written straight into the pool: the blocks a step
// seals (a prefill chunk seals most of its tokens) took ~15 torch ops per tensor and layer plus the copies into
// four planes. Same bytes as kv/codecs.py (coded_affine_params, _quantize, _pack4); tests compare bit for bit.

namespace {

// coded_affine_params(lo, hi, 15) over one chunk's n groups: float scale / zero to quantize with, the uint8
// codes and the chunk's fp16 meta (zmin, dz, ds). Inputs are finite and within fp16's range (the caller checks).
void coded_affine(const float* lo, const float* hi, int64_t n, float* scale, float* zero, uint8_t* scode,
                  uint8_t* zcode, uint16_t* meta) {
  constexpr float kLevels = 15.f;
  float lo_min = lo[0], lo_max = lo[0];
  for (int64_t i = 1; i < n; ++i) {
    lo_min = std::min(lo_min, lo[i]);
    lo_max = std::max(lo_max, lo[i]);
  }
  const float zmin = round_fp16(lo_min, false) + 0.f;  // -0 -> +0, as codecs.py
  const float dz = round_fp16(std::max((lo_max - zmin) / 255.f, kFp16Tiny), true);
  float need_max = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    float code = std::min(std::max(std::floor((lo[i] - zmin) / dz), 0.f), 255.f);
    if (zmin + mul_rounded(code, dz) > lo[i]) code = std::max(code - 1.f, 0.f);
    zero[i] = zmin + mul_rounded(code, dz);
    zcode[i] = static_cast<uint8_t>(code);
    scale[i] = (hi[i] - zero[i]) / kLevels;  // "need", until ds is known
    need_max = i ? std::max(need_max, scale[i]) : scale[i];
  }
  const float ds = round_fp16(std::max(need_max / 254.f, kFp16Tiny), true);
  for (int64_t i = 0; i < n; ++i) {
    float code = std::min(std::max(std::ceil(scale[i] / ds), 1.f), 254.f);
    if (zero[i] + mul_rounded(kLevels, mul_rounded(code, ds)) < hi[i]) code += 1.f;
    scode[i] = static_cast<uint8_t>(code);
    scale[i] = mul_rounded(code, ds);
  }
  meta[0] = fp16_bits(zmin);
  meta[1] = fp16_bits(dz);
  meta[2] = fp16_bits(ds);
}

inline uint8_t code4(float x, float zero, float scale) {
  const float c = std::nearbyint((x - zero) / scale);
  return static_cast<uint8_t>(c > 0.f ? (c < 15.f ? c : 15.f) : 0.f);
}

struct Int4Planes {  // one tensor's planes for a layer, flattened to (num_blocks * nkv, ...)
  uint8_t* q;
  uint8_t* scale;
  uint8_t* zero;
  uint16_t* meta;
  int64_t chunks;
};

Int4Planes int4_planes(const std::vector<torch::Tensor>& p, int64_t bs, int64_t hd, int64_t groups, const char* name) {
  TORCH_CHECK(p.size() == 4, name, ": int4 takes 4 planes (q, scale, zero, meta)");
  for (const auto& t : p) TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " planes must be contiguous CPU tensors");
  const int64_t chunks = p[0].numel() / (bs * hd / 2);
  TORCH_CHECK(p[0].scalar_type() == torch::kByte && p[0].numel() == chunks * bs * hd / 2, name, " codes must be uint8 (chunks, ", bs, ", ", hd / 2, ")");
  TORCH_CHECK(p[1].scalar_type() == torch::kByte && p[2].scalar_type() == torch::kByte && p[1].numel() == chunks * groups &&
                  p[2].numel() == chunks * groups,
              name, " scale and zero codes must be uint8, ", groups, " per chunk");
  TORCH_CHECK(p[3].scalar_type() == torch::kHalf && p[3].numel() == chunks * 3, name, " meta must be fp16, 3 per chunk");
  return Int4Planes{static_cast<uint8_t*>(p[0].data_ptr()), static_cast<uint8_t*>(p[1].data_ptr()),
                    static_cast<uint8_t*>(p[2].data_ptr()), reinterpret_cast<uint16_t*>(p[3].data_ptr()), chunks};
}

// One block of one head: x rows t at x + t * stride (bs rows of hd), per-channel (keys) or per-token groups of g
// channels (values, g > 0).
template <typename S>
void seal_chunk(const S* x, int64_t stride, int64_t bs, int64_t hd, int64_t g, const Int4Planes& p, int64_t c,
                std::vector<float>& buf, std::vector<uint8_t>& codes) {
  const int64_t groups = g ? bs * (hd / g) : hd;
  buf.resize(bs * hd + 4 * groups);
  float* xf = buf.data();
  float *lo = xf + bs * hd, *hi = lo + groups, *scale = hi + groups, *zero = scale + groups;
  for (int64_t t = 0; t < bs; ++t)
    for (int64_t d = 0; d < hd; ++d) xf[t * hd + d] = static_cast<float>(x[t * stride + d]);
  if (!g) {
    for (int64_t d = 0; d < hd; ++d) lo[d] = hi[d] = xf[d];
    for (int64_t t = 1; t < bs; ++t)
      for (int64_t d = 0; d < hd; ++d) {
        lo[d] = std::min(lo[d], xf[t * hd + d]);
        hi[d] = std::max(hi[d], xf[t * hd + d]);
      }
  } else {
    for (int64_t i = 0; i < groups; ++i) {
      const float* v = xf + i * g;
      lo[i] = hi[i] = v[0];
      for (int64_t d = 1; d < g; ++d) {
        lo[i] = std::min(lo[i], v[d]);
        hi[i] = std::max(hi[i], v[d]);
      }
    }
  }
  coded_affine(lo, hi, groups, scale, zero, p.scale + c * groups, p.zero + c * groups, p.meta + c * 3);
  // codes per row (each element's group looked up by stepping, no integer division), then packed in pairs
  uint8_t* q = p.q + c * bs * hd / 2;
  codes.resize(hd);
  for (int64_t t = 0; t < bs; ++t) {
    const float* row = xf + t * hd;
    if (!g) {
      for (int64_t d = 0; d < hd; ++d) codes[d] = code4(row[d], zero[d], scale[d]);
    } else {
      for (int64_t i = 0, d = 0; d < hd; ++i) {
        const float z = zero[t * (hd / g) + i], s = scale[t * (hd / g) + i];
        for (const int64_t e = d + g; d < e; ++d) codes[d] = code4(row[d], z, s);
      }
    }
    for (int64_t d = 0; d < hd; d += 2) q[t * hd / 2 + d / 2] = codes[d] | (codes[d + 1] << 4);
  }
}

}  // namespace

// x: (NS * bs, nkv, hd) float32 or bf16, the sealed blocks' tokens (block-major); chunks: (NS * nkv,)
// int64, the destination chunk (block * nkv + head) of each (block, head), block-major; planes (q, scale, zero,
// meta) of one layer as kv/paged_cache.py holds them; group 0: Int4PerChannel (keys), else Int4PerTokenGroup's
// channels per group (values). Returns false, writing nothing, when x holds a NaN, an infinity or a value
// beyond fp16's range (the torch path encodes those).
bool seal_int4_blocks(const std::vector<torch::Tensor>& planes, const torch::Tensor& chunks, const torch::Tensor& x,
                      int64_t bs, int64_t group) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "x must be float32 or bfloat16 on the CPU, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 3 && bs >= 1 && x.size(0) % bs == 0, "x must be (NS * bs, nkv, hd)");
  const int64_t ns = x.size(0) / bs, nkv = x.size(1), hd = x.size(2);
  TORCH_CHECK(hd % 2 == 0 && (group == 0 || (group > 0 && hd % group == 0)),
              "head_dim must be even and a multiple of the value group");
  const Int4Planes p = int4_planes(planes, bs, hd, group ? bs * (hd / group) : hd, group ? "V" : "K");
  TORCH_CHECK(chunks.scalar_type() == torch::kLong && chunks.dim() == 1 && chunks.size(0) == ns * nkv,
              "chunks must be int64 (NS * nkv,)");
  const auto cc = chunks.contiguous();
  const int64_t* cp = cc.data_ptr<int64_t>();
  for (int64_t i = 0; i < ns * nkv; ++i)
    TORCH_CHECK(cp[i] >= 0 && cp[i] < p.chunks, "chunk ", cp[i], " is outside the pool's ", p.chunks);
  const auto xc = x.contiguous();
  // NaN, infinities and values past fp16's range (their fp16 statistics overflow to NaN, whose bits torch
  // chooses) are left to the torch path; aminmax propagates NaN, so one test covers all three
  const auto [lo, hi] = at::aminmax(xc);
  if (!(lo.item<float>() > -65504.f && hi.item<float>() < 65504.f)) return false;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, xc.scalar_type(), "seal_int4_blocks", [&] {
    const scalar_t* base = xc.data_ptr<scalar_t>();
    team::parallel_for(0, ns * nkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      std::vector<uint8_t> codes;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s = i / nkv, h = i % nkv;
        seal_chunk(base + (s * bs * nkv + h) * hd, nkv * hd, bs, hd, group, p, cp[i], buf, codes);
      }
    });
  });
  return true;
}
