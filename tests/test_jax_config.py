"""Per-layer resolution of a Gemma 4 config.json (no jax compile, no checkpoint): head dims, KV sharing, RoPE."""
from __future__ import annotations

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from serving.jax_runtime import config  # noqa: E402

S, F = config.SLIDING, config.FULL
# google/gemma-4-E2B-it's text layout (docs/FACTS.md): 35 layers, every 5th full, the last 20 KV-shared.
E2B_TYPES = [F if (i + 1) % 5 == 0 else S for i in range(35)]


def _e2b_text_config(**over):
    """E2B's structure with tiny widths, as transformers builds it."""
    from transformers import Gemma4TextConfig

    kw = dict(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=35, num_attention_heads=8,
              num_key_value_heads=1, head_dim=4, global_head_dim=8, sliding_window=512, layer_types=E2B_TYPES,
              num_kv_shared_layers=20, hidden_size_per_layer_input=4, use_double_wide_mlp=True,
              final_logit_softcapping=30.0)
    kw.update(over)
    return Gemma4TextConfig(**kw)


def _hub_spelling(saved: dict, global_head_dim: int) -> dict:
    """The released config.json spells the full-layer head dim as global_head_dim, not per_layer_config."""
    text = {k: v for k, v in saved.items() if k != "per_layer_config"}
    return {"model_type": "gemma4", "text_config": dict(text, global_head_dim=global_head_dim)}


def test_kv_sharing_matches_transformers_attention_modules():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextAttention

    tc = _e2b_text_config()
    ours = config.parse({"text_config": tc.to_dict()})
    attn = [Gemma4TextAttention(tc, i) for i in range(35)]
    # transformers: a shared layer reads shared_kv_states[its type], written by the layer with store_full_length_kv
    stores = {a.layer_type: i for i, a in enumerate(attn) if a.store_full_length_kv}
    want = [stores[a.layer_type] if a.is_kv_shared_layer else i for i, a in enumerate(attn)]
    assert [s.kv_source for s in ours.layers] == want
    assert [s.head_dim for s in ours.layers] == [a.head_dim for a in attn]
    # docs/FACTS.md: layers 15-34 reuse the KV of earlier layers (the last sliding one, 13, and the last full one, 14)
    assert stores == {S: 13, F: 14}
    assert all(s.kv_source == i for i, s in enumerate(ours.layers[:15]))
    assert {s.kv_source for s in ours.layers[15:]} == {13, 14}


def test_hub_and_saved_spellings_resolve_identically():
    tc = _e2b_text_config()
    saved = config.parse({"text_config": tc.to_dict()})
    hub = config.parse(_hub_spelling(tc.to_dict(), 8))
    assert saved == hub
    assert [s.head_dim for s in hub.layers] == [8 if t == F else 4 for t in E2B_TYPES]


def test_k_eq_v_full_layers_take_the_global_kv_head_count():
    tc = _e2b_text_config(attention_k_eq_v=True, num_global_key_value_heads=2, num_kv_shared_layers=0)
    for raw in ({"text_config": tc.to_dict()},
                {"text_config": dict(_hub_spelling(tc.to_dict(), 8)["text_config"], num_global_key_value_heads=2)}):
        c = config.parse(raw)
        assert {(s.kind, s.num_kv_heads, s.k_eq_v) for s in c.layers} == {(S, 1, False), (F, 2, True)}


@pytest.mark.parametrize("kind", [S, F])
def test_rope_frequencies_match_transformers(kind):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    tc = _e2b_text_config(head_dim=16, global_head_dim=32)
    want = getattr(Gemma4TextRotaryEmbedding(tc), f"{kind}_inv_freq").numpy()
    c = config.parse({"text_config": tc.to_dict()})
    got = c.inv_freq(kind, 32 if kind == F else 16)
    np.testing.assert_array_equal(got, want)
    if kind == F:  # partial rotary 0.25: a quarter of the angles rotate, the rest stay put
        assert np.count_nonzero(got) == 4


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layer_types"), "missing key 'layer_types'"),
    (lambda t: t.update(layer_types=[S] * 3), "'layer_types' has 3 entries for 35 layers"),
    (lambda t: t.update(enable_moe_block=True), "'enable_moe_block' is true"),
    (lambda t: t.update(hidden_activation="relu"), "'hidden_activation' 'relu'"),
    (lambda t: t["rope_parameters"][F].update(rope_type="yarn"), "'rope_parameters.full_attention.rope_type'"),
])
def test_bad_config_names_file_and_key(edit, message):
    raw = _hub_spelling(_e2b_text_config().to_dict(), 8)
    edit(raw["text_config"])
    with pytest.raises(config.CheckpointError, match=f"^cfg.json text_config: .*{message}"):
        config.parse(raw, "cfg.json")
