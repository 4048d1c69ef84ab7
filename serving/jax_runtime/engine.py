"""JaxEngine: the Engine seam (serving/engine.py) over the JAX Gemma 4 port, with a fixed set of compiled shapes.

One ladder of buckets serves as both prompt lengths and full-attention capacities. At boot every executable is
compiled ahead of time (through JAX's persistent cache, so a second boot loads them): prefill for each prompt
bucket P (into capacity P), decode for each capacity C, and grow C -> next C. After boot only those compiled
executables run; calling one with another shape raises instead of compiling.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import checkpoint, config, model

DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)
log = logging.getLogger("serving.jax")


# -- compile accounting --------------------------------------------------------------------------------------
# jax.monitoring reports every executable obtained (XLA compile or persistent-cache load) as a backend-compile
# duration event, and every trace as a jaxpr-trace event. Counted process-wide; engines report deltas.
_counts = {"compiles": 0, "traces": 0, "cache_hits": 0}
_counts_lock = threading.Lock()
_listening = False


def _on_duration(event: str, duration: float, **_kw) -> None:
    key = {"/jax/core/compile/backend_compile_duration": "compiles",
           "/jax/core/compile/jaxpr_trace_duration": "traces"}.get(event)
    if key:
        with _counts_lock:
            _counts[key] += 1


def _on_event(event: str, **_kw) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        with _counts_lock:
            _counts["cache_hits"] += 1


def compile_counts() -> dict:
    """Process-wide counts so far: backend compiles (incl. persistent-cache loads), traces, persistent-cache hits."""
    _listen()
    with _counts_lock:
        return dict(_counts)


def _listen() -> None:
    global _listening
    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)
        _listening = True


def configure_persistent_cache(cache_dir: str | None) -> None:
    """Point JAX's persistent compilation cache at cache_dir (None/'' disables it); cache every executable."""
    if cache_dir:
        try:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only or foreign mount must not stop the server: boot compiles instead
            log.warning("G5G_JAX_CACHE_DIR %s unusable (%s): compiling without the persistent cache", cache_dir, e)
            cache_dir = None
    if not cache_dir:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# -- settings ---------------------------------------------------------------------------------------------------
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

    @classmethod
    def from_env(cls, env=os.environ) -> "Settings":
        s = cls()
        buckets = parse_buckets(env["G5G_JAX_BUCKETS"]) if env.get("G5G_JAX_BUCKETS") else s.buckets
        cache_dir = env.get("G5G_JAX_CACHE_DIR", s.cache_dir)
        return cls(buckets=buckets, dtype=env.get("G5G_JAX_DTYPE", s.dtype), cache_dir=cache_dir or None)

    def resolve_dtype(self):
        name = self.dtype
        if name == "auto":
            name = "float32" if jax.default_backend() == "cpu" else "float16"
        if name not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"G5G_JAX_DTYPE: {self.dtype!r} is not auto, float32, float16 or bfloat16")
        return jnp.dtype(name)


# -- the engine ---------------------------------------------------------------------------------------------------
class JaxEngine:
    """One sequence at a time: start(prompt) resets it, step(token) extends it. Not thread-safe by itself;
    the API layer serialises requests."""

    def __init__(self, cfg: config.TextConfig, params: dict, settings: Settings):
        self.cfg = cfg
        self.dtype = settings.resolve_dtype()
        limit = cfg.max_position_embeddings
        self.buckets = tuple(b for b in settings.buckets if b <= limit) or (min(settings.buckets[0], limit),)
        self.max_context = self.buckets[-1]
        t0 = time.perf_counter()
        params = dict(params)
        self.ple_table = params.pop("ple_embed", None)  # host-side: see model._embed
        self.params = jax.device_put(params)
        t_put = time.perf_counter() - t0
        before = compile_counts()
        self._prefill, self._decode, self._grow = self._compile_ladder()
        after = compile_counts()
        self.boot = {"device_put_s": round(t_put, 3), "compile_s": round(time.perf_counter() - t0 - t_put, 3),
                     "executables": len(self._prefill) + len(self._decode) + len(self._grow),
                     **{f"boot_{k}": after[k] - before[k] for k in after}}
        self._cache = None
        self._capacity = 0
        self._pos = 0

    def _compile_ladder(self):
        cfg, dt = self.cfg, self.dtype
        params_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.params)
        i32 = jax.ShapeDtypeStruct((), jnp.int32)

        def rows_spec(n):
            if self.ple_table is None:
                return None
            return jax.ShapeDtypeStruct((n, self.ple_table.shape[1]), self.ple_table.dtype)

        def cache_spec(c):
            return [(jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2 for k, _ in model.empty_cache(cfg, c, dt)]

        prefill, decode, grow = {}, {}, {}
        for n, c in enumerate(self.buckets):
            prefill[c] = jax.jit(functools.partial(model.prefill, cfg, c)).lower(
                params_spec, jax.ShapeDtypeStruct((c,), jnp.int32), i32, rows_spec(c)).compile()
            decode[c] = jax.jit(functools.partial(model.decode, cfg), donate_argnums=(1,)).lower(
                params_spec, cache_spec(c), i32, i32, rows_spec(1)).compile()
            if n + 1 < len(self.buckets):
                nxt = self.buckets[n + 1]
                grow[c] = (nxt, jax.jit(functools.partial(model.grow, cfg, nxt)).lower(
                    cache_spec(c)).compile())
        return prefill, decode, grow

    def _ple_rows(self, tokens: np.ndarray):
        if self.ple_table is None:
            return None
        return self.ple_table[np.minimum(tokens, self.ple_table.shape[0] - 1)]

    def start(self, prompt_ids: Sequence[int]) -> np.ndarray:
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("empty prompt")
        if n > self.max_context:
            raise ValueError(f"prompt of {n} tokens exceeds the JAX runtime's max_context {self.max_context}")
        bucket = next(b for b in self.buckets if b >= n)
        tokens = np.zeros(bucket, np.int32)
        tokens[:n] = np.asarray(prompt_ids, np.int64).clip(0, self.cfg.vocab_size - 1)
        self._cache = None  # release the previous sequence's buffers before allocating the new ones
        logits, self._cache = self._prefill[bucket](self.params, tokens, np.int32(n), self._ple_rows(tokens))
        self._capacity, self._pos = bucket, n
        return np.array(logits, dtype=np.float32)  # a writable host copy: the sampler may scale it in place

    def step(self, token_id: int) -> np.ndarray:
        if self._cache is None:
            raise RuntimeError("step() before start()")
        if self._pos >= self.max_context:
            raise ValueError(f"sequence reached the JAX runtime's max_context {self.max_context}")
        while self._pos >= self._capacity:
            nxt, fn = self._grow[self._capacity]
            self._cache, self._capacity = fn(self._cache), nxt
        token = np.int32(min(max(int(token_id), 0), self.cfg.vocab_size - 1))
        logits, self._cache = self._decode[self._capacity](self.params, self._cache, token, np.int32(self._pos),
                                                           self._ple_rows(token[None]))
        self._pos += 1
        return np.array(logits, dtype=np.float32)  # a writable host copy: the sampler may scale it in place


def load(model_dir: str | Path, settings: Settings | None = None, max_context: int | None = None) -> JaxEngine:
    """Boot: read config and weights, compile the bucket ladder (persistent cache), return a ready engine.

    max_context (the server's --max-model-len) caps the ladder: buckets above it are dropped and it becomes the top.
    """
    settings = settings or Settings.from_env()
    if max_context:
        settings = dataclasses.replace(
            settings, buckets=tuple(b for b in settings.buckets if b < max_context) + (int(max_context),))
    t0 = time.perf_counter()
    _listen()
    configure_persistent_cache(settings.cache_dir)
    cfg = config.load(Path(model_dir))
    dtype = settings.resolve_dtype()
    params = checkpoint.load_params(Path(model_dir), cfg, dtype)
    t_load = time.perf_counter() - t0
    engine = JaxEngine(cfg, params, settings)
    engine.boot.update({"load_s": round(t_load, 3), "boot_s": round(time.perf_counter() - t0, 3),
                        "buckets": list(engine.buckets), "dtype": str(engine.dtype),
                        "backend": jax.default_backend(), "cache_dir": settings.cache_dir})
    b = engine.boot
    log.info("jax runtime ready in %.1fs on %s/%s: %d executables for buckets %s (%d from the persistent cache), "
             "compile %.1fs, load %.1fs", b["boot_s"], b["backend"], b["dtype"], b["executables"], b["buckets"],
             b["boot_cache_hits"], b["compile_s"], b["load_s"])
    return engine
