"""Single operations on the code paths sm_75 takes, beside the path they replace, on whatever NVIDIA GPU is at hand:
what each moves through DRAM against the least it must (ncu, cold L2 as on a T4G's 4 MB), its time here, and its
time predicted on a T4G by benchmarks/t4g_model.py's model (t4g_kernel_s: the largest of DRAM bytes, issue time,
scaled duration and launch floor).

    python -m benchmarks.t4g_kernels OUT_DIR [--cases NAME,...] [--tiny] [--no-ncu]

Cases (CASES; E2B's shapes, 8 rows, random data), each with its peer in the same run:
- attention-S-ROWS: one decode step's attention of a full layer (8 query heads over 1 KV head of 512) over S keys
  for ROWS sequences, through serving/torch_runtime/attention.py's `attend` (two GEMMs over the keys, each K/V read
  once) against the memory-efficient SDPA kernel on the same folded heads (the runtime's path before: one CTA per
  row) and transformers' own SDPA path (which copies K/V per query head whenever a mask is passed); the SDPA
  backends sm_75 has (memory-efficient, math).
- SCHEME-ROWS (w8a16, w4a16; 1 or 8 rows): E2B's gate|up product with packed weights in the JAX runtime, XLA's
  Triton GEMM off (sm_75 has none): the multiply-reduce the runtime takes there, against the packed dot it
  replaces (a dequantised copy first, on cuBLAS) and the fp16 dot of the same weight (cuBLAS).
Writes OUT_DIR/t4g_kernels.json, one row per case and path.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks.harness import children  # noqa: E402
from benchmarks.harness.results import Results  # noqa: E402
from benchmarks.t4g_model import CONSTANTS, METRICS, TURING, parse_ncu, t4g_kernel_s  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 1, 512       # E2B's full-attention layers
WIDTHS = {"e2b": (1536, 6144)}                       # hidden, mlp (gate|up fused: 2 x mlp outputs)


# ------------------------------------------------------------------------------------------------ the cases
def attention(keys: int, rows: int, tiny: bool) -> dict:
    """{path: (call, bytes it must move)}: one decode step's attention of a full layer over `keys` keys, `rows`
    sequences: the runtime's (two GEMMs over the keys), the memory-efficient SDPA kernel it replaced (query heads
    folded, one CTA per row), transformers' SDPA path."""
    import types

    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import torch.nn.functional as F

    from serving.torch_runtime.attention import attend

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.float16 if dev == "cuda" else torch.float32
    d, s = (64, 128) if tiny else (HEAD_DIM, keys)
    q = torch.randn(rows, HEADS, 1, d, device=dev, dtype=dt)
    k, v = (torch.randn(rows, KV_HEADS, s, d, device=dev, dtype=dt) for _ in range(2))
    mask = torch.arange(s, device=dev).view(1, 1, 1, s) <= torch.randint(s // 2, s, (rows, 1, 1, 1), device=dev)
    folded = q.reshape(rows, KV_HEADS, HEADS // KV_HEADS, d)

    def memory_efficient():
        o = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=1.0)
        return o.reshape(rows, HEADS, 1, d).transpose(1, 2)
    layer = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True, layer_idx=0)
    least = (k.numel() + v.numel() + 2 * q.numel()) * k.element_size()
    return {"ours": (lambda: attend(layer, q, k, v, mask, scaling=1.0), least),
            "memory_efficient": (memory_efficient, least),
            "transformers_sdpa": (lambda: sdpa_attention_forward(layer, q, k, v, mask, scaling=1.0), least)}


def packed(scheme: str, rows: int, tiny: bool) -> dict:
    """{path: (call, bytes it must move)}: E2B's gate|up product (its largest per layer) of `rows` decode rows with
    the scheme's packed weight (serving/memory_plan.py's SCHEMES: bits, group), through the path the JAX runtime
    takes without a Triton GEMM (multiply-reduce), the packed dot it replaces, and the fp16 dot of the same
    weight dequantised (its own least bytes: 2 per weight)."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from serving.jax_runtime.engine import PACKED_REDUCE_ROWS
    from serving.jax_runtime.model import Packed, matmul, with_reduce_rows
    from serving.memory_plan import SCHEMES

    bits, group = SCHEMES[scheme]
    hidden, mlp = WIDTHS["e2b"]
    k, n = (256, 128) if tiny else (hidden, 2 * mlp)
    rng = np.random.default_rng(0)
    top = 1 << (bits - 1)
    q = rng.integers(-top, top, (k, n), dtype=np.int8)
    scale = (rng.random((k // group if group else 1, n), np.float32) / top).astype(np.float16)
    w16 = jnp.asarray((q.reshape(scale.shape[0], -1, n) * scale[:, None].astype(np.float32)).reshape(k, n),
                      jnp.float16)
    w = Packed(jnp.asarray(q.astype(ml_dtypes.int4) if bits == 4 else q), jnp.asarray(scale))
    x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.float16)
    io = x.nbytes + rows * n * 2
    f = jax.jit(matmul)
    return {"reduce": (lambda: f(x, with_reduce_rows(w, PACKED_REDUCE_ROWS)), q.size * bits // 8 + scale.nbytes + io),
            "packed_dot": (lambda: f(x, w), q.size * bits // 8 + scale.nbytes + io),
            "fp16_dot": (lambda: f(x, w16), w16.nbytes + io)}


CASES = {
    **{f"attention-{keys}-{rows}": ("torch", lambda tiny, s=keys, r=rows: attention(s, r, tiny))
       for keys in (512, 1024, 4096) for rows in (1, 8)},
    **{f"{scheme}-{rows}": ("jax", lambda tiny, s=scheme, r=rows: packed(s, r, tiny))
       for scheme in ("w8a16", "w4a16") for rows in (1, 8)},
}


# ------------------------------------------------------------------------------------------------ the child
def sync(framework: str, out) -> None:
    if framework == "torch":
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    else:
        import jax
        jax.block_until_ready(out)


def as_numpy(out):
    import numpy as np
    out = out[0] if isinstance(out, tuple) else out       # transformers' attention functions: (output, weights)
    return np.asarray(out.float().cpu() if hasattr(out, "cpu") else out, dtype=np.float32)


def child(case: str, path: str | None, tiny: bool, result: Path | None) -> None:
    """Time every path of `case` (median of 20 calls after 3), or under ncu (path given) profile one call of it."""
    import torch

    framework, build = CASES[case]
    paths = build(tiny)
    gpu = torch.cuda.is_available()
    if gpu and framework == "torch":
        from serving.torch_runtime.attention import turing_backends
        turing_backends()
    if path is not None:            # ncu profiles between cudaProfilerStart and Stop (process-wide: JAX's too)
        call, _ = paths[path]
        for _ in range(3):
            sync(framework, call())
        if gpu:
            torch.cuda.profiler.start()
        sync(framework, call())
        if gpu:
            torch.cuda.profiler.stop()
        return
    res, first = {}, None
    for name, (call, least) in paths.items():
        got = as_numpy(call())                      # every path computes the same thing: checked, not assumed
        first = got if first is None else first
        for _ in range(3):
            sync(framework, call())
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            sync(framework, call())
            times.append((time.perf_counter() - t0) * 1e3)
        res[name] = {"ms_here": round(statistics.median(times), 4), "least_bytes": least,
                     "max_abs_diff_vs_first": float(abs(got - first).max())}
    children.write_result(result, res)


# ----------------------------------------------------------------------------------------------- the parent
def run_case(case: str, args, ncu: str | None) -> dict:
    env = children.child_env(None, **TURING)
    me = children.module_argv("benchmarks.t4g_kernels", "--child", case, *["--tiny"] * args.tiny)
    result = args.work / f"{case}.json"
    timed = children.run_child([*me, "--result", str(result)], result, timeout=args.timeout, env=env, tail=1500)
    if timed.error:
        return {"error": timed.error}
    rows = timed.figures
    for path in rows if ncu else ():
        log = args.work / f"{case}-{path}.csv"
        r = subprocess.run([ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "all",
                            "--metrics", ",".join(METRICS), "--csv", "--page", "raw", "--print-units", "base",
                            "--log-file", str(log), *me, "--path", path], env=env, capture_output=True, text=True,
                           timeout=args.timeout)
        kernels = parse_ncu(log.read_text()) if log.exists() else []
        if r.returncode or not kernels:
            rows[path]["ncu_error"] = (r.stdout + r.stderr)[-800:]
            continue
        dram = sum(k["dram__bytes_read.sum"] + k["dram__bytes_write.sum"] for k in kernels)
        rows[path].update(kernels=len(kernels), dram_bytes=int(dram),
                          dram_over_least=round(dram / rows[path]["least_bytes"], 2),
                          t4g_ms=round(sum(t4g_kernel_s(k)[0] for k in kernels) * 1e3, 4))
    first = next(iter(rows.values()))     # the path the runtime takes; the others are its peers
    for row in rows.values():
        for key in ("ms_here", "t4g_ms"):
            if key in row and key in first:
                row[f"{key}_over_ours"] = round(row[key] / first[key], 2)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU run of the code paths")
    ap.add_argument("--no-ncu", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/t4g_kernels"), help="each child's timings, ncu's CSV")
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("--child")
    ap.add_argument("--path")
    ap.add_argument("--result", type=Path)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.path, args.tiny, args.result)
        return 0
    if args.out is None:
        ap.error("OUT_DIR is required")
    cases = args.cases.split(",")
    if unknown := [c for c in cases if c not in CASES]:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    ncu = None if args.no_ncu else __import__("shutil").which("ncu")
    results = Results(args.out / "t4g_kernels.json")
    results.note(constants=CONSTANTS, turing_env=TURING, ncu=bool(ncu), cases={})
    for case in cases:
        results.note(cases={**results.data["cases"], case: run_case(case, args, ncu)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
