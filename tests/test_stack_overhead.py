"""benchmarks/stack_overhead.py: the timed engine's GPU timeline, the stack-free bound, and a run through the real
server."""
from __future__ import annotations

import json

import pytest

from benchmarks import stack_overhead as so

A, B = frozenset({0}), frozenset({0, 1})


def test_a_step_launched_ahead_hides_host_time_shorter_than_the_step():
    t = so.Timeline(step_s=4.0, prefill_s=10.0)
    assert t.prompt(0.0) == 10.0
    assert t.step(A, 10.0) == 14.0           # nothing ahead yet: launched now; the next one is queued behind it
    # the host took 1.0 after each token (less than a step): tokens still come one step apart
    assert [t.step(A, at) for at in (15.0, 19.0, 23.0)] == [18.0, 22.0, 26.0]


def test_host_time_longer_than_the_step_shows_and_without_ahead_every_step_starts_at_its_launch():
    t = so.Timeline(step_s=4.0, prefill_s=10.0)
    t.prompt(0.0)
    t.step(A, 10.0)                          # 14; the next queued to end at 18
    assert t.step(A, 20.0) == 18.0           # it was done before the host asked
    assert t.step(A, 30.0) == 24.0           # launched ahead at 20 (GPU free at 18): 24
    plain = so.Timeline(step_s=4.0, prefill_s=10.0, ahead=False)
    plain.prompt(0.0)
    assert [plain.step(A, at) for at in (10.0, 15.0)] == [14.0, 19.0]


def test_a_changed_batch_throws_the_queued_step_away_after_the_gpu_has_run_it():
    t = so.Timeline(step_s=4.0, prefill_s=10.0)
    t.prompt(0.0)
    t.step(A, 10.0)                          # ready 14, A's next queued to 18
    assert t.prompt(14.5) == 28.0            # a joiner's prompt waits for the queued step (18), then 10
    assert t.step(B, 28.5) == 32.5           # nothing queued for B: launched now
    assert t.step(A, 33.0) == 40.5           # B's queued step (ends 36.5) is thrown away, then A's own


def test_the_stack_free_bound_takes_the_prompts_one_after_another():
    one = so.ideal(1, 256, 4.0, 10.0)
    assert one == {"tpot_ms": 4.0, "tok_s": round(256 / ((10 + 255 * 4) / 1000), 1), "prefill_wait_ms_per_token": 0.0}
    eight = so.ideal(8, 256, 4.0, 10.0)
    assert eight["tok_s"] == round(8 * 256 / ((80 + 255 * 4) / 1000), 1)
    # the first request waits for 7 more prompts after its first token, the last for none: 3.5 on average
    assert eight["prefill_wait_ms_per_token"] == round(3.5 * 10 / 255, 3)


def test_the_timed_engine_walks_the_upper_vocabulary_and_has_no_logits():
    eng = so.TimedEngine(so.Timeline(0.001, 0.001), dispatch_s=0.0, slots=2, max_context=64)
    first = eng.start(0, [1, 2], None)
    got = eng.step({0: first, 1: first})
    assert set(got) == {0, 1} and all(so.VOCAB // 2 <= t < so.VOCAB for t in [first, *got.values()])
    with pytest.raises(NotImplementedError, match="no model"):
        eng.logprobs(0)


@pytest.mark.slow
def test_a_run_through_the_real_server_writes_each_stream_counts_figures(tmp_path):
    out = tmp_path / "out"
    assert so.main([str(out), "--streams", "1,2", "--requests", "2", "--max-tokens", "6", "--step-ms", "2",
                    "--prefill-ms", "3"]) == 0
    data = json.loads((out / "stack_overhead.json").read_text())
    assert data["settings"]["streams"] == [1, 2]
    for n, requests in ((1, 2), (2, 2)):
        fig = data[f"streams_{n}"]
        assert fig["wire"]["completed"] == requests and fig["wire"]["output_tokens"] == requests * 6
        assert fig["no_stack"] == so.ideal(n, 6, 2.0, 3.0)
        assert fig["wire"]["tpot_ms"] > 0 and fig["wire_over_no_stack_tok_s"] > 0


def test_bad_settings_are_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        so.main([str(tmp_path), "--max-tokens", "1"])
    assert "--max-tokens >= 2" in capsys.readouterr().err
