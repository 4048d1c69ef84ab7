"""serving/api/answers.py's collect against a client that stays and one that hangs up: the request is starlette's own,
over an ASGI receive channel; the jobs are the core's, their events sent from another thread as the engine's are."""
import asyncio
import threading

import pytest
from starlette.requests import ClientDisconnect, Request

from serving.api.answers import collect
from serving.core.generation import Delta, Finish
from serving.core.scheduler import Job
from serving.engine import SamplingParams


def _request(gone: asyncio.Event) -> Request:
    async def receive():
        if gone.is_set():
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)      # starlette's is_disconnected() polls without waiting

    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive)


def _engine(jobs: list[Job], tokens: int, stop: threading.Event) -> threading.Thread:
    """A stand-in for the engine thread's side of the contract: `tokens` deltas per choice, then each choice's end
    ("length"; "abort" for one whose job was cancelled, as the scheduler ends it)."""
    def run():
        for _ in range(tokens):
            if all(j.cancelled.is_set() for j in jobs) or stop.is_set():
                break
            for j in jobs:
                j.send(Delta("x", None))
            stop.wait(0.01)
        for j in jobs:
            j.send(Finish("abort" if j.cancelled.is_set() else "length", 3, 1, []))

    return threading.Thread(target=run, daemon=True)


def _jobs(n: int, loop: asyncio.AbstractEventLoop) -> list[Job]:
    events = asyncio.Queue()
    return [Job([2, 3, 4], SamplingParams(), loop, events=events, index=i) for i in range(n)]


async def _collect(hang_up_after: float | None, tokens: int):
    jobs, gone, stop = _jobs(4, asyncio.get_running_loop()), asyncio.Event(), threading.Event()
    engine = _engine(jobs, tokens, stop)
    engine.start()
    try:
        if hang_up_after is not None:
            asyncio.get_running_loop().call_later(hang_up_after, gone.set)
        return await asyncio.wait_for(collect(_request(gone), jobs), 30), jobs
    finally:
        stop.set()
        engine.join(5)


def test_a_client_that_stays_gets_every_choice():
    results, jobs = asyncio.run(_collect(None, tokens=5))
    assert [(text, fin.reason) for text, _, fin, _ in results] == [("xxxxx", "length")] * 4


def test_no_answer_is_built_for_a_client_that_hung_up():
    # 1 000 tokens a choice (10 s); the client leaves after 0.3 s: its choices are stopped and nothing is built
    with pytest.raises(ClientDisconnect):
        asyncio.run(_collect(0.3, tokens=1000))
