"""POST /tokenize and POST /detokenize, as vLLM serves them (a prompt or chat messages in, token ids out)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from serving.protocol import APIError, DetokenizeRequest, TokenizeRequest, messages, parse

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request):
    ctx = request.app.state.ctx
    req: TokenizeRequest = parse(TokenizeRequest, await request.body())
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send either prompt or messages", param="prompt")
    if req.messages is not None and not req.add_generation_prompt:
        raise APIError(400, "add_generation_prompt=false is not supported", param="add_generation_prompt")
    msgs = messages(req.messages) if req.messages is not None else None
    ctx.check_serving()
    info = ctx.info

    def run() -> list[int]:
        if msgs is None:
            return info.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        try:
            text = info.render_chat(msgs)
        except Exception as e:
            raise APIError(400, f"chat template: {e}", param="messages") from None
        return info.encode(text, add_special_tokens=bool(req.add_special_tokens))

    ids = await asyncio.to_thread(run)
    return {"count": len(ids), "max_model_len": ctx.max_context, "tokens": ids, "token_strs": None}


@router.post("/detokenize")
async def detokenize(request: Request):
    ctx = request.app.state.ctx
    req: DetokenizeRequest = parse(DetokenizeRequest, await request.body())
    ctx.check_model(req.model)
    ctx.check_serving()
    vocab = ctx.info.vocab_size
    bad = next((t for t in req.tokens if t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: token id {bad} is out of range (vocabulary size {vocab})", param="tokens")
    return {"prompt": await asyncio.to_thread(ctx.info.decode, req.tokens)}
