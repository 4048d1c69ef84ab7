"""devtools/mutants.py: every recorded mutation still names one line of the tree (so the audit can be re-run), and
the runner tells a caught mutation from a survivor."""
from __future__ import annotations

import pytest

from devtools import mutants


@pytest.mark.parametrize("m", mutants.load(), ids=lambda m: m["name"])
def test_each_mutation_names_one_line_of_the_tree(m):
    text = (mutants.ROOT / m["file"]).read_text()
    assert text.count(m["old"]) == 1 and m["old"] != m["new"]
    assert (mutants.ROOT / m["tests"][0]).is_file()


def test_the_runner_tells_a_caught_mutation_from_a_survivor(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "lib.py").write_text("LIMIT = 64\n")
    (tmp_path / "tests" / "test_lib.py").write_text(
        "import sys, pathlib\nsys.path.insert(0, str(pathlib.Path(__file__).parents[1]))\nimport lib\n\n"
        "def test_limit():\n    assert lib.LIMIT == 64\n")
    m = {"item": "t", "name": "limit", "file": "lib.py", "tests": ["tests/test_lib.py"]}
    assert mutants.run({**m, "old": "LIMIT = 64", "new": "LIMIT = 65"}, tmp_path)[0] == 1
    assert mutants.run({**m, "old": "LIMIT = 64", "new": "LIMIT = 64  # same"}, tmp_path)[0] == 0
    assert (tmp_path / "lib.py").read_text() == "LIMIT = 64\n"                 # restored either way
    with pytest.raises(ValueError, match="limit: lib.py holds 0 copies of its line, not 1"):
        mutants.apply({**m, "old": "LIMIT = 63", "new": "x"}, tmp_path)
