"""Next-token choice on the device, one row per sequence (the contract in serving/engine.py), sort-free over the
vocabulary.

Sorting 262 144 logits per row per token is the expensive way to find a top-k or top-p cut, and so is bisecting
for it over the whole row (dozens of passes over [rows, vocabulary] float32: 8.4 MB a pass at 8 rows, twice a
T4's 4 MB L2). The cuts look at each row's CANDIDATES most likely tokens first: found with one pass (the maxima of
GROUP-wide blocks; the top n tokens lie in the n blocks with the largest maxima) and a sort of those blocks alone,
then top-k and top-p are exact cuts over the sorted candidates. Two more passes over the row check that the
cut's tokens are all among the candidates (they are unless the nucleus is wider than CANDIDATES); a row where they
are not takes the whole-vocabulary path, its cuts found by bisection. Tokens at a threshold are kept together (ties
at the k-th value all stay). The draw is Gumbel-max over what is kept (argmax of logit/T + Gumbel noise is a draw
from softmax(logit/T)). Branches no row needs are skipped with lax.cond: an all-greedy batch costs one argmax.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine import MASKED

FLOOR = -80.0     # tempered, max-shifted logits are clamped here: exp(-80) ≈ 2e-35, never drawn in practice
ITERS = 30        # bisection steps: the cut lands within 80 / 2**30 ≈ 7e-8 of the exact threshold
CANDIDATES = 512  # tokens per row the cuts look at first (a row whose cut keeps more takes the whole-row path)
GROUP = 64        # candidates come from the rows' GROUP-wide blocks with the largest maxima


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


def _candidates(x, n: int):
    """The n largest values of each row of x [B, V], descending, and their token ids: (values, ids) [B, n].

    Reads x once: every one of the n largest lies in one of the n GROUP-wide blocks with the largest maxima (ties
    included: the values come out right, the ids among equal values may differ), so only those blocks are sorted."""
    b, v = x.shape
    if v <= n * GROUP:
        return jax.lax.top_k(x, n)
    blocks = -(-v // GROUP)
    if blocks * GROUP != v:
        x = jnp.pad(x, ((0, 0), (0, blocks * GROUP - v)), constant_values=-jnp.inf)
    x = x.reshape(b, blocks, GROUP)
    _, best = jax.lax.top_k(x.max(-1), n)                                     # [B, n] block numbers
    vals = x[jnp.arange(b)[:, None], best].reshape(b, n * GROUP)
    ids = (best[:, :, None] * GROUP + jnp.arange(GROUP, dtype=best.dtype)).reshape(b, n * GROUP)
    top, at = jax.lax.top_k(vals, n)
    return top, jnp.take_along_axis(ids, at, axis=1)


def _candidate_cut(x, top_k, top_p, n: int):
    """top-k then top-p over each row's n candidates (x: tempered logits, max 0, floor FLOOR) ->
    (values [B, n], token ids [B, n], kept [B, n] bool, exact [B] bool).

    exact: the row has a cut and every token it keeps (those above FLOOR) is a candidate, so `kept` is the set _cut
    keeps; a row that is not exact needs the whole-vocabulary path."""
    v = x.shape[1]
    n = min(n, v)
    c, ids = _candidates(x, n)
    k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    t_k = jnp.where(k <= n, jnp.take_along_axis(c, jnp.clip(k - 1, 0, n - 1)[:, None], axis=1)[:, 0], FLOOR)
    z = jnp.where(x >= t_k[:, None], jnp.exp(x), 0.0).sum(-1)               # the top-k set's mass, whole row
    # per candidate, the mass of the candidates at or above its value (ties counted together): [B, n, n], in L2
    mass = jnp.where(c[:, None, :] >= c[:, :, None], jnp.exp(c)[:, None, :], 0.0).sum(-1)
    reach = (mass >= (top_p * z)[:, None]) & (c >= t_k[:, None])
    t_p = jnp.where(top_p >= 1.0, FLOOR, jnp.where(reach, c, -jnp.inf).max(-1))
    cut = jnp.maximum(t_k, t_p)[:, None]
    kept = (c >= cut) & (c > FLOOR)
    everywhere = ((x >= cut) & (x > FLOOR)).sum(-1)
    exact = (((k <= n) | (k >= v)) & ((top_p >= 1.0) | reach.any(-1)) & (everywhere == kept.sum(-1))
             & ((k < v) | (top_p < 1.0)))        # a row without a cut draws over the whole row, in any batch
    return c, ids, kept, exact


def sample(logits, temperature, top_k, top_p, keys, positions, candidates: int = CANDIDATES):
    """logits [B, V] float32; per row: temperature, top_k (0 = off), top_p (1 = off), keys [B, 2] uint32
    (the request's threefry key), positions [B] (the position of the token being chosen). -> int32 [B].
    candidates: tokens per row the cuts look at first (0: every cut over the whole vocabulary)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    v = logits.shape[1]

    def stochastic(_):
        hot = temperature > 0
        t = jnp.where(hot, temperature, 1.0)[:, None]
        x = jnp.maximum((logits - logits.max(-1, keepdims=True)) / t, FLOOR)
        cuts = hot & ((top_k > 0) | (top_p < 1.0))
        filtered = jnp.any(cuts)

        def noise(n):
            def row(key, pos):
                key = jax.random.fold_in(jax.random.wrap_key_data(key, impl="threefry2x32"), pos)
                return jax.random.gumbel(key, (n,), jnp.float32)
            return jax.vmap(row)(keys, positions)

        def whole(bisect):
            keep = jax.lax.cond(bisect, lambda: _cut(x, top_k, top_p), lambda: jnp.ones(x.shape, bool))
            return jnp.argmax(jnp.where(keep, x + noise(v), -jnp.inf), axis=-1).astype(jnp.int32)

        def via_candidates(_):
            c, ids, kept, exact = _candidate_cut(x, top_k, top_p, candidates)
            at = jnp.argmax(jnp.where(kept, c + noise(c.shape[1]), -jnp.inf), axis=-1)
            pick = jnp.take_along_axis(ids, at[:, None], axis=1)[:, 0].astype(jnp.int32)
            return jax.lax.cond(jnp.all(exact | ~hot), lambda _: pick,
                                lambda _: jnp.where(exact, pick, whole(jnp.any(cuts & ~exact))), None)

        if not candidates:
            drawn = whole(filtered)
        else:
            drawn = jax.lax.cond(filtered, via_candidates, lambda _: whole(False), None)
        return jnp.where(hot, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda _: greedy, None)


# -- per-request adjustments before the draw, and raw logprobs after it (the contract in serving/engine.py) --------
# `rows` holds one row per sequence: presence, frequency, repetition, min_p [B] float32; bias_ids/bias_vals [B, W]
# (padded with id = vocab size, which the scatter drops); stop_ids [B, S] (padded likewise) and suppress [B] bool
# (fewer than min_tokens out yet); logprobs [B] bool. `state` is the per-slot history the penalties read, on the
# device: counts [slots, V] int32 (generated tokens) and seen [slots, V] bool (prompt tokens).


BIAS_WIDTH = 300          # logit_bias entries per sequence (serving/api/protocol.py refuses more)
STOP_WIDTH = 64           # ids min_tokens holds back per sequence: eos ids + stop_token_ids (at most 32)


def empty_rows(n: int, vocab: int) -> dict:
    """n rows that change nothing (host arrays)."""
    f32 = lambda fill: np.full(n, fill, np.float32)   # noqa: E731
    return {"presence": f32(0), "frequency": f32(0), "repetition": f32(1), "min_p": f32(0),
            "bias_ids": np.full((n, BIAS_WIDTH), vocab, np.int32), "bias_vals": np.zeros((n, BIAS_WIDTH), np.float32),
            "stop_ids": np.full((n, STOP_WIDTH), vocab, np.int32), "suppress": np.zeros(n, bool),
            "logprobs": np.zeros(n, bool)}


def set_row(rows: dict, i: int, row, vocab: int, logprobs: bool = False) -> None:
    """Row i of `rows` from a serving.engine.DeviceRow and whether the request wants logprobs (suppress stays the
    caller's: it changes as tokens come out)."""
    if len(row.bias) > BIAS_WIDTH or len(row.held) > STOP_WIDTH:
        raise ValueError(f"at most {BIAS_WIDTH} logit_bias entries and {STOP_WIDTH} stop token ids")
    fresh = empty_rows(1, vocab)
    fresh.update(presence=row.presence, frequency=row.frequency, repetition=row.repetition, min_p=row.min_p,
                 logprobs=logprobs)
    for k, v in fresh.items():
        if k != "suppress":
            rows[k][i] = v
    rows["bias_ids"][i, :len(row.bias)] = [t for t, _ in row.bias]
    rows["bias_vals"][i, :len(row.bias)] = [b for _, b in row.bias]
    rows["stop_ids"][i, :len(row.held)] = row.held


def empty_state(slots: int, vocab: int) -> dict:
    return {"counts": jnp.zeros((slots, vocab), jnp.int32), "seen": jnp.zeros((slots, vocab), bool)}


def start_row(state, slot, tokens, length):
    """A new sequence in `slot`: nothing generated yet, the prompt is tokens[:length]."""
    v = state["counts"].shape[1]
    ids = jnp.where(jnp.arange(tokens.shape[0]) < length, tokens, v)
    seen = jnp.zeros((v,), bool).at[ids].set(True, mode="drop")
    return {"counts": state["counts"].at[slot].set(0), "seen": state["seen"].at[slot].set(seen)}


def count(state, tokens, undo):
    """The generated tokens just fed to rows 0..B-1 (a free row's count is junk until its slot starts again).
    undo [B]: a token counted by a step this one replaces (a speculative step the engine threw away), or the
    vocabulary size for none."""
    rows = jnp.arange(tokens.shape[0])
    return {**state, "counts": state["counts"].at[rows, undo].add(-1, mode="drop").at[rows, tokens].add(1)}


def _bias(x, rows):
    r = jnp.arange(x.shape[0])[:, None]
    x = x.at[r, rows["bias_ids"]].add(rows["bias_vals"], mode="drop")
    held = jnp.where(rows["suppress"][:, None], rows["stop_ids"], x.shape[1])
    return x.at[r, held].set(-jnp.inf, mode="drop")


def _penalise(x, counts, seen, rows):
    """vLLM's apply_penalties: repetition over prompt + output, then frequency and presence over the output."""
    rep = rows["repetition"][:, None]
    out = counts > 0
    x = jnp.where(seen | out, jnp.where(x > 0, x / rep, x * rep), x)
    return x - rows["frequency"][:, None] * counts - rows["presence"][:, None] * out


def _min_p(x, temperature, min_p):
    """p(token) < min_p * p(most likely) at this temperature  <=>  logit < max + T * log(min_p)."""
    on = (min_p > 0) & (temperature > 0)
    cut = x.max(-1) + temperature * jnp.log(jnp.where(on, min_p, 1.0))
    return jnp.where(on[:, None] & (x < cut[:, None]), -jnp.inf, x)


def adjust(logits, temperature, rows, counts, seen):
    """logit_bias and min_tokens, penalties, min_p, in vLLM's order; skipped (one lax.cond) when no row needs any.
    counts/seen: the rows' history [B, V]."""
    def apply(x):
        x = _penalise(_bias(x, rows), counts, seen, rows)
        return _min_p(x, temperature, rows["min_p"])

    penalised = (rows["presence"] != 0) | (rows["frequency"] != 0) | (rows["repetition"] != 1)
    needed = (jnp.any(rows["bias_ids"] < logits.shape[1]) | jnp.any(rows["suppress"]) | jnp.any(penalised)
              | jnp.any((rows["min_p"] > 0) & (temperature > 0)))
    return jax.lax.cond(needed, apply, lambda x: x, logits)


def logprobs(logits, chosen, wanted, k: int):
    """Raw logprobs (log_softmax of the model's logits): the chosen token's [B], the top k ids and logprobs
    [B, k]; zeros unless some row wants them."""
    def compute(_):
        lp = jax.nn.log_softmax(logits, axis=-1)
        top, ids = jax.lax.top_k(lp, k)
        return jnp.take_along_axis(lp, chosen[:, None], axis=1)[:, 0], ids.astype(jnp.int32), top

    def none(_):
        b = logits.shape[0]
        return jnp.zeros((b,), jnp.float32), jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32)

    return jax.lax.cond(jnp.any(wanted), compute, none, None)
def prompt_chunk(p: int, chunk: int = 32) -> int:
    """Positions prompt_logprobs runs the head over at a time for a prompt bucket of p: the largest divisor <= chunk."""
    return max(d for d in range(1, min(p, chunk) + 1) if p % d == 0)


def prompt_logprobs(head, h, tokens, wanted, k: int, chunk: int = 32):
    """Raw logprobs of a prompt: per position i of hidden states h [P, D], of tokens[i + 1] (the next prompt token;
    the last row's is junk) -> (its logprob [P], its rank [P], the top k ids [P, k] and logprobs [P, k]); zeros
    unless `wanted`. `head` maps hidden states [c, D] to float32 logits [c, V]: a chunk of positions at a time."""
    p = h.shape[0]
    c = prompt_chunk(p, chunk)
    following = jnp.roll(tokens, -1)

    def block(args):
        hc, tc = args
        lp = jax.nn.log_softmax(head(hc), axis=-1)
        chosen = jnp.take_along_axis(lp, tc[:, None], axis=1)[:, 0]
        top, ids = jax.lax.top_k(lp, k)
        return chosen, (lp > chosen[:, None]).sum(-1).astype(jnp.int32) + 1, ids.astype(jnp.int32), top

    def compute(_):
        out = jax.lax.map(block, (h.reshape(p // c, c, -1), following.reshape(p // c, c)))
        return tuple(o.reshape(p, *o.shape[2:]) for o in out)

    def none(_):
        return (jnp.zeros((p,), jnp.float32), jnp.zeros((p,), jnp.int32), jnp.zeros((p, k), jnp.int32),
                jnp.zeros((p, k), jnp.float32))

    return jax.lax.cond(wanted, compute, none, None)


def apply_mask(logits, mask):
    """logits [B, V]; mask int32 [B, ceil(V / 32)], the packed allowed-token bitmask of serving/engine.py.
    Disallowed tokens get the logit MASKED (an all-ones row changes nothing)."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(mask.shape[0], -1)[:, :logits.shape[1]] != 0
    return jnp.where(allowed, logits, MASKED)
