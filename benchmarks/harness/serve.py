"""A server booted as users boot it and measured on the wire as every server here is: `python -m serving`
(devtools/server.py: a free loopback port, ready at /health 200), then `build.py bench` against its URL (TTFT, TPOT
= (E2EL − TTFT)/(N − 1), ITL: `vllm bench serve`'s statistics, docs/FACTS.md's measurement lesson).

    with served("jax", ckpt, "--max-model-len", "1024", env=serving_env(…)) as srv:
        result = bench(srv.url, out / "jax.json", "--requests", "8", "--max-tokens", "64")
"""
from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from collections.abc import Iterator

from benchmarks.harness import ROOT

# How the GPU benchmarks' servers run (serving_speed boots them; t4g_model builds its engines with the same, so the
# step it times is the step these servers serve): the JAX length ladder (512-token prompts + 256 tokens fit in
# 1024), the slots, the flags.
BUCKETS = "128,512,1024"
SLOTS = 8
SERVER_FLAGS = ("--max-model-len", "1024")
AS_IMAGE = ["-m", "benchmarks.harness.as_image"]     # how `served` starts `python -m serving`


def served_settings(work: Path, torch_slots: int = SLOTS) -> dict[str, str]:
    """The runtimes' settings (G5G_* variables) these servers run with; their compile caches under `work`."""
    return {"G5G_JAX_CACHE_DIR": str(work / "jaxcache"), "G5G_JAX_BUCKETS": BUCKETS, "G5G_JAX_SLOTS": str(SLOTS),
            "G5G_TORCH_SLOTS": str(torch_slots), "G5G_TORCH_CACHE_DIR": str(work / f"torchcache{torch_slots}")}


@contextmanager
def served(runtime: str, model: Path, *flags: str, env: dict | None = None, timeout: float = 600,
           fatal: bool = False) -> Iterator:
    """`python -m serving --runtime RUNTIME --model MODEL FLAGS…` as its image runs it (as_image.py: without the
    framework the image lacks), ready, then stopped. fatal: a server that does not come up ends the benchmark
    (SystemExit naming the runtime) instead of raising ServerFailed."""
    from devtools.server import ServerFailed, serving

    try:
        with serving(runtime, model, *flags, env=env, timeout=timeout, entry=AS_IMAGE) as srv:
            yield srv
    except ServerFailed as e:
        if not fatal:
            raise
        raise SystemExit(f"{runtime}: {e}") from None


def bench_argv(url: str, json_path: Path, *args: str) -> list[str]:
    return [sys.executable, "build.py", "bench", "--url", url, *args, "--json", str(json_path)]


def bench(url: str, json_path: Path, *args: str, quiet: bool = False, timeout: float | None = None) -> dict:
    """`build.py bench --url URL ARGS… --json JSON_PATH`, run from the checkout; the figures it wrote. quiet: its
    table not printed (a remote run's log keeps the summary only)."""
    subprocess.run(bench_argv(url, json_path, *args), cwd=ROOT, check=True, timeout=timeout,
                   stdout=subprocess.DEVNULL if quiet else None)
    return json.loads(Path(json_path).read_text())


def compare(files: list[Path]) -> int:
    """`build.py bench compare`: one table across the runs' JSON files; its exit status."""
    return subprocess.run([sys.executable, "build.py", "bench", "compare", *map(str, files)], cwd=ROOT).returncode


def tpots_ms(result: dict) -> list[float]:
    """Each request's TPOT (ms) from a `build.py bench` JSON: (latency − TTFT)/(tokens − 1), requests of one token
    or without a first token left out. The per-request spread the summary's medians hide."""
    return [(lat - ttft) / (n - 1) * 1000 for lat, ttft, n in zip(result["latencies"], result["ttfts"],
                                                                   result["output_lens"]) if ttft is not None and n > 1]
