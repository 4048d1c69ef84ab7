"""Freed heap handed back to the system (serving/shaping/heap.py): glibc's malloc_trim gives back what free() keeps,
G5G_GIVE_BACK_MEMORY=0 turns it off, a trim follows a large request at most once a gap, and the server trims at
boot and after a large request (its g5g:heap_trims counter)."""
from __future__ import annotations

import ctypes

import pytest
import requests

from serving.api.app import create_app
from serving.shaping import heap
from devtools.server import in_thread, wait_ready
from devtools.tiny_gemma4 import QUESTION
from tests.fixtures.observe import metrics, wait_until

MIB = 2 ** 20
CHUNK = 64 * 1024       # below glibc's mmap threshold (128 KiB at least): from the heap, kept there when freed
CHUNKS = 1536           # 96 MiB


@pytest.fixture
def freed_heap():
    """96 MiB malloc'd in 64 KiB chunks, written, then each shrunk to 64 bytes in place (glibc's realloc splits the
    chunk and frees its tail): every freed tail lies between two live heads, so free() can neither merge it into the
    heap's top nor give it back itself (freed whole, the chunks merged and went back now and then)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        pytest.skip("no glibc here")
    libc.malloc.restype = libc.realloc.restype = ctypes.c_void_p
    libc.malloc.argtypes, libc.realloc.argtypes = [ctypes.c_size_t], [ctypes.c_void_p, ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(CHUNK) for _ in range(CHUNKS)]
    for c in chunks:
        ctypes.memset(c, 1, CHUNK)
    heads = [libc.realloc(c, 64) for c in chunks]
    assert heads == chunks, "realloc moved a chunk it shrank"
    yield
    for h in heads:
        libc.free(h)


def test_a_trim_gives_back_what_free_kept(freed_heap, monkeypatch):
    kept = heap.rss()
    monkeypatch.setenv(heap.ENV, "0")
    assert heap.give_back_memory() == 0 and heap.rss() > kept - 16 * MIB         # off: the pages stay resident
    monkeypatch.setenv(heap.ENV, "1")
    released = heap.give_back_memory()
    assert released > 64 * MIB and heap.rss() < kept - 64 * MIB


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_large_request_is_trimmed_after_at_most_once_a_gap(monkeypatch):
    monkeypatch.delenv(heap.ENV, raising=False)
    clock, counted = Clock(), []
    trimmer = heap.Trimmer(counted.append, large=MIB, gap_s=1.0, clock=clock, trim=lambda: 7)
    assert not trimmer.due(MIB - 1)                 # small: never
    assert trimmer.due(MIB)
    clock.now = 0.5
    assert not trimmer.due(3 * MIB)                 # within the gap: held back...
    clock.now = 0.9
    assert not trimmer.due(10)
    clock.now = 1.0
    assert trimmer.due(10)                          # ...and done after the first request past it
    clock.now = 5.0
    assert not trimmer.due(10)                      # nothing pending
    assert trimmer.run() == 7 and counted == [7]


def test_the_switch_turns_the_trimmer_off(monkeypatch):
    monkeypatch.setenv(heap.ENV, "0")
    trimmer = heap.Trimmer(trim=lambda: pytest.fail("trimmed while off"))
    assert not trimmer.due(100 * MIB)


@pytest.fixture(scope="module")
def engine(tiny_gemma4):
    from serving.torch_runtime import load
    return load(tiny_gemma4)


def trims(url: str) -> float:
    return metrics(url).get("g5g:heap_trims_total", 0)


@pytest.mark.parametrize("on", [True, False])
def test_the_server_trims_at_boot_and_after_a_large_request(tiny_gemma4, engine, monkeypatch, on):
    """Boot, then a 1 MiB message (a 400: longer than the context) is followed by a trim, a small chat is not;
    with G5G_GIVE_BACK_MEMORY=0 none ever is."""
    monkeypatch.setenv(heap.ENV, "1" if on else "0")
    with in_thread(create_app(lambda: engine, tiny_gemma4)) as url:
        assert wait_ready(f"{url}/health", timeout=120) is not None
        assert trims(url) == on
        large = {"messages": [{"role": "user", "content": "word " * 220_000}], "max_tokens": 1}
        assert requests.post(f"{url}/v1/chat/completions", json=large, timeout=60).status_code == 400
        if on:      # the trim runs once the answer is out, or (within a second of boot's) after the next request
            wait_until(lambda: trims(url) == 2, timeout=30, what="a trim after the large request")
        small = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2}
        assert requests.post(f"{url}/v1/chat/completions", json=small, timeout=60).status_code == 200
        assert trims(url) == 2 * on
