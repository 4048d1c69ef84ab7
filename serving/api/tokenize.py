"""POST /tokenize and POST /detokenize, as vLLM serves them (a prompt or chat messages in, token ids out)."""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

from serving.shaping.tokenizer import PromptTooLong
from serving.api.protocol import APIError, DetokenizeRequest, TokenizeRequest, messages, read, template_options

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request):
    ctx = request.app.state.ctx
    req: TokenizeRequest = await read(request, TokenizeRequest, ctx.max_messages())
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send either prompt or messages", param="prompt")
    options = template_options(req) if req.messages is not None else {}
    if req.tools and req.messages is None:
        raise APIError(400, "tools are shown by the chat template: send messages, not a prompt", param="tools")
    msgs = await asyncio.to_thread(messages, req.messages) if req.messages is not None else None
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    ctx.check_serving()
    info, where = ctx.info, "prompt" if msgs is None else "messages"

    def run() -> bytes:
        # Built here, tokens and JSON, not on the event loop. Unlike vLLM, a prompt longer than the context is
        # refused (its count is in the message): the answer stays as small as what the model can take.
        if msgs is None:
            ids = info.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False, limit=max_len)
        else:
            try:
                text = info.render_chat(msgs, tools, max_len, **options)
            except PromptTooLong:
                raise
            except Exception as e:
                raise APIError(400, f"chat template: {e}", param="messages") from None
            ids = info.encode(text, add_special_tokens=bool(req.add_special_tokens), limit=max_len)
        strs = info.token_strs(ids) if req.return_token_strs else None
        return json.dumps({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs}).encode()

    max_len = ctx.max_context
    try:
        return Response(await asyncio.to_thread(run), media_type="application/json")
    except PromptTooLong as e:
        raise APIError(400, f"the {where} is {e} long; this model's maximum context length is {max_len} tokens",
                       param=where, code="context_length_exceeded") from None


@router.post("/detokenize")
async def detokenize(request: Request):
    ctx = request.app.state.ctx
    req: DetokenizeRequest = await read(request, DetokenizeRequest)
    ctx.check_model(req.model)
    ctx.check_serving()
    vocab = ctx.info.vocab_size
    bad = next((t for t in req.tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: token id {bad} is out of range (vocabulary size {vocab})", param="tokens")
    return {"prompt": await asyncio.to_thread(ctx.info.decode, req.tokens)}
