"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against HF transformers on the same random weights: the router's
top-k and renormalisation, dense layers among expert layers, the engine over the paged cache (batched and alone,
token by token), quantized experts, and clear errors for routing settings we would not apply."""

from __future__ import annotations

import json

import pytest
import torch

from mcp2026 import Pipeline, QuantConfig
from mcp2026.config import EngineConfig, KVConfig, ModelConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.errors import ModelLoadError
from mcp2026.loading.loader import load_model, parameter_count
from mcp2026.models.moe import Router, SparseMoeBlock
from mcp2026.quant import recipe
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int8_linear import Int8Linear
from mcp2026.types import SamplingParams

from conftest import hf_logits, save_tiny_hf

IDS = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1))
GREEDY = SamplingParams(max_tokens=10)

pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(loaded) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model.compute_logits(loaded.model(IDS, torch.arange(len(IDS))))


@pytest.mark.parametrize(
    "arch,overrides,dense_layers",
    [
        ("qwen3_moe", {}, ()),
        ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [1], "tie_word_embeddings": True}, (1,)),
        ("qwen3_moe", {"num_hidden_layers": 3, "decoder_sparse_step": 2}, (0, 2)),
        ("mixtral", {}, ()),
        ("mixtral", {"sliding_window": 8, "num_experts_per_tok": 1}, ()),
    ],
    ids=["qwen3-moe", "qwen3-moe-unnormalised-dense-layer-tied", "qwen3-moe-sparse-step", "mixtral",
         "mixtral-window-top1"],
)  # fmt: skip
def test_logits_match_hf(tmp_path, arch, overrides, dense_layers):
    path = save_tiny_hf(tmp_path, arch=arch, **overrides)
    ours = load_model(path, dtype=torch.float32)
    config = ours.config
    assert config.num_experts == 4 and config.dense_layers == dense_layers
    assert config.norm_topk_prob == overrides.get("norm_topk_prob", True)
    for i, layer in enumerate(ours.model.layers):
        assert isinstance(layer.mlp, SparseMoeBlock) == (i not in dense_layers)
    assert config.num_params == parameter_count(ours.model)  # experts and routers counted
    assert (_logits(ours) - hf_logits(path, IDS)).abs().max().item() < 1e-4


def test_the_routing_is_what_the_logits_depend_on(tmp_path):
    """The matches above can fail: other routing (no renormalisation, one expert per token) moves the logits."""
    path = save_tiny_hf(tmp_path, arch="qwen3_moe")
    loaded = load_model(path, dtype=torch.float32)
    reference = hf_logits(path, IDS)
    routers = [layer.mlp.router for layer in loaded.model.layers]
    for change in ({"normalize": False}, {"top_k": 1}):
        saved = [(r.normalize, r.top_k) for r in routers]
        for r in routers:
            for key, value in change.items():
                setattr(r, key, value)
        assert (_logits(loaded) - reference).abs().max().item() > 1e-3, change
        for r, (normalize, top_k) in zip(routers, saved, strict=True):
            r.normalize, r.top_k = normalize, top_k


def test_dispatch_groups_tokens_by_expert(tmp_path):
    """One call per expert that has tokens, over all of its tokens at once (never one call per token)."""
    loaded = load_model(save_tiny_hf(tmp_path, arch="mixtral"), dtype=torch.float32)
    block = loaded.model.layers[0].mlp
    rows: list[int] = []
    hooks = [e.register_forward_pre_hook(lambda _m, a: rows.append(a[0].shape[0])) for e in block.experts]
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        block(x)
    for h in hooks:
        h.remove()
    counts = torch.bincount(block.router(x)[1].flatten(), minlength=4)
    assert sorted(rows) == sorted(counts[counts > 0].tolist())
    assert sum(rows) == 24 * 2 and len(rows) <= 4


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return load_model(save_tiny_hf(tmp_path_factory.mktemp("mixtral"), arch="mixtral"), dtype=torch.float32)


def _engine(loaded) -> LLMEngine:
    return LLMEngine(loaded.model, loaded.config, None, EngineConfig(KVConfig(block_size=8, num_blocks=64)))


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, 320, (int(length),), generator=g).tolist() for length in (5, 17, 30, 9)[:n]]


@pytest.mark.usefixtures("kernels")
def test_engine_decodes_token_by_token_as_transformers(mixtral):
    """Over the paged cache, one token a step (the per-op path: expert layers never take the compiled layer)."""
    logits = torch.cat([c.logits for c in _engine(mixtral).score(IDS.tolist(), prompt_len=6, chunk_size=1)])
    assert (logits.float() - hf_logits(mixtral.source, IDS)).abs().max().item() < 2e-4


def test_engine_batched_equals_alone_and_greedy_transformers(mixtral):
    from transformers import AutoModelForCausalLM

    prompts = _prompts(4)
    batched = [o.token_ids for o in _engine(mixtral).generate(prompts, GREEDY)]
    alone = [_engine(mixtral).generate([p], GREEDY)[0].token_ids for p in prompts]
    assert batched == alone
    hf = AutoModelForCausalLM.from_pretrained(mixtral.source, dtype=torch.float32).eval()
    p = prompts[1]
    ref = hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(p) :]
    assert batched[1] == ref.tolist()


def test_cuda_decode_graphs_are_off_for_expert_models(mixtral):
    """The expert group sizes are read on the host each layer: a captured graph would replay one routing."""
    reason = _engine(mixtral).runner.enable_decode_graphs(4, 256, capture=False)
    assert reason is not None and "experts" in reason


@pytest.mark.parametrize(
    "precision,module,tolerance", [("int8", Int8Linear, 1e-3), ("int4", Int4Linear, 0.03)]
)
def test_quantized_experts_run_and_batch_as_they_run_alone(
    tmp_path, monkeypatch, precision, module, tolerance
):
    """Every expert linear quantized (the router not): through the engine the logits are those of the float model
    holding the dequantized weights (up to the kernels' rounding), not the float model's own."""
    fp32_kernels = {"int8": torch.float32, "int4": torch.float32}
    monkeypatch.setattr(
        recipe, "hardware_candidates", lambda device="cpu": (("fp32", "int8", "int4"), fp32_kernels)
    )
    path = save_tiny_hf(tmp_path, arch="qwen3_moe")
    pipe = Pipeline(model=path, config=QuantConfig(target_precision=precision), dtype="fp32")
    model = pipe.loaded.model
    experts = {n: m for n, m in model.named_modules() if ".experts." in n and n.endswith("proj")}
    assert len(experts) == 2 * 4 * 2 and all(isinstance(m, module) for m in experts.values())
    assert all(type(layer.mlp.router) is Router for layer in model.layers)  # the router stays float
    assert model.layers[0].mlp.router.weight.dtype == torch.float32
    logits = torch.cat([c.logits for c in pipe.engine.score(IDS.tolist(), prompt_len=8)]).float()
    floats = load_model(path).model
    dequantized = {n: (m.dequantize(), m.bias) for n, m in model.named_modules() if isinstance(m, module)}
    with torch.no_grad(), recipe.swapped_weights(floats, dequantized):
        expected = floats.compute_logits(floats(IDS, torch.arange(len(IDS))))
    scale = expected.abs().max().item()
    assert (logits - expected).abs().max().item() < tolerance * scale
    assert (logits - hf_logits(path, IDS)).abs().max().item() > tolerance * scale
    prompts = _prompts(3)
    batched = [o.token_ids for o in pipe.engine.generate(prompts, GREEDY)]
    assert batched == [pipe.engine.generate([p], GREEDY)[0].token_ids for p in prompts]


def _edit_config(path, **fields) -> None:
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **fields}))


@pytest.mark.parametrize(
    "arch,field,value,message",
    [
        ("qwen3_moe", "router_scoring_func", "sigmoid", "router_scoring_func='sigmoid' is a routing setting"),
        (
            "qwen3_moe",
            "shared_expert_intermediate_size",
            64,
            "shared_expert_intermediate_size=64 is a routing",
        ),
        ("mixtral", "num_experts_per_group", 2, "num_experts_per_group=2 is a routing setting"),
        ("mixtral", "hidden_act", "gelu", "hidden_act 'gelu' is not supported for the experts"),
    ],
)
def test_settings_we_would_not_apply_are_refused(tmp_path, arch, field, value, message):
    path = save_tiny_hf(tmp_path, arch=arch)
    _edit_config(path, **{field: value})
    with pytest.raises(ModelLoadError, match=message):
        load_model(path)


def test_training_only_router_settings_load(tmp_path):
    """Auxiliary-loss and router-noise settings only act while training: the model loads and matches."""
    path = save_tiny_hf(tmp_path, arch="mixtral")
    _edit_config(path, router_jitter_noise=0.1, output_router_logits=True, router_aux_loss_coef=0.02)
    assert (_logits(load_model(path)) - hf_logits(path, IDS)).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            {"num_experts": 4, "num_experts_per_tok": 5},
            r"num_experts_per_tok must be in \[1, num_experts=4\]",
        ),
        (
            {"num_experts": 4, "num_experts_per_tok": 2, "dense_layers": (2,)},
            r"dense_layers \[2\] must name layers",
        ),
        ({"num_experts_per_tok": 2}, "apply to mixture-of-experts models only"),
    ],
)
def test_model_config_checks_the_expert_fields(fields, message):
    shape = dict(architecture="MixtralForCausalLM", vocab_size=320, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        ModelConfig(**shape, **fields)


def test_a_compiled_artifact_keeps_its_quantized_experts(tmp_path, monkeypatch):
    from mcp2026.quant.artifact import save_artifact

    fp32_kernels = {"int8": torch.float32, "int4": torch.float32}
    monkeypatch.setattr(
        recipe, "hardware_candidates", lambda device="cpu": (("fp32", "int8", "int4"), fp32_kernels)
    )
    loaded = load_model(save_tiny_hf(tmp_path / "hf", arch="qwen3_moe", mlp_only_layers=[1]))
    result = recipe.quantize_model(loaded.model, None, QuantConfig(target_precision="int4"), progress=False)
    back = load_model(save_artifact(tmp_path / "compiled", loaded, result))
    assert back.config == loaded.config and back.config.dense_layers == (1,)
    assert isinstance(back.model.layers[0].mlp.experts[3].down_proj, Int4Linear)
    assert torch.equal(_logits(back), _logits(loaded))
