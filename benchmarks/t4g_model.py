"""A T4G's decode speed, predicted from a decode step run on whatever NVIDIA GPU is at hand, the way sm_75 runs it.

    python benchmarks/t4g_model.py OUT_DIR [--runtimes jax,pytorch] [--schemes fp16,w8a16,w4a16]
        [--heads fp16,int8] [--code DIR] [--work DIR] [--steps 64] [--tiny] [--no-ncu]

Per runtime x scheme (x LM head, PyTorch only) at Gemma 4 E2B's text shapes with random weights (the
checkpoints of benchmarks/quantized_decode.py), one child process, run under Nsight Compute (ncu) when it is on
the PATH:
1. The code paths sm_75 takes, forced on this GPU (TURING): XLA without its Triton GEMM (XLA enables it from
   Ampere only: every dot a cuBLAS call), PyTorch's SDPA without the flash and cuDNN backends (sm_80+: the
   memory-efficient and math backends remain), our packed kernels as sm_75 chooses them, on a T4G's grid
   (G5G_PACKED_ARCH=75, G5G_PACKED_SMS=40).
2. Wall time per engine.step with 1 and 8 live sequences (greedy, no HTTP), --steps steps after a warm-up.
3. In a second child under ncu (ncu slows every launch, so it never times): one decode step with 1 live
   sequence and one with 8, profiled (--cache-control all: every kernel starts from a cold L2, as on a T4G whose
   4 MB L2 keeps almost nothing between kernels): per kernel its DRAM bytes read + written, its L2 traffic, its
   warp instructions and its duration here. Each prediction has its own step's kernels: one stream is what a lone
   sequence runs (PyTorch's one-row step, torch_attention.rows(); JAX's batch-1 executable), a marker kernel
   (MARKER) between the two steps tells them apart in ncu's rows.
The model (MODEL below; every constant stated there): a kernel takes on a T4G
    t = max(DRAM bytes / 277 GB/s, warp instructions / the T4G's issue rate, its duration here)
(a T4G is slower than any GPU this runs on in each respect), a step the sum of its kernels plus the host time
this GPU's step left uncovered (wall - kernel time here), scaled by a stated Graviton2 factor. Predicted tok/s:
1 / step (one stream), 8 / step (8 streams). An L2-bound figure (every L2 byte from DRAM) is the pessimistic
bound. Not calibrated (no T4G here): the host factor, and kernels bound by latency rather than bytes or issue.

--code DIR: import serving/ from DIR instead of this tree (the baseline: the same measure over older code).
Writes OUT_DIR/t4g_model.json (per runtime and scheme: predicted_tok_s_1, predicted_tok_s_8, bytes_per_token,
the measured figures behind them) and OUT_DIR/ncu_csv.tar.gz (ncu's raw per-kernel rows).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

MODEL = {
    "t4g_read_bandwidth_Bps": 277e9,        # measured read on a G5g (seed 000; docs FACTS); theoretical 320 GB/s
    "t4g_theoretical_bandwidth_Bps": 320e9,
    "t4g_sms": 40,
    "t4g_l2_bytes": 4 << 20,
    # 40 SMs x 4 schedulers x 1 warp instruction per clock x 1.59 GHz boost (the H200's SASS counted: the same
    # algorithm, not the same instructions; an estimate of issue time, not a calibration)
    "t4g_warp_issue_per_s": 40 * 4 * 1.59e9,
    # Graviton2 (Neoverse N1, 2.5 GHz) against this machine's host core for the per-step Python/dispatch work
    # not hidden behind kernels: a stated guess, not calibrated (no G5g here)
    "host_factor": 1.6,
}
TURING = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false", "G5G_PACKED_SMS": str(MODEL["t4g_sms"]),
          "G5G_PACKED_ARCH": "75"}
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum", "smsp__inst_executed.sum",
           "gpu__time_duration.sum")
SLOTS, CONTEXT = 8, 1024
LIVE = (1, SLOTS)               # live sequences per step timed and profiled
MARKER = "spin_kernel"          # torch.cuda._sleep's kernel, launched between the profiled steps
RESULT: dict = {}


def note(out: Path, **kw) -> None:
    RESULT.update(kw)
    (out / "t4g_model.json").write_text(json.dumps(RESULT, indent=1))
    print(json.dumps(kw)[:1500], flush=True)


# ------------------------------------------------------------------------------------------------- child
def child(runtime: str, ckpt: Path, steps: int, result: Path, profile: bool) -> None:
    """In this process: load the engine the sm_75 way; then either time its steps (1 and 8 live sequences) or,
    under ncu, run one profiled step with each (ncu slows every launch: the two never share a process)."""
    import torch

    from serving.engine import SamplingParams

    gpu = torch.cuda.is_available()
    if gpu:             # SDPA backends a T4G has (flash attention and cuDNN's need sm_80)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    t0 = time.perf_counter()
    if runtime == "pytorch":
        from serving import pytorch_runtime
        engine = pytorch_runtime.load(ckpt, max_context=CONTEXT, slots=SLOTS)
    else:
        from serving.jax_runtime import Settings, load
        engine = load(ckpt, Settings(buckets=(64, CONTEXT), cache_dir=None, slots=SLOTS, batches=(1, SLOTS)))
    res: dict = {"load_s": round(time.perf_counter() - t0, 1)}
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    prompt = [2] + list(range(100, 131))
    for live in LIVE:
        # a first pass over the positions the timed one reaches: the runtimes compile per length bucket (PyTorch's
        # attention span, JAX's ladder), and the 2026-12-02 run timed 1 live sequence through those compiles
        for warm in (True, False):
            toks = {s: engine.start(s, prompt, greedy) for s in range(live)}
            for _ in range(3 + (3 * steps if warm and not profile else 0)):
                toks = engine.step(toks)
        rates = []
        for _ in range(0 if profile else 3):
            t0 = time.perf_counter()
            for _ in range(steps):
                toks = engine.step(toks)
            rates.append((time.perf_counter() - t0) / steps * 1e3)
        if rates:
            res[f"step_ms_{live}"] = round(statistics.median(rates), 3)
    if profile:
        if hasattr(engine, "pipeline"):     # one dispatch inside the profiled range
            engine.pipeline = False
        for i, live in enumerate(LIVE):    # a lone sequence in slot 0: the rows a lone stream decodes
            toks = engine.step({s: engine.start(s, prompt, greedy) for s in range(live)})
            if gpu:
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                if i:
                    torch.cuda._sleep(1)    # MARKER: the kernels after it are this step's
                engine.step(toks)
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
    result.write_text(json.dumps(res))


# -------------------------------------------------------------------------------------------- the model
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


def split_steps(kernels: list[dict]) -> dict[int, list[dict]]:
    """The profiled child's kernels per step, {live sequences: kernels}: LIVE's steps in order, MARKER between."""
    steps: list[list[dict]] = [[]]
    for k in kernels:
        if MARKER in k["name"]:
            steps.append([])
        else:
            steps[-1].append(k)
    if len(steps) != len(LIVE):
        raise ValueError(f"{len(steps)} profiled steps in ncu's rows, not {len(LIVE)} (one {MARKER} between each)")
    return dict(zip(LIVE, steps))


def t4g_seconds(kernel: dict) -> float:
    """MODEL's time for one kernel on a T4G: its slowest of DRAM bytes, warp instructions and its duration here."""
    return max((kernel["dram__bytes_read.sum"] + kernel["dram__bytes_write.sum"]) / MODEL["t4g_read_bandwidth_Bps"],
               kernel["smsp__inst_executed.sum"] / MODEL["t4g_warp_issue_per_s"], kernel["gpu__time_duration.sum"] / 1e9)


def predict(kernels: list[dict], wall_ms: float, rows: int) -> dict:
    """The T4G prediction for one step's kernels (MODEL) and this GPU's wall time per step."""
    bw, issue = MODEL["t4g_read_bandwidth_Bps"], MODEL["t4g_warp_issue_per_s"]
    dram = sum(k["dram__bytes_read.sum"] + k["dram__bytes_write.sum"] for k in kernels)
    l2 = sum(k["lts__t_bytes.sum"] for k in kernels)
    here_ms = sum(k["gpu__time_duration.sum"] for k in kernels) / 1e6
    per = [t4g_seconds(k) for k in kernels]
    per_l2 = [max(k["lts__t_bytes.sum"] / bw, p) for k, p in zip(kernels, per)]
    host_ms = max(0.0, wall_ms - here_ms) * MODEL["host_factor"]
    gpu_ms = sum(per) * 1e3
    bound = {"bytes": 0.0, "issue": 0.0, "duration here": 0.0}
    for k, p in zip(kernels, per):
        by = {"bytes": (k["dram__bytes_read.sum"] + k["dram__bytes_write.sum"]) / bw,
              "issue": k["smsp__inst_executed.sum"] / issue, "duration here": k["gpu__time_duration.sum"] / 1e9}
        bound[max(by, key=by.get)] += p * 1e3
    step = gpu_ms + host_ms
    return {"kernels": len(kernels), "dram_bytes": int(dram), "l2_bytes": int(l2),
            "kernel_ms_here": round(here_ms, 3), "wall_ms_here": wall_ms,
            "t4g_kernel_ms": round(gpu_ms, 3), "t4g_host_ms": round(host_ms, 3), "t4g_step_ms": round(step, 3),
            "t4g_ms_by_bound": {k: round(v, 3) for k, v in bound.items()},
            "predicted_tok_s": round(rows * 1e3 / step, 1),
            "predicted_tok_s_l2_bound": round(rows * 1e3 / (sum(per_l2) * 1e3 + host_ms), 1)}


# ------------------------------------------------------------------------------------------------ parent
def checkpoints(work: Path, schemes: list[str], tiny: bool) -> dict[str, Path]:
    import quantize
    import torch

    from benchmarks.quantized_decode import build_checkpoint

    src = work / "e2b-fp16"
    if not (src / "config.json").exists():
        build_checkpoint(src, "e2b", tiny)
    dirs = {"fp16": src}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for scheme in schemes:
        if scheme != "fp16":
            dirs[scheme] = work / f"e2b-{scheme}"
            if not (dirs[scheme] / "config.json").exists():
                quantize.quantize(src, dirs[scheme], scheme, log=lambda *_: None, device=dev)
    return dirs


def run_one(runtime: str, ckpt: Path, env: dict, steps: int, work: Path, ncu: str | None, code: Path,
            name: str, timeout: int) -> tuple[dict, str]:
    """The timing child, then (ncu given) the profiled one: the timings and ncu's CSV text."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(code), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out: dict = {}
    text = ""
    for profile in (False, True) if ncu else (False,):
        result, log = work / f"{name}-{profile}.json", work / f"{name}.csv"
        result.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--child", runtime, str(ckpt), "--steps", str(steps), "--result",
               str(result)] + ["--profile"] * profile
        if profile:
            cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "all",
                   "--metrics", ",".join(METRICS), "--csv", "--page", "raw", "--print-units", "base",
                   "--log-file", str(log), *cmd]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {**out, "error": f"timed out after {timeout} s (profile: {profile})"}, text
        if r.returncode or not result.exists():
            return {**out, "error": (r.stdout + r.stderr)[-2000:]}, text
        got = json.loads(result.read_text())
        if profile:
            out["load_s_under_ncu"] = got["load_s"]
            text = log.read_text() if log.exists() else ""
        else:
            out.update(got)
    return out, text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--runtimes", default="pytorch,jax")
    ap.add_argument("--schemes", default="fp16,w8a16,w4a16")
    ap.add_argument("--heads", default="fp16", help="LM heads for the PyTorch runtime (G5G_LM_HEAD): fp16,int8")
    ap.add_argument("--code", type=Path, default=ROOT, help="the tree whose serving/ is measured (default: this)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/t4g_model"))
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--timeout", type=int, default=420)
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a CPU run of the code paths")
    ap.add_argument("--no-ncu", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("RUNTIME", "CKPT"))
    ap.add_argument("--result", type=Path)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    if a.child:
        child(a.child[0], Path(a.child[1]), a.steps, a.result, a.profile)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    import torch

    from serving import memory_plan
    ncu = None if a.no_ncu else shutil.which("ncu")
    note(a.out, started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), model=MODEL, turing_env=TURING,
         device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", ncu=ncu, code=str(a.code),
         steps=a.steps, metrics=METRICS, runtimes={})
    schemes = a.schemes.split(",")
    t0 = time.perf_counter()
    dirs = checkpoints(a.work, schemes, a.tiny)
    note(a.out, checkpoints_s=round(time.perf_counter() - t0, 1))
    csvs: dict[str, str] = {}
    for runtime in a.runtimes.split(","):
        for scheme in schemes:
            for head in (a.heads.split(",") if runtime == "pytorch" else ["fp16"]):
                key = scheme if head == "fp16" else f"{scheme}+int8head"
                name = f"{runtime}-{key}"
                env = {**TURING, "G5G_LM_HEAD": head, "TORCHINDUCTOR_CACHE_DIR": str(a.work / "inductor")}
                t0 = time.perf_counter()
                timed, text = run_one(runtime, dirs[scheme], env, a.steps, a.work, ncu, a.code, name, a.timeout)
                csvs[name] = text
                plan = memory_plan.plan_checkpoint(dirs[scheme], None, CONTEXT, SLOTS, text_only=True, lm_head=head)
                res = {**timed, "wall_s": round(time.perf_counter() - t0, 1),
                       "plan_streamed_bytes": plan.streamed_per_token}
                kernels = parse_ncu(text) if text else []
                steps = None
                if kernels and "step_ms_1" in timed:
                    try:
                        steps = split_steps(kernels)
                    except ValueError as e:
                        res["error"] = str(e)
                if steps:
                    for rows, step in steps.items():
                        p = predict(step, timed[f"step_ms_{rows}"], rows)
                        res[f"step{rows}"] = p
                        res[f"predicted_tok_s_{rows}"] = p["predicted_tok_s"]
                    res["bytes_per_token"] = res["step1"]["dram_bytes"]
                elif ncu and "error" not in res:
                    res["error"] = "no profiled steps in ncu's output: " + text[-1500:]
                RESULT["runtimes"].setdefault(runtime, {})[key] = res
                note(a.out, **{"runtimes": RESULT["runtimes"]})
                with tarfile.open(a.out / "ncu_csv.tar.gz", "w:gz") as tar:
                    for n, t in csvs.items():
                        data = t.encode()
                        info = tarfile.TarInfo(f"{n}.csv")
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
    note(a.out, finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
