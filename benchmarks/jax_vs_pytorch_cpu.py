"""CPU: the JAX runtime vs the PyTorch runtime on the tiny Gemma 4 fixture, through the Engine seam.

Each runtime boots in a fresh process (so imports and compilation are counted, not hidden in a warm process):
- boot: wall time of `load(model_dir)`; JAX twice with one empty persistent cache dir (cold, then warm),
  with its compile / persistent-cache-hit counts;
- decode: greedy (argmax) for --tokens tokens after the chat-formatted fixture QUESTION, EOS ignored, --runs
  times; tokens/s = (tokens - 1) / (time from the first logits to the last), the median run reported;
- compilations after boot in the JAX process across all decode runs (must be 0).
One machine, one run each: no variance claimed beyond the spread of --runs. Load average is recorded.

    python -m benchmarks.jax_vs_pytorch_cpu [--model DIR] [--tokens 200] [--runs 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import children


def child(runtime: str, model_dir: str, tokens: int, runs: int) -> dict:
    """In a fresh process: import and load the runtime (the boot), then greedy decodes of the fixture's question."""
    t0 = time.perf_counter()
    if runtime == "jax":
        from serving.jax_runtime import compile_counts, load
    else:
        from serving.torch_runtime import load
    t_import = time.perf_counter() - t0
    engine = load(model_dir)
    boot = time.perf_counter() - t0
    from transformers import AutoTokenizer

    from devtools.tiny_gemma4 import QUESTION
    from serving.engine import SamplingParams
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    before = compile_counts() if runtime == "jax" else None
    rates, first = [], []
    for _ in range(runs):
        t1 = time.perf_counter()
        token = engine.start(0, prompt, SamplingParams(temperature=0.0))
        t2 = time.perf_counter()
        for _ in range(tokens - 1):
            token = engine.step({0: token})[0]
        rates.append((tokens - 1) / (time.perf_counter() - t2))
        first.append(t2 - t1)
    out = {"runtime": runtime, "import_s": round(t_import, 3), "boot_s": round(boot, 3),
           "prompt_tokens": len(prompt), "decode_tok_s_runs": [round(r, 1) for r in rates],
           "decode_tok_s_median": round(statistics.median(rates), 1),
           "prefill_s_median": round(statistics.median(first), 4)}
    if runtime == "jax":
        after = compile_counts()
        out["engine_boot"] = engine.boot
        out["compiles_after_boot"] = after["compiles"] - before["compiles"]
        out["traces_after_boot"] = after["traces"] - before["traces"]
    return out


def run_child(runtime: str, model: Path, tokens: int, runs: int, env: dict, work: Path) -> dict:
    result = work / f"{runtime}.json"
    argv = children.module_argv("benchmarks.jax_vs_pytorch_cpu", "--child", runtime, "--model", str(model),
                                "--tokens", str(tokens), "--runs", str(runs), "--result", str(result))
    run = children.run_child(argv, result, timeout=1800, env=env, tail=3000)
    if run.error:
        raise SystemExit(f"{runtime} run failed: {run.error}")
    return run.figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint dir (default: the tiny_gemma4 fixture, built/cached if needed)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", dest="json_file")
    ap.add_argument("--child", metavar="RUNTIME", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        children.write_result(args.result, child(args.child, args.model, args.tokens, args.runs))
        return 0
    if args.model:
        model = Path(args.model)
    else:
        from devtools.tiny_gemma4 import cached
        model = cached(log=lambda m: print(m, file=sys.stderr))

    with tempfile.TemporaryDirectory(prefix="g5g-jax-cache-") as cache, tempfile.TemporaryDirectory() as work:
        # One torch thread, as benchmarks/serving_cpu.py runs the server: on a tiny model more threads only cost.
        env = children.child_env(None, JAX_PLATFORMS="cpu", G5G_JAX_CACHE_DIR=cache,
                                 OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        result = {"model": str(model), "tokens": args.tokens, "runs": args.runs, "omp_threads": env["OMP_NUM_THREADS"],
                  "cpus": os.cpu_count(), "loadavg_before": os.getloadavg()[0],
                  "jax_cold": run_child("jax", model, args.tokens, args.runs, env, Path(work)),
                  "jax_warm": run_child("jax", model, args.tokens, args.runs, env, Path(work)),
                  "pytorch": run_child("pytorch", model, args.tokens, args.runs, env, Path(work)),
                  "loadavg_after": os.getloadavg()[0]}
    j, p = result["jax_warm"], result["pytorch"]
    result["summary"] = {
        "jax_cold_boot_s": result["jax_cold"]["boot_s"], "jax_warm_boot_s": j["boot_s"],
        "pytorch_boot_s": p["boot_s"],
        "jax_executables": j["engine_boot"]["executables"],
        "jax_cold_compiles": result["jax_cold"]["engine_boot"]["boot_compiles"],
        "jax_warm_cache_hits": j["engine_boot"]["boot_cache_hits"],
        "jax_compiles_after_boot": j["compiles_after_boot"] + result["jax_cold"]["compiles_after_boot"],
        "jax_decode_tok_s": j["decode_tok_s_median"], "pytorch_decode_tok_s": p["decode_tok_s_median"],
        "decode_speedup": round(j["decode_tok_s_median"] / p["decode_tok_s_median"], 2),
    }
    text = json.dumps(result, indent=1)
    if args.json_file:
        Path(args.json_file).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
