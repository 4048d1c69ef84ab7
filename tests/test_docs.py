"""What the code, the tests and the README cite is readable in the repository, and README figures have one source."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tracked(*patterns: str, repo: Path = REPO) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=repo, capture_output=True,
                         text=True, check=True).stdout.split()
    return [repo / p for p in out if (repo / p).is_file()]


def test_tracked_reads_what_the_repository_tracks(tmp_path):
    """A virtualenv made in the checkout under another name than .venv (`python -m venv venv`) is not the project's."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("")
    subprocess.run([*git, "add", "a.py"], check=True)
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "setupcfg.py").write_text("")
    assert tracked("*.py", repo=tmp_path) == [tmp_path / "a.py"]


def test_every_cited_markdown_file_is_in_the_repository():
    """A fact or contract a test relies on is written down here (docs/FACTS.md, docs/CONTRACTS.md), with its
    source, not in a document outside the checkout."""
    cited = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[A-Z][\w-]*\.md)\b")
    missing = []
    for path in tracked("*.py", "*.md", "*.sh", "*.j2", "*.yaml", "*.yml", "*.toml"):
        for name in cited.findall(path.read_text(errors="replace")):
            if not (REPO / name).is_file():
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert missing == []


def _row(text: str, name: str) -> tuple[str, ...]:
    m = re.search(rf"^\| {re.escape(name)} \|(.+)\|$", text, re.M)
    assert m, f"README has no row {name!r}"
    return tuple(c.strip() for c in m[1].split("|"))


def test_readme_cpu_figures_are_the_committed_results():
    """One source: the README's CPU figures are read off benchmarks/results/, and no other figures for them."""
    readme = (REPO / "README.md").read_text()
    res = REPO / "benchmarks/results"
    pt, jx = (json.loads((res / f"serving_cpu/{rt}.json").read_text()) for rt in ("pytorch", "jax"))
    assert _row(readme, "median TTFT (ms)")[:2] == (f"{pt['median_ttft_ms']:.1f}", f"{jx['median_ttft_ms']:.1f}")
    assert _row(readme, "median TPOT (ms)")[:2] == (f"{pt['median_tpot_ms']:.2f}", f"{jx['median_tpot_ms']:.2f}")
    assert _row(readme, "output throughput (tok/s)")[:2] == (f"{pt['output_throughput']:.0f}",
                                                             f"{jx['output_throughput']:.0f}")
    health = _row(readme, "process start → /health 200 (s)")
    assert health[0] == f"{pt['boot']['health_s']:.1f}" and health[1].startswith(f"{jx['boot']['health_s']:.1f} ")
    ratio = _row(readme, "wire/gauge TTFT, each server's own")
    assert ratio[:2] == tuple(f"{r['gauge']['ratio_stream_to_gauge']['ttft']:.2f}" for r in (pt, jx))
    wire = _row(readme, "tiny fixture, CPU, on the wire (8 × 64 tokens, `build.py bench`)")
    for cell, r in zip(wire, (jx, pt)):
        assert cell.startswith(f"median TPOT {r['median_tpot_ms']:.2f} ms, TTFT {r['median_ttft_ms']:.1f} ms, "
                               f"healthy after {r['boot']['health_s']:.1f} s"), cell
    # no second set of figures for the same benchmark anywhere in the README
    quoted = set(re.findall(r"median TPOT ([\d.]+) ms", readme))
    assert quoted == {f"{r['median_tpot_ms']:.2f}" for r in (pt, jx)}, quoted
    engine = json.loads((res / "jax_vs_pytorch_cpu.json").read_text())
    decode = _row(readme, "tiny fixture, CPU, decode in the engine")
    assert decode[:2] == (f"{engine['jax_warm']['decode_tok_s_median']:.0f} tok/s",
                          f"{engine['pytorch']['decode_tok_s_median']:.0f} tok/s")
