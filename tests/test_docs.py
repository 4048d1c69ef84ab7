"""What the code, the tests and the docs cite is readable in the repository, and the docs' figures have one source."""
from __future__ import annotations

import argparse
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
            if not ((REPO / name).is_file() or (path.parent / name).is_file()):  # a link is relative
                missing.append(f"{path.relative_to(REPO)}: {name}")
    assert missing == []


def _row(text: str, name: str) -> tuple[str, ...]:
    m = re.search(rf"^\| {re.escape(name)} \|(.+)\|$", text, re.M)
    assert m, f"benchmarks/RESULTS.md has no row {name!r}"
    return tuple(c.strip() for c in m[1].split("|"))


def test_serving_cpu_figures_are_the_committed_results():
    """One source: the CPU serving figures in benchmarks/RESULTS.md are read off benchmarks/results/, and no other
    figures for them there or in the docs (which link to them)."""
    readme = (REPO / "benchmarks/RESULTS.md").read_text()
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
    # no second set of figures for the same benchmark anywhere in that page
    quoted = set(re.findall(r"median TPOT ([\d.]+) ms", readme))
    assert not any(re.search(r"median TPOT [\d.]+ ms", d.read_text()) for d in _docs())
    assert quoted == {f"{r['median_tpot_ms']:.2f}" for r in (pt, jx)}, quoted
    engine = json.loads((res / "jax_vs_pytorch_cpu.json").read_text())
    decode = _row(readme, "tiny fixture, CPU, decode in the engine")
    assert decode[:2] == (f"{engine['jax_warm']['decode_tok_s_median']:.0f} tok/s",
                          f"{engine['pytorch']['decode_tok_s_median']:.0f} tok/s")


# --- README and docs/ cannot rot: every link, file path and `build.py` flag they show exists --------------------

def _docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


# the repository's own top-level folders: a path under one of them in the docs must exist
TOP = sorted(p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "build"
             and not p.name.endswith(".egg-info")) + [".github", ".ci"]
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, TOP))})/[\w./{{}},*-]*[\w}}*])")


def _expand(path: str) -> list[str]:
    """`a/{b,c}.json` -> a/b.json, a/c.json."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m[1].split(",") for x in _expand(path[:m.start()] + alt + path[m.end():])]


def _exists(path: str) -> bool:
    return all(any(REPO.glob(p)) if "*" in p else (REPO / p).exists() for p in _expand(path.rstrip(".,:;")))


def paths_that_do_not_exist(doc: Path) -> list[str]:
    text = doc.read_text()
    bad = [f"link {t}" for t in LINK.findall(text)
           if "://" not in t and not (doc.parent / t).exists()]
    for code in CODE.findall(text) + re.findall(r"^    (.+)$", text, re.M):
        bad += [f"path {p}" for p in PATH.findall(code) if not _exists(p)]
    return sorted(set(bad))


def test_every_link_and_repository_path_in_the_docs_exists():
    missing = {str(d.relative_to(REPO)): bad for d in _docs() if (bad := paths_that_do_not_exist(d))}
    assert missing == {}


def test_a_missing_path_is_found(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("See [a](nothere.md), `serving/nothere.py`, `benchmarks/results/{g4dn_vllm_build,nope}.json` "
                   "and `serving/api/app.py`, `http://x/serving/api/app.py`.\n")
    assert paths_that_do_not_exist(doc) == ["link nothere.md", "path benchmarks/results/{g4dn_vllm_build,nope}.json",
                                            "path serving/nothere.py"]


def _commands(text: str) -> list[str]:
    """Every `build.py …` command shown: indented code lines (with `\\` continuations joined) and inline code."""
    text = re.sub(r"\\\n\s*", " ", text)
    found = []
    for chunk in CODE.findall(text) + re.findall(r"^    (.+)$", text, re.M):
        for m in re.finditer(r"build\.py((?:\s+[^\s#`|;&)]+)*)", chunk):
            found.append(m[1].split())
    return found


def unknown_flags(text: str) -> list[str]:
    from g5g import cli
    from serving.__main__ import build_parser as serving_parser

    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    serving_flags = set(serving_parser()._option_string_actions)
    bad = []
    for argv in _commands(text):
        name = argv[0] if argv and argv[0] in subs else "build"
        p = subs[name]
        if name == "bench" and "compare" in argv:
            p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices["compare"]
        known = set(p._option_string_actions) | (serving_flags if name == "serve" else set())
        for tok in argv:
            flag = re.match(r"\[?(--[\w-]+)", tok)
            if flag and flag[1] not in known:
                bad.append(f"build.py {name} {flag[1]}")
    return bad


def test_every_build_py_flag_in_the_docs_is_known_to_the_cli():
    bad = {str(d.relative_to(REPO)): b for d in _docs() if (b := unknown_flags(d.read_text()))}
    assert bad == {}


def test_an_unknown_flag_is_found():
    text = ("    python build.py smoke IMAGE --modle DIR \\\n        --expect X\n"
            "and `build.py serve --runtime jax --model D --max-model-len 8 --no-such` and `build.py --runtime vllm "
            "--psuh`; `build.py bench compare a.json --plot p.png`\n")
    assert sorted(unknown_flags(text)) == ["build.py build --psuh", "build.py serve --no-such", "build.py smoke --modle"]
