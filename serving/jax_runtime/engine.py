"""JaxEngine: the Engine seam (serving/engine.py) over the JAX Gemma 4 port, with a fixed set of compiled shapes.

Continuous batching over a fixed number of slots: one KV cache with a row per slot, allocated once at the context
limit, updated in place (donated). Two ladders fix every shape: lengths (prompt buckets, and the prefix of the
full-attention cache a decode step reads) and batches (how many leading rows a decode step runs). At boot every
executable is compiled ahead of time (kept in executables.py's store, so a second boot loads them untraced): prefill for
each length bucket, decode for each (batch, length) pair; each one samples its tokens on the device, among those
its rows' allowed-token masks allow (serving/engine.py). After boot
only those executables run; calling one with another shape raises instead of compiling.

Decode is pipelined: right after dispatching a step, the engine dispatches the next one speculatively, fed with
this step's tokens while they are still on the device, and only then reads them. The GPU runs step t+1 while the
host hands out token t, so the host's share of a step (argument uploads, the API layer's detokenising and stop
rules) no longer leaves the GPU idle. The next call uses the speculative step when it asks for exactly that
(the same tokens, for those slots or fewer, no grammar mask, no slot restarted); otherwise it runs a real step
over the same positions, which rewrites what the speculative one wrote and takes back the token it counted.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import xla_bridge  # backends_are_initialized: jax_platforms is read once, when a backend starts

from serving import device as gpu_device, memory_plan
from serving.engine import TOP_LOGPROBS, DeviceRow, SamplingParams, TokenLogprobs, mask_words

from . import checkpoint, config, executables, model, sampling, xla
from .xla import apply_default_xla_flags, compile_counts, configure_persistent_cache

DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_SLOTS = 8
log = logging.getLogger("serving.jax")


# Precision dtypes a GPU runs only from a compute capability on: Turing (sm_75) has no bfloat16 datapath.
MIN_CAPABILITY = {"bfloat16": (8, 0)}
# How a packed (int8/int4) weight multiplies a few rows (model.matmul): "dot" (its convert fuses into a Triton GEMM;
# before a cuBLAS call XLA writes a dequantised copy of the weight every step) or "reduce" (a multiply-reduce that
# reads the packed bytes once) for products of up to PACKED_REDUCE_ROWS rows: decode batches, not prefill's buckets.
# "auto": reduce on a GPU where XLA has no Triton GEMM (xla.triton_gemm), else dot (CPU included).
PACKED_DOTS = ("auto", "reduce", "dot")
# One row: the batch-1 executable (a lone stream). Measured on an H200 with Triton GEMM off, E2B's gate|up under ncu
# (benchmarks/t4g_kernels.py; benchmarks/RESULTS.md, issue 27): at 1 row the reduce reads the packed bytes once
# (1.00x the least, the dot 3.66x) and is predicted 3.6x (int8) / 5.8x (int4) faster than the dot on a T4G; at 8
# rows it moved 7.5x the least bytes, twice the dot's time.
PACKED_REDUCE_ROWS = 1


def parse_buckets(text: str, where: str = "G5G_JAX_BUCKETS") -> tuple[int, ...]:
    try:
        vals = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not a comma-separated list of integers") from None
    if not vals or vals[0] < 1:
        raise ValueError(f"{where}: {text!r} needs at least one positive bucket")
    return tuple(vals)


@dataclass(frozen=True)
class Settings:
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    dtype: str = "auto"                # auto: float16 on GPU, float32 on CPU
    cache_dir: str | None = field(default_factory=lambda: str(Path.home() / ".cache" / "g5g-jax"))
    slots: int = DEFAULT_SLOTS         # sequences decoded together
    batches: tuple[int, ...] = ()      # decode batch ladder; () = (slots,): see batch_ladder
    pipeline: bool = True              # dispatch decode step t+1 before reading step t's tokens (module doc)
    xla_defaults: bool = True          # add DEFAULT_XLA_FLAGS to XLA_FLAGS at load
    packed_dot: str = "auto"           # PACKED_DOTS

    @classmethod
    def from_env(cls, env=os.environ) -> "Settings":
        s = cls()
        buckets = parse_buckets(env["G5G_JAX_BUCKETS"]) if env.get("G5G_JAX_BUCKETS") else s.buckets
        batches = parse_buckets(env["G5G_JAX_BATCHES"], "G5G_JAX_BATCHES") if env.get("G5G_JAX_BATCHES") else ()
        try:
            slots = int(env.get("G5G_JAX_SLOTS") or (batches[-1] if batches else s.slots))
        except ValueError:
            raise ValueError(f"G5G_JAX_SLOTS: {env['G5G_JAX_SLOTS']!r} is not an integer") from None
        if slots < 1:
            raise ValueError(f"G5G_JAX_SLOTS: {slots} must be at least 1")
        cache_dir = env.get("G5G_JAX_CACHE_DIR", s.cache_dir)
        switches = {}
        for name in ("G5G_JAX_PIPELINE", "G5G_JAX_XLA_DEFAULTS"):
            switches[name] = env.get(name, "1")
            if switches[name] not in ("0", "1"):
                raise ValueError(f"{name}: {switches[name]!r} is not 0 or 1")
        packed_dot = env.get("G5G_JAX_PACKED_DOT") or s.packed_dot
        if packed_dot not in PACKED_DOTS:
            raise ValueError(f"G5G_JAX_PACKED_DOT: {packed_dot!r} is not {', '.join(PACKED_DOTS)}")
        return cls(buckets=buckets, dtype=env.get("G5G_JAX_DTYPE", s.dtype), cache_dir=cache_dir or None,
                   slots=slots, batches=batches, pipeline=switches["G5G_JAX_PIPELINE"] == "1",
                   xla_defaults=switches["G5G_JAX_XLA_DEFAULTS"] == "1", packed_dot=packed_dot)

    def batch_ladder(self, also: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Decode batch sizes, the largest being the slot count. By default only that one: decode streams the
        weights once per step whatever the batch, and on the H200 a step of 8 rows took less time than a step of
        one (benchmarks/RESULTS.md), so smaller batches would only add executables to compile at boot. `also`:
        sizes the engine adds (the packed multiply-reduce's rows: it pays only at those)."""
        return tuple(sorted({b for b in (*self.batches, *also) if b < self.slots} | {self.slots}))

    def resolve_dtype(self, capability: tuple[int, int] | None = None):
        """The parameter dtype; capability: the GPU's compute capability (None off a GPU), which refuses a dtype
        the GPU has no datapath for (MIN_CAPABILITY) rather than letting XLA emulate it."""
        name = self.dtype
        if name == "auto":
            name = "float32" if jax.default_backend() == "cpu" else "float16"
        if name not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"G5G_JAX_DTYPE: {self.dtype!r} is not auto, float32, float16 or bfloat16")
        need = MIN_CAPABILITY.get(name)
        if capability is not None and need and tuple(capability) < need:
            raise ValueError(f"G5G_JAX_DTYPE: {name} needs a GPU of compute capability {need[0]}.{need[1]} or newer;"
                             f" this one is {capability[0]}.{capability[1]} (use float16)")
        return jnp.dtype(name)

    def resolve_packed_dot(self, capability: tuple[int, int] | None, xla_flags: str) -> str:
        """"reduce" or "dot" (PACKED_DOTS) for a GPU of this compute capability (None off a GPU) under XLA_FLAGS."""
        if self.packed_dot != "auto":
            return self.packed_dot
        return "reduce" if capability is not None and not xla.triton_gemm(capability, xla_flags) else "dot"


def compile_waves(keys: Sequence[tuple]) -> tuple[list[tuple], list[tuple]]:
    """The ladder's executables ("prefill", length) and ("decode", batch, length) in two waves: first, one after
    another, one executable per shape the LM head's dot takes in it (decode: [batch, hidden]; prefill: the last
    position's row and the prompt logprobs' chunk); then the rest side by side. XLA's GPU compiler autotunes a dot
    on fresh copies of its operands and keeps the result for the process: compiled side by side from the start,
    every executable would hold its own copy of the 16-bit LM head at once (memory_plan.plan's `tuning`: one)."""
    first, rest, seen = [], [], set()
    for key in keys:
        shape = ("prefill", sampling.prompt_chunk(key[1])) if key[0] == "prefill" else key[:2]
        (rest if shape in seen else first).append(key)
        seen.add(shape)
    return first, rest


# -- the engine ---------------------------------------------------------------------------------------------------
@dataclass
class _Step:
    """A dispatched decode step: its device outputs and, for a speculative one, what it assumed."""
    out: jax.Array              # int32 [b]: the tokens it chose
    logits: jax.Array
    logprobs: tuple
    slots: frozenset = frozenset()   # the slots it stepped (a speculative step: those of the step before)
    fed: np.ndarray | None = None    # the tokens it fed in (read once the step before is)
    stale: set = field(default_factory=set)   # slots restarted since it was dispatched

    def serves(self, tokens: Mapping[int, int], masks) -> bool:
        return (not masks and set(tokens) <= self.slots and not self.stale & set(tokens)
                and all(self.fed[s] == t for s, t in tokens.items()))

    def undo(self, b: int, vocab: int) -> np.ndarray:
        """Per row of a b-row step replacing this one: the token this one counted, or vocab (none)."""
        out = np.full(b, vocab, np.int32)
        for s in self.slots - self.stale:
            if s < b:
                out[s] = self.fed[s]
        return out


class JaxEngine:
    """`slots` sequences decoded together (serving.engine.Engine). Not thread-safe by itself: one thread (the API
    layer's engine thread) drives it."""

    def __init__(self, cfg: config.TextConfig, params: dict, settings: Settings):
        self.cfg = cfg
        self.dtype = settings.resolve_dtype()
        limit = cfg.max_position_embeddings
        self.buckets = tuple(b for b in settings.buckets if b <= limit) or (min(settings.buckets[0], limit),)
        self.max_context = self.buckets[-1]
        self.slots = settings.slots
        self.pipeline = settings.pipeline
        self.vocab_size = cfg.vocab_size
        self.packed_dot = settings.resolve_packed_dot(_gpu_capability(), os.environ.get("XLA_FLAGS", ""))
        reduce = self.packed_dot == "reduce" and model.has_packed(params)
        params = model.with_reduce_rows(params, PACKED_REDUCE_ROWS if reduce else 0)
        # a lone stream gets the batch its packed weights are read once at
        self.batches = settings.batch_ladder((PACKED_REDUCE_ROWS,) if reduce else ())
        t0 = time.perf_counter()
        self.params = jax.device_put(params)      # asynchronous: the copies overlap the ladder's tracing
        self._cache = model.empty_cache(cfg, self.slots, self.max_context, self.dtype)
        self._state = sampling.empty_state(self.slots, cfg.vocab_size)   # what the penalties read, per slot
        t_put = time.perf_counter() - t0
        before = compile_counts()
        self.boot: dict = {}
        self._prefill, self._decode = self._compile_ladder()
        after = compile_counts()
        t_ladder = time.perf_counter() - t0 - t_put
        jax.block_until_ready((self.params, self._cache))
        counts = {f"boot_{k}": after[k] - before[k] for k in after}
        self.boot.update({
            "device_put_s": round(t_put, 3), "weights_ready_s": round(time.perf_counter() - t0, 3),
            "compile_s": round(t_ladder, 3), "executables": len(self._prefill) + len(self._decode),
            "slots": self.slots, "batches": list(self.batches), "packed_dot": self.packed_dot, **counts,
            # compiles counts every executable XLA handed over, those JAX's persistent cache loaded included
            "boot_xla_compiles": counts["boot_compiles"] - counts["boot_cache_hits"],
            "weight_bytes": sum(a.nbytes for a in jax.tree.leaves(self.params))})
        # per slot: next position, sampling row (temperature, top_k, top_p, threefry key); free slots are greedy
        self._pos = np.zeros(self.slots, np.int32)
        self._temp = np.zeros(self.slots, np.float32)
        self._top_k = np.zeros(self.slots, np.int32)
        self._top_p = np.ones(self.slots, np.float32)
        self._keys = np.zeros((self.slots, 2), np.uint32)
        self._rows = self._empty_rows(self.slots)  # the other per-request parameters (sampling.adjust's rows)
        self._free_row = self._empty_rows(1)       # what a free slot's row holds in a decode step
        self._prompt_len = np.zeros(self.slots, np.int32)
        self._min_tokens = np.zeros(self.slots, np.int32)
        self._top_n = np.zeros(self.slots, np.int32)          # top logprobs each sequence asked for
        self._logits: dict[int, tuple] = {}       # slot -> (device logits [rows, V], row): the last step's
        self._logprobs: dict[int, tuple] = {}     # slot -> ([device or host logprob arrays], row): the last step's
        self._prompt_logprobs: dict[int, tuple] = {}   # slot -> (device arrays, prompt length, k): start's, if asked
        # Allowed-token masks of rows without a grammar stay on the device: only grammar rows are uploaded.
        self._all_allowed = {n: jax.device_put(np.full((n, mask_words(self.vocab_size)), -1, np.int32))
                             for n in {1, *self.batches}}
        self._no_undo = {n: jax.device_put(np.full(n, self.vocab_size, np.int32)) for n in self.batches}
        self._spec: _Step | None = None           # the speculative decode step in flight, if any
        self.speculation = {"used": 0, "replaced": 0}   # speculative steps a call took, and those it ran again

    def _empty_rows(self, n: int) -> dict:
        return sampling.empty_rows(n, self.cfg.vocab_size)

    def _compile_ladder(self):
        cfg = self.cfg
        params_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.params)
        cache_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self._cache)
        i32 = jax.ShapeDtypeStruct((), jnp.int32)

        def vec(n, dtype=jnp.int32, *tail):
            return jax.ShapeDtypeStruct((n, *tail), dtype)

        state_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self._state)

        def sampling_spec(n):
            rows = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self._empty_rows(n).items()}
            return (vec(n, jnp.float32), vec(n), vec(n, jnp.float32), vec(n, jnp.uint32, 2), rows,
                    vec(n, jnp.int32, mask_words(cfg.vocab_size)))

        def choose(logits, state_rows, temp, top_k, top_p, keys, positions, rows, mask):
            x = sampling.adjust(sampling.apply_mask(logits, mask), temp, rows, *state_rows)
            chosen = sampling.sample(x, temp, top_k, top_p, keys, positions)
            return chosen, sampling.logprobs(logits, chosen, rows["logprobs"], TOP_LOGPROBS)

        def prefill_fn(params, cache, state, slot, tokens, length, temp, top_k, top_p, keys, rows, mask, prompt):
            h, cache = model.prefill_hidden(cfg, params, cache, slot, tokens, length)
            head = functools.partial(model.final_logits, cfg, params)
            logits = head(jax.lax.dynamic_slice_in_dim(h, length - 1, 1))
            state = sampling.start_row(state, slot, tokens, length)
            history = [jax.lax.dynamic_slice_in_dim(state[k], slot, 1) for k in ("counts", "seen")]
            chosen, lp = choose(logits, history, temp, top_k, top_p, keys, length[None], rows, mask)
            # the prompt's own logprobs only when asked (prompt: a bool scalar): the head over every position
            return chosen, logits, cache, state, lp, sampling.prompt_logprobs(head, h, tokens, prompt, TOP_LOGPROBS)

        def decode_fn(capacity, params, cache, state, tokens, positions, undo, temp, top_k, top_p, keys, rows,
                      mask):
            logits, cache = model.decode(cfg, capacity, params, cache, tokens, positions)
            state = sampling.count(state, tokens, undo)
            b = tokens.shape[0]
            history = [state["counts"][:b], state["seen"][:b]]
            chosen, lp = choose(logits, history, temp, top_k, top_p, keys, positions + 1, rows, mask)
            return chosen, logits, cache, state, lp

        prompt = jax.ShapeDtypeStruct((), jnp.bool_)
        jobs = {}     # name -> (function, argument specs)
        for c in self.buckets:
            jobs["prefill", c] = (prefill_fn, (params_spec, cache_spec, state_spec, i32, vec(c), i32,
                                               *sampling_spec(1), prompt))
            for b in self.batches:
                jobs["decode", b, c] = (functools.partial(decode_fn, c),
                                        (params_spec, cache_spec, state_spec, vec(b), vec(b), vec(b),
                                         *sampling_spec(b)))
        # A warm boot: every executable from the store, side by side, nothing traced (executables.py); the rest
        # compiled after one executable per shape of the LM head's dot has compiled alone (compile_waves).
        store = executables.Store.beside_persistent_cache(cfg, self.dtype.name)
        compiled, stats = executables.obtain(jobs, store, compile_waves, os.cpu_count() or 1)
        self.boot.update(stats)
        return ({k[1]: v for k, v in compiled.items() if k[0] == "prefill"},
                {k[1:]: v for k, v in compiled.items() if k[0] == "decode"})

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not one of the JAX runtime's {self.slots} slots")

    def _masks(self, rows: int, masks: Mapping[int, np.ndarray] | None):
        """The [rows, words] allowed-token masks of a call: the device's all-allowed one unless a row has a grammar."""
        if not masks:
            return self._all_allowed[rows]
        out = np.full((rows, mask_words(self.vocab_size)), -1, np.int32)
        for row, mask in masks.items():
            out[row] = mask
        return out

    def start(self, slot: int, prompt_ids: Sequence[int], params: SamplingParams,
              mask: np.ndarray | None = None) -> int:
        self._check_slot(slot)
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("empty prompt")
        if n > self.max_context:
            raise ValueError(f"prompt of {n} tokens exceeds the JAX runtime's max_context {self.max_context}")
        bucket = next(b for b in self.buckets if b >= n)
        tokens = np.zeros(bucket, np.int32)
        tokens[:n] = np.asarray(prompt_ids, np.int64).clip(0, self.cfg.vocab_size - 1)
        row = DeviceRow.of(params, self.cfg.vocab_size)
        self._temp[slot], self._top_k[slot], self._top_p[slot] = row.temperature, row.top_k, row.top_p
        self._keys[slot] = params.seed_words()
        sampling.set_row(self._rows, slot, row, self.cfg.vocab_size, params.logprobs is not None)
        self._min_tokens[slot] = params.min_tokens
        self._top_n[slot] = params.logprobs or 0
        self._prompt_len[slot] = n
        s = slice(slot, slot + 1)
        rows = {k: v[s].copy() for k, v in self._rows.items()}
        rows["suppress"] = self._min_tokens[s] > 0
        if self._spec is not None:
            self._spec.stale.add(slot)
        out, logits, self._cache, self._state, lp, prompt_lp = self._prefill[bucket](
            self.params, self._cache, self._state, np.int32(slot), tokens, np.int32(n), self._temp[s],
            self._top_k[s], self._top_p[s], self._keys[s], rows, self._masks(1, None if mask is None else {0: mask}),
            np.bool_(params.prompt_logprobs is not None))
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[slot] = (prompt_lp, n, params.prompt_logprobs)
        self._pos[slot] = n
        self._logits[slot] = (logits, 0)
        self._logprobs[slot] = ([lp], 0)
        return int(np.asarray(out)[0])

    def step(self, tokens: Mapping[int, int], masks: Mapping[int, np.ndarray] | None = None) -> dict[int, int]:
        if not tokens:
            return {}
        for slot in tokens:
            self._check_slot(slot)
            if self._pos[slot] == 0:
                raise RuntimeError(f"step() on slot {slot} before start()")
            if self._pos[slot] >= self.max_context:
                raise ValueError(f"sequence reached the JAX runtime's max_context {self.max_context}")
        live = np.zeros(self.slots, bool)
        live[list(tokens)] = True
        self._pos[~live] = 0                      # a slot left out is free from now on
        spec, self._spec = self._spec, None
        if spec is not None and spec.serves(tokens, masks):
            run = spec
            self.speculation["used"] += 1
        else:
            self.speculation["replaced"] += spec is not None
            b = next(n for n in self.batches if n > max(tokens))
            ids = np.zeros(b, np.int32)
            for slot, t in tokens.items():
                ids[slot] = min(max(int(t), 0), self.cfg.vocab_size - 1)
            undo = self._no_undo[b] if spec is None else spec.undo(b, self.vocab_size)
            run = self._dispatch(ids, live, undo, masks)
        self._pos[live] += 1
        ahead = None
        if self.pipeline and not masks and self._pos[live].max() < self.max_context:
            ahead = self._dispatch(run.out, live, self._no_undo[run.out.shape[0]], None)
        out = np.asarray(run.out)                 # waits for this step only: the next one is already queued
        if ahead is not None:
            ahead.fed, self._spec = out, ahead
        self._logits = {slot: (run.logits, slot) for slot in tokens}
        shared = [run.logprobs]                   # copied to the host once, by the first logprobs() that asks
        self._logprobs = {slot: (shared, slot) for slot in tokens}
        return {slot: int(out[slot]) for slot in tokens}

    def _dispatch(self, ids, live: np.ndarray, undo, masks) -> _Step:
        """Queue a decode step feeding ids [b] (host or device) to rows 0..b-1 at their current positions."""
        b = ids.shape[0]
        c = next(n for n in self.buckets if n > int(self._pos[:b].max()))
        on = live[:b]
        temp = np.where(on, self._temp[:b], 0.0).astype(np.float32)
        rows = {k: np.where(on.reshape(-1, *[1] * (v.ndim - 1)), v[:b], fill[0])
                for (k, v), fill in zip(self._rows.items(), self._free_row.values())}
        # tokens out so far (the one being fed in included) < min_tokens: the stop ids stay held back
        rows["suppress"] = on & (self._pos[:b] - self._prompt_len[:b] + 1 < self._min_tokens[:b])
        out, logits, self._cache, self._state, lp = self._decode[b, c](
            self.params, self._cache, self._state, ids, self._pos[:b].copy(), undo,
            temp, self._top_k[:b].copy(), self._top_p[:b].copy(), self._keys[:b].copy(), rows, self._masks(b, masks))
        return _Step(out, logits, lp, frozenset(np.flatnonzero(live).tolist()))

    def logits(self, slot: int) -> np.ndarray:
        arr, row = self._logits[slot]
        return np.array(arr[row], dtype=np.float32)

    def logprobs(self, slot: int) -> TokenLogprobs:
        box, row = self._logprobs[slot]
        box[0] = [np.asarray(a) for a in box[0]]     # to the host once per step (a no-op after the first call)
        chosen, ids, top = box[0]
        k = int(self._top_n[slot])
        return TokenLogprobs(float(chosen[row]), tuple(zip(ids[row, :k].tolist(), top[row, :k].tolist())))

    def prompt_logprobs(self, slot: int) -> list[TokenLogprobs]:
        arrays, n, k = self._prompt_logprobs.pop(slot)
        chosen, rank, ids, top = (np.asarray(a)[:n - 1].tolist() for a in arrays)
        return [TokenLogprobs(chosen[i], tuple(zip(ids[i][:k], top[i][:k])), rank[i]) for i in range(n - 1)]


def select_device(env: Mapping[str, str] = os.environ, xla_defaults: bool | None = None) -> str:
    """JAX's backend as G5G_DEVICE asks (serving/device.py): gpu pins JAX to its CUDA plugin, whose failure to start
    (an old driver, no GPU) JAX then raises instead of logging it and falling back to the CPU; that failure becomes
    NoGpuError. cpu pins it to the CPU; auto leaves JAX_PLATFORMS to JAX. This starts XLA, which reads XLA_FLAGS
    then only: the defaults go in first (xla_defaults; None: as G5G_JAX_XLA_DEFAULTS says)."""
    want = gpu_device.expected(env)
    if Settings.from_env(env).xla_defaults if xla_defaults is None else xla_defaults:
        apply_default_xla_flags()
    if want != "auto" and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cuda" if want == "gpu" else "cpu")
    try:
        backend = jax.default_backend()
    except Exception as e:   # "Unable to initialize backend 'cuda': …"; no GPU visible: an assert in JAX's backends()
        if want != "gpu":
            raise
        why = str(e).strip() or f"no 'cuda' backend started ({type(e).__name__}: no GPU visible, or no CUDA plugin)"
        raise gpu_device.no_gpu(f"jax: {why}", _plugin_cuda(), env) from e
    if want == "gpu" and backend != "gpu":
        raise gpu_device.no_gpu(f"jax's backend is {backend}", _plugin_cuda(), env)
    if want == "auto" and backend != "gpu":
        log.warning("JAX backend %s: serving on the CPU (%s=auto; gpu makes a missing GPU an error)", backend,
                    gpu_device.ENV)
    return backend


def _plugin_cuda() -> str | None:
    """The CUDA major of the installed JAX CUDA plugin (jax-cuda13-plugin: "13"), None without one."""
    from importlib import metadata
    for d in metadata.distributions():
        if m := re.match(r"^jax[-_]cuda(\d+)[-_]plugin$", d.metadata.get("Name") or ""):
            return m.group(1)
    return None


def _gpu_capability() -> tuple[int, int] | None:
    """The GPU's compute capability, e.g. (7, 5) for a T4, None off a GPU."""
    if jax.default_backend() != "gpu":
        return None
    major, minor = str(jax.devices()[0].compute_capability).split(".")[:2]
    return int(major), int(minor)


def _gpu_memory() -> int | None:
    """Bytes JAX may allocate on its GPU (its pool: 75% of the device unless XLA_PYTHON_CLIENT_MEM_FRACTION says
    otherwise), None off a GPU."""
    if jax.default_backend() != "gpu":
        return None
    return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")


def load(model_dir: str | Path, settings: Settings | None = None, max_context: int | None = None) -> JaxEngine:
    """Boot: read config and weights, compile the ladders (persistent cache), return a ready engine.

    max_context (the server's --max-model-len) caps the length ladder: buckets above it are dropped and it
    becomes the top.
    """
    settings = settings or Settings.from_env()
    if max_context:
        settings = dataclasses.replace(
            settings, buckets=tuple(b for b in settings.buckets if b < max_context) + (int(max_context),))
    t0 = time.perf_counter()
    xla_flags = apply_default_xla_flags() if settings.xla_defaults else os.environ.get("XLA_FLAGS", "")
    xla.listen()
    configure_persistent_cache(settings.cache_dir)
    select_device(xla_defaults=False)  # starts XLA, after its flags: G5G_DEVICE=gpu and no usable GPU stops here
    t_backend = time.perf_counter() - t0
    cfg = config.load(Path(model_dir))
    dtype = settings.resolve_dtype(_gpu_capability())     # a dtype the GPU cannot run: refused before anything
    gpu = _gpu_memory()
    if gpu and (no := memory_plan.refusal(Path(model_dir), settings.buckets[-1], settings.slots, gpu, rings=True,
                                          autotuned=True)):
        raise ValueError(no)      # before any weight is read: weights + KV + boot's autotuning do not fit JAX's pool
    params = checkpoint.load_params(Path(model_dir), cfg, dtype)
    t_load = time.perf_counter() - t0
    log.info("jax boot: load %.1fs (backend %s started in %.1fs, weights read in %.1fs)", t_load,
             jax.default_backend(), t_backend, t_load - t_backend)
    engine = JaxEngine(cfg, params, settings)
    engine.boot.update({"backend_s": round(t_backend, 3), "load_s": round(t_load, 3),
                        "boot_s": round(time.perf_counter() - t0, 3), "buckets": list(engine.buckets),
                        "dtype": str(engine.dtype), "backend": jax.default_backend(), "cache_dir": settings.cache_dir,
                        "xla_flags": xla_flags})
    b = engine.boot
    log.info("jax boot: compile %.1fs for %d executables: %d from the executable store in %.1fs; %d traced and "
             "lowered in %.1fs, then %d compiled by XLA and %d loaded from the persistent cache in %.1fs", b["compile_s"],
             b["executables"], b["store_hits"], b["store_load_s"], b["executables"] - b["store_hits"], b["lower_s"],
             b["boot_xla_compiles"], b["boot_cache_hits"], b["xla_s"])
    log.info("jax boot: weights %.2f GB on the device %.1fs after their upload began (%.1fs of it before the ladder)",
             b["weight_bytes"] / 1e9, b["weights_ready_s"], b["device_put_s"])
    log.info("jax runtime ready in %.1fs on %s/%s: %d executables for %d slots, batches %s, buckets %s; "
             "packed weights: %s; XLA_FLAGS %s", b["boot_s"], b["backend"], b["dtype"], b["executables"], b["slots"],
             b["batches"], b["buckets"], b["packed_dot"], b["xla_flags"] or "(none)")
    return engine
