"""PyTorch runtime: a Gemma 4 checkpoint served through transformers, one sequence at a time with a KV cache.

The checkpoint is the released multimodal layout (`Gemma4ForConditionalGeneration`, text weights under
`model.language_model.*`). We serve text only, so we build transformers' `Gemma4ForCausalLM` from the
`text_config` and load just the language-model tensors into it (the vision and audio towers are never read).
float16 on CUDA (Turing has no bf16 datapath), float32 on CPU.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

log = logging.getLogger("serving.pytorch")

_TEXT_PREFIX = {r"^model\.language_model\.": "model."}


class TorchEngine:
    """serving.engine.Engine over a transformers causal LM with `past_key_values` (DynamicCache)."""

    def __init__(self, model, text_config, device: torch.device, max_context: int):
        self.model = model
        self.text_config = text_config
        self.device = device
        self.max_context = max_context
        self._cache = None
        self._pos = 0

    @torch.inference_mode()
    def _forward(self, ids: Sequence[int]) -> np.ndarray:
        input_ids = torch.tensor([list(ids)], device=self.device)
        positions = torch.arange(self._pos, self._pos + len(ids), device=self.device)[None]
        out = self.model(input_ids=input_ids, position_ids=positions, past_key_values=self._cache,
                         use_cache=True, logits_to_keep=1)
        self._pos += len(ids)
        return out.logits[0, -1].float().cpu().numpy()

    def start(self, prompt_ids: Sequence[int]) -> np.ndarray:
        from transformers.cache_utils import DynamicCache

        if not prompt_ids:
            raise ValueError("empty prompt")
        # DynamicCache built from the config keeps sliding-window layers bounded, as Gemma 4 expects.
        self._cache = DynamicCache(config=self.text_config)
        self._pos = 0
        return self._forward(prompt_ids)

    def step(self, token_id: int) -> np.ndarray:
        if self._cache is None:
            raise RuntimeError("step() before start()")
        return self._forward([token_id])


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
    limit = text_config.max_position_embeddings
    log.info("loaded %s on %s as %s (%d layers, context %d)", model_dir, dev, dtype,
             text_config.num_hidden_layers, min(limit, max_context or limit))
    return TorchEngine(model, text_config, dev, min(limit, max_context or limit))
