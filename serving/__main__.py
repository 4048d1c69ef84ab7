"""python -m serving --runtime {jax,pytorch} --model DIR [--host H] [--port P] [--served-model-name N]

The images' entrypoint and what `python build.py serve` execs. The server listens at once (/health is 503 while
the model loads) and exits non-zero if the model cannot be loaded.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

RUNTIMES = {"pytorch": "serving.pytorch_runtime", "jax": "serving.jax_runtime"}


def build_parser() -> argparse.ArgumentParser:
    """The server's flags, defined here only (`build.py serve` passes them through)."""
    p = argparse.ArgumentParser(prog="python -m serving", description="OpenAI-compatible server for Gemma 4")
    p.add_argument("--runtime", choices=sorted(RUNTIMES), required=True)
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="model id clients ask for (default: the model dir's name)")
    p.add_argument("--max-model-len", type=int,
                   help="cap the context (default: the model's; jax: the top of G5G_JAX_BUCKETS)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests beyond which clients get 429")
    p.add_argument("--log-level", default="info")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = Path(args.model)
    if not (model / "config.json").is_file():
        print(f"error: --model {model}: no config.json there (expected a checkpoint directory)", file=sys.stderr)
        return 2

    import uvicorn

    from serving.api import create_app

    def load():
        # Imported here, in the engine thread, so the port opens before torch/jax are even imported.
        runtime = importlib.import_module(RUNTIMES[args.runtime])
        # The contract with every runtime is `load(model_dir) -> Engine`; the cap is passed only when asked for.
        extra = {"max_context": args.max_model_len} if args.max_model_len else {}
        return runtime.load(model, **extra)

    failed: list[BaseException] = []

    def on_load_error(e: BaseException) -> None:
        failed.append(e)
        server.should_exit = True

    app = create_app(load, model, args.served_model_name, max_waiting=args.max_waiting, on_load_error=on_load_error)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    server.run()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
