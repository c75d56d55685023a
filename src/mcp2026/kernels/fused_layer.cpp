// Decode-sized decoder layers in two calls. A layer's ops between the attention reads, composed from the other
// kernel files' entry points, so a decode step pays one Python-to-C++ crossing per half-layer instead of ~25
// dispatches (measured once with a throwaway script, fused on/off alternating in one process: a batch-1 int4
// decode step 9-17% shorter). Each linear does exactly what its Python module does on a decode-sized input (same
// kernel, same casts, same order), so both paths give identical results.

#include <torch/extension.h>

#include <vector>

#include "cpu_kernels.h"
#include "thread_team.h"

torch::Tensor FusedLinear::run(const torch::Tensor& x, torch::Tensor* slot) const {
  if (kind == 0) return dense_linear(x, a, bias);
  const auto xs = inv_scale.has_value() ? x * *inv_scale : x;
  const bool vnni = kind == 3 || kind == 5;  // the VNNI GEMMs add the bias themselves (before rounding bf16)
  auto y = kind == 3   ? int4_gemm_into(xs, a, b, bias, slot)
           : kind == 5 ? block_gemm_into(xs, a, b, bias, slot)
           : kind == 1 ? int8_gemv(xs, a, b)
           : kind == 2 ? int4_gemv(xs, a, b)
                       : int8_gemm(xs, a, b);
  if (!vnni && bias.has_value()) y = y + *bias;
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// residual (T, H) += x (x absent: residual is the stream already); h = RMSNorm(residual) * norm_w; qkv = h W;
// the per-head q/k norms where the layer has them; RoPE on the q and k heads in place (cos/sin (T, rot): partial
// rotary as in rope_). Returns views q (T, nh, hd), k (T, nkv, hd), v (T, nkv, hd).
std::vector<torch::Tensor> layer_attn_in(torch::Tensor& residual, const c10::optional<torch::Tensor>& x,
                                         const torch::Tensor& norm_w, double eps, const FusedLinear& qkv,
                                         const torch::Tensor& cos, const torch::Tensor& sin, int64_t nh,
                                         int64_t nkv, int64_t hd, const LayerExtras& extras, StepSlots* slots) {
  const auto h = add_rms_norm_into(residual, x, norm_w, eps, residual.scalar_type(), slots ? &slots->norm1 : nullptr);
  const auto y = qkv.run(h, slots ? &slots->qkv : nullptr);
  const int64_t T = y.size(0);
  TORCH_CHECK(y.dim() == 2 && y.size(1) == (nh + 2 * nkv) * hd && y.is_contiguous(), "qkv has the wrong shape");
  auto qk = y.narrow(1, 0, (nh + nkv) * hd).view({T, nh + nkv, hd});
  if (extras.q_norm.has_value()) rms_norm_heads_(qk, *extras.q_norm, *extras.k_norm, nh, extras.qk_eps);
  rope_(qk, cos, sin);
  return {qk.narrow(1, 0, nh), qk.narrow(1, nh, nkv), y.narrow(1, (nh + nkv) * hd, nkv * hd).view({T, nkv, hd})};
}

// attn (T, nh, hd) -> o projection (RMSNorm'd where the layer has a post-attention norm); residual += it;
// h = RMSNorm(residual) * norm_w; down(act(gate) * up), RMSNorm'd where the layer has a post-MLP norm.
torch::Tensor layer_attn_out_mlp(const torch::Tensor& attn, torch::Tensor& residual, const FusedLinear& o,
                                 const torch::Tensor& norm_w, double eps, const FusedLinear& gate_up,
                                 const FusedLinear& down, const LayerExtras& extras, StepSlots* slots) {
  auto a = o.run(attn.reshape({attn.size(0), -1}), slots ? &slots->o : nullptr);
  if (extras.post_attn_norm.has_value())
    a = add_rms_norm_into(a, c10::nullopt, *extras.post_attn_norm, extras.post_attn_eps, a.scalar_type(),
                          slots ? &slots->post_attn : nullptr);
  const auto h = add_rms_norm_into(residual, a, norm_w, eps, residual.scalar_type(), slots ? &slots->norm2 : nullptr);
  const auto gu = gate_up.run(h, slots ? &slots->gate_up : nullptr);
  auto* act_slot = slots ? &slots->act : nullptr;
  const auto act = extras.gate == 1 ? gelu_tanh_mul_into(gu, gu.scalar_type(), act_slot)
                                    : silu_mul_into(gu, gu.scalar_type(), act_slot);
  auto d = down.run(act, slots ? &slots->down : nullptr);
  if (extras.post_mlp_norm.has_value())
    d = add_rms_norm_into(d, c10::nullopt, *extras.post_mlp_norm, extras.post_mlp_eps, d.scalar_type(),
                          slots ? &slots->post_mlp : nullptr);
  return d;
}

// The Python loop of a decode step (models/decode_stack.py) without its ~5 interpreter crossings per layer:
// the same entry points in the same order (half-layer, K/V rows write, paged attention, half-layer), so the
// results are those of the per-layer path bit for bit.
std::vector<torch::Tensor> DecodeStack::run(const torch::Tensor& x, const torch::Tensor& cos,
                                            const torch::Tensor& sin, const torch::Tensor& k_planes,
                                            const torch::Tensor& v_planes, const torch::Tensor& rows,
                                            const torch::Tensor& tables, const torch::Tensor& lengths,
                                            const c10::optional<torch::Tensor>& cos_local,
                                            const c10::optional<torch::Tensor>& sin_local,
                                            const c10::optional<torch::Tensor>& window_starts) const {
  TORCH_CHECK(k_planes.dim() == 5 && v_planes.dim() == 5 && k_planes.size(0) == (int64_t)layers.size() &&
                  v_planes.sizes() == k_planes.sizes(),
              "k_planes and v_planes must be (layers, blocks, nkv, bs, hd) with one plane per layer");
  TORCH_CHECK(k_planes.size(2) == nkv && k_planes.size(4) == hd, "the planes' head sizes do not match the model");
  for (const auto& l : layers)
    TORCH_CHECK(!l.extras.local_rope || (cos_local.has_value() && sin_local.has_value()),
                "a layer rotates with the local table: pass cos_local and sin_local");
  torch::Tensor residual = x.clone();  // the kernels update the residual stream in place
  c10::optional<torch::Tensor> h;
  // Each intermediate is allocated by the first layer and rewritten by the others (every layer has the same
  // shapes): a layer's down output is read by the next layer's first norm before that layer's down rewrites it.
  // Fresh per call: the last layer's output is returned to the caller.
  StepSlots slots;
  team::run([&] {  // one thread team for every layer's parallel loops (thread_team.h)
    for (size_t i = 0; i < layers.size(); ++i) {
      const DecodeLayer& l = layers[i];
      const bool local = l.extras.local_rope;
      const auto qkv = layer_attn_in(residual, h, l.norm1, l.eps1, l.qkv, local ? *cos_local : cos,
                                     local ? *sin_local : sin, nh, nkv, hd, l.extras, &slots);
      const auto kb = k_planes.select(0, (int64_t)i), vb = v_planes.select(0, (int64_t)i);
      auto k_rows = kb.view({-1, hd}), v_rows = vb.view({-1, hd});
      write_kv_rows(k_rows, v_rows, rows, qkv[1], qkv[2]);
      const auto attn = paged_decode_attention_into(qkv[0], kb, vb, tables, lengths, c10::nullopt, &slots.attn,
                                                    l.extras.windowed ? window_starts : c10::nullopt);
      h = layer_attn_out_mlp(attn, residual, l.o, l.norm2, l.eps2, l.gate_up, l.down, l.extras, &slots);
    }
  });
  return {*h, residual};  // layers is never empty (the binding refuses an empty stack)
}
