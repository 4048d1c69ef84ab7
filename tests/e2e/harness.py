"""The end-to-end harness: the engine the tests talk to, and `python build.py …` runs with their logs kept."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.fixtures.engine import engine_env, unavailable  # noqa: F401 - the e2e tests' names

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Engine:
    env: dict[str, str]
    logs: Path

    def cli(self, *args: str, log: str, timeout: float = 1800, extra_env: dict | None = None) -> "Run":
        """Run `python build.py ARGS…` in the repo root; output goes to a log file."""
        path = self.logs / f"{log}.log"
        env = {**self.env, **(extra_env or {})}
        start = time.monotonic()
        with open(path, "w") as out:
            out.write(f"$ build.py {' '.join(args)}\n")
            out.flush()
            try:
                proc = subprocess.run([sys.executable, "build.py", *args], cwd=ROOT, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = -9
        return Run(args=list(args), rc=rc, log=path, seconds=time.monotonic() - start)

    def docker(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def forget(self, ref: str) -> None:
        """Untag every local tag of ref's repository: the engine is shared and long-lived (build cache stays)."""
        tags = self.docker("images", "--format", "{{.Repository}}:{{.Tag}}", ref.rsplit(":", 1)[0]).stdout.split()
        if tags:
            self.docker("rmi", *tags)


@dataclass
class Run:
    args: list[str]
    rc: int
    log: Path
    seconds: float

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def why(self) -> str:
        return f"build.py {' '.join(self.args)} exited {self.rc} after {self.seconds:.0f} s; " \
               f"log {self.log}, last lines:\n{self.output[-4000:]}"

    def json(self):
        """The JSON document the command printed (the last top-level object or list in its output)."""
        text = self.output
        for start in [i for i, c in enumerate(text) if c in "{[" and (i == 0 or text[i - 1] == "\n")][::-1]:
            try:
                return json.JSONDecoder().raw_decode(text[start:])[0]
            except json.JSONDecodeError:
                continue
        raise AssertionError(f"no JSON in the output of {self.why()}")


def plan_tag(engine: Engine, *args: str) -> str:
    """The first full tag the build command would push, read from its own --dry-run --json plan."""
    run = engine.cli(*args, "--dry-run", "--json", log="plan-" + "-".join(a.strip("-").replace("/", "_") for a in args[:4]))
    assert run.rc == 0, run.why()
    plan = run.json()
    images = plan.get("images", plan) if isinstance(plan, dict) else plan
    runtime = args[args.index("--runtime") + 1]
    return next(i for i in images if i["runtime"] == runtime)["tags"][0]
