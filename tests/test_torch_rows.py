"""The PyTorch runtime decodes the live rows only: a step takes the first rows() slots, so a lone stream on an 8-slot
engine decodes two rows when its decode step is compiled (attention.ROWS: no rung of 1, it would be a compile of its
own) and one when it is eager (EAGER_ROWS: a CPU's GEMV), never eight. Each test runs both ladders on an eager engine
(the ladder is the engine's `_steps`). Observed at the model's call (the rows it is fed), at SlotKV.update (the K/V rows each layer writes and reads) and at the sampler (the logits' rows), with the
step dispatched ahead on and off; the answers are those of the same requests alone, and of transformers' eager
recompute (tests/fixtures/eager_reference.py)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from serving.engine import SamplingParams  # noqa: E402
from serving.core.generation import generate  # noqa: E402
from serving.torch_runtime.attention import EAGER_ROWS, ROWS, ladder, rows  # noqa: E402
from tests.fixtures.batching import Job, run_in_batch, summary, torch_engines  # noqa: E402
from tests.fixtures.eager_reference import EagerReference, eager_model  # noqa: E402
from tests.fixtures.tolerances import F32_MODEL_REORDERED  # noqa: E402
from devtools.tiny_gemma4 import ANSWER, QUESTION  # noqa: E402

SLOTS = 8
CONTEXT = 128
GREEDY = SamplingParams(temperature=0.0)


def test_a_step_takes_the_smallest_rung_above_its_highest_live_slot():
    assert [rows([s], 8) for s in range(8)] == [2, 2, 4, 4, 8, 8, 8, 8]
    assert rows([0, 3], 8) == 4 and rows([2, 0], 8) == 4 and rows([0, 1, 2, 3, 4], 8) == 8
    assert [rows([s], 3) for s in range(3)] == [2, 2, 3]           # capped at the slots, the top rung
    assert [rows([s], 12) for s in (7, 8, 11)] == [8, 12, 12]
    assert rows([0], 1) == 1
    assert ladder(8) == (2, 4, 8) and ladder(3) == (2, 3) and ladder(12) == (2, 4, 8, 12) and ladder(1) == (1,)
    assert ladder(2) == (2,) and rows([0], 2) == 2
    assert {rows([s], n) for n in (1, 3, 8, 12) for s in range(n)} <= {b for n in (1, 3, 8, 12) for b in ladder(n)}
    # eager: a lone stream in slot 0 takes one row
    assert [rows([s], 8, EAGER_ROWS) for s in range(8)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert ladder(8, EAGER_ROWS) == (1, 2, 4, 8) and ladder(2, EAGER_ROWS) == (1, 2) and ladder(1, EAGER_ROWS) == (1,)


def test_the_ladder_follows_the_compile(tiny_gemma4, monkeypatch):
    """A compiled decode step takes ROWS (loading compiles nothing yet), an eager one EAGER_ROWS; the warm-up visits
    every rung."""
    from serving.torch_runtime import load

    for mode, steps, warm in [("always", ROWS, (1, 3, 7)), ("0", EAGER_ROWS, (0, 1, 3, 7))]:
        monkeypatch.setenv("G5G_TORCH_COMPILE", mode)
        engine = load(tiny_gemma4, slots=SLOTS, max_context=CONTEXT)
        assert (engine._steps, engine.warm_slots) == (steps, warm)


def test_torch_runs_on_one_thread_in_the_tests():
    """tests/conftest.py sets it before torch loads: a float32 result does not depend on the machine's core count."""
    assert torch.get_num_threads() == 1


@pytest.fixture(scope="module")
def loaded(tiny_gemma4):
    """{pipelined: an 8-slot engine}, the step ahead set through the environment."""
    with torch_engines(tiny_gemma4, {piped: (SLOTS, piped) for piped in (False, True)}, max_context=CONTEXT) as out:
        yield out


@pytest.fixture(params=[ROWS, EAGER_ROWS], ids=["compiled_ladder", "eager_ladder"])
def engines(loaded, request, monkeypatch):
    """The module's engines, decoding on the compiled step's ladder and on the eager one's."""
    for engine in loaded.values():
        monkeypatch.setattr(engine, "_steps", request.param)
    return loaded


def lone(engine) -> int:
    """Rows a lone stream in slot 0 decodes on `engine`'s ladder."""
    return rows([0], SLOTS, engine._steps)


class Rows:
    """What each decode step of `engine` took, per step dispatched: the rows fed to the model, the rows of K/V each
    layer wrote and attended over, the rows of logits the sampler chose from."""

    def __init__(self, engine, mp: pytest.MonkeyPatch):
        self.fed, self.kv, self.sampled = [], set(), []
        decode, update, choose = engine._decode, engine._kv.update, engine.sampler.choose

        def fed(**kw):
            self.fed.append(kw["input_ids"].shape[0])
            return decode(**kw)

        def kv(key, value, layer, *a):
            k, v = update(key, value, layer, *a)
            if engine._kv._pos is not None:           # a decode step (a prompt writes one slot)
                self.kv.add((len(self.fed), key.shape[0], k.shape[0], v.shape[0]))
            return k, v

        def sampled(logits, *a, **kw):
            self.sampled.append(logits.shape[0])
            return choose(logits, *a, **kw)

        mp.setattr(engine, "_decode", fed)
        mp.setattr(engine._kv, "update", kv)
        mp.setattr(engine.sampler, "choose", sampled)

    def steps(self) -> list[int]:
        """Rows per decode step dispatched, checked the same at the model, K/V and the sampler."""
        assert self.kv == {(i + 1, b, b, b) for i, b in enumerate(self.fed)}
        assert [b for b in self.sampled if b > 1] == [b for b in self.fed if b > 1]    # prompts sample 1 row
        return self.fed


@pytest.mark.parametrize("piped", [False, True])
def test_a_lone_stream_decodes_the_lowest_rung(engines, info, piped, monkeypatch):
    engine = engines[piped]
    seen = Rows(engine, monkeypatch)
    ask = info.chat_prompt([{"role": "user", "content": QUESTION}])
    got = summary(run_in_batch(engine, info, [Job(ask, SamplingParams(temperature=0.0, max_tokens=200))])[0])
    assert got[:2] == (ANSWER, "stop")
    steps = seen.steps()
    assert steps == [lone(engine)] * len(steps) and len(steps) == got[2] - 1 + piped    # + the step ahead not taken
    assert engine._kv.k[0].shape[0] == SLOTS                                        # the cache keeps every slot


@pytest.mark.parametrize("piped", [False, True])
def test_streams_in_slots_0_and_3_decode_4_rows_and_get_what_they_get_alone(engines, piped, monkeypatch, tiny_gemma4):
    """Two sequences in slots 0 and 3 (the rows between are free, fed at position 0): four rows a step, then two
    once slot 3 leaves; every step's logits and tokens those of each sequence decoded alone in slot 0, which are
    transformers' eager recompute's."""
    engine = engines[piped]
    prompts = {0: [2, 5, 6, 7, 9, 11], 3: [2, 40, 41, 42]}

    def alone(slot, engine=engine):
        tokens = [engine.start(0, prompts[slot], GREEDY)]
        logits = [engine.logits(0)]
        for _ in range(12 if slot == 0 else 5):
            tokens.append(engine.step({0: tokens[-1]})[0])
            logits.append(engine.logits(0))
        return tokens, logits

    want = {s: alone(s) for s in prompts}
    reference = EagerReference(eager_model(tiny_gemma4, CONTEXT), CONTEXT)
    for s in prompts:
        eager = alone(s, reference)
        assert want[s][0] == eager[0]
        np.testing.assert_allclose(np.stack(want[s][1]), np.stack(eager[1]), atol=F32_MODEL_REORDERED)
    seen = Rows(engine, monkeypatch)
    live = {s: engine.start(s, p, GREEDY) for s, p in prompts.items()}
    got = {s: ([t], [engine.logits(s)]) for s, t in live.items()}
    for i in range(12):
        if i == 5:
            del live[3]                                      # slot 3 leaves: its slot is free from here
        live = engine.step(live)
        for s, t in live.items():
            got[s][0].append(t)
            got[s][1].append(engine.logits(s))
    for s in prompts:
        assert got[s][0] == want[s][0]
        np.testing.assert_allclose(np.stack(got[s][1]), np.stack(want[s][1]), atol=F32_MODEL_REORDERED)   # 4 rows, 1
    # with the step ahead: the one dispatched at 4 rows before slot 3 left is taken, then 2 rows
    assert seen.steps() == [4] * (5 + piped) + [lone(engine)] * 7


def test_a_stream_that_joins_throws_the_step_ahead_at_one_row_away(engines, info):
    """A lone stream decodes its rung (one row or two) with a step dispatched ahead; a second joins in slot 1: that
    step ahead (which ran without it) is thrown away and counted, and both answers are those of the engine that
    waits."""
    ask = info.chat_prompt([{"role": "user", "content": QUESTION}])
    jobs = [Job(ask, SamplingParams(temperature=0.0, max_tokens=12)),
            Job(ask, SamplingParams(temperature=0.9, seed=5, max_tokens=8, logprobs=1))]

    def play(engine):
        seen = Rows(engine, mp)
        first = engine.start(0, jobs[0].prompt_ids, jobs[0].params)
        out = {0: [first]}
        for _ in range(3):
            out[0].append(engine.step({0: out[0][-1]})[0])
        before = dict(engine.speculation)
        out[1] = [engine.start(1, jobs[1].prompt_ids, jobs[1].params)]
        dropped = engine.speculation["replaced"] - before["replaced"]
        live = {0: out[0][-1], 1: out[1][-1]}
        for _ in range(6):
            live = engine.step(live)
            for s, t in live.items():
                out[s].append(t)
        return out, dropped, seen.steps()

    mp = pytest.MonkeyPatch()
    try:
        got, dropped, steps = play(engines[True])
        want, none, waited = play(engines[False])
    finally:
        mp.undo()
    assert got == want and (dropped, none) == (1, 0)
    one = lone(engines[True])
    assert waited == [one] * 3 + [2] * 6 and steps == [one] * 4 + [2] * 7   # + a step ahead thrown away, one left
    alone = [summary(list(generate(engines[True], info, j.prompt_ids, j.params))) for j in jobs]
    assert [summary(ev) for ev in run_in_batch(engines[True], info, jobs)] == alone


def test_the_boot_warm_up_decodes_every_row_count(engines, tiny_gemma4):
    """serving/api/app.py's warm-up steps a lone sequence in each of the engine's warm_slots: every rung of the ladder,
    so no row count reaches the compiled step first under traffic."""
    from devtools.server import in_thread, wait_ready
    from serving.api.app import create_app

    engine = engines[True]
    assert engine.warm_slots == tuple(b - 1 for b in ladder(SLOTS, engine._steps))
    mp = pytest.MonkeyPatch()
    seen = Rows(engine, mp)
    try:
        with in_thread(create_app(lambda: engine, tiny_gemma4)) as url:
            assert wait_ready(f"{url}/health", timeout=60) is not None
    finally:
        mp.undo()
    assert sorted(set(seen.steps())) == list(ladder(SLOTS, engine._steps))


@pytest.mark.slow
def test_one_compile_serves_every_row_count(loaded, monkeypatch):
    """The rows dimension reaches the compiled step marked dynamic, and no step takes a single row (which
    torch.compile would specialise): one compile, whichever count comes first; then none, at any span."""
    from torch._dynamo.testing import CompileCounter

    engine = loaded[False]
    monkeypatch.setattr(engine, "_steps", ROWS)
    torch._dynamo.reset()
    counter = CompileCounter()
    engine._decode, engine._decode_checked = torch.compile(engine.model.__call__, backend=counter), True
    try:
        counts = []
        for slot in (7, 3, 1, 0, 1, 7):
            engine.step({slot: engine.start(slot, [2, 5, 6], GREEDY)})
            counts.append(counter.frame_count)
        assert counts == [1, 1, 1, 1, 1, 1]
        prompt = np.random.default_rng(3).integers(0, 512, 62).tolist()
        live = {s: engine.start(s, prompt, GREEDY) for s in (0, 2)}      # 4 rows, past a span of 64
        for _ in range(4):
            live = engine.step(live)
        assert counter.frame_count == 1
    finally:
        engine._decode = engine.model.__call__
        torch._dynamo.reset()
