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


def base_image() -> str:
    """The workflow's BASE_IMAGE with no repository variable set: its default."""
    expr = _load(IMAGES)["env"]["BASE_IMAGE"]
    return re.fullmatch(r"\$\{\{ vars\.G5G_BASE_IMAGE \|\| '([^']+)' \}\}", expr).group(1)


def matrix_runtimes(job: dict, event: str = "push") -> list:
    """A job's matrix runtimes for an event: a list, or the build job's expression choosing one for pull requests."""
    value = job.get("strategy", {}).get("matrix", {}).get("runtime", [None])
    if isinstance(value, list):
        return value
    m = re.fullmatch(r"\$\{\{ fromJSON\(github\.event_name == 'pull_request' && '(.+?)' \|\| '(.+?)'\) \}\}", value)
    assert m, f"matrix.runtime: the rehearsal does not know {value}"
    return json.loads(m.group(1) if event == "pull_request" else m.group(2))


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

    base, build, jax = jobs["torch-base"], jobs["build"], jobs["jax"]
    assert "torch-base" in build["needs"], "vllm and pytorch build on torch-base's cache: build it first"
    runtimes = set(matrix_runtimes(build)) | {jax["env"]["RUNTIME"]}
    assert runtimes == {"vllm", "jax", "pytorch"} and base["env"]["RUNTIME"] == "torch-base"
    # torch-base can never land on the 14 GB standard runner: it runs on the builder the repository names (a label or
    # a JSON list of labels), and the plan job (which every build needs) fails at once, saying what to set.
    runner = "${{ startsWith(vars.G5G_BUILD_RUNNER, '[') && fromJSON(vars.G5G_BUILD_RUNNER) || vars.G5G_BUILD_RUNNER }}"
    assert base["runs-on"] == runner and build["runs-on"] == runner
    # jax installs wheels: GitHub's arm64 runner, and nothing from torch-base to wait for
    assert jax["runs-on"] == "ubuntu-24.04-arm" and jax["needs"] == "plan"
    assert base["needs"] == "plan" and "plan" in build["needs"]
    check = next(s for s in jobs["plan"]["steps"] if "G5G_BUILD_RUNNER" in str(s.get("env", {})))
    assert jobs["plan"]["steps"].index(check) <= 2 and "exit 1" in check["run"]
    env = {"PATH": "/usr/bin:/bin"}
    r = subprocess.run(["bash", "-eo", "pipefail", "-c", check["run"]], env={**env, "BUILD_RUNNER": ""},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "8 cores, 32 GB of memory and 100 GB of disk" in r.stdout
    for hosted in ("ubuntu-24.04-arm", '["ubuntu-24.04-arm"]', "ubuntu-latest"):  # GitHub's images: refused
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", check["run"]], env={**env, "BUILD_RUNNER": hosted},
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and "names a GitHub-hosted runner" in r.stdout and r.stdout.count("\n") == 1, hosted
    ok = subprocess.run(["bash", "-eo", "pipefail", "-c", check["run"]], env={**env, "BUILD_RUNNER": "graviton-xl"},
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "graviton-xl" in ok.stdout
    for value, rc in (('["self-hosted", "graviton"]', 0), ('["self-hosted", ', 1), ("[]", 1)):
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", check["run"]], env={**env, "BUILD_RUNNER": value},
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == rc, (value, r.stdout)
    for job in (base, build, jax):
        build_step = next(s for s in job["steps"] if s.get("name", "").startswith("Build"))
        if job is jax:  # On a hosted runner the disk is freed first.
            free = next(s for s in job["steps"] if "Free" in s.get("name", ""))
            assert free["if"] == "runner.environment == 'github-hosted'" and "rm -rf" in free["run"]
            assert job["steps"].index(free) < job["steps"].index(build_step)
        else:  # the builder's jobs never run on a hosted runner (test_the_runner_rules)
            assert not any("Free" in s.get("name", "") for s in job["steps"])
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
    jobs = _load(IMAGES)["jobs"]
    assert servable == set(matrix_runtimes(jobs["build"])) | {jobs["jax"]["env"]["RUNTIME"]}


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
               "REGISTRY": "ghcr.io/acme", "PUSH": push, "BASE_IMAGE": base_image(), "BUILDER": ""}
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


# --- the workflow rehearsed: each job's own build command, with its variables --------------------------------------

# The values a run on main of a repository `acme` with no repository variables set gives the expressions jobs use
# in env: (an expression not listed here fails the rehearsal: teach it the new one).
EXPRESSIONS = {
    "github.repository_owner": "acme",
    "vars.G5G_BUILDER": "",
    "github.event_name != 'pull_request' && (github.ref == 'refs/heads/main' || startsWith(github.ref, 'refs/tags/v'))":
        "true",
}


def _expand(value: str, runtime: str | None) -> str:
    def one(m: re.Match) -> str:
        expr = m.group(1).strip()
        if expr == "matrix.runtime" and runtime:
            return runtime
        if d := re.fullmatch(r"vars\.\w+ \|\| '([^']*)'", expr):
            return d.group(1)
        assert expr in EXPRESSIONS, f"the workflow rehearsal does not know ${{{{ {expr} }}}}"
        return EXPRESSIONS[expr]
    return re.sub(r"\$\{\{(.*?)\}\}", one, str(value))


def image_jobs() -> list[tuple[str, str | None, dict, str]]:
    """(job, matrix runtime, env, the Build step's script) for every job and matrix value that runs build.py to bake."""
    doc = _load(IMAGES)
    out = []
    for name, job in doc["jobs"].items():
        step = next((s for s in job["steps"] if s.get("name", "").startswith("Build") and "build.py" in s.get("run", "")),
                    None)
        if step is None:
            continue
        for rt in matrix_runtimes(job):
            env = {k: _expand(v, rt) for k, v in {**doc.get("env", {}), **job.get("env", {})}.items()}
            out.append((name, rt, env, step["run"]))
    return out


def _froms(text: str, args: dict[str, str]) -> list[tuple[str, str]]:
    """(stage, image reference) of every FROM, ARGs expanded as BuildKit does (build args over defaults)."""
    import dockerfile
    defaults: dict[str, str] = {}
    out = []
    for c in dockerfile.parse_string(text):
        if c.cmd == "ARG" and not out:  # global ARGs: before the first FROM
            k, _, v = c.value[0].partition("=")
            defaults[k] = v.strip('"')
        elif c.cmd == "FROM":
            ref = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), defaults.get(m.group(1), "")), c.value[0])
            out.append((c.value[2] if len(c.value) == 3 else "", ref))
    return out


def test_every_from_of_every_image_job_resolves(tmp_path):
    """Each job's own Build script runs with its variables and `python` recording the command; that command's plan is
    rendered as build.py would, and every FROM of every Dockerfile the bake builds must resolve on a runner that has
    nothing local: a stage of the same file, a target of the same bake (named context), or an image pinned by
    digest. The profile's local `g5g-local/trixie` base resolves nowhere in GitHub Actions."""
    from g5g.cli import build_parser
    from g5g.commands.build import plan_from_args
    from g5g import render
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text('#!/bin/sh\nprintf \'%s\\n\' "$@" > "$ARGV_FILE"\n')
    (shim / "python").chmod(0o755)
    jobs = image_jobs()
    assert {r or j for j, r, _, _ in jobs} == {"torch-base", "vllm", "pytorch", "jax", "build-pr"}  # every image
    for job, runtime, env, script in jobs:
        argv_file = tmp_path / f"{job}-{runtime}.argv"
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env={**env, "PATH": f"{shim}:/usr/bin:/bin", "ARGV_FILE": str(argv_file)})
        assert r.returncode == 0, r.stderr
        argv = argv_file.read_text().splitlines()
        assert argv[0] == "build.py", argv
        plan = plan_from_args(build_parser().parse_args(["build", *argv[1:]]), with_secrets=False)
        files = render.render(plan)
        targets = {i.target for i in plan.all_images}
        for img in plan.all_images:
            stages: set[str] = set()
            for stage, ref in _froms(files[img.dockerfile], img.build_args):
                named = img.contexts.get(ref, "")
                ok = (ref in stages or ref == "scratch" or (named.startswith("target:") and named[7:] in targets)
                      or re.search(r"@sha256:[0-9a-f]{64}$", ref))
                assert ok, (f"job {job}{f' ({runtime})' if runtime else ''}: {img.runtime}'s stage {stage} is FROM "
                            f"{ref!r}, which nothing in the workflow builds and no digest pins")
                stages.add(stage)


def test_builder_jobs_never_run_a_pull_request_from_a_fork():
    """A job whose runner is not one of GitHub's (a repository variable, or self-hosted) runs only this repository's
    code: its `if` rules out pull requests from forks (or pull requests altogether)."""
    hosted = re.compile(r"^(ubuntu|windows|macos)-[\w.-]+$")
    fork = "(github.event_name != 'pull_request' || github.event.pull_request.head.repo.full_name == github.repository)"
    checked = []
    for name, job in _load(IMAGES)["jobs"].items():
        labels = job["runs-on"] if isinstance(job["runs-on"], list) else [job["runs-on"]]
        if all(hosted.match(str(label)) for label in labels):
            continue
        cond = " ".join(str(job.get("if", "")).split())
        assert cond in ("github.event_name != 'pull_request'", SAME_REPO_PR) or cond.endswith("&& " + fork), \
            f"job {name} runs on {job['runs-on']} without a guard against fork PRs"
        checked.append(name)
    assert set(checked) >= {"torch-base", "build", "build-pr", "smoke"}


SAME_REPO_PR = "github.event_name == 'pull_request' && github.event.pull_request.head.repo.full_name == github.repository"


def test_pull_requests_from_this_repository_read_the_cache_with_a_read_only_login(tmp_path):
    """Issue 51, item 6: a pull request from this repository's branches logs in to GHCR with a token that can only
    read packages, and its build reads every target's registry cache and pushes nothing; a fork's pull request runs
    no job that logs in; every job whose token can write packages logs in only when it pushes, which no pull request
    does."""
    jobs = _load(IMAGES)["jobs"]
    pr = jobs["build-pr"]
    assert " ".join(pr["if"].split()) == SAME_REPO_PR
    assert pr["permissions"] == {"contents": "read", "packages": "read"}
    assert pr["env"]["PUSH"] == "false" and pr["env"]["RUNTIME"].split() == ["vllm", "pytorch"]
    login = next(s for s in pr["steps"] if "login-action" in s.get("uses", ""))
    assert "if" not in login and login["with"] == {"registry": "ghcr.io", "username": "${{ github.actor }}",
                                                   "password": "${{ secrets.GITHUB_TOKEN }}"}
    build = next(s for s in pr["steps"] if s.get("name", "").startswith("Build"))
    assert pr["steps"].index(login) < pr["steps"].index(build)
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text('#!/bin/sh\nprintf \'%s\\n\' "$@" >> "$ARGV_FILE"; echo >> "$ARGV_FILE"\n')
    (shim / "python").chmod(0o755)
    argv_file = tmp_path / "argv"
    env = {k: _expand(v, None) for k, v in {**_load(IMAGES).get("env", {}), **pr["env"]}.items()}
    r = subprocess.run(["bash", "-eo", "pipefail", "-c", build["run"]], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={**env, "PATH": f"{shim}:/usr/bin:/bin", "ARGV_FILE": str(argv_file)})
    assert r.returncode == 0, r.stderr
    calls = [c.split("\n") for c in argv_file.read_text().strip("\n").split("\n\n")]
    assert [c[c.index("--runtime") + 1] for c in calls] == ["vllm", "pytorch"]
    for argv in calls:
        assert "--push" not in argv and argv[argv.index("--cache") + 1] == "ghcr.io/acme/g5g-images-cache"
    # The plan of a build without --push reads every target's cache and writes none (g5g/plan.py cache_sets).
    from g5g.cli import build_parser
    from g5g.commands.build import plan_from_args
    sets = plan_from_args(build_parser().parse_args(["build", *calls[0][1:]]), with_secrets=False).cache_sets()
    assert any(a.endswith(".cache-from=type=registry,ref=ghcr.io/acme/g5g-images-cache:torch-base") for a in sets)
    assert not any(".cache-to=" in a for a in sets)
    for name, job in jobs.items():
        logins = [s for s in job["steps"] if "login-action" in s.get("uses", "")]
        if not logins or name == "smoke":          # smoke: pushes only, on the self-hosted G5g (never a PR)
            continue
        if job["permissions"].get("packages") == "write":
            assert all(s.get("if") == "env.PUSH == 'true'" for s in logins), name
            assert "github.event_name != 'pull_request' &&" in job["env"]["PUSH"], name
        else:
            assert " ".join(str(job.get("if", "")).split()) == SAME_REPO_PR, f"{name} logs in for forks' PRs"


def test_python_comes_from_a_venv_on_runners_not_githubs():
    """actions/setup-python only where the runner is GitHub's; every job that runs build.py first makes a venv from
    the runner's python3 and puts it on PATH (an Amazon Linux Graviton builder has no setup-python toolcache)."""
    for name, job in _load(IMAGES)["jobs"].items():
        runs = [s.get("run", "") for s in job["steps"]]
        if not any("build.py" in r for r in runs) or name in ("plan", "smoke"):
            continue
        setup = next(s for s in job["steps"] if "setup-python" in s.get("uses", ""))
        assert setup.get("if") == "runner.environment == 'github-hosted'", name
        venv = next(s for s in job["steps"] if "python3 -m venv" in s.get("run", ""))
        first_build = next(i for i, r in enumerate(runs) if "python build.py" in r)
        assert job["steps"].index(venv) < first_build, name
        assert '"$RUNNER_TEMP/venv/bin/pip" install -e .' in venv["run"] and "GITHUB_PATH" in venv["run"], name
        check = venv["run"].splitlines()[0]
        assert subprocess.run(["bash", "-c", check.replace("python3", sys.executable)]).returncode == 0
        old = subprocess.run(["bash", "-c", check.replace("(3, 11)", "(9, 0)").replace("python3", sys.executable)],
                             capture_output=True, text=True)
        assert old.returncode == 1 and "needs Python >= 3.11" in old.stderr


def test_a_persistent_builder_is_used_when_the_repository_names_one(tmp_path):
    """G5G_BUILDER: no docker-container builder is made for the job, and build.py bakes on the named one (which keeps
    BuildKit's cache mounts between jobs)."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text('#!/bin/sh\nprintf \'%s\\n\' "$@" > "$ARGV_FILE"\n')
    (shim / "python").chmod(0o755)
    for job, runtime, env, script in image_jobs():
        if job == "jax":
            assert env["BUILDER"] == ""  # GitHub's runner: a fresh builder
            continue
        setup = next(s for s in _load(IMAGES)["jobs"][job]["steps"] if "setup-buildx-action" in s.get("uses", ""))
        assert setup["if"] == "env.BUILDER == ''"
        for builder, want in (("g5g-persistent", ["--builder", "g5g-persistent"]), ("", [])):
            out = tmp_path / "argv"
            subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=ROOT, check=True, timeout=60,
                           env={**env, "BUILDER": builder, "PATH": f"{shim}:/usr/bin:/bin", "ARGV_FILE": str(out)})
            argv = out.read_text().splitlines()
            assert ("--builder" in argv) == bool(want) and (not want or argv[argv.index("--builder") + 1] == builder)


HOSTED = re.compile(r"^(ubuntu|windows|macos)-[\w.-]+$")


def test_the_runner_rules():
    """Issue 36, item 6. GitHub-hosted jobs stop at 6 hours (360 minutes), self-hosted ones at 5 days: every timeout
    fits its runner. The jobs that bake torch-base (a PyTorch compile: about 25-40 core-hours) never run on a hosted
    runner: their first step fails there with one line. A pull request compiles torch at most once: the torch-base
    job is skipped, and one build job bakes vllm and then pytorch on one builder, reading main's registry cache."""
    jobs = _load(IMAGES)["jobs"]
    for name, job in jobs.items():
        labels = job["runs-on"] if isinstance(job["runs-on"], list) else [job["runs-on"]]
        limit = 360 if all(HOSTED.match(str(label)) for label in labels) else 5 * 24 * 60
        assert 0 < job["timeout-minutes"] <= limit, (name, job["timeout-minutes"], limit)
    bakes_torch = [n for n, rt, _, _ in image_jobs() if rt != "jax" and n != "jax"]
    assert set(bakes_torch) == {"torch-base", "build", "build-pr"}
    for name in bakes_torch:
        job = jobs[name]
        assert not any(HOSTED.match(str(label)) for label in
                       (job["runs-on"] if isinstance(job["runs-on"], list) else [job["runs-on"]]))
        guard = job["steps"][0]
        assert guard["if"] == "runner.environment == 'github-hosted'", name
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", guard["run"]], capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and r.stdout.count("\n") == 1 and "6 hours" in r.stdout, (name, r.stdout)
    # pull requests: torch-base's and build's jobs are skipped and one job (build-pr) builds both images, torch-base
    # once; pushes build each image in its own job after torch-base's
    assert jobs["torch-base"]["if"] == jobs["build"]["if"] == "github.event_name != 'pull_request'"
    assert jobs["build-pr"]["env"]["RUNTIME"] == "vllm pytorch" and "matrix" not in str(jobs["build-pr"])
    assert sorted(matrix_runtimes(jobs["build"], "push")) == ["pytorch", "vllm"]
    assert "torch-base" in jobs["build"]["needs"] and jobs["build-pr"]["needs"] == "plan"
    for name in ("build", "build-pr"):
        script = next(s["run"] for s in jobs[name]["steps"] if s.get("name", "").startswith("Build"))
        assert "for runtime in $RUNTIME; do" in script and '--cache "$REGISTRY/g5g-images-cache"' in script
