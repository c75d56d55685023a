"""``mcp2026 bench kv`` on a tiny random model: the rows, exactness of the identity codec, bytes, retrieval,
targets, the shared-reference lockstep, the CLI and its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from mcp2026.bench.kv import run_kv
from mcp2026.bench.kv_config import QUICK, KVBenchConfig, make_config, parse_config
from mcp2026.bench.kv_retrieval import RetrievalPrompt, build_prompt, score
from mcp2026.bench.report import read_run

from conftest import save_tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")

# block 8, recent window 64 of 128 tokens: heavy_hitter@0.7 keeps 9 of 16 blocks, so it does evict.
SMALL = dict(
    context_tokens=128,
    num_sequences=2,
    codecs=("fp32", "int8", "int4"),
    policies=("heavy_hitter",),
    sparsities=(0.7,),
    combined=("int4+heavy_hitter@0.7", "int8+sink_window@0.7"),
    block_size=8,
    chunk_size=16,
    retrieval_seeds=3,
    retrieval_tokens=96,
    retrieval_configs=("fp32", "heavy_hitter@0.7"),
    budget_gb=0.01,
    concurrent_len=128,
    decode_context=64,
    decode_tokens=2,
    decode_configs=("int4", "heavy_hitter@0.7"),  # the second is the decode policy's row already
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_hf(tmp_path_factory.mktemp("tiny_kv_bench"), max_position_embeddings=256))


@pytest.fixture(scope="module")
def run(tiny_dir):
    return run_kv(KVBenchConfig(model=tiny_dir, **SMALL))


def test_rows_and_exact_identity(run):
    quality = run.aggregates["quality"]
    assert list(quality) == [
        "fp32",
        "int8",
        "int4",
        "heavy_hitter@0.7",
        "int4+heavy_hitter@0.7",
        "int8+sink_window@0.7",
    ]
    table = run.tables[0]
    assert [r[0] for r in table.rows] == ["uncompressed (fp32 KV)", *quality]
    # The identity codec through the same engine path is bit-exact with the reference.
    assert quality["fp32"]["delta_ppl"] == 0.0 and quality["fp32"]["kld"] == 0.0
    assert quality["fp32"]["top1_agreement"] == 1.0
    assert 0 < quality["int8"]["kld"] < 1e-5 and abs(quality["int8"]["delta_ppl"]) < 1e-3
    assert quality["int8"]["kld"] < quality["int4"]["kld"]
    assert quality["fp32"]["num_tokens"] == 2 * 127  # every position with a next token, both sequences
    records = [r for r in run.records if r["kind"] == "quality"]
    assert len(records) == 2 * 6
    evicted = [r["evicted_blocks"] for r in records if r["config"] == "heavy_hitter@0.7"]
    assert all(e > 0 for e in evicted) and quality["heavy_hitter@0.7"]["kld"] > 0
    assert all(r["evicted_blocks"] == 0 for r in records if "@" not in r["config"])
    # llama.cpp's KV types need a GGUF file: a tiny HF folder gets a note, not an error
    assert run.aggregates["llama_cpp_kv"] is None
    assert any(n.startswith("llama.cpp peer skipped") for n in run.notes)


def test_combined_rows_quantize_and_evict(run):
    quality, memory = run.aggregates["quality"], run.aggregates["memory"]
    records = [r for r in run.records if r["kind"] == "quality"]
    for name in ("int4+heavy_hitter@0.7", "int8+sink_window@0.7"):
        assert all(r["evicted_blocks"] > 0 for r in records if r["config"] == name)
    # both losses: more than the codec alone, fewer bytes per context token than eviction alone
    assert quality["int4+heavy_hitter@0.7"]["kld"] > quality["int4"]["kld"]
    assert (
        quality["int4+heavy_hitter@0.7"]["kv_bytes_per_token"]
        < quality["heavy_hitter@0.7"]["kv_bytes_per_token"]
    )
    # memory rows only where the policy bounds the peak (heavy_hitter holds a whole prompt first)
    assert "int8 + sink_window@0.7" in memory and "int4 + heavy_hitter@0.7" not in memory
    assert memory["int8 + sink_window@0.7"]["max_sequences"] > memory["int8"]["max_sequences"]


def test_retrieval_only_configs_get_a_row():
    from mcp2026.bench.kv_report import tables

    config = KVBenchConfig(codecs=("int8",), policies=(), retrieval_configs=("snap@0.7",))
    quality = {"int8": {"delta_ppl": 0.001, "kld": 0.0, "top1_agreement": 1.0, "kv_bytes_per_token": 1.0,
                        "bytes_ratio": 2.0, "num_tokens": 9, "ppl_ref": 3.0}}  # fmt: skip
    scores = {
        name: {"num_agree": a, "num_identical": a, "num_correct": a, "num_kept": a, "num_ref_correct": 4,
               "num_prompts": 5, "agreement": a / 5}
        for name, a in (("uncompressed", 4), ("snap@0.7", 3))
    }  # fmt: skip
    agg = {"quality": quality, "retrieval": {"scores": scores, "mean_prompt_len": 90.0}, "text": "t",
           "memory": {"fp32": {"kv_bytes_per_token": 2.0, "bytes_ratio": 0.5, "max_sequences": 1,
                               "seqs_ratio": 1.0}}, "decode": None}  # fmt: skip
    rows = {r[0]: r for r in tables(config, agg)[0].rows}
    assert rows["snap@0.7"][1:7] == ["—"] * 6 and rows["snap@0.7"][7:11] == ["3/5", "3/5", "3/5", "3/4"]


def test_a_tuned_policy_row_answers_to_the_policys_targets():
    from mcp2026.bench.kv_report import target_config, targets

    tuned = "fp32+heavy_hitter@0.7:layer_weights=smollm2-135m"
    assert target_config(tuned) == target_config("heavy_hitter@0.7:num_anchors=0") == "heavy_hitter@0.7"
    assert target_config("int4+heavy_hitter@0.7") == "int4+heavy_hitter@0.7"  # another codec: its own row
    assert target_config("int4") == "int4"
    agg = {
        "quality": {"heavy_hitter@0.7": {"delta_ppl": 0.08}, tuned: {"delta_ppl": 0.03}},
        "retrieval": {"scores": {tuned: {"agreement": 0.86}}},
        "memory": {},
        "decode": None,
    }
    verdicts = {(t["config"], t["target"]): t["verdict"] for t in targets(agg)}
    assert verdicts[("heavy_hitter@0.7", "ΔPPL ≤ 5%")] == "ΔPPL ≤ 5%: MISS"
    assert verdicts[(tuned, "ΔPPL ≤ 5%")] == "ΔPPL ≤ 5%: PASS"
    assert verdicts[(tuned, "answer agreement ≥ 90% (same answer)")].endswith("MISS")


def test_notes_follow_what_ran(run):
    from mcp2026.bench.kv_report import notes

    assert any("combined rows (CODEC+POLICY) with their codec" in n for n in run.notes)
    assert any(n.startswith("Decode tok/s: the configs' engines take turns") for n in run.notes)
    quiet = KVBenchConfig(codecs=("int8",), policies=(), decode_context=0)
    written = notes(quiet, None, None, quiet.grid())
    assert not any("Decode" in n or "combined" in n for n in written)


def test_bytes(run):
    memory, quality = run.aggregates["memory"], run.aggregates["quality"]
    bytes_ = {name: memory[name]["kv_bytes_per_token"] for name in ("int4", "int8", "bf16", "fp32")}
    assert bytes_["int4"] < bytes_["int8"] < bytes_["bf16"] == bytes_["fp32"] / 2
    assert (
        memory["bf16"]["bytes_ratio"] == 1.0 and memory["int4"]["bytes_ratio"] > memory["int8"]["bytes_ratio"]
    )
    assert memory["int4"]["max_sequences"] > memory["bf16"]["max_sequences"] > memory["fp32"]["max_sequences"]
    for name in ("int8", "int4"):  # no eviction: the pool bytes per token are the codec's
        assert quality[name]["kv_bytes_per_token"] == memory[name]["kv_bytes_per_token"]
    assert quality["heavy_hitter@0.7"]["kv_bytes_per_token"] < quality["fp32"]["kv_bytes_per_token"]


def test_retrieval_decode_and_targets(run):
    scores = run.aggregates["retrieval"]["scores"]
    assert scores["fp32"]["agreement"] == 1.0  # a second, lossless engine answers exactly like the reference
    assert 0.0 <= scores["heavy_hitter@0.7"]["agreement"] <= 1.0
    assert 0.0 <= scores["uncompressed"]["accuracy"] <= 1.0
    assert len([r for r in run.records if r["kind"] == "retrieval"]) == 3 * 3
    decode = run.aggregates["decode"]
    assert decode["tok_per_s"]["uncompressed"] > 0 and decode["speedup"] > 0
    assert list(decode["prefill_tok_per_s"]) == list(decode["tok_per_s"])
    assert all(s > 0 for s in decode["prefill_tok_per_s"].values())
    assert list(decode["tok_per_s"]) == ["uncompressed", "heavy_hitter@0.7", "int4"]  # one engine each
    assert (
        decode["vs_uncompressed"]["int4"] == decode["tok_per_s"]["int4"] / decode["tok_per_s"]["uncompressed"]
    )
    assert [r[0] for r in run.tables[2].rows] == ["uncompressed", "heavy_hitter@0.7", "int4"]
    verdicts = {(t["config"], t["target"]): t["verdict"] for t in run.aggregates["targets"]}
    assert verdicts[("int8", "ΔPPL ≤ 0.1%")].endswith("PASS")
    assert verdicts[("int4", "≥ 3.5x fewer bytes")].endswith(
        "MISS"
    )  # 16-dim heads, 8-token blocks: far from it
    assert verdicts[("heavy_hitter@0.7", "answer agreement ≥ 90% (same answer)")].endswith(("PASS", "MISS"))
    assert "int8" in run.tables[0].rows[2][0] and "ΔPPL ≤ 0.1%: PASS" in run.tables[0].rows[2][-1]
    assert [t.title.split(":")[0] for t in run.tables] == [
        "KV compression quality",
        "Memory",
        "Decode at 64 tokens of context (2 tokens, one sequence, fp32, fp32 weights); prefill of that context",
    ]


def test_compare_quality_many_equals_one_at_a_time(tiny_dir):
    from mcp2026.bench.kv_config import parse_config
    from mcp2026.bench.kv_measure import measurement_engine as _engine
    from mcp2026.bench.quality import compare_quality, compare_quality_many
    from mcp2026.loading.loader import load_model

    loaded = load_model(tiny_dir)
    tokens = torch.randint(320, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    configs = [parse_config(n, "fp32", 8) for n in ("int4", "sink_window@0.5")]

    def engine(kv=None):
        return _engine(loaded, kv, 96, 8)

    together = compare_quality_many(engine(), [engine(kv) for kv in configs], tokens, 48, 16, 8)
    alone = [compare_quality(engine(), engine(kv), tokens, 48, 16, 8) for kv in configs]
    assert together == alone and together[0] != together[1]
    # After the prompt: positions 48..94 (the last has no next token); the whole is a token-weighted mix.
    for q in together:
        assert q.num_tokens == 95 and q.num_tokens_after_prompt == 47
        assert min(q.ppl_after_prompt, q.reference_ppl_after_prompt) > 1.0
    q = together[1]  # sink_window@0.5: the prompt's own positions see the whole prompt so far
    prompt_nll = math.log(q.ppl) * 95 - math.log(q.ppl_after_prompt) * 47
    ref_prompt_nll = math.log(q.reference_ppl) * 95 - math.log(q.reference_ppl_after_prompt) * 47
    assert prompt_nll == pytest.approx(ref_prompt_nll, rel=1e-6)  # the 64-token window covers the prompt
    assert q.ppl_after_prompt != q.reference_ppl_after_prompt


def test_score_counts_facts_kept_where_the_reference_was_right():
    filler = list(range(100, 200))
    prompts = [build_prompt(seed, filler, None, 320) for seed in range(4)]
    right = [list(p.value_ids) + [1] for p in prompts]
    wrong = [[7, 7, 7, 7, 7, 1] for _ in prompts]
    reference = [right[0], right[1], right[2], wrong[3]]  # the reference misses prompt 3
    got = [
        right[0],
        wrong[1],
        [*right[2][:-1], 2],
        right[3],
    ]  # 2: same fact, other ending; 3: only test right
    s = score(prompts, reference, got, None)
    # prompt 2 gives the same fact with another ending: the same answer, not the same tokens
    assert (s.num_agree, s.num_identical, s.num_correct, s.num_ref_correct, s.num_kept) == (2, 1, 3, 3, 2)


class _CharTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def test_text_answers_are_the_code_given_or_none():
    """Agreement compares the code each reply gives (its first number of 3+ digits), not the whole reply:
    two replies that find no code agree, a truncated code does not."""
    tok, ids = _CharTokenizer(), lambda text: [ord(c) for c in text]
    p = RetrievalPrompt(0, [], "61750")
    assert p.answer(ids("The secret code for Elena is 61750."), tok) == "61750"
    assert p.answer(ids("The secret code for Elena is 6175."), tok) == "6175"
    assert p.answer(ids("1.2. Automated grading at 12:11"), tok) is None
    assert p.answer(ids("It is 61,750 (or 61 750)."), tok) == "61750"
    assert p.answer(ids("Section 2 of 3: code 4471"), tok) == "4471"  # the first number of 3+ digits
    reference = [ids("The secret code is 61750."), ids("1. Co-built products"), ids("12:11:17 PM")]
    got = [ids("Code: 61750!"), ids("1.7. 1.2. 1.3."), ids("12:11 PM: 96440")]
    s = score([p] * 3, reference, got, tok)
    assert (s.num_agree, s.num_identical, s.num_correct, s.num_ref_correct, s.num_kept) == (2, 0, 1, 1, 1)


def test_retrieval_prompts_in_token_mode():
    filler = list(range(100, 200))
    p = build_prompt(7, filler, None, 320)
    assert p == build_prompt(7, filler, None, 320) and p != build_prompt(8, filler, None, 320)
    assert len(p.prompt_token_ids) == 100 + 4 + 5 + 4
    assert p.is_correct([*p.value_ids, 1, 2], None) and not p.is_correct([1, *p.value_ids], None)
    s = score([p, p], [[1, 2], [3]], [[1, 2], [4]], None)
    assert (s.num_agree, s.agreement, s.num_correct) == (1, 0.5, 0)
    with pytest.raises(ValueError, match="one reference and one answer"):
        score([p], [[1]], [], None)


@pytest.mark.slow
def test_retrieval_prompts_in_text_mode(default_model_path):
    from mcp2026.loading.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(default_model_path)
    filler = tokenizer.encode(
        "The weather was mild and the market was busy all day. " * 40, add_special_tokens=False
    )
    p = build_prompt(3, filler, tokenizer, tokenizer.vocab_size)
    text = tokenizer.decode(p.prompt_token_ids, skip_special_tokens=False)
    assert f"is {p.code}." in text and text.index(p.code) < len(text) // 2  # stated early
    assert text.rstrip().endswith("assistant") and "What is the secret code for" in text  # chat template
    assert p.is_correct(tokenizer.encode(f"The code is {p.code}.", add_special_tokens=False), tokenizer)
    assert not p.is_correct(tokenizer.encode("I do not know.", add_special_tokens=False), tokenizer)


def test_codecs_that_do_not_run_here_are_skipped(monkeypatch):
    from mcp2026.bench.kv import unavailable_codecs
    from mcp2026.kv import codecs

    def no_float8(self, x):
        raise RuntimeError("no float8 conversion on this device")

    assert unavailable_codecs(["int8", "int4", "fp8"], 16) == {}
    monkeypatch.setattr(codecs.Fp8PerToken, "encode", no_float8)
    assert unavailable_codecs(["int8", "fp8"], 16) == {
        "fp8": "RuntimeError: no float8 conversion on this device"
    }


def test_config_presets_and_validation():
    quick = make_config(True, context_tokens=512, codecs=None)
    assert quick.context_tokens == 512 and quick.codecs == QUICK["codecs"]
    assert make_config(False) == KVBenchConfig()
    assert "--decode-weights" not in KVBenchConfig().command()
    assert "--decode-weights dqg:5" in KVBenchConfig(decode_weights="dqg:5").command()
    assert (
        "--decode-configs int4,int8+snap@0.5"
        in KVBenchConfig(decode_configs=("int4", "int8 + snap@0.5")).command()
    )
    with pytest.raises(ValueError, match="int3"):
        KVBenchConfig(decode_configs=("int3",))
    assert [n for n, _ in KVBenchConfig(codecs=("int8",), policies=("snap",), sparsities=(0.5,)).grid()] == [
        "int8",
        "snap@0.5",
    ]
    combined = KVBenchConfig(codecs=(), policies=(), combined=("int4+heavy_hitter@0.7",))
    ((name, kv),) = combined.grid()
    assert (name, kv.dtype, kv.policy, kv.sparsity_ratio) == (
        "int4+heavy_hitter@0.7",
        "int4",
        "heavy_hitter",
        0.7,
    )
    assert "--combined int4+heavy_hitter@0.7" in combined.command()
    spaced = KVBenchConfig(
        combined=("int4 + heavy_hitter@0.7",), retrieval_configs=("int4 +heavy_hitter@0.7",)
    )
    assert spaced.combined == spaced.retrieval_configs == ("int4+heavy_hitter@0.7",)
    options = KVBenchConfig(retrieval_configs=("heavy_hitter@0.7:lookahead_tokens=16:lookahead_weight=0.25",))
    kv = parse_config(options.retrieval_configs[0], "fp32", 16)
    assert (kv.policy, kv.sparsity_ratio, kv.lookahead_tokens, kv.lookahead_weight) == (
        "heavy_hitter",
        0.7,
        16,
        0.25,
    )
    layered = parse_config("fp32+heavy_hitter@0.7:layer_weights=smollm2-135m", "fp32", 16)
    assert len(layered.layer_weights) == 30 and layered.layer_weights[18] == max(layered.layer_weights)
    assert parse_config("snap@0.5:layer_weights=1/3", "fp32", 16).layer_weights == (1.0, 3.0)
    for kwargs, match in [
        (
            {"retrieval_configs": ("snap@0.5:layer_weights=1/a",)},
            "layer_weights must be 'auto', 'uniform', a preset",
        ),
        ({"context_tokens": 9000}, "--context-tokens"),
        ({"codecs": ("int3",)}, "dtype must be one of"),
        ({"retrieval_configs": ("heavy_hitter@x",)}, "POLICY@SPARSITY"),
        ({"combined": ("int4",)}, "CODEC\\+POLICY@SPARSITY"),
        ({"combined": ("int3+snap@0.5",)}, "dtype must be one of"),
        ({"sparsities": (1.0,)}, "sparsity_ratio"),
        ({"codecs": (), "policies": ()}, "nothing to measure"),
        ({"block_size": 12}, "--block-size"),
        ({"text": "wiki"}, "--text"),
        ({"decode_weights": "int3"}, "weights must be a list of int8, int4, fp8 or dqg:BITS"),
        ({"retrieval_configs": ("heavy_hitter@0.7:lookahead",)}, ":FIELD=NUMBER"),
        (
            {"retrieval_configs": ("heavy_hitter@0.7:lookahed_tokens=8",)},
            "lookahed_tokens is no KVCompressor field",
        ),
        ({"combined": ("int4+heavy_hitter@0.7:dtype=1",)}, "in the name itself"),
        ({"combined": ("int4+heavy_hitter@0.7:lookahead_tokens=-1",)}, "lookahead_tokens must be >= 0"),
        ({"combined": ("int4+heavy_hitter@0.7:num_anchors=1.0",)}, "num_anchors takes a whole number"),
        ({"combined": ("int4+heavy_hitter@0.7:lookahead_weight=x",)}, "lookahead_weight takes a number"),
        ({"combined": ("int4+heavy_hitter@0.7:num_anchors=1:num_anchors=2",)}, "given twice"),
    ]:
        with pytest.raises(ValueError, match=match):
            KVBenchConfig(**kwargs)


def test_cli_writes_json_and_markdown(tiny_dir, tmp_path):
    from mcp2026.cli import app

    args = ["bench", "kv", "--model", tiny_dir, "--quick", "--context-tokens", "96", "--block-size", "8"]
    args += [
        "--retrieval-seeds",
        "2",
        "--retrieval-tokens",
        "80",
        "--decode-context",
        "32",
        "--decode-tokens",
        "2",
    ]
    args += ["--codecs", "int8", "--policies", "none", "--retrieval-configs", "int8"]
    args += ["--budget-gb", "0.01", "--out", str(tmp_path), "--no-progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (json_path,) = tmp_path.glob("*-kv.json")
    run = read_run(json_path)
    assert run.kind == "kv" and list(run.aggregates["quality"]) == ["int8"]
    assert run.config["context_tokens"] == 96 and run.config["sparsities"] == [0.7]
    assert "| int8 |" in json_path.with_suffix(".md").read_text()
    assert "--context-tokens 96" in run.command and json.loads(json_path.read_text())["kind"] == "kv"
    assert "estimate: ~" in result.output and "prefill tok/s" in result.output


def test_cli_bad_options_are_one_line_errors(tiny_dir):
    from mcp2026.cli import app

    for extra, message in [
        (["--sparsities", "0.5,abc"], "--sparsities: expected comma-separated numbers"),
        (["--context-tokens", "100000"], "--context-tokens must be in"),
        (["--context-tokens", "300"], "exceeds this model's context of 256"),
    ]:
        result = CliRunner().invoke(app, ["bench", "kv", "--model", tiny_dir, "--no-progress", *extra])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output


def test_block_size_is_each_codecs_unless_given():
    config = KVBenchConfig(codecs=("int8", "int4"), policies=("heavy_hitter",), sparsities=(0.7,))
    assert {n: kv.block_size for n, kv in config.grid()} == {"int8": 16, "int4": 32, "heavy_hitter@0.7": 16}
    assert "--block-size" not in config.command()
    pinned = KVBenchConfig(codecs=("int4",), policies=(), block_size=16)
    assert [kv.block_size for _, kv in pinned.grid()] == [16] and "--block-size 16" in pinned.command()
