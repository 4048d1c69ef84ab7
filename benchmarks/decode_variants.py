"""JAX decode step under each way of running it, one process per variant, in one run on one machine:
serving_speed.py's in-process profile (engine.step with 1 and 8 live sequences, the executable alone, a trace)
with the pipelined decode off and on, and XLA's command buffers (CUDA graphs) at their default, extended to
conditionals and loops (the sampler's lax.cond and bisection), and off.

    python benchmarks/decode_variants.py OUTDIR --ckpt DIR [--buckets 512] [--layers 35] [--tiny]
Writes OUTDIR/decode_variants.json, and OUTDIR/best.env: the fastest variant's environment, as `export` lines.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
VARIANTS = {
    "plain": {"G5G_JAX_PIPELINE": "0"},
    "pipelined": {"G5G_JAX_PIPELINE": "1"},
    "pipelined, graphs over conditionals and loops": {
        "G5G_JAX_PIPELINE": "1",
        "XLA_FLAGS": f"--xla_gpu_enable_command_buffer={GRAPHS} --xla_gpu_graph_min_graph_size=1"},
    "pipelined, no graphs": {"G5G_JAX_PIPELINE": "1", "XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--buckets", default="512")
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--tiny", action="store_true", help="shrink the widths (smoke-run the script on CPU)")
    args = ap.parse_args()
    if not (args.ckpt / "config.json").exists():      # built once, here: every variant reads the same weights
        sys.path.insert(0, str(ROOT))
        from benchmarks.serving_speed import make_checkpoint
        make_checkpoint(args.ckpt, args.layers, args.tiny)
    results = {}
    for name, env in VARIANTS.items():
        out = args.out / name.replace(" ", "").replace(",", "_")
        try:
            run = subprocess.run([sys.executable, "benchmarks/serving_speed.py", str(out), "--only", "profile",
                                  "--ckpt", str(args.ckpt), "--profile-buckets", args.buckets], cwd=ROOT,
                                 timeout=400, env={**os.environ, **env}, capture_output=True, text=True)
            results[name] = {"env": env, **json.loads((out / "serving_speed.json").read_text())["jax_profile"]}
        except subprocess.TimeoutExpired as e:          # one variant failing must not lose the others
            results[name] = {"env": env, "error": f"no result in {e.timeout:.0f} s"}
        except (OSError, KeyError, ValueError):
            results[name] = {"env": env, "error": (run.stdout + run.stderr)[-3000:]}
        print(name, {k: v for k, v in results[name].items() if k.endswith("_ms") or k == "error"}, flush=True)
        (args.out / "decode_variants.json").write_text(json.dumps(results, indent=1))
    timed = {n: r["live1_engine_step_ms"] for n, r in results.items() if "live1_engine_step_ms" in r}
    if not timed:
        print("no variant ran: see decode_variants.json", file=sys.stderr)
        return 1
    best = min(timed, key=timed.get)
    (args.out / "best.env").write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in VARIANTS[best].items()))
    print("fastest:", best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
