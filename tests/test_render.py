"""Rendered Dockerfiles and docker-bake.json: pinned by golden files, parsed by BuildKit's parser, hadolint-clean.

Regenerate the golden files after an intended change:  G5G_UPDATE_GOLDEN=1 pytest tests/test_render.py
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import dockerfile
import pytest

from g5g import manifest, render
from g5g.errors import UserError
from g5g.plan import make_plan
from tests.fixtures.scratch_repo import repo_with_runtime

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("G5G_UPDATE_GOLDEN") == "1"
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")


def rendered(profile: str) -> tuple:
    plan = make_plan(manifest.load(REPO / "manifests", profile=profile), profile=profile)
    return plan, render.render(plan)


SECRET = "/run/secrets/ca-cert"
# The only ways a step may use the CA secret: test it is there, point a tool's variable or apt's CaInfo at it.
SECRET_USES = re.compile(r"\[ -s /run/secrets/ca-cert \]|\b[A-Z_]+=/run/secrets/ca-cert\b|"
                         r'CaInfo \\?"/run/secrets/ca-cert\\?"')


@pytest.mark.parametrize("profile", ["g5g", "g4dn", "cpu"])
def test_the_ca_certificate_is_never_copied_into_a_layer(profile):
    """--ca-cert travels as a BuildKit secret: mounted for the steps that fetch, only pointed at, never copied
    (a `cp` or `cat` of it, a COPY of a certificate would leave it in the image's layers)."""
    _, files = rendered(profile)
    uses = 0
    for path, text in files.items():
        if not path.endswith("Dockerfile"):
            continue
        for step in dockerfile.parse_string(text):
            line = " ".join(step.value)
            if step.cmd in ("COPY", "ADD"):
                assert not re.search(r"ca-cert|\.pem\b|\.crt\b", line, re.I), (path, step.original)
            if SECRET not in step.original:
                continue
            assert step.cmd == "RUN" and "--mount=type=secret,id=ca-cert" in step.original, (path, step.original)
            uses += step.original.count(SECRET)
            assert SECRET not in SECRET_USES.sub("", step.original), (path, SECRET_USES.sub("", step.original))
    assert uses


def golden_name(rel: str) -> str:
    p = Path(rel)
    return "docker-bake.json" if p.name == "docker-bake.json" else f"{p.parent.name}.Dockerfile"


@pytest.mark.parametrize("profile", ["g5g", "g4dn", "cpu"])
def test_golden_files(profile):
    _, files = rendered(profile)
    gdir = GOLDEN / profile
    if UPDATE:
        shutil.rmtree(gdir, ignore_errors=True)
        gdir.mkdir(parents=True)
        for rel, text in files.items():
            (gdir / golden_name(rel)).write_text(text)
    expected = {p.name for p in gdir.iterdir()}
    assert {golden_name(r) for r in files} == expected
    for rel, text in files.items():
        assert text == (gdir / golden_name(rel)).read_text(), f"{rel} differs from tests/golden/{profile}/ " \
                                                              f"(G5G_UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("profile", ["g5g", "g4dn", "cpu"])
def test_dockerfiles_parse_and_declare_exactly_the_build_args(profile):
    plan, files = rendered(profile)
    for img in plan.all_images:
        cmds = dockerfile.parse_string(files[img.dockerfile])
        declared = {c.value[0].split("=", 1)[0] for c in cmds if c.cmd == "ARG"}
        assert declared == set(img.build_args), img.runtime
        froms = [c for c in cmds if c.cmd == "FROM"]
        assert froms and froms[-1].value[-1] == img.target  # bake's `target` is the last stage
        users = [c.value[0] for c in cmds if c.cmd == "USER"]
        assert users[-1] == "1000:1000", f"{img.runtime} must end non-root"
        assert not any(c.cmd in ("ADD",) for c in cmds)
        text = files[img.dockerfile]
        assert "hf-token" not in text or "--mount=type=secret,id=hf-token" in text
        assert "PTX" not in re.sub(r"^#.*$", "", text, flags=re.M)


@pytest.mark.parametrize("profile", ["g5g", "g4dn", "cpu"])
def test_hadolint_clean_with_documented_ignores(profile, tmp_path):
    plan, files = rendered(profile)
    config = REPO / ".hadolint.yaml"
    ignores = re.findall(r"^\s+- (DL\d+|SC\d+)", config.read_text(), re.M)
    lines = config.read_text().splitlines()
    for rule in ignores:  # each global ignore has a comment right above it
        i = next(n for n, ln in enumerate(lines) if ln.strip() == f"- {rule}")
        assert lines[i - 1].strip().startswith("#"), f"{rule} ignored without a reason"
    for img in plan.all_images:
        path = tmp_path / f"{img.runtime}.Dockerfile"
        path.write_text(files[img.dockerfile])
        r = subprocess.run([HADOLINT, "--config", str(config), str(path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        text = files[img.dockerfile].splitlines()
        for n, ln in enumerate(text):  # inline ignores carry a reason on the line above
            if ln.startswith("# hadolint ignore="):
                assert text[n - 1].startswith("#"), f"{img.runtime}: {ln} without a reason"


def test_bake_links_images_to_the_torch_base_target():
    plan, files = rendered("g5g")
    bake = json.loads(files["build/docker-bake.json"])
    assert bake["group"]["default"]["targets"] == ["torch-base", "vllm", "jax", "pytorch"]
    base_tag = bake["target"]["torch-base"]["tags"][0]
    for name in ("vllm", "pytorch"):
        t = bake["target"][name]
        assert t["contexts"] == {base_tag: "target:torch-base"} and t["args"]["TORCH_BASE"] == base_tag
    assert "contexts" not in bake["target"]["jax"]
    for name, t in bake["target"].items():
        assert t["context"] == f"build/{name}" and t["dockerfile"] == "Dockerfile"
        assert t["labels"]["io.g5g.cuda-archs"] == "7.5" and t["platforms"] == ["linux/arm64"]


def test_cpu_bake_uses_the_wheels_dir_as_torch_base_context():
    _, files = rendered("cpu")
    t = json.loads(files["build/docker-bake.json"])["target"]["torch-base"]
    assert t["context"] == ".whl" and t["dockerfile"] == "../build/torch-base/Dockerfile"


def test_write_fills_the_build_contexts(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(REPO / "manifests", root / "manifests")
    shutil.copytree(REPO / "serving", root / "serving", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "patches", root / "patches")
    shutil.copy(REPO / "pyproject.toml", root)
    plan = make_plan(manifest.load(root / "manifests", profile="g5g"), out="out")
    render.write(plan, root)
    assert (root / "out/docker-bake.json").is_file()
    assert (root / "out/jax/serving/engine.py").read_text() == (REPO / "serving/engine.py").read_text()
    for p in plan.images[1].patches:
        assert (root / "out/vllm/patches" / Path(p["path"]).name).read_bytes() == (root / p["path"]).read_bytes()


def test_patch_step_applies_in_order_and_names_the_failing_patch(tmp_path, vllm_sdist):
    """Run the rendered patch RUN step with bash on a small tree: applies once, then stops naming the patch."""
    _, files = rendered("g5g")
    text = files["build/vllm/Dockerfile"].replace("\\\n", "")
    step = next(ln for ln in text.splitlines() if ln.startswith("RUN { git apply --check"))[4:]
    # The pinned sdist, cached or fetched here (tests/fixtures/vllm_sdist.py), or G5G_VLLM_SDIST.
    sdist = Path(os.environ.get("G5G_VLLM_SDIST", vllm_sdist.path))
    src = tmp_path / "patches"
    shutil.copytree(REPO / "patches/vllm/0.33.0", src)
    step = step.replace("/src/patches/", f"{src}/")
    tree = tmp_path / "vllm"
    tree.mkdir()
    m = manifest.load(REPO / "manifests")
    touched = [p.path for p in m.runtimes["vllm"].patches]
    names = subprocess.run(["grep", "-h", "^+++ b/", *[str(REPO / t) for t in touched]], capture_output=True,
                           text=True).stdout.split()
    members = [f"vllm-0.33.0/{n[2:]}" for n in names if n.startswith("b/")]
    subprocess.run(["tar", "-xzf", str(sdist), "-C", str(tree), "--strip-components=1", *members], check=True)
    env = {**os.environ, "VLLM_VERSION": "0.33.0"}
    first = subprocess.run(["bash", "-c", step], cwd=tree, capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr
    assert "applied 0001-triton-attn-turing-smem.patch" in first.stdout
    again = subprocess.run(["bash", "-c", step], cwd=tree, capture_output=True, text=True, env=env)
    assert again.returncode == 1
    assert "patch 0001-triton-attn-turing-smem.patch does not apply to vLLM 0.33.0" in again.stderr


def test_selection_renders_the_image_and_its_base_only():
    plan = make_plan(manifest.load(REPO / "manifests", profile="g5g"), runtime="pytorch")
    files = render.render(plan)
    assert sorted(files) == ["build/docker-bake.json", "build/pytorch/Dockerfile", "build/torch-base/Dockerfile"]
    assert json.loads(files["build/docker-bake.json"])["group"]["default"]["targets"] == ["torch-base", "pytorch"]
    jax = make_plan(manifest.load(REPO / "manifests", profile="g5g"), runtime="jax")
    assert sorted(render.render(jax)) == ["build/docker-bake.json", "build/jax/Dockerfile"]


def test_sequential_bake_has_no_named_contexts():
    plan = make_plan(manifest.load(REPO / "manifests", profile="cpu"), profile="cpu", sequential=True)
    bake = json.loads(render.render(plan)["build/docker-bake.json"])
    assert all("contexts" not in t for t in bake["target"].values())
    # the images still find the base by its tag
    assert bake["target"]["pytorch"]["args"]["TORCH_BASE"] == bake["target"]["torch-base"]["tags"][0]


def test_existing_torch_base_image_variant(tmp_path):
    """torch-base from an existing image (e.g. captured from a DLAMI host): parses, lints, still checks sm_75."""
    m = manifest.load(REPO / "manifests", profile="g5g",
                      overrides=["torch-base.source=image", "torch-base.image=registry.example/dlami-pytorch:2.14.0"])
    plan = make_plan(m, runtime="torch-base")
    img = plan.images[0]
    text = render.render(plan)[img.dockerfile]
    assert img.build_args == {"TORCH_BASE_IMAGE": "registry.example/dlami-pytorch:2.14.0", "TORCH_VERSION": "2.14.0",
                              "CUDA_CONSTRAINTS": " ".join(f"{k}=={v}" for k, v in m.profiles["g5g"].cuda.constraints.items())}
    assert img.upstream["base_image"] == "registry.example/dlami-pytorch:2.14.0"
    cmds = dockerfile.parse_string(text)
    assert {c.value[0].split("=", 1)[0] for c in cmds if c.cmd == "ARG"} == set(img.build_args)
    assert "'sm_75' in flags" in text and "git clone" not in text
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    r = subprocess.run([HADOLINT, "--config", str(REPO / ".hadolint.yaml"), str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_sm75_check_refuses_a_torch_without_sm75():
    """The torch-base check, run with this machine's torch (a CPU build: no CUDA arch flags), fails and says why."""
    pytest.importorskip("torch")
    _, files = rendered("g5g")
    text = files["build/torch-base/Dockerfile"].replace("\\\n", "")
    line = next(ln for ln in text.splitlines() if "_cuda_getArchFlags" in ln)
    code = line.removeprefix('RUN python3 -c "').removesuffix('"')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    import torch
    if "sm_75" in (getattr(torch._C, "_cuda_getArchFlags", str)() or ""):
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 1 and "lacks sm_75" in r.stderr, r.stderr


def test_buildx_reads_the_bake_file_and_our_secret_flags(tmp_path, buildx):
    """`docker buildx bake --print` (no engine needed) accepts the generated file and the argv the build runs."""
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    root = tmp_path / "repo"
    shutil.copytree(REPO / "serving", root / "serving", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "patches", root / "patches")
    plan = make_plan(manifest.load(REPO / "manifests", profile="g5g"), runtime="vllm",
                     secrets=(f"id=ca-cert,src={ca}", "id=hf-token,env=HF_TOKEN"))
    render.write(plan, root)
    argv = plan.commands()[-1]
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    r = subprocess.run([*argv[:-1], "--print", *argv[-1:]], cwd=root, capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    targets = json.loads(r.stdout)["target"]
    assert set(targets) == {"torch-base", "vllm"}  # the linked base comes along
    vllm = targets["vllm"]
    assert vllm["secret"] == [f"id=ca-cert,src={ca}", "id=hf-token,env=HF_TOKEN"]
    assert vllm["contexts"] == {plan.images[0].build_args["TORCH_BASE"]: "target:torch-base"}
    assert vllm["tags"] == list(plan.images[0].tags) and vllm["args"] == plan.images[0].build_args


def test_generate_writes_outside_the_checkout_and_bake_reads_it(tmp_path, buildx):
    """`generate --out DIR` anywhere: contexts under DIR are absolute, the checkout's wheels stay relative to it
    (bake runs there), and the torch base's Dockerfile is named absolutely; `bake --print` accepts the file."""
    out = tmp_path / "gen"
    r = subprocess.run([sys.executable, "build.py", "generate", "--profile", "cpu", "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"wrote {out / 'docker-bake.json'}" in r.stdout.splitlines()
    assert (out / "pytorch/serving/__main__.py").is_file()
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    p = subprocess.run([buildx, "buildx", "bake", "--file", str(out / "docker-bake.json"), "--print"], cwd=REPO,
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    targets = json.loads(p.stdout)["target"]
    assert targets["pytorch"]["context"] == str(out / "pytorch")
    assert targets["torch-base"]["context"] == ".whl"
    assert targets["torch-base"]["dockerfile"] == str(out / "torch-base/Dockerfile")
    assert not (REPO / "build" / "gen").exists()


def test_a_relative_generate_out_is_from_the_current_directory(tmp_path):
    """`generate --out gen` run from another directory writes there (as every command-line tool does), not into the
    checkout; without --out, build/ in the checkout."""
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "generate", "--runtime", "pytorch", "--profile", "cpu",
                        "--out", "gen"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "gen" / "docker-bake.json").is_file() and (tmp_path / "gen" / "pytorch" / "Dockerfile").is_file()
    assert f"wrote {tmp_path / 'gen' / 'docker-bake.json'}" in r.stdout.splitlines()
    assert not (REPO / "gen").exists()
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "--runtime", "pytorch", "--profile", "cpu",
                        "--dry-run", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "build/docker-bake.json" in json.loads(r.stdout)["commands"][0]  # the checkout's build/, bake runs there


# A new runtime is one manifest and one template: llama.cpp's server, written in a temp dir, no code change.
LLAMA_MANIFEST = """\
runtime: llama-cpp
description: llama.cpp's OpenAI-compatible server (llama-server), compiled for the profile's CUDA archs
order: 5
version_pin: llama-cpp
pins:
  llama-cpp: "7100"                # the release tag b7100
from: {image: "profile.cuda.devel_image if profile.cuda and profile.cuda.devel_image else profile.base_image"}
args:
  BASE_IMAGE: base
  LLAMA_CPP_VERSION: pins['llama-cpp']
  CUDA_ARCHS: {value: "profile.cuda.archs | map('replace', '.', '') | join(';')", if: profile.cuda}
port: 8080
"""
LLAMA_TEMPLATE = """\
{%- import "_macros.j2" as m -%}
{{ m.header(image, profile) }}
{%- set a = image.build_args %}
ARG BASE_IMAGE={{ a.BASE_IMAGE }}
FROM ${BASE_IMAGE} AS llama-cpp
ARG LLAMA_CPP_VERSION={{ a.LLAMA_CPP_VERSION }}
{%- if a.CUDA_ARCHS is defined %}
ARG CUDA_ARCHS="{{ a.CUDA_ARCHS }}"
{%- endif %}
{{ m.root() }}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \\
 && apt-get install -y --no-install-recommends ca-certificates cmake g++ git make \\
 && rm -rf /var/lib/apt/lists/*
RUN git clone --depth 1 --branch "b${LLAMA_CPP_VERSION}" https://github.com/ggml-org/llama.cpp /src/llama.cpp \\
 && cmake -S /src/llama.cpp -B /src/build{% if a.CUDA_ARCHS is defined %} -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS}"{% endif %} \\
 && cmake --build /src/build --target llama-server -j "$(nproc)" \\
 && cp /src/build/bin/llama-server /usr/local/bin/ && rm -rf /src
{{ m.user() }}
EXPOSE {{ image.context_vars.port }}
ENTRYPOINT ["llama-server", "--host", "0.0.0.0", "--port", "{{ image.context_vars.port }}"]
"""


@pytest.mark.parametrize("profile", ["g5g", "g4dn", "cpu"])
def test_a_new_runtime_is_a_manifest_and_a_template(profile, tmp_path):
    root = repo_with_runtime(tmp_path / "repo", "llama-cpp", LLAMA_MANIFEST, LLAMA_TEMPLATE)
    plan = make_plan(manifest.load(root / "manifests", profile=profile), profile=profile)
    assert [i.runtime for i in plan.images][-1] == "llama-cpp"
    img = plan.images[-1]
    suffix = {"g5g": "-cu130-sm75", "g4dn": "-cu130-sm75-g4dn", "cpu": "-cpu"}[profile]
    assert img.tags[0] == f"{plan.profile.registry}/g5g-images:llama-cpp-7100{suffix}"
    assert img.build_args.get("CUDA_ARCHS") == (None if profile == "cpu" else "75")
    files = render.render(plan)
    text = files[img.dockerfile]
    cmds = dockerfile.parse_string(text)  # BuildKit's parser
    assert {c.value[0].split("=", 1)[0] for c in cmds if c.cmd == "ARG"} == set(img.build_args)
    assert [c for c in cmds if c.cmd == "FROM"][-1].value[-1] == img.target
    assert [c.value[0] for c in cmds if c.cmd == "USER"][-1] == "1000:1000"
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    r = subprocess.run([HADOLINT, "--config", str(REPO / ".hadolint.yaml"), str(path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    bake = json.loads(files[plan.bake_file])
    assert bake["group"]["default"]["targets"][-1] == "llama-cpp"
    assert bake["target"]["llama-cpp"]["args"] == img.build_args and "contexts" not in bake["target"]["llama-cpp"]
    # the CLI takes it from the manifests too
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "--manifests", str(root / "manifests"), "--profile",
                        profile, "--runtime", "llama-cpp", "--dry-run", "--json"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert [i["runtime"] for i in json.loads(r.stdout)["images"]] == ["llama-cpp"]


def test_a_runtime_built_from_another_runtime_links_the_chain(tmp_path):
    """FROM pytorch (itself FROM torch-base): the bake file links both, a sequential build loads both bases first."""
    mdir = tmp_path / "manifests"
    shutil.copytree(REPO / "manifests", mdir)
    (mdir / "runtimes/pytorch-extra.yaml").write_text(
        "runtime: pytorch-extra\ndescription: pytorch and one more package\norder: 6\nversion_pin: torch\n"
        "pins: {torch: \"2.14.0\"}\nprofiles: {cpu: {pins: {torch: \"2.13.0+cpu\"}}}\n"
        "from: {runtime: pytorch}\nargs: {PYTORCH_IMAGE: base}\n")
    m = manifest.load(mdir, profile="cpu")
    plan = make_plan(m, profile="cpu", runtime="pytorch-extra", sequential=True, repo_root=REPO)
    img = plan.images[0]
    assert img.depends_on == ("torch-base", "pytorch")
    assert [i.target for i in plan.all_images] == ["torch-base", "pytorch", "pytorch-extra"]
    assert img.build_args["PYTORCH_IMAGE"] == plan.all_images[1].tags[0]
    assert [c[-1] for c in plan.commands()] == ["torch-base", "pytorch", "pytorch-extra"]
    linked = make_plan(m, profile="cpu", runtime="pytorch-extra", repo_root=REPO)
    assert linked.images[0].contexts == {plan.all_images[1].tags[0]: "target:pytorch"}
    (mdir / "runtimes/pytorch-extra.yaml").write_text(
        (mdir / "runtimes/pytorch-extra.yaml").read_text().replace("torch: \"2.13.0+cpu\"", "torch: \"2.12.0\""))
    with pytest.raises(UserError, match=r"pytorch-extra.yaml: profiles.cpu.pins.torch: 2.12.0 differs from "
                                        r"pytorch's torch 2.13.0\+cpu"):
        manifest.load(mdir, profile="cpu")


@pytest.mark.parametrize("profile", ["g5g", "g4dn", "cpu"])
def test_the_cuda_pytorch_image_has_triton_and_its_compiler(profile):
    """The PyTorch image's GPU paths (the compiled decode step, serving/torch_runtime/packed_matmul.py's kernel) need triton, pinned
    to torch's tested release (a source-built torch declares none), and a C compiler for its launcher; a CPU image
    needs neither."""
    _, files = rendered(profile)
    text = files["build/pytorch/Dockerfile"]
    cuda = profile != "cpu"
    assert ('pip install "triton==${TRITON_VERSION}"' in text) == cuda
    assert ("ARG TRITON_VERSION=3.8.0" in text) == cuda
    assert bool(re.search(r"apt-get install -y --no-install-recommends gcc libc6-dev python3-dev", text)) == cuda
