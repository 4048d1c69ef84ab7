"""Read compressed-tensors "pack-quantized" weights (tools/quantize.py writes them) back to floats, in numpy.

Both runtimes dequantise at load (the JAX runtime has no torch; the PyTorch runtime serves float weights): memory
and bandwidth then are those of the 16-bit model. A kernel that reads the packed weights inside the matmul is
GPU work not done here. Only what tools/quantize.py writes is accepted: symmetric int4/int8, one scale per
output channel or per group, values packed little-endian into int32 words with an offset of 2**(bits-1)
(compressed-tensors' pack_to_int32; tests/test_quantize.py checks this reader against its decompress).
"""
from __future__ import annotations

import numpy as np

SUFFIXES = ("_packed", "_scale", "_shape")


class QuantizedCheckpointError(ValueError):
    pass


def weight_args(raw: dict) -> dict | None:
    """The weights' QuantizationArgs (as a dict) of a config.json with a compressed-tensors config we read, or None
    for an unquantised checkpoint; anything else is refused with one line."""
    qc = raw.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        raise QuantizedCheckpointError(f"quantization_config: quant_method {qc.get('quant_method')!r} / format "
                                       f"{qc.get('format')!r}; only compressed-tensors pack-quantized is read")
    groups = list(qc.get("config_groups", {}).values())
    if len(groups) != 1 or groups[0].get("input_activations"):
        raise QuantizedCheckpointError("quantization_config: one weight-only config group expected")
    w = groups[0]["weights"]
    if w.get("type") != "int" or not w.get("symmetric") or w.get("num_bits") not in (4, 8) \
            or w.get("strategy") not in ("channel", "group"):
        raise QuantizedCheckpointError(f"quantization_config: weights {w} are not symmetric int4/int8 "
                                       "per channel or group")
    return w


def dequantise(packed: np.ndarray, scale: np.ndarray, shape, num_bits: int) -> np.ndarray:
    """float32 [out, in] from int32 words [out, ceil(in*bits/32)] and scales [out, groups] (groups = 1: channel)."""
    out, cols = (int(s) for s in shape)
    b = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8).reshape(out, -1)
    if num_bits == 4:
        b = np.stack([b & 0xF, b >> 4], axis=-1).reshape(out, -1)
    q = b[:, :cols].astype(np.int16) - (1 << (num_bits - 1))
    s = np.asarray(scale, np.float32)
    group = cols // s.shape[1]
    if group * s.shape[1] != cols:
        raise QuantizedCheckpointError(f"scales {s.shape} do not divide a weight of {cols} inputs")
    return (q.reshape(out, s.shape[1], group) * s[:, :, None]).reshape(out, cols)


def dequantise_named(get, name: str, num_bits: int) -> np.ndarray:
    """`name` (a `….weight`) from its `name_packed`, `name_scale` and `name_shape` through get(tensor name)."""
    return dequantise(get(name + "_packed"), get(name + "_scale"), get(name + "_shape"), num_bits)
