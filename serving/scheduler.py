"""A request's work as the engine thread sees it (Job) and the refusal of one more than the queue holds
(QueueFull): shared by serving/api.py's Scheduler and the endpoints that submit jobs (serving/openai_text.py)."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from serving.generation import SamplingParams


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.monotonic)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    shutdown: bool = False        # aborted because the server is shutting down (not because the client left)
    index: int = 0                # which of the request's `n` choices (its jobs share one `events` queue)
    grammar: Any = None           # serving/structured.py: the grammar the output follows (None: free text)
    stops: Any = None             # params.stop's serving.generation.StopAutomaton, built off the engine thread
    reveal: frozenset[int] = frozenset()    # special tokens shown in the text (tool-call markup)

    def send(self, ev: Any) -> None:
        """From the engine thread: hand an event, as (index, event), to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, ev))
        except RuntimeError:             # the server is shutting down: its loop is gone
            self.cancelled.set()


class QueueFull(Exception):
    pass
