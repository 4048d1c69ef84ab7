"""Serving speed on the wire: our JAX and PyTorch servers, and transformers' static-cache `generate` as the peer.

One run, one machine, one checkpoint: google/gemma-4-E2B-it's exact text shapes with random float16 weights
(benchmarks/jax_gpu_e2b_shape.py builds it; no download) and a tokenizer whose 262 144 ids all decode to text.
Each server runs as `python -m serving` and is measured by `build.py bench` (the vllm-bench-serve statistics):
- boot: seconds from process start to /health 200 (JAX: cold with an empty compilation cache, then warm);
- single stream, 64 and 256 output tokens (ignore_eos), --runs requests each: per-request TPOT;
- 8 concurrent streams of 256 tokens: aggregate output tok/s and per-stream TPOT;
- prefill of a ~512-token prompt: TTFT of 1-token requests.
The peer, in-process, on the same checkpoint, prompts and lengths: decode tok/s of `generate(...,
cache_implementation="static")` (greedy) as (N - 1) / (t(N tokens) - t(1 token)), batch 1 and 8, and prefill.
Finally an in-process profile of JAX decode: executable time vs engine.step time (host gap), kernel count.

    python benchmarks/serving_speed.py OUTDIR [--runs 5] [--layers 35] [--tiny]
Writes OUTDIR/serving_speed.json (every figure, with spread) and prints a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BUCKETS = "128,512,1024"        # JAX length ladder for this run: 512-token prompts + 256 tokens fit in 1024
SLOTS = 8
RESULT: dict = {}


def note(out: Path, **kw) -> None:
    RESULT.update(kw)
    (out / "serving_speed.json").write_text(json.dumps(RESULT, indent=1))
    print(json.dumps(kw)[:2000], flush=True)


# ------------------------------------------------------------------------------------------- checkpoint
def make_checkpoint(ckpt: Path, layers: int, tiny: bool) -> None:
    """E2B-shaped random weights + a tokenizer over the whole vocabulary (extra ids decode to ' w<id>')."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from benchmarks.jax_gpu_e2b_shape import build
    from tests.fixtures.tiny_gemma4 import build_tokenizer

    build(ckpt, layers, tiny)
    build_tokenizer(ckpt)
    vocab_size = json.loads((ckpt / "config.json").read_text())["text_config"]["vocab_size"]
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"▁w{i}"] = i
    (ckpt / "tokenizer.json").write_text(json.dumps(tj))
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts(ckpt: Path) -> dict:
    """The chat prompts (text) the benches send, and their token counts as the servers will see them."""
    from serving.generation import TokenizerInfo
    from g5g.bench import DEFAULT_PROMPT

    info = TokenizerInfo.load(ckpt)
    long = ""
    while len(info.chat_prompt([{"role": "user", "content": long}])) < 512:
        long += "Site reliability engineering applies software engineering to operations. "
    out = {}
    for name, text in (("short", DEFAULT_PROMPT), ("long", long)):
        ids = info.chat_prompt([{"role": "user", "content": text}])
        out[name] = {"text": text, "ids": ids, "tokens": len(ids)}
    return out


# --------------------------------------------------------------------------------------------- servers
def start_server(runtime: str, ckpt: Path, port: int, env: dict, log: Path) -> tuple[subprocess.Popen, float]:
    """Start `python -m serving`; return it and the seconds until /health said 200."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving", "--runtime", runtime, "--model", str(ckpt), "--port", str(port),
         "--max-model-len", "1024", "--served-model-name", "e2b", "--max-waiting", "64", "--log-level", "warning"],
        cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < 900:
        if proc.poll() is not None:
            raise RuntimeError(f"{runtime} server exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, time.monotonic() - t0
        except requests.RequestException:
            pass
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"{runtime} server not ready in 900 s: {log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def bench(url: str, out: Path, name: str, *, requests_n: int, concurrency: int, max_tokens: int,
          prompt: str | None = None) -> dict:
    """`build.py bench` on the wire; returns its result with per-request TPOTs and their spread."""
    f = out / f"{name}.json"
    cmd = [sys.executable, "build.py", "bench", "--url", url, "--mode", "both", "--requests", str(requests_n),
           "--concurrency", str(concurrency), "--max-tokens", str(max_tokens), "--ignore-eos", "--warmup",
           str(max(1, concurrency)), "--timeout", "300", "--time-limit", "400", "--json", str(f)]
    if prompt:
        cmd += ["--prompt", prompt]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=600, stdout=subprocess.DEVNULL)
    r = json.loads(f.read_text())
    tpots = [(lat - ttft) / (n - 1) * 1000 for lat, ttft, n in zip(r["latencies"], r["ttfts"], r["output_lens"])
             if ttft is not None and n > 1]
    keep = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "output_throughput",
            "median_ttft_ms", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "mean_tpot_ms", "std_tpot_ms",
            "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "gauge")
    res = {k: r.get(k) for k in keep}
    res["tpots_ms"] = [round(t, 3) for t in tpots]
    res["ttfts_ms"] = [round(t * 1000, 3) for t in r["ttfts"] if t is not None]
    if tpots:
        res["decode_tok_s_median"] = round(1000 / statistics.median(tpots), 1)
        res["decode_tok_s_range"] = [round(1000 / max(tpots), 1), round(1000 / min(tpots), 1)]
    return res


def measure_server(runtime: str, ckpt: Path, work: Path, runs: int, p: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "G5G_JAX_CACHE_DIR": str(work / "jaxcache"), "G5G_JAX_BUCKETS": BUCKETS, "G5G_JAX_SLOTS": str(SLOTS),
           "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    port = 18000 + (runtime == "pytorch")
    url = f"http://127.0.0.1:{port}"
    res: dict = {}
    proc, res["boot_s"] = start_server(runtime, ckpt, port, env, work / f"{runtime}-cold.log")
    if runtime == "jax":          # the first boot compiled into an empty cache: boot again from it
        res["boot_cold_s"] = res.pop("boot_s")
        stop(proc)
        proc, res["boot_warm_s"] = start_server(runtime, ckpt, port, env, work / f"{runtime}-warm.log")
    try:
        res["single_64"] = bench(url, work, f"{runtime}-single64", requests_n=runs, concurrency=1, max_tokens=64)
        res["single_256"] = bench(url, work, f"{runtime}-single256", requests_n=runs, concurrency=1, max_tokens=256)
        res["concurrent_8x256"] = bench(url, work, f"{runtime}-conc8", requests_n=max(16, 2 * SLOTS),
                                        concurrency=SLOTS, max_tokens=256)
        res["prefill_512"] = bench(url, work, f"{runtime}-prefill512", requests_n=runs, concurrency=1,
                                   max_tokens=1, prompt=p["long"]["text"])
    finally:
        stop(proc)
        for log in work.glob(f"{runtime}-*.log"):
            res.setdefault("log_tail", {})[log.name] = log.read_text()[-1500:]
    return res


# ------------------------------------------------------------------------------------------------ peer
def measure_peer(ckpt: Path, runs: int, p: dict) -> dict:
    """transformers `generate(cache_implementation="static")`, eager, on the PyTorch runtime's model."""
    import torch
    from serving.pytorch_runtime import load

    model = load(ckpt, max_context=1024).model
    res: dict = {"transformers": __import__("transformers").__version__, "torch": torch.__version__}

    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)

    def timed(ids: list[int], batch: int, n: int) -> float:
        x = torch.tensor([ids] * batch, device=model.device)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 cache_implementation="static", eos_token_id=None, pad_token_id=0)
        sync()
        assert out.shape[1] == len(ids) + n
        return time.perf_counter() - t0

    short = p["short"]["ids"]
    for batch, n in ((1, 64), (1, 256), (8, 256)):
        timed(short, batch, n)                               # warm-up (and the static cache's first allocation)
        rates = []
        for _ in range(runs):
            t1, tn = timed(short, batch, 1), timed(short, batch, n)
            rates.append((n - 1) / (tn - t1))
        key = f"batch{batch}_{n}"
        res[key] = {"decode_tok_s_per_stream": [round(r, 1) for r in rates],
                    "decode_tok_s_median": round(statistics.median(rates), 1),
                    "aggregate_tok_s_median": round(batch * statistics.median(rates), 1)}
    timed(p["long"]["ids"], 1, 1)
    t = sorted(timed(p["long"]["ids"], 1, 1) for _ in range(runs))
    res["prefill_512"] = {"prompt_tokens": p["long"]["tokens"], "ttft_ms": [round(x * 1000, 2) for x in t],
                          "median_ttft_ms": round(statistics.median(t) * 1000, 2)}
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


# --------------------------------------------------------------------------------------------- profile
def profile_jax(ckpt: Path, work: Path, p: dict) -> dict:
    """Where single-stream decode time goes: the decode executable alone vs a whole engine.step, and how many
    kernels the executable launches (fusions and library calls in the optimised HLO)."""
    import jax
    import numpy as np
    from serving.engine import SamplingParams
    from serving.jax_runtime import Settings, load
    from serving.jax_runtime.engine import parse_buckets

    eng = load(ckpt, Settings(buckets=parse_buckets(BUCKETS), cache_dir=str(work / "jaxcache"), slots=SLOTS))
    res: dict = {"boot": eng.boot}
    greedy = SamplingParams(temperature=0.0)
    for b in eng.batches:
        toks = {s: eng.start(s, p["short"]["ids"], greedy) for s in range(b)}
        for _ in range(5):
            toks = eng.step(toks)
        t0 = time.perf_counter()
        n = 100
        for _ in range(n):
            toks = eng.step(toks)
        step_ms = (time.perf_counter() - t0) / n * 1000
        # the executable alone, inputs already on the device, no host work between calls
        c = next(x for x in eng.buckets if x > int(eng._pos[:b].max()))
        exe = eng._decode[b, c]
        args = [jax.device_put(a) for a in (np.zeros(b, np.int32), eng._pos[:b].copy(), eng._ple_rows(np.zeros(b, np.int32)),
                                            np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32),
                                            np.zeros((b, 2), np.uint32))]
        out = exe(eng.params, eng._cache, *args)
        eng._cache = out[2]
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(n):
            out = exe(eng.params, eng._cache, *args)
            eng._cache = out[2]
        jax.block_until_ready(out)
        exe_ms = (time.perf_counter() - t0) / n * 1000
        hlo = exe.as_text()
        res[f"batch{b}"] = {"capacity": c, "engine_step_ms": round(step_ms, 3), "executable_ms": round(exe_ms, 3),
                            "host_gap_ms": round(step_ms - exe_ms, 3),
                            "hlo_fusions": hlo.count(" fusion("), "hlo_custom_calls": hlo.count("custom-call("),
                            "hlo_while_loops": hlo.count(" while(")}
    weights = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(eng.params))
    res["device_weight_bytes"] = weights
    (work / "decode_b1.hlo.txt").write_text(eng._decode[1, next(iter(eng.buckets))].as_text())
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--tiny", action="store_true", help="shrink the widths (smoke-run the script on CPU)")
    ap.add_argument("--only", default="jax,pytorch,peer,profile")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="serving-speed-"))
    ckpt = work / "ckpt"
    t0 = time.perf_counter()
    make_checkpoint(ckpt, args.layers, args.tiny)
    p = prompts(ckpt)
    import torch
    note(out, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", layers=args.layers,
         runs=args.runs, jax_buckets=BUCKETS, slots=SLOTS, checkpoint_s=round(time.perf_counter() - t0, 1),
         prompt_tokens={k: v["tokens"] for k, v in p.items()})
    only = args.only.split(",")
    for runtime in ("jax", "pytorch"):
        if runtime in only:
            try:
                note(out, **{runtime: measure_server(runtime, ckpt, work, args.runs, p)})
            except Exception as e:          # one runtime failing must not lose the others' figures
                note(out, **{runtime: {"error": f"{type(e).__name__}: {e}"[-3000:]}})
    if "peer" in only:
        try:
            note(out, peer_transformers_static=measure_peer(ckpt, args.runs, p))
        except Exception as e:
            note(out, peer_transformers_static={"error": f"{type(e).__name__}: {e}"[-3000:]})
    if "profile" in only:
        try:
            note(out, jax_profile=profile_jax(ckpt, work, p))
        except Exception as e:
            note(out, jax_profile={"error": f"{type(e).__name__}: {e}"[-3000:]})
        hlo = work / "decode_b1.hlo.txt"
        if hlo.exists():
            (out / "decode_b1.hlo.txt").write_text(hlo.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
