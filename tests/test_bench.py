"""bench against a server whose timing is known exactly (devtools/timed_server.py).

Tolerance, stated once: a figure measured on the wire is within TOL_ABS + TOL_REL of the truth (loopback, a shared
2-core machine: the client's reading thread shares the GIL with the server's and the cores with whatever else runs,
so an event may be read tens of ms late while two busy processes run beside the tests, devtools/cpu_load). TPOT and
ITL average many gaps, so they get the relative tolerance only, plus 1 ms. The truth is what the server did (its
log, on the client's clock: it runs in this process), not what it was asked to do: on a loaded machine its sleeps
overshoot by tens of ms, and a bench that measures right must follow them. A wire figure can never be below the
server's own (the request is sent before it arrives, a chunk read after it is sent): that bound holds exactly.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import requests

from g5g import bench, wire
from g5g.cli import main
from devtools.server import serving

TOL_ABS, TOL_REL = 0.025, 0.05  # seconds, fraction


def close(measured_ms: float, truth_s: float, abs_s: float = TOL_ABS) -> bool:
    return abs(measured_ms / 1000 - truth_s) <= abs_s + TOL_REL * truth_s


def truth(ttft: float, gap: float, n: int, per_chunk: int) -> dict:
    chunks = -(-n // per_chunk)
    e2el = ttft + (chunks - 1) * gap
    return {"ttft": ttft, "e2el": e2el, "itl": gap, "tpot": (e2el - ttft) / (n - 1)}


def sent(srv, n: int) -> dict:
    """The truth of the last n requests as the server sent them (its log): per request TTFT and E2EL from arrival
    to the first and last text chunk, the gaps between chunks, TPOT; and their medians and means as bench reports."""
    log = sorted(srv.log, key=lambda e: e["arrived"])[-n:]
    ttft = [e["sent"][0] - e["arrived"] for e in log]
    e2el = [e["sent"][-1] - e["arrived"] for e in log]
    gaps = [b - a for e in log for a, b in zip(e["sent"], e["sent"][1:])]
    return {"ttft": ttft, "e2el": e2el, "median_ttft": float(np.median(ttft)), "mean_e2el": float(np.mean(e2el)),
            "median_itl": float(np.median(gaps)), "e2el_minus_ttft": [b - a for a, b in zip(ttft, e2el)]}


def run_cli(*argv: str) -> int:
    return main(list(argv))


def err_text(capsys) -> str:
    """stderr with rich's line wrapping undone."""
    return " ".join(capsys.readouterr().err.split())


# ---- statistics: the same numbers vllm bench serve computes ----

@pytest.mark.parametrize("n", [1, 2, 5, 16, 101])
def test_percentiles_match_numpy_linear_interpolation(n):
    rng = random.Random(n)
    xs = [rng.uniform(0.001, 0.5) for _ in range(n)]
    d = bench.describe(xs, "itl")
    assert d["mean_itl_ms"] == pytest.approx(np.mean(xs) * 1000)
    assert d["median_itl_ms"] == pytest.approx(np.median(xs) * 1000)
    assert d["std_itl_ms"] == pytest.approx(np.std(xs) * 1000)
    for p in (90, 99):
        assert d[f"p{p}_itl_ms"] == pytest.approx(np.percentile(xs, p) * 1000)


def test_tpot_is_latency_minus_ttft_over_tokens_minus_one():
    a = wire.Answer(success=True, ttft=0.5, latency=2.5, itl=[1.0, 1.0], chunks=3,
                    usage={"completion_tokens": 9, "prompt_tokens": 4})
    one = wire.Answer(success=True, ttft=0.2, latency=0.2, chunks=1, usage={"completion_tokens": 1})
    failed = wire.Answer(success=False, error="HTTP 500")
    r = bench.compute_metrics([a, one, failed], duration=4.0)
    assert r["mean_tpot_ms"] == pytest.approx(250.0)  # (2.5 - 0.5) / (9 - 1); N=1 has no TPOT, as vLLM
    assert r["completed"] == 2 and r["failed"] == 1
    assert r["total_output_tokens"] == 10 and r["output_throughput"] == pytest.approx(2.5)
    assert r["total_input_tokens"] == 4
    assert r["mean_itl_ms"] == pytest.approx(1000.0)
    assert r["mean_tokens_per_chunk"] == pytest.approx((3 + 1) / 2)
    assert r["output_len_source"] == "usage"


def test_output_length_falls_back_to_tokenizer_then_chunks():
    a = wire.Answer(success=True, text="a b c d", ttft=0.1, latency=0.4, chunks=2)
    assert bench.output_length(a, lambda text: len(text.split())) == (4, "tokenizer")
    assert bench.output_length(a, None) == (2, "chunks")


def test_prometheus_parse_and_gauge_delta():
    before = bench.parse_prometheus(
        '# HELP x\nvllm:time_to_first_token_seconds_sum{model_name="a"} 1.0\n'
        'vllm:time_to_first_token_seconds_count{model_name="a"} 4\n'
        'vllm:time_to_first_token_seconds_count{model_name="b"} 1\n'
        'vllm:time_to_first_token_seconds_sum{model_name="b"} 0.5\n'
        'vllm:generation_tokens_total{model_name="a"} 100\n')
    after = bench.parse_prometheus(
        'vllm:time_to_first_token_seconds_sum{model_name="a"} 2.0\n'
        'vllm:time_to_first_token_seconds_count{model_name="a"} 8\n'
        'vllm:time_to_first_token_seconds_count{model_name="b"} 1\n'
        'vllm:time_to_first_token_seconds_sum{model_name="b"} 0.5\n'
        'vllm:generation_tokens_total{model_name="a"} 164\n'
        'vllm:time_per_output_token_seconds_sum 0.3\nvllm:time_per_output_token_seconds_count 10\n')
    g = bench.gauge_delta(before, after)
    assert g["mean_ttft_ms"] == pytest.approx(250.0)  # Δsum 1.0 / Δcount 4
    assert g["generation_tokens"] == 64
    assert g["mean_itl_ms"] == pytest.approx(30.0) and g["itl_metric"] == "vllm:time_per_output_token_seconds"
    assert g["mean_e2el_ms"] is None
    assert not bench.has_gauge(bench.parse_prometheus("python_gc_objects_collected_total 3\n"))


# ---- on the wire, against the timed server ----

def test_stream_timings_match_the_truth(timed_server):
    """Several tokens per chunk, a role chunk sent at once and a usage chunk sent late: neither moves a clock."""
    cfg = dict(ttft=0.15, gap=0.04, tokens=24, tokens_per_chunk=3, usage_delay=0.2)
    srv = timed_server(**cfg)
    answers, duration = bench.run_load(srv.url, "timed", prompt="hi", requests_n=4, concurrency=1, max_tokens=64,
                                       stream=True, warmup=1, timeout=30, time_limit=60)
    r = bench.compute_metrics(answers, duration)
    t = truth(cfg["ttft"], cfg["gap"], cfg["tokens"], cfg["tokens_per_chunk"])
    s = sent(srv, 4)
    assert r["completed"] == 4 and r["output_len_source"] == "usage"
    assert r["total_output_tokens"] == 4 * 24
    assert r["mean_tokens_per_chunk"] == pytest.approx(3.0)
    # never before the server sent it: counting the role chunk (sent at once) would be ~ttft early
    assert all(a.ttft >= s_ttft and a.latency >= s_e2el for a, s_ttft, s_e2el in zip(answers, s["ttft"], s["e2el"]))
    assert close(r["median_ttft_ms"], s["median_ttft"]), (r["median_ttft_ms"], s["ttft"])
    # the usage chunk (usage_delay after the last text) would add 200 ms here
    assert close(r["mean_e2el_ms"], s["mean_e2el"]), (r["mean_e2el_ms"], s["e2el"])
    tpot = np.mean([d / (24 - 1) for d in s["e2el_minus_ttft"]])
    assert close(r["mean_tpot_ms"], tpot, abs_s=0.001), (r["mean_tpot_ms"], tpot, t["tpot"])
    assert close(r["median_itl_ms"], s["median_itl"], abs_s=0.001), (r["median_itl_ms"], s["median_itl"], t["itl"])
    assert len(r["itls"][0]) == 24 // 3 - 1
    # duration covers every request including its trailing usage chunk, as vLLM's benchmark_duration
    assert duration >= 4 * (t["e2el"] + cfg["usage_delay"])
    assert r["output_throughput"] == pytest.approx(96 / duration)


def test_without_usage_the_chunk_count_is_the_length_and_says_so(timed_server):
    srv = timed_server(ttft=0.02, gap=0.01, tokens=12, tokens_per_chunk=2, usage=False)
    answers, duration = bench.run_load(srv.url, "timed", prompt="hi", requests_n=2, concurrency=2, max_tokens=64,
                                       stream=True, warmup=0, timeout=30, time_limit=60)
    r = bench.compute_metrics(answers, duration)
    assert r["output_len_source"] == "chunks" and r["output_lens"] == [6, 6]


def test_tokenizer_count_when_no_usage(timed_server, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(20)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    srv = timed_server(ttft=0.02, gap=0.01, tokens=10, tokens_per_chunk=5, usage=False)
    out = tmp_path / "r.json"
    assert run_cli("bench", "--url", srv.url, "--requests", "2", "--warmup", "0", "--tokenizer", str(tmp_path),
                   "--json", str(out)) == 0
    r = json.loads(out.read_text())
    assert r["output_len_source"] == "tokenizer" and r["output_lens"] == [10, 10]


def test_auto_finds_the_gauge_and_reports_both(timed_server, tmp_path):
    cfg = dict(ttft=0.1, gap=0.03, tokens=16, tokens_per_chunk=2, metrics=True)
    srv = timed_server(**cfg)
    out = tmp_path / "both.json"
    assert run_cli("bench", "--url", srv.url, "--requests", "3", "--warmup", "2", "--json", str(out)) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "both" and r["mode_requested"] == "auto"
    g = r["gauge"]
    assert g["source"] == "metrics" and g["ttft_count"] == 3  # the warm-up is not in the delta
    assert g["generation_tokens"] == 3 * 16
    # The gauge is what the server did for the three timed requests (its log; the warm-up's two excluded), exactly:
    # on a loaded machine that is not the configured timing (the wire's truth: test_stream_timings_match_the_truth).
    assert len(srv.log) == 5
    timed = srv.log[2:]
    assert g["mean_ttft_ms"] == pytest.approx(1000 * sum(e["first"] - e["arrived"] for e in timed) / 3)
    assert g["mean_tpot_ms"] == pytest.approx(1000 * sum((e["last"] - e["first"]) / 15 for e in timed) / 3)
    # The server's clock starts when the request arrived, the client's when it was sent: wire ≥ gauge.
    assert g["ratio_stream_to_gauge"]["ttft"] == pytest.approx(r["mean_ttft_ms"] / g["mean_ttft_ms"])
    assert g["ratio_stream_to_gauge"]["ttft"] >= 1.0
    assert g["ratio_stream_to_gauge"]["tpot"] == pytest.approx(r["mean_tpot_ms"] / g["mean_tpot_ms"])
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "output_throughput", "completed",
                "total_output_tokens", "duration", "boot"):
        assert key in r


def test_a_biased_gauge_changes_its_ratio_never_the_wire_figure(timed_server, tmp_path):
    """Seed 004: stream/gauge was 0.9799 on JAX and 0.9543 on PyTorch. Each ratio belongs to its server; the
    comparable figure is the wire one, which a server's gauge cannot move."""
    cfg = dict(ttft=0.05, gap=0.02, tokens=12, tokens_per_chunk=1, metrics=True)
    runs, tpots = {}, {}
    for scale in (1.0, 0.8):
        srv = timed_server(gauge_scale=scale, **cfg)
        out = tmp_path / f"{scale}.json"
        assert run_cli("bench", "--url", srv.url, "--requests", "2", "--warmup", "0", "--json", str(out)) == 0
        runs[scale] = json.loads(out.read_text())
        tpots[scale] = np.mean([d / (cfg["tokens"] - 1) for d in sent(srv, 2)["e2el_minus_ttft"]])
    for scale, r in runs.items():
        assert close(r["mean_tpot_ms"], tpots[scale], abs_s=0.001)  # the wire figure is the truth, whatever the gauge
        # the ratio is the wire's TPOT over the gauge's, which is what the server did times its bias: exact, whatever
        # a loaded machine added to either
        want = r["mean_tpot_ms"] / 1000 / (tpots[scale] * scale)
        assert r["gauge"]["ratio_stream_to_gauge"]["tpot"] == pytest.approx(want, rel=1e-3)


def test_auto_without_gauge_is_stream_and_gauge_mode_refuses(timed_server, capsys):
    srv = timed_server(ttft=0.01, gap=0.005, tokens=4)
    assert run_cli("bench", "--url", srv.url, "--requests", "1", "--warmup", "0", "--mode", "gauge") == 2
    assert "/metrics has no gauge" in err_text(capsys)
    assert run_cli("bench", "--url", srv.url, "--requests", "1", "--warmup", "0") == 0
    assert "mode stream" in capsys.readouterr().out


def test_gauge_mode_reports_the_server_figure_from_non_streamed_requests(timed_server, tmp_path):
    srv = timed_server(ttft=0.05, gap=0.01, tokens=8, metrics=True)
    out = tmp_path / "g.json"
    assert run_cli("bench", "--url", srv.url, "--requests", "2", "--warmup", "0", "--mode", "gauge",
                   "--json", str(out)) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "gauge" and "mean_ttft_ms" not in r  # no wire TTFT without streaming
    assert r["gauge"]["e2el_count"] == 2 and "ratio_stream_to_gauge" not in r["gauge"]


def test_load_is_bounded_in_time(timed_server):
    srv = timed_server(ttft=0.2, gap=0.01, tokens=2)
    answers, _ = bench.run_load(srv.url, "timed", prompt="hi", requests_n=50, concurrency=1, max_tokens=8,
                                stream=True, warmup=0, timeout=5, time_limit=0.3)
    sent = [a for a in answers if a.success]
    assert 1 <= len(sent) <= 3 and len(answers) == 50
    assert all("time limit" in a.error for a in answers if not a.success)


def test_a_slow_request_is_cut_at_its_timeout(timed_server):
    srv = timed_server(ttft=0.05, gap=0.4, tokens=10)
    ans = wire.stream_chat(requests.Session(), srv.url, wire.chat_payload("timed", "hi", 32, True), 1.0)
    assert not ans.success and "Timeout" in ans.error


def test_compare_prints_one_table_and_plots(tmp_path, timed_server, capsys):
    files = []
    for label, gap in (("fast", 0.01), ("slow", 0.03)):
        srv = timed_server(ttft=0.02, gap=gap, tokens=6)
        files.append(str(tmp_path / f"{label}.json"))
        assert run_cli("bench", "--url", srv.url, "--requests", "2", "--warmup", "0", "--label", label,
                       "--json", files[-1]) == 0
    capsys.readouterr()
    png = tmp_path / "cmp.png"
    assert run_cli("bench", "compare", *files, "--plot", str(png)) == 0
    out = capsys.readouterr().out
    assert "fast" in out and "slow" in out and "median TPOT (ms)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_labels_are_unique_for_the_plot(tmp_path):
    """The same runtime measured twice: its bars must not land on one another (the labels are the x axis)."""
    from g5g.commands.bench import load_results

    result = {"completed": 1, "label": "pytorch"}
    for name in ("a/run", "b/run", "monday"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).with_suffix(".json").write_text(json.dumps(result))
    files = [str(tmp_path / n) + ".json" for n in ("a/run", "b/run", "monday")]
    assert [r["label"] for r in load_results(files)] == ["pytorch (run) #1", "pytorch (run) #2", "pytorch (monday)"]
    assert [r["label"] for r in load_results(files[2:])] == ["pytorch"]


def test_compare_names_a_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a result"}')
    assert run_cli("bench", "compare", str(bad)) == 2
    assert "bad.json: not a bench result" in err_text(capsys)


def test_bad_flags_are_one_line_errors(capsys):
    assert run_cli("bench", "--requests", "3") == 2
    assert "--url URL or --image IMAGE" in err_text(capsys)
    assert run_cli("bench", "--url", "http://127.0.0.1:9", "--requests", "0") == 2
    assert "--requests must be at least 1" in err_text(capsys)


# ---- against the project's own servers (serving/: PyTorch and JAX) with the tiny Gemma 4 fixture ----

@pytest.fixture(scope="module", params=["pytorch", "jax"])
def project_server(request, tiny_gemma4, tmp_path_factory):
    """`python -m serving --runtime R` on 127.0.0.1:<free port>, as the images run it."""
    runtime = request.param
    log = tmp_path_factory.mktemp(f"serve-{runtime}") / "server.log"
    with serving(runtime, tiny_gemma4, "--log-level", "warning", log=log) as srv:
        yield runtime, srv.url


@pytest.mark.slow
def test_smoke_passes_on_the_project_server_with_the_fixed_answer(project_server, capsys):
    from g5g.commands.smoke import check_server
    from devtools.tiny_gemma4 import ANSWER, QUESTION

    _, server_url = project_server
    report = check_server(server_url, None, QUESTION, "Site Reliability Engineering")
    assert report["ok"], report.get("reason")
    assert report["answers"]["stream"]["text"] == report["answers"]["non-stream"]["text"] == ANSWER
    assert report["max_tokens"] <= 128  # the tiny model's context is short: half of it at most
    # The same server fails the check when the expectation is wrong: the check can fail.
    assert main(["smoke", "--url", server_url, "--prompt", QUESTION, "--expect", "Paris"]) == 1
    assert "expected" in err_text(capsys)


@pytest.mark.slow
def test_bench_on_the_project_server_agrees_with_its_own_counters(project_server, tmp_path):
    from devtools.tiny_gemma4 import QUESTION

    runtime, server_url = project_server
    out = tmp_path / f"{runtime}.json"
    assert run_cli("bench", "--url", server_url, "--requests", "3", "--concurrency", "2", "--max-tokens", "24",
                   "--warmup", "1", "--prompt", QUESTION, "--label", runtime, "--json", str(out)) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "both" and r["completed"] == 3 and r["output_len_source"] == "usage"
    assert r["output_lens"] == [24, 24, 24]  # the fixed answer is longer than 24 tokens
    g = r["gauge"]
    assert g["generation_tokens"] == r["total_output_tokens"]  # the server counted what the usage chunks said
    assert g["ttft_count"] == g["e2el_count"] == 3  # warm-up excluded
    # tokens are counted by usage (above); a chunk carries one or more (the detokenizer may hold a piece back)
    assert r["mean_tokens_per_chunk"] >= 1.0
    assert all(g["ratio_stream_to_gauge"][k] > 0 for k in ("ttft", "tpot", "e2el"))
    assert 0 < len(r["itls"][0]) <= 23
