"""What other clients send that must not hold up a small chat (issue 40's scenarios), and how that chat is timed
beside them. tests/test_serving_fuzz.py checks each against its own requests (relative bounds, on a loaded CI
machine); benchmarks/other_clients.py times the chat in absolute seconds beside the same chat alone.

Request scenarios are (path, bodies), posted at once; connection scenarios (`idle`, `slow_headers`, `slow_bodies`)
hold sockets open from threads of this process until their context ends.
"""
from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import requests

from devtools.server import address
from devtools.tiny_gemma4 import QUESTION

ASK = [{"role": "user", "content": QUESTION}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SMALL_CHAT = {"model": "tiny", "messages": ASK, "max_tokens": 4}


def called(arguments: str) -> list[dict]:
    """A conversation whose assistant turn called a tool with these `arguments`, then the question."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": QUESTION}]


def huge_messages() -> tuple[str, list[dict]]:
    """15 MiB of 480 000 empty messages, and two of 60 000 (too long for the context)."""
    return CHAT, [{"model": "tiny", "messages": [{"role": "user", "content": ""}] * n, "max_tokens": 4}
                  for n in (480_000, 60_000, 60_000)]


def huge_token_ids() -> tuple[str, list[dict]]:
    """Five million token ids as one completions prompt, and a thousand prompts of 5 000 (~14 MiB each)."""
    return COMPLETIONS, [{"model": "tiny", "prompt": [2] * 5_000_000}, {"model": "tiny", "prompt": [[2] * 5_000] * 1_000}]


def wide_schema() -> tuple[str, list[dict]]:
    """A schema whose regex takes seconds to build: 150 optional properties of any value."""
    schema = {"type": "object", "properties": {f"p{i}": {} for i in range(150)}}
    return CHAT, [{**SMALL_CHAT, "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "wide", "schema": schema}}}]


def slow_schema(i: int) -> dict:
    """A chat forced to a distinct schema that takes seconds to compile over the tiny checkpoint's vocabulary."""
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 14}}, "required": [f"k{i}"]}
    return {**SMALL_CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}


def slow_schemas(count: int = 8) -> tuple[str, list[dict]]:
    return CHAT, [slow_schema(i) for i in range(count)]


def huge_conversations() -> tuple[str, list[dict]]:
    """4 MB of tool-call arguments, and 1000 tools x 1000 system turns (147 KB the template writes a thousand times)."""
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "d"}} for i in range(1000)]
    return CHAT, [{"model": "tiny", "messages": called(json.dumps({"a": "x" * 4_000_000})), "max_tokens": 4},
                  {"model": "tiny", "messages": [{"role": "system", "content": "s"}] * 1000 + ASK, "tools": tools,
                   "max_tokens": 4}]


def large_answer() -> tuple[str, list[dict]]:
    """64 choices of 220 tokens with 20 top logprobs each: ~19 MB of JSON."""
    return CHAT, [{"model": "tiny", "messages": ASK, "n": 64, "max_tokens": 220, "logprobs": True,
                   "top_logprobs": 20, "ignore_eos": True}]


@dataclass
class Beside:
    answers: list[tuple[int, str, float]] = field(default_factory=list)  # each body's (status, message, seconds)
    chats: list[tuple[int, float]] = field(default_factory=list)         # the small chats' (status, seconds)
    health: list[tuple[int, float]] = field(default_factory=list)        # /health's (status, seconds)


def beside_small(url: str, path: str, bodies: list[dict], chats: int = 1, limit_s: float = 120) -> Beside:
    """Post `bodies` at once; 0.05 s later ask the small chat, again and again while any of them is unanswered (at
    least once, at most `chats` times), and poll /health until all have answered (at least once)."""
    got = Beside(answers=[(0, "", 0.0)] * len(bodies))
    deadline = time.monotonic() + limit_s

    def post(where: str, body: str) -> tuple[int, str, float]:
        t0 = time.monotonic()
        r = requests.post(url + where, data=body, headers={"content-type": "application/json"}, timeout=limit_s)
        seconds = time.monotonic() - t0
        # an error's message only: parsing a 19 MB answer here would hold this process's GIL, and so its /health poll
        return r.status_code, r.json()["error"]["message"][:60] if r.status_code >= 400 else "", seconds

    def ask(i: int, body: str):
        got.answers[i] = post(path, body)

    def small():
        while len(got.chats) < chats and (not got.chats or any(t.is_alive() for t in huge)) \
                and time.monotonic() < deadline:
            status, _, seconds = post(CHAT, json.dumps(SMALL_CHAT))
            got.chats.append((status, seconds))

    huge = [threading.Thread(target=ask, args=(i, json.dumps(b)), daemon=True) for i, b in enumerate(bodies)]
    for t in huge:
        t.start()
    time.sleep(0.05)
    chatting = threading.Thread(target=small, daemon=True)
    chatting.start()
    with requests.Session() as s:
        while not got.health or any(t.is_alive() for t in huge) and time.monotonic() < deadline:
            # at least once: refusals known before any work can all end before the first poll
            t0 = time.monotonic()
            got.health.append((s.get(f"{url}/health", timeout=60).status_code, time.monotonic() - t0))
            time.sleep(0.01)
    for t in (*huge, chatting):
        t.join(60)
    return got


def trickle(sock: socket.socket, data: bytes, gap: float, until: float = float("inf")) -> None:
    """Send `data` a byte every `gap` seconds, until it is sent, the server answers or closes, or `until` passes."""
    with contextlib.suppress(OSError):
        for byte in data:
            if time.monotonic() > until:
                return
            sock.sendall(bytes([byte]))
            if select.select([sock], [], [], gap)[0]:
                return


@contextlib.contextmanager
def idle(url: str, count: int) -> Iterator[list[socket.socket]]:
    """`count` connections that send nothing."""
    socks = []
    try:
        for _ in range(count):
            socks.append(socket.create_connection(address(url), timeout=10))
        yield socks
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def _trickling(url: str, count: int, head: bytes, data: bytes, gap: float, limit_s: float) -> Iterator[None]:
    until = time.monotonic() + limit_s
    with idle(url, count) as socks:
        for s in socks:
            s.sendall(head)
        threads = [threading.Thread(target=trickle, args=(s, data, gap, until), daemon=True) for s in socks]
        for t in threads:
            t.start()
        try:
            yield
        finally:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)      # wakes a trickle waiting in select
            for t in threads:
                t.join(10)


def slow_headers(url: str, count: int, gap: float = 1.0, limit_s: float = 60) -> contextlib.AbstractContextManager:
    """`count` connections sending their request headers a byte every `gap` seconds (slowloris)."""
    return _trickling(url, count, b"", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: x\r\n" * 1000, gap, limit_s)


def slow_bodies(url: str, count: int, gap: float = 1.0, limit_s: float = 60) -> contextlib.AbstractContextManager:
    """`count` chat requests whose 100-byte body comes a byte every `gap` seconds."""
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            .encode())
    return _trickling(url, count, head, b" " * 100, gap, limit_s)
