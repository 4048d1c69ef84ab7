"""PyTorch runtime: a Gemma 4 checkpoint served through transformers, one sequence at a time with a static KV cache.

The checkpoint is the released multimodal layout (`Gemma4ForConditionalGeneration`, text weights under
`model.language_model.*`). We serve text only, so we build transformers' `Gemma4ForCausalLM` from the
`text_config` and load just the language-model tensors into it (the vision and audio towers are never read).
float16 on CUDA (Turing has no bf16 datapath), float32 on CPU.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from serving.engine import SamplingParams, TokenLogprobs
from serving.structured import MASKED

log = logging.getLogger("serving.pytorch")

# The static cache holds this many positions unless --max-model-len says otherwise (full-attention layers attend
# over all of them every step: a 128k default would cost more than the weights), as the JAX ladder's top.
DEFAULT_MAX_CONTEXT = 4096
_TEXT_PREFIX = {r"^model\.language_model\.": "model."}


class TorchEngine:
    """serving.engine.Engine over a transformers causal LM with a StaticCache: one slot (sequences run one after
    another), fixed cache tensors sized for max_context, next token chosen on the device."""

    slots = 1

    def __init__(self, model, text_config, device: torch.device, max_context: int):
        from transformers.cache_utils import StaticCache

        self.model = model
        self.text_config = text_config
        self.device = device
        self.max_context = max_context
        self.vocab_size = text_config.vocab_size
        # Sliding-window layers get rings of the window, full layers max_context positions (transformers' layout).
        self._cache = StaticCache(config=text_config, max_cache_len=max_context)
        self._pos = 0
        self._params = SamplingParams(temperature=0.0)
        self._gen = torch.Generator(device=device)
        self._logits: torch.Tensor | None = None
        # what the penalties read: generated-token counts and the prompt's tokens, over the vocabulary
        vocab = text_config.vocab_size
        self._counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self._out = 0                          # tokens generated so far
        self._logprobs: TokenLogprobs | None = None
        # Decode steps (one token, static shapes) go through transformers' own compiled call, as its
        # generate(cache_implementation="static") does on CUDA: inductor with CUDA graphs ("reduce-overhead").
        # Prompts of any length run eagerly. G5G_TORCH_COMPILE=0 keeps decode eager too.
        compile_ok = (device.type == "cuda" and os.environ.get("G5G_TORCH_COMPILE", "1") != "0"
                      and hasattr(model, "get_compiled_call"))
        self._decode = model.get_compiled_call(None) if compile_ok else model.__call__
        self._decode_checked = not compile_ok

    @torch.inference_mode()
    def _forward(self, ids: Sequence[int], mask: np.ndarray | None) -> int:
        n = len(ids)
        if self._pos + n > self.max_context:
            raise ValueError(f"sequence of {self._pos + n} tokens exceeds the PyTorch runtime's max_context "
                             f"{self.max_context}")
        input_ids = torch.tensor([list(ids)], device=self.device)
        positions = torch.arange(self._pos, self._pos + n, device=self.device)
        kw = dict(input_ids=input_ids, position_ids=positions[None], cache_position=positions,
                  past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        if n > 1:
            out = self.model(**kw)
        elif self._decode_checked:
            out = self._decode(**kw)
        else:                                  # first compiled step: fall back to eager if compiling fails
            try:
                out = self._decode(**kw)
            except Exception as e:
                log.warning("compiled decode failed (%s: %s); decoding eagerly", type(e).__name__, e)
                self._decode = self.model.__call__
                out = self._decode(**kw)
            self._decode_checked = True
        self._pos += n
        # a copy (float32, off the CUDA graph's output buffer, which the next replay overwrites)
        self._logits = out.logits[0, -1].float().clone()
        p = self._params
        x = self._logits if mask is None else apply_mask(self._logits, mask)
        x = adjust(x, p, self._counts, self._seen, held=self._out < p.min_tokens)
        token = int(sample(x, p, self._gen))
        if p.logprobs is not None:
            self._logprobs = raw_logprobs(self._logits, token, p.logprobs)
        return token

    @torch.inference_mode()
    def start(self, slot: int, prompt_ids: Sequence[int], params: SamplingParams,
              mask: np.ndarray | None = None) -> int:
        if slot != 0:
            raise ValueError(f"slot {slot} is not one of the PyTorch runtime's {self.slots} slots")
        if not prompt_ids:
            raise ValueError("empty prompt")
        self._cache.reset()
        self._pos = 0
        self._params = params
        self._gen.manual_seed(params.seed64())
        self._counts.zero_()
        self._seen.zero_()
        self._seen[torch.tensor(list(prompt_ids), device=self.device).clamp(0, self._seen.numel() - 1)] = True
        self._out = 0
        return self._forward(prompt_ids, mask)

    def step(self, tokens: Mapping[int, int], masks: Mapping[int, np.ndarray] | None = None) -> dict[int, int]:
        if not tokens:
            return {}
        if set(tokens) != {0} or self._pos == 0:
            raise RuntimeError("step() on a slot that was not started")
        token = tokens[0]
        if 0 <= token < self._counts.numel():
            self._counts[token] += 1
        self._out += 1
        return {0: self._forward([token], (masks or {}).get(0))}

    def logits(self, slot: int) -> np.ndarray:
        return self._logits.cpu().numpy()

    def logprobs(self, slot: int) -> TokenLogprobs:
        return self._logprobs


FLOOR = -80.0   # as serving/jax_runtime/sampling.py: tempered, max-shifted logits are clamped here


def f32(x) -> float:
    """x rounded to float32, as the JAX runtime holds its per-row parameters."""
    return float(np.float32(x))


def adjust(logits: torch.Tensor, p: SamplingParams, counts: torch.Tensor, seen: torch.Tensor,
           held: bool) -> torch.Tensor:
    """serving.engine's adjustments before the draw, in vLLM's order (as serving/jax_runtime/sampling.py's
    adjust): logit_bias and min_tokens, penalties, min_p. counts/seen: the sequence's history over the vocabulary."""
    x = logits
    v = x.numel()
    bias = [(t, b) for t, b in p.logit_bias if 0 <= t < v]
    held_ids = [t for t in p.min_tokens_ids() if 0 <= t < v] if held else []
    if bias or held_ids:
        x = x.clone()
        if bias:
            x.index_add_(0, torch.tensor([t for t, _ in bias], device=x.device),
                         torch.tensor([b for _, b in bias], dtype=x.dtype, device=x.device))
        x[held_ids] = -torch.inf
    if p.penalised:                  # vLLM's apply_penalties
        out = counts > 0
        rep = f32(p.repetition_penalty)
        x = torch.where(seen | out, torch.where(x > 0, x / rep, x * rep), x)
        x = x - f32(p.frequency_penalty) * counts - f32(p.presence_penalty) * out
    t = f32(p.temperature)
    if p.min_p > 0 and t > 0:        # p < min_p * p_max at temperature t  <=>  logit < max + t * log(min_p)
        x = torch.where(x < x.max() + f32(t * np.log(np.float32(p.min_p))), -torch.inf, x)
    return x


def raw_logprobs(logits: torch.Tensor, chosen: int, k: int) -> TokenLogprobs:
    """vLLM's default logprobs_mode, raw_logprobs: log_softmax of the model's logits, before any adjustment."""
    lp = torch.log_softmax(logits, 0)
    top = lp.topk(k) if k else None
    return TokenLogprobs(float(lp[chosen]), tuple(zip(top.indices.tolist(), top.values.tolist())) if k else ())
def apply_mask(logits: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
    """float32 logits [V] with every token the packed bitmask row `mask` (serving/engine.py) disallows at MASKED."""
    bits = np.unpackbits(np.ascontiguousarray(mask, "<i4").view(np.uint8), bitorder="little")[:logits.numel()]
    return logits.masked_fill(torch.from_numpy(bits == 0).to(logits.device), MASKED)


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """The next token (a 0-d tensor) from float32 logits [V] by serving.engine's sampling contract."""
    t = f32(params.temperature)                   # what underflows float32 is greedy, as on the JAX runtime
    if t <= 0.0:
        return logits.argmax()
    x = ((logits - logits.max()) / t).clamp_min(FLOOR)
    if 0 < params.top_k < x.numel() or params.top_p < 1.0:
        top = x.sort(descending=True).values
        if 0 < params.top_k < x.numel():
            top = top[: params.top_k]
        mass = torch.softmax(top, 0).cumsum(0)
        n = int((mass < params.top_p).sum()) + 1 if params.top_p < 1.0 else top.numel()
        x = torch.where(x >= top[min(n, top.numel()) - 1], x, -torch.inf)   # ties at the cut stay, as on JAX
    q = torch.empty_like(x).exponential_(generator=gen)
    return (x - q.log()).argmax()                    # Gumbel-max: a draw from softmax(x)


def load(model_dir: str | Path, device: str | None = None, max_context: int | None = None) -> TorchEngine:
    from transformers import AutoConfig, Gemma4ForCausalLM
    from transformers.utils import logging as hf_logging

    model_dir = Path(model_dir)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(model_dir)
    text_config = getattr(config, "text_config", config)   # a text-only Gemma 4 checkpoint works too
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()     # the towers' tensors are "unexpected" for a text model, by design
    try:
        model, info = Gemma4ForCausalLM.from_pretrained(
            model_dir, config=text_config, dtype=dtype, key_mapping=_TEXT_PREFIX, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = [k for k in info["missing_keys"] if k != "lm_head.weight"]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks text weights, e.g. {missing[:3]} "
                         f"(expected Gemma 4 weights under model.language_model.*)")
    model.to(dev).eval()
    context = min(text_config.max_position_embeddings, max_context or DEFAULT_MAX_CONTEXT)
    log.info("loaded %s on %s as %s (%d layers, context %d)", model_dir, dev, dtype,
             text_config.num_hidden_layers, context)
    return TorchEngine(model, text_config, dev, context)
