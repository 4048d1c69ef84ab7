"""How long another client's small chat takes while issue 40's scenarios run, beside the same chat alone.

    python -m benchmarks.other_clients [--runtimes pytorch,jax] [--repeats 3] [--out DIR] [--only TEXT]

For each runtime: `python -m serving` on the tiny Gemma 4 fixture (CPU, one thread, as the tests run it); the
small chat (4 tokens) alone, ten times; then each scenario `--repeats` times, the small chat asked again and again
while it runs (devtools/pressure.py: the same requests tests/test_serving_fuzz.py sends), and /health polled. The
table gives the chat's slowest time beside each scenario, its ratio to the chat alone (median), and whether it
stayed within issue 53's bound of 1 s (issue 40's: 2 s); `--out` keeps every time (other_clients.json). `--only`
runs the scenarios whose names contain TEXT (e.g. "message lists"). The tests
check relative bounds only (a loaded CI machine slows both sides); this is where the absolute seconds are measured.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from benchmarks.harness import ROOT
from benchmarks.harness.serve import served
from devtools import pressure
from devtools.server import serving_env

BOUND_S = 1.0           # issue 53: another client's chat is never held longer (issue 40: 2 s)
ALONE = 10              # small chats timed alone
CHATS = 50              # at most this many small chats beside one run of a request scenario
CONNECTIONS_S = 12.0    # how long a connection scenario is held: past --header-timeout's 10 s

_fresh = iter(range(1_000_000))     # each run's slow schemas are new ones: a compiled schema is cached


def _slow_schemas() -> tuple[str, list[dict]]:
    return pressure.CHAT, [pressure.slow_schema(next(_fresh)) for _ in range(16)]


# name: (path, bodies) posted at once
REQUESTS: dict[str, Callable[[], tuple[str, list[dict]]]] = {
    "3 huge message lists (15 MiB)": pressure.huge_messages,
    "2 huge token id lists (14 MiB)": pressure.huge_token_ids,
    "a schema slow to build": pressure.wide_schema,
    "16 slow schemas at once": _slow_schemas,
    "16 slow schemas; small schemas beside": _slow_schemas,
    "4 MB arguments; 1000 tools x 1000 turns": pressure.huge_conversations,
    "n=64 x 220 tokens x 20 logprobs (19 MB)": pressure.large_answer,
}
# name: the other client's chat, when not the plain small chat: a fresh small schema each time (issue 53 item 6)
BESIDE = {"16 slow schemas; small schemas beside": lambda: pressure.small_schema_chat(next(_fresh))}
# name: a context holding the connections open
CONNECTIONS = {
    "1000 idle connections": lambda url: pressure.idle(url, 1000),
    "200 slowloris headers": lambda url: pressure.slow_headers(url, 200, limit_s=CONNECTIONS_S + 5),
    "200 bodies a byte a second": lambda url: pressure.slow_bodies(url, 200, limit_s=CONNECTIONS_S + 5),
}


def _chats_for(url: str, seconds: float) -> pressure.Beside:
    """Small chats one after another, and /health between them, for `seconds`."""
    import requests
    got, end = pressure.Beside(), time.monotonic() + seconds
    with requests.Session() as s:
        while time.monotonic() < end:
            t0 = time.monotonic()
            r = s.post(url + pressure.CHAT, json=pressure.SMALL_CHAT, timeout=60)
            got.chats.append((r.status_code, time.monotonic() - t0))
            t0 = time.monotonic()
            got.health.append((s.get(url + "/health", timeout=60).status_code, time.monotonic() - t0))
            time.sleep(0.2)
    return got


def measure(url: str, repeats: int, only: str = "") -> dict:
    alone = [pressure.beside_small(url, pressure.CHAT, [], chats=1).chats[0] for _ in range(ALONE + 1)][1:]  # warm
    runs: dict[str, list[pressure.Beside]] = {}
    for name, scenario in REQUESTS.items():
        if only not in name:
            continue
        small = BESIDE.get(name, lambda: pressure.SMALL_CHAT)
        runs[name] = [pressure.beside_small(url, *scenario(), chats=CHATS, chat=small) for _ in range(repeats)]
    for name, hold in CONNECTIONS.items():
        if only not in name:
            continue
        runs[name] = []
        for _ in range(repeats):
            with hold(url):
                runs[name].append(_chats_for(url, CONNECTIONS_S))
    return {"alone": alone, "scenarios": {name: [{"answers": b.answers, "chats": b.chats, "health_polls": len(b.health),
                                                   "health_slowest_s": max(dt for _, dt in b.health),
                                                   "health_not_200": sum(code != 200 for code, _ in b.health)}
                                                  for b in got] for name, got in runs.items()}}


def rows(result: dict) -> list[tuple]:
    """(scenario, chats, chats and /health polls not 200, slowest chat s, ratio to alone, slowest /health s, within
    the bound)."""
    alone = statistics.median(dt for _, dt in result["alone"])
    out = []
    for name, runs in result["scenarios"].items():
        chats = [c for run in runs for c in run["chats"]]
        slowest = max(dt for _, dt in chats)
        failed = sum(status != 200 for status, _ in chats) + sum(run["health_not_200"] for run in runs)
        out.append((name, len(chats), failed, slowest, slowest / alone, max(run["health_slowest_s"] for run in runs),
                    slowest <= BOUND_S and not failed))
    return out


def table(runtime: str, result: dict) -> str:
    alone = [dt for _, dt in result["alone"]]
    lines = [f"{runtime}: the small chat alone: median {statistics.median(alone):.3f} s, slowest {max(alone):.3f} s",
             f"  {'scenario':<42} {'chats':>5} {'not 200':>7} {'slowest':>8} {'x alone':>8} {'/health':>8}  "
             f"<= {BOUND_S:g} s"]
    for name, n, failed, slowest, ratio, health, ok in rows(result):
        lines.append(f"  {name:<42} {n:>5} {failed:>7} {slowest:>7.3f}s {ratio:>7.1f}x {health:>7.3f}s  "
                     f"{'yes' if ok else 'NO'}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtimes", default="pytorch,jax")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/other_clients_cpu")
    ap.add_argument("--only", default="", help="run only the scenarios whose names contain this text")
    args = ap.parse_args()
    if not any(args.only in name for name in (*REQUESTS, *CONNECTIONS)):
        ap.error(f"--only {args.only!r}: no scenario's name contains it")
    from devtools.tiny_gemma4 import cached
    model, out = cached(), Path(args.out)
    machine = {"cores": os.cpu_count(), "load_average_at_start": os.getloadavg(),
               "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()}
    results, ok = {}, True
    with tempfile.TemporaryDirectory() as jax_cache:
        for runtime in args.runtimes.split(","):
            with served(runtime, model, "--served-model-name", "tiny", "--log-level", "warning", timeout=600,
                        env=serving_env(Path(jax_cache)), fatal=True) as srv:
                results[runtime] = measure(srv.url, args.repeats, args.only)
            print(table(runtime, results[runtime]), flush=True)
            ok &= all(row[-1] for row in rows(results[runtime]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "other_clients.json").write_text(json.dumps({"machine": machine, "bound_s": BOUND_S, **results},
                                                      indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
