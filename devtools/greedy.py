"""Two greedy answers compared token by token, where floating point may part them and nothing else may.

On a GPU in float16, one row's logits depend on the shapes it was computed with: another batch size picks another
GEMM kernel, another KV length bucket another reduction order. Two runs of the same greedy request then agree until a
step where the top two tokens are within rounding of each other, and may take different ones from there (the gpu
suite saw this after 50-60 tokens of the tiny checkpoint's ignore-eos babble, on an H100, 2026-12-06). A defect (a row
reading another row's KV, a wrong position) parts them where the model was sure. So: equal, or parted at a near-tie.
"""
from __future__ import annotations

from dataclasses import dataclass

# How close (nats) the two tokens must be, in each run's own logprobs, where the runs part: well above float16
# rounding of a logit (~0.01 at |logit| ~ 10), well below a margin the model means.
TIE_NATS = 0.1


@dataclass(frozen=True)
class Step:
    token: str
    logprob: float
    top: dict[str, float]        # the alternatives the server listed (top_logprobs), the chosen one among them


def steps(logprobs: dict) -> list[Step]:
    """The steps of an OpenAI chat choice's `logprobs` ({"content": [{token, logprob, top_logprobs}]})."""
    return [Step(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]})
            for e in logprobs["content"]]


def parting(a: list[Step], b: list[Step], tie: float = TIE_NATS) -> str | None:
    """None if `a` and `b` are the same tokens, or first differ where each run had the other's token within `tie`
    nats of its own; else one line: where they part and by what margins."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x.token == y.token:
            continue
        margins = (x.logprob - x.top.get(y.token, float("-inf")), y.logprob - y.top.get(x.token, float("-inf")))
        if max(margins) <= tie:
            return None
        return (f"parted at token {i}: {x.token!r} (margins {margins[0]:.3g}) vs {y.token!r} ({margins[1]:.3g} nats), "
                f"more than a near-tie ({tie} nats); same before: {''.join(s.token for s in a[:i])[-60:]!r}")
    return None if len(a) == len(b) else f"same tokens, but {len(a)} against {len(b)}"
