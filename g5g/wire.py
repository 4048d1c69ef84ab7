"""One chat request on the wire, timed the same way for every server (used by smoke and bench).

Timing follows `vllm bench serve` (vllm/benchmarks/lib/endpoint_request_func.py, 0.33.0): a clock starts just before
the request is sent; TTFT is the arrival of the first chunk carrying text, every later text chunk adds one ITL gap,
and the latency (E2EL) ends at the last chunk carrying text — the role-only opening chunk, the finish chunk and the
trailing usage chunk carry no token and move no clock. One deviation: vLLM also counts a chunk whose `content` is
the empty string (a special token decoded to nothing) as output; we count only chunks that carry text, as the
issue defines it, so a server streaming empty keep-alive deltas cannot shorten its TTFT.
"""
from __future__ import annotations

import dataclasses
import json
import time

import requests


@dataclasses.dataclass
class Answer:
    """What one request got back, and when."""

    text: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    success: bool = False
    error: str = ""
    start_time: float = 0.0  # perf_counter at send
    ttft: float = 0.0  # seconds, send → first text chunk (streaming only)
    latency: float = 0.0  # seconds, send → last text chunk (streaming) / → full body (non-streaming)
    itl: list[float] = dataclasses.field(default_factory=list)  # gaps between text chunks
    chunks: int = 0  # chunks that carried text
    server_ttft: float | None = None  # from a `metrics` field in the response, when the server sends one
    stream: bool = True

    @property
    def completion_tokens(self) -> int | None:
        n = (self.usage or {}).get("completion_tokens")
        return n if isinstance(n, int) else None

    @property
    def prompt_tokens(self) -> int | None:
        n = (self.usage or {}).get("prompt_tokens")
        return n if isinstance(n, int) else None


def chat_payload(model: str, prompt: str, max_tokens: int, stream: bool, temperature: float = 0.0,
                 ignore_eos: bool = False) -> dict:
    payload = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
               "temperature": temperature, "stream": stream}
    if ignore_eos:          # vLLM's extension (and ours): exactly max_tokens, whatever the model says
        payload["ignore_eos"] = True
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


def _delta_text(choice: dict) -> tuple[str, str]:
    delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    return delta.get("content") or "", reasoning if isinstance(reasoning, str) else ""


def _note_server_metrics(ans: Answer, data: dict) -> None:
    metrics = data.get("metrics")
    if isinstance(metrics, dict) and isinstance(metrics.get("time_to_first_token_ms"), (int, float)):
        ans.server_ttft = metrics["time_to_first_token_ms"] / 1000.0


def _sse_events(resp: requests.Response, deadline: float):
    """Yield (arrival time, data payload) per SSE event, timestamped when its bytes came off the socket.

    read1 (urllib3 ≥ 2) returns what one socket read or one HTTP chunk delivers, so no buffer waits to fill up;
    older urllib3 falls back to iter_content(None), which yields chunked bodies chunk by chunk.
    """
    read1 = getattr(resp.raw, "read1", None)
    pieces = None if read1 else resp.iter_content(chunk_size=None)
    buf = b""
    while True:
        if time.perf_counter() > deadline:
            raise TimeoutError("request exceeded its time limit")
        data = read1(65536) if read1 else next(pieces, b"")
        now = time.perf_counter()
        if not data:
            return
        buf += data
        while True:
            # Events end with a blank line; accept \r\n line ends too.
            cut = min((i for i in (buf.find(b"\n\n"), buf.find(b"\r\n\r\n")) if i >= 0), default=-1)
            if cut < 0:
                break
            sep = 4 if buf[cut:cut + 4] == b"\r\n\r\n" else 2
            raw, buf = buf[:cut], buf[cut + sep:]
            lines = [ln.strip() for ln in raw.decode("utf-8", "replace").splitlines()]
            payload = "\n".join(ln[5:].lstrip() for ln in lines if ln.startswith("data:"))
            if payload:  # comments (":…" pings) and event-only blocks carry no data
                yield now, payload


def stream_chat(session: requests.Session, url: str, payload: dict, timeout: float) -> Answer:
    """POST a streaming chat request and time it on the wire. Never raises for server or network trouble."""
    ans = Answer(stream=True)
    st = ans.start_time = time.perf_counter()
    last = st
    deadline = st + timeout
    try:
        with session.post(f"{url}/v1/chat/completions", json=payload, stream=True,
                          timeout=(min(10.0, timeout), timeout)) as resp:
            if resp.status_code != 200:
                ans.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return ans
            for ts, payload_text in _sse_events(resp, deadline):
                if payload_text == "[DONE]":
                    break
                data = json.loads(payload_text)
                _note_server_metrics(ans, data)
                if isinstance(data.get("usage"), dict):
                    ans.usage = data["usage"]
                for choice in data.get("choices") or []:
                    text, reasoning = _delta_text(choice)
                    if text or reasoning:
                        if ans.chunks == 0:
                            ans.ttft = ts - st
                        else:
                            ans.itl.append(ts - last)
                        last = ts
                        ans.chunks += 1
                        ans.text += text
                        ans.reasoning += reasoning
                    if choice.get("finish_reason"):
                        ans.finish_reason = choice["finish_reason"]
            ans.latency = last - st
            ans.success = True
    except (requests.RequestException, TimeoutError, ValueError, OSError) as e:
        ans.error = f"{type(e).__name__}: {e}"
    return ans


def chat(session: requests.Session, url: str, payload: dict, timeout: float) -> Answer:
    """POST a non-streaming chat request; latency is send → whole body."""
    ans = Answer(stream=False)
    st = ans.start_time = time.perf_counter()
    try:
        resp = session.post(f"{url}/v1/chat/completions", json=payload, timeout=(min(10.0, timeout), timeout))
        ans.latency = time.perf_counter() - st
        if resp.status_code != 200:
            ans.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
            return ans
        data = resp.json()
        _note_server_metrics(ans, data)
        choice = (data.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        ans.text = msg.get("content") or ""
        reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        ans.reasoning = reasoning if isinstance(reasoning, str) else ""
        ans.finish_reason = choice.get("finish_reason")
        ans.usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
        ans.success = True
    except (requests.RequestException, ValueError, OSError) as e:
        ans.error = f"{type(e).__name__}: {e}"
    return ans


def first_model(session: requests.Session, url: str, timeout: float = 10.0) -> str:
    """The id of the server's first model (GET /v1/models)."""
    return model_card(session, url, timeout)["id"]


def model_card(session: requests.Session, url: str, timeout: float = 10.0, model: str | None = None) -> dict:
    """The server's card for `model` (default: its first), e.g. {"id": …, "max_model_len": …}."""
    resp = session.get(f"{url}/v1/models", timeout=timeout)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{url}/v1/models lists no model")
    return next((m for m in models if m.get("id") == model), models[0] if model is None else {"id": model})
