"""Gemma 4 checkpoints at a real model's text shapes with random weights: no download, and the bytes a decode step
streams are the real model's. The widths come from serving/memory_plan.py's SHAPES (E2B, E4B), so the plan and the
measured model cannot disagree on them.

    text = text_config("e2b", layers=10)          # fewer layers, E2B's pattern kept
    build(ckpt, text)                             # fp16 safetensors on the GPU's device (the CPU without one)
    add_whole_vocab_tokenizer(ckpt)               # a tokenizer whose every id decodes (servers, `build.py bench`)
"""
from __future__ import annotations

import json
from pathlib import Path

# What transformers needs beside the widths to build the model (google/gemma-4-E2B-it's values, docs/FACTS.md).
EXTRA = dict(final_logit_softcapping=30.0, max_position_embeddings=131072, pad_token_id=0, eos_token_id=[1, 106],
             bos_token_id=2)
# A CPU run of a benchmark's code paths, not a measurement: every width small, E2B's layer kinds kept.
TINY = dict(vocab_size=1024, vocab_size_per_layer_input=1024, hidden_size=128, intermediate_size=256, head_dim=32,
            global_head_dim=64, sliding_window=16, hidden_size_per_layer_input=32)
TINY_LAYERS = dict(num_hidden_layers=6, num_kv_shared_layers=2,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"] * 2)


def relayered(text: dict, layers: int) -> dict:
    """`text` cut (or grown) to `layers` layers: its full-attention period and its share of KV-shared layers kept."""
    types = text["layer_types"]
    period = types.index("full_attention") + 1
    shared = text["num_kv_shared_layers"] * layers // text["num_hidden_layers"]
    return {**text, "num_hidden_layers": layers, "num_kv_shared_layers": shared,
            "layer_types": ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]}


def text_config(shape: str = "e2b", layers: int | None = None, tiny: bool = False) -> dict:
    """The text_config of a memory_plan shape, ready for transformers' Gemma4Config; `layers` changes the depth,
    `tiny` the widths (and, with no `layers`, gives 6 layers)."""
    from serving import memory_plan

    text = {**memory_plan.SHAPES[shape]["text_config"], **EXTRA}
    if layers is not None:
        text = relayered(text, layers)
    if tiny:
        text.update(TINY, **({} if layers is not None else TINY_LAYERS))
    return text


def fill(name: str, shape, draw, rand):
    """The random value of one tensor, by its name. Small q/k norm weights: q·k is unscaled in Gemma 4, and unit
    norm weights over 256-512 dims give one-hot attention, a chaotic model whose fp16 and fp32 runs disagree
    everywhere (trained models learn small ones). `draw(shape)`/`rand(shape)`: normal and uniform samples."""
    if name.endswith("layer_scalar"):
        return rand(shape) * 0.5 + 0.5
    if "q_norm" in name or "k_norm" in name:
        return 0.25 * (1 + 0.2 * draw(shape))
    if "norm" in name:
        return 1 + 0.2 * draw(shape)
    return draw(shape) / shape[-1] ** 0.5


def randomise(model, seed: int = 0) -> None:
    """Every floating parameter and buffer of `model` drawn afresh (fill), from one seeded generator, in the order
    the model lists them (so the same config and seed give the same weights); RoPE's and the embedding scale's
    buffers are computed, not drawn, and stay."""
    import torch

    dev = next(model.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed)

    def draw(shape):
        return torch.randn(shape, generator=gen, device=dev)

    def rand(shape):
        return torch.rand(shape, generator=gen, device=dev)

    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and "inv_freq" not in name and "embed_scale" not in name:
                t.copy_(fill(name, tuple(t.shape), draw, rand))


def build(ckpt: Path, text: dict, *, dtype: str = "float16", device: str | None = None, seed: int = 0) -> Path:
    """A Gemma4ForConditionalGeneration of `text` (no vision or audio tower), randomised, saved to `ckpt`. Built
    in `dtype` from the start (E4B in float32 would be 29 GB), on `device` (default: CUDA when there is one)."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(dev):
            model = Gemma4ForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(default)
    randomise(model, seed)
    model.save_pretrained(ckpt)
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return Path(ckpt)


def add_whole_vocab_tokenizer(ckpt: Path) -> None:
    """The tiny fixture's tokenizer (devtools/tiny_gemma4.py), grown to the checkpoint's vocabulary: every id past
    its own decodes as ' w<id>', so a server can detokenise whatever a random model picks."""
    from devtools.tiny_gemma4 import build_tokenizer

    build_tokenizer(ckpt)
    vocab_size = json.loads((ckpt / "config.json").read_text())["text_config"]["vocab_size"]
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"▁w{i}"] = i
    (ckpt / "tokenizer.json").write_text(json.dumps(tj))
