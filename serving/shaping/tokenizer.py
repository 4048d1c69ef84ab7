"""The checkpoint's tokenizer as requests and the generation loop use it (TokenizerInfo): its stop and special
tokens, the prompt's token ids within a limit, the chat template, and what a conversation will render to before it
is rendered (rendered_chars)."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from serving.shaping.grammar import tokenizer_family

PROMPT_THREADS = 4                              # requests tokenising or rendering at once
# Gemma 4's markup, all of it here (see the checkpoint's tokenizer.json; serving/shaping/tool_calls.py reads the calls).
TURN_END = "<turn|>"                            # end of a dialogue turn: always a stop token
THOUGHT_START, THOUGHT_END = "<|channel>", "<channel|>"   # the thinking channel: never shown to the client
# A tool call, `<|tool_call>call:NAME{key:value,…}<tool_call|>`, its strings quoted with QUOTE.
CALL_START, CALL_END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
MARKUP = (CALL_START, CALL_END, QUOTE)      # special tokens the detokeniser must show for tool_choice "auto"
# Where a tool's answer begins: written by whoever runs the tool, never by the model (an "auto" reply stops there).
RESPONSE_START = "<|tool_response>"


class PromptTooLong(ValueError):
    def __init__(self, tokens: int, exact: bool = True):
        super().__init__(f"{'' if exact else 'at least '}{tokens} tokens")
        self.tokens, self.exact = tokens, exact


@dataclass
class TokenizerInfo:
    """The checkpoint's tokenizer plus what the generation loop needs to know about its special tokens."""
    tokenizer: object                   # the engine thread's: detokenising the output
    stop_ids: frozenset[int]
    hidden_ids: frozenset[int]          # special tokens: never detokenised for the client
    thought_start: int | None
    thought_end: int | None
    default_sampling: dict = field(default_factory=dict)
    # A second instance for requests (chat template, prompts, /tokenize), used from worker threads: a long prompt
    # never waits on, nor stalls, the detokeniser of the generation in flight. transformers' fast tokenizer
    # reconfigures its Rust backend on every encode through it ("Already borrowed" when shared), so the engine's
    # has a lock; the prompt tokenizer is only called in ways that read its backend (the Rust encode_batch, decode,
    # the template), so requests use it at once, up to PROMPT_THREADS (before: one lock, and 4 MB of one
    # request's tool-call arguments held every other request's tokenisation for 11-13 s).
    prompt_tokenizer: object = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    prompt_lock: threading.Semaphore = field(default_factory=lambda: threading.BoundedSemaphore(PROMPT_THREADS))
    max_token_chars: int = 1            # the longest token's text: n characters are at least n / this tokens
    token_texts: dict = field(default_factory=dict)     # id -> its text alone (logprobs), filled as needed
    tool_markup: frozenset[int] = frozenset()   # Gemma 4's tool-call tags: shown when tool calls are read
    tool_response: int | None = None            # RESPONSE_START's id: ends a reply that may call tools
    family: str = "sentencepiece"               # how its tokens spell bytes (shaping/grammar.py's tokenizer_family)

    @classmethod
    def load(cls, model_dir: str | Path) -> "TokenizerInfo":
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        try:
            family = tokenizer_family(tok)
        except ValueError as e:       # refused at start, not answered with output the grammar did not mean
            raise ValueError(f"{model_dir / 'tokenizer.json'}: {e}") from None
        hidden = {i for i, t in tok.added_tokens_decoder.items() if t.special} | set(tok.all_special_ids)
        vocab = tok.get_vocab()
        stop = set()
        gen: dict = {}
        gen_path = model_dir / "generation_config.json"
        if gen_path.exists():
            gen = json.loads(gen_path.read_text())
            eos = gen.get("eos_token_id")
            stop |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tok.eos_token_id is not None:
            stop.add(tok.eos_token_id)
        if TURN_END in vocab:
            stop.add(vocab[TURN_END])
        # Defaults a request doesn't set come from the checkpoint, as with vLLM's `--generation-config auto`;
        # `do_sample: false` means greedy.
        defaults = {}
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0
        for key in ("temperature", "top_p", "top_k"):
            if gen.get("do_sample") is not False and gen.get(key) is not None:
                defaults[key] = gen[key]
        return cls(tok, frozenset(stop), frozenset(hidden), vocab.get(THOUGHT_START), vocab.get(THOUGHT_END),
                   defaults, prompt_tokenizer=AutoTokenizer.from_pretrained(model_dir),
                   max_token_chars=max(map(len, vocab), default=1),
                   tool_markup=frozenset(vocab[t] for t in MARKUP if t in vocab),
                   tool_response=vocab.get(RESPONSE_START), family=family)

    @property
    def vocab_size(self) -> int:
        return len(self.prompt_tokenizer)

    def token_text(self, token: int) -> str:
        """One token's text on its own, as vLLM names tokens in logprobs (engine thread: its tokenizer)."""
        text = self.token_texts.get(token)
        if text is None:
            with self.lock:
                text = self.token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, limit: int | None = None,
                    **options) -> str:
        """The conversation as the checkpoint's chat template writes it; options: add_generation_prompt (default
        true), continue_final_message, and variables the template reads (serving/api/protocol.py's template_options).
        PromptTooLong, before rendering, when the text the template will write (rendered_chars) could not fit
        `limit` tokens: Gemma's template writes the tools again in every system turn (1000 tools x 1000 system
        turns, 147 KB sent, rendered for 23-26 s)."""
        options.setdefault("add_generation_prompt", True)
        if limit is not None and (chars := rendered_chars(messages, tools)) > self.char_bound(limit):
            raise PromptTooLong(chars // self.char_bound(1), exact=False)
        with self.prompt_lock:
            return self.prompt_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **options)

    def char_bound(self, tokens: int) -> int:
        """The most characters `tokens` tokens can hold (a normaliser may merge up to 4 characters into one)."""
        return 4 * self.max_token_chars * tokens

    def encode(self, text: str, add_special_tokens: bool = False, limit: int | None = None) -> list[int]:
        """Token ids of `text`; PromptTooLong past `limit` tokens. Text that cannot fit is refused before the
        tokenizer runs (a normaliser may merge up to 4 characters into one: the bound allows for it); otherwise
        the Rust tokenizer runs without the GIL (encode_batch) and the ids become a Python list only when they
        fit, so a huge prompt costs a worker thread, never the event loop."""
        if limit is not None and len(text) > self.char_bound(limit):
            raise PromptTooLong(len(text) // self.char_bound(1), exact=False)
        with self.prompt_lock:
            enc = self.prompt_tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and len(enc) > limit:
            raise PromptTooLong(len(enc))
        return enc.ids

    def decode(self, ids: Sequence[int]) -> str:
        with self.prompt_lock:
            return self.prompt_tokenizer.decode(list(ids), skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (/tokenize's return_token_strs, as vLLM)."""
        with self.prompt_lock:
            return self.prompt_tokenizer.convert_ids_to_tokens(list(ids))

    def chat_prompt(self, messages: list[dict], limit: int | None = None) -> list[int]:
        """Token ids of the conversation rendered with the checkpoint's own chat template."""
        return self.encode(self.render_chat(messages), limit=limit)


def _text(value: Any) -> int:
    """The characters of every string in `value` (keys too), walked without recursion."""
    total, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            todo += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            todo += v
    return total


def rendered_chars(messages: list[dict], tools: list[dict] | None) -> int:
    """The characters a chat template like Gemma's writes at least: every message's text and tool calls, the
    tools' text once, and once more for every system turn (each repeats them)."""
    tools_chars = _text(tools) if tools else 0
    return tools_chars + sum(_text(m) + (tools_chars if m.get("role") == "system" else 0) for m in messages)
