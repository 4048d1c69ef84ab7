"""`build.py quantize --model DIR --scheme {w8a16,w4a16} --out DIR [--group-size N]`.

It runs `python tools/quantize.py` in a subprocess: it needs torch and compressed-tensors (the `quantize` extra),
which the driver never imports.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from g5g import REPO_ROOT
from g5g.errors import OK, UserError

def run(args) -> int:
    if not (Path(args.model) / "config.json").is_file():
        raise UserError(f"{args.model}: no config.json (a Hugging Face Gemma 4 checkpoint directory)")
    argv = [sys.executable, str(REPO_ROOT / "tools" / "quantize.py"), "--model", args.model, "--scheme", args.scheme,
            "--out", args.out] + (["--group-size", str(args.group_size)] if args.group_size else [])
    r = subprocess.run(argv)
    if r.returncode:
        raise UserError(f"quantize: `{' '.join(argv[1:])}` exited with {r.returncode}")
    return OK
