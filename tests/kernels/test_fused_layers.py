"""Decode-sized steps run each layer as two compiled calls; they must give exactly what the per-op path gives."""

from __future__ import annotations

import copy

import pytest
import torch

from mcp2026.config import EngineConfig, KVConfig, SpeculativeConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.loading.loader import load_model
from mcp2026.models import fused_linear
from mcp2026.quant.linear import quantize_
from mcp2026.quant.plan import LayerQuantSpec, QuantPlan
from mcp2026.types import SamplingParams

from conftest import count_fused_calls, save_tiny_hf

SAMPLING = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
PROMPTS = [[5, 9, 33, 2, 7], [100, 3, 8], list(range(40, 75))]


@pytest.fixture(scope="module")
def tiny_qkv_bias(tmp_path_factory):
    # qwen2: q/k/v carry a bias, which the fused linear must add as the module does
    return load_model(save_tiny_hf(tmp_path_factory.mktemp("fused_qwen2"), arch="qwen2"))


def _run(
    loaded, fused: bool, monkeypatch, speculative: str = "ngram", prompts=PROMPTS
) -> list[tuple[list[int], list]]:
    monkeypatch.setattr(fused_linear, "ENABLED", fused)
    config = EngineConfig(KVConfig(num_blocks=128), speculative=SpeculativeConfig(method=speculative))
    engine = LLMEngine(loaded.model, loaded.config, None, config)
    return [(o.token_ids, o.logprobs) for o in engine.generate(prompts, SAMPLING)]


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize(
    "spec",
    [None, LayerQuantSpec("int8"), LayerQuantSpec("int4", group_size=32), LayerQuantSpec("bf16")],
    ids=["fp32", "int8", "int4", "bf16-weights"],
)
def test_fused_decode_equals_the_per_op_path(tiny_qkv_bias, spec, monkeypatch):
    from mcp2026.models import decode_stack

    loaded = copy.deepcopy(tiny_qkv_bias)
    if spec is not None:
        quantize_(loaded.model, QuantPlan({"layers.*": spec}))
    monkeypatch.setattr(decode_stack, "ENABLED", False)  # the per-layer calls (the whole stack: below)
    calls = count_fused_calls(monkeypatch)
    fused = _run(loaded, True, monkeypatch)
    assert calls[0] > 0  # the fused path really ran
    calls[0] = 0
    plain = _run(loaded, False, monkeypatch)
    assert calls[0] == 0
    assert fused == plain  # token ids and logprobs, bit for bit


@pytest.mark.usefixtures("kernels")
def test_layers_with_an_unfusable_linear_take_the_per_op_path(tiny_qkv_bias, monkeypatch):
    loaded = copy.deepcopy(tiny_qkv_bias)
    quantize_(loaded.model, QuantPlan({"layers.0.mlp.down_proj": LayerQuantSpec("fp8")}))
    calls = count_fused_calls(monkeypatch)
    fused = _run(loaded, True, monkeypatch)
    steps = calls[0]
    assert steps > 0  # layer 1 fused, layer 0 not
    plain = _run(loaded, False, monkeypatch)
    assert fused == plain


@pytest.mark.usefixtures("kernels")
def test_new_weights_and_swapped_modules_are_picked_up(tiny_qkv_bias, monkeypatch):
    """The compiled handles are cached on the modules: a weight reload and a module swap (the runtime gate's
    plan switch) must both be seen by the next step."""
    loaded = copy.deepcopy(tiny_qkv_bias)
    quantize_(loaded.model, QuantPlan({"layers.*": LayerQuantSpec("int4", group_size=32)}))
    before = _run(loaded, True, monkeypatch)
    layer = loaded.model.layers[1]
    other = copy.deepcopy(loaded)
    quantize_(other.model, QuantPlan({"layers.*": LayerQuantSpec("int8")}))
    layer.mlp.gate_up_proj = other.model.layers[1].mlp.gate_up_proj  # module swap
    state = {k: torch.randn_like(v.float()).to(v.dtype) if v.is_floating_point() else v for k, v in
             layer.attn.o_proj.state_dict().items()}  # fmt: skip
    layer.attn.o_proj.load_state_dict(state)  # new weights, same module
    after_fused = _run(loaded, True, monkeypatch)
    after_plain = _run(loaded, False, monkeypatch)
    assert after_fused == after_plain
    assert after_fused != before


def test_kv_rows_kernel_matches_index_copy(kernels):
    torch.manual_seed(0)
    planes = torch.zeros(2, 40, 8)  # (k|v, rows, hd)
    qkv = torch.randn(3, 5, 8)  # a (T, heads, hd) buffer: k and v are strided head slices of it
    k, v = qkv[:, 1:3], qkv[:, 3:5]
    rows = torch.tensor([7, 0, 39, 12, 5, 6])
    kernels.write_kv_rows(planes[0], planes[1], rows, k, v)
    expected = torch.zeros(2, 40, 8)
    expected[0].index_copy_(0, rows, k.reshape(-1, 8))
    expected[1].index_copy_(0, rows, v.reshape(-1, 8))
    assert torch.equal(planes, expected)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.write_kv_rows(planes[0], planes[1], torch.tensor([0, 1, 2, 3, 4, 40]), k, v)


@pytest.mark.usefixtures("kernels")
def test_a_model_with_cached_handles_can_be_copied_and_pickled(tiny_qkv_bias, monkeypatch):
    import pickle

    loaded = copy.deepcopy(tiny_qkv_bias)
    first = _run(loaded, True, monkeypatch)  # handles now cached on the modules
    assert "_fused" in loaded.model.layers[0].attn.qkv_proj.__dict__
    twin = copy.deepcopy(loaded)
    assert _run(twin, True, monkeypatch) == first
    restored = pickle.loads(pickle.dumps(loaded.model))
    assert restored.layers[0].attn.qkv_proj.__dict__.get("_fused") is None


@pytest.mark.usefixtures("kernels")
def test_forward_hooks_still_see_every_linear(tiny_qkv_bias, monkeypatch):
    """Calibration captures activations with forward hooks: hooked layers must not be fused past them."""
    loaded = copy.deepcopy(tiny_qkv_bias)
    seen = []
    handle = loaded.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, y: seen.append(y.shape))
    calls = count_fused_calls(monkeypatch)
    with_hook = _run(loaded, True, monkeypatch, speculative="off")  # one token per decode step
    assert len(seen) == 10  # one prefill step and 9 decode steps of the batch
    assert calls[0] > 0  # layer 0 still fused
    handle.remove()
    assert with_hook == _run(loaded, True, monkeypatch)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16"])
def test_a_16_bit_cache_is_read_in_place_under_fp32_activations(tiny_qkv_bias, kv_dtype):
    """bf16/fp16 K/V with an fp32 model: written narrowed by one kernel call, read by the decode kernel in
    place; same tokens as the gather-and-matmul path over the same stored values."""
    from mcp2026.kv.compressor import KVCompressor

    def run(in_place: bool):
        config = EngineConfig(
            KVConfig(num_blocks=64), kv_compressor=KVCompressor(dtype=kv_dtype, policy="none")
        )
        engine = LLMEngine(tiny_qkv_bias.model, tiny_qkv_bias.config, None, config)
        assert engine.runner.fused_decode  # the storage allows it
        engine.runner.fused_decode = in_place
        return engine.generate(PROMPTS, SAMPLING)

    kernel, gathered = run(True), run(False)
    assert [o.token_ids for o in kernel] == [o.token_ids for o in gathered]
    for a, b in zip(kernel, gathered):
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8"])
def test_a_quantized_cache_is_decoded_by_the_kernel_as_it_reads(tiny_qkv_bias, kv_dtype):
    """int8 / int4 / fp8 K/V: the decode kernel reads the quantized blocks (and int4's staged bf16 tails) in place;
    same tokens as gathering and decoding the blocks with the codec, then attending."""
    from mcp2026.kernels import ops
    from mcp2026.kv.compressor import KVCompressor

    calls = []
    real = ops.paged_decode_attention_quantized

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    def run(in_place: bool):
        config = EngineConfig(
            KVConfig(num_blocks=64, block_size=8),
            kv_compressor=KVCompressor(dtype=kv_dtype, policy="none", block_size=8),
        )
        engine = LLMEngine(tiny_qkv_bias.model, tiny_qkv_bias.config, None, config)
        assert engine.runner.fused_decode  # the storage allows it
        engine.runner.fused_decode = in_place
        return engine.generate(PROMPTS, SAMPLING)

    ops.paged_decode_attention_quantized = counted
    try:
        kernel = run(True)
        assert calls and set(calls) == {{"int8": 1, "int4": 2, "fp8": 3}[kv_dtype]}
        n = len(calls)
        gathered = run(False)
        assert len(calls) == n  # the gather path never calls it
    finally:
        ops.paged_decode_attention_quantized = real
    assert [o.token_ids for o in kernel] == [o.token_ids for o in gathered]
    for a, b in zip(kernel, gathered):
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4


def test_fused_steps_are_under_every_formats_gemv_row_limit():
    # The model decides "quantized linears take their GEMVs" once per fused step, with the int8 limit; that
    # answer holds for int4 too only while fused steps are smaller than both limits.
    from mcp2026.kernels import ops
    from mcp2026.quant import cpu_routing as routing

    assert min(routing.GEMV_BATCH_MAX_ROWS, routing.INT4_GEMV_BATCH_MAX_ROWS) >= ops.FUSED_MAX_ROWS


def _count_stack_runs(monkeypatch) -> list[int]:
    from mcp2026.models import decode_stack

    calls = [0]
    original = decode_stack.run

    def counting(*args):
        calls[0] += 1
        return original(*args)

    monkeypatch.setattr(decode_stack, "run", counting)
    return calls


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("speculative", ["off", "ngram"])
@pytest.mark.parametrize(
    "spec",
    [None, LayerQuantSpec("int8"), LayerQuantSpec("int4", group_size=32), LayerQuantSpec("bf16")],
    ids=["fp32", "int8", "int4", "bf16-weights"],
)
def test_whole_stack_decode_equals_the_per_layer_path(tiny_qkv_bias, spec, speculative, monkeypatch):
    """Decode-only steps over a raw cache run every layer in one compiled call: same tokens and logprobs, bit
    for bit, as the per-layer loop (drafted steps included: their rows are decodes too)."""
    from mcp2026.models import decode_stack

    loaded = copy.deepcopy(tiny_qkv_bias)
    if spec is not None:
        quantize_(loaded.model, QuantPlan({"layers.*": spec}))
    runs = _count_stack_runs(monkeypatch)
    stacked = _run(loaded, True, monkeypatch, speculative)
    assert runs[0] > 0
    runs[0] = 0
    monkeypatch.setattr(decode_stack, "ENABLED", False)
    per_layer = _run(loaded, True, monkeypatch, speculative)
    assert runs[0] == 0
    assert stacked == per_layer


@pytest.mark.usefixtures("kernels")
def test_the_stack_with_three_threads_equals_the_per_layer_path(tiny_qkv_bias, monkeypatch):
    """The stack runs its layers with one thread team (kernels/thread_team.h): with three threads each loop is
    divided three ways through it, and the results stay those of the per-layer path's at::parallel_for."""
    from mcp2026.models import decode_stack

    loaded = copy.deepcopy(tiny_qkv_bias)
    quantize_(loaded.model, QuantPlan({"layers.*": LayerQuantSpec("int4", group_size=32)}))
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        runs = _count_stack_runs(monkeypatch)
        stacked = _run(loaded, True, monkeypatch, "off")
        assert runs[0] > 0
        monkeypatch.setattr(decode_stack, "ENABLED", False)
        assert _run(loaded, True, monkeypatch, "off") == stacked
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("kernels")
def test_an_error_inside_the_stack_reaches_python_and_the_team_ends(tiny_qkv_bias, monkeypatch):
    """A kernel's check failing inside the team (a length beyond the block table) is a RuntimeError naming it,
    not a hang or a crash, and the next call runs normally."""
    loaded = copy.deepcopy(tiny_qkv_bias)
    _run(loaded, True, monkeypatch, "off")
    model, cfg = loaded.model, loaded.config
    stack = model.__dict__["_decode_stack"]._stack
    x = model.embed_tokens(torch.tensor([5]))
    cos, sin = model.rope.table(torch.tensor([3]), x.dtype)
    planes = torch.zeros(cfg.num_layers, 4, cfg.num_kv_heads, 16, cfg.head_dim)
    rows = torch.tensor([h * 16 + 3 for h in range(cfg.num_kv_heads)])  # block 0, slot 3 of each head
    tables = torch.tensor([[0]])
    with pytest.raises(RuntimeError, match="length out of range"):
        stack.run(x, cos, sin, planes, planes.clone(), rows, tables, torch.tensor([17]))
    hidden, residual = stack.run(x, cos, sin, planes, planes.clone(), rows, tables, torch.tensor([4]))
    assert torch.isfinite(hidden).all() and torch.isfinite(residual).all()


@pytest.mark.usefixtures("kernels")
def test_the_stack_is_rebuilt_when_a_layer_changes(tiny_qkv_bias, monkeypatch):
    loaded = copy.deepcopy(tiny_qkv_bias)
    quantize_(loaded.model, QuantPlan({"layers.*": LayerQuantSpec("int4", group_size=32)}))
    before = _run(loaded, True, monkeypatch)
    stack = loaded.model.__dict__["_decode_stack"]._stack
    norm = loaded.model.layers[1].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 1.5)  # a new norm weight tensor
    after = _run(loaded, True, monkeypatch)
    assert loaded.model.__dict__["_decode_stack"]._stack is not stack
    assert after != before
    from mcp2026.models import decode_stack

    monkeypatch.setattr(decode_stack, "ENABLED", False)
    assert _run(loaded, True, monkeypatch) == after


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("change", ["hook", "swap", "drop"])
def test_a_change_after_the_stack_is_built_ends_the_guard(tiny_qkv_bias, change, monkeypatch):
    """While the recorded lookups hold, steps skip every layer's ``fused`` walk. A forward hook, a swapped
    module and a dropped compiled copy must each be seen on the next step: the hook sees its calls (the
    per-layer path runs), a swapped module computes, a dropped copy is rebuilt."""
    from mcp2026.models import decode_stack

    loaded = copy.deepcopy(tiny_qkv_bias)
    quantize_(loaded.model, QuantPlan({"layers.*": LayerQuantSpec("int4", group_size=32)}))
    runs = _count_stack_runs(monkeypatch)
    before = _run(loaded, True, monkeypatch)
    cache = loaded.model.__dict__["_decode_stack"]
    assert runs[0] > 0 and cache._guard is not None and cache._guard.holds()
    stack, mlp = cache._stack, loaded.model.layers[1].mlp
    seen: list[torch.Size] = []
    if change == "hook":
        mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    elif change == "swap":
        mlp.down_proj = copy.deepcopy(tiny_qkv_bias.model.layers[1].mlp.down_proj)  # fp32 in place of int4
    else:
        del mlp.down_proj.__dict__["_fused"]
    assert not cache._guard.holds()
    runs[0] = 0
    after = _run(loaded, True, monkeypatch)
    if change == "hook":
        assert seen and runs[0] == 0 and after == before
        return
    assert runs[0] > 0 and cache._stack is not stack and cache._guard.holds()
    assert (after == before) == (change == "drop")
    monkeypatch.setattr(decode_stack, "ENABLED", False)
    assert _run(loaded, True, monkeypatch) == after


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize(
    ("kv_dtype", "policy", "stacked"),
    [("int8", "none", False), ("bf16", "none", True), ("fp32", "heavy_hitter", False)],
)
def test_steps_the_stack_cannot_run_take_the_per_layer_path(
    tiny_qkv_bias, kv_dtype, policy, stacked, monkeypatch
):
    """An encoded cache (int8) and eviction scores (heavy_hitter) need the per-layer attention: no stack runs.
    A bf16 cache under fp32 activations is raw storage: the stack runs it, widening on read."""
    from mcp2026.kv.compressor import KVCompressor

    runs = _count_stack_runs(monkeypatch)
    compressor = KVCompressor(
        dtype=kv_dtype, policy=policy, sparsity_ratio=0.5 if policy != "none" else None, block_size=8
    )
    config = EngineConfig(KVConfig(num_blocks=64, block_size=8), kv_compressor=compressor)
    LLMEngine(tiny_qkv_bias.model, tiny_qkv_bias.config, None, config).generate(PROMPTS, SAMPLING)
    assert (runs[0] > 0) == stacked


GEMMA_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module", params=["gemma3", "gemma3-short-window", "qwen3"])
def tiny_with_extras(request, tmp_path_factory):
    """Layers the compiled path runs with ``kernels.LayerExtras``: Gemma 3 (q/k norms, sandwich norms, GeGLU,
    local and global rotary tables) with a window longer than every sequence here and one of 8 tokens (the
    sliding layers attend from each sequence's window start), and Qwen3 (q/k norms)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        return load_model(save_tiny_hf(folder, arch="qwen3"))
    window = 8 if request.param == "gemma3-short-window" else 256
    return load_model(
        save_tiny_hf(
            folder, arch="gemma3", num_hidden_layers=3, layer_types=GEMMA_LAYERS, sliding_window=window
        )
    )


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize(
    "spec",
    [None, LayerQuantSpec("int4", group_size=32), LayerQuantSpec("bf16")],
    ids=["fp32", "int4", "bf16"],
)
def test_layers_with_extras_give_the_per_op_results_fused_and_stacked(tiny_with_extras, spec, monkeypatch):
    from mcp2026.models import decode_stack

    loaded = copy.deepcopy(tiny_with_extras)
    if spec is not None:
        quantize_(loaded.model, QuantPlan({"layers.*": spec}))
    stack_runs = _count_stack_runs(monkeypatch)
    calls = count_fused_calls(monkeypatch)
    stacked = _run(loaded, True, monkeypatch, "off")
    assert calls[0] > 0 and stack_runs[0] > 0
    monkeypatch.setattr(decode_stack, "ENABLED", False)
    per_layer = _run(loaded, True, monkeypatch, "off")
    calls[0] = 0
    per_op = _run(loaded, False, monkeypatch, "off")
    assert calls[0] == 0
    assert stacked == per_layer == per_op  # token ids and logprobs, bit for bit
    if loaded.config.sliding_window == 8:  # the window's start against the gathered window and its mask
        _gather_windows(monkeypatch)
        gathered = _run(loaded, False, monkeypatch, "off")
        for (ids, logprobs), (ref_ids, ref_logprobs) in zip(stacked, gathered):
            assert ids == ref_ids
            for step, ref in zip(logprobs, ref_logprobs):
                assert step.token_id == ref.token_id and abs(step.logprob - ref.logprob) < 1e-4
                assert step.top.keys() == ref.top.keys()
                assert all(abs(step.top[t] - ref.top[t]) < 1e-4 for t in step.top)


def _gather_windows(monkeypatch) -> None:
    """Sliding layers read their windows through the gather path (what the GPU runs) instead of the paged
    kernel from each window's start."""
    from mcp2026.engine.runner import ModelRunner

    original = ModelRunner._window_view

    def gathering(self, decodes, prefills, stage_after, window, in_place):
        return original(self, decodes, prefills, stage_after, window, False)

    monkeypatch.setattr(ModelRunner, "_window_view", gathering)


@pytest.mark.usefixtures("kernels")
def test_changed_extra_norms_reach_the_compiled_layers(tiny_with_extras, monkeypatch):
    loaded = copy.deepcopy(tiny_with_extras)
    before = _run(loaded, True, monkeypatch, "off")
    for layer in loaded.model.layers:
        layer.attn.k_norm.weight = torch.nn.Parameter(layer.attn.k_norm.weight * 3.0)
    after = _run(loaded, True, monkeypatch, "off")
    assert after == _run(loaded, False, monkeypatch, "off") and after != before


# 12 sequences decoding together: more rows than the int8 / int4 GEMVs take (routing.GEMV_MAX_ROWS)
MANY_PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(3 + i)] for i in range(12)]


@pytest.mark.parametrize(
    "spec",
    [None, LayerQuantSpec("int8"), LayerQuantSpec("int4", group_size=32)],
    ids=["fp32", "int8", "int4"],
)
def test_batched_steps_past_the_gemv_rows_fuse_where_the_module_runs_one_kernel(
    tiny_qkv_bias, spec, kernels, monkeypatch
):
    """Past the GEMVs' row limit the compiled layers still run the linears whose module runs one kernel at every
    row count (float weights, the VNNI int4 / int8 GEMMs, a GGUF's stored blocks): same results as per op."""
    from mcp2026.models import decode_stack
    from mcp2026.quant import cpu_routing

    assert len(MANY_PROMPTS) > cpu_routing.GEMV_MAX_ROWS
    loaded = copy.deepcopy(tiny_qkv_bias)
    if spec is not None:
        quantize_(loaded.model, QuantPlan({"layers.*": spec}))
    kinds = set()
    for m in _linears(loaded.model):
        fused_linear.fused_linear(kernels, m, True)
        kinds.add(m.__dict__["_fused"].value[0])
    runs = _count_stack_runs(monkeypatch)
    stacked = _run(loaded, True, monkeypatch, "off", MANY_PROMPTS)
    assert (runs[0] > 0) == (kinds <= fused_linear.ROW_COUNT_FREE)
    monkeypatch.setattr(decode_stack, "ENABLED", False)
    assert stacked == _run(loaded, False, monkeypatch, "off", MANY_PROMPTS)


@pytest.mark.usefixtures("kernels")
def test_a_gguf_s_stored_blocks_fuse_at_every_batch_size(tmp_path, monkeypatch):
    from gguf_files import write_tiny_gguf

    loaded = load_model(write_tiny_gguf(tmp_path / "tiny.gguf", "Q5_0", tie=True), torch.float32, native=True)
    runs = _count_stack_runs(monkeypatch)
    stacked = _run(loaded, True, monkeypatch, "off", MANY_PROMPTS)
    assert runs[0] > 0
    assert stacked == _run(loaded, False, monkeypatch, "off", MANY_PROMPTS)


def _linears(model):
    return [
        m for name, m in model.named_modules() if name.startswith("layers.") and hasattr(m, "in_features")
    ]
