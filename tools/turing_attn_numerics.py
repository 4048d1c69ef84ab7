"""Numerics of the patched unified attention kernel with the Turing branch forced, against PyTorch SDPA.

Needs a CUDA GPU. vLLM's patched launcher runs as an sm_75 device with 64 KiB of opt-in shared memory would
(capability and the one device query replaced through tools/vllm_attn_probe.py's seam), so it picks the
narrowed tiles and one stage; the kernel then runs on the GPU at hand, two ways:
  jit   Triton's normal JIT for this GPU (same tiles/stages, this GPU's code generation);
  sm75  the kernel compiled for ("cuda", 75, 32) and loaded from its PTX, which the driver JIT-compiles
        for this GPU: Turing's code generation (mma.sync, no cp.async), run on newer silicon.
  sm80  for comparison, the launcher as on sm_80 (vLLM's own tiles and stages), this GPU's JIT.
Head sizes 256 and 512, prefill (2D) and decode (3D), with and without a sliding window, fp16.

    python tools/turing_attn_numerics.py --src PATCHED_VLLM_ROOT [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_attn_probe as probe  # noqa: E402

TURING_SMEM = 65536
DEVICE = "cuda"  # "cpu" with --modes dry: compile for sm_75 only, no launch (checks this script without a GPU)


def make_args(head_size: int, window: int, seqs: list[tuple[int, int]], seed: int) -> dict:
    """unified_attention arguments on the GPU for sequences [(query_len, seq_len), ...], random data."""
    g = torch.Generator().manual_seed(seed)
    dev = DEVICE
    bs, nq, nkv, segs = probe.BLOCK_SIZE, probe.NUM_QUERY_HEADS, probe.NUM_KV_HEADS, probe.NUM_SEGMENTS
    blocks = [-(-s // bs) for _, s in seqs]
    num_blocks = sum(blocks) + 8
    tokens = sum(q for q, _ in seqs)
    q = torch.randn(tokens, nq, head_size, generator=g).half().to(dev)
    kv = torch.randn(num_blocks, nkv, bs, 2 * head_size, generator=g).half().to(dev).transpose(1, 2)
    k, v = kv.split(head_size, dim=-1)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[at:at + n]
        at += n
    cu = torch.tensor([0] + [sum(q for q, _ in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    one = torch.ones((), dtype=torch.float32, device=dev)
    rows = max(tokens, 64)
    padded = triton.next_power_of_2(head_size)
    return dict(
        q=q, k=k, v=v, out=torch.full_like(q, float("nan")),
        cu_seqlens_q=cu.to(dev), max_seqlen_q=max(q for q, _ in seqs),
        seqused_k=torch.tensor([s for _, s in seqs], dtype=torch.int32, device=dev),
        max_seqlen_k=max(s for _, s in seqs), softmax_scale=head_size ** -0.5, causal=True,
        window_size=(window - 1, 0) if window else (-1, -1), block_table=table.to(dev), softcap=0,
        q_descale=None, k_descale=one.expand(len(seqs), nkv), v_descale=one.expand(len(seqs), nkv),
        seq_threshold_3D=64 // nkv, num_par_softmax_segments=segs,
        softmax_segm_output=torch.empty(rows, nq, segs, padded, device=dev),
        softmax_segm_max=torch.empty(rows, nq, segs, device=dev),
        softmax_segm_expsum=torch.empty(rows, nq, segs, device=dev),
    )


def reference(a: dict, seqs: list[tuple[int, int]], window: int, dtype=torch.float32) -> torch.Tensor:
    """SDPA (fp32 by default) over each sequence's keys gathered from the paged cache: causal, sliding window as vLLM masks."""
    bs = probe.BLOCK_SIZE
    rep = probe.NUM_QUERY_HEADS // probe.NUM_KV_HEADS
    outs = []
    for i, (ql, sl) in enumerate(seqs):
        blocks = a["block_table"][i, : -(-sl // bs)].long()
        k = a["k"][blocks].reshape(-1, probe.NUM_KV_HEADS, a["k"].shape[-1])[:sl].to(dtype)
        v = a["v"][blocks].reshape(-1, probe.NUM_KV_HEADS, a["v"].shape[-1])[:sl].to(dtype)
        start = int(a["cu_seqlens_q"][i])
        q = a["q"][start:start + ql].to(dtype)
        qpos = torch.arange(sl - ql, sl, device=q.device)[:, None]
        kpos = torch.arange(sl, device=q.device)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= (qpos - kpos) < window
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1),
            attn_mask=mask, scale=a["softmax_scale"])
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


class _Forward:
    """Stands in for kernel_unified_attention: records the launch, then runs it (JIT or sm_75 PTX)."""

    def __init__(self, fn, mode: str):
        self.fn, self.mode, self.launches = fn, mode, []

    def __getitem__(self, grid):
        def launch(**kw):
            self.launches.append(kw)
            if self.mode == "jit":
                return self.fn[grid](**kw)
            from triton.backends.compiler import GPUTarget

            target = GPUTarget("cuda", 75, 32)
            _, bound, src, options = probe.bind(self.fn, kw, target)
            ck = triton.compile(src, target=target, options=options.__dict__)
            ptx = ck.asm["ptx"]
            assert ".target sm_75" in ptx, "not an sm_75 compile"
            self.launches[-1] = dict(kw, _shared=ck.metadata.shared, _stages=ck.metadata.num_stages)
            if self.mode == "dry":
                return
            ck.kernel = ptx.encode() + b"\0"  # the driver JIT-compiles sm_75 PTX for this GPU
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            ck[grid3](*bound.values())
        return launch


def run_case(mod, head_size: int, window: int, prefill: bool, mode: str, seed: int) -> dict:
    seqs = [(300, 1200), (77, 77), (1, 650)] if prefill else [(1, 1200), (1, 700), (1, 33), (1, 2100)]
    a = make_args(head_size, window, seqs, seed)
    fwd = _Forward(mod.kernel_unified_attention, "jit" if mode == "sm80" else mode)
    real = mod.kernel_unified_attention
    mod.kernel_unified_attention = fwd
    mod.current_platform.capability = 80 if mode == "sm80" else 75  # sm80: the unpatched tiles, for comparison
    try:
        mod.unified_attention(**a)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    finally:
        mod.kernel_unified_attention = real
        mod.current_platform.capability = 75
    (kw,) = fwd.launches
    ref = reference(a, seqs, window)
    err = (a["out"].float() - ref).abs()
    sdpa16 = (reference(a, seqs, window, torch.float16).float() - ref).abs()
    return {"mode": mode, "path": "decode 3D" if kw["IS_3D"] else "prefill 2D", "head_size": head_size,
            "sliding_window": window, "tile": kw["TILE_SIZE"], "num_stages": kw.get("_stages", kw.get("num_stages")),
            "shared_sm75": kw.get("_shared"), "max_abs_err": float(err.max()), "mean_abs_err": float(err.mean()),
            "nan": bool(torch.isnan(a["out"]).any()), "max_abs_ref": float(ref.abs().max()),
            "sdpa_fp16_max_abs_err": float(sdpa16.max())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, required=True, help="patched vLLM source root")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--modes", default="jit,sm75,sm80",
                    help="jit: Turing tiles, this GPU's codegen; sm75: Turing tiles and codegen (PTX); "
                         "sm80: the launcher as on sm_80 (unpatched tiles), for comparison")
    a = ap.parse_args()
    global DEVICE
    if a.modes == "dry":
        DEVICE = "cpu"
    mod = probe.load(a.src, capability=75)  # the Turing branch, forced
    mod._device_shared_mem_optin = lambda device_index: TURING_SMEM
    env = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else None, "torch": torch.__version__, "triton": triton.__version__}
    print(json.dumps(env), flush=True)
    results = []
    for mode in a.modes.split(","):
        for head in (256, 512):
            for prefill in (True, False):
                for window in (0, 512):
                    t = time.time()
                    try:
                        r = run_case(mod, head, window, prefill, mode, seed=head + window + prefill)
                    except Exception as e:  # report and go on: one broken mode must not hide the others
                        r = {"mode": mode, "head_size": head, "sliding_window": window,
                             "path": "prefill 2D" if prefill else "decode 3D", "error": f"{type(e).__name__}: {e}"}
                    r["seconds"] = round(time.time() - t, 1)
                    print(json.dumps(r), flush=True)
                    results.append(r)
    if a.json:
        a.json.write_text(json.dumps({"env": env, "results": results}, indent=2))
    bad = [r for r in results if "error" in r or r["nan"] or r["max_abs_err"] > 2e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
