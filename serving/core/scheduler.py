"""The engine thread and its queue (Scheduler), a request's work as that thread sees it (Job), and the refusal of
one more than the queue holds (QueueFull). serving/api/app.py runs the Scheduler; the endpoints
(serving/api/completions.py) submit Jobs to it. A job's failure is one of the core's own errors (SchedulerError), sent as the job's event or
raised by submit; the API layer (serving/api/answers.py) gives each its HTTP status and OpenAI error body.

A failed join or step is reported to its requests (GenerationFailed: a 500) and the engine goes on: one bad
request, or one request's out-of-memory, costs that request only. A device error (DEVICE_ERRORS: a poisoned CUDA
context, an XLA device failure) or FATAL_AFTER failed steps in a row (joins, one request's own, never count) mean
every later step fails too: the engine is dead (`dead` says why), every request in hand and in the queue gets an
EngineFailed (a 503) naming it, new ones are refused, and the loop ends, so that the server can exit
(serving/api/app.py) and its orchestrator restart it (as vLLM's engine-dead exit).
"""
from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from serving.core.generation import Batch, Finish, SamplingParams, TokenizerInfo
from serving.core.metrics import Metrics
from serving.engine import Engine

log = logging.getLogger(__name__)

FATAL_AFTER = 3         # failed decode steps, no step done between, after which the engine is dead
# A request's own failure, however it is worded (an allocation past the device's memory): never fatal alone.
PER_REQUEST_ERRORS = re.compile(r"out of memory|RESOURCE_EXHAUSTED|OutOfMemory", re.I)
# A device that fails every call from now on: a sticky CUDA error (an illegal address, an Xid, an ECC error, a
# device-side assert), XLA's device errors.
DEVICE_ERRORS = re.compile(r"CUDA error|CUDA_ERROR_|cudaError|CUBLAS_STATUS_EXECUTION_FAILED|illegal memory access|"
                           r"illegal address|misaligned address|unspecified launch failure|device-side assert|"
                           r"ECC error|Xid|DEVICE_LOST|device lost|INTERNAL: .*(?:CUDA|GPU|device)", re.I)


def fatal(e: BaseException, failures: int) -> str | None:
    """Why a failed engine call (the `failures`-th in a row) means the engine is dead, or None."""
    text = f"{type(e).__name__}: {e}"
    if failures >= FATAL_AFTER:
        return f"{failures} engine steps failed in a row, the last: {text[:300]}"
    if DEVICE_ERRORS.search(text) and not PER_REQUEST_ERRORS.search(text):
        return f"device error: {text[:300]}"
    return None


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
    choices: int = 1              # how many jobs the request has (n per prompt)
    grammar: Any = None           # serving/shaping/grammar.py: the grammar the output follows (None: free text)
    stops: Any = None             # params.stop's serving.core.detokenize.StopAutomaton, built off the engine thread
    reveal: frozenset[int] = frozenset()    # special tokens shown in the text (tool-call markup)
    # Shared by a request's n choices: set once any of them has a slot. The request then waits no more: its other
    # choices take slots as they come free and never expire (vLLM runs the n choices as one request).
    started: threading.Event = field(default_factory=threading.Event)

    def send(self, ev: Any) -> None:
        """From the engine thread: hand an event, as (index, event), to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, ev))
        except RuntimeError:             # the server is shutting down: its loop is gone
            self.cancelled.set()


class SchedulerError(Exception):
    """Why the engine core did not run a job; its message is the client's (the API layer adds the status)."""


class QueueFull(SchedulerError):
    """submit: every slot and waiting place is taken."""


class QueueTimeout(SchedulerError):
    """The job waited past --max-queue-wait with none of its request's choices started."""


class GenerationFailed(SchedulerError):
    """The job's join or a step it was in failed; the engine goes on."""


class EngineFailed(SchedulerError):
    """The engine is dead (Scheduler.dead says why): no job runs again."""


class Scheduler:
    """A FIFO of jobs and the engine thread that runs them, continuously batched over the runtime's slots:
    between two decode steps, waiting jobs join free slots and finished ones leave. Free slots go, turn about, to the
    oldest waiting job and to the request with the fewest choices started (`_take`).

    The bound (`--max-waiting`): a request is admitted while fewer than `slots + max_waiting` admitted requests
    are unfinished, counting the ones running and the ones waiting whose client is still there. So
    `max_waiting` is exactly how many requests may wait while every slot is busy, whatever their arrival timing;
    0 means no queue (a request is admitted only when a slot is free).

    The wait (`--max-queue-wait`, seconds; 0: none): a request none of whose choices has a slot that long after it
    arrived is answered 429 (its stream too: a stream's headers wait for its first event), rather than waiting on
    for minutes (a CPU server with one slot). Its choices are timed together: once one has a slot, the others wait
    for theirs without a deadline.
    """

    def __init__(self, metrics: Metrics, max_waiting: int, max_queue_wait: float = 0.0):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.metrics = metrics
        self.max_waiting, self.max_queue_wait = max_waiting, max_queue_wait
        self.queued: deque[Job] = deque()   # waiting for a slot, in arrival order
        self._oldest_turn = True            # which of _take's two rules gives the next free slot
        self.wake = threading.Condition()   # guards queued
        self.pending = 0                    # taken from the queue by the engine thread, not in the batch yet
        self.joining: list[Job] = []        # those jobs (abort_all ends them too)
        self.stopping = threading.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.engine: Engine | None = None
        self.batch: Batch | None = None
        self.info: TokenizerInfo | None = None
        self.beat = time.monotonic()        # the engine thread's last sign of life: a join, a step or an idle wait ended
        self.failures = 0                   # failed engine calls in a row
        self.dead: str | None = None        # why the engine is dead (fatal); set once, never cleared

    @property
    def slots(self) -> int:
        return self.engine.slots if self.engine is not None else 1

    def _live(self) -> int:
        # Clients that left while queued stay in the FIFO until the engine thread drops them; they hold no slot.
        return sum(not j.cancelled.is_set() for j in self.queued)

    def _running(self) -> int:
        # A job joins the batch before it stops being pending: a race can only over-count (refuse), never admit more.
        return (len(self.batch.live) if self.batch else 0) + self.pending

    def busy(self) -> bool:
        with self.wake:
            return self._running() > 0 or self._live() > 0

    def stalled_for(self) -> float:
        """Seconds the engine thread has had work in hand without finishing a join or a step (0 while idle: an idle
        thread wakes at least once a second and beats)."""
        return time.monotonic() - self.beat if self.busy() else 0.0

    @property
    def capacity(self) -> int:
        """The most jobs admitted at once (running or waiting)."""
        return self.slots + self.max_waiting

    def submit(self, *jobs: Job) -> None:
        """Admit all of `jobs` (a request's n choices) or none."""
        with self.wake:
            if self.dead:
                raise EngineFailed(f"engine failed: {self.dead}")
            if self._running() + self._live() + len(jobs) > self.capacity:
                raise QueueFull(f"server busy: {self.max_waiting} requests already waiting; retry later")
            self.queued.extend(jobs)
            self.metrics.set_queue(self._live())
            self.wake.notify()

    def abort_all(self) -> int:
        """Shutdown past its grace period: end every queued job now and the running ones at their next token.
        Returns how many requests were aborted."""
        with self.wake:
            dropped, self.queued = list(self.queued), deque()
            # taken from the queue but not started (a long prefill holds the engine thread), and running
            running = list(self.batch.live.values()) if self.batch else []
            started = [*self.joining, *(live.job for live in running)]
        n = 0
        for job in dropped:
            n += not job.cancelled.is_set()
            job.shutdown = True
            job.cancelled.set()
            fin = Finish("abort", len(job.prompt_ids), 0, [])
            self.metrics.finished(job.arrival, fin, running=self._running())
            job.send(fin)
        for job in {id(j): j for j in started}.values():
            if not job.cancelled.is_set():
                job.shutdown = True
                job.cancelled.set()
                n += 1
        self.metrics.set_queue(0)
        return n

    async def run(self) -> None:
        self.batch, self.beat = Batch(self.engine, self.info), time.monotonic()
        await asyncio.get_running_loop().run_in_executor(self.executor, self._loop)

    def cancel_all(self) -> None:
        """Server shutdown: every job ends (live ones when the engine thread sees the flag)."""
        self.stopping.set()
        with self.wake:
            for job in self.queued:
                job.cancelled.set()
            self.wake.notify()

    def _loop(self) -> None:
        """Engine thread: admit, step, hand every event to its request's coroutine, until the server stops."""
        batch = self.batch
        while not self.stopping.is_set():
            self._expire()
            with self.wake:
                while not self.queued and not batch.live and not self.stopping.is_set():
                    self.wake.wait(timeout=1.0)
                    self.beat = time.monotonic()
                joining = self._take(batch.free)
                for job in joining:
                    job.started.set()
                self.pending, self.joining = len(joining), joining
                self.metrics.set_queue(self._live(), running=len(batch.live) + len(joining))
            for i, job in enumerate(joining):
                pending = len(joining) - i - 1          # admitted, not joined yet: they count as running
                self.metrics.queue_time.observe(time.monotonic() - job.arrival)
                try:
                    self._emit(batch.join(job), pending)     # a prefill done proves no decode step works
                except Exception as e:    # a runtime bug must not kill the engine thread: report it to this request
                    self._fail([job], e, pending, in_step=False)
                self.pending, self.beat = pending, time.monotonic()
                if self.dead:
                    break
            with self.wake:
                self.joining = []
            if self.dead:
                break
            try:
                if batch.live:
                    self._emit(batch.step())
                    self.failures = 0
            except Exception as e:
                self._fail(batch.drop_all(), e)
            if self.dead:
                break
            self.beat = time.monotonic()
            self.metrics.set_queue(self._live(), running=len(batch.live))
            self._kv_usage()
        for job in batch.drop_all():
            job.cancelled.set()

    def _take(self, free: int) -> list[Job]:
        """Up to `free` queued jobs. Turn about: the oldest one (no request waits for ever), then the first one of
        the request with the fewest choices started (a request's jobs are queued in index order and each is the
        next of its siblings to start, so its index is how many of them have). A request that comes behind n
        choices thus gets the next free slot, rather than waiting for all n (n=64 x 220 tokens held every other
        client for minutes, then a 429), and the oldest request still gets every other one.
        A request with more choices than there are slots holds at most all slots but one (`_may_take`)."""
        held = Counter(id(live.job.events) for live in self.batch.live.values()) if self.batch else Counter()
        taken = []
        for _ in range(min(free, len(self.queued))):
            eligible = [j for j in self.queued if self._may_take(j, held)]
            if not eligible:
                break
            oldest = eligible[0]
            job = oldest if self._oldest_turn else min(eligible, key=lambda j: j.index)
            self._oldest_turn = job is not oldest       # the oldest served, by either rule: the next is the other's
            self.queued.remove(job)
            held[id(job.events)] += 1
            taken.append(job)
        return taken

    def _may_take(self, job: Job, held: Counter) -> bool:
        """Whether `job` may have a free slot, its request holding held[id(job.events)] of them. One that cannot
        finish in one pass (more choices than slots) leaves the last slot to other requests: otherwise every slot
        ends its choices at about the same step, and another client's chat waited for a whole choice (n=64 x 220
        tokens: 0.9-1.2 s on the CPU, JAX's 8 slots). It then takes ceil(n / (slots - 1)) passes, not
        ceil(n / slots); a request that fits (n <= slots) is never held back."""
        return job.choices <= self.slots or self.slots < 2 or held[id(job.events)] < self.slots - 1

    def _expire(self) -> None:
        """Engine thread: a QueueTimeout (a 429) for each job of a request that waited past max_queue_wait with none
        of its choices started. The whole FIFO is looked at (at most slots + max_waiting jobs): a job that may not
        expire (a sibling started) keeps the ones behind it from expiring."""
        if not self.max_queue_wait:
            return
        too_old = time.monotonic() - self.max_queue_wait
        with self.wake:
            expired = [j for j in self.queued if j.arrival < too_old and not j.started.is_set()]
            if expired:
                gone = set(map(id, expired))
                self.queued = deque(j for j in self.queued if id(j) not in gone)
        for job in expired:
            job.cancelled.set()
            self.metrics.finished(job.arrival, Finish("abort", len(job.prompt_ids), 0, []), running=self._running())
            job.send(QueueTimeout(f"server busy: no slot came free within {self.max_queue_wait:g} s "
                                  f"(--max-queue-wait); retry later"))
        if expired:
            self.metrics.set_queue(self._live())

    def _kv_usage(self) -> None:
        filled = sum(live.gen.prompt_tokens + len(live.gen.times) for live in self.batch.live.values())
        self.metrics.kv_usage.set(filled / (self.slots * self.engine.max_context))

    def _emit(self, events, pending: int = 0) -> None:
        for job, ev in events:
            if isinstance(ev, Finish):           # before the client can see the end
                self.metrics.finished(job.arrival, ev, running=len(self.batch.live) + pending)
                self._kv_usage()
            job.send(ev)

    def _fail(self, jobs: list[Job], e: Exception, pending: int = 0, in_step: bool = True) -> None:
        """A failed join (one request's prefill, which its own input may have failed: never counted, or clients
        could stop the server with FATAL_AFTER bad requests) or step (counted towards FATAL_AFTER)."""
        log.exception("generation failed")
        self.failures += in_step
        why = fatal(e, self.failures if in_step else 0)
        if why:
            return self._die(why, jobs)
        self._kv_usage()
        for job in jobs:
            self.metrics.finished(job.arrival, Finish("abort", len(job.prompt_ids), 0, []),
                                  running=len(self.batch.live) + pending)
            job.send(GenerationFailed(f"generation failed: {type(e).__name__}: {e}"))

    def _die(self, why: str, failed: list[Job]) -> None:
        """The engine is dead: every job in hand (`failed`, the batch's, those joining) and in the queue gets an
        EngineFailed (a 503) naming why, new ones are refused (submit), and the engine loop stops."""
        log.critical("engine dead: %s", why)
        with self.wake:
            self.dead = why
            queued, self.queued = list(self.queued), deque()
            self.stopping.set()
        error = EngineFailed(f"engine failed: {why}; the server is exiting")
        jobs = {id(j): j for j in [*failed, *self.batch.drop_all(), *self.joining, *queued]}
        for job in jobs.values():
            job.cancelled.set()
            self.metrics.finished(job.arrival, Finish("abort", len(job.prompt_ids), 0, []), running=0)
            job.send(error)
        self.metrics.set_queue(0, running=0)

    def call(self, fn: Callable, *args):
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
