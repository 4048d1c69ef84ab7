"""serving/torch_runtime/attention.py: the PyTorch runtime's attention over SlotKV, against transformers' eager attention
(the reference implementation, K/V expanded per query head) and a full recompute of every sequence."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from serving.torch_runtime import attention  # noqa: E402
from serving.engine import SamplingParams  # noqa: E402
from tests.fixtures.tolerances import F32_MODEL_REORDERED, F32_OP_REORDERED  # noqa: E402

CONTEXT = 128


def _eager(query, key, value, mask):
    from transformers.models.gemma4.modeling_gemma4 import eager_attention_forward

    module = SimpleNamespace(num_key_value_groups=query.shape[1] // key.shape[1], training=False)
    additive = torch.zeros(mask.shape).masked_fill(~mask, -torch.inf)
    return eager_attention_forward(module, query, key, value, additive, scaling=1.0)[0]


@pytest.mark.parametrize("heads,kv_heads,queries", [(4, 1, 1), (8, 2, 1), (4, 1, 7), (6, 3, 5)])
def test_folded_groups_are_eager_attention(monkeypatch, heads, kv_heads, queries):
    """Query heads folded into the query axis (in chunks of queries) give what eager attention gives over K/V
    repeated per head, under any mask that leaves each query a key."""
    monkeypatch.setattr(attention, "QUERY_CHUNK", 3)
    g = torch.Generator().manual_seed(heads * queries)
    rows, keys, dim = 3, 21, 16
    q = torch.randn(rows, queries, heads, dim, generator=g).transpose(1, 2)     # as the model lays it out
    k, v = (torch.randn(rows, kv_heads, keys, dim, generator=g) for _ in range(2))
    mask = torch.rand(rows, 1, queries, keys, generator=g) < 0.6
    mask[..., 0] = True
    got, _ = attention.attend(None, q, k, v, mask, scaling=1.0)
    torch.testing.assert_close(got, _eager(q, k, v, mask), **F32_OP_REORDERED)


@pytest.fixture(scope="module")
def engines(tiny_gemma4):
    """(a 4-slot engine, the fixture's model with transformers' eager attention and no cache)."""
    from serving.torch_runtime import load
    reference = load(tiny_gemma4, max_context=CONTEXT).model
    reference.set_attn_implementation("eager")
    yield load(tiny_gemma4, max_context=CONTEXT, slots=4), reference


def test_concurrent_sequences_are_their_eager_recompute(engines):
    """Three sequences that join at different steps, past the sliding window (16: the rings wrap), each decoded
    beside the others: every step's logits are those of eager attention over the whole sequence, recomputed."""
    engine, reference = engines
    rng = np.random.default_rng(5)
    prompts = {0: rng.integers(0, 512, 3).tolist(), 2: rng.integers(0, 512, 20).tolist(),
               3: rng.integers(0, 512, 40).tolist()}
    joins = {0: 0, 2: 4, 3: 9}
    seqs, live = {}, {}

    def check(slot, token):
        want = reference(input_ids=torch.tensor([seqs[slot]]), use_cache=False).logits[0, -1].float()
        np.testing.assert_allclose(engine.logits(slot), want.detach().numpy(), atol=F32_MODEL_REORDERED)
        assert token == int(want.argmax())
        seqs[slot].append(token)
        live[slot] = token

    for step in range(36):
        if step == 20:                                   # slot 0 leaves; its row is free from now on
            del live[0], seqs[0]
        if step:
            for slot, token in engine.step(live).items():
                check(slot, token)
        for slot, at in joins.items():
            if step == at:
                seqs[slot] = list(prompts[slot])
                check(slot, engine.start(slot, prompts[slot], SamplingParams(temperature=0.0)))
    assert len(seqs[3]) > 64 and len(seqs[2]) > 16       # full layers past a span of 64, sliding past the window


def test_a_decode_step_reads_the_cache_where_it_lies(engines, monkeypatch):
    """No expanded copy: transformers' repeat_kv is never called, every K/V that a decode step's GEMMs read is a view of SlotKV's
    own buffers, and sliding layers hold only their window."""
    import transformers.integrations.sdpa_attention as hf_sdpa
    import transformers.models.gemma4.modeling_gemma4 as hf_gemma4

    engine, _ = engines
    kv = engine._kv
    for i, ring in kv.ring.items():
        assert kv.k[i].shape[2] == (kv.window if ring else CONTEXT + attention.PAD)   # PAD: never a whole-buffer span
    assert kv.window == 16 and any(kv.ring.values())
    buffers = {t.untyped_storage().data_ptr() for t in (*kv.k.values(), *kv.v.values())}
    read = []
    one_query = attention.one_query

    def spy(q, k, v, mask, scaling):
        read.append((k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr(), k.shape[1], q.shape[1]))
        return one_query(q, k, v, mask, scaling)

    def no_copies(*_):
        raise AssertionError("repeat_kv")

    monkeypatch.setattr(hf_sdpa, "repeat_kv", no_copies)
    monkeypatch.setattr(hf_gemma4, "repeat_kv", no_copies)
    monkeypatch.setattr(attention, "one_query", spy)
    token = engine.start(1, [5, 6, 7], SamplingParams(temperature=0.0))
    read.clear()
    engine.step({1: token})
    layers = len(engine.model.model.layers)
    assert len(read) == layers * (1 + engine.pipeline)      # G5G_TORCH_PIPELINE=1: the step ahead reads alike
    assert all(k in buffers and v in buffers and kv_heads == q_heads for k, v, kv_heads, q_heads in read)


@pytest.mark.slow
def test_one_compiled_decode_serves_every_span(engines):
    """The span of keys a decode step reads grows with the sequence (64, 128, ...): it reaches the compiled step as a
    mask length marked dynamic, so growing past a power of two replays the graph, never compiles another (goal:
    no per-shape recompiles after the warm-up)."""
    from torch._dynamo.testing import CompileCounter

    engine, reference = engines
    torch._dynamo.reset()
    counter = CompileCounter()
    engine._decode, engine._decode_checked = torch.compile(engine.model.__call__, backend=counter), True
    try:
        prompt = np.random.default_rng(9).integers(0, 512, 60).tolist()
        seq = prompt + [engine.start(2, prompt, SamplingParams(temperature=0.0))]
        seq.append(engine.step({2: seq[-1]})[2])
        compiled = counter.frame_count
        assert compiled >= 1
        while len(seq) < 72:                              # positions 61 .. 70: spans 64, then 128
            seq.append(engine.step({2: seq[-1]})[2])
        assert counter.frame_count == compiled
        want = reference(input_ids=torch.tensor([seq[:-1]]), use_cache=False).logits[0, -1]
        assert seq[-1] == int(want.argmax())
    finally:
        engine._decode = engine.model.__call__
        torch._dynamo.reset()
