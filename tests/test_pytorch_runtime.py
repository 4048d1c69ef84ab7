"""The PyTorch runtime's continuous batching (G5G_TORCH_SLOTS > 1): SlotKV, our cache with a row per sequence,
against transformers' StaticCache that the one-slot engine uses. (Batched requests against each run alone, with
every sampling parameter: tests/test_sampling_params.py.)"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from serving.engine import SamplingParams
from devtools.server import serving, serving_env
from devtools.tiny_gemma4 import ANSWER, QUESTION
from tests.fixtures.batching import decode_alone

GREEDY = SamplingParams(temperature=0.0)
SLOTS = 4
CONTEXT = 128


@pytest.fixture(scope="module")
def engines(tiny_gemma4):
    """(one-slot StaticCache engine, SLOTS-slot SlotKV engine) over the fixture."""
    import torch
    from serving.torch_runtime import load
    yield load(tiny_gemma4, max_context=CONTEXT), load(tiny_gemma4, max_context=CONTEXT, slots=SLOTS)


def _prompt(engine, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, engine.vocab_size, n).tolist()


def test_slot_cache_gives_the_static_cache_logits(engines):
    """Past the sliding window (16 in the fixture) and in a slot other than 0: the same logits as StaticCache."""
    one, many = engines
    for n, slot in [(3, 0), (20, 3), (40, 1)]:
        prompt = _prompt(one, n, seed=n)
        ref, ref_logits = decode_alone(one, prompt, GREEDY, 30)
        got, got_logits = decode_alone(many, prompt, GREEDY, 30, slot=slot)
        assert got == ref
        np.testing.assert_allclose(got_logits, ref_logits, atol=1e-4)


def test_slots_setting_is_a_positive_integer():
    from serving.torch_runtime.engine import slots_from_env
    assert slots_from_env({}) == 2 and slots_from_env({"G5G_TORCH_SLOTS": "8"}) == 8
    # the measured default: continuous batching on a GPU, one slot on a CPU; the variable wins on both
    assert slots_from_env({}, "cuda") == 8 and slots_from_env({}, "cpu") == 2
    assert slots_from_env({"G5G_TORCH_SLOTS": "1"}, "cuda") == 1
    for bad in ("0", "-2", "four"):
        with pytest.raises(ValueError, match=f"G5G_TORCH_SLOTS: '{bad}' is not a positive integer"):
            slots_from_env({"G5G_TORCH_SLOTS": bad})


def test_server_with_slots_answers_concurrent_clients(tiny_gemma4):
    """`python -m serving --runtime pytorch` with G5G_TORCH_SLOTS=4: eight clients at once, each its answer."""
    lengths = [200, 5, 200, 9, 200, 30, 200, 12]
    with serving("pytorch", tiny_gemma4, "--served-model-name", "tiny",
                 env=serving_env(G5G_TORCH_SLOTS=str(SLOTS))) as srv:
        def chat(n):
            body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": n}
            return requests.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)

        with ThreadPoolExecutor(len(lengths)) as pool:
            replies = list(pool.map(chat, lengths))
    for n, r in zip(lengths, replies):
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert text == ANSWER if n == 200 else (ANSWER.startswith(text) and r.json()["usage"]["completion_tokens"] == n)


def test_server_serves_a_context_that_is_no_power_of_two_to_its_end(tiny_gemma4):
    """`--max-model-len 100` on two slots: requests that fill the context to its last token (a decode step's span
    capped at 100, not the 128 above it), one beside the other, each to a length finish at exactly 100 tokens."""
    with serving("pytorch", tiny_gemma4, "--served-model-name", "tiny", "--max-model-len", "100",
                 env=serving_env(G5G_TORCH_SLOTS="2")) as srv:
        def fill(n):
            body = {"model": "tiny", "prompt": list(range(3, 3 + n)), "max_tokens": 100 - n, "temperature": 0,
                    "ignore_eos": True}
            return requests.post(f"{srv.url}/v1/completions", json=body, timeout=300)

        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(fill, (10, 70)))
    for r in replies:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["total_tokens"] == 100


def test_int8_lm_head_keeps_the_embedding_and_tracks_the_fp16_logits(engines, tiny_gemma4, monkeypatch):
    """G5G_LM_HEAD=int8: the head becomes an int8 PackedLinear (the tied embedding, which the gather reads, stays
    16-bit) and a greedy decode's logits stay within int8 rounding of the fp16 head's; a bad value is one line."""
    import torch
    from serving.torch_runtime import packed_matmul
    from serving.torch_runtime.engine import lm_head_from_env, load

    monkeypatch.setenv("G5G_LM_HEAD", "int8")
    q = load(tiny_gemma4, max_context=CONTEXT)
    assert isinstance(q.model.lm_head, packed_matmul.PackedLinear) and q.model.lm_head.bits == 8
    assert q.model.model.embed_tokens.weight.dtype == torch.float32          # CPU dtype; not replaced
    prompt = _prompt(q, 12, 3)
    _, want = decode_alone(engines[0], prompt, GREEDY, 4)
    _, got = decode_alone(q, prompt, GREEDY, 4)
    assert np.abs(got[0] - want[0]).max() < 0.02 * np.abs(want[0]).max()
    with pytest.raises(ValueError, match="G5G_LM_HEAD: 'int4' is not one of fp16, int8"):
        lm_head_from_env({"G5G_LM_HEAD": "int4"})


def test_compile_cache_survives_a_restart_where_asked(tmp_path):
    """G5G_TORCH_CACHE_DIR names inductor's cache (default under ~/.cache: the image mounts a volume there); empty
    leaves torch's temporary one; an explicit TORCHINDUCTOR_CACHE_DIR wins."""
    from pathlib import Path

    from serving.torch_runtime.engine import inductor_env
    assert inductor_env({}) == {"TORCHINDUCTOR_CACHE_DIR": str(Path("~/.cache/g5g-torch").expanduser())}
    assert inductor_env({"G5G_TORCH_CACHE_DIR": str(tmp_path)}) == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    assert inductor_env({"G5G_TORCH_CACHE_DIR": ""}) == {}
    assert inductor_env({"G5G_TORCH_CACHE_DIR": "/x", "TORCHINDUCTOR_CACHE_DIR": "/y"}) == {}
