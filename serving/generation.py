"""The generation loop, shared by every runtime: sampling, stop rules and incremental detokenisation.

A runtime (serving/engine.py) only turns token ids into logits. Everything a client can observe about the text —
which token is picked, when generation stops, what text comes out of each step — is decided here, once, so the
PyTorch and JAX images answer the same request the same way.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from serving.engine import Engine

# Gemma 4's control tokens that shape the output (see the checkpoint's tokenizer.json).
TURN_END = "<turn|>"                            # end of a dialogue turn: always a stop token
THOUGHT_START, THOUGHT_END = "<|channel>", "<channel|>"   # the thinking channel: never shown to the client


# ----------------------------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0    # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0              # 0 = off
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False    # vLLM's extension: generate max_tokens regardless of stop tokens (benchmarks)


class Sampler:
    """Greedy at temperature 0; otherwise temperature, top-k and nucleus (top-p) sampling with a numpy
    Generator seeded by the request's `seed` (same seed, same logits → same tokens, on every runtime)."""

    def __init__(self, params: SamplingParams):
        self.temperature = params.temperature
        self.top_p = params.top_p
        self.top_k = params.top_k
        # OpenAI and vLLM accept any integer seed; numpy only a non-negative one (a negative seed raised in
        # the engine thread: a 500). Folding into [0, 2**64) leaves every seed numpy accepted unchanged.
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float64)
        if self.temperature <= 0.0:
            return int(np.argmax(logits))
        # Gemma's vocabulary is 262k: select with argpartition, sort only the few candidates that matter.
        if 0 < self.top_k < logits.size:
            cand = np.argpartition(-logits, self.top_k - 1)[: self.top_k]
        else:
            cand = np.arange(logits.size)
        x = logits[cand]
        # Shift before scaling: logits / a tiny temperature overflow to inf, and inf - inf is NaN (a wrong token);
        # shifted, they overflow to -inf only, which is probability 0.
        with np.errstate(over="ignore"):
            p = np.exp((x - x.max()) / self.temperature)
        p /= p.sum()
        if self.top_p >= 1.0:
            return int(cand[self._draw(p)])
        # Nucleus: the smallest set of most likely tokens whose mass reaches top_p (at least one token).
        k = min(p.size, 256)
        while True:
            top = np.argpartition(-p, k - 1)[:k] if k < p.size else np.arange(p.size)
            top = top[np.argsort(-p[top], kind="stable")]
            mass = np.cumsum(p[top])
            if mass[-1] >= self.top_p or k == p.size:
                break
            k = min(p.size, k * 8)
        top = top[: int(np.searchsorted(mass, self.top_p)) + 1]
        return int(cand[top[self._draw(p[top])]])

    def _draw(self, weights: np.ndarray) -> int:
        """Index drawn with probability proportional to `weights` (inverse CDF, one uniform per token)."""
        cdf = np.cumsum(weights)
        return min(int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right")), weights.size - 1)


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


def generate(engine: Engine, info: TokenizerInfo, prompt_ids: Sequence[int], params: SamplingParams,
             cancelled: Callable[[], bool] = lambda: False) -> Iterator[Delta | Finish]:
    """Run one request to the end. Yields a Delta per generated token, then one Finish."""
    sampler = Sampler(params)
    detok = Detokenizer(info)
    stops = StopStrings(params.stop)
    budget = min(params.max_tokens, engine.max_context - len(prompt_ids))
    times: list[float] = []
    reason = "length"
    if budget <= 0 or cancelled():
        yield Finish("length" if budget <= 0 else "abort", len(prompt_ids), 0, times)
        return
    logits = engine.start(prompt_ids)
    while True:
        token = sampler(logits)
        times.append(time.monotonic())
        if token in info.stop_ids and not params.ignore_eos:
            yield Delta(_release(stops, detok)[0])
            reason = "stop"
            break
        text, hit = stops.push(detok.push(token))
        if hit:
            yield Delta(text)
            reason = "stop"
            break
        if len(times) >= budget:
            tail, hit = _release(stops, detok)
            yield Delta(text + tail)
            reason = "stop" if hit else "length"
            break
        yield Delta(text)
        if cancelled():
            reason = "abort"
            break
        logits = engine.step(token)
    yield Finish(reason, len(prompt_ids), len(times), times)
