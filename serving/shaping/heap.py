"""Freed heap handed back to the system (glibc's `malloc_trim`), after the work that frees much of it.

glibc keeps what a process frees in its arenas for the next allocation: a request body of a few MiB parsed into
Python objects, or a 19 MB answer built as JSON, leaves its pages resident after it is gone (the server's RSS grew
by the largest such requests and stayed there; benchmarks/RESULTS.md, "RSS over mixed requests"). `malloc_trim(0)`
returns the free pages of every arena. The API layer calls it once when the model is ready (what loading freed)
and after a request whose body and answer together reach LARGE bytes (`Trimmer`, at most once every GAP_S), the
grammar pool after a compile and when a grammar is let go (grammar_pool.py). `G5G_GIVE_BACK_MEMORY=0` turns every
trim off. Where there is no glibc (musl, macOS) a trim does nothing.
"""
from __future__ import annotations

import ctypes
import os
import time
from typing import Callable

ENV = "G5G_GIVE_BACK_MEMORY"
LARGE = 1 << 20         # a request's body + answer bytes from which its garbage is worth a trim
GAP_S = 1.0             # the least time between two trims after requests (a trim walks every arena's free chunks)

try:
    _trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):
    _trim = None


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def rss(pid: int | str = "self", field: str = "VmRSS") -> int:
    """A process's resident set (VmRSS; VmHWM: its peak), in bytes; 0 where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":")), 0)
    except OSError:
        return 0


def give_back_memory() -> int:
    """malloc_trim(0) unless G5G_GIVE_BACK_MEMORY=0: the resident bytes it gave back (0: off, or nothing to give)."""
    if _trim is None or not enabled():
        return 0
    before = rss()
    _trim(0)
    return max(0, before - rss())


class Trimmer:
    """Decides, request by request, when a trim is worth it: after one whose body and answer reach `large` bytes
    (never per token: a stream counts its chunks until it ends), no sooner than `gap_s` after the last. A large
    request too soon after the last trim leaves its trim pending, done after the first request to end once the gap
    has passed. `on_trim(released_bytes)` counts each (serving/core/metrics.py)."""

    def __init__(self, on_trim: Callable[[int], None] = lambda released: None, large: int = LARGE,
                 gap_s: float = GAP_S, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[], int] = give_back_memory):
        self.on_trim, self.large, self.gap_s, self.clock, self.trim = on_trim, large, gap_s, clock, trim
        self.last = float("-inf")
        self.pending = False

    def due(self, nbytes: int) -> bool:
        """A request of `nbytes` (body + answer) ended: whether to trim now (the caller then calls run())."""
        if not enabled():
            return False
        self.pending |= nbytes >= self.large
        if not self.pending or self.clock() - self.last < self.gap_s:
            return False
        self.pending, self.last = False, self.clock()
        return True

    def run(self) -> int:
        """The trim (thread-safe: the API layer runs it off its event loop); the bytes it gave back."""
        released = self.trim()
        self.on_trim(released)
        return released
