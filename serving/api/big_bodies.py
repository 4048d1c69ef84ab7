"""Request bodies of BIG_BODY bytes or more, parsed in a process of their own.

A body is parsed and validated in a worker thread, in small steps that hand the GIL back (protocol.py). That keeps
the event loop answering, but not a thread that needs the GIL back after every operation: the PyTorch runtime's
eager CPU step releases it around each of its hundreds of ops and waits for it after each, so another client's
4-token chat took 0.7-1.3 s while two 14 MiB lists of token ids were parsed beside it (issue 53). Parsed in a
process of its own, a big body takes none of the server's GIL; what comes back is the request (pickled) or the
client's error. One process, started at the first big body: big bodies wait for each other, no one else waits for
them. A process that dies (the OOM killer) fails its body with BodyParserStopped, and the next body gets a new one.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

BIG_BODY = 1 << 20      # bytes


class BodyParserStopped(RuntimeError):
    """The parsing process died under this body (nothing of it is known: the caller answers a retryable 503)."""


def _quiet() -> None:
    # Ctrl-C reaches the whole process group: the server drains, the parser is ended by it, without a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Parser:
    def __init__(self):
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:      # spawned: forking a process with the runtime's threads is not safe
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_quiet)
            return self._pool

    async def run(self, fn: Callable, *args) -> Any:
        """fn(*args) in the parsing process; its exception, if it raises one."""
        pool = self._executor()
        try:
            return await asyncio.wrap_future(pool.submit(fn, *args))
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False)
            raise BodyParserStopped("the process parsing the request body stopped") from None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


PARSER = Parser()
