"""PyTorch on the CPU, one slot against more: a lone stream's prompt and decode time at E2B's widths (issue 53: does
a second CPU slot, which lets another client's chat start beside an n=64 request, cost the lone stream?).

    python -m benchmarks.cpu_slots OUT_DIR [--slots 1,2] [--layers 10] [--vocab 32768] [--tokens 16] [--runs 3]
        [--work /tmp/cpu_slots]

E2B's widths with random fp16 weights (benchmarks/harness/checkpoint.py), `--layers` deep (10: two full-attention
layers, one of them KV-shared) and the vocabulary cut to `--vocab`, so that the LM head keeps a GEMV's share without
E2B's 262 144 rows. Each slot count is loaded in a process of its own (the decode patch is per process), one
thread; greedy, a 64-token prompt, medians of `--runs` after a warm-up. Writes OUT_DIR/cpu_slots.json; the
checkpoint (about 1 GB) is kept under --work for the next run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness import checkpoint, children
from benchmarks.harness.results import Results

PROMPT = list(range(10, 74))


def measure(ckpt: Path, slots: int, tokens: int, runs: int) -> dict:
    """In this process: slot 0 of a `slots`-slot engine, alone."""
    from serving.engine import SamplingParams
    from serving.torch_runtime import load

    eng = load(ckpt, max_context=512, slots=slots)
    greedy, took = SamplingParams(temperature=0.0), []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        tok = eng.start(0, PROMPT, greedy)
        t1 = time.perf_counter()
        for _ in range(tokens):
            tok = eng.step({0: tok})[0]
        took.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) / tokens * 1e3))
    took = took[1:]
    return {"prompt_64_ms": round(statistics.median(t[0] for t in took), 1),
            "decode_ms_per_token": round(statistics.median(t[1] for t in took), 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--slots", default="1,2")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/cpu_slots"))
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)   # one slot count, measured in this process
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)  # where the child writes its figures
    a = ap.parse_args()
    ckpt = a.work / f"ckpt-e2b-{a.layers}l-{a.vocab}v"
    if a.child is not None:
        children.write_result(a.result, measure(ckpt, a.child, a.tokens, a.runs))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if not (ckpt / "config.json").exists():
        text = checkpoint.text_config("e2b", a.layers)
        text.update(vocab_size=a.vocab, vocab_size_per_layer_input=a.vocab)
        checkpoint.build(ckpt, text, device="cpu")
        checkpoint.add_whole_vocab_tokenizer(ckpt)
    results = Results(a.out / "cpu_slots.json")
    results.note(layers=a.layers, vocab=a.vocab, tokens=a.tokens, runs=a.runs, cores=os.cpu_count(), threads=1)
    env = children.child_env(None, OMP_NUM_THREADS="1", G5G_TORCH_COMPILE="0")
    base = None
    for slots in map(int, a.slots.split(",")):
        result = a.work / f"slots-{slots}.json"
        argv = children.module_argv("benchmarks.cpu_slots", str(a.out), "--child", str(slots), "--result",
                                    str(result), "--layers", str(a.layers), "--vocab", str(a.vocab), "--tokens",
                                    str(a.tokens), "--runs", str(a.runs), "--work", str(a.work))
        got = children.run_child(argv, result, timeout=1800, env=env).record()
        if "error" not in got:
            base = base or got
            got["decode_vs_first"] = round(got["decode_ms_per_token"] / base["decode_ms_per_token"], 2)
        results.note(**{f"slots_{slots}": got})
    return 0


if __name__ == "__main__":
    sys.exit(main())
