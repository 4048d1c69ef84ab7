"""JAX decode step under each way of running it, one process per variant, in one run on one machine:
serving_speed.py's in-process profile (engine.step with 1 and 8 live sequences, the executable alone, a trace)
for the runtime's defaults and each departure from them: the pipelined decode off, XLA's own command-buffer set
instead of ours (the whole step as CUDA graphs), no command buffers, and cuBLAS instead of Triton GEMM fusions.
The tool that proves a default: the default must be the fastest, or the winner becomes the default.

    python -m benchmarks.decode_variants OUTDIR --ckpt DIR [--buckets 512] [--layers 35] [--tiny] [--only A,B]
Writes OUTDIR/decode_variants.json, and OUTDIR/best.env: the fastest variant's environment, as `export` lines.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from benchmarks.harness import checkpoint, children
from benchmarks.harness.results import Results

VARIANTS = {   # the runtime's defaults (serving/jax_runtime/engine.py: DEFAULT_XLA_FLAGS) unless a variant says otherwise
    "default": {},
    "plain": {"G5G_JAX_PIPELINE": "0"},
    "xla-own-command-buffers": {"G5G_JAX_XLA_DEFAULTS": "0"},
    "no-command-buffers": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "cublas-dots": {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"},     # no Triton GEMM fusions
}


def variant(name: str, args, base: dict) -> dict:
    """serving_speed's JAX profile under one variant's environment, in its own process: its figures, or the error
    (one variant failing must not lose the others)."""
    out = args.out / name
    argv = children.module_argv("benchmarks.serving_speed", str(out), "--only", "profile", "--ckpt", str(args.ckpt),
                                "--profile-buckets", args.buckets)
    run = children.run_child(argv, out / "serving_speed.json", timeout=400, tail=3000,
                             env=children.child_env(base, **VARIANTS[name]))
    if run.error:
        return {"error": run.error}
    return run.figures.get("jax_profile") or {"error": "serving_speed.json holds no jax_profile"}


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
        checkpoint.build(args.ckpt, checkpoint.text_config("e2b", args.layers, args.tiny))     # serving_speed's
        checkpoint.add_whole_vocab_tokenizer(args.ckpt)
    args.out.mkdir(parents=True, exist_ok=True)
    results = Results(args.out / "decode_variants.json")
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "G5G_JAX_PIPELINE", "G5G_JAX_XLA_DEFAULTS")}
    for name in names:
        results.note(**{name: {"env": VARIANTS[name], **variant(name, args, base)}})
    timed = {n: r["live1_engine_step_ms"] for n, r in results.data.items() if "live1_engine_step_ms" in r}
    if not timed:
        print("no variant ran: see decode_variants.json", file=sys.stderr)
        return 1
    best = min(timed, key=timed.get)
    (args.out / "best.env").write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in VARIANTS[best].items()))
    print("fastest:", best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
