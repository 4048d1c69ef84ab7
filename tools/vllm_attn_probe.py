"""vLLM's Triton unified-attention kernel, driven and compiled without a GPU and without the rest of vLLM.

The kernel, its @triton.jit helpers and the Python launcher are vLLM's own code, loaded from an
unpacked vLLM source tree and run as they are. What the module imports from the rest of vLLM
(platform, envs, logger, KVQuantMode) is replaced by a small explicit seam: the launcher runs with
the compute capability we choose, its launches are recorded instead of sent to a GPU, and each
recorded launch is compiled with Triton for any target, e.g. ("cuda", 75, 32), to read the
shared memory it needs.

    python tools/vllm_attn_probe.py --unpatched DIR --patched DIR [--smem-limit 65536]

prints one JSON document (see `probe`). Run by `python build.py patches verify` in a subprocess:
the driver (g5g/) never imports torch or triton.
"""
from __future__ import annotations

import ast
import importlib.util
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import torch
import triton
import triton.language as tl
from vllm_stubs import VllmLogger, stub_module

KERNEL_FILE = "vllm/v1/attention/ops/triton_unified_attention.py"
HELPERS_FILE = "vllm/v1/attention/ops/triton_attention_helpers.py"
MODULE_NAME = "vllm.v1.attention.ops.triton_unified_attention"


class Platform:
    """The slice of vllm.platforms.current_platform the attention module uses."""

    def __init__(self, capability: int):
        self.capability = capability  # e.g. 75, 80

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0):
        return divmod(self.capability, 10)

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        if isinstance(capability, tuple):
            capability = capability[0] * 10 + capability[1]
        return self.capability >= capability

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        if isinstance(capability, tuple):
            capability = capability[0] * 10 + capability[1]
        return self.capability == capability

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        return self.capability // 10 == capability // 10

    def fp8_dtype(self):
        return torch.float8_e4m3fn


def _kv_quant_mode_enum(src_root: Path) -> type:
    """Exec only `class KVQuantMode` from vllm/v1/kv_cache_interface.py (the module itself is heavy)."""
    path = src_root / "vllm/v1/kv_cache_interface.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KVQuantMode")
    ns: dict = {}
    exec("from enum import IntEnum", ns)
    exec(compile(ast.Module(body=[cls], type_ignores=[]), str(path), "exec"), ns)
    return ns["KVQuantMode"]


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@contextmanager
def _vllm_seam(src_root: Path, platform: Platform):
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for k in saved:
        del sys.modules[k]
    shims = {
        "vllm": stub_module("vllm"),
        "vllm.envs": stub_module("vllm.envs", VLLM_BATCH_INVARIANT=False, VLLM_TRITON_FORCE_FIRST_CONFIG=False),
        "vllm.logger": stub_module("vllm.logger", init_logger=VllmLogger),
        "vllm.platforms": stub_module("vllm.platforms", current_platform=platform),
        "vllm.triton_utils": stub_module("vllm.triton_utils", tl=tl, triton=triton),
        "vllm.v1": stub_module("vllm.v1"),
        "vllm.v1.attention": stub_module("vllm.v1.attention"),
        "vllm.v1.attention.ops": stub_module("vllm.v1.attention.ops"),
        "vllm.v1.kv_cache_interface": stub_module("vllm.v1.kv_cache_interface",
                                              KVQuantMode=_kv_quant_mode_enum(src_root)),
    }
    sys.modules.update(shims)
    try:
        yield
    finally:
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def load(src_root: Path, capability: int = 75) -> types.ModuleType:
    """vLLM's triton_unified_attention module from `src_root` (an unpacked sdist), with a seam platform.

    Set `module.current_platform.capability` to drive the launcher as another GPU would.
    """
    src_root = Path(src_root)
    platform = Platform(capability)
    with _vllm_seam(src_root, platform):
        _load_file("vllm.v1.attention.ops.triton_attention_helpers", src_root / HELPERS_FILE)
        mod = _load_file(MODULE_NAME, src_root / KERNEL_FILE)
    return mod


# --- Gemma 4's attention launches ---------------------------------------------------------------------------------

# Gemma 4: sliding layers head_dim 256 (window 512 in E2B/E4B, 1024 in the larger models, which
# takes vLLM's Gemma 3 tile path), full layers head_dim 512; 8 query heads per KV head (BLOCK_M 16).
SCENARIOS = (  # (head_size, sliding_window or 0)
    (256, 512),
    (256, 1024),
    (512, 0),
)
NUM_QUERY_HEADS, NUM_KV_HEADS, BLOCK_SIZE, NUM_SEGMENTS = 8, 1, 16, 16


def attention_args(head_size: int, window: int, prefill: bool, device="cpu", seq_len: int = 100,
                   query_len: int = 32, num_seqs: int = 4, dtype=torch.float16, seed: int | None = None,
                   num_blocks: int = 64) -> dict:
    """Arguments for vLLM's `unified_attention` shaped the way vLLM's TRITON_ATTN backend passes them.

    prefill: one sequence with `query_len` new tokens (2D kernel); else `num_seqs` decode steps of one
    token (3D split-K kernel). The KV cache is vLLM's (blocks, block_size, kv_heads, 2*head) layout
    split into K and V views. With `seed`, tensors hold random data and each sequence gets its own
    shuffled blocks; otherwise they are left uninitialised (enough to compile).
    """
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    nseq = 1 if prefill else num_seqs
    tokens = query_len if prefill else num_seqs
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = max(num_blocks, nseq * blocks_per_seq)

    def tensor(*shape, dt=dtype):
        if g is None:
            return torch.empty(*shape, dtype=dt, device=device)
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(dt).to(device)

    q = tensor(tokens, NUM_QUERY_HEADS, head_size)
    kv = tensor(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * head_size).transpose(1, 2)
    k, v = kv.split(head_size, dim=-1)
    if g is None:
        block_table = torch.zeros(nseq, blocks_per_seq, dtype=torch.int32)
    else:
        block_table = torch.randperm(num_blocks, generator=g)[: nseq * blocks_per_seq].view(nseq, -1).int()
    if prefill:
        cu_seqlens_q = torch.tensor([0, query_len], dtype=torch.int32)
    else:
        cu_seqlens_q = torch.arange(nseq + 1, dtype=torch.int32)
    seqused_k = torch.full((nseq,), seq_len, dtype=torch.int32)
    scale_one = torch.ones((), dtype=torch.float32, device=device)
    padded = triton.next_power_of_2(head_size)
    rows = max(tokens, 64)
    return dict(
        q=q, k=k, v=v, out=torch.empty_like(q),
        cu_seqlens_q=cu_seqlens_q.to(device), max_seqlen_q=query_len if prefill else 1,
        seqused_k=seqused_k.to(device), max_seqlen_k=seq_len,
        softmax_scale=head_size ** -0.5, causal=True,
        window_size=(window - 1, 0) if window else (-1, -1),
        block_table=block_table.to(device), softcap=0,
        q_descale=None, k_descale=scale_one.expand(nseq, NUM_KV_HEADS),
        v_descale=scale_one.expand(nseq, NUM_KV_HEADS),
        seq_threshold_3D=64 // NUM_KV_HEADS, num_par_softmax_segments=NUM_SEGMENTS,
        softmax_segm_output=torch.empty(rows, NUM_QUERY_HEADS, NUM_SEGMENTS, padded, device=device),
        softmax_segm_max=torch.empty(rows, NUM_QUERY_HEADS, NUM_SEGMENTS, device=device),
        softmax_segm_expsum=torch.empty(rows, NUM_QUERY_HEADS, NUM_SEGMENTS, device=device),
    )


class _Recorder:
    def __init__(self):
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda **kwargs: self.launches.append((grid, kwargs))


def record_launch(mod, args: dict, capability: int, smem_limit: int) -> tuple[tuple, dict]:
    """Run vLLM's launcher as a GPU of `capability` with `smem_limit` bytes of opt-in shared memory would,
    and return the (grid, kwargs) it launches `kernel_unified_attention` with."""
    rec = _Recorder()
    saved = mod.kernel_unified_attention, mod.reduce_segments, mod.current_platform.capability
    mod.kernel_unified_attention, mod.reduce_segments = rec, _Recorder()
    mod.current_platform.capability = capability
    optin = getattr(mod, "_device_shared_mem_optin", None)
    if optin is not None:  # the patch's one GPU query
        mod._device_shared_mem_optin = lambda device_index: smem_limit
    try:
        mod.unified_attention(**args)
    finally:
        mod.kernel_unified_attention, mod.reduce_segments, mod.current_platform.capability = saved
        if optin is not None:
            mod._device_shared_mem_optin = optin
    (launch,) = rec.launches
    return launch


def bind(fn, kwargs: dict, target):
    """Triton's own binding of launch kwargs for `target`: (backend, bound_args, ASTSource, options)."""
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    kwargs = dict(kwargs, debug=False)
    if hasattr(knobs.compilation, "instrumentation_mode"):  # Triton >= 3.7 passes it with every launch
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return backend, bound_args, ASTSource(fn, signature, constexprs, attrs), options


def compile_launch(fn, kwargs: dict, capability: int = 75):
    """Compile one recorded launch for ("cuda", capability, 32) with no GPU; returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", capability, 32)
    _, _, src, options = bind(fn, kwargs, target)
    return triton.compile(src, target=target, options=options.__dict__)


def _launch_config(kwargs: dict) -> dict:
    """The launch's scalar configuration: every non-tensor argument (constexprs, strides, options)."""
    return {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}


def probe(unpatched: Path, patched: Path, smem_limit: int = 65536, capability: int = 75,
          reference_capability: int = 80) -> dict:
    """Record and compile every Gemma 4 launch, unpatched and patched.

    Per launch: tiles and stages chosen, the compiled kernel's shared memory for `capability` (and the
    patch's own estimate where it has one), whether it fits `smem_limit`, the next-wider tile's figure
    where the patch narrowed one, and whether the launch on `reference_capability` is unchanged.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    ref_backend = make_backend(GPUTarget("cuda", reference_capability, 32))
    mods = {"unpatched": load(unpatched, capability), "patched": load(patched, capability)}
    fn = {name: m.kernel_unified_attention for name, m in mods.items()}
    rows = []
    for head_size, window in SCENARIOS:
        for prefill in (True, False):
            args = attention_args(head_size, window, prefill)
            row: dict = {"path": "prefill 2D" if prefill else "decode 3D", "head_size": head_size,
                         "sliding_window": window, "dtype": "float16"}
            for name, mod in mods.items():
                _, kw = record_launch(mod, args, capability, smem_limit)
                ck = compile_launch(fn[name], kw, capability)
                entry = {"tile": kw["TILE_SIZE"], "num_stages": ck.metadata.num_stages,
                         "num_warps": ck.metadata.num_warps, "block_m": kw["BLOCK_M"],
                         "is_3d": kw["IS_3D"], "shared": ck.metadata.shared,
                         "fits": ck.metadata.shared <= smem_limit}
                rule = getattr(mod, "_pre_ampere_shared_mem_bytes", None)
                if rule is not None:
                    entry["estimate"] = rule(kw["TILE_SIZE"], kw["HEAD_SIZE_PADDED"], kw["BLOCK_M"])
                row[name] = entry
            if row["patched"]["tile"] < row["unpatched"]["tile"]:
                _, kw = record_launch(mods["patched"], args, capability, smem_limit)
                wider = compile_launch(fn["patched"], dict(kw, TILE_SIZE=2 * kw["TILE_SIZE"]), capability)
                row["patched"]["wider_tile_shared"] = wider.metadata.shared
            ref = {name: _launch_config(record_launch(mod, args, reference_capability, smem_limit)[1])
                   for name, mod in mods.items()}
            stages = ref_backend.parse_options(ref["patched"]).num_stages  # Triton's default where none is given
            row["reference"] = {"capability": reference_capability, "tile": ref["patched"]["TILE_SIZE"],
                                "num_stages": stages, "unchanged": ref["patched"] == ref["unpatched"]}
            rows.append(row)
    return {"target": ["cuda", capability, 32], "smem_limit": smem_limit, "triton": triton.__version__,
            "torch": torch.__version__, "launches": rows}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unpatched", type=Path, required=True, help="unpacked vLLM source tree, as released")
    ap.add_argument("--patched", type=Path, required=True, help="the same tree with our patches applied")
    ap.add_argument("--smem-limit", type=int, default=65536, help="opt-in shared memory per block (sm_75: 65536)")
    ap.add_argument("--capability", type=int, default=75)
    a = ap.parse_args(argv)
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "triton"))
    print(json.dumps(probe(a.unpatched, a.patched, a.smem_limit, a.capability)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
