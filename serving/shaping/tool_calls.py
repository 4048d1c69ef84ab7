"""Tool calling: what the model writes, turned into OpenAI's `tool_calls` (streamed as deltas, or whole).

`tool_choice` picks how the answer is read:
- "none" (or no tools): plain content;
- a named function: the output is forced (serving/shaping/grammar.py) to be that function's arguments, as JSON valid
  against its `parameters` schema, and streamed as the call's argument fragments;
- "required": the output is forced to be a JSON array of {"name", "parameters"} objects, one per call (what vLLM's
  structured outputs force); the calls are sent when the array is complete;
- "auto": the model writes Gemma 4's own markup, `<|tool_call>call:NAME{key:value,…}<tool_call|>`, where strings
  are quoted with `<|"|>` and keys are bare; text outside the markup is content.

Each reader turns text deltas into OpenAI chat deltas ({"content"} or {"tool_calls": [{"index", "id", "type",
"function": {"name", "arguments"}}]}, the name first, then argument fragments). A non-streamed answer is the merge
of the same deltas, so both ways say the same thing.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

from serving.shaping.tokenizer import CALL_END, CALL_START, QUOTE     # Gemma's markup lives with its tokenizer


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_deltas(index: int, name: str, arguments: str) -> list[dict]:
    head = {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
    out = [{"tool_calls": [head]}]
    if arguments:
        out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})
    return out


class Reader:
    """tool_choice "none": everything is content. Subclasses read tool calls out of the text."""
    called = False      # a tool call was sent: the answer's finish_reason is "tool_calls"

    def feed(self, text: str) -> list[dict]:
        return self._seen(self._feed(text))

    def close(self) -> list[dict]:
        return self._seen(self._close())

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.called and reason == "stop" else reason

    def _seen(self, deltas: list[dict]) -> list[dict]:
        self.called = self.called or any("tool_calls" in d for d in deltas)
        return deltas

    def _feed(self, text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def _close(self) -> list[dict]:
        return []


class NamedCall(Reader):
    """A forced call of one function: the output is its arguments."""

    def __init__(self, name: str):
        self.name, self.started = name, False

    def _feed(self, text: str) -> list[dict]:
        if not self.started:
            self.started = True
            return _call_deltas(0, self.name, text)
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []

    def _close(self) -> list[dict]:
        return [] if self.started else self._feed("")


class RequiredCalls(Reader):
    """tool_choice "required": a JSON array of {"name", "parameters"}, sent as calls once it is complete (if the
    output was cut short, what there is comes back as content)."""

    def __init__(self):
        self.text = ""

    def _feed(self, text: str) -> list[dict]:
        self.text += text
        return []

    def _close(self) -> list[dict]:
        try:
            calls = json.loads(self.text)
        except ValueError:
            return [{"content": self.text}] if self.text else []
        return [d for i, c in enumerate(calls) for d in _call_deltas(i, c["name"], json.dumps(c["parameters"]))]


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the tag may be arriving)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class GemmaCalls(Reader):
    """tool_choice "auto": content, with Gemma 4 tool-call markup cut out and sent as calls. A call is sent when its
    end tag arrives; markup that does not parse stays in the content."""

    def __init__(self):
        self.pending, self.in_call, self.calls = "", False, 0

    def _feed(self, text: str) -> list[dict]:
        self.pending += text
        content, out = "", []
        while True:
            tag = CALL_END if self.in_call else CALL_START
            at = self.pending.find(tag)
            if at < 0:
                if not self.in_call:
                    keep = _partial(self.pending, CALL_START)
                    content += self.pending[:len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                break
            before, self.pending = self.pending[:at], self.pending[at + len(tag):]
            if not self.in_call:
                content += before
            else:
                try:
                    name, arguments = parse_call(before)
                except ValueError:
                    content += CALL_START + before + CALL_END
                else:
                    if content:
                        out.append({"content": content})
                        content = ""
                    out += _call_deltas(self.calls, name, json.dumps(arguments, ensure_ascii=False))
                    self.calls += 1
            self.in_call = not self.in_call
        if content:
            out.append({"content": content})
        return out

    def _close(self) -> list[dict]:
        rest = (CALL_START if self.in_call else "") + self.pending     # an unfinished call is content
        self.pending, self.in_call = "", False
        return [{"content": rest}] if rest else []


def required_schema(parameters: dict[str, Any]) -> dict:
    """The JSON schema "required" forces: one or more calls, each a known name with arguments valid for it."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
              "required": ["name", "parameters"]} for name, schema in parameters.items()]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def merge(deltas: list[dict]) -> dict:
    """The assistant message the deltas add up to."""
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", ()):
            call = calls.setdefault(c["index"], {"id": None, "type": "function",
                                                 "function": {"name": "", "arguments": ""}})
            call["id"] = c.get("id", call["id"])
            call["function"]["name"] += c["function"].get("name", "")
            call["function"]["arguments"] += c["function"].get("arguments", "")
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg


# --------------------------------------------------------------------------------- Gemma 4's argument syntax
_NAME = re.compile(r"\s*call:([A-Za-z0-9_.-]+)\s*(?=\{)")
_BARE_END = re.compile(r"[,}\]]")


def parse_call(body: str) -> tuple[str, dict]:
    """`call:NAME{key:value,…}` (the text between the call tags) -> (NAME, arguments); ValueError if malformed."""
    m = _NAME.match(body)
    if not m:
        raise ValueError(f"not a Gemma 4 call: {body[:80]!r}")
    arguments, end = _value(body, m.end())
    if not isinstance(arguments, dict) or body[end:].strip():
        raise ValueError(f"malformed arguments: {body[:80]!r}")
    return m.group(1), arguments


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _value(s: str, i: int) -> tuple[Any, int]:
    """One value from s[i:]: <|"|>string<|"|>, {key:value,…}, [value,…], a JSON string, or a bare word (a
    number, true, false, null; otherwise kept as text). Returns (value, index after it)."""
    i = _skip(s, i)
    if s.startswith(QUOTE, i):
        end = s.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise ValueError("unterminated string")
        return s[i + len(QUOTE):end], end + len(QUOTE)
    if s.startswith('"', i):
        return json.JSONDecoder().raw_decode(s, i)
    if s.startswith("{", i) or s.startswith("[", i):
        obj = s[i] == "{"
        close, out = ("}" if obj else "]"), ({} if obj else [])
        i = _skip(s, i + 1)
        if s.startswith(close, i):
            return out, i + 1
        while True:
            if obj:
                key, i = _key(s, i)
                out[key], i = _value(s, i)
            else:
                item, i = _value(s, i)
                out.append(item)
            i = _skip(s, i)
            if s.startswith(close, i):
                return out, i + 1
            if not s.startswith(",", i):
                raise ValueError(f"expected ',' or {close!r} at {i}")
            i += 1
    m = _BARE_END.search(s, i)
    end = m.start() if m else len(s)
    word = s[i:end].strip()
    if not word:
        raise ValueError(f"missing value at {i}")
    try:
        return json.loads(word), end
    except ValueError:
        return word, end


def _key(s: str, i: int) -> tuple[str, int]:
    i = _skip(s, i)
    if s.startswith(QUOTE, i) or s.startswith('"', i):
        key, i = _value(s, i)
    else:
        colon = s.find(":", i)
        if colon < 0:
            raise ValueError(f"expected key at {i}")
        key, i = s[i:colon].strip(), colon
    i = _skip(s, i)
    if not s.startswith(":", i) or not isinstance(key, str) or not key:
        raise ValueError(f"expected 'key:' at {i}")
    return key, i + 1
