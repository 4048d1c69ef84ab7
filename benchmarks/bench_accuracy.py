"""How far `build.py bench` is from the truth: runs it against the timed test server at several settings and prints
measured − configured for TTFT, TPOT, ITL and E2EL (ms). The harness's own error bar, measured, not assumed.

    python -m benchmarks.bench_accuracy [--requests 8]
"""
from __future__ import annotations

import argparse

from g5g import bench
from devtools.timed_server import Config, TimedServer

SETTINGS = [  # ttft s, gap s, tokens, tokens per chunk, concurrency
    (0.20, 0.050, 64, 1, 1),
    (0.20, 0.050, 64, 4, 1),
    (0.05, 0.010, 128, 2, 4),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    a = p.parse_args()
    print(f"{'ttft':>6} {'gap':>6} {'N':>4} {'m':>2} {'C':>2} | error ms: {'TTFT':>7} {'TPOT':>7} {'ITL':>7} {'E2EL':>7}")
    for ttft, gap, n, m, c in SETTINGS:
        srv = TimedServer(Config(ttft=ttft, gap=gap, tokens=n, tokens_per_chunk=m)).start()
        try:
            answers, duration = bench.run_load(srv.url, "timed", prompt="hi", requests_n=a.requests, concurrency=c,
                                               max_tokens=n, stream=True, warmup=1, timeout=60, time_limit=300)
        finally:
            srv.stop()
        r = bench.compute_metrics(answers, duration)
        chunks = -(-n // m)
        truth = {"ttft": ttft, "tpot": (chunks - 1) * gap / (n - 1), "itl": gap, "e2el": ttft + (chunks - 1) * gap}
        errs = [r[f"mean_{k}_ms"] - truth[k] * 1000 for k in ("ttft", "tpot", "itl", "e2el")]
        print(f"{ttft:>6} {gap:>6} {n:>4} {m:>2} {c:>2} | {'':>10}" + " ".join(f"{e:>+7.2f}" for e in errs))


if __name__ == "__main__":
    main()
