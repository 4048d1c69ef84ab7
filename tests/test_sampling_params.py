"""The per-request sampling parameters (logit_bias, min_tokens, stop_token_ids, penalties, min_p, logprobs) on both
runtimes' engines, over the tiny Gemma 4 checkpoint, against a numpy reference of vLLM's sampler applied to
`engine.logits()` (the raw logits behind each token)."""
from __future__ import annotations

import numpy as np
import pytest

from serving.engine import SamplingParams
from serving.core.generation import Delta, generate
from tests.fixtures.batching import Job, every_parameter_jobs, run_in_batch, summary
from tests.fixtures.tolerances import F32_MODEL_REORDERED
from devtools.tiny_gemma4 import ANSWER, QUESTION

RUNTIMES = ["pytorch", "jax"]
LP_ATOL = F32_MODEL_REORDERED   # logprobs against log_softmax of the same engine's logits, from another prefill shape
CROSS_ATOL = 2e-3       # the two runtimes' logprobs (their logits agree within 5e-4: tests/test_jax_runtime.py)


@pytest.fixture(scope="module")
def engines(tiny_gemma4, request):
    from serving.torch_runtime import load
    out = {"pytorch": load(tiny_gemma4), "pytorch_batched": load(tiny_gemma4, slots=3)}
    if _has_jax():
        out["jax"] = request.getfixturevalue("tiny_jax_engine")
    yield out


def _has_jax() -> bool:
    try:
        import jax  # noqa: F401
        return True
    except ImportError:
        return False


@pytest.fixture(params=RUNTIMES)
def engine(request, engines):
    if request.param not in engines:
        pytest.skip("jax not installed")
    return engines[request.param]


@pytest.fixture(scope="module")
def ask(info) -> list[int]:
    return info.chat_prompt([{"role": "user", "content": QUESTION}])


@pytest.fixture(scope="module")
def untrained(info) -> list[int]:
    """A question the fixture was not trained on: its answers are less certain, so penalties show."""
    return info.chat_prompt([{"role": "user", "content": "What is a stop string? " * 3}])


def reference(logits: np.ndarray, p: SamplingParams, prompt: list[int], out: list[int]) -> np.ndarray:
    """vLLM's sampler before the draw, in numpy: logit_bias, min_tokens, then apply_penalties (repetition over
    prompt + output tokens: divide positive logits, multiply negative ones; frequency and presence over the output)."""
    x = logits.astype(np.float32).copy()
    for t, b in p.logit_bias:
        x[t] += b
    if len(out) < p.min_tokens:
        x[list(p.min_tokens_ids())] = -np.inf
    counts = np.bincount(out, minlength=len(x)).astype(np.float32)
    seen = np.zeros(len(x), bool)
    seen[prompt] = True
    seen |= counts > 0
    rep = np.float32(p.repetition_penalty)
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - np.float32(p.frequency_penalty) * counts - np.float32(p.presence_penalty) * (counts > 0)


def run(engine, prompt, p: SamplingParams, n: int, slot: int = 0):
    """n tokens fed back one by one; per token: (token, raw logits behind it, logprobs or None)."""
    out = []
    token = engine.start(slot, prompt, p)
    for i in range(n):
        out.append((token, engine.logits(slot), engine.logprobs(slot) if p.logprobs is not None else None))
        if i + 1 < n:
            token = engine.step({slot: token})[slot]
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


# ------------------------------------------------------------------------------------------------ penalties
def test_penalised_greedy_is_the_argmax_of_vllms_formula(engine, untrained):
    ask = untrained
    plain = [t for t, _, _ in run(engine, ask, SamplingParams(temperature=0.0), 30)]
    for p in (SamplingParams(temperature=0.0, repetition_penalty=1.6),
              SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.7),
              SamplingParams(temperature=0.0, repetition_penalty=0.7, frequency_penalty=-0.4,
                             logit_bias=((5, 3.0), (40, -2.0)))):
        steps = run(engine, ask, p, 30)
        tokens = [t for t, _, _ in steps]
        for i, (token, logits, _) in enumerate(steps):
            want = reference(logits, p, ask, tokens[:i])
            assert token == int(np.argmax(want)), (p, i)
        assert tokens != plain, p                           # the penalties changed what was chosen


def test_a_repeated_tokens_probability_goes_down(engine, ask):
    """The same raw logits, with and without the history: the reference lowers what was generated."""
    p = SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5)
    steps = run(engine, ask, p, 12)
    tokens = [t for t, _, _ in steps]
    logits = steps[-1][1]
    before = np.exp(log_softmax(logits))
    after = np.exp(log_softmax(reference(logits, p, ask, tokens[:-1])))
    for t in set(tokens[:-1]):
        assert after[t] < before[t]


# ---------------------------------------------------------------------------------------- bias, stops, min_p
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_logit_bias_of_100_forces_the_token(engine, ask, temperature):
    p = SamplingParams(temperature=temperature, seed=3, logit_bias=((77, 100.0),))
    assert {t for t, _, _ in run(engine, ask, p, 8)} == {77}


def test_min_tokens_keeps_the_stop_tokens_out(engine, info, ask):
    plain = list(generate(engine, info, ask, SamplingParams(temperature=0.0, max_tokens=200)))
    n = plain[-1].completion_tokens
    assert plain[-1].reason == "stop" and "".join(e.text for e in plain[:-1]) == ANSWER
    p = SamplingParams(temperature=0.0, max_tokens=n + 20, min_tokens=n + 5, eos_token_ids=tuple(info.stop_ids))
    longer = list(generate(engine, info, ask, p))
    assert longer[-1].completion_tokens >= n + 5
    assert "".join(e.text for e in longer[:-1]).startswith(ANSWER[:20])
    # a stop string is looked for only from min_tokens on (as vLLM)
    cut = SamplingParams(temperature=0.0, max_tokens=n, stop=("Reliability",))
    assert "".join(e.text for e in generate(engine, info, ask, cut) if isinstance(e, Delta)) == "Site "
    late = SamplingParams(temperature=0.0, max_tokens=n, stop=("Reliability",), min_tokens=6)
    assert "".join(e.text for e in generate(engine, info, ask, late) if isinstance(e, Delta)) == ANSWER


def test_stop_token_ids_end_generation_like_eos(engine, info, ask):
    steps = run(engine, ask, SamplingParams(temperature=0.0), 6)
    stop = steps[4][0]                      # the fifth token of the answer (not earlier in it)
    first = [t for t, _, _ in steps].index(stop) + 1
    events = list(generate(engine, info, ask, SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=(stop,))))
    assert (events[-1].reason, events[-1].completion_tokens) == ("stop", first)
    # held back by min_tokens like eos: generation goes on past it
    held = SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=(stop,), min_tokens=first + 3,
                          ignore_eos=True)
    assert list(generate(engine, info, ask, held))[-1].completion_tokens >= first + 3


def test_min_p_drops_the_unlikely(engine, ask):
    """At temperature 2 the tiny model's distribution is flat enough that plain sampling picks tokens less likely
    than a quarter of the most likely one; with min_p 0.25 none is."""
    def ratios(p):
        return [np.exp((lg[t] - lg.max()) / p.temperature) for t, lg, _ in run(engine, ask, p, 40)]

    assert min(ratios(SamplingParams(temperature=2.0, seed=11))) < 0.25
    for seed in (11, 12):
        assert min(ratios(SamplingParams(temperature=2.0, seed=seed, min_p=0.25))) >= 0.25 * (1 - 1e-5)


# ------------------------------------------------------------------------------------------------- logprobs
def test_logprobs_are_the_raw_log_softmax(engine, ask):
    p = SamplingParams(temperature=1.0, seed=5, logprobs=5, repetition_penalty=1.3, logit_bias=((9, 4.0),))
    for token, logits, lp in run(engine, ask, p, 15):
        want = log_softmax(logits)
        assert abs(lp.logprob - want[token]) < LP_ATOL
        assert len(lp.top) == 5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, np.sort(want)[::-1][:5], atol=LP_ATOL)
        assert all(abs(want[t] - v) < LP_ATOL for t, v in lp.top)
    none = SamplingParams(temperature=0.0, logprobs=0)
    assert all(lp.top == () for _, _, lp in run(engine, ask, none, 3))


def test_prompt_logprobs_are_the_raw_log_softmax_behind_each_prompt_token(engine, ask):
    """Per prompt token after the first: its logprob given the tokens before it (the logits a prefill of that
    prefix ends with), its rank and the top ones; the first token generated is the same as without them."""
    p = SamplingParams(temperature=0.0, prompt_logprobs=4)
    first = engine.start(0, ask, p)
    got = engine.prompt_logprobs(0)
    assert first == engine.start(0, ask, SamplingParams(temperature=0.0)) and len(got) == len(ask) - 1
    for i, lp in enumerate(got):
        engine.start(1 % engine.slots, ask[:i + 1], SamplingParams(temperature=0.0))
        want = log_softmax(engine.logits(1 % engine.slots))
        token = ask[i + 1]
        assert abs(lp.logprob - want[token]) < LP_ATOL
        assert 1 + (want > want[token] + LP_ATOL).sum() <= lp.rank <= 1 + (want > want[token] - LP_ATOL).sum()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(want)[::-1][:4], atol=LP_ATOL)
        assert all(abs(want[t] - v) < LP_ATOL for t, v in lp.top)
    engine.start(0, ask, SamplingParams(temperature=0.0, prompt_logprobs=0))
    assert all(lp.top == () for lp in engine.prompt_logprobs(0))


def test_jax_and_pytorch_agree_on_greedy_and_logprobs(engines, ask):
    if "jax" not in engines:
        pytest.skip("jax not installed")
    p = SamplingParams(temperature=0.0, logprobs=3, presence_penalty=0.4, logit_bias=((12, 1.5),))
    a, b = (run(engines[rt], ask, p, 25) for rt in RUNTIMES)
    assert [t for t, _, _ in a] == [t for t, _, _ in b]
    for (_, _, x), (_, _, y) in zip(a, b):
        assert abs(x.logprob - y.logprob) < CROSS_ATOL
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        np.testing.assert_allclose([v for _, v in x.top], [v for _, v in y.top], atol=CROSS_ATOL)


# ------------------------------------------------------------------------------------------------ batches
@pytest.mark.parametrize("batched", ["jax", "pytorch_batched"])
def test_batch_gives_each_request_with_these_parameters_what_it_gets_alone(engines, info, ask, batched):
    """Five requests over three slots (two join as others leave), alone and in the batch."""
    if batched not in engines:
        pytest.skip("jax not installed")
    eng = engines[batched]
    other = info.chat_prompt([{"role": "user", "content": "What is a stop string? " * 3}])
    jobs = [*every_parameter_jobs(ask, other, info.stop_ids), Job(ask, SamplingParams(temperature=0.0, max_tokens=30))]
    alone = [summary(list(generate(eng, info, j.prompt_ids, j.params))) for j in jobs]
    assert [summary(events) for events in run_in_batch(eng, info, jobs)] == alone
    assert alone[2][2] >= 45 and alone[4][0] == ANSWER[:len(alone[4][0])]


def test_no_compilation_for_these_parameters(engines, ask):
    if "jax" not in engines:
        pytest.skip("jax not installed")
    from serving.jax_runtime import compile_counts
    eng = engines["jax"]
    before = compile_counts()
    params = [SamplingParams(temperature=0.9, seed=1, min_p=0.1, logprobs=20, logit_bias=((3, 1.0),) * 1),
              SamplingParams(temperature=0.0, repetition_penalty=1.2, min_tokens=5, eos_token_ids=(1, 106)),
              SamplingParams(temperature=0.5, top_k=4, presence_penalty=1.0, frequency_penalty=1.0, seed=2,
                             prompt_logprobs=20)]
    for slot, p in enumerate(params):
        eng.start(slot, ask[: 10 + slot], p)
    for _ in range(3):
        eng.step({s: 7 for s in range(3)})
    run(eng, ask, params[0], 3)
    assert compile_counts() == before
