"""`build.py fits (--model DIR | --shape e2b) --max-model-len N [--slots S] [--scheme …]`: will the model and its KV
cache fit the GPU? serving/memory_plan.py, a pure function: nothing is started; exit 1 when it does not fit."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from g5g.commands.smoke import manifest_defaults, servable_runtimes
from g5g.errors import OK, UserError

console = Console(highlight=False, soft_wrap=True)


def run(args) -> int:
    from serving import memory_plan as mp

    servable = servable_runtimes()
    if args.runtime not in servable:
        raise UserError(f"fits --runtime {args.runtime}: not a serving runtime (one of {', '.join(servable)})")
    gpu = mp.GPUS[args.gpu]
    kw = dict(gpu_mib=gpu, overhead_mib=args.overhead_mib, lm_head=args.lm_head)
    try:
        if args.model:
            if not (Path(args.model) / "config.json").is_file():
                raise UserError(f"{args.model}: no config.json")
            plan = mp.plan_checkpoint(Path(args.model), args.scheme, args.max_model_len, args.slots,
                                      text_only=manifest_defaults(args.runtime)["text_only"], **kw)
        else:
            plan = mp.plan(mp.SHAPES[args.shape], args.scheme or "fp16", args.max_model_len, args.slots, **kw)
    except (ValueError, KeyError, OSError) as e:
        raise UserError(f"fits: {e}") from None
    for line in plan.lines():
        console.print(line, markup=False)
    return OK if plan.fits else 1
