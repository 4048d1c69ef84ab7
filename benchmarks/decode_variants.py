"""JAX decode step under each way of running it, one process per variant, in one run on one machine:
serving_speed.py's in-process profile (engine.step with 1 and 8 live sequences, the executable alone, a trace)
for the runtime's defaults and each departure from them: the pipelined decode off, XLA's own command-buffer set
instead of ours (the whole step as CUDA graphs), no command buffers, and cuBLAS instead of Triton GEMM fusions.
The tool that proves a default: the default must be the fastest, or the winner becomes the default.

    python benchmarks/decode_variants.py OUTDIR --ckpt DIR [--buckets 512] [--layers 35] [--tiny] [--only A,B]
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
VARIANTS = {   # the runtime's defaults (serving/jax_runtime/engine.py: DEFAULT_XLA_FLAGS) unless a variant says otherwise
    "default": {},
    "plain": {"G5G_JAX_PIPELINE": "0"},
    "xla-own-command-buffers": {"G5G_JAX_XLA_DEFAULTS": "0"},
    "no-command-buffers": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "cublas-dots": {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"},     # no Triton GEMM fusions
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--buckets", default="512")
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--tiny", action="store_true", help="shrink the widths (smoke-run the script on CPU)")
    ap.add_argument("--only", help="comma-separated variant names (default: all of them)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(VARIANTS)
    if unknown := set(names) - set(VARIANTS):
        ap.error(f"--only: unknown variant(s) {sorted(unknown)}; known: {list(VARIANTS)}")
    if not (args.ckpt / "config.json").exists():      # built once, here: every variant reads the same weights
        sys.path.insert(0, str(ROOT))
        from benchmarks.serving_speed import make_checkpoint
        make_checkpoint(args.ckpt, args.layers, args.tiny)
    results = {}
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "G5G_JAX_PIPELINE", "G5G_JAX_XLA_DEFAULTS")}
    for name in names:
        env = VARIANTS[name]
        out = args.out / name
        try:
            run = subprocess.run([sys.executable, "benchmarks/serving_speed.py", str(out), "--only", "profile",
                                  "--ckpt", str(args.ckpt), "--profile-buckets", args.buckets], cwd=ROOT,
                                 timeout=400, env={**base, **env}, capture_output=True, text=True)
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
