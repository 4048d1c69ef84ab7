"""serving/torch_runtime/sampling.py: every slot's next token in one pass, against the per-slot sampler the PyTorch runtime
used before it (kept below as the reference, verbatim in its math): the same distributions, tested statistically,
and a row's draws independent of the batch it is in."""
from __future__ import annotations

import numpy as np
import pytest

from serving.engine import DeviceRow, SamplingParams

torch = pytest.importorskip("torch")

from serving.torch_runtime.sampling import FLOOR, Sampler  # noqa: E402

V = 48


def _reference_adjust(logits, row: DeviceRow, counts, seen, held: bool):
    """The per-slot adjustments (serving/torch_runtime/engine.py before the batched sampler)."""
    x = logits
    held_ids = list(row.held) if held else []
    if row.bias or held_ids:
        x = x.clone()
        if row.bias:
            x.index_add_(0, torch.tensor([t for t, _ in row.bias]), torch.tensor([b for _, b in row.bias]))
        x[held_ids] = -torch.inf
    if row.penalised:
        out = counts > 0
        rep = row.repetition
        x = torch.where(seen | out, torch.where(x > 0, x / rep, x * rep), x)
        x = x - row.frequency * counts - row.presence * out
    if row.min_p > 0:
        x = torch.where(x < x.max() + float(np.float32(row.temperature * np.log(np.float32(row.min_p)))),
                        -torch.inf, x)
    return x


def _reference_cut(logits, row: DeviceRow):
    """The per-slot cuts: tempered logits, -inf outside top-k then top-p (a full sort)."""
    x = ((logits - logits.max()) / row.temperature).clamp_min(FLOOR)
    if row.top_k or row.top_p < 1.0:
        top = x.sort(descending=True).values
        if row.top_k:
            top = top[: row.top_k]
        mass = torch.softmax(top, 0).cumsum(0)
        n = int((mass < row.top_p).sum()) + 1 if row.top_p < 1.0 else top.numel()
        x = torch.where(x >= top[min(n, top.numel()) - 1], x, -torch.inf)
    return x


def _reference_sample(logits, row: DeviceRow, gen):
    """The per-slot draw: exponential noise from the slot's torch.Generator."""
    if row.temperature <= 0.0:
        return logits.argmax()
    x = _reference_cut(logits, row)
    q = torch.empty_like(x).exponential_(generator=gen)
    return (x - q.log()).argmax()


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=7),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.8, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3,
                   logit_bias=((5, 2.0), (9, -3.0))),
    SamplingParams(temperature=1.1, top_k=20, min_tokens=3, eos_token_ids=(0, 1), stop_token_ids=(2,)),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
]


@pytest.fixture(scope="module")
def history():
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((len(CASES), V)) * 1.5).astype(np.float32)
    counts = (rng.integers(0, 3, (len(CASES), V)) * (rng.random((len(CASES), V)) < 0.2)).astype(np.int32)
    prompts = [rng.integers(0, V, 6).tolist() for _ in CASES]
    return logits, counts, prompts


def _batched(history, n: int, seed_base: int = 0) -> np.ndarray:
    """n draws for every case ([n, cases]), draw i at position i: one pass over n x cases rows of the slots."""
    logits, counts, prompts = history
    c = len(CASES)
    s = Sampler(c, V, torch.device("cpu"))
    for i, p in enumerate(CASES):
        s.set(i, DeviceRow.of(p, V), seed_base + i, prompts[i])
    s.counts[:] = torch.tensor(counts)
    rows = torch.arange(c).repeat(n)
    x = torch.tensor(logits).repeat(n, 1)
    drawn = s.choose(x, rows, list(range(c)), torch.arange(n).repeat_interleave(c), torch.ones(n * c, dtype=bool))
    return drawn.reshape(n, c).numpy()


def _adjusted(history, case: int):
    logits, counts, prompts = history
    row = DeviceRow.of(CASES[case], V)
    seen = torch.zeros(V, dtype=torch.bool)
    seen[prompts[case]] = True
    return _reference_adjust(torch.tensor(logits[case]), row, torch.tensor(counts[case]), seen, held=True), row


def _per_slot(history, case: int, n: int) -> np.ndarray:
    x, row = _adjusted(history, case)
    gen = torch.Generator().manual_seed(1000 + case)
    return np.array([int(_reference_sample(x, row, gen)) for _ in range(n)])


def _homogeneity(a: np.ndarray, b: np.ndarray) -> float:
    """chi-squared p-value that two samples of tokens come from one distribution; tokens seen fewer than 20 times
    in both together share one cell (the test's expected counts stay large)."""
    tokens, both = np.unique(np.concatenate([a, b]), return_counts=True)
    big = tokens[both >= 20]
    cells = lambda d: [np.sum(d == t) for t in big] + [np.sum(~np.isin(d, big))]  # noqa: E731
    table = np.array([cells(a), cells(b)], np.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    return _chi2_tail(stat, table.shape[1] - 1)


def _chi2_tail(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _fit(drawn: np.ndarray, p: np.ndarray) -> float:
    """chi-squared goodness-of-fit p-value of tokens drawn against probabilities p [V] (cells of expected count
    under 20 share one)."""
    expected = p * len(drawn)
    big = np.nonzero(expected >= 20)[0]
    observed = np.array([np.sum(drawn == t) for t in big] + [np.sum(~np.isin(drawn, big))], np.float64)
    expected = np.append(expected[big], len(drawn) - expected[big].sum())
    keep = expected > 1e-9
    return _chi2_tail(float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1)


def test_batched_draws_follow_the_per_slot_distributions(history):
    """Each case's 10 000 batched draws against 4000 of the per-slot sampler: only tokens the per-slot cuts keep, a
    chi-squared test of homogeneity, and each against the exact distribution the per-slot code defines, none
    rejecting at 0.1% (fixed seeds: a reproducible verdict)."""
    n = 10000
    batched = _batched(history, n)
    for case, params in enumerate(CASES):
        ours, ref = batched[:, case], _per_slot(history, case, 4000)
        x, row = _adjusted(history, case)
        if params.temperature == 0:
            assert set(ours) == set(ref) == {int(x.argmax())}
            continue
        kept = set(torch.isfinite(_reference_cut(x, row)).nonzero()[:, 0].tolist())
        assert set(ours) <= kept and set(ref) <= kept, params
        assert _homogeneity(ours, ref) > 1e-3, params
        exact = torch.softmax(_reference_cut(x, row).double(), 0).numpy()     # what the per-slot sampler draws from
        assert _fit(ours, exact) > 1e-3 and _fit(ref, exact) > 1e-3, params


def test_the_test_tells_a_changed_distribution():
    """The homogeneity test above rejects a sampler whose top-p keeps one token fewer (its power, shown)."""
    rng = np.random.default_rng(2)
    logits = torch.tensor((rng.standard_normal(V) * 1.5).astype(np.float32))
    row = DeviceRow.of(SamplingParams(temperature=1.3, top_p=0.8), V)
    narrow = DeviceRow.of(SamplingParams(temperature=1.3, top_p=0.7), V)
    gen = torch.Generator().manual_seed(3)
    a = np.array([int(_reference_sample(logits, row, gen)) for _ in range(4000)])
    b = np.array([int(_reference_sample(logits, narrow, gen)) for _ in range(4000)])
    assert _homogeneity(a, b) < 1e-3


def test_a_rows_draws_do_not_depend_on_its_batch(history):
    """Seeded draws depend on (seed, position) alone: a case drawn alone gives what it gives in the batch."""
    logits, counts, prompts = history
    together = _batched(history, 40)
    for case in (0, 3, 6):
        s = Sampler(3, V, torch.device("cpu"))
        s.set(2, DeviceRow.of(CASES[case], V), case, prompts[case])
        s.counts[2] = torch.tensor(counts[case])
        x = torch.tensor(logits[case:case + 1])
        alone = [int(s.choose(x, torch.tensor([2]), [2], torch.tensor([i]), torch.ones(1, dtype=torch.bool))[0])
                 for i in range(40)]
        assert alone == together[:, case].tolist()
    assert not np.array_equal(_batched(history, 40, seed_base=100), together)   # another seed, other draws


def test_hashed_noise_is_standard_gumbel():
    """The noise behind the draws: mean Euler's gamma, variance pi^2 / 6, no correlation between neighbours."""
    from serving.torch_runtime.sampling import gumbel, row_keys, _mix

    keys = row_keys(torch.tensor([[0, 7], [1, 7], [0, 8]]), torch.tensor([0, 0, 5]))
    g = gumbel(keys, _mix(torch.arange(200_000))).double()
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.var() - np.pi ** 2 / 6) < 0.03
    assert abs(np.corrcoef(g[0, 1:].numpy(), g[0, :-1].numpy())[0, 1]) < 0.01
    assert abs(np.corrcoef(g[0].numpy(), g[1].numpy())[0, 1]) < 0.01
