"""Write a Gemma 4 checkpoint as a compressed-tensors one: weight-only int8 (one scale per output channel) or int4
(one scale per group of 32 inputs), symmetric, packed into int32 ("pack-quantized") — the format and schemes
vLLM's Marlin kernels run on sm_75 (uint8b128 / uint4b8), read by our JAX and PyTorch runtimes too.

    python tools/quantize.py --model DIR --scheme {w8a16,w4a16} --out DIR [--group-size 32]

A build-time tool, not image code: `build.py quantize` runs it in a subprocess (it needs torch and
compressed-tensors, the `quantize` extra; the driver imports neither, and the images never install it).
Scales and packing are compressed-tensors' own (calculate_qparams, PackedQuantizationCompressor). Which tensors
are packed is serving/memory_plan.py's rule; every other tensor (embeddings, towers, norms) is copied unchanged,
and config.json gains the `quantization_config` vLLM and transformers read.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

try:
    import torch
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors import safe_open
    from safetensors.torch import save_file
except ImportError as e:        # exit 3: build.py names the extra to install
    print(f"error: {e.name} is not installed (pip install -e '.[quantize]')", file=sys.stderr)
    sys.exit(3)

from serving import memory_plan

SHARD_BYTES = 4 << 30
# Linear modules never packed, as compressed-tensors `ignore` regexes (vLLM and transformers match module names;
# regexes survive vLLM's renaming of the checkpoint's prefixes): the towers, the PLE projection, the LM head.
IGNORE = ["lm_head", "re:.*vision_tower.*", "re:.*audio_tower.*", "re:.*embed_vision.*", "re:.*embed_audio.*",
          "re:.*per_layer_model_projection$"]


def scheme_args(scheme: str, group_size: int | None) -> QuantizationArgs:
    bits, default_group = memory_plan.SCHEMES[scheme]
    group = group_size if bits == 4 and group_size else default_group
    return QuantizationArgs(num_bits=bits, type="int", symmetric=True, dynamic=False,
                            strategy="group" if group else "channel", group_size=group)


def pack(weight: torch.Tensor, args: QuantizationArgs) -> dict[str, torch.Tensor]:
    """{weight_packed, weight_scale, weight_shape} of one [out, in] weight, scales as float16 (Turing's dtype)."""
    w = weight.to(torch.float32)
    rows = w.reshape(w.shape[0], -1, args.group_size) if args.group_size else w[:, None, :]
    scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
    scale = scale.to(torch.float16)     # rounded first: the values are quantised against the scale stored
    if not args.group_size:
        scale, zero = scale.reshape(-1, 1), zero.reshape(-1, 1)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale.to(torch.float32), "weight_zero_point": zero}, scheme)
    out["weight_scale"] = scale
    return out


def quantize(model_dir: Path, out: Path, scheme: str, group_size: int | None = None, log=print,
             device: str = "cpu") -> dict:
    """Write the quantised checkpoint into `out`; returns a summary (tensors packed, bytes before/after).
    `device`: where the scales and packing are computed (a GPU packs a 4B model in seconds)."""
    model_dir, out = Path(model_dir), Path(out)
    raw = json.loads((model_dir / "config.json").read_text())
    args = scheme_args(scheme, group_size)
    out.mkdir(parents=True, exist_ok=True)
    headers = memory_plan.safetensors_headers(model_dir)
    index = model_dir / "model.safetensors.index.json"
    where = (json.loads(index.read_text())["weight_map"] if index.is_file()
             else dict.fromkeys(headers, "model.safetensors"))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, packed, skipped, before, after = 0, 0, [], 0, 0
    handles = {}
    for name in sorted(headers):
        f = where[name]
        if f not in handles:
            handles[f] = safe_open(str(model_dir / f), framework="pt")
        t = handles[f].get_tensor(name)
        before += t.numel() * t.element_size()
        prefix = next((p for p in memory_plan.PREFIXES if name.startswith(p)), "")
        text_name = name[len(prefix):]
        tensors = {name: t}
        if memory_plan.QUANTISED.search(text_name) and t.ndim == 2:
            if args.group_size and t.shape[1] % args.group_size:
                skipped.append(name.removesuffix(".weight"))       # group size does not divide the inputs
            else:
                tensors = {f"{name}_{k.split('_', 1)[1]}": v.cpu() for k, v in pack(t.to(device), args).items()}
                packed += 1
        for k, v in tensors.items():
            n = v.numel() * v.element_size()
            if size + n > SHARD_BYTES and shards[-1]:
                shards.append({})
                size = 0
            shards[-1][k] = v.contiguous()
            size += n
            after += n
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, shard in zip(names, shards):
        save_file(shard, str(out / fname), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": after}, "weight_map": {k: f for f, s in zip(names, shards) for k in s}}, indent=1))
    qc = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        format="pack-quantized", quantization_status=QuantizationStatus.COMPRESSED,
        ignore=IGNORE + [f"re:.*{re.escape('layers.' + n.split('layers.', 1)[-1])}$" for n in skipped])
    raw["quantization_config"] = qc.model_dump(exclude_none=True, mode="json")
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for p in model_dir.iterdir():     # tokenizer, chat template, generation config: unchanged
        if p.is_file() and p.name != "config.json" and not p.name.startswith("model") and p.suffix != ".safetensors":
            shutil.copy2(p, out / p.name)
    summary = {"scheme": scheme, "packed": packed, "left_16bit_for_group": skipped,
               "bytes_before": before, "bytes_after": after}
    log(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/quantize.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--scheme", required=True, choices=[s for s, v in memory_plan.SCHEMES.items() if v])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--group-size", type=int, help="int4 group size (default 32; Marlin takes 32, 64, 128)")
    a = p.parse_args(argv)
    if not (a.model / "config.json").is_file():
        print(f"error: {a.model}: no config.json", file=sys.stderr)
        return 2
    if a.out.resolve() == a.model.resolve():
        print("error: --out must differ from --model", file=sys.stderr)
        return 2
    if a.group_size is not None and a.scheme != "w4a16":
        print("error: --group-size is for w4a16 (w8a16 has one scale per output channel)", file=sys.stderr)
        return 2
    if a.group_size is not None and a.group_size not in (32, 64, 128):
        print(f"error: --group-size {a.group_size}: vLLM's Marlin takes 32, 64 or 128", file=sys.stderr)
        return 2
    quantize(a.model, a.out, a.scheme, a.group_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
