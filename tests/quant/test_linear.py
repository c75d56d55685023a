"""Quantization math and quantized linears: round trips, kernel vs dequantized reference, quantize_."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mcp2026.kernels import ops as kernel_ops
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int4_packing import int4pack_block_rows, pack_int4, unpack_int4
from mcp2026.quant.int8_linear import Int8Linear
from mcp2026.quant.linear import LINEAR_FORMATS, build_linear, quantize_
from mcp2026.quant.plan import FORMATS, LayerQuantSpec, QuantPlan, high_row_count
from mcp2026.quant.quantizer import (
    dequantize_groupwise_int4,
    dequantize_per_channel_int8,
    fake_quantize,
    quantize_groupwise_int4,
    quantize_per_channel_int8,
    search_act_scale,
)
from mcp2026.quant.split_rows_linear import SplitRowsLinear


def _linear(in_features: int, out_features: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
    return linear


def test_registry_covers_every_plan_format():
    assert set(LINEAR_FORMATS) == set(FORMATS)


@pytest.mark.parametrize(("n", "k"), [(32, 64), (48, 64), (16, 32), (96, 576)])
def test_int4_pack_unpack_round_trip(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + k))
    packed = pack_int4(q)
    assert packed.shape == (n, k // 2)
    assert torch.equal(unpack_int4(packed, n, k), q)


def _pack_by_hand(q: torch.Tensor, block_rows: int) -> torch.Tensor:
    """torch's packed int4 layout written out element by element (the unpack docstring's description)."""
    n, k = q.shape
    out = []
    for r0 in range(0, n, block_rows):
        rows = min(block_rows, n - r0)
        for kk in range(k):
            for j in range(rows // 2):
                lo, hi = (j, j + rows // 2) if rows == block_rows else (2 * j, 2 * j + 1)
                out.append(int(q[r0 + lo, kk]) | int(q[r0 + hi, kk]) << 4)
    return torch.tensor(out, dtype=torch.uint8).view(n, k // 2)


@pytest.mark.parametrize(("n", "k"), [(96, 8), (80, 4), (48, 8), (16, 4), (128, 2)])
def test_int4_unpack_reads_the_avx2_and_avx512_layouts(n, k):
    # Both CPU kinds' layouts (32- and 64-row blocks) whatever this machine packs, so an artifact
    # compiled on one kind unpacks on the other; and this machine's pack is the layout it reports.
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(n * k))
    for block_rows in (32, 64):
        assert torch.equal(unpack_int4(_pack_by_hand(q, block_rows), n, k, block_rows), q)
    assert torch.equal(pack_int4(q), _pack_by_hand(q, int4pack_block_rows()))


@pytest.mark.parametrize("offset", [0, 2, 8])
def test_int8_module_takes_weights_and_activations_at_any_address(offset):
    # torch's AVX-512 int8 kernel faults on operands off a 16-byte boundary (weights mmapped from an
    # artifact, activation views): the module realigns them and gives the dequantized reference.
    torch.manual_seed(0)
    q = Int8Linear.from_linear(_linear(64, 96), LayerQuantSpec("int8"), torch.bfloat16)
    raw = torch.zeros(q.weight.numel() + 64, dtype=torch.int8)
    start = (-raw.data_ptr()) % 64 + offset
    q.weight = raw[start : start + q.weight.numel()].view_as(q.weight).copy_(q.weight)
    xs = torch.zeros(40 * 64 + 64, dtype=torch.bfloat16)
    begin = ((-xs.data_ptr()) % 64 + offset) // 2
    x = xs[begin : begin + 40 * 64].view(40, 64).copy_(torch.randn(40, 64))
    with torch.inference_mode():
        out = q(x)
    ref = x.float() @ q.dequantize().T + q.bias.float()
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.02)


def test_int8_quantize_round_trip_error_within_half_step():
    w = torch.randn(64, 96)
    q, scales = quantize_per_channel_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (dequantize_per_channel_int8(q, scales) - w).abs()
    assert (err <= scales[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_quantize_round_trip_error_within_half_step(symmetric):
    w = torch.randn(32, 128)
    q, scales, zeros = quantize_groupwise_int4(w, 32, symmetric)
    assert q.max() <= 15 and scales.shape == zeros.shape == (32, 4)
    err = (dequantize_groupwise_int4(q, scales, zeros, 32) - w).abs().reshape(32, 4, 32)
    step = scales.abs()[..., None]
    if symmetric:  # Q4_0's levels -8..7: the group's peak is on -8, a value near minus the peak clips to +7
        assert torch.all(zeros == 0)
        peak = w.reshape(32, 4, 32).abs().amax(-1, keepdim=True)
        inside = w.reshape(32, 4, 32).abs() <= 7 * step
        assert (err[inside] <= (step * 0.51 + 1e-6).expand_as(err)[inside]).all()
        assert (err <= peak - 7 * step + step * 0.01 + 1e-6).all()
    else:  # fp16 rounding of scale/zero may push a group edge a little outside the grid
        assert (err <= step * 0.51 + 1e-6).all()


def test_int4_asymmetric_reproduces_weights_already_on_the_grid():
    gen = torch.Generator().manual_seed(1)
    n, k, g = 32, 128, 32
    scales = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.005).half().float()
    zeros = (torch.randn(n, k // g, generator=gen) * 0.05).half().float()
    q = torch.randint(0, 16, (n, k // g, g), generator=gen)
    q[..., 0], q[..., 1] = 0, 15  # every group spans the whole range
    w = dequantize_groupwise_int4(q.reshape(n, k), scales, zeros, g)
    q2, scales2, zeros2 = quantize_groupwise_int4(w, g, symmetric=False)
    assert torch.equal(dequantize_groupwise_int4(q2, scales2, zeros2, g), w)  # fp16 grids are kept exactly
    for dtype in (torch.float32, torch.bfloat16):  # whatever the compute dtype
        module = Int4Linear.from_linear(_bias_free(w), LayerQuantSpec("int4", group_size=g), dtype)
        assert torch.equal(module.dequantize(), w)


def _bias_free(w: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    return linear


SPECS = [
    LayerQuantSpec("int8"),
    LayerQuantSpec("int4", group_size=32),
    LayerQuantSpec("int4", group_size=64, symmetric=True),
    LayerQuantSpec("int4", group_size=128, clip_ratio="mse"),
    LayerQuantSpec("int4", group_size=32, scale_bits=8),
    LayerQuantSpec("bf16"),
]


@pytest.mark.parametrize(
    "spec", SPECS, ids=lambda s: f"{s.format}-g{s.group_size}-{s.clip_ratio}-s{s.scale_bits}"
)
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_module_matches_dequantized_reference(spec, compute_dtype):
    linear = _linear(256, 96)
    module = LINEAR_FORMATS[spec.format].from_linear(linear, spec, compute_dtype)
    x = torch.randn(2, 5, 256)
    y = module(x)
    reference = x @ module.dequantize().T + linear.bias
    assert y.shape == (2, 5, 96) and y.dtype == torch.float32
    # fp32 kernels: rounding only; bf16 compute: the activations are rounded to bf16 (2^-9 relative)
    tol = 1e-5 if compute_dtype == torch.float32 or spec.format == "bf16" else 1e-2
    if spec.format == "bf16":
        tol = 1e-2
    if spec.format == "int4" and kernel_ops.kernels_for(x) is not None:
        tol = 2e-2  # our int4 GEMV quantizes activations to int8 per 32 values (~0.5% relative, W4A8)
    if spec.format == "int8" and kernel_ops.vnni_gemm_kernels(x.reshape(-1, 256)) is not None:
        tol = 1e-4  # our int8 GEMM: activations in two int8 planes, to within 1/512 of a block's step
    assert (y - reference).abs().max() <= tol * reference.abs().max()


def test_fp8_module_runs_as_a_reference_on_cpu():
    linear = _linear(64, 32)
    module = LINEAR_FORMATS["fp8"].from_linear(linear, LayerQuantSpec("fp8"), torch.float32)
    x = torch.randn(4, 64)
    reference = x @ module.dequantize().T + linear.bias
    # activations are quantized to e4m3 per row at run time: a few % per element
    assert (module(x) - reference).abs().max() <= 0.05 * reference.abs().max()
    assert LINEAR_FORMATS["fp8"].kernel_on(torch.device("cpu")) is None


def test_int4_group_size_must_divide_in_features():
    with pytest.raises(ValueError, match="must divide in_features=96"):
        Int4Linear.from_linear(_linear(96, 32), LayerQuantSpec("int4", group_size=64))


def test_sizes_and_bits():
    linear = _linear(576, 64, bias=False)
    int4 = Int4Linear.from_linear(linear, LayerQuantSpec("int4", group_size=32), torch.bfloat16)
    assert int4.bits_per_weight == 5.0
    assert int4.nbytes == 576 * 64 // 2 + (576 // 32) * 64 * 2 * 2  # packed nibbles + bf16 scale/zero
    int8 = Int8Linear.from_linear(linear, LayerQuantSpec("int8"), torch.float32)
    assert int8.bits_per_weight == pytest.approx(8 + 16 / 576)
    coded = Int4Linear.from_linear(linear, LayerQuantSpec("int4", 32, scale_bits=8), torch.bfloat16)
    assert coded.bits_per_weight == pytest.approx(4 + 16 / 32 + 16 / 576)
    # packed nibbles, an 8-bit scale code and zero code per group, two int8 exponents per row
    assert coded.nbytes == 576 * 64 // 2 + (576 // 32) * 64 * 2 + 64 * 2


def test_int4_with_8_bit_scales_stores_codes_and_computes_with_their_fp16_grids():
    linear = _bias_free(_linear(576, 64).weight.detach())
    spec = LayerQuantSpec("int4", 32, scale_bits=8)
    module = Int4Linear.from_linear(linear, spec, torch.float32)
    assert {k: v.dtype for k, v in module.state_dict().items()} == {
        "weight": torch.uint8, "scale_codes": torch.uint8, "zero_codes": torch.int8, "grid_exponents": torch.int8,
    }  # fmt: skip
    grids = module.grids()
    assert grids.dtype == torch.float16 and grids.shape == (576 // 32, 64, 2)
    assert torch.equal(module.dequantize(), fake_quantize(linear.weight, spec))
    fp16 = Int4Linear.from_linear(linear, LayerQuantSpec("int4", 32), torch.float32)
    w = linear.weight.detach()
    assert (module.dequantize() - w).pow(2).mean() < 1.01 * (fp16.dequantize() - w).pow(2).mean()
    empty = Int4Linear(576, 64, spec, False, torch.float32)
    empty.load_state_dict(module.state_dict())
    x = torch.randn(3, 576)
    assert torch.equal(empty(x), module(x))
    with pytest.raises(ValueError, match="not on 8-bit codes"):  # fp16 grids cannot be stored as codes
        empty._store(*quantize_groupwise_int4(w, 32))


def _heavy_tailed(n: int, k: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.distributions.StudentT(3.0).sample((n, k)) * 0.02


@pytest.mark.parametrize("symmetric", [False, True])
def test_mse_clipping_reduces_error_on_heavy_tailed_weights(symmetric):
    w = _heavy_tailed(128, 256)
    plain = LayerQuantSpec("int4", group_size=32, symmetric=symmetric)
    clipped = LayerQuantSpec("int4", group_size=32, symmetric=symmetric, clip_ratio="mse")
    err_plain = ((fake_quantize(w, plain) - w) ** 2).mean()
    err_clipped = ((fake_quantize(w, clipped) - w) ** 2).mean()
    # measured: asymmetric 0.90x, symmetric 0.94x of the unclipped error (clipping and least-squares grids)
    assert err_clipped < (0.92 if not symmetric else 0.96) * err_plain


def test_activation_aware_scaling_reduces_output_error():
    torch.manual_seed(0)
    w = torch.randn(128, 256) * 0.02
    x = torch.randn(256, 256)
    x[:, :8] *= 30  # a few input channels carry large activations
    spec = LayerQuantSpec("int4", group_size=32)
    reference = x @ w.T
    plain_err = ((x @ fake_quantize(w, spec).T - reference) ** 2).sum() / (reference**2).sum()
    scale, alpha, scaled_err = search_act_scale(w, x, spec)
    assert alpha > 0 and scaled_err < 0.7 * plain_err.item()  # measured: about 0.45x
    # the module computes with the same effective weight (input divided by the scale)
    linear = _bias_free(w)
    module = Int4Linear.from_linear(
        linear, LayerQuantSpec("int4", group_size=32, act_scale="s"), torch.float32, scale
    )
    assert torch.allclose(module.dequantize(), fake_quantize(w, spec, scale), atol=1e-6)
    xx = torch.cat([x, x])  # prefill-sized
    expected = xx @ module.dequantize().T
    if kernel_ops.vnni_gemm_kernels(xx) is None:  # float activations (dequantize + GEMM, or torch's kernel)
        assert torch.allclose(module(xx), expected, atol=1e-4)
    else:  # our int4 GEMM: activations in int8 per 32 values, ~0.5% off
        assert ((module(xx) - expected).norm() / expected.norm()).item() < 0.01


class _Block(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv_proj = nn.Linear(hidden, 3 * hidden, bias=False)
        self.attn.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, hidden, bias=False)


class TinyModel(nn.Module):
    def __init__(self, vocab: int = 96, hidden: int = 64, inter: int = 128, num_layers: int = 2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(_Block(hidden, inter) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied


def test_quantize_replaces_planned_modules_and_keeps_tied_embedding():
    torch.manual_seed(0)
    model = TinyModel()
    embedding_before = model.embed_tokens.weight.detach().clone()
    plan = QuantPlan(
        {
            "layers.*.mlp.*": LayerQuantSpec("int4", group_size=32),
            "lm_head": "int8",
            "layers.1.attn.o_proj": "fp32",
            "_default": LayerQuantSpec("int4", group_size=64, symmetric=True),
        }
    )
    quantize_(model, plan, compute_dtypes={"int4": torch.bfloat16})
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)
    assert model.layers[0].mlp.down_proj.compute_dtype == torch.bfloat16
    assert isinstance(model.layers[1].attn.qkv_proj, Int4Linear)
    assert model.layers[1].attn.qkv_proj.spec.group_size == 64
    assert type(model.layers[1].attn.o_proj) is nn.Linear  # fp32 already
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.compute_dtype == torch.float32
    assert isinstance(model.embed_tokens.weight, nn.Parameter)
    assert torch.equal(model.embed_tokens.weight, embedding_before)
    h = model.embed_tokens(torch.tensor([[1, 2, 3]]))
    reference = h @ embedding_before.T
    assert (model.lm_head(h) - reference).abs().max() < 0.05 * reference.abs().max()


def test_quantize_requires_named_act_scales():
    model = TinyModel()
    plan = QuantPlan({"lm_head": LayerQuantSpec("int8", act_scale="lm_head")})
    with pytest.raises(KeyError, match=r"tensor 'lm_head' \(act_scale\)"):
        quantize_(model, plan)
    quantize_(model, plan, tensors={"lm_head": torch.rand(64) + 0.5})
    assert model.lm_head.inv_act_scale is not None


def test_quantize_names_the_layer_in_errors():
    model = TinyModel(hidden=96)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.qkv_proj: int4 group size 64"):
        quantize_(model, QuantPlan({"_default": LayerQuantSpec("int4", group_size=64)}))


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", "bf16"])
def test_state_dict_loads_into_an_empty_module(fmt):
    spec = LayerQuantSpec(fmt, act_scale=None if fmt == "bf16" else "s")
    linear = _linear(64, 32)
    cls = LINEAR_FORMATS[fmt]
    scale = None if fmt == "bf16" else torch.rand(64) + 0.5
    built = cls.from_linear(linear, spec, torch.float32, scale)
    empty = cls(64, 32, spec, True, torch.float32)
    empty.load_state_dict(built.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(empty(x), built(x))


# ---- split rows (int8 rows inside int4) and bias correction -------------------------------------------
def test_split_spec_validation_and_bits():
    with pytest.raises(ValueError, match="int4 only"):
        LayerQuantSpec("int8", high_rows=0.1)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        LayerQuantSpec("int4", high_rows=1.0)
    with pytest.raises(ValueError, match="set high_rows"):
        LayerQuantSpec("int4", row_scores="x")
    with pytest.raises(ValueError, match="act_scale"):
        LayerQuantSpec("int4", high_rows=0.1, act_scale="s")
    with pytest.raises(ValueError, match="not quantized"):
        LayerQuantSpec("fp32", bias_correction="m")
    assert [high_row_count(320, s) for s in (0.0, 0.02, 0.1, 0.5, 0.99)] == [0, 0, 32, 160, 304]
    spec = LayerQuantSpec("int4", 64, high_rows=0.1, bias_correction="m")
    # 288 int4 rows at 4 + 32/64 bits, 32 int8 rows at 8 + (16 scale + 32 index)/64, bias 32/64 per weight
    expected = (288 * 4.5 + 32 * (8 + 48 / 64)) / 320 + 32 / 64
    assert spec.bits_per_weight(64, 320) == pytest.approx(expected)
    assert "10% of rows int8" in spec.describe() and "bias-corrected" in spec.describe()


@pytest.mark.parametrize("rows", [1, 5, 40, 300])  # GEMV, batched GEMV and dequantize + GEMM sizes
def test_split_rows_linear_matches_its_dequantized_weight(rows):
    linear = _linear(64, 320, bias=True)
    scores = torch.rand(320, generator=torch.Generator().manual_seed(1))
    spec = LayerQuantSpec("int4", 32, high_rows=0.1, row_scores="s")
    module = build_linear("lm_head", linear, spec, torch.float32, {"s": scores})
    assert isinstance(module, SplitRowsLinear) and module.high.out_features == 32
    # the int8 rows are the 32 best-scored ones, and the weight is what fake_quantize predicts
    assert set(module.high_index.tolist()) == set(scores.topk(32).indices.tolist())
    w = linear.weight.detach()
    assert torch.equal(module.dequantize(), fake_quantize(w, spec, row_scores=scores))
    high = module.high_index.long()
    assert torch.equal(module.dequantize()[high], fake_quantize(w[high], LayerQuantSpec("int8")))
    x = torch.randn(rows, 64)
    reference = x @ module.dequantize().T + linear.bias.detach()
    torch.testing.assert_close(module(x), reference, rtol=0.02, atol=0.02 * reference.abs().max().item())
    # int8 rows have less error than the int4 rows they replaced
    plain = Int4Linear.from_linear(linear, LayerQuantSpec("int4", 32), torch.float32)
    assert (module.dequantize()[high] - w[high]).pow(2).sum() < (plain.dequantize()[high] - w[high]).pow(
        2
    ).sum()


def test_split_rows_without_scores_takes_the_worst_int4_rows():
    linear = _linear(64, 64, bias=False)
    with torch.no_grad():
        linear.weight[[3, 40]] *= 20  # two rows with far larger int4 errors
    spec = LayerQuantSpec("int4", 32, high_rows=0.25)
    module = build_linear("x", linear, spec, torch.float32)
    assert {3, 40} <= set(module.high_index.tolist()) and module.high_index.numel() == 16


def test_bias_correction_cancels_the_mean_output_error():
    linear = _linear(64, 48, bias=False)
    torch.manual_seed(2)
    x = torch.randn(4096, 64) * 0.5 + torch.linspace(-2, 2, 64)  # inputs with a clear non-zero mean
    spec = LayerQuantSpec("int4", 64, symmetric=True, bias_correction="mean")
    corrected = build_linear("x", linear, spec, torch.float32, {"mean": x.mean(0)})
    plain = Int4Linear.from_linear(linear, LayerQuantSpec("int4", 64, symmetric=True), torch.float32)
    reference = linear(x).detach()
    err_plain, err_corrected = plain(x) - reference, corrected(x) - reference
    assert err_corrected.mean(0).abs().max() < 1e-4  # the mean error per output is gone
    assert err_corrected.pow(2).mean() < err_plain.pow(2).mean()  # and the total squared error drops
    expected = -(x.mean(0) @ (plain.dequantize() - linear.weight.detach()).T)
    torch.testing.assert_close(corrected.bias, expected)


def test_plan_naming_a_missing_tensor_is_a_clear_error():
    model = TinyModel()
    plan = QuantPlan({"lm_head": LayerQuantSpec("int4", 32, high_rows=0.1, row_scores="scores")})
    with pytest.raises(KeyError, match=r"lm_head: the plan names tensor 'scores' \(row_scores\)"):
        quantize_(model, plan)
    with pytest.raises(ValueError, match="one score per output row"):
        quantize_(model, plan, tensors={"scores": torch.rand(7)})


def test_split_layer_inside_a_decoder_layer_runs_unfused(tiny_llama_dir):
    # decode steps fuse a layer's linears; a split layer has no single weight, so it runs as itself
    from mcp2026.loading.loader import load_model

    model = load_model(tiny_llama_dir).model
    name = "layers.0.mlp.down_proj"
    reference = model.get_submodule(name)
    quantize_(model, QuantPlan({name: LayerQuantSpec("int4", 32, high_rows=0.25)}))
    split = model.get_submodule(name)
    assert isinstance(split, SplitRowsLinear)
    dense = nn.Linear(reference.in_features, reference.out_features, bias=False)
    dense.weight = nn.Parameter(split.dequantize())
    ids = torch.tensor([5, 17, 3])
    with torch.inference_mode():
        steps = [model(ids[i : i + 1], torch.tensor([i])) for i in range(1)]  # one decode-sized step
        model.layers[0].mlp.down_proj = dense
        expected = model(ids[:1], torch.tensor([0]))
    torch.testing.assert_close(steps[0], expected, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchs_kernels_get_the_scales_in_the_activations_dtype(monkeypatch, cls, dtype):
    # without our compiled kernels the int linears run torch's, which take the scales in the input's dtype; the
    # stored scales stay as quantized (fp16 for int4, fp32 for int8 per channel)
    monkeypatch.setattr(kernel_ops.cpu, "load", lambda: None)
    torch.manual_seed(0)
    module = cls.from_linear(nn.Linear(128, 64, bias=False), LayerQuantSpec(cls.formats[0]), dtype)
    stored = module.scales_and_zeros if cls is Int4Linear else module.scales
    assert stored.dtype == (torch.float16 if cls is Int4Linear else torch.float32)
    x = torch.randn(3, 128)
    with torch.inference_mode():
        y = module(x)
    expected = x.to(dtype).float() @ module.dequantize().T
    torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.02)
    assert torch.equal(module.torch_scales(dtype), stored.to(dtype))
