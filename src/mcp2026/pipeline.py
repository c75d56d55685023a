"""Pipeline: the one-call facade. load -> (quantize) -> engine -> infer, with an optional profile."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mcp2026 import hardware
from mcp2026.config import EngineConfig, KVConfig, QuantConfig, SchedulerConfig, SpeculativeConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.errors import NotSupportedYetError
from mcp2026.kv.compressor import KVCompressor
from mcp2026.loading.compressed_tensors import is_compressed_folder
from mcp2026.loading.loader import LoadedModel, load_model
from mcp2026.loading.loader import weight_bytes as loader_weight_bytes
from mcp2026.quant.block_linear import kernels_unavailable
from mcp2026.quant.compile_cli import CompileSpec
from mcp2026.quant.recipe import gate_for_config, quantize_loaded
from mcp2026.types import CompletionOutput, EmbeddingParams, EmbeddingResult, InferResult, SamplingParams

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}

Messages = Sequence[Mapping[str, Any]]
Inputs = str | Sequence[str] | Sequence[Messages] | Messages


def resolve_dtype(dtype: str | torch.dtype, quant: QuantConfig | None) -> torch.dtype:
    """ "auto": bf16 where it is fast (AVX512-BF16/AMX CPUs, CUDA), else fp32; QuantConfig may pin it."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" and quant is not None and quant.target_precision in ("fp32", "bf16"):
        dtype = quant.target_precision
    if dtype == "auto":
        return torch.bfloat16 if hardware.has_fast_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, fp32, bf16, got {dtype!r}")
    return DTYPES[dtype]


def native_weights_blocker(
    model: str | Path | None, dtype: str | torch.dtype, quant: QuantConfig | None, device: str
) -> str | None:
    """Why a model's stored block quantization will not run as it is (None: it will). Only GGUF files and
    compressed-tensors folders have one; an explicit float dtype or a re-quantization asks for float weights; the blocks' kernels are CPU ones."""
    if model is not None and not (str(model).endswith(".gguf") or is_compressed_folder(model)):
        return "not a GGUF file or a compressed-tensors folder (HF folders and artifacts load as they are stored)"
    if dtype != "auto":
        return f"dtype={dtype} asks for float weights"
    if quant is not None and (quant.quantizes_weights or quant.pressure_bits_budget is not None):
        return f"target_precision={quant.target_precision} re-quantizes float weights"
    if quant is not None and quant.target_precision in ("fp32", "bf16"):
        return f"target_precision={quant.target_precision} asks for float weights"
    if device != "cpu":
        return f"no {device} kernels for GGUF blocks yet"

    return kernels_unavailable()


def _check_quant_supported(quant: QuantConfig | None) -> None:
    if quant is None:
        return
    if quant.target_precision == "fp16":
        raise NotSupportedYetError("fp16 weights are not supported yet; use 'fp32' or 'bf16'")


def normalize_inputs(inputs: Inputs) -> list[str | Messages]:
    """A str, a list of str, one conversation (list of messages) or a list of conversations -> a list."""
    if isinstance(inputs, str):
        return [inputs]
    items = list(inputs)
    if items and all(isinstance(m, Mapping) for m in items):
        return [items]  # one conversation
    for i, item in enumerate(items):
        is_chat = (
            isinstance(item, Sequence)
            and not isinstance(item, str)
            and all(isinstance(m, Mapping) for m in item)
        )
        if not isinstance(item, str) and not is_chat:
            raise ValueError(
                f"inputs[{i}] must be a string or a list of chat messages, got {type(item).__name__}"
            )
    return items


def quant_spec(config: QuantConfig | CompileSpec | None) -> CompileSpec | None:
    """``config`` as a CompileSpec: a QuantConfig gets the calibration and DQG settings a YAML of only its
    fields gives (``compile``'s defaults); a CompileSpec (a quant YAML's ``load_spec``) is kept as it is."""
    if config is None:
        return None

    if isinstance(config, CompileSpec):
        return config
    if isinstance(config, QuantConfig):
        return CompileSpec.from_config(config)
    raise TypeError(
        "config must be a QuantConfig or a CompileSpec (a quant YAML: "
        f"mcp2026.quant.compile_cli.load_spec(path)), got {type(config).__name__}"
    )


def coerce_speculative(value: SpeculativeConfig | str | None) -> SpeculativeConfig:
    """A SpeculativeConfig from itself, a method name ("ngram" | "off") or None (the default)."""
    if value is None:
        return SpeculativeConfig()
    if isinstance(value, str):
        return SpeculativeConfig(method=value)
    if isinstance(value, SpeculativeConfig):
        return value
    raise TypeError(f"speculative must be a SpeculativeConfig or a method name, got {type(value).__name__}")


class Pipeline:
    """``Pipeline(model=None | path, config=QuantConfig(...)).infer(inputs=[...], profile=True)``.

    ``config`` may also be a CompileSpec (``load_spec("q.yaml")``): then the weights are quantized with the
    YAML's ``calibration:`` and ``dqg:`` settings too, exactly as ``mcp2026 compile`` would.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        config: QuantConfig | CompileSpec | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        kv: Any = None,  # KVCompressor, a dict of its fields, or a YAML path
        scheduler: SchedulerConfig | None = None,
        kv_config: KVConfig | None = None,
        speculative: SpeculativeConfig | str | None = None,  # "ngram" (the default) | "off", or the config
    ) -> None:
        spec = quant_spec(config)
        config = spec.quant if spec is not None else None
        _check_quant_supported(config)
        if kv is not None:
            kv = KVCompressor.coerce(kv)
        if device != "cpu" and not (device.startswith("cuda") and torch.cuda.is_available()):
            raise ValueError(
                f"device {device!r} is not available here; use 'cpu'"
                + (" or 'cuda'" if torch.cuda.is_available() else "")
            )
        self.quant_config = config
        self.quant_spec = spec  # the QuantConfig with the calibration and DQG settings used; None unquantized
        self.dtype = resolve_dtype(dtype, config)
        self.device = torch.device(device)
        # why the file's stored quantization does not run as it is (None: it does)
        self.native_blocker = native_weights_blocker(model, dtype, config, device)
        self.loaded: LoadedModel = load_model(model, dtype=self.dtype, native=self.native_blocker is None)
        if self.loaded.file_format == "gguf" and self.native_blocker is not None:
            log.warning(
                "mcp2026: %s runs as %s floats: %s", self.loaded.source.name, self.dtype, self.native_blocker
            )
        self.loaded.model.to(self.device)
        self.quant_result = None  # how the weights were quantized: a mcp2026.quant.dqg.DQGResult
        self.pressure_result = None  # the pressure plan's DQGResult when the config asks for one
        self.gate = None  # a QuantGate holding both plans (the server's traffic gate switches it)
        if config is not None and config.pressure_bits_budget is not None:
            if self.loaded.file_format == "mcp2026-artifact":
                raise ValueError(
                    f"{self.loaded.source} is a compiled artifact (one plan); a pressure plan needs the "
                    "original model: pass the HF folder or GGUF file instead"
                )

            self.quant_result, self.pressure_result, self.gate = gate_for_config(
                self.loaded.model,
                self.loaded.tokenizer,
                config,
                self.device,
                settings=spec.dqg,
                calibration=spec.calibration,
            )
        elif config is not None and config.quantizes_weights:
            self.quant_result = quantize_loaded(
                self.loaded,
                config,
                self.device,
                settings=spec.dqg,
                calibration=spec.calibration,
                gptq_settings=spec.gptq,
                learned_settings=spec.learned,
            )
        kv_config = kv_config or KVConfig(  # block size: the compressor's (EngineConfig resolves it)
            max_kv_cache_shards=config.max_kv_cache_shards if config else 1,
            enable_dtss=config.enable_dtss if config else False,
        )
        self.engine = LLMEngine(
            self.loaded.model,
            self.loaded.config,
            self.loaded.tokenizer,
            EngineConfig(
                kv_config,
                scheduler or SchedulerConfig(),
                kv_compressor=kv,
                speculative=coerce_speculative(speculative),
            ),
        )

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    def encode(self, item: str | Messages, chat: bool | None = None) -> list[int]:
        """Token ids for one input: chat template for message lists (and for strings when ``chat``)."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer; pass token ids to the engine directly")
        if isinstance(item, str):
            if chat:
                return tok.encode_chat([{"role": "user", "content": item}])
            return tok.encode(item)
        return tok.encode_chat(list(item))

    def infer(
        self,
        inputs: Inputs,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        profile: bool = False,
        chat: bool | None = None,
        priority: int | Sequence[int] = 0,
        ttft_deadline_ms: float | None = None,
    ) -> InferResult:
        """Generate for every input, batched on the engine. Outputs keep the input order.

        ``priority`` (one per input, or one for all) and ``ttft_deadline_ms`` reach the scheduler's "priority"
        and "deadline" policies (``SchedulerConfig.policy``); structured output is ``SamplingParams.structured_outputs``.
        """
        items = normalize_inputs(inputs)
        if profile:
            hardware.peak_rss_reset()
            self.engine.stats.reset()
        t0 = time.perf_counter()
        prompts = [self.encode(item, chat) for item in items]
        t_tok = time.perf_counter()
        params = (
            list(sampling)
            if isinstance(sampling, Sequence)
            else [sampling or SamplingParams()] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} inputs")
        priorities = list(priority) if isinstance(priority, Sequence) else [priority] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} inputs")
        engine = self.engine
        deadline = None if ttft_deadline_ms is None else time.monotonic() + ttft_deadline_ms / 1e3
        ids = [
            engine.add_request(p, sp, priority=pr, ttft_deadline=deadline)
            for p, sp, pr in zip(prompts, params, priorities)
        ]
        finals = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        latency = time.perf_counter() - t0
        outputs = [finals[i].output for i in ids]
        result = InferResult(outputs=outputs)
        if profile:
            self._fill_profile(result, [finals[i] for i in ids], latency, (t_tok - t0) * 1e3)
        return result

    def _fill_profile(self, result: InferResult, finals: list, latency_s: float, tokenize_ms: float) -> None:
        stats = self.engine.stats
        num_generated = sum(len(o.output.token_ids) for o in finals)
        ttfts = [o.first_token_time - o.arrival_time for o in finals if o.first_token_time]
        tpots = [
            (o.finish_time - o.first_token_time) / (len(o.output.token_ids) - 1)
            for o in finals
            if o.first_token_time and o.finish_time and len(o.output.token_ids) > 1
        ]
        result.latency_ms = latency_s * 1e3
        result.ttft_ms = 1e3 * sum(ttfts) / len(ttfts) if ttfts else None
        result.tpot_ms = 1e3 * sum(tpots) / len(tpots) if tpots else None
        result.tokens_per_s = num_generated / latency_s if latency_s > 0 else None
        result.peak_rss_bytes = hardware.peak_rss_bytes()
        result.mem_saturation = stats.peak_kv_usage
        result.memory = self.memory_breakdown(result.peak_rss_bytes, stats.peak_kv_usage)
        result.speculation = self.engine.speculation
        result.breakdown = {
            "tokenize": tokenize_ms,
            "prefill": stats.prefill_ms,
            "decode": stats.decode_ms,
            "sample": stats.sample_ms,
            "detokenize": stats.detokenize_ms,
        }
        if stats.decode_ms > 0:
            moved = (
                stats.num_decode_steps * self.weight_bytes()
                + stats.decode_context_tokens * self.engine.cache.bytes_per_token
            )
            result.mem_bw_util = moved / (stats.decode_ms / 1e3) / hardware.peak_read_bandwidth()

    def memory_breakdown(self, rss_bytes: int, kv_usage: float | None) -> dict[str, int]:
        """Bytes by owner: the weights as held, the KV pool (reserved; its pages are committed as blocks are first
        written) and its peak in use, and the rest of the process (activations, the runtime and libraries)."""
        weights = loader_weight_bytes(self.loaded.model)
        pool = self.engine.cache.nbytes
        in_use = int(pool * (kv_usage or 0.0))
        return {
            "weights": weights,
            "kv_pool_reserved": pool,
            "kv_peak_in_use": in_use,
            "activations_and_runtime": max(rss_bytes - weights - in_use, 0),
        }

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (tied embeddings counted once, the embedding table excluded
        unless it doubles as the lm_head)."""
        model = self.loaded.model
        seen, total = set(), 0
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if id(t) in seen or name.startswith("rope."):
                continue
            seen.add(id(t))
            if name == "embed_tokens.weight" and not self.loaded.config.tie_word_embeddings:
                continue
            total += t.numel() * t.element_size()
        return total

    def embed(
        self,
        inputs: str | Sequence[str | Sequence[int]],
        pooling: str = "last",
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> EmbeddingResult:
        """One vector per input (a string, a list of strings or of token-id lists, or one token-id list): the
        final hidden states pooled over the input's last token or all of its tokens (``pooling`` "last" |
        "mean"), the first ``dimensions`` of them, L2-normalised unless ``normalize`` is False. Batched."""
        params = EmbeddingParams(pooling, normalize, dimensions)
        if isinstance(inputs, str):
            items: list[str | Sequence[int]] = [inputs]
        elif inputs and all(isinstance(t, int) for t in inputs):
            items = [list(inputs)]  # one token-id list
        else:
            items = list(inputs)
        return self.engine.embedder.embed(items, params)

    def generate(
        self, prompt: str | Messages, sampling: SamplingParams | None = None, chat: bool | None = None
    ) -> CompletionOutput:
        return self.infer(
            [prompt] if isinstance(prompt, str) else [list(prompt)], sampling, chat=chat
        ).outputs[0]
