// Quantize-on-write for the per-token KV codecs (int8, fp8 e4m3) in one call per layer.
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
#include <limits>
#include <type_traits>
#include <vector>

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
  const float zero = round_fp16(lo, false);
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
  at::parallel_for(0, n, std::max<int64_t>(1, 4096 / hd), [&](int64_t begin, int64_t end) {
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
