"""Quantised checkpoints (tools/quantize.py): the format against compressed-tensors itself, and the logits of the
quantised model against the 16-bit one on both runtimes (KL divergence, top-1 agreement, greedy equality).

Tolerances, per scheme (mean over teacher-forced positions of KL(p_fp32 || p_quant) in nats; top-1 agreement):
  w8a16  KL < 2e-3, top-1 >= 0.97      w4a16  KL < 5e-2, top-1 >= 0.85      (trained tiny checkpoint)
E2B-shaped random weights: tests/test_quantize_e2b.py. In both models int4's KL is ~100x int8's (KL grows with the
square of the weight noise: ~10x the noise).
And greedy equality wherever the original's top-1/top-2 margin exceeds twice the largest logit change.
int8 per channel keeps ~8 bits of each weight, int4 per group of 32 ~4: the bounds leave room for the test's
randomness (random-weight models have flat, near-tied logits), not for a wrong packing (tested exactly below),
which gives KL of order 1 and top-1 near 1/vocab.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.utils.match import match_name  # noqa: E402

from serving import memory_plan, quantized  # noqa: E402

from devtools.tiny_gemma4 import _prompt_ids  # noqa: E402
from tests.fixtures.quantised import (assert_safe_argmax_kept, kl_top1, quantize, quantised,  # noqa: E402
                                      runtime_logits)

BOUNDS = {"w8a16": (2e-3, 0.97), "w4a16": (5e-2, 0.85)}


@pytest.mark.parametrize("scheme,group", [("w8a16", None), ("w4a16", None), ("w4a16", 128)])
def test_numpy_reader_equals_compressed_tensors_decompress(scheme, group):
    """The runtimes' reader (no torch) against the library's own decompress, bit for bit, with rows of varied scale."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen) * torch.logspace(-3, 1, 48)[:, None]
    args = quantize.scheme_args(scheme, group)
    packed = quantize.pack(w, args)
    ref = PackedQuantizationCompressor.decompress(
        {**packed, "weight_scale": packed["weight_scale"].float()},
        QuantizationScheme(targets=["Linear"], weights=args))["weight"]
    got = quantized.dequantise(packed["weight_packed"].numpy(), packed["weight_scale"].numpy(),
                               packed["weight_shape"].numpy(), args.num_bits)
    np.testing.assert_array_equal(got, ref.numpy())
    step = packed["weight_scale"].float().repeat_interleave(args.group_size or 256, 1).numpy()
    # round to nearest: half a step, plus the row maximum's clip (the library's scale is max/127.5, resp. /7.5,
    # the largest code 127, resp. 7) after the scale's rounding to float16 (2**-11 relative: 0.07 step at 127.5)
    assert np.all(np.abs(got - w.numpy()) <= 0.6 * step)


@pytest.mark.parametrize("scheme,group", [("w8a16", None), ("w4a16", None)])
def test_codes_are_quantised_against_the_float16_scale_that_is_stored(scheme, group):
    """The runtimes multiply the codes by the stored float16 scale: the codes must be round(w / that scale), not
    w / the float32 scale before its rounding (a different code wherever the two straddle a .5)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=gen) * torch.logspace(-3, 1, 64)[:, None]
    args = quantize.scheme_args(scheme, group)
    packed = quantize.pack(w, args)
    assert packed["weight_scale"].dtype == torch.float16
    scale = packed["weight_scale"].float().repeat_interleave(args.group_size or 256, 1)
    lim = 2 ** (args.num_bits - 1)
    want = torch.clamp(torch.round(w / scale), -lim, lim - 1)
    got = quantized.dequantise(packed["weight_packed"].numpy(), packed["weight_scale"].numpy(),
                               packed["weight_shape"].numpy(), args.num_bits) / scale.numpy()
    np.testing.assert_array_equal(np.round(got), want.numpy())


@pytest.fixture(scope="module")
def tiny_quantised(tiny_gemma4, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny-q")
    return tiny_gemma4, {s: quantised(tiny_gemma4, tmp, s) for s in BOUNDS}


def test_written_config_is_what_compressed_tensors_and_our_plan_read(tiny_quantised):
    src, outs = tiny_quantised
    for scheme, out in outs.items():
        raw = json.loads((out / "config.json").read_text())
        qc = QuantizationConfig.model_validate(raw["quantization_config"])
        w = qc.config_groups["group_0"].weights
        assert (qc.quant_method, qc.format) == ("compressed-tensors", "pack-quantized")
        assert (w.symmetric, w.type) == (True, "int")
        assert (w.num_bits, w.strategy, w.group_size) == {"w8a16": (8, "channel", None),
                                                          "w4a16": (4, "group", 32)}[scheme]
        assert memory_plan.scheme_of(raw) == scheme and quantized.weight_args(raw)["num_bits"] == w.num_bits
        headers = memory_plan.safetensors_headers(out)
        assert "model.language_model.embed_tokens.weight" in headers                 # kept 16-bit (tied LM head)
        # what the plan keeps 16-bit, compressed-tensors (vLLM, transformers) must not look for packed
        for module in ("lm_head", "model.vision_tower.encoder.layers.0.mlp.fc1",
                       "model.embed_audio.embedding_projection"):
            assert not memory_plan.QUANTISED.search(module + ".weight")
            assert any(match_name(module, target) for target in qc.ignore), (module, qc.ignore)
        assert headers["model.language_model.layers.0.mlp.up_proj.weight_packed"]["dtype"] == "I32"
        # the tiny model's per_layer_projection has 16 inputs: no group of 32 divides them -> 16-bit, in ignore
        left = "model.language_model.layers.0.per_layer_projection.weight"
        assert (left in headers) == (scheme == "w4a16")
        assert any("layers\\.0\\.per_layer_projection$" in i for i in qc.ignore) == (scheme == "w4a16")
        # the plan's view of the checkpoint is the bytes actually written (text tensors + towers)
        plan = memory_plan.plan_checkpoint(out, None, 64, 1)
        written = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in headers.values())
        text_bf16 = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in headers.items()
                        if k.startswith("model.language_model.") and v["dtype"] == "BF16")
        packed = written - text_bf16 - plan.towers          # int32 words + fp16 scales + int64 shapes
        shapes = 8 * 2 * sum(k.endswith("_shape") for k in headers)
        assert plan.weights == text_bf16 + packed - shapes


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["pytorch", "jax", "jax-reduce"])
def test_tiny_quantised_logits_and_greedy_answer(tiny_quantised, runtime):
    """The trained tiny checkpoint: its chat answer (teacher-forced) under each scheme, against the bf16 original."""
    from transformers import AutoTokenizer

    from devtools.tiny_gemma4 import ANSWER
    src, outs = tiny_quantised
    tok = AutoTokenizer.from_pretrained(src)
    prompt = _prompt_ids(tok)
    ids = prompt + tok.encode(ANSWER, add_special_tokens=False)
    ref = runtime_logits(runtime, src, ids)
    for scheme, out in outs.items():
        got = runtime_logits(runtime, out, ids)
        kl, top1 = kl_top1(ref, got)
        print(f"{runtime} tiny {scheme}: KL {kl:.2e} top-1 {top1:.3f}")
        assert kl < BOUNDS[scheme][0] and top1 >= BOUNDS[scheme][1], (scheme, kl, top1)
        # greedy: the trained answer's tokens stay the argmax wherever the margin allows
        ans = slice(len(prompt) - 1, len(ids) - 1)
        assert np.all(ref[ans].argmax(-1) == np.array(ids[len(prompt):]))        # the original answers it
        assert_safe_argmax_kept(ref[ans], got[ans], scheme)


def test_vllm_0_33_parses_the_config_into_marlin_wna16(tiny_quantised, tmp_path):
    """vLLM 0.33.0's own CompressedTensorsConfig (from the pinned sdist, the rest of vLLM stood in for, platform
    sm_75) picks CompressedTensorsWNA16 — the Marlin weight-only scheme — for both checkpoints."""
    import subprocess
    import sys

    from g5g import patches
    sdist = patches.fetch_sdist("0.33.0")
    root = patches._unpack(sdist, {"vllm/model_executor/layers/quantization/compressed_tensors/" + f
                                   for f in ("compressed_tensors.py", "utils.py")}, tmp_path)
    _, outs = tiny_quantised
    for scheme, out in outs.items():
        r = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "tools" / "vllm_ct_probe.py"), str(root),
                            str(out / "config.json")], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(r.stdout)
        assert got["quant_format"] == "pack-quantized"
        s = got["schemes"]["Linear"]
        assert (s["scheme"], s["num_bits"], s["symmetric"]) == ("CompressedTensorsWNA16", int(scheme[1]), True)
        assert s["group_size"] in ({"w8a16": None, "w4a16": 32}[scheme],)   # Marlin: -1 (channel), 32, 64, 128


def test_build_py_quantize_runs_the_tool_in_a_subprocess(tiny_gemma4, tmp_path, capsys):
    from g5g import cli
    assert cli.main(["quantize", "--model", str(tiny_gemma4), "--scheme", "w8a16", "--out", str(tmp_path / "q")]) == 0
    assert memory_plan.scheme_of(json.loads((tmp_path / "q" / "config.json").read_text())) == "w8a16"
    assert (tmp_path / "q" / "tokenizer.json").is_file()
    assert cli.main(["quantize", "--model", str(tmp_path / "none"), "--scheme", "w8a16", "--out", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["pytorch", "jax"])
def test_servers_answer_from_the_int8_checkpoint(tiny_quantised, runtime):
    """`python -m serving` on the w8a16 checkpoint: the chat answer, token for token (every answer position has
    the margin under int8). Not int4: free-running, its answer leaves the original's after 47 characters on both
    runtimes (measured)."""
    import requests

    from devtools.server import serving, serving_env
    from devtools.tiny_gemma4 import ANSWER, QUESTION
    _, outs = tiny_quantised
    with serving(runtime, outs["w8a16"], "--served-model-name", "tiny", env=serving_env()) as srv:
        body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 200}
        r = requests.post(f"{srv.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ANSWER


def _packed_rows_and_dots(engine, rows: int) -> tuple[set[int], list]:
    """(the reduce_rows of the packed weights a JAX engine holds, the dots of its compiled `rows`-row decode step
    that read a tensor of a packed weight's [in, out] shape: the dot path's converted weights)."""
    import jax

    from serving.jax_runtime import model
    packed = [w for w in jax.tree.leaves(engine.params, is_leaf=lambda w: isinstance(w, model.Packed))
              if isinstance(w, model.Packed)]
    assert packed
    weights = {tuple(w.q.shape) for w in packed}
    hlo = engine._decode[rows, engine.max_context].as_text()
    shapes = {m[0]: tuple(int(d) for d in m[1].split(",") if d) for m in re.findall(r"(%\S+) = \w+\[([\d,]*)\]", hlo)}
    dots = re.findall(r"= \w+\[[\d,]*\]\S* dot\((%[^,]+), (%[^)]+)\)", hlo)
    assert dots                                     # the attention's and the 16-bit LM head's are dots either way
    return {w.reduce_rows for w in packed}, [d for d in dots if {shapes.get(d[0]), shapes.get(d[1])} & weights]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", sorted(BOUNDS))
def test_jax_packed_paths_give_the_same_greedy_tokens_in_a_batch(tiny_quantised, scheme):
    """Four sequences decoded together (a 4-row step: dots either way), then the first alone (the batch-1
    executable: the multiply-reduce with G5G_JAX_PACKED_DOT=reduce), with packed weights as dots and as the
    multiply-reduce: the same greedy tokens, and logits equal to float32 rounding. And the reduce is what the engine
    does, not only what it reports: every packed weight it holds takes the multiply-reduce up to PACKED_REDUCE_ROWS
    rows, and its one-row decode step, as XLA compiled it, has no dot on a packed weight (the dot engine's have)."""
    from serving.engine import SamplingParams
    from serving.jax_runtime import Settings, engine as jax_engine, load
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    prompts = [[2] + list(range(100 + 7 * s, 110 + 9 * s)) for s in range(4)]
    runs = {}
    for how in ("dot", "reduce"):
        engine = load(tiny_quantised[1][scheme], Settings(buckets=(64,), dtype="float32", cache_dir=None, slots=4,
                                                          packed_dot=how))
        assert engine.boot["packed_dot"] == how
        assert engine.batches == {"dot": (4,), "reduce": (1, 4)}[how]     # a lone stream: the reduce's one row
        rows, dots = _packed_rows_and_dots(engine, engine.batches[0])
        assert rows == {jax_engine.PACKED_REDUCE_ROWS if how == "reduce" else 0}
        assert bool(dots) == (how == "dot"), dots
        toks = {s: engine.start(s, p, greedy) for s, p in enumerate(prompts)}
        seqs, logits = [list(toks.values())], []
        for i in range(24):
            toks = engine.step(toks if i < 12 else {0: toks[0]})
            seqs.append(list(toks.values()))
            logits.append(np.stack([engine.logits(s) for s in toks]))
        runs[how] = (seqs, logits)
    assert runs["dot"][0] == runs["reduce"][0]
    for reduce, dot in zip(runs["reduce"][1], runs["dot"][1]):
        np.testing.assert_allclose(reduce, dot, atol=1e-4 * np.abs(dot).max(), rtol=0)


@pytest.mark.parametrize("scheme", sorted(BOUNDS))
def test_runtimes_hold_the_packed_weights_the_plan_counts(tiny_quantised, scheme):
    """Neither runtime dequantises at load: every packed linear stays int8/int4 (PyTorch: PackedLinear over the
    checkpoint's bytes; JAX: model.Packed of int8/int4), and the bytes they hold for the text model are the plan's."""
    import jax
    import ml_dtypes

    from serving.torch_runtime import load
    from serving.jax_runtime import checkpoint, config, model
    from serving.torch_runtime.packed_matmul import PackedLinear

    out = tiny_quantised[1][scheme]
    bits = memory_plan.SCHEMES[scheme][0]
    n_packed = sum(k.endswith("_packed") for k in memory_plan.safetensors_headers(out))
    plan = memory_plan.plan_checkpoint(out, None, 64, 1, text_only=True)

    torch_model = load(out, device="cpu", slots=1).model
    layers = [m for m in torch_model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == n_packed and all(m.bits == bits for m in layers)
    # the plan counts fp16 scales and 16-bit everything else; the CPU runtime holds float32: compare packed bytes
    assert sum(m.packed.numel() for m in layers) == sum(
        r * c * bits // 8 for r, c in (memory_plan.text_tensors(json.loads((out / "config.json").read_text()))
                                       [n.removeprefix("model.language_model.").removesuffix("_packed")]
                                       for n in memory_plan.safetensors_headers(out) if n.endswith("_packed")))

    cfg = config.load(out)
    params = checkpoint.load_params(out, cfg, np.float16)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, model.Packed))
    packed = [p for p in leaves if isinstance(p, model.Packed)]
    # weights that read the same input are fused at load (q|k|v, gate|up): every packed tensor's columns are there
    shapes = memory_plan.text_tensors(json.loads((out / "config.json").read_text()))
    assert sum(p.q.shape[1] for p in packed) == sum(
        shapes[n.removeprefix("model.language_model.").removesuffix("_packed")][0]
        for n in memory_plan.safetensors_headers(out) if n.endswith("_packed"))
    assert n_packed > len(packed) > 0
    assert {p.q.dtype for p in packed} == {np.dtype(ml_dtypes.int4 if bits == 4 else np.int8)}
    held = sum(x.size * (bits / 8 if x.dtype == ml_dtypes.int4 or x.dtype == np.int8 else x.itemsize)
               for x in jax.tree.leaves(params))
    assert held == plan.weights
