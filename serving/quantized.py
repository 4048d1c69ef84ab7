"""Read compressed-tensors "pack-quantized" weights (tools/quantize.py writes them), in numpy: as the signed
integers and scales the runtimes keep on the device (`unpack`; their matmuls dequantise inside the product:
serving/torch_runtime/packed_matmul.py for PyTorch, jax_runtime/model.py's `matmul` for JAX), or back to floats (`dequantise`).

Only what tools/quantize.py writes is accepted: symmetric int4/int8, one scale per output channel or per group,
values packed little-endian into int32 words with an offset of 2**(bits-1) (compressed-tensors' pack_to_int32;
tests/test_quantize.py checks this reader against its decompress).
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


def unpack(packed: np.ndarray, shape, num_bits: int) -> np.ndarray:
    """int8 [out, in] (values in [-2**(bits-1), 2**(bits-1))) from int32 words [out, ceil(in*bits/32)]."""
    out, cols = (int(s) for s in shape)
    b = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8).reshape(out, -1)
    if num_bits == 4:
        b = np.stack([b & 0xF, b >> 4], axis=-1).reshape(out, -1)
    return (b[:, :cols].astype(np.int16) - (1 << (num_bits - 1))).astype(np.int8)


def group_size(scale: np.ndarray, cols: int) -> int:
    """Inputs per scale of a weight with `cols` inputs and scales [out, groups] (cols: one scale per channel)."""
    groups = np.shape(scale)[1]
    if cols % groups:
        raise QuantizedCheckpointError(f"scales {np.shape(scale)} do not divide a weight of {cols} inputs")
    return cols // groups


def dequantise(packed: np.ndarray, scale: np.ndarray, shape, num_bits: int) -> np.ndarray:
    """float32 [out, in] from int32 words [out, ceil(in*bits/32)] and scales [out, groups] (groups = 1: channel)."""
    q = unpack(packed, shape, num_bits)
    out, cols = q.shape
    s = np.asarray(scale, np.float32)
    group = group_size(s, cols)
    return (q.reshape(out, s.shape[1], group) * s[:, :, None]).reshape(out, cols)
