"""Shutdown, the queue bound and disconnects, against real server processes (`python -m serving`).

Where requests must be running or queued when something happens, the server runs the `paced` runtime: the real
PyTorch engine with a pause before each decode step (tests/fixtures/paced_runtime.py).
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest
import requests

from tests.fixtures.observe import hangs_up_waiting, metrics as gauges, wait_until
from devtools.pressure import trickle
from devtools.server import REPO, address, serving_env
from tests.fixtures.serving import tiny_server
from devtools.tiny_gemma4 import ANSWER, QUESTION

ASK = [{"role": "user", "content": QUESTION}]
LONG = {"messages": ASK, "max_tokens": 200, "ignore_eos": True}        # 200 paced steps: seconds




def in_flight(url: str) -> float:
    m = gauges(url)
    return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]


class Call(threading.Thread):
    """One request in a thread: .status, .body (JSON) or .events (SSE data lines) once joined."""

    def __init__(self, url: str, body: dict, path: str = "/v1/chat/completions"):
        super().__init__(daemon=True)
        self.url, self.body, self.path = url, body, path
        self.status, self.json, self.events, self.error = None, None, [], None
        self.first = threading.Event()
        self.start()

    def run(self):
        try:
            with requests.post(self.url + self.path, json=self.body, stream=True, timeout=120) as r:
                self.status = r.status_code
                if r.headers.get("content-type", "").startswith("text/event-stream"):
                    for line in r.iter_lines(decode_unicode=True):
                        if line:
                            self.events.append(line)
                            self.first.set()
                else:
                    self.json = r.json()
        except Exception as e:      # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.first.set()

    def chunks(self) -> list[dict]:
        return [json.loads(e[len("data: "):]) for e in self.events if e != "data: [DONE]"]


# --------------------------------------------------------------------------------------------- shutdown
def test_sigterm_lets_running_and_queued_requests_finish_then_exits_0(tiny_gemma4):
    with tiny_server(tiny_gemma4, "--shutdown-timeout", "60", pace=0.02) as srv:
        stream = Call(srv.url, {**LONG, "stream": True})          # 200 steps, 4 s: the second request comes in it
        stream.first.wait(30)
        queued = Call(srv.url, {"messages": ASK})
        wait_until(lambda: in_flight(srv.url) == 2, what="one running, one queued")
        srv.terminate()
        stream.join(60), queued.join(60)
        assert srv.exited(60) == 0, srv.output[-3000:]
    assert stream.events[-1] == "data: [DONE]"
    assert stream.chunks()[-1]["choices"][0]["finish_reason"] == "length"
    assert len([c for c in stream.chunks() if c["choices"][0]["delta"].get("content")]) > 0
    assert queued.status == 200 and queued.json["choices"][0]["message"]["content"] == ANSWER
    with pytest.raises(requests.ConnectionError):      # gone: nothing listens any more
        requests.get(f"{srv.url}/health", timeout=5)


def test_past_the_grace_period_streams_end_with_abort_and_the_rest_get_503(tiny_gemma4):
    with tiny_server(tiny_gemma4, "--shutdown-timeout", "3", pace=0.05) as srv:
        running = Call(srv.url, {**LONG, "stream": True})
        running.first.wait(30)
        queued_stream = Call(srv.url, {**LONG, "stream": True})
        queued = Call(srv.url, {"messages": ASK})
        wait_until(lambda: in_flight(srv.url) == 3, what="one running, two queued")
        before = len(running.events)
        srv.terminate()
        # draining, within the grace period (3 s of the stream's 10): /health and new requests get a 503
        wait_until(lambda: requests.get(f"{srv.url}/health", timeout=5).status_code == 503, what="the drain")
        late = requests.post(f"{srv.url}/v1/chat/completions", json={"messages": ASK}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
        for c in (running, queued_stream, queued):
            c.join(60)
        assert srv.exited(60) == 0, srv.output[-3000:]
    # Counted in steps, not seconds (a loaded machine slows the steps, never speeds them): each waits its 0.05 s
    # pace, so the 3 s grace holds at most 60, and the abort comes within one more (not after 200 steps).
    after = [c for c in running.chunks()[before:] if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(after) <= 3 / 0.05 + 2, len(after)
    assert running.status == 200 and running.error is None
    assert running.events[-1] == "data: [DONE]", running.events[-3:]
    assert running.chunks()[-1]["choices"][0]["finish_reason"] == "abort"
    assert any(c["choices"][0]["delta"].get("content") for c in running.chunks())   # it had generated text
    for c in (queued, queued_stream):           # never started: a 503 (a stream's headers had not gone out)
        assert c.status == 503 and set(c.json["error"]) == {"message", "type", "param", "code"}, (c.status, c.events)
        assert "shutting down" in c.json["error"]["message"]


def test_a_running_non_streamed_request_past_the_grace_period_gets_a_json_503(tiny_gemma4):
    with tiny_server(tiny_gemma4, "--shutdown-timeout", "0.5", pace=0.05) as srv:
        running = Call(srv.url, LONG)
        wait_until(lambda: gauges(srv.url)["vllm:num_requests_running"] == 1, what="request running")
        srv.terminate()
        running.join(60)
        assert srv.exited(60) == 0, srv.output[-3000:]
    assert running.status == 503 and running.json["error"]["type"] == "service_unavailable"


def test_an_idle_server_exits_0_at_once(tiny_gemma4):
    with tiny_server(tiny_gemma4, "--shutdown-timeout", "300") as srv:
        t0 = time.monotonic()
        srv.terminate()
        assert srv.exited(150) == 0, srv.output[-3000:]
        # the 300 s grace is for requests, not spent when there are none (half of it: room for a loaded machine)
        assert time.monotonic() - t0 < 150


# ---------------------------------------------------------------------------------------------- queueing
@pytest.fixture(scope="module")
def paced(tiny_gemma4):
    with tiny_server(tiny_gemma4, "--max-waiting", "2", pace=0.05) as srv:
        yield srv.url
        assert srv.stop() == 0


def test_a_burst_gets_exactly_the_running_slot_plus_max_waiting(paced):
    wait_until(lambda: in_flight(paced) == 0, what="an idle server")
    go = threading.Barrier(6)
    results = []

    def ask():
        go.wait()
        # 60 paced steps, 3 s: all six arrive within the first request, under load too
        r = requests.post(f"{paced}/v1/chat/completions", json={**LONG, "max_tokens": 60}, timeout=120)
        results.append(r)

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    codes = sorted(r.status_code for r in results)
    assert codes == [200, 200, 200, 429, 429, 429], [r.text for r in results]      # 1 running + 2 waiting
    for r in results:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded"


def test_disconnect_mid_stream_frees_the_slot(paced):
    wait_until(lambda: in_flight(paced) == 0, what="an idle server")
    before = gauges(paced)
    with requests.post(f"{paced}/v1/chat/completions", stream=True, timeout=60, json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith(b"data: ")
    wait_until(lambda: in_flight(paced) == 0, timeout=10, what="the abandoned generation to stop")
    after = gauges(paced)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 100
    assert after["vllm:request_success_total{finished_reason=abort}"] - \
        before.get("vllm:request_success_total{finished_reason=abort}", 0) == 1
    r = requests.post(f"{paced}/v1/chat/completions", json={"messages": ASK}, timeout=60)
    assert r.json()["choices"][0]["message"]["content"] == ANSWER


def test_clients_that_left_the_queue_hold_no_slot(paced):
    wait_until(lambda: in_flight(paced) == 0, what="an idle server")
    running = Call(paced, {**LONG, "max_tokens": 80})
    wait_until(lambda: gauges(paced)["vllm:num_requests_running"] == 1, what="request running")
    for _ in range(2):                       # fill the queue (max 2), each client hangs up
        assert hangs_up_waiting(paced, {"messages": ASK, "stream": True}, 0.3)
    # each is seen gone (a socket poll, not at once: under load the last may still count when the next comes)
    wait_until(lambda: gauges(paced)["vllm:num_requests_waiting"] == 0, what="the queue emptied by hang-ups")
    # admitted (no 429 at once) while the first request runs
    assert hangs_up_waiting(paced, {"messages": ASK, "stream": True, "max_tokens": 2}, 0.5)
    assert running.is_alive()
    running.join(60)


def test_a_request_that_waits_past_max_queue_wait_gets_a_429(tiny_gemma4):
    """One slot busy for ~5 s (100 paced steps): the requests queued behind it, plain and streamed, get a 429 once
    they have waited 1 s (--max-queue-wait 1), not an answer minutes later (a CPU server with one slot took 331 s
    for a 32-client storm); the running one finishes, and the gauges come back to zero."""
    with tiny_server(tiny_gemma4, "--max-waiting", "8", "--max-queue-wait", "1", pace=0.05) as srv:
        running = Call(srv.url, {**LONG, "max_tokens": 100})
        wait_until(lambda: gauges(srv.url)["vllm:num_requests_running"] == 1, what="request running")
        queued = [Call(srv.url, {"messages": ASK}), Call(srv.url, {"messages": ASK, "stream": True})]
        for c in queued:
            c.join(60)
            assert c.status == 429 and c.json["error"]["code"] == "rate_limit_exceeded", (c.status, c.json, c.events)
            assert "--max-queue-wait" in c.json["error"]["message"]
        assert running.is_alive()                      # refused while the slot was still busy
        running.join(60)
        assert running.status == 200 and running.json["choices"][0]["finish_reason"] == "length"
        wait_until(lambda: in_flight(srv.url) == 0, what="the gauges back to zero")
        r = requests.post(f"{srv.url}/v1/chat/completions", json={"messages": ASK}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ANSWER


def test_max_waiting_0_admits_only_when_the_engine_is_free(tiny_gemma4):
    with tiny_server(tiny_gemma4, "--max-waiting", "0", pace=0.05) as srv:
        first = Call(srv.url, {**LONG, "max_tokens": 60})
        wait_until(lambda: gauges(srv.url)["vllm:num_requests_running"] == 1, what="request running")
        r = requests.post(f"{srv.url}/v1/chat/completions", json={"messages": ASK}, timeout=60)
        assert r.status_code == 429
        first.join(60)
        assert first.status == 200
        r = requests.post(f"{srv.url}/v1/chat/completions", json={"messages": ASK}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ANSWER


@pytest.mark.parametrize("flag,value", [("--max-waiting", "-1"), ("--max-waiting", "many"),
                                        ("--shutdown-timeout", "-2"), ("--shutdown-timeout", "inf"),
                                        ("--max-body-bytes", "0"), ("--allowed-origins", "*")])
def test_nonsense_flag_values_are_refused(tiny_gemma4, flag, value):
    proc = subprocess.run([sys.executable, "-m", "serving", "--runtime", "pytorch", "--model", str(tiny_gemma4),
                           flag, value], cwd=REPO, env=serving_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_abort_all_ends_requests_taken_from_the_queue_but_not_started(tiny_gemma4):
    """--shutdown-timeout 0 on JAX: a slow prefill holds the engine thread while the jobs taken with it wait their
    turn; abort_all must end those too (they ran on to `length`), not only the queued and the running ones."""
    import asyncio

    from serving.core.metrics import Metrics
    from serving.core.scheduler import Job, Scheduler
    from serving.core.generation import Finish, SamplingParams, TokenizerInfo

    info = TokenizerInfo.load(tiny_gemma4)
    prefilling, release = threading.Event(), threading.Event()

    class SlowPrefill:                      # the engine seam: a prefill that waits for the test
        slots, max_context, vocab_size = 4, 64, info.vocab_size

        def start(self, slot, prompt_ids, params, mask=None):
            prefilling.set()
            release.wait(10)
            return 7

        def step(self, tokens, masks=None):
            return {slot: 7 for slot in tokens}

    async def main():
        sched = Scheduler(Metrics("t"), max_waiting=4)
        sched.engine, sched.info = SlowPrefill(), info
        runner = asyncio.create_task(sched.run())
        loop = asyncio.get_running_loop()
        jobs = [Job([2, 5, 9], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), loop)
                for _ in range(3)]
        sched.submit(*jobs)
        assert await asyncio.to_thread(prefilling.wait, 10)      # job 0 in prefill, jobs 1 and 2 taken with it
        aborted = sched.abort_all()
        release.set()
        ends = []
        for job in jobs:
            while not isinstance(ev := (await asyncio.wait_for(job.events.get(), 10))[1], Finish):
                pass
            ends.append((ev.reason, job.shutdown))
        sched.cancel_all()
        await asyncio.wait_for(runner, 10)
        return aborted, ends

    aborted, ends = asyncio.run(main())
    assert (aborted, ends) == (3, [("abort", True)] * 3)


@pytest.mark.parametrize("runtime", ["pytorch", "jax"])
def test_n_choices_wait_as_one_request(tiny_gemma4, jax_compile_cache, runtime):
    """One slot, --max-queue-wait 1, n=3 choices of 30 paced steps (1.5 s each): the second and third choice wait
    for the slot while their siblings run, longer than 1 s, and must not expire (before: a 429 after the first,
    or a 200 stream with an error event in it). Plain and streamed, on both runtimes."""
    body = {**LONG, "max_tokens": 30, "n": 3, "temperature": 1.0, "seed": 4}
    env = serving_env(jax_compile_cache, G5G_JAX_SLOTS="1") if runtime == "jax" else serving_env()
    with tiny_server(tiny_gemma4, "--max-waiting", "8", "--max-queue-wait", "1", runtime=runtime, pace=0.05,
                     env=env) as srv:
        plain = Call(srv.url, body)
        plain.join(120)
        streamed = Call(srv.url, {**body, "stream": True})
        streamed.join(120)
        assert plain.status == 200, (plain.status, plain.json)
        assert [c["finish_reason"] for c in plain.json["choices"]] == ["length"] * 3
        assert streamed.status == 200 and streamed.events[-1] == "data: [DONE]", streamed.events[-3:]
        chunks = [json.loads(e.removeprefix("data: ")) for e in streamed.events[:-1]]
        assert not [c for c in chunks if "error" in c]
        assert sorted(ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]) == [0, 1, 2]


def test_a_request_behind_n_choices_takes_the_next_free_slot(tiny_gemma4):
    """One slot (PyTorch on the CPU), n=3 choices of 30 paced steps (1.5 s each) running, then a small chat: it
    takes the slot as soon as the first choice ends and is answered while the n=3 request still runs (before: it
    waited for all three choices, as every client waited behind n=64 x 220 tokens, and got a 429)."""
    with tiny_server(tiny_gemma4, "--max-waiting", "8", pace=0.05) as srv:
        many = Call(srv.url, {**LONG, "max_tokens": 30, "n": 3})
        wait_until(lambda: gauges(srv.url)["vllm:num_requests_running"] == 1, what="the n=3 request running")
        small = Call(srv.url, {"messages": ASK, "max_tokens": 2})
        small.join(60)
        assert small.status == 200 and many.is_alive(), (small.status, small.json)
        many.join(60)
        assert many.status == 200 and len(many.json["choices"]) == 3


def test_free_slots_go_turn_about_to_the_oldest_job_and_the_least_served_request():
    """Request A (n=5) came first, then B and C (one choice each): A0 (the oldest), B (fewest started), A1, C, A2;
    then A alone takes A3, and D, coming after, the next slot, before A4."""
    import threading
    sched, jobs, loop = _expiring([5.0, 5.0, 5.0, 5.0, 5.0, 2.0, 1.0, 0.0])
    a = threading.Event()
    for i, job in enumerate(jobs[:5]):
        job.started, job.index = a, i
    d = jobs.pop()
    sched.queued.remove(d)
    assert sched._take(5) == [jobs[0], jobs[5], jobs[1], jobs[6], jobs[2]]
    assert sched._take(1) == [jobs[3]]
    sched.queued.append(d)
    assert sched._take(5) == [d, jobs[4]] and not sched.queued
    loop.close()


def test_a_request_with_more_choices_than_slots_leaves_one_slot_to_the_others():
    """Four slots. A (n=10) takes three and leaves the fourth free even with nobody else waiting; B, coming after,
    takes it at once. C (n=4, one pass) takes all four: a request that fits is never held back. One slot: the rule
    would leave nothing, so it does not apply."""
    import types

    sched, jobs, loop = _expiring([5.0] * 10 + [1.0] + [0.5] * 4)
    sched.engine = types.SimpleNamespace(slots=4)
    a, b, c = jobs[:10], jobs[10], jobs[11:]
    for group in (a, c):
        for i, job in enumerate(group):
            job.events, job.started, job.index, job.choices = group[0].events, group[0].started, i, len(group)
    sched.queued.remove(b)
    for job in c:
        sched.queued.remove(job)
    assert sched._take(4) == a[:3]
    sched.batch = types.SimpleNamespace(live={slot: types.SimpleNamespace(job=j) for slot, j in enumerate(a[:3])})
    assert sched._take(1) == []                 # running three, A waits for one of its own to end
    sched.queued.append(b)
    assert sched._take(1) == [b]
    sched.batch.live.popitem()                  # one of A's choices ended: A takes that slot again
    assert sched._take(1) == [a[3]]
    sched.batch = None
    sched.queued.clear()
    sched.queued.extend(c)
    assert sched._take(4) == c
    sched.engine.slots = 1
    sched.queued.extend(a[4:])
    assert sched._take(1) == [a[4]]
    loop.close()


def _expiring(jobs_ago: list[float], max_queue_wait: float = 1.0):
    """A Scheduler whose FIFO holds jobs that arrived `ago` seconds back, and the loop their events go to."""
    from serving.core.generation import SamplingParams
    from serving.core.metrics import Metrics
    from serving.core.scheduler import Job, Scheduler

    loop = asyncio.new_event_loop()
    sched = Scheduler(Metrics("t"), max_waiting=8, max_queue_wait=max_queue_wait)
    now = time.monotonic()
    jobs = [Job([2, 5], SamplingParams(temperature=0.0, max_tokens=4), loop, arrival=now - ago) for ago in jobs_ago]
    sched.queued.extend(jobs)
    return sched, jobs, loop


def _answers(loop, jobs) -> list:
    """What each job was sent (an error's status, as the API layer answers it), once the loop ran the callbacks the
    engine thread queued."""
    from serving.api.answers import api_error
    from serving.core.scheduler import SchedulerError

    loop.run_until_complete(asyncio.sleep(0))
    out = [j.events.get_nowait()[1] if not j.events.empty() else None for j in jobs]
    loop.close()
    return [api_error(ev).status if isinstance(ev, SchedulerError) else ev for ev in out]


def test_a_cancelled_head_of_the_queue_does_not_hold_back_the_expiry_behind_it():
    """The FIFO's head left (cancelled) while queued; the jobs behind it waited past --max-queue-wait: each gets
    its 429, and only the young one stays queued."""
    sched, jobs, loop = _expiring([5.0, 4.0, 3.0, 0.0])
    jobs[0].cancelled.set()
    sched._expire()
    assert list(sched.queued) == [jobs[3]]
    assert _answers(loop, jobs)[1:] == [429, 429, None]


def test_a_choice_whose_sibling_has_a_slot_never_expires():
    """Choices 0 and 1 of one request: 0 has a slot (taken from the queue), so 1 waits on without a deadline; an
    older-than-the-limit request behind it still expires."""
    import threading
    sched, jobs, loop = _expiring([5.0, 5.0, 3.0])
    jobs[0].started = jobs[1].started = threading.Event()
    sched.queued.popleft().started.set()
    sched._expire()
    assert list(sched.queued) == [jobs[1]]
    assert _answers(loop, jobs)[1:] == [None, 429]


# ------------------------------------------------------------------------------------------ connections
def _status_line(sock, timeout: float = 30.0) -> bytes:
    """The first line the server sends on `sock` (b"" if it closes without one)."""
    sock.settimeout(timeout)
    answer = b""
    try:
        while b"\r\n" not in answer and (chunk := sock.recv(4096)):
            answer += chunk
    except TimeoutError:
        return b"no answer"
    return answer.split(b"\r\n", 1)[0]


def test_idle_slow_and_surplus_connections_are_answered_and_closed(tiny_gemma4):
    """--header-timeout 3 (the surplus connection comes well within it), --max-connections 3, --body-total-timeout 2.
    An idle connection and one that sends its headers a byte at a time get a 408 and are closed (before: kept
    for ever, 20 100 of them ran the server out of descriptors); a fourth connection while three are open takes the
    place of the oldest idle one, which gets a 503 at once (before: the fourth got it, /health too:
    tests/test_http_framing.py); a body that comes a byte every 0.3 s (each gap well inside --body-timeout 10) gets
    a 408 once it has taken 2 s in all. /health answers after."""
    import socket
    with tiny_server(tiny_gemma4, "--header-timeout", "3", "--max-connections", "3", "--body-total-timeout", "2",
                     "--body-timeout", "10") as srv:
        server = address(srv.url)
        idle = [socket.create_connection(server, timeout=10) for _ in range(3)]
        with socket.create_connection(server, timeout=10) as surplus:
            assert _status_line(idle[0]) == b"HTTP/1.1 503 Service Unavailable"
            assert [_status_line(s) for s in (*idle[1:], surplus)] == [b"HTTP/1.1 408 Request Timeout"] * 3
        for s in idle:
            s.close()
        with socket.create_connection(server, timeout=10) as slow:
            trickle(slow, b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: x\r\n" * 20, 0.1)
            assert _status_line(slow) == b"HTTP/1.1 408 Request Timeout"
        with socket.create_connection(server, timeout=10) as body:
            body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n")
            trickle(body, b" " * 99, 0.3)
            assert _status_line(body) == b"HTTP/1.1 408 Request Timeout"
        assert requests.get(f"{srv.url}/health", timeout=10).status_code == 200
