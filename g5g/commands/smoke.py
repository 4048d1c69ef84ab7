"""`build.py smoke (IMAGE | --url URL)`: ask for a chat answer, streamed and not, at temperature 0, and check it.

Exit 0 only when both answers pass every check (g5g.smoke); 1 with the failed check named (and, for an IMAGE, the
container's last log lines); 2 for bad input (no engine, unknown image, no expected answer to check against).
"""
from __future__ import annotations

import functools
import json
import re
import time
from pathlib import Path

import requests
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from g5g import REPO_ROOT, containers, manifest, smoke, wire
from g5g.console import print_table
from g5g.errors import FAILED, OK, UserError

MAX_TOKENS = 256
REQUEST_TIMEOUT = 300.0
DEFAULT_PROMPT = "What does the abbreviation SRE stand for? Answer in one short sentence."

console = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def manifest_dir() -> Path | None:
    """As the build command: the manifests of the checkout this package runs from."""
    found = REPO_ROOT / "manifests"
    return found if found.is_dir() else None


@functools.cache
def _manifests() -> manifest.Manifests | None:
    """Loaded and validated once per process: smoke and bench consult them several times."""
    root = manifest_dir()
    return manifest.load(root) if root is not None else None


def servable_runtimes() -> tuple[str, ...]:
    """The runtimes whose manifest says how to smoke-test them (`smoke:`): the ones that serve."""
    m = _manifests()
    return tuple(name for name, rt in m.runtimes.items() if rt.smoke is not None) if m else ()


def manifest_defaults(runtime: str | None) -> dict:
    """From the runtime manifest: `smoke: {prompt, expect}`, `port`, how it takes the model (`serve.model_arg`) and
    whether it serves the text model only (`serve.text_only`) ({} when there is no manifest)."""
    m = _manifests()
    if not runtime or m is None:
        return {}
    rt = m.runtimes.get(runtime)
    if rt is None:
        return {}
    out = {"port": rt.port, "model_style": rt.serve.model_arg, "text_only": rt.serve.text_only}
    if rt.smoke is not None:
        out |= {"prompt": rt.smoke.prompt, "expect": rt.smoke.expect}
    return out


def resolve_check(runtime: str | None, prompt: str | None, expect: str | None,
                  defaults: dict | None = None) -> tuple[str, str]:
    defaults = manifest_defaults(runtime) if defaults is None else defaults
    prompt = prompt or defaults.get("prompt") or DEFAULT_PROMPT
    expect = expect or defaults.get("expect")
    if not expect:
        if runtime:
            raise UserError(f"nothing to check the answer against: no smoke.expect for {runtime} in the runtime "
                            "manifests; pass --expect REGEX")
        raise UserError("nothing to check the answer against: the runtime is unknown; pass --runtime R (its "
                        "manifest's smoke prompt and regex) or --expect REGEX")
    try:
        re.compile(expect)
    except re.error as e:
        raise UserError(f"--expect {expect!r} is not a valid regex: {e}") from None
    return prompt, expect


def check_server(url: str, model: str | None, prompt: str, expect: str, max_tokens: int | None = None,
                 timeout: float = REQUEST_TIMEOUT) -> dict:
    """Ask `url` twice (streamed, then not) and check both answers. Returns the report (JSON-ready).

    max_tokens defaults to 256, or half the model's context when the server says it is shorter (a request for
    more than the context is refused, by vLLM as by ours)."""
    session = requests.Session()
    try:
        card = wire.model_card(session, url, model=model)
    except (requests.RequestException, ValueError, KeyError) as e:
        return {"ok": False, "url": url, "reason": f"GET /v1/models failed: {e}", "failed_check": "request",
                "checks": {}, "answers": {}}
    model = card["id"]
    if max_tokens is None:
        context = card.get("max_model_len")
        max_tokens = min(MAX_TOKENS, context // 2) if isinstance(context, int) and context > 1 else MAX_TOKENS
    report: dict = {"ok": True, "url": url, "model": model, "prompt": prompt, "expect": expect,
                    "max_tokens": max_tokens, "checks": {}, "answers": {}}
    for mode, send in (("stream", wire.stream_chat), ("non-stream", wire.chat)):
        ans = send(session, url, wire.chat_payload(model, prompt, max_tokens, stream=mode == "stream"), timeout)
        checks = smoke.check_answer(ans, expect, max_tokens)
        report["checks"][mode] = [c.__dict__ for c in checks]
        report["answers"][mode] = {"text": ans.text, "finish_reason": ans.finish_reason, "usage": ans.usage,
                                   "latency_s": ans.latency, "error": ans.error or None}
        failed = smoke.first_failure(checks)
        if failed and report["ok"]:
            report.update(ok=False, failed_check=failed.name, reason=f"{mode}: {failed.name}: {failed.detail}")
    # Informational, not a check: at temperature 0 both should agree, but vLLM's prefix cache may take another
    # kernel path for the second request and diverge in float16 without anything being broken.
    texts = [a["text"] for a in report["answers"].values()]
    report["same_text"] = len(set(texts)) == 1
    return report


def _table(report: dict) -> Table:
    t = Table(title=escape(f"smoke {report.get('image') or report['url']}"), title_justify="left")
    for col in ("answer", "check", "", "detail"):
        t.add_column(col)
    for mode, checks in report["checks"].items():
        for c in checks:
            t.add_row(mode, c["name"], "[green]ok[/]" if c["ok"] else "[bold red]FAIL[/]", escape(c["detail"]))
    return t


def _print(report: dict, as_json: bool) -> None:
    if as_json:  # the report on stdout; a failure still says why on stderr, for CI logs
        print(json.dumps(report, indent=2))
    else:
        if report["checks"]:
            print_table(console, _table(report))
        for mode, a in report["answers"].items():
            console.print(f"[dim]{mode} answer:[/] {escape(repr(a['text'][:300]))}")
        if report.get("boot"):
            console.print("boot: " + ", ".join(f"{k} {v:.2f} s" for k, v in report["boot"].items()))
        if report["ok"]:
            console.print("[bold green]smoke: ok[/]")
    if not report["ok"]:
        err.print(f"[bold red]smoke failed:[/] {escape(report['reason'])}", soft_wrap=True)
        if report.get("logs"):
            err.print(f"[dim]last {len(report['logs'])} log lines of the container:[/]")
            for line in report["logs"]:
                err.print(f"  {line}", markup=False, soft_wrap=True)


def image_runtime(image: str, labels: dict, runtime: str | None, profile: str | None) -> tuple[str, str, bool]:
    """(runtime, profile, whether the container gets the GPU): from the arguments, else the image's labels; the
    manifests say which runtimes serve and which profiles are CUDA ones."""
    runtime = runtime or labels.get("io.g5g.runtime")
    profile = profile or labels.get("io.g5g.profile")
    m = _manifests()
    servable = servable_runtimes()
    if runtime not in servable:
        raise UserError(f"{image}: runtime unknown (label io.g5g.runtime is {runtime!r}); "
                        f"pass --runtime {'|'.join(servable)}")
    profiles = m.profiles if m else {}
    if profile not in profiles:
        raise UserError(f"{image}: profile unknown (label io.g5g.profile is {profile!r}); "
                        f"pass --profile {'|'.join(sorted(profiles))}")
    return runtime, profile, profiles[profile].cuda is not None


def smoke_image(image: str, *, runtime: str | None, profile: str | None, model: str | None,
                served_model_name: str | None, prompt: str | None, expect: str | None, timeout: float,
                max_tokens: int | None = None, after_ready=None, no_gpu: bool = False) -> dict:
    """Boot `image`, check it, remove it. Boot timings: container start → port open → /health 200 → first answer
    that passed. `after_ready(server)` runs on the live server after a passing check (bench uses it). `no_gpu`:
    no GPU device request even for a CUDA profile's image (its jax/torch then runs on the CPU)."""
    dc = containers.client()
    runtime, profile, gpu = image_runtime(image, containers.image_labels(dc, image), runtime, profile)
    gpu = gpu and not no_gpu
    defaults = manifest_defaults(runtime)
    prompt, expect = resolve_check(runtime, prompt, expect, defaults)
    base = {"image": image, "runtime": runtime, "profile": profile, "gpu": gpu, "url": None, "checks": {},
            "answers": {}}
    try:
        with containers.serve_image(image, gpu=gpu, model=model, model_style=defaults.get("model_style", "flag"),
                                    served_model_name=served_model_name, timeout=timeout,
                                    port=defaults.get("port", containers.PORT), docker_client=dc) as srv:
            report = base | check_server(srv.url, srv.model_name, prompt, expect, max_tokens)
            if report["ok"]:
                srv.boot["first_answer_s"] = time.perf_counter() - srv.started
            report |= {"image": image, "boot": srv.boot}
            if not report["ok"]:
                report["logs"] = srv.logs()
            elif after_ready:
                report["after"] = after_ready(srv)
            return report
    except containers.ContainerFailed as e:
        return base | {"ok": False, "reason": str(e), "failed_check": "start", "logs": e.logs}


def run(args) -> int:
    if bool(args.image) == bool(args.url):
        raise UserError("give either an IMAGE or --url URL" + (" (not both)" if args.image else ""))
    if args.url:
        url = args.url.rstrip("/")
        runtime = args.runtime or _runtime_from_server(url)
        prompt, expect = resolve_check(runtime, args.prompt, args.expect)
        report = check_server(url, args.served_model_name, prompt, expect, args.max_tokens)
    else:
        report = smoke_image(args.image, runtime=args.runtime, profile=args.profile, model=args.model,
                             served_model_name=args.served_model_name, prompt=args.prompt, expect=args.expect,
                             timeout=args.timeout, max_tokens=args.max_tokens, no_gpu=args.no_gpu)
    _print(report, args.json)
    return OK if report["ok"] else FAILED


def _runtime_from_server(url: str) -> str | None:
    """vLLM says `owned_by: vllm` in /v1/models; our servers say their runtime."""
    try:
        data = requests.get(f"{url}/v1/models", timeout=10).json().get("data") or []
    except (requests.RequestException, ValueError):
        return None
    owner = (data[0].get("owned_by") if data else None) or ""
    return owner if owner in servable_runtimes() else None
