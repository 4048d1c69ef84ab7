"""The GitHub workflows users run: valid against GitHub's schema, clean under zizmor, and doing what docs/building.md says."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.y*ml"))
IMAGES = ROOT / ".github" / "workflows" / "images.yml"


def _tool(name: str) -> str:
    """The linter from the same environment as this pytest (pinned in pyproject), else from PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]' (pinned in pyproject.toml)")
    return found


def _load(path: Path) -> dict:
    # YAML 1.1 reads the key `on` as True; GitHub means the string.
    doc = yaml.safe_load(path.read_text())
    if True in doc:
        doc["on"] = doc.pop(True)
    return doc


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_there_are_workflows():
    assert IMAGES in WORKFLOWS


def test_schema():
    r = _run([_tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", *map(str, WORKFLOWS)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_zizmor_offline():
    r = _run([_tool("zizmor"), "--offline", "--no-progress", "--format", "plain", str(ROOT / ".github" / "workflows")])
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_actions_pinned_by_commit_sha(path: Path):
    uses = re.findall(r"^\s*(?:-\s*)?uses:\s*(\S+)", path.read_text(), re.M)
    assert uses
    for ref in uses:
        if ref.startswith("./"):
            continue
        assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", ref), f"{path.name}: {ref} is not pinned by commit SHA"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_permissions_minimal(path: Path):
    doc = _load(path)
    assert doc.get("permissions") == {}, f"{path.name}: top-level permissions must be {{}} (jobs ask for what they need)"
    for name, job in doc["jobs"].items():
        perms = job.get("permissions")
        assert isinstance(perms, dict), f"{path.name}: job {name} must declare its permissions"
        writes = {k for k, v in perms.items() if v == "write"}
        assert writes <= {"packages"}, f"{path.name}: job {name} writes {writes}"


def test_images_workflow_shape():
    doc = _load(IMAGES)
    jobs = doc["jobs"]
    assert set(doc["on"]["push"]["tags"]) == {"v*"} and doc["on"]["push"]["branches"] == ["main"]

    base, build = jobs["torch-base"], jobs["build"]
    assert "torch-base" in build["needs"], "vllm and pytorch build on torch-base's cache: build it first"
    runtimes = set(build["strategy"]["matrix"]["runtime"])
    assert runtimes == {"vllm", "jax", "pytorch"} and base["env"]["RUNTIME"] == "torch-base"
    # torch-base can never land on the 14 GB standard runner: it runs on the builder the repository names, and the
    # plan job (which every build needs) fails at once, saying what to set, when none is named.
    assert base["runs-on"] == "${{ vars.G5G_BUILD_RUNNER }}" and "ubuntu-24.04-arm" not in str(base["runs-on"])
    assert build["runs-on"] == "${{ matrix.runtime == 'jax' && 'ubuntu-24.04-arm' || vars.G5G_BUILD_RUNNER }}"
    assert base["needs"] == "plan" and "plan" in build["needs"]
    check = next(s for s in jobs["plan"]["steps"] if "G5G_BUILD_RUNNER" in str(s.get("env", {})))
    assert jobs["plan"]["steps"].index(check) <= 2 and "exit 1" in check["run"]
    env = {"PATH": "/usr/bin:/bin"}
    r = subprocess.run(["bash", "-eo", "pipefail", "-c", check["run"]], env={**env, "BUILD_RUNNER": ""},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "8 cores, 32 GB of memory and 100 GB of disk" in r.stdout
    ok = subprocess.run(["bash", "-eo", "pipefail", "-c", check["run"]], env={**env, "BUILD_RUNNER": "graviton-xl"},
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "graviton-xl" in ok.stdout
    for job in (base, build):
        # On a hosted runner the disk is freed first.
        free = next(s for s in job["steps"] if "Free" in s.get("name", ""))
        assert free["if"] == "runner.environment == 'github-hosted'" and "rm -rf" in free["run"]
        build_step = next(s for s in job["steps"] if s.get("name", "").startswith("Build"))
        assert job["steps"].index(free) < job["steps"].index(build_step)
        assert 'python build.py "${args[@]}"' in build_step["run"], "the workflow builds with the driver users run"
        assert "--cache" in build_step["run"] and "linux/arm64" in build_step["run"] and "--push" in build_step["run"]
        # Only main and tags push (and log in); pull requests never do.
        assert "pull_request" in job["env"]["PUSH"] and "refs/heads/main" in job["env"]["PUSH"]
        login = next(s for s in job["steps"] if "login-action" in s.get("uses", ""))
        assert login["if"] == "env.PUSH == 'true'"
        assert job["permissions"] == {"contents": "read", "packages": "write"}

    smoke = jobs["smoke"]
    assert smoke["runs-on"] == ["self-hosted", "g5g"]
    assert smoke["if"] == "github.event_name != 'pull_request'", "self-hosted runners must not run PR code"
    assert set(smoke["strategy"]["matrix"]["runtime"]) == runtimes
    runs = "\n".join(s.get("run", "") for s in smoke["steps"])
    assert "--gpus all" in runs and "build.py smoke" in runs and "build.py bench" in runs
    upload = next(s for s in smoke["steps"] if "upload-artifact" in s.get("uses", ""))
    assert "smoke-" in upload["with"]["path"] and "bench-" in upload["with"]["path"]
    assert "smoke" not in smoke["permissions"] and smoke["permissions"].get("packages") == "read"


def test_shell_steps_fail_on_pipe_errors():
    """GitHub's implicit shell is `bash -e` (no pipefail): `smoke … | tee` would pass on a failed smoke."""
    for path in WORKFLOWS:
        assert _load(path).get("defaults", {}).get("run", {}).get("shell") == "bash", path.name


def test_manifest_runtimes_are_all_built():
    runtime_dir = ROOT / "manifests" / "runtimes"
    servable = {p.stem for p in runtime_dir.glob("*.yaml")} - {"torch-base"}  # torch-base is built inside vllm's bake
    matrix = set(_load(IMAGES)["jobs"]["build"]["strategy"]["matrix"]["runtime"])
    assert servable == matrix


def test_no_expression_injection_in_run_steps():
    """Values from the github context reach shell steps through env:, never pasted into the script text."""
    for path in WORKFLOWS:
        for name, job in _load(path)["jobs"].items():
            for step in job["steps"]:
                assert "${{" not in step.get("run", ""), f"{path.name}: job {name}: ${{{{ }}}} inside run:"


def test_build_step_gives_every_bake_target_its_registry_cache(tmp_path, buildx):
    """Run the workflow's own build script with `python` shimmed to add `--dry-run --json`: the plan's bake
    commands, run with `--print` on the files `generate` writes, must be accepted by buildx, and every target
    (torch-base too) reads and, on a push, writes its own cache; a pull request only reads."""
    job = _load(IMAGES)["jobs"]["build"]
    script = next(s["run"] for s in job["steps"] if s.get("name", "").startswith("Build"))
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@" --dry-run --json\n')
    (shim / "python").chmod(0o755)
    out = tmp_path / "generated"  # never into the checkout
    gen = _run([sys.executable, "build.py", "generate", "--runtime", "vllm", "--profile", "g5g",
                "--registry", "ghcr.io/acme", "--out", str(out)])
    assert gen.returncode == 0, gen.stdout + gen.stderr
    for push in ("true", "false"):
        env = {"PATH": f"{shim}:/usr/bin:/bin", "HOME": str(Path.home()), "RUNTIME": "vllm",
               "REGISTRY": "ghcr.io/acme", "PUSH": push}
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        argv = json.loads(r.stdout)["commands"][-1]
        argv = [str(out / "docker-bake.json") if a.endswith("docker-bake.json") else a for a in argv]
        assert ("--push" in argv) == (push == "true")
        argv = [a for a in argv if a != "--push"]
        printed = subprocess.run([buildx, *argv[1:], "--print"], cwd=ROOT, capture_output=True, text=True,
                                 timeout=120, env={**env, "PATH": "/usr/bin:/bin",
                                                   "DOCKER_HOST": "unix:///nonexistent.sock"})
        assert printed.returncode == 0, printed.stderr[-3000:]
        targets = json.loads(printed.stdout)["target"]
        assert set(targets) == {"torch-base", "vllm"}
        for name, t in targets.items():
            ref = f"type=registry,ref=ghcr.io/acme/g5g-images-cache:{name}"
            assert t["cache-from"] == [ref], t
            # torch-base exports its image only (cache_mode: min), never PyTorch's multi-GB build tree.
            mode = "min" if name == "torch-base" else "max"
            assert t.get("cache-to") == ([f"{ref},mode={mode}"] if push == "true" else None), t
            assert t["platforms"] == ["linux/arm64"]
