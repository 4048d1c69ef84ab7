"""The OpenAI-compatible server, live on loopback, driven with the official `openai` client.

The model is the tiny trained Gemma 4 fixture served by the PyTorch runtime (CPU), a `python -m serving` process
(tests/fixtures/serving.py). Where a test needs requests to pile up, the real engine is paced (a pause before each
decode step: the `paced` runtime); the health tests use the seam `create_app(load_engine=…)` in this process.
"""
from __future__ import annotations

import json
import threading

import openai
import pytest
import requests

from serving.api.app import create_app
from tests.fixtures.observe import hangs_up_waiting, metrics, wait_until
from devtools.tiny_gemma4 import ANSWER, QUESTION
from devtools.server import in_thread, wait_ready
from tests.fixtures.serving import tiny_server

ASK = [{"role": "user", "content": QUESTION}]
NAME = ("--served-model-name", "tiny-gemma4")


# ----------------------------------------------------------------------------------------------- helpers
def live_server(load_engine, model_dir, **kw):
    """create_app(load_engine, …) in this process (devtools/server.py's in_thread): the seam for a loader."""
    return in_thread(create_app(load_engine, model_dir, **kw))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)






@pytest.fixture(scope="module")
def engine(tiny_gemma4):
    from serving.torch_runtime import load
    return load(tiny_gemma4)


@pytest.fixture(scope="module")
def server(tiny_gemma4):
    with tiny_server(tiny_gemma4, *NAME) as srv:
        yield srv.url


# ------------------------------------------------------------------------------------------------- tests
def test_models_lists_the_served_name(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny-gemma4"]


def test_fixed_answer_verbatim(server):
    r = client(server).chat.completions.create(model="tiny-gemma4", messages=ASK)   # greedy by generation_config
    assert r.choices[0].message.content == ANSWER
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.object == "chat.completion" and r.model == "tiny-gemma4"


def test_streaming_gives_the_same_text_and_usage(server):
    c = client(server)
    plain = c.chat.completions.create(model="tiny-gemma4", messages=ASK, temperature=0)
    chunks = list(c.chat.completions.create(model="tiny-gemma4", messages=ASK, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [ch for ch in chunks if ch.choices]
    text = "".join(ch.choices[0].delta.content or "" for ch in with_choices)
    assert text == plain.choices[0].message.content == ANSWER
    assert [ch.choices[0].finish_reason for ch in with_choices][-1] == "stop"
    assert all(ch.choices[0].finish_reason is None for ch in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert len({ch.id for ch in chunks}) == 1


def test_stream_ends_with_done_and_no_usage_unless_asked(server):
    with requests.post(f"{server}/v1/chat/completions", stream=True, timeout=60,
                       json={"messages": ASK, "stream": True, "max_tokens": 3}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]"
    bodies = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all("usage" not in b for b in bodies)
    assert bodies[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_and_max_completion_tokens(server):
    c = client(server)
    a = c.chat.completions.create(model="tiny-gemma4", messages=ASK, max_tokens=5)
    b = c.chat.completions.create(model="tiny-gemma4", messages=ASK, max_completion_tokens=5)
    assert a.choices[0].finish_reason == b.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == b.usage.completion_tokens == 5
    assert a.choices[0].message.content == b.choices[0].message.content
    assert ANSWER.startswith(a.choices[0].message.content) and a.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_text(server, stream):
    c = client(server)
    for stop, expect in ((" Engineering", "Site Reliability"), (["zzz", "discipline"], ANSWER.split("discipline")[0])):
        r = c.chat.completions.create(model="tiny-gemma4", messages=ASK, stop=stop, stream=stream)
        if stream:
            chunks = [ch for ch in r if ch.choices]
            text, reason = "".join(ch.choices[0].delta.content or "" for ch in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert (text, reason) == (expect, "stop")


def test_seeded_sampling_is_reproducible_streamed_or_not(server):
    c = client(server)
    kw = dict(model="tiny-gemma4", messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.5,
              top_p=0.95, max_tokens=20, seed=1234)
    a = c.chat.completions.create(**kw).choices[0].message.content
    b = c.chat.completions.create(**kw).choices[0].message.content
    s = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw) if ch.choices)
    assert a == b == s


def test_negative_seed_is_a_seed_not_a_server_error(server):
    c = client(server)
    kw = dict(model="tiny-gemma4", messages=ASK, temperature=1.5, max_tokens=8, seed=-1)
    a = c.chat.completions.create(**kw)
    s = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw) if ch.choices)
    assert a.choices[0].finish_reason in ("stop", "length") and a.choices[0].message.content == s

BAD = [
    (b'{"messages": [', 400, None),                                                   # malformed JSON
    (b'[1, 2]', 400, None),                                                           # not an object
    (json.dumps({"messages": "hi"}), 400, "messages"),
    (json.dumps({"messages": []}), 400, "messages"),
    (json.dumps({"messages": ASK, "temperature": "hot"}), 400, "temperature"),
    (json.dumps({"messages": ASK, "temperature": 5}), 400, "temperature"),
    (json.dumps({"messages": ASK, "temperature": 2.01}), 400, "temperature"),           # OpenAI's range is 0-2
    (json.dumps({"messages": ASK, "max_tokens": 1.5}), 400, "max_tokens"),
    (json.dumps({"messages": ASK, "max_tokens": 0}), 400, "max_tokens"),
    (json.dumps({"messages": ASK, "stream": "yes"}), 400, "stream"),
    (json.dumps({"messages": ASK, "stop": 3}), 400, None),
    (json.dumps({"messages": ASK, "stop": [3]}), 400, "stop"),                       # not "stop.list[str].0"
    (json.dumps({"messages": ASK, "stop": ["a"] * 65}), 400, "stop"),               # each char cost every stop
    (json.dumps({"messages": ASK, "stop": ["x" * 8193] * 2}), 400, "stop"),         # the matcher's size
    (json.dumps({"messages": ASK, "stop": "x" * 16385}), 400, "stop"),
    (json.dumps({"messages": [{"role": "user", "content": 5}]}), 400, "messages.0.content"),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}), 400, "messages.0.role"),
    (json.dumps({"messages": [{"role": "tool", "content": "hi"}]}), 400, "messages.0.tool_call_id"),
    (json.dumps({"messages": [{"role": "function", "content": "hi"}]}), 400, "messages.0.role"),
    (json.dumps({"messages": [{"content": "hi"}]}), 400, "messages.0.role"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
     400, "messages.0.content"),
    (json.dumps({"messages": ASK, "n": 0}), 400, "n"),
    (json.dumps({"messages": ASK, "n": 10**6}), 400, "n"),                           # more than the server holds
    (json.dumps({"messages": ASK, "presence_penalty": 2.5}), 400, "presence_penalty"),
    (json.dumps({"messages": ASK, "logit_bias": {"99999": 5}}), 400, "logit_bias"),  # outside the vocabulary
    (json.dumps({"messages": ASK, "top_logprobs": 3}), 400, "top_logprobs"),         # without logprobs: true
    (json.dumps({"messages": ASK, "min_tokens": 9, "max_tokens": 4}), 400, "min_tokens"),
    (json.dumps({"messages": ASK, "max_tokens": 3, "stream_options": {"include_usage": True}}), 400,
     "stream_options"),
    (json.dumps({"messages": [{"role": "user", "content": "word " * 400}]}), 400, "messages"),   # > context
    (json.dumps({"messages": ASK, "max_tokens": 250}), 400, "messages"),   # prompt + max_tokens > context
    (json.dumps({"model": "gpt-4o", "messages": ASK}), 404, "model"),
]


def test_temperature_is_accepted_over_openais_whole_range():
    from serving.api.protocol import ChatRequest, parse
    for t in (0, 0.5, 2, 2.0):
        assert parse(ChatRequest, json.dumps({"messages": ASK, "temperature": t}).encode()).temperature == t


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_an_openai_error_not_a_500(server, body, status, param):
    r = requests.post(f"{server}/v1/chat/completions", data=body, headers={"content-type": "application/json"},
                      timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param, err
    assert requests.get(f"{server}/health", timeout=5).status_code == 200


def test_context_error_is_named_and_client_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError) as e:
        client(server).chat.completions.create(model="tiny-gemma4",
                                               messages=[{"role": "user", "content": "word " * 400}])
    assert "maximum context length is 256 tokens" in str(e.value)
    assert e.value.body["code"] == "context_length_exceeded"


def test_unknown_route_is_an_openai_404(server):
    r = requests.get(f"{server}/v1/nothing", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_metrics_count_the_requests_made(server):
    before = metrics(server)
    c = client(server)
    rs = [c.chat.completions.create(model="tiny-gemma4", messages=ASK, max_tokens=n) for n in (4, 7)]
    rs.append(c.chat.completions.create(model="tiny-gemma4", messages=ASK))
    streamed = list(c.chat.completions.create(model="tiny-gemma4", messages=ASK, max_tokens=6, stream=True,
                                              stream_options={"include_usage": True}))
    usages = [r.usage for r in rs] + [streamed[-1].usage]
    after = metrics(server)

    def d(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert d("vllm:e2e_request_latency_seconds_count") == 4
    assert d("vllm:time_to_first_token_seconds_count") == 4
    assert d("vllm:request_time_per_output_token_seconds_count") == 4
    assert d("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert d("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert d("vllm:inter_token_latency_seconds_count") == sum(u.completion_tokens - 1 for u in usages)
    assert d("vllm:request_success_total{finished_reason=length}") == 3
    assert d("vllm:request_success_total{finished_reason=stop}") == 1
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    # what vLLM's dashboards read too: per-request token histograms, queue time, preemptions (none: a slot holds a
    # whole context), the KV cache in use (none once idle)
    assert d("vllm:request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert d("vllm:request_generation_tokens_sum") == sum(u.completion_tokens for u in usages)
    assert d("vllm:request_prompt_tokens_count") == d("vllm:request_queue_time_seconds_count") == 4
    assert after["vllm:num_preemptions_total"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    text = requests.get(f"{server}/metrics", timeout=5).text
    assert 'vllm:generation_tokens_total{model_name="tiny-gemma4"}' in text


def test_kv_cache_usage_counts_the_running_requests_tokens(paced_server, tiny_gemma4):
    """vllm:kv_cache_usage_perc: the share of the runtime's KV cache (slots × context) the running requests fill."""
    long = threading.Thread(target=lambda: client(paced_server).chat.completions.create(
        model="tiny-gemma4", messages=ASK, max_tokens=100, extra_body={"ignore_eos": True}), daemon=True)
    long.start()
    seen = []
    wait_until(lambda: seen.append(metrics(paced_server)["vllm:kv_cache_usage_perc"]) or seen[-1] > 0,
               what="the KV cache to fill")
    used = seen[-1]
    assert 0 < used <= 1
    long.join(60)
    assert metrics(paced_server)["vllm:kv_cache_usage_perc"] == 0


# ------------------------------------------------------------------------------- queueing, with a paced engine
@pytest.fixture()
def paced_server(tiny_gemma4):
    with tiny_server(tiny_gemma4, *NAME, "--max-waiting", "3", pace=0.03) as srv:
        yield srv.url


def _in_flight(url: str) -> float:
    m = metrics(url)
    return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]


def _arrived(url: str) -> float:
    """Requests accepted so far: running + waiting + finished (any reason), read from one consistent scrape."""
    m = metrics(url)
    return (m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] +
            sum(v for k, v in m.items() if k.startswith("vllm:request_success_total")))


def test_parallel_requests_answered_in_arrival_order(paced_server):
    c = client(paced_server)
    finished: list[int] = []
    results: dict[int, str] = {}
    lock = threading.Lock()

    def ask(i: int) -> None:
        r = c.chat.completions.create(model="tiny-gemma4", messages=ASK, max_tokens=24)   # 0.7 s apart
        with lock:
            finished.append(i)
            results[i] = r.choices[0].message.content

    threads = []
    for i in range(4):                       # 1 running + 3 waiting: exactly the bound
        threads.append(threading.Thread(target=ask, args=(i,)))
        threads[-1].start()
        wait_until(lambda: _arrived(paced_server) >= i + 1, what=f"request {i} queued")
    for t in threads:
        t.join(timeout=60)
    assert finished == [0, 1, 2, 3]
    assert len(set(results.values())) == 1 and ANSWER.startswith(results[0])


def test_beyond_the_bound_is_429(paced_server):
    c = client(paced_server)
    done = []
    # the first runs 200 steps (6 s), so the other three are still queued when the fifth comes, under load too
    threads = [threading.Thread(target=lambda n=n: done.append(c.chat.completions.create(
        model="tiny-gemma4", messages=ASK, max_tokens=n, extra_body={"ignore_eos": True}))) for n in (200, 40, 40, 40)]
    for i, t in enumerate(threads):
        t.start()
        wait_until(lambda: _in_flight(paced_server) >= i + 1, what=f"request {i} in flight")
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model="tiny-gemma4", messages=ASK, max_tokens=2)
    assert e.value.body["code"] == "rate_limit_exceeded"
    for t in threads:
        t.join(timeout=60)
    assert len(done) == 4 and all(r.choices[0].finish_reason == "length" for r in done)


def test_disconnect_mid_stream_frees_the_slot(paced_server):
    before = metrics(paced_server)
    with requests.post(f"{paced_server}/v1/chat/completions", stream=True, timeout=60,
                       json={"messages": ASK, "stream": True, "max_tokens": 200, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]        # role chunk + a few tokens, then hang up
        assert got[0].startswith(b"data: ")
    wait_until(lambda: metrics(paced_server)["vllm:num_requests_running"] == 0, timeout=10,
               what="the abandoned generation to stop")
    generated = metrics(paced_server)["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0)
    assert 0 < generated < 100           # stopped early: 200 tokens would take 6 s at this pace
    r = client(paced_server).chat.completions.create(model="tiny-gemma4", messages=ASK, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert metrics(paced_server)["vllm:e2e_request_latency_seconds_count"] == 1   # the aborted one is not a success


def test_non_streaming_client_that_gives_up_frees_the_slot(paced_server):
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{paced_server}/v1/chat/completions", timeout=(5, 1.5),    # 200 tokens take 6 s
                      json={"messages": ASK, "max_tokens": 200, "ignore_eos": True})
    wait_until(lambda: metrics(paced_server)["vllm:num_requests_running"] == 0, timeout=10,
               what="the abandoned generation to stop")
    m = metrics(paced_server)
    assert 0 < m["vllm:generation_tokens_total"] < 100
    assert m["vllm:request_success_total{finished_reason=abort}"] == 1


def test_disconnect_while_queued_is_skipped(paced_server):
    c = client(paced_server)
    # 100 paced tokens (3 s) outlast the second request's 1 s wait: it is still queued when its client hangs up
    t = threading.Thread(target=lambda: c.chat.completions.create(model="tiny-gemma4", messages=ASK, max_tokens=100,
                                                                  extra_body={"ignore_eos": True}))
    t.start()
    wait_until(lambda: _in_flight(paced_server) >= 1, what="first request running")
    assert hangs_up_waiting(paced_server, {"messages": ASK, "stream": True, "max_tokens": 50})    # queued, gone
    t.join(timeout=60)
    wait_until(lambda: _in_flight(paced_server) == 0, what="queue to drain")
    # Only the first request generated anything; the second is counted as aborted.
    m = metrics(paced_server)
    assert m["vllm:generation_tokens_total"] == 100
    assert m["vllm:request_success_total{finished_reason=abort}"] == 1


def test_clients_that_left_the_queue_hold_no_slot(paced_server):
    c = client(paced_server)
    long = threading.Thread(target=lambda: c.chat.completions.create(model="tiny-gemma4", messages=ASK,
                                                                     max_tokens=200, extra_body={"ignore_eos": True}))
    long.start()
    wait_until(lambda: _in_flight(paced_server) >= 1, what="first request running")
    for _ in range(3):                                # fill the bound (max_waiting=3), each client hangs up
        assert hangs_up_waiting(paced_server, {"messages": ASK, "stream": True, "max_tokens": 5}, 0.3)
    # each is seen gone (a socket poll, not at once: under load the last may still count when the next comes)
    wait_until(lambda: metrics(paced_server)["vllm:num_requests_waiting"] == 0, what="the queue emptied by hang-ups")
    # admitted (not a 429 at once) while the 200-token request still runs (~6 s)
    assert hangs_up_waiting(paced_server, {"messages": ASK, "stream": True, "max_tokens": 2}, 0.5)
    assert long.is_alive()
    long.join(timeout=60)

# ------------------------------------------------------------------------------------------------- health
def test_health_is_503_until_loaded_and_warmed(tiny_gemma4, engine):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return engine

    with live_server(slow_load, tiny_gemma4) as url:
        r = requests.get(f"{url}/health", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["message"] == "model is loading"
        r = requests.post(f"{url}/v1/chat/completions", json={"messages": ASK}, timeout=5)
        assert r.status_code == 503
        release.set()
        assert wait_ready(f"{url}/health", timeout=60) is not None, "not ready 60 s after the model loaded"
        assert client(url).chat.completions.create(model=tiny_gemma4.name, messages=ASK).choices[0].message.content == ANSWER


@pytest.mark.parametrize("beside", [True, False])
def test_the_tokenizer_loads_beside_the_engine_only_where_asked(tiny_gemma4, engine, monkeypatch, beside):
    """create_app(tokenizer_beside_engine=True): the engine's load starts while the tokenizer loads (the tokenizer
    sees it start); False: the tokenizer has loaded before the engine's load starts. Both answer."""
    from serving.core.generation import TokenizerInfo

    engine_loading, saw = threading.Event(), []
    load_tokenizer = TokenizerInfo.load

    def tokenizer_seeing_the_engine(model_dir):
        saw.append(engine_loading.wait(30 if beside else 0.5))
        return load_tokenizer(model_dir)

    def load():
        engine_loading.set()
        return engine

    monkeypatch.setattr(TokenizerInfo, "load", tokenizer_seeing_the_engine)
    with live_server(load, tiny_gemma4, tokenizer_beside_engine=beside) as url:
        assert wait_ready(f"{url}/health", timeout=60) is not None
        answer = client(url).chat.completions.create(model=tiny_gemma4.name, messages=ASK)
        assert answer.choices[0].message.content == ANSWER
    assert saw == [beside]


def test_a_refused_tokenizer_fails_the_boot_without_waiting_for_the_engine_beside_it(tiny_gemma4, monkeypatch):
    from serving.core.generation import TokenizerInfo

    release, failed = threading.Event(), []

    def refused(model_dir):
        raise ValueError(f"{model_dir}/tokenizer.json: its decoder (WordPiece) is neither byte-level BPE nor …")

    def slow_load():
        release.wait(30)
        raise RuntimeError("the engine was not meant to finish")

    monkeypatch.setattr(TokenizerInfo, "load", refused)
    try:
        with live_server(slow_load, tiny_gemma4, tokenizer_beside_engine=True, on_load_error=failed.append) as url:
            wait_until(lambda: failed, what="load failure", timeout=10)
            assert isinstance(failed[0], ValueError)
            r = requests.get(f"{url}/health", timeout=5)
            assert r.status_code == 503 and "WordPiece" in r.json()["error"]["message"]
    finally:
        release.set()


def test_health_reports_a_load_failure(tiny_gemma4):
    def broken():
        raise FileNotFoundError("model.safetensors")

    failed = []
    with live_server(broken, tiny_gemma4, on_load_error=failed.append) as url:
        wait_until(lambda: failed, what="load failure")
        r = requests.get(f"{url}/health", timeout=5)
        assert r.status_code == 503 and "model.safetensors" in r.json()["error"]["message"]


def test_text_parts_of_a_message_are_joined_with_newlines_as_vllm_does():
    from serving.api.protocol import ChatRequest, messages, parse

    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert messages(parse(ChatRequest, json.dumps(body).encode()).messages)[0]["content"] == "a\nb"


NULLABLE = {"stream": None, "n": None, "ignore_eos": None, "min_tokens": None, "skip_special_tokens": None,
            "include_stop_str_in_output": None}


def test_openais_nullable_fields_take_null_as_the_default(server):
    """OpenAI's API lets `stream`, `n` (and vLLM's extensions) be null; a 400 refused what its own client may send.
    Null for a field where it means something else stays that (completions' max_tokens null: no limit)."""
    chat = requests.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": "tiny-gemma4", "messages": ASK, "add_generation_prompt": None, "continue_final_message": None,
        **NULLABLE})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == ANSWER and len(chat.json()["choices"]) == 1
    done = requests.post(f"{server}/v1/completions", timeout=60, json={
        "model": "tiny-gemma4", "prompt": "hi", "echo": None, "max_tokens": 2, **NULLABLE})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] <= 2, done.text
    tok = requests.post(f"{server}/tokenize", timeout=60, json={"messages": ASK, "return_token_strs": None,
                                                                 "add_generation_prompt": None})
    assert tok.status_code == 200 and tok.json()["token_strs"] is None, tok.text
    from serving.api.protocol import CompletionRequest, parse
    assert parse(CompletionRequest, b'{"prompt": "a", "max_tokens": null}').max_tokens is None


def test_the_stop_limits_are_exact():
    """64 stop strings and 16 384 characters in all are taken; one more of either is refused."""
    from serving.api.protocol import APIError, ChatRequest, parse

    def body(stop) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": stop}).encode()

    for ok in (["s"] * 64, "x" * 16_384, ["x" * 8_192] * 2, ["ab"] * 63 + ["c" * (16_384 - 126)]):
        assert parse(ChatRequest, body(ok)).stop == ok
    for bad, message in ((["s"] * 65, "stop: more than 64 stop strings"),
                         ("x" * 16_385, "stop: more than 16384 characters"),
                         (["ab"] * 63 + ["c" * (16_385 - 126)], "stop: more than 16384 characters")):
        with pytest.raises(APIError, match=message):
            parse(ChatRequest, body(bad))


def test_a_message_list_longer_than_the_context_holds_is_refused_before_validation():
    """More messages than max_messages: a context-length 400 before any message is validated (a bad last message is
    not reached); max_messages of them are validated (the bad one is named). MESSAGE_CHARS is what the shortest
    message adds to rendered_chars, the bound the chat route applies after validation, so the early refusal refuses
    nothing that the later one would take."""
    from serving.api.protocol import MESSAGE_CHARS, ROLES, APIError, ChatRequest, Message, messages, parse
    from serving.shaping.tokenizer import rendered_chars

    bad = {"role": "user", "content": 5}
    for n, refusal, code in ((4, "messages: more than 3 messages cannot fit this model's context",
                              "context_length_exceeded"), (3, "messages.2.content: ", None)):
        with pytest.raises(APIError, match=refusal) as e:
            parse(ChatRequest, json.dumps({"messages": [{"role": "user", "content": ""}] * (n - 1) + [bad]}).encode(),
                  max_messages=3)
        assert (e.value.status, e.value.code) == (400, code) and e.value.param.startswith("messages")
    least = [rendered_chars(messages([Message(role=role, content="")]), None) for role in ROLES if role != "tool"]
    assert min(least) == MESSAGE_CHARS == rendered_chars([{"role": "tool", "content": ""}], None)  # a tool's, bare
    assert len(parse(ChatRequest, json.dumps({"messages": ASK * 3}).encode(), max_messages=3).messages) == 3


def test_a_large_answer_is_serialised_off_the_event_loop():
    """64 choices of 220 tokens with 20 top logprobs each (~19 MB of JSON, as n=64 x top_logprobs 20 asks): built on
    the event loop it held /health for 2 s. A coroutine that wakes every millisecond meanwhile is never held up for
    a quarter of the answer's time, and the bytes are the JSON of the answer."""
    import asyncio
    import time

    from serving.api.answers import json_response
    from serving.api.completions import chat_logprobs
    from serving.core.generation import Logprob

    lps = [Logprob(f"tok{t}", -0.5, [(f"alt{k}", -1.0 - k) for k in range(20)]) for t in range(220)]

    def build() -> dict:
        return {"id": "x", "choices": [{"index": i, "message": {"role": "assistant", "content": "t" * 220},
                                        "logprobs": chat_logprobs(lps)} for i in range(64)], "usage": {"n": 1}}

    async def main():
        gaps, done = [], asyncio.Event()

        async def tick():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.001)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        response = await json_response(build)
        took = time.monotonic() - t0
        done.set()
        await ticker
        return response, took, max(gaps)

    import gc
    gc.collect()
    gc.freeze()         # as the server does after boot: a full collection walks this answer's objects only
    try:
        response, took, worst = asyncio.run(main())
    finally:
        gc.unfreeze()
    assert json.loads(response.body) == build() and len(response.body) > 10 * 2**20
    assert worst < took / 4, (worst, took)
