"""serving/torch_runtime/packed_matmul.py: the PyTorch runtime's packed int8/int4 linears, against compressed-tensors' own
decompress. The Triton kernels run here in Triton's interpreter (TRITON_INTERPRET=1, in a child process: the
flag is read when a kernel is defined) and are compiled for a T4G (sm_75) with no GPU; on a GPU
benchmarks/quantized_decode.py --phase kernels checks and times them."""
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

from serving.torch_runtime import packed_matmul  # noqa: E402
from serving.torch_runtime.packed_matmul import PackedLinear, pack_model  # noqa: E402
from tests.fixtures.tolerances import F32_OP_REORDERED  # noqa: E402

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
    torch.testing.assert_close(layer(x), x @ ref.T, **F32_OP_REORDERED)
    assert layer.packed.dtype == torch.uint8 and layer.packed.numel() == 48 * 512 * bits // 8


def test_kernel_in_triton_interpreter_matches_the_reference():
    """The decode kernel (every scheme; 1, 5 and 16 rows; a width that is not a multiple of the column block and
    inputs that are not a multiple of the K block) against x @ W.T with the library's decompressed W."""
    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "tools")
        from tests.test_packed_matmul import CASES, _packed
        from serving.torch_runtime.packed_matmul import packed_mm, KERNEL_CONFIG
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


def test_gemv_in_triton_interpreter_matches_the_reference():
    """The decode GEMV (1-8 rows), every scheme, against x @ W.T with the library's decompressed W: packed_mm's own
    choice for these rows (split-K as a GPU of 2 SMs would take it) and explicit configs, one with slices of
    uneven length; 72 outputs (not a multiple of the 16-row block)."""
    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "tools")
        from tests.test_packed_matmul import CASES, _packed
        from serving.torch_runtime.packed_matmul import packed_mm, gemv
        for scheme, group in CASES:
            packed, ref, bits = _packed(scheme, group, out=72, cols=1024)
            w = packed["weight_packed"].view(torch.uint8).reshape(72, -1)[:, :1024 * bits // 8].contiguous()
            s = packed["weight_scale"].float()
            for rows in (1, 5):
                x = torch.randn(rows, 1024)
                for y in (packed_mm(x, w, s, bits), gemv(x, w, s, bits, config=(8, 64, 3, 2))):
                    err = (y - x @ ref.T).abs().max().item()
                    assert err < 1e-3, (scheme, group, rows, err)
        print("gemv ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "G5G_PACKED_SMS": "2", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "gemv ok" in r.stdout, r.stdout + r.stderr


def test_gemv_config_splits_k_until_every_sm_has_work():
    """A T4G (40 SMs) splits E2B's down projection (1536 outputs over 12 288 int4 inputs: 96 column blocks) in
    two; an H200 (132 SMs) in eight; q (4096 outputs) is not split; a group's bytes always divide a step."""
    assert packed_matmul.gemv_config(1536, 12288, 4, 32, 40) == (16, 256, 2, 4)
    assert packed_matmul.gemv_config(1536, 12288, 4, 32, 132)[2] == 8
    assert packed_matmul.gemv_config(4096, 1536, 8, 0, 40)[2] == 1
    assert packed_matmul.gemv_config(64, 64, 4, 128, 40)[1] == 64


def test_sm75_takes_the_gemv_for_every_decode_row_and_newer_gpus_keep_the_faster_int8_dot():
    assert all(packed_matmul.uses_gemv(rows, bits, 0, 75) for rows in range(1, 9) for bits in (4, 8))
    assert all(packed_matmul.uses_gemv(rows, 4, 32, 90) for rows in range(1, 9))
    assert packed_matmul.uses_gemv(1, 8, 0, 90) and not packed_matmul.uses_gemv(2, 8, 0, 90)
    assert not packed_matmul.uses_gemv(9, 4, 32, 75) and not packed_matmul.uses_gemv(1, 4, 96, 75)


def test_kernels_compile_for_a_t4g_without_a_gpu():
    """Both kernels compile for ("cuda", 75, 32) with Triton's own compiler (no GPU here): the GEMV at 1 and 8
    rows for every scheme, with no tensor-core instruction in its PTX and no shared memory beyond the
    reductions' scratch; the dot kernel (9-16 rows) too."""
    sys.path.insert(0, str(ROOT / "tools"))
    from vllm_attn_probe import compile_launch      # Triton's own binding of a launch, for any target

    n, k = 4096, 1536
    for bits, group in ((8, 0), (4, 0), (4, 32)):
        for rows in (1, 8):
            kw = dict(x_ptr=torch.empty(8, k, dtype=torch.float16),
                      w_ptr=torch.empty(n, k * bits // 8, dtype=torch.uint8),
                      s_ptr=torch.empty(n, k // (group or k), dtype=torch.float16),
                      y_ptr=torch.empty(2, 8, n, dtype=torch.float32), M=rows, N=n, KB=k * bits // 8, SLICE=256,
                      stride_xm=k, stride_wn=k * bits // 8, stride_sn=k // (group or k), stride_ys=8 * n,
                      stride_ym=n, BITS=bits, GROUP=group, BLOCK_M=rows, BLOCK_N=16, BLOCK_KB=256, num_warps=4)
            ck = compile_launch(packed_matmul._gemv_kernel(), kw, 75)
            ptx = ck.asm["ptx"]
            assert ".target sm_75" in ptx and "mma" not in ptx and ck.asm["cubin"], (bits, group, rows)
            assert ck.metadata.shared <= 4096, ck.metadata.shared
    kw = dict(x_ptr=torch.empty(16, k, dtype=torch.float16), w_ptr=torch.empty(n, k // 2, dtype=torch.uint8),
              s_ptr=torch.empty(n, k // 32, dtype=torch.float16), y_ptr=torch.empty(16, n, dtype=torch.float16),
              M=16, N=n, K=k, GROUP=32, stride_xm=k, stride_wn=k // 2, stride_sn=k // 32, stride_ym=n, BITS=4,
              PER_CHANNEL=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=512, num_warps=4)
    assert ".target sm_75" in compile_launch(packed_matmul._kernel(), kw, 75).asm["ptx"]


def test_int8_head_is_compressed_tensors_w8a16():
    """PackedLinear.from_weight (the int8 LM head, quantised at load in the runtime, no compressed-tensors in the
    image) stores exactly what tools/quantize.py's w8a16 stores, and computes with its decompressed weight."""
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(96, 256, generator=gen) * torch.logspace(-3, 0, 96)[:, None]).half()
    w[5] = 0                                        # an all-zero row: a tiny scale, not a NaN
    packed = quantize.pack(w.float(), quantize.scheme_args("w8a16", None))
    ref = PackedQuantizationCompressor.decompress(
        {**packed, "weight_scale": packed["weight_scale"].float()},
        QuantizationScheme(targets=["Linear"], weights=quantize.scheme_args("w8a16", None)))["weight"]
    head = PackedLinear.from_weight(w, torch.float32)
    lib = PackedLinear(packed["weight_packed"], packed["weight_scale"], 256, 8, torch.float32)
    assert torch.equal(head.packed, lib.packed) and torch.equal(head.scale, lib.scale)
    torch.testing.assert_close(head.dequantised(torch.float32), ref, rtol=0, atol=0)


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

    from serving.torch_runtime import packed_matmul

    monkeypatch.setattr(shutil, "which", lambda c: "/usr/bin/" + c)
    assert packed_matmul.kernel_missing() is None        # the dev extra pins triton
    monkeypatch.setattr(shutil, "which", lambda _: None)
    assert "C compiler" in packed_matmul.kernel_missing()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "needs triton" in packed_matmul.kernel_missing()
