"""Read a Gemma 4 safetensors checkpoint into numpy parameter trees (no jax, no torch).

Our own reader of the safetensors layout (8-byte header size, JSON header, raw little-endian data) because
safetensors' numpy frontend cannot represent bfloat16, the dtype Gemma 4 checkpoints ship in; ml_dtypes can.
Weights are taken from `model.language_model.*` (Gemma4ForConditionalGeneration, the Hub layout) or `model.*`
(Gemma4ForCausalLM); vision and audio towers are never read.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from serving import quantized

from .config import CheckpointError, TextConfig
from .model import Packed

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
PREFIXES = ("model.language_model.", "model.")


class SafetensorsDir:
    """Tensor name -> numpy array (memory-mapped) over model.safetensors or a sharded index."""

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        single = model_dir / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: no readable 'weight_map' ({e})") from None
            files = sorted({model_dir / f for f in weight_map.values()})
        elif single.is_file():
            files = [single]
        else:
            raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
        self._where: dict[str, tuple[Path, dict]] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: shard {f.name} not found")
            header, base = self._header(f)
            for name, meta in header.items():
                if name != "__metadata__":
                    self._where[name] = (f, {**meta, "base": base})

    @staticmethod
    def _header(path: Path) -> tuple[dict, int]:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path}: truncated safetensors file")
            (size,) = struct.unpack("<Q", head)
            try:
                return json.loads(fh.read(size)), 8 + size
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise CheckpointError(f"{path}: unreadable safetensors header") from None

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> np.ndarray:
        path, meta = self._where[name]
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        if path not in self._maps:
            with open(path, "rb") as fh:
                self._maps[path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        start, end = meta["data_offsets"]
        count = int(np.prod(meta["shape"], dtype=np.int64))
        arr = np.frombuffer(self._maps[path], dtype=dtype, count=count, offset=meta["base"] + start)
        if arr.nbytes != end - start:
            raise CheckpointError(f"{path}: tensor {name} size does not match its shape {meta['shape']}")
        return arr.reshape(meta["shape"])


def _quantized_args(model_dir: Path) -> dict | None:
    """The weights' args of a compressed-tensors checkpoint (serving/quantized.py), None for a 16-bit one."""
    try:
        return quantized.weight_args(json.loads((model_dir / "config.json").read_text()))
    except (OSError, json.JSONDecodeError):
        return None                      # config.json problems are config.load's to report
    except quantized.QuantizedCheckpointError as e:
        raise CheckpointError(f"{model_dir}/config.json: {e}") from None


def _prefix(names: set[str], where: Path) -> str:
    for p in PREFIXES:
        if p + "embed_tokens.weight" in names:
            return p
    raise CheckpointError(f"{where}: no 'model.language_model.embed_tokens.weight' (nor 'model.embed_tokens.weight')")


CHUNK_BYTES = 64 << 20    # one task of a conversion: a row block of the output this large


def _converted(pool: ThreadPoolExecutor, pending: list[Future], src, dtype, transpose: bool):
    """src (a memory-mapped tensor) as a C-contiguous array of dtype, transposed if asked: the tensor itself when
    nothing changes; else a new array that tasks appended to `pending` fill in row blocks. Transposing and casting
    gigabytes is most of a load, and numpy releases the GIL while it copies: every core takes a share.

    src may be a list of tensors of as many rows (columns, transposed): they come out side by side, one array."""
    parts = src if isinstance(src, list) else [src]
    if len(parts) == 1 and not transpose and parts[0].dtype == dtype:
        return parts[0]
    views = [p.T if transpose else p for p in parts]
    if len(views) == 1:
        out = np.empty(views[0].shape, dtype)
        targets = [out]
    else:
        out = np.empty((views[0].shape[0], sum(v.shape[1] for v in views)), dtype)
        edges = np.cumsum([0] + [v.shape[1] for v in views])
        targets = [out[:, a:b] for a, b in zip(edges, edges[1:])]
    step = max(1, CHUNK_BYTES // max(1, out[:1].nbytes))
    for target, view in zip(targets, views):
        def block(r0: int, target=target, view=view) -> None:
            target[r0:r0 + step] = view[r0:r0 + step]

        pending += [pool.submit(block, r0) for r0 in range(0, len(out), step)]
    return out


def load_params(model_dir: Path, cfg: TextConfig, dtype, workers: int | None = None) -> dict:
    """The parameter tree the model functions take, as numpy arrays of `dtype`, shapes checked against cfg.

    Linear weights are stored transposed ([in, out]) so the model computes x @ W. Tensors already in that form
    stay memory-mapped; the others are converted on `workers` threads (default: every core).
    """
    pending: list[Future] = []
    with ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
        params = _read_params(Path(model_dir), cfg, lambda src, transpose=False, to=None: _converted(
            pool, pending, src, np.dtype(to or dtype), transpose))
        for task in pending:
            task.result()
    return params


def _read_params(model_dir: Path, cfg: TextConfig, convert) -> dict:
    """load_params' tree; convert(tensor, transpose=False) gives each tensor's array of the parameter dtype."""
    st = SafetensorsDir(model_dir)
    names = st.names()
    prefix = _prefix(names, Path(model_dir))
    qargs = _quantized_args(Path(model_dir))

    def raw(key: str, shape: tuple | None = None) -> np.ndarray:
        full = prefix + key
        if full not in names:
            raise CheckpointError(f"{model_dir}: tensor {full!r} missing from the checkpoint")
        arr = st.get(full)
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"{model_dir}: tensor {full!r} has shape {tuple(arr.shape)}, config says {shape}")
        return arr

    def get(key: str, shape: tuple | None = None, optional_default=None) -> np.ndarray:
        if optional_default is not None and prefix + key not in names:
            return convert(np.asarray(optional_default, np.float32))
        return convert(raw(key, shape))

    def source(key: str, n_in: int, n_out: int | None):
        """(weight [out, in] as stored, or unpacked to integers; its scales [out, groups], None if not packed)."""
        full = prefix + key
        packed = qargs and full not in names and full + "_packed" in names
        w = quantized.unpack(st.get(full + "_packed"), st.get(full + "_shape"), qargs["num_bits"]) if packed \
            else raw(key)
        if w.ndim != 2 or w.shape[1] != n_in or (n_out is not None and w.shape[0] != n_out):
            raise CheckpointError(f"{model_dir}: tensor {full!r} has shape {w.shape}, expected "
                                  f"[{n_out if n_out is not None else 'N'}, {n_in}]")
        if not packed:
            return w, None
        scale = st.get(full + "_scale")
        quantized.group_size(scale, n_in)          # refuses scales that do not divide the inputs
        return w, scale

    def linear(n_in: int, *parts: tuple[str, int | None]):
        """[in, out] of a linear weight, or of several that read the same input side by side ([in, out1 + out2 …]:
        one dot per step where XLA would otherwise concatenate them on every call); an array, or model.Packed for
        compressed-tensors packed ones. parts: (key, out width or None: the file's for the first, the first's after)."""
        srcs: list = []
        for key, n_out in parts:
            srcs.append(source(key, n_in, n_out if n_out is not None or not srcs else srcs[0][0].shape[0]))
        scales = [scale for _, scale in srcs]
        if any(sc is None for sc in scales):
            if any(sc is not None for sc in scales):
                raise CheckpointError(f"{model_dir}: {', '.join(prefix + k for k, _ in parts)} read the same input "
                                      "but only some are packed: quantise all of them or none")
            return convert([w for w, _ in srcs], transpose=True)
        if len({sc.shape[1] for sc in scales}) > 1:
            raise CheckpointError(f"{model_dir}: {', '.join(prefix + k for k, _ in parts)} read the same input "
                                  "but are quantised with different group sizes")
        q_type = ml_dtypes.int4 if qargs["num_bits"] == 4 else np.int8
        return Packed(convert([w for w, _ in srcs], transpose=True, to=q_type), convert(scales, transpose=True))

    d, h, v = cfg.hidden_size, cfg.num_heads, cfg.vocab_size
    embed = get("embed_tokens.weight", (v, d))
    params: dict = {"embed": embed, "final_norm": get("norm.weight", (d,))}
    if cfg.tie_word_embeddings or "lm_head.weight" not in names:
        params["lm_head"] = None  # tied: logits = h @ embed.T
    else:
        lm = st.get("lm_head.weight")
        if tuple(lm.shape) != (v, d):
            raise CheckpointError(f"{model_dir}: tensor 'lm_head.weight' has shape {lm.shape}, expected {(v, d)}")
        params["lm_head"] = convert(lm, transpose=True)
    if cfg.ple_dim:
        n, p = cfg.num_layers, cfg.ple_dim
        params["ple_embed"] = get("embed_tokens_per_layer.weight", (cfg.ple_vocab_size, n * p))
        params["ple_proj"] = linear(d, ("per_layer_model_projection.weight", n * p))
        params["ple_norm"] = get("per_layer_projection_norm.weight", (p,))

    layers = []
    for i, spec in enumerate(cfg.layers):
        pre = f"layers.{i}."
        hd, kvh = spec.head_dim, spec.num_kv_heads
        # q, k and v read the same normed input, as do gate and up: each group is one weight (model.py splits)
        qkv = [(pre + "self_attn.q_proj.weight", h * hd)]
        if spec.kv_source == i:  # shared layers have no k/v weights of their own (any in the file are unused)
            qkv.append((pre + "self_attn.k_proj.weight", kvh * hd))
            if not spec.k_eq_v:
                qkv.append((pre + "self_attn.v_proj.weight", kvh * hd))
        lp = {
            "input_ln": get(pre + "input_layernorm.weight", (d,)),
            "post_attn_ln": get(pre + "post_attention_layernorm.weight", (d,)),
            "pre_ff_ln": get(pre + "pre_feedforward_layernorm.weight", (d,)),
            "post_ff_ln": get(pre + "post_feedforward_layernorm.weight", (d,)),
            "qkv": linear(d, *qkv),
            "q_norm": get(pre + "self_attn.q_norm.weight", (hd,)),
            "o": linear(h * hd, (pre + "self_attn.o_proj.weight", d)),
            "layer_scalar": get(pre + "layer_scalar", (1,), optional_default=[1.0]),
        }
        lp["gate_up"] = linear(d, (pre + "mlp.gate_proj.weight", None), (pre + "mlp.up_proj.weight", None))
        ff = (lp["gate_up"].q if isinstance(lp["gate_up"], Packed) else lp["gate_up"]).shape[1] // 2
        lp["down"] = linear(ff, (pre + "mlp.down_proj.weight", d))
        if spec.kv_source == i:
            lp["k_norm"] = get(pre + "self_attn.k_norm.weight", (hd,))
        if cfg.ple_dim:
            lp["ple_gate"] = linear(d, (pre + "per_layer_input_gate.weight", cfg.ple_dim))
            lp["ple_proj"] = linear(cfg.ple_dim, (pre + "per_layer_projection.weight", d))
            lp["ple_ln"] = get(pre + "post_per_layer_input_norm.weight", (d,))
        layers.append(lp)
    params["layers"] = layers
    return params
