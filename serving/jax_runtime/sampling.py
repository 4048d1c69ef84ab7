"""Next-token choice on the device, one row per sequence (the contract in serving/engine.py), sort-free.

Sorting 262 144 logits per row per token is the expensive way to find a top-k or top-p cut. Both cuts are a
threshold on the (tempered) logit instead, found by bisection: a few dozen fused compare-and-reduce passes over
the row. Tokens at the threshold are kept together (ties at the k-th value all stay). The draw is Gumbel-max over
what is kept (argmax of logit/T + Gumbel noise is a draw from softmax(logit/T)). Branches no row needs are
skipped with lax.cond: an all-greedy batch costs one argmax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.structured import MASKED

FLOOR = -80.0     # tempered, max-shifted logits are clamped here: exp(-80) ≈ 2e-35, never drawn in practice
ITERS = 30        # bisection steps: the cut lands within 80 / 2**30 ≈ 7e-8 of the exact threshold


def _bisect(x, ok):
    """Per row, the largest threshold t in [FLOOR, 0] with ok(x, t) true (ok is monotone: true at FLOOR)."""
    lo = jnp.full(x.shape[:1], FLOOR, x.dtype)
    hi = jnp.zeros(x.shape[:1], x.dtype)

    def body(_, bounds):
        lo, hi = bounds
        mid = 0.5 * (lo + hi)
        good = ok(x, mid)
        return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

    lo, _ = jax.lax.fori_loop(0, ITERS, body, (lo, hi))
    return lo


def _cut(x, top_k, top_p):
    """Boolean mask [B, V] of the tokens top-k then top-p keep (x: tempered logits, max 0, floor FLOOR)."""
    v = x.shape[1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    t_k = _bisect(x, lambda x, t: (x >= t[:, None]).sum(-1) >= k)
    t_k = jnp.where(k >= v, FLOOR, t_k)
    w = jnp.where(x >= t_k[:, None], jnp.exp(x), 0.0)           # the top-k distribution, unnormalised
    need = top_p * w.sum(-1)
    t_p = _bisect(x, lambda x, t: jnp.where(x >= t[:, None], w, 0.0).sum(-1) >= need)
    t_p = jnp.where(top_p >= 1.0, FLOOR, t_p)
    return x >= jnp.maximum(t_k, t_p)[:, None]


def sample(logits, temperature, top_k, top_p, keys, positions):
    """logits [B, V] float32; per row: temperature, top_k (0 = off), top_p (1 = off), keys [B, 2] uint32
    (the request's threefry key), positions [B] (the position of the token being chosen). -> int32 [B]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def stochastic(_):
        hot = temperature > 0
        t = jnp.where(hot, temperature, 1.0)[:, None]
        x = jnp.maximum((logits - logits.max(-1, keepdims=True)) / t, FLOOR)
        filtered = jnp.any(hot & ((top_k > 0) | (top_p < 1.0)))
        keep = jax.lax.cond(filtered, lambda: _cut(x, top_k, top_p), lambda: jnp.ones(x.shape, bool))

        def noise(key, pos):
            key = jax.random.fold_in(jax.random.wrap_key_data(key, impl="threefry2x32"), pos)
            return jax.random.gumbel(key, (x.shape[1],), jnp.float32)

        g = jax.vmap(noise)(keys, positions)
        drawn = jnp.argmax(jnp.where(keep, x + g, -jnp.inf), axis=-1).astype(jnp.int32)
        return jnp.where(hot, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda _: greedy, None)


def apply_mask(logits, mask):
    """logits [B, V]; mask int32 [B, ceil(V / 32)], the packed allowed-token bitmask of serving/engine.py.
    Disallowed tokens get the logit MASKED (an all-ones row changes nothing)."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(mask.shape[0], -1)[:, :logits.shape[1]] != 0
    return jnp.where(allowed, logits, MASKED)
