"""The JAX runtime: our own Gemma 4 text model in JAX behind the Engine seam (serving/engine.py).

`load(model_dir)` reads a transformers Gemma 4 checkpoint (config.json + safetensors), compiles the bucket
ladder and returns a ready engine. Settings come from the environment:
  G5G_DEVICE         gpu (the CUDA images) | cpu | auto (default): serving/device.py
  G5G_JAX_BUCKETS    prompt/capacity ladder, e.g. "64,128,256,512,1024,2048,4096" (largest = max_context)
  G5G_JAX_CACHE_DIR  persistent compilation cache (default ~/.cache/g5g-jax; empty disables it)
  G5G_JAX_DTYPE      auto (float16 on GPU, float32 on CPU) | float32 | float16 | bfloat16 (refused below sm_80)
  G5G_JAX_SLOTS      sequences decoded together (continuous batching; default 8)
  G5G_JAX_BATCHES    extra, smaller decode batch sizes to compile, e.g. "1,4" (default: none, only SLOTS)
  G5G_JAX_PIPELINE   1 (default): dispatch decode step t+1 before reading step t's tokens; 0: no speculation
  G5G_JAX_XLA_DEFAULTS 1 (default): add xla.DEFAULT_XLA_FLAGS (the step as CUDA graphs) to XLA_FLAGS for each
                     flag XLA_FLAGS does not name; 0: XLA's own defaults
"""
from .config import CheckpointError
from .engine import JaxEngine, Settings, load, select_device
from .xla import compile_counts

__all__ = ["CheckpointError", "JaxEngine", "Settings", "compile_counts", "load", "select_device"]
