"""Greedy text of the PyTorch runtime: one slot (StaticCache) against continuous batching (SlotKV), same weights.

Issue 18's observation (1): on the H200 the 8-slot server's greedy answer left the one-slot server's at its 33rd
token, while on a CPU they agree. Three runs of one prompt, `--tokens` greedy tokens each:
  one_slot   slots=1, transformers' StaticCache (the compiled decode on CUDA)
  batched_1  slots=8, one live sequence (the other rows idle)
  batched_8  slots=8, eight copies of the sequence at once
For each pair: the first step whose token differs, and at that step (same prefix in both runs, so same inputs) the
top-2 logit margin of each run beside the largest logit difference between them. A difference at least as large
as the margin means the two computations round differently and the argmax flips: legitimate, not a bug. A flip with
a margin far above the difference would be a bug. batched_1 and batched_8 must agree token for token: answers under
concurrency equal answers alone.

    python benchmarks/torch_batch_divergence.py OUTDIR --ckpt DIR [--tokens 48] [--layers 35] [--tiny]
Writes OUTDIR/torch_batch_divergence.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def greedy(engine, ids: list[int], tokens: int, live: int) -> tuple[list[int], np.ndarray]:
    """`live` copies of the prompt in slots 0..live-1, greedy; slot 0's tokens and float32 logits per step."""
    from serving.engine import SamplingParams

    g = SamplingParams(temperature=0.0)
    toks = {s: engine.start(s, ids, g) for s in range(live)}
    assert len(set(toks.values())) == 1, toks
    out, logits = [toks[0]], [engine.logits(0)]
    for _ in range(tokens - 1):
        toks = engine.step(toks)
        assert len(set(toks.values())) == 1, f"copies of one prompt disagree within one batch: {toks}"
        out.append(toks[0])
        logits.append(engine.logits(0))
    return out, np.stack(logits)


def margin(row: np.ndarray) -> float:
    top2 = np.sort(row)[-2:]
    return float(top2[1] - top2[0])


def compare(a: tuple[list[int], np.ndarray], b: tuple[list[int], np.ndarray]) -> dict:
    (ta, la), (tb, lb) = a, b
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    same = len(ta) if first is None else first              # steps with identical inputs in both runs
    diff = np.abs(la[:same + (first is not None)] - lb[:same + (first is not None)]).max(axis=1)
    res = {"first_different_token": first, "equal_tokens": same,
           "max_abs_logit_diff_while_equal": float(diff[:same].max()) if same else None,
           "median_abs_logit_diff_while_equal": float(np.median(diff[:same])) if same else None,
           "smallest_margin_while_equal": float(min(margin(r) for r in la[:same])) if same else None}
    if first is not None:
        res.update(at_divergence={"tokens": [ta[first], tb[first]], "margin_a": margin(la[first]),
                                  "margin_b": margin(lb[first]), "max_abs_logit_diff": float(diff[first]),
                                  "rounding_flip": bool(diff[first] >= min(margin(la[first]), margin(lb[first])))})
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--tiny", action="store_true", help="shrink the widths (smoke-run the script on CPU)")
    args = ap.parse_args()
    from benchmarks.serving_speed import make_checkpoint, prompts
    if not (args.ckpt / "config.json").exists():
        make_checkpoint(args.ckpt, args.layers, args.tiny)
    import torch
    from serving import pytorch_runtime

    ids = prompts(args.ckpt)["short"]["ids"]
    runs = {}
    for name, slots, live in (("one_slot", 1, 1), ("batched_1", 8, 1), ("batched_8", 8, 8)):
        if name != "batched_8":         # batched_8 reuses batched_1's engine
            engine = pytorch_runtime.load(args.ckpt, max_context=1024, slots=slots)
        runs[name] = greedy(engine, ids, args.tokens, live)
        print(name, runs[name][0], flush=True)
        if name == "one_slot" and torch.cuda.is_available():
            del engine
            torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "prompt_tokens": len(ids), "tokens": args.tokens,
              "texts": {k: v[0] for k, v in runs.items()},
              "one_slot_vs_batched_1": compare(runs["one_slot"], runs["batched_1"]),
              "batched_1_vs_batched_8": compare(runs["batched_1"], runs["batched_8"]),
              "one_slot_vs_batched_8": compare(runs["one_slot"], runs["batched_8"])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "torch_batch_divergence.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "texts"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
