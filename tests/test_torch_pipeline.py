"""The PyTorch runtime's step dispatched ahead (serving/torch_runtime/pipeline.py, G5G_TORCH_PIPELINE=1, forced on here: on
a CPU the step ahead just runs early), against the same engine waiting for each step's tokens and against
transformers' eager recompute (tests/fixtures/eager_reference.py): the same tokens, logprobs and finishes, whoever
joins, finishes or is fed something else; and how many steps ahead were thrown away where none must be and where
some must."""
from __future__ import annotations

import numpy as np
import pytest

from serving.engine import SamplingParams
from serving.core.generation import generate
from tests.fixtures.batching import Job, every_parameter_jobs, run_in_batch, summary, torch_engines
from tests.fixtures.eager_reference import EagerReference, close_logprobs, eager_model, tokens
from tests.fixtures.tolerances import F32_MODEL_REORDERED
from devtools.tiny_gemma4 import ANSWER, QUESTION

SLOTS = 3
CONTEXT = 256


@pytest.fixture(scope="module")
def engines(tiny_gemma4):
    """{(slots, pipelined): engine} over the fixture, the pipeline set through the environment."""
    variants = {(slots, piped): (slots, piped) for slots in (1, SLOTS) for piped in (False, True)}
    with torch_engines(tiny_gemma4, variants, max_context=CONTEXT) as out:
        yield out


@pytest.fixture(scope="module")
def reference(tiny_gemma4, engines):
    """Three slots of transformers' eager recompute (after `engines`: torch on one thread)."""
    return EagerReference(eager_model(tiny_gemma4, CONTEXT), CONTEXT, SLOTS)


def _eager(reference, info, jobs) -> list[tuple]:
    return [summary(list(generate(reference, info, j.prompt_ids, j.params))) for j in jobs]


@pytest.fixture(scope="module")
def prompts(info) -> tuple[list[int], list[int]]:
    return (info.chat_prompt([{"role": "user", "content": QUESTION}]),
            info.chat_prompt([{"role": "user", "content": "What is a stop string? " * 3}]))


def _counts(engine) -> tuple[int, int]:
    return engine.speculation["used"], engine.speculation["replaced"]


def _batch(engine, info, jobs):
    return [summary(ev) for ev in run_in_batch(engine, info, [Job(j.prompt_ids, j.params) for j in jobs])]


def test_the_setting_is_on_on_a_gpu_off_on_a_cpu_and_the_variable_wins():
    from serving.torch_runtime.pipeline import pipeline_from_env
    assert pipeline_from_env({}, "cuda") and not pipeline_from_env({}, "cpu")
    assert pipeline_from_env({"G5G_TORCH_PIPELINE": "1"}, "cpu")
    assert not pipeline_from_env({"G5G_TORCH_PIPELINE": "0"}, "cuda")
    with pytest.raises(ValueError, match="G5G_TORCH_PIPELINE: 'yes' is not 0 or 1"):
        pipeline_from_env({"G5G_TORCH_PIPELINE": "yes"})


def test_sequences_that_start_together_take_every_step_ahead(engines, info, prompts, reference):
    """Three greedy sequences in three slots, ending one by one (two at max_tokens, one at its stop token): the
    same as alone and as without the pipeline, and no step ahead thrown away (one that finished is left out)."""
    ask, other = prompts
    jobs = [Job(ask, SamplingParams(temperature=0.0, max_tokens=200)),
            Job(other, SamplingParams(temperature=0.0, max_tokens=7)),
            Job(ask, SamplingParams(temperature=0.0, max_tokens=23))]
    piped, plain = engines[SLOTS, True], engines[SLOTS, False]
    alone = [summary(list(generate(plain, info, j.prompt_ids, j.params))) for j in jobs]
    before = _counts(piped)
    got = _batch(piped, info, jobs)
    taken, dropped = (a - b for a, b in zip(_counts(piped), before))
    assert got == _batch(plain, info, jobs) == alone
    assert [tokens(g) for g in got] == [tokens(w) for w in _eager(reference, info, jobs)]
    assert got[0][:2] == (ANSWER, "stop") and [g[1] for g in got[1:]] == ["length", "length"]
    assert dropped == 0 and taken == got[0][2] - 2            # every step but the first


def test_one_stream_on_the_static_cache_takes_every_step_ahead(engines, info, prompts):
    piped, plain = engines[1, True], engines[1, False]
    p = SamplingParams(temperature=0.7, seed=3, max_tokens=40, ignore_eos=True, logprobs=2)
    before = _counts(piped)
    got = summary(list(generate(piped, info, prompts[1], p)))
    assert got == summary(list(generate(plain, info, prompts[1], p)))
    assert _counts(piped) == (before[0] + 38, before[1])


def test_joins_and_every_sampling_parameter_match_the_engine_that_waits(engines, info, prompts, reference):
    """Seven requests over three slots (four join as others leave: the step ahead, run without them, is thrown
    away), seeded, penalised, min_tokens (one ending exactly where its hold ends), logit_bias, logprobs: the same
    as without the pipeline, as alone and as transformers' eager recompute."""
    ask, other = prompts
    stops = tuple(sorted(info.stop_ids))
    jobs = [*every_parameter_jobs(ask, other, info.stop_ids),
            Job(ask, SamplingParams(temperature=1.0, seed=2, top_k=5, top_p=0.9, max_tokens=30,
                                    frequency_penalty=0.8)),
            # the greedy answer's stop is its 88th token: min_tokens 87 lets it stop there, 88 holds it back
            Job(ask, SamplingParams(temperature=0.0, max_tokens=120, min_tokens=87, eos_token_ids=stops)),
            Job(ask, SamplingParams(temperature=0.0, max_tokens=120, min_tokens=88, eos_token_ids=stops))]
    piped, plain = engines[SLOTS, True], engines[SLOTS, False]
    before = _counts(piped)
    got = _batch(piped, info, jobs)
    taken, dropped = (a - b for a, b in zip(_counts(piped), before))
    assert got == _batch(plain, info, jobs)
    assert got == [summary(list(generate(piped, info, j.prompt_ids, j.params))) for j in jobs]
    want = _eager(reference, info, jobs)
    assert [tokens(g) for g in got] == [tokens(w) for w in want] and all(map(close_logprobs, got, want))
    assert dropped >= 1 and taken > 40


def test_a_token_other_than_the_one_chosen_and_a_mask_throw_the_step_ahead_away(engines, prompts, reference):
    """Fed another token than it chose (penalised: the step ahead's counts are taken back out), then a mask, then
    a new sequence in the slot: each time the engine computes what the waiting one does."""
    from serving.engine import mask_words
    ask = prompts[0]
    p = SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5, max_tokens=100)
    piped, plain = engines[SLOTS, True], engines[SLOTS, False]
    allow = np.zeros(mask_words(piped.vocab_size) * 32, np.uint8)
    allow[[77, 78]] = 1
    mask = np.packbits(allow, bitorder="little").view("<i4")

    def play(engine):
        out = [engine.start(2, ask, p)]
        for i in range(12):
            fed = out[-1] if i != 4 else (out[-1] + 1) % engine.vocab_size        # step 4 feeds another token
            masks = {2: mask} if i == 8 else None
            out.append(engine.step({2: fed}, masks)[2])
            if i == 8:
                assert out[-1] in (77, 78)
                counts = engine.sampler.counts[2].clone()   # what the penalties read (a step ahead counted too)
        out.append(engine.start(2, ask[:-3], p))
        for _ in range(2):
            out.append(engine.step({2: out[-1]})[2])
        logits = engine.logits(2)
        engine.start(0, ask[:5], p)         # a sequence in another slot: the step ahead (slot 2's) is taken back
        return out, logits, (counts, engine.sampler.counts[2].clone())

    piped.start(2, ask, p)              # a step ahead that an earlier test's last request left: thrown away here
    before = _counts(piped)
    (got, logits, counts), (want, want_logits, want_counts) = play(piped), play(plain)
    eager, eager_logits, _ = play(reference)
    assert got == want == eager
    np.testing.assert_allclose(logits, eager_logits, atol=F32_MODEL_REORDERED)
    assert [c.sum() for c in counts] == [9, 2] and all((a == b).all() for a, b in zip(counts, want_counts))
    np.testing.assert_array_equal(logits, want_logits)      # same rows and kernels, one thread: the same sums
    taken, dropped = (a - b for a, b in zip(_counts(piped), before))
    assert dropped == 4 and taken == 12 - 1 - 3 + 1      # fed other, mask, 2 starts; after the mask: none ahead


def test_a_sequence_stepped_past_its_max_tokens_keeps_its_cache(engines, prompts, reference):
    """max_tokens is the generation loop's to enforce: a caller may step a sequence on past it. The step ahead
    (dispatched for the other sequence, which goes on) feeds it at its next position too, not as a free row."""
    piped, plain = engines[SLOTS, True], engines[SLOTS, False]

    def play(engine):
        live = {0: engine.start(0, prompts[0], SamplingParams(temperature=0.0, max_tokens=3)),
                1: engine.start(1, prompts[1], SamplingParams(temperature=0.0, max_tokens=100))}
        seen = []
        for _ in range(10):
            live = engine.step(live)
            seen.append((dict(live), engine.logits(0)))
        return seen

    for (got, got_logits), (want, want_logits), (eager, eager_logits) in zip(play(piped), play(plain),
                                                                            play(reference)):
        assert got == want == eager
        np.testing.assert_array_equal(got_logits, want_logits)      # same rows and kernels: bit for bit
        np.testing.assert_allclose(got_logits, eager_logits, atol=F32_MODEL_REORDERED)
