"""Next-token sampling on the device, both runtimes, against serving.engine's contract (statistics, seeds, cuts)."""
from __future__ import annotations

import numpy as np
import pytest

from serving.engine import DeviceRow, SamplingParams


def _jax_draws(logits, params: SamplingParams, n: int, **kw) -> list[int]:
    """n draws for one request: the token at positions 0..n-1 (one key per position), as a batch of n rows."""
    import jax
    import jax.numpy as jnp
    from serving.jax_runtime import sampling

    rows = np.broadcast_to(np.asarray(logits, np.float32), (n, len(logits)))
    row = DeviceRow.of(params, len(logits))
    out = jax.jit(sampling.sample, static_argnames="candidates")(jnp.asarray(rows), jnp.full(n, row.temperature, jnp.float32), jnp.full(n, row.top_k, jnp.int32),
                 jnp.full(n, row.top_p, jnp.float32), jnp.asarray(np.tile(params.seed_words(), (n, 1)), jnp.uint32),
                 jnp.arange(n, dtype=jnp.int32), **kw)
    return np.asarray(out).tolist()


def _torch_draws(logits, params: SamplingParams, n: int) -> list[int]:
    """The same on PyTorch's batched sampler: n rows of the one slot, at positions 0..n-1."""
    import torch
    from serving.torch_runtime.sampling import Sampler

    sampler = Sampler(1, len(logits), torch.device("cpu"))
    sampler.set(0, DeviceRow.of(params, len(logits)), params.seed64(), [])
    x = torch.tensor(np.asarray(logits, np.float32)).expand(n, -1)
    return sampler.choose(x, torch.zeros(n, dtype=torch.int64), [0], torch.arange(n), None).tolist()


def test_what_parameters_mean_on_the_device_is_decided_once_for_both_runtimes():
    """DeviceRow: each "off" spelled one way and values as float32 holds them, whatever runtime reads them."""
    v = 100
    row = DeviceRow.of(SamplingParams(temperature=1e-46, top_k=v, min_p=0.5, logit_bias=((3, 1.0), (v, 2.0)),
                                      min_tokens=2, eos_token_ids=(1, v + 5), repetition_penalty=1.1), v)
    assert (row.temperature, row.top_k, row.min_p) == (0.0, 0, 0.0)        # underflows float32: greedy, no min_p
    assert row.bias == ((3, 1.0),) and row.held == (1,) and row.penalised
    assert row.repetition == float(np.float32(1.1)) != 1.1
    hot = DeviceRow.of(SamplingParams(temperature=0.7, top_k=-1, top_p=0.3, min_p=0.5), v)
    assert (hot.top_k, hot.min_p, hot.penalised, hot.held) == (0, 0.5, False, ())
    assert DeviceRow.of(SamplingParams(top_k=v - 1), v).top_k == v - 1


@pytest.fixture(params=["jax", "torch"])
def draws(request):
    pytest.importorskip(request.param)
    return _jax_draws if request.param == "jax" else _torch_draws


def test_greedy_and_degenerate_filters_pick_the_argmax(draws):
    logits = [0.1, 3.0, 2.9, -1.0]
    assert set(draws(logits, SamplingParams(temperature=0.0), 5)) == {1}
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=1e-6, seed=3), 50)) == {1}
    assert set(draws(logits, SamplingParams(temperature=1.0, top_k=1, seed=3), 50)) == {1}


def test_sampling_follows_the_distribution_and_the_seed(draws):
    logits = [0.0, np.log(3.0)]
    many = draws(logits, SamplingParams(temperature=1.0, seed=7), 4000)
    assert 0.72 < np.mean(many) < 0.78                      # p(1) = 3/4
    assert draws(logits, SamplingParams(temperature=1.0, seed=7), 4000) == many
    assert draws(logits, SamplingParams(temperature=1.0, seed=8), 4000) != many
    hot = draws(logits, SamplingParams(temperature=4.0, seed=7), 4000)
    assert 0.52 < np.mean(hot) < 0.62                       # p(1) = 3^(1/4) / (1 + 3^(1/4)) = 0.568
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.7, seed=1), 200)) == {1}   # 0.75 alone


def test_a_tiny_temperature_is_greedy_not_nan(draws):
    logits = [0.0, 5.0, 1.0, -2.0]
    for t in (1e-310, 1e-200, 1e-5):
        assert set(draws(logits, SamplingParams(temperature=t, seed=1), 20)) == {1}
        assert set(draws(logits, SamplingParams(temperature=t, top_p=0.9, seed=1), 20)) == {1}


def test_any_integer_seed_is_accepted_and_reproducible(draws):
    logits = [0.0, np.log(3.0)]
    got = {}
    for seed in (-1, -2**63, 2**64 + 5):                    # OpenAI/vLLM allow negative seeds
        got[seed] = draws(logits, SamplingParams(temperature=1.0, seed=seed), 200)
        assert got[seed] == draws(logits, SamplingParams(temperature=1.0, seed=seed), 200)
    assert got[-1] != got[-2**63]


def test_top_k_keeps_exactly_the_k_most_likely(draws):
    logits = np.random.default_rng(1).standard_normal(300)
    top = set(np.argsort(-logits)[:20].tolist())
    drawn = draws(logits, SamplingParams(temperature=3.0, top_k=20, seed=2), 3000)
    assert set(drawn) == top                                # all of them, nothing else


def test_nucleus_is_exact_when_it_is_wide(draws):
    """top_p over a flat 5000-token distribution: the nucleus is large, and drawn from as a whole."""
    logits = np.random.default_rng(3).standard_normal(5000) * 0.5
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    nucleus = set(order[: int(np.searchsorted(np.cumsum(p[order]), 0.9)) + 1].tolist())
    assert len(nucleus) > 1000
    drawn = set(draws(logits, SamplingParams(temperature=1.0, top_p=0.9, seed=5), 1500))
    assert drawn <= nucleus
    assert len(drawn & set(order[256:].tolist())) > 100
    edge = order[len(nucleus) - 1]                          # the cut is the exact one: its last token is kept ...
    assert edge in nucleus and order[len(nucleus)] not in nucleus


def test_jax_rows_do_not_depend_on_their_batch():
    """A request's draws depend on its seed and positions alone, not on the other rows or the batch size."""
    pytest.importorskip("jax")
    import jax.numpy as jnp
    from serving.jax_runtime.sampling import sample

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 64)).astype(np.float32)
    temp = np.array([1.0, 0.0, 0.7, 1.3], np.float32)
    top_k = np.array([0, 0, 5, 0], np.int32)
    top_p = np.array([1.0, 1.0, 1.0, 0.8], np.float32)
    keys = np.array([[0, 1], [0, 2], [5, 3], [9, 9]], np.uint32)
    pos = np.array([3, 8, 17, 40], np.int32)
    together = np.asarray(sample(*map(jnp.asarray, (logits, temp, top_k, top_p, keys, pos))))
    for r in range(4):
        alone = sample(*map(jnp.asarray, (logits[r:r + 1], temp[r:r + 1], top_k[r:r + 1], top_p[r:r + 1],
                                          keys[r:r + 1], pos[r:r + 1])))
        assert int(alone[0]) == together[r]
    assert together[1] == logits[1].argmax()


ADJUSTED = [
    SamplingParams(temperature=0.7, repetition_penalty=1.7, frequency_penalty=0.5, presence_penalty=-1.2),
    SamplingParams(temperature=1.0, logit_bias=((3, 100.0), (7, -100.0), (250, 2.5)), min_p=0.2),
    SamplingParams(temperature=0.0, min_tokens=4, eos_token_ids=(1, 2), stop_token_ids=(9,), min_p=0.9),
    SamplingParams(temperature=2.0, repetition_penalty=0.5, min_p=0.01, logit_bias=((1, 1.0),), min_tokens=1,
                   eos_token_ids=(5,)),
]


def test_both_runtimes_adjust_logits_alike():
    """The adjustments before the draw (bias, min_tokens, penalties, min_p) give the same logits on both
    runtimes, a batch of differently set rows on each."""
    pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp
    from serving.jax_runtime import sampling as js
    from serving.torch_runtime.sampling import Sampler

    rng = np.random.default_rng(4)
    v, n = 300, len(ADJUSTED)
    logits = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    counts = rng.integers(0, 3, (n, v)).astype(np.int32) * (rng.random((n, v)) < 0.05)
    seen = rng.random((n, v)) < 0.05
    rows = js.empty_rows(n, v)
    for i, p in enumerate(ADJUSTED):
        js.set_row(rows, i, DeviceRow.of(p, v), v)
    rows["suppress"] = np.array([bool(p.min_tokens) for p in ADJUSTED])
    temp = np.array([p.temperature for p in ADJUSTED], np.float32)
    got = np.asarray(js.adjust(jnp.asarray(logits), jnp.asarray(temp), {k: jnp.asarray(a) for k, a in rows.items()},
                               jnp.asarray(counts), jnp.asarray(seen)))
    sampler = Sampler(n, v, torch.device("cpu"))
    for i, p in enumerate(ADJUSTED):
        sampler.set(i, DeviceRow.of(p, v), 0, [])
    sampler.counts[:], sampler.seen[:] = torch.tensor(counts), torch.tensor(seen)
    adjusted = sampler._adjust(torch.tensor(logits), torch.arange(n), sampler.rows, torch.ones(n, dtype=torch.bool))
    for i, p in enumerate(ADJUSTED):
        want = adjusted[i].numpy()
        np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want))
        # elementwise float32 in two runtimes (XLA may fuse a division into a multiply): a few ulps apart
        np.testing.assert_allclose(got[i][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6, atol=1e-5)
        assert not np.array_equal(want, logits[i])           # every row changed something
    assert np.isneginf(got[2][[1, 2, 9]]).all() and got[1].argmax() == 3


# ------------------------------------------------------------------ the cuts over the candidates (JAX's fast path)
def _rows_to_cut(v: int, seed: int = 11):
    """Tempered, max-shifted, floored rows (as sample() makes them) of every kind: peaked, flat, with ties, with
    masked tokens; and per row a top_k / top_p, some of them wider than the candidates."""
    from serving.jax_runtime.sampling import FLOOR

    rng = np.random.default_rng(seed)
    rows, ks, ps = [], [], []
    for i in range(48):
        x = rng.standard_normal(v) * [0.3, 1.0, 3.0, 6.0][i % 4]
        if i % 5 == 0:
            x = np.round(x, 1)                                  # many exact ties
        if i % 7 == 0:
            x[rng.random(v) < 0.98] = -1e30                     # a grammar mask: few tokens allowed
        x = np.maximum(x - x.max(), FLOOR)
        rows.append(x)
        ks.append([0, 1, 5, 20, 63, 64, 200, 0][i % 8])
        ps.append([1.0, 0.9, 0.5, 0.99, 0.3, 1.0][i % 6])
    return (np.array(rows, np.float32), np.array(ks, np.int32), np.array(ps, np.float32))


@pytest.mark.parametrize("v,n", [(5000, 64), (300, 512)])
def test_candidate_cuts_keep_exactly_what_the_whole_row_cuts_keep(v, n):
    """Per row, the top-k/top-p cut over its n candidates keeps the tokens the whole-vocabulary bisection keeps,
    and calls itself exact only then; rows whose cut is wider than the candidates say so (the whole-row path)."""
    pytest.importorskip("jax")
    import jax.numpy as jnp
    from serving.jax_runtime.sampling import FLOOR, _candidate_cut, _cut

    x, ks, ps = _rows_to_cut(v)
    c, ids, kept, exact = map(np.asarray, _candidate_cut(jnp.asarray(x), jnp.asarray(ks), jnp.asarray(ps), n))
    whole = np.asarray(_cut(jnp.asarray(x), jnp.asarray(ks), jnp.asarray(ps)))
    assert (np.diff(c, axis=1) <= 0).all()
    np.testing.assert_array_equal(c, -np.sort(-x, axis=1)[:, :n])       # the n largest values, descending
    for r in range(len(x)):
        np.testing.assert_array_equal(x[r, ids[r]], c[r])
        want = set(np.flatnonzero(whole[r] & (x[r] > FLOOR)).tolist())
        if exact[r]:
            assert set(ids[r][kept[r]].tolist()) == want, r
        else:
            assert len(want) > n or n < ks[r] < v or ps[r] >= 0.99 or (ks[r] == 0 and ps[r] == 1.0), r
    wide = (ks > n) & (ks < v)
    assert not exact[wide].any()
    if n < v:
        assert 0.3 < exact.mean() < 1.0                         # both paths are exercised
    else:
        assert exact[(ks > 0) | (ps < 1.0)].all()


def _chi2_p(observed, expected) -> float:
    """p-value of Pearson's chi-square (bins expecting fewer than 5 draws pooled)."""
    from jax.scipy.special import gammaincc

    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    small = expected < 5
    o = np.append(observed[~small], observed[small].sum())
    e = np.append(expected[~small], expected[small].sum())
    o, e = o[e > 0], e[e > 0]
    stat = float(((o - e) ** 2 / e).sum())
    return float(gammaincc((len(e) - 1) / 2, stat / 2))


CUTS = [SamplingParams(temperature=2.0, top_k=30, seed=1), SamplingParams(temperature=0.6, top_p=0.8, seed=2),
        SamplingParams(temperature=0.8, top_k=25, top_p=0.9, seed=3), SamplingParams(temperature=1.5, top_k=5, seed=4)]


@pytest.mark.parametrize("params", CUTS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_candidate_sampling_draws_from_the_distribution_of_the_whole_row_sampler(params):
    """Statistics: draws through the candidates (group path, 32 of 3000; and the default) follow the exact
    softmax over the cut, and cannot be told apart from today's whole-vocabulary sampler's (chi-square, p > 1e-4;
    fixed seeds, so the test is deterministic)."""
    pytest.importorskip("jax")
    import jax.numpy as jnp
    from serving.jax_runtime.sampling import _candidate_cut

    v, n = 3000, 3000
    logits = (np.random.default_rng(21).standard_normal(v) * 2.5).astype(np.float32)
    x = (logits - logits.max()) / params.temperature
    order = np.argsort(-x, kind="stable")
    kept = order[:params.top_k] if params.top_k else order
    p = np.exp(x[kept] - x[kept].max())
    p /= p.sum()
    if params.top_p < 1:
        kept = kept[:int(np.searchsorted(np.cumsum(p), params.top_p)) + 1]
    exact = np.zeros(v)
    exact[kept] = np.exp(x[kept] - x[kept].max())
    exact /= exact.sum()
    row = DeviceRow.of(params, v)
    assert np.asarray(_candidate_cut(jnp.asarray(np.maximum(x, -80.0))[None], jnp.asarray([row.top_k]),
                                     jnp.asarray([row.top_p], jnp.float32), 32)[3]).all()   # the fast path is taken

    drawn = {name: np.bincount(_jax_draws(logits, params, n, **kw), minlength=v)
             for name, kw in [("group", {"candidates": 32}), ("default", {}), ("whole", {"candidates": 0})]}
    for name, counts in drawn.items():
        assert set(np.flatnonzero(counts)) <= set(kept.tolist()), name
        assert _chi2_p(counts, exact * n) > 1e-4, name
    for name in ("group", "default"):       # two samples, one distribution: the pooled frequencies as expected
        pooled = (drawn[name] + drawn["whole"]) / (2 * n)
        both = np.concatenate([drawn[name], drawn["whole"]])
        assert _chi2_p(both, np.concatenate([pooled * n, pooled * n])) > 1e-4, name
    assert drawn["group"].tolist() != drawn["whole"].tolist()
