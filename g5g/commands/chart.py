"""`build.py chart [--out DIR] [--registry R]`: the serving Helm chart's values for every serving image on every
profile that deploy/fleet.yaml places (g5g, g4dn), from the same plan the images are built from."""
from __future__ import annotations

import tomllib
from pathlib import Path

from rich.console import Console

from g5g import REPO_ROOT, chart, manifest
from g5g.errors import OK
from g5g.plan import make_plan

console = Console(highlight=False, soft_wrap=True)
CHART = REPO_ROOT / "deploy" / "chart"


def files(registry: str | None = None, manifests: str | None = None, overrides: tuple[str, ...] = ()) -> dict:
    fleet = chart.load_fleet(REPO_ROOT)
    mdir = Path(manifests) if manifests else REPO_ROOT / "manifests"
    plans = [make_plan(manifest.load(mdir, profile=p, overrides=list(overrides)), profile=p, registry=registry,
                       repo_root=REPO_ROOT) for p in fleet["nodes"]]
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    return chart.chart_files(plans, fleet, REPO_ROOT, version)


def run(args) -> int:
    out = Path(args.out)
    written, removed = chart.write(out, files(args.registry, args.manifests, tuple(args.overrides)), CHART)
    for path in written:
        console.print(f"wrote {path}", markup=False)
    for path in removed:
        console.print(f"removed {path} (no longer generated)", markup=False)
    return OK
