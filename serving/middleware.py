"""What every HTTP request passes through before an endpoint sees it (one pure-ASGI middleware, streaming-safe):

- an `x-request-id` on every response: the client's own, or a new one (it also names the completion's id);
- `--api-key`: /v1/* needs exactly one `Authorization: Bearer <key>` header, as with `vllm serve --api-key` (401
  otherwise: a wrong key followed by the right one is refused too);
- a request-body limit (`--max-body-bytes`): 413 from the Content-Length alone, or as soon as a chunked body
  passes the limit, before anything parses or tokenises it;
- a body that stops coming (`--body-timeout`: seconds without a byte while the body is incomplete, e.g. a
  Content-Length of 100 and 7 bytes sent), or that takes longer than `--body-total-timeout` in all (one byte every
  few seconds), gets a 408, instead of holding its connection and handler open;

and, below the app, in the HTTP protocol (`http_protocol`):

- a request uvicorn's HTTP parser refuses (a malformed Content-Length, a garbled request line) gets an OpenAI
  error body too, not uvicorn's plain text;
- a connection whose request headers are not complete `--header-timeout` seconds after it opened (or after the
  first byte of its next request) gets a 408 and is closed: idle and slowloris connections hold no descriptor;
- past `--max-connections` open connections (kept below the process's descriptor limit) a new one gets a 503 and
  is closed at once, so the server always has a descriptor left to answer with;
- a client that shuts down its write side once its request is sent (a half-close) still gets its answer, and one
  that closed its socket is still found gone (`eof_received`).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import socket
import uuid

from serving.protocol import APIError


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
                 body_total_timeout_s: float = 60.0):
        self.app, self.limit, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self.body_total_timeout_s = body_total_timeout_s
        self.auth = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:256] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", rid.encode("latin-1"))]}
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
        received, complete = 0, False
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


PEER_POLL_S = 0.1       # how often a half-closed connection is checked for the reset that says its client is gone


def http_protocol(header_timeout_s: float = 10.0, max_connections: int = 0) -> type:
    """uvicorn's HTTP protocol as its "auto" picks it (httptools when installed, else h11), with an OpenAI error body
    for a request it cannot parse, a deadline on each request's headers, and a bound on open connections
    (0: none)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class Protocol(AutoHTTPProtocol):
        _header_timer = None

        def send_400_response(self, msg: str) -> None:
            self._answer_and_close(APIError(400, f"malformed HTTP request: {msg}"))

        def _answer_and_close(self, error: APIError) -> None:
            body = json.dumps(error.body()).encode()
            reason = {400: b"Bad Request", 408: b"Request Timeout", 503: b"Service Unavailable"}[error.status]
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n%s" % (error.status, reason, len(body), body))
            self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if max_connections and len(self.connections) > max_connections:
                self._answer_and_close(APIError(503, f"server busy: {max_connections} connections open "
                                                     f"(--max-connections); retry later", "service_unavailable"))
            else:
                self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._await_headers()           # the first byte of a next request on a kept-alive connection
            super().data_received(data)

        def eof_received(self) -> bool | None:
            """The client's end of input. TCP says the same for a half-close (`shutdown(SHUT_WR)`, the client still
            reading) and for a closed socket, so an HTTP/1.1 request sent whole and not yet answered keeps its
            connection open for writing: an interim `100 Continue` (which HTTP/1.1 lets any request have) goes out
            if the answer has not started; a closed socket answers it, or the answer's next bytes, with a reset,
            seen within PEER_POLL_S, and the request's client counts as gone; a half-closed one reads its answer,
            then the connection closes. Anything else closes now, as uvicorn does (and so vLLM's server)."""
            cycle = self.cycle
            if cycle is None or cycle.response_complete or cycle.more_body or \
                    cycle.scope.get("http_version") != "1.1":
                return None
            cycle.keep_alive = False
            if not cycle.response_started:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._watch_peer()
            return True

        def _watch_peer(self) -> None:
            if self.transport.is_closing():
                return
            if self.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self.transport.abort()      # reset: uvicorn tells the request its client is gone
            else:
                self.loop.call_later(PEER_POLL_S, self._watch_peer)

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            if header_timeout_s:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late, self.cycle)

        def _headers_late(self, cycle) -> None:
            self._header_timer = None
            if self.cycle is cycle and not self.transport.is_closing():     # no request's headers came since
                self._answer_and_close(APIError(408, f"request headers incomplete after {header_timeout_s:g} s "
                                                     f"(--header-timeout)", code="request_timeout"))

    return Protocol
