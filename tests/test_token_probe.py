"""The chart's token probe (deploy/chart/files/token_probe.py: vLLM's liveness, and `helm test`), run as the kubelet
runs it, a separate python3 process, against a real HTTP server on 127.0.0.1 that answers as vLLM does, hangs like
a stuck engine, or fails."""
from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "deploy" / "chart" / "files" / "token_probe.py"


class Engine:
    """A loopback stand-in for vLLM's routes the probe uses: /v1/completions and /metrics."""

    def __init__(self):
        self.tokens = 0.0            # vllm:generation_tokens_total
        self.mode = "ok"             # ok | hang | error | empty
        self.release = threading.Event()
        self.requests: list[tuple[str, dict, str | None]] = []
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                try:
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:      # the probe gave up on a hung answer and closed the connection
                    pass

            def do_GET(self):
                if self.path != "/metrics":
                    return self._send(404, b"{}")
                text = ("# TYPE vllm:generation_tokens_total counter\n"
                        f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {engine.tokens}\n'
                        'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n')
                self._send(200, text.encode(), "text/plain")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.requests.append((self.path, body, self.headers.get("Authorization")))
                if engine.mode == "hang":     # a stuck engine: the answer comes only when the test lets it
                    engine.release.wait(60)
                if engine.mode == "error":
                    return self._send(500, b'{"error": "engine dead"}')
                tokens = 0 if engine.mode == "empty" else body["max_tokens"]
                engine.tokens += tokens
                self._send(200, json.dumps({"object": "text_completion", "choices": [
                    {"index": 0, "text": "2" * tokens, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": 1 + tokens}}).encode())

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.release.set()
    e.server.shutdown()
    e.server.server_close()


def run_probe(url: str, *extra: str, deadline: str = "5", env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--url", url, "--model", "gemma", "--deadline", deadline,
                           *extra], capture_output=True, text=True, timeout=60, env=env or {"PATH": "/usr/bin:/bin"})


def test_a_token_out_passes_and_the_key_is_sent(engine):
    r = run_probe(engine.url, env={"VLLM_API_KEY": "k-123"})
    assert r.returncode == 0, r.stdout + r.stderr
    ((path, body, auth),) = engine.requests
    assert path == "/v1/completions" and body["max_tokens"] == 1 and body["model"] == "gemma"
    assert auth == "Bearer k-123"
    assert run_probe(engine.url).returncode == 0 and engine.requests[-1][2] is None   # no key set: none sent


def test_a_hung_engine_fails_at_the_deadline_not_when_it_answers(engine):
    """The engine holds the request until the test releases it (60 s at most); the probe must give up by its own
    deadline: had it waited, the late answer would carry a token and it would pass."""
    engine.mode = "hang"
    r = run_probe(engine.url, deadline="1")
    released_before = engine.release.is_set()
    engine.release.set()
    assert not released_before and r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith("token_probe: ") and r.stdout.count("\n") == 1


@pytest.mark.parametrize("mode,why", [("error", "HTTP 500"), ("empty", "without a completion token")])
def test_an_answer_without_a_token_fails(engine, mode, why):
    engine.mode = mode
    r = run_probe(engine.url)
    assert r.returncode == 1 and why in r.stdout, r.stdout + r.stderr


def test_nothing_listening_fails():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]      # bound, not listening: connection refused
        r = run_probe(f"http://127.0.0.1:{port}")
    assert r.returncode == 1 and "/v1/completions" in r.stdout, r.stdout + r.stderr


def test_a_busy_engine_passes_on_its_counter_without_more_work(engine, tmp_path):
    """With --state: tokens counted since the last run prove the engine is producing; no completion is asked for.
    A counter that did not move means asking; a hung engine whose counter stands still fails."""
    state = str(tmp_path / "probe.state")
    assert run_probe(engine.url, "--state", state).returncode == 0       # first run: no record, asks
    assert len(engine.requests) == 1
    engine.tokens += 40                                                   # other streams decoded meanwhile
    assert run_probe(engine.url, "--state", state).returncode == 0
    assert len(engine.requests) == 1                                      # passed on the counter alone
    assert run_probe(engine.url, "--state", state).returncode == 0       # idle since: asks again
    assert len(engine.requests) == 2
    # its own token is not the next run's proof: the next run asks again, and a stuck engine fails it
    engine.mode = "hang"
    r = run_probe(engine.url, "--state", state, deadline="1")
    engine.release.set()
    assert r.returncode == 1 and "deadline" in r.stdout, r.stdout + r.stderr
