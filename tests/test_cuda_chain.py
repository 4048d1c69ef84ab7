"""The CUDA build chain as generated: each defect a review found in the g5g Dockerfiles, pinned on the real output.

Stages are read with BuildKit's own parser (`dockerfile`), so a test sees what the builder sees.
"""
from __future__ import annotations

import re
from pathlib import Path

import dockerfile
import pytest

from g5g import manifest, render
from g5g.errors import UserError
from g5g.plan import make_plan

REPO = Path(__file__).resolve().parent.parent
DIGEST = "sha256:" + "ab" * 32


def stages(profile: str, runtime: str, overrides: list[str] | None = None) -> dict[str, list]:
    """Stage name -> its instructions (the FROM first) of the rendered Dockerfile."""
    plan = make_plan(manifest.load(REPO / "manifests", profile=profile, overrides=overrides), profile=profile)
    image = next(i for i in plan.all_images if i.runtime == runtime)
    out: dict[str, list] = {"#global": []}  # ARGs before the first FROM
    current: list = out["#global"]
    for c in dockerfile.parse_string(render.render(plan)[image.dockerfile]):
        if c.cmd == "FROM":
            current = out.setdefault(c.value[-1] if len(c.value) == 3 else f"#{len(out)}", [])
        current.append(c)
    return out


def runs(stage: list) -> str:
    return "\n".join(c.value[0] for c in stage if c.cmd == "RUN")


def arg(stage: list, name: str) -> str | None:
    return next((c.value[0].split("=", 1)[1] for c in stage if c.cmd == "ARG" and c.value[0].startswith(name + "=")),
                None)


def test_vllm_toolchain_starts_from_the_devel_image_and_never_installs_the_toolkit_with_apt():
    s = stages("g5g", "vllm")
    assert s["toolchain"][0].value[0] == "${CUDA_DEVEL_IMAGE}"
    for name, stage in s.items():
        assert not re.search(r"apt-get install[^&]*cuda-toolkit", runs(stage)), f"{name}: apt hits held packages"
    # torch-base's environment comes along instead of a second torch.
    copies = [c.original for c in s["toolchain"] if c.cmd == "COPY"]
    assert any("--from=torch-base-image /opt/venv /opt/venv" in c for c in copies)


def test_cuda_bases_can_be_pinned_by_digest_and_a_bad_digest_names_the_key():
    devel = f"nvidia/cuda:13.2.1-cudnn-devel-ubuntu24.04@{DIGEST}"
    s = stages("g5g", "vllm", [f"profile.cuda.devel_image={devel}"])
    assert any(c.cmd == "ARG" and c.value[0] == f"CUDA_DEVEL_IMAGE={devel}" for c in s["#global"])
    with pytest.raises(UserError, match=r"g5g.yaml: cuda.runtime_image: .*@sha256: and 64 hex"):
        manifest.load(REPO / "manifests", profile="g5g",
                      overrides=["profile.cuda.runtime_image=nvidia/cuda:13.2.1-cudnn-runtime-ubuntu24.04@sha256:abc"])


@pytest.mark.parametrize("profile", ["g5g", "g4dn"])
def test_max_jobs_is_divided_by_nvcc_threads_only_once_by_vllms_setup(profile):
    build = runs(stages(profile, "vllm")["vllm-build"])
    assert "MAX_JOBS=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 4194304 ))" in build
    assert not re.search(r"/\s*\$?\{?NVCC_THREADS", build), "setup.py divides MAX_JOBS by NVCC_THREADS itself"
    assert "export MAX_JOBS NVCC_THREADS" in build


def test_rust_frontend_is_built_and_required_where_the_profile_says_so():
    s = stages("g5g", "vllm")
    toolchain = runs(s["toolchain"])
    assert re.search(r"apt-get install[^&]*\bmake\b", toolchain) and re.search(r"apt-get install[^&]*\bperl\b",
                                                                               toolchain)
    assert "sh.rustup.rs" in toolchain and arg(s["toolchain"], "RUST_VERSION") == "1.95"
    assert "export VLLM_REQUIRE_RUST_FRONTEND=1" in runs(s["vllm-build"])


def test_rust_frontend_off_is_a_named_setting_not_a_silent_skip():
    s = stages("g4dn", "vllm")  # build.rust_frontend: false (no crates registry where it is built)
    assert "rustup" not in runs(s["toolchain"]) and arg(s["toolchain"], "RUST_VERSION") is None
    assert "Rust frontend off (profile build.rust_frontend: false)" in runs(s["vllm-build"])
    on = stages("g4dn", "vllm", ["profile.build.rust_frontend=true"])
    assert "export VLLM_REQUIRE_RUST_FRONTEND=1" in runs(on["vllm-build"])


@pytest.mark.parametrize("profile", ["g5g", "g4dn"])
def test_triton_is_pinned_to_torchs_tested_release(profile):
    final = stages(profile, "vllm")["vllm"]
    pin = manifest.load(REPO / "manifests", profile=profile).runtimes["vllm"].pins["triton"]
    assert pin.startswith("3.8.") and arg(final, "TRITON_VERSION") == pin
    assert '"triton==${TRITON_VERSION}"' in runs(final)


def test_torch_from_source_skips_flash_attention_pins_nccl_and_names_its_compiler_and_cache():
    s = stages("g5g", "torch-base")
    build, final = s["torch-build"], s["torch-base"]
    text = runs(build)
    assert "USE_FLASH_ATTENTION=0" in text
    assert re.search(r"apt-get install[^&]*\bg\+\+", text)
    compile_step = next(c for c in build if c.cmd == "RUN" and "MAX_JOBS" in c.value[0])
    mount = re.search(r"--mount=type=cache,target=(\S+)", " ".join(compile_step.flags))
    assert f"CCACHE_DIR={mount.group(1)}" in text
    nccl = manifest.load(REPO / "manifests", profile="g5g").profiles["g5g"].cuda.nccl
    assert arg(build, "NCCL_VERSION") == arg(final, "NCCL_VERSION") == nccl
    for stage in (build, final):
        assert '"nvidia-nccl-cu13==${NCCL_VERSION}"' in runs(stage)
        assert not re.search(r"apt-get install[^&]*libnccl", runs(stage)), "NCCL from one place only"


@pytest.mark.parametrize("profile", ["g5g", "g4dn"])
def test_external_sources_cache_is_one_per_vllm_version(profile):
    build = next(" ".join(c.flags) for c in stages(profile, "vllm")["vllm-build"] if "vllm-deps" in c.original)
    assert "--mount=type=cache,id=vllm-deps-0.33.0,target=/root/.cache/vllm-deps" in build


def test_g4dn_builds_from_local_sources_and_checks_its_toolkit_before_torch():
    s = stages("g4dn", "vllm")
    assert s["cuda-check"][0].value[0] == "${BASE_IMAGE}", "the toolkit check needs no torch (CI builds it)"
    assert "-gencode arch=compute_%s,code=sm_%s" in runs(s["cuda-check"])
    assert any("--from=cuda-check" in c.original for c in s["toolchain"]), "the vLLM build runs only past the check"
    build = runs(s["vllm-build"])
    assert ". /vllm-sources/env.sh" in build
    assert "--mount=type=bind,from=vllm-sources,target=/vllm-sources,rw" in next(
        " ".join(c.flags) for c in s["vllm-build"] if "env.sh" in c.original)
    plan = make_plan(manifest.load(REPO / "manifests", profile="g4dn"), profile="g4dn")
    target = render.bake(plan)["target"]["vllm"]
    assert target["contexts"]["vllm-sources"] == ".cache/vllm-sources/0.33.0"
    # With internet: no local context, CMake fetches from GitHub.
    net = stages("g4dn", "vllm", ["profile.build.vllm_sources="])
    assert "vllm-sources" not in runs(net["vllm-build"])


def test_g4dn_torch_base_refuses_a_torch_without_sm75_sass():
    base = runs(stages("g4dn", "torch-base")["torch-base"])
    assert 'cuobjdump/nvidia/cu13/bin/cuobjdump --list-elf "$lib"' in base and "libtorch_cuda.so" in base
    assert "has no sm_$sm SASS" in base and "exit 1" in base
