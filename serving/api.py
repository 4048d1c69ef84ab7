"""OpenAI-compatible HTTP API over any serving.engine.Engine (FastAPI + uvicorn).

Generation runs in one engine thread (the event loop stays free to accept, stream and answer /health and
/metrics), continuously batched over the runtime's slots, behind a FIFO queue with a bound: requests take free
slots in order of arrival, beyond the bound the client gets a 429 at once. A client that goes away (mid-stream
or while queued) frees its slot: its generation stops at the next token.

Endpoints: POST /v1/chat/completions (JSON or SSE), GET /v1/models, GET /health (200 only once the model is
loaded and a warm-up produced a token), GET /metrics (Prometheus text, vLLM's metric names and model_name label).
Every error is an OpenAI error body {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.engine import Engine
from serving.generation import Batch, Delta, Finish, SamplingParams, TokenizerInfo

log = logging.getLogger("serving.api")
disable_created_metrics()

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


# ------------------------------------------------------------------------------------------------ errors
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# ----------------------------------------------------------------------------------------------- request
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: str
    text: str | None = None


class Message(_Strict):
    role: str
    content: str | list[TextPart] | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatRequest(_Strict):
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    ignore_eos: bool = False
    logprobs: bool | None = None
    tools: list | None = None


_FIELDS = {f for m in (ChatRequest, Message, TextPart, StreamOptions) for f in m.model_fields}


def _param(loc: tuple) -> str:
    """The request path of a validation error: pydantic puts union members ('str', 'list[str]') in `loc`,
    which are not part of the request, so the path ends where they begin."""
    out = []
    for p in loc:
        if not (isinstance(p, int) or p in _FIELDS):
            break
        out.append(str(p))
    return ".".join(out)


def _parse(body: bytes) -> ChatRequest:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}")
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        req = ChatRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param(first["loc"])
        raise APIError(400, f"{param}: {first['msg']}", param=param)
    if req.n not in (None, 1):
        raise APIError(400, "n > 1 is not supported (one choice per request)", param="n")
    if req.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs")
    if req.tools:
        raise APIError(400, "tools are not supported by this server", param="tools")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return req


def _messages(req: ChatRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise APIError(400, f"messages[{i}].role: unsupported role {m.role!r} "
                                f"(expected one of {', '.join(ROLES)})", param=f"messages.{i}.role")
        if isinstance(m.content, list):
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                                   param=f"messages.{i}.content")
            content = "".join(p.text for p in m.content)
        elif m.content is None:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}].content is required", param=f"messages.{i}.content")
            content = ""
        else:
            content = m.content
        out.append({"role": ROLES[m.role], "content": content})
    return out


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
@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.monotonic)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def send(self, ev: Any) -> None:
        """From the engine thread: hand an event to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:             # the server is shutting down: its loop is gone
            self.cancelled.set()


class QueueFull(Exception):
    pass


class Scheduler:
    """A FIFO of jobs and the engine thread that runs them, continuously batched over the runtime's slots:
    between two decode steps, waiting jobs join free slots in order of arrival and finished ones leave."""

    def __init__(self, metrics: Metrics, max_waiting: int):
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.queued: collections.deque[Job] = collections.deque()   # waiting for a slot, in arrival order
        self.wake = threading.Condition()
        self.stopping = threading.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.engine: Engine | None = None
        self.batch: Batch | None = None
        self.info: TokenizerInfo | None = None

    def submit(self, job: Job) -> None:
        with self.wake:
            # Clients that left while queued stay in the FIFO until the engine thread drops them; they hold no slot.
            if sum(not j.cancelled.is_set() for j in self.queued) >= self.max_waiting:
                raise QueueFull
            self.queued.append(job)
            self.metrics.set_queue(len(self.queued))
            self.wake.notify()

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
            with self.wake:
                while not self.queued and not batch.live and not self.stopping.is_set():
                    self.wake.wait(timeout=1.0)
                joining = [self.queued.popleft() for _ in range(min(batch.free, len(self.queued)))]
                self.metrics.set_queue(len(self.queued), running=len(batch.live) + len(joining))
            for i, job in enumerate(joining):
                pending = len(joining) - i - 1          # admitted, not joined yet: they count as running
                try:
                    self._emit(batch.join(job), pending)
                except Exception as e:    # a runtime bug must not kill the engine thread: report it to this request
                    self._fail([job], e, pending)
            try:
                self._emit(batch.step())
            except Exception as e:
                self._fail(batch.drop_all(), e)
            self.metrics.set_queue(len(self.queued), running=len(batch.live))
        for job in batch.drop_all():
            job.cancelled.set()

    def _emit(self, events, pending: int = 0) -> None:
        for job, ev in events:
            if isinstance(ev, Finish):           # before the client can see the end
                self.metrics.finished(job.arrival, ev, running=len(self.batch.live) + pending)
            job.send(ev)

    def _fail(self, jobs: list[Job], e: Exception, pending: int = 0) -> None:
        log.exception("generation failed")
        for job in jobs:
            self.metrics.finished(job.arrival, Finish("abort", len(job.prompt_ids), 0, []),
                                  running=len(self.batch.live) + pending)
            job.send(APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error"))

    def call(self, fn: Callable, *args):
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


# --------------------------------------------------------------------------------------------------- app
def create_app(load_engine: Callable[[], Engine], model_dir: str | Path, served_model_name: str | None = None,
               max_waiting: int = 64, on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """`load_engine` runs in the engine thread after the server starts listening; /health is 503 until it
    returns and a warm-up has produced a token."""
    model_dir = Path(model_dir)
    name = served_model_name or model_dir.name
    metrics = Metrics(name)
    state: dict[str, Any] = {"ready": False, "error": None, "created": int(time.time())}

    async def startup(sched: Scheduler) -> None:
        try:
            sched.info = await asyncio.to_thread(TokenizerInfo.load, model_dir)
            t0 = time.monotonic()
            sched.engine = await sched.call(load_engine)
            warm = sched.info.chat_prompt([{"role": "user", "content": "Hello"}])
            # One prefill and one decode step: both code paths are compiled/warmed before we say ready.
            greedy = SamplingParams(temperature=0.0)
            await sched.call(lambda: sched.engine.step({0: sched.engine.start(0, warm, greedy)}))
            log.info("model %s ready in %.1fs (context %d)", name, time.monotonic() - t0, sched.engine.max_context)
            state["ready"] = True
        except asyncio.CancelledError:    # shut down while loading
            raise
        except BaseException as e:
            log.exception("loading %s failed", model_dir)
            state["error"] = f"{type(e).__name__}: {e}"
            if on_load_error:
                on_load_error(e)
            return
        await sched.run()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        sched = Scheduler(metrics, max_waiting)
        app.state.scheduler = sched
        task = asyncio.create_task(startup(sched))
        try:
            yield
        finally:
            task.cancel()
            sched.cancel_all()
            sched.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="g5g serving", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return APIError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                        else "server_error").response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("unexpected error")
        return APIError(500, f"internal error: {type(e).__name__}", "server_error").response()

    @app.get("/health")
    async def health():
        if state["ready"]:
            return JSONResponse({"status": "ok"})
        msg = f"model failed to load: {state['error']}" if state["error"] else "model is loading"
        return APIError(503, msg, "service_unavailable").response()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        sched: Scheduler = request.app.state.scheduler
        card = {"id": name, "object": "model", "created": state["created"], "owned_by": "g5g-images",
                "root": str(model_dir), "parent": None}
        if sched.engine is not None:
            card["max_model_len"] = sched.engine.max_context
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        sched: Scheduler = request.app.state.scheduler
        req = _parse(await request.body())
        if req.model is not None and req.model != name:
            raise APIError(404, f"The model `{req.model}` does not exist.", param="model", code="model_not_found")
        messages = _messages(req)
        if not state["ready"]:
            raise APIError(503, "model is loading", "service_unavailable")
        try:
            prompt = sched.info.chat_prompt(messages)
        except Exception as e:             # e.g. the template rejects the conversation
            raise APIError(400, f"chat template: {e}", param="messages")
        ctx = sched.engine.max_context
        max_tokens = req.max_completion_tokens or req.max_tokens
        if len(prompt) >= ctx or (max_tokens and len(prompt) + max_tokens > ctx):
            raise APIError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{len(prompt) + (max_tokens or 0)} tokens ({len(prompt)} in the messages, "
                                f"{max_tokens or 0} in the completion).", param="messages",
                           code="context_length_exceeded")
        d = sched.info.default_sampling
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        params = SamplingParams(
            temperature=req.temperature if req.temperature is not None else d.get("temperature", 1.0),
            top_p=req.top_p if req.top_p is not None else d.get("top_p", 1.0),
            top_k=max(0, req.top_k if req.top_k is not None else d.get("top_k", 0)),
            max_tokens=max_tokens or ctx - len(prompt), stop=stop, seed=req.seed, ignore_eos=req.ignore_eos)
        job = Job(prompt, params, asyncio.get_running_loop())
        try:
            sched.submit(job)
        except QueueFull:
            raise APIError(429, f"server busy: {sched.max_waiting} requests already waiting; retry later",
                           "rate_limit_error", code="rate_limit_exceeded")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(job, rid, created, name, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _complete(request, job, rid, created, name)

    return app


def _usage(fin: Finish) -> dict:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens}


async def _complete(request: Request, job: Job, rid: str, created: int, model: str) -> JSONResponse:
    async def watch_disconnect():
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
        job.cancelled.set()

    watcher = asyncio.create_task(watch_disconnect())
    parts = []
    try:
        while True:
            ev = await job.events.get()
            if isinstance(ev, APIError):
                raise ev
            if isinstance(ev, Delta):
                parts.append(ev.text)
                continue
            return JSONResponse({
                "id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                             "logprobs": None, "finish_reason": ev.reason}],
                "usage": _usage(ev)})
    finally:
        watcher.cancel()
        job.cancelled.set()


async def _stream(job: Job, rid: str, created: int, model: str, include_usage: bool):
    def chunk(delta: dict, finish: str | None = None) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            ev = await job.events.get()
            if isinstance(ev, Delta):
                if ev.text:
                    yield chunk({"content": ev.text})
            elif isinstance(ev, Finish):
                yield chunk({}, ev.reason)
                if include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                                 "model": model, "choices": [], "usage": _usage(ev)}) + "\n\n"
                break
            else:                          # an APIError from the engine thread, after headers went out
                yield f"data: {json.dumps({'error': {'message': ev.message, 'type': ev.type, 'param': None, 'code': None}})}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()               # client gone (or done): stop generating, free the slot
