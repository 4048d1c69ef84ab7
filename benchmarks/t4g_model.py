"""A T4G's decode speed, predicted from decode steps run on whatever NVIDIA GPU is at hand, the way sm_75 runs them,
with physical constants (CONSTANTS: each with its source and an optimistic and a pessimistic value), calibrated
against transformers' own eager decode, whose T4G step time is published.

    python -m benchmarks.t4g_model OUT_DIR [--runtimes transformers,pytorch,jax] [--schemes fp16,w8a16,w4a16]
        [--heads fp16,int8] [--ncu-budget 800] [--work DIR] [--steps 32] [--tiny] [--no-ncu]
    python -m benchmarks.t4g_model OUT_DIR --recompute      # the predictions again from OUT_DIR/raw/ (no GPU)
    python -m benchmarks.t4g_model OUT_DIR --recompute --wire serving_speed.json   # + the served TPOT beside each
                                                            # fp16 cell's wall per step (same GPU)

A cell is a (runtime, scheme): `transformers` is the calibration (transformers' eager decode, fp16, SDPA, dynamic
cache: what a transformers server runs), `pytorch` and `jax` our runtimes. Each cell is three child processes at
Gemma 4 E2B's text shapes with random weights, on the code paths sm_75 takes (TURING: XLA without Triton GEMM,
SDPA without flash and cuDNN, our packed kernels as sm_75 picks them):
0. The warm-up child: the measure child's run from cold caches, its figures thrown away: every compile happens
   here, under its own bound (COMPILE_TIMEOUT_S), so the two timed children load from warm caches.
1. The measure child (no profiler attached): load, time engine steps with 1 and 8
   live sequences (wall per step, defaults), then trace one step of each with a cheap tracer (the PyTorch
   profiler's CUPTI activity records; jax.profiler for JAX): every kernel's name, duration here and grid.
2. The ncu child (compile caches warm: JAX loads its executables from the persistent cache, inductor from its
   cache; nothing compiles under ncu): the same two steps, with Nsight Compute profiling only the kernels that
   take the most time here (their names, chosen from the trace, up to --ncu-budget launches in all): DRAM bytes
   read and written (cold L2, as on a T4G whose 4 MB keeps almost nothing between kernels), warp instructions
   and FP32-pipe instructions. A marker kernel (MARKER) between the two steps tells them apart.
The model (t4g_kernel_s, predict): a kernel takes on a T4G the largest of
  - its DRAM bytes over the T4G's bandwidth,
  - its warp instructions at the T4G's issue rate, FP32-pipe instructions at Turing's rate (16 lanes a scheduler:
    two issue cycles a warp instruction, against one on Hopper),
  - its duration here scaled by clock (here / T4G) and by SM waves (grids wider than 40 SMs),
  - the launch floor (the smallest kernel's time on a T4G);
a step is the slower of two lanes that run at once (launches are asynchronous, our runtimes dispatch a step
ahead): the GPU's, its kernels' T4G times, and the host's, the wall time of a step here times the Graviton2 host
factor (the host's work is at most that wall time, and all of it where this GPU is host-bound, as eager decode is;
kept apart: `t4g_host_ms`). Kernels ncu did not profile take their scaled duration (`unprofiled_*` says how many).
Predicted tok/s: 1 / step (one stream), 8 / step (8 streams). The range: optimistic constants with both lanes at
their least (host: only the time the GPU left uncovered here), and pessimistic constants with no overlap at all.

Writes OUT_DIR/t4g_model.json (`runtimes.{pytorch,jax}.{scheme}`, `calibration.transformers_eager`, `constants`)
and OUT_DIR/raw/CELL.json (each cell's timings, traced kernels and ncu rows: what --recompute reads).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks.harness import checkpoint, children, jax_trace  # noqa: E402

# Every constant of the model: its point value, its optimistic and pessimistic values, and where it comes from.
CONSTANTS = {
    "t4g_bandwidth_Bps": {
        "value": 277e9, "optimistic": 300e9, "pessimistic": 250e9,
        "source": "measured read on a G5g (seed 000, docs FACTS); 320 GB/s theoretical GDDR6: 300 is 94% of it, "
                  "250 the 78% a decode GEMV commonly reaches"},
    "t4g_clock_hz": {
        "value": 1.29e9, "optimistic": 1.59e9, "pessimistic": 1.29e9,
        "source": "a T4G decoding at its 70 W cap: 1.29 GHz, a published nvidia-smi reading from a T4G rig "
                  "(issue 35); 1.59 GHz is the T4's boost clock, reached only below the cap"},
    "t4g_sms": {"value": 40, "optimistic": 40, "pessimistic": 40, "source": "T4/T4G: 40 SMs (TU104, NVIDIA)"},
    "t4g_fp32_issue_cycles": {
        "value": 2, "optimistic": 2, "pessimistic": 2,
        "source": "Turing: 64 FP32 lanes an SM, 16 a scheduler, so a 32-thread FP32 warp instruction takes 2 "
                  "issue cycles (Hopper: 32 lanes a scheduler, 1); the Turing whitepaper"},
    "t4g_launch_floor_s": {
        "value": 2.0e-6, "optimistic": 1.0e-6, "pessimistic": 3.0e-6,
        "source": "the least a kernel costs on a Turing GPU back to back in one stream: an estimate (no T4G here). "
                  "Optimistic: the smallest kernel traced on the H200 scaled to 1.29 GHz (1.03 us, "
                  "`launch_floor_scaled_s`); point and pessimistic: 2 and 3 us, what small PyTorch kernels commonly "
                  "show on a T4 in traces"},
    "t4g_gemv_Bps": {
        "value": None, "optimistic": None, "pessimistic": None,      # GEMV_SOURCE's arithmetic, filled in below
        "source": "the DRAM rate a T4G GEMV reaches (a weight read at 1-8 rows): the published T4G profile of "
                  "transformers' eager decode, E2B fp16, batch 1 (2026-08-29, the 93.2 ms step): cuBLAS gemv2T "
                  "10.155 ms + gemvx 9.634 ms = 19.79 ms a step, for the bytes those kernels read (GEMV_SOURCE). "
                  "Optimistic: the same time with the tied LM head's bytes counted in too; pessimistic: the copy "
                  "rate's own pessimistic ratio (250/277) applied to it"},
    "host_factor": {
        "value": 2.5, "optimistic": 2.0, "pessimistic": 3.0,
        "source": "Graviton2 (Neoverse N1, 2.5 GHz) against this GPU's x86 host for the per-step Python and "
                  "launch work the GPU did not hide: Graviton2 launches and dispatches 2-5x slower than x86 "
                  "(issue 38's published comparison); cross-checked by vLLM, same T4, 42.4 tok/s on a g4dn "
                  "and 32.53 on a G5g (+7 ms a token of host)"},
}
# The GEMV rate's source: the published kernel times, and the bytes those kernels read in that step. At batch 1 a
# GEMV reads its weight once, so the bytes are E2B's decoder-layer weights that a decode step streams: the memory
# plan's streamed bytes a token of the fp16 checkpoint (serving/memory_plan.py; `plan_streamed_bytes` in
# raw/transformers-fp16.json) less the tied LM head (vocab x hidden x 2 B). The head is left out: counted in, the
# rate would be 230 GB/s, 83% of a T4G's copy rate, against the source's own reading (about two thirds).
GEMV_SOURCE = {
    "published_ms": {"gemv2T_kernel_val": 10.155, "gemvx_kernel": 9.634},
    "plan_streamed_bytes": 4_558_946_304,         # serving/memory_plan.py, E2B fp16, text only (with the head)
    "lm_head_bytes": 262_144 * 1536 * 2,          # vocab x hidden, fp16, tied: not a gemv2T/gemvx read
    "source": "transformers eager decode (fp16, SDPA, dynamic cache), E2B, batch 1, g5g, 2026-08-29: the same "
              "profile as the 93.2 ms step (issue 48, docs FACTS)",
}
GEMV_SOURCE["published_total_ms"] = round(sum(GEMV_SOURCE["published_ms"].values()), 3)
GEMV_SOURCE["bytes"] = GEMV_SOURCE["plan_streamed_bytes"] - GEMV_SOURCE["lm_head_bytes"]
_gemv = CONSTANTS["t4g_gemv_Bps"]
_gemv["value"] = round(GEMV_SOURCE["bytes"] / (GEMV_SOURCE["published_total_ms"] * 1e-3), -6)
_gemv["optimistic"] = round(GEMV_SOURCE["plan_streamed_bytes"] / (GEMV_SOURCE["published_total_ms"] * 1e-3), -6)
_gemv["pessimistic"] = round(_gemv["value"] * CONSTANTS["t4g_bandwidth_Bps"]["pessimistic"]
                             / CONSTANTS["t4g_bandwidth_Bps"]["value"], -6)
POINT = {k: c["value"] for k, c in CONSTANTS.items()}
OPTIMISTIC = {k: c["optimistic"] for k, c in CONSTANTS.items()}
PESSIMISTIC = {k: c["pessimistic"] for k, c in CONSTANTS.items()}
# the GPU the kernels were traced on, where a record does not say (each run records its own): an H200 SXM's SMs and
# its SM clock under load (nvidia-smi on the lent H200)
HERE = {"clock_hz": 1.98e9, "sms": 132}
ANCHORS = {
    "transformers_eager_step_ms_1": {
        "value": 93.2, "source": "transformers eager decode (fp16, SDPA, dynamic cache, ~5 650 launches a step), "
                                 "E2B, batch 1, g5g, 2026-08-29 (issue 35)"},
    "vllm_tok_s_1": {"value": 32.53, "source": "vLLM 0.27.2, E2B fp16, g5g.2xlarge, client ITL, 3 repeats, 2026-08-31"},
    "vllm_tok_s_8": {"value": 168, "source": "vLLM at 8 concurrent streams on a T4G"},
    "vllm_g4dn_tok_s_1": {"value": 42.4, "source": "the same vLLM on an x86 T4 (g4dn)"},
}
TURING = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false", "G5G_PACKED_SMS": "40", "G5G_PACKED_ARCH": "75"}
DRAM = ("dram__bytes_read.sum", "dram__bytes_write.sum")
COUNTERS = (*DRAM, "smsp__inst_executed.sum", "smsp__inst_executed_pipe_fma.sum")   # what a kernel takes from ncu
METRICS = (*COUNTERS, "gpu__time_duration.sum")
SCHEMES = ("fp16", "w8a16", "w4a16")
SLOTS, CONTEXT = 8, 1024
LIVE = (1, SLOTS)               # live sequences per step: one stream, eight
PROMPT = [2] + list(range(100, 131))   # transformers' eager decode (the calibration's cell)
# Where our engines' timed and traced steps sit: after serving_speed's short chat prompt as the servers see it (its
# JSON's prompt_tokens.short: 117 tokens), half-way through its 256-token answer, the middle of the wire's single_256
# TPOT. JAX decodes with one executable per context bucket (128, 512, 1024): cells begun at 32 positions timed the
# 128 bucket, 7.06 ms a step, where the server on sm_75's paths took 14.9 ms at positions 117-373 (H100, 2026-12-07).
SERVED_PROMPT = [2] + list(range(100, 216))
SERVED_AT = len(SERVED_PROMPT) + 128
MARKER = "spin_kernel"          # torch.cuda._sleep's kernel, launched between the profiled steps
CELL_TIMEOUT_S = 180            # each child's bound: a cell that cannot finish in it is a defect of the measure
# The warm-up child's bound: it compiles what the other two load from the caches. E2B's PyTorch decode graphs took
# past 180 s from cold caches on a fresh H200 (2026-12-03), where the timed children took under 180 s warm.
COMPILE_TIMEOUT_S = 330


# ------------------------------------------------------------------------------------------ names, parsing
def base_name(name: str) -> str:
    """A kernel's function name without return type, namespaces, template arguments and parameters, the same for
    the tracer's spelling and ncu's ('void at::native::(anonymous namespace)::k<...>(...)' and
    'void <unnamed>::k<...>(...)' are both 'k')."""
    out, depth = [], 0
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)" and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    return "".join(out).split()[-1].split("::")[-1] if "".join(out).split() else name


def parse_ncu(text: str) -> list[dict]:
    """ncu --csv --page raw --print-units base rows: [{name, <metric>: float}] in launch order."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if head is None:
        return []
    cols = rows[head]
    out = []
    for r in rows[head + 1:]:
        rec = dict(zip(cols, r))
        if not rec.get("ID", "").strip().isdigit():
            continue                                        # the units row
        k = {"name": rec["Kernel Name"]}
        for m in METRICS:
            v = (rec.get(m) or "").replace(",", "").strip()
            k[m] = float(v) if v not in ("", "n/a") else 0.0
        out.append(k)
    return out


def split_steps(kernels: list[dict], count: int = len(LIVE)) -> list[list[dict]]:
    """The profiled child's kernels per step, in order: MARKER between consecutive steps."""
    steps: list[list[dict]] = [[]]
    for k in kernels:
        if base_name(k["name"]) == MARKER:
            steps.append([])
        else:
            steps[-1].append(k)
    if len(steps) != count:
        raise ValueError(f"{len(steps)} profiled steps in ncu's rows, not {count} (one {MARKER} between each)")
    return steps


def torch_trace_kernels(trace: dict) -> list[dict]:
    """The kernels of a PyTorch profiler chrome trace (CUPTI activity records), in start order."""
    ev = sorted((e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return [{"name": e["name"], "dur_ns": float(e["dur"]) * 1e3,
             "blocks": math.prod(e.get("args", {}).get("grid") or [1])} for e in ev]


SYNC_CALLS = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy")    # runtime calls that can block
JAX_WAITS = re.compile(r"BlockHostUntilReady|BlockUntilReady|Synchroniz|Await|ToLiteral|TransferToHost|CopyToHost",
                       re.I)


def torch_trace_blocked_ms(trace: dict) -> float:
    """The time the host spent in CUDA runtime calls that wait for the GPU (synchronise, copy to the host), from
    a PyTorch profiler trace recorded with CPU activity: waiting, not work."""
    return sum(float(e.get("dur", 0.0)) for e in trace.get("traceEvents", [])
               if e.get("cat") == "cuda_runtime" and SYNC_CALLS.search(e.get("name", ""))) / 1e3


def jax_trace_blocked_ms(profile) -> tuple[float, dict[str, float]]:
    """The time the host spent waiting for the GPU in a jax.profiler ProfileData (host events named as waits,
    JAX_WAITS; outermost only), and the host events' total ms per name (the 30 longest: what the names were)."""
    blocked = 0.0
    for plane in profile.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            end = -1
            for e in sorted(line.events, key=lambda e: e.start_ns):
                if JAX_WAITS.search(e.name) and e.start_ns >= end:
                    blocked += e.duration_ns / 1e6
                    end = e.start_ns + e.duration_ns
    top = dict(sorted(jax_trace.host_event_ms(profile).items(), key=lambda kv: -kv[1])[:30])
    return blocked, {k: round(v, 3) for k, v in top.items()}


def jax_trace_kernels(profile) -> list[dict]:
    """The GPU kernels of a jax.profiler ProfileData, in start order (memory copies and sets left out)."""
    ev = []
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():       # derived lines (XLA Ops, Modules, Steps) repeat the kernels
                continue
            for e in line.events:
                if e.name.lower().startswith(("memcpy", "memset")):
                    continue
                try:
                    stats = dict(e.stats)
                except (AttributeError, TypeError, ValueError):
                    stats = {}
                grid = re.search(r"grid:(\d+),(\d+),(\d+)", str(stats.get("kernel_details", "")))
                ev.append((e.start_ns, {"name": e.name, "dur_ns": float(e.duration_ns),
                                        "blocks": math.prod(map(int, grid.groups())) if grid else 1}))
    return [k for _, k in sorted(ev, key=lambda x: x[0])]


def heavy_names(steps: list[list[dict]], budget: int) -> list[str]:
    """Base names of the kernels ncu profiles: the matrix kernels (MATMUL: the weight reads the T4G GEMV rate
    applies to, every launch of them) first, then by their longest launch here, longest first, while all their
    launches (over every step) fit the budget."""
    count: dict[str, int] = {}
    longest: dict[str, float] = {}
    for k in (k for step in steps for k in step):
        b = base_name(k["name"])
        count[b] = count.get(b, 0) + 1
        longest[b] = max(longest.get(b, 0.0), k["dur_ns"])
    chosen, used = [], 0
    for b in sorted(longest, key=lambda n: (not MATMUL.search(n), -longest[n])):
        if used + count[b] <= budget:
            chosen.append(b)
            used += count[b]
    return chosen


def ncu_filter(names: list[str]) -> str:
    """ncu's --kernel-name regex: these base names as whole identifiers, whatever ncu's spelling around them."""
    alts = "|".join(re.escape(n) for n in [MARKER, *names])
    return f"regex:(^|[^A-Za-z0-9_])({alts})($|[^A-Za-z0-9_])"


def join(traced: list[dict], profiled: list[dict]) -> list[dict]:
    """Each traced kernel with its ncu row where ncu profiled that launch (the same step of the other child,
    matched per base name in launch order)."""
    queues: dict[str, list[dict]] = {}
    for row in profiled:
        queues.setdefault(base_name(row["name"]), []).append(row)
    out = []
    for k in traced:
        q = queues.get(base_name(k["name"]))
        row = q.pop(0) if q else None
        out.append({**k, **{m: row[m] for m in COUNTERS}, "profiled": True} if row else k)
    return out


# -------------------------------------------------------------------------------------------- the model
GEMV_MIN_READ = 2**20           # a weight read: at least 1 MiB from DRAM (E2B's smallest fp16 weight is 0.75 MiB:
GEMV_MAX_WRITE_SHARE = 1 / 32   # its share of the step's bytes is negligible) and writes at most 1/32 of its reads
ATTENTION = re.compile(r"fmha|flash|attn|attention|sdpa", re.I)
MATMUL = re.compile(r"gemv|gemm|nvjet|xmma|cutlass|cublas", re.I)    # cuBLAS/cuBLASLt/CUTLASS matrix kernels


def gemv_kind(k: dict) -> bool:
    """A kernel of the GEMV's kind: a weight read at 1-8 rows (GEMV, packed w8/w4 GEMV, the LM head; on XLA a
    multiply-reduce fusion): it streams a large operand from DRAM into a small output, at least GEMV_MIN_READ read
    and at most GEMV_MAX_WRITE_SHARE of that written, and it is not attention (whose keys are not weights). Known
    only from ncu's bytes: an unprofiled kernel is never of this kind."""
    read, write = k.get(DRAM[0], 0.0), k.get(DRAM[1], 0.0)
    return (bool(k.get("profiled")) and read >= GEMV_MIN_READ and write <= read * GEMV_MAX_WRITE_SHARE
            and not ATTENTION.search(base_name(k["name"])))


def t4g_kernel_s(k: dict, c: dict = POINT, here: dict | None = None) -> tuple[float, str]:
    """(seconds on a T4G, the bound that sets it) for one kernel: the largest of its DRAM bytes, its issue time
    (FP32 at Turing's rate), its duration here scaled by clock and SM waves, and the launch floor. A kernel of the
    GEMV's kind (gemv_kind) reads its bytes at the T4G GEMV rate (bound 'gemv bytes'), any other at the copy rate."""
    here = here or HERE
    dur = k.get("dur_ns", k.get("gpu__time_duration.sum", 0.0)) / 1e9
    blocks = k.get("blocks", 1)
    waves = min(blocks, here["sms"]) / min(blocks, c["t4g_sms"])     # 1 up to 40 blocks, then the SMs' ratio
    issue_cycles = max(k.get("smsp__inst_executed.sum", 0.0),
                       c["t4g_fp32_issue_cycles"] * k.get("smsp__inst_executed_pipe_fma.sum", 0.0))
    gemv = gemv_kind(k)       # a GEMV streams at the rate a T4G GEMV reaches, other kernels at the copy rate
    by = {"gemv bytes" if gemv else "bytes":
          sum(k.get(m, 0.0) for m in DRAM) / c["t4g_gemv_Bps" if gemv else "t4g_bandwidth_Bps"],
          "issue": issue_cycles / (c["t4g_sms"] * 4 * c["t4g_clock_hz"]),
          "latency": dur * here["clock_hz"] / c["t4g_clock_hz"] * waves,
          "launch floor": c["t4g_launch_floor_s"]}
    bound = max(by, key=by.get)
    return by[bound], bound


def predict(kernels: list[dict], wall_ms: float, rows: int, c: dict = POINT, here: dict | None = None,
            overlap: bool = True, host_all_wall: bool = True, least_bytes: float = 0.0,
            work_ms: float | None = None) -> dict:
    """The T4G step for one step's kernels (t4g_kernel_s) and this GPU's wall time per step. Two lanes run at once
    (launches are asynchronous; our runtimes dispatch a step ahead): the GPU's, the kernels' T4G times, and the
    host's, this GPU's host work times the Graviton2 factor. overlap: the step is the slower lane (else, the
    pessimistic bound, their sum). host_all_wall: the host's work is the whole wall time here (its upper bound: all
    of it when this GPU is host-bound, as eager decode is); else only the time this GPU's kernels left uncovered.
    least_bytes: what the step must read at the least (the memory plan's weights a token): the GPU lane is never
    shorter than reading them through GEMVs (the T4G GEMV rate), whatever ncu could not profile (kernels inside CUDA
    graphs with conditional nodes).
    work_ms: the host's work in a step, measured in the traced step: its wall time there less the time the host
    spent blocked on this GPU (synchronising calls). Waiting is not work, so it is not scaled by the Graviton2
    factor (a host that waits for the GPU does not wait 2.5 times as long on a T4G: the GPU lane says how long).
    The tracer slows the host, so it is an upper bound; the host's work is never more than the wall time here
    either. None: not measured, the whole wall time counts."""
    timed = [t4g_kernel_s(k, c, here) for k in kernels]
    here_ms = sum(k["dur_ns"] for k in kernels) / 1e6
    floor_ms = least_bytes / c["t4g_gemv_Bps"] * 1e3
    gpu_ms = max(sum(t for t, _ in timed) * 1e3, floor_ms)
    uncovered = max(0.0, wall_ms - here_ms)
    work = wall_ms if work_ms is None else min(wall_ms, max(0.0, work_ms))
    host_ms = (work if host_all_wall else min(work, uncovered)) * c["host_factor"]
    gemv = [(k, t) for k, (t, _) in zip(kernels, timed) if gemv_kind(k)]
    by: dict[str, float] = {}
    for t, b in timed:
        by[b] = by.get(b, 0.0) + t * 1e3
    missed = [k for k in kernels if not k.get("profiled")]
    step = max(gpu_ms, host_ms) if overlap else gpu_ms + host_ms
    return {"kernels": len(kernels), "dram_bytes": int(sum(k.get(m, 0.0) for k in kernels for m in DRAM)),
            "kernel_ms_here": round(here_ms, 3), "wall_ms_here": wall_ms, "host_ms_here": round(uncovered, 3),
            "host_work_ms_here": round(work, 3), "host_work_measured": work_ms is not None,
            "gemv_kernels": len(gemv), "gemv_bytes": int(sum(k.get(DRAM[0], 0.0) + k.get(DRAM[1], 0.0) for k, _ in gemv)),
            "gemv_t4g_ms": round(sum(t for _, t in gemv) * 1e3, 3),
            "gemv_rate_applied_to": dict(sorted(_count(base_name(k["name"]) for k, _ in gemv).items())),
            "t4g_kernel_ms": round(gpu_ms, 3), "weights_floor_ms": round(floor_ms, 3),
            "t4g_host_ms": round(host_ms, 3), "t4g_step_ms": round(step, 3),
            "bound_by": "host" if host_ms > gpu_ms else "gpu",
            "t4g_ms_by_bound": {b: round(v, 3) for b, v in sorted(by.items())},
            "unprofiled_kernels": len(missed), "unprofiled_ms_here": round(sum(k["dur_ns"] for k in missed) / 1e6, 3),
            "predicted_tok_s": round(rows * 1e3 / step, 1)}


def _count(names) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in names:
        out[n] = out.get(n, 0) + 1
    return out


def cell_prediction(raw: dict) -> dict:
    """A cell's figures from its raw record: per step (one stream, eight) the point prediction and the range."""
    here = raw.get("here") or HERE
    out: dict = {}
    for live in LIVE:
        kernels = raw.get("steps", {}).get(str(live))
        wall = raw.get(f"step_ms_{live}")
        if not kernels or wall is None:
            continue
        weights = raw.get("plan_streamed_bytes") or 0
        work = (raw.get("host_work_ms") or {}).get(str(live))
        p = predict(kernels, wall, live, POINT, here, least_bytes=weights, work_ms=work)
        # optimistic: both lanes at their least (host: only the time the GPU left uncovered here), overlapped;
        # pessimistic: the same host time, with no overlap at all
        p["range_tok_s"] = [
            predict(kernels, wall, live, c, here, overlap, host_all_wall=False, least_bytes=weights,
                    work_ms=work)["predicted_tok_s"]
            for c, overlap in ((PESSIMISTIC, False), (OPTIMISTIC, True))]
        p.update(layer_gemvs(kernels, here))
        out[f"step{live}"] = p
        out[f"predicted_tok_s_{live}"] = p["predicted_tok_s"]
        out[f"predicted_step_ms_{live}"] = p["t4g_step_ms"]
    if "step1" in out:
        out["bytes_per_token"] = out["step1"]["dram_bytes"]
        smallest = min(k["dur_ns"] for k in raw["steps"]["1"]) / 1e9
        out["launch_floor_scaled_s"] = round(smallest * here["clock_hz"] / POINT["t4g_clock_hz"], 9)
    return out


def layer_gemvs(kernels: list[dict], here: dict | None = None, c: dict = POINT) -> dict:
    """What the published GEMV figure covers, in one step: the decoder layers' weight GEMVs, i.e. the cuBLAS-family
    matrix kernels (MATMUL) of the GEMV's kind, the LM head aside (a launch reading at least 90% of the tied head's
    bytes). `layer_gemv_unprofiled`: matrix kernels ncu did not profile (their bytes unknown: the sum is short)."""
    head = 0.9 * GEMV_SOURCE["lm_head_bytes"]
    mats = [k for k in kernels if MATMUL.search(base_name(k["name"]))]
    chosen = [k for k in mats if gemv_kind(k) and k.get(DRAM[0], 0.0) < head]
    return {"layer_gemv_kernels": len(chosen),
            "layer_gemv_bytes": int(sum(k.get(DRAM[0], 0.0) + k.get(DRAM[1], 0.0) for k in chosen)),
            "layer_gemv_t4g_ms": round(sum(t4g_kernel_s(k, c, here)[0] for k in chosen) * 1e3, 3),
            "layer_gemv_unprofiled": sum(not k.get("profiled") for k in mats)}


def calibration(cell: dict) -> dict:
    """The transformers eager cell against its published T4G figures: the step (93.2 ms), and its weight GEMVs
    (19.79 ms: the GPU lane's check, the kernels the T4G GEMV rate applies to); the host factor the step implies."""
    anchor = ANCHORS["transformers_eager_step_ms_1"]["value"]
    out = {"published_step_ms_1": anchor, "published_source": ANCHORS["transformers_eager_step_ms_1"]["source"],
           "published_gemv_ms_1": GEMV_SOURCE["published_total_ms"], "published_gemv_source": GEMV_SOURCE}
    if "step1" in cell:
        g = cell["step1"]
        out["gemv_t4g_ms_1"] = g["layer_gemv_t4g_ms"]
        out["gemv_bytes_1"] = g["layer_gemv_bytes"]
        out["gemv_kernels_1"] = g["layer_gemv_kernels"]
        out["gemv_unprofiled_1"] = g["layer_gemv_unprofiled"]
        out["gemv_error_pct"] = round((g["layer_gemv_t4g_ms"] / out["published_gemv_ms_1"] - 1) * 100, 1)
        out["gemv_within_15pct"] = abs(out["gemv_error_pct"]) <= 15 and not g["layer_gemv_unprofiled"]
    for key in ("predicted_step_ms_1", "predicted_step_ms_8", "step1", "step8"):
        if key in cell:
            out[key] = cell[key]
    if "step1" in cell:
        s = cell["step1"]
        out["error_pct"] = round((s["t4g_step_ms"] / anchor - 1) * 100, 1)
        out["within_20pct"] = abs(out["error_pct"]) <= 20
        out["range_step_ms_1"] = [round(1e3 / t, 2) for t in s["range_tok_s"][::-1]]
        if s["bound_by"] == "host":     # not fitted: the host factor that would put the point on the anchor
            out["implied_host_factor"] = round(anchor / s["host_work_ms_here"], 2)
    return out


# ------------------------------------------------------------------------------------------------- child
class EngineRunner:
    """One of our engines (serving.engine.Engine): sequences in the first `live` slots, greedy."""

    def __init__(self, runtime: str, ckpt: Path, settings_dir: Path, at: int = SERVED_AT):
        # the engine the server builds (serving.__main__.load_engine) with serving_speed's flags; the settings come
        # from the environment, which measure_cell gives serving_speed's (served_settings)
        from benchmarks.harness.serve import SERVER_FLAGS
        from serving.__main__ import load_engine, parse
        args = parse(["--runtime", runtime, "--model", str(ckpt), *SERVER_FLAGS])
        self.engine = load_engine(args.runtime, Path(args.model), args.max_model_len)
        from serving.engine import SamplingParams
        # a sequence that goes on to the context, as a served request of max_tokens does: at the default 16, the
        # PyTorch engine stopped dispatching a step ahead after 16 tokens, and every timed step waited (2026-12-07)
        self.greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=CONTEXT)
        self.toks: dict = {}
        self.at = at

    def begin(self, live: int) -> None:
        """`live` sequences of SERVED_PROMPT, each stepped on to position `at` (SERVED_AT)."""
        self.toks = self.engine.step({s: self.engine.start(s, SERVED_PROMPT, self.greedy) for s in range(live)})
        for _ in range(self.at - len(SERVED_PROMPT) - 1):
            self.step()

    def step(self) -> None:
        self.toks = self.engine.step(self.toks)

    def one_dispatch(self) -> None:
        """A traced step is that step alone, not the next one dispatched ahead."""
        if hasattr(self.engine, "pipeline"):
            self.engine.pipeline = False


class EagerRunner:
    """transformers' own eager decode, as a transformers server runs it: fp16, SDPA, a dynamic cache, one forward
    a token, the tokens to the host each step."""

    def __init__(self, ckpt: Path):
        import torch
        from transformers import Gemma4ForConditionalGeneration

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.torch = torch
        self.model = Gemma4ForConditionalGeneration.from_pretrained(
            ckpt, dtype=torch.float16 if dev == "cuda" else torch.float32, attn_implementation="sdpa").to(dev).eval()
        self.dev = dev

    def _forward(self, ids):
        with self.torch.inference_mode():
            out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.next = out.logits[:, -1].argmax(-1)
        self.next.tolist()

    def begin(self, live: int) -> None:
        self.cache = None
        self._forward(self.torch.tensor([PROMPT] * live, device=self.dev))
        self._forward(self.next[:, None])

    def step(self) -> None:
        self._forward(self.next[:, None])

    def one_dispatch(self) -> None:
        pass


def child(runtime: str, ckpt: Path, steps: int, result: Path, profile: bool, work: Path) -> None:
    """In this process: load the runner the sm_75 way; then either time and trace its steps (1 and 8 live
    sequences) or, under ncu, run the same two steps profiled, MARKER between them."""
    import torch

    gpu = torch.cuda.is_available()
    if gpu:             # SDPA backends a T4G has (flash attention and cuDNN's need sm_80)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    t0 = time.perf_counter()
    runner = EagerRunner(ckpt) if runtime == "transformers" else EngineRunner(runtime, ckpt, work)
    res: dict = {"load_s": round(time.perf_counter() - t0, 1)}
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    for live in LIVE:   # warm over every position timed: the runtimes compile per length bucket and row count
        runner.begin(live)
        for _ in range(3 if profile else 3 * steps):
            runner.step()
    for live in LIVE if not profile else ():
        runner.begin(live)
        rates = []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                runner.step()
            sync()
            rates.append((time.perf_counter() - t0) / steps * 1e3)
        res[f"step_ms_{live}"] = round(statistics.median(rates), 3)
    runner.one_dispatch()
    res["steps"] = {}
    for i, live in enumerate(LIVE):
        runner.begin(live)
        sync()
        if profile:
            if gpu:
                torch.cuda.profiler.start()
                if i:
                    torch.cuda._sleep(1)        # MARKER: the kernels after it are this step's
                runner.step()
                sync()
                torch.cuda.profiler.stop()
        else:
            traced = trace_step(runtime, runner, work / f"trace-{os.getpid()}-{live}", gpu)
            res["steps"][str(live)] = traced.pop("kernels")
            for key, value in traced.items():
                res.setdefault(key, {})[str(live)] = value
    if gpu and not profile:
        res["here"] = {"clock_hz": gpu_clock_hz(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
                       "device": torch.cuda.get_device_name()}
    result.write_text(json.dumps(res))


def trace_step(runtime: str, runner, where: Path, gpu: bool) -> dict:
    """One step from the cheap tracer: its kernels (name, duration here, blocks), its wall time traced, the time
    its host spent blocked on the GPU, and the host's work (the difference)."""
    if not gpu:
        runner.step()
        return {"kernels": []}
    out: dict = {}
    if runtime == "jax":
        import jax
        from jax.profiler import ProfileData
        with jax.profiler.trace(str(where)):
            t0 = time.perf_counter()
            runner.step()
            jax.effects_barrier()
            wall = (time.perf_counter() - t0) * 1e3
        data = ProfileData.from_file(str(next(where.rglob("*.xplane.pb"))))
        blocked, out["host_events_ms"] = jax_trace_blocked_ms(data)
        out["kernels"] = jax_trace_kernels(data)
    else:
        import torch
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            runner.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        where.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(where / "trace.json"))
        trace = json.loads((where / "trace.json").read_text())
        blocked = torch_trace_blocked_ms(trace)
        out["kernels"] = torch_trace_kernels(trace)
    out.update(traced_wall_ms=round(wall, 3), blocked_ms=round(blocked, 3), host_work_ms=round(wall - blocked, 3))
    return out


def gpu_clock_hz() -> float:
    """The GPU's maximum SM clock (nvidia-smi): what its kernels' durations were measured at."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        return float(out[0]) * 1e6
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return HERE["clock_hz"]


# ------------------------------------------------------------------------------------------------ parent
def checkpoints(work: Path, schemes: list[str], tiny: bool) -> dict[str, Path]:
    import torch

    from tools import quantize

    src = work / "e2b-fp16"
    if not (src / "config.json").exists():
        checkpoint.build(src, checkpoint.text_config("e2b", tiny=tiny))
    dirs = {"fp16": src}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for scheme in schemes:
        if scheme != "fp16":
            dirs[scheme] = work / f"e2b-{scheme}"
            if not (dirs[scheme] / "config.json").exists():
                quantize.quantize(src, dirs[scheme], scheme, log=lambda *_: None, device=dev)
    return dirs


def available(ncu: str, metrics: tuple[str, ...]) -> tuple[str, ...]:
    """The metrics this GPU's ncu knows (a missing one would fail every profile); all of them if it cannot say."""
    try:
        known = subprocess.run([ncu, "--query-metrics", "--csv"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return metrics
    have = tuple(m for m in metrics if m.rsplit(".", 1)[0] in known)
    return have if DRAM[0] in have else metrics


def run_child(args: list[str], env: dict, result: Path, timeout: int, ncu: list[str] | None = None) -> dict:
    """One child of a cell (under ncu when given): its record, or its error, with the seconds it ran (child_s)."""
    cmd = [*(ncu or []), *children.module_argv("benchmarks.t4g_model", "--child", *args, "--result", str(result))]
    return children.run_child(cmd, result, timeout=timeout, env=env).record(timed="child_s")


# ncu cannot profile the kernel nodes of a CUDA graph that may hold conditional nodes ("not supported for profiling"):
# XLA's command buffers of these kinds, on by default (serving/jax_runtime/xla.py), hid every kernel of JAX's fp16
# step from it (H100, 2026-12-06). The profiled JAX child runs without them: the same kernels, fewer in graphs.
UNPROFILABLE_COMMAND_BUFFERS = ("CONDITIONAL", "WHILE")


def profiled_env(runtime: str, env: dict) -> dict:
    """The environment of a cell's profiled children: JAX's command buffers without UNPROFILABLE_COMMAND_BUFFERS
    (the XLA flags a user set stay first and win), every other runtime's as measured."""
    if runtime != "jax":
        return env
    from serving.jax_runtime.xla import DEFAULT_XLA_FLAGS, with_default_xla_flags

    flag = "--xla_gpu_enable_command_buffer"
    kinds = [k for k in DEFAULT_XLA_FLAGS[flag].split(",") if k not in UNPROFILABLE_COMMAND_BUFFERS]
    return {**env, "XLA_FLAGS": with_default_xla_flags(env.get("XLA_FLAGS", ""),
                                                       {**DEFAULT_XLA_FLAGS, flag: ",".join(kinds)})}


def measure_cell(runtime: str, ckpt: Path, env: dict, a, ncu: str | None, metrics: tuple[str, ...],
                 name: str) -> dict:
    """A cell's raw record: the measure child's timings and traced steps, joined with the ncu child's rows."""
    env = children.child_env(None, **env)
    common = [runtime, str(ckpt), "--steps", str(a.steps), "--work", str(a.work)]
    warm = run_child(common, env, a.work / f"{name}-warm.json", COMPILE_TIMEOUT_S)
    if "error" in warm:
        return {"error": f"warm-up: {warm['error']}", "warm_child_s": warm["child_s"]}
    raw = run_child(common, env, a.work / f"{name}-measure.json", CELL_TIMEOUT_S)
    raw.update(warm_child_s=warm["child_s"], measure_child_s=raw.pop("child_s"))
    traced = [raw.get("steps", {}).get(str(live)) or [] for live in LIVE]
    if "error" in raw or not ncu or not all(traced):
        raw["steps"] = {str(live): t for live, t in zip(LIVE, traced)}
        return raw
    names = heavy_names(traced, a.ncu_budget)
    log = a.work / f"{name}.ncu.csv"
    log.unlink(missing_ok=True)
    penv = profiled_env(runtime, env)
    if penv is not env:        # its executables differ: compiled into the cache first, never under ncu
        warm = run_child(common + ["--profile"], penv, a.work / f"{name}-ncu-warm.json", COMPILE_TIMEOUT_S)
        raw["ncu_warm_child_s"] = warm["child_s"]
    got = run_child(common + ["--profile"], penv, a.work / f"{name}-ncu.json", CELL_TIMEOUT_S,
                    [ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "all",
                     "--kernel-name", ncu_filter(names), "--launch-count", str(a.ncu_budget + len(LIVE)),
                     "--metrics", ",".join(metrics), "--csv", "--page", "raw", "--print-units", "base",
                     "--log-file", str(log)])
    raw.update(ncu_child_s=got.get("child_s"), ncu_load_s=got.get("load_s"), ncu_names=len(names))
    try:
        if "error" in got:
            raise ValueError(got["error"])
        profiled = split_steps(parse_ncu(log.read_text()))
        raw["ncu_kernels"] = sum(map(len, profiled))
        raw["steps"] = {str(live): join(t, p) for live, t, p in zip(LIVE, traced, profiled)}
    except (OSError, ValueError) as e:
        raw["ncu_error"] = str(e)[-1500:]
        raw["steps"] = {str(live): t for live, t in zip(LIVE, traced)}
    return raw


WIRE_PHASES = {"jax": "jax", "pytorch": "pytorch_batched"}     # serving_speed's server of SLOTS slots per runtime


def wall_vs_wire(cell: dict, runtime: str, wire: dict) -> dict:
    """The measured step beside the served one (an fp16 cell): the cell's wall per step here with 1 and 8 live
    sequences against serving_speed's TPOT on the wire (single stream of 256 tokens; per stream of 8x256), from
    a serving_speed.json of the same GPU (`device` must match) whose servers ran sm_75's paths as the cell did
    (its `paths_env` holds TURING), and each pair's difference."""
    server = wire.get(WIRE_PHASES.get(runtime, ""), {})
    out = {"wall_ms_here_1": cell.get("step_ms_1"), "wall_ms_here_8": cell.get("step_ms_8"),
           "wire_tpot_ms_1": (server.get("single_256") or {}).get("median_tpot_ms"),
           "wire_tpot_ms_8": (server.get("concurrent_8x256") or {}).get("median_tpot_ms"),
           "wire_device": wire.get("device"), "wall_device": (cell.get("here") or {}).get("device"),
           "wire_on_turing_paths": all((wire.get("paths_env") or {}).get(k) == v for k, v in TURING.items())}
    for live in LIVE:
        wall, tpot = out[f"wall_ms_here_{live}"], out[f"wire_tpot_ms_{live}"]
        out[f"wall_vs_wire_pct_{live}"] = round((wall / tpot - 1) * 100, 1) if wall and tpot else None
    same_machine_and_paths = out["wire_device"] == out["wall_device"] and out["wire_on_turing_paths"]
    out["wall_within_15pct_of_wire"] = (same_machine_and_paths and all(
        out[f"wall_vs_wire_pct_{live}"] is not None and abs(out[f"wall_vs_wire_pct_{live}"]) <= 15 for live in LIVE))
    return out


def table(raws: dict[str, dict], wire: dict | None = None) -> dict:
    """t4g_model.json's figures from every cell's raw record (and, with `wire`, a serving_speed.json of the same
    GPU: each fp16 cell's wall per step beside the served TPOT)."""
    out: dict = {"constants": CONSTANTS, "anchors": ANCHORS, "runtimes": {}, "calibration": {}}
    for name, raw in sorted(raws.items()):
        runtime, key = name.split("-", 1)
        cell = {k: raw[k] for k in ("load_s", "step_ms_1", "step_ms_8", "warm_child_s", "measure_child_s",
                                    "ncu_child_s", "ncu_load_s", "ncu_names", "ncu_kernels", "cell_s", "error",
                                    "ncu_error", "plan_streamed_bytes", "here") if k in raw}
        cell.update(cell_prediction(raw))
        for live in LIVE:
            cell.setdefault(f"predicted_tok_s_{live}", None)
        cell.setdefault("bytes_per_token", None)
        if runtime == "transformers":
            out["calibration"]["transformers_eager"] = {**cell, **calibration(cell)}
        else:
            if wire and key == "fp16":
                cell.update(wall_vs_wire(cell, runtime, wire))
            out["runtimes"].setdefault(runtime, {})[key] = cell
    for runtime in ("pytorch", "jax"):        # every cell of the table, measured or not
        for scheme in SCHEMES:
            out["runtimes"].setdefault(runtime, {}).setdefault(scheme, {
                "predicted_tok_s_1": None, "predicted_tok_s_8": None, "bytes_per_token": None, "note": "not measured"})
    return out


def wire_record(a) -> dict | None:
    path = a.wire or (a.out / "serving_speed.json")
    return json.loads(path.read_text()) if path.exists() else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--runtimes", default="transformers,pytorch,jax")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--heads", default="fp16", help="LM heads for the PyTorch runtime (G5G_LM_HEAD): fp16,int8")
    ap.add_argument("--work", type=Path, default=Path("/tmp/t4g_model"))
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--ncu-budget", type=int, default=800, help="kernel launches ncu profiles per cell")
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a CPU run of the code paths")
    ap.add_argument("--no-ncu", action="store_true")
    ap.add_argument("--recompute", action="store_true", help="the table again from OUT/raw/ (no GPU)")
    ap.add_argument("--wire", type=Path, help="serving_speed.json of the same GPU (default: OUT/serving_speed.json "
                    "if there): each fp16 cell's wall per step beside the served TPOT")
    ap.add_argument("--child", nargs=2, metavar=("RUNTIME", "CKPT"))
    ap.add_argument("--result", type=Path)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    if a.child:
        child(a.child[0], Path(a.child[1]), a.steps, a.result, a.profile, a.work)
        return 0
    rawdir = a.out / "raw"
    rawdir.mkdir(parents=True, exist_ok=True)
    if a.recompute:
        raws = {p.stem: json.loads(p.read_text()) for p in rawdir.glob("*.json")}
        prev = json.loads((a.out / "t4g_model.json").read_text()) if (a.out / "t4g_model.json").exists() else {}
        (a.out / "t4g_model.json").write_text(json.dumps({**prev, **table(raws, wire_record(a))}, indent=1))
        return 0
    a.work.mkdir(parents=True, exist_ok=True)
    import torch

    from benchmarks.harness.serve import served_settings
    from serving import memory_plan
    ncu = None if a.no_ncu else shutil.which("ncu")
    metrics = available(ncu, METRICS) if ncu else METRICS
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    head = {"started": started, "command": " ".join(sys.argv), "turing_env": TURING, "ncu": ncu, "steps": a.steps,
            "metrics": METRICS, "ncu_budget": a.ncu_budget,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    t0 = t_all = time.perf_counter()
    schemes = a.schemes.split(",")
    dirs = checkpoints(a.work, schemes, a.tiny)
    head["checkpoints_s"] = round(time.perf_counter() - t0, 1)
    raws: dict[str, dict] = {}
    cells = [("transformers", "fp16", "fp16")] if "transformers" in a.runtimes.split(",") else []
    for scheme in schemes:      # the most telling cells first: fp16 of each runtime, then the quantised ones
        for runtime in (r for r in a.runtimes.split(",") if r != "transformers"):
            for lm in (a.heads.split(",") if runtime == "pytorch" else ["fp16"]):
                cells.append((runtime, scheme, lm))
    for runtime, scheme, lm in cells:
        name = f"{runtime}-{scheme}" + ("+int8head" if lm == "int8" else "")
        env = {**served_settings(a.work), **TURING, "G5G_LM_HEAD": lm,
               "TORCHINDUCTOR_CACHE_DIR": str(a.work / "inductor")}
        t0 = time.perf_counter()
        raw = measure_cell(runtime, dirs[scheme], env, a, ncu, metrics, name)
        raw["cell_s"] = round(time.perf_counter() - t0, 1)
        raw["plan_streamed_bytes"] = memory_plan.plan_checkpoint(dirs[scheme], None, CONTEXT, SLOTS,
                                                                 text_only=True, lm_head=lm).streamed_per_token
        raws[name] = raw
        (rawdir / f"{name}.json").write_text(json.dumps(raw))
        head["total_s"] = round(time.perf_counter() - t_all, 1)
        (a.out / "t4g_model.json").write_text(json.dumps({**head, **table(raws, wire_record(a))}, indent=1))
        print(name, json.dumps({k: raw.get(k) for k in ("cell_s", "step_ms_1", "step_ms_8", "error", "ncu_error")}),
              flush=True)
    head["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (a.out / "t4g_model.json").write_text(json.dumps({**head, **table(raws, wire_record(a))}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
