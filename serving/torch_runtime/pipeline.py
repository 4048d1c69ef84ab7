"""The PyTorch runtime's decode steps as the device runs them, and the one dispatched ahead (G5G_TORCH_PIPELINE).

A step's tokens go back to the host by a non-blocking copy into pinned memory, and the host waits on an event
recorded after that copy, not on the stream: before waiting, the engine dispatches the next step, fed the chosen
tokens where they lie on the device, at the next positions. So the GPU decodes step t+1 while the host
detokenises step t, checks its stops and runs the scheduler. What a step ahead does is undone or overwritten when
the next request turns out otherwise (serving/torch_runtime/engine.py's `step` checks; docs/serving.md says why each
holds):
- K/V: it wrote each row's entries at the row's next position; a row fed another token there writes them again
  before any layer reads them, a row that finished wrote into a freed slot whose next prompt starts from 0, and a
  prompt started after it runs after it on the stream;
- penalty counts: `Run.undo` takes its fed tokens back out;
- sampling: draws are keyed by (seed, position), so the step ahead draws what the requested one would.
A step decodes the first rows (attention.rows()) that hold its live slots: a step ahead is never wider than
the step it follows (its slots are among that step's), and a `start`, the one way a wider step can be asked for,
throws the step ahead away first.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from serving.engine import TokenLogprobs

# Where a step dispatched ahead is on by default, per device type: on a GPU it hides the host's time between
# steps; on a CPU the host is the device, so running the next step early hides nothing.
DEFAULT_PIPELINE = {"cuda": True, "cpu": False}
INPUTS = 5          # rows of a step's host inputs: token fed, position, counted, holding, live


def pipeline_from_env(env=os.environ, device_type: str = "cpu") -> bool:
    """G5G_TORCH_PIPELINE: 1 dispatches each decode step before the previous one's tokens are back on the host, 0
    waits for them first (default: DEFAULT_PIPELINE for the device)."""
    text = env.get("G5G_TORCH_PIPELINE", "")
    if text not in ("", "0", "1"):
        raise ValueError(f"G5G_TORCH_PIPELINE: {text!r} is not 0 or 1")
    return DEFAULT_PIPELINE.get(device_type, False) if text == "" else text == "1"


class Stager:
    """A step's host inputs (int64 [INPUTS, rows], rows up to `slots`) to the device in one copy. On CUDA from
    pinned memory, over a ring of buffers, each written again only after the copy out of it is done (its event):
    never while one may be in flight, even with a step dispatched ahead."""

    def __init__(self, slots: int, device: torch.device, depth: int = 4):
        self.device, self.cuda = device, device.type == "cuda"
        n = depth if self.cuda else 0
        self.bufs = [torch.zeros(INPUTS * slots, dtype=torch.int64, pin_memory=True) for _ in range(n)]
        self.events = [torch.cuda.Event() for _ in range(n)]
        self.next = 0

    def send(self, inputs: np.ndarray) -> torch.Tensor:
        if not self.cuda:
            return torch.from_numpy(inputs)
        i, self.next = self.next, (self.next + 1) % len(self.bufs)
        self.events[i].synchronize()            # done long ago unless the ring is shorter than the steps in flight
        buf = self.bufs[i][:inputs.size].view(inputs.shape)        # contiguous: one pinned copy of that many rows
        buf.numpy()[:] = inputs
        out = buf.to(self.device, non_blocking=True)
        self.events[i].record()
        return out


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy on the host that a CUDA tensor's stream fills without blocking (pinned memory; read it after the
    event recorded behind it); a CPU tensor as it is."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


@dataclass
class Run:
    """One dispatched decode step: what it was fed, its logits and chosen tokens on the device, their copies on
    their way to the host, and `fed`: for a step dispatched ahead, the tokens it was fed as the host learns them."""
    live: list[int]
    ids: torch.Tensor               # [rows] tokens fed to the first rows slots (attention.rows())
    counted: torch.Tensor           # [rows] 1 where the fed token entered the penalty counts
    logits: torch.Tensor            # [rows, vocab] float32, a copy of its own
    chosen: torch.Tensor            # [rows]
    host: torch.Tensor = None
    lp: tuple | None = None         # on the host: (chosen's raw logprob [rows], top values [rows, k], ids)
    done: object = None             # torch.cuda.Event behind the copies (None on CPU)
    fed: dict[int, int] | None = field(default=None)

    def send(self, top: int | None) -> "Run":
        """Start the copies to the host (and, with `top` not None, the raw logprobs of the chosen tokens and the
        `top` most likely per row, computed here on the device first)."""
        self.host = to_host(self.chosen)
        if top is not None:
            lp = torch.log_softmax(self.logits, -1)
            picked = lp.gather(1, self.chosen[:, None])[:, 0]
            best = lp.topk(top, -1) if top else None
            self.lp = tuple(to_host(t) for t in (picked, *((best.values, best.indices) if top else ())))
        if self.chosen.device.type == "cuda":
            self.done = torch.cuda.Event()
            self.done.record()
        return self

    def tokens(self) -> list[int]:
        """The chosen tokens, per row (= slot; waits for this step only: a step dispatched after it runs on)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()

    def logprobs(self, slot: int, k: int) -> TokenLogprobs:
        """After `tokens`: the slot's raw logprobs, its k most likely tokens."""
        picked = float(self.lp[0][slot])
        if not k:
            return TokenLogprobs(picked, ())
        return TokenLogprobs(picked, tuple(zip(self.lp[2][slot, :k].tolist(), self.lp[1][slot, :k].tolist())))

    def matches(self, tokens: dict[int, int], masks) -> bool:
        """Whether this step, dispatched ahead, is the one `tokens` (and `masks`) ask for: no masks, every slot
        asked for was live in it and fed the token asked for. A slot it ran that is not asked for has finished:
        its row's results are left unread."""
        return (not masks and self.fed is not None
                and all(s in self.fed and self.fed[s] == t for s, t in tokens.items()))

    def undo(self, sampler) -> None:
        """Take this step's fed tokens back out of the penalty counts (a step dispatched ahead, not taken)."""
        sampler.count(torch.arange(len(self.ids), device=self.ids.device), self.ids, -self.counted)
