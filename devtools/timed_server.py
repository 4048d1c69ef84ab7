"""An OpenAI-compatible chat server whose timing is known exactly, for testing smoke and bench.

Standard library only, so the same file also runs inside a bare Debian container (the e2e tests do that):

    python3 timed_server.py --port 8000 --ttft 0.2 --gap 0.05 --tokens 32 --tokens-per-chunk 2 --metrics

Timing is scheduled against absolute deadlines from the moment the request arrived: the first text chunk goes out
at `ttft`, chunk k at `ttft + k·gap`, so sleep overshoot never accumulates. A chunk carrying only the role goes
out at once and the usage chunk `usage_delay` after the last text chunk: a benchmark that counts either as a token
gets TTFT/E2EL wrong by a known amount. The truth for a request of N tokens in K = ceil(N/m) chunks of m tokens:
TTFT = ttft, E2EL = ttft + (K-1)·gap, ITL = gap, TPOT = (K-1)·gap/(N-1).

Behaviours (`mode`): ok (the configured answer or N synthetic tokens), garbage (`: ok: ok: ok…`), empty (no text),
truncated (finish_reason "length"), pad (`<pad><pad>…`). `die_after` makes the process print `die_message` to
stderr and exit 3: a server that dies during start-up.

In a process: `TimedServer(Config(…)).start()` serves it from a thread on 127.0.0.1:<free port>, `.stop()` ends it
(tests/fixtures/timed_server.py is the pytest fixture).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("ok", "garbage", "empty", "truncated", "pad")


@dataclasses.dataclass
class Config:
    ttft: float = 0.05
    gap: float = 0.02
    tokens: int = 16  # synthetic tokens per answer when `answer` is empty
    tokens_per_chunk: int = 1
    answer: str = ""  # a fixed answer, one token per word (leading space kept)
    mode: str = "ok"
    usage: bool = True  # honour stream_options.include_usage
    usage_delay: float = 0.05
    metrics: bool = False  # /metrics with vLLM's names
    gauge_scale: float = 1.0  # the gauge misreads durations by this factor (each runtime's gauge has its own bias)
    health_delay: float = 0.0  # /health answers 503 until this long after start
    model: str = "timed"
    prompt_tokens: int = 7


def answer_tokens(cfg: Config, max_tokens: int) -> tuple[list[str], str]:
    """The tokens this request gets and its finish_reason."""
    if cfg.mode == "garbage":
        tokens = [":", " ok"] * 8
    elif cfg.mode == "pad":
        tokens = ["<pad>"] * 8
    elif cfg.mode == "empty":
        tokens = []
    elif cfg.answer:
        words = cfg.answer.split(" ")
        tokens = [words[0]] + [" " + w for w in words[1:]]
    else:
        tokens = [f" w{i}" for i in range(cfg.tokens)]
    finish = "stop"
    if len(tokens) > max_tokens:
        tokens, finish = tokens[:max_tokens], "length"
    if cfg.mode == "truncated":
        finish = "length"
    return tokens, finish


class _Histogram:
    def __init__(self) -> None:
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1


class TimedServer:
    """The server, its config and what it actually did (`log`: one dict per request, perf_counter times)."""

    def __init__(self, cfg: Config, host: str = "127.0.0.1", port: int = 0) -> None:
        self.cfg = cfg
        self.started = time.monotonic()
        self.log: list[dict] = []
        self.lock = threading.Lock()
        self.hist = {name: _Histogram() for name in (
            "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
            "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds")}
        self.generation_tokens = 0
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread: threading.Thread | None = None

    def start(self) -> "TimedServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread:
            self._thread.join(timeout=5)

    def record(self, entry: dict, tokens: int) -> None:
        k = self.cfg.gauge_scale
        with self.lock:
            self.log.append(entry)
            if "first" in entry:  # server-side gauge, as vLLM's: from arrival to first / last token
                ttft, e2e = (entry["first"] - entry["arrived"]) * k, (entry["last"] - entry["arrived"]) * k
                self.hist["vllm:time_to_first_token_seconds"].observe(ttft)
                self.hist["vllm:e2e_request_latency_seconds"].observe(e2e)
                for a, b in zip(entry["sent"], entry["sent"][1:]):
                    self.hist["vllm:inter_token_latency_seconds"].observe((b - a) * k)
                if tokens > 1:
                    self.hist["vllm:request_time_per_output_token_seconds"].observe((e2e - ttft) / (tokens - 1))
            self.generation_tokens += tokens

    def metrics_text(self) -> str:
        lines = []
        with self.lock:
            for name, h in self.hist.items():
                lines += [f"# TYPE {name} histogram",
                          f'{name}_bucket{{le="+Inf",model_name="{self.cfg.model}"}} {h.count}',
                          f'{name}_sum{{model_name="{self.cfg.model}"}} {h.sum!r}',
                          f'{name}_count{{model_name="{self.cfg.model}"}} {h.count}']
            lines += ["# TYPE vllm:generation_tokens_total counter",
                      f'vllm:generation_tokens_total{{model_name="{self.cfg.model}"}} {float(self.generation_tokens)}']
        return "\n".join(lines) + "\n"


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


def _handler(server: TimedServer):
    cfg = server.cfg

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                ready = time.monotonic() - server.started >= cfg.health_delay
                self._send(200 if ready else 503, b"{}")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [
                    {"id": cfg.model, "object": "model", "owned_by": "timed"}]}).encode())
            elif self.path == "/metrics" and cfg.metrics:
                self._send(200, server.metrics_text().encode(), "text/plain; version=0.0.4")
            else:
                self._send(404, b'{"error": {"message": "not found"}}')

        def do_POST(self) -> None:
            arrived = time.perf_counter()
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/v1/chat/completions":
                return self._send(404, b'{"error": {"message": "not found"}}')
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 10**6)
            tokens, finish = answer_tokens(cfg, max_tokens)
            n_tokens = len(tokens) if tokens else 1  # an empty answer still generated an end-of-turn token
            m = max(1, cfg.tokens_per_chunk)
            chunks = ["".join(tokens[i:i + m]) for i in range(0, len(tokens), m)]
            usage = {"prompt_tokens": cfg.prompt_tokens, "completion_tokens": n_tokens,
                     "total_tokens": cfg.prompt_tokens + n_tokens}
            entry: dict = {"arrived": arrived, "sent": []}
            if not body.get("stream"):
                _sleep_until(arrived + cfg.ttft + max(0, len(chunks) - 1) * cfg.gap)
                msg = {"id": "cmpl-t", "object": "chat.completion", "model": cfg.model, "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "".join(chunks)},
                     "finish_reason": finish}], "usage": usage}
                if chunks:  # as if generated on schedule and held back until the end
                    entry["sent"] = [arrived + cfg.ttft + k * cfg.gap for k in range(len(chunks))]
                    entry["first"], entry["last"] = entry["sent"][0], entry["sent"][-1]
                server.record(entry, n_tokens)  # before the answer: a client reading /metrics next sees it
                self._send(200, json.dumps(msg).encode())
                entry["done"] = time.perf_counter()
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def event(obj) -> None:
                data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def chunk(delta: dict, finish_reason=None) -> dict:
                return {"id": "cmpl-t", "object": "chat.completion.chunk", "model": cfg.model,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

            event(chunk({"role": "assistant", "content": ""}))  # at once: not a token
            for k, text in enumerate(chunks):
                _sleep_until(arrived + cfg.ttft + k * cfg.gap)
                entry["sent"].append(time.perf_counter())  # before the write: no client reads it earlier
                event(chunk({"content": text}))
            if chunks:
                entry["first"], entry["last"] = entry["sent"][0], entry["sent"][-1]
            else:
                _sleep_until(arrived + cfg.ttft)
            # Counted when generation ends, before the finish chunk, as vLLM does: once the client has [DONE],
            # /metrics already includes this request (recording after it raced the benchmark's next read).
            server.record(entry, n_tokens)
            event(chunk({}, finish))
            if cfg.usage and (body.get("stream_options") or {}).get("include_usage"):
                _sleep_until(time.perf_counter() + cfg.usage_delay)
                event({"id": "cmpl-t", "object": "chat.completion.chunk", "model": cfg.model, "choices": [],
                       "usage": usage})
            event(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    for f in dataclasses.fields(Config):
        if f.name == "model":
            continue  # --served-model-name below
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(flag, type={"float": float, "int": int, "str": str}[f.type], default=f.default)
    p.add_argument("--die-after", type=float, help="exit 3 after this many seconds (a server dying in start-up)")
    p.add_argument("--die-message", default="fatal: the engine failed to start")
    # A real entrypoint takes --model/--runtime: accept and ignore them so containers can run us in its place.
    p.add_argument("--model-dir", "--model", dest="model_dir")
    p.add_argument("--runtime")
    p.add_argument("--served-model-name", default=Config.model)
    a = p.parse_args(argv)
    cfg = Config(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Config) if f.name != "model"},
                 model=a.served_model_name)
    print(f"timed_server: starting ({cfg})", flush=True)
    if a.die_after is not None:
        time.sleep(a.die_after)
        print(a.die_message, file=sys.stderr, flush=True)
        return 3
    s = TimedServer(cfg, a.host, a.port)
    print(f"timed_server: listening on {s.url}", flush=True)
    try:
        s.httpd.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
