"""`build.py inspect IMAGE…`: per-platform CUDA arch lists and whether --arch is covered (see g5g.inspect)."""
from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from g5g import inspect as inspector
from g5g.console import print_table

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False)


def _covered(value: bool | None, how: str | None) -> str:
    if value is True:
        return f"[green]yes[/] ({how})"
    if value is False:
        return "[bold red]no[/]"
    return "[yellow]unknown[/]"


def table(r: dict) -> Table:
    arch = r["arch"]
    t = Table(title=f"{r['image']}", caption=f"{r['digest']} (via {r['backend']})", title_justify="left")
    for col in ("platform", "CUDA archs", "PTX", "source", f"covers {arch}"):
        t.add_column(col)
    for platform, e in r["platforms"].items():
        archs = " ".join(e["cuda_archs"]) if e["cuda_archs"] else ("none" if e["cuda_archs"] == [] else "-")
        t.add_row(platform, archs, " ".join(e["ptx"]) or "-", e["source"] or "-",
                  _covered(e["covered"], e["covered_by"]))
    for platform, e in r["platforms"].items():
        if e.get("probe_error"):
            t.caption += f"\n[yellow]{platform}: probe failed: {e['probe_error']}[/]"
        if e.get("rehearsal"):
            t.caption += f"\n[yellow]{platform}: a rehearsal ({e['rehearsal']}): it proves no kernel coverage[/]"
    return t


def run(args) -> int:
    results = [inspector.inspect(image, arch=args.arch, platform=args.platform, backend=args.backend,
                                 insecure=args.insecure, probe_images=args.probe,
                                 say=lambda msg: err_console.print(f"[yellow]{msg}[/]"))
               for image in args.images]
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        for r in results:
            print_table(console, table(r))
            if any(e["covered"] is None for e in r["platforms"].values()) and not args.probe:
                console.print(f"[yellow]{r['image']}: no CUDA arch list in some configs; "
                              "--probe runs the image and asks torch (slow)[/]")
    return inspector.exit_code(results)
