"""``mcp2026 bench export``: a quantized plan exported to GGUF, scored by llama.cpp (llama-cpp-python) and by us on
the same held-out windows, llama.cpp-style perplexity: the file holds the model we run when the two agree."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from mcp2026.bench.peers import load_llama_cpp
from mcp2026.bench.quality import evaluate, reference_logprobs
from mcp2026.bench.quality_peers import llama_cpp_scored_logprobs
from mcp2026.bench.quant_quality import wide_output_plan
from mcp2026.export.gguf_export import export_gguf
from mcp2026.loading.loader import load_model
from mcp2026.quant import dqg, recipe
from mcp2026.quant.perplexity import N_CTX, evaluation_windows
from mcp2026.quant.plan import LayerQuantSpec


@dataclass(frozen=True)
class ExportCheck:
    plan: str
    our_ppl: float
    llama_cpp_ppl: float  # the exported file in llama.cpp
    kld: float  # KL(ours || llama.cpp's), nats per token
    source_llama_cpp_ppl: float  # the source file as stored, in llama.cpp (for scale)
    num_tokens: int
    file_mib: float
    summary: list[str]

    @property
    def relative_gap(self) -> float:
        return self.llama_cpp_ppl / self.our_ppl - 1

    def markdown(self) -> str:
        return "\n".join([
            "| plan | ours PPL | llama.cpp PPL (exported GGUF) | gap | KLD | GGUF MiB |",
            "|---|---|---|---|---|---|",
            f"| {self.plan} | {self.our_ppl:.4f} | {self.llama_cpp_ppl:.4f} | {100 * self.relative_gap:+.3f}% | "
            f"{self.kld:.5f} | {self.file_mib:.1f} |",
            "",
            f"{self.num_tokens} scored tokens; the source file as stored in llama.cpp: PPL "
            f"{self.source_llama_cpp_ppl:.4f}.",
        ])  # fmt: skip


def run_export_check(model: str | Path | None, num_windows: int, symmetric: bool) -> ExportCheck:
    loaded = load_model(model)
    body = LayerQuantSpec("int4", 32, symmetric)
    plan = wide_output_plan(loaded.model, body)
    _, dtypes = recipe.hardware_candidates("cpu")
    recipe.apply(loaded.model, dqg.DQGResult("uniform", plan, {}), dtypes, progress=False)
    windows = evaluation_windows(loaded.tokenizer, num_windows, N_CTX)
    ours = reference_logprobs(loaded.model, windows)
    our_ppl = evaluate(loaded.model, windows).ppl
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "export.gguf"
        report = export_gguf(loaded, path)
        theirs = _llama_cpp(path, windows, ours)
        source = _llama_cpp(loaded.source, windows, ours)
        size = path.stat().st_size / 2**20
    return ExportCheck(
        f"{body.describe()}, lm_head int8", our_ppl, theirs.ppl, theirs.kld, source.ppl, theirs.num_tokens, size,
        report.summary(),
    )  # fmt: skip


def _llama_cpp(path: Path, windows, reference):
    llm = load_llama_cpp(path, n_ctx=N_CTX, logits_all=True)
    try:
        return evaluate(lambda w: llama_cpp_scored_logprobs(llm, w), windows, reference)
    finally:
        llm.close()
