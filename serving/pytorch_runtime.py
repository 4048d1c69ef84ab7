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

from serving import memory_plan, packed_matmul, quantized
from serving.engine import DeviceRow, SamplingParams, TokenLogprobs
from serving.structured import MASKED

log = logging.getLogger("serving.pytorch")

# The static cache holds this many positions unless --max-model-len says otherwise (full-attention layers attend
# over all of them every step: a 128k default would cost more than the weights), as the JAX ladder's top.
DEFAULT_MAX_CONTEXT = 4096
_TEXT_PREFIX = {r"^model\.language_model\.": "model."}


class _StaticKV:
    """One sequence in transformers' StaticCache (what `generate(cache_implementation="static")` uses): sliding
    layers keep rings of the window, full layers max_context positions."""

    def __init__(self, text_config, max_context: int, device: torch.device):
        from transformers.cache_utils import StaticCache

        self.cache = StaticCache(config=text_config, max_cache_len=max_context)
        self.device = device

    def prefill(self, slot: int, n: int) -> dict:
        self.cache.reset()
        positions = torch.arange(n, device=self.device)
        return dict(position_ids=positions[None], cache_position=positions, past_key_values=self.cache)

    def decode(self, positions: list[int]) -> dict:
        p = torch.tensor(positions, device=self.device)
        return dict(position_ids=p[:, None], cache_position=p, past_key_values=self.cache)


class SlotKV:
    """Continuous batching's KV cache: every layer that computes KV keeps [slots, kv_heads, max_context, head_dim],
    each row one sequence at its own position. transformers' caches share one cache_position across the batch, so
    rows at different positions need a cache of our own: the model reaches it through the Cache `update` call, and
    the sliding windows are per-row masks (the model takes a {layer type: mask} mapping as attention_mask).
    A decode step runs every row (free ones too: static shapes) and attends over a power-of-two prefix of the
    positions that covers every row."""

    def __init__(self, model, slots: int, max_context: int, device: torch.device, dtype):
        self.k, self.v = {}, {}
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            if not a.is_kv_shared_layer:
                shape = (slots, a.k_proj.out_features // a.head_dim, max_context, a.head_dim)
                self.k[i] = torch.zeros(shape, dtype=dtype, device=device)
                self.v[i] = torch.zeros(shape, dtype=dtype, device=device)
        if device.type == "cuda":                # CUDA graphs replay over these very buffers
            for t in (*self.k.values(), *self.v.values()):
                torch._dynamo.mark_static_address(t)
        self.window = model.config.sliding_window
        self.max_context, self.device = max_context, device
        self._slot, self._pos, self._span = 0, None, 0

    def _masks(self, q: torch.Tensor, k: torch.Tensor) -> dict:
        """{layer type: bool mask [rows, 1, queries, keys]} for query positions q [rows, Q], key positions k [K]."""
        full = k[None, None, :] <= q[:, :, None]
        sliding = full & (k[None, None, :] > q[:, :, None] - self.window)
        return {"full_attention": full[:, None], "sliding_attention": sliding[:, None]}

    def prefill(self, slot: int, n: int) -> dict:
        self._slot, self._pos = slot, None
        q = torch.arange(n, device=self.device)
        return dict(position_ids=q[None], attention_mask=self._masks(q[None], q), past_key_values=self)

    def decode(self, positions: list[int]) -> dict:
        self._pos = torch.tensor(positions, device=self.device)
        self._span = min(self.max_context, max(64, 1 << max(positions).bit_length()))
        p = self._pos[:, None]
        return dict(position_ids=p, attention_mask=self._masks(p, torch.arange(self._span, device=self.device)),
                    past_key_values=self)

    def update(self, key, value, layer_idx, cache_kwargs=None):
        """Write the new entries (key/value [rows, kv_heads, T, head_dim]) and return what the layer attends over."""
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self._pos is None:                   # a prompt, into one slot from position 0
            n, s = key.shape[2], self._slot
            k[s, :, :n], v[s, :, :n] = key[0], value[0]
            return k[s:s + 1, :, :n], v[s:s + 1, :, :n]
        rows = torch.arange(key.shape[0], device=key.device)
        k[rows, :, self._pos], v[rows, :, self._pos] = key[:, :, 0], value[:, :, 0]
        return k[:, :, :self._span], v[:, :, :self._span]


class TorchEngine:
    """serving.engine.Engine over a transformers causal LM, next tokens chosen on the device. One slot: transformers'
    StaticCache (sequences run one after another). More (G5G_TORCH_SLOTS; 8 on a GPU by default): continuous batching
    over SlotKV, every live sequence decoded in one forward."""

    def __init__(self, model, text_config, device: torch.device, max_context: int, slots: int = 1):
        self.model = model
        self.text_config = text_config
        self.device = device
        self.max_context = max_context
        self.slots = slots
        self.vocab_size = vocab = text_config.vocab_size
        self._kv = (_StaticKV(text_config, max_context, device) if slots == 1
                    else SlotKV(model, slots, max_context, device, model.dtype))
        self._pos = [0] * slots                 # next position per slot (0: not started)
        self._params = [SamplingParams(temperature=0.0)] * slots
        self._rows = [DeviceRow.of(self._params[0], vocab)] * slots    # what the sampler reads, per slot
        self._gens = [torch.Generator(device=device) for _ in range(slots)]
        self._logits: dict[int, torch.Tensor] = {}
        self._logprobs: dict[int, TokenLogprobs] = {}
        self._prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
        # what the penalties read, per slot: generated-token counts and the prompt's tokens, over the vocabulary
        self._counts = torch.zeros((slots, vocab), dtype=torch.int32, device=device)
        self._seen = torch.zeros((slots, vocab), dtype=torch.bool, device=device)
        self._out = [0] * slots                 # tokens generated so far
        # Decode steps (one token per row, static shapes) go through transformers' own compiled call, as its
        # generate(cache_implementation="static") does on CUDA: inductor with CUDA graphs ("reduce-overhead").
        # Prompts of any length run eagerly. G5G_TORCH_COMPILE=0 keeps decode eager too.
        compile_ok = (device.type == "cuda" and os.environ.get("G5G_TORCH_COMPILE", "1") != "0"
                      and hasattr(model, "get_compiled_call"))
        self._decode = model.get_compiled_call(None) if compile_ok else model.__call__
        self._decode_checked = not compile_ok

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not one of the PyTorch runtime's {self.slots} slots")

    def _forward(self, call, input_ids: list[list[int]], kw: dict) -> torch.Tensor:
        out = call(input_ids=torch.tensor(input_ids, device=self.device), use_cache=True, logits_to_keep=1, **kw)
        # a copy (float32, off the CUDA graph's output buffer, which the next replay overwrites)
        return out.logits[:, -1].float().clone()

    def _decode_call(self, input_ids: list[list[int]], kw: dict) -> torch.Tensor:
        if self._decode_checked:
            return self._forward(self._decode, input_ids, kw)
        try:                                   # first compiled step: fall back to eager if compiling fails
            out = self._forward(self._decode, input_ids, kw)
        except Exception as e:
            log.warning("compiled decode failed (%s: %s); decoding eagerly", type(e).__name__, e)
            self._decode = self.model.__call__
            out = self._forward(self._decode, input_ids, kw)
        self._decode_checked = True
        return out

    def _choose(self, slot: int, logits: torch.Tensor, mask: np.ndarray | None) -> torch.Tensor:
        """The slot's next token (a 0-d tensor) from its float32 logits [V]."""
        row = self._rows[slot]
        self._logits[slot] = logits
        x = logits if mask is None else apply_mask(logits, mask)
        x = adjust(x, row, self._counts[slot], self._seen[slot], held=self._out[slot] < self._params[slot].min_tokens)
        return sample(x, row, self._gens[slot])

    def _took(self, slot: int, token: int) -> int:
        p = self._params[slot]
        if p.logprobs is not None:
            self._logprobs[slot] = raw_logprobs(self._logits[slot], token, p.logprobs)
        return token

    @torch.inference_mode()
    def start(self, slot: int, prompt_ids: Sequence[int], params: SamplingParams,
              mask: np.ndarray | None = None) -> int:
        self._check_slot(slot)
        n = len(prompt_ids)
        if not n:
            raise ValueError("empty prompt")
        if n > self.max_context:
            raise ValueError(f"sequence of {n} tokens exceeds the PyTorch runtime's max_context {self.max_context}")
        self._params[slot] = params
        self._rows[slot] = DeviceRow.of(params, self.vocab_size)
        self._gens[slot].manual_seed(params.seed64())
        self._counts[slot].zero_()
        self._seen[slot].zero_()
        self._seen[slot, torch.tensor(list(prompt_ids), device=self.device).clamp(0, self.vocab_size - 1)] = True
        self._out[slot] = 0
        self._pos[slot] = n
        kw = self._kv.prefill(slot, n)
        if params.prompt_logprobs is None:
            logits = self._forward(self.model.__call__, [list(prompt_ids)], kw)[0]
        else:      # the model's head over every prompt position (the last one's logits as the call above makes them)
            h = self.model.model(input_ids=torch.tensor([list(prompt_ids)], device=self.device), use_cache=True,
                                 **kw).last_hidden_state[0]
            self._prompt_logprobs[slot] = prompt_logprobs(self._head, h[:-1], prompt_ids[1:], params.prompt_logprobs)
            logits = self._head(h[-1:])[0].float()
        return self._took(slot, int(self._choose(slot, logits, mask)))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states [T, D], as Gemma4ForCausalLM's forward makes them (lm_head, soft-capping)."""
        logits = self.model.lm_head(h)
        cap = self.text_config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def step(self, tokens: Mapping[int, int], masks: Mapping[int, np.ndarray] | None = None) -> dict[int, int]:
        if not tokens:
            return {}
        for slot in tokens:
            self._check_slot(slot)
            if self._pos[slot] == 0:
                raise RuntimeError(f"step() on slot {slot} before start()")
            if self._pos[slot] >= self.max_context:
                raise ValueError(f"sequence of {self._pos[slot] + 1} tokens exceeds the PyTorch runtime's "
                                 f"max_context {self.max_context}")
        ids, positions = [[0] for _ in range(self.slots)], [0] * self.slots
        for slot, token in tokens.items():
            if self._rows[slot].penalised and 0 <= token < self.vocab_size:   # only the penalties read it
                self._counts[slot, token] += 1
            self._out[slot] += 1
            ids[slot], positions[slot] = [token], self._pos[slot]
            self._pos[slot] += 1
        for slot in set(range(self.slots)) - set(tokens):
            self._pos[slot] = 0                  # a slot left out is free from now on
        logits = self._decode_call(ids, self._kv.decode(positions))
        masks = masks or {}
        chosen = torch.stack([self._choose(s, logits[s], masks.get(s)) for s in tokens]).tolist()
        return {s: self._took(s, t) for s, t in zip(tokens, chosen)}

    def logits(self, slot: int) -> np.ndarray:
        return self._logits[slot].cpu().numpy()

    def logprobs(self, slot: int) -> TokenLogprobs:
        return self._logprobs[slot]

    def prompt_logprobs(self, slot: int) -> list[TokenLogprobs]:
        return self._prompt_logprobs.pop(slot)


FLOOR = -80.0   # as serving/jax_runtime/sampling.py: tempered, max-shifted logits are clamped here


def adjust(logits: torch.Tensor, row: DeviceRow, counts: torch.Tensor, seen: torch.Tensor,
           held: bool) -> torch.Tensor:
    """serving.engine's adjustments before the draw, in vLLM's order (as serving/jax_runtime/sampling.py's
    adjust): logit_bias and min_tokens, penalties, min_p. counts/seen: the sequence's history over the vocabulary."""
    x = logits
    held_ids = list(row.held) if held else []
    if row.bias or held_ids:
        x = x.clone()
        if row.bias:
            x.index_add_(0, torch.tensor([t for t, _ in row.bias], device=x.device),
                         torch.tensor([b for _, b in row.bias], dtype=x.dtype, device=x.device))
        x[held_ids] = -torch.inf
    if row.penalised:                # vLLM's apply_penalties
        out = counts > 0
        rep = row.repetition
        x = torch.where(seen | out, torch.where(x > 0, x / rep, x * rep), x)
        x = x - row.frequency * counts - row.presence * out
    if row.min_p > 0:                # p < min_p * p_max at temperature t  <=>  logit < max + t * log(min_p)
        x = torch.where(x < x.max() + float(np.float32(row.temperature * np.log(np.float32(row.min_p)))),
                        -torch.inf, x)
    return x


def raw_logprobs(logits: torch.Tensor, chosen: int, k: int) -> TokenLogprobs:
    """vLLM's default logprobs_mode, raw_logprobs: log_softmax of the model's logits, before any adjustment."""
    lp = torch.log_softmax(logits, 0)
    top = lp.topk(k) if k else None
    return TokenLogprobs(float(lp[chosen]), tuple(zip(top.indices.tolist(), top.values.tolist())) if k else ())


PROMPT_CHUNK = 32       # prompt positions whose float32 logits [chunk, vocab] exist at once (32 MiB at 262 144)


def prompt_logprobs(head, h: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Per position i of hidden states h [T, D]: the raw logprob of targets[i] (the prompt token that follows),
    its rank and the k most likely tokens, a chunk of positions at a time."""
    out, want = [], torch.tensor(list(targets), device=h.device)
    for i in range(0, len(targets), PROMPT_CHUNK):
        lp = torch.log_softmax(head(h[i:i + PROMPT_CHUNK]).float(), -1)
        chosen = lp.gather(1, want[i:i + PROMPT_CHUNK, None])[:, 0]
        rank = ((lp > chosen[:, None]).sum(-1) + 1).tolist()
        top = lp.topk(k) if k else None
        for j, value in enumerate(chosen.tolist()):
            pairs = tuple(zip(top.indices[j].tolist(), top.values[j].tolist())) if k else ()
            out.append(TokenLogprobs(value, pairs, rank[j]))
    return out


def apply_mask(logits: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
    """float32 logits [V] with every token the packed bitmask row `mask` (serving/engine.py) disallows at MASKED."""
    bits = np.unpackbits(np.ascontiguousarray(mask, "<i4").view(np.uint8), bitorder="little")[:logits.numel()]
    return logits.masked_fill(torch.from_numpy(bits == 0).to(logits.device), MASKED)


def sample(logits: torch.Tensor, row: DeviceRow, gen: torch.Generator) -> torch.Tensor:
    """The next token (a 0-d tensor) from float32 logits [V] by serving.engine's sampling contract."""
    t = row.temperature
    if t <= 0.0:
        return logits.argmax()
    x = ((logits - logits.max()) / t).clamp_min(FLOOR)
    if row.top_k or row.top_p < 1.0:
        top = x.sort(descending=True).values
        if row.top_k:
            top = top[: row.top_k]
        mass = torch.softmax(top, 0).cumsum(0)
        n = int((mass < row.top_p).sum()) + 1 if row.top_p < 1.0 else top.numel()
        x = torch.where(x >= top[min(n, top.numel()) - 1], x, -torch.inf)   # ties at the cut stay, as on JAX
    q = torch.empty_like(x).exponential_(generator=gen)
    return (x - q.log()).argmax()                    # Gumbel-max: a draw from softmax(x)


# Sequences decoded together by default, per device type: on a GPU a decode step streams the weights once whatever
# its rows, and the 8-slot server beat the one-slot one on a lone stream too (H200: 185.9 vs 168.3 tok/s,
# benchmarks/RESULTS.md, round 2); on a CPU 8 rows cost 8 rows' compute (a lone stream 0.81x), so one slot.
DEFAULT_SLOTS = {"cuda": 8, "cpu": 1}


def slots_from_env(env=os.environ, device_type: str = "cpu") -> int:
    """G5G_TORCH_SLOTS: sequences decoded together (default: DEFAULT_SLOTS for the device; 1 is transformers'
    StaticCache, sequences one after another)."""
    text = env.get("G5G_TORCH_SLOTS") or str(DEFAULT_SLOTS.get(device_type, 1))
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"G5G_TORCH_SLOTS: {text!r} is not a positive integer")
    return int(text)


def lm_head_from_env(env=os.environ) -> str:
    """G5G_LM_HEAD: the LM head a decode step reads, fp16 (the tied embedding itself) or int8 (a copy quantised at
    load, one scale per vocabulary row: half the head's bytes per token; serving/memory_plan.py counts it)."""
    head = env.get("G5G_LM_HEAD") or "fp16"
    if head not in memory_plan.LM_HEADS:
        raise ValueError(f"G5G_LM_HEAD: {head!r} is not one of {', '.join(memory_plan.LM_HEADS)}")
    return head


def _quantised_text(model_dir: Path, dtype) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """A compressed-tensors checkpoint's text weights named as Gemma4ForCausalLM's, and its packed linears as
    {module path: (packed words, scales, in_features)} for packed_matmul.pack_model. The state dict holds an
    uninitialised `dtype` stand-in for each packed weight: from_pretrained wants a tensor there, and the module
    is replaced before it is ever read."""
    from safetensors import safe_open

    sd: dict[str, torch.Tensor] = {}
    packed: dict[str, tuple] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if not name.startswith("model.language_model."):
                    continue
                key = "model." + name.removeprefix("model.language_model.")
                if name.endswith(".weight_packed"):
                    base = name.removesuffix("_packed")
                    out, cols = (int(v) for v in st.get_tensor(base + "_shape"))
                    sd[key.removesuffix("_packed")] = torch.empty((out, cols), dtype=dtype)
                    packed[key.removesuffix(".weight_packed")] = (st.get_tensor(name), st.get_tensor(base + "_scale"),
                                                                  cols)
                elif not name.endswith(quantized.SUFFIXES):
                    sd[key] = st.get_tensor(name)
    return sd, packed


def load(model_dir: str | Path, device: str | None = None, max_context: int | None = None,
         slots: int | None = None) -> TorchEngine:
    from transformers import AutoConfig, Gemma4ForCausalLM
    from transformers.utils import logging as hf_logging

    model_dir = Path(model_dir)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(model_dir)
    text_config = getattr(config, "text_config", config)   # a text-only Gemma 4 checkpoint works too
    context = min(text_config.max_position_embeddings, max_context or DEFAULT_MAX_CONTEXT)
    slots = slots or slots_from_env(os.environ, dev.type)
    head = lm_head_from_env()
    if dev.type == "cuda":          # refuse before loading what the plan says cannot fit (weights + KV cache)
        gpu = torch.cuda.get_device_properties(dev).total_memory
        if no := memory_plan.refusal(model_dir, context, slots, gpu, lm_head=head):
            raise ValueError(no)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()     # the towers' tensors are "unexpected" for a text model, by design
    qargs = quantized.weight_args({"quantization_config": getattr(config, "quantization_config", None)})
    try:
        if qargs:    # compressed-tensors: the packed linears stay packed (serving/packed_matmul.py)
            if dev.type == "cuda" and (why := packed_matmul.kernel_missing()):
                raise ValueError(f"{model_dir}: {why}")
            state, packed = _quantised_text(model_dir, dtype)
            model, info = Gemma4ForCausalLM.from_pretrained(
                None, config=text_config, dtype=dtype, state_dict=state, output_loading_info=True)
            del state
            packed_matmul.pack_model(model, packed, qargs["num_bits"], dtype)
        else:
            model, info = Gemma4ForCausalLM.from_pretrained(
                model_dir, config=text_config, dtype=dtype, key_mapping=_TEXT_PREFIX, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = [k for k in info["missing_keys"] if k != "lm_head.weight"]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks text weights, e.g. {missing[:3]} "
                         f"(expected Gemma 4 weights under model.language_model.*)")
    model.to(dev).eval()
    if head == "int8":      # the tied embedding stays 16-bit for the gather; the head reads its int8 copy
        if dev.type == "cuda" and (why := packed_matmul.kernel_missing()):
            raise ValueError(f"G5G_LM_HEAD=int8: {why}")
        model.lm_head = packed_matmul.PackedLinear.from_weight(model.lm_head.weight, dtype).to(dev)
    if slots > 1 and model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")    # SlotKV's masks are boolean (True: attend), as sdpa takes them
    log.info("loaded %s on %s as %s (%d layers, context %d, %d slot%s, %s LM head)", model_dir, dev, dtype,
             text_config.num_hidden_layers, context, slots, "s" * (slots > 1), head)
    return TorchEngine(model, text_config, dev, context, slots)
