"""The PyTorch runtime against transformers itself (tests/fixtures/eager_reference.py: every sequence recomputed
eagerly, no cache), not against another of its own engines: one and three slots, the step ahead off and on, at
context lengths that are not powers of two. A bug that both the piped and the plain engine share (min_tokens
ignored in decode steps, its hold off by one, a draw keyed by the wrong position) shows here, and only here."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from serving.engine import SamplingParams  # noqa: E402
from serving.core.generation import generate  # noqa: E402
from tests.fixtures.batching import Job, run_in_batch, summary, torch_engines  # noqa: E402
from tests.fixtures.eager_reference import EagerReference, close_logprobs, eager_model, tokens  # noqa: E402
from tests.fixtures.tolerances import F32_MODEL_REORDERED  # noqa: E402
from devtools.tiny_gemma4 import ANSWER, QUESTION  # noqa: E402

CONTEXTS = (100, 200)                       # neither a power of two: a decode step's span is capped at the cache
VARIANTS = [(slots, piped) for slots in (1, 3) for piped in (False, True)]
# greedy decoding of QUESTION: ANSWER in 87 tokens, then its stop token (the 88th): min_tokens 87 lets it stop
# there, 88 holds it back one token (the fixture's premise, checked below)
STOP_AT = 87


@pytest.fixture(scope="module")
def engines(tiny_gemma4):
    """{(context, slots, pipelined): engine}, and {context: the eager reference's model}."""
    variants = {(c, s, p): (s, p) for c in CONTEXTS for s, p in VARIANTS}
    out = {}
    for context in CONTEXTS:
        with torch_engines(tiny_gemma4, {k: v for k, v in variants.items() if k[0] == context},
                           max_context=context) as got:
            out.update(got)
    yield out, {c: eager_model(tiny_gemma4, c) for c in CONTEXTS}


def _jobs(info) -> list[Job]:
    ask = info.chat_prompt([{"role": "user", "content": QUESTION}])
    other = info.chat_prompt([{"role": "user", "content": "What is a stop string? " * 2}])
    stops = tuple(sorted(info.stop_ids))
    return [Job(ask, SamplingParams(temperature=0.0, max_tokens=200, logprobs=1)),
            Job(ask, SamplingParams(temperature=0.0, max_tokens=200, min_tokens=STOP_AT, eos_token_ids=stops)),
            Job(ask, SamplingParams(temperature=0.0, max_tokens=200, min_tokens=STOP_AT + 1, eos_token_ids=stops,
                                    logprobs=0)),
            Job(other, SamplingParams(temperature=0.9, seed=7, top_k=6, top_p=0.9, max_tokens=40, min_tokens=30,
                                      eos_token_ids=stops, frequency_penalty=0.4, logprobs=2)),
            Job(ask, SamplingParams(temperature=1.1, seed=3, min_p=0.1, max_tokens=25, repetition_penalty=1.3,
                                    logit_bias=((30, 3.0),), logprobs=0))]


@pytest.fixture(scope="module")
def wanted(engines, info) -> list[tuple]:
    """Each job's summary from the eager reference, run alone (context 200: every job ends before it)."""
    reference = EagerReference(engines[1][200], 200)
    return [summary(list(generate(reference, info, j.prompt_ids, j.params))) for j in _jobs(info)]


def test_the_reference_runs_the_fixture_as_its_premise_says(wanted):
    """transformers' greedy answer, its stop at token 88 (min_tokens 87 lets it stop there, 88 holds it back)."""
    greedy, edge, held = wanted[:3]
    assert greedy[:3] == (ANSWER, "stop", STOP_AT + 1)
    assert edge[:3] == (ANSWER, "stop", STOP_AT + 1)
    assert held[0].startswith(ANSWER[:-1]) and held[2] > STOP_AT + 2
    assert wanted[3][2] >= 30 and wanted[4][1] == "length"


@pytest.mark.parametrize("slots,piped", VARIANTS)
def test_a_batch_of_requests_is_their_eager_recompute(engines, info, wanted, slots, piped):
    """Five requests over the engine's slots (joining as others leave), greedy and sampled, min_tokens at the stop
    and one past it, penalties, min_p, logit_bias: each the tokens transformers' eager recompute gives alone."""
    engine = engines[0][200, slots, piped]
    got = [summary(ev) for ev in run_in_batch(engine, info, _jobs(info))]
    for g, w in zip(got, wanted):
        assert tokens(g) == tokens(w)
        assert close_logprobs(g, w)


def _greedy_to_the_end(engine, slot: int, prompt: list[int], params: SamplingParams):
    """Tokens and logits of one sequence stepped (by hand, as a caller may) until it fills the cache, then the
    step that would go past it."""
    out, logits = [engine.start(slot, prompt, params)], [engine.logits(slot)]
    while len(prompt) + len(out) <= engine.max_context:
        out.append(engine.step({slot: out[-1]})[slot])
        logits.append(engine.logits(slot))
    return out, np.stack(logits)


@pytest.fixture(scope="module")
def to_the_end(engines):
    """{context: (prompt, params, the reference's tokens and logits to the last position)}."""
    out = {}
    for context in CONTEXTS:
        prompt = np.random.default_rng(context).integers(3, 512, 30).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=1000, min_tokens=context, eos_token_ids=(1, 106))
        out[context] = prompt, params, _greedy_to_the_end(EagerReference(engines[1][context], context), 0,
                                                          prompt, params)
    return out


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("slots,piped", VARIANTS)
def test_a_sequence_fills_a_context_that_is_no_power_of_two(engines, to_the_end, context, slots, piped):
    """A sequence in the engine's last slot stepped until its last token sits at position max_context - 1 (the
    step ahead is never dispatched past it; full layers attend over the whole cache, not a power of two beyond
    it): every token and its logits are the eager recompute's, and one more step is refused, naming the limit."""
    engine = engines[0][context, slots, piped]
    prompt, params, (want, want_logits) = to_the_end[context]
    slot = slots - 1
    got, got_logits = _greedy_to_the_end(engine, slot, prompt, params)
    assert len(prompt) + len(got) == context + 1         # the last token chosen, at position max_context: not fed
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, atol=F32_MODEL_REORDERED)
    with pytest.raises(ValueError, match=f"exceeds the PyTorch runtime's max_context {context}"):
        engine.step({slot: got[-1]})
