"""`build.py generate --runtime R --out DIR`: write the Dockerfiles, their build contexts and docker-bake.json."""
from __future__ import annotations

from rich.console import Console

from g5g import render
from g5g.commands.build import REPO_ROOT, plan_from_args
from g5g.errors import OK

console = Console(highlight=False, soft_wrap=True)


def run(args) -> int:
    plan = plan_from_args(args, with_secrets=False)
    for path in render.write(plan, REPO_ROOT):
        shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
        console.print(f"wrote {shown}", markup=False)
    return OK
