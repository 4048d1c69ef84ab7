"""Prompts replayed from CUDA graphs against eager prompts, in one process (serving/torch_runtime/prefill.py, issue
49): per prompt length, the time from `start()` to the first token each way (median of --runs), their ratio, and
whether the two agree (first-token logits, then --tokens greedy tokens); and the same for graphs captured with fused
RMSNorms (G5G_TORCH_FUSED_NORMS=1, serving/torch_runtime/norms.py: opt-in until this measures it). E2B's text
shapes with random fp16 weights (benchmarks/harness/checkpoint.py); a GPU only, since the graphs are CUDA's. Decode
runs eagerly here (G5G_TORCH_COMPILE=0): only the prompts are compared, and no compile is spent on the rest.

    python -m benchmarks.prompt_graphs OUT_DIR [--ckpt DIR] [--lengths 5,117,526,960] [--runs 5] [--tokens 32]
Writes OUT_DIR/prompt_graphs.json and prints each length's figures.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness import checkpoint
from benchmarks.harness.results import Results

CONTEXT = 1024      # serving_speed's --max-model-len
SLOTS = 8
SLOT = 2            # not slot 0, which the capture's own runs write


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ckpt", type=Path, help="reuse (or build here) the checkpoint in this directory")
    ap.add_argument("--lengths", default="5,117,526,960")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    lengths = [int(n) for n in a.lengths.split(",")]
    if max(lengths) + a.tokens > CONTEXT:       # each prompt is answered with --tokens greedy tokens after it
        raise SystemExit(f"prompt_graphs: a prompt of {max(lengths)} tokens and {a.tokens} more do not fit the "
                         f"context ({CONTEXT})")
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("prompt_graphs: no CUDA GPU here (the graphs it compares are CUDA graphs)")
    os.environ |= {"G5G_TORCH_PREFILL_GRAPHS": "1", "G5G_TORCH_COMPILE": "0", "G5G_TORCH_FUSED_NORMS": "0"}
    from serving.engine import SamplingParams
    from serving.torch_runtime import load, prefill

    ckpt = a.ckpt or a.out / "ckpt"
    if not (ckpt / "config.json").exists():
        checkpoint.build(ckpt, checkpoint.text_config("e2b"))
    a.out.mkdir(parents=True, exist_ok=True)
    results = Results(a.out / "prompt_graphs.json")
    eng = load(ckpt, max_context=CONTEXT, slots=SLOTS)
    greedy = SamplingParams(temperature=0.0)

    # the fused arm: the engine's own capture forward with G5G_TORCH_FUSED_NORMS=1's setting while it captures
    arms = {"graph": eng.prompt_graphs, "eager": None,
            "fused": prefill.PromptGraphs(eng._graph_prompt, eng.prompt_graphs.ladder, eng.device)}

    def answer(prompt: list[int], arm: str) -> tuple[np.ndarray, list[int], float]:
        """First-token logits, the greedy tokens, and the median seconds from start() to the first token."""
        keep, eng.prompt_graphs = eng.prompt_graphs, arms[arm]
        eng.fused_norms = arm == "fused"
        try:
            took = []
            for _ in range(a.runs):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                first = eng.start(SLOT, prompt, greedy)      # the token is on the host: the prompt has run
                took.append(time.perf_counter() - t0)
            logits, tokens = eng.logits(SLOT), [first]
            while len(tokens) < a.tokens:
                tokens.append(eng.step({SLOT: tokens[-1]})[SLOT])
            return logits, tokens, statistics.median(took)
        finally:
            eng.prompt_graphs, eng.fused_norms = keep, False

    for arm in ("graph", "fused"):       # captures every bucket's graph (as a server's warm-up does)
        answer([2, 5, 6], arm)
    results.note(device=torch.cuda.get_device_name(), context=CONTEXT, slots=SLOTS, runs=a.runs, tokens=a.tokens,
                 capture=arms["graph"].describe(), capture_fused=arms["fused"].describe())
    rng = np.random.default_rng(0)
    for n in lengths:
        prompt = rng.integers(10, eng.vocab_size, n).tolist()
        got = {arm: answer(prompt, arm) for arm in ("graph", "fused", "eager")}
        e_logits, e_tokens, e_s = got["eager"]
        row = {"eager_ms": round(e_s * 1000, 2)}
        for arm, key in (("graph", ""), ("fused", "fused_")):     # each graph arm beside the eager prompt
            logits, tokens, s = got[arm]
            row |= {f"{arm}_ms": round(s * 1000, 2), f"eager_over_{arm}": round(e_s / s, 2),
                    f"{key}max_abs_logit_diff": round(float(np.abs(logits - e_logits).max()), 4),
                    f"{key}same_first_token": int(logits.argmax()) == int(e_logits.argmax()),
                    f"{key}tokens_parted_at": next((i for i, (x, y) in enumerate(zip(tokens, e_tokens)) if x != y),
                                                   None)}
        results.note(**{f"prompt_{n}": row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
