"""The JAX runtime behind the shared API layer, as `build.py serve --runtime jax` runs it, against the PyTorch one.

Both servers run as their own processes on loopback and serve the trained tiny Gemma 4 fixture; the same requests
must produce the same text (greedy and seeded sampling: the sampler is shared, so this checks the logits).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.fixtures.tiny_gemma4 import ANSWER, QUESTION
from tests.fixtures.net import free_port
from tests.test_serving_cli import _stop, _wait_health

pytest.importorskip("jax")
REPO = Path(__file__).resolve().parents[1]


def _env(jax_cache: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
            "G5G_JAX_CACHE_DIR": str(jax_cache), "G5G_JAX_BUCKETS": "32,64,256",
            "G5G_JAX_SLOTS": "4"}


@pytest.fixture(scope="module")
def servers(tiny_gemma4, tmp_path_factory):
    """{runtime: base URL} for `build.py serve --runtime jax` and `--runtime pytorch` on the fixture."""
    env = _env(tmp_path_factory.mktemp("jaxcache"))
    procs, urls = {}, {}
    try:
        for runtime in ("jax", "pytorch"):
            port = free_port()
            procs[runtime] = subprocess.Popen(
                [sys.executable, "build.py", "serve", "--runtime", runtime, "--model", str(tiny_gemma4),
                 "--port", str(port), "--served-model-name", "tiny"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            urls[runtime] = f"http://127.0.0.1:{port}"
        for runtime, url in urls.items():
            _wait_health(procs[runtime], url, timeout=600)
        yield urls
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                _stop(proc)


def _chat(url: str, **kw) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], **kw}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_jax_server_gives_the_fixture_answer_like_pytorch(servers):
    jax_reply, torch_reply = _chat(servers["jax"]), _chat(servers["pytorch"])
    assert jax_reply["choices"][0]["message"]["content"] == ANSWER
    assert torch_reply["choices"][0]["message"]["content"] == ANSWER
    assert jax_reply["usage"] == torch_reply["usage"]
    assert jax_reply["choices"][0]["finish_reason"] == torch_reply["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible_on_both_runtimes(servers):
    """Each runtime samples on its device with its own generator: the same seed twice gives the same text."""
    kw = dict(temperature=2.0, top_p=0.95, max_tokens=24)
    for rt, url in servers.items():
        texts = {seed: _chat(url, seed=seed, **kw)["choices"][0]["message"]["content"] for seed in (1, 2, 3)}
        assert texts == {seed: _chat(url, seed=seed, **kw)["choices"][0]["message"]["content"] for seed in texts}
        # the requests really sampled (fixed seeds: deterministic): not every one stayed on the greedy answer
        assert any(not ANSWER.startswith(t) for t in texts.values()), (rt, texts)


def test_concurrent_requests_are_batched_and_each_gets_its_answer(servers):
    """Eight clients at once on the JAX server (slots: 4): each gets the answer it gets alone."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda n: _chat(servers["jax"], max_tokens=n), [200, 5, 200, 9, 200, 30, 200, 12]))
    for n, r in zip([200, 5, 200, 9, 200, 30, 200, 12], replies):
        text = r["choices"][0]["message"]["content"]
        assert text == ANSWER if n == 200 else (ANSWER.startswith(text) and r["usage"]["completion_tokens"] == n)
    m = requests.get(f"{servers['jax']}/metrics", timeout=10).text
    assert "vllm:num_requests_running{model_name=\"tiny\"} 0.0" in m


def test_models_card_reports_the_jax_ladder_top(servers):
    card = requests.get(f"{servers['jax']}/v1/models", timeout=10).json()["data"][0]
    assert card["max_model_len"] == 256


def test_max_model_len_caps_the_jax_ladder(tiny_gemma4, tmp_path):
    env = _env(tmp_path / "jaxcache")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--runtime", "jax", "--model", str(tiny_gemma4),
                             "--port", str(port), "--max-model-len", "100"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(proc, url, timeout=600)
        assert requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"] == 100
    finally:
        _stop(proc)
