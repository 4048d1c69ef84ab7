"""Gemma 4's RMSNorms as one kernel each while prompt graphs are captured (prefill.py), opt-in until measured:
G5G_TORCH_FUSED_NORMS=1.

transformers' Gemma4RMSNorm launches about eight kernels a call (the input's float copy, pow, mean, add, pow, mul,
the weight's float copy, mul, the cast back), and a layer calls it about eight times (the tiny fixture: 46 calls in
6 layers), about half of a prompt forward's kernels: where a prompt graph's time goes at short prompts (H100: 10.4 ms
at 64 positions, 10.9 at 128, where a compiled decode step took 3.7). torch.rms_norm is one fused kernel on CUDA,
reducing in float32 as transformers' does. The compiled decode step never sees it: inductor fuses the norms itself.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator, Mapping

import torch

NORM_CLASS = "Gemma4RMSNorm"        # transformers' Gemma 4 norm (its forward: `normed * weight`, no `1 +`)


def from_env(env: Mapping[str, str]) -> bool:
    """G5G_TORCH_FUSED_NORMS: 1 captures the prompt graphs with fused norms; 0 (default) with transformers' own."""
    text = env.get("G5G_TORCH_FUSED_NORMS") or "0"
    if text not in ("0", "1"):
        raise ValueError(f"G5G_TORCH_FUSED_NORMS: {text!r} is not 0 or 1")
    return text == "1"


def _fused_forward(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = norm.weight.to(x.dtype) if norm.with_scale else None
    return torch.rms_norm(x, (x.shape[-1],), weight, norm.eps)


@contextmanager
def fused(model: torch.nn.Module) -> Iterator[int]:
    """Within: each Gemma4RMSNorm of `model` is torch.rms_norm (yields how many); after: transformers' own."""
    norms = [m for m in model.modules() if type(m).__name__ == NORM_CLASS]
    for m in norms:
        m.forward = functools.partial(_fused_forward, m)
    try:
        yield len(norms)
    finally:
        for m in norms:
            del m.forward
