"""python -m serving --runtime {jax,pytorch} --model DIR [--host H] [--port P] [--served-model-name N] [...]

The images' entrypoint and what `python build.py serve` execs. The server listens at once (/health is 503 while
the model loads) and exits 1 if the model cannot be loaded; where a GPU is expected (--device gpu, G5G_DEVICE=gpu:
the CUDA images) and none is usable, it exits 1 before listening, with one line saying why (serving/device.py).
SIGTERM (or Ctrl-C) drains: new requests get 503, running ones --shutdown-timeout seconds to finish, then the rest
are aborted; the exit status is 0.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import pkgutil
import sys
from pathlib import Path

from serving import device


# --runtime NAME where it is not the package's name less `_runtime` (the images and manifests say "pytorch")
RUNTIME_NAMES = {"torch_runtime": "pytorch"}


def runtimes(package_dir: Path = Path(__file__).parent) -> dict[str, str]:
    """--runtime NAME -> its module: every serving/<NAME>_runtime module or package (a new runtime is a module)."""
    return {RUNTIME_NAMES.get(m.name, m.name.removesuffix("_runtime")): f"serving.{m.name}"
            for m in pkgutil.iter_modules([str(package_dir)]) if m.name.endswith("_runtime")}


RUNTIMES = runtimes()
# Runtimes whose load() never imports transformers: the tokenizer, which does, loads beside them (serving/api/app.py).
TRANSFORMERS_FREE = {"jax"}


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _count(text: str) -> int:
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def _positive(text: str) -> int:
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def _seconds(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return x


def _stall(text: str) -> float:
    x = _seconds(text)
    if 0 < x < 1:   # an idle engine thread beats once a second: under that, a request arriving could read as a stall
        raise argparse.ArgumentTypeError(f"must be 0 (off) or at least 1 second, got {text}")
    return x


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]', got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The server's flags, defined here only (`build.py serve` passes them through)."""
    p = argparse.ArgumentParser(prog="python -m serving", description="OpenAI-compatible server for Gemma 4",
                                allow_abbrev=False)   # --por=9001 must not slip past the chart's extraArgs guard
    p.add_argument("--runtime", choices=sorted(RUNTIMES), required=True)
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="model id clients ask for (default: the model dir's name)")
    p.add_argument("--max-model-len", type=int,
                   help="cap the context (default: the model's; jax: the top of G5G_JAX_BUCKETS)")
    p.add_argument("--max-waiting", type=_count, default=64,
                   help="how many requests may wait while the engine is busy; one more gets a 429 at once "
                        "(0: no queue, a request is admitted only when the engine is free; default: 64)")
    p.add_argument("--max-queue-wait", type=_seconds, default=60.0,
                   help="seconds a request may wait for a slot; then a 429 (0: no limit; default: 60)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=5.0,
                   help="on SIGTERM, seconds running and queued requests get to finish before they are aborted "
                        "(streams end with finish_reason \"abort\", others get a 503; default: 5)")
    p.add_argument("--engine-stall-timeout", type=_stall, default=0.0,
                   help="/health answers 503 while the engine has work and has finished no step for this many "
                        "seconds: a liveness probe then restarts a wedged engine. Above the longest prefill "
                        "(0: off; default: 0)")
    p.add_argument("--max-body-bytes", type=_positive, default=16 * 2**20,
                   help="largest request body; a larger one gets a 413 before it is read (default: 16 MiB)")
    p.add_argument("--body-timeout", type=_seconds, default=10.0,
                   help="seconds a request body may pause before it is complete; then a 408 (0: no limit; default: 10)")
    p.add_argument("--body-total-timeout", type=_seconds, default=60.0,
                   help="seconds a request body may take in all, from its headers; then a 408 (0: no limit; "
                        "default: 60)")
    p.add_argument("--header-timeout", type=_seconds, default=10.0,
                   help="seconds a connection may take to send a request's headers (from when it opened, or from "
                        "the first byte of its next request); then a 408 and the connection closed (0: no limit; "
                        "default: 10)")
    p.add_argument("--max-connections", type=_count, default=1024,
                   help="open connections; one more gets a 503 and is closed at once (0: as many as the "
                        "descriptor limit allows, less 128 kept spare, which also caps this; default: 1024)")
    from serving.shaping.grammar_pool import CACHE_BYTES, COMPILE_MEMORY, COMPILES

    p.add_argument("--grammar-compiles", type=_positive, default=COMPILES,
                   help="schema compiles (response_format, forced tools) run at once, each in its own process; "
                        "twice as many more may wait, past that a 429 (default: %(default)s)")
    p.add_argument("--grammar-memory", type=_count, default=COMPILE_MEMORY,
                   help="bytes of address space for all schema compiles' processes together, shared equally "
                        "by the compiles and the quick slot (0: no cap; default: 3 GiB, 1 GiB each)")
    p.add_argument("--grammar-cache-bytes", type=_count, default=CACHE_BYTES,
                   help="bytes of compiled schemas the server holds, cached or in use; a new compile past it is a "
                        "429 (default: 384 MiB)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (as vllm serve; default: $VLLM_API_KEY)")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS origins, a JSON list")
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods, a JSON list")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers, a JSON list")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--log-level", default="info")
    p.add_argument("--device", choices=device.CHOICES,
                   help="gpu: a usable CUDA GPU or exit 1 with why (the CUDA images' default); cpu: the CPU on "
                        "purpose; auto: the GPU if usable, else the CPU (default: $G5G_DEVICE, else auto)")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def load_engine(runtime_name: str, model: Path, max_model_len: int | None = None):
    """The engine the server runs: `--runtime`'s module's `load(model_dir)`, settings from the environment (each
    runtime's G5G_* variables), the context capped only when --max-model-len asks. Benchmarks that time the
    served step (benchmarks/t4g_model.py) build their engine here too, so they cannot drift from the server."""
    runtime = importlib.import_module(RUNTIMES[runtime_name])
    # The contract with every runtime is `load(model_dir) -> Engine`; the cap is passed only when asked for.
    extra = {"max_context": max_model_len} if max_model_len else {}
    return runtime.load(model, **extra)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = Path(args.model)
    if not (model / "config.json").is_file():
        print(f"error: --model {model}: no config.json there (expected a checkpoint directory)", file=sys.stderr)
        return 2

    try:
        os.environ[device.ENV] = args.device or device.expected()   # what the engine's load() reads
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.environ[device.ENV] == "gpu":
        # Expected a GPU (the CUDA images): without a usable one, one line and exit before the port opens, rather
        # than a server answering at CPU speed. This imports the framework before the port opens, on this path only.
        try:
            importlib.import_module(RUNTIMES[args.runtime]).select_device()
        except device.NoGpuError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    from serving.api.app import create_app, server as make_server

    def load():
        # Imported here, in the engine thread, so the port opens before torch/jax are even imported.
        return load_engine(args.runtime, model, args.max_model_len)

    failed: list[BaseException] = []

    def on_load_error(e: BaseException) -> None:
        failed.append(e)
        server.should_exit = True

    cors = {"allow_origins": args.allowed_origins, "allow_methods": args.allowed_methods,
            "allow_headers": args.allowed_headers, "allow_credentials": args.allow_credentials}
    app = create_app(load, model, args.served_model_name, max_waiting=args.max_waiting, on_load_error=on_load_error,
                     shutdown_grace=args.shutdown_timeout, max_body_bytes=args.max_body_bytes,
                     api_key=args.api_key, cors=cors, body_timeout_s=args.body_timeout,
                     body_total_timeout_s=args.body_total_timeout,
                     max_queue_wait=args.max_queue_wait, engine_stall_timeout=args.engine_stall_timeout,
                     tokenizer_beside_engine=args.runtime in TRANSFORMERS_FREE,
                     grammar_limits={"workers": args.grammar_compiles, "memory": args.grammar_memory,
                                     "cache_bytes": args.grammar_cache_bytes})
    server = make_server(app, args.host, args.port, args.shutdown_timeout, args.log_level,
                         header_timeout_s=args.header_timeout, max_connections=args.max_connections)
    server.run()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
