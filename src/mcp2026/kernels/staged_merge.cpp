// A staged KV codec's prefill chunk on the CPU: each query's own (staged, 16-bit) block merged into the
// attention the flash kernel computed over the sealed context.
//
// models/attention.py's _split_staged_attention did this with ~20 torch ops per layer (pads, two batched
// matmuls over (nkv, blocks, group, bs, bs), logsumexp, exp, permutes, the merge): ~0.3 s of a 5.3 s int4
// prefill of 2048 tokens on 2 cores, where the arithmetic is ~1 GFLOP. Here it is one pass per (query, head):
// the query's scores against the block's earlier tokens (itself included), their softmax and values, and the
// log-sum-exp merge with the sealed part. Same formulas as the torch path (which runs without the kernels).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_kernels.h"

namespace {

template <typename S>
inline float dot(const float* q, const S* k, int64_t hd) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t d = 0;
  for (; d + 8 <= hd; d += 8)
    for (int j = 0; j < 8; ++j) acc[j] += q[d + j] * static_cast<float>(k[d + j]);
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; d < hd; ++d) s += q[d] * static_cast<float>(k[d]);
  return s;
}

template <typename S>
void merge_impl(const float* oa, int64_t oa_h, int64_t oa_t, const float* la, int64_t la_h, int64_t la_t,
                const S* q, int64_t q_t, int64_t q_h, const S* ks, const S* vs, int64_t kv_h, int64_t kv_t,
                const bool* no_sealed, S* out, int64_t T, int64_t nh, int64_t nkv, int64_t hd, int64_t num_prior,
                int64_t bs) {
  const int64_t g = nh / nkv;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, T * nh, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(hd), acc(hd), scores(bs);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / nh, h = i % nh, kvh = h / g;
      const int64_t r = num_prior + t, j = r % bs, first = r - j;  // row within its block, the block's start
      const float* a = oa + h * oa_h + t * oa_t;
      const float lse_a = no_sealed[t] ? kNegInf : la[h * la_h + t * la_t];
      S* o = out + (t * nh + h) * hd;
      std::fill(acc.begin(), acc.end(), 0.f);
      float lse_b = kNegInf;
      if (j < bs - 1) {  // the block-filling query reads its block sealed: nothing staged for it
        const S* qr = q + t * q_t + h * q_h;
        for (int64_t d = 0; d < hd; ++d) qf[d] = static_cast<float>(qr[d]);
        float top = kNegInf;
        for (int64_t c = 0; c <= j; ++c) {
          scores[c] = dot(qf.data(), ks + kvh * kv_h + (first + c) * kv_t, hd);
          top = std::max(top, scores[c]);
        }
        float sum = 0.f;
        for (int64_t c = 0; c <= j; ++c) {
          const float e = std::exp(scores[c] - top);
          sum += e;
          const S* v = vs + kvh * kv_h + (first + c) * kv_t;
          for (int64_t d = 0; d < hd; ++d) acc[d] += e * static_cast<float>(v[d]);
        }
        for (int64_t d = 0; d < hd; ++d) acc[d] /= sum;
        lse_b = top + std::log(sum);
      }
      const float top = std::max(lse_a, lse_b);
      if (top == kNegInf) {  // sees nothing (not reachable from the engine: every row sees itself)
        for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<S>(0.f);
        continue;
      }
      const float wa = std::exp(lse_a - top), wb = std::exp(lse_b - top), norm = wa + wb;
      for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<S>((wa * a[d] + wb * acc[d]) / norm);
    }
  });
}

}  // namespace

// out_a (nh, T, hd) and lse_a (nh, T): the flash kernel's attention over the sealed context (rows with
// no_sealed[t] true saw none of it); q (T, nh, hd) pre-scaled; ks, vs (nkv, num_prior + T, hd) the staged
// keys and values from the first block's start. Returns (T, nh, hd) in q's dtype.
torch::Tensor merge_own_blocks(const torch::Tensor& out_a, const torch::Tensor& lse_a, const torch::Tensor& q,
                               const torch::Tensor& ks, const torch::Tensor& vs, const torch::Tensor& no_sealed,
                               int64_t num_prior, int64_t bs) {
  TORCH_CHECK(q.device().is_cpu() && (q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16),
              "q must be float32 or bfloat16 on the CPU");
  TORCH_CHECK(q.dim() == 3 && ks.dim() == 3 && vs.dim() == 3 && ks.sizes() == vs.sizes(), "q (T, nh, hd), ks and vs (nkv, S, hd)");
  TORCH_CHECK(ks.scalar_type() == q.scalar_type() && vs.scalar_type() == q.scalar_type(), "q, ks and vs must share a dtype");
  const int64_t T = q.size(0), nh = q.size(1), hd = q.size(2), nkv = ks.size(0);
  TORCH_CHECK(nkv >= 1 && nh % nkv == 0 && ks.size(2) == hd && ks.size(1) == num_prior + T && num_prior >= 0 && bs >= 1,
              "ks and vs must hold num_prior + T rows of hd for a divisor of q's heads");
  TORCH_CHECK(out_a.dim() == 3 && out_a.size(0) == nh && out_a.size(1) == T && out_a.size(2) == hd, "out_a must be (nh, T, hd)");
  TORCH_CHECK(lse_a.dim() == 2 && lse_a.size(0) == nh && lse_a.size(1) == T && lse_a.scalar_type() == torch::kFloat,
              "lse_a must be float32 (nh, T)");
  TORCH_CHECK(no_sealed.scalar_type() == torch::kBool && no_sealed.numel() == T, "no_sealed must be bool (T,)");
  auto oa = out_a.scalar_type() == torch::kFloat ? out_a : out_a.to(torch::kFloat);
  if (oa.stride(2) != 1) oa = oa.contiguous();
  const auto qc = q.stride(2) == 1 ? q : q.contiguous();
  const auto kc = ks.contiguous(), vc = vs.contiguous();  // concatenated by the caller: contiguous already
  const auto nc = no_sealed.contiguous();
  auto out = torch::empty({T, nh, hd}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "merge_own_blocks", [&] {
    merge_impl<scalar_t>(oa.data_ptr<float>(), oa.stride(0), oa.stride(1), lse_a.data_ptr<float>(),
                                   lse_a.stride(0), lse_a.stride(1), qc.data_ptr<scalar_t>(), qc.stride(0),
                                   qc.stride(1), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(), kc.stride(0),
                                   kc.stride(1), nc.data_ptr<bool>(), out.data_ptr<scalar_t>(), T, nh, nkv, hd,
                                   num_prior, bs);
  });
  return out;
}
