"""`build.py doctor`: is this machine ready to build? One line per check, with the fix for what is missing, then
every buildx builder with its nodes and their platforms (`docker buildx ls`)."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from g5g import buildx
from g5g.commands.build import plan_from_args
from g5g.errors import FAILED, OK, UserError

console = Console(highlight=False, soft_wrap=True)


def run(args) -> int:
    plan = plan_from_args(args, with_secrets=False)
    platforms = plan.images[0].platforms
    checks = [buildx.check_docker_cli(), buildx.check_buildx(), buildx.check_engine()]
    checks.append(buildx.check_named_contexts(checks[-1]))
    try:
        builders = buildx.list_builders()
    except UserError as e:
        builders = None
        checks.append(buildx.Check("builders", False, str(e), "install buildx >= 0.13", warn=not plan.builder))
    current = buildx.current_builder()
    if plan.builder and builders is not None:
        checks += buildx.check_builder(plan.builder, platforms, builders, current)
    else:  # the current builder: with the docker driver, foreign platforms need this machine's QEMU
        checks += buildx.check_binfmt(platforms)
    reg = buildx.check_registry(plan.images[0].tags[0].rsplit("/", 1)[0])
    # The profile's default registry only matters for --push: a warning unless --registry named one.
    checks.append(reg if reg.ok or args.registry else buildx.Check(reg.name, False, reg.detail, reg.fix, warn=True))
    for c in checks:
        mark = "[green]ok[/]  " if c.ok else ("[yellow]warn[/]" if c.warn else "[red]FAIL[/]")
        # detail and fix quote docker's own messages: text, not markup (a "[/…" in them would raise MarkupError)
        console.print(f"{mark} {c.name}: {escape(c.detail)}" + (f"\n       fix: {escape(c.fix)}" if not c.ok else ""))
    if builders:
        console.print("builders (docker buildx ls):")
        for b in builders:
            tags = [t for t, on in (("current", b.name == current), ("--builder", b.name == plan.builder)) if on]
            console.print(f"  {b.name} ({b.driver})" + (f" [{', '.join(tags)}]" if tags else "")
                          + (f": {b.error}" if b.error else ""), markup=False)
            for n in b.nodes:
                console.print(f"    node {n.name} {n.endpoint} {n.status}" + (f" buildkit {n.buildkit}" if n.buildkit
                              else "") + f": {', '.join(n.platforms) or 'platforms unknown'}"
                              + (f" ({n.error})" if n.error else ""), markup=False)
    return OK if all(c.ok or c.warn for c in checks) else FAILED
