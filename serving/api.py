"""OpenAI-compatible HTTP API over any serving.engine.Engine (FastAPI + uvicorn): the app, its scheduler, shutdown.

Generation runs in one engine thread (the event loop stays free to accept, stream and answer /health and
/metrics; tokenisation and the chat template run in other threads), continuously batched over the runtime's
slots, behind a FIFO queue with a bound: requests take free slots in order of arrival, beyond the bound the client
gets a 429 at once. A client that goes away (mid-stream or while queued) frees its slot: its generation stops at
the next token.

The endpoints live by family: serving/openai_text.py (chat and completions), serving/tokenization.py; this module
holds what they share (Context, Scheduler, Metrics) and the small ones (health, models, version, metrics,
embeddings: refused, as vLLM refuses them for a generate model).
Every error is an OpenAI error body {"error": {"message", "type", "param", "code"}} (serving/protocol.py).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import gc
import logging
import signal
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from serving import openai_text, tokenization
from serving.engine import Engine
from serving.generation import Batch, Finish, SamplingParams, TokenizerInfo
from serving.middleware import Guard, http_protocol
from serving.protocol import APIError, unavailable
from serving.scheduler import Job, QueueFull
from serving.structured import Grammars

log = logging.getLogger("serving.api")
disable_created_metrics()

# ----------------------------------------------------------------------------------------------- metrics
class Metrics:
    """vLLM's names and label, so dashboards and the bench's `gauge` mode read us like a vLLM server."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, ln = self.registry, ["model_name"]
        lat = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0, 160.0, 640.0)
        tok = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (from arrival).", ln,
                              buckets=lat, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", ln,
                             buckets=tok, registry=r).labels(model_name)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: (e2e latency - TTFT) / (output tokens - 1).", ln, buckets=tok,
                              registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", ln,
                             buckets=lat, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", ln,
                                         registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", ln,
                                     registry=r).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests.", ln + ["finished_reason"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests generating now.", ln,
                             registry=r).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued.", ln, registry=r).labels(model_name)
        counts = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5))      # vLLM's 1-2-5 series
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.", ln,
                                        buckets=counts, registry=r).labels(model_name)
        self.request_generation = Histogram("vllm:request_generation_tokens", "Generated tokens per finished "
                                            "request.", ln, buckets=counts, registry=r).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Arrival to prefill.", ln, buckets=lat,
                                    registry=r).labels(model_name)
        # Never incremented: a slot holds its request's whole context, so no request is ever preempted.
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted.", ln, registry=r).labels(model_name)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Share of the KV cache (slots x context) the running "
                              "requests' tokens fill, 0 to 1.", ln, registry=r).labels(model_name)
        self.model_name = model_name
        self.lock = threading.Lock()

    # Updates and scrapes hold one lock, so a scrape never sees a request both running and finished:
    # running + waiting + request_success_total (all reasons) = requests accepted so far.
    def set_queue(self, waiting: int, running: int | None = None) -> None:
        with self.lock:
            self.waiting.set(waiting)
            if running is not None:
                self.running.set(running)

    def finished(self, arrival: float, fin: Finish, running: int) -> None:
        """A request ended; `running` is how many still run, set in the same update (see above)."""
        with self.lock:
            self.running.set(running)
            self.success.labels(self.model_name, fin.reason).inc()
            prefilled = fin.completion_tokens > 0 or fin.reason != "abort"
            self.prompt_tokens.inc(fin.prompt_tokens if prefilled else 0)
            self.generation_tokens.inc(fin.completion_tokens)
            self.request_prompt.observe(fin.prompt_tokens if prefilled else 0)
            self.request_generation.observe(fin.completion_tokens)
            times = fin.token_times
            if fin.reason == "abort" or not times:
                return
            ttft, e2e = times[0] - arrival, times[-1] - arrival
            self.ttft.observe(ttft)
            self.e2e.observe(e2e)
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)
            if len(times) > 1:
                self.tpot.observe((e2e - ttft) / (len(times) - 1))

    def scrape(self) -> bytes:
        with self.lock:
            return generate_latest(self.registry)


# ------------------------------------------------------------------------------------------- scheduling
class Scheduler:
    """A FIFO of jobs and the engine thread that runs them, continuously batched over the runtime's slots:
    between two decode steps, waiting jobs join free slots in order of arrival and finished ones leave.

    The bound (`--max-waiting`): a request is admitted while fewer than `slots + max_waiting` admitted requests
    are unfinished, counting the ones running and the ones waiting whose client is still there. So
    `max_waiting` is exactly how many requests may wait while every slot is busy, whatever their arrival timing;
    0 means no queue (a request is admitted only when a slot is free).

    The wait (`--max-queue-wait`, seconds; 0: none): a job still waiting for a slot that long after it arrived is
    answered 429 (its stream too: a stream's headers wait for its first event), rather than waiting on for minutes
    (a CPU server with one slot).
    """

    def __init__(self, metrics: Metrics, max_waiting: int, max_queue_wait: float = 0.0):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.metrics = metrics
        self.max_waiting, self.max_queue_wait = max_waiting, max_queue_wait
        self.queued: deque[Job] = deque()   # waiting for a slot, in arrival order
        self.wake = threading.Condition()   # guards queued
        self.pending = 0                    # taken from the queue by the engine thread, not in the batch yet
        self.joining: list[Job] = []        # those jobs (abort_all ends them too)
        self.stopping = threading.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.engine: Engine | None = None
        self.batch: Batch | None = None
        self.info: TokenizerInfo | None = None

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

    @property
    def capacity(self) -> int:
        """The most jobs admitted at once (running or waiting)."""
        return self.slots + self.max_waiting

    def submit(self, *jobs: Job) -> None:
        """Admit all of `jobs` (a request's n choices) or none."""
        with self.wake:
            if self._running() + self._live() + len(jobs) > self.capacity:
                raise QueueFull
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
        self.batch = Batch(self.engine, self.info)
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
                joining = [self.queued.popleft() for _ in range(min(batch.free, len(self.queued)))]
                self.pending, self.joining = len(joining), joining
                self.metrics.set_queue(self._live(), running=len(batch.live) + len(joining))
            for i, job in enumerate(joining):
                pending = len(joining) - i - 1          # admitted, not joined yet: they count as running
                self.metrics.queue_time.observe(time.monotonic() - job.arrival)
                try:
                    self._emit(batch.join(job), pending)
                except Exception as e:    # a runtime bug must not kill the engine thread: report it to this request
                    self._fail([job], e, pending)
                self.pending = pending
            with self.wake:
                self.joining = []
            try:
                self._emit(batch.step())
            except Exception as e:
                self._fail(batch.drop_all(), e)
            self.metrics.set_queue(self._live(), running=len(batch.live))
            self._kv_usage()
        for job in batch.drop_all():
            job.cancelled.set()

    def _expire(self) -> None:
        """Engine thread: a 429 for each job that waited past max_queue_wait (the FIFO's oldest come first)."""
        if not self.max_queue_wait:
            return
        too_old = time.monotonic() - self.max_queue_wait
        with self.wake:
            expired = []
            while self.queued and self.queued[0].arrival < too_old:
                expired.append(self.queued.popleft())
        for job in expired:
            job.cancelled.set()
            self.metrics.finished(job.arrival, Finish("abort", len(job.prompt_ids), 0, []), running=self._running())
            job.send(APIError(429, f"server busy: no slot came free within {self.max_queue_wait:g} s "
                                   f"(--max-queue-wait); retry later", "rate_limit_error", code="rate_limit_exceeded"))
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

    def _fail(self, jobs: list[Job], e: Exception, pending: int = 0) -> None:
        log.exception("generation failed")
        self._kv_usage()
        for job in jobs:
            self.metrics.finished(job.arrival, Finish("abort", len(job.prompt_ids), 0, []),
                                  running=len(self.batch.live) + pending)
            job.send(APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error"))

    def call(self, fn: Callable, *args):
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


# ---------------------------------------------------------------------------------------------- context
@dataclass
class Context:
    """What every endpoint shares: app.state.ctx."""
    name: str
    model_dir: Path
    metrics: Metrics
    scheduler: Scheduler
    created: int = field(default_factory=lambda: int(time.time()))
    ready: bool = False
    error: str | None = None
    draining: bool = False

    @property
    def info(self) -> TokenizerInfo:
        return self.scheduler.info

    @property
    def max_context(self) -> int:
        return self.scheduler.engine.max_context

    @functools.cached_property
    def grammars(self) -> Grammars:
        return Grammars(self.info, self.scheduler.engine.vocab_size)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def check_serving(self) -> None:
        if self.draining:
            raise unavailable("server is shutting down")
        if not self.ready:
            raise unavailable(f"model failed to load: {self.error}" if self.error else "model is loading")

    def model_card(self) -> dict:
        card = {"id": self.name, "object": "model", "created": self.created, "owned_by": "g5g-images",
                "root": str(self.model_dir), "parent": None}
        if self.scheduler.engine is not None:
            card["max_model_len"] = self.max_context
        return card


def version() -> str:
    try:
        return metadata.version("g5g-images")
    except metadata.PackageNotFoundError:     # the images copy serving/ without installing the package
        return "0+unknown"


# --------------------------------------------------------------------------------------------------- app
def create_app(load_engine: Callable[[], Engine], model_dir: str | Path, served_model_name: str | None = None,
               max_waiting: int = 64, on_load_error: Callable[[BaseException], None] | None = None,
               shutdown_grace: float = 5.0, max_body_bytes: int = 16 * 2**20, api_key: str | None = None,
               cors: dict | None = None, body_timeout_s: float = 10.0, max_queue_wait: float = 60.0) -> FastAPI:
    """`load_engine` runs in the engine thread after the server starts listening; /health is 503 until it
    returns and a warm-up has produced a token. `app.state.begin_shutdown()` (thread-safe; `Server` calls it on
    SIGTERM) starts the drain: new requests get 503, running ones `shutdown_grace` seconds to finish, then
    every open stream ends with finish_reason "abort" and [DONE] and every other request gets a 503."""

    model_dir = Path(model_dir)
    name = served_model_name or model_dir.name
    metrics = Metrics(name)
    ctx = Context(name, model_dir, metrics, Scheduler(metrics, max_waiting, max_queue_wait))
    app = FastAPI(title="g5g serving", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_lifespan(ctx, load_engine, on_load_error, shutdown_grace))
    app.state.ctx = ctx
    app.state.begin_shutdown = lambda: None          # replaced once the server runs
    app.add_middleware(Guard, max_body_bytes=max_body_bytes, api_key=api_key, body_timeout_s=body_timeout_s)
    cors = {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["*"], "allow_credentials": False,
            **(cors or {})}
    app.add_middleware(CORSMiddleware, **cors)       # outermost: preflights never need the API key
    for exc, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(exc, handler)
    for r in (router, openai_text.router, tokenization.router):
        app.include_router(r)
    return app


async def _startup(ctx: Context, load_engine: Callable[[], Engine],
                   on_load_error: Callable[[BaseException], None] | None) -> None:
    """Load the tokenizer and the engine, warm both code paths up, say ready, then run the engine thread."""
    sched = ctx.scheduler
    try:
        sched.info = await asyncio.to_thread(TokenizerInfo.load, ctx.model_dir)
        t0 = time.monotonic()
        sched.engine = await sched.call(load_engine)
        warm = sched.info.chat_prompt([{"role": "user", "content": "Hello"}])
        # One prefill and one decode step: both code paths are compiled/warmed before we say ready.
        greedy = SamplingParams(temperature=0.0)
        await sched.call(lambda: sched.engine.step({0: sched.engine.start(0, warm, greedy)}))
        log.info("model %s ready in %.1fs (context %d)", ctx.name, time.monotonic() - t0, sched.engine.max_context)
        # What boot made (torch, transformers, the tokenizers: millions of objects) lives as long as the server:
        # out of the collector's sight, a full collection a request's allocations set off (one that holds every
        # thread, the event loop's too) walks that request's objects only, not the whole process (as vLLM).
        gc.collect()
        gc.freeze()
        ctx.ready = True
    except asyncio.CancelledError:    # shut down while loading
        raise
    except BaseException as e:
        log.exception("loading %s failed", ctx.model_dir)
        ctx.error = f"{type(e).__name__}: {e}"
        if on_load_error:
            on_load_error(e)
        return
    await sched.run()


async def _drain(ctx: Context, shutdown_grace: float) -> None:
    """New requests get 503; running and queued ones get `shutdown_grace` seconds, then are aborted."""
    sched = ctx.scheduler
    ctx.draining = True
    deadline = time.monotonic() + shutdown_grace
    log.info("shutting down: draining requests (up to %.1fs)", shutdown_grace)
    while sched.busy() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if sched.busy():
        log.warning("shutdown grace period (%.1fs) over: aborting %d request(s)", shutdown_grace,
                    sched.abort_all())


def _lifespan(ctx: Context, load_engine: Callable[[], Engine],
              on_load_error: Callable[[BaseException], None] | None, shutdown_grace: float):
    """The app's lifespan: start loading as the server starts listening; app.state.begin_shutdown starts one drain."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop, drains = asyncio.get_running_loop(), []

        def start_drain() -> None:
            if not drains:                                   # a second signal does not start a second drain
                drains.append(loop.create_task(_drain(ctx, shutdown_grace)))   # held: the loop keeps weak refs

        app.state.begin_shutdown = lambda: loop.call_soon_threadsafe(start_drain)
        task = asyncio.create_task(_startup(ctx, load_engine, on_load_error))
        try:
            yield
        finally:
            task.cancel()
            ctx.scheduler.cancel_all()
            ctx.scheduler.executor.shutdown(wait=False, cancel_futures=True)

    return lifespan


# ------------------------------------------------------------------------------------------------ errors
async def _api_error(_: Request, e: APIError):
    return e.response()


async def _http_error(_: Request, e: StarletteHTTPException):
    return APIError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                    else "server_error").response(headers=getattr(e, "headers", None))


async def _unexpected(_: Request, e: Exception):
    log.exception("unexpected error")
    return APIError(500, f"internal error: {type(e).__name__}", "server_error").response()


ERROR_HANDLERS = {APIError: _api_error, StarletteHTTPException: _http_error, Exception: _unexpected}


# ----------------------------------------------------------------------------------------- small routes
router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request):
    request.app.state.ctx.check_serving()
    return Response(status_code=200)


@router.api_route("/ping", methods=["GET", "POST", "HEAD"])    # SageMaker's health check, as vLLM
async def ping(request: Request):
    return await health(request)


@router.get("/version")
async def get_version():
    return {"version": version()}


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(request.app.state.ctx.metrics.scrape(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [request.app.state.ctx.model_card()]}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str):
    ctx = request.app.state.ctx
    ctx.check_model(model_id)
    return ctx.model_card()


@router.post("/v1/embeddings")
async def embeddings():
    # vLLM serves embeddings for pooling models only; Gemma 4 is a generate model, and vLLM answers the same.
    raise APIError(400, "The model does not support Embeddings API")


# ------------------------------------------------------------------------------------------------ server
class Server(uvicorn.Server):
    """uvicorn with our shutdown: SIGTERM/SIGINT start the app's drain (see create_app), and the process exits
    with its own status (0 after a drain) instead of re-raising the signal. A second SIGINT forces the exit."""

    def handle_exit(self, sig: int, frame) -> None:
        self.config.app.state.begin_shutdown()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def server(app: FastAPI, host: str, port: int, shutdown_grace: float, log_level: str = "info") -> Server:
    # uvicorn's own deadline is a backstop only: our drain answers every request by `shutdown_grace` (plus the
    # time the running generation takes to reach its next token).
    return Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http_protocol(),
                                 timeout_graceful_shutdown=shutdown_grace + 10))
