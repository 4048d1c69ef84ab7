"""A runtime's engine on its own (no HTTP): the shared generation loop over `start`/`step`.

    python -m benchmarks.engine_bench --model DIR [--runtime pytorch] [--device cuda] [--max-tokens 128]

Checks the greedy answer when DIR is the tiny Gemma 4 fixture (its tiny_gemma4.json names it), checks that
incremental decoding matches one full forward pass (PyTorch), then times prefill (time to first token inside the
engine) and decode (tokens/s) over --requests runs that ignore end-of-turn. Useful where the server's own
dependencies are not installed, e.g. on a GPU box, and to split wire overhead from engine time.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from serving.core.generation import Delta, Finish, SamplingParams, TokenizerInfo, generate

RUNTIMES = {"pytorch": "serving.torch_runtime", "jax": "serving.jax_runtime"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--runtime", default="pytorch", choices=sorted(RUNTIMES))
    ap.add_argument("--device", help="pytorch: cpu or cuda (default: cuda when available)")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()

    model = Path(args.model)
    runtime = importlib.import_module(RUNTIMES[args.runtime])
    t0 = time.monotonic()
    engine = runtime.load(model, **({"device": args.device} if args.device else {}))
    load_s = time.monotonic() - t0
    info = TokenizerInfo.load(model)
    result: dict = {"runtime": args.runtime, "model": str(model), "load_s": round(load_s, 2)}
    if hasattr(engine, "model"):
        result["device"] = str(getattr(engine, "device", "")) + " " + str(engine.model.dtype)

    meta = model / "tiny_gemma4.json"
    if meta.exists():
        fixture = json.loads(meta.read_text())
        prompt = info.chat_prompt([{"role": "user", "content": fixture["question"]}])
        events = list(generate(engine, info, prompt, SamplingParams(temperature=0.0, max_tokens=200)))
        text = "".join(e.text for e in events if isinstance(e, Delta))
        result["fixture_answer_verbatim"] = text == fixture["answer"] and events[-1].reason == "stop"
        if not result["fixture_answer_verbatim"]:
            result["fixture_answer"] = text
        if args.runtime == "pytorch" and engine.slots == 1:     # a batched engine's model attends through SlotKV,
            import torch                                          # which a plain full forward does not set up
            answer = info.tokenizer.encode(fixture["answer"], add_special_tokens=False)
            with torch.inference_mode():
                full = engine.model(input_ids=torch.tensor([prompt + answer], device=engine.device)).logits[0]
            full = full.float().cpu().numpy()[len(prompt) - 1:-1]
            engine.start(0, prompt, SamplingParams(temperature=0.0))
            steps = [engine.logits(0)]
            for t in answer[:-1]:
                engine.step({0: t})
                steps.append(engine.logits(0))
            steps = np.stack(steps)
            result["incremental_vs_full_max_abs_diff"] = float(np.abs(steps - full).max())
            result["incremental_argmax_equal"] = bool((steps.argmax(-1) == full.argmax(-1)).all())

    prompt = info.chat_prompt([{"role": "user", "content": "What does SRE stand for?"}])
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for i in range(args.requests + 1):                 # first run warms up
        start = time.monotonic()
        fin = [e for e in generate(engine, info, prompt, params) if isinstance(e, Finish)][0]
        t = fin.token_times
        if i:
            rows.append({"ttft_ms": (t[0] - start) * 1e3,
                         "decode_tokens_per_s": (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else None})
    result.update({"prompt_tokens": len(prompt), "max_tokens": args.max_tokens, "requests": len(rows),
                   "median_ttft_ms": round(statistics.median(r["ttft_ms"] for r in rows), 2),
                   "median_decode_tokens_per_s": round(statistics.median(r["decode_tokens_per_s"] for r in rows), 1)})
    print(json.dumps(result, indent=1))
    return 0 if result.get("fixture_answer_verbatim", True) else 1


if __name__ == "__main__":
    sys.exit(main())
