"""The JAX runtime's packed (int8/int4) weights: model.matmul's multiply-reduce path against compressed-tensors' own
decompress, the program XLA compiles for it (no dot, no dequantised weight), and which path the engine takes where.
The engine's greedy parity on quantised checkpoints, with either path, is in tests/test_quantize.py."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from serving import quantized
from serving.jax_runtime import engine, model, xla

ROWS = 1           # the engine's PACKED_REDUCE_ROWS, spelled here so a change of it is a change of this test too
UP_TO = 8          # model.matmul's multiply-reduce takes whatever rows reduce_rows lets in: tested up to 8


def _packed(k: int, n: int, bits: int, group: int | None, seed: int = 0):
    """(model.Packed as checkpoint.py loads it, compressed-tensors' decompressed weight [in, out] float64) of a
    random [n, k] weight whose output channels span three decades of scale, packed by tools/quantize.py."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import quantize  # tools/quantize.py

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None] / k ** 0.5
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, dynamic=False,
                            strategy="group" if group else "channel", group_size=group)
    p = quantize.pack(w, args)
    ref = PackedQuantizationCompressor.decompress({**p, "weight_scale": p["weight_scale"].float()},
                                                  QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    q = quantized.unpack(p["weight_packed"].numpy(), p["weight_shape"].numpy(), bits).T
    q = np.ascontiguousarray(q.astype(ml_dtypes.int4 if bits == 4 else np.int8))
    scale = np.ascontiguousarray(p["weight_scale"].numpy().T)
    return model.Packed(jnp.asarray(q), jnp.asarray(scale), UP_TO), ref.double().numpy().T


CASES = [(8, None), (8, 128), (4, None), (4, 32)]


@pytest.mark.parametrize("bits,group", CASES)
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("k", [512, 8448])        # 8448: three parts of K (the parts: test_reduce_cuts_k...)
def test_reduce_path_equals_the_product_with_compressed_tensors_weights(bits, group, rows, k):
    w, ref_w = _packed(k, 48, bits, group)
    x = np.random.default_rng(rows).standard_normal((rows, k))
    ref = x @ ref_w
    got = np.asarray(jax.jit(model.matmul)(jnp.asarray(x, jnp.float32), w), np.float64)
    # float32 sums of k products (the decompressed values are exact in float32): a few ulps of the row's size
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max(-1, keepdims=True).max())
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6 * np.abs(ref).max())
    # float16 activations, as served on a GPU: the float16 inputs' product, rounded once to float16
    x16 = jnp.asarray(x, jnp.float16)
    ref16 = np.asarray(x16, np.float64) @ ref_w
    got16 = np.asarray(jax.jit(model.matmul)(x16, w), np.float64)
    np.testing.assert_allclose(got16, ref16, rtol=2 ** -10, atol=2 ** -14)
    # the dot path (reduce_rows 0) gives the same product
    dot = np.asarray(jax.jit(model.matmul)(jnp.asarray(x, jnp.float32), model.with_reduce_rows(w, 0)), np.float64)
    np.testing.assert_allclose(got, dot, rtol=1e-4, atol=1e-6 * np.abs(ref).max())


K_SPLIT = 4096     # model.COLUMN_REDUCE_MAX, spelled here for the same reason


@pytest.mark.parametrize("k,parts", [(512, 1), (4096, 1), (4097, 17), (6144, 2), (8448, 3), (12288, 3), (12290, 5)])
def test_reduce_cuts_k_into_the_fewest_equal_parts_of_at_most_the_split(k, parts):
    """The multiply-reduce's program, as traced: one reduction over K of [parts, K/parts, out, rows] (each part no
    longer than XLA's one-pass column reduce), then parts - 1 adds of [out, rows]. 4097 = 17 x 241: no fewer equal
    parts divide it; 12290 needs 4 parts of at most 4096, 4 does not divide it, 5 x 2458 does."""
    assert model.COLUMN_REDUCE_MAX == K_SPLIT
    w = model.Packed(jax.ShapeDtypeStruct((k, 48), jnp.int8), jax.ShapeDtypeStruct((1, 48), jnp.float16), UP_TO)
    text = jax.jit(model.matmul).lower(jax.ShapeDtypeStruct((2, k), jnp.float32), w).as_text()
    reduces = re.findall(r"stablehlo\.reduce\(.*across dimensions = \[1\] : \(tensor<(\d+)x(\d+)x48x2xf32>", text)
    assert [(int(p), int(n)) for p, n in reduces] == [(parts, k // parts)]
    assert parts * (k // parts) == k and k // parts <= K_SPLIT
    assert len(re.findall(r"stablehlo\.add %\S+, %\S+ : tensor<48x2xf32>", text)) == parts - 1


def test_rows_beyond_reduce_rows_take_the_dot():
    w = model.Packed(jax.ShapeDtypeStruct((256, 32), jnp.int8), jax.ShapeDtypeStruct((1, 32), jnp.float16), ROWS)
    for rows, dot in [(1, False), (ROWS, False), (ROWS + 1, True), (64, True)]:
        x = jax.ShapeDtypeStruct((rows, 256), jnp.float32)
        assert _ops(jax.jit(model.matmul).lower(x, w).compile().as_text())[1] == dot, rows
    assert _ops(jax.jit(model.matmul).lower(jax.ShapeDtypeStruct((1, 256), jnp.float32),
                                            model.with_reduce_rows(w, 0)).compile().as_text())[1]


def _ops(hlo: str) -> tuple[list[tuple[str, int]], bool]:
    """(per instruction of the entry computation: (opcode, elements of its output)), whether any dot or convolution
    is left anywhere in the module (fused computations included)."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    out = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* (\w[\w-]*)\(", line)
        if m:
            out.append((m.group(2), int(np.prod([int(d) for d in m.group(1).split(",") if d]))))
    return out, bool(re.search(r"\s(dot|convolution)\(", hlo))


@pytest.mark.parametrize("bits,group", CASES)
@pytest.mark.parametrize("rows,k", [(1, 1536), (8, 1536), (8, 6144)])   # E2B: qkv/gate_up's K, down_proj's
def test_decode_shapes_compile_to_no_dot_and_no_dequantised_weight(bits, group, rows, k):
    """XLA's optimised program for the decode shapes (CPU's compiler: the GPU's is not here; the simplifier is XLA's
    own on both): no dot or convolution (nothing for cuBLAS), and no instruction but the weight itself as large as
    the weight (no dequantised copy written). CPU's YNNPACK fusions take no int4 input, so for int4 its program
    converts the weight to float32 in a fusion of its own (a CPU artefact, exempt below; on a GPU the benchmark's
    bandwidth shows whether the reduction reads the int4 bytes); a 16-bit weight-sized output is never allowed."""
    n = 2048
    w = model.Packed(jax.ShapeDtypeStruct((k, n), jnp.int4 if bits == 4 else jnp.int8),
                     jax.ShapeDtypeStruct((k // group if group else 1, n), jnp.float16), UP_TO)
    x = jax.ShapeDtypeStruct((rows, k), jnp.float16)
    hlo = jax.jit(model.matmul).lower(x, w).compile().as_text()
    ops, has_dot = _ops(hlo)
    assert not has_dot
    big = [op for op, size in ops if size >= k * n and op != "parameter"]
    assert len(big) == (bits == 4), (big, hlo[hlo.index("\nENTRY"):])
    if big:
        assert not re.search(rf"= (f16|bf16)\[{k},{n}\]", hlo)      # the copy is CPU's float32 one, never 16-bit
    # the same check sees today's dot path: a weight-sized float copy, and a dot
    ops, has_dot = _ops(jax.jit(model.matmul).lower(x, model.with_reduce_rows(w, 0)).compile().as_text())
    assert has_dot and [op for op, size in ops if size >= k * n and op != "parameter"]


def test_prefill_shapes_keep_the_dot():
    """Hundreds of rows are compute-bound: a multiply per weight and row would not pay, the dot stays."""
    w = model.Packed(jax.ShapeDtypeStruct((1536, 2048), jnp.int8), jax.ShapeDtypeStruct((1, 2048), jnp.float16), ROWS)
    hlo = jax.jit(model.matmul).lower(jax.ShapeDtypeStruct((64, 1536), jnp.float16), w).compile().as_text()
    assert _ops(hlo)[1]


def test_engine_reduce_rows_is_this_test_s():
    assert engine.PACKED_REDUCE_ROWS == ROWS


@pytest.mark.parametrize("capability,flags,want", [
    ((7, 5), "", "reduce"),                                               # T4G: no Triton GEMM below Ampere
    ((8, 0), "", "dot"), ((9, 0), "--xla_gpu_graph_min_graph_size=1", "dot"),
    ((9, 0), "--xla_gpu_enable_triton_gemm=false", "reduce"),             # an H200 on sm_75's path
    ((9, 0), "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_triton_gemm=true", "dot"),   # the last one wins
    ((9, 0), "--xla_gpu_enable_triton_gemm", "dot"), ((9, 0), "--xla_gpu_enable_triton_gemm=0", "reduce"),
    (None, "--xla_gpu_enable_triton_gemm=false", "dot"),                  # CPU: the dot, as before
])
def test_auto_takes_the_reduce_where_xla_has_no_triton_gemm(capability, flags, want):
    assert engine.Settings().resolve_packed_dot(capability, flags) == want
    assert xla.triton_gemm(capability, flags) == (capability is not None and want == "dot")
    for forced in ("reduce", "dot"):
        assert engine.Settings(packed_dot=forced).resolve_packed_dot(capability, flags) == forced


def test_packed_dot_setting_reads_the_env_and_refuses_anything_else():
    assert engine.Settings.from_env({}).packed_dot == "auto"
    assert engine.Settings.from_env({"G5G_JAX_PACKED_DOT": "reduce"}).packed_dot == "reduce"
    with pytest.raises(ValueError, match="G5G_JAX_PACKED_DOT: 'triton' is not auto, reduce, dot"):
        engine.Settings.from_env({"G5G_JAX_PACKED_DOT": "triton"})


def test_with_reduce_rows_marks_every_packed_weight_and_nothing_else():
    q = np.zeros((4, 2), np.int8)
    params = {"embed": np.ones((3, 4), np.float16),
              "layers": [{"qkv": model.Packed(q, np.ones((1, 2), np.float16)), "norm": np.ones(4)}]}
    out = model.with_reduce_rows(params, ROWS)
    assert out["layers"][0]["qkv"].reduce_rows == ROWS and out["layers"][0]["qkv"].q is q
    assert out["embed"] is params["embed"] and params["layers"][0]["qkv"].reduce_rows == 0
    # static: the leaves are the arrays, the choice is in the tree's structure (so in the compiled program's key)
    assert len(jax.tree.leaves(out)) == 4 and jax.tree.structure(out) != jax.tree.structure(params)


def test_the_reduce_adds_its_rows_to_the_batch_ladder_and_nothing_else():
    """A lone stream reads packed weights once only in a batch of PACKED_REDUCE_ROWS rows: the engine asks the
    ladder for it when packed weights take the reduce; an unpacked model's ladder stays the slots alone."""
    s = engine.Settings(slots=8)
    assert s.batch_ladder() == (8,) and s.batch_ladder((ROWS,)) == (ROWS, 8)
    assert engine.Settings(slots=8, batches=(2, 8)).batch_ladder((ROWS,)) == (ROWS, 2, 8)
    assert engine.Settings(slots=1).batch_ladder((ROWS,)) == (1,)
    q = model.Packed(jnp.zeros((4, 4), jnp.int8), jnp.ones((1, 4), jnp.float16))
    assert model.has_packed({"layers": [{"qkv": q}], "embed": jnp.zeros(3)})
    assert not model.has_packed({"layers": [{"qkv": jnp.zeros((4, 4))}], "embed": jnp.zeros(3)})
