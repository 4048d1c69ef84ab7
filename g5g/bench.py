"""The benchmark: one load loop and one set of statistics for every server, as `vllm bench serve` defines them.

Per request (g5g.wire): TTFT, ITL gaps, E2EL measured on the wire. Output length from the final usage chunk, else a
tokenizer count of the text, else the number of text chunks — the source is recorded. Then, as vLLM 0.33.0's
`calculate_metrics` (vllm/benchmarks/serve.py): TPOT = (E2EL − TTFT) / (N − 1) for N > 1; mean, median, std
(population) and percentiles with numpy's default linear interpolation; output_throughput = Σ N / duration, with
duration from the start of the timed run to the end of its last request.

The server's own gauge (`gauge`/`both`): Prometheus `/metrics` with vLLM's names, scraped before and after the timed
run; a mean is Δ_sum / Δ_count. Its figures are reported beside the wire figures with their ratio, for this server
only: a ratio measured on one runtime never converts another runtime's number (seed 004: 0.9799 vs 0.9543).
"""
from __future__ import annotations

import concurrent.futures
import math
import re
import threading
import time
from typing import Callable

import requests

from g5g import wire

PERCENTILES = (90.0, 99.0)
METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PROMPT = ("Explain, in a few short paragraphs, how a GPU executes a matrix multiplication and why memory "
                  "bandwidth limits token generation for large language models.")

# Server gauges with vLLM's names; the first name present wins (older vLLM: time_per_output_token_seconds).
GAUGES = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "tpot": ("vllm:request_time_per_output_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2el": ("vllm:e2e_request_latency_seconds",),
}
GENERATION_TOKENS = "vllm:generation_tokens_total"


# ---- statistics (pure) ----

def percentile(values: list[float], p: float) -> float:
    """numpy.percentile(values, p) with its default 'linear' method."""
    xs = sorted(values)
    if not xs:
        return 0.0
    h = (len(xs) - 1) * p / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def describe(values_s: list[float], name: str) -> dict[str, float]:
    """mean/median/std/pXX of seconds, in ms, keyed as vllm bench serve keys them (0 for no values, as vLLM)."""
    xs = list(values_s) or [0.0]
    mean = sum(xs) / len(xs)
    out = {f"mean_{name}_ms": mean * 1000, f"median_{name}_ms": percentile(xs, 50) * 1000,
           f"std_{name}_ms": math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) * 1000}
    for p in PERCENTILES:
        out[f"p{int(p) if p == int(p) else p}_{name}_ms"] = percentile(xs, p) * 1000
    return out


def output_length(ans: wire.Answer, count_tokens: Callable[[str], int] | None) -> tuple[int, str]:
    if ans.completion_tokens:
        return ans.completion_tokens, "usage"
    if count_tokens is not None:
        return count_tokens(ans.reasoning + ans.text), "tokenizer"
    return ans.chunks, "chunks"


def compute_metrics(answers: list[wire.Answer], duration: float,
                    count_tokens: Callable[[str], int] | None = None) -> dict:
    """The vllm-bench-serve result for a timed run (streamed answers: wire timings; non-streamed: E2EL only)."""
    ttfts, tpots, itls, e2els, out_lens, sources, per_chunk = [], [], [], [], [], set(), []
    total_input = 0
    streamed = any(a.stream for a in answers)
    for a in answers:
        if not a.success:
            out_lens.append(0)
            continue
        n, source = output_length(a, count_tokens)
        sources.add(source)
        out_lens.append(n)
        total_input += a.prompt_tokens or 0
        e2els.append(a.latency)
        if a.stream:
            ttfts.append(a.ttft)
            itls += a.itl
            if n > 1:
                tpots.append((a.latency - a.ttft) / (n - 1))
            if a.chunks:
                per_chunk.append(n / a.chunks)
    completed = sum(1 for a in answers if a.success)
    total_output = sum(out_lens)
    duration = duration or float("nan")
    result = {
        "duration": duration,
        "completed": completed,
        "failed": len(answers) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "output_len_source": "+".join(sorted(sources)) or None,
        "mean_tokens_per_chunk": sum(per_chunk) / len(per_chunk) if per_chunk else None,
    }
    if streamed:
        result |= describe(ttfts, "ttft") | describe(tpots, "tpot") | describe(itls, "itl")
    result |= describe(e2els, "e2el")
    result |= {
        "output_lens": out_lens,
        "ttfts": [a.ttft if a.success and a.stream else None for a in answers],
        "itls": [a.itl for a in answers],
        "latencies": [a.latency for a in answers],
        "errors": [a.error for a in answers],
    }
    return result


# ---- the server's gauge ----

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format → {sample name: value summed over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def has_gauge(samples: dict[str, float]) -> bool:
    return any(f"{n}_count" in samples for names in GAUGES.values() for n in names)


def scrape(session: requests.Session, url: str) -> dict[str, float] | None:
    """The server's /metrics, or None when it has none (or not in vLLM's names)."""
    try:
        resp = session.get(f"{url}/metrics", timeout=10)
    except requests.RequestException:
        return None
    if resp.status_code != 200:
        return None
    samples = parse_prometheus(resp.text)
    return samples if has_gauge(samples) else None


def gauge_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """Means over the timed run from _sum/_count deltas, in ms; None where the server has no such gauge."""
    out: dict = {"source": "metrics"}
    for key, names in GAUGES.items():
        out[f"mean_{key}_ms"] = None
        for name in names:
            if f"{name}_count" in after:
                count = after[f"{name}_count"] - before.get(f"{name}_count", 0.0)
                total = after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0) if f"{name}_sum" in after else 0.0
                out[f"mean_{key}_ms"] = total / count * 1000 if count > 0 else None
                out[f"{key}_count"] = count
                out[f"{key}_metric"] = name
                break
    if GENERATION_TOKENS in after:
        out["generation_tokens"] = after[GENERATION_TOKENS] - before.get(GENERATION_TOKENS, 0.0)
    return out


def response_gauge(answers: list[wire.Answer]) -> dict | None:
    """The server's TTFT from a `metrics` field in its responses (vLLM can send one), when there is no /metrics."""
    ttfts = [a.server_ttft for a in answers if a.success and a.server_ttft is not None]
    if not ttfts:
        return None
    return {"source": "response", "mean_ttft_ms": sum(ttfts) / len(ttfts) * 1000}


def ratios(result: dict, gauge: dict) -> dict:
    """stream/gauge per metric, for this server only."""
    out = {}
    for key in METRICS:
        client, server = result.get(f"mean_{key}_ms"), gauge.get(f"mean_{key}_ms")
        if client and server:
            out[key] = client / server
    return out


# ---- the load loop ----

def run_load(url: str, model: str, *, prompt: str, requests_n: int, concurrency: int, max_tokens: int,
             stream: bool, warmup: int, timeout: float, time_limit: float,
             before_run: Callable[[], None] | None = None, ignore_eos: bool = False) -> tuple[list[wire.Answer], float]:
    """Warm up, call `before_run` (the gauge's first scrape), then send `requests_n` requests, at most `concurrency`
    in flight, each bounded by `timeout`; none starts after `time_limit` seconds (those count as failed).
    Returns the answers (in send order) and the run's duration."""
    payload = wire.chat_payload(model, prompt, max_tokens, stream, temperature=0.0, ignore_eos=ignore_eos)
    send = wire.stream_chat if stream else wire.chat
    local = threading.local()

    def one(deadline: float) -> wire.Answer:
        if time.perf_counter() > deadline:
            return wire.Answer(stream=stream, error="not sent: the run's time limit was reached")
        if not hasattr(local, "session"):
            local.session = requests.Session()
        return send(local.session, url, payload, timeout)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        warm_deadline = time.perf_counter() + time_limit
        for ans in pool.map(lambda _: one(warm_deadline), range(warmup)):
            if not ans.success:
                raise RuntimeError(f"warm-up request failed: {ans.error}")
        if before_run:
            before_run()
        start = time.perf_counter()
        deadline = start + time_limit
        answers = list(pool.map(lambda _: one(deadline), range(requests_n)))
        duration = time.perf_counter() - start  # as vLLM: start of the run → every request returned
    return answers, duration
