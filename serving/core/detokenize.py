"""Text out of generated tokens, shared by every runtime: the detokenizer (token ids -> text deltas, never half a
UTF-8 character, no special tokens or thought blocks) and the stop strings (text held back while it may start one,
cut at the first to complete). The generation loop (serving/core/generation.py) runs one of each per request.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from serving.shaping.tokenizer import TokenizerInfo


class Detokenizer:
    """Turns generated token ids into text deltas: never splits a UTF-8 character across deltas, never shows
    special tokens (except those in `reveal`) or what the model writes inside a thought block."""

    def __init__(self, info: TokenizerInfo, reveal: frozenset[int] = frozenset()):
        self.info, self.reveal = info, reveal
        self.ids: list[int] = []       # visible ids so far
        self.prefix = 0                # ids[prefix:read] is already-emitted context used to decode the next delta
        self.read = 0
        self.in_thought = False

    def _decode(self, ids: Sequence[int]) -> str:
        with self.info.lock:
            return self.info.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        if token_id == self.info.thought_start:
            self.in_thought = True
            return ""
        if token_id == self.info.thought_end:
            self.in_thought = False
            return ""
        if self.in_thought or (token_id in self.info.hidden_ids and token_id not in self.reveal):
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the bytes that complete it.
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """What is still held back when generation ends (an incomplete character stays U+FFFD)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


class StopAutomaton:
    """An Aho-Corasick automaton over a request's stop strings: built once, in time linear in their length (bounded
    by the API: serving/api/protocol.py's MAX_STOP, MAX_STOP_CHARS; the API builds it off the engine thread, Job.stops),
    it then costs O(1) amortised per generated character, however many stops there are and however long they and
    the output are. Read-only: the n choices of a request share one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in dict.fromkeys(stops) if s)
        # The trie of the stops: node 0 the root, goto[n] its edges, depth[n] the length of the text it stands for,
        # ends[n] the length of the longest stop that text ends with (0: none), fail[n] the node of its longest
        # proper suffix that is in the trie.
        self.goto: list[dict[str, int]] = [{}]
        self.depth, self.ends = [0], [0]
        for stop in self.stops:
            n = 0
            for ch in stop:
                if ch not in self.goto[n]:
                    self.goto[n][ch] = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[n] + 1)
                    self.ends.append(0)
                n = self.goto[n][ch]
            self.ends[n] = len(stop)
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())   # breadth first: a node's suffix is done before it
        while queue:
            n = queue.popleft()
            for ch, child in self.goto[n].items():
                f = self.fail[n]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[child] = self.goto[f].get(ch, 0)
                self.ends[child] = self.ends[child] or self.ends[self.fail[child]]
                queue.append(child)


class StopStrings:
    """Holds back text that might be the start of a stop string; cuts the text at the first stop string to
    complete (the longest, if several complete at one character). `stops`: the strings, or their StopAutomaton."""

    def __init__(self, stops: Sequence[str] | StopAutomaton, include: bool = False):
        self.include = include                  # the text ends with the stop string (vLLM's include_stop_str_in_output)
        self.auto = stops if isinstance(stops, StopAutomaton) else StopAutomaton(stops)
        self.stops = self.auto.stops
        self.node = 0                           # where the text so far ends in the trie
        self.pending = ""                       # unsent text: the longest possible start of a stop string

    def push(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to send, whether a stop string was hit)."""
        if not self.stops:
            return delta, False
        text, base = self.pending + delta, len(self.pending)
        goto, fail, ends, n = self.auto.goto, self.auto.fail, self.auto.ends, self.node
        for i, ch in enumerate(delta):
            while n and ch not in goto[n]:
                n = fail[n]
            n = goto[n].get(ch, 0)
            if ends[n]:
                end = base + i + 1
                self.pending, self.node = "", 0
                return text[:end if self.include else end - ends[n]], True
        self.node, keep = n, self.auto.depth[n]
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
