"""`build.py patches verify [--version V] [--json]`: our vLLM patches, applied and measured for sm_75.

Exit 0 when every patched launch fits Turing's shared memory and sm_80 launches are unchanged, 1 when not,
2 on bad input (a patch that does not apply, a sha256 that differs, an unreachable index).
"""
from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from g5g import patches
from g5g.console import print_table
from g5g.errors import FAILED, OK

console = Console(highlight=False, soft_wrap=True)  # digests and paths on one line, in a terminal or a CI log


def _fits(entry: dict) -> str:
    return "[green]yes[/]" if entry["fits"] else "[red]no[/]"


def print_report(r: dict) -> None:
    limit = r["smem_limit"]
    t = Table(title=f"vLLM {r['vllm']} unified attention on sm_{r['target'][1]} · fp16 · limit {limit} B "
                    f"· triton {r['triton']}")
    for col in ("path", "head", "window", "unpatched tile/stages", "shared B", "fits",
                "patched tile/stages", "shared B", "fits", "sm_80 tile/stages (patched)"):
        t.add_column(col, justify="right" if "B" in col or col in ("head", "window") else "left")
    for row in r["launches"]:
        u, p, ref = row["unpatched"], row["patched"], row["reference"]
        same = "unchanged" if ref["unchanged"] else "[red]CHANGED[/]"
        t.add_row(row["path"], str(row["head_size"]), str(row["sliding_window"] or "-"),
                  f"{u['tile']}/{u['num_stages']}", str(u["shared"]), _fits(u),
                  f"{p['tile']}/{p['num_stages']}", str(p["shared"]), _fits(p),
                  f"{ref['tile']}/{ref['num_stages']} {same}")
    print_table(console, t)
    for row in r["launches"]:
        p = row["patched"]
        if "wider_tile_shared" in p:
            console.print(f"{row['path']} head {row['head_size']}: tile {2 * p['tile']} would need "
                          f"{p['wider_tile_shared']} B > {limit} B, so {p['tile']} is the widest that fits")
        if "estimate" in p and p["estimate"] != p["shared"]:
            console.print(f"[yellow]{row['path']} head {row['head_size']}: the patch estimates {p['estimate']} B, "
                          f"the compiled kernel needs {p['shared']} B[/]")
    for pa in r["patches"]:
        console.print(f"patch {pa['path']} sha256 {pa['sha256']}")
    console.print("[green]ok[/]: every patched launch fits; sm_80 unchanged" if r["ok"] else "[red]FAILED[/]")


def run(args: argparse.Namespace) -> int:
    report = patches.verify(args.version)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return OK if report["ok"] else FAILED
