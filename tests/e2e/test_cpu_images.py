"""Build, push, inspect and smoke-test the CPU images of both servable runtimes, as a user would.

    python build.py --runtime jax --profile cpu --registry 127.0.0.1:PORT --push
    python build.py inspect IMAGE [--backend imagetools|http]
    python build.py smoke IMAGE --model TINY_GEMMA4 --prompt QUESTION --expect ANSWER

The base is the local debootstrap image (scripts/base-images.sh). Python packages come from PyPI inside RUN
steps, through the CA bundle given as a BuildKit secret. The pytorch image installs torch from the CPU wheel
in .whl/ (the cpu profile's `wheels` directory, sent to the build as the named context `wheels`): PyPI's
x86_64 torch is a CUDA build of several GB, which would dominate CI time and disk for no extra coverage.

The jax build doubles as the secret check: it gets a canary HF token and a canary CA bundle (the real bundle
plus a marker line, so pip still works) and neither may show up in `docker history`, the image config or
any pushed layer.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e import oci
from tests.e2e.harness import ROOT, plan_tag, unavailable
from tests.fixtures.helm import helm  # noqa: F401 - the fixture

pytestmark = pytest.mark.e2e

RUNTIMES = ("jax", "pytorch")
HOST_CA = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")


@pytest.fixture(scope="session")
def canaries(tmp_path_factory) -> dict:
    """A fake HF token and a CA bundle carrying a unique marker; both must stay out of the image."""
    if not HOST_CA.is_file():
        unavailable(f"no host CA bundle at {HOST_CA}: builds cannot reach PyPI")
    tag = secrets.token_hex(12)
    ca_marker = f"g5g-canary-ca-{tag}"
    ca = tmp_path_factory.mktemp("secrets") / "ca-bundle.pem"
    ca.write_text(HOST_CA.read_text() + f"\n# {ca_marker}\n")
    return {"hf_token": f"hf_canary{tag}", "ca_marker": ca_marker, "ca_file": str(ca)}


@pytest.fixture(scope="session")
def cpu_wheels() -> Path:
    """The cpu profile's wheel directory (.whl/) with torch's CPU wheel for Debian bookworm's Python 3.11."""
    wheels = ROOT / ".whl"
    wanted = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    if not (wheels / wanted).exists():
        sources = [Path(p) for p in os.environ.get("PIP_FIND_LINKS", "").split() if p] + [Path("/opt/wheels")]
        found = next((d / wanted for d in sources if (d / wanted).is_file()), None)
        if found is None:
            unavailable(f"{wanted} not in .whl/ nor in {', '.join(map(str, sources))}: the pytorch cpu image needs it")
        wheels.mkdir(exist_ok=True)
        try:
            os.link(found, wheels / wanted)
        except OSError:
            shutil.copy2(found, wheels / wanted)
    return wheels


@pytest.fixture(scope="session")
def built(engine, registry, canaries, request):
    """runtime → (image reference, build run); each image is built once per session, on first use."""
    cache: dict[str, tuple] = {}

    def build(runtime: str):
        if runtime not in cache:
            if runtime == "pytorch":
                request.getfixturevalue("cpu_wheels")
            # its own output directory: the arm64 build may be writing the checkout's build/ on another worker
            args = ["--runtime", runtime, "--profile", "cpu", "--registry", registry.host,
                    "--out", str(engine.logs / f"out-{runtime}")]
            ref = plan_tag(engine, *args)
            run = engine.cli(*args, "--push", "--ca-cert", canaries["ca_file"], log=f"build-{runtime}",
                             extra_env={"HF_TOKEN": canaries["hf_token"]})
            cache[runtime] = (ref, run)
        ref, run = cache[runtime]
        assert run.rc == 0, run.why()
        return ref

    yield build
    for ref, _ in cache.values():
        engine.forget(ref)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_build_and_push(built, runtime):
    ref = built(runtime)
    platforms = oci.platform_manifests(ref)
    assert list(platforms) == ["linux/amd64"], f"{ref}: pushed platforms {list(platforms)}"
    assert platforms["linux/amd64"]["layers"], f"{ref} has no layers"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_labels_read_back_from_registry(built, runtime):
    ref = built(runtime)
    cfg = oci.config(ref, "linux/amd64")
    labels = cfg["config"].get("Labels") or {}
    assert labels.get("io.g5g.runtime") == runtime
    assert labels.get("io.g5g.profile") == "cpu"
    assert labels.get("io.g5g.cuda-archs") == "", "a CPU image claims CUDA archs"
    upstream = json.loads(labels["io.g5g.upstream"])
    assert isinstance(upstream, dict) and upstream, labels["io.g5g.upstream"]
    assert isinstance(json.loads(labels["io.g5g.patches"]), list)
    assert any(k.startswith("org.opencontainers.image.") for k in labels), sorted(labels)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert labels["org.opencontainers.image.revision"].removesuffix("-dirty") == head, "not the commit built from"
    # The entrypoint is the shared server, as the contract says.
    argv = (cfg["config"].get("Entrypoint") or []) + (cfg["config"].get("Cmd") or [])
    assert "serving" in " ".join(argv), argv


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_inspect_both_backends_agree(engine, built, runtime):
    ref = built(runtime)
    _, digest = oci.get_manifest(ref)
    answers = {}
    for backend in ("imagetools", "http"):
        extra = ["--insecure"] if backend == "http" else []
        run = engine.cli("inspect", ref, "--json", "--backend", backend, *extra, log=f"inspect-{runtime}-{backend}")
        # A CPU image has no CUDA archs: 7.5 is not covered, which inspect reports with exit 1.
        assert run.rc == 1, run.why()
        answers[backend] = result = run.json()
        assert result["digest"] == digest
        entry = result["platforms"]["linux/amd64"]
        assert list(result["platforms"]) == ["linux/amd64"]
        assert entry["source"] == "label:io.g5g.cuda-archs" and not entry["cuda_archs"], entry
        assert entry["covered"] is False
    assert answers["imagetools"]["platforms"] == answers["http"]["platforms"]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_smoke_answers_with_the_tiny_model(engine, built, runtime, tiny_gemma4):
    from devtools.tiny_gemma4 import ANSWER, QUESTION

    ref = built(runtime)
    run = engine.cli("smoke", ref, "--model", str(tiny_gemma4), "--prompt", QUESTION,
                     "--expect", re.escape(ANSWER[:40]), "--timeout", "600", "--json", log=f"smoke-{runtime}",
                     timeout=900)
    assert run.rc == 0, run.why()


def test_secrets_stay_out_of_the_image(engine, built, canaries):
    ref = built("jax")
    needles = [canaries["hf_token"].encode(), canaries["ca_marker"].encode()]

    history = engine.docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", ref)
    if history.returncode != 0:  # not in the engine's store: take it from the registry
        assert engine.docker("pull", "-q", ref, timeout=600).returncode == 0
        history = engine.docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", ref)
    assert history.returncode == 0, history.stderr
    assert len(history.stdout.splitlines()) > 2, history.stdout
    for n in needles:
        assert n.decode() not in history.stdout, f"{n.decode()} in docker history"

    cfg = json.dumps(oci.config(ref, "linux/amd64")).encode()
    for n in needles:
        assert n not in cfg, f"{n.decode()} in the image config"

    # The scan reads real content: a file every image has is found; the canaries are not.
    found = oci.find_in_layers(ref, needles + [b"serving/api/app.py", b"ID=debian"])
    assert found[b"ID=debian"], "layer scan found not even /etc/os-release: it reads nothing"
    assert found[b"serving/api/app.py"], "the serving code is in no layer"
    for n in needles:
        assert not found[n], f"{n.decode()} in layers {found[n]}"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_image_runs_as_the_charts_pod_runs_it(engine, built, tiny_gemma4, helm, runtime):  # noqa: F811
    """The image with the chart's args and the pod's restrictions, as docker can give them: a read-only root
    with HOME and /tmp writable (the chart's emptyDirs), uid 1000, no capabilities, no privilege escalation, the
    model read-only where the chart mounts it, the chart's `port` (not the image's 8000). It serves."""
    import time

    import requests
    import yaml

    from devtools.server import free_port

    ref = built(runtime)
    if engine.docker("image", "inspect", ref).returncode != 0:   # pushed, not kept: take it from the registry
        assert engine.docker("pull", "-q", ref, timeout=600).returncode == 0
    chart = ROOT / "deploy" / "chart"
    r = subprocess.run([helm, "template", "gemma", str(chart), "-f", str(chart / f"values-{runtime}-g4dn.yaml"),
                        "--set", "port=9000"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    dep = next(d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] == "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    scratch = sorted(m["mountPath"] for m in c["volumeMounts"] if m["name"] in ("home", "tmp"))
    assert scratch == ["/home/g5g", "/tmp"]
    port, name = free_port(), f"g5g-chart-pod-{secrets.token_hex(4)}"
    run = engine.docker("run", "-d", "--name", name, "--read-only", *[a for p in scratch for a in
                        ("--tmpfs", f"{p}:uid=1000,gid=1000")], "--user", "1000:1000", "--cap-drop", "ALL",
                        "--security-opt", "no-new-privileges", "-v", f"{tiny_gemma4}:/models/gemma-4-E2B-it:ro",
                        "-p", f"127.0.0.1:{port}:9000", ref, *c["args"])
    assert run.returncode == 0, run.stderr
    try:
        deadline, healthy = time.monotonic() + 600, False
        while not healthy and time.monotonic() < deadline:
            try:
                healthy = requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except requests.RequestException:
                pass
            state = engine.docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip()
            assert healthy or state == "true", engine.docker("logs", "--tail", "40", name).stderr
            time.sleep(1)
        assert healthy, engine.docker("logs", "--tail", "40", name).stderr
        answer = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
            "model": "gemma-4-E2B-it", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert answer.status_code == 200, answer.text
    finally:
        engine.docker("rm", "-f", name)
