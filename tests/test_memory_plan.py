"""serving/memory_plan.py (`build.py fits`): hand-computed E2B figures (docs/FACTS.md) and a real checkpoint."""
from __future__ import annotations

import json

import pytest

from g5g import cli
from serving import memory_plan as mp

E2B = mp.SHAPES["e2b"]


def _e2b_hand() -> dict:
    """Parameter counts of E2B's text model, written out: 35 layers, full every 5th, layers 15-34 KV-shared
    (no k/v, MLP 12 288 wide), per-layer embeddings of 256 per layer."""
    d, full = 1536, {4, 9, 14, 19, 24, 29, 34}
    linear = 0
    for i in range(35):
        hd = 512 if i in full else 256
        linear += 2 * d * 8 * hd                              # q, o
        linear += 2 * d * hd if i < 15 else 0                 # k, v (one KV head)
        linear += 3 * d * (6144 if i < 15 else 12288)         # gate, up, down
        linear += 2 * d * 256                                 # per_layer_input_gate, per_layer_projection
    return {"linear": linear, "ple_proj": d * 35 * 256, "embed": 262144 * d, "ple": 262144 * 35 * 256}


def test_e2b_kv_and_bytes_per_token_match_hand_figures():
    # KV: 3 full layers x K,V x 512 x fp16 + 12 sliding x K,V x 256 x fp16 = 18 KiB (FACTS: ~18 KiB/token)
    assert mp.kv_bytes_per_token(E2B) == 3 * 2 * 512 * 2 + 12 * 2 * 256 * 2 == 18432
    h = _e2b_hand()
    p = mp.plan(E2B, "fp16", 4096, 1)
    assert p.streamed_per_token == 2 * (h["linear"] + h["ple_proj"] + h["embed"])
    assert round(p.streamed_per_token / 1e9, 2) == 4.56                 # FACTS: 4.56 GB streamed per token
    norms = p.weights - 2 * sum(h.values())
    assert 0 < norms < 1 << 20                                          # the rest is norms and scalars
    # FACTS' 9.5 GiB is the whole checkpoint; the text model alone is 8.6 GiB (towers ~0.9 GiB)
    assert 8.6 < p.weights / 2**30 < 8.65


def test_schemes_pack_the_layers_and_keep_embeddings():
    h = _e2b_hand()
    fp16, w8, w4 = (mp.plan(E2B, s, 4096, 1) for s in ("fp16", "w8a16", "w4a16"))
    rows = w8.weights - fp16.weights + h["linear"]                      # int8: one fp16 scale per output row
    assert 0 < rows / 2 < h["linear"] / 1536
    assert w4.weights == fp16.weights - 2 * h["linear"] + h["linear"] // 2 + 2 * h["linear"] // 32
    # the tied LM head (0.81 GB) stays fp16: 43% of what a w4a16 decode step streams
    assert round(2 * h["embed"] / w4.streamed_per_token, 2) == 0.43


def test_fits_at_the_t4g_limit():
    fits = mp.plan(E2B, "fp16", 32768, 8)
    assert fits.fits and fits.total == fits.weights + 8 * 32768 * 18432 + (1024 << 20)
    assert not mp.plan(E2B, "fp16", 131072, 8).fits


def test_config_tensors_are_the_checkpoints(tiny_gemma4):
    """The plan's tensor list from config.json is exactly the text tensors transformers saved."""
    raw = json.loads((tiny_gemma4 / "config.json").read_text())
    text, towers = mp.checkpoint_tensors(tiny_gemma4)
    assert mp.text_tensors(raw) == text and towers > 0


def test_cli_fits_exit_status_and_breakdown(capsys, tiny_gemma4):
    assert cli.main(["fits", "--shape", "e2b", "--scheme", "w4a16", "--max-model-len", "32768", "--slots", "8"]) == 0
    out = capsys.readouterr().out
    assert "KV cache" in out and "4608.0 MiB" in out and "fits" in out
    assert cli.main(["fits", "--shape", "e2b", "--max-model-len", "131072", "--slots", "8"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert cli.main(["fits", "--model", str(tiny_gemma4), "--max-model-len", "64"]) == 0
    assert cli.main(["fits", "--model", "/nonexistent", "--max-model-len", "64"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_refusal_is_one_line_when_the_plan_does_not_fit(tiny_gemma4):
    """What the PyTorch server raises at startup on a GPU (serving/torch_runtime/engine.load): weights + KV + overhead
    against the device's memory."""
    need = mp.plan_checkpoint(tiny_gemma4, None, 64, 1, text_only=True).total
    assert mp.refusal(tiny_gemma4, 64, 1, need + mp.MIB) is None        # whole MiB: floored
    line = mp.refusal(tiny_gemma4, 64, 1, need - mp.MIB)
    assert "does not fit" in line and "--max-model-len 64" in line and "\n" not in line
    assert mp.refusal(tiny_gemma4.parent / "nonexistent", 64, 1, 1) is None   # loading reports that


def test_our_runtimes_plan_the_packed_weights_without_towers(tiny_gemma4):
    vllm = mp.plan_checkpoint(tiny_gemma4, "w4a16", 64, 1)
    torch_rt = mp.plan_checkpoint(tiny_gemma4, "w4a16", 64, 1, text_only=True)
    assert vllm.towers > 0 and torch_rt.towers == 0
    assert torch_rt.weights == vllm.weights < mp.plan_checkpoint(tiny_gemma4, "fp16", 64, 1).weights


def test_the_jax_server_refuses_on_its_gpu_pool_before_reading_weights(tiny_gemma4, monkeypatch):
    """JAX's plan keeps sliding layers as rings of their window (as its cache does), and its load refuses before any
    weight is read when weights + KV + overhead exceed the GPU pool it may use (the device query is the seam:
    no GPU here)."""
    from serving.jax_runtime import Settings, checkpoint, engine

    rings = mp.plan_checkpoint(tiny_gemma4, None, 4096, 4, text_only=True, rings=True)
    full = mp.plan_checkpoint(tiny_gemma4, None, 4096, 4, text_only=True)
    assert rings.kv == 4 * 4096 * rings.kv_per_token_sliding < full.kv
    monkeypatch.setattr(engine, "_gpu_memory", lambda: rings.total - mp.MIB)
    monkeypatch.setattr(checkpoint, "load_params", lambda *a: pytest.fail("weights read before the refusal"))
    with pytest.raises(ValueError, match="does not fit this GPU at --max-model-len 4096 with 4 slot"):
        engine.load(tiny_gemma4, Settings(buckets=(64, 4096), cache_dir=None, slots=4))


def test_fits_holds_at_exact_equality_and_not_a_byte_over():
    import dataclasses
    p = mp.plan(E2B, "fp16", 4096, 1)
    assert dataclasses.replace(p, gpu=p.total).fits
    assert not dataclasses.replace(p, gpu=p.total - 1).fits


def test_sliding_layers_hold_only_their_window():
    """E2B: 3 full layers at full length, 12 sliding ones capped at their 512-token window."""
    full, sliding = 3 * 2 * 512 * 2, 12 * 2 * 256 * 2
    assert mp.kv_bytes_per_token(E2B, 4096) == full + round(sliding * 512 / 4096)
    assert mp.kv_bytes_per_token(E2B, 256) == full + sliding          # shorter than the window: all of it
    rings, flat = mp.plan(E2B, "fp16", 4096, 2, rings=True), mp.plan(E2B, "fp16", 4096, 2)
    assert rings.kv == 2 * 4096 * (full + sliding // 8) and flat.kv == 2 * 4096 * (full + sliding)


def test_int8_lm_head_streams_half_the_head_and_keeps_the_embedding():
    """G5G_LM_HEAD=int8: the tied embedding stays 16-bit (the gather), the head read per token is an int8 copy with a
    scale per vocabulary row: E2B w4a16 streams 1.48 GB instead of 1.88 (FACTS' 187 tok/s ceiling at 277 GB/s)."""
    h = _e2b_hand()
    int8 = 262144 * 1536 + 2 * 262144
    for scheme in ("fp16", "w8a16", "w4a16"):
        fp16, q = mp.plan(E2B, scheme, 4096, 1), mp.plan(E2B, scheme, 4096, 1, lm_head="int8")
        assert q.streamed_per_token == fp16.streamed_per_token - 2 * h["embed"] + int8
        assert q.weights == fp16.weights + int8                         # the copy is resident beside the table
    assert round(mp.plan(E2B, "w4a16", 4096, 1, lm_head="int8").streamed_per_token / 1e9, 2) == 1.48
    with pytest.raises(ValueError, match="LM head 'int4' is not one of fp16, int8"):
        mp.plan(E2B, "w4a16", 4096, 1, lm_head="int4")


def test_cli_fits_counts_the_int8_head(capsys, tiny_gemma4):
    assert cli.main(["fits", "--shape", "e2b", "--scheme", "w4a16", "--lm-head", "int8",
                     "--max-model-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "w4a16, int8 LM head" in out and "1.479 GB" in out
    need = mp.plan_checkpoint(tiny_gemma4, None, 64, 1, text_only=True, lm_head="int8").total
    assert need > mp.plan_checkpoint(tiny_gemma4, None, 64, 1, text_only=True).total
    assert mp.refusal(tiny_gemma4, 64, 1, need - mp.MIB, lm_head="int8") is not None


def test_the_jax_plan_counts_what_autotuning_holds_at_boot(tiny_gemma4, monkeypatch):
    """XLA autotunes each dot at boot on fresh copies of its operands: the JAX plan holds the largest one, the 16-bit
    LM head (tied: the embedding) and its [slots, vocab] float32 logits, once (the ladder compiles one executable
    per head shape alone first). A pool that fits weights + KV + overhead but not that is refused, in one line."""
    from serving.jax_runtime import Settings, checkpoint, engine

    raw = json.loads((tiny_gemma4 / "config.json").read_text())
    text = mp.text_section(raw)
    slots = 600                          # the tiny model's head is small: enough logits rows to weigh over a MiB
    tuned = mp.plan_checkpoint(tiny_gemma4, None, 64, slots, text_only=True, rings=True, autotuned=True)
    untuned = mp.plan_checkpoint(tiny_gemma4, None, 64, slots, text_only=True, rings=True)
    assert tuned.tuning == 2 * text["vocab_size"] * text["hidden_size"] + 4 * slots * text["vocab_size"] > mp.MIB
    assert tuned.total == untuned.total + tuned.tuning and untuned.tuning == 0
    assert mp.plan(mp.SHAPES["e4b"], "fp16", 1024, 8, rings=True, autotuned=True).tuning > 1024 * mp.MIB

    pool = -(-untuned.total // mp.MIB) * mp.MIB                   # fits weights + KV + overhead, not boot's tuning
    monkeypatch.setattr(engine, "_gpu_memory", lambda: pool)
    monkeypatch.setattr(checkpoint, "load_params", lambda *a: pytest.fail("weights read before the refusal"))
    with pytest.raises(ValueError) as refused:
        engine.load(tiny_gemma4, Settings(buckets=(64,), cache_dir=None, slots=slots))
    assert "GEMM autotuning at boot" in str(refused.value) and "\n" not in str(refused.value)


def test_the_pytorch_plan_counts_what_its_cache_attention_and_sampler_hold(tiny_gemma4):
    """The PyTorch server's refusal plans sliding layers as rings (SlotKV holds only their window) and counts its
    attention and sampler: the cache and the sampler's state are exactly what a loaded engine allocates (float32 on
    a CPU, twice the plan's fp16), and a prompt chunk's scores are counted at the chunk the attention uses."""
    torch = pytest.importorskip("torch")
    from serving.torch_runtime import attention
    from serving.torch_runtime import load

    slots, context = 4, 128
    engine = load(tiny_gemma4, max_context=context, slots=slots)
    plan = mp.plan_checkpoint(tiny_gemma4, None, context, slots, text_only=True, rings=True, attention=True)
    assert engine._kv.nbytes() == 2 * plan.kv < 2 * mp.plan_checkpoint(tiny_gemma4, None, context, slots).kv
    s = engine.sampler
    state = sum(t.numel() * t.element_size() for t in (s.bias, s.counts, s.held, s.seen))
    assert state == slots * engine.vocab_size * mp.SAMPLER_STATE_BYTES
    raw = json.loads((tiny_gemma4 / "config.json").read_text())
    heads = raw["text_config"]["num_attention_heads"]
    assert attention.QUERY_CHUNK == mp.ATTENTION_QUERY_CHUNK
    assert plan.attention == (heads * min(mp.ATTENTION_QUERY_CHUNK, context) * context * mp.PREFILL_BYTES_PER_SCORE
                              + slots * engine.vocab_size * (mp.SAMPLER_STATE_BYTES + mp.SAMPLER_STEP_BYTES))
    assert plan.total == plan.weights + plan.kv + plan.attention + plan.overhead
    assert any(line.startswith("attention + sampling") for line in plan.lines())
    assert torch.float32 == engine.model.dtype
