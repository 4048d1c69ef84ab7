"""What every HTTP request passes through before an endpoint sees it (one pure-ASGI middleware, streaming-safe):

- an `x-request-id` on every response: the client's own, or a new one (it also names the completion's id);
- `--api-key`: /v1/* needs exactly one `Authorization: Bearer <key>` header, as with `vllm serve --api-key` (401
  otherwise: a wrong key followed by the right one is refused too);
- a request-body limit (`--max-body-bytes`): 413 from the Content-Length alone, or as soon as a chunked body
  passes the limit, before anything parses or tokenises it;
- a body that stops coming (`--body-timeout`: seconds without a byte while the body is incomplete, e.g. a
  Content-Length of 100 and 7 bytes sent), or that takes longer than `--body-total-timeout` in all (one byte every
  few seconds), gets a 408, instead of holding its connection and handler open;
- a request whose body and answer together are large (serving/shaping/heap.py's Trimmer) is followed by a
  `malloc_trim` off the event loop, so that the heap its parse and its answer freed goes back to the system;

and, below the app, in the HTTP protocol (`http_protocol`, uvicorn's h11 one):

- a request uvicorn's HTTP parser refuses (a malformed Content-Length, a garbled request line, a chunk header past
  its limits) gets an OpenAI error body too, not uvicorn's plain text, and one warning line in the log;
- a request framed two ways (Content-Length and Transfer-Encoding), or not HTTP/1.x (an HTTP/2 preface), gets a 400
  and the connection is closed: no byte after it is read as a request (no smuggling past a proxy);
- a connection whose request headers are not complete `--header-timeout` seconds after it opened, or after the
  first byte of its next request (kept alive), gets a 408 and is closed: each request has its own deadline;
- past `--max-connections` open connections (kept below the process's descriptor limit), the oldest idle
  connection of the client holding the most gives way (a 503, closed) to the new one; where none is idle, the new
  one may ask for /health only (RESERVE places past the cap), and anything else is a 503; past those, a 503 at once;
- a client that shuts down its write side once its requests are sent (a half-close) still gets every answer,
  pipelined ones too, and one that closed its socket is still found gone (`eof_received`).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import socket
import uuid

from serving.api.protocol import APIError
from serving.shaping.heap import Trimmer


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than the server's limit of {limit} bytes "
                              f"(--max-body-bytes)", code="request_too_large")


class BodyTimeout(APIError):
    def __init__(self, seconds: float, total: bool = False):
        why = f"not complete within {seconds:g} s (--body-total-timeout)" if total else \
            f"no byte of it came for {seconds:g} s (--body-timeout)"
        super().__init__(408, f"request body incomplete: {why}", code="request_timeout")


class Guard:
    def __init__(self, app, max_body_bytes: int, api_key: str | None = None, body_timeout_s: float = 10.0,
                 body_total_timeout_s: float = 60.0, heap: Trimmer | None = None):
        self.app, self.limit, self.body_timeout_s, self.heap = app, max_body_bytes, body_timeout_s, heap
        self.body_total_timeout_s = body_total_timeout_s
        self.auth = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:256] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        received = sent = 0

        async def send_with_id(message):
            nonlocal sent
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", rid.encode("latin-1"))]}
            else:
                sent += len(message.get("body", b""))
            await send(message)

        async def refuse(error: APIError):
            response = error.response()
            if error.status == 401:
                response.headers["www-authenticate"] = "Bearer"
            await response(scope, receive, send_with_id)

        keys = [v for k, v in scope["headers"] if k == b"authorization"]     # dict(headers) keeps the last one
        if self.auth and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS" and \
                not (len(keys) == 1 and hmac.compare_digest(keys[0], self.auth)):
            return await refuse(APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                         "authentication_error", code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await refuse(BodyTooLarge(self.limit) if length.isdigit() else
                                APIError(400, "invalid Content-Length header"))
        complete = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_total_timeout_s if self.body_total_timeout_s else float("inf")

        async def limited_receive():
            nonlocal received, complete
            if complete:            # after the body: waits for the client to leave (a stream's watch), no deadline
                return await receive()
            gap = self.body_timeout_s or float("inf")       # 0: no limit
            wait = min(gap, deadline - loop.time())
            try:
                message = await asyncio.wait_for(receive(), None if wait == float("inf") else max(0.0, wait))
            except asyncio.TimeoutError:        # reaches the endpoint's body read: a 408
                raise BodyTimeout(*((self.body_total_timeout_s, True) if wait < gap else (gap,))) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)       # reaches the endpoint's body read: a 413 response
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        await self.app(scope, limited_receive, send_with_id)
        if self.heap is not None and self.heap.due(received + sent):
            await asyncio.to_thread(self.heap.run)     # the answer is out; a trim walks every arena


PEER_POLL_S = 0.1       # how often a half-closed connection is checked for the reset that says its client is gone
RESERVE = 32            # connections past --max-connections that may ask for /health only (within the 128 spare)
HEALTH_LINE = 256       # the most bytes of a reserve connection's request line read before it is refused
BUSY = "server busy: {} connections open (--max-connections); retry later"


def framing_problem(http_version: bytes, headers) -> str | None:
    """Why a request's framing cannot be trusted, or None. Both Content-Length and Transfer-Encoding: a proxy that
    frames by the one and a server that frames by the other read different requests from the same bytes (RFC 9112
    §6.1: the server closes the connection after answering). Any version but HTTP/1.x (an HTTP/2 preface,
    `PRI * HTTP/2.0`): what follows it is no HTTP/1.1 request either."""
    if http_version not in (b"1.0", b"1.1"):
        return f"HTTP/{http_version.decode(errors='replace')} is not served here (HTTP/1.1 only)"
    names = {name.lower() for name, _ in headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        return "both Content-Length and Transfer-Encoding (ambiguous framing, RFC 9112 section 6.1)"
    return None


def is_health(line: bytes) -> bool:
    """Whether a request line asks for /health (GET or HEAD, any query)."""
    method, _, rest = line.partition(b" ")
    target = rest.partition(b" ")[0].partition(b"?")[0]
    return method in (b"GET", b"HEAD") and target == b"/health"


def evictable(connections, newcomer) -> object | None:
    """The connection to close so that `newcomer` may stay, past the cap: the oldest idle one (no request in
    progress) of the client holding the most connections, provided it holds at least as many as the newcomer's
    client. One client's flood of idle sockets thus gives way to every other client, and to its own next one."""
    counts: dict = {}
    for c in connections:
        counts[c.peer] = counts.get(c.peer, 0) + 1
    idle = [c for c in connections if c is not newcomer and c.idle() and not c.transport.is_closing()]
    if not idle:
        return None
    victim = max(idle, key=lambda c: (counts[c.peer], -c.opened))
    return victim if counts[victim.peer] >= counts[newcomer.peer] else None


def http_protocol(header_timeout_s: float = 10.0, max_connections: int = 0) -> type:
    """uvicorn's h11 protocol (pinned, whatever else is installed: the one parser whose framing is tested here),
    with an OpenAI error body for a request it cannot parse, a refusal of ambiguous framing (framing_problem), a
    deadline on each request's headers, and a bound on open connections (0: none) that neither /health nor a light
    client can be starved by."""
    import h11
    from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Connection(h11.Connection):
        problem: str | None = None

        def next_event(self):
            event = super().next_event()
            if isinstance(event, h11.Request):
                self.problem = framing_problem(event.http_version, event.headers)
                if self.problem:        # uvicorn's handler: send_400_response, and the connection closed
                    raise h11.RemoteProtocolError(self.problem)
            return event

    class Protocol(H11Protocol):
        _header_timer = _header_cycle = None
        _input_ended = False        # the client half-closed: answer what it sent whole, then close
        _health_only: bytes | None = None   # past the cap: the request line read so far (only /health is served)

        def __init__(self, config, *args, **kw):
            super().__init__(config, *args, **kw)
            self.conn = Connection(h11.SERVER, config.h11_max_incomplete_event_size or
                                   DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)

        def send_400_response(self, msg: str) -> None:
            self._answer_and_close(APIError(400, f"malformed HTTP request: {self.conn.problem or msg}"))

        def _answer_and_close(self, error: APIError) -> None:
            body = json.dumps(error.body()).encode()
            reason = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}[error.status]
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n%s" % (error.status, reason, len(body), body))
            self.transport.close()

        def idle(self) -> bool:
            """No request in progress: none yet, or the last one answered."""
            return self.cycle is None or self.cycle.response_complete

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.peer = (transport.get_extra_info("peername") or ("",))[0]
            self.opened = self.loop.time()
            self._await_headers()
            if not max_connections or len(self.connections) <= max_connections:
                return
            busy = APIError(503, BUSY.format(max_connections), "service_unavailable")
            victim = evictable(self.connections, self)
            if victim is not None:
                victim._answer_and_close(busy)
            elif len(self.connections) <= max_connections + RESERVE:
                self._health_only = b""
            else:
                self._answer_and_close(busy)

        def data_received(self, data: bytes) -> None:
            if self._health_only is not None:
                data = self._admit_health(data)
                if not data:
                    return
            if self._header_timer is None and self.idle():
                self._await_headers()           # the first byte of a next request on a kept-alive connection
            super().data_received(data)
            if self._header_timer is not None and self._header_cycle is not self.cycle:
                self._stop_header_timer()       # this request's headers came: its deadline is met

        def _admit_health(self, data: bytes) -> bytes:
            """A connection past the cap: its request line, once read, is served if it asks for /health (and the
            connection closed after), refused with a 503 otherwise. Returns what to parse now (b"": nothing yet)."""
            seen = self._health_only + data
            line, newline, _ = seen.partition(b"\r\n")
            if not newline and len(seen) < HEALTH_LINE:
                self._health_only = seen
                return b""
            self._health_only = None
            if newline and is_health(line):
                self._input_ended = True        # answered, then closed: a reserve place is not kept
                return seen
            self._answer_and_close(APIError(503, BUSY.format(max_connections), "service_unavailable"))
            return b""

        def on_response_complete(self) -> None:
            super().on_response_complete()      # starts the next request if one came whole (pipelined)
            if self.transport.is_closing():
                return
            if self._input_ended and (self.idle() or self.cycle.more_body):
                self.transport.close()          # nothing more can come: what was sent whole is answered
            elif self.idle() and self._header_timer is None and self.conn.trailing_data[0]:
                self._await_headers()           # part of the next request is here already: its deadline runs

        def eof_received(self) -> bool | None:
            """The client's end of input. TCP says the same for a half-close (`shutdown(SHUT_WR)`, the client still
            reading) and for a closed socket, so an HTTP/1.1 request sent whole and not yet answered keeps its
            connection open for writing: an interim `100 Continue` (which HTTP/1.1 lets any request have) goes out
            if the answer has not started; a closed socket answers it, or the answer's next bytes, with a reset,
            seen within PEER_POLL_S, and the request's client counts as gone; a half-closed one reads its answers,
            every request it sent whole (pipelined ones too), then the connection closes. Anything else closes now,
            as uvicorn does (and so vLLM's server)."""
            cycle = self.cycle
            if cycle is None or cycle.response_complete or cycle.more_body or \
                    cycle.scope.get("http_version") != "1.1":
                return None
            self._input_ended = True
            if not cycle.response_started:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._watch_peer()
            return True

        def _watch_peer(self) -> None:
            sock = self.transport.get_extra_info("socket")
            if self.transport.is_closing() or sock is None:
                return
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self.transport.abort()      # reset: uvicorn tells the request its client is gone
            else:
                self.loop.call_later(PEER_POLL_S, self._watch_peer)

        def connection_lost(self, exc) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            """A deadline for the next request's headers, armed once per request (the timer knows for which)."""
            if header_timeout_s:
                self._stop_header_timer()
                self._header_cycle = self.cycle
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late, self.cycle)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self, cycle) -> None:
            self._header_timer = None
            if self.cycle is cycle and not self.transport.is_closing():     # no request's headers came since
                self._answer_and_close(APIError(408, f"request headers incomplete after {header_timeout_s:g} s "
                                                     f"(--header-timeout)", code="request_timeout"))

    return Protocol
