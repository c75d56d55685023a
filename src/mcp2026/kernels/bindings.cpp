// The CPU kernel module (built once per machine by mcp2026.kernels.cpu; see there): its Python bindings.
//
// A batch-1 decode step of a small model is dominated by op count, not arithmetic: every torch op costs a few
// microseconds to dispatch, and a layer ran ~40 of them. These kernels replace the elementwise chains
// (residual add + RMSNorm, RoPE, SiLU * up: elementwise.cpp) with one call each, the paged decode attention
// (gather the live blocks, scores, softmax, weighted sum: decode_attention.cpp) with one call that reads the
// blocks where they lie, and whole half-layers with one call (fused_layer.cpp). The entry points, by file:
// cpu_kernels.h.

#include <torch/extension.h>

#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention, "causal prefill attention over a chunk's context (AVX-512)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("offset"));
  m.def("prefill_attention_available", &prefill_attention_available, "whether this build has it");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged K/V blocks",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("lengths"),
        py::arg("mass") = py::none(), py::arg("starts") = py::none());
  m.def("paged_decode_attention_quantized", &paged_decode_attention_quantized,
        "decode attention over int8 / int4 / fp8 paged K/V blocks (and int4's staged bf16 tails)", py::arg("q"),
        py::arg("kind"), py::arg("k_planes"), py::arg("v_planes"), py::arg("stage_k"), py::arg("stage_v"),
        py::arg("tables"), py::arg("lengths"), py::arg("mass") = py::none());
  m.def("add_rms_norm", &add_rms_norm, "residual += x; RMSNorm(residual) * weight");
  m.def("rope_", &rope_, "rotate-half RoPE in place");
  m.def("int4_gemv", &int4_gemv, "int4 weights x int8-quantized activations, decode-sized batches");
  m.def("int4_gemm", &int4_gemm, "int4 weights x int8-quantized activations (+ bias), any row count (VNNI)",
        py::arg("x"), py::arg("wp"), py::arg("so"), py::arg("bias") = py::none());
  m.def("int4_gemm_pack", &int4_gemm_pack, "the int4 GEMV layout -> the GEMM's (weights, scales, offsets)");
  m.def("vnni_gemm_available", &vnni_gemm_available, "whether this build has the int4 and int8 GEMMs (VNNI)");
  m.def("int8_gemv", &int8_gemv, "int8 weights x float activations, decode-sized batches");
  m.def("int8_gemm", &int8_gemm, "int8 weights x int8-quantized activations, prefill-sized inputs (VNNI)");
  m.def("block_gemm", &block_gemm, "stored block quantization (scale * u + offset per group) x int8 activations",
        py::arg("x"), py::arg("wp"), py::arg("so"), py::arg("bias") = py::none());
  m.def("block_gemm_reference", &block_gemm_reference, "block_gemm as a portable scalar loop (for tests)");
  m.def("block_dequant", &block_dequant, "a block GEMM weight as fp32 (N, K)");
  m.def("block_weight_rows", &block_weight_rows, "rows of a block GEMM weight as fp32 (an embedding lookup)", py::arg("wp"),
        py::arg("so"), py::arg("k"), py::arg("ids"));
  m.def("block_float_gemm_min_rows", &block_float_gemm_min_rows,
        "rows from which block_gemm runs a float GEMM on the dequantized weight (0: never)");
  m.def("int8_gemm_pack", &int8_gemm_pack, "int8 (N, K) weights -> the int8 GEMM's column tiles (+128)");
  m.def("dense_linear", &dense_linear, "float weights: our GEMV for decode-sized inputs, else at::linear",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.attr("DENSE_GEMV_MAX_ROWS") = kDenseGemvMaxRows;
  m.def("int4_dequant", &int4_dequant, "the int4 GEMV layout back to float or bf16 (N, K)", py::arg("qs"),
        py::arg("sz"), py::arg("out_bf16") = false, py::arg("out") = py::none());
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "tanh-approximated GELU(gate) * up");
  m.def("rms_norm_heads_", &rms_norm_heads_, "per-head RMSNorm of (T, heads, hd) in place: q heads, then k heads",
        py::arg("x"), py::arg("q_weight"), py::arg("k_weight"), py::arg("nq"), py::arg("eps"));
  // The classes are module-local: another build of these sources loaded beside this one (the test of the AVX2
  // build) registers its own instead of clashing with these names.
  py::class_<LayerExtras>(m, "LayerExtras", py::module_local())
      .def(py::init([](c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, double qk_eps,
                       c10::optional<torch::Tensor> post_attn_norm, double post_attn_eps,
                       c10::optional<torch::Tensor> post_mlp_norm, double post_mlp_eps, int64_t gate,
                       bool local_rope, bool windowed) {
             TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
             TORCH_CHECK(gate == 0 || gate == 1, "gate must be 0 (SiLU) or 1 (tanh-GELU)");
             return LayerExtras{std::move(q_norm), std::move(k_norm), std::move(post_attn_norm),
                                std::move(post_mlp_norm), qk_eps, post_attn_eps, post_mlp_eps, gate, local_rope,
                                windowed};
           }),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("qk_eps") = 1e-6,
           py::arg("post_attn_norm") = py::none(), py::arg("post_attn_eps") = 1e-6,
           py::arg("post_mlp_norm") = py::none(), py::arg("post_mlp_eps") = 1e-6, py::arg("gate") = 0,
           py::arg("local_rope") = false, py::arg("windowed") = false);
  py::class_<FusedLinear>(m, "FusedLinear", py::module_local())
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
  m.def(
      "layer_attn_in",
      [](torch::Tensor& residual, const c10::optional<torch::Tensor>& x, const torch::Tensor& norm_w, double eps,
         const FusedLinear& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t nh, int64_t nkv,
         int64_t hd, const LayerExtras& extras) {
        return layer_attn_in(residual, x, norm_w, eps, qkv, cos, sin, nh, nkv, hd, extras);
      },
      "residual add + RMSNorm + qkv projection (+ q/k norms) + RoPE; returns q, k, v", py::arg("residual"),
      py::arg("x"), py::arg("norm_w"), py::arg("eps"), py::arg("qkv"), py::arg("cos"), py::arg("sin"),
      py::arg("nh"), py::arg("nkv"), py::arg("hd"), py::arg("extras") = LayerExtras{});
  m.def(
      "layer_attn_out_mlp",
      [](const torch::Tensor& attn, torch::Tensor& residual, const FusedLinear& o, const torch::Tensor& norm_w,
         double eps, const FusedLinear& gate_up, const FusedLinear& down, const LayerExtras& extras) {
        return layer_attn_out_mlp(attn, residual, o, norm_w, eps, gate_up, down, extras);
      },
      "o projection (+ its norm) + residual add + RMSNorm + gated MLP (+ its norm)", py::arg("attn"),
      py::arg("residual"), py::arg("o"), py::arg("norm_w"), py::arg("eps"), py::arg("gate_up"), py::arg("down"),
      py::arg("extras") = LayerExtras{});
  py::class_<DecodeLayer>(m, "DecodeLayer", py::module_local())
      .def(py::init([](torch::Tensor norm1, double eps1, FusedLinear qkv, torch::Tensor norm2, double eps2,
                       FusedLinear o, FusedLinear gate_up, FusedLinear down, LayerExtras extras) {
             return DecodeLayer{std::move(norm1), eps1, std::move(qkv), std::move(norm2), eps2,
                                std::move(o),     std::move(gate_up), std::move(down), std::move(extras)};
           }),
           py::arg("norm1"), py::arg("eps1"), py::arg("qkv"), py::arg("norm2"), py::arg("eps2"), py::arg("o"),
           py::arg("gate_up"), py::arg("down"), py::arg("extras") = LayerExtras{});
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init([](std::vector<DecodeLayer> layers, int64_t nh, int64_t nkv, int64_t hd) {
             TORCH_CHECK(!layers.empty(), "a decode stack needs at least one layer");
             TORCH_CHECK(nh > 0 && nkv > 0 && hd > 0 && nh % nkv == 0, "bad head counts");
             return DecodeStack{std::move(layers), nh, nkv, hd};
           }),
           py::arg("layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"))
      .def("run", &DecodeStack::run, "every layer of a decode-only step over a raw paged cache",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_planes"), py::arg("v_planes"), py::arg("rows"),
           py::arg("tables"), py::arg("lengths"), py::arg("cos_local") = py::none(),
           py::arg("sin_local") = py::none(), py::arg("window_starts") = py::none());
  py::class_<LookupGuard>(m, "LookupGuard", py::module_local())
      .def(py::init([](const std::vector<py::tuple>& reads, const std::vector<py::object>& empty, py::object missing) {
             LookupGuard g;
             for (const auto& r : reads) {
               TORCH_CHECK(r.size() == 3 && PyDict_Check(r[0].ptr()), "reads must be (dict, key, value) tuples");
               g.dicts.push_back(r[0]);
               g.keys.push_back(r[1]);
               g.values.push_back(r[2]);
             }
             for (const auto& d : empty) TORCH_CHECK(PyDict_Check(d.ptr()), "empty must hold dicts");
             g.empty = empty;
             g.missing = std::move(missing);
             return g;
           }),
           py::arg("reads"), py::arg("empty"), py::arg("missing"))
      .def("holds", &LookupGuard::holds, "whether every read still gives the recorded object");
}
