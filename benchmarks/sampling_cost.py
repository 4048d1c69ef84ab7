"""What the per-request sampling parameters cost a JAX decode step, on whatever backend JAX runs here.

A random Gemma 4 shaped model with a tiny body and Gemma's 262 144-token vocabulary (so the sampler, not the
layers, is what a step spends its time on), 8 slots decoding together. Times decode steps (median of --steps)
for: all greedy; all sampled (temperature 1); all sampled with every extra set (penalties, logit_bias, min_p,
min_tokens, 20 logprobs). Run it on a checkout without the extras too (same command) to see what the
adjustments' skipped branches cost when no row asks for them.

    python -m benchmarks.sampling_cost [--steps 40]

Then the sampler alone (sampling.sample, jitted) on [8, 262 144] float32 logits with top-p / top-k cuts: its
candidates path (the default) beside the whole-row bisection (candidates=0, the sampler before the candidates),
on peaked rows (Zipf 2: a nucleus of a few tokens, the candidates hold it) and flat ones (Zipf 1.1: the nucleus
is wider than the candidates, so those rows fall back to the bisection; the price of the check).
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from serving.engine import SamplingParams
from serving.jax_runtime import Settings, load

TEXT = dict(vocab_size=262144, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
            final_logit_softcapping=30.0, max_position_embeddings=1024, tie_word_embeddings=True)


def checkpoint(out: Path) -> Path:
    """TEXT's random model (benchmarks/harness/checkpoint.py), float32 on the CPU: the sampler's inputs, not
    its weights, are what this measures."""
    from benchmarks.harness import checkpoint as random_checkpoint

    return random_checkpoint.build(out, TEXT, dtype="float32", device="cpu")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    extras = "logit_bias" in inspect.signature(SamplingParams).parameters
    modes = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, seed=1)}
    if extras:
        modes["sampled+extras"] = dict(temperature=1.0, seed=1, presence_penalty=0.5, frequency_penalty=0.3,
                                       repetition_penalty=1.2, logit_bias=tuple((i, 1.0) for i in range(100)),
                                       min_p=0.05, min_tokens=1000, eos_token_ids=(1, 106), logprobs=20)
    with tempfile.TemporaryDirectory() as tmp:
        engine = load(checkpoint(Path(tmp)), Settings(buckets=(64, 128), dtype="float32", cache_dir=None, slots=8))
        result = {"extras_in_this_checkout": extras, "backend": engine.boot["backend"]}
        rng = np.random.default_rng(0)
        for name, kw in modes.items():
            p = SamplingParams(**kw)
            tokens = {s: engine.start(s, rng.integers(3, 1000, 20).tolist(), p) for s in range(8)}
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                tokens = engine.step(tokens)
                if extras and p.logprobs is not None:
                    [engine.logprobs(s) for s in tokens]
                times.append(time.perf_counter() - t0)
            result[f"{name}_step_ms"] = round(1000 * statistics.median(times[3:]), 2)
    result["sampler_alone"] = sampler_alone(args.steps)
    print(json.dumps(result))
    return 0


def sampler_alone(steps: int, rows: int = 8, vocab: int = 262144) -> dict:
    """Milliseconds per call of the jitted sampler, candidates path and whole-row bisection, per logits and cut."""
    import jax
    import jax.numpy as jnp
    from serving.jax_runtime import sampling

    rng = np.random.default_rng(0)
    out = {}
    for shape, zipf in (("peaked", 2.0), ("flat", 1.1)):
        logits = np.stack([rng.permutation(-zipf * np.log(np.arange(1, vocab + 1))) for _ in range(rows)])
        logits = jnp.asarray(logits, jnp.float32)
        cuts = {"top_p0.9": (0, 0.9), "top_k50": (50, 1.0), "top_k50+top_p0.95": (50, 0.95)}
        for cut, (top_k, top_p) in cuts.items():
            args = (logits, jnp.ones(rows, jnp.float32), jnp.full(rows, top_k, jnp.int32),
                    jnp.full(rows, top_p, jnp.float32), jnp.zeros((rows, 2), jnp.uint32), jnp.arange(rows))
            ms = {}
            for name, n in (("candidates", sampling.CANDIDATES), ("whole_row", 0)):
                fn = jax.jit(lambda *a, n=n: sampling.sample(*a, candidates=n))
                fn(*args).block_until_ready()
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    fn(*args).block_until_ready()
                    times.append(time.perf_counter() - t0)
                ms[name] = round(1000 * statistics.median(times), 3)
            out[f"{shape}/{cut}"] = {**ms, "whole_row_over_candidates": round(ms["whole_row"] / ms["candidates"], 2)}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
