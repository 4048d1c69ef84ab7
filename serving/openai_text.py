"""POST /v1/chat/completions and POST /v1/completions: a prompt in, generated text out (JSON or SSE).

Both share one path: parse (400s), check the model and readiness, build the prompt's token ids off the event loop
(the chat template and the tokenizer can take seconds on a long prompt), check the context, queue a Job, then
answer from the job's events. A client that leaves frees its slot; a server that shuts down ends every open
stream with finish_reason "abort" and [DONE] and answers every other request with a 503.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from serving.api import Job, QueueFull
from serving.generation import Delta, Finish, PromptTooLong, SamplingParams
from serving.protocol import APIError, ChatRequest, CompletionRequest, ResponseFormat, messages, parse, unavailable
from serving.structured import InvalidGrammar
from serving.tool_calls import GemmaCalls, NamedCall, Reader, RequiredCalls, merge, required_schema

router = APIRouter()


def context_error(ctx_len: int, n: int, max_tokens: int | None, where: str, exact: bool = True) -> APIError:
    some = "" if exact else "at least "
    return APIError(400, f"This model's maximum context length is {ctx_len} tokens. However, you requested "
                         f"{some}{n + (max_tokens or 0)} tokens ({some}{n} in the {where}, {max_tokens or 0} in "
                         f"the completion).", param=where, code="context_length_exceeded")


async def prompt_ids(ctx, build: Callable[[int], list[int]], max_tokens: int | None, where: str) -> list[int]:
    """Token ids from `build(limit)` in a worker thread; a 400 when they cannot fit the context."""
    ctx_len = ctx.max_context
    try:
        ids = await asyncio.to_thread(build, ctx_len)
    except PromptTooLong as e:
        raise context_error(ctx_len, e.tokens, max_tokens, where, e.exact) from None
    if not ids:
        raise APIError(400, f"{where} is empty", param=where)
    if len(ids) >= ctx_len or (max_tokens and len(ids) + max_tokens > ctx_len):
        raise context_error(ctx_len, len(ids), max_tokens, where)
    return ids


def sampling(ctx, req, prompt_len: int, max_tokens: int | None) -> SamplingParams:
    d = ctx.info.default_sampling
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        temperature=req.temperature if req.temperature is not None else d.get("temperature", 1.0),
        top_p=req.top_p if req.top_p is not None else d.get("top_p", 1.0),
        top_k=max(0, req.top_k if req.top_k is not None else d.get("top_k", 0)),
        max_tokens=ctx.max_context - prompt_len if max_tokens is None else max_tokens,
        stop=stop, seed=req.seed, ignore_eos=req.ignore_eos)


def tool_plan(req: ChatRequest) -> tuple[list[dict] | None, Callable[[], Reader], Any]:
    """What `tools` and `tool_choice` ask for (serving/tool_calls.py): (the tools the chat template shows, a new
    reader of the output, the JSON schema the output is forced to follow or None)."""
    tools = req.tools or []
    choice = req.tool_choice or "auto"
    if choice == "none" or (choice == "auto" and not tools):
        return None, Reader, None
    if not tools:
        raise APIError(400, f"tool_choice {json.dumps(choice) if isinstance(choice, str) else 'a function'} needs "
                            f"tools", param="tool_choice")
    shown = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "auto":
        return shown, GemmaCalls, None
    params = {t.function.name: t.function.parameters or {"type": "object", "properties": {}} for t in tools}
    if choice == "required":
        return shown, RequiredCalls, required_schema(params)
    name = choice.function.name
    if name not in params:
        raise APIError(400, f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    return shown, lambda: NamedCall(name), params[name]


def output_grammar(ctx, fmt: ResponseFormat | None, tool_schema: Any = None) -> Any:
    """The grammar the output follows (compiled here: call from a worker thread), or None for free text."""
    try:
        if tool_schema is not None:
            if fmt is not None and fmt.type != "text":
                raise APIError(400, "response_format cannot be combined with tool_choice \"required\" or a named "
                                    "function (the call's arguments are already JSON)", param="response_format")
            try:
                return ctx.grammars.json_schema(tool_schema)
            except InvalidGrammar as e:
                raise APIError(400, f"tools: a function's parameters are not a usable JSON schema: {e}",
                               param="tools") from None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ctx.grammars.json_object()
        if fmt.json_schema is None:
            raise InvalidGrammar("type json_schema needs json_schema: {\"name\": …, \"schema\": {…}}")
        return ctx.grammars.json_schema(fmt.json_schema.schema_)
    except InvalidGrammar as e:
        raise APIError(400, f"response_format: invalid JSON schema: {e}", param="response_format") from None


def submit(request: Request, ids: list[int], params: SamplingParams, grammar: Any = None,
           reveal: frozenset[int] = frozenset()) -> Job:
    ctx = request.app.state.ctx
    ctx.check_serving()                    # again: the server may have begun shutting down while we tokenised
    job = Job(ids, params, asyncio.get_running_loop(), grammar=grammar, reveal=reveal)
    try:
        ctx.scheduler.submit(job)
    except QueueFull:
        raise APIError(429, f"server busy: {ctx.scheduler.max_waiting} requests already waiting; retry later",
                       "rate_limit_error", code="rate_limit_exceeded") from None
    return job


def usage(fin: Finish) -> dict:
    return {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
            "total_tokens": fin.prompt_tokens + fin.completion_tokens}


def sse(body: Any) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
async def chat(request: Request):
    ctx = request.app.state.ctx
    req: ChatRequest = parse(ChatRequest, await request.body())
    ctx.check_model(req.model)
    msgs = messages(req.messages)
    tools, reader, tool_schema = tool_plan(req)
    ctx.check_serving()
    max_tokens = req.max_completion_tokens or req.max_tokens

    def build(limit: int) -> list[int]:
        try:
            text = ctx.info.render_chat(msgs, tools)
        except Exception as e:             # e.g. the template rejects the conversation
            raise APIError(400, f"chat template: {e}", param="messages") from None
        return ctx.info.encode(text, limit=limit)

    ids = await prompt_ids(ctx, build, max_tokens, "messages")
    grammar = await asyncio.to_thread(output_grammar, ctx, req.response_format, tool_schema)
    reader = reader()
    reveal = ctx.info.tool_markup if isinstance(reader, GemmaCalls) else frozenset()
    job = submit(request, ids, sampling(ctx, req, len(ids), max_tokens), grammar, reveal)
    rid, created, model = f"chatcmpl-{request.state.request_id}", int(time.time()), ctx.name
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    if req.stream:
        def chunk(delta: dict, finish: str | None = None) -> str:
            body = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            return sse({**body, "usage": None} if include_usage else body)

        def end(fin: Finish) -> list[str]:
            out = [chunk(d) for d in reader.close()] + [chunk({}, reader.finish_reason(fin.reason))]
            if include_usage:
                out.append(sse({**base, "choices": [], "usage": usage(fin)}))
            return out

        return stream(job, chunk({"role": "assistant", "content": ""}),
                      lambda t: [chunk(d) for d in reader.feed(t)], end)

    text, fin = await collect(request, job)
    message = merge(reader.feed(text) + reader.close())
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": reader.finish_reason(fin.reason)}],
        "usage": usage(fin)})


# ------------------------------------------------------------------------------------------ completions
@router.post("/v1/completions")
async def completions(request: Request):
    ctx = request.app.state.ctx
    req: CompletionRequest = parse(CompletionRequest, await request.body())
    ctx.check_model(req.model)
    ctx.check_serving()
    prompt = req.prompt[0] if isinstance(req.prompt, list) and req.prompt and \
        isinstance(req.prompt[0], (str, list)) else req.prompt
    if isinstance(prompt, list):
        vocab = ctx.info.vocab_size
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is out of range (vocabulary size {vocab})", param="prompt")

    def build(limit: int) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else ctx.info.encode(prompt, add_special_tokens=True,
                                                                               limit=limit)

    ids = await prompt_ids(ctx, build, req.max_tokens, "prompt")
    grammar = await asyncio.to_thread(output_grammar, ctx, req.response_format)
    echo = ""
    if req.echo:
        echo = prompt if isinstance(prompt, str) else await asyncio.to_thread(ctx.info.decode, ids)
    job = submit(request, ids, sampling(ctx, req, len(ids), req.max_tokens), grammar)
    rid, created, model = f"cmpl-{request.state.request_id}", int(time.time()), ctx.name
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    if req.stream:
        def chunk(text: str, finish: str | None = None) -> str:
            body = {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
            return sse({**body, "usage": None} if include_usage else body)

        def end(fin: Finish) -> list[str]:
            out = [chunk("", fin.reason)]
            if include_usage:
                out.append(sse({**base, "choices": [], "usage": usage(fin)}))
            return out

        return stream(job, chunk(echo) if echo else None, lambda t: [chunk(t)], end)

    text, fin = await collect(request, job)
    return JSONResponse({
        **base, "choices": [{"index": 0, "text": echo + text, "logprobs": None, "finish_reason": fin.reason}],
        "usage": usage(fin)})


# -------------------------------------------------------------------------------------------- answering
async def collect(request: Request, job) -> tuple[str, Finish]:
    """The whole text of a non-streamed request; stops the generation if the client hangs up."""
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
            if job.shutdown and ev.reason == "abort":
                raise unavailable("server is shutting down: request aborted")
            return "".join(parts), ev
    finally:
        watcher.cancel()
        job.cancelled.set()


def stream(job, first: str | None, on_text: Callable[[str], list[str]], end: Callable[[Finish], list[str]]):
    async def events():
        try:
            if first:
                yield first
            while True:
                ev = await job.events.get()
                if isinstance(ev, Delta):
                    if ev.text:
                        for line in on_text(ev.text):
                            yield line
                elif isinstance(ev, Finish):
                    for line in end(ev):
                        yield line
                    break
                else:                      # an APIError from the engine thread, after headers went out
                    yield sse({"error": ev.body()["error"]})
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()           # client gone (or done): stop generating, free the slot

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
