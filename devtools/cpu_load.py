"""CPU-bound load beside a command, bounded in time: proof that the suite does not depend on an idle machine.

    python -m devtools.cpu_load --procs 2 --max-seconds 3600 -- bash scripts/test.sh

starts `--procs` processes that each keep one core busy with float arithmetic, runs the command, and stops the load
when the command ends or after `--max-seconds`, whichever comes first (the load never outlives either). The exit
status is the command's; the seconds the command took and how long the load ran go to stderr.
"""
from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time


def burn(until: float) -> None:
    """Keep one core busy until the monotonic clock reaches `until`."""
    x = 1.0
    while time.monotonic() < until:
        for _ in range(100_000):
            x = x * 1.0000001 + 1e-9
            x -= int(x)


def run_loaded(command: list[str], procs: int, max_seconds: float) -> int:
    start = time.monotonic()
    until = start + max_seconds
    load = [multiprocessing.Process(target=burn, args=(until,), daemon=True) for _ in range(procs)]
    for p in load:
        p.start()
    try:
        rc = subprocess.call(command)
    finally:
        loaded_s = min(time.monotonic(), until) - start
        for p in load:
            p.terminate()
            p.join(5)
    took = time.monotonic() - start
    print(f"cpu_load: {' '.join(command)!r} exit {rc} in {took:.0f} s, {procs} busy processes beside it for "
          f"{loaded_s:.0f} s", file=sys.stderr)
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.cpu_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2, help="busy processes (default 2: one per core here)")
    ap.add_argument("--max-seconds", type=float, default=3600, help="the load stops by then (default 3600)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run under load")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command: give one after --")
    if args.procs < 1 or args.max_seconds <= 0:
        ap.error("--procs must be >= 1 and --max-seconds > 0")
    return run_loaded(command, args.procs, args.max_seconds)


if __name__ == "__main__":
    sys.exit(main())
