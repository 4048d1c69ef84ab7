"""Prompts padded to a length bucket (serving/torch_runtime/prefill.py: what each CUDA graph replays) give the
unpadded prompt's tokens and logits, here on the CPU with the padded forward called eagerly; the graphs themselves
are the GPU suite's (tests/test_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest

from serving.engine import SamplingParams
from serving.torch_runtime import prefill
from tests.fixtures.batching import decode_alone

GREEDY = SamplingParams(temperature=0.0)
CONTEXT = 128


def test_buckets_double_from_64_with_half_steps_then_quarter_steps_to_the_context():
    assert prefill.buckets(4096) == (64, 96, 128, 192, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048,
                                     2560, 3072, 3584, 4096)
    assert prefill.buckets(1024) == (64, 96, 128, 192, 256, 384, 512, 640, 768, 896, 1024)
    assert prefill.buckets(1000) == (64, 96, 128, 192, 256, 384, 512, 640, 768, 896, 1000)
    assert prefill.buckets(700) == (64, 96, 128, 192, 256, 384, 512, 640, 700)
    assert prefill.buckets(64) == (64,)
    assert prefill.buckets(90) == (64, 90)
    assert prefill.bucket_of(65, prefill.buckets(1000)) == 96
    assert prefill.bucket_of(526, prefill.buckets(4096)) == 640
    assert prefill.bucket_of(1000, prefill.buckets(1000)) == 1000
    assert prefill.bucket_of(1001, prefill.buckets(1000)) is None


def test_graphs_are_the_default_on_cuda_with_slots_and_the_setting_is_checked():
    on = {"G5G_TORCH_PREFILL_GRAPHS": "1"}
    assert prefill.graphs_from_env(on, "cuda", 8)
    assert prefill.graphs_from_env({}, "cuda", 8)              # measured on an H100 (2026-12-07): the default
    assert not prefill.graphs_from_env({}, "cpu", 8)
    assert not prefill.graphs_from_env(on, "cpu", 8)
    assert not prefill.graphs_from_env(on, "cuda", 1)          # StaticCache: one sequence, prompts eager
    assert not prefill.graphs_from_env({"G5G_TORCH_PREFILL_GRAPHS": "0"}, "cuda", 8)
    with pytest.raises(ValueError, match="G5G_TORCH_PREFILL_GRAPHS"):
        prefill.graphs_from_env({"G5G_TORCH_PREFILL_GRAPHS": "yes"}, "cuda", 8)


@pytest.fixture(scope="module")
def engines(tiny_gemma4):
    from serving.torch_runtime import load
    yield load(tiny_gemma4, max_context=CONTEXT), load(tiny_gemma4, max_context=CONTEXT, slots=4)


@pytest.mark.parametrize("n, slot", [(3, 0), (20, 3), (40, 1), (64, 2), (100, 1)])
def test_a_padded_prompt_gives_the_unpadded_tokens_and_logits(engines, monkeypatch, n, slot):
    """Past the fixture's sliding window (16), where the padding (random ids) would overwrite the prompt's ring
    entries if it were written there, and into slots other than 0: the StaticCache engine's tokens and logits."""
    import torch

    one, many = engines
    rng = np.random.default_rng(n)
    prompt = rng.integers(0, one.vocab_size, n).tolist()
    ref, ref_logits = decode_alone(one, prompt, GREEDY, 24)
    length = prefill.bucket_of(n, prefill.buckets(CONTEXT))
    padded = []

    def prompt_padded(s, ids):
        x = torch.tensor([list(ids) + rng.integers(0, one.vocab_size, length - len(ids)).tolist()])
        padded.append(x.shape[1])
        return many._padded_prompt(x, torch.tensor([s]), torch.tensor([len(ids)]))

    monkeypatch.setattr(many, "_prompt", prompt_padded)
    got, got_logits = decode_alone(many, prompt, GREEDY, 24, slot=slot)
    assert padded == [length] and (length > n or n == 64)
    assert got == ref
    np.testing.assert_allclose(got_logits, ref_logits, atol=1e-4)


def test_fused_norms_are_opt_in_and_the_setting_is_checked():
    from serving.torch_runtime import norms

    assert not norms.from_env({}) and not norms.from_env({"G5G_TORCH_FUSED_NORMS": "0"})
    assert norms.from_env({"G5G_TORCH_FUSED_NORMS": "1"})
    with pytest.raises(ValueError, match="G5G_TORCH_FUSED_NORMS"):
        norms.from_env({"G5G_TORCH_FUSED_NORMS": "yes"})


def test_the_graphs_forward_with_fused_norms_gives_the_same_logits_then_puts_transformers_norms_back(
        engines, monkeypatch):
    """G5G_TORCH_FUSED_NORMS=1: the forward the prompt graphs capture runs every Gemma4RMSNorm as torch.rms_norm
    (one kernel on CUDA), with the logits of transformers' own norms; after it, the model's norms are transformers'
    again (the compiled decode step traces those)."""
    import torch

    from serving.torch_runtime import norms

    _, many = engines
    ids, slot, n = torch.tensor([list(range(5, 45)) + [0] * 24]), torch.tensor([1]), torch.tensor([40])
    plain = many._graph_prompt(ids, slot, n)
    calls = []
    real = torch.rms_norm
    monkeypatch.setattr(norms.torch, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(many, "fused_norms", True)
    fused = many._graph_prompt(ids, slot, n)
    modules = [m for m in many.model.modules() if type(m).__name__ == norms.NORM_CLASS]
    assert modules and len(calls) >= len(modules)      # every norm ran fused (some run once a layer, some more)
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
    assert all("forward" not in vars(m) for m in modules)
    calls.clear()
    monkeypatch.setattr(many, "fused_norms", False)
    torch.testing.assert_close(many._graph_prompt(ids, slot, n), plain)
    assert not calls
