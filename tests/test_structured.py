"""Structured output and tool calls below the HTTP layer: the allowed-token mask on both runtimes, grammars compiled
over the tiny checkpoint's tokenizer, generation that must follow them, and Gemma 4's tool-call markup read back."""
from __future__ import annotations

import json
import time

import jsonschema
import numpy as np
import pytest

from serving.core.detokenize import Detokenizer
from serving.core.generation import Delta, Finish, SamplingParams, TokenizerInfo, generate
from serving.shaping.grammar_pool import Grammars, GrammarBusy
from serving.engine import MASKED, mask_words
from serving.shaping.grammar import InvalidGrammar, _bounded_integers, _depth, integer_regex, token_bytes
from serving.shaping.tool_calls import GemmaCalls, NamedCall, RequiredCalls, merge, parse_call, required_schema
from tests.fixtures.batching import Job, run_in_batch
from devtools.tiny_gemma4 import QUESTION

# Every field bounded (an integer range too: an unbounded one lets a model write digits until max_tokens, which a
# fixture trained on another CPU did), so whatever the weights the answer ends by itself within max_tokens.
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 150},
                         "unit": {"enum": ["celsius", "fahrenheit"]}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
          "required": ["name", "age", "unit", "ok"]}


def only(vocab: int, tokens) -> np.ndarray:
    """The packed mask row allowing exactly `tokens`."""
    bits = np.zeros(mask_words(vocab) * 32, np.uint8)
    bits[list(tokens)] = 1
    return np.packbits(bits, bitorder="little").view("<i4")


# ------------------------------------------------------------------------------------------------ the mask
@pytest.mark.parametrize("runtime", ["jax", "torch"])
def test_mask_keeps_exactly_the_allowed_logits(runtime):
    rng = np.random.default_rng(0)
    vocab = 1000                                   # not a multiple of 32: the last word is partly padding
    allowed = sorted(set(rng.integers(0, vocab, 200).tolist()) | {0, 31, 32, 999})
    logits = rng.normal(size=vocab).astype(np.float32)
    if runtime == "jax":
        jnp = pytest.importorskip("jax.numpy")
        from serving.jax_runtime.sampling import apply_mask
        got = np.asarray(apply_mask(jnp.asarray(logits[None]), jnp.asarray(only(vocab, allowed)[None])))[0]
        assert np.array_equal(np.asarray(apply_mask(jnp.asarray(logits[None]),
                                                    jnp.full((1, mask_words(vocab)), -1, jnp.int32)))[0], logits)
    else:
        torch = pytest.importorskip("torch")
        from serving.torch_runtime.sampling import apply_mask
        got = apply_mask(torch.tensor(logits[None]), only(vocab, allowed)[None]).numpy()[0]
    want = np.full(vocab, MASKED, np.float32)
    want[allowed] = logits[allowed]
    assert np.array_equal(got, want)


# --------------------------------------------------------------------------------------------- grammars
@pytest.fixture(scope="module")
def grammars(info) -> Grammars:
    return Grammars(info, len(info.prompt_tokenizer))


@pytest.mark.parametrize("schema,message", [
    ({"type": "string", "pattern": "(["}, "Failed to build DFA"),
    ({"properties": {"a": {"$ref": "#/$defs/missing"}}}, "Invalid reference path"),
    ({"type": "nonsense"}, "Unsupported type: nonsense"),
    ({"$ref": "#"}, "recusion limit"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
    (False, "Unsupported JSON Schema structure false$"),
])
def test_unusable_schemas_are_refused_with_the_reason(grammars, schema, message):
    with pytest.raises(InvalidGrammar, match=message):
        grammars.json_schema(schema)


def test_the_vocabulary_is_what_each_token_writes(info):
    """Every ordinary token's bytes are what the tokenizer decodes it to; byte-fallback tokens are one byte;
    special and stop tokens write nothing (the grammar never allows them as text)."""
    tok = info.prompt_tokenizer
    got = {i: b for b, ids in token_bytes(tok, info.hidden_ids | info.stop_ids).items() for i in ids}
    assert not set(got) & (info.hidden_ids | info.stop_ids)
    assert got[tok.convert_tokens_to_ids("<0x0A>")] == b"\n"
    assert len(got) == len(tok) - len(info.hidden_ids | info.stop_ids)
    for i, b in got.items():
        if len(b) > 1 or b.isascii():
            assert tok.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode() == b


@pytest.mark.parametrize("lo,hi", [(1, 7), (0, None), (None, 0), (-5, 5), (13, 987), (0, 0), (-1000, -3), (5, None),
                                   (None, -3), (100, 100000), (-3, None), (None, 12), (-1, 1), (9, 10)])
def test_integer_bounds_become_an_exact_regex(lo, hi):
    """outlines-core ignores minimum/maximum; serving/shaping/grammar.py enforces them with a regex of its own."""
    import re
    rx = re.compile(integer_regex(lo, hi))
    for n in [*range(-1500, 1500), -123456, 123456, 99999, 100000, 100001]:
        assert bool(rx.fullmatch(str(n))) == ((lo is None or n >= lo) and (hi is None or n <= hi)), n
    assert not any(rx.fullmatch(t) for t in ("-0", "01", "007", "+1", ""))


def test_a_repeated_schema_is_compiled_once_and_the_cache_is_bounded_in_bytes(info):
    """The cache holds compiled grammars up to cache_bytes (their indexes' sizes), least recently used out first;
    before it held 64 whatever their size (64 of Gemma's 131 MiB indexes: 8 GiB)."""
    sizes = {k: Grammars(info, len(info.prompt_tokenizer)).json_schema(s).nbytes
             for k, s in (("schema", SCHEMA), ("integer", {"type": "integer"}), ("boolean", {"type": "boolean"}))}
    assert min(sizes.values()) > 0
    grammars = Grammars(info, len(info.prompt_tokenizer), cache_bytes=sizes["schema"] + sizes["integer"])
    first = grammars.json_schema(SCHEMA)
    assert grammars.json_schema(json.loads(json.dumps(SCHEMA))) is first
    grammars.json_schema({"type": "integer"})
    assert grammars.cached_bytes == sizes["schema"] + sizes["integer"]
    grammars.json_schema({"type": "boolean"})                  # evicts SCHEMA, the least recently used
    assert grammars.cached_bytes == sizes["integer"] + sizes["boolean"] <= grammars.cache_bytes
    assert grammars.json_schema(SCHEMA) is not first


def test_compile_limits_refuse_instead_of_hanging(info):
    with pytest.raises(InvalidGrammar, match="too large: its regex has"):
        Grammars(info, len(info.prompt_tokenizer), max_regex_chars=50).json_schema(SCHEMA)
    with pytest.raises(InvalidGrammar, match="longer than 0 s"):
        Grammars(info, len(info.prompt_tokenizer), timeout_s=0).json_schema(SCHEMA)
    with pytest.raises(InvalidGrammar, match="the compile stopped"):        # its process past its share
        Grammars(info, len(info.prompt_tokenizer), workers=2, memory=2 * 48 * 2**20).json_schema(SCHEMA)


def test_the_compile_process_imports_serving_from_the_tree_it_was_started_from(tmp_path):
    """The compile's program finds `serving` at the root it is given (serving/shaping/grammar_pool.py's _ROOT), not
    through an install or the working directory: run here without site (no editable install) from elsewhere."""
    import os
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    import outlines_core

    from serving.shaping import grammar_pool
    from serving.shaping.grammar import MAX_REGEX_CHARS, MAX_STRING_BOUND

    vocabulary = outlines_core.Vocabulary(8, {ch: [i] for i, ch in enumerate("truefals")})
    libraries = {str(Path(m.__file__).resolve().parents[1]) for m in (np, outlines_core)}    # not serving's
    r = subprocess.run([sys.executable, "-S", "-c", grammar_pool._INDEX_PROGRAM, str(os.getpid()), grammar_pool._ROOT,
                        "0"], input=pickle.dumps(('{"type": "boolean"}', MAX_STRING_BOUND, MAX_REGEX_CHARS, vocabulary)),
                       capture_output=True, check=False, cwd=tmp_path,
                       env={"PYTHONPATH": os.pathsep.join(sorted(libraries))}, timeout=120)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-500:]
    ok, index = pickle.loads(r.stdout)
    assert ok and isinstance(index, outlines_core.Index)


def test_a_matcher_walks_a_valid_instance_to_a_stop_token(info, grammars):
    """The mask allows each token of a compact valid instance in turn, then any of the checkpoint's stop tokens
    (and only then); taking one ends the grammar."""
    from serving.shaping.grammar import Matcher
    text = json.dumps({"name": "Ada", "age": 36, "unit": "celsius", "ok": True}, separators=(",", ":"))
    for stop in sorted(info.stop_ids):
        m = Matcher(grammars.json_schema(SCHEMA))
        for tok in info.encode(text):
            bits = np.unpackbits(m.allowed().view(np.uint8), bitorder="little")
            assert bits[tok] and not any(bits[s] for s in info.stop_ids)
            m.accept(tok)
        assert np.unpackbits(m.allowed().view(np.uint8), bitorder="little")[stop]
        m.accept(stop)
        assert m.done


@pytest.fixture(scope="module")
def engines(tiny_gemma4):
    from serving.jax_runtime import Settings
    from serving.jax_runtime import load as load_jax
    from serving.torch_runtime import load as load_torch
    yield {"pytorch": load_torch(tiny_gemma4),
           "jax": load_jax(tiny_gemma4, Settings(buckets=(32, 256), dtype="float32", cache_dir=None, slots=2))}


def _text(events) -> tuple[str, str]:
    assert isinstance(events[-1], Finish) and all(isinstance(e, Delta) for e in events[:-1])
    return "".join(e.text for e in events[:-1]), events[-1].reason


@pytest.mark.parametrize("runtime", ["pytorch", "jax"])
def test_output_follows_the_schema_whatever_the_weights(runtime, engines, info, grammars):
    """The fixture model knows one sentence; under the grammar, greedy and sampled answers are valid JSON for the
    schema, and end by themselves (finish "stop"). In a batch (JAX: two slots, one unconstrained) each request
    gets what it gets alone."""
    engine = engines[runtime]
    ask = info.chat_prompt([{"role": "user", "content": QUESTION}])
    jobs = [Job(ask, SamplingParams(temperature=0.0, max_tokens=150), grammars.json_schema(SCHEMA)),
            Job(ask, SamplingParams(temperature=1.0, seed=5, max_tokens=150), grammars.json_schema(SCHEMA)),
            Job(ask, SamplingParams(temperature=0.0, max_tokens=40))]
    alone = [_text(list(generate(engine, info, j.prompt_ids, j.params, grammar=j.grammar))) for j in jobs]
    for text, reason in alone[:2]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert not alone[2][0].startswith("{")              # the unconstrained one is the model's own text

    jobs = [Job(j.prompt_ids, j.params, j.grammar and grammars.json_schema(SCHEMA)) for j in jobs]
    assert [_text(events) for events in run_in_batch(engine, info, jobs)] == alone


def test_max_tokens_cuts_the_json_with_length(engines, info, grammars):
    ask = info.chat_prompt([{"role": "user", "content": QUESTION}])
    text, reason = _text(list(generate(engines["jax"], info, ask, SamplingParams(temperature=0.0, max_tokens=5),
                                       grammar=grammars.json_schema(SCHEMA))))
    assert reason == "length" and text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(text)


def test_a_mask_costs_no_compile_on_jax(engines):
    from serving.jax_runtime import compile_counts
    engine = engines["jax"]
    before = compile_counts()
    assert engine.start(0, [2, 105, 9], SamplingParams(temperature=0.0), only(engine.vocab_size, [77])) == 77
    assert engine.start(1, [2, 105], SamplingParams(temperature=1.0, seed=1), only(engine.vocab_size, [5, 6])) in (5, 6)
    out = engine.step({0: 77, 1: 5}, {1: only(engine.vocab_size, [300])})
    assert out[1] == 300
    assert compile_counts() == before


# ----------------------------------------------------------------------------------------------- tool calls
def _play(reader, chunks) -> tuple[list[dict], dict]:
    deltas = [d for c in chunks for d in reader.feed(c)] + reader.close()
    return deltas, merge(deltas)


def test_gemma_call_markup_becomes_openai_tool_calls():
    name, args = parse_call('call:get_weather{city:<|"|>Paris, "FR" {x}<|"|>,days:3,metric:true,extra:null,'
                            'scale:-1.5e2,nested:{list:[1,<|"|>a<|"|>,[]],"quoted key":"json \\"s\\""},empty:{}}')
    assert name == "get_weather"
    assert args == {"city": 'Paris, "FR" {x}', "days": 3, "metric": True, "extra": None, "scale": -150.0,
                    "nested": {"list": [1, "a", []], "quoted key": 'json "s"'}, "empty": {}}
    for bad in ("call:f", "f{a:1}", "call:f{a:1", "call:f{a}", "call:f{a:1} trailing", 'call:f{a:<|"|>x}'):
        with pytest.raises(ValueError):
            parse_call(bad)


def test_a_call_split_across_stream_chunks():
    text = 'Let me check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>' \
           '<|tool_call>call:now{}<tool_call|>'
    whole, _ = _play(GemmaCalls(), [text])
    for cut in range(1, len(text)):                    # every split point, and one character at a time
        for chunks in ([text[:cut], text[cut:]], list(text)):
            reader = GemmaCalls()
            deltas, msg = _play(reader, chunks)
            assert msg["content"] == "Let me check." and reader.called
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
                [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]
            assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"])
            # the name comes in a chunk of its own (with the id), before any argument
            heads = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
            assert [(h["index"], h["function"]) for h in heads] == [
                (0, {"name": "get_weather", "arguments": ""}), (1, {"name": "now", "arguments": ""})]
    assert "<|" not in "".join(d.get("content", "") for d in whole)


def test_text_that_only_looks_like_markup_stays_content():
    for text in ("a <|tool_ b", "x<|tool_call>call:bad name{}<tool_call|>y", "unfinished <|tool_call>call:f{a:"):
        reader = GemmaCalls()
        _, msg = _play(reader, list(text))
        assert msg == {"role": "assistant", "content": text} and not reader.called
        assert reader.finish_reason("stop") == "stop"


def test_tool_markup_reaches_the_reader_only_when_revealed(info):
    """Gemma 4's tool-call tags are special tokens: hidden from content, shown to the "auto" reader."""
    text = 'ok<|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|>'
    ids = info.encode(text)
    assert len(info.tool_markup) == 3 and sum(i in info.tool_markup for i in ids) == 4

    def detokenized(reveal):
        detok = Detokenizer(info, reveal)
        return "".join(detok.push(i) for i in ids) + detok.flush()

    assert detokenized(frozenset()) == "okcall:f{a:x}"
    assert detokenized(info.tool_markup) == text
    _, msg = _play(GemmaCalls(), [detokenized(info.tool_markup)])
    assert msg["content"] == "ok" and msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": "x"}'}


def test_named_and_required_readers():
    reader = NamedCall("f")
    deltas, msg = _play(reader, ['{"a"', ": 1}"])
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert [list(d["tool_calls"][0]["function"]) for d in deltas] == [["name", "arguments"], ["arguments"],
                                                                       ["arguments"]]
    assert reader.finish_reason("stop") == "tool_calls" and reader.finish_reason("length") == "length"
    _, msg = _play(RequiredCalls(), ['[{"name": "f", "parameters": {"a": 1}}, ', '{"name": "g", "parameters": {}}]'])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("f", {"a": 1}), ("g", {})]
    _, msg = _play(RequiredCalls(), ['[{"name": "f", "param'])           # cut short by max_tokens
    assert msg == {"role": "assistant", "content": '[{"name": "f", "param'}


def test_required_schema_accepts_only_known_calls():
    schema = required_schema({"f": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                              "g": {"type": "object", "properties": {}}})
    jsonschema.validate([{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}], schema)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {}}], [{"name": "f"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_a_long_bounded_string_is_refused_before_its_automaton_is_built(info):
    """{"type": "string", "maxLength": 100000} kept a core busy for minutes after its client had the 30 s 400."""
    grammars = Grammars(info, len(info.prompt_tokenizer), timeout_s=60)
    for schema in ({"type": "string", "maxLength": 100000},
                   {"type": "object", "properties": {"a": {"type": "string", "minLength": 17}}},
                   # outlines-core builds the bounded string, not the pattern (a maxLength of 1e9 with a pattern
                   # passed every check and took its compile to the OOM range)
                   {"type": "string", "pattern": "^a+$", "maxLength": 10**9},
                   {"type": "string", "format": "email", "minLength": 17}):
        with pytest.raises(InvalidGrammar, match="too large: m..Length 1.*at most 16"):
            grammars.json_schema(schema)
    assert grammars.json_schema({"type": "string", "maxLength": 12}) is not None


def test_a_compile_past_its_time_limit_is_stopped(info):
    """outlines-core's index build cannot be interrupted: it runs in a process killed at the time limit, so a
    compile whose requester had its 400 keeps no core busy and no memory (before: it ran on in a thread for
    minutes). A string bounded at 30 characters takes far longer than the limit to index."""
    import threading
    grammars = Grammars(info, len(info.prompt_tokenizer), timeout_s=2, max_string=40)
    t0 = time.monotonic()
    assert grammars.json_schema({"type": "boolean"}) is not None    # a quick compile: how loaded the machine is
    slack = max(5.0, 4 * (time.monotonic() - t0))
    t0 = time.monotonic()
    with pytest.raises(InvalidGrammar, match="longer than 2 s"):
        grammars.json_schema({"type": "string", "maxLength": 30})
    assert time.monotonic() - t0 < 2 + slack                         # at the limit, not after the index build
    deadline = time.monotonic() + slack
    while any(t.name == "grammar" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "grammar" for t in threading.enumerate())
    assert grammars.json_schema({"type": "string", "maxLength": 8}) is not None     # and the next one compiles


def test_a_compile_every_requester_left_is_stopped(info):
    """Two requests wait on one slow compile; it goes on while one of them is there, and stops (its process
    killed, long before the time limit) once both left, and nothing of it is cached."""
    import threading
    grammars = Grammars(info, len(info.prompt_tokenizer), timeout_s=120, max_string=40)
    slow = {"type": "string", "maxLength": 30}
    gone = [threading.Event(), threading.Event()]
    errors = []

    def ask(i):
        try:
            grammars.json_schema(slow, gone[i])
        except InvalidGrammar as e:
            errors.append(str(e))

    waiters = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(2)]
    for t in waiters:
        t.start()
    time.sleep(1.0)
    gone[0].set()
    waiters[0].join(5)
    time.sleep(1.0)
    assert errors == ["its requester left"] and any(t.name == "grammar" for t in threading.enumerate())
    t0 = time.monotonic()
    gone[1].set()
    waiters[1].join(5)
    while any(t.name == "grammar" for t in threading.enumerate()) and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert not any(t.name == "grammar" for t in threading.enumerate()), "the compile went on"
    assert errors == ["its requester left"] * 2 and not grammars._cache


def test_a_compile_dies_with_its_server(tiny_gemma4):
    """A server that exits (killed, or crashed) while a slow schema compiles leaves no compile process behind
    (before: the orphan went on for minutes)."""
    import subprocess
    import sys
    from pathlib import Path
    server = f"""
import os, threading, time
from pathlib import Path
from serving.core.generation import TokenizerInfo
from serving.shaping.grammar_pool import Grammars
info = TokenizerInfo.load({str(tiny_gemma4)!r})
grammars = Grammars(info, len(info.prompt_tokenizer), timeout_s=120, max_string=40)
threading.Thread(target=grammars.json_schema, args=({{"type": "string", "maxLength": 30}},), daemon=True).start()
def parent(stat):
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[1]
    except OSError:
        return None
end = time.monotonic() + 20     # until the compile's process runs
while time.monotonic() < end and str(os.getpid()) not in map(parent, Path("/proc").glob("[0-9]*/stat")):
    time.sleep(0.1)
print(os.getpid(), flush=True)
os._exit(0)
"""
    out = subprocess.run([sys.executable, "-c", server], capture_output=True, text=True, timeout=60, check=True)
    pid = out.stdout.split()[-1]

    def compiles() -> list[str]:
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                argv = cmdline.read_bytes().split(b"\0")
            except OSError:
                continue
            if len(argv) > 3 and argv[1] == b"-c" and b"outlines_core" in argv[2] and argv[3] == pid.encode():
                found.append(cmdline.parent.name)
        return found

    deadline = time.monotonic() + 5
    while compiles() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert compiles() == []


def _held_workers(grammars: Grammars, n: int):
    """Make the next `n` compiles hold their workers until the returned event is set; (release, started)."""
    import threading
    compile, release, started = grammars._compile, threading.Event(), threading.Semaphore(0)
    held = [n]

    def held_then_compiled(key, deadline, stop, quick=False):
        if held[0] > 0 and not quick:
            held[0] -= 1
            started.release()
            release.wait(60)                    # a compile that goes on, holding its worker
        return compile(key, deadline, stop, quick=quick)

    grammars._compile = held_then_compiled
    return release, started


def test_a_schema_is_never_refused_for_time_it_spent_queueing(info):
    """One worker, a 4 s limit: a compile holds the worker for 5 s while json_object and SCHEMA wait for it. Their
    deadlines run from the start of their own compiles, so both compile (before: the deadline ran from queueing,
    and the refusal was cached: the same schema sent later to an idle server got the same 400 at once). The limit
    leaves each compile seconds of room on a loaded machine."""
    import threading
    grammars = Grammars(info, len(info.prompt_tokenizer), timeout_s=4, workers=1, quick_s=0)   # workers only
    grammars.json_schema({"type": "boolean"})           # the vocabulary, built once
    release, started = _held_workers(grammars, 1)

    def held():
        with pytest.raises(InvalidGrammar, match="longer than 4 s"):     # held in its compile past the limit
            grammars.json_schema({"type": "integer"})

    threading.Thread(target=held, daemon=True).start()
    assert started.acquire(timeout=10)
    got = {}
    waiters = [threading.Thread(target=lambda k=k, f=f: got.update({k: f()}), daemon=True)
               for k, f in (("object", grammars.json_object), ("schema", lambda: grammars.json_schema(SCHEMA)))]
    for t in waiters:
        t.start()
    time.sleep(5)                                       # past the limit, queued
    release.set()
    for t in waiters:
        t.join(120)
    assert sorted(got) == ["object", "schema"] and all(g.words == mask_words(len(info.prompt_tokenizer))
                                                       for g in got.values())


def test_busy_compiling_is_refused_at_once_and_never_cached(info):
    """One worker, one waiting place, both taken: a third schema (json_object too: it is inside the same limit)
    is GrammarBusy at once, and compiles when sent again once the worker is free."""
    import threading
    grammars = Grammars(info, len(info.prompt_tokenizer), workers=1, queued=1, quick_s=0)
    release, started = _held_workers(grammars, 1)
    for schema in ({"type": "integer"}, {"type": "boolean"}):
        threading.Thread(target=grammars.json_schema, args=(schema,), daemon=True).start()
    assert started.acquire(timeout=10)
    while grammars.in_flight < 2:
        time.sleep(0.01)
    for ask in (lambda: grammars.json_schema(SCHEMA), grammars.json_object):
        with pytest.raises(GrammarBusy, match=r"2 schemas are compiling or waiting to \(at most 2\)"):
            ask()
    release.set()
    while grammars.in_flight:
        time.sleep(0.01)
    assert grammars.json_schema(SCHEMA) is grammars.json_schema(SCHEMA)


def test_grammars_in_use_past_the_budget_make_a_new_compile_busy(info):
    """The byte budget covers every compiled grammar the server holds: one a request holds is not freed by
    leaving the cache, so a new compile past the budget is GrammarBusy until it is let go."""
    import gc
    grammars = Grammars(info, len(info.prompt_tokenizer), cache_bytes=1)
    held = grammars.json_schema(SCHEMA)
    assert grammars.live_bytes == held.nbytes > grammars.cache_bytes
    with pytest.raises(GrammarBusy, match="compiled schemas in use hold"):
        grammars.json_schema({"type": "integer"})
    del held
    deadline = time.monotonic() + 30        # the compile thread may still hold its result for a moment (ci7)
    while grammars.live_bytes and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert grammars.live_bytes == 0 and grammars.json_schema({"type": "integer"}) is not None


def test_a_mask_after_an_unmasked_step_is_never_served_by_the_speculative_step(engines):
    """The JAX engine dispatches step t+1 ahead, unmasked; a call that brings a mask for those same slots and tokens
    (the Engine API allows it, though Batch never makes one) must run a real step under the mask."""
    engine = engines["jax"]
    ask = [2, 105, 9, 40, 41]
    first = engine.start(0, ask, SamplingParams(temperature=0.0))
    free = engine.step({0: first})[0]                      # dispatches the next step ahead, unmasked
    ahead = int(np.asarray(engine._spec.out)[0])          # what the speculative step chose
    forced = 300 if ahead != 300 else 301
    spec = dict(engine.speculation)
    assert engine.step({0: free}, {0: only(engine.vocab_size, [forced])})[0] == forced
    assert engine.speculation["replaced"] == spec["replaced"] + 1


@pytest.mark.parametrize("schema,message", [
    ({"type": "string", "maxLength": 10**400}, r"too large: maxLength 100… \(401 digits\)"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": -10**400, "maxLength": 10**30}}},
     r"too large: maxLength 100… \(31 digits\)"),
    ({"type": "integer", "minimum": 10**400}, r"integer bound of 100… \(401 digits\) is past"),
    ({"type": "integer", "exclusiveMaximum": -10**19}, "integer bound of -10000000000000000001 is past"),
    ({"type": "integer", "maximum": 1e300}, r"integer bound of 100… \(301 digits\) is past"),
])
def test_bounds_past_float_range_are_the_clients_400(grammars, schema, message):
    """math.isfinite(10**400) raises OverflowError: a 500 for a client's schema (response_format or a forced tool's
    parameters). Integer bounds past ±2**63 are refused: their range regex would grow with their digits."""
    with pytest.raises(InvalidGrammar, match=message):
        grammars.json_schema(schema)


def test_a_number_bound_past_float_range_is_outlines_cores_400(grammars):
    with pytest.raises(InvalidGrammar):
        grammars.json_schema({"type": "number", "minimum": 10**400})


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_deep_schema_is_refused_by_its_depth(grammars):
    """250 objects deep ran past Python's recursion limit in the server (a 500); the depth is measured first,
    without recursion, and the tool-call wrapper (tool_choice "required") counts too."""
    for schema in (nested(250), nested(5000), required_schema({"f": nested(31)})):
        with pytest.raises(InvalidGrammar, match="nested more than 64 levels deep"):
            grammars.json_schema(schema)
    assert grammars.json_schema(nested(20)) is not None


def test_a_huge_schema_compiles_without_holding_the_server(info):
    """150 optional properties of any value: outlines-core builds a 147-million-character regex (quadratic in the
    properties) before the size limit can refuse it. That build ran in the server's process holding the GIL
    (10 000 properties stalled /health for 12-22 s and kept 1.5 GB); now it runs in the compile's process. A thread
    that wakes every 10 ms meanwhile is never held up for a quarter of the compile's time."""
    import threading
    grammars = Grammars(info, len(info.prompt_tokenizer), timeout_s=120)
    schema = {"type": "object", "properties": {f"p{i}": {} for i in range(150)}}
    gaps, done = [], threading.Event()

    def tick():
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    t0 = time.monotonic()
    with pytest.raises(InvalidGrammar, match="too large: its regex has 1[0-9]{8} characters"):
        grammars.json_schema(schema)
    took = time.monotonic() - t0
    done.set()
    ticker.join(5)
    assert max(gaps) < took / 4, (max(gaps), took)


# ------------------------------------------------------------------------------------------ tokenizer families
@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory):
    """A byte-level BPE tokenizer (GPT-2's alphabet, as Llama 3's and Qwen's), trained here on a little JSON-ish
    text to a 420-token vocabulary, saved as a checkpoint's tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    corpus = [json.dumps({"name": f"Ada {i}", "age": i, "ok": i % 2 == 0, "note": "ünï 🤖 \t\n"}) for i in range(300)]
    bpe.train_from_iterator(corpus, vocab_size=420, min_frequency=1, special_tokens=["<eos>"])
    out = tmp_path_factory.mktemp("byte_level")
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>").save_pretrained(out)
    return out


def test_a_byte_level_tokenizers_tokens_write_their_bytes(byte_level_dir):
    """Each token's bytes are what the tokenizer decodes it to (before: read as SentencePiece, 'Ġ{' wrote 'Ġ{'
    instead of ' {', and the bytes 0x00-0x1F as characters past U+0100)."""
    info = TokenizerInfo.load(byte_level_dir)
    tok = info.prompt_tokenizer
    assert info.family == "byte_level"
    got = {i: b for b, ids in token_bytes(tok, info.hidden_ids | info.stop_ids, info.family).items() for i in ids}
    assert len(got) == len(tok) - 1
    whole = [i for i, b in got.items() if not b.decode(errors="replace").count("\ufffd")]
    assert len(whole) > 250
    for i in whole:
        assert tok.decode([i]).encode() == got[i], i
    joined = b"".join(got[i] for i in tok.encode('{"name": "ünï 🤖"}'))     # split bytes join into characters
    assert joined.decode() == '{"name": "ünï 🤖"}'


def test_forced_json_is_json_with_a_byte_level_tokenizer(byte_level_dir):
    """Random walks through the grammar (every step any token the mask allows, until the stop token) decode to
    JSON valid for the schema, without control characters: the mask speaks the tokenizer's bytes (read as
    SentencePiece, most walks wrote raw control characters or U+FFFD)."""
    from serving.shaping.grammar import Matcher
    info = TokenizerInfo.load(byte_level_dir)
    grammar = Grammars(info, len(info.prompt_tokenizer)).json_schema(
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5},
                                          "b": {"type": "integer", "minimum": 0, "maximum": 99}},
         "required": ["a", "b"]})
    rng, bad = np.random.default_rng(0), []
    for _ in range(40):
        m, ids = Matcher(grammar), []
        while not m.done and len(ids) < 200:
            token = int(rng.choice(np.flatnonzero(np.unpackbits(m.allowed().view(np.uint8), bitorder="little"))))
            m.accept(token)
            ids.append(token)
        text = info.prompt_tokenizer.decode(ids[:-1])
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not (isinstance(value, dict) and set(value) == {"a", "b"} and len(value["a"]) <= 5
                and 0 <= value["b"] <= 99) or any(c < " " or c == "\ufffd" for c in text):
            bad.append(text)
    assert not bad, bad


def test_a_tokenizer_no_grammar_can_speak_for_is_refused_at_start(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]").save_pretrained(tmp_path)
    with pytest.raises(ValueError) as e:
        TokenizerInfo.load(tmp_path)
    assert str(e.value) == (f"{tmp_path / 'tokenizer.json'}: its decoder (WordPiece) is neither byte-level BPE nor "
                            f"SentencePiece's, so structured output could not be constrained over it")


def test_too_many_optional_properties_are_refused_before_any_regex(grammars):
    """Past 160 optional properties in one object the regex is over the limit whatever they are: refused at once,
    before a compile (10 000 took 12-22 s and 1.5 GB to learn that)."""
    many = {f"p{i}": {"type": "integer"} for i in range(10_000)}
    cached = len(grammars._cache)
    with pytest.raises(InvalidGrammar, match="too large: 10000 optional properties in one object"):
        grammars.json_schema({"type": "object", "properties": many})
    with pytest.raises(InvalidGrammar, match="too large: 9839 optional properties"):
        grammars.json_schema({"type": "array", "items": {"type": "object", "properties": many,
                                                         "required": [f"p{i}" for i in range(161)]}})
    assert len(grammars._cache) == cached        # no compile was started
    assert grammars.json_schema({"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(50)},
                                 "required": [f"p{i}" for i in range(50)]}) is not None


# -------------------------------------------------------------------------------- the schema limits' edges
def _nest(levels: int) -> dict:
    """`levels` objects, each inside the last."""
    schema: dict = {}
    for _ in range(levels - 1):
        schema = {"a": schema}
    return schema


def test_the_depth_limit_is_exact():
    """64 levels of objects and arrays pass, 65 do not (65 did)."""
    _depth(_nest(64), 64)
    _depth([[[[{}]]]], 5)
    with pytest.raises(InvalidGrammar, match="nested more than 64 levels deep"):
        _depth(_nest(65), 64)
    with pytest.raises(InvalidGrammar, match="nested more than 4 levels deep"):
        _depth([[[[{}]]]], 4)


def _object(optional: int, required: int) -> dict:
    names = [f"p{i}" for i in range(optional + required)]
    return {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names[optional:]}


def test_the_optional_property_limit_is_exact_and_counts_only_optional_ones():
    """160 optional properties pass the check, 161 do not; required ones never count (200 properties of which 40
    required is 160 optional)."""
    for ok in (_object(160, 0), _object(160, 40), _object(0, 500)):
        _bounded_integers(ok, {})
    for bad, n in ((_object(161, 0), 161), (_object(161, 39), 161)):
        with pytest.raises(InvalidGrammar, match=f"too large: {n} optional properties in one object"):
            _bounded_integers(bad, {})


@pytest.mark.parametrize("key", ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"])
def test_the_integer_bound_limit_is_exact(key):
    """±2**63 is enforced; one past it is refused."""
    at = 2**63 if "aximum" in key else -(2**63)
    ranges: dict = {}
    _bounded_integers({"type": "integer", key: at}, ranges)
    assert len(ranges) == 1
    step = 1 if at > 0 else -1
    past = at + step + (step if key.startswith("exclusive") else 0)
    with pytest.raises(InvalidGrammar, match="is past the largest this server enforces"):
        _bounded_integers({"type": "integer", key: past}, {})


@pytest.mark.parametrize("bounds,allowed", [
    ({"exclusiveMinimum": 5, "maximum": 8}, [6, 7, 8]), ({"minimum": 5, "exclusiveMaximum": 8}, [5, 6, 7]),
    ({"exclusiveMinimum": 4.5, "exclusiveMaximum": 7.5}, [5, 6, 7]), ({"minimum": 5, "maximum": 5}, [5]),
    ({"exclusiveMinimum": -3, "exclusiveMaximum": -1}, [-2]), ({"minimum": -0.5, "maximum": 0.5}, [0]),
])
def test_integer_bounds_exclusive_and_equal(bounds, allowed):
    """Exclusive bounds leave their own value out; minimum == maximum allows exactly that one."""
    import re
    ranges: dict = {}
    _bounded_integers({"type": "integer", **bounds}, ranges)
    rx = re.compile(*ranges.values())
    assert [n for n in range(-20, 20) if rx.fullmatch(str(n))] == allowed


def test_integer_ranges_are_exact_across_digit_counts():
    """Every range between small bounds, and random ranges over up to 9 digits checked around their ends and at
    every power of ten: the digit-by-digit regex allows exactly lo..hi."""
    import random
    import re
    pairs = [(lo, hi) for lo in range(-25, 125, 3) for hi in range(lo, 125, 4)]
    rng = random.Random(7)
    for _ in range(300):
        a, b = (rng.randint(-10**rng.randint(1, 9), 10**rng.randint(1, 9)) for _ in range(2))
        pairs.append((min(a, b), max(a, b)))
    for lo, hi in pairs:
        rx = re.compile(integer_regex(lo, hi))
        probes = {*range(-30, 130), *range(lo - 12, lo + 12), *range(hi - 12, hi + 12),
                  *(s * (10**k + d) for k in range(10) for d in (-1, 0, 1) for s in (1, -1)),
                  *(rng.randint(lo, hi) for _ in range(20))}
        wrong = [n for n in probes if bool(rx.fullmatch(str(n))) != (lo <= n <= hi)]
        assert not wrong, (lo, hi, wrong[:5])


# ----------------------------------------------------------------------------- a compile that dies (issue 53)
def _spawned(monkeypatch) -> list:
    """The compile processes started from now on (subprocess.Popen, recorded)."""
    import subprocess
    procs, real = [], subprocess.Popen

    class Recorded(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            procs.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    return procs


def _first(procs: list, bound_s: float = 60):
    deadline = time.monotonic() + bound_s
    while not procs:
        assert time.monotonic() < deadline, "no compile process started"
        time.sleep(0.01)
    return procs[0]


@pytest.mark.parametrize("sig,timeout_s", [("SIGKILL", 120), ("SIGSTOP", 3)])
def test_a_compile_killed_or_stopped_from_outside_is_the_servers_failure_and_not_cached(info, monkeypatch, sig,
                                                                                         timeout_s):
    """SIGKILL (as the OOM killer sends) and SIGSTOP (held past the deadline) of a compile's process: before, the
    client's 400 'the compile stopped (exit code -9)' or 'takes longer than', cached, so the same valid schema was
    refused at once ever after. Now CompileFailed (the API's 503, to retry), and the schema compiles when sent
    again."""
    import signal
    import threading

    from serving.shaping.grammar_pool import CompileFailed
    grammars = Grammars(info, len(info.prompt_tokenizer), timeout_s=timeout_s)
    grammars.json_schema({"type": "boolean"})            # the vocabulary, built once
    procs = _spawned(monkeypatch)
    got = []
    asking = threading.Thread(target=lambda: got.append(_outcome(lambda: grammars.json_schema(SCHEMA))),
                              daemon=True)
    asking.start()
    _first(procs).send_signal(getattr(signal, sig))
    asking.join(timeout_s + 60)
    assert len(got) == 1 and isinstance(got[0], CompileFailed), got
    assert ("killed (SIGKILL)" if sig == "SIGKILL" else "stopped") in str(got[0])
    monkeypatch.undo()
    assert grammars.json_schema(SCHEMA) is not None         # compiled: nothing of the failure was cached


def _outcome(ask):
    try:
        return ask()
    except Exception as e:      # noqa: BLE001 - the test looks at it
        return e


def test_a_full_tmpdir_does_not_stop_compiles_and_no_room_at_all_is_the_servers_failure(info, monkeypatch):
    """A full TMPDIR made every compile a 500 (OSError writing its input). Now the input waits in memory of its own
    (memfd), so compiles go on; where no room is to be had at all, CompileFailed (a 503), and nothing is cached."""
    import errno
    import os
    import tempfile

    from serving.shaping.grammar_pool import CompileFailed

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    grammars = Grammars(info, len(info.prompt_tokenizer))
    monkeypatch.setattr(tempfile, "TemporaryFile", full)
    assert grammars.json_schema({"type": "integer"}) is not None
    monkeypatch.setattr(os, "memfd_create", full, raising=False)
    with pytest.raises(CompileFailed, match="could not start"):
        grammars.json_schema(SCHEMA)
    monkeypatch.undo()
    assert grammars.json_schema(SCHEMA) is not None         # compiled: nothing of the failure was cached


# ------------------------------------------------------------------- a small schema beside slow ones (issue 53)
def test_a_small_schema_compiles_while_slow_ones_hold_every_worker(info, monkeypatch):
    """Two slow schemas (one client's, say) hold both workers; a small one sent then compiles in the quick slot
    while they still run. Before: the workers were first come, first served, and the small schema waited for a slow
    one to end (12-29 s). The pool is the same code under both runtimes' servers (serving/api/app.py builds it)."""
    import threading
    # quick_s well above a small compile's time on a loaded machine: what is checked is where it runs, not how fast
    grammars = Grammars(info, len(info.prompt_tokenizer), timeout_s=120, max_string=40, quick_s=60)
    grammars.json_schema({"type": "boolean"})            # the vocabulary, built once
    procs = _spawned(monkeypatch)
    gone = [threading.Event(), threading.Event()]
    slow = [threading.Thread(target=_outcome, args=(lambda i=i: grammars.json_schema(
        {"type": "string", "maxLength": 30 - i}, gone[i]),), daemon=True) for i in range(2)]
    for t in slow:
        t.start()
    deadline = time.monotonic() + 60
    while len(procs) < 2:                               # both workers hold a slow compile's process
        assert time.monotonic() < deadline, "the slow compiles did not start"
        time.sleep(0.01)
    small = {}
    asking = threading.Thread(target=lambda: small.update(got=_outcome(lambda: grammars.json_schema(SCHEMA))),
                              daemon=True)
    asking.start()
    try:
        deadline = time.monotonic() + 120               # past it, the slow ones end anyway (their time limit)
        while not small and all(t.is_alive() for t in slow) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert small and all(t.is_alive() for t in slow), "the small schema waited for a slow one"
        assert small["got"].words == mask_words(len(info.prompt_tokenizer)) and len(procs) == 3
    finally:
        for g in gone:
            g.set()
        for t in (*slow, asking):
            t.join(30)


def test_a_shorter_schema_takes_the_place_of_the_longest_waiting_for_the_quick_slot(info):
    """Every place taken by one client's flood (the worker, the waiting place held in the quick slot, and the quick
    slot's own place by a long schema waiting for it): another client's short schema is admitted in the long one's
    place (the smallest job first), which is GrammarBusy, and compiles once the quick slot frees. Before: a 429 at
    once (the pressure run's round 6: every small schema beside 16 slow ones refused). A schema no shorter than any
    waiting is still busy."""
    import threading

    grammars = Grammars(info, len(info.prompt_tokenizer), timeout_s=120, workers=1, queued=1, quick_s=60)
    grammars.json_schema({"type": "boolean"})            # the vocabulary, built once
    while grammars.in_flight:
        time.sleep(0.01)
    compile, release = grammars._compile, threading.Event()

    def flood_held(key, deadline, stop, quick=False):
        if '"flood-' in key:                             # the flood holds the worker and the quick slot
            release.wait(60)
        return compile(key, deadline, stop, quick=quick)

    grammars._compile = flood_held
    outcomes = {}

    def ask(name, schema):
        outcomes[name] = _outcome(lambda: grammars.json_schema(schema))

    long_one = {"enum": ["flood-3", "x" * 200]}
    threads = [threading.Thread(target=ask, args=(n, sc), daemon=True)
               for n, sc in (("flood-1", {"enum": ["flood-1"]}), ("flood-2", {"enum": ["flood-2"]}))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while grammars.in_flight < 2 or grammars._free["quick"]:            # the worker and the quick slot held
        assert time.monotonic() < deadline, "the flood did not fill the places"
        time.sleep(0.01)
    threads.append(threading.Thread(target=ask, args=("long", long_one), daemon=True))
    threads[-1].start()
    while len(grammars._quick_queue) < 1:                                # the long one waits for the quick slot
        assert time.monotonic() < deadline, "the long schema was not admitted for the quick slot"
        time.sleep(0.01)
    try:
        with pytest.raises(GrammarBusy, match="compiling or waiting"):  # no shorter than the one waiting
            grammars.json_schema({"enum": ["flood-4", "y" * 300]})
        threads.append(threading.Thread(target=ask, args=("short", {"type": "string", "maxLength": 3}), daemon=True))
        threads[-1].start()
        threads[2].join(60)
        assert isinstance(outcomes["long"], GrammarBusy) and "shorter schema" in str(outcomes["long"])
    finally:
        release.set()
        for t in threads:
            t.join(60)
    assert outcomes["short"].words == mask_words(len(info.prompt_tokenizer))
    assert not any(isinstance(outcomes[n], Exception) for n in ("flood-1", "flood-2"))
    assert json.dumps(long_one, separators=(",", ":")) not in grammars._cache      # the refusal is never cached


def test_a_small_schema_compiles_when_slow_ones_fill_every_place(info, monkeypatch):
    """One worker and one waiting place, both taken by slow schemas (one client's flood; the second's quick try
    ends, and it waits for the worker): a small schema is admitted for the quick slot alone, ahead of them, and
    compiles while they are still in flight. Before: a 429 'server busy compiling schemas' at once (the pressure
    run's "small schemas beside 16 slow ones", 2026-12-06). One more past the quick slot's places is still busy."""
    import threading

    from serving.shaping import grammar_pool

    grammars = Grammars(info, len(info.prompt_tokenizer), timeout_s=120, workers=1, queued=1, quick_s=60)
    grammars.json_schema({"type": "boolean"})            # the vocabulary, built once
    while grammars.in_flight:                            # its thread's accounting, just after its answer
        time.sleep(0.01)
    compile, release = grammars._compile, threading.Event()

    def slow_ones_held(key, deadline, stop, quick=False):
        if '"flood-' in key:                             # the flood: its worker held; its quick try cut short
            if quick:
                time.sleep(0.2)
                raise grammar_pool._Slow
            release.wait(60)
        return compile(key, deadline, stop, quick=quick)

    grammars._compile = slow_ones_held
    flood = [threading.Thread(target=_outcome, args=(lambda s=s: grammars.json_schema({"enum": [s]}),), daemon=True)
             for s in ("flood-1", "flood-2")]
    for t in flood:
        t.start()
    deadline = time.monotonic() + 60
    while grammars.in_flight < 2 or grammars._free["quick"] == 0:     # both in flight, the quick slot free again
        assert time.monotonic() < deadline, "the flood did not fill the places"
        time.sleep(0.01)
    try:
        got = grammars.json_schema(SCHEMA)
        assert got.words == mask_words(len(info.prompt_tokenizer)) and all(t.is_alive() for t in flood)
        assert grammars.in_flight == 2 and grammars.quick_only == 0
        grammars.quick_only = grammars.queued                  # the quick slot's places taken too
        with pytest.raises(GrammarBusy, match=r"3 schemas are compiling or waiting to \(at most 2, and 1 more for "
                           r"the quick slot\)"):
            grammars.json_schema({"type": "string", "maxLength": 3})
        grammars.quick_only = 0
    finally:
        release.set()
        for t in flood:
            t.join(60)


def test_a_compile_past_its_quick_try_waits_for_a_worker_and_compiles(info, monkeypatch):
    """The one worker is held; a schema gets the quick slot, runs past its time there (its process is killed: no
    verdict, and nothing of it is cached) and waits for the worker, where it compiles with its whole time limit."""
    import threading
    grammars = Grammars(info, len(info.prompt_tokenizer), timeout_s=120, workers=1, quick_s=0.001)
    grammars.json_schema({"type": "boolean"})            # the vocabulary, built once
    release, started = _held_workers(grammars, 1)
    threading.Thread(target=grammars.json_schema, args=({"type": "integer"},), daemon=True).start()
    assert started.acquire(timeout=60)
    procs = _spawned(monkeypatch)
    got = []
    asking = threading.Thread(target=lambda: got.append(_outcome(lambda: grammars.json_schema(SCHEMA))),
                              daemon=True)
    asking.start()
    _first(procs).wait(60)                              # its quick try, ended
    assert procs[0].returncode == -9 and not got and len(procs) == 1 and asking.is_alive()
    release.set()
    asking.join(120)
    assert len(got) == 1 and got[0].words == mask_words(len(info.prompt_tokenizer)), got
    assert len(procs) == 3 and grammars.json_schema(SCHEMA) is got[0]     # with the held one's, once let go
