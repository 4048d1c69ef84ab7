"""The CUDA build chain as generated: each defect a review found in the g5g Dockerfiles, pinned on the real output.

Stages are read with BuildKit's own parser (`dockerfile`), so a test sees what the builder sees.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
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


@pytest.mark.parametrize("profile", ["g5g", "g4dn"])
def test_max_jobs_is_divided_by_nvcc_threads_only_once_by_vllms_setup(profile):
    build = runs(stages(profile, "vllm")["vllm-build"])
    assert "MAX_JOBS=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 4194304 ))" in build
    assert not re.search(r"/\s*\$?\{?NVCC_THREADS", build), "setup.py divides MAX_JOBS by NVCC_THREADS itself"
    assert "export MAX_JOBS NVCC_THREADS" in build


def test_rust_frontend_is_built_and_required_where_the_profile_says_so():
    s = stages("g5g", "vllm", ["profile.build.rust_frontend=true"])
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


def test_no_profile_builds_a_rust_frontend_that_vllm_would_not_run(vllm_sdist):
    """Issue 51, item 5: vLLM runs its Rust frontend only with VLLM_USE_RUST_FRONTEND=1, off by default in the pinned
    sdist and set by no image: no profile builds it (nor requires it) untested. A vLLM whose default turns it on
    fails here, and the choice is made again."""
    with tarfile.open(vllm_sdist.path) as t:
        envs = t.extractfile(f"vllm-{vllm_sdist.version}/vllm/envs.py").read().decode()
    assert "VLLM_USE_RUST_FRONTEND: bool = False" in envs
    assert 'os.environ.get("VLLM_USE_RUST_FRONTEND", "0")' in envs
    for profile in ("g5g", "g4dn"):
        assert manifest.load(REPO / "manifests", profile=profile).profiles[profile].build.rust_frontend is False
        s = stages(profile, "vllm")
        assert "VLLM_REQUIRE_RUST_FRONTEND" not in runs(s["vllm-build"]) and "rustup" not in runs(s["toolchain"])
        assert "Rust frontend off (profile build.rust_frontend: false)" in runs(s["vllm-build"])
        assert not any("VLLM_USE_RUST_FRONTEND" in text for text in rendered_files(profile).values())


@pytest.mark.parametrize("profile", ["g5g", "g4dn"])
def test_triton_is_pinned_to_torchs_tested_release(profile):
    final = stages(profile, "vllm")["vllm"]
    pin = manifest.load(REPO / "manifests", profile=profile).runtimes["vllm"].pins["triton"]
    assert pin.startswith("3.8.") and arg(final, "TRITON_VERSION") == pin
    assert '"triton==${TRITON_VERSION}"' in runs(final)



def _requirement_names(text: str) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r)[0].lower() for r in text.split()}


def test_what_the_source_built_torch_leaves_out_of_pypis_requirements_is_what_the_docs_say():
    """PyPI's torch 2.14.0 requirements (docs/FACTS.md) are the source-built torch's declared wheels
    (TORCH_CUDA_WHEELS) plus exactly the ones docs/building.md names as not declared: cuda-bindings and triton."""
    facts = (REPO / "docs/FACTS.md").read_text()
    bullet = facts[facts.index("- PyPI's torch 2.14.0 requires"):].split("; every one has", 1)[0]
    pypi = _requirement_names(" ".join(re.findall(r"`([a-z][\w.-]*(?:\[[\w,\s]+\])?[=<>~!][^`]*)`",
                                                      bullet.replace("\n  ", ""))))
    declared = _requirement_names(arg(stages("g5g", "torch-base")["torch-build"], "TORCH_CUDA_WHEELS").strip('"'))
    building = (REPO / "docs/building.md").read_text()
    said = re.search(r"PyPI's torch also requires `([^`]+)` and `([^`]+)`, which ours does not declare", building)
    assert said, "docs/building.md says what the source-built torch leaves out of PyPI's requirements"
    assert pypi - declared == _requirement_names(" ".join(said.groups())) == {"cuda-bindings", "triton"}
    assert declared <= pypi

def test_torch_from_source_skips_flash_attention_and_runs_on_the_wheels_pypis_torch_requires():
    s = stages("g5g", "torch-base")
    build, final = s["torch-env"] + s["torch-build"], s["torch-base"]
    text = runs(build)
    assert "USE_FLASH_ATTENTION=0" in arg(build, "TORCH_BUILD_FLAGS").strip('"').split() and "$TORCH_BUILD_FLAGS" in text
    assert re.search(r"apt-get install[^&]*\bg\+\+", text)
    compile_step = next(c for c in build if c.cmd == "RUN" and "pip wheel" in c.value[0])
    mount = re.search(r"--mount=type=cache,target=(\S+)", " ".join(compile_step.flags))
    assert f"CCACHE_DIR={mount.group(1)}" in text
    pins = manifest.load(REPO / "manifests", profile="g5g").runtimes["torch-base"].pins
    wheels = arg(build, "TORCH_CUDA_WHEELS").strip('"').split()
    assert f"nvidia-nccl-cu13=={pins['nccl']}" in wheels and f"nvidia-cudnn-cu13=={pins['cudnn']}" in wheels
    assert any(w.startswith("cuda-toolkit[") and "cupti" in w and w.endswith("==13.0.3") for w in wheels)
    # built against them, and the wheel declares them: the runtime stage installs exactly these
    assert "${TORCH_CUDA_WHEELS}" in text and 'PYTORCH_EXTRA_INSTALL_REQUIREMENTS="$requires"' in text
    assert "pip install /tmp/wheels/torch-*.whl" in runs(final)
    for stage in (build, final):
        assert not re.search(r"apt-get install[^&]*(libnccl|cuda|cudnn)", runs(stage)), "CUDA from the wheels only"


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


# --- one recipe ------------------------------------------------------------------------------------------------------

def rendered_files(profile: str, overrides: list[str] | None = None) -> dict[str, str]:
    plan = make_plan(manifest.load(REPO / "manifests", profile=profile, overrides=overrides), profile=profile)
    return {i.runtime: render.render(plan)[i.dockerfile] for i in plan.all_images}


@pytest.mark.parametrize("profile", ["g5g", "g4dn"])
def test_both_cuda_profiles_build_from_reachable_channels_no_nvidia_image(profile):
    """The toolkit and libraries come from NVIDIA's wheels on the profile's Debian base; JAX needs no toolkit."""
    m = manifest.load(REPO / "manifests", profile=profile)
    base = m.profiles[profile].base_image
    assert base == f"g5g-local/trixie:{'arm64' if profile == 'g5g' else 'amd64'}"
    for runtime, text in rendered_files(profile).items():
        assert "nvidia/cuda" not in text, runtime
        froms = [c.value for c in dockerfile.parse_string(text) if c.cmd == "FROM"]
        named = {f[2] for f in froms if len(f) == 3}
        assert all(f[0] in ("${BASE_IMAGE}", "${TORCH_BASE}", "scratch") or f[0] in named for f in froms), froms
    assert f"ARG BASE_IMAGE={base}" in rendered_files(profile)["jax"]


def test_g5g_and_g4dn_differ_only_in_data():
    """The same template text for both: the CUDA stages of vllm are identical up to the profiles' values."""
    g5g, g4dn = rendered_files("g5g")["vllm"], rendered_files("g4dn")["vllm"]
    stages5 = {k: [c.cmd for c in v] for k, v in stages("g5g", "vllm").items()}
    stages4 = {k: [c.cmd for c in v] for k, v in stages("g4dn", "vllm").items()}
    assert set(stages5) == set(stages4)
    for name in ("cuda-check", "vllm-source", "vllm-report", "vllm"):
        assert stages5[name] == stages4[name], name
    assert "check-sass.sh --only" in g5g and "check-sass.sh --only" in g4dn


def test_nvidia_cuda_images_stay_selectable():
    devel = f"nvidia/cuda:13.0.2-devel-ubuntu24.04@{DIGEST}"
    runtime = f"nvidia/cuda:13.0.2-runtime-ubuntu24.04@{DIGEST}"
    files = rendered_files("g5g", [f"profile.cuda.devel_image={devel}", f"profile.base_image={runtime}"])
    for name in ("torch-base", "vllm"):
        cmds = dockerfile.parse_string(files[name])
        assert any(c.cmd == "FROM" and c.value == ("${CUDA_DEVEL_IMAGE}", "AS", "cuda-devel") for c in cmds)
        assert "COPY --from=cuda-devel /usr/local/cuda/ /usr/local/cuda/" in files[name]
        assert f"ARG BASE_IMAGE={runtime}" in files[name] and f"ARG CUDA_DEVEL_IMAGE={devel}" in files[name]
        assert '"cuda-toolkit[nvcc,cccl,crt,nvvm,cudart]' not in files[name]
    with pytest.raises(UserError, match=r"g5g.yaml: cuda.devel_image: .*@sha256: and 64 hex"):
        manifest.load(REPO / "manifests", profile="g5g",
                      overrides=["profile.cuda.devel_image=nvidia/cuda:13.0.2-devel-ubuntu24.04@sha256:abc"])


# --- review defect 2: every RUN stops at its first failing command ----------------------------------------------------

ALL = [(p, r) for p in ("g5g", "g4dn", "cpu") for r in ("torch-base", "vllm", "jax", "pytorch")
       if not (p == "cpu" and r == "vllm")]


@pytest.mark.parametrize("profile,runtime", ALL)
def test_every_run_runs_under_bash_e_pipefail(profile, runtime):
    shells: dict[str, list | None] = {}
    for name, stage in stages(profile, runtime).items():
        # a stage FROM another stage of the file inherits its SHELL (it is in the image config); any other starts anew
        shell = shells.get(stage[0].value[0]) if stage and stage[0].cmd == "FROM" else None
        for c in stage:
            if c.cmd == "SHELL":
                shell = list(c.value)
            if c.cmd == "RUN":
                assert shell is not None, f"{profile}/{runtime}/{name}: RUN before SHELL: {c.original[:80]}"
                assert shell[0] == "/bin/bash" and "-e" in shell and shell[shell.index("-o") + 1] == "pipefail", shell
        shells[name] = shell
    # and that shell stops where the old one went on (item 1 hid behind it)
    shell = next(c.value for c in dockerfile.parse_string(rendered_files("g5g")["torch-base"]) if c.cmd == "SHELL")
    r = subprocess.run([*shell, "false; echo went-on"], capture_output=True, text=True)
    assert r.returncode == 1 and "went-on" not in r.stdout


# --- review defect 1: the Python the RUN lines execute, run against the real pinned wheels -----------------------------

WHEELS = REPO / ".cache" / "nvidia-wheels"


@pytest.fixture(scope="module")
def nvidia_venv(tmp_path_factory):
    """A venv with the pinned NCCL (a namespace package), CUPTI, CUDA runtime and cuobjdump wheels for this machine
    (downloaded once into .cache/nvidia-wheels)."""
    pins = manifest.load(REPO / "manifests", profile="g4dn")
    tb, cuda = pins.runtimes["torch-base"].pins, pins.profiles["g4dn"].cuda
    reqs = [f"nvidia-nccl-cu13=={tb['nccl']}", "nvidia-cuda-cupti==13.0.85", "nvidia-cuda-runtime==13.0.96",
            f"nvidia-cuda-cuobjdump=={cuda.cuobjdump}"]  # cupti/runtime: cuda-toolkit 13.0.3's, resolved for torch
    arch = platform.machine()
    tags = [f"--platform=manylinux_2_{v}_{arch}" for v in (28, 27, 25, 18, 17)]
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *tags,
                        "-d", str(WHEELS), *reqs], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    venv = tmp_path_factory.mktemp("nvidia") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    files = [str(f) for f in WHEELS.glob("*.whl") if any(f.name.startswith(q.split("==")[0].replace("-", "_") + "-"
                                                                             + q.split("==")[1] + "-") for q in reqs)]
    assert len(files) == len(reqs), files
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", *files],
                   check=True, timeout=600)
    return venv


def python_snippets(text: str) -> list[str]:
    """The `python3 -c "…"` programs of a Dockerfile's RUN lines, as the shell would pass them."""
    joined = text.replace("\\\n", "")
    out = []
    for m in re.finditer(r'python3 -c "((?:[^"\\]|\\.)*)"', joined):
        out.append(m.group(1).replace('\\"', '"'))
    return out


def test_python_of_the_run_lines_runs_against_the_pinned_nvidia_wheels(nvidia_venv):
    ran = []
    for profile in ("g5g", "g4dn"):
        for runtime, text in rendered_files(profile).items():
            assert not re.search(r"nvidia\.\w+\.__file__", text), f"{runtime}: a namespace package has no __file__"
            for code in python_snippets(text):
                if "nvidia" not in code or ("nvidia.cudnn" in code):  # cuDNN's 550 MB wheel is not fetched here
                    continue
                r = subprocess.run([str(nvidia_venv / "bin/python"), "-c", code], capture_output=True, text=True,
                                   timeout=60)
                assert r.returncode == 0, f"{profile}/{runtime}: {code}\n{r.stderr}"
                lines = r.stdout.split()
                assert lines and all(Path(x).is_dir() for x in lines), (code, r.stdout)
                ran.append(code)
    assert any("nvidia.nccl.__path__[0]" in c for c in ran)
    conf = next(c for c in ran if "ld.so.conf" in c or "glob.glob" in c)
    dirs = subprocess.run([str(nvidia_venv / "bin/python"), "-c", conf], capture_output=True, text=True).stdout
    assert {Path(d).relative_to(Path(d).parents[2]).as_posix() for d in dirs.split()} >= {"nvidia/nccl/lib",
                                                                                          "nvidia/cu13/lib"}


# --- review defect 3: CUPTI is there, every DT_NEEDED resolves ---------------------------------------------------------

def test_check_needed_fails_on_an_unresolved_library_and_passes_once_it_is_on_the_path(tmp_path):
    """A library whose DT_NEEDED (a stand-in for libcupti.so.13, by a name no host has) is off the loader path fails
    the check, naming it; on the path (as ld.so.conf.d puts the wheels' lib/), it passes."""
    for d in ("dep", "lib"):
        (tmp_path / d).mkdir()
    (tmp_path / "d.c").write_text("int g5g_probe(void) { return 1; }\n")
    (tmp_path / "k.c").write_text("int g5g_probe(void); int f(void) { return g5g_probe(); }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libg5gcupti.so.13", "-o",
                    str(tmp_path / "dep/libg5gcupti.so.13"), str(tmp_path / "d.c")], check=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "lib/libkineto_like.so"), str(tmp_path / "k.c"),
                    f"-L{tmp_path / 'dep'}", "-l:libg5gcupti.so.13"], check=True)
    script = str(REPO / "dockerfiles/check-needed.sh")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    bad = subprocess.run(["bash", script, str(tmp_path / "lib")], capture_output=True, text=True, env=env)
    assert bad.returncode == 1 and "not found: libg5gcupti.so.13" in bad.stderr
    good = subprocess.run(["bash", script, str(tmp_path / "lib")], capture_output=True, text=True,
                          env={**env, "LD_LIBRARY_PATH": str(tmp_path / "dep")})
    assert good.returncode == 0 and "every DT_NEEDED of 1 libraries" in good.stdout, good.stderr
    assert subprocess.run(["bash", script, str(tmp_path / "d.c")], capture_output=True).returncode == 1  # no library


@pytest.mark.parametrize("profile", ["g5g", "g4dn"])
def test_images_prove_every_dt_needed_resolves(profile):
    base = runs(stages(profile, "torch-base")["torch-base"])
    assert "cupti" in arg(stages("g5g", "torch-base")["torch-build"], "TORCH_CUDA_WHEELS")
    conf = base.index("/etc/ld.so.conf.d/g5g-nvidia-wheels.conf")
    assert conf < base.index('bash /tmp/check/check-needed.sh "$torch/lib"')
    final = runs(stages(profile, "vllm")["vllm"])
    assert 'bash /tmp/check/check-needed.sh "$vllm"' in final


# --- review defect 5: cuobjdump failures are fatal, sm_75 must be present; the extensions load ---------------------------

def test_check_sass_requires_the_arch_and_fails_on_what_it_cannot_read(nvidia_venv, tmp_path):
    sp = next(nvidia_venv.glob("lib/python*/site-packages"))
    env = {**os.environ, "CUOBJDUMP": str(sp / "nvidia/cu13/bin/cuobjdump")}
    nccl = str(sp / "nvidia/nccl/lib/libnccl.so.2")  # SASS 75 80 90 100 110 120, PTX 120
    (tmp_path / "h.c").write_text("int f(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "host.so"), str(tmp_path / "h.c")], check=True)

    def check(*args):
        return subprocess.run(["bash", str(REPO / "dockerfiles/check-sass.sh"), *args], capture_output=True,
                              text=True, env=env, timeout=120)
    assert check("7.5", nccl).returncode == 0
    for archs in ("", " "):   # TORCH_CUDA_ARCH_LIST unset: nothing to hold the library to is not a pass
        r = check(archs, nccl)
        assert r.returncode == 2 and "no ARCH given" in r.stderr, r.stdout + r.stderr
    r = check("6.1", nccl)
    assert r.returncode == 1 and "no sm_61 SASS" in r.stderr
    r = check("--only", "7.5", nccl)
    assert r.returncode == 1 and "unexpected SASS" in r.stderr
    # every SASS it has, so only its PTX is left to object to: vLLM's libraries must be SASS-only
    line = check("7.5", nccl).stdout
    sass = line.split(" sass: ")[1].split(" ptx: ")[0].split()
    assert "sm_75" in sass and line.split(" ptx: ")[1].strip() != "none", line
    r = check("--only", " ".join(f"{s[3:-1]}.{s[-1]}" for s in sass), nccl)
    assert r.returncode == 1 and "carries PTX" in r.stderr, r.stdout + r.stderr
    r = check("7.5", str(tmp_path / "host.so"))
    assert r.returncode == 0 and "no device code" in r.stdout
    for bad, why in (("not an ELF file\n", "not a readable ELF file"), ("\x7fELF broken\n", "cuobjdump failed")):
        (tmp_path / "bad.so").write_text(bad)
        r = check("7.5", str(tmp_path / "bad.so"))
        assert r.returncode == 1 and why in r.stderr, r.stdout + r.stderr
    r = check("7.5", str(tmp_path / "missing.so"))
    assert r.returncode == 1


@pytest.mark.parametrize("profile", ["g5g", "g4dn"])
def test_vllm_build_checks_sass_cmake_archs_and_loads_the_extensions(profile):
    s = stages(profile, "vllm")
    build, final = runs(s["vllm-build"]), runs(s["vllm"])
    assert "2>/dev/null" not in build.split("check-sass")[0][-200:] and "cuobjdump --list" not in build
    assert 'check-sass.sh --only "${TORCH_CUDA_ARCH_LIST}"' in build
    assert "CUDA supported target architectures: " in build and "CUDA supported arch\"" not in build
    assert "vllm serve --help" not in final
    assert "os.RTLD_NOW" in final and "torch.ops.load_library" in final
    assert "'_C_stable_libtorch', '_moe_C_stable_libtorch'" in final
    # issue 36: a source-built torch holds SASS for exactly the arch list, no PTX, in every library; PyPI's torch
    # (g4dn) carries more archs, so only the list's presence is asked of it
    tb = runs(stages(profile, "torch-base")["torch-base"])
    if profile == "g5g":
        assert 'check-sass.sh --only "${TORCH_CUDA_ARCH_LIST}" "$torch"/lib/*.so' in tb
    else:
        assert 'check-sass.sh "${TORCH_CUDA_ARCH_LIST}" "$torch/lib/libtorch_cuda.so"' in tb and "--only" not in tb


def test_the_cmake_line_the_build_reads_is_the_one_vllm_prints(tmp_path, vllm_sdist):
    with tarfile.open(vllm_sdist.path) as t:   # the pinned sdist, cached or fetched (tests/fixtures/vllm_sdist.py)
        cmake = t.extractfile("vllm-0.33.0/CMakeLists.txt").read().decode()
    assert 'message(STATUS "CUDA supported target architectures: ${CUDA_ARCHS}")' in cmake
    step = next(c.value[0] for c in stages("g5g", "vllm")["vllm-build"] if "got=$(" in c.value[0])
    check = step[step.index("got=$("):]
    log = tmp_path / "build.log"
    for line, ok in (("  -- CUDA supported target architectures: 7.5", True),
                     ("  -- CUDA supported target architectures: 7.5;8.0", False), ("nothing", False)):
        log.write_text("-- CUDA target architectures: 7.5\n" + line + "\n")
        r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", check.replace("/report/build.log", str(log))],
                           capture_output=True, text=True, env={**os.environ, "TORCH_CUDA_ARCH_LIST": "7.5"})
        assert (r.returncode == 0) == ok, (line, r.stderr)


# --- review defect 6: NVCC_THREADS is 1 with one arch --------------------------------------------------------------------

def test_nvcc_threads_above_one_with_one_arch_is_refused():
    with pytest.raises(UserError, match=r"g5g.yaml: build.nvcc_threads: 2 with one CUDA arch \(7.5\)"):
        manifest.load(REPO / "manifests", profile="g5g", overrides=["profile.build.nvcc_threads=2"])
    m = manifest.load(REPO / "manifests", profile="g5g",
                      overrides=["profile.build.nvcc_threads=2", 'profile.cuda.archs=["7.5", "8.6"]'])
    assert m.profiles["g5g"].build.nvcc_threads == 2
    for p in ("g5g", "g4dn"):
        assert arg(stages(p, "vllm")["vllm-build"], "NVCC_THREADS") == "1"


# --- review defect 8: nothing may replace torch; no label for what is not built --------------------------------------------

def test_torchcodec_and_every_torch_requirement_leave_vllms_requirements(tmp_path, vllm_sdist):
    with tarfile.open(vllm_sdist.path) as t:   # the pinned sdist, cached or fetched (tests/fixtures/vllm_sdist.py)
        members = [m for m in t.getmembers() if m.name.startswith(("vllm-0.33.0/requirements/",
                                                                   "vllm-0.33.0/tools/use_existing_torch.py",
                                                                   "vllm-0.33.0/pyproject.toml"))]
        t.extractall(tmp_path, members=members, filter="data")
    tree = tmp_path / "vllm-0.33.0"
    upstream_only = subprocess.run([sys.executable, "tools/use_existing_torch.py", "--prefix"], cwd=tree,
                                   capture_output=True, text=True)
    assert upstream_only.returncode == 0
    assert "torchcodec >= 0.14" in (tree / "requirements/cuda.txt").read_text(), "the defect: it survives"
    step = next(c.value[0] for c in stages("g5g", "vllm")["vllm-build"] if "use_existing_torch" in c.value[0])
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step.replace("python3 ", f"{sys.executable} ")],
                       cwd=tree, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = "".join(p.read_text() for p in tree.glob("requirements/**/*.txt"))
    left = re.findall(r"(?im)^\s*torch(?:vision|audio|codec)?\s*(?:[<>=!~;\[].*)?$", text)
    assert left == [], left
    assert "torch-c-dlpack-ext==" in text, "other packages named torch-… stay"


def test_a_pip_install_that_replaces_torch_fails_the_build(tmp_path):
    pytest.importorskip("torch")
    text = rendered_files("g4dn")["vllm"].replace("\\\n", "")
    step = next(ln for ln in text.splitlines() if "pip install -r requirements/build/cuda.txt" in ln)
    check = step[step.index("if ! "):].replace("/opt/g5g/torch.txt", str(tmp_path / "torch.txt"))
    record = re.search(r'(python3 -c "import hashlib.*?")', check).group(1)
    ident = subprocess.run(["bash", "-c", record.replace("python3", sys.executable)], capture_output=True, text=True)
    check = check.replace("python3 -c", f"{sys.executable} -c")
    (tmp_path / "torch.txt").write_text(ident.stdout)
    assert subprocess.run(["bash", "-e", "-o", "pipefail", "-c", check], capture_output=True).returncode == 0
    (tmp_path / "torch.txt").write_text(ident.stdout.replace("torch ", "torch 0.0.0-other ", 1))
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", check], capture_output=True, text=True,
                       env={**os.environ, "PIP_CONSTRAINT": "/opt/g5g/constraints.txt"})
    assert r.returncode == 1 and "replaced torch" in r.stderr
    base = stages("g4dn", "torch-base")["torch-base"]
    assert any(c.cmd == "ENV" and "PIP_CONSTRAINT=/opt/g5g/constraints.txt" in c.original for c in base)
    for runtime in ("vllm", "pytorch"):
        assert "replaced torch" in rendered_files("g5g")[runtime]


def test_the_rust_pin_is_labelled_only_where_the_frontend_is_built():
    def upstream(profile, overrides=None):
        plan = make_plan(manifest.load(REPO / "manifests", profile=profile, overrides=overrides), profile=profile)
        return next(i for i in plan.images if i.runtime == "vllm").upstream
    assert "rust" not in upstream("g4dn") and "rust" not in upstream("g5g")
    assert upstream("g4dn", ["profile.build.rust_frontend=true"])["rust"] == "1.95"
    assert upstream("g5g", ["profile.build.rust_frontend=true"])["rust"] == "1.95"
    # torch-base's CUDA wheel pins label the source-built torch only; a CPU torch claims no cuDNN
    def base(profile):
        plan = make_plan(manifest.load(REPO / "manifests", profile=profile), profile=profile, runtime="torch-base")
        return plan.images[0].upstream
    assert base("g5g")["nccl"] == "2.30.7" and base("g5g")["cudnn"] == "9.24.0.43"
    assert "cudnn" not in base("cpu") and "nccl" not in base("cpu") and base("cpu")["torch"] == "2.13.0+cpu"


def test_build_py_generate_for_g5g_writes_what_the_issue_asks(tmp_path):
    """`build.py generate` as a user runs it: every RUN under bash -e, no namespace package's __file__, CUPTI on the
    loader path and every DT_NEEDED checked, cuobjdump checks that fail on errors and need sm_75, NVCC_THREADS 1, the
    bases and toolkit from reachable channels, and the check scripts in each build context."""
    out = tmp_path / "gen"
    r = subprocess.run([sys.executable, "build.py", "generate", "--runtime", "all", "--profile", "g5g", "--out",
                        str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    files = {d.name: (d / "Dockerfile").read_text() for d in out.iterdir() if d.is_dir()}
    assert set(files) == {"torch-base", "vllm", "jax", "pytorch"}
    for name, text in files.items():
        shells = [c.value for c in dockerfile.parse_string(text) if c.cmd == "SHELL"]
        assert shells and all(s == ("/bin/bash", "-e", "-o", "pipefail", "-c") for s in shells), name
        assert "__file__)" not in re.sub(r"(torch|vllm)\.__file__\)", "", text), name
        assert "nvidia/cuda" not in text, name
        assert name == "pytorch" or "ARG BASE_IMAGE=g5g-local/trixie:arm64" in text, name  # pytorch: FROM torch-base
    assert "cupti" in files["torch-base"] and "check-needed.sh \"$torch/lib\"" in files["torch-base"]
    assert 'check-sass.sh --only "${TORCH_CUDA_ARCH_LIST}" "$torch"/lib/*.so' in files["torch-base"]
    assert "check-sass.sh --only" in files["vllm"] and "ARG NVCC_THREADS=1" in files["vllm"]
    assert "ARG NVCC_THREADS=1" in files["torch-base"] and "ARG CUDA_TOOLKIT_VERSION=13.0.3" in files["vllm"]
    for ctx in ("torch-base", "vllm"):
        for script in ("check-sass.sh", "check-needed.sh"):
            assert (out / ctx / script).read_text() == (REPO / "dockerfiles" / script).read_text()


# --- round 3: torch-base reads back what it built (dockerfiles/check-torch.py) ----------------------------------------

CHECK_TORCH = REPO / "dockerfiles" / "check-torch.py"


def check_torch(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run([python, str(CHECK_TORCH), *args], capture_output=True, text=True, timeout=300)


def test_check_torch_reads_the_cmake_cache(tmp_path):
    """The configure's cache, in CMake's own format: a flag that did not reach CMake, or one torch turned off, fails."""
    cache = tmp_path / "CMakeCache.txt"
    cache.write_text("//Use cuDNN\nUSE_CUDNN:BOOL=ON\nUSE_NCCL:BOOL=ON\nUSE_FLASH_ATTENTION:BOOL=OFF\n"
                     "BUILD_TEST:BOOL=OFF\nUSE_KINETO:BOOL=1\n")
    ok = check_torch("cmake-cache", str(cache), "USE_CUDNN=1", "USE_NCCL=1", "USE_FLASH_ATTENTION=0", "BUILD_TEST=0",
                     "USE_KINETO=1")
    assert ok.returncode == 0 and "every flag agrees" in ok.stdout, ok.stderr
    cache.write_text(cache.read_text().replace("USE_CUDNN:BOOL=ON", "USE_CUDNN:BOOL=OFF"))
    bad = check_torch("cmake-cache", str(cache), "USE_CUDNN=1", "USE_CUDSS=0")
    assert bad.returncode == 1
    assert "USE_CUDNN: OFF in" in bad.stderr and "asks for ON" in bad.stderr
    assert "USE_CUDSS: not in" in bad.stderr and "did not pass it to CMake" in bad.stderr
    missing = check_torch("cmake-cache", str(tmp_path / "nope.txt"), "USE_CUDNN=1")
    assert missing.returncode == 1 and "cannot read the configure's cache" in missing.stderr
    for flag in ("use_cudnn=1", "USE_CUDNN", "USE_CUDNN=", "USE_CUDNN=of", "USE_CUDNN=2"):   # a typo is not OFF
        r = check_torch("cmake-cache", str(cache), flag)
        assert r.returncode == 1 and r.stderr == f"check-torch: {flag!r}: expected NAME=VALUE, VALUE one of 1 ON YES " \
                                                 f"TRUE Y or 0 OFF NO FALSE N (e.g. USE_CUDNN=1)\n", r.stderr


def test_check_torch_fails_a_torch_without_cudnn_nccl_or_cupti():
    """The installed torch of this environment (the CPU wheel): every promise of a CUDA build fails, by name; what it
    is (no CUDA, no cuDNN, no NCCL) passes."""
    pytest.importorskip("torch")
    bad = check_torch("installed", "USE_CUDA=1", "USE_CUDNN=1", "USE_NCCL=1", "USE_KINETO=1")
    assert bad.returncode == 1, bad.stdout
    for what in ("torch.version.cuda", "torch.backends.cudnn.is_available()", "is_nccl_available()", "HAS_CUPTI"):
        assert what in bad.stderr, bad.stderr
    ok = check_torch("installed", "USE_CUDA=0", "USE_CUDNN=0", "USE_NCCL=0")
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("profile", ["g5g", "g4dn"])
def test_torch_base_reads_back_what_it_built(profile):
    """The compile step reads the flags back from the configure's cache; the image checks the installed torch against
    the manifest's flags (all of TORCH_BUILD_FLAGS for a source build, cuDNN/NCCL/CUPTI for any CUDA torch)."""
    s = stages(profile, "torch-base")
    final = runs(s["torch-base"])
    if profile == "g5g":
        build = runs(s["torch-build"])
        assert build.index("pip wheel") < build.index('check-torch.py cmake-cache "$SKBUILD_BUILD_DIR/CMakeCache.txt"')
        assert build.index("check-torch.py cmake-cache") < build.index('check-torch.py library "$lib" $TORCH_BUILD_FLAGS')
        assert "python3 /tmp/check/check-torch.py installed $TORCH_BUILD_FLAGS" in final
    else:
        assert arg(s["torch-base"], "TORCH_FLAGS").strip('"').split() == ["USE_CUDA=1", "USE_CUDNN=1", "USE_NCCL=1",
                                                                          "USE_KINETO=1"]
        assert "python3 /tmp/check/check-torch.py installed $TORCH_FLAGS" in final


def test_the_compile_finds_cudnn_and_nccl_in_one_cuda_tree_and_passes_its_flags_to_both_build_backends():
    """Review round 3, items 1-3: FindCUDNN searches CUDNN_LIBRARY as a directory (the old file path found nothing and
    torch turned cuDNN off); nccl.h needs cuda_runtime.h beside it; scikit-build-core gets the flags as CMAKE_ARGS and
    `cmake --build` its parallelism."""
    s = stages("g5g", "torch-base")
    build = s["torch-env"] + s["torch-build"]
    text = runs(build)
    assert "libcudnn.so\"" not in text and 'CUDNN_LIBRARY="$CUDA_HOME/lib64"' in text
    assert 'NCCL_INCLUDE_DIR="$CUDA_HOME/include"' in text and 'CUDNN_INCLUDE_DIR="$CUDA_HOME/include"' in text
    link = next(c.value[0] for c in build if c.cmd == "RUN" and "nvidia.cudnn" in c.value[0] and "ln -sf" in c.value[0])
    assert '"$d"/include/*) to="$CUDA_HOME/include"' in link and 'to="$CUDA_HOME/lib64"' in link
    assert 'CMAKE_BUILD_PARALLEL_LEVEL="$MAX_JOBS"' in text and 'CMAKE_ARGS="$cmake_args"' in text
    assert "cmake_args=$(printf -- '-D%s ' $TORCH_BUILD_FLAGS)" in text and "SKBUILD_BUILD_DIR=" in text


@pytest.mark.parametrize("profile", ["g5g", "g4dn"])
def test_jax_runs_on_the_cuda_set_of_the_other_images(profile):
    """Review round 3, item 7: jax[cuda13]'s open-ended bounds took CUDA 13.5's runtime and cuDNN 9.28 into an image
    tagged cu130. The install names cuda-toolkit at the profile's pip_toolkit and torch-base's cuDNN/NCCL/NVSHMEM."""
    m = manifest.load(REPO / "manifests", profile=profile)
    tb, jax = m.runtimes["torch-base"].pins, m.runtimes["jax"].pins
    assert {k: jax[k] for k in ("cudnn", "nccl", "nvshmem")} == {k: tb[k] for k in ("cudnn", "nccl", "nvshmem")}
    s = stages(profile, "jax")["jax"]
    wheels = arg(s, "JAX_CUDA_WHEELS").strip('"').split()
    toolkit = m.profiles[profile].cuda.pip_toolkit
    assert any(w.startswith("cuda-toolkit[") and "cudart" in w and "cupti" in w and w.endswith(f"=={toolkit}")
               for w in wheels)
    assert {f"nvidia-cudnn-cu13=={tb['cudnn']}", f"nvidia-nccl-cu13=={tb['nccl']}"} <= set(wheels)
    assert '"jax[${JAX_EXTRA}]==${JAX_VERSION}" ${JAX_CUDA_WHEELS}' in runs(s)
    assert "JAX_CUDA_WHEELS" not in rendered_files("cpu")["jax"]


# --- issue 36 / issue 41: checks tested against inputs that must fail -------------------------------------------------

@pytest.fixture(scope="module")
def nvcc():
    path = shutil.which("nvcc")
    if not path:
        pytest.skip("nvcc not installed")
    return path


KERNEL = "__global__ void k(float *x) { x[0] = 1.f; }\nvoid launch(float *x) { k<<<1, 1>>>(x); }\n"


def sass_check(nvidia_venv, *args, cuobjdump: str | None = None) -> subprocess.CompletedProcess:
    sp = next(nvidia_venv.glob("lib/python*/site-packages"))
    env = {**os.environ, "CUOBJDUMP": cuobjdump or str(sp / "nvidia/cu13/bin/cuobjdump")}
    return subprocess.run(["bash", str(REPO / "dockerfiles/check-sass.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.slow   # four nvcc compiles
def test_check_sass_counts_sass_not_ptx_and_only_means_exactly_the_arch_list(nvidia_venv, nvcc, tmp_path):
    """Real libraries compiled here: PTX for 7.5 is not SASS for 7.5 (issue 41); `--only 7.5` fails a library that
    also has sm_80 (a build that ignored TORCH_CUDA_ARCH_LIST) or carries PTX (issue 36, item 3)."""
    (tmp_path / "k.cu").write_text(KERNEL)

    def lib(name: str, *gencode: str) -> str:
        out = tmp_path / f"{name}.so"
        subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", *gencode, "-o", str(out), str(tmp_path / "k.cu")],
                       check=True, timeout=600, capture_output=True)
        return str(out)
    ptx_only = lib("ptx75", "-gencode=arch=compute_75,code=compute_75")
    r = sass_check(nvidia_venv, "7.5", ptx_only)
    assert r.returncode == 1 and "no sm_75 SASS" in r.stderr and "ptx: sm_75" in r.stdout, r.stdout + r.stderr
    sass75 = lib("sass75", "-gencode=arch=compute_75,code=sm_75")
    r = sass_check(nvidia_venv, "--only", "7.5", sass75)
    assert r.returncode == 0 and "sass: sm_75 ptx: none" in r.stdout, r.stderr
    every = lib("every", "-gencode=arch=compute_75,code=sm_75", "-gencode=arch=compute_80,code=sm_80")
    assert sass_check(nvidia_venv, "7.5", every).returncode == 0
    r = sass_check(nvidia_venv, "--only", "7.5", every)
    assert r.returncode == 1 and "unexpected SASS sm_80" in r.stderr
    with_ptx = lib("ptx", "-gencode=arch=compute_75,code=[sm_75,compute_75]")
    r = sass_check(nvidia_venv, "--only", "7.5", with_ptx)
    assert r.returncode == 1 and "carries PTX (sm_75)" in r.stderr
    # PTX only where the list asks for it (TORCH_CUDA_ARCH_LIST's X+PTX), and then it must be there
    assert sass_check(nvidia_venv, "--only", "7.5+PTX", with_ptx).returncode == 0
    r = sass_check(nvidia_venv, "--only", "7.5+PTX", sass75)
    assert r.returncode == 1 and "no sm_75 PTX (asked with +PTX" in r.stderr


def test_check_sass_fails_when_cuobjdump_fails_or_the_library_is_truncated(nvidia_venv, tmp_path):
    """cuobjdump's exit status alone fails the check, even when what it printed would pass (issue 41): a cuobjdump
    that lists the real library and then exits 1 (a crash at the end). A truncated library, which cuobjdump calls
    "does not contain device code", fails on its section table."""
    sp = next(nvidia_venv.glob("lib/python*/site-packages"))
    nccl = sp / "nvidia/nccl/lib/libnccl.so.2"
    crash = tmp_path / "cuobjdump"
    crash.write_text(f'#!/bin/sh\n"{sp / "nvidia/cu13/bin/cuobjdump"}" "$@"\nexit 1\n')
    crash.chmod(0o755)
    assert sass_check(nvidia_venv, "7.5", str(nccl)).returncode == 0
    r = sass_check(nvidia_venv, "7.5", str(nccl), cuobjdump=str(crash))
    assert r.returncode == 1 and "cuobjdump failed (exit 1)" in r.stderr, r.stdout + r.stderr
    # "does not contain device code" passes a host-only library only with cuobjdump's own exit status for it (255)
    (tmp_path / "h.c").write_text("int f(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "host.so"), str(tmp_path / "h.c")], check=True,
                   timeout=60)
    assert "no device code" in sass_check(nvidia_venv, "7.5", str(tmp_path / "host.so")).stdout
    r = sass_check(nvidia_venv, "7.5", str(tmp_path / "host.so"), cuobjdump=str(crash))
    assert r.returncode == 1 and "cuobjdump failed (exit 1)" in r.stderr and "does not contain device code" in r.stderr
    cut = tmp_path / "libnccl.so.2"
    with nccl.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(60_000_000))
    r = sass_check(nvidia_venv, "7.5", str(cut))
    assert r.returncode == 1 and "truncated (its section table ends past the file)" in r.stderr, r.stdout + r.stderr


def test_check_torch_cmake_cache_fails_a_flag_on_that_the_manifest_asks_off(tmp_path):
    """Issue 41: ON in the cache where the manifest asks OFF (FlashAttention built after all) fails."""
    cache = tmp_path / "CMakeCache.txt"
    cache.write_text("USE_FLASH_ATTENTION:BOOL=ON\nUSE_CUDNN:BOOL=ON\n")
    bad = check_torch("cmake-cache", str(cache), "USE_FLASH_ATTENTION=0", "USE_CUDNN=1")
    assert bad.returncode == 1 and "USE_FLASH_ATTENTION: ON in" in bad.stderr and "asks for OFF" in bad.stderr
    assert "USE_CUDNN" not in bad.stderr


def test_check_torch_compares_every_flag_that_show_lists():
    """Issue 41: a flag torch.__config__.show() lists with the other value fails, whatever else agrees (the CPU
    wheel lists USE_MKLDNN=ON; no other evidence is read for it)."""
    pytest.importorskip("torch")
    bad = check_torch("installed", "USE_MKLDNN=0")
    assert bad.returncode == 1 and "USE_MKLDNN: ON in torch.__config__.show(), the manifest asks for OFF" in bad.stderr
    assert check_torch("installed", "USE_MKLDNN=1").returncode == 0


def test_check_torch_fails_a_feature_that_is_there_but_asked_off():
    """Issue 41: present but asked OFF fails; the CPU wheel has torch.distributed."""
    pytest.importorskip("torch")
    bad = check_torch("installed", "USE_DISTRIBUTED=0")
    assert bad.returncode == 1 and "USE_DISTRIBUTED=0: torch.distributed.is_available() is True" in bad.stderr
    ok = check_torch("installed", "USE_DISTRIBUTED=1")
    assert ok.returncode == 0 and "USE_DISTRIBUTED=1: torch.distributed.is_available(): True" in ok.stdout


def test_check_torch_kineto_needs_both_cupti_hints(nvidia_venv):
    """Issue 41: libcupti loaded (LD_PRELOAD of the pinned wheel's) without -DHAS_CUPTI in show() is not kineto."""
    pytest.importorskip("torch")
    cupti = next(nvidia_venv.glob("lib/python*/site-packages/nvidia/cu13/lib/libcupti.so.13"))
    env = {**os.environ, "LD_PRELOAD": str(cupti)}
    maps = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"], env=env,
                          capture_output=True, text=True, timeout=60).stdout
    assert "libcupti.so.13" in maps  # the hint is there
    bad = subprocess.run([sys.executable, str(CHECK_TORCH), "installed", "USE_KINETO=1"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "USE_KINETO=1: kineto built with CUPTI" in bad.stderr, bad.stdout + bad.stderr


def test_check_torch_kineto_rule_takes_the_flag_and_the_library_together():
    """Issue 41: each CUPTI hint alone is refused, both ways round. The CXX_FLAGS are those of PyPI's CUDA torch
    2.14.1 (read from its libtorch_cpu.so) and of the CPU wheel; no CUDA torch runs here, so the rule is called."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_torch", CHECK_TORCH)
    ct = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ct)
    cuda = "CXX_FLAGS= -fvisibility-inlines-hidden -DNDEBUG -DUSE_KINETO -DHAS_CUPTI -DUSE_FBGEMM -O2,"
    cpu = cuda.replace(" -DHAS_CUPTI", "")
    with_cupti, without = {"libtorch_cuda.so", "libcupti.so.13"}, {"libtorch_cuda.so", "libcudart.so.13"}
    assert ct.kineto_with_cupti(cuda, with_cupti)
    assert not ct.kineto_with_cupti(cuda, without)      # compiled with CUPTI, none loaded (static or not linked)
    assert not ct.kineto_with_cupti(cpu, with_cupti)    # CPU-only kineto; libcupti is someone else's
    assert not ct.kineto_with_cupti(cpu, without)


def test_check_torch_reads_the_kernels_names_in_the_library(tmp_path):
    """Issue 36, item 4: evidence the build was not told: the names the kernels leave in libtorch_cuda.so. Real
    shared objects built here: one with the Turing memory-efficient kernel's name and FlashAttention's namespace
    (as PyPI's 2.14 libtorch_cuda.so has both), one with neither."""
    (tmp_path / "with.cc").write_text("extern \"C\" void fmha_cutlassF_f16_aligned_64x64_rf_sm75() {}\n"
                                      "namespace pytorch_flash { void run_mha_fwd() {} }\n")
    (tmp_path / "without.cc").write_text("void other() {}\n")
    for n in ("with", "without"):
        subprocess.run(["g++", "-shared", "-fPIC", "-o", str(tmp_path / f"{n}.so"), str(tmp_path / f"{n}.cc")],
                       check=True, timeout=120)
    ok = check_torch("library", str(tmp_path / "with.so"), "USE_MEM_EFF_ATTENTION=1", "USE_FLASH_ATTENTION=1")
    assert ok.returncode == 0, ok.stderr
    bad = check_torch("library", str(tmp_path / "with.so"), "USE_FLASH_ATTENTION=0")
    assert bad.returncode == 1 and "USE_FLASH_ATTENTION=0: FlashAttention's kernels in with.so" in bad.stderr
    bad = check_torch("library", str(tmp_path / "without.so"), "USE_MEM_EFF_ATTENTION=1")
    assert bad.returncode == 1 and "fmha_cutlassF_f16_aligned_64x64_rf_sm75) is False" in bad.stderr
    assert check_torch("library", str(tmp_path / "without.so"), "USE_FLASH_ATTENTION=0").returncode == 0
    (tmp_path / "empty.so").write_bytes(b"")   # a wrong path or an empty file is not a library without the kernels
    for lib in (tmp_path / "nope.so", tmp_path / "empty.so"):
        r = check_torch("library", str(lib), "USE_FLASH_ATTENTION=0")
        assert r.returncode == 1 and r.stderr == f"check-torch: {lib}: no such library, or an empty file (nothing to " \
                                                 f"read the kernels' names from)\n", r.stderr


def test_check_torch_each_feature_of_a_cuda_build_is_absent_from_a_cpu_torch():
    """Every flag's own evidence, asked of the CPU wheel (which has none of them): each fails by name."""
    pytest.importorskip("torch")
    flags = {"USE_MEM_EFF_ATTENTION": "memory-efficient attention", "USE_CUSPARSELT": "cusparselt.is_available()",
             "USE_NVSHMEM": "libtorch_nvshmem.so", "USE_CUFILE": "libcufile linked", "USE_CUDSS": "libcudss linked",
             "USE_SYSTEM_NCCL": "libnccl.so linked", "USE_FLASH_ATTENTION": "FlashAttention's kernels"}
    bad = check_torch("installed", *(f"{f}=1" for f in flags))
    assert bad.returncode == 1
    for flag, what in flags.items():
        assert re.search(rf"{flag}=1: .*{re.escape(what)}.* is False", bad.stderr), (flag, bad.stderr)
    assert check_torch("installed", *(f"{f}=0" for f in flags)).returncode == 0


def run_link_step(tmp_path: Path, nvidia_venv: Path, old: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
    """torch-env's link step as rendered, run here: CUDA_HOME an empty tree, NCCL 2.30.7's real wheel, cuDNN a stand-in
    package (its 550 MB wheel is not fetched here: one header and one library), cmake/ninja stand-ins on PATH."""
    link = next(c.value[0] for c in stages("g5g", "torch-base")["torch-env"]
                if c.cmd == "RUN" and "nvidia.nccl" in c.value[0])
    if old:  # the recipe before issue 36: only include/*.h
        link = link.replace('"$d"/include/* "$d"/lib/lib*.so*', '"$d"/include/*.h "$d"/lib/lib*.so*')
    cuda, extra, bin_ = tmp_path / "cuda", tmp_path / "py", tmp_path / "bin"
    for d in (cuda / "include", cuda / "lib64", extra / "nvidia/cudnn/include", extra / "nvidia/cudnn/lib", bin_):
        d.mkdir(parents=True, exist_ok=True)
    (extra / "nvidia/cudnn/include/cudnn.h").write_text("#define CUDNN_MAJOR 9\n")
    (extra / "nvidia/cudnn/lib/libcudnn.so").write_text("")
    nccl = next(nvidia_venv.glob("lib/python*/site-packages/nvidia/nccl"))
    (nccl / "lib/libnccl.so").unlink(missing_ok=True)
    (nccl / "lib/libnccl.so").symlink_to("libnccl.so.2")  # as the toolkit step makes the unversioned links
    for tool in ("cmake", "ninja"):
        (bin_ / tool).write_text("#!/bin/sh\necho 1.0\n")
        (bin_ / tool).chmod(0o755)
    env = {**os.environ, "CUDA_HOME": str(cuda), "PYTHONPATH": str(extra),
           "PATH": f"{nvidia_venv / 'bin'}:{bin_}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", link], env=env, capture_output=True, text=True,
                          timeout=120), cuda


def test_the_cuda_tree_holds_ncclss_whole_include_tree(nvidia_venv, tmp_path):
    """Issue 36, item 1, on NCCL 2.30.7's wheel: every header of its include tree is found under the CUDA tree,
    nccl_device/coop.h included; the old recipe (include/*.h) fails the step, naming what it dropped."""
    r, cuda = run_link_step(tmp_path / "new", nvidia_venv)
    assert r.returncode == 0, r.stderr
    nccl = next(nvidia_venv.glob("lib/python*/site-packages/nvidia/nccl/include"))
    headers = [p.relative_to(nccl) for p in nccl.rglob("*") if p.is_file()]
    assert Path("nccl_device/coop.h") in headers and all((cuda / "include" / h).is_file() for h in headers)
    r, _ = run_link_step(tmp_path / "old", nvidia_venv, old=True)
    assert r.returncode == 1 and "include/nccl_device/coop.h: not in the CUDA tree" in r.stderr, r.stderr


def test_the_header_stage_fails_on_the_old_cuda_tree_naming_coop_h(nvidia_venv, nvcc, tmp_path):
    """Issue 36, item 2, in small: check-headers.py with nvcc for sm_75 over a header that includes <nccl_device.h>
    as torch 2.14's symm_mem/nccl_dev_cap.hpp does, against both trees of the link step."""
    inc = tmp_path / "torch-include" / "torch/csrc/distributed/c10d/symm_mem"
    inc.mkdir(parents=True)
    (inc / "nccl_dev_cap.hpp").write_text("#pragma once\n#include <nccl.h>\n#include <nccl_device.h>\n")
    for name, old in (("new", False), ("old", True)):
        _, cuda = run_link_step(tmp_path / name, nvidia_venv, old=old)
        r = subprocess.run([sys.executable, str(REPO / "dockerfiles/check-headers.py"), str(tmp_path / "torch-include"),
                            str(tmp_path / f"{name}.cu"), "--", nvcc, "-gencode=arch=compute_75,code=sm_75",
                            "-std=c++17", f"-I{tmp_path / 'torch-include'}", f"-I{cuda / 'include'}", "-c", "-o",
                            str(tmp_path / f"{name}.o")],
                           capture_output=True, text=True, timeout=600)
        if old:
            assert r.returncode == 1 and "fatal error: nccl_device/coop.h: No such file or directory" in r.stderr
        else:
            assert r.returncode == 0 and "1 of torch's headers that name NVIDIA library headers compiled" in r.stdout, \
                r.stdout + r.stderr


def test_check_headers_refuses_what_is_not_torchs_include_tree(tmp_path):
    (tmp_path / "a.h").write_text("#include <vector>\n")
    r = subprocess.run([sys.executable, str(REPO / "dockerfiles/check-headers.py"), str(tmp_path), "t.cu", "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no header under" in r.stderr and "names an NVIDIA library header" in r.stderr
    (tmp_path / "b.h").write_text("#include <cudnn.h>\n")
    r = subprocess.run([sys.executable, str(REPO / "dockerfiles/check-headers.py"), str(tmp_path), "t.cu",
                        "--skip", "c.h=third_party/x", "--", "true"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--skip c.h: no such header names an NVIDIA library header" in r.stderr


def test_every_build_tool_is_pinned_in_the_manifest_and_installed_at_its_pin():
    """Issue 36, item 5: torch's requirements.txt takes cmake>=3.27 and vLLM's cmake>=3.26.1 (4.x today): CMake and
    Ninja come at the manifests' pins in every stage that installs a build's requirements, with NVML's header for
    torch's (c10/cuda/driver_api.h), and `build.py --dry-run` shows them."""
    m = manifest.load(REPO / "manifests", profile="g5g")
    for runtime, arg_name, reqs in (("torch-base", "TORCH_BUILD_TOOLS", "requirements.txt"),
                                    ("vllm", "VLLM_BUILD_TOOLS", "requirements/build/cuda.txt")):
        pins = m.runtimes[runtime].pins
        assert {"cmake", "ninja"} <= set(pins), runtime
        s = stages("g5g", runtime)
        stage = "torch-build" if runtime == "torch-base" else "vllm-build"
        tools = arg(s[stage], arg_name).strip('"').split()
        assert {f"cmake=={pins['cmake']}", f"ninja=={pins['ninja']}"} <= set(tools), tools
        assert f"pip install -r {reqs} ${arg_name}" in runs(s[stage])
        every = "\n".join(runs(st) for st in s.values())
        assert not re.search(r"pip install[^&|]*\b(cmake|ninja)\b(?!==)", every.replace("${", "")), runtime
    tb = stages("g5g", "torch-base")
    assert "cuda-toolkit[nvml]==13.0.3" in arg(tb["torch-env"], "TORCH_BUILD_TOOLS")
    assert "${TORCH_BUILD_TOOLS}" in runs(tb["torch-env"])
    from g5g.plan import make_plan as plan_of
    up = {i.runtime: i.upstream for i in plan_of(m, profile="g5g").images}
    assert up["torch-base"]["cmake"] == up["vllm"]["cmake"] == "3.31.10" and up["torch-base"]["ninja"] == "1.13.2"


@pytest.mark.parametrize("profile,flags", [("g5g", "-mtune=neoverse-n1"), ("g4dn", "-march=x86-64-v3 -mtune=cascadelake")])
def test_host_code_flags_are_the_platforms_own(profile, flags, tmp_path):
    """Issue 36, item 7: on x86 GCC's -mcpu is a deprecated alias of -mtune (no baseline at all): the profile names
    its flags, -march on x86; on aarch64 -mtune (issue 51: never -mcpu, which GCC refuses beside FBGEMM's -march);
    the compile and the discovery rehearsal export them."""
    plan = make_plan(manifest.load(REPO / "manifests", profile=profile, rehearse=True), profile=profile, rehearse=True)
    tb = next(i for i in plan.all_images if i.runtime == "torch-base")
    assert tb.build_args["CPU_FLAGS"] == flags
    assert 'CFLAGS="${CPU_FLAGS}" CXXFLAGS="${CPU_FLAGS}"' in render.render(plan)[tb.dockerfile]
    if platform.machine() == "x86_64" and profile == "g4dn":  # the host compiler takes them, silently
        (tmp_path / "a.c").write_text("int main(void) { return 0; }\n")
        r = subprocess.run(["gcc", *flags.split(), "-Werror", "-c", "-o", str(tmp_path / "a.o"), str(tmp_path / "a.c")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and not r.stderr, r.stderr


def test_the_header_stage_gates_the_compile_with_torchs_defines_archs_and_include_path():
    """Issue 36, item 2, as rendered for g5g: the stage's own shell turns the profile's archs into SASS-only gencodes
    and the flags set to 1 (plus USE_C10D_NCCL) into defines; the include path is the real build's; torch-build
    starts only once the stage's log exists (BuildKit builds what a COPY --from needs first)."""
    s = stages("g5g", "torch-base")
    hdr = runs(s["torch-headers"])
    assert 'pip download --no-deps --only-binary=:all: --dest /tmp/torch-wheel "torch==${TORCH_VERSION}"' in hdr
    for inc in ('-I"$inc"', '-I"$inc/torch/csrc/api/include"', '-I"$CUDA_HOME/include"', '-I"$nv/cusparselt/include"',
                '-I"$nv/nvshmem/include"'):
        assert inc in hdr, inc
    env = {k: arg(s["torch-headers"], k).strip('"') for k in ("TORCH_CUDA_ARCH_LIST", "TORCH_BUILD_FLAGS",
                                                              "TORCH_HEADER_DEFINES", "TORCH_HEADER_SKIP")}
    snippets = re.findall(r"((?:gencode|defines|skips)=\$\(.*?; done\))", hdr)
    assert len(snippets) == 3
    r = subprocess.run(["bash", "-c", "; ".join(snippets) + '; echo "$gencode|$defines|$skips"'],
                       env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
    gencode, defines, skips = r.stdout.strip().split("|")
    assert gencode.split() == ["-gencode=arch=compute_75,code=sm_75"]
    assert {"-DUSE_CUDA=1", "-DUSE_CUDNN=1", "-DUSE_NCCL=1", "-DUSE_DISTRIBUTED=1", "-DUSE_C10D_NCCL=1",
            "-DUSE_MEM_EFF_ATTENTION=1"} <= set(defines.split())
    assert not any(d.endswith("=0") or "FLASH" in d for d in defines.split())
    assert skips.split()[::2] == ["--skip"] * 3 and all("=third_party/" in x for x in skips.split()[1::2])
    nvcc_flags = arg(s["torch-headers"], "TORCH_HEADER_NVCC_FLAGS").strip('"').split()
    assert {"-std=c++20", "--expt-relaxed-constexpr", "--expt-extended-lambda", "-D__CUDA_NO_HALF_OPERATORS__"} <= \
        set(nvcc_flags)
    build = s["torch-build"]
    copy = next(c for c in build if c.cmd == "COPY")
    assert copy.flags == ("--from=torch-headers",) and build.index(copy) < next(
        i for i, c in enumerate(build) if c.cmd == "RUN" and "git clone" in c.value[0])


# --- issue 51, item 4: JAX's sm_75 proven on its CUDA plugin's libraries ------------------------------------------------

def jax_sass_check(nvidia_venv, archs: str, site: Path) -> subprocess.CompletedProcess:
    sp = next(nvidia_venv.glob("lib/python*/site-packages"))
    env = {**os.environ, "CUOBJDUMP": str(sp / "nvidia/cu13/bin/cuobjdump")}
    return subprocess.run(["bash", str(REPO / "dockerfiles/check-jax-sass.sh"), archs, str(site)], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.slow   # one nvcc compile
def test_the_jax_plugin_check_fails_a_plugin_library_without_sm75(nvidia_venv, nvcc, tmp_path):
    """A site-packages laid out as jax[cuda13]'s (the PJRT plugin, jax_cuda13_plugin's kernels and host-only
    libraries), of real libraries: NCCL's (sm_75 among others, and PTX) passes; one library compiled for sm_80 only
    (the mutation: a plugin without sm_75) fails, named; no plugin, or no device code in it, fails too."""
    sp = next(nvidia_venv.glob("lib/python*/site-packages"))
    site = tmp_path / "site-packages"
    (site / "jax_plugins/xla_cuda13").mkdir(parents=True)
    (site / "jax_cuda13_plugin").mkdir()
    shutil.copy(sp / "nvidia/nccl/lib/libnccl.so.2", site / "jax_plugins/xla_cuda13/xla_cuda_plugin.so")
    shutil.copy(sp / "nvidia/nccl/lib/libnccl.so.2", site / "jax_cuda13_plugin/_prng.so")
    (tmp_path / "h.c").write_text("int f(void) { return 1; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(site / "jax_cuda13_plugin/_hybrid.so"), str(tmp_path / "h.c")],
                   check=True, timeout=60)
    r = jax_sass_check(nvidia_venv, "7.5", site)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "_hybrid.so: no device code" in r.stdout and "3 JAX CUDA plugin libraries" in r.stdout
    assert re.search(r"xla_cuda_plugin\.so sass: .*\bsm_75\b", r.stdout)
    # the mutation: one kernel library of the plugin built without sm_75
    (tmp_path / "k.cu").write_text(KERNEL)
    subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-gencode=arch=compute_80,code=sm_80", "-o",
                    str(site / "jax_cuda13_plugin/_prng.so"), str(tmp_path / "k.cu")], check=True, timeout=600,
                   capture_output=True)
    r = jax_sass_check(nvidia_venv, "7.5", site)
    assert r.returncode == 1 and f"{site}/jax_cuda13_plugin/_prng.so: no sm_75 SASS (it has: sm_80)" in r.stderr, \
        r.stdout + r.stderr
    # nothing to read is not a pass
    r = jax_sass_check(nvidia_venv, "7.5", tmp_path / "empty")
    assert r.returncode == 1 and "no JAX CUDA plugin library under" in r.stderr
    for so in ("jax_plugins/xla_cuda13/xla_cuda_plugin.so", "jax_cuda13_plugin/_prng.so"):
        (site / so).unlink()
    r = jax_sass_check(nvidia_venv, "7.5", site)
    assert r.returncode == 1 and "none of the 1 plugin libraries" in r.stderr and "holds device code" in r.stderr


@pytest.mark.parametrize("profile,rehearse", [("g5g", False), ("g5g", True), ("g4dn", False)])
def test_the_jax_image_and_the_rehearsal_check_the_plugins_sass(profile, rehearse):
    """The check runs in the jax image's build (the rehearsal builds it as always), after jax[cuda13] is installed,
    against the profile's archs, with both scripts in its build context."""
    m = manifest.load(REPO / "manifests", profile=profile)
    plan = make_plan(m, profile=profile, repo_root=REPO, rehearse=rehearse)
    jax = next(i for i in plan.images if i.runtime == "jax")
    text = render.render(plan)[jax.dockerfile].replace("\\\n", "")
    assert jax.build_args["JAX_CUDA_ARCHS"] == " ".join(m.profiles[profile].cuda.archs) == "7.5"
    assert {"dockerfiles/check-sass.sh", "dockerfiles/check-jax-sass.sh"} <= set(jax.copy)
    check = text.index('bash /tmp/check/check-jax-sass.sh "${JAX_CUDA_ARCHS}"')
    assert text.index('pip install "jax[${JAX_EXTRA}]==${JAX_VERSION}"') < check
    assert "CUOBJDUMP=/tmp/cuobjdump/nvidia/cu13/bin/cuobjdump bash /tmp/check/check-jax-sass.sh" in text
