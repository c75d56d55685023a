"""Runs inside vLLM's own venv (``bench offline --batched-decode N --vllm-venv DIR``), never imported by
mcp2026: the requests of the JSON file given as the only argument, all at once through vLLM's offline
``LLM.generate`` (bf16, greedy, EOS ignored, prefix caching off so every round prefills), ``rounds`` x (a
run that stops after the first token, then a run that generates every token). Prints one JSON line."""

import json
import sys
import time

import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    requests = spec["requests"]
    longest = max(len(r["ids"]) + r["output_len"] for r in requests)
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=max(2048, longest),
        max_num_seqs=max(len(requests), 1),
        enable_prefix_caching=False,
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=r["ids"]) for r in requests]

    def params(first_only: bool) -> list[SamplingParams]:
        return [
            SamplingParams(
                max_tokens=1 if first_only else r["output_len"],
                temperature=0.0,
                ignore_eos=True,
                detokenize=False,
            )
            for r in requests
        ]

    llm.generate(prompts[:2], params(True)[:2], use_tqdm=False)  # warm-up, not timed
    first, full, counts = [], [], []
    for _ in range(spec["rounds"]):
        t0 = time.perf_counter()
        llm.generate(prompts, params(True), use_tqdm=False)
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params(False), use_tqdm=False)
        full.append(time.perf_counter() - t0)
        counts = [len(o.outputs[0].token_ids) for o in outs]
    result = {
        "first_seconds": first,
        "full_seconds": full,
        "num_output_tokens": counts,
        "version": vllm.__version__,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
