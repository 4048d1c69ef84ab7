"""Compiling a request's schema (serving/shaping/grammar.py) where it can take nothing from other clients.

- **Its own workers**: at most `workers` compiles run at once (`--grammar-compiles`), each in a child process whose
  address space is capped at `memory / (workers + 1)` (`--grammar-memory` bounds all of them and the quick slot's
  together), killed at its deadline or once every request waiting for it left. The deadline runs from the start of
  its compile, never from its wait for a worker: a schema is never refused for time it spent queueing.
- **A quick slot**, so that a small schema never waits behind slow ones (one client's slow schemas held every other
  client's for 12-29 s): a compile that finds every worker busy runs in the quick slot first, for at most `quick_s`
  (QUICK_S); one still running then is stopped and waits for a worker, where it starts again with its whole
  deadline. Most schemas compile well within it, so a small one waits at most QUICK_S for each new compile ahead
  of it, never for a slow compile to end (a slow one, whoever sent it, pays one quick try). No per-client share:
  behind a proxy every client is the same peer.
- **Admission**: at most `workers + queued` distinct compiles are in flight (running, or waiting for a worker).
  Past that (one client's slow schemas filled it, and every other client's schema was refused), up to `queued`
  more are admitted for the quick slot alone, ahead of those in flight: one that does not compile within its
  quick try, like one more past those, is GrammarBusy, the client's 429, never cached: the same schema compiles
  when sent again. **The smallest job first** (a schema's compact JSON length: the size of what it asks for): the
  quick slot goes to the shortest of those admitted for it alone, and with every place taken, a schema shorter
  than the longest of them still waiting takes its place (that one is GrammarBusy). One client's flood of slow
  schemas fills every place within milliseconds, so first come alone refused every other client's small schema
  that came next (the pressure run's round 6, benchmarks/RESULTS.md).
- **Waiting holds no thread**: the API awaits a compile's future (serving/api/completions.py); `json_schema` waits in
  the caller's thread, for tests and tools.
- **Memory**: compiled grammars are cached per schema, within `cache_bytes` (`--grammar-cache-bytes`, each index
  counted by the memory it holds once loaded), least recently used out first; freed memory goes back to the system.
  The same budget bounds every compiled grammar the server holds, cached or in a request's hands: while those in use
  fill it, a new compile is GrammarBusy. A refusal that comes from the schema itself (too large, a compile past its
  time limit) is cached like a grammar; one that comes from the server's load never is.
- **A compile that dies is the server's failure**: one killed from outside (SIGKILL from the OOM killer, SIGTERM),
  stopped (SIGSTOP) or starved of CPU past its deadline (less than STARVED of it spent computing), or one whose
  input found no room, is CompileFailed: the client's 503, to retry, and nothing is cached.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.engine import mask_words
from serving.shaping.grammar import (ANY_OBJECT, MAX_REGEX_CHARS, MAX_SCHEMA_DEPTH, MAX_STRING_BOUND, Grammar,
                                InvalidGrammar, check_schema, token_bytes)
from serving.shaping.heap import give_back_memory

COMPILE_TIMEOUT_S = float(os.environ.get("G5G_GRAMMAR_TIMEOUT_S", "30"))     # from the start of a compile
COMPILES = 2                # compiles at once (--grammar-compiles); twice as many more may wait for a worker
# All compile processes together (--grammar-memory): 1 GiB each of two workers and the quick slot. Measured on a
# 262 144-token vocabulary (benchmarks/grammar_bench.py's): json_object peaks at 235 MiB, an object of 60 required
# strings at 605 MiB.
COMPILE_MEMORY = 3 * 2**30
# How long a compile may run in the quick slot before it waits for a worker instead: a typical schema takes 0.64 s
# over Gemma's 262 144-token vocabulary (docs/serving.md), 0.3-0.5 s over the tiny checkpoint's (its process's start).
QUICK_S = float(os.environ.get("G5G_GRAMMAR_QUICK_S", "1"))
CACHE_BYTES = 384 * 2**20   # compiled grammars held, cached or in use (--grammar-cache-bytes)
# An index takes this many times its pickled size once loaded (an object of 60 required strings over a 262 144-token
# vocabulary: pickled 123 MiB, 288 MiB of RSS held): what a grammar counts against CACHE_BYTES.
LOADED_PER_PICKLED = 2.4
POLL_S = 0.25               # how often a waiter or a compile looks whether to stop
# A compile at its deadline that spent less than this share of it on the CPU was starved (a loaded server) or
# stopped: not the schema's doing, so no verdict on it.
STARVED = 0.25
# How a compile's process ends when something outside kills it (the OOM killer's SIGKILL, a stop of the server),
# rather than the schema (past its memory share: a MemoryError, or an abort from the index's allocator).
OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


class GrammarBusy(Exception):
    """Every compile worker and waiting place is taken, or compiled grammars in use fill the budget: the
    client's 429 (retry later), never cached."""


class CompileFailed(Exception):
    """The compile ended with no verdict on the schema, for a cause of the server's: its process killed, stopped or
    starved from outside, or no room for its input. The client's 503 (retry), never cached."""


class _Slow(Exception):
    """A compile ran past the quick slot's time: it goes on to wait for a worker."""


class _Stopped(InvalidGrammar):
    """Every request waiting for the compile left: nobody gets this, and nothing is cached."""

    def __init__(self):
        super().__init__("its requesters left")


@dataclass
class _Compile:
    """One schema's compile: its result, how many requests wait on it, the switch that stops it (set when the last
    of them left before it finished), when it got a worker (its deadline runs from there), its index's size."""
    future: Future = field(default_factory=Future)
    waiting: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    started: float | None = None
    nbytes: int = 0
    quick_only: bool = False        # admitted past the workers' places: the quick slot or nothing
    size: int = 0                   # its schema's compact JSON length: the job's size, for the smallest first
    bumped: bool = False            # a shorter schema took its place in the quick slot's queue


class Grammars:
    """Compiles grammars over a checkpoint's tokenizer (serving.shaping.tokenizer.TokenizerInfo), for a runtime whose
    logits are `vocab_size` wide. The vocabulary is built on first use, not at boot. Compiled grammars are cached by the
    schema's compact JSON (key order kept: it is the output's key order); one instance serves one tokenizer."""

    def __init__(self, info, vocab_size: int, timeout_s: float = COMPILE_TIMEOUT_S,
                 max_regex_chars: int = MAX_REGEX_CHARS, cache_bytes: int = CACHE_BYTES,
                 max_string: int = MAX_STRING_BOUND, workers: int = COMPILES, queued: int | None = None,
                 memory: int = COMPILE_MEMORY, quick_s: float = QUICK_S):
        self.info, self.vocab_size = info, vocab_size
        self.timeout_s, self.max_regex_chars, self.cache_bytes = timeout_s, max_regex_chars, cache_bytes
        self.max_string, self.workers, self.quick_s = max_string, workers, quick_s    # quick_s 0: no quick slot
        self.queued = 2 * workers if queued is None else queued
        self.child_memory = memory // (workers + (quick_s > 0))     # 0: no cap
        self._vocabulary = None
        # re-entrant: dropping a cached grammar may run its finalizer (_released) under the lock
        self._lock, self._vocab_lock = threading.RLock(), threading.Lock()
        self._cache: OrderedDict[str, _Compile] = OrderedDict()
        self._slots = threading.Condition(threading.Lock())
        self._free = {"worker": workers, "quick": int(quick_s > 0)}
        self.in_flight = 0          # compiles running or waiting for a worker
        self.quick_only = 0         # compiles admitted past those, for the quick slot alone
        self._quick_queue: list[_Compile] = []  # of those, waiting for it (they take it before any other)
        self.cached_bytes = 0       # the finished grammars in the cache
        self.live_bytes = 0         # every compiled grammar still held (cached, or a request's)

    # ------------------------------------------------------------------------------------------ requests
    def enter(self, schema: Any) -> tuple[str, _Compile]:
        """The compile of `schema`, cached or started, counted as waited for (`leave` when done with it).
        InvalidGrammar for a schema past the bounds (checked here, cheaply, before anything is queued), GrammarBusy
        when a new compile cannot be admitted."""
        check_schema(schema, MAX_SCHEMA_DEPTH, self.max_string)     # what it refuses, refused before queueing a compile
        key = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            entry = self._cache.pop(key, None)
            if entry is None:
                self._evict(lambda: self.live_bytes > self.cache_bytes)
                full = self.in_flight >= self.workers + self.queued
                if full and (not self.quick_s or self.quick_only >= self.queued and not self._bump(len(key))):
                    limit = f"at most {self.workers + self.queued}" + (
                        f", and {self.queued} more for the quick slot" if self.quick_s else "")
                    raise GrammarBusy(f"{self.in_flight + self.quick_only} schemas are compiling or waiting to "
                                      f"({limit})")
                if self.live_bytes > self.cache_bytes:
                    raise GrammarBusy(f"compiled schemas in use hold {self.live_bytes >> 20} MiB (at most "
                                      f"{self.cache_bytes >> 20} MiB, --grammar-cache-bytes)")
                entry = self._start(key, quick_only=full)
            self._cache[key] = entry                    # the most recently used last
            entry.waiting += 1
        return key, entry

    def leave(self, key: str, entry: _Compile, gone: bool) -> None:
        """A request is done waiting for `entry`; `gone`: its client left. A compile nobody waits for any more is
        stopped and forgotten."""
        with self._lock:
            entry.waiting -= 1
            if gone and not entry.waiting and not entry.future.done():
                entry.stop.set()
                self._forget(key, entry)

    def json_schema(self, schema: Any, gone: threading.Event | None = None) -> Grammar:
        """A compiled grammar for JSON valid against `schema`, written compactly (no free whitespace: a weak
        model cannot stall in it), waited for in this thread. InvalidGrammar with the reason, or GrammarBusy.
        `gone`: set when the requester left."""
        key, entry = self.enter(schema)
        try:
            while True:
                try:
                    return entry.future.result(timeout=POLL_S)
                except TimeoutError:
                    if gone is not None and gone.is_set():
                        raise InvalidGrammar("its requester left") from None
        finally:
            self.leave(key, entry, gone is not None and gone.is_set())

    def json_object(self, gone: threading.Event | None = None) -> Grammar:
        """Any JSON object (response_format json_object), nested at most two deep (ANY_OBJECT): a compile like
        any other, inside the same limits."""
        return self.json_schema(ANY_OBJECT, gone)

    # ---------------------------------------------------------------------------------------- the cache
    def _forget(self, key: str, entry: _Compile) -> None:
        if self._cache.get(key) is entry:
            del self._cache[key]
            self.cached_bytes -= entry.nbytes

    def _evict(self, over: Any) -> None:
        """Drop finished entries, least recently used first, while `over()` (under self._lock)."""
        for key, entry in list(self._cache.items()):
            if not over():
                return
            if entry.future.done():
                self._forget(key, entry)

    def _finished(self, key: str, entry: _Compile) -> None:
        """A compile ended: account for its index, or forget an outcome that says nothing of the schema."""
        with self._lock:
            if entry.quick_only:
                self.quick_only -= 1
            else:
                self.in_flight -= 1
            error = entry.future.exception()
            if error is not None and (not isinstance(error, InvalidGrammar) or isinstance(error, _Stopped)):
                self._forget(key, entry)
            elif self._cache.get(key) is entry:
                entry.nbytes = 0 if error is not None else entry.future.result().nbytes
                self.cached_bytes += entry.nbytes
                self._evict(lambda: self.cached_bytes > self.cache_bytes)
        # what the compile's result crossed in (its pickle) is freed by now (glibc kept it otherwise: 864 MiB of
        # RSS stayed after three dropped indexes)
        give_back_memory()

    def _held(self, grammar: Grammar) -> Grammar:
        """Count `grammar` in live_bytes for as long as anything holds it."""
        with self._lock:
            self.live_bytes += grammar.nbytes
        weakref.finalize(grammar, self._released, grammar.nbytes)
        return grammar

    def _released(self, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes
        give_back_memory()


    # -------------------------------------------------------------------------------------- the compile
    def _start(self, key: str, quick_only: bool = False) -> _Compile:
        """Compile in a daemon thread of its own (a compile still running at exit must not hold the server), which
        waits for a worker first (`quick_only`: for the quick slot, and only there); at most workers + 2 * queued
        such threads (enter's admission)."""
        entry = _Compile(quick_only=quick_only, size=len(key))
        entry.future.set_running_or_notify_cancel()     # no waiter can cancel it (asyncio.wrap_future would try)
        if quick_only:
            self.quick_only += 1
        else:
            self.in_flight += 1

        def run():
            try:
                slot, grammar = self._slot(entry, ("quick",) if quick_only else ("worker", "quick")), None
                if slot == "quick":
                    try:
                        grammar = self._compile(key, time.monotonic() + min(self.quick_s, self.timeout_s),
                                                entry.stop, quick=True)
                    except _Slow:
                        if quick_only:
                            raise GrammarBusy(f"every compile worker and waiting place is taken, and it did not "
                                              f"compile within the quick slot's {self.quick_s:g} s") from None
                    finally:
                        self._give_back(slot)
                    if grammar is None:
                        slot = self._slot(entry, ("worker",))
                if grammar is None:
                    try:
                        entry.started = time.monotonic()
                        grammar = self._compile(key, entry.started + self.timeout_s, entry.stop)
                    finally:
                        self._give_back(slot)
                entry.future.set_result(self._held(grammar))
            except BaseException as e:      # handed to whoever waits on it
                if not isinstance(e, InvalidGrammar) or isinstance(e, _Stopped):
                    with self._lock:        # no verdict on the schema: out of the cache before anyone sees it
                        self._forget(key, entry)
                entry.future.set_exception(e)
            self._finished(key, entry)

        threading.Thread(target=run, name="grammar", daemon=True).start()
        return entry

    def _slot(self, entry: _Compile, kinds: tuple[str, ...]) -> str:
        """Wait for the first free slot of `kinds` (a worker first), and take it; _Stopped once every requester
        left; GrammarBusy once a shorter schema took its place (_bump)."""
        with self._slots:
            if entry.quick_only:
                self._quick_queue.append(entry)
            try:
                while True:
                    if entry.stop.is_set():
                        raise _Stopped
                    if entry.bumped:
                        raise GrammarBusy("every compile worker and waiting place is taken, and a shorter schema "
                                          "took its place for the quick slot")
                    for kind in kinds:
                        if self._free[kind] and self._may_take(entry, kind):
                            self._free[kind] -= 1
                            return kind
                    self._slots.wait(POLL_S)
            finally:
                if entry.quick_only:
                    self._quick_queue.remove(entry)

    def _may_take(self, entry: _Compile, kind: str) -> bool:
        """The quick slot goes to the shortest schema waiting for it alone, before any other (under _slots)."""
        return kind != "quick" or not self._quick_queue or entry is min(self._quick_queue, key=lambda e: e.size)

    def _bump(self, size: int) -> bool:
        """Every place taken: the longest schema still waiting for the quick slot alone, if longer than `size`,
        gives its place up (its requests get GrammarBusy, never cached). Whether one did."""
        with self._slots:
            longest = max((e for e in self._quick_queue if not e.bumped), key=lambda e: e.size, default=None)
            if longest is None or longest.size <= size:
                return False
            longest.bumped = True
            self._slots.notify_all()
            return True

    def _give_back(self, slot: str) -> None:
        with self._slots:
            self._free[slot] += 1
            self._slots.notify_all()

    def _compile(self, schema_json: str, deadline: float, stop: threading.Event, quick: bool = False) -> Grammar:
        """The grammar, or its reason (InvalidGrammar); in the quick slot (`quick`), _Slow at the deadline."""
        if stop.is_set():                               # every requester left while it queued
            raise _Stopped
        try:
            index, nbytes = build_index(schema_json, self._vocab(), deadline, stop, max_string=self.max_string,
                                        max_regex_chars=self.max_regex_chars, memory=self.child_memory,
                                        quick=quick)
        except ValueError as e:
            # outlines-core's reason is its first line; the rest is advice to file bugs
            raise InvalidGrammar(str(e).strip().split("\n")[0].strip()) from None
        except TimeoutError:
            if stop.is_set():
                raise _Stopped from None
            if quick:
                raise _Slow from None
            raise InvalidGrammar(f"compiling it takes longer than {self.timeout_s:g} s") from None
        return Grammar(index, self.info.stop_ids, mask_words(self.vocab_size), nbytes)

    def _vocab(self):
        from outlines_core import Vocabulary

        with self._vocab_lock:
            if self._vocabulary is None:
                with self.info.prompt_lock:
                    tokens = token_bytes(self.info.prompt_tokenizer, self.info.hidden_ids | self.info.stop_ids,
                                         self.info.family)
                # outlines-core knows one end token; Matcher lets any of the checkpoint's stop tokens end.
                self._vocabulary = Vocabulary(min(self.info.stop_ids), tokens)
            return self._vocabulary


# The compile, as a program of its own: (schema JSON, bounds, outlines-core Vocabulary) pickled in, (ok, Index or
# reason) out. On Linux it dies with the thread that started it (the server's), so no server exit leaves it
# running; its address space is capped, and whatever it allocated goes back when it exits.
_INDEX_PROGRAM = """
import ctypes, os, pickle, resource, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):                # the server went before that took effect
    sys.exit(1)
sys.path.insert(0, sys.argv[2])
memory = int(sys.argv[3])
if memory:
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
from outlines_core import Index
from serving.shaping.grammar import schema_regex
schema_json, max_string, max_regex_chars, vocabulary = pickle.load(sys.stdin.buffer)
try:
    out = (True, Index(schema_regex(schema_json, max_string, max_regex_chars), vocabulary))
except (ValueError, TypeError, RecursionError, MemoryError) as e:
    out = (False, str(e) or type(e).__name__)
pickle.dump(out, sys.stdout.buffer)
"""
_ROOT = str(Path(__file__).resolve().parents[2])       # where `serving` is imported from (serving/shaping/ is 2 down)


def build_index(schema_json: str, vocabulary, deadline: float, stop: threading.Event | None = None,
                max_string: int = MAX_STRING_BOUND, max_regex_chars: int = MAX_REGEX_CHARS,
                memory: int = COMPILE_MEMORY // (COMPILES + 1), quick: bool = False) -> tuple[Any, int]:
    """outlines-core's Index of the schema's regex (grammar.schema_regex) over `vocabulary`, and the memory it
    holds once loaded (LOADED_PER_PICKLED times its size as it crossed), built in a child process (the server's
    threads, memory and devices stay out of it) that is killed at `deadline` or once `stop` is set (TimeoutError).
    Its reason (ValueError) if it cannot. `quick`: a try in the quick slot, whose timeout says nothing of the server
    (its CPU time is not looked at)."""
    try:
        with _payload() as payload:     # a file, not a pipe: no write to resume after a timeout
            pickle.dump((schema_json, max_string, max_regex_chars, vocabulary), payload)
            payload.seek(0)
            proc = subprocess.Popen([sys.executable, "-c", _INDEX_PROGRAM, str(os.getpid()), _ROOT, str(memory)],
                                    stdin=payload, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:            # no room for its input (a full TMPDIR), no process to be had
        raise CompileFailed(f"the compile could not start: {e}") from None
    started = time.monotonic()
    try:
        while True:
            try:        # a retry goes on reading where the last call stopped
                out, err = proc.communicate(None, min(POLL_S, max(0.0, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if stop is not None and stop.is_set():
                    raise TimeoutError from None
                if time.monotonic() >= deadline:
                    if not quick:
                        _starved(proc.pid, deadline - started)
                    raise TimeoutError from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if -proc.returncode in OUTSIDE_SIGNALS:
        raise CompileFailed(f"the compile's process was killed ({signal.Signals(-proc.returncode).name})")
    if proc.returncode:             # e.g. past its memory
        last = (err.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise ValueError(f"the compile stopped (exit code {proc.returncode}: {last})")
    ok, index = pickle.loads(out)
    if not ok:
        raise ValueError(index)
    return index, int(len(out) * LOADED_PER_PICKLED)


def _payload():
    """Where the compile's input waits for it: memory of its own where Linux gives it (no TMPDIR to fill), else a
    temporary file."""
    if hasattr(os, "memfd_create"):
        return open(os.memfd_create("grammar-compile"), "w+b")
    return tempfile.TemporaryFile()


def _starved(pid: int, budget: float) -> None:
    """CompileFailed if the process at its deadline is stopped, or spent less than STARVED of `budget` seconds on
    the CPU (Linux's /proc; elsewhere every timeout is the schema's)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return
    state, cpu = fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    if state in ("T", "t"):
        raise CompileFailed("the compile's process was stopped")
    if cpu < STARVED * budget:
        raise CompileFailed(f"the compile was starved: {cpu:.1f} s on the CPU in {budget:g} s")
