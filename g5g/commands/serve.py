"""`python build.py serve --runtime R --model DIR [--host] [--port] [server flags…]`: run the image's server locally.

Execs `python -m serving …`, the same entrypoint the jax/pytorch images run. The driver never imports torch or
jax: it only checks that the checkpoint directory and the runtime's packages are there, then replaces itself.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from g5g import REPO_ROOT
from g5g.errors import UserError

RUNTIME_PACKAGES = {"pytorch": ("torch", "transformers", "fastapi", "uvicorn"),
                    "jax": ("jax", "transformers", "fastapi", "uvicorn")}


def argv(args) -> list[str]:
    cmd = [sys.executable, "-m", "serving", "--runtime", args.runtime, "--model", str(Path(args.model).resolve()),
           "--host", args.host, "--port", str(args.port)]
    if getattr(args, "served_model_name", None):
        cmd += ["--served-model-name", args.served_model_name]
    return cmd + list(getattr(args, "server_args", []))


def run(args) -> int:
    model = Path(args.model)
    if not model.is_dir():
        raise UserError(f"--model {model}: no such directory")
    if not (model / "config.json").is_file():
        raise UserError(f"--model {model}: no config.json (expected a Hugging Face checkpoint directory)")
    missing = [p for p in RUNTIME_PACKAGES[args.runtime] if importlib.util.find_spec(p) is None]
    if missing:
        raise UserError(f"serve --runtime {args.runtime}: missing Python packages {', '.join(missing)} "
                        f"(pip install -e '.[serving,{'torch' if args.runtime == 'pytorch' else 'jax'}]')")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = argv(args)
    os.execve(cmd[0], cmd, env)
    return 1  # not reached
