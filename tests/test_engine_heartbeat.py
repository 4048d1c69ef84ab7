"""The engine heartbeat (`--engine-stall-timeout N`): /health answers 503 once the engine has work in hand and has
finished no prefill or decode step for N s, so the chart's liveness probe restarts a wedged engine; an idle engine
stays healthy however long it idles. Against the real server on both runtimes, with a decode step that never
returns (tests/fixtures/wedged_runtime.py)."""
from __future__ import annotations

import re
import threading
import time

import pytest
import requests

from devtools.server import serving_env
from devtools.tiny_gemma4 import QUESTION
from tests.fixtures.serving import tiny_server
from tests.fixtures.wedged_runtime import WEDGE_SEED

STALL_S = 3


def wedge(url: str) -> None:
    """A request that wedges the engine, sent from a thread: it never gets an answer (the server is killed)."""
    def send():
        try:
            chat(url, seed=WEDGE_SEED, max_tokens=8)
        except requests.RequestException:
            pass
    threading.Thread(target=send, daemon=True).start()


def chat(url: str, **extra) -> requests.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, **extra}
    return requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["pytorch", "jax"])
def test_health_turns_503_when_a_step_never_returns_and_an_idle_engine_stays_200(tiny_gemma4, tmp_path, inner):
    if inner == "jax":
        pytest.importorskip("jax")
    env = serving_env(tmp_path / "jax-cache" if inner == "jax" else None, G5G_TEST_INNER=inner)
    with tiny_server(tiny_gemma4, "--engine-stall-timeout", str(STALL_S), runtime="wedged",
                     entry=["-m", "tests.fixtures.wedged_runtime"], env=env) as srv:
        try:
            assert chat(srv.url).status_code == 200          # steps return until the wedge: work is done
            time.sleep(STALL_S + 1)                         # idle past the limit: not a stall
            assert requests.get(f"{srv.url}/health", timeout=10).status_code == 200
            sent = time.monotonic()
            wedge(srv.url)
            deadline = sent + STALL_S + 60                  # a bound on the poll, not a speed requirement
            while (r := requests.get(f"{srv.url}/health", timeout=10)).status_code == 200:
                assert time.monotonic() < deadline, "/health stayed 200 with the engine wedged"
                time.sleep(0.2)
            took = time.monotonic() - sent
            assert r.status_code == 503, r.text
            message = r.json()["error"]["message"]
            assert message.startswith("engine stalled: work in hand and no step done for ") and \
                f"(--engine-stall-timeout {STALL_S})" in message, message
            assert int(re.search(r"for (\d+) s", message).group(1)) >= STALL_S and took >= STALL_S
            # the rest of the API still answers: it is the engine, not the server, that is stuck
            assert requests.get(f"{srv.url}/v1/models", timeout=10).status_code == 200
        finally:
            srv.proc.kill()                                 # the wedged step never returns: nothing drains it


@pytest.mark.slow
def test_without_the_flag_a_wedged_engine_stays_healthy(tiny_gemma4):
    """Today's behaviour, kept as the default (0: off): what the flag changes."""
    env = serving_env(G5G_TEST_INNER="pytorch")
    with tiny_server(tiny_gemma4, runtime="wedged", entry=["-m", "tests.fixtures.wedged_runtime"], env=env) as srv:
        try:
            wedge(srv.url)
            time.sleep(2)
            assert requests.get(f"{srv.url}/health", timeout=10).status_code == 200
        finally:
            srv.proc.kill()


@pytest.mark.parametrize("value,message", [("0.5", "must be 0 (off) or at least 1 second, got 0.5"),
                                           ("-1", "must be a finite number of seconds >= 0, got -1"),
                                           ("soon", "must be a finite number of seconds >= 0, got soon")])
def test_a_stall_limit_under_the_idle_beat_is_refused(capsys, value, message):
    """An idle engine thread beats once a second: a shorter limit could call a request that just arrived a stall."""
    from serving.__main__ import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--runtime", "pytorch", "--model", "m", "--engine-stall-timeout", value])
    err = capsys.readouterr().err
    assert f"argument --engine-stall-timeout: {message}" in err, err
    assert build_parser().parse_args(["--runtime", "pytorch", "--model", "m", "--engine-stall-timeout",
                                      "1"]).engine_stall_timeout == 1.0
