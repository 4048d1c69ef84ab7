"""End-to-end tests on a real Docker engine (scripts/provision.sh starts one; .ci/run always does).

Every test here is marked `e2e`. Without a reachable engine and buildx they are skipped, saying why.
Builds go through `python build.py …` exactly as a user types it; logs of every command are kept under
pytest's tmp dir and their tails are shown on failure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER_ENV = ROOT / ".cache" / "docker.env"


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.e2e)


def _engine_env() -> dict[str, str]:
    """os.environ plus what provision.sh wrote into .cache/docker.env (unless already set)."""
    env = dict(os.environ)
    if DOCKER_ENV.exists():
        for line in DOCKER_ENV.read_text().splitlines():
            if line.startswith("export ") and "=" in line:
                key, value = line[len("export "):].split("=", 1)
                env.setdefault(key.strip(), value.strip().strip("'\""))
    return env


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


@pytest.fixture(scope="session")
def engine(tmp_path_factory) -> Engine:
    env = _engine_env()
    try:
        import docker

        client = docker.DockerClient(base_url=env.get("DOCKER_HOST") or "unix:///var/run/docker.sock", timeout=10)
        client.ping()
        version = client.version().get("Version", "?")
        client.close()
    except Exception as e:  # noqa: BLE001 - any failure means: no engine to test against
        pytest.skip(f"no Docker engine reachable at {env.get('DOCKER_HOST', 'the default socket')} ({e.__class__.__name__}); "
                    "run `sudo bash scripts/provision.sh` (scripts/test.sh does when root)")
    buildx = subprocess.run(["docker", "buildx", "version"], env=env, capture_output=True, text=True)
    if buildx.returncode != 0:
        pytest.skip(f"docker engine {version} is up but buildx is missing ({buildx.stderr.strip()[:200]}); "
                    "scripts/provision.sh installs it")
    return Engine(env=env, logs=tmp_path_factory.mktemp("e2e-logs"))


def plan_tag(engine: Engine, *args: str) -> str:
    """The first full tag the build command would push, read from its own --dry-run --json plan."""
    run = engine.cli(*args, "--dry-run", "--json", log="plan-" + "-".join(a.strip("-").replace("/", "_") for a in args[:4]))
    assert run.rc == 0, run.why()
    plan = run.json()
    images = plan.get("images", plan) if isinstance(plan, dict) else plan
    runtime = args[args.index("--runtime") + 1]
    return next(i for i in images if i["runtime"] == runtime)["tags"][0]
