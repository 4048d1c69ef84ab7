"""What every HTTP request passes through before an endpoint sees it (one pure-ASGI middleware, streaming-safe):

- an `x-request-id` on every response: the client's own, or a new one (it also names the completion's id);
- `--api-key`: /v1/* needs exactly one `Authorization: Bearer <key>` header, as with `vllm serve --api-key` (401
  otherwise: a wrong key followed by the right one is refused too);
- a request-body limit (`--max-body-bytes`): 413 from the Content-Length alone, or as soon as a chunked body
  passes the limit, before anything parses or tokenises it;
- a body that stops coming (`--body-timeout`: seconds without a byte while the body is incomplete, e.g. a
  Content-Length of 100 and 7 bytes sent) gets a 408, instead of holding its connection and handler open;
- a request uvicorn's HTTP parser refuses (a malformed Content-Length, a garbled request line) gets an OpenAI
  error body too, not uvicorn's plain text (`http_protocol`).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import uuid

from serving.protocol import APIError


class BodyTooLarge(APIError):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than the server's limit of {limit} bytes "
                              f"(--max-body-bytes)", code="request_too_large")


class BodyTimeout(APIError):
    def __init__(self, seconds: float):
        super().__init__(408, f"request body incomplete: no byte of it came for {seconds:g} s (--body-timeout)",
                         code="request_timeout")


class Guard:
    def __init__(self, app, max_body_bytes: int, api_key: str | None = None, body_timeout_s: float = 10.0):
        self.app, self.limit, self.body_timeout_s = app, max_body_bytes, body_timeout_s
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

        async def limited_receive():
            nonlocal received, complete
            if complete:            # after the body: waits for the client to leave (a stream's watch), no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s or None)     # 0: no limit
            except asyncio.TimeoutError:
                raise BodyTimeout(self.body_timeout_s) from None    # reaches the endpoint's body read: a 408
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)       # reaches the endpoint's body read: a 413 response
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        await self.app(scope, limited_receive, send_with_id)


def http_protocol() -> type:
    """uvicorn's HTTP protocol as its "auto" picks it (httptools when installed, else h11), whose 400 for a request
    it cannot parse is an OpenAI error body."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class Protocol(AutoHTTPProtocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(APIError(400, f"malformed HTTP request: {msg}").body()).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return Protocol
