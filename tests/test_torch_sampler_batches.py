"""serving/torch_runtime/sampling.py over batches whose rows differ: mixed top_k / top_p / min_p / min_tokens rows
drawn together, each against the exact distribution the per-slot reference defines (tests/fixtures/
sampler_reference.py), a min_tokens hold that stays on its own row, and a reused slot that keeps nothing of the
request before. Seeds are fixed: every verdict is reproducible (draws are a hash of seed, position and token)."""
from __future__ import annotations

import numpy as np
import pytest

from serving.engine import DeviceRow, SamplingParams

torch = pytest.importorskip("torch")

from serving.torch_runtime.sampling import Sampler  # noqa: E402
from tests.fixtures.sampler_reference import fit, reference_adjust, reference_cut  # noqa: E402

V = 48
EOS = 0
# token 0 55%, 1 22%, 2 18%, the other 45 share 5%
PROBS = np.array([0.55, 0.22, 0.18] + [0.05 / (V - 3)] * (V - 3))
LOGITS = torch.tensor(np.log(PROBS), dtype=torch.float32)

# (params, holding): rows drawn together in one batch
MIXED = [
    # top-k 2 then top-p 0.7: token 0 is 0.55 / 0.77 = 71% of the two kept, so top-p keeps it alone (over three
    # tokens, 58%: top-p would keep token 1 too)
    (SamplingParams(temperature=1.0, top_k=2, top_p=0.7), False),
    (SamplingParams(temperature=1.0, top_k=1), False),
    (SamplingParams(temperature=1.0, top_k=3), False),            # beside a top_k=1 row: still three candidates
    (SamplingParams(temperature=0.8, top_p=0.9), False),          # the whole vocabulary, then top-p
    (SamplingParams(temperature=1.2, top_k=5, top_p=0.95, min_tokens=4, eos_token_ids=(EOS,)), True),
    (SamplingParams(temperature=1.0, min_p=0.1, min_tokens=2, eos_token_ids=(EOS,)), False),
    (SamplingParams(temperature=0.0, min_tokens=3, eos_token_ids=(EOS,)), True),
    (SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=(EOS,)), False),
]


def _sampler(rows: list[SamplingParams], prompts=None, seed_base: int = 40) -> Sampler:
    s = Sampler(len(rows), V, torch.device("cpu"))
    for i, p in enumerate(rows):
        s.set(i, DeviceRow.of(p, V), seed_base + i, prompts[i] if prompts else [V - 1])
    return s


def _draws(s: Sampler, logits: torch.Tensor, holding: list[bool], n: int, first: int = 0) -> np.ndarray:
    """n draws of every slot of `s` ([n, slots]), draw i at position first + i, all in one batch."""
    r = len(holding)
    slots = torch.arange(r).repeat(n)
    drawn = s.choose(logits.expand(r, V).repeat(n, 1), slots, slots.tolist(),
                     torch.arange(first, first + n).repeat_interleave(r), torch.tensor(holding).repeat(n))
    return drawn.reshape(n, r).numpy()


def _exact(params: SamplingParams, holding: bool) -> np.ndarray:
    """The per-slot reference's distribution for one row over LOGITS (no penalties, prompt [V - 1])."""
    row = DeviceRow.of(params, V)
    seen = torch.zeros(V, dtype=torch.bool)
    seen[V - 1] = True
    x = reference_adjust(LOGITS, row, torch.zeros(V, dtype=torch.int32), seen, holding)
    if row.temperature == 0:
        return np.eye(V)[int(x.argmax())]
    return torch.softmax(reference_cut(x, row).double(), 0).numpy()


@pytest.mark.parametrize("whole", [True, False], ids=["with-a-top-p-only-row", "top-k-rows-only"])
def test_a_mixed_batch_draws_each_rows_exact_distribution(whole):
    """Eight rows of different cuts and holds drawn together 4000 times: each row only tokens its own cuts keep, at
    the frequencies the per-slot reference gives (chi-squared, none rejecting at 0.1%). Without the top-p-only row
    every cut row has a top_k, and the batch's candidates are the largest of them."""
    mixed = [(p, h) if whole or p.top_k or p.top_p == 1 else (SamplingParams(temperature=0.0), False)
             for p, h in MIXED]
    drawn = _draws(_sampler([p for p, _ in mixed]), LOGITS, [h for _, h in mixed], 4000)
    for i, (params, holding) in enumerate(mixed):
        exact = _exact(params, holding)
        assert set(drawn[:, i]) <= set(np.nonzero(exact)[0]), params
        if np.count_nonzero(exact > 1e-9) > 1:         # one token: the line above is the whole check
            assert fit(drawn[:, i], exact) > 1e-3, params
    assert set(drawn[:, 0]) == {0}                      # top-k 2 then top-p 0.7: never token 1
    assert set(drawn[:, 2]) == {0, 1, 2}                # top_k 3 beside top_k 1
    assert EOS not in set(drawn[:, 4]) and set(drawn[:, 6]) == {1}     # held rows never stop
    assert set(drawn[:, 7]) == {EOS}                    # its hold is over: its stop is the argmax


def test_a_hold_stays_on_its_row():
    """Greedy rows whose argmax is their stop token: the row still holding never draws it; the row past its
    min_tokens and the row without one (beside the holding row) draw it."""
    rows = [SamplingParams(temperature=0.0, min_tokens=5, eos_token_ids=(EOS,)),
            SamplingParams(temperature=0.0, min_tokens=2, eos_token_ids=(EOS,)),
            SamplingParams(temperature=0.0, eos_token_ids=(EOS,)),
            SamplingParams(temperature=1.0, seed=1, top_k=2, min_tokens=1, eos_token_ids=(EOS,))]
    drawn = _draws(_sampler(rows), LOGITS, [True, False, False, True], 50)
    assert set(drawn[:, 0]) == {1} and set(drawn[:, 1]) == {EOS} and set(drawn[:, 2]) == {EOS}
    assert set(drawn[:, 3]) == {1, 2}


def test_a_reused_slot_keeps_nothing_of_the_request_before():
    """Each slot's previous request (a prompt, penalties with counts, a logit_bias, a min_tokens hold of other ids)
    leaves nothing behind: the next request there draws exactly what it draws in a fresh sampler, and the greedy
    ones the tokens that only a leftover could change."""
    before = [SamplingParams(temperature=0.0, repetition_penalty=3.0),
              SamplingParams(temperature=0.9, seed=3, frequency_penalty=2.0, presence_penalty=1.0,
                             logit_bias=((7, 30.0),)),
              SamplingParams(temperature=0.0, min_tokens=9, eos_token_ids=(EOS,))]
    after = [SamplingParams(temperature=0.0, repetition_penalty=3.0),       # token 0 was in the previous prompt
             SamplingParams(temperature=0.7, seed=5, frequency_penalty=0.5, top_k=4, logit_bias=((3, 1.0),)),
             SamplingParams(temperature=0.0, min_tokens=9, eos_token_ids=(1,))]
    reused = _sampler(before, prompts=[[EOS, 5], [9], [9]])
    reused.count(torch.tensor([1, 1, 1]), torch.tensor([1, 2, 7]), torch.ones(3, dtype=torch.int64))
    _draws(reused, LOGITS, [True] * 3, 5)
    prompts = [[4, 5], [9], [9]]
    for slot, p in enumerate(after):
        reused.set(slot, DeviceRow.of(p, V), 50 + slot, prompts[slot])
    got = _draws(reused, LOGITS, [True] * 3, 400, first=20)
    assert np.array_equal(got, _draws(_sampler(after, prompts=prompts, seed_base=50), LOGITS, [True] * 3, 400, 20))
    assert set(got[:, 0]) == {EOS} and set(got[:, 2]) == {EOS}     # not penalised, not held: the argmax
    assert {0, 1, 2} <= set(got[:, 1]) <= {0, 1, 2, 3}
