// The elementwise chains of a decoder layer, one call each: residual add + RMSNorm, RoPE, the gated
// activations (SiLU or tanh-GELU of the gate times up), and the per-head q/k norms.
// At decode sizes every torch op costs a few microseconds to dispatch, more than its arithmetic; these fold a
// chain of them into one pass. All arithmetic is float32; bf16 tensors are widened on load and rounded once on
// store.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_kernels.h"
#include "simd.h"
#include "thread_team.h"

namespace {

// The kernels here split rows across threads once a thread's share holds this many values (a batch-1 decode
// step stays on the calling thread; a batched one, 32 rows of SiLU x up over 1536 values, no longer runs on one
// thread while the others wait). A row's arithmetic is the same either way.
constexpr int64_t kParallelValues = 4096;

inline int64_t row_grain(int64_t values_per_row) {
  return std::max<int64_t>(1, kParallelValues / std::max<int64_t>(values_per_row, 1));
}

// ---- residual add + RMSNorm ------------------------------------------------------------------------------
// residual += x (in place, when x is given), then out = residual / rms(residual) * weight, in out_dtype.
template <typename T, typename R, typename O, typename W>
void add_rms_norm_impl(const T* x, R* res, const W* w, O* out, int64_t rows, int64_t hidden, float eps) {
  team::parallel_for(0, rows, row_grain(hidden), [&](int64_t r0, int64_t r1) {
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
    for (int64_t i = 0; i < hidden; ++i)
      orow[i] = static_cast<O>(static_cast<float>(rr[i]) * inv * static_cast<float>(w[i]));
  }
  });
}

}  // namespace

torch::Tensor add_rms_norm(const torch::Tensor& residual, const c10::optional<torch::Tensor>& x,
                           const torch::Tensor& weight, double eps, c10::ScalarType out_dtype) {
  return add_rms_norm_into(residual, x, weight, eps, out_dtype, nullptr);
}

torch::Tensor add_rms_norm_into(const torch::Tensor& residual, const c10::optional<torch::Tensor>& x,
                                const torch::Tensor& weight, double eps, c10::ScalarType out_dtype,
                                torch::Tensor* slot) {
  check_cpu_float(residual, "residual");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be a contiguous (T, H) tensor");
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  torch::Tensor xc;
  if (x.has_value()) {
    check_cpu_float(*x, "x");
    TORCH_CHECK(x->sizes() == residual.sizes(), "x and residual must have one shape");
    xc = x->contiguous();
  }
  // A bf16 weight is read as it is (widening is exact): converting it to fp32 on every call allocated a copy
  // per norm per step.
  const auto wc = weight.scalar_type() == torch::kBFloat16 ? weight.contiguous() : weight.to(torch::kFloat).contiguous();
  TORCH_CHECK(wc.numel() == hidden, "weight must have H elements");
  auto out = slot_or_empty(slot, {rows, hidden}, residual.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, residual.scalar_type(), "add_rms_norm_res", [&] {
    using R = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, out_dtype, "add_rms_norm_out", [&] {
      using O = scalar_t;
      auto run = [&](const auto* w) {
        if (!x.has_value()) {
          add_rms_norm_impl<float, R, O>(nullptr, residual.data_ptr<R>(), w, out.data_ptr<O>(), rows, hidden,
                                         static_cast<float>(eps));
        } else if (xc.scalar_type() == torch::kFloat) {
          add_rms_norm_impl<float, R, O>(xc.data_ptr<float>(), residual.data_ptr<R>(), w, out.data_ptr<O>(), rows,
                                         hidden, static_cast<float>(eps));
        } else {
          add_rms_norm_impl<at::BFloat16, R, O>(xc.data_ptr<at::BFloat16>(), residual.data_ptr<R>(), w,
                                                out.data_ptr<O>(), rows, hidden, static_cast<float>(eps));
        }
      };
      if (wc.scalar_type() == torch::kBFloat16)
        run(wc.data_ptr<at::BFloat16>());
      else
        run(wc.data_ptr<float>());
    });
  });
  return out;
}

// ---- RoPE (rotate-half convention), in place --------------------------------------------------------------
// x: (T, heads, hd) with contiguous (heads, hd) rows (any row stride); cos, sin: (T, rot), float32 or x's dtype,
// rot <= hd: the first rot dims of each head rotate (pairs i, i + rot/2), the rest pass through (partial rotary).
namespace {

template <typename T, typename C>
void rope_impl(T* x, int64_t row_stride, const C* cos, const C* sin, int64_t rows, int64_t heads, int64_t hd,
               int64_t rot) {
  const int64_t half = rot / 2;
  team::parallel_for(0, rows, row_grain(heads * hd), [&](int64_t r0, int64_t r1) {
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

}  // namespace

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

// ---- gated activations: SiLU(gate) * up, tanh-GELU(gate) * up ----------------------------------------------
// gate_up: (T, 2I) as [gate | up] -> (T, I) in out_dtype.
// Both are gate * sigmoid(z) * up: SiLU with z = gate; the tanh-approximated GELU (Gemma's GeGLU) with
// z = 2 sqrt(2/pi) (gate + 0.044715 gate^3), since (1 + tanh(z/2)) / 2 = sigmoid(z). sigmoid through
// e = exp(-|z|) (never overflows): 1 / (1 + e) for z >= 0, else e / (1 + e). fp32 and bf16 rows take 8 lanes at
// a time with exp_nonpositive (simd.h); fp16 and the tail, std::exp.
namespace {

enum class Gate { kSilu, kGeluTanh };

constexpr float kGeluZ1 = 1.5957691216057308f;          // 2 sqrt(2 / pi)
constexpr float kGeluZ3 = 1.5957691216057308f * 0.044715f;

template <Gate G>
inline float gate_arg(float a) {
  if constexpr (G == Gate::kSilu) return a;
  else return a * (kGeluZ1 + kGeluZ3 * a * a);
}

template <Gate G>
inline float gated_scalar(float a) {
  const float z = gate_arg<G>(a);
  const float e = std::exp(-std::fabs(z));
  return a * ((z >= 0.f ? 1.f : e) / (1.f + e));
}

template <Gate G, typename T, typename O>
void gated_mul_impl(const T* gu, O* out, int64_t rows, int64_t inter) {
  team::parallel_for(0, rows, row_grain(2 * inter), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      O* o = out + r * inter;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
      constexpr bool vector_in = std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>;
      constexpr bool vector_out = std::is_same_v<O, float> || std::is_same_v<O, at::BFloat16>;
      if constexpr (vector_in && vector_out) {
        const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
        for (; i + 8 <= inter; i += 8) {
          const __m256 a = load8(g + i);
          __m256 z = a;
          if constexpr (G == Gate::kGeluTanh)
            z = _mm256_mul_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(kGeluZ3), _mm256_mul_ps(a, a),
                                                 _mm256_set1_ps(kGeluZ1)));
          const __m256 e = exp_nonpositive(_mm256_or_ps(z, sign));  // exp(-|z|)
          const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_GE_OQ));
          const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
          store8(o + i, _mm256_mul_ps(_mm256_mul_ps(a, sig), load8(u + i)));
        }
      }
#endif
      for (; i < inter; ++i) o[i] = static_cast<O>(gated_scalar<G>(static_cast<float>(g[i])) * static_cast<float>(u[i]));
    }
  });
}

template <Gate G>
torch::Tensor gated_mul_into(const torch::Tensor& gate_up, c10::ScalarType out_dtype, torch::Tensor* slot) {
  check_cpu_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be (T, 2I)");
  const auto gc = gate_up.contiguous();
  const int64_t rows = gc.size(0), inter = gc.size(1) / 2;
  auto out = slot_or_empty(slot, {rows, inter}, gc.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, gc.scalar_type(), "gated_mul_in", [&] {
    using T = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, out_dtype, "gated_mul_out", [&] {
      gated_mul_impl<G, T, scalar_t>(gc.data_ptr<T>(), out.data_ptr<scalar_t>(), rows, inter);
    });
  });
  return out;
}

}  // namespace

torch::Tensor silu_mul(const torch::Tensor& gate_up, c10::ScalarType out_dtype) {
  return gated_mul_into<Gate::kSilu>(gate_up, out_dtype, nullptr);
}

torch::Tensor silu_mul_into(const torch::Tensor& gate_up, c10::ScalarType out_dtype, torch::Tensor* slot) {
  return gated_mul_into<Gate::kSilu>(gate_up, out_dtype, slot);
}

torch::Tensor gelu_tanh_mul(const torch::Tensor& gate_up, c10::ScalarType out_dtype) {
  return gated_mul_into<Gate::kGeluTanh>(gate_up, out_dtype, nullptr);
}

torch::Tensor gelu_tanh_mul_into(const torch::Tensor& gate_up, c10::ScalarType out_dtype, torch::Tensor* slot) {
  return gated_mul_into<Gate::kGeluTanh>(gate_up, out_dtype, slot);
}

// ---- per-head RMSNorm (q/k norms), in place ------------------------------------------------------------------
// x: (T, heads, hd) with contiguous (heads, hd) rows (any row stride): heads < nq scale by q_w, the others by
// k_w (both hd long), each head normalized over its own hd values.
namespace {

template <typename T, typename W>
void rms_norm_heads_impl(T* x, int64_t row_stride, const W* qw, const W* kw, int64_t rows, int64_t heads,
                         int64_t nq, int64_t hd, float eps) {
  team::parallel_for(0, rows, row_grain(heads * hd), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        T* p = x + r * row_stride + h * hd;
        const W* w = h < nq ? qw : kw;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < hd; ++i) {
          const float v = static_cast<float>(p[i]);
          ss += v * v;
        }
        const float inv = 1.f / std::sqrt(ss / static_cast<float>(hd) + eps);
        for (int64_t i = 0; i < hd; ++i)
          p[i] = static_cast<T>(static_cast<float>(p[i]) * inv * static_cast<float>(w[i]));
      }
    }
  });
}

}  // namespace

void rms_norm_heads_(torch::Tensor& x, const torch::Tensor& q_weight, const torch::Tensor& k_weight, int64_t nq,
                     double eps) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be (T, heads, hd) rows");
  const int64_t rows = x.size(0), heads = x.size(1), hd = x.size(2);
  TORCH_CHECK(nq >= 0 && nq <= heads, "nq must be within the heads");
  TORCH_CHECK(q_weight.numel() == hd && k_weight.numel() == hd, "the q and k norm weights must have hd elements");
  TORCH_CHECK(q_weight.scalar_type() == k_weight.scalar_type(), "the q and k norm weights must share a dtype");
  const bool bf16 = q_weight.scalar_type() == torch::kBFloat16;
  const auto qw = bf16 ? q_weight.contiguous() : q_weight.to(torch::kFloat).contiguous();
  const auto kw = bf16 ? k_weight.contiguous() : k_weight.to(torch::kFloat).contiguous();
  if (rows == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rms_norm_heads", [&] {
    if (bf16)
      rms_norm_heads_impl(x.data_ptr<scalar_t>(), x.stride(0), qw.data_ptr<at::BFloat16>(),
                          kw.data_ptr<at::BFloat16>(), rows, heads, nq, hd, static_cast<float>(eps));
    else
      rms_norm_heads_impl(x.data_ptr<scalar_t>(), x.stride(0), qw.data_ptr<float>(), kw.data_ptr<float>(), rows,
                          heads, nq, hd, static_cast<float>(eps));
  });
}
