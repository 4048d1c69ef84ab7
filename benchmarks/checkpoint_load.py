"""JAX runtime weight loading: `checkpoint.load_params` with its conversions on one thread and on every core.

A checkpoint at Gemma 4 E2B's real widths (random weights, float16; --layers of its 35, default 10: 3 GB) is built
once, then loaded --runs times each way into float16 (the GPU dtype), page cache warm after the first read.

    python benchmarks/checkpoint_load.py OUT_JSON [--ckpt DIR] [--layers 10] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ckpt", type=Path, default=ROOT / ".cache" / "e2b-width-ckpt")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    import numpy as np
    from serving.jax_runtime import checkpoint, config

    if not (args.ckpt / "config.json").exists():
        from benchmarks.jax_gpu_e2b_shape import build
        build(args.ckpt, args.layers, False)
    cfg = config.load(args.ckpt)
    res: dict = {"checkpoint_bytes": sum(f.stat().st_size for f in args.ckpt.glob("*.safetensors")),
                 "layers": cfg.num_layers, "cpus": os.cpu_count()}
    checkpoint.load_params(args.ckpt, cfg, np.float16)          # the first read fills the page cache
    for name, workers in (("one_thread", 1), ("every_core", None)):
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            checkpoint.load_params(args.ckpt, cfg, np.float16, workers=workers)
            times.append(round(time.perf_counter() - t0, 3))
        res[name] = {"s": times, "median_s": statistics.median(times)}
    res["speedup"] = round(res["one_thread"]["median_s"] / res["every_core"]["median_s"], 2)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
