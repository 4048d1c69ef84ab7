"""Proves that the server's engine still produces tokens: the vLLM liveness probe and the chart's `helm test`.

    token_probe.py --url http://127.0.0.1:8000 --model NAME --deadline 8 [--state /tmp/.token_probe]

vLLM's /health answers 200 while its engine core is alive but stuck in a step, so liveness cannot rest on it. With
--state, the probe first reads `vllm:generation_tokens_total` from /metrics: if it rose since the value recorded at
the last run, tokens came out in between and it passes without adding work (a busy engine is never asked for more).
Otherwise it asks for a 1-token completion (`Authorization: Bearer $VLLM_API_KEY` when that is set) and passes only
if the reply counts a completion token. Everything ends by --deadline seconds: a hung engine is a failure, never a
wait. Exit 0: a token came out; 1: none did (one line on stdout, which the kubelet keeps in the probe's event).
Standard library only: it runs in the server's image, with python3 from the image.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import urllib.error
import urllib.request

COUNTER = "vllm:generation_tokens_total"


class Deadline(BaseException):   # not an Exception: no handler on the way out of urllib swallows it
    pass


def _expired(signum, frame):
    raise Deadline()


def tokens_total(url: str, timeout: float) -> float | None:
    """The sum of every sample of the generated-tokens counter (vLLM labels it per model and engine), or None."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    total, seen = 0.0, False
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == COUNTER:
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                return None
    return total if seen else None


def one_token(url: str, model: str, timeout: float) -> str | None:
    """None when a completion token came out, else why not."""
    body = json.dumps({"model": model, "prompt": "1", "max_tokens": 1, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if os.environ.get("VLLM_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['VLLM_API_KEY']}"
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            reply = json.loads(r.read())
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code} from /v1/completions"
    except (OSError, ValueError) as e:
        return f"/v1/completions: {type(e).__name__}: {e}"
    usage = reply.get("usage") if isinstance(reply, dict) else None
    if not (isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int)
            and usage["completion_tokens"] >= 1):
        return f"/v1/completions answered without a completion token: {json.dumps(reply)[:200]}"
    return None


def _read_state(path: str) -> float | None:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def _write_state(path: str, value: float) -> None:
    try:
        with open(path + ".new", "w") as f:
            f.write(repr(value))
        os.replace(path + ".new", path)
    except OSError:
        pass   # no state: the next run asks for a token, which is only dearer


def probe(url: str, model: str, deadline: float, state: str | None) -> str | None:
    """None when a token came out, else why not. Raises Deadline when the deadline passes first."""
    if state:
        before, now = _read_state(state), tokens_total(url, deadline)
        if now is not None:
            _write_state(state, now)
            if before is not None and now > before:
                return None
    why = one_token(url, model, deadline)
    if why is None and state:
        after = tokens_total(url, deadline)
        if after is not None:
            _write_state(state, after)   # this probe's own token is not the next run's proof
    return why


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="token_probe.py", allow_abbrev=False)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--deadline", type=float, required=True, help="seconds for the whole probe")
    p.add_argument("--state", help="file that keeps the token counter between runs (liveness; none: always ask)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, a.deadline)
    try:
        why = probe(a.url.rstrip("/"), a.model, a.deadline, a.state)
    except Deadline:
        why = f"no token within the {a.deadline:g} s deadline"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if why:
        print(f"token_probe: {why}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
