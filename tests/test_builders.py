"""`--builder NAME` (passed to every `docker buildx bake`) and `build.py doctor`'s report of builders, nodes and
platforms, against the real `docker buildx ls` of this machine's engine.

A second builder here is a second Docker context on the same engine (buildx names its `docker`-driver builder
after the context): a `docker-container` builder would need the moby/buildkit image, which cannot be pulled here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from g5g import buildx, manifest, render
from g5g.errors import UserError
from g5g.plan import make_plan
from tests.fixtures.scratch_repo import repo_with_runtime
from tests.fixtures.engine import engine_env

REPO = Path(__file__).resolve().parent.parent
SECOND = "g5g-second"

TINY_MANIFEST = """\
runtime: tiny
description: nothing but a label, to show which builder ran the bake
order: 9
version_pin: tiny
pins: {tiny: "1"}
from: {image: "'scratch'"}
args: {}
"""
TINY_TEMPLATE = """\
FROM scratch AS tiny
LABEL io.g5g.test=builder
"""


@pytest.fixture(scope="module")
def cpu():
    return manifest.load(REPO / "manifests", profile="cpu")


def test_builder_goes_into_every_bake_right_after_bake(cpu):
    plan = make_plan(cpu, runtime="pytorch", profile="cpu", builder="g5g", sequential=True, push=True)
    cmds = plan.commands() + [c for i in plan.images for c in plan.image_commands(i)]
    assert len(cmds) >= 3
    assert all(c[:5] == ["docker", "buildx", "bake", "--builder", "g5g"] for c in cmds), cmds
    assert all("--builder" not in c for c in make_plan(cpu, profile="cpu").commands())


@pytest.mark.parametrize("name", ["-x", "a b", "", "g5g;rm"])
def test_a_builder_name_that_is_not_one_is_refused(cpu, name):
    with pytest.raises(UserError, match=r"--builder .*: not a builder name"):
        make_plan(cpu, profile="cpu", builder=name)


def test_dry_run_json_shows_the_builder(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "--runtime", "vllm", "--builder", "g5g-arm",
                        "--dry-run", "--json"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert all(c[3:5] == ["--builder", "g5g-arm"] for c in data["commands"] + data["images"][0]["commands"])


def test_builder_coverage_names_the_nodes_and_the_fix():
    remote = buildx.Builder("g5g", "docker-container", (
        buildx.Node("g5g0", "unix:///var/run/docker.sock", "running", ("linux/amd64", "linux/amd64/v2")),
        buildx.Node("g5g1", "ssh://ec2-user@graviton", "running", ("linux/arm64", "linux/arm/v7"))))
    ok = buildx.check_builder("g5g", ["linux/arm64", "linux/amd64"], [remote])
    assert all(c.ok for c in ok) and "g5g1 (ssh://ec2-user@graviton)" in ok[1].detail and "g5g0" in ok[2].detail
    amd_only = buildx.Builder("x86", "docker", (buildx.Node("x86", "default", "running", ("linux/amd64",)),))
    bad = buildx.check_builder("x86", ["linux/arm64"], [amd_only])
    assert not bad[1].ok and "docker buildx create --append --name x86 --platform linux/arm64" in bad[1].fix
    missing = buildx.check_builder("nope", ["linux/arm64"], [remote, amd_only])
    assert len(missing) == 1 and not missing[0].ok and "known: g5g, x86" in missing[0].detail


# --- against the real engine ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_builders(buildx, docker_client, tmp_path_factory):
    """This machine's engine seen through a private Docker config whose current context is a second one: buildx
    then lists two builders, `g5g-second` (current, running) and `default` (the default context's socket, where no
    engine listens here: an error). The environment to run docker and build.py in."""
    env = engine_env()
    host = env.pop("DOCKER_HOST")  # the context says where the engine is
    config = tmp_path_factory.mktemp("docker-config")
    plugins = Path(env.get("DOCKER_CONFIG", Path.home() / ".docker")) / "cli-plugins"
    if plugins.is_dir():  # the buildx plugin, where provision.sh unpacked it
        (config / "cli-plugins").symlink_to(plugins)
    env["DOCKER_CONFIG"] = str(config)
    for argv in (["context", "create", SECOND, "--docker", f"host={host}"], ["context", "use", SECOND]):
        r = subprocess.run(["docker", *argv], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
    return env


@pytest.fixture
def in_second(two_builders, monkeypatch):
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    monkeypatch.setenv("DOCKER_CONFIG", two_builders["DOCKER_CONFIG"])


def test_list_builders_parses_the_real_buildx_ls(in_second):
    builders = buildx.list_builders()
    assert sorted(b.name for b in builders) == ["default", SECOND], builders  # 0.13.1 prints the current one twice
    second, default = sorted(builders, key=lambda b: b.name != SECOND)
    assert second.driver == "docker" and len(second.nodes) == 1 and not second.error
    node = second.nodes[0]
    assert node.status == "running" and node.endpoint == SECOND and node.buildkit
    host = buildx.HOST_PLATFORM[os.uname().machine]
    assert host in node.platforms
    assert buildx.current_builder() == SECOND
    assert [c.ok for c in buildx.check_builder(SECOND, [host], builders, SECOND)] == [True, True]
    assert "Cannot connect to the Docker daemon" in default.error
    assert not buildx.check_builder("default", [host], builders, SECOND)[0].ok


def test_doctor_reports_builders_nodes_and_platforms(two_builders):
    def doctor(builder):
        return subprocess.run([sys.executable, str(REPO / "build.py"), "doctor", "--profile", "cpu", "--builder",
                               builder, "--registry", "127.0.0.1:1"], capture_output=True, text=True,
                              env=two_builders, timeout=120)
    r = doctor(SECOND)
    out = r.stdout
    assert f"ok   builder {SECOND}: docker, 1 node(s)" in out, out + r.stderr
    assert f"ok   builder {SECOND} linux/amd64: on {SECOND} ({SECOND})" in out, out
    assert "builders (docker buildx ls):" in out and f"  {SECOND} (docker) [current, --builder]" in out, out
    node_line = next(ln for ln in out.splitlines() if ln.startswith(f"    node {SECOND} {SECOND} running"))
    assert "linux/amd64" in node_line and "buildkit" in node_line, out
    assert "  default (): Cannot connect to the Docker daemon" in out, out
    # the registry at 127.0.0.1:1 is down: doctor fails on that, and only that
    assert r.returncode == 1 and [ln.split(":")[0] for ln in out.splitlines() if ln.startswith("FAIL")] == \
        ["FAIL registry"], out
    r = doctor("default")
    assert r.returncode == 1 and "FAIL builder default: Cannot connect to the Docker daemon" in r.stdout, r.stdout


def test_an_unknown_builder_stops_the_build_in_one_line(two_builders):
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "--profile", "cpu", "--runtime", "jax",
                        "--builder", "nope", "--out", "build/builder-test"], capture_output=True, text=True,
                       env=two_builders, timeout=120, cwd=REPO)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: builder nope: no such builder (known: " in r.stderr and SECOND in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (REPO / "build/builder-test").exists()


def test_the_bake_runs_on_the_named_builder(in_second, tmp_path):
    """Our argv, with --builder, through the real buildx: the named builder builds; another is buildx's error (so
    the flag reaches buildx, not only our preflight)."""
    root = repo_with_runtime(tmp_path / "repo", "tiny", TINY_MANIFEST, TINY_TEMPLATE)
    m = manifest.load(root / "manifests", profile="cpu")
    for builder, error in ((SECOND, None), ("default", "use `docker --context=default buildx`"),
                           ("g5g-missing", 'no builder "g5g-missing" found')):
        plan = make_plan(m, runtime="tiny", profile="cpu", builder=builder, registry="127.0.0.1:5999/t")
        render.write(plan, root)
        (argv,) = plan.commands()
        log = tmp_path / f"{builder}.log"
        rc = buildx.run_bake(argv, root, log, ["tiny"])
        text = log.read_text()
        assert f"bake --builder {builder} --file" in text.splitlines()[0]
        assert (rc == 0) == (error is None), text
        assert error is None or error in text, text
