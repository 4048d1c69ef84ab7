"""The shared generation loop (serving/core/generation.py) and the PyTorch runtime, on the tiny Gemma 4 checkpoint."""
from __future__ import annotations

import random

import numpy as np
import pytest

from serving.core.detokenize import Detokenizer, StopAutomaton, StopStrings
from serving.core.generation import Batch, Delta, Finish, SamplingParams, generate
from tests.fixtures.batching import Job, run_in_batch
from tests.fixtures.jax_engines import load_tiny as load_tiny_jax
from tests.fixtures.tolerances import F32_MODEL_REORDERED
from devtools.tiny_gemma4 import ANSWER, QUESTION


@pytest.fixture(scope="module")
def engine(tiny_gemma4):
    from serving.torch_runtime import load
    yield load(tiny_gemma4)


def run(engine, info, params, content=QUESTION, cancelled=lambda: False):
    events = list(generate(engine, info, info.chat_prompt([{"role": "user", "content": content}]), params, cancelled))
    *deltas, fin = events
    assert all(isinstance(d, Delta) for d in deltas) and isinstance(fin, Finish)
    return "".join(d.text for d in deltas), fin


def feed(info, ids) -> str:
    detok = Detokenizer(info)
    deltas = [detok.push(i) for i in ids]
    assert not any("\ufffd" in d for d in deltas), deltas
    return "".join(deltas) + detok.flush()


# ------------------------------------------------------------------------------------------ tokenizer info
def test_stop_ids_come_from_generation_config_and_turn_end(info):
    tok = info.tokenizer
    assert info.stop_ids == {1, 106}
    assert tok.convert_ids_to_tokens(106) == "<turn|>"
    assert info.default_sampling == {"temperature": 0.0}      # do_sample: false in generation_config.json


def test_chat_prompt_uses_the_checkpoints_template(info):
    ids = info.chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}])
    assert info.tokenizer.decode(ids) == ("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n"
                                          "<|turn>model\nHello<turn|>\n<|turn>user\nBye<turn|>\n<|turn>model\n")


def test_a_conversation_the_template_would_blow_up_is_refused_before_rendering(info):
    """Gemma's template writes the tools again in every system turn: 1000 tools x 1000 system turns (147 KB sent)
    rendered for 23-26 s before the length check. Its rendered size is known from the inputs first."""
    from serving.shaping.tokenizer import PromptTooLong, rendered_chars
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "d"}} for i in range(1000)]
    turns = [{"role": "system", "content": "s"}] * 1000
    assert rendered_chars(turns, tools) == 1001 * rendered_chars([], tools) + 1000 * len("rolesystemcontents")
    calls = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": {"a": "x" * 4_000_000}}}]}]
    for messages, tools_shown in ((turns, tools), (calls, None)):
        with pytest.raises(PromptTooLong, match="at least"):
            info.render_chat(messages, tools_shown, limit=256)
    text = info.render_chat(turns[:2], tools[:3], limit=4096)       # what fits is rendered
    assert text.count("<|tool>declaration:f2") == 2 and len(text) >= rendered_chars(turns[:2], tools[:3])


def test_requests_tokenise_at_once_without_borrowing_errors(info):
    """The prompt tokenizer serves several request threads at once (encode, decode, the template, token strings):
    no "Already borrowed", and a short prompt is not held behind a long one (before: one lock for all)."""
    import threading
    errors, order = [], []

    def busy(i: int):
        try:
            for _ in range(30):
                ids = info.encode(f"{QUESTION} {i}", limit=4096)
                assert info.decode(ids) == f"{QUESTION} {i}" and len(info.token_strs(ids)) == len(ids)
                info.render_chat([{"role": "user", "content": str(i)}], limit=4096)
        except Exception as e:      # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=busy, args=(i,)) for i in range(8)]
    # 5 MB: seconds to encode (3 million words took a minute), while the short prompts' 240 rounds take ~0.1 s
    long = threading.Thread(target=lambda: order.append(("long", len(info.encode("word " * 1_000_000)))))
    long.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    order.append(("short", 0))
    long.join(120)
    assert not errors, errors[:3]
    assert [name for name, _ in order] == ["short", "long"]


# ---------------------------------------------------------------------------------------- detokenisation
def test_multibyte_characters_never_split(info):
    text = "héllo 🎉 wörld — ✓ 日本"
    ids = info.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())              # byte-fallback pieces: a character spans several tokens
    assert feed(info, ids) == text


def test_special_tokens_never_reach_the_client(info):
    ids = info.tokenizer.encode("<bos><|turn>model\nHi<turn|><eos>", add_special_tokens=False)
    assert 106 in ids and 2 in ids
    assert feed(info, ids) == "model\nHi"


def test_thought_blocks_are_hidden(info):
    ids = info.tokenizer.encode("<|channel>thought\nsecret plan<channel|>The answer", add_special_tokens=False)
    assert feed(info, ids) == "The answer"
    # A generation that ends inside a thought shows nothing of it.
    assert feed(info, info.tokenizer.encode("Ok<|channel>thought\nhmm", add_special_tokens=False)) == "Ok"


# ------------------------------------------------------------------------------------------- stop strings
def test_stop_string_is_held_back_across_deltas_and_cut():
    s = StopStrings(["Reliability"])
    assert s.push("Site Rel") == ("Site ", False)
    assert s.push("iab") == ("", False)
    assert s.push("ility Eng") == ("", True)


def test_held_back_text_is_released_when_it_is_not_a_stop():
    s = StopStrings(["Relax"])
    assert s.push("Site Rel") == ("Site ", False)
    assert s.push("iability") == ("Reliability", False)
    s = StopStrings(["xyz"])
    assert s.push("abcx") == ("abc", False) and s.flush() == "x"


def _first_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Reference: the text up to the first stop string to complete (the longest, if several end together)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if s and text[:end].endswith(s)]
        if starts:
            return text[:min(starts)], True
    return text, False


def _held(text: str, stops: list[str]) -> int:
    """Reference: the longest end of `text` that begins some stop string (and is not all of it)."""
    return max([n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])], default=0)


@pytest.mark.parametrize("seed", range(40))
def test_stop_strings_match_the_reference_however_the_text_is_split(seed):
    rng = random.Random(seed)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
    s, sent, hit, pos = StopStrings(stops), "", False, 0
    while pos < len(text) and not hit:
        step = rng.randint(1, 5)
        out, hit = s.push(text[pos:pos + step])
        pos, sent = pos + step, sent + out
        if not hit:          # holds back exactly what may still become a stop string, no more, no less
            assert len(text[:pos]) - len(sent) == _held(text[:pos], stops), (stops, text[:pos], sent)
    if not hit:
        sent += s.flush()
    assert (sent, hit) == _first_stop(text, stops), (stops, text)


@pytest.mark.parametrize("seed", range(20))
def test_a_shared_automaton_keeps_each_matchers_place_and_include_ends_at_the_stop(seed):
    """The n choices of a request share one StopAutomaton (built off the engine thread); each StopStrings keeps its
    own place in it. With include_stop_str_in_output the text ends where the first stop string completes."""
    rng = random.Random(seed)
    stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
    texts = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 40))) for _ in range(2)]
    auto = StopAutomaton(stops)
    matchers = [StopStrings(auto), StopStrings(auto, include=True)]
    sent, hit = ["", ""], [False, False]
    for pos in range(max(map(len, texts))):              # interleaved, a character at a time
        for i, m in enumerate(matchers):
            if pos < len(texts[i]) and not hit[i]:
                out, hit[i] = m.push(texts[i][pos])
                sent[i] += out
    for i, m in enumerate(matchers):
        sent[i] += "" if hit[i] else m.flush()
    assert (sent[0], hit[0]) == _first_stop(texts[0], stops), (stops, texts[0])
    end = next((e for e in range(1, len(texts[1]) + 1) if any(texts[1][:e].endswith(s) for s in stops)), None)
    assert (sent[1], hit[1]) == ((texts[1], False) if end is None else (texts[1][:end], True)), (stops, texts[1])


# ------------------------------------------------------------------------------------------------ sampler
# ------------------------------------------------------------------------------------ the loop, real engine
def test_greedy_answer_stops_at_end_of_turn(engine, info):
    text, fin = run(engine, info, SamplingParams(temperature=0.0, max_tokens=200))
    assert text == ANSWER
    assert fin.reason == "stop"
    assert fin.completion_tokens == len(info.tokenizer.encode(ANSWER, add_special_tokens=False)) + 1


def test_max_tokens_and_ignore_eos(engine, info):
    text, fin = run(engine, info, SamplingParams(temperature=0.0, max_tokens=4))
    assert (fin.reason, fin.completion_tokens) == ("length", 4) and ANSWER.startswith(text)
    n = fin.completion_tokens
    _, fin = run(engine, info, SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
    assert (fin.reason, fin.completion_tokens) == ("length", 120)
    assert n < 120


def test_context_limit_ends_generation(engine, info):
    prompt = info.chat_prompt([{"role": "user", "content": QUESTION}])
    _, fin = run(engine, info, SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
    assert fin.reason == "length" and fin.completion_tokens == engine.max_context - len(prompt)


def test_cancel_stops_at_the_next_token(engine, info):
    calls = []
    _, fin = run(engine, info, SamplingParams(temperature=0.0, max_tokens=100),
                 cancelled=lambda: calls.append(1) or len(calls) > 3)
    assert fin.reason == "abort" and fin.completion_tokens == 3


# ------------------------------------------------------------------------------------------ pytorch runtime
def test_incremental_decode_matches_one_full_forward(engine, info, tiny_gemma4):
    """KV cache, sliding window (16) and KV-shared layers: each step's logits equal a full forward's (transformers'
    eager attention: the engine's own attends through its cache)."""
    import torch

    from tests.fixtures.eager_reference import eager_model
    prompt = info.chat_prompt([{"role": "user", "content": QUESTION}])
    answer = info.tokenizer.encode(ANSWER, add_special_tokens=False)
    seq = prompt + answer
    assert len(seq) > 4 * engine.text_config.sliding_window
    with torch.inference_mode():
        full = eager_model(tiny_gemma4, engine.max_context)(input_ids=torch.tensor([seq])).logits[0].float().numpy()
    greedy = SamplingParams(temperature=0.0)
    first = engine.start(0, prompt, greedy)
    steps = [engine.logits(0)]
    for t in answer[:-1]:
        engine.step({0: t})
        steps.append(engine.logits(0))
    assert first == answer[0]
    # one forward over the whole sequence against a step at a time: the model's sums in another order, over more keys
    np.testing.assert_allclose(np.stack(steps), full[len(prompt) - 1:-1], atol=2 * F32_MODEL_REORDERED,
                               rtol=F32_MODEL_REORDERED)
    assert all(s.dtype == np.float32 and s.shape == (512,) for s in steps)


def test_runtime_loads_text_weights_only(engine, tiny_gemma4):
    from safetensors import safe_open
    with safe_open(tiny_gemma4 / "model.safetensors", "np") as f:
        towers = [k for k in f.keys() if k.startswith(("model.vision_tower.", "model.audio_tower."))]
    assert towers                                     # the checkpoint has them ...
    names = {n for n, _ in engine.model.named_parameters()}
    assert not any("tower" in n for n in names)       # ... the served model does not
    assert engine.model.dtype.is_floating_point and str(engine.model.dtype) == "torch.float32"
    assert engine.max_context == 256


# --------------------------------------------------------------------------------------- continuous batching
@pytest.fixture(scope="module")
def jax_engine(tiny_gemma4):
    """This module's own engine, not the session's tiny_jax_engine: its tests leave requests unfinished (a client
    that left, a batch stopped mid-way), which another module's tests would then find in the slots."""
    return load_tiny_jax(tiny_gemma4)


@pytest.mark.parametrize("runtime", ["pytorch", "jax"])
def test_batch_gives_each_request_what_it_gets_alone(runtime, engine, jax_engine, info):
    """Requests join (more than there are slots: the rest wait) and leave (stop token, length, stop string,
    a client that hung up); each one's events equal those of the request run alone."""
    eng = engine if runtime == "pytorch" else jax_engine
    ask = info.chat_prompt([{"role": "user", "content": QUESTION}])
    other = info.chat_prompt([{"role": "user", "content": "What is a stop string? " * 3}])
    jobs = [Job(ask, SamplingParams(temperature=0.0, max_tokens=200)),
            Job(other, SamplingParams(temperature=1.0, seed=4, max_tokens=30)),
            Job(ask, SamplingParams(temperature=0.0, max_tokens=7)),
            Job(ask, SamplingParams(temperature=0.0, max_tokens=60, stop=("software",))),
            Job(other, SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=40, ignore_eos=True))]

    def text(events):
        return "".join(e.text for e in events if isinstance(e, Delta)), [
            (e.reason, e.prompt_tokens, e.completion_tokens) for e in events if isinstance(e, Finish)]

    alone = [text(list(generate(eng, info, j.prompt_ids, j.params))) for j in jobs]
    assert [text(events) for events in run_in_batch(eng, info, jobs)] == alone
    assert alone[0][0] == ANSWER and alone[3][0] == ANSWER[:ANSWER.index("software")]


def test_batch_ends_a_job_whose_client_left(jax_engine, info):
    ask = info.chat_prompt([{"role": "user", "content": QUESTION}])
    batch = Batch(jax_engine, info)
    stay, leave = Job(ask, SamplingParams(temperature=0.0, max_tokens=20)), Job(ask, SamplingParams(max_tokens=20))
    batch.join(stay)
    batch.join(leave)
    batch.step()
    leave.cancelled.set()
    events = batch.step()
    fin = [ev for job, ev in events if job is leave and isinstance(ev, Finish)]
    assert fin and fin[0].reason == "abort" and fin[0].completion_tokens == 3
    assert list(batch.live.values())[0].job is stay and batch.free == 2
