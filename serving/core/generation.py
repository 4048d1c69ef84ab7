"""The generation loop, shared by every runtime: a request's budget, stop rules and token times, continuous batching.

A runtime (serving/engine.py) turns token ids into next token ids (it samples on the device, by the contract in
serving/engine.py). When generation stops and what text comes out of each token is decided here, once (the text
itself by serving/core/detokenize.py), so the PyTorch and JAX images answer the same request the same way. `Batch`
keeps a runtime's slots busy: requests join between decode steps and leave when they finish or their client goes
away.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from serving.engine import Engine, SamplingParams, TokenLogprobs, mask_words
from serving.core.detokenize import Detokenizer, StopAutomaton, StopStrings
from serving.shaping.grammar import Matcher
from serving.shaping.tokenizer import TokenizerInfo


# ---------------------------------------------------------------------------------------------- the loop
@dataclass
class Logprob:
    """A generated token's raw logprob and the most likely alternatives', by token text (an echoed prompt's first
    token: no logprob)."""
    token: str
    logprob: float | None
    top: list[tuple[str, float]]


@dataclass
class PromptLogprob:
    """A prompt token's raw logprob given the tokens before it, its rank, and the most likely tokens there
    (id, text, logprob); the first prompt token has none of them (None, None, [])."""
    token_id: int
    token: str
    logprob: float | None
    rank: int | None
    top: list[tuple[int, str, float]]


@dataclass
class Delta:
    """One generated token: the text it released (may be empty), its logprobs when the request asked, and on the
    first one the prompt's (one per prompt token) when the request asked.
    Its time is in Finish.token_times."""
    text: str
    logprob: Logprob | None = None
    prompt: list[PromptLogprob] | None = None


@dataclass
class Finish:
    reason: str                 # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    token_times: list[float]    # monotonic time of each generated token


def _release(stops: StopStrings, detok: Detokenizer) -> tuple[str, bool]:
    """At the end: whatever the detokeniser and the stop-string check still hold back."""
    text, hit = stops.push(detok.flush())
    return (text, True) if hit else (text + stops.flush(), False)


class Generation:
    """One request's state between tokens: its budget, detokeniser, stop strings and token times."""

    def __init__(self, info: TokenizerInfo, prompt_ids: Sequence[int], params: SamplingParams, max_context: int,
                 grammar: Any = None, reveal: frozenset[int] = frozenset(), vocab_size: int | None = None,
                 stops: StopAutomaton | None = None):
        self.info, self.params = info, params
        self.prompt_tokens = len(prompt_ids)
        self.budget = min(params.max_tokens, max_context - len(prompt_ids))
        self.detok = Detokenizer(info, reveal)
        self.stops = StopStrings(params.stop if stops is None else stops, params.include_stop_str)
        self.matcher = Matcher(grammar) if grammar is not None else None
        words = mask_words(vocab_size or info.vocab_size)
        self.allowed = None             # allowed_token_ids as a mask row (serving/engine.py's layout)
        if params.allowed_token_ids:
            bits = np.zeros(words * 32, np.uint8)
            bits[list(params.allowed_token_ids)] = 1
            self.allowed = np.packbits(bits, bitorder="little").view("<i4")
        elif params.bad_words_ids:
            self.allowed = np.full(words, -1, np.int32)
        self.ids: list[int] = []        # generated token ids (what bad_words look back at)
        self.prompt_lps: list[PromptLogprob] | None = None     # start's, until the first Delta carries them
        self.times: list[float] = []

    def mask(self) -> np.ndarray | None:
        """The tokens the request's grammar, allowed_token_ids and bad_words allow next (serving/engine.py's mask);
        None: any. A bad word's last token is banned where the output ends with the rest of it (as vLLM)."""
        grammar = self.matcher.allowed() if self.matcher is not None else None
        mask = self.allowed if grammar is None or self.allowed is None else grammar & self.allowed
        if mask is None:
            return grammar
        banned = [seq[-1] for seq in self.params.bad_words_ids
                  if len(seq) == 1 or tuple(self.ids[len(self.ids) - len(seq) + 1:]) == seq[:-1]]
        if banned:
            mask = mask.copy().view(np.uint32)
            for t in banned:
                mask[t >> 5] &= ~np.uint32(1 << (t & 31))
            mask = mask.view(np.int32)
        return mask

    def push(self, token: int) -> tuple[str, str | None]:
        """Take a generated token: (text it releases, finish reason or None to go on)."""
        self.times.append(time.monotonic())
        self.ids.append(token)
        if self.matcher is not None:
            self.matcher.accept(token)
        done = self.matcher is not None and self.matcher.done     # the grammar took its stop token
        if (done or (token in self.info.stop_ids and not self.params.ignore_eos)
                or token in self.params.stop_token_ids):
            return _release(self.stops, self.detok)[0], "stop"
        delta = self.detok.push(token)
        # before min_tokens tokens are out no stop string ends generation (as vLLM); the runtime holds back the stop ids
        text, hit = self.stops.push(delta) if len(self.times) >= self.params.min_tokens else (delta, False)
        if hit:
            return text, "stop"
        if len(self.times) >= self.budget:
            tail, hit = _release(self.stops, self.detok)
            return text + tail, "stop" if hit else "length"
        return text, None

    def finish(self, reason: str) -> Finish:
        return Finish(reason, self.prompt_tokens, len(self.times), self.times)

    def start(self, engine: Engine, slot: int, prompt_ids: Sequence[int]) -> int:
        """Prefill the prompt into `slot`: the first token (and the prompt's logprobs, for the first Delta)."""
        token = engine.start(slot, prompt_ids, self.params, self.mask())
        if self.params.prompt_logprobs is not None:
            name = self.info.token_text
            self.prompt_lps = [PromptLogprob(prompt_ids[0], name(prompt_ids[0]), None, None, [])] + [
                PromptLogprob(t, name(t), lp.logprob, lp.rank, [(i, name(i), v) for i, v in lp.top])
                for t, lp in zip(prompt_ids[1:], engine.prompt_logprobs(slot))]
        return token

    def delta(self, text: str, token: int | None, engine: Engine, slot: int) -> Delta:
        prompt, self.prompt_lps = self.prompt_lps, None
        if self.params.logprobs is None or token is None:
            return Delta(text, prompt=prompt)
        lp: TokenLogprobs = engine.logprobs(slot)
        name = self.info.token_text
        return Delta(text, Logprob(name(token), lp.logprob, [(name(t), v) for t, v in lp.top]), prompt)

    def prompt_only(self, engine: Engine, slot: int, prompt_ids: Sequence[int]) -> list:
        """No token to generate (max_tokens 0) yet the prompt's logprobs asked: a prefill for them alone."""
        self.start(engine, slot, prompt_ids)
        return [self.delta("", None, engine, slot), self.finish("length")]


def generate(engine: Engine, info: TokenizerInfo, prompt_ids: Sequence[int], params: SamplingParams,
             cancelled: Callable[[], bool] = lambda: False, slot: int = 0,
             grammar: Any = None) -> Iterator[Delta | Finish]:
    """Run one request to the end in one slot (following `grammar`, a serving.shaping.grammar compiled grammar, when
    given). Yields a Delta per generated token, then one Finish."""
    gen = Generation(info, prompt_ids, params, engine.max_context, grammar, vocab_size=engine.vocab_size)
    if gen.budget <= 0 and params.prompt_logprobs is not None and not cancelled():
        yield from gen.prompt_only(engine, slot, prompt_ids)
        return
    if gen.budget <= 0 or cancelled():
        yield gen.finish("length" if gen.budget <= 0 else "abort")
        return
    token = gen.start(engine, slot, prompt_ids)
    while True:
        text, reason = gen.push(token)
        yield gen.delta(text, token, engine, slot)
        if reason:
            break
        if cancelled():
            reason = "abort"
            break
        mask = gen.mask()
        token = engine.step({slot: token}, None if mask is None else {slot: mask})[slot]
    yield gen.finish(reason)


# ------------------------------------------------------------------------------------------ batching
@dataclass
class _Live:
    job: Any
    gen: Generation
    token: int


class Batch:
    """Continuous batching over an engine's slots. A job is anything with `prompt_ids`, `params`, `cancelled`
    (a threading.Event), and optionally `grammar` (serving/shaping/grammar.py; None: unconstrained), `reveal`
    (special token ids the text shows, e.g. TokenizerInfo.tool_markup) and `stops` (params.stop's StopAutomaton,
    built before: none, it is built on the engine thread). `join` prefills a job into a free slot,
    `step` advances every live job by one token; both return the (job, Delta | Finish) events to hand out. A job
    whose client left ends with "abort" at its next token. One thread drives a Batch (the engine's)."""

    def __init__(self, engine: Engine, info: TokenizerInfo):
        self.engine, self.info = engine, info
        self.live: dict[int, _Live] = {}

    @property
    def free(self) -> int:
        return self.engine.slots - len(self.live)

    def join(self, job) -> list[tuple[Any, Delta | Finish]]:
        gen = Generation(self.info, job.prompt_ids, job.params, self.engine.max_context,
                         getattr(job, "grammar", None), getattr(job, "reveal", frozenset()), self.engine.vocab_size,
                         getattr(job, "stops", None))
        slot = next(s for s in range(self.engine.slots) if s not in self.live)
        if gen.budget <= 0 and job.params.prompt_logprobs is not None and not job.cancelled.is_set():
            return [(job, ev) for ev in gen.prompt_only(self.engine, slot, job.prompt_ids)]
        if gen.budget <= 0 or job.cancelled.is_set():
            return [(job, gen.finish("length" if gen.budget <= 0 else "abort"))]
        token = gen.start(self.engine, slot, job.prompt_ids)
        self.live[slot] = _Live(job, gen, token)
        return self._take(slot, token)

    def step(self) -> list[tuple[Any, Delta | Finish]]:
        if not self.live:
            return []
        masks = {slot: m for slot, live in self.live.items() if (m := live.gen.mask()) is not None}
        out = self.engine.step({slot: live.token for slot, live in self.live.items()}, masks or None)
        events = []
        for slot, token in out.items():
            self.live[slot].token = token
            events += self._take(slot, token)
        return events

    def _take(self, slot: int, token: int) -> list[tuple[Any, Delta | Finish]]:
        live = self.live[slot]
        text, reason = live.gen.push(token)
        events: list[tuple[Any, Delta | Finish]] = [(live.job, live.gen.delta(text, token, self.engine, slot))]
        if not reason and live.job.cancelled.is_set():
            reason = "abort"
        if reason:
            del self.live[slot]
            events.append((live.job, live.gen.finish(reason)))
        return events

    def drop_all(self) -> list[Any]:
        """Forget every live job (after a runtime error); returns them."""
        jobs = [live.job for live in self.live.values()]
        self.live.clear()
        return jobs
