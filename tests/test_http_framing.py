"""The HTTP protocol below the app (serving/api/middleware.py's http_protocol), on loopback, in this process: framing
that cannot smuggle, a half-close that loses no pipelined request, a header deadline per request, one log line for
a body the parser refuses, and a connection cap that /health and light clients get past. The app is a small one
behind the server's own Guard and error handlers (the runtimes' servers: tests/test_serving_fuzz.py)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import threading
import time

import pytest
import requests
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from devtools.server import free_port
from serving.api.app import ERROR_HANDLERS
from serving.api.middleware import Guard, http_protocol

WAIT_S = 30         # a bound on every wait, never a speed requirement


def small_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(Guard, max_body_bytes=2**20, body_timeout_s=WAIT_S, body_total_timeout_s=WAIT_S)
    for exc, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(exc, handler)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.api_route("/other", methods=["GET"])
    async def other():
        return Response(status_code=200)

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    return app


@contextlib.contextmanager
def serve(**protocol):
    """The small app under http_protocol(**protocol) on 127.0.0.1; yields the uvicorn Server (its state: the open
    connections and running tasks). Logs propagate (log_config=None), for caplog."""
    server = uvicorn.Server(uvicorn.Config(small_app(), host="127.0.0.1", port=free_port(), log_config=None,
                                           http=http_protocol(**{"header_timeout_s": WAIT_S, **protocol})))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started, "the server started")
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(15)


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.02)


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.config.port), timeout=WAIT_S)


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset ends it too: a server that closes with unread input
    resets the connection, which may discard its answer on the way)."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            out += chunk
    return out


def statuses(answer: bytes) -> list[int]:
    """The status codes of the responses in `answer`, in order (bodies are JSON or empty: no status line in them)."""
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)]


def post(body: bytes) -> bytes:
    return b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


# ----------------------------------------------------------------------------------------------- framing
def test_content_length_beside_transfer_encoding_is_one_400_and_the_connection_closes():
    """Both framings in one request: a proxy that counts Content-Length sees a second request inside the body (here
    a GET) that a chunked reader serves as a request of its own. Before: the chunked body was read, answered, and the
    connection stayed open, so the 'body' was answered too (two responses). Now: a 400 and the connection closed."""
    smuggled = b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n"
    body = b"0\r\n\r\n" + smuggled
    with serve() as server, connect(server) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s"
                     % (len(body), body))
        answer = read_to_end(sock)
    assert statuses(answer) == [400], answer
    assert b"both Content-Length and Transfer-Encoding" in answer


def test_an_http2_preface_gets_one_400():
    """Before: `PRI * HTTP/2.0` was served as a request (a 404), then `SM` as another (a 400)."""
    with serve() as server, connect(server) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        answer = read_to_end(sock)
    assert statuses(answer) == [400], answer
    assert b"HTTP/2.0 is not served here" in answer


def test_pipelined_requests_then_a_half_close_are_all_answered():
    """Three whole requests, then shutdown(SHUT_WR) (`printf ... | nc -N`). Before: a 100 Continue and one answer;
    the end of input closed the connection after the first. Now: every request sent whole is answered, then the
    connection closes."""
    with serve() as server, connect(server) as sock:
        sock.sendall(post(b"a") + post(b"bb") + post(b"ccc"))
        sock.shutdown(socket.SHUT_WR)
        answer = read_to_end(sock)
    assert [s for s in statuses(answer) if s != 100] == [200, 200, 200], answer
    assert [answer.count(b'{"bytes":%d}' % n) for n in (1, 2, 3)] == [1, 1, 1], answer


def test_a_half_close_after_an_incomplete_pipelined_request_answers_the_whole_ones_and_closes():
    with serve() as server, connect(server) as sock:
        sock.sendall(post(b"a") + b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\nshort")
        sock.shutdown(socket.SHUT_WR)
        answer = read_to_end(sock)          # closed, not held until the body timeout
    assert [s for s in statuses(answer) if s != 100] == [200], answer


@pytest.mark.parametrize("chunk", [b"1;" + b"x" * 200_000 + b"\r\nA\r\n0\r\n\r\n",      # a 200 KB chunk extension
                                   b"%x\r\nA\r\n0\r\n\r\n" % 2**96])                    # a chunk size past 2^64
def test_a_chunked_body_the_parser_refuses_is_a_400_and_one_log_line(caplog, chunk):
    """Before: a 400, then 'unexpected error' with a traceback and uvicorn's 'Exception in ASGI application' with
    another (the endpoint's body read saw the connection close): ~130 lines a request. Now: the parser's one
    warning."""
    with serve() as server:
        with caplog.at_level(logging.INFO), connect(server) as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk)
            answer = read_to_end(sock)
            until(lambda: not server.server_state.tasks, "the request's task ended")
    assert statuses(answer) in ([400], []), answer[:300]       # [] where the reset came first
    loud = [(r.name, r.getMessage()[:80]) for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1 and not any(r.exc_info for r in caplog.records), loud


# ----------------------------------------------------------------------------------------- header deadline
class Clock:
    """The protocol's event loop, except that its timers fire when the test says (fire): no wait, no timing."""

    def __init__(self, loop):
        self.loop, self.timers = loop, []

    def call_later(self, delay, callback, *args):
        handle = asyncio.TimerHandle(0, callback, args, self.loop)
        self.timers.append((delay, handle))
        return handle

    def fire(self, callback_name: str) -> list[float]:
        """Run every pending timer whose callback is `callback_name`; their delays."""
        due = [(d, h) for d, h in self.timers if not h.cancelled() and h._callback.__name__ == callback_name]
        self.timers = [t for t in self.timers if t not in due]
        for _, handle in due:
            handle._run()
        return [d for d, _ in due]

    def __getattr__(self, name):
        return getattr(self.loop, name)


class Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.out, self.closed = b"", False

    def write(self, data):
        self.out += data

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def get_extra_info(self, name, default=None):
        return {"peername": ("10.0.0.1", 4000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


async def _kept_alive_second_request(together: bool) -> tuple[list[float], bytes]:
    """A request answered, then the first line of a second one (sent with the first when `together`); every header
    deadline pending then is fired. Returns their delays and what the connection wrote."""
    protocol_class = http_protocol(header_timeout_s=7)
    config = uvicorn.Config(small_app(), http=protocol_class, log_config=None, lifespan="off")
    config.load()
    clock, transport = Clock(asyncio.get_running_loop()), Transport()
    proto = protocol_class(config, uvicorn.server.ServerState(), {}, _loop=clock)
    proto.connection_made(transport)
    second = b"GET /health HTTP/1.1\r\n"
    proto.data_received(post(b"a") + (second if together else b""))
    for _ in range(500):                          # the app answers (a bound on the loop turns, not a time)
        if b'{"bytes":1}' in transport.out:
            break
        await asyncio.sleep(0.01)
    assert b'{"bytes":1}' in transport.out
    if not together:
        proto.data_received(second)
    proto.data_received(b"X-Trickled: 1\r\n")
    return clock.fire("_headers_late"), transport.out


@pytest.mark.parametrize("together", [False, True], ids=["sent-later", "pipelined"])
def test_the_header_deadline_is_armed_again_for_each_request_on_a_kept_alive_connection(together):
    """Before: the deadline armed at the connection's opening was never cleared once the first request's headers
    came, so the second request got none until it had fired (a 10 s deadline held ~24 s of trickled headers). Now:
    each request's headers have their own --header-timeout, from the first byte of the request (or, pipelined,
    from the previous answer): firing it answers 408."""
    delays, out = asyncio.run(_kept_alive_second_request(together))
    assert delays == [7] and b"HTTP/1.1 408 Request Timeout" in out, (delays, out[-300:])


# ------------------------------------------------------------------------------------------ connection cap
def _opened(server, n: int) -> None:
    until(lambda: len(server.server_state.connections) >= n, f"{n} connections open")


def test_past_the_cap_an_idle_connection_of_the_heaviest_client_gives_way_to_health():
    """--max-connections 3, three idle sockets of one client (1 100 of them filled 1 024 places): before, /health
    got the 503. Now the oldest idle connection of the client holding the most is closed (with a 503) and the new
    one is served."""
    with serve(max_connections=3) as server:
        idle = [connect(server) for _ in range(3)]
        _opened(server, 3)
        try:
            assert requests.get(f"http://127.0.0.1:{server.config.port}/health", timeout=WAIT_S).status_code == 200
            first = idle[0].recv(4096)
            assert first.startswith(b"HTTP/1.1 503 Service Unavailable") and b"--max-connections" in first
        finally:
            for s in idle:
                s.close()


def test_past_the_cap_with_every_connection_busy_only_health_is_served():
    """Every place holds a request in progress (a body still coming): nothing to give way. A new connection may
    still ask for /health (a small reserve past the cap); anything else is a 503, as every new connection was."""
    with serve(max_connections=3) as server:
        busy = [connect(server) for _ in range(3)]
        try:
            for s in busy:
                s.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            until(lambda: len(server.server_state.tasks) >= 3, "three requests in progress")
            url = f"http://127.0.0.1:{server.config.port}"
            assert requests.get(f"{url}/health", timeout=WAIT_S).status_code == 200
            other = requests.get(f"{url}/other", timeout=WAIT_S)
            assert other.status_code == 503 and "--max-connections" in other.json()["error"]["message"]
        finally:
            for s in busy:
                s.close()
