"""Time to first token and decode speed of `python -m serving`, measured on the wire (as `vllm bench serve`).

    python -m benchmarks.serving_cpu [--runtime pytorch] [--model DIR] [--requests 8] [--max-tokens 128]

Starts the server in its own process (default model: the tiny Gemma 4 fixture, built if needed), waits for
/health, sends sequential streaming requests that ignore end-of-turn so every one yields exactly --max-tokens,
and reports per-request TTFT, TPOT = (latency - ttft) / (output_tokens - 1), tokens/s, plus the server's own
vllm:request_time_per_output_token_seconds for comparison. Boot time is reported too (process start → 200).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai
import requests
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gauge(url: str, name: str) -> tuple[float, float]:
    for fam in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=5).text):
        for s in fam.samples:
            if s.name == f"{name}_sum":
                total = s.value
            if s.name == f"{name}_count":
                count = s.value
    return total, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", default="pytorch", choices=("pytorch", "jax"))
    ap.add_argument("--model", help="checkpoint dir (default: the tiny Gemma 4 fixture)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="OMP/torch threads for the server (CPU)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    if args.model:
        model = Path(args.model)
    else:
        sys.path.insert(0, str(REPO))
        from tests.fixtures.tiny_gemma4 import cached
        model = cached()
    port = _port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--runtime", args.runtime, "--model", str(model),
                             "--port", str(port), "--log-level", "warning"], env=env, cwd=REPO)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.05)
        boot = time.monotonic() - t0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        prompt = [{"role": "user", "content": "What does SRE stand for?"}]
        rows = []
        for i in range(args.requests + 1):           # the first one is a warm-up, not counted
            start = time.perf_counter()
            ttft = None
            usage = None
            stream = client.chat.completions.create(
                model=name, messages=prompt, max_tokens=args.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.perf_counter() - start
                if chunk.usage:
                    usage = chunk.usage
            latency = time.perf_counter() - start
            n = usage.completion_tokens
            if i:
                rows.append({"ttft_ms": ttft * 1e3, "tpot_ms": (latency - ttft) / (n - 1) * 1e3,
                             "tokens_per_s": n / latency, "decode_tokens_per_s": (n - 1) / (latency - ttft),
                             "output_tokens": n, "latency_ms": latency * 1e3})
        total, count = _gauge(url, "vllm:request_time_per_output_token_seconds")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)

    def med(k):
        return statistics.median(r[k] for r in rows)

    result = {"runtime": args.runtime, "model": str(model), "requests": len(rows), "max_tokens": args.max_tokens,
              "threads": args.threads, "boot_s": round(boot, 2),
              "median_ttft_ms": round(med("ttft_ms"), 2), "mean_ttft_ms": round(statistics.mean(r["ttft_ms"] for r in rows), 2),
              "median_tpot_ms": round(med("tpot_ms"), 3), "median_tokens_per_s": round(med("tokens_per_s"), 1),
              "median_decode_tokens_per_s": round(med("decode_tokens_per_s"), 1),
              "server_mean_tpot_ms_incl_warmup": round(total / count * 1e3, 3) if count else None}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": result, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
