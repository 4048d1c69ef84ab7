"""The Gemma 4 text decoder as pure JAX functions: prefill a padded prompt, decode one token, grow the cache.

Numerics follow transformers' Gemma4 text model: RMSNorm in float32 (x * (mean(x²) + eps) ** -0.5 * w),
q/k norms with weights and a weightless v norm, attention scale 1, RoPE per layer kind (proportional RoPE on
full layers), sqrt(hidden) embedding scale, per-layer embeddings (PLE) mixed into every layer, a learned
per-layer scalar, tied embeddings and tanh soft-capping of the final logits.

The KV cache holds one (k, v) pair per layer that computes its own KV (KV-shared layers read their source's):
- sliding layers: a ring of `sliding_window` slots; position p lives in slot p % window.
- full layers: `capacity` slots (a bucket of the ladder); position p lives in slot p.
Keys are stored after RoPE, so a slot never needs its position again except for masking.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import TextConfig

F32 = jnp.float32
NEG = -1e30  # mask value (finite: a fully masked row must not produce NaNs in padded rows)


def rms_norm(x, w, eps):
    xf = x.astype(F32)
    y = xf * (jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) ** -0.5
    if w is not None:
        y = y * w.astype(F32)
    return y.astype(x.dtype)


def _act(cfg: TextConfig, x):
    return jax.nn.gelu(x, approximate=cfg.activation == "gelu_pytorch_tanh")


def _rope(x, cos, sin):
    """x [..., T, heads, hd]; cos/sin [T, hd]."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def _cos_sin(cfg: TextConfig, kind: str, head_dim: int, positions, dtype):
    inv = jnp.asarray(cfg.inv_freq(kind, head_dim))
    freqs = positions.astype(F32)[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _rope_tables(cfg: TextConfig, positions, dtype) -> dict:
    """(cos, sin) per (layer kind, head dim) present in the model.

    Sorted, not a set: the trace order must not depend on string hashing, or the lowered program (and so its
    persistent-cache key) would differ from one process to the next."""
    kinds = sorted({(s.kind, s.head_dim) for s in cfg.layers})
    return {(k, hd): _cos_sin(cfg, k, hd, positions, dtype) for k, hd in kinds}


def _embed(cfg: TextConfig, params, tokens, ple_rows):
    """Scaled token embeddings [T, D] and per-layer inputs [T, L, P] (None without PLE).

    ple_rows [T, L*P] are the tokens' rows of the per-layer embedding table, gathered on the host: the table is
    half of E2B's weights (4.7 GB in fp16) and only ever read one row per token, so it stays off the GPU.
    """
    dtype = params["embed"].dtype
    x = jnp.take(params["embed"], tokens, axis=0) * jnp.asarray(cfg.hidden_size ** 0.5, dtype)
    if not cfg.ple_dim:
        return x, None
    t, n, p = tokens.shape[0], cfg.num_layers, cfg.ple_dim
    tok = ple_rows * jnp.asarray(p ** 0.5, dtype)
    proj = (x @ params["ple_proj"]) * jnp.asarray(cfg.hidden_size ** -0.5, dtype)
    proj = rms_norm(proj.reshape(t, n, p), params["ple_norm"], cfg.rms_norm_eps)
    return x, (proj + tok.reshape(t, n, p)) * jnp.asarray(2.0 ** -0.5, dtype)


def _qkv(cfg: TextConfig, spec, lp, x, cos, sin, own_kv: bool):
    """Projections of normed hidden states x [T, D]: q [T, H, hd] and, for KV-owning layers, k, v [T, kvh, hd]."""
    t, hd, kvh = x.shape[0], spec.head_dim, spec.num_kv_heads
    q = _rope(rms_norm((x @ lp["q"]).reshape(t, cfg.num_heads, hd), lp["q_norm"], cfg.rms_norm_eps), cos, sin)
    if not own_kv:
        return q, None, None
    k_raw = (x @ lp["k"]).reshape(t, kvh, hd)
    v_raw = k_raw if spec.k_eq_v else (x @ lp["v"]).reshape(t, kvh, hd)
    k = _rope(rms_norm(k_raw, lp["k_norm"], cfg.rms_norm_eps), cos, sin)
    v = rms_norm(v_raw, None, cfg.rms_norm_eps)
    return q, k, v


def _attend(q, k, v, mask):
    """q [T, H, hd], k/v [S, kvh, hd], mask [T, S] bool -> [T, H*hd]. Scale 1 (q and k are normed)."""
    t, h, hd = q.shape
    kvh = k.shape[1]
    qg = q.reshape(t, kvh, h // kvh, hd)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=F32)
    scores = jnp.where(mask[None, None], scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("kgts,skd->tkgd", probs, v)
    return out.reshape(t, h * hd)


def _finish_layer(cfg: TextConfig, lp, h, attn, ple):
    """Everything after attention: o_proj, norms, residuals, MLP, per-layer input, layer scalar."""
    eps = cfg.rms_norm_eps
    h = h + rms_norm(attn @ lp["o"], lp["post_attn_ln"], eps)
    x = rms_norm(h, lp["pre_ff_ln"], eps)
    x = (_act(cfg, x @ lp["gate"]) * (x @ lp["up"])) @ lp["down"]
    h = h + rms_norm(x, lp["post_ff_ln"], eps)
    if ple is not None:
        g = _act(cfg, h @ lp["ple_gate"]) * ple
        h = h + rms_norm(g @ lp["ple_proj"], lp["ple_ln"], eps)
    return h * lp["layer_scalar"]


def _logits(cfg: TextConfig, params, h):
    """h [D] -> float32 logits [V], soft-capped."""
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    if params["lm_head"] is None:
        logits = jnp.einsum("d,vd->v", h, params["embed"], preferred_element_type=F32)
    else:
        logits = jnp.einsum("d,dv->v", h, params["lm_head"], preferred_element_type=F32)
    cap = cfg.final_logit_softcapping
    if cap:
        logits = jnp.tanh(logits / cap) * cap
    return logits.astype(F32)


def kv_owners(cfg: TextConfig) -> list[int]:
    """Layers that compute (and cache) their own KV, in order; the cache is a list aligned with this."""
    return [i for i, s in enumerate(cfg.layers) if s.kv_source == i]


def empty_cache(cfg: TextConfig, capacity: int, dtype) -> list:
    """Host-side zero cache shapes (numpy), for lowering and tests."""
    out = []
    for i in kv_owners(cfg):
        s = cfg.layers[i]
        slots = cfg.sliding_window if s.sliding else capacity
        z = np.zeros((slots, s.num_kv_heads, s.head_dim), dtype)
        out.append((z, z))
    return out


def prefill(cfg: TextConfig, capacity: int, params, tokens, length, ple_rows=None):
    """Run a prompt padded to a bucket. tokens [P] int32 (valid up to `length`), length int32 scalar,
    ple_rows [P, L*P'] the per-layer embedding rows of the tokens (None without PLE).

    Returns (float32 logits [V] for the token after position length-1, cache for `capacity` slots).
    """
    p_len = tokens.shape[0]
    assert p_len <= capacity, (p_len, capacity)
    window = cfg.sliding_window
    dtype = params["embed"].dtype
    h, ple = _embed(cfg, params, tokens, ple_rows)
    pos = jnp.arange(p_len, dtype=jnp.int32)
    causal = pos[None, :] <= pos[:, None]
    masks = {"full": causal, "sliding": causal & (pos[:, None] - pos[None, :] < window)}
    trig = _rope_tables(cfg, pos, dtype)

    # ring slot s holds the last prompt position p < length with p % window == s (garbage if none: masked later)
    slot = jnp.arange(window, dtype=jnp.int32)
    ring_src = jnp.clip(slot + window * ((length - 1 - slot) // window), 0, p_len - 1)

    kv: dict[int, tuple] = {}
    cache = []
    for i, (spec, lp) in enumerate(zip(cfg.layers, params["layers"])):
        own = spec.kv_source == i
        cos, sin = trig[(spec.kind, spec.head_dim)]
        q, k, v = _qkv(cfg, spec, lp, rms_norm(h, lp["input_ln"], cfg.rms_norm_eps), cos, sin, own)
        if own:
            kv[i] = (k, v)
            if spec.sliding:
                cache.append((k[ring_src], v[ring_src]))
            else:
                pad = ((0, capacity - p_len), (0, 0), (0, 0))
                cache.append((jnp.pad(k, pad), jnp.pad(v, pad)))
        k, v = kv[spec.kv_source]
        attn = _attend(q, k, v, masks["sliding" if spec.sliding else "full"])
        h = _finish_layer(cfg, lp, h, attn, None if ple is None else ple[:, i])
    last = jax.lax.dynamic_index_in_dim(h, length - 1, axis=0, keepdims=False)
    return _logits(cfg, params, last), cache


def decode(cfg: TextConfig, params, cache, token, pos, ple_rows=None):
    """Append one token at position `pos` (int32 scalars; ple_rows [1, L*P'] its per-layer embedding row).
    Returns (float32 logits [V], updated cache)."""
    window = cfg.sliding_window
    dtype = params["embed"].dtype
    h, ple = _embed(cfg, params, token[None], ple_rows)
    trig = _rope_tables(cfg, pos[None], dtype)

    slot = jnp.arange(window, dtype=jnp.int32)
    ring_mask = (pos - (pos - slot) % window >= 0)[None, :]  # slot's position (pos - (pos-s) mod W) exists

    owners = {layer: n for n, layer in enumerate(kv_owners(cfg))}
    cache = list(cache)
    for i, (spec, lp) in enumerate(zip(cfg.layers, params["layers"])):
        own = spec.kv_source == i
        cos, sin = trig[(spec.kind, spec.head_dim)]
        q, k, v = _qkv(cfg, spec, lp, rms_norm(h, lp["input_ln"], cfg.rms_norm_eps), cos, sin, own)
        if own:
            ck, cv = cache[owners[i]]
            at = pos % window if spec.sliding else pos
            ck = jax.lax.dynamic_update_slice_in_dim(ck, k, at, axis=0)
            cv = jax.lax.dynamic_update_slice_in_dim(cv, v, at, axis=0)
            cache[owners[i]] = (ck, cv)
        ck, cv = cache[owners[spec.kv_source]]
        if spec.sliding:
            mask = ring_mask
        else:
            mask = (jnp.arange(ck.shape[0], dtype=jnp.int32) <= pos)[None, :]
        attn = _attend(q, ck, cv, mask)
        h = _finish_layer(cfg, lp, h, attn, None if ple is None else ple[:, i])
    return _logits(cfg, params, h[0]), cache


def grow(cfg: TextConfig, capacity: int, cache):
    """Copy a cache into the next capacity bucket: full layers get zero slots appended; rings are unchanged."""
    out = []
    for i, (k, v) in zip(kv_owners(cfg), cache):
        if cfg.layers[i].sliding:
            out.append((k, v))
        else:
            pad = ((0, capacity - k.shape[0]), (0, 0), (0, 0))
            out.append((jnp.pad(k, pad), jnp.pad(v, pad)))
    return out
