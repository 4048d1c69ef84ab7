"""16-bit vs weight-only int8 / int4 (compressed-tensors, tools/quantize.py) on a GPU, at Gemma 4 E2B and E4B text
shapes with random weights (no download), beside transformers.

    python -m benchmarks.quantized_decode OUT_DIR [--phase kernels|models] [--shapes e2b,e4b] [--tiny]

kernels: every distinct packed linear of the shapes, 1 and 8 rows. PyTorch: cuBLAS fp16 (F.linear) against
  serving/torch_runtime/packed_matmul.py's GEMV (its own config for this GPU, a T4G's grid, and the GEMV_SWEEP around it) and
  its dot kernel (KERNEL_CONFIG); the device's copy bandwidth first, each kernel's packed GB/s as a share of it;
  JAX (unless --kernel-runtimes torch): an fp16 dot against model.matmul on Packed int8/int4, as a dot and as the
  multiply-reduce (G5G_JAX_PACKED_DOT), each as a ratio to the fp16 dot (vs_fp16) and a share of JAX's own copy
  bandwidth; run it with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false for sm_75's cuBLAS dots; --kernel-runtimes jax
  --tiny runs it on a CPU. Time per matmul
  over enough distinct weights to overflow L2 (so the bytes come from HBM), PyTorch
  replayed from a CUDA graph (kernel time, launch excluded); effective GB/s of the bytes a matmul must read; the
  largest error against the dequantised weight.
models: per shape, a random fp16 checkpoint, quantised to w8a16 and w4a16; per checkpoint, in a child process
  per runtime: GPU memory held after load against serving/memory_plan.py's plan, and engine decode tokens/s with
  1 and 8 live sequences (greedy, no HTTP). Peer: transformers generate() with a static cache, fp16 and
  transformers' own compressed-tensors path on the quantised checkpoints (run_compressed).
Each result lands in OUT_DIR/quantized_decode.json as it is measured.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

# JAX takes 75% of the GPU at its first array unless told otherwise: the kernel phase runs in this process, and the
# models phase builds checkpoints here with torch (the H200 run of 2026-12-01 lost E4B to exactly that).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from benchmarks.harness import checkpoint, children  # noqa: E402
from benchmarks.harness.results import Results  # noqa: E402
from serving import memory_plan  # noqa: E402

SCHEMES = ("fp16", "w8a16", "w4a16")
TOP_SHAPES = 5
GEMV_SWEEP = [(8, 256), (16, 128), (16, 512), (32, 256)]     # (BLOCK_N, BLOCK_KB), split: 3 ways
L2_BYTES = 256 << 20            # weights cycled per timing: well beyond any GPU's L2 (H200: 50 MB) ...
MAX_COPIES = 64                 # ... up to this many (the smallest weights then partly stay in L2: noted per row)


def linear_shapes(shape: str, tiny: bool) -> dict[tuple[int, int], int]:
    """{(out, in): count} of the packed linears."""
    counts: dict = {}
    raw = {"text_config": checkpoint.text_config(shape, tiny=tiny)}
    for name, s in memory_plan.text_tensors(raw).items():
        if memory_plan.quantisable(name, s, "w4a16"):
            counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------- kernels
def _copies(nbytes: int) -> int:
    return min(MAX_COPIES, max(4, -(-L2_BYTES // max(1, nbytes))))


def copy_bandwidth() -> float:
    """The device's copy bandwidth, bytes read + written per second (a 2 GiB device-to-device copy)."""
    import torch
    a = torch.empty(1 << 30, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() * 2 / statistics.median(times)


def kernels_torch(n: int, k: int, rows: int, copy_bw: float) -> dict:
    import torch

    from serving.torch_runtime import packed_matmul
    from tools import quantize
    from serving.torch_runtime.packed_matmul import PackedLinear, gemv, packed_mm

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(n, k, device=dev, generator=gen) / k ** 0.5
    x = torch.randn(rows, k, device=dev, dtype=torch.float16)
    res: dict = {}

    def timed(fn, copies: int) -> float:
        fn(0)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(copies):
                fn(i)
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / copies)
        return statistics.median(times)

    w16 = w.half()
    c = _copies(w16.numel() * 2)
    ws = [w16.clone() for _ in range(c)]
    us = timed(lambda i: torch.nn.functional.linear(x, ws[i]), c)
    res["fp16"] = {"us": round(us, 2), "GB_s": round(w16.numel() * 2 / us / 1e3, 1),
                   "set_MB": c * w16.numel() * 2 >> 20,
                   "of_copy_bw": round(w16.numel() * 2 / us / 1e-6 / copy_bw, 3)}
    for scheme in ("w8a16", "w4a16"):
        args = quantize.scheme_args(scheme, None)
        p = quantize.pack(w.float().cpu(), args)
        layer = PackedLinear(p["weight_packed"], p["weight_scale"], k, args.num_bits, torch.float16).to(dev)
        ref = x.float() @ layer.dequantised(torch.float32).T
        nbytes = layer.packed.numel() + layer.scale.numel() * 2
        c = _copies(nbytes)
        packs = [(layer.packed.clone(), layer.scale.clone()) for _ in range(c)]
        group = 0 if layer.scale.shape[1] == 1 else k // layer.scale.shape[1]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        here = packed_matmul.gemv_config(n, k, args.num_bits, group, sms)
        t4g = packed_matmul.gemv_config(n, k, args.num_bits, group, 40)
        cands = {"gemv": ("gemv", here), "gemv_t4g_grid": ("gemv", t4g),
                 "dot": ("dot", packed_matmul.KERNEL_CONFIG[args.num_bits])}
        for bn, kb in GEMV_SWEEP:
            if group and kb < group * args.num_bits // 8:
                continue
            for split in {max(1, here[2] // 2), here[2], 2 * here[2]}:
                cands[f"gemv{(bn, kb, split)}"] = ("gemv", (bn, kb, split, 4))
        per = {}
        for name, (kind, cfg) in cands.items():
            try:
                fn = ((lambda xx, w, s, cfg=cfg: gemv(xx, w, s, args.num_bits, config=cfg)) if kind == "gemv"
                      else (lambda xx, w, s, cfg=cfg: packed_mm(xx, w, s, args.num_bits, config=cfg)))
                y = fn(x, layer.packed, layer.scale)
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                us = timed(lambda i, fn=fn: fn(x, *packs[i]), c)
                per[name] = {"config": cfg, "us": round(us, 2), "GB_s": round(nbytes / us / 1e3, 1),
                             "of_copy_bw": round(nbytes / us / 1e-6 / copy_bw, 3), "rel_err": round(err, 5)}
            except Exception as e:          # a config the shape does not take: recorded, not fatal
                per[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        best = min((v["us"], kk) for kk, v in per.items() if "us" in v)
        res[scheme] = {"configs": per, "best": best[1], "us": best[0], "vs_fp16": round(res["fp16"]["us"] / best[0], 2),
                       "default_of_copy_bw": per["gemv"].get("of_copy_bw"), "bytes": nbytes}
    return res


def copy_bandwidth_jax(nbytes: int) -> float:
    """JAX's copy bandwidth on its default device, bytes read + written per second (an elementwise pass over
    nbytes of float16: the bandwidth a memory-bound fusion gets)."""
    import jax
    import jax.numpy as jnp
    a = jnp.zeros(nbytes // 2, jnp.float16)
    f = jax.jit(lambda a: a + jnp.float16(1))
    f(a).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def reduce_tiled(x, w, tile: int = 32):
    """model.matmul's multiply-reduce with another layout, for comparison: rows between tiles of `tile` outputs
    ([K, out/tile, rows, tile]: the threads of a row of K read `tile` neighbouring bytes of one row each) where
    the model puts rows minor ([K, out, rows])."""
    import jax.numpy as jnp
    from serving.jax_runtime import model
    f32 = jnp.float32
    k, out = w.q.shape
    groups = w.scale.shape[0]
    q = w.q.astype(f32)
    if groups > 1:
        q = (q.reshape(groups, -1, out) * w.scale.astype(f32)[:, None, :]).reshape(k, out)
    parts = model._k_parts(k)
    xr = x.astype(f32).T
    sums = jnp.sum(q.reshape(parts, k // parts, out // tile, 1, tile) * xr.reshape(parts, k // parts, 1, -1, 1), 1)
    y = sums[0]
    for i in range(1, parts):
        y = y + sums[i]
    y = y.transpose(1, 0, 2).reshape(-1, out)
    if groups == 1:
        y = y * w.scale[0].astype(f32)
    return y.astype(x.dtype)


def kernels_jax(n: int, k: int, rows: int, copy_bw: float) -> dict:
    """fp16 dot against each packed path of model.matmul, in one process (so under the same XLA_FLAGS: with
    --xla_gpu_enable_triton_gemm=false every dot is a cuBLAS call, as on sm_75): "dot" (today's: on cuBLAS a
    dequantised copy first), "reduce" (the multiply-reduce G5G_JAX_PACKED_DOT=reduce runs) and "reduce_tiled"
    (reduce_tiled's layout). Each copy of a weight gets its own rows, so XLA cannot merge the timed dots into one."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    import torch

    from serving import quantized
    from serving.jax_runtime.engine import PACKED_REDUCE_ROWS
    from serving.jax_runtime.model import Packed, matmul, with_reduce_rows
    from tools import quantize

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, k), np.float32) / k ** 0.5)
    x = jnp.asarray(rng.standard_normal((rows, k), np.float32), jnp.float16)
    res: dict = {}

    def grouped_after(x, w):    # the alternative to model.matmul for groups: scale each group's partial product
        groups, out = w.scale.shape
        part = jnp.einsum("tgk,gko->tgo", x.reshape(x.shape[0], groups, -1),
                          w.q.astype(x.dtype).reshape(groups, -1, out), preferred_element_type=jnp.float32)
        return (part * w.scale.astype(jnp.float32)[None]).sum(1).astype(x.dtype)

    def timed(weights, mm=matmul) -> float:
        xs = jnp.stack([x * (1 + i / 1024) for i in range(len(weights))])
        f = jax.jit(lambda xs, ws: sum(mm(xs[i], wi).astype(jnp.float32) for i, wi in enumerate(ws)))
        f(xs, weights).block_until_ready()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            f(xs, weights).block_until_ready()
            times.append((time.perf_counter() - t0) * 1e6 / len(weights))
        return statistics.median(times)

    def row(us: float, nbytes: int, fp16_us: float | None = None) -> dict:
        out = {"us": round(us, 2), "GB_s": round(nbytes / us / 1e3, 1),
               "of_copy_bw": round(nbytes / us / 1e-6 / copy_bw, 3)}
        return out if fp16_us is None else {**out, "vs_fp16": round(fp16_us / us, 2)}

    w16 = jnp.asarray(w.T, jnp.float16)
    c = _copies(n * k * 2)
    fp16_us = timed([w16 + 0 for _ in range(c)])
    res["fp16"] = row(fp16_us, n * k * 2)
    for scheme in ("w8a16", "w4a16"):
        args = quantize.scheme_args(scheme, None)
        p = quantize.pack(torch.from_numpy(w), args)
        q = quantized.unpack(p["weight_packed"].numpy(), p["weight_shape"].numpy(), args.num_bits).T
        q = q.astype(ml_dtypes.int4) if args.num_bits == 4 else q
        scale = p["weight_scale"].numpy().T.astype(np.float16)
        packed = Packed(jnp.asarray(np.ascontiguousarray(q)), jnp.asarray(np.ascontiguousarray(scale)))
        ref = np.asarray(x, np.float32) @ quantized.dequantise(p["weight_packed"].numpy(), p["weight_scale"].numpy(),
                                                               p["weight_shape"].numpy(), args.num_bits).T
        nbytes = n * k * args.num_bits // 8 + scale.size * 2
        c = _copies(nbytes)
        copies = [Packed(jnp.array(packed.q), packed.scale + 0) for _ in range(c)]
        paths = {"dot": (0, matmul), "reduce": (PACKED_REDUCE_ROWS, matmul)}
        if n % 32 == 0:
            paths["reduce_tiled"] = (0, reduce_tiled)
        if args.num_bits == 4:
            paths["grouped_after"] = (0, grouped_after)
        res[scheme] = {"bytes": nbytes}
        for name, (reduce_rows, mm) in paths.items():
            y = np.asarray(jax.jit(mm)(x, with_reduce_rows(packed, reduce_rows)), np.float32)
            us = timed([with_reduce_rows(cp, reduce_rows) for cp in copies], mm)
            res[scheme][name] = {**row(us, nbytes, fp16_us),
                                 "rel_err": round(float(np.abs(y - ref).max() / np.abs(ref).max()), 5)}
    return res


def run_kernels(note: Callable[..., None], shapes: list[str], tiny: bool, runtimes: list[str]) -> None:
    if "torch" in runtimes:
        copy_bw = copy_bandwidth()
        note(**{"kernels.copy_bandwidth_GB_s": round(copy_bw / 1e9, 1)})
    if "jax" in runtimes:
        import jax
        from serving.jax_runtime import engine
        jax_bw = copy_bandwidth_jax((64 if tiny else 1024) << 20)
        cap = engine._gpu_capability()
        flags = os.environ.get("XLA_FLAGS", "")
        note(**{"kernels.jax": {"copy_bandwidth_GB_s": round(jax_bw / 1e9, 1), "backend": jax.default_backend(),
                                     "device": str(jax.devices()[0].device_kind), "xla_flags": flags,
                                     "packed_dot_auto": engine.Settings().resolve_packed_dot(cap, flags)}})
    seen = set()
    for shape in shapes:      # the shapes that carry most of a token's packed bytes (each model's top TOP_SHAPES)
        ranked = sorted(linear_shapes(shape, tiny).items(), key=lambda kv: -kv[1] * kv[0][0] * kv[0][1])
        for (n, k), count in ranked[:TOP_SHAPES]:
            if (n, k) in seen:
                continue
            seen.add((n, k))
            for rows in (1, 8):
                key = f"{n}x{k}/rows{rows}"
                if "torch" in runtimes:
                    note(**{f"kernels.torch.{key}": kernels_torch(n, k, rows, copy_bw)})
                if "jax" in runtimes:
                    note(**{f"kernels.jax.{key}": kernels_jax(n, k, rows, jax_bw)})


# ------------------------------------------------------------------------------------------------ models
def build_checkpoint(ckpt: Path, shape: str, tiny: bool) -> None:
    """A random fp16 checkpoint of `shape` (benchmarks/harness/checkpoint.py)."""
    checkpoint.build(ckpt, checkpoint.text_config(shape, tiny=tiny))


def measure_engine(runtime: str, ckpt: Path, steps: int) -> dict:
    """In this (child) process: load, memory held against the plan, decode tokens/s with 1 and 8 live rows."""
    import numpy as np

    from serving.engine import SamplingParams
    slots, context = 8, 1024
    plan = memory_plan.plan_checkpoint(ckpt, None, context, slots, text_only=True)
    t0 = time.perf_counter()
    if runtime == "pytorch":
        import torch
        from serving.torch_runtime import load
        engine = load(ckpt, max_context=context, slots=slots)
        gpu = torch.cuda.is_available()
        held, peak = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()) if gpu else (None, None)
    else:
        import jax
        from serving.jax_runtime import Settings, load
        engine = load(ckpt, Settings(buckets=(64, context), cache_dir=None, slots=slots, batches=(1, slots),
                                     packed_dot=Settings.from_env().packed_dot))     # G5G_JAX_PACKED_DOT
        stats = jax.devices()[0].memory_stats() or {}
        held, peak = stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")
    # the plan the runtime refuses on (JAX: rings, and the LM head's copy that XLA's GEMM autotuning holds at boot)
    own = memory_plan.plan_checkpoint(ckpt, None, context, slots, text_only=True, rings=True,
                                      **({"attention": True} if runtime == "pytorch" else {"autotuned": True}))
    res = {"load_s": round(time.perf_counter() - t0, 1), "held_bytes": held, "peak_bytes": peak,
           **({"packed_dot": engine.boot["packed_dot"]} if runtime == "jax" else {}),
           "plan_weights_bytes": plan.weights, "plan_kv_bytes": plan.kv, "plan_weights_plus_kv": plan.weights + plan.kv,
           "runtime_plan_total_bytes": own.total, "runtime_plan_tuning_bytes": own.tuning}
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    prompt = [2] + list(range(100, 131))
    for live in (1, slots):
        rates = []
        for _ in range(3):
            toks = {s: engine.start(s, prompt, greedy) for s in range(live)}
            toks = engine.step(toks)                            # the first step may carry one-off work
            t0 = time.perf_counter()
            for _ in range(steps):
                toks = engine.step(toks)
            rates.append(steps / (time.perf_counter() - t0))
        res[f"decode_tok_s_{live}"] = round(statistics.median(rates), 1)
        res[f"aggregate_tok_s_{live}"] = round(live * statistics.median(rates), 1)
    res["first_tokens"] = [int(t) for t in np.asarray(list(toks.values()))[:4]]
    return res


def measure_peer(ckpt: Path, steps: int) -> dict:
    """transformers generate(cache_implementation="static") on Gemma4ForCausalLM as transformers loads the
    directory: fp16, or for a compressed-tensors one its own integration (compressed linears)."""
    import torch
    from transformers import AutoConfig, Gemma4ForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    text = getattr(config, "text_config", config)
    if getattr(config, "quantization_config", None):
        text.quantization_config = config.quantization_config
    t0 = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = Gemma4ForCausalLM.from_pretrained(ckpt, config=text, dtype=torch.float16 if dev == "cuda" else None,
                                              key_mapping={"^model.language_model.": "model."}).to(dev).eval()
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    res = {"load_s": round(time.perf_counter() - t0, 1),
           "held_bytes": torch.cuda.memory_allocated() if dev == "cuda" else None,
           "linear_types": sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__})}
    ids = torch.tensor([[2] + list(range(100, 131))], device=dev)
    for batch in (1, 8):
        x = ids.repeat(batch, 1)

        def timed(n: int) -> float:
            sync()
            t = time.perf_counter()
            with torch.inference_mode():
                model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               cache_implementation="static", eos_token_id=None, pad_token_id=0)
            sync()
            return time.perf_counter() - t

        timed(steps)
        rates = [(steps - 1) / (timed(steps) - timed(1)) for _ in range(2)]
        res[f"decode_tok_s_{batch}"] = round(statistics.median(rates), 1)
        res[f"aggregate_tok_s_{batch}"] = round(batch * statistics.median(rates), 1)
    return res


def child(kind: str, ckpt: Path, steps: int, timeout: int, work: Path) -> dict:
    """One measurement in its own process (each runtime owns the GPU's memory while it runs)."""
    argv = children.module_argv(__spec__.name, "--child", kind, str(ckpt), "--steps", str(steps),
                                "--result", str(work / f"{kind}-child.json"))
    return children.run_child(argv, work / f"{kind}-child.json", timeout=timeout, tail=1500,
                              env=children.child_env(XLA_PYTHON_CLIENT_PREALLOCATE="false")).record()


def run_models(note: Callable[..., None], shapes: list[str], tiny: bool, steps: int, work: Path, peer: bool) -> None:
    from tools import quantize

    for shape in shapes:
        src = work / f"{shape}-fp16"
        t0 = time.perf_counter()
        if not (src / "config.json").exists():
            build_checkpoint(src, shape, tiny)
        note(**{f"models.{shape}.build_s": round(time.perf_counter() - t0, 1)})
        dirs = {"fp16": src}
        for scheme in SCHEMES[1:]:
            dirs[scheme] = work / f"{shape}-{scheme}"
            if not (dirs[scheme] / "config.json").exists():
                t0 = time.perf_counter()
                quantize.quantize(src, dirs[scheme], scheme, log=lambda *_: None, device=_device())
                note(**{f"models.{shape}.{scheme}.quantize_s": round(time.perf_counter() - t0, 1)})
        for scheme, d in dirs.items():
            p = memory_plan.plan_checkpoint(d, None, 1024, 8, text_only=True)
            note(**{f"models.{shape}.{scheme}.plan": {"weights_bytes": p.weights,
                                                          "streamed_per_token_bytes": p.streamed_per_token}})
        for kind in ("pytorch", "jax") + (("peer",) if peer else ()):
            for scheme, d in dirs.items():
                note(**{f"models.{shape}.{scheme}.{kind}": child(kind, d, steps, 420, work)})
        for d in dirs.values():             # the next shape's checkpoints need the disk
            shutil.rmtree(d)


def _device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--phase", choices=("kernels", "models"), action="append")
    ap.add_argument("--shapes", default="e2b,e4b")
    ap.add_argument("--kernel-runtimes", default="torch,jax")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qdecode"))
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny widths: a CPU run of the code paths")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "CKPT"))
    ap.add_argument("--result", type=Path, help="(a child) where its figures go")
    a = ap.parse_args()
    if a.child:
        kind, ckpt = a.child[0], Path(a.child[1])
        children.write_result(a.result, measure_peer(ckpt, a.steps) if kind == "peer"
                              else measure_engine(kind, ckpt, a.steps))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    note = Results(a.out / "quantized_decode.json", echo=3000).note
    a.work.mkdir(parents=True, exist_ok=True)
    shapes = a.shapes.split(",")
    note(started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), shapes=shapes)
    for phase in a.phase or ("kernels", "models"):
        if phase == "kernels":
            run_kernels(note, shapes, a.tiny, a.kernel_runtimes.split(","))
        else:
            run_models(note, shapes, a.tiny, a.steps, a.work, not a.no_peer)
    note(finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
