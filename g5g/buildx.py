"""The edge between the plan and Docker: preflight checks and `docker buildx bake` runs, always as argv lists.

Checks return `Check`s (doctor prints them all; build stops at the first failing one with its fix).
`run_bake` streams BuildKit's plain progress, keeps the whole log on disk and reports per-target state.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import requests

from g5g.errors import UserError

QEMU_BINFMT = {"linux/arm64": "qemu-aarch64", "linux/amd64": "qemu-x86_64"}
HOST_PLATFORM = {"x86_64": "linux/amd64", "amd64": "linux/amd64", "aarch64": "linux/arm64", "arm64": "linux/arm64"}


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False  # a warning does not stop a build


def _run(argv: list[str], timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def check_docker_cli() -> Check:
    path = shutil.which("docker")
    if not path:
        return Check("docker CLI", False, "not found on PATH",
                     "install the Docker CLI (Debian: apt-get install docker.io; or docker-ce-cli)")
    return Check("docker CLI", True, path)


def check_engine() -> Check:
    try:
        r = _run(["docker", "version", "--format", "{{.Server.Version}}"])
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("docker engine", False, f"no answer ({e})", "start dockerd, or set DOCKER_HOST to a running engine")
    if r.returncode != 0 or not r.stdout.strip():
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        last = (r.stderr.strip().splitlines() or ["no server version"])[-1]
        return Check("docker engine", False, f"unreachable at {host}: {last}",
                     "start dockerd (bash scripts/provision.sh does it here), or export DOCKER_HOST=…")
    return Check("docker engine", True, f"server {r.stdout.strip()}")


def check_named_contexts(engine: Check) -> Check:
    """Bake's `contexts` need a BuildKit frontend with named contexts: Docker >= 23 or a docker-container builder."""
    m = re.search(r"server (\d+)\.", engine.detail)
    if not engine.ok or not m:
        return Check("named contexts", False, "unknown (no engine)", "see the docker engine check", warn=True)
    if int(m.group(1)) < 23:
        return Check("named contexts", False,
                     f"Docker {engine.detail.split()[-1]}'s built-in BuildKit lacks named contexts (bake `contexts`)",
                     "build with --sequential (torch-base first, found by tag), or use Docker >= 23 / a "
                     "docker-container builder", warn=True)
    return Check("named contexts", True, "supported by the engine's BuildKit")


def check_buildx() -> Check:
    try:
        r = _run(["docker", "buildx", "version"])
    except (OSError, subprocess.TimeoutExpired) as e:
        return Check("buildx", False, str(e), "install the buildx plugin into ~/.docker/cli-plugins/docker-buildx")
    if r.returncode != 0:
        return Check("buildx", False, (r.stderr.strip().splitlines() or ["not installed"])[-1],
                     "install buildx: Debian's docker-buildx package, or its binary as "
                     "~/.docker/cli-plugins/docker-buildx")
    return Check("buildx", True, r.stdout.strip())


def check_binfmt(platforms: Iterable[str], machine: str | None = None,
                 binfmt_dir: str = "/proc/sys/fs/binfmt_misc") -> list[Check]:
    """Foreign platforms need a QEMU binfmt handler so RUN steps execute."""
    host = HOST_PLATFORM.get(machine or os.uname().machine)
    out = []
    for p in platforms:
        if p == host:
            continue
        handler = QEMU_BINFMT.get(p, "")
        entry = Path(binfmt_dir) / handler
        try:
            enabled = entry.is_file() and entry.read_text().splitlines()[0].strip() == "enabled"
        except OSError:
            enabled = False
        if enabled:
            out.append(Check(f"binfmt {p}", True, f"{entry} enabled"))
        else:
            out.append(Check(f"binfmt {p}", False, f"{entry} missing or disabled: RUN steps for {p} cannot execute",
                             "apt-get install qemu-user-static binfmt-support (registers "
                             f"{handler}), or build on a {p} host"))
    return out


def check_registry(registry: str, insecure_hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> Check:
    """GET /v2/ answers 200 or 401 on any registry that can take a push."""
    host = registry.split("/", 1)[0]
    scheme = "http" if host.split(":")[0] in insecure_hosts else "https"
    url = f"{scheme}://{host}/v2/"
    try:
        r = requests.get(url, timeout=10)
    except requests.RequestException as e:
        return Check("registry", False, f"{url} unreachable ({type(e).__name__})",
                     f"start the registry or check the name/network (--registry {registry})")
    if r.status_code in (200, 401):
        return Check("registry", True, f"{url} answered {r.status_code}"
                     + (" (log in with docker login before --push)" if r.status_code == 401 else ""))
    return Check("registry", False, f"{url} answered HTTP {r.status_code}",
                 f"is {host} a Docker registry (API v2)? check --registry")


# --- builders: `docker buildx ls` ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Node:
    name: str
    endpoint: str  # "default", "unix:///…", "ssh://user@host", "kubernetes:///…"
    status: str  # running, inactive, stopped, error, …
    platforms: tuple[str, ...]  # what the node builds (its own, plus QEMU's where binfmt is registered there)
    buildkit: str = ""
    error: str = ""


@dataclass(frozen=True)
class Builder:
    name: str
    driver: str  # docker, docker-container, kubernetes, remote
    nodes: tuple[Node, ...]
    error: str = ""

    def covers(self, platform: str) -> tuple[Node, ...]:
        """The nodes that build `platform` (linux/amd64 also matches a node's linux/amd64/v2 … lists)."""
        return tuple(n for n in self.nodes if any(p == platform or p.startswith(platform + "/") for p in n.platforms))


def parse_builders(text: str) -> list[Builder]:
    """`docker buildx ls --format json` (buildx >= 0.13): one JSON object per builder per line (0.13.1 prints the
    current one twice when it is not the default context's: kept once)."""
    out: list[Builder] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        b = json.loads(line)
        if any(o.name == b["Name"] for o in out):
            continue
        nodes = tuple(Node(name=n.get("Name", ""), endpoint=n.get("Endpoint", ""), status=n.get("Status", ""),
                           platforms=tuple(n.get("Platforms") or ()), buildkit=n.get("Version", ""),
                           error=n.get("Err", "") or "")
                      for n in b.get("Nodes") or ())
        out.append(Builder(name=b["Name"], driver=b.get("Driver", ""), nodes=nodes, error=b.get("Err", "") or ""))
    return out


def list_builders() -> list[Builder]:
    """Every builder of this Docker CLI, with its nodes and their platforms. Raises UserError when buildx cannot
    say (no buildx, or one older than 0.13 without `ls --format json`)."""
    try:
        r = _run(["docker", "buildx", "ls", "--format", "json"], timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"docker buildx ls: cannot run ({e})") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"docker buildx ls --format json: {last} (buildx >= 0.13 lists builders as JSON)")
    try:
        return parse_builders(r.stdout)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"docker buildx ls --format json: unexpected output ({type(e).__name__}: {e})") from None


def current_builder() -> str | None:
    """The builder `docker buildx bake` uses without --builder (`docker buildx inspect`'s Name)."""
    try:
        r = _run(["docker", "buildx", "inspect"], timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^Name:\s*(\S+)", r.stdout, re.M) if r.returncode == 0 else None
    return m.group(1) if m else None


def check_builder(name: str, platforms: Iterable[str], builders: list[Builder],
                  current: str | None = None) -> list[Check]:
    """--builder NAME: it exists, can be used from here, and for each platform of the build one of its nodes lists
    it (a remote native node, or a local one with QEMU: buildx lists what the node's binfmt allows).

    A `docker`-driver builder is its Docker context's: buildx refuses it unless that context is the current one
    ("use `docker --context=NAME buildx`"), so it is checked against `current`."""
    found = next((b for b in builders if b.name == name), None)
    if found is None:
        known = ", ".join(b.name for b in builders) or "none"
        return [Check(f"builder {name}", False, f"no such builder (known: {known})",
                      f"docker buildx create --name {name} … (docs/building.md: \"Building on native arm64 nodes\"), or "
                      "pick one of `docker buildx ls`")]
    if found.error:
        return [Check(f"builder {name}", False, found.error, f"docker buildx inspect --bootstrap {name}")]
    if found.driver == "docker" and current is not None and name != current:
        return [Check(f"builder {name}", False, f"a docker-driver builder (context {name}'s engine); buildx uses it "
                      f"only from its own context, and the current builder is {current}",
                      f"docker context use {name} (or DOCKER_CONTEXT={name}), or a docker-container/kubernetes "
                      "builder (docs/building.md: \"Building on native arm64 nodes\")")]
    out = [Check(f"builder {name}", True, f"{found.driver}, {len(found.nodes)} node(s)")]
    for p in platforms:
        nodes = found.covers(p)
        if nodes:
            out.append(Check(f"builder {name} {p}", True, "on " + ", ".join(f"{n.name} ({n.endpoint})" for n in nodes)))
        else:
            inactive = [n.name for n in found.nodes if n.status != "running"]
            out.append(Check(f"builder {name} {p}", False,
                             f"no node of {name} lists {p}" + (f" ({', '.join(inactive)} not running: "
                                                               "platforms unknown until it boots)" if inactive else ""),
                             f"docker buildx create --append --name {name} --platform {p} ssh://USER@HOST (a native "
                             f"{p} Docker host), or docker buildx inspect --bootstrap {name}"))
    return out


def preflight(platforms: Iterable[str], registry: str | None, sequential: bool,
              builder: str | None = None) -> list[Check]:
    """The checks a build needs, in order; stops collecting after the first failure that blocks the rest.

    With a builder, its nodes' platforms replace the local binfmt check: a remote node builds natively."""
    checks = [check_docker_cli()]
    if not checks[-1].ok:
        return checks
    checks.append(check_buildx())
    checks.append(check_engine())
    if not checks[-1].ok:
        return checks
    nc = check_named_contexts(checks[-1])
    if not sequential:
        checks.append(nc)
    if builder:
        try:
            checks += check_builder(builder, platforms, list_builders(), current_builder())
        except UserError as e:
            checks.append(Check(f"builder {builder}", False, str(e), "install buildx >= 0.13"))
    else:
        checks += check_binfmt(platforms)
    if registry:
        checks.append(check_registry(registry))
    return checks


def require(checks: list[Check]) -> None:
    for c in checks:
        if not c.ok and not c.warn:
            raise UserError(f"{c.name}: {c.detail} — fix: {c.fix}")


# --- running bake ---------------------------------------------------------------------------------------------------

STEP_RE = re.compile(r"^#\d+ \[(?P<target>[\w.-]+)(?: (?P<stage>[\w.-]+))? ?(?P<step>\d+/\d+)?\] (?P<what>.*)$")
ERROR_RE = re.compile(r"^(#\d+ )?ERROR|^ERROR:|^error:|failed to solve", re.I)


def run_bake(argv: list[str], cwd: str | Path, log_path: Path, targets: list[str],
             on_event: Callable[[str, str], None] | None = None) -> int:
    """Run one bake argv (progress=plain) in cwd; every line goes to log_path; on_event(target, text) per step."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "BUILDKIT_PROGRESS": "plain"}
    with open(log_path, "a", buffering=1) as log:  # line-buffered: `tail -f` follows the build
        log.write("$ " + " ".join(argv) + "\n")
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, bufsize=1)
        except OSError as e:
            raise UserError(f"{argv[0]}: cannot run ({e})") from None
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            m = STEP_RE.match(line.rstrip())
            # Several targets: BuildKit prefixes the target name; one target: only its stage names appear.
            target = (m.group("target") if m and m.group("target") in targets else
                      targets[0] if m and len(targets) == 1 and m.group("target") != "internal" else None)
            if on_event and m and target:
                on_event(target, f"{m.group('step') or ''} {m.group('what')}".strip())
            elif on_event and ERROR_RE.search(line):
                on_event("", line.strip())
        return proc.wait()


def read_metadata(path: Path) -> dict[str, str]:
    """target -> image digest, from bake's --metadata-file (absent when nothing was exported)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {t: v.get("containerimage.digest", "") for t, v in data.items() if isinstance(v, dict)}


def last_error(log_path: Path) -> str:
    """The last `ERROR: …` line BuildKit wrote, for a one-line reason on failure."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((ln.strip() for ln in reversed(lines) if ln.startswith("ERROR:")), "")
