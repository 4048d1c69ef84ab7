"""The PyTorch and JAX servers side by side, measured by the project's one harness (`build.py bench`).

    python -m benchmarks.serving_cpu [--runtimes pytorch,jax] [--model DIR] [--requests 8] [--max-tokens 128]
                                     [--concurrency 1]

For each runtime: start `python -m serving` (default model: the tiny Gemma 4 fixture, built if needed), time
process start → /health 200, run `build.py bench --url …` (TTFT, TPOT, ITL on the wire, the server's gauge beside
it), stop the server; then `build.py bench compare` prints one table across runtimes. Results land in --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.harness import serve
from devtools.server import serving_env

BOOT_TIMEOUT_S = 600


def bench_runtime(runtime: str, model: Path, args, out: Path) -> Path:
    result = out / f"{runtime}.json"
    with serve.served(runtime, model, "--log-level", "warning", timeout=BOOT_TIMEOUT_S,
                      env=serving_env(OMP_NUM_THREADS=str(args.threads)), fatal=True) as srv:
        data = serve.bench(srv.url, result, "--label", runtime, "--requests", str(args.requests), "--max-tokens",
                           str(args.max_tokens), "--concurrency", str(args.concurrency), "--warmup", "2")
    data["boot"] = {"health_s": round(srv.ready_s, 2)}  # a local process: start → /health 200
    result.write_text(json.dumps(data, indent=1) + "\n")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtimes", default="pytorch,jax")
    ap.add_argument("--model", help="checkpoint dir (default: the tiny Gemma 4 fixture)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1, help="clients at once (a storm: what the queue carries)")
    ap.add_argument("--threads", type=int, default=1, help="OMP/torch threads for the server (CPU)")
    ap.add_argument("--out", default="benchmarks/results/serving_cpu", help="where <runtime>.json go")
    args = ap.parse_args()
    if args.model:
        model = Path(args.model)
    else:
        from devtools.tiny_gemma4 import cached
        model = cached()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = [bench_runtime(rt, model, args, out) for rt in args.runtimes.split(",")]
    return serve.compare(files)


if __name__ == "__main__":
    sys.exit(main())
