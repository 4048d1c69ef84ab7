"""The product's modules (g5g/, serving/) are split by responsibility: none runs past 500 lines, the size at which
one was found to hold two (g5g/manifest.py: the schema, the loading and the expressions; serving/api/app.py: the app,
the engine thread and the metrics)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIMIT = 500


def test_no_module_of_the_product_runs_past_500_lines():
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines())
             for pkg in ("g5g", "serving") for p in (REPO / pkg).rglob("*.py")}
    assert len(sizes) > 30 and max(sizes.values()) > 200                  # it read the modules
    assert {f: n for f, n in sizes.items() if n > LIMIT} == {}
