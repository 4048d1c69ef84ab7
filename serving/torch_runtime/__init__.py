"""The PyTorch runtime: transformers' Gemma 4 text model behind the Engine seam (serving/engine.py), as
serving/jax_runtime/ is our own JAX model behind the same seam.

`load(model_dir)` reads a transformers Gemma 4 checkpoint (fp16, or compressed-tensors w8a16/w4a16), builds the
text model and returns a ready engine. Modules:
  engine         TorchEngine and `load`: slots, prefill, decode steps, logprobs
  attention      SlotKV: the batched KV cache and its attention (sm_75's SDPA backends)
  compile_cache  the compiled decode step's persistent cache, and what each compile cost
  precompiled    the compiled decode step kept whole across boots, dynamo's trace included (opt-in)
  prefill        prompts replayed from a CUDA graph per length bucket
  norms          Gemma 4's RMSNorms as one kernel each, for the prompt graphs' capture
  pipeline       the decode step dispatched ahead of the host
  sampling       the batched sampler, on the device
  packed_matmul  the packed int8/int4 Triton GEMV/GEMM and the int8 LM head
Settings come from the environment:
  G5G_DEVICE          gpu (the CUDA images) | cpu | auto (default): serving/device.py
  G5G_TORCH_SLOTS     sequences decoded together (default 8 on a GPU, 2 on a CPU)
  G5G_TORCH_PIPELINE  1 (default on a GPU): dispatch decode step t+1 before reading step t's tokens; 0: wait
  G5G_TORCH_COMPILE   1 (default): decode steps compiled by inductor with CUDA graphs; 0: eager; always: on a
                      CPU too (tests of the compile cache)
  G5G_TORCH_PREFILL_GRAPHS  1 (default): prompts from CUDA graphs (a GPU with slots); 0: eager prompts
  G5G_TORCH_FUSED_NORMS  1: the prompt graphs captured with each RMSNorm as one kernel; 0 (default): as transformers'
  G5G_TORCH_CACHE_DIR inductor's persistent cache (default ~/.cache/g5g-torch; empty: torch's temporary directory)
  G5G_TORCH_PRECOMPILED  1: the compiled decode step kept whole there, so a warm boot traces nothing; 0 (default)
  G5G_LM_HEAD         fp16 (default) | int8
  G5G_PACKED_ARCH, G5G_PACKED_SMS  the packed kernels' target as if on another GPU (75 and 40: a T4G)
"""
from .engine import TorchEngine, load, select_device

__all__ = ["TorchEngine", "load", "select_device"]
