"""devtools/greedy.py: two greedy answers are the same, or part at a near-tie and nowhere else."""
from devtools.greedy import TIE_NATS, Step, parting, steps


def run(*tokens):
    """Steps from (token, logprob, {alternative: logprob}) triples; the chosen token is among its alternatives."""
    return [Step(t, lp, {t: lp, **alt}) for t, lp, alt in tokens]


SURE = ("a", -0.01, {"b": -5.0})


def test_the_same_tokens_agree():
    assert parting(run(SURE, SURE), run(SURE, SURE)) is None


def test_a_parting_at_a_near_tie_is_rounding():
    x = run(SURE, ("b", -0.70, {"c": -0.72}), ("z", -0.1, {}))
    y = run(SURE, ("c", -0.69, {"b": -0.71}), ("q", -3.0, {}))      # after the parting, anything
    assert parting(x, y) is None


def test_a_parting_where_the_model_was_sure_is_a_defect():
    x = run(SURE, ("b", -0.05, {"c": -3.0}))
    y = run(SURE, ("c", -0.70, {"b": -0.72}))
    why = parting(x, y)
    assert why and why.startswith("parted at token 1: 'b'") and "'c'" in why


def test_a_token_missing_from_the_other_runs_alternatives_is_no_tie():
    assert parting(run(("b", -0.5, {})), run(("c", -0.5, {"b": -0.5}))) is not None


def test_the_tie_bound_and_lengths_count():
    near, far = run(("b", -1.0, {"c": -1.0 - TIE_NATS / 2})), run(("b", -1.0, {"c": -1.0 - 2 * TIE_NATS}))
    other = run(("c", -1.0, {"b": -1.0}))
    assert parting(near, other) is None and parting(far, other) is not None
    assert parting(run(SURE), run(SURE, SURE)) == "same tokens, but 1 against 2"


def test_steps_reads_the_openai_chat_shape():
    got = steps({"content": [{"token": "Hi", "logprob": -0.1, "bytes": None,
                              "top_logprobs": [{"token": "Hi", "logprob": -0.1}, {"token": "Yo", "logprob": -2.5}]}]})
    assert got == [Step("Hi", -0.1, {"Hi": -0.1, "Yo": -2.5})]
