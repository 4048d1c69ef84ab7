"""Continuous batching's KV cache for the PyTorch runtime, and the attention that reads it once.

transformers' SDPA path expands a grouped KV head to every query head it serves (`repeat_kv`) whenever a mask is
passed: on Gemma 4 (8 query heads, 1 KV head) that is 8 copies of the cache per layer per step. SDPA's own
`enable_gqa` does not help on Turing: the memory-efficient kernel (with math, the only SDPA backends sm_75 has)
takes as many KV heads as query heads. So `attend` folds each group of query heads into the query axis instead:
[rows, kv_heads, group x queries, head_dim] against K/V [rows, kv_heads, keys, head_dim] is ordinary attention, and
K/V are read where they lie. It is registered with transformers as the attention implementation ATTENTION.

A decode step (one query per row) does not go through SDPA: the memory-efficient kernel gives each (row, KV head)
one CTA that streams every key, so a lone stream's attention ran on one of a T4's 40 SMs, its time growing with the
context. `one_query` is two batched GEMMs instead (scores over every key, then the weighted sum of values), each
spread over the keys, with float32 scores and softmax as the memory-efficient kernel keeps them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from serving.memory_plan import ATTENTION_QUERY_CHUNK

ATTENTION = "g5g_slots"
QUERY_CHUNK = ATTENTION_QUERY_CHUNK     # prompt queries attended at once (what a prefill holds: memory_plan counts it)


def attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
           scaling: float | None = None, **_) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [rows, heads, Q, D], key/value [rows, kv_heads, S, D],
    a boolean mask [rows, 1, Q, S] (True: attend); returns [rows, Q, heads, D]."""
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    if q_len == 1:
        o = one_query(query.reshape(rows, kv_heads, group, dim), key, value, attention_mask, scaling)
        return o.reshape(rows, 1, heads, dim), None
    out = []
    for i in range(0, q_len, QUERY_CHUNK):
        q = query[:, :, i:i + QUERY_CHUNK]
        n = q.shape[2]
        # heads are kv-head-major (repeat_kv's order): head h reads KV head h // group
        q = q.reshape(rows, kv_heads, group * n, dim)
        m = attention_mask[:, :, i:i + n]
        m = m[:, :, None].expand(rows, 1, group, n, m.shape[-1]).reshape(rows, 1, group * n, m.shape[-1])
        o = F.scaled_dot_product_attention(q, key, value, attn_mask=m, scale=scaling)
        out.append(o.reshape(rows, heads, n, dim))
    o = out[0] if len(out) == 1 else torch.cat(out, 2)
    return o.transpose(1, 2).contiguous(), None


def one_query(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
              scaling: float | None) -> torch.Tensor:
    """q [rows, kv_heads, group, D] (a row's query heads of each KV head), key/value [rows, kv_heads, S, D], mask
    [rows, 1, 1, S]: [rows, kv_heads, group, D]. Each KV head's K/V is a strided view of the cache, which the GEMMs
    read as it lies (no copy, and no reshape whose copy would depend on whether S is the whole cache)."""
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    out = []
    for h in range(key.shape[1]):
        scores = _float_bmm(q[:, h], key[:, h].transpose(1, 2)) * scale          # [rows, group, S]
        p = torch.softmax(scores.masked_fill(~mask[:, 0], float("-inf")), dim=-1).to(q.dtype)
        out.append(torch.bmm(p, value[:, h]))
    return torch.stack(out, 1)


def _float_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in float32 (cuBLAS keeps its float32 accumulator for 16-bit inputs)."""
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    return torch.bmm(a, b, out_dtype=torch.float32) if a.is_cuda else torch.bmm(a.float(), b.float())


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attend)
    return ATTENTION


def turing_backends() -> None:
    """Leave SDPA only the backends sm_75 has (memory-efficient, math), so a newer GPU measures Turing's path."""
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


# Rows a decode step may take (below the slot count, itself always a rung): a step decodes rows [:b] for the
# smallest b that covers its highest live slot, so a lone stream (Batch.join fills the lowest free slot) decodes two
# rows, not every slot's. Each b is one more CUDA graph, all of one compile (the rows dimension is dynamic). No rung
# of 1: torch.compile specialises sizes of 1, so one row was a second compile at every boot (cold and warm), for a
# step that streams the same weights as two rows do.
ROWS = (2, 4, 8)
# An eager step (no compile to share) takes one row too: a lone stream's products are then GEMVs, which a CPU runs
# about 2x faster than two-row GEMMs (fp32, one thread, 6144x1536: 2.6 against 4.9 ms; benchmarks/cpu_slots.py).
EAGER_ROWS = (1, *ROWS)


def rows(live, slots: int, steps=ROWS) -> int:
    """Rows a decode step of the slots `live` decodes: the smallest of `steps` below `slots` above every live slot,
    else `slots`."""
    top = max(live) + 1
    return next((b for b in steps if top <= b < slots), slots)


def ladder(slots: int, steps=ROWS) -> tuple[int, ...]:
    """Every row count rows() gives for `slots`, smallest first (what a warm-up visits)."""
    return tuple(b for b in steps if b < slots) + (slots,)


def span(positions: list[int], max_context: int) -> int:
    """Keys a decode step attends over on full layers: a power of two (one compiled graph per size) covering every
    position, at least 64."""
    return min(max_context, max(64, 1 << max(positions).bit_length()))


# Positions a full layer's buffer keeps past max_context. A decode step writes the buffer, then reads its first span()
# positions: traced, the write is a fresh contiguous copy of the buffer, and a slice of it is contiguous exactly when
# the span is the whole buffer, which AOTAutograd guards on: the first context past max_context / 2 recompiled the
# step mid-serving (issue 49). One position more than any span makes no span contiguous (never read nor written).
PAD = 1


class SlotKV:
    """Every layer that computes KV keeps one row per sequence: full layers [slots, kv_heads, max_context + PAD,
    head_dim], sliding layers a ring of their window [slots, kv_heads, window, head_dim] (position p at p % window).
    Rows are at different positions, which transformers' caches cannot hold, so the model reaches this one through the
    Cache `update` call and takes {layer type: mask} as attention_mask. A decode step attends over the first
    span(positions) keys of full layers, the length of their mask (marked dynamic: one compiled graph serves every
    span), and over the whole ring of sliding ones: keys are stored rotated, so a ring's order does not matter, and
    entry j is written exactly when j <= p, the same mask as a full layer's prefix. A decode step may take the first
    rows only (rows()): it reads and writes views of those rows, its rows dimension marked dynamic as the span is."""

    def __init__(self, model, slots: int, max_context: int, device: torch.device, dtype):
        self.window = min(model.config.sliding_window, max_context)
        self.k, self.v, self.ring = {}, {}, {}
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            if not a.is_kv_shared_layer:
                self.ring[i] = a.is_sliding
                shape = (slots, a.k_proj.out_features // a.head_dim,
                         self.window if a.is_sliding else max_context + PAD, a.head_dim)
                self.k[i] = torch.zeros(shape, dtype=dtype, device=device)
                self.v[i] = torch.zeros(shape, dtype=dtype, device=device)
        if device.type == "cuda":                # CUDA graphs replay over these very buffers
            for t in (*self.k.values(), *self.v.values()):
                torch._dynamo.mark_static_address(t)
        self.max_context, self.device = max_context, device
        self._slot, self._pos = 0, None

    def nbytes(self) -> int:
        """The bytes of every position a sequence may use (memory_plan's count; the PAD positions aside)."""
        return sum(t[:, :, :self.max_context].numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def prefill(self, slot: int | torch.Tensor, n: int | torch.Tensor, length: int | None = None) -> dict:
        """A prompt of n tokens into `slot` from position 0: it attends over its own keys (causal, window). slot and
        n may be device tensors [1] (a captured prompt reads them from its buffers: prefill.py), and `length` (default
        n) pads the prompt: positions from n on are computed and their keys written to full layers' rows, where every
        decode step writes a position before it reads it, but never to a ring."""
        length = length or n
        self._slot = torch.as_tensor(slot, device=self.device).view(1)
        n = torch.as_tensor(n, device=self.device).view(1)
        # ring entry j keeps the last prompt position p < n with p % window == j (none where j >= n: an entry no step
        # reads before writing it; position 0's key goes there)
        j = torch.arange(self.window, device=self.device)
        self._ring_src = (n - 1 - torch.remainder(n - 1 - j, self.window)).clamp_min(0)
        self._pos = None
        q = torch.arange(length, device=self.device)
        full = q[None, :] <= q[:, None]
        sliding = full & (q[None, :] > q[:, None] - self.window)
        return dict(position_ids=q[None], past_key_values=self,
                    attention_mask={"full_attention": full[None, None], "sliding_attention": sliding[None, None]})

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, span: int) -> dict:
        """The compiled call's arguments for one token per row: input_ids [rows, 1] at positions [rows] (on the
        device; rows: the first rows() slots); span: span() of them, from the host."""
        self._pos, self._ring_pos = positions, positions % self.window
        at = positions.view(-1, 1, 1, 1)
        # tensors of their own, not views of one: the compiler sees a view's base, and the span's mark with it
        self._full = torch.arange(span, device=self.device).view(1, 1, 1, span) <= at
        torch._dynamo.maybe_mark_dynamic(self._full, 3)
        masks = {"full_attention": self._full,
                 "sliding_attention": torch.arange(self.window, device=self.device).view(1, 1, 1, -1) <= at}
        kw = dict(input_ids=input_ids, position_ids=positions[:, None], attention_mask=masks, past_key_values=self)
        for t in (input_ids, kw["position_ids"], self._pos, self._ring_pos, *masks.values()):
            torch._dynamo.maybe_mark_dynamic(t, 0)    # rows: one compile serves every count above 1
        return kw

    def update(self, key, value, layer_idx, cache_kwargs=None):
        """Write the new entries (key/value [rows, kv_heads, T, head_dim]) and return what the layer attends over."""
        k, v, ring = self.k[layer_idx], self.v[layer_idx], self.ring[layer_idx]
        if self._pos is None:                   # a prompt: the ring keeps its last window positions
            if ring:
                k.index_copy_(0, self._slot, key[:, :, self._ring_src])
                v.index_copy_(0, self._slot, value[:, :, self._ring_src])
            else:
                n = key.shape[2]
                k[:, :, :n].index_copy_(0, self._slot, key)
                v[:, :, :n].index_copy_(0, self._slot, value)
            return key, value
        b = key.shape[0]                        # the step's rows: the first b slots
        row = torch.arange(b, device=key.device)
        at = self._ring_pos if ring else self._pos
        k[row, :, at], v[row, :, at] = key[:, :, 0], value[:, :, 0]
        if ring:
            return k[:b], v[:b]
        n = self._full.shape[-1]
        return k[:b, :, :n], v[:b, :, :n]
