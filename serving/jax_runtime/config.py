"""Gemma 4 text configuration, resolved per layer from a checkpoint's config.json (no jax here).

Reads both spellings transformers produces: the Hub's (`global_head_dim`, `num_global_key_value_heads`) and
the one `save_pretrained` writes since 5.15 (`per_layer_config: {"<layer>": {"head_dim": …}}`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class CheckpointError(ValueError):
    """The model directory is not a Gemma 4 checkpoint we can serve; the message names the file and the key."""


SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class LayerSpec:
    kind: str          # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    kv_source: int     # layer whose keys/values this layer attends to (itself unless KV-shared)
    k_eq_v: bool       # values are the (v-normed) key projection: no v_proj

    @property
    def sliding(self) -> bool:
        return self.kind == SLIDING


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    rms_norm_eps: float
    sliding_window: int
    activation: str
    final_logit_softcapping: float | None
    ple_dim: int                  # hidden_size_per_layer_input; 0 = no per-layer embeddings
    ple_vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    layers: tuple[LayerSpec, ...]
    rope: dict                    # layer kind -> {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def inv_freq(self, kind: str, head_dim: int) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2] for a layer kind, float32 as transformers computes them.

        'proportional' rotates only the first partial_rotary_factor of the angles but keeps the exponent's
        denominator at the full head_dim; the remaining angles get frequency 0 (cos 1, sin 0: untouched).
        """
        p = self.rope[kind]
        theta = float(p["rope_theta"])
        if p["rope_type"] == "default":
            exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
            return (1.0 / (theta ** exps)).astype(np.float32)
        angles = int(float(p.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        exps = np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / head_dim
        rotated = (1.0 / (theta ** exps)).astype(np.float32)
        inv = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)])
        return (inv / float(p.get("factor", 1.0))).astype(np.float32)


def _need(d: dict, key: str, where: str):
    if key not in d or d[key] is None:
        raise CheckpointError(f"{where}: missing key {key!r}")
    return d[key]


def text_section(raw: dict, where: str) -> dict:
    """The text model's section: `text_config` of a multimodal config, or the whole file for a text-only one."""
    if "text_config" in raw:
        if not isinstance(raw["text_config"], dict):
            raise CheckpointError(f"{where}: 'text_config' is not an object")
        return raw["text_config"]
    if raw.get("model_type") in ("gemma4_text",):
        return raw
    raise CheckpointError(f"{where}: no 'text_config' (model_type {raw.get('model_type')!r} is not Gemma 4)")


def parse(raw: dict, where: str = "config.json") -> TextConfig:
    t = text_section(raw, where)
    w = f"{where} text_config" if "text_config" in raw else where
    if t.get("enable_moe_block"):
        raise CheckpointError(f"{w}: 'enable_moe_block' is true; the JAX runtime serves dense Gemma 4 (E2B/E4B) only")
    if t.get("use_bidirectional_attention") == "all":
        raise CheckpointError(f"{w}: 'use_bidirectional_attention' = 'all' is not a causal language model")
    act = t.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise CheckpointError(f"{w}: 'hidden_activation' {act!r} is not one of {', '.join(ACTIVATIONS)}")

    n = int(_need(t, "num_hidden_layers", w))
    types = list(_need(t, "layer_types", w))
    if len(types) != n:
        raise CheckpointError(f"{w}: 'layer_types' has {len(types)} entries for {n} layers")
    for i, k in enumerate(types):
        if k not in (SLIDING, FULL):
            raise CheckpointError(f"{w}: 'layer_types'[{i}] = {k!r} is not {SLIDING!r} or {FULL!r}")
    if types[-1] != FULL:  # transformers forces this too
        types[-1] = FULL

    rope = _need(t, "rope_parameters", w)
    for kind in dict.fromkeys(types):  # first-seen order, not hash order: the same error in every process
        p = rope.get(kind)
        if not isinstance(p, dict) or "rope_theta" not in p:
            raise CheckpointError(f"{w}: 'rope_parameters.{kind}.rope_theta' is missing")
        if p.get("rope_type", "default") not in ("default", "proportional"):
            raise CheckpointError(f"{w}: 'rope_parameters.{kind}.rope_type' {p['rope_type']!r} is not supported")
    rope = {k: {"rope_type": v.get("rope_type", "default"), **v} for k, v in rope.items() if isinstance(v, dict)}

    head_dim = int(_need(t, "head_dim", w))
    kv_heads = int(_need(t, "num_key_value_heads", w))
    k_eq_v = bool(t.get("attention_k_eq_v", False))
    overrides: dict[int, dict] = {}
    if t.get("per_layer_config"):
        for key, val in t["per_layer_config"].items():
            idx = [i for i, k in enumerate(types) if k == key] if key in (SLIDING, FULL) else [int(key)]
            for i in idx:
                overrides.setdefault(i, {}).update(val)
    else:  # Hub spelling: one override for every full-attention layer
        full = {"head_dim": int(t.get("global_head_dim", 512))}
        if k_eq_v and t.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = int(t["num_global_key_value_heads"])
        for i, k in enumerate(types):
            if k == FULL:
                overrides[i] = full

    # KV sharing: from layer n - num_kv_shared_layers on, a layer attends to the KV of the last earlier
    # non-shared layer of its own type (transformers' `store_full_length_kv` / `shared_kv_states`).
    shared = int(t.get("num_kv_shared_layers") or 0)
    first_shared = n - shared
    layers = []
    for i, kind in enumerate(types):
        o = overrides.get(i, {})
        src = i
        if shared and i >= first_shared:
            earlier = [j for j in range(first_shared) if types[j] == kind]
            if not earlier:
                raise CheckpointError(f"{w}: layer {i} shares KV but no earlier {kind} layer exists")
            src = earlier[-1]
        layers.append(LayerSpec(kind=kind, head_dim=int(o.get("head_dim", head_dim)),
                                num_kv_heads=int(o.get("num_key_value_heads", kv_heads)),
                                kv_source=src, k_eq_v=k_eq_v and kind == FULL))
    for i, spec in enumerate(layers):
        src = layers[spec.kv_source]
        if (src.head_dim, src.num_kv_heads) != (spec.head_dim, spec.num_kv_heads):
            raise CheckpointError(f"{w}: layer {i} shares KV with layer {spec.kv_source} of another shape")

    num_heads = int(_need(t, "num_attention_heads", w))
    for i, spec in enumerate(layers):
        if num_heads % spec.num_kv_heads:
            raise CheckpointError(f"{w}: layer {i}: {num_heads} heads not divisible by {spec.num_kv_heads} KV heads")

    vocab = int(_need(t, "vocab_size", w))
    tie = raw.get("tie_word_embeddings", t.get("tie_word_embeddings", True))
    return TextConfig(
        vocab_size=vocab,
        hidden_size=int(_need(t, "hidden_size", w)),
        num_heads=num_heads,
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        sliding_window=int(_need(t, "sliding_window", w)),
        activation=act,
        final_logit_softcapping=t.get("final_logit_softcapping"),
        ple_dim=int(t.get("hidden_size_per_layer_input") or 0),
        ple_vocab_size=int(t.get("vocab_size_per_layer_input") or vocab),
        tie_word_embeddings=bool(tie),
        max_position_embeddings=int(t.get("max_position_embeddings", 131072)),
        layers=tuple(layers),
        rope=rope,
    )


def load(model_dir: Path) -> TextConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (is {model_dir} a model directory?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    return parse(raw, str(path))
