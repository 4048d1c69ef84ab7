"""JAX runtime on a GPU at google/gemma-4-E2B-it's exact shapes (random weights: no download here), float16.

What it measures (one run, no variance claimed; the GPU is whatever this runs on, not the target T4G):
- numerics: teacher-forced logits of JAX float16 and transformers float16 against transformers float32
  (TF32 off) on the same checkpoint, and how many greedy tokens JAX-fp16 and torch-fp16 agree on;
- boot: weight load, ladder compile (cold: empty persistent cache; warm: second engine from the cache);
- decode tokens/s for one sequence, JAX engine vs a transformers DynamicCache loop (the PyTorch runtime's way).

    python benchmarks/jax_gpu_e2b_shape.py OUT_JSON [--buckets 128,512,2048] [--layers 35]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.35")  # leave room for torch in the same process
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

S, F = "sliding_attention", "full_attention"
RESULT: dict = {}


def note(out: Path, **kw) -> None:
    RESULT.update(kw)
    out.write_text(json.dumps(RESULT, indent=1))
    print(json.dumps(kw), flush=True)


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def e2b_text(layers: int, tiny: bool) -> dict:
    shared = 20 * layers // 35
    if tiny:  # a local smoke run of this script on CPU, not a measurement
        return dict(e2b_text(layers, False), vocab_size=1024, vocab_size_per_layer_input=1024, hidden_size=64,
                    intermediate_size=64, head_dim=16, global_head_dim=32, sliding_window=16,
                    hidden_size_per_layer_input=8)
    return dict(vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size=1536, intermediate_size=6144,
                num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                global_head_dim=512, sliding_window=512, num_kv_shared_layers=shared, use_double_wide_mlp=True,
                hidden_size_per_layer_input=256, final_logit_softcapping=30.0, tie_word_embeddings=True,
                layer_types=[F if (i + 1) % 5 == 0 else S for i in range(layers)], max_position_embeddings=131072,
                pad_token_id=0, eos_token_id=[1, 106], bos_token_id=2)


def build(ckpt: Path, layers: int, tiny: bool):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    cfg = Gemma4Config(text_config=e2b_text(layers, tiny), vision_config=None, audio_config=None)
    with torch.device(DEV):
        model = Gemma4ForConditionalGeneration(cfg).half()
    gen = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name or "embed_scale" in name:
                continue
            if name.endswith("layer_scalar"):
                t.copy_(torch.rand(t.shape, generator=gen, device=DEV) * 0.5 + 0.5)
            elif "q_norm" in name or "k_norm" in name:
                # q·k is unscaled (scale 1): unit-ish norm weights over 256-512 dims give one-hot attention and
                # a chaotic random model (fp16 and fp32 then disagree everywhere); trained models learn small ones.
                t.copy_(0.25 * (1 + 0.2 * torch.randn(t.shape, generator=gen, device=DEV)))
            elif "norm" in name:
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen, device=DEV))
            else:
                t.copy_(torch.randn(t.shape, generator=gen, device=DEV) / t.shape[-1] ** 0.5)
    model.save_pretrained(ckpt)


def load_torch(ckpt: Path, dtype):
    """As served: from disk (an in-memory .half()/.float() round trip would also round the RoPE buffers)."""
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(ckpt, dtype=dtype).to(DEV).eval()


def torch_logits(model, seq, prompt_len):
    """Teacher-forced logits through a DynamicCache loop: prompt, then one token at a time (as served)."""
    from transformers.cache_utils import DynamicCache

    text_cfg = model.config.get_text_config()
    cache, out = DynamicCache(config=text_cfg), []
    with torch.inference_mode():
        ids = torch.tensor([seq[:prompt_len]], device=DEV)
        out.append(model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1])
        for t in seq[prompt_len:]:
            ids = torch.tensor([[t]], device=DEV)
            out.append(model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1])
    return torch.stack(out).float().cpu().numpy()


def torch_greedy(model, prompt, n):
    from transformers.cache_utils import DynamicCache

    cache, toks = DynamicCache(config=model.config.get_text_config()), []
    t0 = time.perf_counter()
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=DEV)
        for i in range(n):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            toks.append(int(np.argmax(logits.float().cpu().numpy())))
            if i == 0:
                t1 = time.perf_counter()
            ids = torch.tensor([[toks[-1]]], device=DEV)
    return toks, (n - 1) / (time.perf_counter() - t1), t1 - t0


def jax_greedy(engine, prompt, n):
    from serving.engine import SamplingParams

    t0 = time.perf_counter()
    toks = [engine.start(0, prompt, SamplingParams(temperature=0.0))]
    t1 = time.perf_counter()
    while len(toks) < n:
        toks.append(engine.step({0: toks[-1]})[0])
    return toks, (n - 1) / (time.perf_counter() - t1), t1 - t0


def jax_forced_logits(engine, prompt, forced):
    from serving.engine import SamplingParams

    engine.start(0, prompt, SamplingParams(temperature=0.0))
    out = [engine.logits(0)]
    for t in forced:
        engine.step({0: t})
        out.append(engine.logits(0))
    return np.stack(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--buckets", default="128,512,2048")
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--jax-dtype", default="float16", help="float16 (served on GPU) or float32 (exact check)")
    ap.add_argument("--numerics-only", action="store_true", help="stop after the logits comparison")
    ap.add_argument("--tiny", action="store_true", help="shrink the widths (smoke-run the script on CPU)")
    args = ap.parse_args()
    out = Path(args.out)
    import jax

    from serving.jax_runtime import Settings, load
    from serving.jax_runtime.engine import parse_buckets

    note(out, device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", jax=jax.__version__, jax_backend=jax.default_backend(),
         torch=torch.__version__, layers=args.layers, buckets=args.buckets)
    work = Path(tempfile.mkdtemp(prefix="e2b-shape-"))
    t0 = time.perf_counter()
    build(work / "ckpt", args.layers, args.tiny)
    torch.cuda.empty_cache()
    note(out, build_and_save_s=round(time.perf_counter() - t0, 1))

    rng = np.random.default_rng(0)
    seq = rng.integers(3, 1024 if args.tiny else 262144, 700).tolist()   # 600-token prompt > window 512; decode wraps the ring
    prompt_len = 600
    torch.backends.cuda.matmul.allow_tf32 = False
    model = load_torch(work / "ckpt", torch.float32)
    truth = torch_logits(model, seq, prompt_len)
    del model
    torch.cuda.empty_cache()
    model = load_torch(work / "ckpt", torch.float16)
    t16 = torch_logits(model, seq, prompt_len)
    torch.cuda.empty_cache()

    if args.jax_dtype == "float32":  # no TF32 on the JAX side either
        jax.config.update("jax_default_matmul_precision", "highest")
    settings = Settings(buckets=parse_buckets(args.buckets), dtype=args.jax_dtype, cache_dir=str(work / "jaxcache"),
                        slots=1)
    t0 = time.perf_counter()
    eng = load(work / "ckpt", settings)
    note(out, jax_cold_boot_s=round(time.perf_counter() - t0, 1), jax_cold_boot=eng.boot)
    j16 = jax_forced_logits(eng, seq[:prompt_len], seq[prompt_len:])[: truth.shape[0]]
    jx = "jax_" + args.jax_dtype
    note(out, jax_dtype=args.jax_dtype, truth_logit_std=float(truth.std()),
         **{f"{jx}_vs_torch_fp16": {"max_abs": float(np.abs(j16 - t16).max()),
                                     "mean_abs": float(np.abs(j16 - t16).mean())}},
         max_abs_logit_err_vs_fp32={jx: float(np.abs(j16 - truth).max()),
                                    "torch_fp16": float(np.abs(t16 - truth).max())},
         mean_abs_logit_err_vs_fp32={jx: float(np.abs(j16 - truth).mean()),
                                     "torch_fp16": float(np.abs(t16 - truth).mean())},
         argmax_agreement_vs_fp32={jx: float((j16.argmax(-1) == truth.argmax(-1)).mean()),
                                   "torch_fp16": float((t16.argmax(-1) == truth.argmax(-1)).mean())})

    if args.numerics_only:
        return 0
    prompt = seq[:64]
    jt, jtps, jttft = jax_greedy(eng, prompt, args.tokens)
    jt, jtps, jttft = jax_greedy(eng, prompt, args.tokens)      # second run: steady state
    tt, ttps, tttft = torch_greedy(model, prompt, args.tokens)
    tt, ttps, tttft = torch_greedy(model, prompt, args.tokens)
    agree = next((i for i, (a, b) in enumerate(zip(jt, tt)) if a != b), len(jt))
    note(out, decode_tok_s={jx: round(jtps, 1), "torch_fp16": round(ttps, 1)},
         prefill_64_s={"jax": round(jttft, 4), "torch": round(tttft, 4)},
         greedy_tokens_identical_jax_vs_torch_fp16=agree, greedy_tokens=args.tokens)
    del eng
    t0 = time.perf_counter()
    warm = load(work / "ckpt", settings)
    note(out, jax_warm_boot_s=round(time.perf_counter() - t0, 1), jax_warm_boot=warm.boot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
