"""`python build.py serve --runtime R --model DIR [python -m serving's flags]`: run the image's server locally.

Execs `python -m serving …`, the same entrypoint the jax/pytorch images run. The driver never imports torch or
jax: it only checks that the checkpoint directory and the runtime's packages are there, then replaces itself.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from g5g import REPO_ROOT, manifest
from g5g.errors import UserError
from g5g.schema import Local


def local_runtimes(manifest_dir: Path | None = None) -> dict[str, Local]:
    """The runtimes `build.py serve` runs here: those whose manifest has a serve.local section."""
    m = manifest.load(manifest_dir or REPO_ROOT / "manifests")
    return {name: rt.serve.local for name, rt in m.runtimes.items() if rt.serve.local is not None}


def argv(args) -> list[str]:
    """`python -m serving`'s own flags are defined there only: everything but --runtime/--model passes through."""
    return [sys.executable, "-m", "serving", "--runtime", args.runtime, "--model", str(Path(args.model).resolve()),
            *args.server_args]


def run(args) -> int:
    model = Path(args.model)
    if not model.is_dir():
        raise UserError(f"--model {model}: no such directory")
    if not (model / "config.json").is_file():
        raise UserError(f"--model {model}: no config.json (expected a Hugging Face checkpoint directory)")
    local = local_runtimes(Path(args.manifests) if args.manifests else None)
    if args.runtime not in local:
        raise UserError(f"serve --runtime {args.runtime}: not one that runs here (runtimes with serve.local in "
                        f"their manifest: {', '.join(local)})")
    missing = [p for p in local[args.runtime].packages if importlib.util.find_spec(p) is None]
    if missing:
        raise UserError(f"serve --runtime {args.runtime}: missing Python packages {', '.join(missing)} "
                        f"(pip install -e '.[{','.join(local[args.runtime].extras)}]')")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = argv(args)
    os.execve(cmd[0], cmd, env)
    return 1  # not reached
