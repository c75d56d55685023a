"""`bench serve` side by side: the same workload against our endpoint and a peer in interleaved phases, and
the ratios ours / peer. Two tiny fake OpenAI-compatible servers stand in for the engines: one streams like
ours (usage in a last chunk without choices), one like llama.cpp's llama-server (a closing chunk with empty
text, a finish_reason and the usage); each logs when every request arrived and ended."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from mcp2026.bench.load_generator import LoadGenerator
from mcp2026.bench.serve import bench_serve
from mcp2026.bench.serve_cli import serve_app
from mcp2026.bench.serve_config import OURS, PeerEndpoint, ServeBenchConfig, parse_peers
from mcp2026.bench.serve_side_by_side import block_bounds, compute_ratios, phase_schedule, round_ratios
from mcp2026.bench.workloads import BenchRequest

LOG_LOCK = threading.Lock()


class FakeServer:
    """``/v1/models`` and streaming ``/v1/completions``: one chunk per token, ``token_delay_s`` apart."""

    def __init__(
        self, name: str, log: list[dict], token_delay_s: float, style: str, usage: bool = True, silent=False
    ):
        self.name, self.log, self.delay, self.style, self.usage = name, log, token_delay_s, style, usage
        self.silent = silent  # ours' style when no token has any text: only the finishing chunk, empty
        self.drop: list[str] = []  # per coming POST: "silent" closes before any response, "cut" after headers
        self.seen: set[tuple[int, ...]] = set()  # prompts served (the llama style reports them as cached)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                body = json.dumps({"object": "list", "data": [{"id": f"{fake.name}-model"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                drop = fake.drop.pop(0) if fake.drop else None
                if drop == "cut":  # a response starts, then the connection goes
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                if drop is not None:
                    self.close_connection = True
                    return
                entry = {"server": fake.name, "arrived": time.monotonic(), **request}
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                fake.stream(self.wfile, request)
                entry["ended"] = time.monotonic()
                with LOG_LOCK:
                    fake.log.append(entry)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stream(self, out, request: dict) -> None:
        n = request["max_tokens"]
        usage = {"prompt_tokens": len(request["prompt"]), "completion_tokens": n, "total_tokens": n}
        if (
            self.style == "llama"
        ):  # llama-server's prompt cache: a prompt seen before is all cached but its last
            key = tuple(request["prompt"])
            usage["prompt_tokens_details"] = {"cached_tokens": len(key) - 1 if key in self.seen else 0}
            self.seen.add(key)

        def send(chunk: dict) -> None:
            out.write(f"data: {json.dumps(chunk)}\n\n".encode())
            out.flush()

        for i in range(n):
            time.sleep(self.delay)
            last = i == n - 1 and self.style == "ours"
            if self.silent and not last:
                continue
            text = "" if self.silent else f" t{i}"
            send({"choices": [{"index": 0, "text": text, "finish_reason": "length" if last else None}]})
        if self.style == "llama":  # llama-server: empty closing chunk, with the usage
            chunk = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
            send({**chunk, "usage": usage} if self.usage else chunk)
        elif self.usage and (request.get("stream_options") or {}).get("include_usage"):
            send({"choices": [], "usage": usage})
        out.write(b"data: [DONE]\n\n")

    def __enter__(self) -> FakeServer:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def two_fakes(ours_delay: float, peer_delay: float, peer_usage: bool = True) -> Iterator[tuple]:
    log: list[dict] = []
    with (
        FakeServer("ours", log, ours_delay, "ours") as ours,
        FakeServer("llama", log, peer_delay, "llama", usage=peer_usage) as peer,
    ):
        yield ours, peer, log


def requests_for(num: int, output_len: int = 5) -> list[BenchRequest]:
    return [BenchRequest(f"q{i}", [100 + i, 7, 8, 9], output_len) for i in range(num)]


# ---- pure parts ---------------------------------------------------------------------------------
def test_schedule_alternates_and_blocks_split_evenly():
    order = [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (3, "b"), (3, "a")]
    assert phase_schedule(["a", "b"], 4) == order
    assert phase_schedule(["a", "b", "c"], 2) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")]
    assert phase_schedule(["a"], 3) == [(0, "a"), (1, "a"), (2, "a")]
    assert block_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert block_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="rounds"):
        block_bounds(3, 4)


def test_ratios_are_ours_over_peer():
    ours = {
        "request_throughput": 3.0,
        "request_goodput": None,
        "output_throughput": 120.0,
        "total_token_throughput": 300.0,
        "median_ttft_ms": 50.0,
        "p99_ttft_ms": 200.0,
        "mean_e2el_ms": 900.0,
        "std_e2el_ms": 4.0,
        "completed": 30,
    }
    peer = {**ours, "request_throughput": 1.5, "output_throughput": 40.0, "median_ttft_ms": 100.0}
    peer |= {"total_token_throughput": 0.0, "p99_ttft_ms": 400.0, "mean_e2el_ms": 300.0}
    ratios = compute_ratios(ours, peer)
    assert ratios["request_throughput"] == pytest.approx(2.0)
    assert ratios["output_throughput"] == pytest.approx(3.0)
    assert ratios["median_ttft_ms"] == pytest.approx(0.5) and ratios["p99_ttft_ms"] == pytest.approx(0.5)
    assert ratios["mean_e2el_ms"] == pytest.approx(3.0)
    assert ratios["total_token_throughput"] is None  # the peer's 0: no ratio
    assert ratios["request_goodput"] is None  # no SLOs given
    assert "std_e2el_ms" not in ratios and "completed" not in ratios
    phases = [
        {"round": 0, "endpoint": OURS, "output_throughput": 10.0},
        {"round": 0, "endpoint": "llama", "output_throughput": 5.0},
        {"round": 1, "endpoint": "llama", "output_throughput": 8.0},
        {"round": 1, "endpoint": OURS, "output_throughput": 6.0},
    ]
    assert round_ratios(phases, "llama") == pytest.approx([2.0, 0.75])


def test_peer_options():
    peers = parse_peers(["llama=http://127.0.0.1:8012/", "vllm=http://h:1"], ["llama=smollm2"])
    assert peers == (
        PeerEndpoint("llama", "http://127.0.0.1:8012", "smollm2"),
        PeerEndpoint("vllm", "http://h:1", None),
    )
    for urls, models in ((["llama"], []), (["llama=ftp://x"], []), ([f"{OURS}=http://x"], [])):
        with pytest.raises(ValueError):
            parse_peers(urls, models)
    with pytest.raises(ValueError, match="without a --peer-url"):
        parse_peers(["a=http://x"], ["b=m"])
    with pytest.raises(ValueError, match="twice"):
        parse_peers(["a=http://x", "a=http://y"])
    with pytest.raises(ValueError, match="rounds"):
        ServeBenchConfig(rounds=0)


def test_extra_bodies_per_endpoint(tmp_path):
    schema = tmp_path / "format.json"
    schema.write_text('{"response_format": {"type": "json_object"}, "ignore_eos": false}')
    (peer,) = parse_peers(["json=http://127.0.0.1:8000"], [], [f"json=@{schema}"])
    assert peer.extra_body == {"response_format": {"type": "json_object"}, "ignore_eos": False}
    for bad in ("json={nope", "json=[1]", 'json={"prompt": [1]}', "other={}"):
        with pytest.raises(ValueError, match="peer-body|extra body|without a --peer-url"):
            parse_peers(["json=http://x"], [], [bad])
    with pytest.raises(ValueError, match="max_tokens"):
        ServeBenchConfig(extra_body={"max_tokens": 3})
    with two_fakes(ours_delay=0.001, peer_delay=0.001) as (ours, fake_peer, log):
        config = ServeBenchConfig(
            base_url=ours.url,
            max_concurrency=2,
            peers=(PeerEndpoint("json", fake_peer.url, extra_body={"seed": 7, "ignore_eos": False}),),
            extra_body={"top_k": 3},
        )
        bench_serve(config, requests_for(4))
    assert {(e["top_k"], e["ignore_eos"], "seed" in e) for e in log if e["server"] == "ours"} == {
        (3, True, False)
    }
    assert {(e["seed"], e["ignore_eos"], "top_k" in e) for e in log if e["server"] == "llama"} == {
        (7, False, False)
    }


# ---- against two fake servers -------------------------------------------------------------------
def test_same_workload_interleaved_and_ratios():
    requests = requests_for(8)
    with two_fakes(ours_delay=0.002, peer_delay=0.03) as (ours, peer, log):
        config = ServeBenchConfig(
            base_url=ours.url,
            max_concurrency=2,
            seed=5,
            rounds=2,
            peers=(PeerEndpoint("llama", peer.url),),
            goodput_ms={"e2el": 60_000},
            detailed=True,
        )
        run = bench_serve(config, requests)
    # The same requests, the same max tokens, the model each server lists.
    sent = {
        name: sorted((e["prompt"], e["max_tokens"]) for e in log if e["server"] == name)
        for name in ("ours", "llama")
    }
    assert sent["ours"] == sent["llama"] == sorted((r.prompt_token_ids, 5) for r in requests)
    assert {e["model"] for e in log if e["server"] == "llama"} == {"llama-model"}
    assert {e["model"] for e in log if e["server"] == "ours"} == {"ours-model"}
    # Interleaved A B | B A: block 0 (q0-q3) to ours, then to llama; block 1 to llama, then to ours.
    log.sort(key=lambda e: e["arrived"])
    groups = [(e["server"], int(e["prompt"][0] >= 104)) for e in log]
    assert groups == [("ours", 0)] * 4 + [("llama", 0)] * 4 + [("llama", 1)] * 4 + [("ours", 1)] * 4
    for k in range(3):  # a phase has ended before the next one starts
        assert max(e["ended"] for e in log[4 * k : 4 * k + 4]) < min(
            e["arrived"] for e in log[4 * k + 4 : 4 * k + 8]
        )
    phases = run.aggregates["phases"]
    assert [(p["round"], p["endpoint"]) for p in phases] == [(0, OURS), (0, "llama"), (1, "llama"), (1, OURS)]
    assert [p["completed"] for p in phases] == [4, 4, 4, 4]
    # Tokens from the usage; llama's empty closing chunk is no token (5 token chunks -> 4 ITLs).
    endpoints = run.aggregates["endpoints"]
    for name in (OURS, "llama"):
        agg = endpoints[name]
        assert agg["completed"] == 8 and agg["total_output_tokens"] == 40
        assert agg["token_sources"] == {"usage": 8}
        assert agg["duration_s"] == pytest.approx(sum(p["seconds"] for p in phases if p["endpoint"] == name))
    assert endpoints["llama"]["prompt_cache_share"] == 0.0  # every prompt new to it
    assert endpoints[OURS]["prompt_cache_share"] is None  # the fake of ours reports no cached tokens
    assert not any("prefix cache" in note for note in run.notes)
    records = {(r["endpoint"], r["request_id"]): r for r in run.records}
    assert len(records) == 16 and all(r["output_tokens"] == 5 for r in records.values())
    assert all(len(r["itl"]) == 4 for r in records.values())
    # Ratios: ours / llama of each endpoint's own aggregates; ours streams 15x faster.
    ratios = run.aggregates["ratios"]["llama"]
    ours_agg, peer_agg = endpoints[OURS], endpoints["llama"]
    for key in (
        "output_throughput",
        "request_throughput",
        "request_goodput",
        "median_e2el_ms",
        "p99_ttft_ms",
    ):
        assert ratios[key] == pytest.approx(ours_agg[key] / peer_agg[key])
    assert ratios["output_throughput"] > 1 and ratios["median_e2el_ms"] < 1
    assert run.aggregates["output_throughput"] == ours_agg["output_throughput"]  # ours at the top level
    assert len(run.aggregates["round_ratios"]["llama"]) == 2
    table = run.tables[0]
    assert table.columns == ["metric", OURS, "llama", f"{OURS} / llama"]
    row = next(r for r in table.rows if r[0].startswith("output token throughput"))
    assert row[1:3] == [ours_agg["output_throughput"], peer_agg["output_throughput"]]
    assert row[3] == f"{ratios['output_throughput']:.2f}x"


def test_duration_phases_continue_the_sequence_and_usage_fallback():
    requests = requests_for(50, output_len=3)
    with two_fakes(ours_delay=0.03, peer_delay=0.03, peer_usage=False) as (ours, peer, log):
        config = ServeBenchConfig(
            base_url=ours.url,
            max_concurrency=2,
            duration_s=0.6,
            rounds=2,
            peers=(PeerEndpoint("llama", peer.url, model="asked-for"),),
        )
        run = bench_serve(config, requests, count_tokens=lambda text: len(text.split()))
    phases = run.aggregates["phases"]
    for name in (OURS, "llama"):
        first, second = [p for p in phases if p["endpoint"] == name]
        assert first["first_index"] == 0 and second["first_index"] == first["next_index"] > 0
        assert first["num_sent"] == first["next_index"]
        # Requests still waiting for a slot at a phase's end (0.3 s) are not sent.
        starts = [r["start_time"] for r in run.records if r["endpoint"] == name]
        assert max(starts) < 0.3 + 0.02
        ids = [r["request_id"] for r in run.records if r["endpoint"] == name]
        assert len(ids) == len(set(ids))  # the second phase continued, it did not start over
    assert {e["model"] for e in log if e["server"] == "llama"} == {"asked-for"}
    peer_agg = run.aggregates["endpoints"]["llama"]
    assert peer_agg["token_sources"] == {"tokenizer": peer_agg["num_sent"]}
    assert peer_agg["total_output_tokens"] == 3 * peer_agg["completed"]  # " t0 t1 t2": 3 words
    assert any("carried no usage" in note and note.startswith("llama") for note in run.notes)


def test_unreachable_peer_is_one_line_and_ours_still_runs(tmp_path):
    with two_fakes(ours_delay=0.001, peer_delay=0.001) as (ours, _peer, log):
        args = ["--base-url", ours.url, "--workload", "random", "--num-prompts", "4", "--input-len", "16"]
        args += ["--output-len", "3", "--max-concurrency", "2", "--peer-url", "gone=http://127.0.0.1:9"]
        result = CliRunner().invoke(serve_app, [*args, "--no-progress", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("peer gone skipped")]
    assert "http://127.0.0.1:9" in line
    (path,) = tmp_path.glob("*-serve.json")
    data = json.loads(path.read_text())
    assert data["aggregates"]["completed"] == 4 and "gone" in data["config"]["skipped_peers"]
    assert {e["server"] for e in log} == {"ours"}


def test_side_by_side_command(tmp_path):
    with two_fakes(ours_delay=0.001, peer_delay=0.004) as (ours, peer, log):
        args = ["--base-url", ours.url, "--workload", "random", "--num-prompts", "4", "--input-len", "16"]
        args += ["--output-len", "3", "--max-concurrency", "2", "--peer-url", f"llama={peer.url}"]
        args += ["--goodput", "ttft:1000", "tpot:100"]  # vLLM's syntax: several SLOs after one flag
        args += ["--rounds", "2", "--no-progress", "--out", str(tmp_path)]
        result = CliRunner().invoke(serve_app, args)
        too_many = CliRunner().invoke(serve_app, [*args, "--rounds", "5"])
        stray = CliRunner().invoke(serve_app, ["--base-url", ours.url, "tpot:100", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert too_many.exit_code == 2 and "rounds" in too_many.output
    assert stray.exit_code == 2 and "unexpected argument(s) tpot:100" in stray.output
    assert f"| metric | {OURS} | llama | {OURS} / llama |" in result.output
    (path,) = tmp_path.glob("*-serve.json")
    data = json.loads(path.read_text())
    assert data["aggregates"]["endpoints"]["llama"]["completed"] == 4
    assert data["config"]["goodput_ms"] == {"ttft": 1000.0, "tpot": 100.0}
    assert data["aggregates"]["endpoints"]["llama"]["request_goodput"] is not None
    assert data["config"]["peers"] == [
        {"name": "llama", "base_url": peer.url, "model": "llama-model", "extra_body": {}}
    ]
    assert set(data["aggregates"]["ratios"]["llama"]) >= {"output_throughput", "median_ttft_ms"}
    assert len([e for e in log if e["server"] == "llama"]) == 4


def test_a_duration_phase_ends_with_its_window_not_at_the_next_arrival():
    """At 0.5 req/s the first arrival is ~2 s out; phases of 0.15 s send what is due in them and end, the
    next phase continuing the sequence (it is not slept through)."""
    requests = requests_for(6, output_len=2)
    with two_fakes(ours_delay=0.001, peer_delay=0.001) as (ours, peer, _log):
        config = ServeBenchConfig(
            base_url=ours.url,
            request_rate=0.5,
            seed=0,
            duration_s=0.3,
            rounds=2,
            peers=(PeerEndpoint("llama", peer.url),),
        )
        run = bench_serve(config, requests)
    schedule = LoadGenerator(replace(config, peers=()), "m")
    for phase in run.aggregates["phases"]:
        assert phase["seconds"] < 0.15 + 0.1, phase
        due = schedule.arrival_offset(phase["first_index"]) - schedule.arrival_offset(
            phase["first_index"] - 1
        )
        assert phase["num_sent"] == (1 if due < 0.15 else 0)


def test_requests_go_out_on_their_schedule_in_every_phase():
    """Each request is sent at its arrival offset counted from its phase's start, never early, and late
    wake-ups do not push every later arrival back (the schedule is absolute)."""
    requests = requests_for(12, output_len=2)
    with two_fakes(ours_delay=0.001, peer_delay=0.001) as (ours, peer, _log):
        config = ServeBenchConfig(
            base_url=ours.url, request_rate=40.0, seed=3, rounds=2, peers=(PeerEndpoint("llama", peer.url),)
        )
        run = bench_serve(config, requests)
    schedule = LoadGenerator(replace(config, peers=()), "m")
    for name in (OURS, "llama"):
        for phase in (p for p in run.aggregates["phases"] if p["endpoint"] == name):
            start = phase["first_index"]
            base = schedule.arrival_offset(start - 1, len(requests))
            sent = sorted(
                (r["start_time"], int(r["request_id"][1:]))
                for r in run.records
                if r["endpoint"] == name and r["phase"] == phase["phase"]
            )
            assert [i for _, i in sent] == list(range(start, start + 6))
            for t, i in sent:
                due = schedule.arrival_offset(i, len(requests)) - base
                assert due - 0.002 <= t <= due + 0.25, (name, i, t, due)


def test_latency_cdfs_get_a_series_per_endpoint():
    from mcp2026.bench.figures import latency_samples
    from mcp2026.bench.report import BenchRun

    record = {"kind": "normal", "success": True, "ttft": 0.1, "latency": 0.5, "output_tokens": 5}
    records = [{**record, "endpoint": OURS}, {**record, "endpoint": "llama", "ttft": 0.2}]
    series = latency_samples(BenchRun("serve", "", {}, records=records))
    assert set(series) == {f"serve {OURS}", "serve llama"}
    assert series["serve llama"]["ttft"] == pytest.approx([200.0])
    single = latency_samples(BenchRun("serve", "", {}, records=[record, record]))
    assert list(single) == ["serve"] and len(single["serve"]["ttft"]) == 2


def test_a_request_the_server_dropped_before_any_response_is_sent_again():
    """A keep-alive connection the server closes as the request goes out (llama-server closes idle ones after
    5 s) never reached it: sent once more and counted. A response cut after it started is a failure."""
    from mcp2026.bench.serve_metrics import endpoint_aggregates, token_source_notes

    with FakeServer("llama", [], 0.001, "llama") as peer:
        config = ServeBenchConfig(base_url=peer.url, max_concurrency=1)
        peer.drop = ["silent"]
        results, seconds = asyncio.run(LoadGenerator(config, "m").run(requests_for(2)))
        assert [(r.success, r.retries) for r in results] == [(True, 1), (True, 0)]
        endpoint = endpoint_aggregates(results, seconds, config)
        assert endpoint["num_retried"] == 1 and "sent twice" in token_source_notes({"llama": endpoint})[0]
        peer.drop = ["cut"]
        (cut,), _ = asyncio.run(LoadGenerator(config, "m").run(requests_for(1)))
        assert (
            not cut.success and cut.retries == 0 and cut.status == 200 and "RemoteProtocolError" in cut.error
        )


def test_ours_empty_finishing_chunk_is_a_token():
    """Ours skips chunks without text but always sends the last token's, finish_reason set, usage apart."""

    log: list[dict] = []
    with FakeServer("ours", log, 0.001, "ours", silent=True) as ours:
        config = ServeBenchConfig(base_url=ours.url, max_concurrency=1)
        results, _ = asyncio.run(LoadGenerator(config, "m").run(requests_for(2, output_len=4)))
    assert [(r.success, r.output_tokens, r.token_source) for r in results] == [(True, 4, "usage")] * 2
    assert all(0 < r.ttft == r.latency for r in results)


@pytest.mark.parametrize("seqs", [16, 32])
@pytest.mark.parametrize("suffix", ["", "-int4"])
def test_example_configs_match_the_peer_slots(seqs, suffix):
    from mcp2026.bench.report import project_root
    from mcp2026.serve.config import load_serve_yaml

    path = project_root() / "examples" / "bench_peers" / f"ours-seqs{seqs}{suffix}.yaml"
    serve, engine = load_serve_yaml(path)
    assert engine.scheduler.max_num_seqs == seqs and not serve.breaker.enabled
    if suffix:  # int4 weights, K/V in bf16 (llama-server's f16 KV: same bytes), nothing evicted
        assert serve.quant is not None
        assert engine.kv_compressor.dtype == "bf16" and engine.kv_compressor.policy == "none"


def test_a_rerun_against_a_warm_prefix_cache_says_so():
    requests = requests_for(4)
    with two_fakes(ours_delay=0.002, peer_delay=0.002) as (ours, peer, log):
        config = ServeBenchConfig(
            base_url=ours.url, max_concurrency=2, peers=(PeerEndpoint("llama", peer.url),)
        )
        bench_serve(config, requests)
        rerun = bench_serve(config, requests)  # the same prompts again: llama-style servers serve them cached
    share = rerun.aggregates["endpoints"]["llama"]["prompt_cache_share"]
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    assert share == pytest.approx((prompt - len(requests)) / prompt)
    assert any(
        note.startswith("llama:") and "prefix cache" in note and "--seed" in note for note in rerun.notes
    )
    assert {r["cached_tokens"] for r in rerun.records if r["endpoint"] == "llama"} == {
        len(r.prompt_token_ids) - 1 for r in requests
    }
