"""`build.py quantize --model DIR --scheme {w8a16,w4a16} --out DIR [--group-size N]` and `build.py fits …`.

quantize runs `python tools/quantize.py` in a subprocess: it needs torch and compressed-tensors (the `quantize`
extra), which the driver never imports. fits is serving/memory_plan.py, a pure function: nothing is started.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rich.console import Console

from g5g import REPO_ROOT
from g5g.errors import OK, UserError

console = Console(highlight=False, soft_wrap=True)


def run(args) -> int:
    if args.command == "fits":
        return fits(args)
    if not (Path(args.model) / "config.json").is_file():
        raise UserError(f"{args.model}: no config.json (a Hugging Face Gemma 4 checkpoint directory)")
    argv = [sys.executable, str(REPO_ROOT / "tools" / "quantize.py"), "--model", args.model, "--scheme", args.scheme,
            "--out", args.out] + (["--group-size", str(args.group_size)] if args.group_size else [])
    r = subprocess.run(argv)
    if r.returncode:
        raise UserError(f"quantize: `{' '.join(argv[1:])}` exited with {r.returncode}")
    return OK


def fits(args) -> int:
    from serving import memory_plan as mp

    gpu = mp.GPUS[args.gpu]
    kw = dict(gpu_mib=gpu, overhead_mib=args.overhead_mib)
    try:
        if args.model:
            if not (Path(args.model) / "config.json").is_file():
                raise UserError(f"{args.model}: no config.json")
            plan = mp.plan_checkpoint(Path(args.model), args.scheme, args.max_model_len, args.slots,
                                      runtime=args.runtime, **kw)
        else:
            plan = mp.plan(mp.SHAPES[args.shape], args.scheme or "fp16", args.max_model_len, args.slots, **kw)
    except (ValueError, KeyError, OSError) as e:
        raise UserError(f"fits: {e}") from None
    for line in plan.lines():
        console.print(line, markup=False)
    return OK if plan.fits else 1
