"""The generation loop, shared by every runtime: stop rules, incremental detokenisation, continuous batching.

A runtime (serving/engine.py) turns token ids into next token ids (it samples on the device, by the contract in
serving/engine.py). When generation stops and what text comes out of each token is decided here, once, so the
PyTorch and JAX images answer the same request the same way. `Batch` keeps a runtime's slots busy: requests join
between decode steps and leave when they finish or their client goes away.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from serving.engine import Engine, SamplingParams

# Gemma 4's control tokens that shape the output (see the checkpoint's tokenizer.json).
TURN_END = "<turn|>"                            # end of a dialogue turn: always a stop token
THOUGHT_START, THOUGHT_END = "<|channel>", "<channel|>"   # the thinking channel: never shown to the client


# ------------------------------------------------------------------------------------------ tokenisation
@dataclass
class TokenizerInfo:
    """The checkpoint's tokenizer plus what the generation loop needs to know about its special tokens."""
    tokenizer: object
    stop_ids: frozenset[int]
    hidden_ids: frozenset[int]          # special tokens: never detokenised for the client
    thought_start: int | None
    thought_end: int | None
    default_sampling: dict = field(default_factory=dict)
    # transformers' fast tokenizer reconfigures its Rust backend on every encode; concurrent use from the event
    # loop (prompts) and the engine thread (detokenising) can fail with "Already borrowed". One lock for both.
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def load(cls, model_dir: str | Path) -> "TokenizerInfo":
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        hidden = {i for i, t in tok.added_tokens_decoder.items() if t.special} | set(tok.all_special_ids)
        vocab = tok.get_vocab()
        stop = set()
        gen: dict = {}
        gen_path = model_dir / "generation_config.json"
        if gen_path.exists():
            gen = json.loads(gen_path.read_text())
            eos = gen.get("eos_token_id")
            stop |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tok.eos_token_id is not None:
            stop.add(tok.eos_token_id)
        if TURN_END in vocab:
            stop.add(vocab[TURN_END])
        # Defaults a request doesn't set come from the checkpoint, as with vLLM's `--generation-config auto`;
        # `do_sample: false` means greedy.
        defaults = {}
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0
        for key in ("temperature", "top_p", "top_k"):
            if gen.get("do_sample") is not False and gen.get(key) is not None:
                defaults[key] = gen[key]
        return cls(tok, frozenset(stop), frozenset(hidden), vocab.get(THOUGHT_START), vocab.get(THOUGHT_END),
                   defaults)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of the conversation rendered with the checkpoint's own chat template."""
        with self.lock:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)


class Detokenizer:
    """Turns generated token ids into text deltas: never splits a UTF-8 character across deltas, never shows
    special tokens or what the model writes inside a thought block."""

    def __init__(self, info: TokenizerInfo):
        self.info = info
        self.ids: list[int] = []       # visible ids so far
        self.prefix = 0                # ids[prefix:read] is already-emitted context used to decode the next delta
        self.read = 0
        self.in_thought = False

    def _decode(self, ids: Sequence[int]) -> str:
        with self.info.lock:
            return self.info.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        if token_id == self.info.thought_start:
            self.in_thought = True
            return ""
        if token_id == self.info.thought_end:
            self.in_thought = False
            return ""
        if self.in_thought or token_id in self.info.hidden_ids:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the bytes that complete it.
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """What is still held back when generation ends (an incomplete character stays U+FFFD)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


class StopStrings:
    """Holds back text that might be the start of a stop string; cuts the text at the first stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0

    def push(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to send, whether a stop string was hit)."""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, False
        search_from = max(0, self.sent - max(map(len, self.stops)))
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            out, self.sent = self.text[self.sent:cut], cut
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


# ---------------------------------------------------------------------------------------------- the loop
@dataclass
class Delta:
    """One generated token: the text it released (may be empty). Its time is in Finish.token_times."""
    text: str


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

    def __init__(self, info: TokenizerInfo, prompt_ids: Sequence[int], params: SamplingParams, max_context: int):
        self.info, self.params = info, params
        self.prompt_tokens = len(prompt_ids)
        self.budget = min(params.max_tokens, max_context - len(prompt_ids))
        self.detok = Detokenizer(info)
        self.stops = StopStrings(params.stop)
        self.times: list[float] = []

    def push(self, token: int) -> tuple[str, str | None]:
        """Take a generated token: (text it releases, finish reason or None to go on)."""
        self.times.append(time.monotonic())
        if token in self.info.stop_ids and not self.params.ignore_eos:
            return _release(self.stops, self.detok)[0], "stop"
        text, hit = self.stops.push(self.detok.push(token))
        if hit:
            return text, "stop"
        if len(self.times) >= self.budget:
            tail, hit = _release(self.stops, self.detok)
            return text + tail, "stop" if hit else "length"
        return text, None

    def finish(self, reason: str) -> Finish:
        return Finish(reason, self.prompt_tokens, len(self.times), self.times)


def generate(engine: Engine, info: TokenizerInfo, prompt_ids: Sequence[int], params: SamplingParams,
             cancelled: Callable[[], bool] = lambda: False, slot: int = 0) -> Iterator[Delta | Finish]:
    """Run one request to the end in one slot. Yields a Delta per generated token, then one Finish."""
    gen = Generation(info, prompt_ids, params, engine.max_context)
    if gen.budget <= 0 or cancelled():
        yield gen.finish("length" if gen.budget <= 0 else "abort")
        return
    token = engine.start(slot, prompt_ids, params)
    while True:
        text, reason = gen.push(token)
        yield Delta(text)
        if reason:
            break
        if cancelled():
            reason = "abort"
            break
        token = engine.step({slot: token})[slot]
    yield gen.finish(reason)


# ------------------------------------------------------------------------------------------ batching
@dataclass
class _Live:
    job: Any
    gen: Generation
    token: int


class Batch:
    """Continuous batching over an engine's slots. A job is anything with `prompt_ids`, `params` and `cancelled`
    (a threading.Event). `join` prefills a job into a free slot, `step` advances every live job by one token;
    both return the (job, Delta | Finish) events to hand out. A job whose client left ends with "abort" at its
    next token. One thread drives a Batch (the engine's)."""

    def __init__(self, engine: Engine, info: TokenizerInfo):
        self.engine, self.info = engine, info
        self.live: dict[int, _Live] = {}

    @property
    def free(self) -> int:
        return self.engine.slots - len(self.live)

    def join(self, job) -> list[tuple[Any, Delta | Finish]]:
        gen = Generation(self.info, job.prompt_ids, job.params, self.engine.max_context)
        if gen.budget <= 0 or job.cancelled.is_set():
            return [(job, gen.finish("length" if gen.budget <= 0 else "abort"))]
        slot = next(s for s in range(self.engine.slots) if s not in self.live)
        token = self.engine.start(slot, job.prompt_ids, job.params)
        self.live[slot] = _Live(job, gen, token)
        return self._take(slot, token)

    def step(self) -> list[tuple[Any, Delta | Finish]]:
        if not self.live:
            return []
        out = self.engine.step({slot: live.token for slot, live in self.live.items()})
        events = []
        for slot, token in out.items():
            self.live[slot].token = token
            events += self._take(slot, token)
        return events

    def _take(self, slot: int, token: int) -> list[tuple[Any, Delta | Finish]]:
        live = self.live[slot]
        text, reason = live.gen.push(token)
        events: list[tuple[Any, Delta | Finish]] = [(live.job, Delta(text))]
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
