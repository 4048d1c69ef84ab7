"""The smoke checks: is this chat answer a real answer? Pure functions over what the server sent.

A health endpoint can pass while the model answers garbage (`: ok: ok: ok` on a healthy server), so every answer
goes through the same checks, in this order (the first failure is the reason reported):
  not_degenerate  no short unit repeated over most of the text, no special token repeated (`<pad><pad>`)
  non_empty       text left after stripping thought blocks, special tokens and padding
  finish_reason   "stop": the model ended its turn, it was not cut off
  expected        the expected keyword/regex is in the cleaned text (case-insensitive)
  token_counts    usage present, 1 ≤ completion_tokens ≤ max_tokens, and consistent with the text and chunks
"""
from __future__ import annotations

import dataclasses
import re

from g5g.wire import Answer

CHECKS = ("not_degenerate", "non_empty", "finish_reason", "expected", "token_counts")

# Thought blocks: <think>…</think>, <thought>…</thought>, Gemma 4's <|channel>thought…<channel|> (unterminated too).
_THOUGHT = re.compile(r"<(think|thought)>.*?(</\1>|$)|<\|channel\>.*?(<channel\|>|$)", re.S | re.I)
# Special tokens: <pad>, <eos>, <bos>, <unk>, <mask>, <s>, </s>, <start_of_turn>, <end_of_turn>, <|…|>, <|turn>, <turn|>…
_SPECIAL = re.compile(
    r"<\|[^<>\s]{0,40}\|>|<\|[a-z_]{1,30}>|<[a-z_]{1,30}\|>|</?s>|"
    r"<(?:pad|eos|bos|unk|mask|start_of_turn|end_of_turn|start_of_image|end_of_image|image_soft_token)>|"
    r"<unused\d+>|\[PAD\]", re.I)
# A short unit repeated 3+ times in a row, or a longer one (a phrase, a sentence) 2+ times.
_REPEATS = (re.compile(r"(.{1,40}?)\1{2,}", re.S), re.compile(r"(.{8,200}?)\1+", re.S))


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


def clean(text: str) -> str:
    """The answer a user would read: no thought blocks, no special tokens or padding, trimmed."""
    return _SPECIAL.sub("", _THOUGHT.sub("", text)).strip()


def degeneracy(text: str) -> str | None:
    """Why `text` is degenerate (repetition), or None. Looks at the raw text, special tokens included."""
    specials = [m.group(0) for m in _SPECIAL.finditer(text)]
    for a, b in zip(specials, specials[1:]):
        if a == b and f"{a}{b}" in text:
            return f"special token {a} repeated"
    body = _THOUGHT.sub("", text).strip()[:4000]
    if not body:
        return None
    for pattern in _REPEATS:
        covered, worst = 0, ""
        for m in pattern.finditer(body):
            unit = m.group(1)
            if not unit.strip() or (len(unit.strip()) == 1 and len(m.group(0)) < 6):
                continue  # whitespace runs; "!!!" or "..." are punctuation, not a loop
            covered += len(m.group(0))
            worst = worst or f"{unit!r} ×{len(m.group(0)) // len(unit)}"
        if covered * 2 >= len(body):
            return f"repetition {worst} covers {covered}/{len(body)} characters"
    return None


def check_answer(ans: Answer, expect: str, max_tokens: int) -> list[Check]:
    """All checks for one answer (streamed or not)."""
    if not ans.success:
        return [Check("request", False, ans.error or "no answer")]
    raw = ans.text
    text = clean(raw)
    checks = []
    why = degeneracy(raw)
    checks.append(Check("not_degenerate", why is None, why or "no repetition"))
    checks.append(Check("non_empty", bool(text), f"{len(text)} characters" if text else
                        f"nothing left after stripping thought blocks and special tokens (raw {raw[:60]!r})"))
    checks.append(Check("finish_reason", ans.finish_reason == "stop", f"finish_reason {ans.finish_reason!r}"
                        + ("" if ans.finish_reason == "stop" else f" (max_tokens {max_tokens})")))
    found = re.search(expect, text, re.I | re.S)
    checks.append(Check("expected", bool(found), f"/{expect}/ matched {found.group(0)!r}" if found
                        else f"/{expect}/ not found in {text[:120]!r}"))
    checks.append(token_check(ans, max_tokens))
    return checks


def token_check(ans: Answer, max_tokens: int) -> Check:
    n = ans.completion_tokens
    if n is None:
        where = "final usage chunk (stream_options.include_usage)" if ans.stream else "usage"
        return Check("token_counts", False, f"no completion_tokens in the {where}")
    problems = []
    if not 1 <= n <= max_tokens:
        problems.append(f"completion_tokens {n} outside 1…{max_tokens}")
    visible = len(ans.text)
    # One token decodes to at most a few dozen characters (Gemma's longest pieces are whitespace runs of 31).
    if visible > 64 * n:
        problems.append(f"{visible} characters from {n} tokens")
    # Every chunk that carried text carried at least one token.
    if ans.stream and ans.chunks > n:
        problems.append(f"{ans.chunks} text chunks but {n} tokens")
    # Many more tokens than characters: tokens went somewhere (unless they were thoughts the server kept back).
    if n > 4 * (visible + len(ans.reasoning)) + 16:
        problems.append(f"{n} tokens for {visible} characters")
    prompt = ans.prompt_tokens
    if prompt is not None and prompt < 1:
        problems.append(f"prompt_tokens {prompt}")
    detail = "; ".join(problems) or f"{n} tokens for {visible} characters" + (
        f" in {ans.chunks} chunks" if ans.stream else "")
    return Check("token_counts", not problems, detail)


def first_failure(checks: list[Check]) -> Check | None:
    return next((c for c in checks if not c.ok), None)
