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
class PromptTooLong(ValueError):
    def __init__(self, tokens: int, exact: bool = True):
        super().__init__(f"{'' if exact else 'at least '}{tokens} tokens")
        self.tokens, self.exact = tokens, exact


@dataclass
class TokenizerInfo:
    """The checkpoint's tokenizer plus what the generation loop needs to know about its special tokens."""
    tokenizer: object                   # the engine thread's: detokenising the output
    stop_ids: frozenset[int]
    hidden_ids: frozenset[int]          # special tokens: never detokenised for the client
    thought_start: int | None
    thought_end: int | None
    default_sampling: dict = field(default_factory=dict)
    # A second instance for requests (chat template, prompts, /tokenize), used from worker threads: a long prompt
    # never waits on, nor stalls, the detokeniser of the generation in flight. transformers' fast tokenizer
    # reconfigures its Rust backend on every encode ("Already borrowed" when shared), so each has its own lock.
    prompt_tokenizer: object = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    prompt_lock: threading.Lock = field(default_factory=threading.Lock)
    max_token_chars: int = 1            # the longest token's text: n characters are at least n / this tokens

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
                   defaults, prompt_tokenizer=AutoTokenizer.from_pretrained(model_dir),
                   max_token_chars=max(map(len, vocab), default=1))

    @property
    def vocab_size(self) -> int:
        return len(self.prompt_tokenizer)

    def render_chat(self, messages: list[dict]) -> str:
        with self.prompt_lock:
            return self.prompt_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str, add_special_tokens: bool = False, limit: int | None = None) -> list[int]:
        """Token ids of `text`; PromptTooLong past `limit` tokens. Text that cannot fit is refused before the
        tokenizer runs (a normaliser may merge up to 4 characters into one: the bound allows for it); otherwise
        the Rust tokenizer runs without the GIL (encode_batch) and the ids become a Python list only when they
        fit, so a huge prompt costs a worker thread, never the event loop."""
        if limit is not None and len(text) > 4 * self.max_token_chars * limit:
            raise PromptTooLong(len(text) // (4 * self.max_token_chars), exact=False)
        with self.prompt_lock:
            enc = self.prompt_tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and len(enc) > limit:
            raise PromptTooLong(len(enc))
        return enc.ids

    def decode(self, ids: Sequence[int]) -> str:
        with self.prompt_lock:
            return self.prompt_tokenizer.decode(list(ids), skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False)

    def chat_prompt(self, messages: list[dict], limit: int | None = None) -> list[int]:
        """Token ids of the conversation rendered with the checkpoint's own chat template."""
        return self.encode(self.render_chat(messages), limit=limit)


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


def _failure(s: str) -> list[int]:
    """KMP failure function: f[i] = length of the longest proper prefix of s[:i+1] that is also its suffix."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class StopStrings:
    """Holds back text that might be the start of a stop string; cuts the text at the first stop string to
    complete. One KMP matcher per stop string: the work per delta is linear in the delta (times the number of
    stops), however long the stops and the output are."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.fail = [_failure(s) for s in self.stops]
        self.matched = [0] * len(self.stops)    # per stop: how many of its first characters end the text
        self.pending = ""                       # unsent text: the longest possible start of a stop string

    def push(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to send, whether a stop string was hit)."""
        if not self.stops:
            return delta, False
        text, base = self.pending + delta, len(self.pending)
        for i, ch in enumerate(delta):
            cut = None
            for k, s in enumerate(self.stops):
                q, f = self.matched[k], self.fail[k]
                while q and s[q] != ch:
                    q = f[q - 1]
                if s[q] == ch:
                    q += 1
                if q == len(s):
                    start = base + i + 1 - q
                    cut = start if cut is None else min(cut, start)
                    q = f[q - 1]
                self.matched[k] = q
            if cut is not None:
                self.pending = ""
                return text[:cut], True
        keep = max(self.matched)
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
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
