"""One measurement per child process: each runtime owns the GPU's memory (and its compile caches, its threads)
while it runs, and one that crashes or hangs costs its own figures, not the run's.

A child is a benchmark's own module run with its child flags (`python -m benchmarks.NAME --child …`); it writes
its figures as JSON to the file the parent names (write_result), so nothing it prints can be taken for them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import ROOT

TAIL = 2000         # characters of a failed child's output kept in its error


def module_argv(module: str, *args: str) -> list[str]:
    """The command line that runs `module` (dotted) as a child: this interpreter, `-m`."""
    return [sys.executable, "-m", module, *args]


def child_env(env: dict | None = None, **extra: str) -> dict[str, str]:
    """`env` (default: this process's) with `extra` on top and the checkout first on PYTHONPATH: `-m
    benchmarks.…` then finds its modules from any working directory (under ncu, too)."""
    base = dict(os.environ if env is None else env)
    path = [str(ROOT)] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    return {**base, **extra, "PYTHONPATH": os.pathsep.join(path)}


def write_result(path: Path, figures: dict) -> None:
    """The child's side: its figures, where the parent reads them."""
    Path(path).write_text(json.dumps(figures))


@dataclass(frozen=True)
class Child:
    """How a child ended: its figures, or why there are none (`error`); `seconds` it ran (the bound if it hung)."""
    figures: dict | None
    error: str | None
    seconds: float

    def record(self, timed: str | None = None) -> dict:
        """The figures, or {"error": …}; with `timed`, the seconds under that key as well."""
        out = dict(self.figures) if self.error is None else {"error": self.error}
        return {**out, timed: self.seconds} if timed else out


def _signal(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def failure(argv: list[str], returncode: int, output: str, result: Path, tail: int = TAIL) -> str:
    """What a child that left no figures said: its exit status (a signal by name), which module, its output's tail."""
    if returncode == 0:
        how = f"exit status 0 but no result in {result}"
    else:
        how = f"killed by {_signal(-returncode)}" if returncode < 0 else f"exit status {returncode}"
    name = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else argv[0]
    return f"child {name} failed ({how}); its output ends:\n{output[-tail:]}"


def run_child(argv: list[str], result: Path, *, timeout: float, env: dict | None = None, cwd: Path | None = None,
              tail: int = TAIL) -> Child:
    """Run `argv` to its end or `timeout` seconds, then read the JSON it wrote to `result` (removed first: a
    figure left by an earlier run is never taken for this one's)."""
    result = Path(result)
    result.unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Child(None, f"timed out after {timeout} s", timeout)
    seconds = round(time.perf_counter() - t0, 1)
    if r.returncode or not result.exists():
        return Child(None, failure(argv, r.returncode, r.stdout + r.stderr, result, tail), seconds)
    try:
        return Child(json.loads(result.read_text()), None, seconds)
    except ValueError as e:
        return Child(None, f"child wrote an unreadable result {result}: {e}", seconds)
