"""Bodies of BIG_BODY bytes or more are parsed in a process of their own (serving/api/big_bodies.py): the request
comes back as a worker thread would have parsed it, the client's error as it was raised, and a parsing process that
dies is a retryable 503 for its body, not for the next one."""
from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

pytest.importorskip("fastapi")

from serving.api import big_bodies  # noqa: E402
from serving.api.protocol import APIError, ChatRequest, parse, read  # noqa: E402

CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"a": [1, 2]})}}]}
# unknown fields are ignored (as vLLM does): a big body that is a valid request
BIG = {"messages": [{"role": "user", "content": "hi"}, CALL], "max_tokens": 3, "pad": "x" * big_bodies.BIG_BODY}


def request_with(body: bytes):
    """starlette's Request over an ASGI receive channel that sends `body` whole."""
    from starlette.requests import Request

    sent = []

    async def receive():
        if sent:
            return {"type": "http.disconnect"}
        sent.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


@pytest.fixture
def parser(monkeypatch):
    """A parser of its own as the module's, closed after the test."""
    fresh = big_bodies.Parser()
    monkeypatch.setattr(big_bodies, "PARSER", fresh)
    yield fresh
    fresh.close()


def test_a_big_body_comes_back_as_a_thread_parses_it(parser):
    small = json.dumps({**BIG, "pad": ""}).encode()
    assert asyncio.run(read(request_with(small), ChatRequest)) == parse(ChatRequest, small)
    assert parser._pool is None                              # a small body stays in a worker thread
    body = json.dumps(BIG).encode()
    got = asyncio.run(read(request_with(body), ChatRequest, 10))
    assert parser._pool is not None                          # a big one went to the parsing process
    want = parse(ChatRequest, body, 10)
    assert got == want and got.max_tokens == 3
    assert got.messages[1].tool_calls[0].function._parsed == {"a": [1, 2]}


@pytest.mark.parametrize("change, message", [
    ({"temperature": "hot"}, "temperature: "),
    ({"messages": [{"role": "user", "content": ""}] * 11}, "messages: more than 10 messages cannot fit"),
    ({"messages": [CALL | {"tool_calls": [CALL["tool_calls"][0] | {"function": {"name": "f", "arguments": "{"}}]}]},
     "messages.0.tool_calls.0.function.arguments is not valid JSON"),
])
def test_a_big_bodys_error_is_the_one_a_thread_raises(parser, change, message):
    body = json.dumps({**BIG, **change}).encode()
    with pytest.raises(APIError, match=message) as thread:
        parse(ChatRequest, body, 10)
    with pytest.raises(APIError) as process:
        asyncio.run(read(request_with(body), ChatRequest, 10))
    assert process.value.body() == thread.value.body() and process.value.status == thread.value.status == 400


def test_a_parsing_process_that_dies_fails_its_body_with_a_503_and_the_next_gets_a_new_one(parser):
    async def killed_under_a_body():
        pid = await parser.run(os.getpid)
        assert pid != os.getpid()
        task = asyncio.ensure_future(read(request_with(json.dumps(BIG).encode()), ChatRequest))
        os.kill(pid, signal.SIGKILL)                         # as the OOM killer sends
        with pytest.raises(APIError) as e:
            await task
        return pid, e.value

    pid, error = asyncio.run(killed_under_a_body())
    assert (error.status, error.type) == (503, "service_unavailable")
    assert error.message == "the process parsing the request body stopped (out of memory?); retry"
    assert asyncio.run(parser.run(os.getpid)) not in (pid, os.getpid())
    assert asyncio.run(read(request_with(json.dumps(BIG).encode()), ChatRequest)).max_tokens == 3
