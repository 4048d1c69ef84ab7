"""serving/torch_runtime/sampling.py: every slot's next token in one pass, against the per-slot sampler the PyTorch runtime
used before it (tests/fixtures/sampler_reference.py, verbatim in its math): the same distributions, tested
statistically, and a row's draws independent of the batch it is in."""
from __future__ import annotations

import numpy as np
import pytest

from serving.engine import DeviceRow, SamplingParams

torch = pytest.importorskip("torch")

from serving.torch_runtime.sampling import Sampler  # noqa: E402
from tests.fixtures.sampler_reference import (  # noqa: E402
    fit, homogeneity, reference_adjust, reference_cut, reference_sample)

V = 48


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
    return reference_adjust(torch.tensor(logits[case]), row, torch.tensor(counts[case]), seen, held=True), row


def _per_slot(history, case: int, n: int) -> np.ndarray:
    x, row = _adjusted(history, case)
    gen = torch.Generator().manual_seed(1000 + case)
    return np.array([int(reference_sample(x, row, gen)) for _ in range(n)])


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
        kept = set(torch.isfinite(reference_cut(x, row)).nonzero()[:, 0].tolist())
        assert set(ours) <= kept and set(ref) <= kept, params
        assert homogeneity(ours, ref) > 1e-3, params
        exact = torch.softmax(reference_cut(x, row).double(), 0).numpy()     # what the per-slot sampler draws from
        assert fit(ours, exact) > 1e-3 and fit(ref, exact) > 1e-3, params


def test_the_test_tells_a_changed_distribution():
    """The homogeneity test above rejects a sampler whose top-p keeps one token fewer (its power, shown)."""
    rng = np.random.default_rng(2)
    logits = torch.tensor((rng.standard_normal(V) * 1.5).astype(np.float32))
    row = DeviceRow.of(SamplingParams(temperature=1.3, top_p=0.8), V)
    narrow = DeviceRow.of(SamplingParams(temperature=1.3, top_p=0.7), V)
    gen = torch.Generator().manual_seed(3)
    a = np.array([int(reference_sample(logits, row, gen)) for _ in range(4000)])
    b = np.array([int(reference_sample(logits, narrow, gen)) for _ in range(4000)])
    assert homogeneity(a, b) < 1e-3


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
