"""build.py --rehearse: the plan and the Dockerfiles of a rehearsal (every stage real, the long compiles cut to their
configure and a sample of objects), and rehearse-cmake.sh run for real with cmake and ninja.

Golden files: tests/golden/g5g-rehearse/ (G5G_UPDATE_GOLDEN=1 regenerates them).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import dockerfile
import pytest

from g5g import manifest, render
from g5g.cli import main
from g5g.plan import make_plan
from tests.fixtures.dockerfiles import stage_runs

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden" / "g5g-rehearse"
UPDATE = os.environ.get("G5G_UPDATE_GOLDEN") == "1"
WRAPPER = REPO / "dockerfiles" / "rehearse-cmake.sh"


def rehearsal(profile: str = "g5g", overrides: list[str] | None = None):
    m = manifest.load(REPO / "manifests", profile=profile, overrides=overrides, rehearse=True)
    plan = make_plan(m, profile=profile, rehearse=True)
    return plan, render.render(plan)


def test_golden_files():
    plan, files = rehearsal()
    names = {rel: "docker-bake.json" if rel.endswith(".json") else f"{Path(rel).parent.name}.Dockerfile"
             for rel in files}
    if UPDATE:
        shutil.rmtree(GOLDEN, ignore_errors=True)
        GOLDEN.mkdir(parents=True)
        for rel, text in files.items():
            (GOLDEN / names[rel]).write_text(text)
    assert set(names.values()) == {p.name for p in GOLDEN.iterdir()}
    for rel, text in files.items():
        assert text == (GOLDEN / names[rel]).read_text(), f"{rel} differs (G5G_UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("profile", ["g5g", "g4dn", "cpu"])
def test_dockerfiles_parse_and_declare_exactly_the_build_args(profile):
    plan, files = rehearsal(profile)
    for img in plan.all_images:
        cmds = dockerfile.parse_string(files[img.dockerfile])
        assert {c.value[0].split("=", 1)[0] for c in cmds if c.cmd == "ARG"} == set(img.build_args), img.runtime
        assert [c for c in cmds if c.cmd == "FROM"][-1].value[-1] == img.target
        assert [c.value[0] for c in cmds if c.cmd == "USER"][-1] == "1000:1000"


def test_the_rehearsal_is_data_the_real_build_unchanged():
    """Without --rehearse nothing of it shows; with it: the manifests' rehearse sections, -rehearsal tags, a label."""
    real = make_plan(manifest.load(REPO / "manifests", profile="g5g"), profile="g5g")
    plan, files = rehearsal()
    assert not any("REHEARSE" in t or "REHEARSAL" in t for t in render.render(real).values())
    vllm = next(i for i in plan.images if i.runtime == "vllm")
    objects = manifest.load(REPO / "manifests", profile="g5g").runtimes["vllm"].rehearse.objects
    assert objects and vllm.build_args["REHEARSE_OBJECTS"] == " ".join(objects)
    assert all(t.endswith("-rehearsal") for i in plan.images for t in i.tags)
    assert all(i.labels["io.g5g.rehearsal"] for i in plan.images)
    assert vllm.build_args["TORCH_BASE"].endswith("torch-base-2.14.0-cu130-sm75-rehearsal")
    text = files[vllm.dockerfile]
    # rehearse.set: no crates registry (Rust off), vLLM's external sources from the local tree, torch from the index
    assert "RUST_VERSION" not in vllm.build_args and "rustup" not in text and "--mount=type=bind,from=vllm-sources" in text
    assert vllm.contexts["vllm-sources"] == ".cache/vllm-sources/0.33.0"
    tb = next(i for i in plan.all_images if i.runtime == "torch-base")
    assert tb.context_vars["source"] == "pypi" and tb.build_args["TORCH_STANDIN_ARCHS"] == "8.0 9.0 10.0 12.0"
    assert 'check-sass.sh "${TORCH_STANDIN_ARCHS}"' in files[tb.dockerfile]
    # the compile step still runs setup.py (its configure), with rehearse-cmake.sh first on PATH
    assert 'PATH="/opt/g5g/rehearse:$PATH"' in text and "pip wheel -v --no-build-isolation" in text
    assert "check-sass.sh --only \"${TORCH_CUDA_ARCH_LIST}\"" in text.split("AS vllm-report")[0]


def test_user_set_wins_over_the_rehearsal():
    plan, _ = rehearsal(overrides=["profile.build.vllm_sources="])
    vllm = next(i for i in plan.images if i.runtime == "vllm")
    assert "vllm-sources" not in vllm.contexts


def test_dry_run_json_shows_the_rehearsal(capsys):
    assert main(["--runtime", "vllm", "--rehearse", "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rehearse"] is True
    img = out["images"][0]
    assert img["runtime"] == "vllm" and img["rehearse"]["objects"] and "compile cut" in img["rehearse"]["why"]
    assert main(["--runtime", "vllm", "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "rehearse" not in out and "rehearse" not in out["images"][0]


PROJECT = """cmake_minimum_required(VERSION 3.25)
project(p C)
add_custom_command(OUTPUT gen.c COMMAND ${CMAKE_COMMAND} -E copy ${CMAKE_CURRENT_SOURCE_DIR}/gen.in gen.c)
add_library(a SHARED a.c gen.c)
add_library(b SHARED b.c)
"""


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja")), reason="cmake and ninja not installed")
def test_rehearse_cmake_configures_for_real_and_builds_only_the_sample(tmp_path):
    src, build, out = tmp_path / "src", tmp_path / "build", tmp_path / "out"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(PROJECT)
    (src / "gen.in").write_text("int gen(void) { return 1; }\n")  # a generated source, as vLLM's Marlin kernels
    for n in ("a", "b"):
        (src / f"{n}.c").write_text(f"int {n}(void) {{ return 0; }}\n")
    env = {**os.environ, "REHEARSE_REAL_CMAKE": shutil.which("cmake"), "REHEARSE_OUT": str(out), "MAX_JOBS": "2",
           "REHEARSE_OBJECTS": "CMakeFiles/a.dir/gen.c.o"}
    build.mkdir()
    r = subprocess.run(["bash", str(WRAPPER), str(src), "-G", "Ninja"], cwd=build, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and (build / "build.ninja").is_file(), r.stderr  # configure: the real cmake
    r = subprocess.run(["bash", str(WRAPPER), "--build", ".", "-j=2", "--target=a", "--target=b"], cwd=build, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 97, r.stdout + r.stderr  # stops the wheel build on purpose
    assert (out / "objects" / "gen.c.o").is_file() and (build / "gen.c").is_file()  # with what it needs first
    assert not (build / "CMakeFiles/a.dir/a.c.o").exists() and not list(build.glob("lib*.so"))  # nothing else
    assert "cuda_objects_in_build 0" in (out / "sample.txt").read_text() and (out / "ninja_log").is_file()
    env["REHEARSE_OBJECTS"] = "CMakeFiles/a.dir/nope.c.o"
    r = subprocess.run(["bash", str(WRAPPER), "--build", "."], cwd=build, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "CMakeFiles/a.dir/nope.c.o is not a target" in r.stderr


def test_hadolint_clean(tmp_path):
    hadolint = shutil.which("hadolint") or str(Path(os.sys.executable).parent / "hadolint")
    plan, files = rehearsal()
    for img in plan.all_images:
        path = tmp_path / f"{img.runtime}.Dockerfile"
        path.write_text(files[img.dockerfile])
        r = subprocess.run([hadolint, "--config", str(REPO / ".hadolint.yaml"), str(path)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("source", ["pypi", "image"])
def test_the_stand_in_check_reads_a_declared_arch_list(source):
    """Every ${TORCH_STANDIN_ARCHS} the torch-base stage expands comes after its ARG (an undeclared ARG is empty, and
    an empty list passed the stand-in check: found with `--set torch-base.profiles.g4dn.source=image`)."""
    sets = [f"torch-base.profiles.g4dn.source={source}", "torch-base.image=127.0.0.1:5055/g5g-images:torch-base-g4dn"]
    plan, files = rehearsal("g4dn", sets)
    text = files[next(i for i in plan.all_images if i.runtime == "torch-base").dockerfile]
    stage = text.split("AS torch-base", 1)[1]
    uses = [n for n, ln in enumerate(stage.splitlines()) if "${TORCH_STANDIN_ARCHS}" in ln]
    arg = next(n for n, ln in enumerate(stage.splitlines()) if ln.startswith("ARG TORCH_STANDIN_ARCHS="))
    assert uses and arg < min(uses)
    assert "sys.exit(0 if want and set(want) <= set(flags)" in stage


def test_inspect_claims_no_coverage_for_a_rehearsal_image():
    """A rehearsal's torch-base carries the target's arch label (7.5) over a stand-in torch without sm_75: inspect
    must not say "covers 7.5" (exit 3: cannot tell), and says why."""
    from g5g import inspect
    plan, _ = rehearsal()
    labels = next(i for i in plan.all_images if i.runtime == "torch-base").labels
    cfg = {"config": {"Env": ["TORCH_CUDA_ARCH_LIST=7.5"], "Labels": labels}}
    r = inspect.result("reg/g5g-images:torch-base-rehearsal", None, "http", "7.5", {"linux/arm64": cfg})
    e = r["platforms"]["linux/arm64"]
    assert e["covered"] is None and "compile cut" in e["rehearsal"] and inspect.exit_code([r]) == inspect.UNKNOWN
    from g5g.commands.inspect import table
    assert "linux/arm64: a rehearsal (" in table(r).caption and "proves no kernel coverage" in table(r).caption
    real = {"config": {"Env": ["TORCH_CUDA_ARCH_LIST=7.5"], "Labels": {}}}
    assert inspect.result("x", None, "http", "7.5", {"linux/arm64": real})["platforms"]["linux/arm64"]["covered"]


# --- PyTorch's CUDA discovery, rehearsed (torch-discovery) ------------------------------------------------------------

def _stage_froms(text: str) -> dict[str, str]:
    return {c.value[-1]: c.value[0] for c in dockerfile.parse_string(text) if c.cmd == "FROM" and len(c.value) == 3}


@pytest.mark.parametrize("profile", ["g5g", "g4dn"])
def test_the_rehearsal_runs_torchs_cuda_discovery_in_the_compiles_environment(profile):
    """The rehearsal's torch-env and torch-headers stages are the real build's, word for word; torch-discovery
    starts from the header stage, configures with the compile step's environment, runs torch's own CMake modules
    from the pinned wheel, fails on what they do not find, and torch-base's image depends on it."""
    plan, files = rehearsal(profile)
    tb = next(i for i in plan.all_images if i.runtime == "torch-base")
    text = files[tb.dockerfile]
    disc = stage_runs(text, "torch-discovery")
    real = make_plan(manifest.load(REPO / "manifests", profile="g5g"), profile="g5g")
    real_tb = next(i for i in real.all_images if i.runtime == "torch-base")
    real_text = render.render(real)[real_tb.dockerfile]
    if profile == "g5g":
        for stage in ("torch-env", "torch-headers"):
            assert stage_runs(text, stage) == stage_runs(real_text, stage) != [], stage
    froms = _stage_froms(text)
    assert froms["torch-headers"] == "torch-env" and froms["torch-discovery"] == "torch-headers"
    assert _stage_froms(real_text)["torch-build"] == "torch-env"
    assert "COPY --from=torch-headers /report/torch-headers.log" in real_text.split("AS torch-build")[1]
    compile_step = next(r for r in stage_runs(real_text, "torch-build") if "pip wheel" in r)
    env = compile_step[compile_step.index('if [ "$MAX_JOBS" = auto ]'):compile_step.index('echo "building torch')]
    assert any(env in r for r in disc), "the discovery runs with the compile step's environment"
    # its own generator: the stage (as torch-build) has no make; CMake and Ninja are pinned build tools of torch-env
    cmake = next(r for r in disc if "cmake -G Ninja -S /tmp/torch-discovery" in r)
    assert "ninja==1.13.2" in tb.build_args["TORCH_BUILD_TOOLS"].split()
    assert "-DTORCH_CMAKE=/opt/torch-wheel/torch/share/cmake" in cmake
    for pattern in ("Could NOT find", "Cannot find", "[Tt]urning the option off", "NCCL_VERSION_CODE - not found"):
        assert pattern in cmake
    assert any('pip download --no-deps --only-binary=:all: --dest /tmp/torch-wheel "torch==${TORCH_VERSION}"' in r
               for r in stage_runs(text, "torch-headers"))
    assert "COPY --from=torch-discovery /report/torch-discovery.log /opt/g5g/torch-discovery.log" in text
    assert "COPY --from=torch-headers /report/torch-headers.log /opt/g5g/torch-headers.log" in text
    assert "torch-discovery" not in real_text  # the real build compiles instead
    assert {"dockerfiles/torch-discovery", "dockerfiles/check-torch.py", "dockerfiles/check-headers.py"} <= set(tb.copy)


@pytest.mark.skipif(not shutil.which("cmake"), reason="cmake not installed")
def test_the_discovery_project_needs_torchs_own_modules(tmp_path):
    """Without torch/share/cmake of the wheel the project stops at once, naming what is missing (no fallback)."""
    r = subprocess.run(["cmake", "-S", str(REPO / "dockerfiles/torch-discovery"), "-B", str(tmp_path / "b"),
                        f"-DTORCH_CMAKE={tmp_path / 'none'}"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no Caffe2/public/cuda.cmake" in r.stderr, r.stderr


def test_args_from_names_a_source_of_the_runtime(tmp_path):
    src = REPO / "manifests"
    dst = tmp_path / "manifests"
    shutil.copytree(src, dst)
    tb = dst / "runtimes" / "torch-base.yaml"
    tb.write_text(tb.read_text().replace("args_from: {source: build,", "args_from: {source: nope,"))
    from g5g.errors import UserError
    with pytest.raises(UserError, match=r"torch-base.yaml: rehearse.args_from.source: nope is not one of sources"):
        manifest.load(dst, profile="g5g", rehearse=True)
