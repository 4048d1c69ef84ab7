"""JAX decode step under each way of running it, one process per variant, in one run on one machine:
serving_speed.py's in-process profile (engine.step with 1 and 8 live sequences, the executable alone, a trace of
the device's kernels and the host's events) for the runtime's defaults and each departure from them: the pipelined
decode off, XLA's own command-buffer set instead of ours (the whole step as CUDA graphs), no command buffers, stable
addresses for XLA's temporary buffers; and on sm_75's paths (cuBLAS dots, no Triton GEMM fusions: what XLA compiles
for a T4G) ours, cuBLAS outside the command buffers, none, and stable temporary addresses. The tool that proves a
default: per kind of paths, the default must be the fastest, or the winner becomes the default.

    python -m benchmarks.decode_variants OUTDIR --ckpt DIR [--buckets 512] [--layers 35] [--tiny] [--only A,B]
Writes OUTDIR/decode_variants.json (`fastest`: the winner per kind of paths), OUTDIR/best.env (the fastest on this
GPU's own paths) and OUTDIR/best_sm75.env (the fastest on sm_75's), as `export` lines.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from benchmarks.harness import checkpoint, children
from benchmarks.harness.results import Results

CUBLAS_DOTS = "--xla_gpu_enable_triton_gemm=false"      # sm_75's dots on any GPU: cuBLAS calls (jax_runtime/xla.py)
# On sm_75's paths each decode step updated its command buffer (`command_buffer::update`: 7.5 of a traced 18.4 ms
# step; H100, 2026-12-07, benchmarks/results/t4g_model_h100/raw/jax-fp16.json): the variants after "cublas-dots"
# tell what the cuBLAS calls inside the command buffers cost, and whether XLA's stable addresses for its temporary
# buffers (`--xla_gpu_command_buffer_update_mode=SKIP_TEMP`, a newer XLA's: an older one refuses the flag, and the
# variant says so) spare the updates.
UPDATE_FREE_TEMPS = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
VARIANTS = {   # the runtime's defaults (serving/jax_runtime/xla.py: DEFAULT_XLA_FLAGS) unless a variant says otherwise
    "default": {},
    "plain": {"G5G_JAX_PIPELINE": "0"},
    "xla-own-command-buffers": {"G5G_JAX_XLA_DEFAULTS": "0"},
    "no-command-buffers": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "stable-temp-addresses": {"XLA_FLAGS": UPDATE_FREE_TEMPS},
    "cublas-dots": {"XLA_FLAGS": CUBLAS_DOTS},          # what a T4G runs by default
    "cublas-dots-outside-command-buffers": {
        "XLA_FLAGS": f"{CUBLAS_DOTS} --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"},
    "cublas-dots-no-command-buffers": {"XLA_FLAGS": f"{CUBLAS_DOTS} --xla_gpu_enable_command_buffer="},
    "cublas-dots-stable-temp-addresses": {"XLA_FLAGS": f"{CUBLAS_DOTS} {UPDATE_FREE_TEMPS}"},
}


def paths(name: str) -> str:
    """The kind of paths a variant's XLA compiles: "sm75" (cuBLAS dots) or "own" (this GPU's)."""
    return "sm75" if CUBLAS_DOTS in VARIANTS[name].get("XLA_FLAGS", "") else "own"


def fastest(step_ms: dict[str, float]) -> dict[str, str]:
    """The variant with the shortest one-stream step per kind of paths (variants of sm_75's paths never compete
    with this GPU's own)."""
    best: dict[str, str] = {}
    for name, ms in step_ms.items():
        kind = paths(name)
        if kind not in best or ms < step_ms[best[kind]]:
            best[kind] = name
    return best


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
    best = fastest(timed)
    results.note(fastest=best)
    for kind, name in best.items():
        env = args.out / ("best.env" if kind == "own" else f"best_{kind}.env")
        env.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in VARIANTS[name].items()))
        print(f"fastest on {kind} paths:", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
