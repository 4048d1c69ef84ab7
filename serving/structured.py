"""Structured output: a grammar per request, enforced where the next token is chosen.

`response_format` (json_object, json_schema) and forced tool calls compile to an xgrammar grammar, once per request,
in a worker thread (an invalid schema is the client's 400). The generation loop (serving/generation.py) gives each
such request a `Matcher`: before every sampling step it writes the tokens the grammar allows next as a bitmask
(bit i % 32 of int32 word i // 32 is token i, the layout xgrammar and the runtimes share) and after every generated
token it advances. The runtime sets every other token's logit to MASKED before it samples (serving/engine.py).
xgrammar was chosen over outlines-core by measurement (benchmarks/grammar_bench.py, README).
"""
from __future__ import annotations

import json
import re
import threading
from typing import Any

import numpy as np

MASKED = -1e30      # the logit a disallowed token gets: finite, so a row that allows nothing never makes NaNs


def mask_words(vocab_size: int) -> int:
    """int32 words in one row of the bitmask."""
    return (vocab_size + 31) // 32


class InvalidGrammar(ValueError):
    """The request's schema cannot be compiled: a 400 for the client."""


class Grammars:
    """Compiles grammars over a checkpoint's tokenizer (serving.generation.TokenizerInfo), for a runtime whose logits
    are `vocab_size` wide. The tokenizer tables are built on first use, not at boot."""

    def __init__(self, info, vocab_size: int):
        self.info, self.vocab_size = info, vocab_size
        self._compiler = None
        self._lock = threading.Lock()

    def _get(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                with self.info.prompt_lock:
                    tables = xgr.TokenizerInfo.from_huggingface(self.info.prompt_tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=sorted(self.info.stop_ids))
                self._compiler = xgr.GrammarCompiler(tables, max_threads=1)
            return self._compiler

    def json_schema(self, schema: Any) -> Any:
        """A compiled grammar for JSON valid against `schema`, written compactly (no free whitespace: a weak
        model cannot stall in it)."""
        try:
            return self._get().compile_json_schema(json.dumps(schema), any_whitespace=False)
        except RuntimeError as e:      # xgrammar's message starts with "[time] file.cc:line: "
            raise InvalidGrammar(re.sub(r"^\[[^]]*\] \S+: ", "", str(e)).strip()) from None

    def json_object(self) -> Any:
        """Any JSON object (response_format json_object)."""
        return self._get().compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, grammar):
        import xgrammar as xgr
        self._matcher = xgr.GrammarMatcher(grammar)
        self._mask = np.empty((1, mask_words(grammar.tokenizer_info.vocab_size)), np.int32)

    def allowed(self) -> np.ndarray:
        """The bitmask row of the tokens allowed next (a view, rewritten by the next call)."""
        self._matcher.fill_next_token_bitmask(self._mask)
        return self._mask[0]

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} breaks the request's grammar (the runtime ignored the mask?)")

    @property
    def done(self) -> bool:
        """The grammar is complete and has taken its stop token."""
        return self._matcher.is_terminated()
