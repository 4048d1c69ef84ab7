"""The seam between the OpenAI API layer and a model runtime (PyTorch or JAX).

A runtime holds up to `slots` sequences at once, each in its own slot of a fixed KV cache. It runs prompts and
decode steps and picks every next token on the device (greedy, temperature, top-k, top-p, seeded per request:
the contract below), so only token ids cross to the host. Tokenisation, the chat template, stop rules,
detokenisation and scheduling (which request holds which slot) are the API layer's (serving/core/generation.py), so
both runtimes behave the same on the wire.

Sampling contract, the same on every runtime:
- temperature 0 (or one that underflows float32) is greedy: the argmax;
- otherwise top-k (0 = off) keeps the k most likely tokens, then top-p keeps the smallest most-likely set whose
  renormalised mass reaches top_p (at least one token); the token is drawn from what is kept at `temperature`;
- the draw for the token at position p uses a key derived from (seed, p) alone: the same request with the same
  seed gives the same tokens whatever else shares the batch. A request without a seed gets a random one.
Before that, in vLLM's order (its v1 sampler), the logits are adjusted per request:
- logit_bias is added; while fewer than min_tokens tokens are out, every stop token id (the checkpoint's eos ids
  and stop_token_ids) is -inf;
- penalties: repetition (over prompt + generated tokens: a positive logit is divided by it, a negative one
  multiplied), then frequency (times the token's count among the generated tokens), then presence (once per
  token generated at least once);
- min_p (sampled rows): tokens less likely than min_p times the most likely one, at `temperature`, are dropped.
Logprobs are vLLM's default `logprobs_mode="raw_logprobs"`: log_softmax of the model's logits before any of the
above (bias, penalties, temperature, cuts); `logprobs(slot)` has the chosen token's and the top ones,
`prompt_logprobs(slot)` the same for each prompt token (computed by `start` only when the params ask: it costs the
LM head over every prompt position).

Allowed tokens (structured output, serving/shaping/grammar.py): `start` takes a mask and `step` a {slot: mask} for the
slots whose request follows a grammar. A mask is a packed bitmask row, int32 [ceil(vocab_size / 32)], bit i % 32 of
word i // 32 set when token i may come next (mask_words below: the words in a row); the runtime gives every other
token the logit MASKED before the adjustments above and the draw. A slot without a mask is unconstrained. The
generation loop writes a fresh mask for every token (the grammar advances on the host), so both calls take it on
every call.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import numpy as np

MASKED = -1e30      # the logit a disallowed token gets: finite, so a row that allows nothing never makes NaNs


def mask_words(vocab_size: int) -> int:
    """int32 words in one row of the bitmask."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0    # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0              # 0 = off
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    include_stop_str: bool = False  # the text keeps the stop string that ended it (API layer only)
    seed: int | None = None
    ignore_eos: bool = False    # vLLM's extension: generate max_tokens regardless of stop tokens (benchmarks)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0             # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()        # end generation like eos
    eos_token_ids: tuple[int, ...] = ()         # the checkpoint's stop ids (what min_tokens holds back, with the above)
    logprobs: int | None = None                 # how many top alternatives per token (0: the chosen one's only)
    prompt_logprobs: int | None = None          # the same for every prompt token after the first (start computes them)
    allowed_token_ids: tuple[int, ...] = ()     # only these may be generated (API layer: a mask); () = any
    bad_words_ids: tuple[tuple[int, ...], ...] = ()     # token sequences never generated (API layer: a mask)

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def min_tokens_ids(self) -> tuple[int, ...]:
        """The ids held back (-inf) until min_tokens tokens are out."""
        return tuple(sorted(set(self.eos_token_ids) | set(self.stop_token_ids))) if self.min_tokens else ()

    def seed64(self) -> int:
        """The request's seed folded into [0, 2**64) (OpenAI and vLLM accept any integer, negative too);
        a fresh random one when the request has none."""
        return secrets.randbits(64) if self.seed is None else self.seed % 2**64

    def seed_words(self) -> tuple[int, int]:
        """seed64 as two uint32 words (high, low): a threefry key, or a torch Generator seed."""
        s = self.seed64()
        return s >> 32, s & 0xFFFFFFFF


def _f32(x) -> float:
    return float(np.float32(x))


@dataclass(frozen=True)
class DeviceRow:
    """What a request's SamplingParams mean for the math on the device, decided here once for every runtime (the
    array math stays each framework's): values as float32 holds them, and every "off" spelled one way."""
    temperature: float                      # 0: greedy (also a negative one, or one that underflows float32)
    top_k: int                              # 0: off (also k of the vocabulary or more)
    top_p: float                            # 1: off
    min_p: float                            # 0: off (also when greedy: min_p is relative at the temperature)
    presence: float
    frequency: float
    repetition: float                       # 1: off
    bias: tuple[tuple[int, float], ...]     # (id, value) inside the vocabulary
    held: tuple[int, ...]                   # ids at -inf while fewer than min_tokens tokens are out

    @property
    def penalised(self) -> bool:
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1

    @classmethod
    def of(cls, p: SamplingParams, vocab: int) -> "DeviceRow":
        t = max(_f32(p.temperature), 0.0)
        return cls(temperature=t, top_k=p.top_k if 0 < p.top_k < vocab else 0, top_p=_f32(p.top_p),
                   min_p=_f32(p.min_p) if t > 0 else 0.0, presence=_f32(p.presence_penalty),
                   frequency=_f32(p.frequency_penalty), repetition=_f32(p.repetition_penalty),
                   bias=tuple((i, _f32(b)) for i, b in p.logit_bias if 0 <= i < vocab),
                   held=tuple(i for i in p.min_tokens_ids() if 0 <= i < vocab))


class Engine(Protocol):
    #: largest prompt + generated length the runtime accepts
    max_context: int
    #: sequences it holds at once (slot ids are 0 .. slots-1)
    slots: int
    #: width of the logits (the model's vocabulary, at least the tokenizer's)
    vocab_size: int

    def start(self, slot: int, prompt_ids: Sequence[int], params: SamplingParams,
              mask: np.ndarray | None = None) -> int:
        """Put a new sequence into `slot` (dropping whatever was there), run its prompt, return its first token
        (one `mask` allows)."""

    def step(self, tokens: Mapping[int, int], masks: Mapping[int, np.ndarray] | None = None) -> dict[int, int]:
        """One decode step for the sequences in `tokens` ({slot: the token just generated for it}): append each
        token, return {slot: next token} (among those masks[slot] allows). Every live slot is stepped together;
        a slot left out is free."""

    def logits(self, slot: int) -> np.ndarray:
        """float32 logits [vocab] behind the slot's last token (tests, diagnostics; copies from the device)."""

    def logprobs(self, slot: int) -> "TokenLogprobs":
        """The raw logprobs of the slot's last chosen token, for a sequence started with params.logprobs set."""

    def prompt_logprobs(self, slot: int) -> list["TokenLogprobs"]:
        """For a sequence started with params.prompt_logprobs set: per prompt token after the first, its raw logprob
        given the tokens before it, its rank, and the params.prompt_logprobs most likely tokens there."""


TOP_LOGPROBS = 20    # the most alternatives a request may ask for (vLLM's default max_logprobs, OpenAI's top_logprobs)


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float                             # of the chosen token
    top: tuple[tuple[int, float], ...]         # the params.logprobs most likely (id, logprob), most likely first
    rank: int | None = None                    # 1 + how many tokens are more likely (prompt logprobs only)
