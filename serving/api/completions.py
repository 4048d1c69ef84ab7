"""POST /v1/chat/completions and POST /v1/completions: a prompt in, generated text out (JSON or SSE).

Both share one path: parse (400s), check the model and readiness, build the prompt's token ids off the event loop
(the chat template and the tokenizer can take seconds on a long prompt), check the context, queue a Job, then
answer from the job's events. A client that leaves frees its slot; a server that shuts down ends every open
stream with finish_reason "abort" and [DONE] and answers every other request with a 503.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from fastapi import APIRouter, Request

from serving.api.answers import api_error, collect, json_response, sse, stream
from serving.core.detokenize import StopAutomaton
from serving.core.generation import Delta, Finish, Logprob, PromptLogprob, SamplingParams
from serving.api.protocol import (APIError, ChatRequest, CompletionRequest, ResponseFormat, messages, read,
                              template_options)
from serving.core.scheduler import Job, SchedulerError
from serving.shaping.grammar_pool import POLL_S, CompileFailed, GrammarBusy
from serving.shaping.grammar import ANY_OBJECT, InvalidGrammar
from serving.shaping.tokenizer import PromptTooLong
from serving.shaping.tool_calls import GemmaCalls, NamedCall, Reader, RequiredCalls, merge, required_schema

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


def sampling(ctx, req, prompt_len: int, max_tokens: int | None, top_logprobs: int | None,
             prompt_logprobs: int | None = None) -> SamplingParams:
    d = ctx.info.default_sampling
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    vocab = ctx.info.vocab_size
    bias = []
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab:
            raise APIError(400, f"logit_bias: token id {token} is out of range (vocabulary size {vocab})",
                           param="logit_bias")
        bias.append((token, min(100.0, max(-100.0, value))))     # OpenAI's range; vLLM clamps the same way
    for name in ("stop_token_ids", "allowed_token_ids"):
        bad = next((t for t in getattr(req, name) or () if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"{name}: token id {bad} is out of range (vocabulary size {vocab})", param=name)
    # Integers reach the runtimes only bounded (int32 on the JAX device), as vLLM bounds them: min_tokens past the
    # tokens to generate is a 400 (max_tokens unset: what the context leaves); a top_k of the vocabulary or more
    # is no cut.
    limit = ctx.max_context - prompt_len if max_tokens is None else max_tokens
    if req.min_tokens > limit:
        raise APIError(400, f"min_tokens ({req.min_tokens}) must be less than or equal to max_tokens ({limit}"
                            f"{'' if max_tokens is not None else ': what the context leaves'})", param="min_tokens")
    top_k = req.top_k if req.top_k is not None else d.get("top_k", 0)
    if req.n > ctx.scheduler.capacity:
        raise APIError(400, f"n: at most {ctx.scheduler.capacity} choices on this server (its slots plus "
                            f"--max-waiting)", param="n")
    return SamplingParams(
        temperature=req.temperature if req.temperature is not None else d.get("temperature", 1.0),
        top_p=req.top_p if req.top_p is not None else d.get("top_p", 1.0),
        top_k=top_k if 0 < top_k < vocab else 0,
        max_tokens=limit,
        stop=stop, include_stop_str=req.include_stop_str_in_output, seed=req.seed, ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
        logit_bias=tuple(bias), min_p=req.min_p or 0.0, min_tokens=req.min_tokens,
        stop_token_ids=tuple(req.stop_token_ids or ()), eos_token_ids=tuple(sorted(ctx.info.stop_ids)),
        allowed_token_ids=tuple(sorted(set(req.allowed_token_ids or ()))),
        bad_words_ids=bad_words_ids(ctx.info, req.bad_words or ()),
        logprobs=top_logprobs, prompt_logprobs=prompt_logprobs)


def bad_words_ids(info, words) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids, alone and after a space (a word mid-sentence), as vLLM bans them."""
    out = []
    for i, word in enumerate(words):
        if not word.strip():            # vLLM strips it to nothing and fails on the empty token list
            raise APIError(400, f"bad_words.{i}: a word of only whitespace bans nothing", param=f"bad_words.{i}")
        alone = tuple(info.encode(word.lstrip()))
        spaced = tuple(info.encode(" " + word.lstrip()))
        out += [alone] + ([spaced] if alone and spaced and spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    return tuple(seq for seq in out if seq)


def revealed(ctx, req) -> frozenset[int]:
    """The special tokens the text shows: every one with skip_special_tokens false (as vLLM; a stop token that ends
    the output and the thinking channel stay out), none by default."""
    return frozenset() if req.skip_special_tokens else ctx.info.hidden_ids


def tool_plan(req: ChatRequest) -> tuple[list[dict] | None, Callable[[], Reader], Any]:
    """What `tools` and `tool_choice` ask for (serving/shaping/tool_calls.py): (the tools the chat template shows, a new
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


def grammar_schema(fmt: ResponseFormat | None, tool_schema: Any = None) -> tuple[Any, str] | None:
    """The JSON schema the output follows and the parameter that asked for it, or None for free text."""
    if tool_schema is not None:
        if fmt is not None and fmt.type != "text":
            raise APIError(400, "response_format cannot be combined with tool_choice \"required\" or a named "
                                "function (the call's arguments are already JSON)", param="response_format")
        return tool_schema, "tools"
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ANY_OBJECT, "response_format"
    if fmt.json_schema is None:
        raise APIError(400, "response_format: invalid JSON schema: type json_schema needs json_schema: {\"name\": "
                            "…, \"schema\": {…}}", param="response_format")
    return fmt.json_schema.schema_, "response_format"


async def output_grammar(request: Request, fmt: ResponseFormat | None, tool_schema: Any = None) -> Any:
    """The grammar the output follows, or None for free text. Compiled by the server's Grammars
    (serving/shaping/grammar_pool.py: its own workers and admission) and awaited here, holding no thread; a compile
    nobody waits for any more (its clients left) stops. Busy compiling: a 429, to retry; a compile that died (killed,
    stopped, no room): a 503, to retry."""
    wanted = grammar_schema(fmt, tool_schema)
    if wanted is None:
        return None
    (schema, param), grammars = wanted, request.app.state.ctx.grammars
    try:
        key, entry = await asyncio.to_thread(grammars.enter, schema)      # its checks walk the schema
        gone, compiled = False, asyncio.wrap_future(entry.future)
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(compiled), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        gone = True
                        raise InvalidGrammar("its requester left") from None
        finally:
            grammars.leave(key, entry, gone)
    except GrammarBusy as e:
        raise APIError(429, f"server busy compiling schemas: {e}; retry later", "rate_limit_error", param=param,
                       code="rate_limit_exceeded") from None
    except CompileFailed as e:
        raise APIError(503, f"schema compile failed on the server: {e}; retry later", "service_unavailable",
                       param=param) from None
    except InvalidGrammar as e:
        message = ("tools: a function's parameters are not a usable JSON schema" if param == "tools" else
                   "response_format: invalid JSON schema")
        raise APIError(400, f"{message}: {e}", param=param) from None


GOLDEN = 0x9E3779B97F4A7C15     # 2**64 / golden ratio: choice i's seed is the request's plus i times this


async def submit(request: Request, prompts: list[tuple[list[int], SamplingParams]], n: int, grammar: Any = None,
                 reveal: frozenset[int] = frozenset()) -> list[Job]:
    """Queue n choices of each (prompt ids, params) (all or none); choice j of prompt p has index p * n + j (as
    vLLM). Choice j of a seeded request samples with a seed derived from the request's seed and j (choice 0 with
    the seed itself), so the same request gives the same choices. Each choice follows `grammar` with a matcher of
    its own. The stop strings' automaton (the same for every prompt) is built here, in a worker thread."""
    stops = await asyncio.to_thread(StopAutomaton, prompts[0][1].stop)
    ctx = request.app.state.ctx
    ctx.check_serving()                    # again: the server may have begun shutting down while we tokenised
    loop, events, started = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
    jobs = [Job(ids, params if params.seed is None or j == 0 else replace(params, seed=params.seed + j * GOLDEN),
                loop, events=events, index=p * n + j, choices=len(prompts) * n, grammar=grammar, reveal=reveal,
                stops=stops, started=started)
            for p, (ids, params) in enumerate(prompts) for j in range(n)]
    try:
        ctx.scheduler.submit(*jobs)
    except SchedulerError as e:            # the queue is full (429), or the engine died since check_serving (503)
        raise api_error(e) from None
    return jobs


def usage(fins: list[Finish], n: int | None = None) -> dict:
    """Every prompt once (fins: n choices per prompt, in index order), every choice's tokens."""
    prompt = sum(f.prompt_tokens for f in fins[::n or len(fins)])
    completion = sum(f.completion_tokens for f in fins)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _lp(value: float) -> float:
    return max(value, -9999.0)         # -inf is not JSON: OpenAI's and vLLM's floor


def chat_logprobs(lps: list[Logprob]) -> dict:
    """OpenAI's chat shape: per token its text, logprob, UTF-8 bytes and the top alternatives."""
    def entry(token: str, value: float) -> dict:
        return {"token": token, "logprob": _lp(value), "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def completion_logprobs(lps: list[Logprob], offset: int) -> dict:
    """OpenAI's completions shape. top_logprobs holds the chosen token and the top ones (up to logprobs + 1),
    text_offset each token's place in the text, counting from `offset`. A token without a logprob (an echoed
    prompt's first) has null for both."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        out["tokens"].append(lp.token)
        out["token_logprobs"].append(None if lp.logprob is None else _lp(lp.logprob))
        top = None if lp.logprob is None else {lp.token: _lp(lp.logprob)}
        for t, v in lp.top:
            top.setdefault(t, _lp(v))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(lp.token)
    return out


def echoed(prompt: list[PromptLogprob], k: int) -> list[Logprob]:
    """An echoed prompt's tokens as completion logprobs (the top k, as the generated tokens have)."""
    return [Logprob(p.token, p.logprob, [(t, v) for _, t, v in p.top[:k]]) for p in prompt]


def prompt_logprobs(prompt: list[PromptLogprob] | None) -> list | None:
    """vLLM's prompt_logprobs: null for the first prompt token, then per token {id: {logprob, rank, decoded_token}}
    for the token itself and the top ones."""
    if prompt is None:
        return None
    out: list = [None]
    for p in prompt[1:]:
        entry = {str(p.token_id): {"logprob": _lp(p.logprob), "rank": p.rank, "decoded_token": p.token}}
        for rank, (i, t, v) in enumerate(p.top, 1):
            entry.setdefault(str(i), {"logprob": _lp(v), "rank": rank, "decoded_token": t})
        out.append(entry)
    return out


# ------------------------------------------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
async def chat(request: Request):
    ctx = request.app.state.ctx
    req: ChatRequest = await read(request, ChatRequest, ctx.max_messages())
    ctx.check_model(req.model)
    msgs = await asyncio.to_thread(messages, req.messages)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "when using top_logprobs, logprobs must be set to true", param="top_logprobs")
    tools, new_reader, tool_schema = tool_plan(req)
    options = template_options(req)
    ctx.check_serving()
    max_tokens = req.max_completion_tokens or req.max_tokens

    def build(limit: int) -> list[int]:
        try:
            text = ctx.info.render_chat(msgs, tools, limit, **options)
        except PromptTooLong:
            raise
        except Exception as e:             # e.g. the template rejects the conversation
            raise APIError(400, f"chat template: {e}", param="messages") from None
        return ctx.info.encode(text, limit=limit)

    ids = await prompt_ids(ctx, build, max_tokens, "messages")
    grammar = await output_grammar(request, req.response_format, tool_schema)
    params = sampling(ctx, req, len(ids), max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                      req.prompt_logprobs)   # n checked
    readers = [new_reader() for _ in range(req.n)]     # each choice's text -> content and tool_calls deltas
    reveal = revealed(ctx, req)
    if isinstance(readers[0], GemmaCalls):     # the model's own markup is read: show it, and let no reply go on
        reveal |= ctx.info.tool_markup         # into a tool's answer it would have to make up
        if ctx.info.tool_response is not None:
            params = replace(params, stop_token_ids=params.stop_token_ids + (ctx.info.tool_response,))
    jobs = await submit(request, [(ids, params)], req.n, grammar, reveal)
    rid, created, model = f"chatcmpl-{request.state.request_id}", int(time.time()), ctx.name
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    if req.stream:
        def chunk(i: int, delta: dict, lps: list[Logprob] | None = None, finish: str | None = None) -> str:
            body = {**base, "choices": [{"index": i, "delta": delta, "logprobs": chat_logprobs(lps) if lps else None,
                                         "finish_reason": finish}]}
            return sse({**body, "usage": None} if include_usage else body)

        def on_text(i: int, ev: Delta) -> list[str]:
            text, lps = ev.text, [ev.logprob] if ev.logprob else None
            deltas = readers[i].feed(text) if text else []
            if not deltas:                 # held back (a tool call in the making), or no text: logprobs only
                return [chunk(i, {"content": ""}, lps)] if lps else []
            return [chunk(i, d, lps if k == 0 else None) for k, d in enumerate(deltas)]

        def on_finish(i: int, fin: Finish) -> list[str]:
            return ([chunk(i, d) for d in readers[i].close()]
                    + [chunk(i, {}, None, readers[i].finish_reason(fin.reason))])

        def end(fins: list[Finish]) -> list[str]:
            return [sse({**base, "choices": [], "usage": usage(fins)})] if include_usage else []

        return await stream(request, jobs, [chunk(i, {"role": "assistant", "content": ""}) for i in range(req.n)],
                            on_text, on_finish, end)

    results = await collect(request, jobs)
    return await json_response(lambda: {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": merge(readers[i].feed(text) + readers[i].close()),
                     "logprobs": chat_logprobs(lps) if req.logprobs else None,
                     "finish_reason": readers[i].finish_reason(fin.reason)}
                    for i, (text, lps, fin, _) in enumerate(results)],
        "usage": usage([fin for _, _, fin, _ in results]), "prompt_logprobs": prompt_logprobs(results[0][3])})


# ------------------------------------------------------------------------------------------ completions
@router.post("/v1/completions")
async def completions(request: Request):
    ctx = request.app.state.ctx
    req: CompletionRequest = await read(request, CompletionRequest)
    ctx.check_model(req.model)
    ctx.check_serving()
    several = isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (str, list))
    prompts = list(req.prompt) if several else [req.prompt]
    if several and len(prompts) * req.n > ctx.scheduler.capacity:
        raise APIError(400, f"prompt: {len(prompts)} prompts × n {req.n} choices; at most {ctx.scheduler.capacity} "
                            f"on this server (its slots plus --max-waiting)", param="prompt")
    vocab = ctx.info.vocab_size
    for prompt in prompts:
        if isinstance(prompt, list) and len(prompt) < ctx.max_context:      # a longer one: a context error below
            bad = next((t for t in prompt if t >= vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt: token id {bad} is out of range (vocabulary size {vocab})",
                               param="prompt")

    def build(prompt) -> Callable[[int], list[int]]:
        return lambda limit: list(prompt) if isinstance(prompt, list) else \
            ctx.info.encode(prompt, add_special_tokens=True, limit=limit)

    ids = [await prompt_ids(ctx, build(prompt), req.max_tokens, "prompt") for prompt in prompts]
    grammar = await output_grammar(request, req.response_format)
    echoes = [""] * len(prompts)
    if req.echo:
        echoes = [p if isinstance(p, str) else await asyncio.to_thread(ctx.info.decode, i)
                  for p, i in zip(prompts, ids)]
    # echo with logprobs: the prompt's tokens lead the logprobs, as vLLM (its prompt logprobs, the first one null)
    with_prompt = req.echo and req.logprobs is not None
    prompt_lps = req.logprobs if with_prompt and req.prompt_logprobs is None else req.prompt_logprobs
    jobs = await submit(request, [(i, sampling(ctx, req, len(i), req.max_tokens, req.logprobs, prompt_lps))
                                  for i in ids], req.n, grammar, revealed(ctx, req))
    rid, created, model = f"cmpl-{request.state.request_id}", int(time.time()), ctx.name
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    if req.stream:
        offsets = [0] * len(jobs)          # per choice: where the next token's text begins

        def chunk(i: int, text: str, lps: list[Logprob] | None = None, finish: str | None = None) -> str:
            logprobs = None
            if lps:
                logprobs = completion_logprobs(lps, offsets[i])
                offsets[i] += sum(len(lp.token) for lp in lps)
            body = {**base, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
            return sse({**body, "usage": None} if include_usage else body)

        def end(fins: list[Finish]) -> list[str]:
            return [sse({**base, "choices": [], "usage": usage(fins, req.n)})] if include_usage else []

        def on_text(i: int, ev: Delta) -> list[str]:
            lps = [ev.logprob] if ev.logprob else None
            first = [chunk(i, echoes[i // req.n], echoed(ev.prompt, req.logprobs))] if with_prompt and ev.prompt else []
            return first + ([chunk(i, ev.text, lps)] if ev.text or lps else [])

        return await stream(request, jobs, [chunk(i, echoes[i // req.n]) for i in range(len(jobs))]
                            if req.echo and not with_prompt else [], on_text,
                            lambda i, fin: [chunk(i, "", None, fin.reason)], end)

    results = await collect(request, jobs)
    return await json_response(lambda: {
        **base, "choices": [{"index": i, "text": echoes[i // req.n] + text,
                             "logprobs": None if req.logprobs is None else completion_logprobs(
                                 (echoed(prompt, req.logprobs) if with_prompt else []) + lps, 0),
                             "finish_reason": fin.reason, "prompt_logprobs": prompt_logprobs(prompt)}
                            for i, (text, lps, fin, prompt) in enumerate(results)],
        "usage": usage([fin for _, _, fin, _ in results], req.n)})
