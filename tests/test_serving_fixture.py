"""The tiny Gemma 4 checkpoint keeps the features of the real one that runtimes must get right."""
from __future__ import annotations

import json

from safetensors import safe_open

from devtools import tiny_gemma4 as fx


def test_config_is_the_multimodal_layout_with_gemma4_text_features(tiny_gemma4):
    config = json.loads((tiny_gemma4 / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"] and config["model_type"] == "gemma4"
    assert {"text_config", "vision_config", "audio_config"} <= set(config)
    text = config["text_config"]
    assert text["model_type"] == "gemma4_text"
    assert (text["head_dim"], text["global_head_dim"]) == (32, 64) and "per_layer_config" not in text
    assert {"sliding_attention", "full_attention"} == set(text["layer_types"]) and text["layer_types"][-1] == "full_attention"
    assert text["num_kv_shared_layers"] == 2 and text["use_double_wide_mlp"] is True
    assert text["hidden_size_per_layer_input"] > 0 and text["final_logit_softcapping"] == 30.0
    assert text["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25
    assert text["tie_word_embeddings"] is True and text["eos_token_id"] == [1, 106]
    assert json.loads((tiny_gemma4 / "generation_config.json").read_text())["eos_token_id"] == [1, 106]


def test_weights_are_bfloat16_under_the_real_key_names(tiny_gemma4):
    text = json.loads((tiny_gemma4 / "config.json").read_text())["text_config"]
    with safe_open(tiny_gemma4 / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        lm = "model.language_model."
        assert str(f.get_tensor(lm + "embed_tokens.weight").dtype) == "torch.bfloat16"
        assert "lm_head.weight" not in keys                                 # tied
        shared = range(text["num_hidden_layers"] - text["num_kv_shared_layers"], text["num_hidden_layers"])
        for i, kind in enumerate(text["layer_types"]):
            head = text["global_head_dim"] if kind == "full_attention" else text["head_dim"]
            q = f.get_tensor(f"{lm}layers.{i}.self_attn.q_proj.weight")
            assert tuple(q.shape) == (text["num_attention_heads"] * head, text["hidden_size"])
            assert (f"{lm}layers.{i}.self_attn.k_proj.weight" in keys) == (i not in shared)   # KV-shared layers
            up = f.get_tensor(f"{lm}layers.{i}.mlp.up_proj.weight")
            assert up.shape[0] == text["intermediate_size"] * (2 if i in shared else 1)     # double-wide MLP
        ple = f.get_tensor(lm + "embed_tokens_per_layer.weight")
        assert tuple(ple.shape) == (text["vocab_size_per_layer_input"],
                                    text["num_hidden_layers"] * text["hidden_size_per_layer_input"])
    assert any(k.startswith("model.vision_tower.") for k in keys) and any(k.startswith("model.audio_tower.") for k in keys)


def test_tokenizer_has_gemma4_control_tokens_at_gemma_ids(tiny_gemma4):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_gemma4)
    ids = tok.convert_tokens_to_ids
    assert [ids(t) for t in ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>")] == [0, 1, 2, 105, 106]
    assert all(ids(t) != tok.unk_token_id for t in ("<|think|>", "<|channel>", "<channel|>"))
    assert len(tok) == fx.PARAMS["vocab_size"]


def test_cache_key_follows_every_parameter(monkeypatch):
    key = fx.cache_key()
    monkeypatch.setitem(fx.PARAMS, "seed", fx.PARAMS["seed"] + 1)
    assert fx.cache_key() != key
