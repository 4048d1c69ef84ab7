"""The PyTorch runtime's next tokens: every slot's at once, on the device, by serving/engine.py's sampling contract.

Per slot the request's settings live in device tensors, written once when the request starts; a step reads them
for all rows in one pass (no per-slot calls, no host round trip). Which stages run (bias, min_tokens, penalties,
min_p, cuts) is known on the host from the live requests' settings, so no stage waits on the device to decide.

Cuts: the top-k candidates come first (torch.topk of the largest top_k among the rows; the whole vocabulary only
when a row asks for top-p without top-k), then top-p over what top-k kept, renormalised; candidates tied with
the cut stay.
The draw is Gumbel-max, its noise a counter-based hash of (seed, position of the token being drawn, token id):
the same request with the same seed draws the same tokens whatever else shares the batch, on any device.
"""
from __future__ import annotations

import numpy as np
import torch

from serving.engine import MASKED, DeviceRow, SamplingParams

FLOOR = -80.0   # as serving/jax_runtime/sampling.py: tempered, max-shifted logits are clamped here
_U32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """a * c mod 2**32 for int64 a in [0, 2**32): split in 16-bit halves, so no product leaves int64."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _U32


def _mix(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser: a bijection of [0, 2**32) in which every input bit flips half the output bits."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from seeds [R, 2] (high, low words) and positions [R] (int64)."""
    return _mix(seeds[:, 1] ^ _mix(seeds[:, 0] ^ _mix(positions & _U32)))


def gumbel(keys: torch.Tensor, token_codes: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [R, K] for rows' keys [R] and tokens' codes (_mix of the token id) [R, K] or [K]:
    23 bits of a hash of both as a uniform in (0, 1), through -log(-log u)."""
    h = _mix(_mix(keys[:, None] ^ token_codes))
    u = ((h >> 9).float() + 0.5) * 2.0 ** -23
    return -torch.log(-torch.log(u))


def unpack_masks(words: np.ndarray, vocab: int, device) -> torch.Tensor:
    """Packed bitmask rows int32 [R, ceil(V / 32)] (serving/engine.py) as bool [R, V] on the device."""
    w = torch.from_numpy(np.ascontiguousarray(words, "<i4").view(np.int32)).to(device, non_blocking=True)
    bits = (w[:, :, None] >> torch.arange(32, device=device, dtype=torch.int32)) & 1
    return bits.reshape(w.shape[0], -1)[:, :vocab].bool()


def apply_mask(logits: torch.Tensor, words: np.ndarray) -> torch.Tensor:
    """float32 logits [R, V] with every token the packed bitmask rows `words` disallow at MASKED."""
    return logits.masked_fill(~unpack_masks(words, logits.shape[-1], logits.device), MASKED)


class Sampler:
    """Per-slot sampling state on the device and the batched choice over it."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        f32 = lambda fill: torch.full((slots,), fill, dtype=torch.float32, device=device)  # noqa: E731
        self.temperature, self.top_p, self.min_p_shift = f32(0.0), f32(1.0), f32(-torch.inf)
        self.presence, self.frequency, self.repetition = f32(0.0), f32(0.0), f32(1.0)
        self.top_k = torch.zeros(slots, dtype=torch.int64, device=device)
        self.seeds = torch.zeros((slots, 2), dtype=torch.int64, device=device)
        self.bias = torch.zeros((slots, vocab), dtype=torch.float32, device=device)
        self.held = torch.zeros((slots, vocab), dtype=torch.bool, device=device)
        # what the penalties read: generated-token counts and the prompt's tokens, over the vocabulary
        self.counts = torch.zeros((slots, vocab), dtype=torch.int32, device=device)
        self.seen = torch.zeros((slots, vocab), dtype=torch.bool, device=device)
        self.codes = _mix(torch.arange(vocab, dtype=torch.int64, device=device))
        self.rows = [DeviceRow.of(SamplingParams(temperature=0.0), vocab)] * slots     # host copies

    def set(self, slot: int, row: DeviceRow, seed64: int, prompt_ids) -> None:
        """A new request in `slot`: its settings, seed and prompt (what repetition penalises)."""
        self.rows[slot] = row
        shift = float(np.float32(row.temperature * np.log(np.float32(row.min_p)))) if row.min_p > 0 else -np.inf
        values = torch.tensor([row.temperature, row.top_p, shift, row.presence, row.frequency, row.repetition],
                              dtype=torch.float32)
        for t, v in zip((self.temperature, self.top_p, self.min_p_shift, self.presence, self.frequency,
                         self.repetition), values.to(self.device, non_blocking=True)):
            t[slot] = v
        self.top_k[slot] = row.top_k
        self.seeds[slot] = torch.tensor([seed64 >> 32, seed64 & _U32], dtype=torch.int64)
        self.bias[slot].zero_()
        if row.bias:
            ids = torch.tensor([t for t, _ in row.bias], device=self.device)
            self.bias[slot].index_add_(0, ids, torch.tensor([b for _, b in row.bias], device=self.device))
        self.held[slot].zero_()
        if row.held:
            self.held[slot, list(row.held)] = True
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        ids = torch.tensor(list(prompt_ids), dtype=torch.int64).clamp(0, self.vocab - 1)
        self.seen[slot, ids.to(self.device, non_blocking=True)] = True

    def count(self, slots: torch.Tensor, tokens: torch.Tensor, counted: torch.Tensor) -> None:
        """The tokens just generated ([R] on the device, one per slot in `slots`) into the penalties' counts, for
        the rows where `counted` [R] (int) is 1 (the host's: live and penalised)."""
        ok = ((tokens >= 0) & (tokens < self.vocab)).to(torch.int32) * counted.to(torch.int32)
        self.counts.index_put_((slots, tokens.clamp(0, self.vocab - 1)), ok, accumulate=True)

    def choose(self, logits: torch.Tensor, slots: torch.Tensor, live: list[int], draw_positions: torch.Tensor,
               holding: torch.Tensor | None, allowed: np.ndarray | None = None) -> torch.Tensor:
        """Next tokens [R] for float32 logits [R, V] of the rows `slots` [R] (device; `live`: the same on the host,
        the rows whose settings decide which stages run). draw_positions [R]: the position of the token drawn;
        holding [R] bool: min_tokens holds the stop ids back (None: no row does); allowed: packed bitmask rows
        [R, ceil(V / 32)] (serving/engine.py) or None."""
        rows = [self.rows[s] for s in live]
        x = logits if allowed is None else apply_mask(logits, allowed)
        x = self._adjust(x, slots, rows, holding)
        greedy = x.argmax(-1)
        hot = [r for r in rows if r.temperature > 0]
        if not hot:
            return greedy
        t = self.temperature[slots]
        z = ((x - x.max(-1, keepdim=True).values) / torch.where(t > 0, t, 1.0)[:, None]).clamp_min(FLOOR)
        keys = row_keys(self.seeds[slots], draw_positions)
        cut = [r for r in hot if r.top_k or r.top_p < 1.0]
        drawn = None
        if len(cut) < len(hot):                  # a row draws from the whole vocabulary
            drawn = (z + gumbel(keys, self.codes)).argmax(-1)
        if cut:
            k = self.vocab if any(not r.top_k for r in cut) else max(r.top_k for r in cut)
            from_cut = self._cut_draw(z, slots, keys, k)
            has_cut = (self.top_k[slots] > 0) | (self.top_p[slots] < 1.0)
            drawn = from_cut if drawn is None else torch.where(has_cut, from_cut, drawn)
        return torch.where(t > 0, drawn, greedy)

    def _adjust(self, x: torch.Tensor, slots: torch.Tensor, rows: list[DeviceRow], holding) -> torch.Tensor:
        """serving.engine's adjustments before the draw, in vLLM's order: logit_bias and min_tokens, penalties,
        min_p (as serving/jax_runtime/sampling.py's adjust)."""
        if any(r.bias for r in rows):
            x = x + self.bias[slots]
        if holding is not None:
            x = x.masked_fill(self.held[slots] & holding[:, None], -torch.inf)
        if any(r.penalised for r in rows):      # vLLM's apply_penalties; a row without penalties is unchanged
            counts = self.counts[slots]
            out = counts > 0
            rep = self.repetition[slots, None]
            x = torch.where(self.seen[slots] | out, torch.where(x > 0, x / rep, x * rep), x)
            x = x - self.frequency[slots, None] * counts - self.presence[slots, None] * out
        if any(r.min_p > 0 for r in rows):       # p < min_p * p_max at temperature t <=> logit < max + t log(min_p)
            x = torch.where(x < x.max(-1, keepdim=True).values + self.min_p_shift[slots, None], -torch.inf, x)
        return x

    def _cut_draw(self, z: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, k: int) -> torch.Tensor:
        """Draws from the rows' top-k, then top-p, of tempered logits z [R, V], over the k largest candidates."""
        vals, ids = z.topk(k, -1)                                            # sorted, largest first
        top_k = self.top_k[slots]
        rank = torch.arange(k, device=z.device)
        top_k = torch.where(top_k > 0, top_k.clamp_max(k), k)
        kept = torch.where(rank[None] < top_k[:, None], vals, -torch.inf)
        mass = torch.softmax(kept, -1).cumsum(-1)
        top_p = self.top_p[slots]
        n = torch.where(top_p < 1.0, (mass < top_p[:, None]).sum(-1) + 1, top_k).clamp_max(top_k)
        edge = vals.gather(1, (n - 1)[:, None])                              # ties at the cut stay
        noisy = torch.where(vals >= edge, vals + gumbel(keys, self.codes[ids]), -torch.inf)
        return ids.gather(1, noisy.argmax(-1, keepdim=True))[:, 0]

