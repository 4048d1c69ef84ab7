"""What the serving stack costs on the wire, apart from any model: the real server (scheduler, generation loop,
detokeniser, SSE, HTTP) over a timed engine whose GPU is a timeline, measured by `build.py bench`.

    python -m benchmarks.stack_overhead OUTDIR [--step-ms 3.8] [--prefill-ms 15] [--dispatch-ms 0]
                                        [--streams 1,8] [--max-tokens 256] [--no-ahead]

The timed engine (`TimedEngine`) takes a prompt in --prefill-ms and a decode step in --step-ms of GPU time, spends
--dispatch-ms of host time holding the GIL to launch each (a runtime's own Python), and dispatches the next step
before returning this one's tokens, as both runtimes do (--no-ahead: each step waits for the last). Its tokens are
ids from the upper half of the vocabulary (the benchmark checkpoint's tokenizer spells each as a word). The
defaults are the H100's measured figures (benchmarks/RESULTS.md: a compiled 8-row PyTorch step 3.79 ms, a short
prompt 13-17 ms). The server runs as an image runs it, neither framework importable (harness/as_image.py).

For each stream count, the wire's median TPOT and aggregate output tok/s beside the engine's own timeline: the
step time, and the aggregate a client would see if the stack cost nothing (prompts taken one after another, then
the steps). What the stack adds is the difference; `prefill_wait_ms_per_token` is the part of the TPOT that is
only the later joiners' prompts: a request whose first token came from an early prompt waits for the rest before
its second (a TPOT the bench measures per request, over its whole decode).
Writes OUTDIR/stack_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import as_image, checkpoint, serve
from benchmarks.harness.results import Results

RUNTIME = "timed"
ENTRY = ["-m", "benchmarks.stack_overhead", "--serve"]     # `python -m serving` with the timed runtime registered
VOCAB = 262_144          # the benchmark checkpoint's tokenizer (every id a word)


# ------------------------------------------------------------------------------------------- the engine
@dataclass
class Timeline:
    """One GPU queue: a prompt or a step starts when the GPU is free and the host has launched it. With `ahead`,
    the step for the tokens a call returns was launched at the previous call (for the same slots; otherwise that
    one is thrown away, its GPU time spent, as the runtimes' speculation is), and the call launches the next."""
    step_s: float
    prefill_s: float
    ahead: bool = True
    free_at: float = 0.0                       # when the GPU has finished all it was given
    queued: tuple[frozenset, float] | None = None    # (slots, done at) of the step launched ahead

    def prompt(self, launched: float) -> float:
        """A prompt launched at `launched`: when its first token is ready."""
        self.queued = None
        self.free_at = max(self.free_at, launched) + self.prefill_s
        return self.free_at

    def step(self, slots: frozenset, launched: float) -> float:
        """A step of `slots` asked for at `launched` (the host's launch done): when its tokens are ready."""
        if self.queued and self.queued[0] == slots:
            ready = self.queued[1]
        else:
            ready = self.free_at = max(self.free_at, launched) + self.step_s
        self.queued = None
        if self.ahead:
            self.free_at = max(self.free_at, launched) + self.step_s
            self.queued = (slots, self.free_at)
        return ready


def _spin(seconds: float) -> None:
    """Host work: the GIL held for `seconds` (a runtime's launch in Python)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@dataclass
class TimedEngine:
    """The Engine protocol (serving/engine.py) over a Timeline: no model, no logits."""
    timeline: Timeline
    dispatch_s: float
    slots: int
    max_context: int
    vocab_size: int = VOCAB
    _drawn: int = field(default=0)

    def _token(self) -> int:
        self._drawn += 1          # a fixed walk over the vocabulary's upper half (words, never special tokens)
        return self.vocab_size // 2 + (self._drawn * 7919) % (self.vocab_size // 2)

    def _wait(self, ready: float) -> None:
        delay = ready - time.perf_counter()
        if delay > 0:
            time.sleep(delay)            # the GIL released, as a device sync releases it

    def start(self, slot, prompt_ids, params, mask=None) -> int:
        _spin(self.dispatch_s)
        self._wait(self.timeline.prompt(time.perf_counter()))
        return self._token()

    def step(self, tokens, masks=None) -> dict[int, int]:
        _spin(self.dispatch_s)
        self._wait(self.timeline.step(frozenset(tokens), time.perf_counter()))
        return {slot: self._token() for slot in tokens}

    def logits(self, slot):
        raise NotImplementedError("the timed engine has no model: no logits")

    logprobs = prompt_logprobs = logits


def _seconds(name: str) -> float:
    return float(os.environ[name]) / 1000


def load(model_dir, max_context: int | None = None, **_) -> TimedEngine:
    """The runtime's entry (serving/__main__.py's load_engine): its figures from the G5G_TIMED_* settings."""
    timeline = Timeline(_seconds("G5G_TIMED_STEP_MS"), _seconds("G5G_TIMED_PREFILL_MS"),
                        os.environ["G5G_TIMED_AHEAD"] == "1")
    return TimedEngine(timeline, _seconds("G5G_TIMED_DISPATCH_MS"), int(os.environ["G5G_TIMED_SLOTS"]),
                       max_context or 1024)


def serve_timed(argv: list[str]) -> int:
    """`python -m serving ARGV` with this module as the `timed` runtime, neither framework importable."""
    as_image.hide(list(as_image.FRAMEWORKS))
    from serving import __main__ as serving_main

    serving_main.RUNTIMES[RUNTIME] = "benchmarks.stack_overhead"
    return serving_main.main(argv)


# ------------------------------------------------------------------------------------------- the measure
def ideal(streams: int, max_tokens: int, step_ms: float, prefill_ms: float) -> dict:
    """What a client would see if the stack cost nothing: `streams` requests arriving together, their prompts one
    after another, then max_tokens - 1 steps of them all."""
    seconds = (streams * prefill_ms + (max_tokens - 1) * step_ms) / 1000
    # request i's first token comes after i + 1 prompts, its second after all of them and one step
    wait = sum(streams - 1 - i for i in range(streams)) / streams * prefill_ms
    return {"tpot_ms": step_ms, "tok_s": round(streams * max_tokens / seconds, 1),
            "prefill_wait_ms_per_token": round(wait / (max_tokens - 1), 3)}


def measure(out: Path, ckpt: Path, a) -> dict:
    from devtools.server import serving, serving_env

    env = serving_env(G5G_TIMED_STEP_MS=str(a.step_ms), G5G_TIMED_PREFILL_MS=str(a.prefill_ms),
                      G5G_TIMED_DISPATCH_MS=str(a.dispatch_ms), G5G_TIMED_AHEAD="0" if a.no_ahead else "1",
                      G5G_TIMED_SLOTS=str(max(a.streams)))
    got = {}
    with serving(RUNTIME, ckpt, *serve.SERVER_FLAGS, "--log-level", "warning", env=env, entry=ENTRY,
                 timeout=120) as srv:
        for n in a.streams:
            requests_n = max(n, a.requests) if n == 1 else n
            r = serve.bench(srv.url, out / f"streams{n}.json", "--mode", "stream", "--requests", str(requests_n),
                            "--concurrency", str(n), "--max-tokens", str(a.max_tokens), "--ignore-eos", "--warmup",
                            "1", "--timeout", "120", "--time-limit", "300", quiet=True, timeout=400)
            best = ideal(n, a.max_tokens, a.step_ms, a.prefill_ms)
            wire = {"tpot_ms": round(r["median_tpot_ms"], 3), "tok_s": round(r["output_throughput"], 1),
                    "ttft_ms": round(r["median_ttft_ms"], 2), "completed": r["completed"],
                    "output_tokens": r["total_output_tokens"]}
            got[f"streams_{n}"] = {
                "wire": wire, "no_stack": best,
                "stack_ms_per_step": round(wire["tpot_ms"] - best["tpot_ms"] - best["prefill_wait_ms_per_token"], 3),
                "wire_over_no_stack_tok_s": round(wire["tok_s"] / best["tok_s"], 3)}
    return got


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        return serve_timed(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--step-ms", type=float, default=3.8, help="GPU time of a decode step (default: H100, 8 rows)")
    ap.add_argument("--prefill-ms", type=float, default=15.0, help="GPU time of a prompt")
    ap.add_argument("--dispatch-ms", type=float, default=0.0, help="host time (GIL held) to launch each")
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--requests", type=int, default=4, help="requests at one stream (more streams: one each)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--no-ahead", action="store_true", help="each step waits for the last one's tokens")
    a = ap.parse_args(argv)
    if a.max_tokens < 2 or min(a.streams) < 1 or a.step_ms <= 0 or a.prefill_ms < 0 or a.dispatch_ms < 0:
        ap.error("--max-tokens >= 2, --streams >= 1, --step-ms > 0, --prefill-ms and --dispatch-ms >= 0")
    a.out.mkdir(parents=True, exist_ok=True)
    res = Results(a.out / "stack_overhead.json")
    res.note(settings={k: getattr(a, k) for k in ("step_ms", "prefill_ms", "dispatch_ms", "streams", "requests",
                                                 "max_tokens", "no_ahead")})
    with tempfile.TemporaryDirectory(prefix="stack-overhead-") as tmp:
        ckpt = Path(tmp)
        (ckpt / "config.json").write_text(json.dumps({"text_config": {"vocab_size": VOCAB}}))
        checkpoint.add_whole_vocab_tokenizer(ckpt)
        res.note(**measure(a.out, ckpt, a))
    for key, fig in res.data.items():
        if key.startswith("streams_"):
            print(f"{key}: wire TPOT {fig['wire']['tpot_ms']} ms against a {a.step_ms} ms step (+"
                  f"{fig['no_stack']['prefill_wait_ms_per_token']} ms waiting for later prompts); "
                  f"{fig['wire']['tok_s']} tok/s = {fig['wire_over_no_stack_tok_s']}x the stack-free "
                  f"{fig['no_stack']['tok_s']}; the stack: {fig['stack_ms_per_step']} ms a step")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
