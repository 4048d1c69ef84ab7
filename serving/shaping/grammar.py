"""Structured output: a grammar per request, enforced where the next token is chosen.

`response_format` (json_object, json_schema) and forced tool calls compile, through outlines-core, to an index over
the checkpoint's tokenizer: JSON schema -> regex -> for every state, the tokens allowed and where each leads. What a
schema may be is checked first, cheaply (its depth, integer bounds, string length bounds, optional properties: an
unusable schema is the client's 400); the compile itself, regex and index, can grow quadratically with the schema
and cannot be interrupted, so it runs in a process of its own, with capped memory, killed at the time limit or once
every request waiting for it left: a compile nobody waits for keeps no core and no memory, and no compile holds the
server's GIL (serving/shaping/grammar_pool.py: its workers, admission and cache). The generation loop
(serving/core/generation.py) gives each such request a `Matcher`: before every sampling step it writes the tokens the
grammar allows next as a bitmask (bit i % 32 of int32 word i // 32 is token i, the layout outlines-core and the
runtimes share) and after every generated token it advances. The runtime sets every other token's logit to MASKED
before it samples (serving/engine.py: the mask's layout, mask_words and MASKED are the runtime contract).
Why outlines-core: docs/serving.md.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

# The size of the regex a compile starts from (environment, read at import).
MAX_REGEX_CHARS = int(os.environ.get("G5G_GRAMMAR_MAX_REGEX", "100000"))
# A JSON string of at most n characters (maxLength, minLength) costs outlines-core's index time exponential in n
# (tiny fixture: n = 12 0.3 s, 14 1.0 s, 16 4.5 s, 18 15 s, 20 over 20 s): refused past this bound before the build.
MAX_STRING_BOUND = int(os.environ.get("G5G_GRAMMAR_MAX_STRING_BOUND", "16"))
# How deeply a schema's JSON may nest (objects and arrays): checked before anything recurses into it.
MAX_SCHEMA_DEPTH = int(os.environ.get("G5G_GRAMMAR_MAX_DEPTH", "64"))
# An object's optional properties make a regex that grows with their square (outlines-core writes every order in
# which they may come): past this many in one object it is over MAX_REGEX_CHARS whatever they are, refused before.
MAX_OPTIONAL_PROPERTIES = 160
# An integer minimum/maximum past this magnitude is refused (its range regex would grow with its digits).
MAX_INTEGER_BOUND = 2**63

# response_format json_object: outlines-core's own "any object" nests values 3 deep and costs ~30 s and ~330 MB
# on a 262k vocabulary; this one (values: scalars, arrays of scalars, objects of scalars) costs ~6 s and ~90 MB.
_SCALAR = {"type": ["string", "number", "boolean", "null"]}
ANY_OBJECT = {"type": "object", "additionalProperties": {"anyOf": [
    _SCALAR, {"type": "array", "items": _SCALAR}, {"type": "object", "additionalProperties": _SCALAR}]}}


class InvalidGrammar(ValueError):
    """The request's schema cannot be compiled: a 400 for the client."""


def tokenizer_family(tokenizer) -> str:
    """How a fast tokenizer's tokens spell their bytes, read from its decoder: "byte_level" (GPT-2's alphabet: Llama
    3, Qwen, ...) or "sentencepiece" ('▁' a space, <0xNN> a byte: Gemma's). ValueError for any other: a grammar
    over bytes could not know what its tokens write."""
    decoder = tokenizer.backend_tokenizer.decoder
    spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    parts = spec.get("decoders") or [spec]
    kinds = {d.get("type") for d in parts}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "Metaspace" in kinds or any(d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "▁"
                                   for d in parts):
        return "sentencepiece"
    raise ValueError(f"its decoder ({', '.join(sorted(filter(None, kinds))) or 'none'}) is neither byte-level BPE "
                     f"nor SentencePiece's, so structured output could not be constrained over it")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the printable Latin-1 bytes stand for themselves, every
    other byte for the character 256 + its rank among them."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def token_bytes(tokenizer, skip: frozenset[int], family: str = "sentencepiece") -> dict[bytes, list[int]]:
    """What each token writes, by the tokenizer's family (tokenizer_family). SentencePiece (Gemma's): '▁' is a
    space, <0xNN> is the byte NN, other tokens are their UTF-8 text. Byte-level BPE: each character of the token is
    one byte of GPT-2's alphabet (an added token that is not spelled in it writes its own text). Tokens in `skip`
    (special tokens, stop tokens) write nothing here."""
    alphabet = _byte_level_alphabet() if family == "byte_level" else {}
    out: dict[bytes, list[int]] = {}
    for text, i in tokenizer.get_vocab().items():
        if i in skip:
            continue
        if family == "byte_level":
            data = bytes(alphabet[c] for c in text) if all(c in alphabet for c in text) else text.encode()
        else:
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", text)
            data = bytes([int(byte[1], 16)]) if byte else text.replace("▁", " ").encode()
        if data:
            out.setdefault(data, []).append(i)
    return out


def _digits(lo: str, hi: str) -> list[str]:
    """Regex alternatives for the numbers from `lo` to `hi`, both written with the same number of digits."""
    if lo == hi:
        return [lo]
    n = len(lo) - 1
    if lo[1:] == "0" * n and hi[1:] == "9" * n:
        return [f"[{lo[0]}-{hi[0]}]" + "[0-9]" * n]
    if lo[0] == hi[0]:
        return [lo[0] + r for r in _digits(lo[1:], hi[1:])]
    middle = [f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}]" + "[0-9]" * n] if int(hi[0]) - int(lo[0]) > 1 else []
    return ([lo[0] + r for r in _digits(lo[1:], "9" * n)] + middle
            + [hi[0] + r for r in _digits("0" * n, hi[1:])])


def _naturals(lo: int, hi: int | None) -> list[str]:
    """Regex alternatives for the integers lo..hi (hi None: no end), 0 <= lo, in canonical decimal."""
    out, length = [], len(str(lo))
    while hi is None or length <= len(str(hi)):
        first, last = max(lo, 10 ** (length - 1) if length > 1 else 0), 10 ** length - 1
        if hi is None and first == 10 ** (length - 1) and length > 1:
            return out + [f"[1-9][0-9]{{{length - 1},}}"]          # every longer number
        out += _digits(str(first), str(last if hi is None else min(hi, last)))
        length += 1
    return out


def integer_regex(lo: int | None, hi: int | None) -> str:
    """A regex for the integers from `lo` to `hi` (None: unbounded on that side), as JSON writes them."""
    parts = []
    if lo is None or lo < 0:
        parts += ["-" + r for r in _naturals(1 if hi is None or hi >= 0 else -hi, None if lo is None else -lo)]
    if hi is None or hi >= 0:
        parts += _naturals(max(lo or 0, 0), hi)
    return "(" + "|".join(parts) + ")"


def _number(value: Any) -> int | float | None:
    """A finite JSON number, else None (an integer of any size is finite: math.isfinite overflows on 10**400)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if isinstance(value, int) or math.isfinite(value) else None


def _shown(n: int | float) -> str:
    """A number for a message: floats as %g, integers in full up to 20 digits."""
    if isinstance(n, float):
        return f"{n:g}"
    digits = str(abs(n))
    return str(n) if len(digits) <= 20 else f"{'-' if n < 0 else ''}{digits[:3]}… ({len(digits)} digits)"


def _depth(schema: Any, limit: int) -> None:
    """InvalidGrammar when `schema` nests objects and arrays more than `limit` deep (walked without recursion)."""
    level = [schema]                    # the containers `depth` + 1 levels down
    for depth in range(limit):
        level = [v for node in level for v in (node.values() if isinstance(node, dict) else
                                               node if isinstance(node, list) else ())
                 if isinstance(v, (dict, list))]
        if not level:
            return
    raise InvalidGrammar(f"nested more than {limit} levels deep")


def check_schema(schema: Any, max_depth: int = MAX_SCHEMA_DEPTH, max_string: int = MAX_STRING_BOUND) -> None:
    """InvalidGrammar for a schema past the bounds a compile can afford (its depth first, before anything recurses
    into it; then string length bounds, optional properties, integer bounds): cheap, so the server checks it before
    it queues a compile (serving/shaping/grammar_pool.py)."""
    _depth(schema, max_depth)
    _bounded_integers(schema, {}, max_string)


def _bounded_integers(schema: Any, ranges: dict[str, str], max_string: int = MAX_STRING_BOUND) -> Any:
    """`schema` with each integer subschema that has bounds (outlines-core ignores them) swapped for a string with
    a marker pattern; `ranges` gets each marker's regex, put in place of the marker's string after the compile.
    A string length bound past `max_string` (whatever `pattern` or `format` say: outlines-core builds the bounded
    string then, not the pattern), and an object with more than MAX_OPTIONAL_PROPERTIES optional properties, are
    refused here, before any regex or automaton is built."""
    if isinstance(schema, list):
        return [_bounded_integers(s, ranges, max_string) for s in schema]
    if not isinstance(schema, dict):
        return schema
    for key in ("maxLength", "minLength"):
        n = _number(schema.get(key))
        if n is not None and n > max_string:        # outlines-core takes the bound over a pattern or a format
            raise InvalidGrammar(f"too large: {key} {_shown(n)} (the automaton for a string of bounded length grows "
                                 f"exponentially with the bound; at most {max_string} here)")
    properties, required = schema.get("properties"), schema.get("required")
    if isinstance(properties, dict) and len(properties) > MAX_OPTIONAL_PROPERTIES:
        optional = len(set(properties) - (set(required) if isinstance(required, list) and
                                          all(isinstance(r, str) for r in required) else set()))
        if optional > MAX_OPTIONAL_PROPERTIES:
            raise InvalidGrammar(f"too large: {optional} optional properties in one object (its regex grows with "
                                 f"their square; at most {MAX_OPTIONAL_PROPERTIES})")
    low, xlow, high, xhigh = (_number(schema.get(k))
                              for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"))
    lows = ([math.ceil(low)] if low is not None else []) + ([math.floor(xlow) + 1] if xlow is not None else [])
    highs = ([math.floor(high)] if high is not None else []) + ([math.ceil(xhigh) - 1] if xhigh is not None else [])
    if schema.get("type") == "integer" and (lows or highs):
        past = next((n for n in (*lows, *highs) if abs(n) > MAX_INTEGER_BOUND), None)
        if past is not None:
            raise InvalidGrammar(f"an integer bound of {_shown(past)} is past the largest this server enforces "
                                 f"(±2**63)")
        lo, hi = max(lows, default=None), min(highs, default=None)
        if lo is not None and hi is not None and lo > hi:
            raise InvalidGrammar(f"no integer from {lo} to {hi} (minimum greater than maximum)")
        marker = f"G5GINTEGER{len(ranges)}"
        ranges[marker] = integer_regex(lo, hi)
        return {"type": "string", "pattern": marker}
    return {k: v if k in ("enum", "const", "default", "examples") else _bounded_integers(v, ranges, max_string)
            for k, v in schema.items()}


@dataclass(frozen=True)
class Grammar:
    """A compiled schema: outlines-core's index, the stop tokens that may end it, the mask width, and the index's
    size as it crossed from its compile's process (what it holds in memory, near enough)."""
    index: Any
    stop_ids: frozenset[int]
    words: int
    nbytes: int = 0


def schema_regex(schema_json: str, max_string: int = MAX_STRING_BOUND,
                 max_regex_chars: int = MAX_REGEX_CHARS) -> str:
    """The regex of JSON valid against the schema, written compactly, with exact integer ranges; InvalidGrammar
    past the regex size limit. Its cost can grow quadratically with the schema (optional properties), so it runs
    in the compile's process (build_index), never in the server's."""
    from outlines_core.json_schema import build_regex_from_schema

    ranges: dict[str, str] = {}
    schema = _bounded_integers(json.loads(schema_json), ranges, max_string)
    try:
        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
    except TypeError as e:          # nested past outlines-core's JSON parser
        raise InvalidGrammar(str(e)) from None
    for marker, integers in ranges.items():
        regex = regex.replace(f'"{marker}"', integers)
    if len(regex) > max_regex_chars:
        raise InvalidGrammar(f"too large: its regex has {len(regex)} characters, over the limit of {max_regex_chars}")
    return regex


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, grammar: Grammar):
        from outlines_core import Guide

        self._guide, self._stops = Guide(grammar.index), grammar.stop_ids
        self._mask = np.zeros(grammar.words, np.int32)
        self.done = False       # the grammar is complete and has taken its stop token

    def allowed(self) -> np.ndarray:
        """The bitmask row of the tokens allowed next (a view, rewritten by the next call)."""
        self._guide.write_mask_into(self._mask.ctypes.data, self._mask.size, self._mask.itemsize)
        if self._guide.is_finished():
            bits = self._mask.view(np.uint32)
            for s in self._stops:
                bits[s >> 5] |= np.uint32(1 << (s & 31))
        return self._mask

    def accept(self, token: int) -> None:
        if token in self._stops and self._guide.is_finished():
            self.done = True
            return
        try:
            self._guide.advance(token, return_tokens=False)
        except ValueError:
            raise RuntimeError(f"token {token} breaks the request's grammar (the runtime ignored the mask?)") from None
