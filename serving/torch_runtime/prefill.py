"""Prompts as CUDA graphs: a prompt's forward, padded to a length bucket, replayed from a graph captured once per
bucket at boot (issue 49).

An eager prompt forward is the host launching ~25 kernels a layer one by one: on an H100 a 526-token prefill took
75 ms where JAX's compiled one took 19 ms, most of it launches, not GPU work. A graph replays every kernel of the
forward in one launch. What makes a forward replayable:
- static shapes: the prompt is padded to its bucket (the smallest of `buckets()` that holds it). Padded positions
  sit after the prompt, so no prompt query attends to them (causal), their keys go to full layers' rows past the
  prompt, which every decode step writes before it reads them, and never to a ring (SlotKV.prefill);
- static inputs: the prompt's ids, its slot and its length are copied into buffers the graph reads; the logits it
  keeps are the prompt's last position's (`logits_to_keep` as an index);
- one memory pool for every bucket (the largest captured first): prompts run one at a time, and each replay's
  logits are copied out before the next.
Graphs are captured on the first prompt (the boot's warm-up), with SlotKV (slots > 1) on CUDA only, by default
(G5G_TORCH_PREFILL_GRAPHS=0: eager prompts). On an H100 at E2B's shapes (benchmarks/prompt_graphs.py,
results/serving_speed_gpu/2026-12-07-h100/) they gave the eager prompt's first token at 5, 117 and 526 tokens and
took it 3.7x sooner at 5 and 117 tokens (10.3-10.7 ms against 38-40), 1.5x at 526 (30.9 against 45.8 ms, padded to
1024 by a ladder of powers of two); the capture took 0.8 s. With the half steps (the day's second lease,
2026-12-07-h100-b/), 526 tokens padded to 768: 23.6 ms against the eager 67.3, 9 graphs captured in 1.5 s (now
640: quarter steps from 512, not yet measured). The padded forward is also the CPU's tests/test_torch_prefill.py.
A prompt longer than every bucket, or one that asks for prompt_logprobs, runs eagerly.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger("serving.pytorch")

SMALLEST = 64         # the first bucket: shorter prompts pad to it (a chat template alone is ~20 tokens)
# From here on a bucket's padding costs milliseconds, below it little: a graph took 10.4 ms at 64 positions, 10.9 at
# 128, 23.6 at 768, 31.4 at 1024 (H100, 2026-12-07-h100-b/prompt_graphs.json). Quarter steps from it, half below.
QUARTER_STEPS_FROM = 512


def buckets(max_context: int, smallest: int = SMALLEST) -> tuple[int, ...]:
    """Powers of two from `smallest` with the half steps between them (64, 96, 128, 192, ...) and, from
    QUARTER_STEPS_FROM, the quarter steps (512, 640, 768, 896, 1024, 1280, ...), below max_context; then
    max_context. A prompt pads to at most 1.5x its positions, 1.25x from 512 (526 tokens to 640, not 1024); one graph
    per bucket (11 at a context of 1024, 19 at 4096)."""
    out, b = [], smallest
    while b < max_context:
        step = b // 4 if b >= QUARTER_STEPS_FROM else b // 2
        out += [n for n in range(b, 2 * b, step) if n < max_context]
        b *= 2
    return (*out, max_context)


def graphs_from_env(env, device_type: str, slots: int) -> bool:
    """G5G_TORCH_PREFILL_GRAPHS: 1 (default) captures prompt graphs on CUDA with SlotKV (slots > 1); 0 never."""
    text = env.get("G5G_TORCH_PREFILL_GRAPHS") or "1"
    if text not in ("0", "1"):
        raise ValueError(f"G5G_TORCH_PREFILL_GRAPHS: {text!r} is not 0 or 1")
    return text == "1" and device_type == "cuda" and slots > 1


def bucket_of(n: int, ladder: Sequence[int]) -> int | None:
    return next((b for b in ladder if n <= b), None)


class PromptGraphs:
    """`forward(ids [1, L], slot [1], n [1]) -> logits [1, vocab]` (float32) captured once per bucket length L;
    `run(slot, prompt_ids)` replays the prompt's bucket, or returns None where no bucket holds it."""

    def __init__(self, forward: Callable, ladder: Sequence[int], device: torch.device):
        self.forward, self.ladder, self.device = forward, tuple(ladder), device
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.n = torch.ones(1, dtype=torch.long, device=device)
        self._ids: dict[int, torch.Tensor] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.capture_s: float | None = None

    def capture(self) -> None:
        """Every bucket's graph, the largest first (the pool it leaves serves the smaller ones). A warm-up run of
        each comes first (on a side stream, as capture requires); both write slot 0's rows, at boot, before any
        sequence holds it."""
        t0, pool = time.monotonic(), None
        for length in sorted(self.ladder, reverse=True):
            ids = torch.zeros((1, length), dtype=torch.long, device=self.device)
            self.slot.zero_()
            self.n.fill_(length)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.forward(ids, self.slot, self.n)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[length] = self.forward(ids, self.slot, self.n)
            pool = graph.pool()
            self._ids[length], self._graphs[length] = ids, graph
        self.capture_s = time.monotonic() - t0
        log.info("prefill graphs: %d bucket(s) %s captured in %.1fs", len(self.ladder), ",".join(map(str, self.ladder)),
                 self.capture_s)

    def run(self, slot: int, prompt_ids: Sequence[int]) -> torch.Tensor | None:
        length = bucket_of(len(prompt_ids), self.ladder)
        if length is None:
            return None
        if not self._graphs:
            try:
                self.capture()
            except Exception as e:       # as a decode step that fails to compile: said once, then eager
                log.warning("prefill graphs failed (%s: %s); prompts run eagerly", type(e).__name__, e)
                self.ladder, self._graphs = (), {}
                return None
        ids = self._ids[length]
        ids[0, :len(prompt_ids)].copy_(torch.tensor(list(prompt_ids)), non_blocking=False)
        self.slot.fill_(slot)
        self.n.fill_(len(prompt_ids))
        self._graphs[length].replay()
        return self._logits[length].clone()      # the next replay writes the graph's own output again

    def describe(self) -> str:
        if self.capture_s is None:
            return "prefill graphs not captured" if self.ladder else "prefill graphs failed: prompts eager"
        return f"prefill graphs: {len(self._graphs)} captured in {self.capture_s:.1f}s"
