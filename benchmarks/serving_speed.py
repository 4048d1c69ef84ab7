"""Serving speed on the wire: our JAX and PyTorch servers, and transformers' static-cache `generate` as the peer.

One run, one machine, one checkpoint: google/gemma-4-E2B-it's exact text shapes with random float16 weights
(benchmarks/harness/checkpoint.py builds it; no download) and a tokenizer whose 262 144 ids all decode to text.
Each server runs as `python -m serving`, as its image runs it (without the other runtime's framework:
harness/as_image.py), and is measured by `build.py bench` (the vllm-bench-serve statistics):
- boot: seconds from process start to /health 200, cold with an empty compile cache, then warm from it (JAX:
  G5G_JAX_CACHE_DIR; PyTorch: G5G_TORCH_CACHE_DIR, per slot count);
- single stream, 64 and 256 output tokens (ignore_eos), --runs requests each: per-request TPOT;
- 8 concurrent streams of 256 tokens: aggregate output tok/s and per-stream TPOT;
- prefill of a ~512-token prompt: TTFT of 1-token requests.
The peer, in-process, on the same checkpoint, prompts and lengths: decode tok/s of `generate(...,
cache_implementation="static")` (greedy) as (N - 1) / (t(N tokens) - t(1 token)), batch 1 and 8, and prefill.
Then an in-process profile of JAX decode: executable time vs engine.step time (host gap), a device trace; the
PyTorch server again with G5G_TORCH_SLOTS=8 (continuous batching, phase pytorch_batched), and once more with
G5G_TORCH_PIPELINE=0 (each step waits for the last one's tokens: pytorch_batched_waiting), and with eager prompts
rather than CUDA graphs (G5G_TORCH_PREFILL_GRAPHS=0: pytorch_batched_eager_prompts, not in the default phases),
and with graphs captured with fused RMSNorms (G5G_TORCH_FUSED_NORMS=1: pytorch_batched_fused_norms, nor that);
the JAX server booted from its executable store (G5G_JAX_EXECUTABLE_STORE=1: jax_executable_store, nor that), the
PyTorch one from its compiled step kept whole (G5G_TORCH_PRECOMPILED=1: pytorch_batched_precompiled, nor that); and
the PyTorch engine in-process, engine.step time with and without the step dispatched ahead (profile_torch).

    python -m benchmarks.serving_speed OUTDIR [--runs 5] [--layers 35] [--tiny] [--ckpt DIR] [--only PHASES] [--boots 1|2]
Writes OUTDIR/serving_speed.json (every figure, with spread) and prints a summary.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

from benchmarks.harness import checkpoint, jax_trace, serve
from benchmarks.harness.results import Results
# the servers' flags and settings: benchmarks/t4g_model.py builds its engines with the same (served_settings), so the
# step it times is the step these servers serve
from benchmarks.harness.serve import BUCKETS, SERVER_FLAGS, SLOTS, served_settings


# ------------------------------------------------------------------------------------------- checkpoint
def make_checkpoint(ckpt: Path, layers: int, tiny: bool) -> None:
    """E2B-shaped random weights + a tokenizer over the whole vocabulary (extra ids decode to ' w<id>')."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    checkpoint.build(ckpt, checkpoint.text_config("e2b", layers, tiny))
    checkpoint.add_whole_vocab_tokenizer(ckpt)


def prompts(ckpt: Path) -> dict:
    """The chat prompts (text) the benches send, and their token counts as the servers will see them."""
    from serving.core.generation import TokenizerInfo
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
def bench(url: str, out: Path, name: str, *, requests_n: int, concurrency: int, max_tokens: int,
          prompt: str | None = None) -> dict:
    """`build.py bench` on the wire; returns its result with per-request TPOTs and their spread."""
    args = ["--mode", "both", "--requests", str(requests_n), "--concurrency", str(concurrency), "--max-tokens",
            str(max_tokens), "--ignore-eos", "--warmup", "1", "--timeout", "300", "--time-limit", "400"]
    r = serve.bench(url, out / f"{name}.json", *args, *(["--prompt", prompt] if prompt else []), quiet=True,
                    timeout=600)
    tpots = serve.tpots_ms(r)
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


def runtime_lines(output: str, keep: int = 40) -> list[str]:
    """The server's own log lines (boot phases, compiles, the ready line with its flags), not uvicorn's access log."""
    return [line for line in output.splitlines() if " serving" in line][-keep:]


def measure_server(runtime: str, ckpt: Path, work: Path, runs: int, p: dict, torch_slots: int = 1, boots: int = 2,
                   **extra: str) -> dict:
    from devtools.server import serving_env

    env = serving_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"), XLA_PYTHON_CLIENT_MEM_FRACTION="0.5",
                      **{**served_settings(work, torch_slots), **extra})
    # --max-queue-wait 0: the concurrent runs queue on a one-slot runtime by design (throughput, not latency)
    flags = (*SERVER_FLAGS, "--served-model-name", "e2b", "--max-waiting", "64", "--max-queue-wait", "0",
             "--log-level", "info")
    res: dict = {"log": {}}
    # the first boot compiles into an empty cache (JAX: the bucket ladder; PyTorch: the decode step): time it, then
    # boot from that cache, as a restarted pod with the chart's compile-cache volume does (boots=1: measure on the
    # cold-booted server, when GPU time is short)
    if boots == 2:
        with serve.served(runtime, ckpt, *flags, env=env, timeout=900) as srv:
            res["boot_cold_s"] = round(srv.ready_s, 1)
        res["log"]["cold"] = runtime_lines(srv.output)
    with serve.served(runtime, ckpt, *flags, env=env, timeout=900) as srv:
        res["boot_warm_s" if boots == 2 else "boot_cold_s"] = round(srv.ready_s, 1)
        url = srv.url
        r = requests.post(f"{url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": p["short"]["text"]}], "max_tokens": 48, "temperature": 0,
            "ignore_eos": True})
        res["greedy_48_text"] = r.json()["choices"][0]["message"]["content"]   # runtimes agree? (a sanity check)
        res["single_64"] = bench(url, work, f"{runtime}-single64", requests_n=runs, concurrency=1, max_tokens=64)
        res["single_256"] = bench(url, work, f"{runtime}-single256", requests_n=runs, concurrency=1, max_tokens=256)
        res["concurrent_8x256"] = bench(url, work, f"{runtime}-conc8", concurrency=SLOTS, max_tokens=256,
                                        requests_n=SLOTS * (2 if runtime == "jax" or torch_slots > 1 else 1))
        res["prefill_512"] = bench(url, work, f"{runtime}-prefill512", requests_n=runs, concurrency=1,
                                   max_tokens=1, prompt=p["long"]["text"])
    res["log"]["measured"] = runtime_lines(srv.output)
    return res


# ------------------------------------------------------------------------------------------------ peer
def measure_peer(ckpt: Path, runs: int, p: dict) -> dict:
    """transformers as a user runs it: `AutoModelForCausalLM.from_pretrained` on the same checkpoint, then
    `generate(cache_implementation="static")`, which compiles its own decode step where it can (a GPU). `path` says
    which it took."""
    import torch
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float16 if cuda else torch.float32)
    model.to("cuda" if cuda else "cpu").eval()
    res: dict = {"transformers": __import__("transformers").__version__, "torch": torch.__version__,
                 "model_class": type(model).__name__}

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
        # generate keeps the forward it compiled (get_compiled_call) on the model: none means it decoded eagerly
        res["path"] = "compiled decode (torch.compile)" if hasattr(model, "_compiled_call") else "eager"
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
def profile_torch(ckpt: Path, p: dict) -> dict:
    """The PyTorch engine in-process with SLOTS slots: wall time per engine.step with 1 and SLOTS live greedy
    sequences (in the first slots: the rows a step decodes, attention.rows()), waiting for each step's tokens (G5G_TORCH_PIPELINE=0) and with the next step dispatched ahead (=1),
    and how many steps ahead were used and thrown away."""
    import torch
    from serving.engine import SamplingParams
    from serving.torch_runtime import load
    from serving.torch_runtime.attention import rows

    eng = load(ckpt, max_context=1024, slots=SLOTS)
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)      # no row ends: every step has one ahead
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    res: dict = {}
    n = min(200, eng.max_context - len(p["short"]["ids"]) - 10)
    for piped in (False, True):
        eng.pipeline = piped
        for live in (1, SLOTS):
            toks = {s: eng.start(s, p["short"]["ids"], greedy) for s in range(live)}
            for _ in range(5):
                toks = eng.step(toks)
            sync()
            before = dict(eng.speculation)
            t0 = time.perf_counter()
            for _ in range(n):
                toks = eng.step(toks)
            res[f"{'pipelined' if piped else 'waiting'}_live{live}_engine_step_ms"] = \
                round((time.perf_counter() - t0) / n * 1000, 3)
            res[f"live{live}_rows_decoded"] = rows(list(toks), SLOTS)
            if piped:
                res[f"pipelined_live{live}_speculation"] = {k: v - before[k] for k, v in eng.speculation.items()}
    del eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def _trace_summary(path: Path, steps: int) -> dict:
    """Per device line of a jax.profiler trace: kernels per step, their busy time per step, the span covered,
    and the kernels that take the most time; and the host's events that take the most time per step (by name,
    over every thread, harness.jax_trace as t4g_model's host_events_ms: `command_buffer::update` is where a step
    updated its CUDA graphs)."""
    from jax.profiler import ProfileData

    out: dict = {}
    profile = ProfileData.from_file(str(path))
    for plane in profile.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            ev = [(e.name, e.start_ns, e.duration_ns) for e in line.events]
            if not ev:
                continue
            span = (max(s + d for _, s, d in ev) - min(s for _, s, _ in ev)) / 1e6
            by: dict = {}
            for name, _, d in ev:
                by[name] = by.get(name, 0.0) + d / 1e6
            top = sorted(by.items(), key=lambda kv: -kv[1])[:12]
            out[f"{plane.name} | {line.name}"] = {
                "events_per_step": round(len(ev) / steps, 1), "busy_ms_per_step": round(sum(by.values()) / steps, 3),
                "span_ms_per_step": round(span / steps, 3),
                "top_ms_per_step": {n[:90]: round(t / steps, 4) for n, t in top}}
    top_host = sorted(jax_trace.host_event_ms(profile).items(), key=lambda kv: -kv[1])[:20]
    # markers (no duration) and events under 0.05 us a step round to nothing: left out
    out["host_top_ms_per_step"] = {n[:90]: ms for n, t in top_host if (ms := round(t / steps, 4)) > 0}
    return out


def profile_jax(ckpt: Path, work: Path, p: dict, buckets: str = BUCKETS) -> dict:
    """Where decode time goes, in-process (settings from the environment: G5G_JAX_*, XLA_FLAGS): a whole
    engine.step with 1 and with SLOTS live sequences, the decode executable alone (inputs already on the device,
    no host work between calls: what the step would cost with no host gap), and a device trace of 20 single-stream
    steps (kernels per step, GPU busy time per step vs wall time per step)."""
    import dataclasses
    import glob

    import jax
    import numpy as np
    from serving.engine import SamplingParams
    from serving.jax_runtime import Settings, load
    from serving.jax_runtime.engine import parse_buckets

    settings = dataclasses.replace(Settings.from_env(), buckets=parse_buckets(buckets),
                                   cache_dir=str(work / "jaxcache"), slots=SLOTS)
    eng = load(ckpt, settings)
    res: dict = {"boot": eng.boot, "pipeline": eng.pipeline, "xla_flags": eng.boot["xla_flags"]}
    greedy = SamplingParams(temperature=0.0)
    n = 200
    for live in (1, SLOTS):
        toks = {s: eng.start(s, p["short"]["ids"], greedy) for s in range(live)}
        for _ in range(5):
            toks = eng.step(toks)
        t0 = time.perf_counter()
        for _ in range(n):
            toks = eng.step(toks)
        res[f"live{live}_engine_step_ms"] = round((time.perf_counter() - t0) / n * 1000, 3)
        if live == 1:
            tdir = work / f"trace_{os.getpid()}"
            with jax.profiler.trace(str(tdir)):
                for _ in range(20):
                    toks = eng.step(toks)
            try:
                res["trace_live1"] = _trace_summary(
                    Path(glob.glob(f"{tdir}/**/*.xplane.pb", recursive=True)[0]), 20)
            except Exception as e:          # the trace is a diagnostic: its failure must not lose the timings
                res["trace_live1"] = f"{type(e).__name__}: {e}"
    b = SLOTS
    c = next(x for x in eng.buckets if x > int(eng._pos[:b].max()))
    exe = eng._decode[b, c]
    put = jax.device_put
    args = [put(np.zeros(b, np.int32)), put(eng._pos[:b].copy()), eng._no_undo[b], put(np.zeros(b, np.float32)),
            put(np.zeros(b, np.int32)), put(np.ones(b, np.float32)), put(np.zeros((b, 2), np.uint32)),
            put(eng._empty_rows(b)), eng._all_allowed[b]]
    jax.block_until_ready(eng._spec.out if eng._spec else args)
    eng._spec = None
    for i in range(n + 5):
        if i == 5:
            jax.block_until_ready(out)
            t0 = time.perf_counter()
        out = exe(eng.params, eng._cache, eng._state, *args)
        eng._cache, eng._state = out[2], out[3]
    jax.block_until_ready(out)
    res[f"batch{b}_executable_ms"] = round((time.perf_counter() - t0) / n * 1000, 3)
    hlo = exe.as_text()
    res.update(capacity=c, hlo_fusions=hlo.count(" fusion("), hlo_custom_calls=hlo.count("custom-call("),
               hlo_conditionals=hlo.count(" conditional("), hlo_while_loops=hlo.count(" while("),
               speculation=dict(eng.speculation))
    res["device_weight_bytes"] = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(eng.params))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layers", type=int, default=35)
    ap.add_argument("--tiny", action="store_true", help="shrink the widths (smoke-run the script on CPU)")
    ap.add_argument("--only", default="peer,jax,profile,pytorch,pytorch_batched,pytorch_batched_waiting,profile_torch",
                    help="phases, in this order")
    ap.add_argument("--profile-buckets", default=BUCKETS, help="JAX length ladder of the profile (default: the "
                    "server's, whose executables the jax phase left in the persistent cache)")
    ap.add_argument("--ckpt", type=Path, help="reuse (or build here) the checkpoint in this directory")
    ap.add_argument("--boots", type=int, choices=(1, 2), default=2,
                    help="servers booted per runtime: 2 times a cold and a warm boot, 1 measures on the cold one")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="serving-speed-"))
    ckpt = args.ckpt or work / "ckpt"
    t0 = time.perf_counter()
    if not (ckpt / "config.json").exists():
        make_checkpoint(ckpt, args.layers, args.tiny)
    p = prompts(ckpt)
    import torch
    results = Results(out / "serving_speed.json")
    note = results.note
    note(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", layers=args.layers,
         runs=args.runs, jax_buckets=BUCKETS, slots=SLOTS, checkpoint_s=round(time.perf_counter() - t0, 1),
         prompt_tokens={k: v["tokens"] for k, v in p.items()},
         # what picks the kernels the servers run (t4g_model.py pairs its steps only with a run on sm_75's paths)
         paths_env={k: v for k, v in sorted(os.environ.items()) if k == "XLA_FLAGS" or k.startswith("G5G_PACKED_")})
    phases = {"peer": ("peer_transformers_static", lambda: measure_peer(ckpt, args.runs, p)),
              "jax": ("jax", lambda: measure_server("jax", ckpt, work, args.runs, p, boots=args.boots)),
              # ladders deserialised from the executable store (opt-in: serving/jax_runtime/executables.py): the
              # first boot traces (its cache shared with the jax phase) and stores, the measured one deserialises
              "jax_executable_store": ("jax_executable_store",
                                       lambda: measure_server("jax", ckpt, work, args.runs, p, boots=args.boots,
                                                              G5G_JAX_EXECUTABLE_STORE="1")),
              "profile": ("jax_profile", lambda: profile_jax(ckpt, work, p, args.profile_buckets)),
              "pytorch": ("pytorch", lambda: measure_server("pytorch", ckpt, work, args.runs, p, boots=args.boots)),
              "pytorch_batched": ("pytorch_batched",
                                  lambda: measure_server("pytorch", ckpt, work, args.runs, p, torch_slots=SLOTS,
                                                                 boots=args.boots)),
              # the same server waiting for each step's tokens before dispatching the next (the pipeline's baseline)
              "pytorch_batched_waiting": ("pytorch_batched_waiting",
                                          lambda: measure_server("pytorch", ckpt, work, args.runs, p, torch_slots=SLOTS,
                                                                 boots=args.boots, G5G_TORCH_PIPELINE="0")),
              # prompts run eagerly (the default replays them from CUDA graphs: serving/torch_runtime/prefill.py)
              "pytorch_batched_eager_prompts": ("pytorch_batched_eager_prompts",
                                                lambda: measure_server("pytorch", ckpt, work, args.runs, p,
                                                                       torch_slots=SLOTS, boots=args.boots,
                                                                       G5G_TORCH_PREFILL_GRAPHS="0")),
              # prompt graphs captured with fused RMSNorms (opt-in: serving/torch_runtime/norms.py)
              "pytorch_batched_fused_norms": ("pytorch_batched_fused_norms",
                                              lambda: measure_server("pytorch", ckpt, work, args.runs, p,
                                                                     torch_slots=SLOTS, boots=args.boots,
                                                                     G5G_TORCH_FUSED_NORMS="1")),
              # the compiled step kept whole, dynamo's trace too (opt-in: serving/torch_runtime/precompiled.py): the
              # first boot compiles it ahead of time and writes it, the measured one loads it and traces nothing
              "pytorch_batched_precompiled": ("pytorch_batched_precompiled",
                                              lambda: measure_server("pytorch", ckpt, work, args.runs, p,
                                                                     torch_slots=SLOTS, boots=args.boots,
                                                                     G5G_TORCH_PRECOMPILED="1")),
              "profile_torch": ("pytorch_profile", lambda: profile_torch(ckpt, p))}
    for phase in args.only.split(","):
        key, run = phases[phase]
        try:
            note(**{key: run()})
        except Exception as e:              # one phase failing must not lose the others' figures
            note(**{key: {"error": f"{type(e).__name__}: {e}"[-3000:]}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
