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


def small_schema_chat(i: int) -> dict:
    """A small chat forced to a distinct schema that compiles at once (a boolean property): another client's schema."""
    schema = {"type": "object", "properties": {f"b{i}": {"type": "boolean"}}, "required": [f"b{i}"]}
    return {**SMALL_CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": f"b{i}", "schema": schema}}}


def beside_small(url: str, path: str, bodies: list[dict], chats: int = 1, limit_s: float = 120,
                 chat=lambda: SMALL_CHAT) -> Beside:
    """Post `bodies` at once; 0.05 s later ask the small chat (`chat()`), again and again while any of them is
    unanswered (at least once, at most `chats` times), and poll /health until all have answered (at least once)."""
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
            status, _, seconds = post(CHAT, json.dumps(chat()))
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


# ------------------------------------------------------------------------------ on the wire (issue 53's repros)
def _request(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


_SMALL = json.dumps(SMALL_CHAT).encode()
_SMUGGLED = b"0\r\n\r\n" + _request("GET", "/v1/models")
_CHUNKED = _request("POST", CHAT, Transfer_Encoding="chunked", Content_Type="application/json")


@dataclass(frozen=True)
class Wire:
    """Bytes sent on one connection, then (`half_close`) its write side shut; what must come back: `statuses` in
    order (interim 100s aside; None: any, none a 5xx), and the server closing the connection. `trickle`: after the
    first answer, these bytes one every `gap` seconds (a request whose headers never end)."""
    name: str
    data: bytes
    statuses: tuple[int, ...] | None
    half_close: bool = False
    trickle: bytes = b""
    gap: float = 0.5


# Never shrinks: each is a defect found once (issue 53, round 5), answered as the wanted statuses now.
WIRE = [
    Wire("Content-Length beside Transfer-Encoding (smuggling)", b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n%s" % (CHAT.encode(), len(_SMUGGLED), _SMUGGLED), (400,)),
    Wire("an HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", (400,)),
    Wire("three pipelined chats, then a half-close", _request("POST", CHAT, _SMALL, Content_Type="application/json")
         * 3, (200, 200, 200), half_close=True),
    Wire("a 200 KB chunk extension", _CHUNKED + b"1;" + b"x" * 200_000 + b"\r\nA\r\n0\r\n\r\n", None),
    Wire("a chunk size of 2^96", _CHUNKED + b"%x\r\nA\r\n0\r\n\r\n" % 2**96, None),
    Wire("a kept-alive connection's second request trickling its headers",
         _request("GET", "/health"), (200, 408), trickle=b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: x\r\n" * 60),
]


def on_the_wire(url: str, case: Wire, limit_s: float = 120) -> tuple[list[int], bool, float]:
    """Send `case` on a new connection to `url`; (the statuses answered, interim 100s aside; whether the server
    closed the connection within `limit_s`; seconds until it did)."""
    import re
    t0, got, closed = time.monotonic(), b"", False
    with socket.create_connection(address(url), timeout=limit_s) as sock:
        sock.sendall(case.data)
        if case.half_close:
            sock.shutdown(socket.SHUT_WR)
        if case.trickle:
            while b"\r\n\r\n" not in got and (chunk := sock.recv(65536)):     # the first answer (GET: no body)
                got += chunk
            trickle(sock, case.trickle, case.gap, until=t0 + limit_s)
        sock.settimeout(max(0.1, t0 + limit_s - time.monotonic()))
        try:
            while chunk := sock.recv(65536):
                got += chunk
            closed = True
        except ConnectionResetError:        # closed with input unread: the answer may be lost on the way
            closed = True
        except socket.timeout:
            pass
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", got) if code != b"100"]
    return statuses, closed, time.monotonic() - t0


def compiles_of(url: str) -> list[int]:
    """The schema compiles' processes of the server at `url` (started with `--port PORT`, as devtools/server.py
    starts it): children whose argv names the server's pid (serving/shaping/grammar_pool.py's _INDEX_PROGRAM)."""
    from pathlib import Path

    def argv(pid: str) -> list[bytes]:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return []

    port = str(address(url)[1]).encode()
    pids = [p.name for p in Path("/proc").glob("[0-9]*")]
    servers = {pid.encode() for pid in pids if any(a == b"--port" and b == port for a, b in zip(argv(pid),
                                                                                                 argv(pid)[1:]))}
    return [int(pid) for pid in pids
            if (a := argv(pid)) and len(a) > 3 and a[1] == b"-c" and b"outlines_core" in a[2] and a[3] in servers]


def killed_compile(url: str, body: dict, limit_s: float = 120) -> tuple[int, str, int]:
    """Post `body` (a chat with a schema that compiles for seconds), SIGKILL its compile's process once it runs (as
    the OOM killer does), then post it again: (the first status, its message, the second status)."""
    import os
    import signal
    first: list = []
    asking = threading.Thread(target=lambda: first.append(requests.post(url + CHAT, json=body, timeout=limit_s)),
                              daemon=True)
    asking.start()
    deadline = time.monotonic() + limit_s
    while not (pids := compiles_of(url)) and asking.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    asking.join(limit_s)
    r = first[0]
    message = r.json()["error"]["message"][:80] if r.status_code >= 400 else ""
    return r.status_code, message, requests.post(url + CHAT, json=body, timeout=limit_s).status_code
