"""What the code, the tests and the README cite is readable in the repository, and README figures have one source."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *patterns], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    return [REPO / p for p in out if (REPO / p).is_file()]


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
