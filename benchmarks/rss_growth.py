"""The server's resident memory over mixed requests, with the heap given back after large ones and without.

    python -m benchmarks.rss_growth [--runtimes jax,pytorch] [--trims on,off] [--requests 180] [--huge 4]
                                    [--batches 10] [--every 12] [--out benchmarks/results/rss_growth_cpu]

For each runtime, twice (`--trims`: G5G_GIVE_BACK_MEMORY=1, then =0: serving/shaping/heap.py's trims on, then off):
`python -m serving` on the tiny Gemma 4 fixture (CPU, one thread, as the tests run it; a cold JAX compile cache
each boot), its RSS (/proc/PID/status) at ready; then small chats; then `--requests` mixed ones one after another
(small chats, streamed and not; message lists of 1-3 MiB; n=8 answers with 20 logprobs a token, ~1.4 MB, streamed
and not), the RSS every `--every`; then `--huge` of issue 53's sizes (480 000 messages, 15 MiB; a 19 MB answer) in
turn, the RSS after each; then `--batches` of the mixed kinds four at once; then, past the trim's gap, one /health.
Every phase is bounded in count and in time (`--limit-s`). The table: RSS at ready, after each phase, the peak
(VmHWM), at the end, and the trims the server counted (g5g:heap_trims); `--out` keeps every sample
(rss_growth.json).
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmarks.harness import ROOT
from benchmarks.harness.results import Results
from benchmarks.harness.serve import served
from devtools import pressure
from devtools.server import serving_env
from g5g.bench import parse_prometheus
from serving.shaping.heap import GAP_S, rss

MIB = 2 ** 20
SMALL = 40              # small chats before the mixed ones
AT_ONCE = 4             # requests of a concurrent batch


def _stream(body: dict) -> dict:
    return {**body, "stream": True}


def _answer(n: int = 8) -> dict:
    """n choices of 128 tokens with 20 top logprobs each: ~1.4 MB of JSON."""
    return {**pressure.SMALL_CHAT, "n": n, "max_tokens": 128, "logprobs": True, "top_logprobs": 20,
            "ignore_eos": True}


# name: body; the mixed phases take them in turn
KINDS = {
    "small chat": pressure.SMALL_CHAT,
    "small stream": _stream(pressure.SMALL_CHAT),
    "100 000 empty messages (3 MiB)": {**pressure.SMALL_CHAT, "messages": [{"role": "user", "content": ""}] * 100_000},
    "one 1 MiB message": {**pressure.SMALL_CHAT, "messages": [{"role": "user", "content": "word " * 200_000}]},
    "n=8 x 128 tokens x 20 logprobs": _answer(),
    "the same, streamed": _stream(_answer()),
}
# issue 53's sizes (devtools/pressure.py, as tests/test_serving_fuzz.py sends them), taken in turn by the huge phase
HUGE = {
    "480 000 empty messages (15 MiB)": pressure.huge_messages()[1][0],
    "n=64 x 220 tokens x 20 logprobs (19 MB)": pressure.large_answer()[1][0],
}


def post(session: requests.Session, url: str, body: dict) -> int:
    """One request, its answer read whole (a stream to its end); its status (0: none within 300 s: PyTorch's one
    CPU slot takes minutes for a 19 MB answer on a loaded box)."""
    try:
        with session.post(url + pressure.CHAT, json=body, stream=bool(body.get("stream")), timeout=300) as r:
            for _ in r.iter_content(1 << 16):
                pass
            return r.status_code
    except requests.Timeout:
        return 0


def mib(pid: int, field: str = "VmRSS") -> float:
    return round(rss(pid, field) / MIB, 1)


def trims(url: str) -> dict:
    m = parse_prometheus(requests.get(url + "/metrics", timeout=30).text)
    return {"trims": m.get("g5g:heap_trims_total", 0),
            "released_mib": round(m.get("g5g:heap_released_bytes_total", 0) / MIB, 1)}


def measure(url: str, pid: int, requests_: int, huge: int, batches: int, every: int, limit_s: float) -> dict:
    out = {"ready_mib": mib(pid), "statuses": {}, "samples": []}

    def count(kind: str, status: int) -> None:
        key = f"{kind}: {status}"
        out["statuses"][key] = out["statuses"].get(key, 0) + 1

    with requests.Session() as s:
        end = time.monotonic() + limit_s
        for i in range(SMALL):
            if time.monotonic() > end:
                break
            kind = "small stream" if i % 2 else "small chat"
            count(kind, post(s, url, KINDS[kind]))
        out["small_mib"] = mib(pid)
        kinds, end, done = itertools.cycle(KINDS), time.monotonic() + limit_s, 0
        while done < requests_ and time.monotonic() < end:
            kind = next(kinds)
            count(kind, post(s, url, KINDS[kind]))
            done += 1
            if done % every == 0:
                out["samples"].append([done, mib(pid)])
        out["mixed_mib"], out["mixed_done"] = mib(pid), done
        kinds, end = itertools.cycle(HUGE), time.monotonic() + limit_s
        for i in range(huge):
            if time.monotonic() > end:
                break
            kind = next(kinds)
            count(kind, post(s, url, HUGE[kind]))
            out["samples"].append([f"huge {i + 1}", mib(pid)])
        out["huge_mib"] = mib(pid)

    def one(kind: str) -> tuple[str, int]:
        with requests.Session() as s:
            return kind, post(s, url, KINDS[kind])

    kinds, end = itertools.cycle(KINDS), time.monotonic() + limit_s
    with ThreadPoolExecutor(AT_ONCE) as pool:
        for b in range(batches):
            if time.monotonic() > end:
                break
            for kind, status in pool.map(one, [next(kinds) for _ in range(AT_ONCE)]):
                count(kind, status)
            out["samples"].append([f"batch {b + 1}", mib(pid)])
    out["concurrent_mib"] = mib(pid)
    time.sleep(GAP_S + 0.5)         # a trim held back by the gap runs after the next request, this one
    requests.get(url + "/health", timeout=30)
    time.sleep(1.0)                 # and ends after its answer
    out["final_mib"] = mib(pid)
    out["peak_mib"] = mib(pid, "VmHWM")
    out.update(trims(url))
    return out


COLUMNS = ("ready", "small", "mixed", "huge", "concurrent", "peak", "final")


def table(results: dict) -> str:
    lines = ["| runtime | trim | " + " | ".join(f"{c} (MiB)" for c in COLUMNS) + " | trims | released (MiB) |",
             "|---|---|" + "---:|" * (len(COLUMNS) + 2)]
    for key, r in results.items():
        runtime, trim = key.split(" ")
        lines.append(f"| {runtime} | {trim} | " + " | ".join(f"{r[c + '_mib']:,.0f}" for c in COLUMNS) +
                     f" | {r['trims']:.0f} | {r['released_mib']:,.0f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtimes", default="jax,pytorch")
    ap.add_argument("--trims", default="on,off", help="G5G_GIVE_BACK_MEMORY=1, =0: the servers booted, in turn")
    ap.add_argument("--requests", type=int, default=180, help="mixed requests one after another")
    ap.add_argument("--huge", type=int, default=4, help="issue 53's huge requests one after another")
    ap.add_argument("--batches", type=int, default=10, help=f"batches of {AT_ONCE} mixed requests at once")
    ap.add_argument("--every", type=int, default=12, help="an RSS sample every this many mixed requests")
    ap.add_argument("--limit-s", type=float, default=300, help="the most seconds a phase runs")
    ap.add_argument("--out", default="benchmarks/results/rss_growth_cpu")
    args = ap.parse_args()
    from devtools.tiny_gemma4 import cached
    model, out = cached(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = Results(out / "rss_growth.json", echo=400)
    results.note(machine={"cores": os.cpu_count(), "load_average_at_start": os.getloadavg(),
                          "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                                   text=True).stdout.strip()},
                 argv=sys.argv[1:], kinds=list(KINDS))
    measured = {}
    for runtime in args.runtimes.split(","):
        for trim in args.trims.split(","):
            # a cold JAX compile cache for each boot: a warm one leaves less garbage at ready, and the two boots differ
            with tempfile.TemporaryDirectory() as jax_cache:
                env = serving_env(Path(jax_cache), G5G_GIVE_BACK_MEMORY="1" if trim == "on" else "0")
                with served(runtime, model, "--served-model-name", "tiny", "--log-level", "warning", timeout=600,
                            env=env, fatal=True) as srv:
                    measured[f"{runtime} {trim}"] = measure(srv.url, srv.proc.pid, args.requests, args.huge,
                                                            args.batches, args.every, args.limit_s)
            results.note(**{f"{runtime} {trim}": measured[f"{runtime} {trim}"]})
    print(table(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
