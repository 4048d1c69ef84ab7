"""A benchmark's result file, rewritten whole at every figure: a run cut short (a lease ending, a phase crashing)
keeps everything it measured before."""
from __future__ import annotations

import json
from pathlib import Path


class Results:
    """One JSON object on disk (`indent=1`), keys in the order they were first noted. `echo`: how many characters
    of each note go to stdout (the live log of a remote run); None prints all of it."""

    def __init__(self, path: Path, echo: int | None = 2000):
        self.path, self.echo, self.data = Path(path), echo, {}

    def note(self, **figures) -> None:
        self.data.update(figures)
        self.path.write_text(json.dumps(self.data, indent=1))
        print(json.dumps(figures)[:self.echo], flush=True)
