"""The Gemma 4 text decoder as pure JAX functions: prefill a padded prompt into a cache row, decode one
token for a batch of rows.

Numerics follow transformers' Gemma4 text model: RMSNorm in float32 (x * (mean(x²) + eps) ** -0.5 * w),
q/k norms with weights and a weightless v norm, attention scale 1, RoPE per layer kind (proportional RoPE on
full layers), sqrt(hidden) embedding scale, per-layer embeddings (PLE) mixed into every layer, a learned
per-layer scalar, tied embeddings and tanh soft-capping of the final logits.

Linear weights that read the same input are one weight, fused at load (checkpoint.py): a layer's q|k|v ("qkv")
and gate|up ("gate_up"). One dot per group and step, so XLA has nothing to join per call (its DotMerger
concatenates weights sharing an operand on every step when dots go to cuBLAS, as all do below Ampere).

The KV cache holds one (k, v) pair per layer that computes its own KV (KV-shared layers read their source's),
each with one row per sequence slot (continuous batching: rows are independent sequences at their own positions):
- sliding layers: a ring of `sliding_window` entries per row; position p lives in entry p % window.
- full layers: `capacity` entries per row (the context limit); position p lives in entry p. A decode step reads
  only a prefix of them (a bucket of the ladder that covers every row's position).
Keys are stored after RoPE, so an entry never needs its position again except for masking. Entries a row has not
written yet (or a previous sequence's) are always masked.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .config import TextConfig

F32 = jnp.float32
NEG = -1e30  # mask value (finite: a fully masked row must not produce NaNs in padded rows)


# XLA's GPU backend reduces a column (the reduced dimension major, as K is here) in one pass up to 32 x 128 inputs;
# a longer one becomes two reductions with an f32 partial sum of every output in between (its reduction_utils and
# tree-reduction rewriter). The multiply-reduce path cuts K into parts no longer than this and adds the parts after.
COLUMN_REDUCE_MAX = 4096


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scale"], meta_fields=["reduce_rows"])
@dataclasses.dataclass(frozen=True)
class Packed:
    """A weight-only quantised linear weight (serving/quantized.py): q int8 or int4 [in, out], scale [groups, out]
    (groups = 1: one scale per output channel; else one per `in // groups` inputs).

    reduce_rows (static: part of the compiled program, not an argument): a product of at most this many rows is a
    multiply-reduce rather than a dot (matmul); 0: always a dot. The engine sets it at load (engine.packed_dot)."""
    q: jax.Array
    scale: jax.Array
    reduce_rows: int = 0


def _is_packed(w) -> bool:
    return isinstance(w, Packed)


def has_packed(params) -> bool:
    return any(map(_is_packed, jax.tree.leaves(params, is_leaf=_is_packed)))


def with_reduce_rows(params, rows: int):
    """params with every Packed weight's reduce_rows set to rows."""
    return jax.tree.map(lambda w: dataclasses.replace(w, reduce_rows=rows) if _is_packed(w) else w, params,
                        is_leaf=_is_packed)


def matmul(x, w):
    """x @ w for a 16-bit weight or a Packed one.

    Packed, as a dot: the weight is converted inside the product. A Triton GEMM fuses the convert (and the group
    scales) into its operand, so the bytes read are the packed ones; a cuBLAS call cannot (every dot below Ampere, or
    with XLA's Triton GEMM off): XLA then writes a dequantised 16-bit copy of the weight first, every step. Rows up to
    w.reduce_rows take _reduce_matmul instead, which has no dot."""
    if not isinstance(w, Packed):
        return x @ w
    if x.size // x.shape[-1] <= w.reduce_rows:
        return _reduce_matmul(x, w)
    groups, out = w.scale.shape
    if groups == 1:                       # per channel: scale the product's columns
        return (x @ w.q.astype(x.dtype)) * w.scale[0].astype(x.dtype)
    deq = w.q.astype(x.dtype).reshape(groups, -1, out) * w.scale[:, None, :].astype(x.dtype)
    return x @ deq.reshape(w.q.shape)


def _k_parts(k: int) -> int:
    """The fewest equal parts of k inputs with none longer than COLUMN_REDUCE_MAX."""
    parts = -(-k // COLUMN_REDUCE_MAX)
    while k % parts:
        parts += 1
    return parts


def _reduce_matmul(x, w: Packed):
    """x @ w as an elementwise product [K, out, rows] summed over K in float32: XLA compiles it as reductions over K
    whose input fusion converts (and scales) the packed weight as it reads it, one pass for all rows (rows minor, so
    a row of K's bytes serves every row at once), and writes only the [out, rows] sums: nothing for cuBLAS, no
    dequantised weight. For memory-bound decode only: each row costs a multiply per weight, so prefill keeps the dot.
    (benchmarks/quantized_decode.py --phase kernels times it against the float16 dot and a tiled layout.)"""
    k, out = w.q.shape
    groups = w.scale.shape[0]
    rows = x.reshape(-1, k).astype(F32).T                       # [K, R]
    q = w.q.astype(F32)
    if groups > 1:                                              # each group's scale on its inputs, in the fusion
        q = (q.reshape(groups, -1, out) * w.scale.astype(F32)[:, None, :]).reshape(k, out)
    parts = _k_parts(k)
    prod = q.reshape(parts, k // parts, out, 1) * rows.reshape(parts, k // parts, 1, -1)
    sums = jnp.sum(prod, axis=1)                                # [parts, out, R]
    y = sums[0]
    for i in range(1, parts):                                   # adds, not a reduce: XLA would merge two reduces
        y = y + sums[i]
    if groups == 1:
        y = y * w.scale[0].astype(F32)[:, None]
    return y.T.reshape(*x.shape[:-1], out).astype(x.dtype)


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


def _embed(cfg: TextConfig, params, tokens):
    """Scaled token embeddings [T, D] and per-layer inputs [T, L, P] (None without PLE).

    The per-layer embedding table lives on the device with the other weights (4.7 GB for E2B in fp16, read one row
    per token): gathering it in the graph lets a decode step take its tokens straight from the previous step's
    output, with nothing from the host (JaxEngine's pipelined decode)."""
    dtype = params["embed"].dtype
    x = jnp.take(params["embed"], tokens, axis=0) * jnp.asarray(cfg.hidden_size ** 0.5, dtype)
    if not cfg.ple_dim:
        return x, None
    t, n, p = tokens.shape[0], cfg.num_layers, cfg.ple_dim
    tok = jnp.take(params["ple_embed"], tokens, axis=0, mode="clip") * jnp.asarray(p ** 0.5, dtype)
    proj = (x @ params["ple_proj"]) * jnp.asarray(cfg.hidden_size ** -0.5, dtype)
    proj = rms_norm(proj.reshape(t, n, p), params["ple_norm"], cfg.rms_norm_eps)
    return x, (proj + tok.reshape(t, n, p)) * jnp.asarray(2.0 ** -0.5, dtype)


def _qkv(cfg: TextConfig, spec, lp, x, cos, sin, own_kv: bool):
    """Projections of normed hidden states x [T, D]: q [T, H, hd] and, for KV-owning layers, k, v [T, kvh, hd]."""
    t, hd, kvh = x.shape[0], spec.head_dim, spec.num_kv_heads
    qkv = matmul(x, lp["qkv"])            # one dot: q | k | v side by side (k, v only for KV-owning layers)
    nq, nk = cfg.num_heads * hd, kvh * hd
    q = _rope(rms_norm(qkv[:, :nq].reshape(t, cfg.num_heads, hd), lp["q_norm"], cfg.rms_norm_eps), cos, sin)
    if not own_kv:
        return q, None, None
    k_raw = qkv[:, nq:nq + nk].reshape(t, kvh, hd)
    v_raw = k_raw if spec.k_eq_v else qkv[:, nq + nk:].reshape(t, kvh, hd)
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
    h = h + rms_norm(matmul(attn, lp["o"]), lp["post_attn_ln"], eps)
    x = rms_norm(h, lp["pre_ff_ln"], eps)
    gate_up = matmul(x, lp["gate_up"])    # one dot: gate | up side by side
    ff = gate_up.shape[-1] // 2
    x = matmul(_act(cfg, gate_up[:, :ff]) * gate_up[:, ff:], lp["down"])
    h = h + rms_norm(x, lp["post_ff_ln"], eps)
    if ple is not None:
        g = _act(cfg, matmul(h, lp["ple_gate"])) * ple
        h = h + rms_norm(matmul(g, lp["ple_proj"]), lp["ple_ln"], eps)
    return h * lp["layer_scalar"]


def final_logits(cfg: TextConfig, params, h):
    """h [B, D] -> float32 logits [B, V], soft-capped."""
    h = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    if params["lm_head"] is None:
        logits = jnp.einsum("bd,vd->bv", h, params["embed"], preferred_element_type=F32)
    else:
        logits = jnp.einsum("bd,dv->bv", h, params["lm_head"], preferred_element_type=F32)
    cap = cfg.final_logit_softcapping
    if cap:
        logits = jnp.tanh(logits / cap) * cap
    return logits.astype(F32)


def kv_owners(cfg: TextConfig) -> list[int]:
    """Layers that compute (and cache) their own KV, in order; the cache is a list aligned with this."""
    return [i for i, s in enumerate(cfg.layers) if s.kv_source == i]


def cache_shapes(cfg: TextConfig, slots: int, capacity: int) -> list[tuple[int, ...]]:
    """Shape of each KV owner's k (and v) for `slots` sequences of up to `capacity` positions:
    [slots, positions, kv_heads, head_dim]."""
    return [(slots, cfg.sliding_window if cfg.layers[i].sliding else capacity, cfg.layers[i].num_kv_heads,
             cfg.layers[i].head_dim) for i in kv_owners(cfg)]


def empty_cache(cfg: TextConfig, slots: int, capacity: int, dtype) -> list:
    """A zero cache on the device: (k, v) per KV owner."""
    return [(jnp.zeros(s, dtype), jnp.zeros(s, dtype)) for s in cache_shapes(cfg, slots, capacity)]


def prefill(cfg: TextConfig, params, cache, slot, tokens, length):
    """Run a prompt padded to a bucket into cache row `slot` (any previous sequence there is dropped).
    tokens [P] int32 (valid up to `length`), slot and length int32 scalars. P must not exceed the cache's capacity.

    Returns (float32 logits [V] for the token after position length-1, updated cache).
    """
    h, cache = prefill_hidden(cfg, params, cache, slot, tokens, length)
    last = jax.lax.dynamic_index_in_dim(h, length - 1, axis=0, keepdims=False)
    return final_logits(cfg, params, last[None])[0], cache


def prefill_hidden(cfg: TextConfig, params, cache, slot, tokens, length):
    """prefill up to the final hidden states of every position [P, D] (before the final norm and the head)."""
    p_len = tokens.shape[0]
    window = cfg.sliding_window
    dtype = params["embed"].dtype
    h, ple = _embed(cfg, params, tokens)
    pos = jnp.arange(p_len, dtype=jnp.int32)
    causal = pos[None, :] <= pos[:, None]
    masks = {"full": causal, "sliding": causal & (pos[:, None] - pos[None, :] < window)}
    trig = _rope_tables(cfg, pos, dtype)

    # ring slot s holds the last prompt position p < length with p % window == s (garbage if none: masked later)
    ring = jnp.arange(window, dtype=jnp.int32)
    ring_src = jnp.clip(ring + window * ((length - 1 - ring) // window), 0, p_len - 1)

    owners = {layer: n for n, layer in enumerate(kv_owners(cfg))}
    kv: dict[int, tuple] = {}
    cache = list(cache)
    zero = jnp.int32(0)
    for i, (spec, lp) in enumerate(zip(cfg.layers, params["layers"])):
        own = spec.kv_source == i
        cos, sin = trig[(spec.kind, spec.head_dim)]
        q, k, v = _qkv(cfg, spec, lp, rms_norm(h, lp["input_ln"], cfg.rms_norm_eps), cos, sin, own)
        if own:
            kv[i] = (k, v)
            rows = (k[ring_src], v[ring_src]) if spec.sliding else (k, v)
            cache[owners[i]] = tuple(jax.lax.dynamic_update_slice(c, r[None], (slot, zero, zero, zero))
                                     for c, r in zip(cache[owners[i]], rows))
        k, v = kv[spec.kv_source]
        attn = _attend(q, k, v, masks["sliding" if spec.sliding else "full"])
        h = _finish_layer(cfg, lp, h, attn, None if ple is None else ple[:, i])
    return h, cache


def _attend_rows(q, k, v, mask):
    """One query per row against that row's cache: q [B, H, hd], k/v [B, S, kvh, hd], mask [B, S] -> [B, H*hd]."""
    b, h, hd = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, kvh, h // kvh, hd)
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k, preferred_element_type=F32)
    scores = jnp.where(mask[:, None, None, :], scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgs,bskd->bkgd", probs, v).reshape(b, h * hd)


def decode(cfg: TextConfig, capacity: int, params, cache, tokens, positions):
    """One token for each of the first B cache rows: tokens, positions [B] int32 (row r's token goes to position
    positions[r]). Full-attention layers read only the first `capacity` positions (every position must be below
    it). Returns (float32 logits [B, V], updated cache)."""
    window = cfg.sliding_window
    dtype = params["embed"].dtype
    b = tokens.shape[0]
    rows = jnp.arange(b, dtype=jnp.int32)
    h, ple = _embed(cfg, params, tokens)
    trig = _rope_tables(cfg, positions, dtype)

    ring = jnp.arange(window, dtype=jnp.int32)
    p = positions[:, None]
    masks = {True: p - (p - ring[None, :]) % window >= 0,      # the ring slot's position exists
             False: jnp.arange(capacity, dtype=jnp.int32)[None, :] <= p}

    owners = {layer: n for n, layer in enumerate(kv_owners(cfg))}
    cache = list(cache)
    for i, (spec, lp) in enumerate(zip(cfg.layers, params["layers"])):
        own = spec.kv_source == i
        cos, sin = trig[(spec.kind, spec.head_dim)]
        q, k, v = _qkv(cfg, spec, lp, rms_norm(h, lp["input_ln"], cfg.rms_norm_eps), cos, sin, own)
        if own:
            at = positions % window if spec.sliding else positions
            ck, cv = cache[owners[i]]
            cache[owners[i]] = (ck.at[rows, at].set(k), cv.at[rows, at].set(v))
        ck, cv = cache[owners[spec.kv_source]]
        span = window if spec.sliding else capacity
        attn = _attend_rows(q, ck[:b, :span], cv[:b, :span], masks[spec.sliding])
        h = _finish_layer(cfg, lp, h, attn, None if ple is None else ple[:, i])
    return final_logits(cfg, params, h), cache
