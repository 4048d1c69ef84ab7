"""What a Gemma 4 text model costs in GPU memory and in bytes streamed per decoded token, per weight scheme.

Pure (json and struct only: no numpy, torch or jax), so the driver (`build.py fits`), the quantizer
(tools/quantize.py: which tensors it quantises) and the servers (refusing to start) share one rule.

Tensors are {name: shape} with names relative to the text model (`layers.0.mlp.up_proj.weight`), from a
config (`text_tensors`) or from a checkpoint's safetensors headers (`checkpoint_tensors`).
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
T4G_MIB = 15360
GPUS = {"t4g": T4G_MIB, "t4": T4G_MIB}
# CUDA context, cuBLAS workspace, activations, logits and sampling buffers: a stated allowance, not a measurement
# (the field run's vLLM left 15 360 - 13 501 MiB unused; docs/FACTS.md).
DEFAULT_OVERHEAD_MIB = 1024
# scheme -> (bits, group size or None for one scale per output channel); None: 16-bit weights.
SCHEMES = {"fp16": None, "w8a16": (8, None), "w4a16": (4, 32)}
SCALE_BYTES = 2                 # fp16 scales, one per output row (channel) or per group
# The LM head as the decode step reads it: fp16, or int8 with one scale per vocabulary row (a copy the PyTorch
# runtime quantises at load, G5G_LM_HEAD=int8; the tied embedding stays 16-bit for the gather, so a tied head adds
# the int8 copy to the resident bytes and streams only it).
LM_HEADS = ("fp16", "int8")
# What the PyTorch runtime's attention and sampler hold beside weights and KV (serving/torch_runtime/attention.py,
# serving/torch_runtime/sampling.py): a prompt's queries are attended ATTENTION_QUERY_CHUNK at a time, each query head's row of
# keys costing its boolean mask, SDPA's fp16 additive mask and the math backend's float32 scores and probabilities;
# per slot and vocabulary entry the sampler keeps bias, counts (float32, int32) and held, seen (bool), and a step's
# logits, their adjusted copies, the noise's int64 hash words and the top-k values and ids stay under 64 bytes,
# plus the float32 logits of the step dispatched ahead (serving/torch_runtime/pipeline.py), alive beside this one's.
ATTENTION_QUERY_CHUNK = 256
PREFILL_BYTES_PER_SCORE = 1 + 2 + 4 + 4
SAMPLER_STATE_BYTES = 4 + 4 + 1 + 1
SAMPLER_STEP_BYTES = 64 + 4
PREFIXES = ("model.language_model.", "model.")
# Linear weights the quantiser packs: attention, MLP and the per-layer-input gate/projection of every layer.
# Left in 16-bit (the quantisation_config's `ignore`): the tied embedding/LM head, the per-layer embedding table
# (a gather of 1/262 144 of it per token), per_layer_model_projection (one small matmul), norms and scalars.
QUANTISED = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|per_layer_input_gate"
                       r"|per_layer_projection)\.weight$")


def text_section(raw: dict) -> dict:
    return raw.get("text_config") or raw


def text_tensors(raw: dict) -> dict[str, tuple[int, ...]]:
    """The text model's weight tensors (those served; KV-shared layers have no k/v) from a config.json dict."""
    t = text_section(raw)
    n, d, heads = t["num_hidden_layers"], t["hidden_size"], t["num_attention_heads"]
    types = list(t["layer_types"])
    types[-1] = "full_attention"
    first_shared = n - int(t.get("num_kv_shared_layers") or 0)
    ple, vocab = int(t.get("hidden_size_per_layer_input") or 0), t["vocab_size"]
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, d), "norm.weight": (d,)}
    if ple:
        out["embed_tokens_per_layer.weight"] = (int(t.get("vocab_size_per_layer_input") or vocab), n * ple)
        out["per_layer_model_projection.weight"] = (n * ple, d)
        out["per_layer_projection_norm.weight"] = (ple,)
    for i, kind in enumerate(types):
        full = kind == "full_attention"
        hd = int(t.get("global_head_dim") or t["head_dim"]) if full else t["head_dim"]
        kvh = t["num_key_value_heads"]
        if full and t.get("attention_k_eq_v") and t.get("num_global_key_value_heads") is not None:
            kvh = t["num_global_key_value_heads"]
        p = f"layers.{i}."
        ff = t["intermediate_size"] * (2 if t.get("use_double_wide_mlp") and i >= first_shared else 1)
        out |= {p + "self_attn.q_proj.weight": (heads * hd, d), p + "self_attn.o_proj.weight": (d, heads * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
                p + "mlp.down_proj.weight": (d, ff), p + "layer_scalar": (1,)}
        out |= {p + f"{k}.weight": (d,) for k in ("input_layernorm", "post_attention_layernorm",
                                                  "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        if i < first_shared:
            out[p + "self_attn.k_proj.weight"] = (kvh * hd, d)
            out[p + "self_attn.k_norm.weight"] = (hd,)
            if not (full and t.get("attention_k_eq_v")):
                out[p + "self_attn.v_proj.weight"] = (kvh * hd, d)
        if ple:
            out |= {p + "per_layer_input_gate.weight": (ple, d), p + "per_layer_projection.weight": (d, ple),
                    p + "post_per_layer_input_norm.weight": (d,)}
    return out


def safetensors_headers(model_dir: Path) -> dict[str, dict]:
    """{tensor name: header entry (dtype, shape, …)} over model.safetensors or its sharded index."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    files = (sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
             if index.is_file() else [model_dir / "model.safetensors"])
    out: dict[str, dict] = {}
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            out |= {k: v for k, v in json.loads(fh.read(size)).items() if k != "__metadata__"}
    return out


def checkpoint_tensors(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], int]:
    """(text tensors as text_tensors names them, bytes of every other tensor: vision/audio towers) of a checkpoint."""
    text, other = {}, 0
    for name, meta in safetensors_headers(model_dir).items():
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix == "model." and name.startswith(("model.vision", "model.audio", "model.embed_vision",
                                                   "model.embed_audio")):
            prefix = None
        if prefix is None:
            other += meta["data_offsets"][1] - meta["data_offsets"][0]
        else:
            text[name[len(prefix):]] = tuple(meta["shape"])
    return text, other


def quantisable(name: str, shape: tuple[int, ...], scheme: str) -> bool:
    """Whether `scheme` packs this tensor: a QUANTISED linear whose input width its group size divides."""
    spec = SCHEMES[scheme]
    if spec is None or not QUANTISED.search(name) or len(shape) != 2:
        return False
    group = spec[1]
    return group is None or shape[1] % group == 0


def _gemma4_e2b_text(layers: int = 35) -> dict:
    """google/gemma-4-E2B-it's text_config, the fields the plan reads (docs/FACTS.md)."""
    return dict(vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size=1536, intermediate_size=6144,
                num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                global_head_dim=512, sliding_window=512, num_kv_shared_layers=20 * layers // 35,
                use_double_wide_mlp=True, hidden_size_per_layer_input=256, tie_word_embeddings=True,
                layer_types=["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(layers)])


def _gemma4_e4b_text() -> dict:
    """google/gemma-4-E4B-it's text_config, the fields the plan reads: as public ports of Gemma 4 write it
    (docs/FACTS.md: 42 layers, 5 sliding + 1 full, 18 KV-shared, no double-wide MLP); not read from the hub here."""
    return dict(vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size=2560, intermediate_size=10240,
                num_hidden_layers=42, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                global_head_dim=512, sliding_window=512, num_kv_shared_layers=18, use_double_wide_mlp=False,
                hidden_size_per_layer_input=256, tie_word_embeddings=True,
                layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(42)])


# --shape presets.
SHAPES = {"e2b": {"text_config": _gemma4_e2b_text()}, "e4b": {"text_config": _gemma4_e4b_text()}}


def tensor_bytes(name: str, shape: tuple[int, ...], scheme: str) -> int:
    count = 1
    for s in shape:
        count *= s
    if not quantisable(name, shape, scheme):
        return 2 * count
    bits, group = SCHEMES[scheme]
    scales = shape[0] * (shape[1] // group if group else 1)
    return count * bits // 8 + SCALE_BYTES * scales


@dataclass(frozen=True)
class Plan:
    scheme: str
    weights: int                # bytes resident: text model
    towers: int                 # bytes of the vision/audio towers (vLLM loads them; our runtimes do not)
    streamed_per_token: int     # bytes read per decode step: every linear + the LM head (not the gathers)
    kv_per_token: int           # bytes of KV cache per token of context, every non-shared layer at full length
    kv_per_token_sliding: int   # the same with sliding layers holding only their window (the floor)
    kv: int                     # slots x max_model_len x kv_per_token
    overhead: int
    gpu: int
    lm_head: str = "fp16"
    attention: int = 0          # the PyTorch runtime's attention and sampler buffers (attention_bytes)
    tuning: int = 0             # a runtime whose compiler autotunes its dots: what tuning the largest one holds

    @property
    def total(self) -> int:
        return self.weights + self.towers + self.kv + self.attention + self.overhead + self.tuning

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu

    def lines(self) -> list[str]:
        m = lambda b: f"{b / MIB:9.1f} MiB"  # noqa: E731
        head = "" if self.lm_head == "fp16" else f", {self.lm_head} LM head"
        return [f"weights ({self.scheme}{head}, text) {m(self.weights)}",
                *([f"vision/audio towers     {m(self.towers)}  (vLLM loads them; our runtimes do not)"]
                  if self.towers else []),
                f"KV cache                {m(self.kv)}  ({self.kv_per_token} B/token; sliding layers at their "
                f"window: {self.kv_per_token_sliding} B/token at this length)",
                *([f"attention + sampling   {m(self.attention)}  (prompt chunks' scores, per-slot sampler state)"]
                  if self.attention else []),
                f"overhead (stated)       {m(self.overhead)}",
                *([f"GEMM autotuning at boot {m(self.tuning)}  (a copy of the LM head and its logits)"]
                  if self.tuning else []),
                f"total                   {m(self.total)} of {m(self.gpu)}: "
                + ("fits" if self.fits else f"does NOT fit (over by {(self.total - self.gpu) / MIB:.1f} MiB)"),
                f"streamed per token      {self.streamed_per_token / 1e9:.3f} GB (decode bound on bandwidth)"]


def kv_bytes_per_token(raw: dict, max_len: int | None = None, elem_bytes: int = 2) -> int:
    """K and V of every layer that computes its own (KV-shared layers reuse an earlier layer's). With max_len,
    the per-token average when sliding layers keep only their window of a max_len context."""
    t = text_section(raw)
    tensors = text_tensors(raw)
    total = 0
    window = int(t.get("sliding_window") or 0)
    for i, kind in enumerate(t["layer_types"][:-1] + ["full_attention"]):
        k = tensors.get(f"layers.{i}.self_attn.k_proj.weight")
        if k is None:
            continue
        per = 2 * k[0] * elem_bytes                 # K and V rows (k_eq_v layers still cache both)
        if max_len and kind == "sliding_attention" and window:
            per = per * min(window, max_len) / max_len
        total += per
    return int(round(total))


def attention_bytes(raw: dict, max_model_len: int, slots: int) -> int:
    """What the PyTorch runtime's attention and sampler hold at most: one prompt chunk's scores over max_model_len
    keys, every query head, and the sampler's state and step per slot over the vocabulary."""
    t = text_section(raw)
    prefill = t["num_attention_heads"] * min(ATTENTION_QUERY_CHUNK, max_model_len) * max_model_len
    return prefill * PREFILL_BYTES_PER_SCORE + slots * t["vocab_size"] * (SAMPLER_STATE_BYTES + SAMPLER_STEP_BYTES)


def plan(raw: dict, scheme: str, max_model_len: int, slots: int, gpu_mib: int = T4G_MIB,
         overhead_mib: int = DEFAULT_OVERHEAD_MIB, tensors: dict | None = None, towers: int = 0,
         rings: bool = False, attention: bool = False, autotuned: bool = False, lm_head: str = "fp16") -> Plan:
    """rings: the runtime keeps sliding layers' KV as rings of their window (JAX, PyTorch); else at full length
    (vLLM's allocation counted as such). attention: count attention_bytes (the PyTorch runtime's). autotuned: the
    runtime's compiler autotunes each dot at boot (XLA on a GPU), running it on fresh copies of its operands and
    output: the LM head's is the largest (16-bit, [slots, vocab] float32 logits out), held once if the runtime
    compiles one executable per shape of it before the rest. lm_head: one of LM_HEADS."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    if lm_head not in LM_HEADS:
        raise ValueError(f"LM head {lm_head!r} is not one of {', '.join(LM_HEADS)}")
    tensors = tensors if tensors is not None else text_tensors(raw)
    sizes = {n: tensor_bytes(n, s, scheme) for n, s in tensors.items()}
    streamed = sum(b for n, b in sizes.items() if QUANTISED.search(n) or n.endswith("model_projection.weight"))
    tied = text_section(raw).get("tie_word_embeddings", raw.get("tie_word_embeddings", True)) \
        or "lm_head.weight" not in tensors
    head = "embed_tokens.weight" if tied else "lm_head.weight"
    vocab, width = tensors[head]
    if lm_head == "int8":
        int8 = vocab * width + SCALE_BYTES * vocab
        if not tied:            # an untied head is replaced by its int8 copy
            del sizes[head]
        sizes["lm_head.int8"] = int8
        streamed += int8
    else:
        streamed += sizes[head]
    per_tok, per_tok_rings = kv_bytes_per_token(raw), kv_bytes_per_token(raw, max_model_len)
    tuning = 2 * vocab * width + 4 * slots * vocab if autotuned else 0
    return Plan(tuning=tuning, scheme=scheme, weights=sum(sizes.values()), towers=towers, streamed_per_token=streamed,
                kv_per_token=per_tok, kv_per_token_sliding=per_tok_rings,
                kv=slots * max_model_len * (per_tok_rings if rings else per_tok), overhead=overhead_mib * MIB,
                gpu=gpu_mib * MIB, attention=attention_bytes(raw, max_model_len, slots) if attention else 0,
                lm_head=lm_head)


def plan_checkpoint(model_dir: Path, scheme: str | None, max_model_len: int, slots: int, text_only: bool = False,
                    **kw) -> Plan:
    """plan() from a checkpoint's config.json and its tensors' real shapes; scheme None: the checkpoint's own
    (compressed-tensors config → w8a16/w4a16, else fp16). Packed weights stay packed in every runtime (vLLM's
    Marlin, our PackedLinear and JAX's model.Packed); text_only: a runtime that never loads the vision/audio towers
    (the runtime manifest's serve.text_only)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    tensors, towers = checkpoint_tensors(model_dir)
    if text_only:
        towers = 0
    packed = {n.removesuffix("_packed"): s for n, s in tensors.items() if n.endswith(".weight_packed")}
    if packed:   # a quantised checkpoint: plan on the unpacked shapes (weight_shape) under its scheme
        tensors = {n: s for n, s in tensors.items() if not n.endswith(("_packed", "_scale", "_shape"))}
        tensors |= {n: text_tensors(raw)[n] for n in packed}
    return plan(raw, scheme or scheme_of(raw), max_model_len, slots, tensors=tensors, towers=towers, **kw)


def refusal(model_dir: Path, max_model_len: int, slots: int, gpu_bytes: int, rings: bool = False,
            attention: bool = False, autotuned: bool = False, lm_head: str = "fp16") -> str | None:
    """The one line a server logs before refusing to start when the plan says the model does not fit the GPU it
    runs on (weights + KV + the stated overhead), else None. A checkpoint the plan cannot read is not refused
    here: loading it reports what is wrong."""
    try:
        p = plan_checkpoint(model_dir, None, max_model_len, slots, text_only=True, gpu_mib=gpu_bytes // MIB,
                            rings=rings, attention=attention, autotuned=autotuned, lm_head=lm_head)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if p.fits:
        return None
    return (f"{model_dir} does not fit this GPU at --max-model-len {max_model_len} with {slots} slot(s): "
            + "; ".join(" ".join(line.split()) for line in p.lines()[:-1]))


def scheme_of(raw: dict) -> str:
    """fp16, or the SCHEMES name of a compressed-tensors quantization_config written by tools/quantize.py."""
    qc = raw.get("quantization_config")
    if not qc:
        return "fp16"
    for group in qc.get("config_groups", {}).values():
        w = group.get("weights") or {}
        for name, spec in SCHEMES.items():
            if spec and w.get("num_bits") == spec[0]:    # int4 groups of 64/128: planned as 32 (0.03 B/param more)
                return name
    raise ValueError("quantization_config: not one of the schemes " + ", ".join(SCHEMES))
