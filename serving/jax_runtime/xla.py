"""Process-wide XLA set-up for the JAX runtime: compile accounting (every executable compiled or loaded from the
persistent cache, every trace), the persistent compilation cache, and the XLA flags the runtime adds by default.
XLA reads its flags once per process, when a backend starts: engine.load applies them first."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Mapping

import jax
from jax._src import xla_bridge  # backends_are_initialized: XLA reads XLA_FLAGS once, when a backend starts

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


_thread = threading.local()     # cache hits of the calling thread (listeners run in the thread that compiles)


def _on_event(event: str, **_kw) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        with _counts_lock:
            _counts["cache_hits"] += 1
        _thread.hits = thread_cache_hits() + 1


def thread_cache_hits() -> int:
    """Persistent-cache hits so far in this thread: whether one compile() call loaded rather than compiled."""
    return getattr(_thread, "hits", 0)


def compile_counts() -> dict:
    """Process-wide counts so far: backend compiles (incl. persistent-cache loads), traces, persistent-cache hits."""
    listen()
    with _counts_lock:
        return dict(_counts)


def listen() -> None:
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


# -- default flags --------------------------------------------------------------------------------------------
# XLA flags the runtime sets unless the user's XLA_FLAGS names them (G5G_JAX_XLA_DEFAULTS=0: none): the fastest
# decode measured on a GPU (benchmarks/decode_variants.py, benchmarks/RESULTS.md) runs the whole step as CUDA graphs,
# the sampler's conditional and bisection loop included (H200: 5.31 ms per step, 7.07 with XLA's own command-buffer
# set). XLA's CPU backend reads none of them.
DEFAULT_XLA_FLAGS = {
    "--xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE",
    "--xla_gpu_graph_min_graph_size": "1",
}


def with_default_xla_flags(current: str, defaults: Mapping[str, str] = DEFAULT_XLA_FLAGS) -> str:
    """XLA_FLAGS `current` plus each default flag it does not name (the user's value of a flag wins)."""
    named = {flag.split("=", 1)[0] for flag in current.split()}
    return " ".join([*current.split(), *(f"{k}={v}" for k, v in defaults.items() if k not in named)])


def apply_default_xla_flags(env=os.environ) -> str:
    """Set the defaults into env["XLA_FLAGS"] before XLA reads it (once per process, when a backend starts)."""
    current = env.get("XLA_FLAGS", "")
    wanted = with_default_xla_flags(current)
    if wanted == current:
        return current
    if xla_bridge.backends_are_initialized():
        log.warning("XLA backends already started: XLA_FLAGS defaults not applied (%s)", current)
        return current
    env["XLA_FLAGS"] = wanted
    return wanted


# -- the paths XLA's GPU compiler takes -----------------------------------------------------------------------
# Dots become Triton GEMMs from this compute capability on (gpu_compiler.cc runs GemmFusion only when the GPU
# IsAtLeast(kAmpere)) unless XLA_FLAGS turns them off; every other dot is a cuBLAS call, which cannot take a convert
# of its operands (model.matmul's packed weights).
TRITON_GEMM_FROM = (8, 0)
TRITON_GEMM_FLAG = "--xla_gpu_enable_triton_gemm"


def flag_value(xla_flags: str, flag: str) -> str | None:
    """The value XLA takes for a flag in XLA_FLAGS (the last one named; a bare flag is true), None if not named."""
    value = None
    for item in xla_flags.split():
        name, _, val = item.partition("=")
        if name == flag:
            value = val or "true"
    return value


def triton_gemm(capability: tuple[int, int] | None, xla_flags: str) -> bool:
    """Whether XLA compiles dots as Triton GEMMs: on a GPU (capability not None) of TRITON_GEMM_FROM or newer whose
    XLA_FLAGS do not turn them off (`--xla_gpu_enable_triton_gemm=false` reproduces sm_75's cuBLAS dots on an H200)."""
    off = (flag_value(xla_flags, TRITON_GEMM_FLAG) or "true").lower() in ("false", "0", "no", "f", "n")
    return capability is not None and tuple(capability) >= TRITON_GEMM_FROM and not off
