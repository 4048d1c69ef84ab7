"""serving/packed_matmul.py: the PyTorch runtime's packed int8/int4 linears, against compressed-tensors' own
decompress. The Triton kernel runs here in Triton's interpreter (TRITON_INTERPRET=1, in a child process: the
flag is read when a kernel is defined); on a GPU benchmarks/packed_matmul_bench.py checks and times it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationScheme  # noqa: E402

from serving.packed_matmul import PackedLinear, pack_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import quantize  # noqa: E402  (tools/quantize.py)

CASES = [("w8a16", None), ("w4a16", None), ("w4a16", 128)]


def _packed(scheme, group, out=48, cols=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=gen) * torch.logspace(-2, 0, out)[:, None]
    args = quantize.scheme_args(scheme, group)
    packed = quantize.pack(w, args)
    ref = PackedQuantizationCompressor.decompress(
        {**packed, "weight_scale": packed["weight_scale"].float()},
        QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    return packed, ref, args.num_bits


@pytest.mark.parametrize("scheme,group", CASES)
def test_packed_linear_is_the_decompressed_linear(scheme, group):
    """The plain path (CPU, prefill) computes with exactly compressed-tensors' decompressed weight, and keeps only
    the packed bytes: in/2 (int8) or in/4 (int4) of the 16-bit weight's."""
    packed, ref, bits = _packed(scheme, group)
    layer = PackedLinear(packed["weight_packed"], packed["weight_scale"], 512, bits, torch.float32)
    torch.testing.assert_close(layer.dequantised(torch.float32), ref, rtol=0, atol=0)
    x = torch.randn(3, 5, 512)
    torch.testing.assert_close(layer(x), x @ ref.T, rtol=1e-5, atol=1e-5)
    assert layer.packed.dtype == torch.uint8 and layer.packed.numel() == 48 * 512 * bits // 8


def test_kernel_in_triton_interpreter_matches_the_reference():
    """The decode kernel (every scheme; 1, 5 and 16 rows; a width that is not a multiple of the column block and
    inputs that are not a multiple of the K block) against x @ W.T with the library's decompressed W."""
    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "tools")
        from tests.test_packed_matmul import CASES, _packed
        from serving.packed_matmul import packed_mm, KERNEL_CONFIG
        for scheme, group in CASES:
            packed, ref, bits = _packed(scheme, group, out=72, cols=640)
            layer_bytes = packed["weight_packed"].view(torch.uint8).reshape(72, -1)[:, :640 * bits // 8]
            for rows in (1, 5, 16):
                x = torch.randn(rows, 640)
                y = packed_mm(x, layer_bytes.contiguous(), packed["weight_scale"].float(), bits, config=(32, 256, 4))
                err = (y - x @ ref.T).abs().max().item()
                assert err < 1e-3, (scheme, group, rows, err)
        print("kernel ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "kernel ok" in r.stdout, r.stdout + r.stderr


def test_pack_model_replaces_only_bias_free_linears_of_the_right_width():
    packed, _, bits = _packed("w8a16", None, out=8, cols=512)
    model = torch.nn.Sequential(torch.nn.Linear(512, 8, bias=False), torch.nn.Linear(8, 8))
    assert pack_model(model, {"0": (packed["weight_packed"], packed["weight_scale"], 512)}, bits, torch.float32) == 1
    assert isinstance(model[0], PackedLinear)
    with pytest.raises(ValueError, match="not a bias-free Linear"):
        pack_model(model, {"1": (packed["weight_packed"], packed["weight_scale"], 8)}, bits, torch.float32)


def test_a_missing_compiler_or_triton_is_named_before_a_gpu_load(monkeypatch):
    """The GPU path needs triton and a C compiler (Triton builds its launcher): the server names what is missing
    before loading a packed checkpoint onto a GPU, instead of failing its first decode step."""
    import importlib.util
    import shutil

    from serving import packed_matmul

    monkeypatch.setattr(shutil, "which", lambda c: "/usr/bin/" + c)
    assert packed_matmul.kernel_missing() is None        # the dev extra pins triton
    monkeypatch.setattr(shutil, "which", lambda _: None)
    assert "C compiler" in packed_matmul.kernel_missing()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "needs triton" in packed_matmul.kernel_missing()
