"""Generation throughput at 16 streams with and without structured output on the default model.

The same 16 chat prompts, greedy, once plain and once constrained to a JSON schema; prints tokens per second
and the time per step spent sampling (where the grammar masks are filled and applied).
Run: python examples/structured/throughput.py
"""

from __future__ import annotations

import time

from mcp2026 import Pipeline, SamplingParams, StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "facts": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 4},
    },
    "required": ["city", "facts"],
}
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Delhi"] * 2


def run(pipe: Pipeline, params: SamplingParams) -> None:
    prompts = [[{"role": "user", "content": f"Describe {c} as JSON."}] for c in CITIES]
    pipe.engine.stats.reset()
    t = time.perf_counter()
    result = pipe.infer(prompts, params)
    elapsed = time.perf_counter() - t
    num_tokens = sum(len(o.token_ids) for o in result.outputs)
    stats = pipe.engine.stats
    label = "structured" if params.structured_outputs else "plain"
    print(
        f"{label:>10}: {num_tokens} tokens in {elapsed:.2f} s = {num_tokens / elapsed:.1f} tok/s, "
        f"sampling {stats.sample_ms / max(stats.num_steps, 1):.2f} ms/step, decode {stats.decode_ms / max(stats.num_decode_steps, 1):.2f} ms/step"
    )


def main() -> None:
    pipe = Pipeline()
    run(pipe, SamplingParams(max_tokens=8))  # warm-up
    run(pipe, SamplingParams(max_tokens=96))
    run(pipe, SamplingParams(max_tokens=96, structured_outputs=StructuredOutputs(json=SCHEMA)))


if __name__ == "__main__":
    main()
