"""Which grammar library constrains JSON output: xgrammar vs outlines-core, on CPU, over a Gemma-sized vocabulary;
and the server's own path (serving/shaping/grammar.py, outlines-core) over the same vocabulary.

For `response_format` json_schema the server compiles one grammar per request and, for every generated token, asks
the request's matcher which of the vocabulary's tokens may come next (a bitmask the runtime applies to the logits
before sampling). So two figures decide:
- compile time: a typical schema (nested object, enum, array, integer, pattern) to a ready matcher, cold (no
  compile cache: a fresh compiler / index per run); the tokenizer-side tables are built once, outside the timing;
- per-token mask time: fill the bitmask and advance the matcher by one token, walking a valid instance of the
  schema one character token at a time (every step of the walk, median and p99).

The vocabulary has Gemma 4's size, 262 144 tokens, in Gemma's layout (specials, 256 <0xNN> byte-fallback tokens,
'▁' for a space), but its words are synthetic (fixed seed: letters, capitalised and '▁'-prefixed, digits,
punctuation runs): no real Gemma tokenizer is reachable from here. All see the same tokens. xgrammar is not a
dependency of the server (pip install xgrammar==0.2.9 to measure it; without it, it is left out). The server's path
also reports the cold compile of response_format json_object (its generic object schema) and a cache hit.

    python -m benchmarks.grammar_bench [--runs 5] [--json benchmarks/results/grammar_cpu.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import string
import time
from importlib.metadata import version

import numpy as np

VOCAB = 262_144
EOS = 1
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "unit", "tags", "address"],
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "unit": "celsius", "tags": ["math", "poetry"],
            "address": {"city": "London", "zip": "12345"}}


def vocabulary(seed: int = 0) -> list[str]:
    """262 144 distinct token strings in Gemma's sentencepiece spelling."""
    rng = random.Random(seed)
    toks = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + [f"<unused{i}>" for i in range(100)]
    toks += [f"<0x{b:02X}>" for b in range(256)]
    printable = [c for c in string.printable if c not in "\t\n\r\x0b\x0c "]
    toks += printable + ["▁" + c for c in printable] + ["▁"]
    seen = set(toks)
    punct = '{}[]":,.-_!?()'
    while len(toks) < VOCAB:
        kind = rng.random()
        if kind < 0.75:
            w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 10)))
            w = w.capitalize() if rng.random() < 0.2 else w
        elif kind < 0.85:
            w = "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 4)))
        else:
            w = "".join(rng.choice(punct) for _ in range(rng.randint(2, 4)))
        w = "▁" + w if rng.random() < 0.5 else w
        if w not in seen:
            seen.add(w)
            toks.append(w)
    return toks


def walk_ids(vocab: list[str], text: str) -> list[int]:
    """`text` as single-character tokens (every printable character is one, a space is '▁'), then EOS."""
    index = {t: i for i, t in enumerate(vocab)}
    return [index[c] for c in text.replace(" ", "▁")] + [EOS]


def bench_xgrammar(vocab, text, runs):
    import xgrammar as xgr

    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_FALLBACK, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiles = []
    for _ in range(runs):
        t0 = time.perf_counter()
        compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        matcher = xgr.GrammarMatcher(compiled)
        compiles.append(time.perf_counter() - t0)
    mask = np.zeros((1, (VOCAB + 31) // 32), np.int32)
    steps = []
    for tok in walk_ids(vocab, text):
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        assert mask[0, tok >> 5] >> (tok & 31) & 1, vocab[tok]
        assert matcher.accept_token(tok)
        steps.append(time.perf_counter() - t0)
    assert matcher.is_terminated()
    return compiles, steps


def bench_outlines(vocab, text, runs):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def decoded(t: str) -> bytes:
        if t.startswith("<0x") and len(t) == 6:
            return bytes([int(t[3:5], 16)])
        return t.replace("▁", " ").encode()

    tokens: dict = {}
    for i, t in enumerate(vocab):
        if i != EOS and not (t.startswith("<") and t.endswith(">") and len(t) > 1 and not t.startswith("<0x")):
            tokens.setdefault(decoded(t), []).append(i)
    vocabulary = Vocabulary(EOS, tokens)           # once, as the server would
    compiles = []
    for _ in range(runs):
        t0 = time.perf_counter()
        guide = Guide(Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary))
        compiles.append(time.perf_counter() - t0)
    mask = np.zeros((VOCAB + 31) // 32, np.int32)
    steps = []
    for tok in walk_ids(vocab, text):
        t0 = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        assert mask[tok >> 5] >> (tok & 31) & 1, vocab[tok]
        if tok != EOS:
            guide.advance(tok, return_tokens=False)
        steps.append(time.perf_counter() - t0)
    assert guide.is_finished()
    return compiles, steps


def bench_serving(vocab, text, runs):
    """serving.shaping.grammar as the server runs it: Grammars without a cache (every compile cold) and with one, and a
    Matcher walking the instance."""
    import threading
    from types import SimpleNamespace

    from serving.shaping.grammar import Matcher
    from serving.shaping.grammar_pool import Grammars

    class Tokenizer:      # the synthetic vocabulary behind the one method serving.shaping.grammar.token_bytes calls
        def get_vocab(self):
            return {t: i for i, t in enumerate(vocab)}

    specials = frozenset(i for i, t in enumerate(vocab) if t.startswith("<") and t.endswith(">") and len(t) > 1
                         and not t.startswith("<0x"))
    info = SimpleNamespace(prompt_tokenizer=Tokenizer(), prompt_lock=threading.Lock(), hidden_ids=specials,
                           stop_ids=frozenset([EOS]))
    cold, cached = Grammars(info, VOCAB, cache_bytes=0), Grammars(info, VOCAB)
    for grammars in (cold, cached):
        grammars.json_schema({"type": "integer"})         # builds the vocabulary, once per server
    compiles, hits = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        cold.json_schema(SCHEMA)
        compiles.append(time.perf_counter() - t0)
    grammar = cached.json_schema(SCHEMA)
    for _ in range(runs):
        t0 = time.perf_counter()
        cached.json_schema(SCHEMA)
        hits.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    cold.json_object()
    object_compile = time.perf_counter() - t0
    matcher, steps = Matcher(grammar), []
    for tok in walk_ids(vocab, text):
        t0 = time.perf_counter()
        mask = matcher.allowed()
        assert mask[tok >> 5] >> (tok & 31) & 1, vocab[tok]
        matcher.accept(tok)
        steps.append(time.perf_counter() - t0)
    assert matcher.done
    return compiles, steps, {"json_object_compile_s": round(object_compile, 4),
                             "cache_hit_ms_median": round(statistics.median(hits) * 1e3, 4)}


def summary(compiles, steps, extra=None) -> dict:
    ms = sorted(s * 1e3 for s in steps)
    return {"compile_s_median": round(statistics.median(compiles), 4),
            "compile_s_runs": [round(c, 4) for c in compiles],
            "mask_ms_median": round(statistics.median(ms), 4), "mask_ms_p99": round(ms[int(0.99 * (len(ms) - 1))], 4),
            "mask_ms_max": round(ms[-1], 4), "steps": len(ms), **(extra or {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    vocab = vocabulary()
    text = json.dumps(INSTANCE, separators=(",", ":"))
    out = {"vocab_size": VOCAB, "vocabulary": "synthetic, Gemma layout (see benchmarks/grammar_bench.py)",
           "schema": SCHEMA, "instance": text, "runs": args.runs, "machine": platform.machine(),
           "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
           "outlines_core": {"version": version("outlines_core"), **summary(*bench_outlines(vocab, text, args.runs))},
           "serving_structured": {"version": version("outlines_core"),
                                  **summary(*bench_serving(vocab, text, args.runs))}}
    if importlib.util.find_spec("xgrammar"):
        out["xgrammar"] = {"version": version("xgrammar"), **summary(*bench_xgrammar(vocab, text, args.runs))}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
