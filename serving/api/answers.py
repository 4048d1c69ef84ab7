"""Answering a request from its jobs' events (serving/core/scheduler.py): the whole answer (collect, then
json_response, built off the event loop) or an SSE stream (stream), each stopping the generations once the
client hangs up; a stream's headers wait for its first event, so a refusal from the queue is its status. The
engine core's errors (serving/core/scheduler.py: SchedulerError) become HTTP here (api_error)."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from serving.core.generation import Delta, Finish, Logprob, PromptLogprob
from serving.api.protocol import APIError, unavailable
from serving.core.scheduler import EngineFailed, GenerationFailed, Job, QueueFull, QueueTimeout, SchedulerError

# Each of the core's errors as the API answers it: status, OpenAI error type, code.
_STATUS = {QueueFull: (429, "rate_limit_error", "rate_limit_exceeded"),
           QueueTimeout: (429, "rate_limit_error", "rate_limit_exceeded"),
           GenerationFailed: (500, "server_error", None),
           EngineFailed: (503, "service_unavailable", None)}


def api_error(e: SchedulerError) -> APIError:
    """The HTTP answer to a job the core did not run: the core's message, with the status and body type vLLM's
    server gives it."""
    status, type_, code = _STATUS[type(e)]
    return APIError(status, str(e), type_, code=code)


async def json_response(build: Callable[[], dict]) -> Response:
    """The answer `build` makes, built and serialised in a worker thread, one choice at a time: n=64 choices with 20
    top logprobs per token are 19 MB of JSON, which held the event loop (and /health) for 2 s, and json.dumps holds
    the GIL for the whole of one call (0.4 s for those 19 MB on a loaded 2-core box)."""
    def body() -> bytes:
        answer = build()
        choices = ",".join(map(_dumps, answer["choices"]))
        # `"choices":[]` can only be the key: a quote inside a string value is written escaped
        return _dumps({**answer, "choices": []}).replace('"choices":[]', f'"choices":[{choices}]', 1).encode()

    return Response(await asyncio.to_thread(body), media_type="application/json")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def sse(body: Any) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _stop_when_gone(request: Request, jobs: list[Job]) -> None:
    """Stops the jobs' generations once the client hangs up (a task, cancelled when the answer is done)."""
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
    for job in jobs:
        job.cancelled.set()


async def first_event(request: Request, jobs: list[Job]) -> tuple[int, Any]:
    """The jobs' first (index, event), awaited before a stream's headers go out, so that a request the queue
    refuses (429: no slot within --max-queue-wait), the engine fails or the shutdown aborts before it started
    (503) gets its status, not a 200 and an error event or an empty "abort". Stops the jobs if the client hangs up
    meanwhile."""
    watcher = asyncio.create_task(_stop_when_gone(request, jobs))
    try:
        head = await jobs[0].events.get()
        if isinstance(head[1], SchedulerError):
            raise api_error(head[1])
        if isinstance(head[1], Finish) and head[1].reason == "abort" and jobs[head[0]].shutdown:
            raise unavailable("server is shutting down: request aborted")      # before its headers: a 503
        return head
    except BaseException:
        for job in jobs:
            job.cancelled.set()
        raise
    finally:
        watcher.cancel()


async def collect(request: Request, jobs: list[Job]) -> list[tuple[str, list[Logprob], Finish, list | None]]:
    """Each choice's whole text, logprobs, end and prompt logprobs. Stops the generations if the client hangs up,
    and then raises ClientDisconnect (the app answers it without building anything)."""
    watcher = asyncio.create_task(_stop_when_gone(request, jobs))
    parts: list[list[str]] = [[] for _ in jobs]
    lps: list[list[Logprob]] = [[] for _ in jobs]
    prompts: list[list[PromptLogprob] | None] = [None] * len(jobs)
    fins: dict[int, Finish] = {}
    try:
        while len(fins) < len(jobs):
            i, ev = await jobs[0].events.get()
            if isinstance(ev, SchedulerError):
                raise api_error(ev)
            if isinstance(ev, Delta):
                parts[i].append(ev.text)
                if ev.logprob:
                    lps[i].append(ev.logprob)
                if ev.prompt:
                    prompts[i] = ev.prompt
                continue
            if jobs[i].shutdown and ev.reason == "abort":
                raise unavailable("server is shutting down: request aborted")
            fins[i] = ev
        if watcher.done() and not watcher.cancelled():
            # the client hung up and its choices were stopped: no answer to build (n=64 choices with logprobs are
            # seconds of JSON, which held every other client's request) and nobody to send it to
            raise ClientDisconnect()
        return [("".join(parts[i]), lps[i], fins[i], prompts[i]) for i in range(len(jobs))]
    finally:
        watcher.cancel()
        for job in jobs:
            job.cancelled.set()


async def stream(request: Request, jobs: list[Job], first: list[str], on_text: Callable[[int, Delta], list[str]],
                 on_finish: Callable[[int, Finish], list[str]], end: Callable[[list[Finish]], list[str]]):
    """SSE over the choices' events as they come (each chunk names its choice's index): what `on_text` makes of
    each token's Delta, what `on_finish` makes of each choice's end, then `end` and [DONE]. The headers go out with
    the first event (first_event)."""
    head = await first_event(request, jobs)

    async def events():
        try:
            for line in first:
                yield line
            fins: dict[int, Finish] = {}
            pending = [head]
            while len(fins) < len(jobs):
                i, ev = pending.pop() if pending else await jobs[0].events.get()
                if isinstance(ev, Delta):
                    for line in on_text(i, ev):
                        yield line
                elif isinstance(ev, Finish):
                    fins[i] = ev
                    for line in on_finish(i, ev):
                        yield line
                else:                      # a SchedulerError from the engine thread, after headers went out
                    yield sse({"error": api_error(ev).body()["error"]})
                    break
            else:
                for line in end([fins[i] for i in range(len(jobs))]):
                    yield line
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:               # client gone (or done): stop generating, free the slots
                job.cancelled.set()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
