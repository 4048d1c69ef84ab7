"""The JAX runtime behind the shared API layer, as `build.py serve --runtime jax` runs it, against the PyTorch one.

Both servers run as their own processes on loopback and serve the trained tiny Gemma 4 fixture; the same requests
must produce the same text (greedy and seeded sampling: the sampler is shared, so this checks the logits).
"""
from __future__ import annotations

import re

import pytest
import requests

from devtools.tiny_gemma4 import ANSWER, QUESTION
from devtools.server import serving, serving_env

pytest.importorskip("jax")


@pytest.fixture()
def servers(runtime_servers):
    """{runtime: base URL}: `python -m serving --runtime jax` and `--runtime pytorch` on the fixture (shared)."""
    return runtime_servers


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


def test_max_model_len_caps_the_jax_ladder_and_the_gpu_xla_defaults_apply(tiny_gemma4, tmp_path):
    """One boot, four checks: --max-model-len tops the ladder, requests fill that context (100: no power of two)
    to its last token, and `python -m serving` with no XLA_FLAGS runs with the measured winner's flags (on a CPU they
    change nothing; on a GPU they make the step CUDA graphs), and the log names each boot phase."""
    from serving.jax_runtime.xla import with_default_xla_flags

    env = serving_env(tmp_path / "jaxcache", G5G_JAX_SLOTS="4")
    env.pop("XLA_FLAGS", None)
    env.pop("G5G_JAX_XLA_DEFAULTS", None)
    with serving("jax", tiny_gemma4, "--max-model-len", "100", env=env, timeout=600) as srv:
        card = requests.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]
        assert card["max_model_len"] == 100
        for n in (10, 70):        # requests that fill the context (no power of two) to its last token
            body = {"model": card["id"], "prompt": list(range(3, 3 + n)), "max_tokens": 100 - n, "temperature": 0,
                    "ignore_eos": True}
            r = requests.post(f"{srv.url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["total_tokens"] == 100
    assert "XLA_FLAGS " + with_default_xla_flags("") in srv.output
    assert "CONDITIONAL,WHILE" in with_default_xla_flags("")
    # each boot phase in the log with its seconds: load, the ladder (a fresh cache: all compiled), warm-up
    for phase in (r"jax boot: load [\d.]+s", r"jax boot: compile [\d.]+s for 6 executables: 0 from the executable "
                  r"store .* 6 compiled by XLA and 0 loaded", r"jax boot: weights ", r"boot: warm-up [\d.]+s"):
        assert re.search(phase, srv.output), phase
