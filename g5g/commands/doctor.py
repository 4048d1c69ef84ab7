"""`build.py doctor`: is this machine ready to build? One line per check, with the fix for what is missing."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from g5g import buildx
from g5g.commands.build import plan_from_args
from g5g.errors import FAILED, OK

console = Console(highlight=False, soft_wrap=True)


def run(args) -> int:
    plan = plan_from_args(args, with_secrets=False)
    platforms = plan.images[0].platforms
    checks = [buildx.check_docker_cli(), buildx.check_buildx(), buildx.check_engine()]
    checks.append(buildx.check_named_contexts(checks[-1]))
    checks += buildx.check_binfmt(platforms)
    reg = buildx.check_registry(plan.images[0].tags[0].rsplit("/", 1)[0])
    # The profile's default registry only matters for --push: a warning unless --registry named one.
    checks.append(reg if reg.ok or args.registry else buildx.Check(reg.name, False, reg.detail, reg.fix, warn=True))
    for c in checks:
        mark = "[green]ok[/]  " if c.ok else ("[yellow]warn[/]" if c.warn else "[red]FAIL[/]")
        # detail and fix quote docker's own messages: text, not markup (a "[/…" in them would raise MarkupError)
        console.print(f"{mark} {c.name}: {escape(c.detail)}" + (f"\n       fix: {escape(c.fix)}" if not c.ok else ""))
    return OK if all(c.ok or c.warn for c in checks) else FAILED
