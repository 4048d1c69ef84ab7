"""OpenAI-compatible HTTP API over any serving.engine.Engine (FastAPI + uvicorn): the app, its start-up, shutdown.

Generation runs in one engine thread (the event loop stays free to accept, stream and answer /health and
/metrics; tokenisation and the chat template run in other threads), continuously batched over the runtime's
slots, behind a FIFO queue with a bound: requests take free slots in order of arrival, beyond the bound the client
gets a 429 at once. A client that goes away (mid-stream or while queued) frees its slot: its generation stops at
the next token.

The engine thread and its queue are serving/core/scheduler.py's, the Prometheus metrics serving/core/metrics.py's. The
endpoints live by family: serving/api/completions.py (chat and completions), serving/api/tokenize.py; this module holds
what they share (Context) and the small ones (health, models, version, metrics, embeddings: refused, as vLLM
refuses them for a generate model).
Every error is an OpenAI error body {"error": {"message", "type", "param", "code"}} (serving/api/protocol.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from serving.api import completions, tokenize
from serving.engine import Engine
from serving.core.generation import SamplingParams, TokenizerInfo
from serving.core.metrics import Metrics
from serving.api.middleware import Guard, http_protocol
from serving.api.protocol import MESSAGE_CHARS, APIError, unavailable
from serving.core.scheduler import Scheduler
from serving.shaping import heap
from serving.shaping.grammar_pool import Grammars

log = logging.getLogger("serving.api")

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
    stall_limit: float = 0.0      # --engine-stall-timeout: /health is 503 once the engine is stuck this long (0: off)
    grammar_limits: dict = field(default_factory=dict)     # Grammars' workers, memory, cache_bytes (flags)

    @property
    def info(self) -> TokenizerInfo:
        return self.scheduler.info

    @property
    def max_context(self) -> int:
        return self.scheduler.engine.max_context

    def max_messages(self) -> int | None:
        """The most chat messages that can fit the context (protocol.MESSAGE_CHARS each at least), refused before
        validation past that; None until the model is served (check_serving answers then)."""
        return self.info.char_bound(self.max_context) // MESSAGE_CHARS if self.ready else None

    @functools.cached_property
    def grammars(self) -> Grammars:
        return Grammars(self.info, self.scheduler.engine.vocab_size, **self.grammar_limits)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def check_serving(self) -> None:
        if self.scheduler.dead:
            raise unavailable(f"engine failed: {self.scheduler.dead}; the server is exiting")
        if self.draining:
            raise unavailable("server is shutting down")
        if not self.ready:
            raise unavailable(f"model failed to load: {self.error}" if self.error else "model is loading")

    def check_alive(self) -> None:
        """/health's question beyond check_serving: has the engine moved lately when it has work?"""
        self.check_serving()
        if self.stall_limit and (stalled := self.scheduler.stalled_for()) > self.stall_limit:
            raise unavailable(f"engine stalled: work in hand and no step done for {stalled:.0f} s "
                              f"(--engine-stall-timeout {self.stall_limit:g})")

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
               cors: dict | None = None, body_timeout_s: float = 10.0, max_queue_wait: float = 60.0,
               grammar_limits: dict | None = None, body_total_timeout_s: float = 60.0,
               engine_stall_timeout: float = 0.0, tokenizer_beside_engine: bool = False) -> FastAPI:
    """`load_engine` runs in the engine thread after the server starts listening; /health is 503 until it
    returns and a warm-up has produced a token. `app.state.begin_shutdown(on_drained=None)` (thread-safe; `Server`
    calls it on SIGTERM) starts the drain: new requests get 503, running ones `shutdown_grace` seconds to finish, then
    every open stream ends with finish_reason "abort" and [DONE] and every other request gets a 503.
    `engine_stall_timeout` (seconds, 0: off): /health is also 503 while the engine has work and has finished no
    prefill or decode step for that long (a wedged CUDA call), so a liveness probe on /health restarts the pod.
    An engine that dies (serving/core/scheduler.py: a device error, or failures in a row) turns /health 503 at once and
    is handed to `on_load_error` as EngineDead, as a failed load is: `python -m serving` exits 1.
    `tokenizer_beside_engine`: the tokenizer loads while `load_engine` runs, for a loader that never imports
    transformers (else first)."""

    model_dir = Path(model_dir)
    name = served_model_name or model_dir.name
    metrics = Metrics(name)
    ctx = Context(name, model_dir, metrics, Scheduler(metrics, max_waiting, max_queue_wait),
                  stall_limit=engine_stall_timeout,
                  grammar_limits=grammar_limits or {})
    app = FastAPI(title="g5g serving", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_lifespan(ctx, load_engine, on_load_error, shutdown_grace, tokenizer_beside_engine))
    app.state.ctx = ctx
    app.state.begin_shutdown = lambda on_drained=None: on_drained and on_drained()    # replaced once it runs
    app.add_middleware(Guard, max_body_bytes=max_body_bytes, api_key=api_key, body_timeout_s=body_timeout_s,
                       body_total_timeout_s=body_total_timeout_s, heap=heap.Trimmer(metrics.trimmed))
    cors = {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["*"], "allow_credentials": False,
            **(cors or {})}
    app.add_middleware(CORSMiddleware, **cors)       # outermost: preflights never need the API key
    for exc, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(exc, handler)
    for r in (router, completions.router, tokenize.router):
        app.include_router(r)
    return app


async def _startup(ctx: Context, load_engine: Callable[[], Engine],
                   on_load_error: Callable[[BaseException], None] | None, tokenizer_beside_engine: bool) -> None:
    """Load the tokenizer and the engine, warm both code paths up, say ready, then run the engine thread."""
    sched = ctx.scheduler
    try:
        t0, took = time.monotonic(), {}

        def timed(name: str, fn: Callable):
            def run():
                start = time.monotonic()
                out = fn()
                took[name] = time.monotonic() - start
                return out
            return run

        # The tokenizer (importing transformers: ~11 s of an H100 host's 27 s warm JAX boot) beside the engine's
        # load where that load never imports transformers; otherwise before it, since transformers' names resolve
        # lazily and not thread-safely (side by side, CI saw "cannot import name 'AutoConfig' from 'transformers'").
        load_tokenizer = timed("tokenizer", lambda: TokenizerInfo.load(ctx.model_dir))
        tokenizer = asyncio.create_task(asyncio.to_thread(load_tokenizer))
        if not tokenizer_beside_engine:
            await tokenizer
        # gather raises the first failure as it happens: a refused tokenizer never waits for the engine
        sched.info, sched.engine = await asyncio.gather(tokenizer, sched.call(timed("engine", load_engine)))
        t_warm = time.monotonic()
        warm = sched.info.chat_prompt([{"role": "user", "content": "Hello"}])
        # A prefill and a decode step: both code paths are compiled/warmed before we say ready; one step per slot
        # in the engine's warm_slots (default slot 0), for an engine whose decode shape follows the highest live slot.
        greedy = SamplingParams(temperature=0.0)
        for slot in getattr(sched.engine, "warm_slots", (0,)):
            await sched.call(lambda s=slot: sched.engine.step({s: sched.engine.start(s, warm, greedy)}))
        now = time.monotonic()
        summary = getattr(sched.engine, "boot_summary", None)     # its compiles (torch_runtime/compile_cache.py)
        log.info("boot: warm-up %.1fs (tokenizer %.1fs, %s the engine's %.1fs)%s", now - t_warm, took["tokenizer"],
                 "beside" if tokenizer_beside_engine else "then", took["engine"], f"; {summary()}" if summary else "")
        log.info("model %s ready in %.1fs (context %d)", ctx.name, now - t0, sched.engine.max_context)
        # What boot made (torch, transformers, the tokenizers: millions of objects) lives as long as the server:
        # out of the collector's sight, a full collection a request's allocations set off (one that holds every
        # thread, the event loop's too) walks that request's objects only, not the whole process (as vLLM).
        gc.collect()
        gc.freeze()
        # what loading freed (the checkpoint's host copies, the compiles' garbage) goes back: 460 MiB of the tiny
        # JAX server's RSS after a cold boot on the CPU (benchmarks/RESULTS.md)
        if heap.enabled():
            ctx.metrics.trimmed(await asyncio.to_thread(heap.give_back_memory))
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
    if sched.dead and on_load_error:        # the engine died (serving/core/scheduler.py): the server exits non-zero
        on_load_error(EngineDead(sched.dead))


class EngineDead(RuntimeError):
    """The engine failed past recovery after it loaded (Scheduler.dead says why)."""


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
              on_load_error: Callable[[BaseException], None] | None, shutdown_grace: float,
              tokenizer_beside_engine: bool):
    """The app's lifespan: start loading as the server starts listening; app.state.begin_shutdown starts one drain."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop, drains = asyncio.get_running_loop(), []

        def start_drain(on_drained: Callable[[], None] | None) -> None:
            if not drains:                                   # a second signal does not start a second drain
                drains.append(loop.create_task(_drain(ctx, shutdown_grace)))   # held: the loop keeps weak refs
                if on_drained is not None:
                    drains[0].add_done_callback(lambda _: on_drained())

        app.state.begin_shutdown = lambda on_drained=None: loop.call_soon_threadsafe(start_drain, on_drained)
        task = asyncio.create_task(_startup(ctx, load_engine, on_load_error, tokenizer_beside_engine))
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


async def _client_gone(_: Request, e: ClientDisconnect):
    # The connection closed before the body came whole (the HTTP parser refused the rest, and its one warning line
    # says so) or before the answer (answers.collect). Nobody reads this answer, and it is no error of the
    # server's: nothing to log.
    return APIError(400, "the connection closed before the answer").response()


async def _unexpected(_: Request, e: Exception):
    log.exception("unexpected error")
    return APIError(500, f"internal error: {type(e).__name__}", "server_error").response()


ERROR_HANDLERS = {APIError: _api_error, StarletteHTTPException: _http_error, ClientDisconnect: _client_gone,
                  Exception: _unexpected}


# ----------------------------------------------------------------------------------------- small routes
router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request):
    request.app.state.ctx.check_alive()
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
    """uvicorn with our shutdown: SIGTERM/SIGINT start the app's drain (see create_app) while the server still
    listens (a new request gets a 503, not a refused connection); uvicorn's own shutdown follows the drain. The
    process exits with its own status (0 after a drain) instead of re-raising the signal. A second signal ends the
    drain's wait (a third SIGINT forces the exit)."""
    draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if self.draining:
            return super().handle_exit(sig, frame)
        self.draining = True
        self.config.app.state.begin_shutdown(lambda: super(Server, self).handle_exit(sig, frame))

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


def connection_limit(wanted: int, spare: int = 128) -> int:
    """At most `wanted` connections (0: as many as descriptors allow), and always `spare` descriptors fewer than
    the process may open (its soft limit raised to the hard one first, as vLLM raises it), so that accepting one
    more never fails for want of a descriptor (model files, compile pipes, the answer to that connection)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    room = max(1, soft - spare) if soft != resource.RLIM_INFINITY else wanted or 2**20
    return min(wanted, room) if wanted else room


def server(app: FastAPI, host: str, port: int, shutdown_grace: float, log_level: str = "info",
           header_timeout_s: float = 10.0, max_connections: int = 1024) -> Server:
    # uvicorn's own deadline is a backstop only: our drain answers every request by `shutdown_grace` (plus the
    # time the running generation takes to reach its next token).
    protocol = http_protocol(header_timeout_s, connection_limit(max_connections))
    return Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                                 timeout_graceful_shutdown=shutdown_grace + 10))
