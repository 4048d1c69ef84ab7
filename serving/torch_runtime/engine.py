"""PyTorch runtime: a Gemma 4 checkpoint served through transformers, one sequence at a time with a static KV cache.

The checkpoint is the released multimodal layout (`Gemma4ForConditionalGeneration`, text weights under
`model.language_model.*`). We serve text only, so we build transformers' `Gemma4ForCausalLM` from the
`text_config` and load just the language-model tensors into it (the vision and audio towers are never read).
float16 on CUDA (Turing has no bf16 datapath), float32 on CPU.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from serving import device as gpu_device, memory_plan, quantized
from serving.engine import DeviceRow, SamplingParams, TokenLogprobs

from . import attention, compile_cache, norms, packed_matmul, precompiled, prefill
from .attention import SlotKV, ladder, rows, span
from .compile_cache import DEFAULT_CACHE_DIR, inductor_env  # noqa: F401 (the runtime's settings, read here)
from .pipeline import INPUTS, Run, Stager, pipeline_from_env
from .sampling import Sampler

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

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, span: int) -> dict:
        return dict(input_ids=input_ids, position_ids=positions[:, None], cache_position=positions,
                    past_key_values=self.cache)


class TorchEngine:
    """serving.engine.Engine over a transformers causal LM, next tokens chosen on the device (sampling.py,
    every slot in one pass). One slot: transformers' StaticCache (sequences run one after another). More
    (G5G_TORCH_SLOTS; 8 on a GPU by default): continuous batching over SlotKV (attention.py), every
    live sequence decoded in one forward, over the first rows() slots only (attention.ROWS compiled, EAGER_ROWS
    eager)."""

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
        self.sampler = Sampler(slots, vocab, device)
        self._rows = torch.arange(slots, device=device)
        # a step's host inputs cross in one copy, from pinned memory on a GPU so that it does not wait
        self._stager = Stager(slots, device)
        # the next decode step, dispatched before this one's tokens reach the host (pipeline.py)
        self.pipeline = pipeline_from_env(os.environ, device.type)
        self._ahead: Run | None = None
        # steps dispatched ahead that the next call took, and those thrown away (as the JAX runtime's)
        self.speculation = {"used": 0, "replaced": 0}
        self._logits: dict[int, torch.Tensor] = {}
        self._logprobs: dict[int, TokenLogprobs] = {}
        self._prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
        self._out = [0] * slots                 # tokens generated so far
        # Decode steps (one token per row, static shapes) go through transformers' own compiled call, as its
        # generate(cache_implementation="static") does on CUDA: inductor with CUDA graphs ("reduce-overhead").
        # Prompts of any length run eagerly. G5G_TORCH_COMPILE=0 keeps decode eager too.
        compile_ok = compile_from_env(os.environ, device.type) and hasattr(model, "get_compiled_call")
        if compile_ok:
            use_cache_dir()
            compile_cache.ordered_layer_types(model)
        # G5G_TORCH_PRECOMPILED=1: the compiled step kept whole across boots, dynamo's trace too (precompiled.py)
        kept = precompiled.from_env() and compile_ok and precompiled.path_for(model, slots, max_context)
        self.precompiled = precompiled.DecodeStep(model, kept) if kept else None
        self._decode = self.precompiled or (model.get_compiled_call(None) if compile_ok else model.__call__)
        # row counts a decode step may take (attention.rows)
        self._steps = attention.ROWS if compile_ok else attention.EAGER_ROWS
        self._decode_checked = not compile_ok
        # what each compile of the decode step cost and took from the cache (logged; boot_summary() sums them)
        self.compiles = compile_cache.Compiles(log) if compile_ok else None
        # prompts replayed from a CUDA graph per length bucket (prefill.py), captured at the first prompt
        self.fused_norms = norms.from_env(os.environ)     # the graphs' RMSNorms as one kernel each (norms.py)
        self.prompt_graphs = (prefill.PromptGraphs(self._graph_prompt, prefill.buckets(max_context), device)
                              if prefill.graphs_from_env(os.environ, device.type, slots) else None)

    @property
    def warm_slots(self) -> tuple[int, ...]:
        """Slots a boot's warm-up (serving/api/app.py) decodes a lone sequence in: every row count rows() gives."""
        return tuple(b - 1 for b in ladder(self.slots, self._steps))

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not one of the PyTorch runtime's {self.slots} slots")

    def _forward(self, call, kw: dict, keep: int | torch.Tensor = 1) -> torch.Tensor:
        out = call(use_cache=True, logits_to_keep=keep, **kw)
        # a copy (float32, off the CUDA graph's output buffer, which the next replay overwrites)
        return out.logits[:, -1].float().clone()

    def _decode_call(self, kw: dict) -> torch.Tensor:
        if self.compiles is not None:       # a compile (a first shape, a recompile) is logged with its cache figures
            what = f"decode {kw['input_ids'].shape[0]} row(s)"
            return self.compiles.around(lambda: self._checked_call(kw), what)
        return self._checked_call(kw)

    def _checked_call(self, kw: dict) -> torch.Tensor:
        if self._decode_checked:
            return self._forward(self._decode, kw)
        try:                                   # first compiled step: fall back to eager if compiling fails
            out = self._forward(self._decode, kw)
        except Exception as e:
            log.warning("compiled decode failed (%s: %s); decoding eagerly", type(e).__name__, e)
            self._decode = self.model.__call__
            self.compiles = self.precompiled = None
            out = self._forward(self._decode, kw)
        self._decode_checked = True
        return out

    def _padded_prompt(self, ids: torch.Tensor, slot: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """The logits of a prompt's last position, its first n of ids [1, L] (the rest padding), into `slot`:
        every shape static, every input on the device (what prefill.PromptGraphs captures)."""
        kw = self._kv.prefill(slot, n, ids.shape[1])
        return self._forward(self.model.__call__, dict(input_ids=ids, **kw), keep=n - 1)

    def _graph_prompt(self, ids: torch.Tensor, slot: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """_padded_prompt as the prompt graphs capture it: with fused RMSNorms where G5G_TORCH_FUSED_NORMS=1."""
        with norms.fused(self.model) if self.fused_norms else contextlib.nullcontext():
            return self._padded_prompt(ids, slot, n)

    def _prompt(self, slot: int, prompt_ids: Sequence[int]) -> torch.Tensor:
        if self.prompt_graphs is not None and (logits := self.prompt_graphs.run(slot, prompt_ids)) is not None:
            return logits
        ids = torch.tensor([list(prompt_ids)], device=self.device)
        return self._forward(self.model.__call__, dict(input_ids=ids, **self._kv.prefill(slot, len(prompt_ids))))

    def boot_summary(self) -> str:
        """What compiling the decode step (and capturing prompt graphs) has cost so far (a boot's warm-up:
        serving/api/app.py logs it)."""
        decode = ("compiled decode: " + compile_cache.describe(self.compiles.total()) if self.compiles is not None
                  else "decode not compiled")
        if self.precompiled is not None:
            decode = f"{decode}; {self.precompiled.describe()}"
        return decode if self.prompt_graphs is None else f"{decode}; {self.prompt_graphs.describe()}"

    def _took(self, slot: int, token: int) -> int:
        p = self._params[slot]
        if p.logprobs is not None:
            self._logprobs[slot] = raw_logprobs(self._logits[slot], token, p.logprobs)
        return token

    def _holds(self, slot: int) -> bool:
        return self._out[slot] < self._params[slot].min_tokens

    @torch.inference_mode()
    def start(self, slot: int, prompt_ids: Sequence[int], params: SamplingParams,
              mask: np.ndarray | None = None) -> int:
        self._check_slot(slot)
        n = len(prompt_ids)
        if not n:
            raise ValueError("empty prompt")
        if n > self.max_context:
            raise ValueError(f"sequence of {n} tokens exceeds the PyTorch runtime's max_context {self.max_context}")
        self._drop_ahead()                  # a new sequence: the step ahead ran without it (its counts first)
        self._params[slot] = params
        self.sampler.set(slot, DeviceRow.of(params, self.vocab_size), params.seed64(), prompt_ids)
        self._out[slot] = 0
        self._pos[slot] = n
        if params.prompt_logprobs is None:
            logits = self._prompt(slot, prompt_ids)
        else:      # the model's head over every prompt position (the last one's logits as _prompt makes them)
            ids = torch.tensor([list(prompt_ids)], device=self.device)
            h = self.model.model(input_ids=ids, use_cache=True, **self._kv.prefill(slot, n)).last_hidden_state[0]
            self._prompt_logprobs[slot] = prompt_logprobs(self._head, h[:-1], prompt_ids[1:], params.prompt_logprobs)
            logits = self._head(h[-1:]).float()
        self._logits[slot] = logits[0]
        row = self._rows[slot:slot + 1]
        holding = torch.ones(1, dtype=torch.bool, device=self.device) if self._holds(slot) else None
        chosen = self.sampler.choose(logits, row, [slot], torch.full((1,), n, device=self.device), holding,
                                     None if mask is None else mask[None])
        return self._took(slot, int(chosen[0]))

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
        live = list(tokens)
        for slot in live:
            self._out[slot] += 1
            self._pos[slot] += 1
        for slot in set(range(self.slots)) - set(tokens):
            self._pos[slot] = 0                  # a slot left out is free from now on
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.matches(tokens, masks):
            run = ahead
            self.speculation["used"] += 1
        else:
            if ahead is not None:
                self._drop(ahead)
            run = self._dispatch(self._inputs(live, tokens), live, masks)
        # The step after this one, unless a mask (the grammar moves on the host) or every row ends here (its
        # max_tokens; a row at max_context cannot go on and is left out: its slot can only be started again).
        # A row past its max_tokens still goes at its next position: a caller may step it on, and a row left out
        # would be written as a free one, at position 0.
        going = [s for s in live if self._pos[s] < self.max_context]
        if self.pipeline and not masks and any(self._out[s] + 1 < self._params[s].max_tokens for s in going):
            self._ahead = self._dispatch(self._inputs(going), going, None, after=run)
        chosen = run.tokens()                    # the step's one wait: its tokens, to the host
        if self._ahead is not None:
            self._ahead.fed = {s: chosen[s] for s in going}
        for slot in live:
            self._logits[slot] = run.logits[slot]
            if (k := self._params[slot].logprobs) is not None:
                self._logprobs[slot] = run.logprobs(slot, k)
        return {s: chosen[s] for s in live}

    def _inputs(self, live: list[int], tokens: Mapping[int, int] | None = None) -> np.ndarray:
        """Host inputs [INPUTS, rows] of the step just counted in _out/_pos (feeding `tokens`), or with `tokens`
        None of the step after it (its tokens fed on the device): token, position, counted, holding, live. rows:
        rows(live), the first slots, the only ones the step decodes."""
        x = np.zeros((INPUTS, rows(live, self.slots, self._steps)), np.int64)
        ahead = tokens is None
        for slot in live:
            p = self._params[slot]
            x[:, slot] = (0 if ahead else tokens[slot], self._pos[slot] - (not ahead),
                          self.sampler.rows[slot].penalised, self._out[slot] + ahead < p.min_tokens, 1)
        return x

    def _dispatch(self, inputs: np.ndarray, live: list[int], masks, after: Run | None = None) -> Run:
        """Dispatch a decode step of `inputs` (_inputs'), fed after's chosen tokens if given; nothing waits."""
        ids, positions, counted, holding, alive = self._stager.send(inputs)
        b = inputs.shape[1]
        if after is not None:        # after decoded as many rows or more (its live slots include these)
            ids = torch.where(alive.bool(), after.chosen[:b], 0)
        row_ids = self._rows[:b]
        self.sampler.count(row_ids, ids, counted)
        logits = self._decode_call(self._kv.decode(ids[:, None], positions, span(inputs[1, live].tolist(),
                                                                                self.max_context)))
        allowed = None
        if masks:
            allowed = np.full((b, (self.vocab_size + 31) // 32), -1, np.int32)
            for slot, m in masks.items():
                allowed[slot] = m
        chosen = self.sampler.choose(logits, row_ids, live, positions + 1,
                                     holding.bool() if inputs[3].any() else None, allowed)
        top = [self._params[s].logprobs for s in live if self._params[s].logprobs is not None]
        return Run(live, ids, counted, logits, chosen).send(max(top) if top else None)

    def _drop(self, ahead: Run) -> None:
        ahead.undo(self.sampler)
        self.speculation["replaced"] += 1

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._drop(self._ahead)
            self._ahead = None

    def logits(self, slot: int) -> np.ndarray:
        return self._logits[slot].cpu().numpy()

    def logprobs(self, slot: int) -> TokenLogprobs:
        return self._logprobs[slot]

    def prompt_logprobs(self, slot: int) -> list[TokenLogprobs]:
        return self._prompt_logprobs.pop(slot)


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


# Sequences decoded together by default, per device type: on a GPU a decode step streams the weights once whatever
# its rows, and the 8-slot server beat the one-slot one on a lone stream too (H200: 185.9 vs 168.3 tok/s,
# benchmarks/RESULTS.md, round 2); on a CPU two, so that another client's chat starts beside a running request
# (issue 53: 0.08 s beside an n=64 request, 2.6 s with one slot) at no cost to a lone stream, which decodes one row
# eagerly (benchmarks/cpu_slots.py at E2B's widths: 145 ms a token with two slots, 161 with one).
DEFAULT_SLOTS = {"cuda": 8, "cpu": 2}


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


COMPILE_MODES = ("0", "1", "always")


def compile_from_env(env=os.environ, device_type: str = "cpu") -> bool:
    """G5G_TORCH_COMPILE: 1 (default) compiles decode on CUDA only, 0 never, `always` on any device (a CPU compiles
    through inductor's C++ backend: tests of the compile cache)."""
    mode = env.get("G5G_TORCH_COMPILE") or "1"
    if mode not in COMPILE_MODES:
        raise ValueError(f"G5G_TORCH_COMPILE: {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    return mode == "always" or (mode == "1" and device_type == "cuda")


def use_cache_dir() -> None:
    """Point inductor at G5G_TORCH_CACHE_DIR (compile_cache.inductor_env), before anything is compiled."""
    for key, path in inductor_env().items():
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            os.environ[key] = path
        except OSError as e:
            log.warning("G5G_TORCH_CACHE_DIR %s unusable (%s): compiling without a persistent cache", path, e)
    log.info("compile cache: %s", os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default"))


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


def select_device(env=os.environ) -> str:
    """"cuda" or "cpu" as G5G_DEVICE asks (serving/device.py); gpu without a usable one raises NoGpuError, with what
    torch's own CUDA initialisation said (an old driver, none, a CPU build of torch)."""
    want = gpu_device.expected(env)
    if want == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    try:
        torch.cuda.init()
        why = "torch sees no CUDA device"
    except Exception as e:   # torch's reason: "Found no NVIDIA driver…", "The NVIDIA driver … is too old…"
        why = f"torch: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
    if want == "gpu":
        raise gpu_device.no_gpu(why, torch.version.cuda, env)
    log.warning("no usable GPU (%s): serving on the CPU (%s=auto; gpu makes this an error)", why, gpu_device.ENV)
    return "cpu"


def load(model_dir: str | Path, device: str | None = None, max_context: int | None = None,
         slots: int | None = None) -> TorchEngine:
    from transformers import AutoConfig, Gemma4ForCausalLM
    from transformers.utils import logging as hf_logging

    t0 = time.monotonic()
    model_dir = Path(model_dir)
    dev = torch.device(device or select_device())
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(model_dir)
    text_config = getattr(config, "text_config", config)   # a text-only Gemma 4 checkpoint works too
    context = min(text_config.max_position_embeddings, max_context or DEFAULT_MAX_CONTEXT)
    slots = slots or slots_from_env(os.environ, dev.type)
    head = lm_head_from_env()
    if dev.type == "cuda":          # refuse before loading what the plan says cannot fit (weights + KV cache)
        gpu = torch.cuda.get_device_properties(dev).total_memory
        if no := memory_plan.refusal(model_dir, context, slots, gpu, rings=True, attention=True, lm_head=head):
            raise ValueError(no)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()     # the towers' tensors are "unexpected" for a text model, by design
    qargs = quantized.weight_args({"quantization_config": getattr(config, "quantization_config", None)})
    try:
        if qargs:    # compressed-tensors: the packed linears stay packed (packed_matmul.py)
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
    if slots > 1:        # SlotKV's attention: each K/V read once, on the SDPA backends sm_75 has
        model.set_attn_implementation(attention.register())
        if dev.type == "cuda":
            attention.turing_backends()
    log.info("load: %.1fs: %s on %s as %s (%d layers, context %d, %d slot%s, %s LM head)", time.monotonic() - t0,
             model_dir, dev, dtype, text_config.num_hidden_layers, context, slots, "s" * (slots > 1), head)
    return TorchEngine(model, text_config, dev, context, slots)
