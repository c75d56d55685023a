// The entry points of the CPU kernel module (bindings.cpp exposes them to Python; fused_layer.cpp composes
// them), by the file that defines each, and the argument check they share.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

inline void check_cpu_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

// A decode stack's step allocates each intermediate once and its layers reuse it: the kernels below that take a
// slot write their output into *slot when it has the shape and dtype wanted, else into a new tensor left in *slot
// (no slot: a new tensor, as always). Only the stack passes slots; every Python entry point allocates.
inline torch::Tensor slot_or_empty(torch::Tensor* slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (slot != nullptr && slot->defined() && slot->sizes() == sizes &&
      slot->scalar_type() == c10::typeMetaToScalarType(options.dtype()))
    return *slot;
  auto t = torch::empty(sizes, options);
  if (slot != nullptr) *slot = t;
  return t;
}

// decode_attention.cpp
torch::Tensor paged_decode_attention_into(const torch::Tensor& q, const torch::Tensor& k_cache,
                                          const torch::Tensor& v_cache, const torch::Tensor& tables,
                                          const torch::Tensor& lengths, const c10::optional<torch::Tensor>& mass,
                                          torch::Tensor* slot,
                                          const c10::optional<torch::Tensor>& starts = c10::nullopt);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& tables,
                                     const torch::Tensor& lengths, const c10::optional<torch::Tensor>& mass,
                                     const c10::optional<torch::Tensor>& starts);
torch::Tensor paged_decode_attention_quantized(const torch::Tensor& q, int64_t kind, const std::vector<torch::Tensor>& kp,
                                               const std::vector<torch::Tensor>& vp, const torch::Tensor& stage_k,
                                               const torch::Tensor& stage_v, const torch::Tensor& tables,
                                               const torch::Tensor& lengths, const c10::optional<torch::Tensor>& mass);
// prefill_attention.cpp
bool prefill_attention_available();
torch::Tensor prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                int64_t offset);
// elementwise.cpp
torch::Tensor add_rms_norm(const torch::Tensor& residual, const c10::optional<torch::Tensor>& x,
                           const torch::Tensor& weight, double eps, c10::ScalarType out_dtype);
torch::Tensor add_rms_norm_into(const torch::Tensor& residual, const c10::optional<torch::Tensor>& x,
                                const torch::Tensor& weight, double eps, c10::ScalarType out_dtype,
                                torch::Tensor* slot);
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor silu_mul(const torch::Tensor& gate_up, c10::ScalarType out_dtype);
torch::Tensor silu_mul_into(const torch::Tensor& gate_up, c10::ScalarType out_dtype, torch::Tensor* slot);
torch::Tensor gelu_tanh_mul(const torch::Tensor& gate_up, c10::ScalarType out_dtype);
torch::Tensor gelu_tanh_mul_into(const torch::Tensor& gate_up, c10::ScalarType out_dtype, torch::Tensor* slot);
void rms_norm_heads_(torch::Tensor& x, const torch::Tensor& q_weight, const torch::Tensor& k_weight, int64_t nq,
                     double eps);
// gemv.cpp
constexpr int64_t kDenseGemvMaxRows = 32;  // the most rows dense_linear gives its own GEMV (gemv.cpp)
torch::Tensor int4_gemv(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& sz);
torch::Tensor int8_gemv(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales);
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
torch::Tensor int4_dequant(const torch::Tensor& qs, const torch::Tensor& sz, bool out_bf16,
                           const c10::optional<torch::Tensor>& out_buffer);
// IQ4_NL's and IQ4_XS's 16 levels plus 128 (quant/block_linear.py LEVEL_VALUES holds the same): a block weight
// typed int8 holds 4-bit indices into this table where a uint8 one holds the 4-bit values themselves.
inline constexpr uint8_t kLevelValues[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
// The "bits" the block GEMM gives that layout (its values are bytes).
constexpr int kLevelNibbles = 16;

// Block weights' scales and offsets come per (tile, group) as the 16 columns' scales then their offsets (2 parts),
// or as the scales alone (1 part) where every offset is -center x scale, center the middle of the layout's values.
inline float value_center(int bits) { return bits == 4 ? 8.f : bits == 5 ? 16.f : bits == 6 ? 32.f : 128.f; }

// int4_gemm.cpp
bool vnni_gemm_available();
std::vector<torch::Tensor> int4_gemm_pack(const torch::Tensor& qs, const torch::Tensor& sz);
torch::Tensor int4_gemm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so,
                        const c10::optional<torch::Tensor>& bias = c10::nullopt);
torch::Tensor int4_gemm_into(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so,
                             const c10::optional<torch::Tensor>& bias, torch::Tensor* slot);
// int8_gemm.cpp
torch::Tensor int8_gemm_pack(const torch::Tensor& w);
torch::Tensor int8_gemm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scales);
// block_gemm.cpp
torch::Tensor block_gemm(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so,
                         const c10::optional<torch::Tensor>& bias = c10::nullopt);
torch::Tensor block_gemm_into(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so,
                              const c10::optional<torch::Tensor>& bias, torch::Tensor* slot);
torch::Tensor block_gemm_reference(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& so);
torch::Tensor block_dequant(const torch::Tensor& wp, const torch::Tensor& so, int64_t K);
torch::Tensor block_weight_rows(const torch::Tensor& wp, const torch::Tensor& so, int64_t K, const torch::Tensor& ids);
int64_t block_float_gemm_min_rows(int64_t n, int64_t k);
// kv_write.cpp
void write_kv_rows(torch::Tensor& k_dst, torch::Tensor& v_dst, const torch::Tensor& rows, const torch::Tensor& k,
                   const torch::Tensor& v);
void write_kv_rows_quantized(int64_t kind, const std::vector<torch::Tensor>& kp, const std::vector<torch::Tensor>& vp,
                             const torch::Tensor& rows, const torch::Tensor& k, const torch::Tensor& v);
bool seal_int4_blocks(const std::vector<torch::Tensor>& planes, const torch::Tensor& chunks, const torch::Tensor& x,
                      int64_t bs, int64_t group);
// staged_merge.cpp
torch::Tensor merge_own_blocks(const torch::Tensor& out_a, const torch::Tensor& lse_a, const torch::Tensor& q,
                               const torch::Tensor& ks, const torch::Tensor& vs, const torch::Tensor& no_sealed,
                               int64_t num_prior, int64_t bs);

// fused_layer.cpp: a linear layer as the fused decode layers call it.
struct FusedLinear {
  int64_t kind;  // 0: float weight through dense_linear; 1: int8 weight + fp32 scales; 2: int4 GEMV layout;
                 // 3: int4 GEMM layout (int4_gemm.cpp); 4: int8 GEMM layout (int8_gemm.cpp);
                 // 5: byte weights with group scales and offsets (block_gemm.cpp)
  torch::Tensor a, b;  // dense: (weight, unused); int8: (weight, scales); int4: (qs, sz); int4 GEMM: (wp, so);
                       // int8 GEMM: (wp, scales); block GEMM: (wp, so)
  c10::optional<torch::Tensor> bias, inv_scale;

  torch::Tensor operator()(const torch::Tensor& x) const { return run(x, nullptr); }
  torch::Tensor run(const torch::Tensor& x, torch::Tensor* slot) const;  // slot: see slot_or_empty
};

// The intermediates of a decode stack's step, each allocated by its first layer and reused by the others.
struct StepSlots {
  torch::Tensor norm1, qkv, attn, o, post_attn, norm2, gate_up, act, down, post_mlp;
};

// What a layer adds to the Llama layer, each part optional: per-head RMSNorms of q and k before RoPE (Qwen3,
// Gemma 3), RMSNorms of the attention's and the MLP's outputs before their residual adds (Gemma 3's "sandwich"),
// the MLP's gate activation, which of the step's two rotary tables the layer takes (Gemma 3's sliding-window
// layers rotate with their own base), and whether the layer's attention slides.
struct LayerExtras {
  c10::optional<torch::Tensor> q_norm, k_norm, post_attn_norm, post_mlp_norm;
  double qk_eps = 1e-6, post_attn_eps = 1e-6, post_mlp_eps = 1e-6;
  int64_t gate = 0;  // 0: SiLU(gate) * up; 1: tanh-GELU(gate) * up
  bool local_rope = false;
  bool windowed = false;  // a sliding-window layer: attends from the step's window starts, when it has them
};

std::vector<torch::Tensor> layer_attn_in(torch::Tensor& residual, const c10::optional<torch::Tensor>& x,
                                         const torch::Tensor& norm_w, double eps, const FusedLinear& qkv,
                                         const torch::Tensor& cos, const torch::Tensor& sin, int64_t nh,
                                         int64_t nkv, int64_t hd, const LayerExtras& extras,
                                         StepSlots* slots = nullptr);
torch::Tensor layer_attn_out_mlp(const torch::Tensor& attn, torch::Tensor& residual, const FusedLinear& o,
                                 const torch::Tensor& norm_w, double eps, const FusedLinear& gate_up,
                                 const FusedLinear& down, const LayerExtras& extras, StepSlots* slots = nullptr);

// A decoder layer as DecodeStack runs it: the half-layers above with the layer's K/V write and paged attention
// between them.
struct DecodeLayer {
  torch::Tensor norm1;
  double eps1;
  FusedLinear qkv;
  torch::Tensor norm2;
  double eps2;
  FusedLinear o, gate_up, down;
  LayerExtras extras;
};

// Every layer of a decode-only step over a raw paged cache (fp32 / bf16 / fp16 K/V, one plane per layer) in one
// call. Returns (hidden, residual) after the last layer.
struct DecodeStack {
  std::vector<DecodeLayer> layers;
  int64_t nh, nkv, hd;

  // cos_local / sin_local: the rotary table of the layers with local_rope (required when any has it);
  // window_starts (B,): where the windowed layers' attention starts, when the window is shorter than a context
  std::vector<torch::Tensor> run(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                 const torch::Tensor& k_planes, const torch::Tensor& v_planes,
                                 const torch::Tensor& rows, const torch::Tensor& tables, const torch::Tensor& lengths,
                                 const c10::optional<torch::Tensor>& cos_local,
                                 const c10::optional<torch::Tensor>& sin_local,
                                 const c10::optional<torch::Tensor>& window_starts) const;
};

// Dictionary reads repeated in one call: the Python objects a decode step's compiled stack was decided from
// (models/decode_stack.py records them), checked on every step instead of walking the modules in the
// interpreter. holds(): every (dict, key) still maps to the same object (or is still missing), and every dict
// that was empty (the hook tables) still is.
struct LookupGuard {
  std::vector<pybind11::object> dicts, keys, values;  // values[i] is `missing` where the key was absent
  std::vector<pybind11::object> empty;
  pybind11::object missing;

  bool holds() const;
};
