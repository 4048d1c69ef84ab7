"""Weight-only int8/int4 linear layers for the PyTorch runtime: the weights stay on the device as the checkpoint
packs them, and a decode step's matmul unpacks and scales them inside the product (a Triton kernel that reads
each packed byte once), so a token streams about 1/2 (int8) or 1/4 (int4) of the 16-bit weight bytes.

The layout is compressed-tensors' "pack-quantized" one (serving/quantized.py) read as bytes: weight [out, in] as
uint8 [out, in * bits / 8], input 2j in the low nibble of byte j for int4, every value stored with an offset of
2**(bits-1); scales [out, groups] (one group: a scale per output channel).

Two kernels, both plain Triton that every GPU runs the same way:
- up to GEMV_MAX_ROWS rows (a decode step of 1-8 sequences; `uses_gemv` says which): a GEMV on CUDA cores, no tl.dot
  (Triton lowers tl.dot to FMA below sm_80 anyway, and a 16-row dot tile does 16x the work of one row). Each program
  takes BLOCK_N output rows and a slice of K (split-K when the columns alone give too few programs for the GPU's
  SMs; the slices' fp32 partial sums are added by one torch sum). Bytes become fp16 by or-ing them into the exponent
  of 1024.0 (0x6400 | b is 1024 + b) and subtracting the offset: no integer-to-float conversion. int4 reads the
  checkpoint's own layout: the low nibbles multiply the even inputs, the high nibbles the odd ones (no unpack, no
  repack). Group scales multiply each group's partial sum once, not every weight.
- up to KERNEL_MAX_ROWS rows: the tl.dot kernel (one BLOCK_M 16 tile of rows per program).
Rows beyond that (a prefill) and any CPU tensor take the plain path: the layer's weight dequantised once, then
cuBLAS / the CPU's matmul; those are bound by compute, not by the weight bytes.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from serving import quantized

KERNEL_MAX_ROWS = 16        # the dot kernel's row block: a decode step of up to 16 sequences
GEMV_MAX_ROWS = 8           # rows the GEMV takes; above that the dot kernel's 16-row tile wastes less
# (BLOCK_N, BLOCK_K, num_warps) per bits, from the H200's kernel table over E2B/E4B's largest weights at 1 and 8
# rows (benchmarks/quantized_decode.py --phase kernels; benchmarks/RESULTS.md, issue 21): int8's winner at 8 rows
# (1 row prefers BLOCK_K 512 by a few percent), int4's most frequent winner.
KERNEL_CONFIG = {8: (32, 256, 4), 4: (16, 512, 4)}


class PackedLinear(torch.nn.Module):
    """nn.Linear's forward (no bias) over a packed weight; buffers move with .to() like a Linear's weight."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, in_features: int, bits: int, dtype):
        super().__init__()
        if bits not in KERNEL_CONFIG:
            raise ValueError(f"{bits}-bit weights: only {sorted(KERNEL_CONFIG)} are served")
        out = packed.shape[0]
        as_bytes = packed.contiguous().view(torch.uint8).reshape(out, -1)     # int32 words (little-endian) or bytes
        self.register_buffer("packed", as_bytes[:, :in_features * bits // 8])
        self.register_buffer("scale", scale.to(dtype).contiguous())
        self.in_features, self.out_features, self.bits = in_features, out, bits
        quantized.group_size(self.scale, in_features)      # refuses scales that do not divide the inputs

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, " \
               f"group={self.in_features // self.scale.shape[1]}"

    def dequantised(self, dtype) -> torch.Tensor:
        """The [out, in] weight in `dtype`."""
        b = self.packed
        if self.bits == 4:
            b = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(self.out_features, -1)
        q = (b.to(torch.int16) - (1 << (self.bits - 1))).to(dtype)
        groups = self.scale.shape[1]
        return (q.reshape(self.out_features, groups, -1) * self.scale.to(dtype)[:, :, None]).reshape(q.shape)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, dtype) -> "PackedLinear":
        """An int8 PackedLinear (one scale per output row) of a 16-bit weight [out, in], quantised on its device
        as tools/quantize.py's w8a16 does (compressed-tensors' symmetric channel rule: scale = max|w| / 127.5,
        rounded to fp16 first; tests/test_packed_matmul.py checks it against the library): the int8 LM head."""
        w = weight.detach().float()
        scale = w.abs().amax(1, keepdim=True) / 127.5
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale).to(torch.float16)
        q = torch.clamp(torch.round(w / scale.float()), -128, 127).to(torch.int16) + 128
        return cls(q.to(torch.uint8), scale, weight.shape[1], 8, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if x.is_cuda and rows <= KERNEL_MAX_ROWS:
            y = packed_mm_op(x.reshape(rows, self.in_features), self.packed, self.scale, self.bits)
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantised(x.dtype))


def kernel_missing() -> str | None:
    """Why the GPU kernel cannot run here (triton, or the C compiler it builds its launcher with, is missing), or
    None: a server checks before it loads a packed checkpoint onto a GPU, instead of failing its first decode."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("triton") is None:
        return "the packed int8/int4 kernel needs triton (pip install triton, torch's tested release)"
    if not any(shutil.which(c) for c in (os.environ.get("CC") or "", "cc", "gcc", "clang") if c):
        return "the packed int8/int4 kernel needs a C compiler for Triton's launcher (gcc, or CC=...)"
    return None


def packed_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bits: int,
              config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= KERNEL_MAX_ROWS) @ W.T with W [N, K] packed as PackedLinear keeps it -> [M, N] in x's dtype."""
    import triton     # only here: a CPU-only install never needs it

    m, k = x.shape
    n = packed.shape[0]
    group = 0 if scale.shape[1] == 1 else k // scale.shape[1]
    if config is None and uses_gemv(m, bits, group, device_arch(x.device)):
        return gemv(x, packed, scale, bits)
    block_n, block_k, warps = config or KERNEL_CONFIG[bits]
    groups = scale.shape[1]
    if m > KERNEL_MAX_ROWS:
        raise ValueError(f"packed_mm: {m} rows; the kernel takes up to {KERNEL_MAX_ROWS}")
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _kernel()[(triton.cdiv(n, block_n),)](
        x, packed, scale, y, m, n, k, k // groups, x.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
        BITS=bits, PER_CHANNEL=groups == 1, BLOCK_M=KERNEL_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps)
    return y


def uses_gemv(rows: int, bits: int, group: int, arch: int) -> bool:
    """Whether `rows` inputs take the GEMV rather than the dot kernel: up to GEMV_MAX_ROWS rows on sm_75 (tl.dot
    runs on CUDA cores there too) and for int4 everywhere; int8 beyond one row on a GPU whose tl.dot has tensor
    cores (sm_80+) keeps the dot kernel, which the H200 ran 2.4x faster at 8 rows (benchmarks/RESULTS.md, issue
    26). Groups must be a power of two inputs (whole groups per step)."""
    if rows > GEMV_MAX_ROWS or (group and group & (group - 1)):
        return False
    return bits == 4 or rows == 1 or arch < 80


def device_arch(device) -> int:
    """Compute capability as 75, 90…: the device's, or G5G_PACKED_ARCH (benchmarks/t4g_model.py sets 75: any GPU
    then takes a T4G's kernels); 75 off CUDA (Triton's interpreter stands in for the T4G)."""
    if text := os.environ.get("G5G_PACKED_ARCH"):
        return int(text)
    d = torch.device(device)
    return _device_arch(d.index or 0) if d.type == "cuda" else 75


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def sm_count(device) -> int:
    """The SMs the GEMV spreads its programs over: the device's, or G5G_PACKED_SMS (benchmarks/t4g_model.py sets
    40, a T4G's, so that any GPU launches exactly the grid a T4G would)."""
    if text := os.environ.get("G5G_PACKED_SMS"):
        return int(text)
    return _device_sms(torch.device(device).index or 0)


@functools.lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gemv_config(n: int, k: int, bits: int, group: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_KB bytes, split, num_warps) of the GEMV for W [n, k]: 16 output rows of 256 bytes per
    step, and K split in two until there are PROGRAMS_PER_SM programs per SM (or a slice would fall below two
    steps). A group's bytes must divide a step."""
    row_bytes = k * bits // 8
    block_kb = max(16, min(256, triton_next_pow2(row_bytes)))
    if group:
        block_kb = max(block_kb, group * bits // 8)
    block_n, split = 16, 1
    tiles = -(-n // block_n)
    while tiles * split < PROGRAMS_PER_SM * sms and row_bytes // (2 * split) >= 2 * block_kb:
        split *= 2
    return block_n, block_kb, split, 4


PROGRAMS_PER_SM = 4


def triton_next_pow2(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


def gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bits: int,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS) @ W.T, W [N, K] packed as PackedLinear keeps it -> [M, N] in x's dtype."""
    m, k = x.shape
    n = packed.shape[0]
    groups = scale.shape[1]
    group = 0 if groups == 1 else k // groups
    block_n, block_kb, split, warps = config or gemv_config(n, k, bits, group, sm_count(x.device))
    row_bytes = k * bits // 8
    slice_bytes = -(-row_bytes // split // block_kb) * block_kb          # whole steps per slice
    split = -(-row_bytes // slice_bytes)
    x = x.contiguous()
    y = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    _gemv_kernel()[(-(-n // block_n), split)](
        x, packed, scale, y, m, n, row_bytes, slice_bytes, x.stride(0), packed.stride(0), scale.stride(0),
        y.stride(0), y.stride(1), BITS=bits, GROUP=group, BLOCK_M=triton_next_pow2(m), BLOCK_N=block_n,
        BLOCK_KB=block_kb, num_warps=warps)
    return y[0] if split == 1 else y.sum(0, dtype=x.dtype)


@torch.library.custom_op("g5g::packed_mm", mutates_args=())
def packed_mm_op(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """packed_mm as an operator torch.compile treats as opaque (the runtime's compiled, CUDA-graphed decode step
    captures the kernel launch instead of breaking its graph on it)."""
    return packed_mm(x, packed, scale, bits)


@packed_mm_op.register_fake
def _(x, packed, scale, bits):
    return x.new_empty((x.shape[0], packed.shape[0]))


@functools.cache
def _gemv_kernel():
    """The GEMV kernel, defined on first use, as `_kernel`."""
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, KB, SLICE, stride_xm, stride_wn, stride_sn, stride_ys,
                    stride_ym, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr):
        # Program (n, s): output rows [n * BLOCK_N, +BLOCK_N) over the packed bytes [s * SLICE, +SLICE) of each row,
        # for every one of the M (<= BLOCK_M) input rows; the result (fp32 partial sums when K is split) goes to
        # y[s]. KB: packed bytes per weight row. GROUP: inputs per scale, 0 for one scale per output row.
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rb = tl.arange(0, BLOCK_KB)
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        start = tl.program_id(1) * SLICE
        for b0 in range(start, tl.minimum(start + SLICE, KB), BLOCK_KB):
            cb = b0 + rb
            b_ok = cb < KB
            wb = tl.load(w_ptr + rn[:, None] * stride_wn + cb[None, :], mask=n_ok[:, None] & b_ok[None, :],
                         other=0).to(tl.uint16)
            if BITS == 8:       # 0x6400 | b is the fp16 1024 + b: minus 1024 + 128, the signed value
                w0 = (wb | 0x6400).to(tl.float16, bitcast=True) - 1152.0
            else:               # byte j: input 2j in the low nibble, 2j + 1 in the high one
                w0 = ((wb & 0xF) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
                w1 = ((wb >> 4) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
            if GROUP:
                gb: tl.constexpr = GROUP * BITS // 8                # bytes per group
                rg = b0 // gb + tl.arange(0, BLOCK_KB // gb)
                s = tl.load(s_ptr + rn[:, None] * stride_sn + rg[None, :],
                            mask=n_ok[:, None] & (rg[None, :] < KB // gb), other=0.0).to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                m_ok = m < M
                if BITS == 8:
                    xm = tl.load(x_ptr + m * stride_xm + cb, mask=b_ok & m_ok, other=0.0).to(tl.float32)
                    p = w0.to(tl.float32) * xm[None, :]
                else:
                    xe = tl.load(x_ptr + m * stride_xm + 2 * cb, mask=b_ok & m_ok, other=0.0).to(tl.float32)
                    xo = tl.load(x_ptr + m * stride_xm + 2 * cb + 1, mask=b_ok & m_ok, other=0.0).to(tl.float32)
                    p = w0.to(tl.float32) * xe[None, :] + w1.to(tl.float32) * xo[None, :]
                if GROUP:       # each group's partial sum scaled once
                    part = tl.sum(tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_KB // gb, gb)), axis=2) * s, axis=1)
                else:
                    part = tl.sum(p, axis=1)
                acc = tl.where(rm[:, None] == m, acc + part[None, :], acc)
        if not GROUP:
            acc *= tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + tl.program_id(1) * stride_ys + rm[:, None] * stride_ym + rn[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_ok[None, :])

    return gemv_kernel


@functools.cache
def _kernel():
    """The Triton kernel, defined on first use (TRITON_INTERPRET, read when a kernel is defined, then applies)."""
    import triton
    import triton.language as tl

    @triton.jit
    def packed_mm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, GROUP, stride_xm, stride_wn, stride_sn, stride_ym,
                         BITS: tl.constexpr, PER_CHANNEL: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # One program: BLOCK_N output columns for every row, walking K; each packed byte is loaded once.
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        per_byte: tl.constexpr = 8 // BITS
        bk: tl.constexpr = BLOCK_K // per_byte            # bytes of one row per step
        rb = tl.arange(0, bk)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :],
                        mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 // per_byte + rb)[None, :],
                        mask=(rn[:, None] < N) & ((k0 // per_byte + rb)[None, :] < K // per_byte), other=0)
            if BITS == 4:       # byte j: input 2j low nibble, 2j+1 high nibble
                b = tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_N, BLOCK_K))
            w = (b.to(tl.int32) - (1 << (BITS - 1))).to(x.dtype)
            if not PER_CHANNEL:
                s = tl.load(s_ptr + rn[:, None] * stride_sn + (rk // GROUP)[None, :],
                            mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
                w = w * s
            acc += tl.dot(x, tl.trans(w))
        if PER_CHANNEL:
            acc *= tl.load(s_ptr + rn * stride_sn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return packed_mm_kernel


def pack_model(model: torch.nn.Module, packed: dict[str, tuple[torch.Tensor, torch.Tensor, int]], bits: int,
               dtype) -> int:
    """Replace each Linear named in `packed` ({module path: (packed int32 words, scales, in_features)}) by a
    PackedLinear; returns how many were replaced."""
    for path, (words, scale, in_features) in packed.items():
        parent, _, child = path.rpartition(".")
        owner = model.get_submodule(parent)
        old = getattr(owner, child)
        if not isinstance(old, torch.nn.Linear) or old.bias is not None or old.in_features != in_features:
            raise ValueError(f"{path}: not a bias-free Linear of {in_features} inputs ({old})")
        setattr(owner, child, PackedLinear(words, scale, in_features, bits, dtype))
    return len(packed)
