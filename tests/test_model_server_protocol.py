"""The Gateway API Inference Extension's Model Server Protocol, the part an Endpoint Picker reads, on our JAX and
PyTorch servers: the three gauges exist under vLLM's names and move as the protocol says. Queued requests raise
`vllm:num_requests_waiting` one for one, a running stream is `vllm:num_requests_running`, and
`vllm:kv_cache_usage_perc` is a share between 0 and 1 that rises with the context held. The engine is held still
after one decode step (tests/fixtures/wedged_runtime.py, released through a file) so the gauges can be read while
the requests are where the test put them; one slot, so a second request waits."""
from __future__ import annotations

import threading

import pytest
import requests

from devtools.server import serving_env
from devtools.tiny_gemma4 import QUESTION
from tests.fixtures.observe import metrics, wait_until
from tests.fixtures.serving import tiny_server
from tests.fixtures.wedged_runtime import WEDGE_SEED

GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def send(url: str, question: str, **extra) -> threading.Thread:
    body = {"model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": 24, **extra}

    def post():
        try:
            requests.post(f"{url}/v1/chat/completions", json=body, timeout=300,
                          stream=bool(extra.get("stream"))).content
        except requests.RequestException:
            pass
    t = threading.Thread(target=post, daemon=True)
    t.start()
    return t


def held_kv(url: str, release, question: str) -> float:
    """A stream that the engine holds still after one step: the KV share it fills, read while it runs."""
    send(url, question, seed=WEDGE_SEED, stream=True, ignore_eos=True)
    wait_until(lambda: metrics(url)["vllm:num_requests_running"] == 1 and
               metrics(url)["vllm:kv_cache_usage_perc"] > 0, timeout=120, what="the stream to run")
    return metrics(url)["vllm:kv_cache_usage_perc"]


@pytest.mark.slow
@pytest.mark.parametrize("inner", ["pytorch", "jax"])
def test_the_endpoint_pickers_gauges_move_as_the_protocol_says(tiny_gemma4, tmp_path, inner):
    if inner == "jax":
        pytest.importorskip("jax")
    release = tmp_path / "release"
    env = serving_env(tmp_path / "jax-cache" if inner == "jax" else None, G5G_TEST_INNER=inner,
                      G5G_TEST_RELEASE=str(release), G5G_JAX_SLOTS="1", G5G_TORCH_SLOTS="1")
    with tiny_server(tiny_gemma4, runtime="wedged", entry=["-m", "tests.fixtures.wedged_runtime"], env=env) as srv:
        idle = metrics(srv.url)
        assert [idle[g] for g in GAUGES] == [0, 0, 0]                 # present before any request
        short = held_kv(srv.url, release, QUESTION)
        assert 0 < short < 1
        for waiting in (1, 2, 3):                                     # the slot is taken: each new request waits
            send(srv.url, QUESTION, max_tokens=2)
            wait_until(lambda: metrics(srv.url)["vllm:num_requests_waiting"] == waiting, what=f"{waiting} waiting")
            assert metrics(srv.url)["vllm:num_requests_running"] == 1
        release.touch()                                               # let it go: all finish, the gauges fall
        wait_until(lambda: [metrics(srv.url)[g] for g in GAUGES] == [0, 0, 0], timeout=120, what="all to finish")
        long = held_kv(srv.url, release, " ".join([QUESTION] * 6))   # more context held: a larger share
        assert short < long < 1, (short, long)
        release.touch()
        wait_until(lambda: metrics(srv.url)["vllm:num_requests_running"] == 0, timeout=120, what="the stream to end")
