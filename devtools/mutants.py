"""Issue 41's mutation audit, re-run: each mutation in devtools/mutants.json (one line of the tree, `old` replaced by
`new`) is applied, its catching tests run, and the file restored. A mutation the tests pass is a survivor.

    .venv/bin/python -m devtools.mutants [-k SUBSTRING]     # exit 1 unless every one was caught

Run it on a clean tree (it rewrites files in place, restoring each in a finally)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = Path(__file__).with_name("mutants.json")


def load(path: Path = MUTANTS) -> list[dict]:
    return json.loads(path.read_text())


def apply(m: dict, root: Path = ROOT) -> str:
    """Write the mutation into its file; return the file's original text. ValueError unless `old` occurs once."""
    p = root / m["file"]
    text = p.read_text()
    if text.count(m["old"]) != 1:
        raise ValueError(f"{m['name']}: {m['file']} holds {text.count(m['old'])} copies of its line, not 1")
    p.write_text(text.replace(m["old"], m["new"]))
    return text


def run(m: dict, root: Path = ROOT) -> tuple[int, str]:
    """(pytest's exit status with the mutation applied: 1 its tests failed, 0 they passed; pytest's last line)."""
    original = apply(m, root)
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m["tests"]],
                           cwd=root, capture_output=True, text=True, timeout=1800)
    finally:
        (root / m["file"]).write_text(original)
    return r.returncode, (r.stdout.strip().splitlines() or ["(no output)"])[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only mutations whose item or name contains this")
    a = ap.parse_args(argv)
    survivors = 0
    for m in load():
        if a.k not in f"{m['item']}: {m['name']}":
            continue
        status, last = run(m)
        survivors += status != 1
        verdict = {1: "caught  ", 0: "SURVIVED"}.get(status, f"ERROR {status}")   # 2-5: pytest could not run them
        print(f"{verdict} {m['item']}: {m['name']} | {last}", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
