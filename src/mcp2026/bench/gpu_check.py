"""The GPU check: exactness against HF transformers and speed beside it, on one CUDA GPU, in one run.

The model is SmolLM2-135M's shape (30 layers, 576 wide, 9 query heads on 3 KV heads, 49152 tokens) with
random weights, built here and saved as an HF folder, so the check needs no network and no model file. Each
figure of ours is taken in the same process as HF's on the same GPU, one after the other.

    python -m mcp2026.bench.gpu_check --out gpu_check.json --docs docs/benchmarks.md

Prints one JSON object; ``--docs`` rewrites the file's section between the gpu-check markers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.kernels import gpu
from mcp2026.kv.compressor import KVCompressor
from mcp2026.loading.loader import LoadedModel, load_model
from mcp2026.quant.linear import QuantLinear, quantize_
from mcp2026.quant.plan import QuantPlan
from mcp2026.types import SamplingParams

SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)  # fmt: skip
# a 2-layer model of the same family: how the CPU test runs every stage of the check (``run(tiny=True)``)
TINY = {**SHAPE, "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
START, END = "<!-- gpu-check:start -->", "<!-- gpu-check:end -->"
BLOCKS = 12288  # KV pool: 256 sequences x 256 tokens is 4096 blocks of 16; the rest is headroom
_where = {"device": "cuda", "shape": SHAPE, "scale": 1}  # set by run()


def _n(size: int) -> int:
    """A length or count of the check; an eighth of it for the tiny CPU run."""
    return size // _where["scale"]


def build_checkpoint(path: Path, seed: int = 0) -> Path:
    """An HF Llama folder at SmolLM2-135M's shape with random weights (norms drawn away from 1 so that they
    matter)."""

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**_where["shape"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


def _sync() -> None:
    if _where["device"] == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, _where["shape"]["vocab_size"], (n, length), generator=g).tolist()


def ours(path: Path, dtype: torch.dtype) -> LoadedModel:
    loaded = load_model(path, dtype)
    loaded.model.to(_where["device"])
    return loaded


def engine(
    loaded: LoadedModel,
    max_seqs: int = 256,
    budget: int = 8192,
    graphs: bool = True,
    kv: KVCompressor | None = None,
) -> LLMEngine:
    """The engine as a GPU deployment sets it: a step budget of 8192 tokens (a prompt is split only past it)."""
    sched = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=4096,
        long_prefill_token_threshold=budget,
    )
    config = EngineConfig(
        KVConfig(block_size=16, num_blocks=BLOCKS),
        sched,
        kv_compressor=kv,
        cuda_graph_max_batch=256 if graphs else 0,
    )
    return LLMEngine(loaded.model, loaded.config, None, config)


def hf_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(_where["device"]).eval()


# ---- exactness ------------------------------------------------------------------------------------------
def _score(eng: LLMEngine, tokens: list[int]) -> torch.Tensor:
    return torch.cat([c.logits.float().cpu() for c in eng.score(tokens)])


@torch.inference_mode()
def exactness(path: Path) -> dict[str, Any]:
    """Prefill logits of 256 tokens against HF's on the same GPU (fp32 and bf16), and greedy decode through
    the captured graphs checked token by token against HF's fp32 logits."""
    tokens = _prompts(1, 256, seed=1)[0]
    ids = torch.tensor([tokens], device=_where["device"])
    hf32 = hf_model(path, torch.float32)
    ref = hf32(ids).logits[0].float().cpu()
    hf16 = hf_model(path, torch.bfloat16)
    hf_bf16 = hf16(ids).logits[0].float().cpu()
    del hf16
    ours32 = engine(ours(path, torch.float32), max_seqs=8)
    ours16 = engine(ours(path, torch.bfloat16), max_seqs=8)
    ours_fp32, ours_bf16 = _score(ours32, tokens), _score(ours16, tokens)
    result = {
        "prefill_fp32_max_abs_diff": (ours_fp32 - ref).abs().max().item(),
        "prefill_bf16_max_abs_diff": (ours_bf16 - ref).abs().max().item(),
        "hf_bf16_max_abs_diff": (hf_bf16 - ref).abs().max().item(),
        "prefill_bf16_mean_abs_diff": (ours_bf16 - ref).abs().mean().item(),
        "hf_bf16_mean_abs_diff": (hf_bf16 - ref).abs().mean().item(),
    }
    # decode: our fp32 greedy tokens through the graphs; HF's fp32 logits at every step must rank each of
    # them first (a gap to HF's best logit within fp32 noise)
    prompt = tokens[:64]
    out = ours32.generate([prompt], SamplingParams(max_tokens=64, ignore_eos=True))[0].token_ids
    logits = (
        hf32(torch.tensor([prompt + out], device=_where["device"])).logits[0, len(prompt) - 1 : -1].float()
    )
    chosen = logits.gather(1, torch.tensor(out, device=_where["device"])[:, None])[:, 0]
    result["decode_fp32_max_gap_to_hf_argmax"] = (logits.max(1).values - chosen).max().item()
    result["decode_graph_replays"] = ours32.runner.graphs.num_runs if ours32.runner.graphs else 0
    return result


# ---- speed ----------------------------------------------------------------------------------------------
def _decode_ms(eng: LLMEngine, prompt: list[int], new_tokens: int) -> float:
    """Milliseconds per decode step of one sequence (prefill and the first token excluded)."""
    eng.add_request(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    eng.step()  # prefill + first token
    _sync()
    t0, steps = time.perf_counter(), 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    _sync()
    return 1e3 * (time.perf_counter() - t0) / steps


@torch.inference_mode()
def batch1_decode(path: Path, loaded: LoadedModel, hf: torch.nn.Module) -> dict[str, Any]:
    prompt = _prompts(1, _n(128), seed=2)[0]
    result = {}
    for name, graphs in (("ours_graphs", True), ("ours_eager", False)):
        eng = engine(loaded, max_seqs=8, graphs=graphs)
        _decode_ms(eng, prompt, 32)  # warm-up: kernels compiled, the graph captured
        result[f"{name}_ms_per_token"] = _decode_ms(eng, prompt, _n(256))
    ids = torch.tensor([prompt], device=_where["device"])
    hf_gen = dict(
        max_new_tokens=_n(256), min_new_tokens=_n(256), do_sample=False, cache_implementation="static"
    )
    hf.generate(ids, **hf_gen)  # the same call once before: whatever HF compiles for it is not timed
    result["hf_static_ms_per_token_incl_prefill"] = 1e3 * _timed(lambda: hf.generate(ids, **hf_gen)) / _n(256)
    return result


@torch.inference_mode()
def batched(loaded: LoadedModel, hf: torch.nn.Module, num_seqs: int, hf_too: bool) -> dict[str, Any]:
    """``num_seqs`` x (128 in, 128 out): output tokens per second of the whole run."""
    num_seqs, new = _n(num_seqs), _n(128)
    prompts = _prompts(num_seqs, _n(128), seed=3)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    eng = engine(loaded)
    eng.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    eng.generate(prompts, params)  # captures the buckets this run meets
    eng.stats.reset()
    seconds = _timed(lambda: eng.generate(prompts, params))
    st = eng.stats
    # where a step's time goes (execute returns once the graph is launched; sampling waits for the GPU)
    steps = {"steps": st.num_steps, "decode_steps": st.num_decode_steps, "wall_ms": 1e3 * seconds}
    steps.update(
        {k: round(getattr(st, k), 1) for k in ("prefill_ms", "decode_ms", "sample_ms", "detokenize_ms")}
    )
    result = {"ours_output_tok_s": num_seqs * new / seconds, "ours_step_ms_totals": steps}
    if hf_too:
        ids = torch.tensor(prompts, device=_where["device"])
        gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
        hf.generate(ids, **gen)  # the same call once before: whatever HF compiles for it is not timed
        result["hf_static_output_tok_s"] = num_seqs * new / _timed(lambda: hf.generate(ids, **gen))
    return result


@torch.inference_mode()
def prefill(loaded: LoadedModel, hf: torch.nn.Module) -> dict[str, Any]:
    """8 x 2048-token prompts, one token each: prompt tokens per second."""
    prompts = _prompts(8, _n(2048), seed=4)
    eng = engine(loaded, max_seqs=8, budget=16384)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.generate(prompts, one)
    seconds = min(_timed(lambda: eng.generate(prompts, one)) for _ in range(3))
    ids = torch.tensor(prompts, device=_where["device"])
    hf(ids[:1, :128])
    hf_seconds = min(_timed(lambda: hf(ids, logits_to_keep=1)) for _ in range(3))
    return {"ours_tok_s": 8 * _n(2048) / seconds, "hf_forward_tok_s": 8 * _n(2048) / hf_seconds}


@torch.inference_mode()
def quantized_decode(path: Path) -> dict[str, Any]:
    """Batch-1 decode with every linear in int8 / int4 / fp8 (bf16 activations), and each kernel checked
    against its own dequantized weights on one random input (relative error of the layer's output)."""
    prompt = _prompts(1, _n(128), seed=5)[0]
    result: dict[str, Any] = {}
    for fmt, extra in (("int8", {}), ("int4", {"group_size": 32}), ("fp8", {})):
        try:
            loaded = ours(path, torch.bfloat16)
            quantize_(loaded.model, QuantPlan.uniform(fmt, **extra), compute_dtypes={fmt: torch.bfloat16})
            worst = 0.0
            hidden = _where["shape"]["hidden_size"]
            x = torch.randn(4, hidden, device=_where["device"], dtype=torch.bfloat16)
            for m in loaded.model.modules():
                if isinstance(m, QuantLinear) and m.in_features == hidden:
                    ref = x.float() @ m.dequantize().float().t()
                    got = m(x).float()
                    worst = max(worst, ((got - ref).norm() / ref.norm()).item())
            eng = engine(loaded, max_seqs=8)
            _decode_ms(eng, prompt, 32)
            result[fmt] = {"ms_per_token": _decode_ms(eng, prompt, _n(256)), "kernel_rel_error": worst}
        except Exception as error:  # noqa: BLE001 - one format failing must not hide the others' figures
            result[fmt] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return result


@torch.inference_mode()
def kv_quantized_decode(loaded: LoadedModel) -> dict[str, Any]:
    """bf16 weights over an int8 / fp8 KV cache (read in place by the decode kernel): batch-1 ms per token and
    64 x (128 in, 128 out) output tok/s, and whether the decode steps replayed graphs."""
    prompt = _prompts(1, _n(128), seed=6)[0]
    prompts = _prompts(_n(64), _n(128), seed=7)
    params = SamplingParams(max_tokens=_n(128), ignore_eos=True)
    result: dict[str, Any] = {}
    for dtype in ("int8", "fp8"):
        try:
            eng = engine(loaded, max_seqs=8, kv=KVCompressor(dtype=dtype))
            _decode_ms(eng, prompt, 32)
            row: dict[str, Any] = {"ms_per_token": _decode_ms(eng, prompt, _n(256))}
            row["graphs"] = eng.runner.graphs is not None and eng.runner.graphs.num_runs > 0
            eng = engine(loaded, kv=KVCompressor(dtype=dtype))
            eng.generate(prompts, params)  # captures the buckets this run meets
            row["batch64_output_tok_s"] = (
                len(prompts) * params.max_tokens / _timed(lambda eng=eng: eng.generate(prompts, params))
            )
            result[dtype] = row
        except Exception as error:  # noqa: BLE001 - one codec failing must not hide the other's figures
            result[dtype] = {"error": f"{type(error).__name__}: {error}"[:300]}
    return result


def environment() -> dict[str, Any]:
    if _where["device"] == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu_name, capability = props.name, f"sm{props.major}{props.minor}"
    else:
        gpu_name, capability = "cpu", "-"
    commit = os.environ.get("MCP2026_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"

    return {
        "gpu": gpu_name,
        "capability": capability,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "kernels": gpu.status(),
        "commit": commit,
    }


def run(quick: bool = False, tiny: bool = False) -> dict[str, Any]:
    """Every stage, each one's failure reported in its place. ``tiny`` runs a 2-layer model of the family on
    the CPU (how tests exercise the check without a GPU; its figures mean nothing)."""
    if not tiny and not torch.cuda.is_available():
        raise SystemExit("the GPU check needs a CUDA GPU (torch.cuda.is_available() is False)")
    _where.update(device="cpu" if tiny else "cuda", shape=TINY if tiny else SHAPE, scale=8 if tiny else 1)
    results: dict[str, Any] = {"environment": environment()}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "smollm2-135m-shape")
        stages: list[tuple[str, Callable[[], Any]]] = [("exactness", lambda: exactness(path))]
        loaded = ours(path, torch.bfloat16)
        hf = hf_model(path, torch.bfloat16)
        stages += [
            ("decode_batch1_bf16", lambda: batch1_decode(path, loaded, hf)),
            ("batch64_128in_128out_bf16", lambda: batched(loaded, hf, 64, hf_too=True)),
            ("prefill_8x2048_bf16", lambda: prefill(loaded, hf)),
        ]
        if not quick:
            stages += [
                ("batch256_128in_128out_bf16", lambda: batched(loaded, hf, 256, hf_too=True)),
                ("quantized_decode_batch1", lambda: quantized_decode(path)),
                ("kv_quantized_decode_bf16", lambda: kv_quantized_decode(loaded)),
            ]
        for name, stage in stages:
            t0 = time.perf_counter()
            try:
                results[name] = stage()
            except Exception as error:  # noqa: BLE001 - report the stage's failure, keep the others
                results[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            results[name]["stage_seconds"] = round(time.perf_counter() - t0, 1)
            gc.collect()  # the stage's engines and their KV pools
            if _where["device"] == "cuda":
                torch.cuda.empty_cache()
            print(f"{name}: {json.dumps(results[name])}", flush=True)
    return results


def _fmt(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        START,
        f"GPU check on {env['gpu']} ({env['capability']}), torch {env['torch']}, transformers "
        f"{env['transformers']}, kernels: {env['kernels']}, commit {env['commit']}. SmolLM2-135M's shape with "
        "random weights; HF transformers on the same GPU in the same run. Command: "
        "`python -m mcp2026.bench.gpu_check --docs docs/benchmarks.md`.",
        "",
        "| check | ours | HF transformers |",
        "|---|---|---|",
    ]
    ex = results.get("exactness", {})
    if "error" not in ex:
        lines += [
            f"| prefill logits fp32, max abs diff to HF fp32 | {_fmt(ex['prefill_fp32_max_abs_diff'])} | 0 |",
            f"| prefill logits bf16, max / mean abs diff to HF fp32 | {_fmt(ex['prefill_bf16_max_abs_diff'])} / "
            f"{_fmt(ex['prefill_bf16_mean_abs_diff'])} | HF bf16: {_fmt(ex['hf_bf16_max_abs_diff'])} / "
            f"{_fmt(ex['hf_bf16_mean_abs_diff'])} |",
            f"| greedy decode fp32 (graphs), largest gap of our token to HF's best logit | "
            f"{_fmt(ex['decode_fp32_max_gap_to_hf_argmax'])} | |",
        ]
    b1 = results.get("decode_batch1_bf16", {})
    if "error" not in b1:
        lines.append(
            f"| batch-1 decode bf16, ms per token (128-token prompt, 256 new) | {_fmt(b1['ours_graphs_ms_per_token'])} "
            f"(without graphs {_fmt(b1['ours_eager_ms_per_token'])}) | static cache: "
            f"{_fmt(b1['hf_static_ms_per_token_incl_prefill'])} (its prefill included) |"
        )
    for key, label in (("batch64_128in_128out_bf16", "64"), ("batch256_128in_128out_bf16", "256")):
        r = results.get(key, {})
        if r and "error" not in r:
            lines.append(
                f"| {label} sequences x (128 in, 128 out) bf16, output tok/s | {r['ours_output_tok_s']:,.0f} | "
                f"static cache: {r.get('hf_static_output_tok_s', float('nan')):,.0f} |"
            )
    pf = results.get("prefill_8x2048_bf16", {})
    if "error" not in pf:
        lines.append(
            f"| prefill 8 x 2048 bf16, tok/s | {pf['ours_tok_s']:,.0f} | one forward: {pf['hf_forward_tok_s']:,.0f} |"
        )
    for fmt, r in results.get("quantized_decode_batch1", {}).items():
        if isinstance(r, dict) and "ms_per_token" in r:
            lines.append(
                f"| batch-1 decode {fmt} weights, ms per token (kernel vs its dequantized weights: rel. error "
                f"{_fmt(r['kernel_rel_error'])}) | {_fmt(r['ms_per_token'])} | |"
            )
        elif isinstance(r, dict) and "error" in r:
            lines.append(f"| batch-1 decode {fmt} weights | failed: {r['error'][:120]} | |")
    for dtype, r in results.get("kv_quantized_decode_bf16", {}).items():
        if isinstance(r, dict) and "ms_per_token" in r:
            graphs = "graphs" if r["graphs"] else "eager"
            lines.append(
                f"| {dtype} KV cache (bf16 weights): batch-1 ms per token ({graphs}) / 64 x (128, 128) output tok/s "
                f"| {_fmt(r['ms_per_token'])} / {r['batch64_output_tok_s']:,.0f} | |"
            )
        elif isinstance(r, dict) and "error" in r:
            lines.append(f"| {dtype} KV cache | failed: {r['error'][:120]} | |")
    lines.append(END)
    return "\n".join(lines)


def write_docs(path: Path, section: str) -> None:
    text = path.read_text() if path.exists() else ""
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## On a GPU\n\n" + section + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON results here too")
    parser.add_argument("--docs", type=Path, help="rewrite this markdown file's gpu-check section")
    parser.add_argument("--quick", action="store_true", help="skip the 256-sequence and quantized runs")
    args = parser.parse_args(argv)
    results = run(args.quick)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.docs:
        write_docs(args.docs, markdown(results))


if __name__ == "__main__":
    main()
