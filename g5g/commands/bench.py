"""`build.py bench (--url URL | --image IMAGE)` and `build.py bench compare A.json B.json … [--plot PNG]`."""
from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

import requests
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from g5g import bench, wire
from g5g.console import print_table
from g5g.errors import FAILED, OK, UserError

console = Console(highlight=False)
err = Console(stderr=True, highlight=False)

ROWS = [  # (key, label) for the result and compare tables
    ("completed", "completed requests"), ("failed", "failed requests"), ("duration", "duration (s)"),
    ("total_output_tokens", "output tokens"), ("output_len_source", "output length from"),
    ("mean_tokens_per_chunk", "tokens per chunk"), ("output_throughput", "output throughput (tok/s)"),
    ("request_throughput", "requests/s"),
    *[(f"{s}_{m}_ms", f"{s} {m.upper()} (ms)") for m in bench.METRICS for s in ("mean", "median", "p90", "p99")],
]
BOOT_ROWS = [("port_open_s", "boot: port open (s)"), ("health_s", "boot: /health 200 (s)"),
             ("first_answer_s", "boot: first good answer (s)")]
PLOTTED = [("median_ttft_ms", "median TTFT (ms)"), ("median_tpot_ms", "median TPOT (ms)"),
           ("output_throughput", "output throughput (tok/s)"), ("boot.first_answer_s", "boot to first answer (s)")]


def run(args) -> int:
    if getattr(args, "bench_command", None) == "compare":
        return compare(args.files, args.plot)
    if bool(args.url) == bool(args.image):
        raise UserError("bench needs either --url URL or --image IMAGE" + (" (not both)" if args.url else ""))
    for flag in ("requests", "concurrency", "max_tokens"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
    if args.warmup < 0:
        raise UserError(f"--warmup must be 0 or more (got {args.warmup})")
    count_tokens = _tokenizer(args.tokenizer) if args.tokenizer else None

    if args.image:
        from g5g.commands.smoke import smoke_image

        report = smoke_image(args.image, runtime=args.runtime, profile=args.profile, model=args.model,
                             served_model_name=None, timeout=args.boot_timeout,
                             # --expect pairs with --prompt; alone, neither replaces the manifest's smoke pair
                             prompt=args.prompt if args.expect else None, expect=args.expect, no_gpu=args.no_gpu,
                             after_ready=lambda srv: measure(args, srv.url, srv.model_name, count_tokens))
        if not report["ok"]:
            err.print(f"[bold red]bench: {escape(args.image)} failed before the benchmark:[/] "
                      f"{escape(report['reason'])}", soft_wrap=True)
            for line in report.get("logs") or []:
                err.print(f"  {line}", markup=False, soft_wrap=True)
            return FAILED
        result = report["after"] | {"image": args.image, "runtime": report["runtime"], "boot": report["boot"]}
        result["label"] = args.label or report["runtime"]
    else:
        result = measure(args, args.url.rstrip("/"), None, count_tokens)
    return finish(result, args.json_file)


def measure(args, url: str, model: str | None, count_tokens) -> dict:
    """The timed run against a live server, in the mode asked for ('auto' resolved here)."""
    session = requests.Session()
    try:
        model = model or wire.first_model(session, url)
    except (requests.RequestException, ValueError, KeyError) as e:
        raise UserError(f"{url}: cannot list models (GET /v1/models): {e}") from None
    mode = args.mode
    if mode != "stream":
        has_gauge = bench.scrape(session, url) is not None
        if mode == "auto":
            mode = "both" if has_gauge else "stream"
        elif not has_gauge:
            raise UserError(f"{url}/metrics has no gauge in vLLM's names (vllm:time_to_first_token_seconds, …); "
                            "use --mode stream")
    scraped: dict = {}

    def before_run() -> None:  # after warm-up, right before the timed requests
        scraped["before"] = bench.scrape(session, url)

    with console.status(f"bench {url}: {args.warmup} warm-up + {args.requests} requests, "
                        f"concurrency {args.concurrency}, mode {mode}"):
        try:
            answers, duration = bench.run_load(
                url, model, prompt=args.prompt or bench.DEFAULT_PROMPT, requests_n=args.requests,
                concurrency=args.concurrency, max_tokens=args.max_tokens, stream=mode != "gauge",
                warmup=args.warmup, timeout=args.timeout, time_limit=args.time_limit,
                before_run=before_run if mode in ("gauge", "both") else None, ignore_eos=args.ignore_eos)
        except RuntimeError as e:
            raise UserError(f"{url}: {e}") from None
    result = bench.compute_metrics(answers, duration, count_tokens)
    gauge = None
    if mode in ("gauge", "both"):
        after = bench.scrape(session, url)
        if not scraped.get("before") or not after:
            raise UserError(f"{url}/metrics stopped answering during the run")
        gauge = bench.gauge_delta(scraped["before"], after)
    elif args.mode == "auto" and (gauge := bench.response_gauge(answers)):
        mode = "both"  # no /metrics, but the server put its own timings in its responses
    if gauge and mode == "both":
        gauge["ratio_stream_to_gauge"] = bench.ratios(result, gauge)
    return result | {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat", "label": args.label or model, "url": url, "model_id": model,
        "num_prompts": args.requests, "max_concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "num_warmups": args.warmup, "ignore_eos": args.ignore_eos,
        "mode": mode, "mode_requested": args.mode, "gauge": gauge, "boot": None,
    }


def _tokenizer(path: str):
    """A token counter from a tokenizer.json (or a model directory holding one), via the `tokenizers` package."""
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.is_file():
        raise UserError(f"--tokenizer {path}: no tokenizer.json there")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError("--tokenizer needs the `tokenizers` package (pip install -e .[serving])") from None
    tok = Tokenizer.from_file(str(p))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _get(result: dict, key: str):
    if key.startswith("boot."):
        return (result.get("boot") or {}).get(key[5:])
    return result.get(key)


def result_table(result: dict) -> Table:
    t = Table(title=escape(f"bench {result.get('label') or result.get('url')} — mode {result['mode']}"),
              title_justify="left")
    t.add_column("metric")
    t.add_column("on the wire", justify="right")
    gauge = result.get("gauge")
    if gauge:
        t.add_column(f"server gauge ({gauge['source']})", justify="right")
        t.add_column("wire/gauge", justify="right")
    for key, label in ROWS:
        if key not in result and key not in (gauge or {}):
            continue
        row = [label, _fmt(result.get(key))]
        if gauge:
            metric = key.split("_")[1] if key.startswith("mean_") and key.endswith("_ms") else None
            ratio = (gauge.get("ratio_stream_to_gauge") or {}).get(metric)
            row += [_fmt(gauge[key]) if key in gauge else "", _fmt(ratio) if ratio else ""]
        t.add_row(*row)
    for key, label in BOOT_ROWS:
        if (result.get("boot") or {}).get(key) is not None:
            t.add_row(label, _fmt(result["boot"][key]), *([""] * 2 if gauge else []))
    return t


def finish(result: dict, json_file: str | None) -> int:
    print_table(console, result_table(result))
    if json_file:
        Path(json_file).write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {json_file}")
    if result["failed"]:
        first = next(e for e in result["errors"] if e)
        err.print(f"[bold red]bench: {result['failed']} of {result['failed'] + result['completed']} requests "
                  f"failed;[/] first: {escape(first)}", soft_wrap=True)
        return FAILED
    return OK


def load_results(files: list[str]) -> list[dict]:
    results = []
    for f in files:
        try:
            r = json.loads(Path(f).read_text())
        except FileNotFoundError:
            raise UserError(f"{f}: no such file") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{f}: not JSON ({e})") from None
        if not isinstance(r, dict) or "completed" not in r:
            raise UserError(f"{f}: not a bench result (no 'completed' key)")
        r.setdefault("label", Path(f).stem)
        results.append(r)
    # Labels name the table's columns and the plot's bars: two runs with one label (the same runtime, measured
    # twice) would share one bar. The file tells them apart, else the position.
    for suffix in (lambda i: f"({Path(files[i]).stem})", lambda i: f"#{i + 1}"):
        names = [str(r["label"]) for r in results]
        for i, r in enumerate(results):
            if names.count(names[i]) > 1:
                r["label"] = f"{names[i]} {suffix(i)}"
    return results


def compare(files: list[str], plot: str | None) -> int:
    """One table across runs. Wire figures are comparable across runtimes; server gauges are shown per run only."""
    if len(files) < 1:
        raise UserError("bench compare needs at least one result file")
    results = load_results(files)
    t = Table(title="bench compare (all figures on the wire unless marked gauge)", title_justify="left")
    t.add_column("metric")
    for r in results:
        t.add_column(escape(str(r["label"])), justify="right")
    t.add_row("mode", *[str(r.get("mode")) for r in results])
    for key, label in ROWS + [(f"boot.{k}", v) for k, v in BOOT_ROWS]:
        values = [_get(r, key) for r in results]
        if any(v is not None for v in values):
            t.add_row(label, *map(_fmt, values))
    for key in (f"mean_{m}_ms" for m in bench.METRICS):
        values = [(r.get("gauge") or {}).get(key) for r in results]
        if any(v is not None for v in values):
            t.add_row(f"gauge {key} (server's own, this run only)", *map(_fmt, values))
    for m in bench.METRICS:
        values = [((r.get("gauge") or {}).get("ratio_stream_to_gauge") or {}).get(m) for r in results]
        if any(v is not None for v in values):
            t.add_row(f"wire/gauge {m.upper()} (that server's own ratio)", *(_fmt(v) if v is None else f"{v:.4f}"
                                                                             for v in values))
    print_table(console, t)
    if plot:
        write_plot(results, plot)
        console.print(f"wrote {plot}")
    return OK


def write_plot(results: list[dict], path: str) -> None:
    import matplotlib.pyplot as plt

    fig = plot(results)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot(results: list[dict]):
    """One bar panel per plotted metric, a bar per run; the runs are named once, in a legend under the panels (run
    names such as jax-g5g-cu130-sm75-fp16 are too long for a tick label under every bar)."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib (pip install -e .[dev])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [(k, lbl) for k, lbl in PLOTTED if any(_get(r, k) is not None for r in results)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4), squeeze=False)
    labels = [str(r["label"]) for r in results]
    colors = [f"C{i % 10}" for i in range(len(results))]
    for ax, (key, title) in zip(axes[0], panels):
        values = [_get(r, key) for r in results]
        bars = ax.bar(range(len(results)), [v or 0.0 for v in values], color=colors)
        ax.bar_label(bars, labels=["n/a" if v is None else f"{v:.1f}" for v in values], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
    fig.suptitle("g5g-images bench (on the wire)", fontsize=10)
    fig.tight_layout()
    handles = [Patch(color=c) for c in colors]
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=max(1, min(len(labels), 3)),
               fontsize=8, frameon=False)
    return fig
