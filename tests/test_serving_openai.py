"""The OpenAI surface, driven with the official `openai` client against both runtimes' server processes.

Chat, completions (string and token-id prompts, streaming, echo), the sampling parameters (logprobs, n,
penalties, logit_bias, min_p, min_tokens, stop_token_ids), structured output (response_format), tool calls, the
parameters refused with a 400, model retrieval, /tokenize, /detokenize, /version, /ping, HEAD /health,
x-request-id; then --api-key and CORS on a server started with those flags.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import jsonschema
import openai
import pytest
import requests

from serving.api.completions import GOLDEN
from devtools.server import address, serving_env
from tests.fixtures.observe import wait_until
from tests.fixtures.serving import tiny_server
from devtools.tiny_gemma4 import ANSWER, QUESTION

ASK = [{"role": "user", "content": QUESTION}]
RUNTIMES = ["pytorch", "jax"]


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(params=RUNTIMES)
def url(request, runtime_servers):
    return runtime_servers[request.param]


def chat_ids(url: str) -> list[int]:
    """The fixture question rendered with the chat template, as token ids (from /tokenize)."""
    r = requests.post(f"{url}/tokenize", json={"model": "tiny", "messages": ASK}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ----------------------------------------------------------------------------------------------- chat
def test_chat_answer_streamed_and_not(url):
    c = client(url)
    r = c.chat.completions.create(model="tiny", messages=ASK)
    assert r.choices[0].message.content == ANSWER and r.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model="tiny", messages=ASK, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ANSWER
    assert chunks[-1].usage == r.usage


# ---------------------------------------------------------------------------------------- completions
def test_completion_of_token_ids_is_the_chat_answer(url):
    c = client(url)
    ids = chat_ids(url)
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=100, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ANSWER and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(ids)
    streamed = list(c.completions.create(model="tiny", prompt=ids, max_tokens=100, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == ANSWER
    assert [ch.choices[0].finish_reason for ch in streamed if ch.choices][-1] == "stop"
    assert streamed[-1].usage == r.usage


def test_completion_of_a_string_prompt_adds_bos_and_respects_max_tokens(url):
    c = client(url)
    r = c.completions.create(model="tiny", prompt="Site Reliability", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    n = requests.post(f"{url}/tokenize", json={"prompt": "Site Reliability"}, timeout=30).json()["count"]
    assert r.usage.prompt_tokens == n
    assert c.completions.create(model="tiny", prompt="Site Reliability").usage.completion_tokens <= 16  # default


def test_echo_prepends_the_prompt(url):
    c = client(url)
    plain = c.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0)
    echoed = c.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
    ids = chat_ids(url)
    text = requests.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    streamed = c.completions.create(model="tiny", prompt=ids, max_tokens=100, temperature=0, echo=True, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == text + ANSWER
    only = c.completions.create(model="tiny", prompt="Hi", max_tokens=0, echo=True)
    assert only.choices[0].text == "Hi" and only.usage.completion_tokens == 0


def test_completion_stop_and_seed(url):
    c = client(url)
    ids = chat_ids(url)
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=100, temperature=0, stop=[" Engineering"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("Site Reliability", "stop")
    kw = dict(model="tiny", prompt=ids, max_tokens=12, temperature=1.5, seed=7)
    assert c.completions.create(**kw).choices[0].text == c.completions.create(**kw).choices[0].text


# ------------------------------------------------------------------------------------ sampling parameters
def test_chat_logprobs_are_openais_shape(url):
    r = client(url).chat.completions.create(model="tiny", messages=ASK, temperature=0, logprobs=True,
                                            top_logprobs=3)
    choice = r.choices[0]
    assert choice.message.content == ANSWER
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content).startswith(ANSWER)
    for e in content:
        assert e.bytes == list(e.token.encode()) and e.logprob <= 0
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        # greedy, no adjustments: the chosen token is the most likely one
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    plain = client(url).chat.completions.create(model="tiny", messages=ASK, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert client(url).chat.completions.create(model="tiny", messages=ASK, max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs_streamed_and_not(url):
    c = client(url)
    ids = chat_ids(url)
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert "".join(lp.tokens) == r.choices[0].text == ANSWER[:len(r.choices[0].text)]
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(12)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and 1 <= len(top) <= 3 and max(top.values()) == value   # greedy: the top one
    chunks = list(c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, logprobs=2,
                                       stream=True))
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs


def test_prompt_logprobs_and_echo_with_logprobs_as_vllm(url):
    """prompt_logprobs: null for the first prompt token, then {id: {logprob, rank, decoded_token}} for the token and
    the top ones (chat: in the response, completions: in each choice); echo with logprobs puts the prompt's tokens
    first in the logprobs (the first one null), streamed or not, max_tokens 0 too."""
    c, ids = client(url), chat_ids(url)
    r = requests.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 3,
                                                      "temperature": 0, "prompt_logprobs": 2}, timeout=60).json()
    prompt = r["choices"][0]["prompt_logprobs"]
    assert len(prompt) == len(ids) and prompt[0] is None
    for token, entry in zip(ids[1:], prompt[1:]):
        mine = entry[str(token)]
        assert mine["logprob"] <= 0 and mine["rank"] >= 1 and 2 <= len(entry) <= 3
        ranked = sorted((e["rank"], -e["logprob"]) for e in entry.values())
        assert [r for r, _ in ranked][:2] == [1, 2] and ranked == sorted(ranked, key=lambda e: e[1])
    chat = requests.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 2,
                                                              "prompt_logprobs": 2}, timeout=60).json()
    assert chat["prompt_logprobs"] == prompt
    plain = c.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=2)
    echoed = c.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True)
    lp, n = echoed.choices[0].logprobs, len(ids)
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens and len(lp.tokens) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == [prompt[i][str(ids[i])]["logprob"] for i in range(1, n)]
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(n + 3)]
    assert all(len(top) <= 3 for top in lp.top_logprobs[1:])
    chunks = list(c.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, logprobs=2,
                                       echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == echoed.choices[0].text
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    only = c.completions.create(model="tiny", prompt=ids, max_tokens=0, logprobs=1, echo=True)
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n] and only.usage.completion_tokens == 0


def test_n_choices_are_independent_reproducible_and_indexed(url):
    c = client(url)
    kw = dict(model="tiny", messages=ASK, temperature=1.5, max_tokens=12, seed=7)
    r = c.chat.completions.create(n=3, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    texts = [ch.message.content for ch in r.choices]
    assert len(set(texts)) > 1
    assert [ch.message.content for ch in c.chat.completions.create(n=3, **kw).choices] == texts
    # choice i is the request alone with the seed 7 + i * GOLDEN (mod 2**64, as an int64): choice 0 the seed itself
    alone = [c.chat.completions.create(**{**kw, "seed": (7 + i * GOLDEN + 2**63) % 2**64 - 2**63}) for i in range(3)]
    assert [a.choices[0].message.content for a in alone] == texts
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    chunks = list(c.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    got = {i: "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
           for i in range(3)}
    assert got == dict(enumerate(texts))
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].finish_reason) == 3
    assert chunks[-1].usage == r.usage
    done = c.completions.create(model="tiny", prompt="Site", max_tokens=4, n=2, temperature=0)
    assert [ch.index for ch in done.choices] == [0, 1] and done.choices[0].text == done.choices[1].text


def test_logit_bias_stop_token_ids_and_min_tokens(url):
    c = client(url)
    ids = chat_ids(url)
    answer = c.completions.create(model="tiny", prompt=ids, max_tokens=100, temperature=0, logprobs=0)
    forced = requests.post(f"{url}/tokenize", json={"prompt": "Site", "add_special_tokens": False},
                           timeout=30).json()["tokens"][0]
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=1.0, seed=1,
                             logit_bias={str(forced): 100})
    assert r.choices[0].text == requests.post(f"{url}/detokenize", json={"tokens": [forced] * 5},
                                              timeout=30).json()["prompt"]
    tokens = requests.post(f"{url}/tokenize", json={"prompt": ANSWER, "add_special_tokens": False},
                           timeout=30).json()["tokens"]
    stop = tokens[3]
    first = tokens.index(stop)
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=100, temperature=0,
                             extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    n = answer.usage.completion_tokens
    r = c.completions.create(model="tiny", prompt=ids, max_tokens=n + 10, temperature=0,
                             extra_body={"min_tokens": n + 4})
    assert r.usage.completion_tokens >= n + 4 and r.choices[0].text.startswith(ANSWER)


def test_both_runtimes_answer_the_same_with_these_parameters(runtime_servers):
    """Greedy with penalties, bias and logprobs: the same text and (within float tolerance) the same logprobs, the
    prompt's too."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "What is a stop string?"}], temperature=0,
              max_tokens=20, logprobs=True, top_logprobs=2, presence_penalty=0.8, frequency_penalty=0.4,
              logit_bias={"40": 2.5}, extra_body={"repetition_penalty": 1.3, "min_tokens": 5, "prompt_logprobs": 2})
    answers = [client(runtime_servers[rt]).chat.completions.create(**kw) for rt in RUNTIMES]
    a, b = (r.choices[0] for r in answers)
    assert a.message.content == b.message.content
    for x, y in zip(*(r.model_extra["prompt_logprobs"][1:] for r in answers), strict=True):
        assert x.keys() == y.keys() and all(abs(x[t]["logprob"] - y[t]["logprob"]) < 2e-3 for t in x)
    for x, y in zip(a.logprobs.content, b.logprobs.content, strict=True):
        assert x.token == y.token and abs(x.logprob - y.logprob) < 2e-3
        assert [t.token for t in x.top_logprobs] == [t.token for t in y.top_logprobs]


@pytest.mark.parametrize("kind,kw,param", [
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat", {"logit_bias": {"five": 3}}, "logit_bias"),
    ("chat", {"logit_bias": {"512": 3}}, "logit_bias"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("chat", {"extra_body": {"min_p": 1.5}}, "min_p"),
    ("chat", {"extra_body": {"min_tokens": 5}}, "min_tokens"),                       # more than max_tokens
    ("chat", {"extra_body": {"stop_token_ids": [100000]}}, "stop_token_ids"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ("chat", {"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),       # as vLLM
    ("completions", {"stream": True, "extra_body": {"prompt_logprobs": 0}}, "prompt_logprobs"),
])
def test_out_of_range_sampling_parameters_are_a_400_naming_them(url, kind, kw, param):
    _assert_400_naming(url, kind, kw, param)


# ------------------------------------------------------------------------------------------- refused
@pytest.mark.parametrize("kind,kw,param", [
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "!"}, "suffix"),
    # vLLM refuses a priority without --scheduling-policy priority; the others were ignored without a word
    ("chat", {"extra_body": {"priority": 1}}, "priority"),
    ("completions", {"extra_body": {"priority": -1}}, "priority"),
    ("chat", {"extra_body": {"return_tokens_as_token_ids": True}}, "return_tokens_as_token_ids"),
    ("completions", {"extra_body": {"return_tokens_as_token_ids": True}, "logprobs": 1}, "return_tokens_as_token_ids"),
    ("chat", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("completions", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
])
def test_parameters_we_do_not_honour_are_a_400_naming_them(url, kind, kw, param):
    _assert_400_naming(url, kind, kw, param)


def _assert_400_naming(url: str, kind: str, kw: dict, param: str) -> None:
    """A short chat or completions request with `kw` is a 400 whose error names `param`."""
    c = client(url)
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            c.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, **kw)
        else:
            c.completions.create(model="tiny", prompt="hi", max_tokens=2, **kw)
    assert e.value.body["param"] == param and param in e.value.body["message"], e.value.body


@pytest.mark.parametrize("kw,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "tool_call_id": "nope", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                          "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_bad_structured_output_and_tool_requests_are_a_400_naming_the_parameter(url, kw, param):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, **kw}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_defaults_of_unhonoured_parameters_are_accepted(url):
    r = client(url).chat.completions.create(model="tiny", messages=ASK, n=1, presence_penalty=0, frequency_penalty=0,
                                            logprobs=False, response_format={"type": "text"}, logit_bias={})
    assert r.choices[0].message.content == ANSWER


# -------------------------------------------------------------------------------- structured output, tools
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},   # bounded: see test_structured
                         "unit": {"enum": ["celsius", "fahrenheit"]}, "tags": {"type": "array", "maxItems": 2,
                                                                                "items": {"type": "string",
                                                                                          "maxLength": 6}}},
          "required": ["name", "age", "unit"]}
# The fixture's context is 256 tokens and its tokenizer spells most of a declaration a character at a time: small tools.
WEATHER = {"type": "function", "function": {
    "name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 7},
                                                                 "u": {"enum": ["c", "f"]}},
                                "required": ["n", "u"]}}}
CLOCK = {"type": "function", "function": {"name": "g"}}


def test_json_schema_output_validates_streamed_and_not(url):
    """The fixture model knows one sentence, yet its answer under response_format is JSON valid for the schema."""
    c = client(url)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for temperature in (0.0, 1.0):
        r = c.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=150,
                                      temperature=temperature, seed=7)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        chunks = list(c.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=150,
                                                temperature=temperature, seed=7, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "stop"
    r = c.completions.create(model="tiny", prompt=chat_ids(url), max_tokens=150, temperature=0,
                             extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_json_cut_short_by_max_tokens_finishes_with_length(url):
    r = client(url).chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                            response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def _streamed_calls(chunks) -> tuple[list[dict], str]:
    """Tool calls put together from stream deltas, as a client does; and the last finish_reason."""
    calls: dict[int, dict] = {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                assert call["id"] is None and not call["arguments"]       # id and name first, then arguments
                call["id"] = d.id
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_call_is_well_formed_streamed_and_not(url, choice):
    """Named: greedy. Required: the fixture model, asked for a JSON array of calls, often opens another call until
    max_tokens cuts it (then the partial array is the content, finish "length"; an array closed by the very last
    token is calls with finish "length", as vLLM reports it); of ten seeded samples, the first that closes the array
    before the limit is checked."""
    c = client(url)
    params = {"f": WEATHER["function"]["parameters"], "g": {"type": "object", "properties": {}}}
    tool_choice = {"type": "function", "function": {"name": "f"}} if choice == "named" else "required"
    for seed in range(10):
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, CLOCK],
                  tool_choice=tool_choice, temperature=0 if choice == "named" else 1, seed=seed)
        r = c.chat.completions.create(**kw)
        if r.choices[0].finish_reason == "tool_calls":
            break
        assert choice == "required" and r.choices[0].finish_reason == "length"
        msg = r.choices[0].message
        if msg.tool_calls:  # closed at the limit: whole calls, no content
            assert msg.content is None
            for call in msg.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        else:
            assert msg.content.startswith('[{"name":"')
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and msg.tool_calls
    for call in msg.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert choice == "required" or call.function.name == "f"
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    calls, finish = _streamed_calls(list(c.chat.completions.create(**kw, stream=True)))
    assert finish == "tool_calls"
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls]


def test_each_of_n_choices_makes_its_own_forced_call_with_logprobs_streamed_and_not(url):
    """n, logprobs and a grammar together: every choice follows the grammar with a matcher of its own, its stream
    chunks carry its index, and its logprobs cover the tokens it generated."""
    c = client(url)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "f"}}, temperature=1, seed=3, n=3,
              logprobs=True, top_logprobs=2)
    r = c.chat.completions.create(**kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
        jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
        assert ch.logprobs.content and all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices)
    chunks = list(c.chat.completions.create(**kw, stream=True))
    for i, ch in enumerate(r.choices):
        calls, finish = _streamed_calls([x for x in chunks if x.choices and x.choices[0].index == i])
        assert finish == "tool_calls"
        assert json.loads(calls[0]["arguments"]) == json.loads(ch.message.tool_calls[0].function.arguments)


def test_a_reply_that_may_call_tools_stops_where_a_tool_answer_would_begin(url):
    """tool_choice auto: the model must not write the tool's answer itself. Forced (logit_bias) to open one, the
    reply ends there, with stop; without tools the same token is just text the detokeniser hides."""
    c = client(url)
    start = requests.post(f"{url}/tokenize", json={"prompt": "<|tool_response>", "add_special_tokens": False},
                          timeout=30).json()["tokens"]
    assert len(start) == 1
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], max_tokens=5, temperature=0,
              logit_bias={str(start[0]): 100})
    r = c.chat.completions.create(**kw, tools=[WEATHER], tool_choice="auto")
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert c.chat.completions.create(**kw).usage.completion_tokens == 5


def _cpu_s(pid: int) -> float:
    """CPU seconds used by process `pid` and its live children (Linux /proc)."""
    def used(stat: str) -> float:
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    total = used(Path(f"/proc/{pid}/stat").read_text())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:                         # gone meanwhile
            continue
        if int(text.rsplit(")", 1)[1].split()[1]) == pid:
            total += used(text)
    return total


def test_a_client_that_leaves_stops_its_schema_compile(tiny_gemma4):
    """A schema whose index takes minutes (a string of up to 30 characters, allowed here by
    G5G_GRAMMAR_MAX_STRING_BOUND): the client gives up after 2 s; the compile stops with it, so the server and its
    children use next to no CPU afterwards (before: the compile went on for the time limit or longer)."""
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "maxLength": 30}}}
    with tiny_server(tiny_gemma4, env=serving_env(G5G_GRAMMAR_MAX_STRING_BOUND="40")) as srv:
        with pytest.raises(requests.Timeout):
            requests.post(f"{srv.url}/v1/chat/completions", timeout=2,
                          json={"model": "tiny", "messages": ASK, "max_tokens": 4, "response_format": schema})
        def idle() -> bool:                       # a second in which the server and its children used < 0.2 s
            before = _cpu_s(srv.proc.pid)
            time.sleep(1)
            return _cpu_s(srv.proc.pid) - before < 0.2

        # the server sees the disconnect and the compile stops: within seconds, where it alone would take minutes
        wait_until(idle, timeout=20, what="the server idle after its client left")
        r = client(srv.url).chat.completions.create(model="tiny", messages=ASK)
        assert r.choices[0].message.content == ANSWER


def test_a_conversation_with_tool_results_renders_through_the_template(url):
    conversation = [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "f", "arguments": '{"n": 2, "u": "c"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = requests.post(f"{url}/tokenize", json={"messages": conversation}, timeout=30)
    text = requests.post(f"{url}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()["prompt"]
    assert ('<|turn>model\n<|tool_call>call:f{n:2,u:<|"|>c<|"|>}<tool_call|><turn|>' in text and
            '<|turn>tool\n<|tool_response>response:f{value:<|"|>sunny<|"|>}<tool_response|><turn|>' in text), text
    out = client(url).chat.completions.create(model="tiny", messages=conversation, tools=[WEATHER], max_tokens=8)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


# ---------------------------------------------------------------------------------------- the rest
def test_embeddings_are_refused_as_vllm_refuses_them_for_a_generate_model(url):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).embeddings.create(model="tiny", input="hi")
    assert e.value.body == {"message": "The model does not support Embeddings API", "type": "invalid_request_error",
                            "param": None, "code": None}


def test_models_retrieve(url):
    c = client(url)
    m = c.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model" and m.model_extra["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


def test_tokenize_and_detokenize_round_trip(url, tiny_gemma4):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_gemma4)
    r = requests.post(f"{url}/tokenize", json={"model": "tiny", "prompt": QUESTION}, timeout=30).json()
    assert r == {"count": len(r["tokens"]), "max_model_len": 256, "tokens": tok.encode(QUESTION), "token_strs": None}
    plain = requests.post(f"{url}/tokenize", json={"prompt": QUESTION, "add_special_tokens": False}, timeout=30)
    assert plain.json()["tokens"] == tok.encode(QUESTION, add_special_tokens=False)
    back = requests.post(f"{url}/detokenize", json={"model": "tiny", "tokens": plain.json()["tokens"]}, timeout=30)
    assert back.json() == {"prompt": QUESTION}


def test_tokenize_returns_token_strings_and_shows_tools_as_the_chat_template_does(url, tiny_gemma4):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_gemma4)
    r = requests.post(f"{url}/tokenize", json={"prompt": QUESTION, "return_token_strs": True}, timeout=30).json()
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = requests.post(f"{url}/tokenize", json={"messages": ASK, "tools": tools}, timeout=30).json()
    assert with_tools["tokens"] == tok.apply_chat_template(ASK, tools=tools, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
    assert with_tools["count"] > len(chat_ids(url))


def test_version_ping_and_head_health(url):
    assert requests.get(f"{url}/version", timeout=5).json()["version"]
    assert requests.get(f"{url}/ping", timeout=5).status_code == 200
    assert requests.post(f"{url}/ping", timeout=5).status_code == 200
    r = requests.head(f"{url}/health", timeout=5)
    assert r.status_code == 200 and r.content == b""


def test_request_id_header_names_the_completion(url):
    raw = client(url).chat.completions.with_raw_response.create(
        model="tiny", messages=ASK, max_tokens=2, extra_headers={"x-request-id": "trace-42"})
    assert raw.headers["x-request-id"] == "trace-42" and raw.parse().id == "chatcmpl-trace-42"
    r = requests.get(f"{url}/v1/models", timeout=5)
    assert len(r.headers["x-request-id"]) == 32                       # one is made up when the client sent none


@pytest.mark.parametrize("body,message", [
    (b"[" * 100_000, "nested too deeply"),
    (b'{"messages": [], "seed": 1' + b"0" * 5000 + b"}", "not valid JSON"),
    (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "lone surrogate"),
])
def test_bodies_python_cannot_hold_are_a_400_not_a_500(url, body, message):
    r = requests.post(f"{url}/v1/chat/completions", data=body, headers={"content-type": "application/json"},
                      timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------------------- api key, CORS, body limit
@pytest.fixture(scope="module")
def guarded(tiny_gemma4):
    # paced (10 ms before each decode step): a 200-token stream outlasts the body timeout
    with tiny_server(tiny_gemma4, "--api-key", "s3cret", "--max-body-bytes", "65536", "--body-timeout", "1",
                     "--allowed-origins", '["https://app.example"]', pace=0.01) as srv:
        yield srv.url
        assert srv.stop() == 0


def test_api_key_guards_v1_only(guarded):
    with pytest.raises(openai.AuthenticationError):
        client(guarded, "wrong").chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client(guarded, "wrong").models.list()
    r = requests.post(f"{guarded}/v1/chat/completions", json={"messages": ASK}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client(guarded, "s3cret").chat.completions.create(model="tiny", messages=ASK).choices[0].message.content \
        == ANSWER
    assert requests.get(f"{guarded}/health", timeout=5).status_code == 200        # probes need no key, as vLLM
    assert requests.get(f"{guarded}/metrics", timeout=5).status_code == 200


def _raw(url: str, request: bytes) -> tuple[int, dict]:
    """Send `request` as is: (status, error object) of the answer (no answer within 30 s: socket.timeout)."""
    with socket.create_connection(address(url), timeout=30) as sock, sock.makefile("rb") as answer:
        sock.sendall(request)
        status, length = int(answer.readline().split()[1]), 0
        while line := answer.readline().strip():
            name, _, value = line.partition(b":")
            length = int(value) if name.lower() == b"content-length" else length
        return status, json.loads(answer.read(length))["error"]


def test_two_authorization_headers_are_refused(guarded):
    """A wrong key followed by the right one was let in (the last header won); either order is a 401 now."""
    body = json.dumps({"model": "tiny", "messages": ASK, "max_tokens": 2}).encode()
    for keys in (("wrong", "s3cret"), ("s3cret", "wrong"), ("s3cret", "s3cret")):
        head = "".join(f"Authorization: Bearer {k}\r\n" for k in keys)
        status, error = _raw(guarded, f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{head}Content-Type: "
                                      f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert (status, error["code"]) == (401, "invalid_api_key"), keys


def test_a_body_that_stops_coming_gets_a_408(guarded):
    """Content-Length 100 and 7 bytes sent: the request was held open without an answer; after --body-timeout
    (1 s here) without a byte it is a 408."""
    status, error = _raw(guarded, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret"
                                  b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\": 1")
    assert (status, error["code"]) == (408, "request_timeout") and "--body-timeout" in error["message"]


def test_a_stream_outlives_the_body_timeout(guarded):
    """Once the body is complete, the wait for the client to leave (a stream's watch) has no deadline: a stream
    longer than --body-timeout ends with [DONE]."""
    r = requests.post(f"{guarded}/v1/chat/completions", headers={"Authorization": "Bearer s3cret"}, timeout=60,
                      json={"model": "tiny", "messages": ASK, "max_tokens": 200, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}, stream=True)
    lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]" and all(b'"error"' not in line for line in lines), lines[-3:]
    # 200 tokens, each after a 10 ms pause: longer than the 1 s body timeout. Counted by usage, not by chunks: a chunk
    # may carry two tokens (the detokenizer holds back an incomplete UTF-8 piece).
    assert json.loads(lines[-2][len(b"data: "):])["usage"]["completion_tokens"] == 200


def test_cors_allows_only_the_configured_origin(guarded):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = requests.options(f"{guarded}/v1/chat/completions", headers={"Origin": "https://app.example", **pre},
                          timeout=5)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    bad = requests.options(f"{guarded}/v1/chat/completions", headers={"Origin": "https://evil.example", **pre},
                           timeout=5)
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    r = requests.get(f"{guarded}/v1/models", headers={"Origin": "https://app.example",
                                                      "Authorization": "Bearer s3cret"}, timeout=5)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"


def test_body_limit_is_a_413_announced_or_chunked(guarded):
    auth = {"Authorization": "Bearer s3cret", "content-type": "application/json"}
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 70_000}]}).encode()
    r = requests.post(f"{guarded}/v1/chat/completions", data=big, headers=auth, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunked = (big[i:i + 8192] for i in range(0, len(big), 8192))       # no Content-Length: counted as it arrives
    r = requests.post(f"{guarded}/v1/chat/completions", data=chunked, headers=auth, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    small = json.dumps({"messages": ASK}).encode()
    r = requests.post(f"{guarded}/v1/chat/completions", data=(small[i:i + 7] for i in range(0, len(small), 7)),
                      headers=auth, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ANSWER


# ------------------------------------------------------------------------------------------ vLLM parity
def test_include_stop_str_in_output(url):
    """vLLM's include_stop_str_in_output: the text ends with the stop string that ended it (streamed too)."""
    c = client(url)
    cut = ANSWER.index("discipline")
    for stream in (False, True):
        kw = dict(model="tiny", messages=ASK, temperature=0, stop=["discipline"], stream=stream,
                  extra_body={"include_stop_str_in_output": True})
        r = c.chat.completions.create(**kw)
        text = "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if stream else \
            r.choices[0].message.content
        assert text == ANSWER[:cut + len("discipline")], (stream, text)
    r = c.completions.create(model="tiny", prompt=chat_ids(url), temperature=0, max_tokens=60, stop="discipline",
                             extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == ANSWER[:cut + len("discipline")] and r.choices[0].finish_reason == "stop"


def test_chat_template_options_as_vllm_takes_them(url, tiny_gemma4):
    """add_generation_prompt, continue_final_message and chat_template_kwargs reach the chat template, in a chat
    request and in /tokenize; what would bypass the request's own fields is a 400 naming it."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_gemma4)
    start = [*ASK, {"role": "assistant", "content": "Site Reliability"}]

    def tokenize(**kw):
        r = requests.post(f"{url}/tokenize", json={"model": "tiny", **kw}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def template(msgs, **kw):
        return tok.apply_chat_template(msgs, tokenize=True, return_dict=False, **kw)

    assert tokenize(messages=ASK, add_generation_prompt=False) == template(ASK, add_generation_prompt=False)
    assert tokenize(messages=start, add_generation_prompt=False, continue_final_message=True) == \
        template(start, add_generation_prompt=False, continue_final_message=True)
    thinking = tokenize(messages=ASK, chat_template_kwargs={"enable_thinking": True})
    assert thinking == template(ASK, add_generation_prompt=True, enable_thinking=True) != chat_ids(url)
    c = client(url)
    r = c.chat.completions.create(model="tiny", messages=start, temperature=0, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    assert r.choices[0].message.content == ANSWER.removeprefix("Site Reliability")
    assert r.usage.prompt_tokens == len(template(start, add_generation_prompt=False, continue_final_message=True))
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"add_generation_prompt": False, "continue_final_message": True, "messages": ASK},
                          "continue_final_message"),
                         ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize")):
        body = {"model": "tiny", "messages": start, "max_tokens": 2, **extra}
        for path in ("/v1/chat/completions", "/tokenize"):
            bad = requests.post(url + path, json=body, timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (path, bad.text)


def test_skip_special_tokens_false_keeps_them_in_the_text(url):
    """As vLLM: the special tokens generated are in the text (here <bos>, forced), the stop token that ends the
    answer is not; both endpoints, streamed and not."""
    c = client(url)
    forced = {"allowed_token_ids": [2], "skip_special_tokens": False}
    r = c.completions.create(model="tiny", prompt="Hi", max_tokens=3, extra_body=forced)
    assert r.choices[0].text == "<bos>" * 3
    streamed = c.completions.create(model="tiny", prompt="Hi", max_tokens=3, stream=True, extra_body=forced)
    assert "".join(ch.choices[0].text for ch in streamed) == "<bos>" * 3
    r = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, extra_body=forced)
    assert r.choices[0].message.content == "<bos>" * 2
    skipped = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=2,
                                        extra_body={"allowed_token_ids": [2]})
    assert skipped.choices[0].message.content == ""
    shown = c.chat.completions.create(model="tiny", messages=ASK, extra_body={"skip_special_tokens": False})
    assert (shown.choices[0].message.content, shown.choices[0].finish_reason) == (ANSWER, "stop")


def test_allowed_token_ids_are_the_only_tokens_generated(url, tiny_gemma4):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_gemma4)
    allowed = tok.encode(" discipline that", add_special_tokens=False)
    names = {tok.decode([i]) for i in allowed}
    c = client(url)
    for temperature in (0, 1.5):
        r = c.chat.completions.create(model="tiny", messages=ASK, temperature=temperature, seed=3, max_tokens=6,
                                      logprobs=True, extra_body={"allowed_token_ids": allowed})
        got = [t.token for t in r.choices[0].logprobs.content]
        assert len(got) == 6 and set(got) <= names and r.choices[0].finish_reason == "length", got
    for bad in ([], [tok.vocab_size + 5], [-1]):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, extra_body={"allowed_token_ids": bad})
        assert e.value.body["param"].startswith("allowed_token_ids"), e.value.body


def test_bad_words_are_never_generated(url):
    """vLLM's bad_words: a word's last token is banned wherever the output ends with the rest of it."""
    c = client(url)
    before = ANSWER[:ANSWER.index(" discipline")]
    for stream in (False, True):
        r = c.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=40, stream=stream,
                                      extra_body={"bad_words": ["discipline", "nonexistentword"]})
        text = "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if stream else \
            r.choices[0].message.content
        assert text.startswith(before) and "discipline" not in text, text
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, extra_body={"bad_words": [""]})
    assert e.value.body["param"].startswith("bad_words"), e.value.body


def test_several_prompts_in_one_completions_request(url):
    """As vLLM: choice index = prompt index × n + choice; each prompt's choices are what it gets alone; usage counts
    every prompt once and every choice's tokens."""
    c = client(url)
    ids = chat_ids(url)
    kw = dict(model="tiny", max_tokens=5, temperature=1.0, seed=11, n=2)
    alone = [c.completions.create(prompt=p, **kw) for p in ("Site Reliability", "Hello")]
    both = c.completions.create(prompt=["Site Reliability", "Hello"], **kw)
    assert [(ch.index, ch.text) for ch in both.choices] == \
        [(i, ch.text) for i, ch in enumerate(alone[0].choices + alone[1].choices)]
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens
    assert both.usage.completion_tokens == alone[0].usage.completion_tokens + alone[1].usage.completion_tokens
    token_prompts = [ids, ids[:5]]
    chunks = list(c.completions.create(prompt=token_prompts, stream=True, echo=True, **kw))
    texts = ["", "", "", ""]
    for ch in chunks:
        texts[ch.choices[0].index] += ch.choices[0].text
    single = [c.completions.create(prompt=p, echo=True, **kw) for p in token_prompts]
    assert texts == [ch.text for r in single for ch in r.choices]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=["a"] * 40, n=10, max_tokens=2)
    assert e.value.body["param"] == "prompt", e.value.body
