"""The plan: tags, labels, build args, the commands a build runs, and `--dry-run --json` (docs/CONTRACTS.md)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from g5g import buildx, manifest, render
from g5g.commands import build as build_cmd
from g5g.errors import UserError
from g5g.plan import make_plan
from devtools.server import free_port

REPO = Path(__file__).resolve().parent.parent
CONTRACT_KEYS = {"runtime", "tags", "platforms", "build_args", "env", "labels", "patches", "upstream", "commands"}


@pytest.fixture(scope="module")
def g5g():
    return manifest.load(REPO / "manifests", profile="g5g")


@pytest.fixture(scope="module")
def cpu():
    return manifest.load(REPO / "manifests", profile="cpu")


def test_tags_are_deterministic_and_documented(g5g, cpu):
    p = make_plan(g5g, registry="reg.example:5000/me")
    tags = {i.runtime: i.tags for i in p.images}
    assert tags["vllm"] == ("reg.example:5000/me/g5g-images:vllm-0.33.0-cu130-sm75", "reg.example:5000/me/g5g-images:vllm")
    assert tags["torch-base"][0] == "reg.example:5000/me/g5g-images:torch-base-2.14.0-cu130-sm75"
    assert tags["jax"][0].endswith(":jax-0.12.0.1-cu130-sm75")
    c = make_plan(cpu, profile="cpu", registry="127.0.0.1:5000")
    ctags = {i.runtime: i.tags for i in c.images}
    assert ctags["jax"] == ("127.0.0.1:5000/g5g-images:jax-0.10.2-cpu", "127.0.0.1:5000/g5g-images:jax-cpu")
    assert ctags["pytorch"][0] == "127.0.0.1:5000/g5g-images:pytorch-2.13.0-cpu"  # local version label dropped
    assert make_plan(g5g, registry="reg.example:5000/me").to_json() == p.to_json()


def test_no_two_images_of_any_profiles_share_a_tag():
    """g4dn's short alias (…:vllm-g4dn) must not be g5g's (…:vllm): a push of one would overwrite the other."""
    owner: dict[str, tuple[str, str]] = {}
    for profile in ("g5g", "g4dn", "cpu"):
        for image in make_plan(manifest.load(REPO / "manifests", profile=profile), profile=profile).images:
            assert len(image.tags) == 2, image.tags
            for tag in image.tags:
                assert tag not in owner, (tag, owner[tag], (profile, image.runtime))
                owner[tag] = (profile, image.runtime)
    assert {owner[t][0] for t in owner} == {"g5g", "g4dn", "cpu"}


def test_labels_carry_arch_list_pins_and_patch_digests(g5g, cpu):
    vllm = make_plan(g5g, runtime="vllm").images[0]
    assert vllm.labels["io.g5g.runtime"] == "vllm" and vllm.labels["io.g5g.profile"] == "g5g"
    assert vllm.labels["io.g5g.cuda-archs"] == "7.5"
    up = json.loads(vllm.labels["io.g5g.upstream"])
    assert up["vllm"] == "0.33.0" and up["torch"] == "2.14.0" and up["cuda"] == "13.0"
    assert json.loads(vllm.labels["io.g5g.patches"]) == [dict(p) for p in vllm.patches]
    assert all(k.startswith(("org.opencontainers.image.", "io.g5g.")) for k in vllm.labels)
    jax_cpu = make_plan(cpu, runtime="jax", profile="cpu").images[0]
    assert jax_cpu.labels["io.g5g.cuda-archs"] == "" and "cuda" not in jax_cpu.upstream



def test_images_carry_the_commit_they_are_built_from(g5g, tmp_path):
    """org.opencontainers.image.revision: what image_proof and vllm_build_report bind their reports to."""
    labels = [i.labels for i in make_plan(g5g, revision="f" * 40).images]
    assert labels and all(lb["org.opencontainers.image.revision"] == "f" * 40 for lb in labels)
    assert not any("org.opencontainers.image.revision" in i.labels for i in make_plan(g5g).images)
    assert build_cmd.git_revision(tmp_path) is None  # not a checkout: no label rather than a guess
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "serving/api").mkdir(parents=True)
    for f in ("serving/api/app.py", "notes.md"):
        (tmp_path / f).write_text("1")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert build_cmd.git_revision(tmp_path) == head
    (tmp_path / "notes.md").write_text("2")  # not an image input: the image is still the commit's
    assert build_cmd.git_revision(tmp_path) == head
    (tmp_path / "serving/api/app.py").write_text("2")
    assert build_cmd.git_revision(tmp_path) == head + "-dirty"

def test_vllm_build_args(g5g):
    a = make_plan(g5g, runtime="vllm").images[0].build_args
    assert a["TORCH_CUDA_ARCH_LIST"] == "7.5" and "PTX" not in a["TORCH_CUDA_ARCH_LIST"]
    assert a["VLLM_VERSION"] == "0.33.0" and len(a["VLLM_SDIST_SHA256"]) == 64
    assert a["MAX_JOBS"] == "auto" and a["NVCC_THREADS"] == "1" and "RUST_VERSION" not in a  # no Rust frontend (issue 51)
    assert not any(w in k for k in a for w in ("TOKEN", "SECRET", "PASSWORD"))


@pytest.mark.parametrize("name", ["HF_TOKEN", "AWS_SECRET_KEY", "PIP_PASSWORD", "GIT_CREDENTIALS"])
def test_a_secret_named_build_arg_is_refused(tmp_path, name):
    """A build arg ends up in the image's history: secrets travel as BuildKit secrets only."""
    shutil.copytree(REPO / "manifests", tmp_path / "manifests")
    runtime = tmp_path / "manifests" / "runtimes" / "pytorch.yaml"
    text = runtime.read_text()
    assert "\n  TORCH_BASE: base\n" in text
    runtime.write_text(text.replace("\n  TORCH_BASE: base\n", f"\n  TORCH_BASE: base\n  {name}: base\n"))
    with pytest.raises(UserError, match=f"args.{name}: secrets travel only as BuildKit secrets"):
        make_plan(manifest.load(tmp_path / "manifests", profile="g5g"), runtime="pytorch", repo_root=REPO)


def test_vllm_refused_on_cpu(cpu):
    with pytest.raises(UserError, match="vllm needs CUDA"):
        make_plan(cpu, runtime="vllm", profile="cpu")
    assert [i.runtime for i in make_plan(cpu, profile="cpu").images] == ["torch-base", "jax", "pytorch"]


def test_bad_flags(g5g):
    with pytest.raises(UserError, match="--platform linux/s390x"):
        make_plan(g5g, platforms="linux/s390x")
    with pytest.raises(UserError, match="--registry"):
        make_plan(g5g, registry="https://ghcr.io/me")
    with pytest.raises(UserError, match="--platform linux/amd64: profile g5g builds only linux/arm64"):
        make_plan(g5g, platforms="linux/arm64,linux/amd64")


def test_out_goes_anywhere_and_stays_relative_inside_the_checkout(g5g, tmp_path):
    root = g5g.root.parent
    assert make_plan(g5g, out="build").out == "build"
    assert make_plan(g5g, out=str(root / "gen" / "x")).out == "gen/x"  # inside: relative, as bake runs there
    assert make_plan(g5g, out="gen/../other").out == "other"
    outside = make_plan(g5g, out=str(tmp_path / "files"))
    assert outside.out == str(tmp_path / "files") and outside.bake_file == str(tmp_path / "files/docker-bake.json")
    assert all(i.dockerfile.startswith(str(tmp_path)) for i in outside.all_images)
    assert make_plan(g5g, out="../elsewhere").out == str(root.parent / "elsewhere")


def test_cpu_profile_builds_any_supported_platform(cpu):
    assert make_plan(cpu, profile="cpu", platforms="linux/arm64,linux/amd64").images[0].platforms == (
        "linux/arm64", "linux/amd64")


def test_commands_build_once_then_push_all_or_none(g5g):
    plain = make_plan(g5g, runtime="all")
    assert plain.commands() == [["docker", "buildx", "bake", "--file", "build/docker-bake.json",
                                 "torch-base", "vllm", "jax", "pytorch"]]
    pushed = make_plan(g5g, runtime="vllm", push=True, secrets=("id=ca-cert,src=/etc/ca.pem",))
    first, second = pushed.commands(metadata="build/m.json")
    assert "--push" not in first and second[-2:] == ["--push", "vllm"]
    assert ["--set", "*.secrets=id=ca-cert,src=/etc/ca.pem"] == first[5:7] == second[5:7]
    assert second[second.index("--metadata-file") + 1] == "build/m.json"


def test_sequential_builds_the_base_first_and_loads_it(cpu):
    p = make_plan(cpu, runtime="pytorch", profile="cpu", sequential=True)
    cmds = p.commands()
    assert cmds[0][-2:] == ["--load", "torch-base"] and cmds[1][-2:] == ["--load", "pytorch"]


def test_dry_run_json_contract(g5g):
    out = make_plan(g5g).to_json()
    assert [i["runtime"] for i in out["images"]] == ["torch-base", "vllm", "jax", "pytorch"]
    for img in out["images"]:
        assert set(img) == CONTRACT_KEYS
        assert all(isinstance(c, list) and c[:3] == ["docker", "buildx", "bake"] for c in img["commands"])
    vllm = out["images"][1]
    assert vllm["upstream"]["vllm"] == "0.33.0" and vllm["patches"][0]["path"].startswith("patches/vllm/0.33.0/")


def test_dry_run_json_subprocess_without_docker(tmp_path: Path):
    """`python build.py --runtime all --dry-run --json` on a machine with no docker on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in build_cmd.CA_ENV + ("HF_TOKEN",)}
    env["PATH"] = str(tmp_path)  # nothing there: no docker
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "--runtime", "all", "--dry-run", "--json"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert len(data["images"]) == 4 and all(set(i) == CONTRACT_KEYS for i in data["images"])
    assert not (tmp_path / "build").exists()  # a dry run writes nothing


def test_dry_run_in_a_pipe_prints_every_reference_whole():
    """A CI log or `| tee` is no terminal: rich would fit the table to 80 columns and cut or fold the tags."""
    argv = [sys.executable, str(REPO / "build.py"), "--runtime", "all", "--registry",
            "registry.example.com/a-rather-long/namespace-for-images", "--dry-run"]
    env = {**os.environ, "COLUMNS": "80"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    plan = json.loads(subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=60).stdout)
    assert r.returncode == 0, r.stderr
    assert "…" not in r.stdout
    words = r.stdout.split()
    assert all(tag in words for img in plan["images"] for tag in img["tags"])
    assert all("$ " + " ".join(cmd) in r.stdout.splitlines() for cmd in plan["commands"])


def test_build_summary_in_a_pipe_prints_every_tag_whole(cpu, tmp_path, buildx, monkeypatch, capsys):
    """The table after a build (here a failed one: the engine is unreachable) is copied from: no tag cut to "…"."""
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/g5g-docker.sock")
    monkeypatch.setenv("COLUMNS", "80")
    plan = make_plan(cpu, runtime="pytorch", profile="cpu", out=str(tmp_path / "out"),
                     registry="registry.example.com/a-rather-long/namespace-for-images")
    render.write(plan, REPO)
    assert build_cmd.execute(plan, REPO) == 1
    out = capsys.readouterr().out
    assert "Build failed" in out and "…" not in out
    assert all(tag in out.split() for tag in plan.images[0].tags), out


def test_manifests_outside_the_repository(tmp_path: Path):
    """--manifests DIR anywhere: the serving extra still comes from our pyproject.toml, not DIR's parent."""
    shutil.copytree(REPO / "manifests", tmp_path / "mine")
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "--manifests", str(tmp_path / "mine"),
                        "--runtime", "pytorch", "--dry-run", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [i["runtime"] for i in json.loads(r.stdout)["images"]] == ["pytorch"]


def test_cli_user_error_exit_code(tmp_path: Path):
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "--runtime", "vllm", "--profile", "cpu", "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "vllm needs CUDA" in r.stderr and "Traceback" not in r.stderr


def test_ca_cert_resolution(tmp_path: Path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    assert build_cmd.ca_cert_path(None, {"SSL_CERT_FILE": str(ca)}) == str(ca)
    assert build_cmd.ca_cert_path(str(ca), {}) == str(ca)
    assert build_cmd.ca_cert_path(None, {}) is None
    with pytest.raises(UserError, match="--ca-cert .*not found"):
        build_cmd.ca_cert_path(str(tmp_path / "nope.pem"), {})
    assert build_cmd.secrets(str(ca), {"HF_TOKEN": "hf_x"}) == (f"id=ca-cert,src={ca}", "id=hf-token,env=HF_TOKEN")


def test_our_patches_pass_the_pre_build_check(g5g):
    """The check the build runs first (see the test below): our patches apply to the pinned sdist."""
    plan = make_plan(g5g, runtime="vllm")
    build_cmd.check_patches(plan)


def test_the_build_runs_the_patch_check_before_writing_or_baking(tmp_path, docker_client, buildx):
    """`build.py --runtime vllm` asks g5g.patches about the pinned sdist before it writes or bakes anything: a wrong
    sdist pin stops it there, exit 2. The builder it names does not exist, so a build that skipped the check would
    fail at once in bake (exit 1) instead of compiling for hours."""
    from tests.fixtures.engine import engine_env

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "build.py", "--runtime", "vllm", "--sequential", "--out", str(out),
                        "--set", "vllm.sdist_sha256=" + "a" * 64], cwd=REPO, capture_output=True, text=True,
                       env={**engine_env(), "BUILDX_BUILDER": "g5g-no-such-builder"}, timeout=600)
    err = " ".join(r.stderr.split())
    assert r.returncode == 2, r.stdout + r.stderr
    # the sdist's digest against the pin (cached sdist), or the index it would come from (none cached, offline)
    assert "vllm-0.33.0.tar.gz: sha256" in err or "package index" in err, err
    assert not out.exists()


def test_missing_wheels_directory_is_one_line_before_any_build(cpu, tmp_path: Path):
    plan = make_plan(cpu, runtime="pytorch", profile="cpu")
    with pytest.raises(UserError, match=r"profiles/cpu.yaml: wheels: \.whl/ not found .*torch 2\.13\.0\+cpu"):
        build_cmd.check_contexts(plan, tmp_path)
    (tmp_path / ".whl").mkdir()
    build_cmd.check_contexts(plan, tmp_path)


def test_patch_check_uses_the_plans_sdist_pin():
    """--set vllm.sdist_sha256=… (or --manifests) is the pin the build uses: the pre-build check holds to it too."""
    m = manifest.load(REPO / "manifests", profile="g5g", overrides=["vllm.sdist_sha256=" + "a" * 64])
    with pytest.raises(UserError, match="vllm-0.33.0.tar.gz: sha256 .*pins a{64}"):
        build_cmd.check_patches(make_plan(m, runtime="vllm"))


def test_run_bake_streams_progress_and_keeps_the_log(tmp_path: Path):
    """run_bake with a real child process printing BuildKit's plain progress format."""
    script = ("print('#5 [vllm toolchain 2/6] RUN apt-get update'); "
              "print('#9 [jax 3/5] RUN pip install jax'); print('ERROR: failed to solve: boom'); raise SystemExit(3)")
    events = []
    rc = buildx.run_bake([sys.executable, "-c", script], tmp_path, tmp_path / "logs" / "b.log", ["vllm", "jax"],
                         lambda t, s: events.append((t, s)))
    assert rc == 3
    assert ("vllm", "2/6 RUN apt-get update") in events and ("jax", "3/5 RUN pip install jax") in events
    assert ("", "ERROR: failed to solve: boom") in events
    assert "failed to solve: boom" in (tmp_path / "logs" / "b.log").read_text()
    one = []  # a single target: BuildKit names only its stages ([toolchain 2/6]), still that target's progress
    buildx.run_bake([sys.executable, "-c", "print('#4 [toolchain 2/6] RUN rustup'); print('#1 [internal] load x')"],
                    tmp_path, tmp_path / "logs" / "c.log", ["vllm"], lambda t, s: one.append((t, s)))
    assert one == [("vllm", "2/6 RUN rustup")]


def test_metadata_digests(tmp_path: Path):
    meta = tmp_path / "m.json"
    meta.write_text(json.dumps({"vllm": {"containerimage.digest": "sha256:abc", "image.name": "x"}}))
    assert buildx.read_metadata(meta) == {"vllm": "sha256:abc"}
    assert buildx.read_metadata(tmp_path / "missing.json") == {}


def test_binfmt_check_reads_the_handler(tmp_path: Path):
    (tmp_path / "qemu-aarch64").write_text("enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\n")
    ok = buildx.check_binfmt(["linux/arm64", "linux/amd64"], machine="x86_64", binfmt_dir=str(tmp_path))
    assert [c.ok for c in ok] == [True]  # the host platform needs no handler
    (tmp_path / "qemu-aarch64").write_text("disabled\n")
    bad = buildx.check_binfmt(["linux/arm64"], machine="x86_64", binfmt_dir=str(tmp_path))[0]
    assert not bad.ok and "qemu-user-static" in bad.fix
    assert not buildx.check_binfmt(["linux/amd64"], machine="aarch64", binfmt_dir=str(tmp_path))[0].ok


def test_registry_check_against_a_loopback_server():
    """A real HTTP server on 127.0.0.1: /v2/ answering 401 is a registry; 404 is not; a closed port is unreachable."""
    import http.server
    import threading

    status = {"code": 401}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status["code"] if self.path == "/v2/" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        host = f"127.0.0.1:{srv.server_port}"
        assert buildx.check_registry(f"{host}/ns").ok
        status["code"] = 404
        c = buildx.check_registry(host)
        assert not c.ok and "HTTP 404" in c.detail
    finally:
        srv.shutdown()
        srv.server_close()
    free = free_port()
    c = buildx.check_registry(f"127.0.0.1:{free}")
    assert not c.ok and "unreachable" in c.detail


def test_preflight_without_docker_names_the_fix(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an environment with no docker CLI (a real condition, not a mock)
    checks = buildx.preflight(["linux/arm64"], None, sequential=False)
    assert [c.name for c in checks] == ["docker CLI"] and not checks[0].ok
    with pytest.raises(UserError, match="docker CLI: not found on PATH — fix: install the Docker CLI"):
        buildx.require(checks)


def test_a_registry_cache_gives_every_target_its_own_tag_read_always_written_on_push(cpu):
    """--cache REPO: each bake target (the bases it is built FROM too) reads REPO:<target>; only a pushing build,
    which has registry credentials, writes it — from its first bake on, so a finished base survives a later
    image failing."""
    def sets(plan):
        return [[a for a in argv if "cache-" in a] for argv in plan.commands()]

    pulled = make_plan(cpu, runtime="jax", profile="cpu", cache="localhost:5000/me/cache")
    assert sets(pulled) == [["jax.cache-from=type=registry,ref=localhost:5000/me/cache:jax"]]
    pushed = make_plan(cpu, runtime="jax", profile="cpu", cache="localhost:5000/me/cache", push=True)
    ref = "type=registry,ref=localhost:5000/me/cache:jax"
    assert sets(pushed) == [[f"jax.cache-from={ref}", f"jax.cache-to={ref},mode=max"]] * 2
    assert sets(make_plan(cpu, runtime="jax", profile="cpu")) == [[]]
    # torch-base's cache_mode is min: its image (with the wheel), never PyTorch's multi-GB build tree
    base = make_plan(cpu, runtime="pytorch", profile="cpu", cache="localhost:5000/me/cache", push=True)
    assert "torch-base.cache-to=type=registry,ref=localhost:5000/me/cache:torch-base,mode=min" in base.commands()[0]
    assert "pytorch.cache-to=type=registry,ref=localhost:5000/me/cache:pytorch,mode=max" in base.commands()[0]


@pytest.mark.parametrize("cache", ["ghcr.io/me/cache:v1", "ghcr.io/me/cache@sha256:" + "0" * 64, "Ghcr.io/x y"])
def test_a_cache_reference_with_a_tag_or_bad_characters_is_refused(cpu, cache):
    with pytest.raises(UserError, match=r"--cache .*: expected a registry repository without a tag"):
        make_plan(cpu, profile="cpu", cache=cache)


def test_a_failed_builds_error_line_is_printed_as_written(cpu, tmp_path, monkeypatch, capsys):
    """BuildKit's error quotes the RUN line: pip's extras (`cuda-toolkit[nvcc,cccl]`) are text, not rich markup."""
    line = 'ERROR: process "pip install \\"cuda-toolkit[nvcc,cccl,crt,nvvm,cudart]==13.0.3\\"" did not complete'

    def fake_bake(argv, repo_root, log_path, targets, on_event):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(line + "\n")
        on_event(targets[0], "[pytorch 2/5] RUN pip install x[y]")
        return 1
    monkeypatch.setattr(build_cmd.buildx, "run_bake", fake_bake)
    plan = make_plan(cpu, runtime="pytorch", profile="cpu", out=str(tmp_path / "out"))
    assert build_cmd.execute(plan, REPO) == 1
    assert "cuda-toolkit[nvcc,cccl,crt,nvvm,cudart]==13.0.3" in capsys.readouterr().err


def test_a_profile_of_two_archs_separates_them_in_the_tag_and_the_label():
    """sm75-86 in the tag (sm7586 would read as one arch), and the label `build.py inspect` reads back lists them
    with a space, as TORCH_CUDA_ARCH_LIST does."""
    from g5g import archlist
    two = manifest.load(REPO / "manifests", profile="g4dn", overrides=['profile.cuda.archs=["7.5", "8.6"]'])
    vllm = make_plan(two, runtime="vllm", profile="g4dn", registry="r.example").images[0]
    assert vllm.tags[0] == "r.example/g5g-images:vllm-0.33.0-cu130-sm75-86-g4dn"
    assert vllm.labels["io.g5g.cuda-archs"] == "7.5 8.6" == vllm.build_args["TORCH_CUDA_ARCH_LIST"]
    found = archlist.find({}, vllm.labels)
    assert found.source == "label:io.g5g.cuda-archs" and found.archs.native == ("7.5", "8.6")


@pytest.mark.parametrize("profile", ["g5g", "g4dn", "cpu"])
def test_the_planner_reads_each_runtime_resolved_once_and_never_the_manifest_again(monkeypatch, profile):
    """g5g/resolve.py evaluates the manifests' expressions once, into plain data; past that, planning asks the
    manifest nothing (no expression evaluated, no pin or source looked up)."""
    from g5g import plan as plan_mod, resolve, schema

    m = manifest.load(REPO / "manifests", profile=profile)
    want = make_plan(m, profile=profile, registry="r.example", rehearse=True).to_json()
    calls = []

    def resolve_then_close(*args, **kw):
        builds = resolve.resolve(*args, **kw)
        calls.append(list(builds))

        def closed(*_, **__):
            raise AssertionError("the planner went back to the manifest")
        monkeypatch.setattr(resolve, "_eval", closed)
        for name in ("pins_for", "source_for", "build_for"):
            monkeypatch.setattr(schema.Runtime, name, closed)
        return builds

    monkeypatch.setattr(plan_mod, "resolve", resolve_then_close)
    assert make_plan(m, profile=profile, registry="r.example", rehearse=True).to_json() == want
    assert len(calls) == 1 and calls[0] == [i["runtime"] for i in want["images"]]
