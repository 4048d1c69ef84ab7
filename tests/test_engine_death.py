"""An engine that dies says so and goes (issue 53): a device error, or FATAL_AFTER failed steps in a row, turns
/health 503 at once, every request in hand gets a 503 naming the cause, and the process exits non-zero, so that
its orchestrator restarts it. One request's failure (an out-of-memory) stays that request's. Against the real
server on both runtimes, with steps that fail on a request's word (tests/fixtures/failing_runtime.py); the rule
itself, on the scheduler alone, below."""
from __future__ import annotations

import json
import threading

import pytest
import requests

from devtools.server import serving_env
from devtools.tiny_gemma4 import QUESTION
from serving.core.scheduler import FATAL_AFTER, fatal
from tests.fixtures.failing_runtime import BROKEN_SEED, OOM_SEED, POISON_SEED, REFUSED_SEED
from tests.fixtures.serving import tiny_server

EXIT_S = 60         # a bound on the wait for the exit, not a speed requirement


def chat(url: str, **extra) -> requests.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, **extra}
    return requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)


class Stream(threading.Thread):
    """A long streamed request in a thread: .status, .lines once joined; .first set at its first line."""

    def __init__(self, url: str, **extra):
        super().__init__(daemon=True)
        self.url, self.status, self.lines, self.first = url, None, [], threading.Event()
        self.extra = extra
        self.start()

    def run(self):
        body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 200,
                "ignore_eos": True, "stream": True, **self.extra}
        try:
            with requests.post(f"{self.url}/v1/chat/completions", json=body, stream=True, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines(decode_unicode=True):
                    if line:
                        self.lines.append(line)
                        self.first.set()
        except requests.RequestException as e:
            self.lines.append(f"no answer: {e}")
        finally:
            self.first.set()


def _server(tiny_gemma4, tmp_path, inner: str):
    if inner == "jax":
        pytest.importorskip("jax")
    env = serving_env(tmp_path / "jax-cache" if inner == "jax" else None, G5G_TEST_INNER=inner, G5G_TEST_PACE="0.02")
    return tiny_server(tiny_gemma4, runtime="failing", entry=["-m", "tests.fixtures.failing_runtime"], env=env)


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["pytorch", "jax"])
def test_a_poisoned_engine_fails_every_request_then_the_server_exits_non_zero(tiny_gemma4, tmp_path, inner):
    """Before: each request got a 500 and /health stayed 200 for ever. Now: one out-of-memory is that request's
    500 and the next request is served; then an illegal address in a stream: it ends with the error 'engine
    failed', the request beside or behind it gets that 503, /health is 503 until the process exits 1."""
    with _server(tiny_gemma4, tmp_path, inner) as srv:
        oom = chat(srv.url, seed=OOM_SEED)
        assert oom.status_code == 500 and "out of memory" in oom.json()["error"]["message"], oom.text
        assert requests.get(f"{srv.url}/health", timeout=10).status_code == 200
        assert chat(srv.url).status_code == 200
        poisoned = Stream(srv.url, seed=POISON_SEED)          # fails at its POISON_AFTER-th step (seconds)
        assert poisoned.first.wait(60) and poisoned.status == 200, poisoned.lines
        behind = []                                             # running beside it, or queued behind it
        long = {"max_tokens": 200, "ignore_eos": True}         # still in hand when the poison comes
        asking = threading.Thread(target=lambda: behind.append(chat(srv.url, **long)), daemon=True)
        asking.start()
        poisoned.join(EXIT_S)
        errors = [json.loads(line[len("data: "):])["error"] for line in poisoned.lines
                  if line.startswith("data: {\"error\"")]
        assert errors and errors[0]["message"].startswith("engine failed: device error: RuntimeError: CUDA error"), \
            poisoned.lines[-3:]
        asking.join(EXIT_S)
        assert behind and behind[0].status_code == 503, behind and behind[0].text
        assert behind[0].json()["error"]["message"].startswith("engine failed: ")
        try:
            health = requests.get(f"{srv.url}/health", timeout=10)
            assert health.status_code == 503 and "engine failed" in health.json()["error"]["message"]
        except requests.ConnectionError:
            pass                                                # already gone: the exit below says so
        assert srv.proc.wait(EXIT_S) == 1


@pytest.mark.slow
def test_steps_that_keep_failing_kill_the_engine_after_fatal_after_in_a_row(tiny_gemma4, tmp_path):
    """Steps that fail without a device error: each is its request's 500 until FATAL_AFTER in a row, which is
    the 503 'engine failed', and the server exits 1."""
    with _server(tiny_gemma4, tmp_path, "pytorch") as srv:
        got = [chat(srv.url, seed=BROKEN_SEED).status_code for _ in range(FATAL_AFTER)]
        assert got == [500] * (FATAL_AFTER - 1) + [503]
        try:
            assert requests.get(f"{srv.url}/health", timeout=10).status_code == 503
        except requests.ConnectionError:
            pass                                                # already gone: the exit below says so
        assert srv.proc.wait(EXIT_S) == 1


@pytest.mark.slow
def test_requests_the_runtime_refuses_never_kill_the_engine(tiny_gemma4, tmp_path):
    """A prefill that fails is that request's alone, however many come in a row: otherwise FATAL_AFTER bad
    requests from one client would stop the server for everyone."""
    with _server(tiny_gemma4, tmp_path, "pytorch") as srv:
        got = [chat(srv.url, seed=REFUSED_SEED).status_code for _ in range(FATAL_AFTER + 1)]
        assert got == [500] * (FATAL_AFTER + 1)
        assert chat(srv.url).status_code == 200
        assert requests.get(f"{srv.url}/health", timeout=10).status_code == 200
        assert srv.proc.poll() is None


@pytest.mark.parametrize("error,failures,dead", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), 1, True),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), 1, True),
    (RuntimeError("INTERNAL: Failed to launch CUDA kernel: CUDA_ERROR_ILLEGAL_ADDRESS"), 1, True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), 1, False),
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.5GiB"), 1, False),
    (ValueError("a runtime bug"), 1, False),
    (ValueError("a runtime bug"), FATAL_AFTER, True),
])
def test_which_failures_kill_the_engine(error, failures, dead):
    assert (fatal(error, failures) is not None) is dead
