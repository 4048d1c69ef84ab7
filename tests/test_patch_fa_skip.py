"""Patch 0002: a build whose target archs are all below sm_80 skips FlashAttention's FA2/FA3 kernels.

Checked on the pinned vLLM sdist (package index, cached under .cache/vllm-sdist/) with both our patches applied
in order:
- CMake: the patched cmake/external_projects/vllm_flash_attn.cmake runs, as vLLM's CMakeLists.txt includes it, in
  a small project with real cmake; `cmake --build --target` and `cmake --install --component` run as setup.py
  runs them. The seam: FA's source tree (fetched from GitHub in a real build) is a stand-in whose two extension
  targets only write a stamp when built, and whose Python files are the paths FA ships (layers/rotary.py, …);
  G5G_FA_SRC=<a vllm-project/flash-attention checkout> adds a run with FA's real tree.
- Python: tools/vllm_fa_probe.py imports vllm.vllm_flash_attn, its layers.rotary as the CMake install left it, and
  fa_utils (what mm_encoder_attention imports on Gemma 4's path) from the tree, with a CUDA torch stand-in.
What cannot run here is the CUDA build itself (docs/building.md, "Building", says how to check it on a real one).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from g5g import patches

FA_CMAKE = "cmake/external_projects/vllm_flash_attn.cmake"
FA_PY = ("setup.py", "vllm/vllm_flash_attn/__init__.py", "vllm/vllm_flash_attn/flash_attn_interface.py",
         "vllm/v1/attention/backends/fa_utils.py", FA_CMAKE)
OURS = ("patches/vllm/0.33.0/0001-triton-attn-turing-smem.patch",
        "patches/vllm/0.33.0/0002-skip-flash-attn-below-sm80.patch")
PROBE = patches.REPO_ROOT / "tools" / "vllm_fa_probe.py"

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(unpatched, patched) vLLM source roots: the pinned sdist, and it with the manifest's patches in order."""
    pin = patches.manifest_pin()
    version = pin[0] if pin else "0.33.0"
    sdist = patches.fetch_sdist(version, pin[1] if pin else None)
    listed = patches.patches_for(version)
    assert [rel for rel, _ in listed][: len(OURS)] == list(OURS)  # both ours, 0001 first, each sha256-pinned
    assert all(sha for _, sha in listed)
    return patches.apply_all(listed, sdist, tmp_path_factory.mktemp("fa-skip"), FA_PY)


def test_both_patches_apply_in_order(trees):
    unpatched, patched = trees
    text = (patched / FA_CMAKE).read_text()
    assert "VLLM_FA_SKIP_KERNELS" in text and "VLLM_FA_SKIP_KERNELS" not in (unpatched / FA_CMAKE).read_text()
    assert "_pre_ampere_shared_mem_bytes" in (patched / "vllm/v1/attention/ops/triton_unified_attention.py").read_text()


def test_0002_touches_none_of_0001s_files():
    """0002 touches none of 0001's files: each can be dropped independently when upstream catches up."""
    a, b = (set(patches.touched_files(patches.REPO_ROOT / p)) for p in OURS)
    assert a and b and not a & b


def _fa_extensions(setup_py: Path) -> dict:
    """setup.py's CMakeExtension(...) calls for the FA2/FA3 targets: {name: optional}."""
    import ast

    found = {}
    for node in ast.walk(ast.parse(setup_py.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "CMakeExtension":
            kw = {k.arg: k.value for k in node.keywords}
            name = kw["name"].value if "name" in kw else node.args[0].value
            if "_vllm_fa" in name and "cutedsl" not in name:
                found[name] = isinstance(kw.get("optional"), ast.Constant) and kw["optional"].value is True
    return found


def test_setup_py_no_longer_requires_the_fa_outputs(trees):
    """setuptools copies a missing extension output only for optional=False (editable installs): FA2/FA3 optional."""
    names = ["vllm.vllm_flash_attn._vllm_fa2_C", "vllm.vllm_flash_attn._vllm_fa3_C"]
    assert _fa_extensions(trees[0] / "setup.py") == dict.fromkeys(names, False)
    assert _fa_extensions(trees[1] / "setup.py") == dict.fromkeys(names, True)


# --- CMake ---------------------------------------------------------------------------------------------------------

PROJECT = """cmake_minimum_required(VERSION 3.25)
project(fa_skip LANGUAGES NONE)
include(FetchContent)
set(FETCHCONTENT_FULLY_DISCONNECTED ON)
set(VLLM_GPU_LANG "CUDA")
include("{fa_cmake}")
"""

# Stand-in for vllm-project/flash-attention's CMakeLists.txt: building an extension target writes a stamp, so a
# stamp means "FA's kernels would have been compiled".
FA_STANDIN = """cmake_minimum_required(VERSION 3.25)
project(vllm_flash_attn LANGUAGES NONE)
message(STATUS "stand-in FA project added")
foreach(_t _vllm_fa2_C _vllm_fa3_C)
  add_custom_target(${_t} COMMAND ${CMAKE_COMMAND} -E touch "${CMAKE_BINARY_DIR}/${_t}.compiled")
endforeach()
"""
FA_PY_FILES = {  # paths FA ships under vllm_flash_attn/ and flash_attn/cute/; content is ours
    "vllm_flash_attn/__init__.py": "raise AssertionError('vLLM keeps its own __init__.py')\n",
    "vllm_flash_attn/flash_attn_interface.py": "raise AssertionError('vLLM keeps its own interface')\n",
    "vllm_flash_attn/layers/__init__.py": "",
    "vllm_flash_attn/layers/rotary.py":
        "from vllm.vllm_flash_attn.ops.triton.rotary import apply_rotary\n\n\n"
        "def apply_rotary_emb(x, cos, sin, interleaved=False):\n    return apply_rotary(x, cos, sin, interleaved)\n",
    "vllm_flash_attn/ops/__init__.py": "",
    "vllm_flash_attn/ops/triton/__init__.py": "",
    "vllm_flash_attn/ops/triton/rotary.py": "def apply_rotary(x, cos, sin, interleaved=False):\n    return x\n",
    "flash_attn/cute/__init__.py": "",
}


@pytest.fixture(scope="module")
def fa_source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fa-src")
    (root / "CMakeLists.txt").write_text(FA_STANDIN)
    for rel, text in FA_PY_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def cmake_build(src_root: Path, fa_source: Path, work: Path, archs: str, *, env_skip: str | None = None,
                define_skip: str | None = None, via_git_branch: bool = False, prefix: Path | None = None) -> dict:
    """Configure, build the FA targets and install their components as setup.py does; what happened."""
    proj, build = work / "proj", work / "build"
    proj.mkdir(parents=True, exist_ok=True)
    (proj / "CMakeLists.txt").write_text(PROJECT.format(fa_cmake=(src_root / FA_CMAKE).as_posix()))
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_SKIP_FLASH_ATTN", "VLLM_FLASH_ATTN_SRC_DIR")}
    args = ["cmake", "-S", str(proj), "-B", str(build), f"-DCUDA_ARCHS={archs}"]
    if via_git_branch:  # the GitHub FetchContent_Declare, its download replaced by a local source dir
        args.append(f"-DFETCHCONTENT_SOURCE_DIR_VLLM-FLASH-ATTN={fa_source}")
    else:
        env["VLLM_FLASH_ATTN_SRC_DIR"] = str(fa_source)
    if env_skip is not None:
        env["VLLM_SKIP_FLASH_ATTN"] = env_skip
    if define_skip is not None:
        args.append(f"-DVLLM_SKIP_FLASH_ATTN={define_skip}")
    conf = subprocess.run(args, env=env, capture_output=True, text=True)
    out = {"configured": conf.returncode == 0, "log": conf.stdout + conf.stderr}
    if conf.returncode:
        return out
    targets = ["_vllm_fa2_C", "_vllm_fa3_C", "_vllm_fa4_cutedsl_C"]
    b = subprocess.run(["cmake", "--build", str(build), *[f"--target={t}" for t in targets]],
                       env=env, capture_output=True, text=True)
    assert b.returncode == 0, b.stdout + b.stderr
    prefix = prefix or work / "prefix"
    for component in targets:
        i = subprocess.run(["cmake", "--install", str(build), "--prefix", str(prefix), "--component", component],
                           env=env, capture_output=True, text=True)
        assert i.returncode == 0, i.stdout + i.stderr
    stamps = sorted(p.name.removesuffix(".compiled") for p in build.rglob("*.compiled"))
    installed = sorted(str(p.relative_to(prefix)) for p in (prefix / "vllm" / "vllm_flash_attn").rglob("*.py"))
    return dict(out, compiled=stamps, fa_project_added="stand-in FA project added" in conf.stdout,
                skip_message="vllm-flash-attn: kernels not built" in conf.stdout, installed=installed)


ROTARY = "vllm/vllm_flash_attn/layers/rotary.py"


@pytest.mark.parametrize("archs, expect_skip", [
    ("7.5", True),
    ("7.0;7.5", True),
    ("7.5;8.0", False),
    ("7.5;8.6", False),
    ("9.0a", False),
    ("7.5;10.0f", False),
    ("8.0;8.6;8.7;8.9;9.0;10.0;11.0;12.0", False),  # upstream's arm64 list: unchanged
])
@pytest.mark.parametrize("via_git_branch", [False, True], ids=["src-dir", "git"])
def test_cmake_builds_fa_kernels_only_for_sm80_and_newer(trees, fa_source, tmp_path, archs, expect_skip,
                                                         via_git_branch):
    r = cmake_build(trees[1], fa_source, tmp_path, archs, via_git_branch=via_git_branch)
    assert r["configured"], r["log"]
    if expect_skip:
        assert r["compiled"] == [] and not r["fa_project_added"] and r["skip_message"], r
    else:
        assert r["compiled"] == ["_vllm_fa2_C", "_vllm_fa3_C"] and r["fa_project_added"], r
        assert not r["skip_message"]
    # Either way FA's Python files are installed as before (vLLM's own __init__/interface excluded).
    assert ROTARY in r["installed"]
    assert "vllm/vllm_flash_attn/ops/triton/rotary.py" in r["installed"]
    assert "vllm/vllm_flash_attn/__init__.py" not in r["installed"]


def test_unpatched_cmake_compiles_fa_for_7_5(trees, fa_source, tmp_path):
    """The problem, reproduced: released vLLM adds FA's project and builds both extensions for 7.5 alone."""
    r = cmake_build(trees[0], fa_source, tmp_path, "7.5")
    assert r["configured"], r["log"]
    assert r["compiled"] == ["_vllm_fa2_C", "_vllm_fa3_C"] and r["fa_project_added"]


@pytest.mark.parametrize("archs, how, value, expect_skip", [
    ("7.5", "env", "0", False),
    ("7.5;8.0", "env", "1", True),
    ("7.5", "define", "0", False),
    ("9.0", "define", "1", True),
    ("7.5", "env", "", True),  # empty: as if unset
])
def test_override(trees, fa_source, tmp_path, archs, how, value, expect_skip):
    kw = {"env_skip": value} if how == "env" else {"define_skip": value}
    r = cmake_build(trees[1], fa_source, tmp_path, archs, **kw)
    assert r["configured"], r["log"]
    assert (r["compiled"] == []) is expect_skip, r


@pytest.mark.parametrize("how", ["env", "define"])
def test_override_bad_value_is_one_clear_error(trees, fa_source, tmp_path, how):
    kw = {"env_skip": "yes"} if how == "env" else {"define_skip": "maybe"}
    r = cmake_build(trees[1], fa_source, tmp_path, "7.5", **kw)
    assert not r["configured"]
    assert f"VLLM_SKIP_FLASH_ATTN must be 0 or 1, not '{'yes' if how == 'env' else 'maybe'}'" in r["log"]


# --- Python ----------------------------------------------------------------------------------------------------------

def fa_probe(src: Path, torch_cuda: str = "13.0") -> dict:
    out = subprocess.run([sys.executable, str(PROBE), "--src", str(src), "--torch-cuda", torch_cuda],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def installed_7_5(trees, fa_source, tmp_path_factory):
    """The patched tree with FA's Python files installed by the patched CMake for a 7.5-only build, into the
    tree as setup.py installs into build_lib (prefix = the directory holding vllm/)."""
    patched = trees[1]
    work = tmp_path_factory.mktemp("fa-install")
    r = cmake_build(patched, fa_source, work, "7.5", prefix=patched)
    assert r["compiled"] == [] and ROTARY in r["installed"], r
    return patched


def test_patched_python_reports_fa_unavailable_without_raising(installed_7_5):
    r = fa_probe(installed_7_5)
    fa = r["vllm_flash_attn"]
    assert fa["imported"], fa
    assert not fa["FA2_AVAILABLE"] and not fa["FA3_AVAILABLE"]
    assert fa["supported"] == {"2": False, "3": False, "4": False}
    assert fa["reasons"]["2"].startswith("FA2 is unavailable due to: ") and "_vllm_fa2_C" in fa["reasons"]["2"]
    assert r["rotary"] == {"imported": True, "apply_rotary_emb": True}  # rotary_embedding/common.py's import
    # mm_encoder_attention's import on Gemma 4's path, and FA's verdict: no FA version, so another backend.
    assert r["fa_utils"] == {"imported": True, "flash_attn_version": None}


def test_unpatched_python_raises_on_the_gemma4_path(trees):
    r = fa_probe(trees[0])
    for key in ("vllm_flash_attn", "fa_utils"):
        assert not r[key]["imported"]
        assert r[key]["error"].startswith("ImportError: vllm.vllm_flash_attn requires the CUDA flash attention")


def test_patched_python_still_raises_without_cuda_torch(installed_7_5):
    """ROCm/CPU torch: unchanged, the package refuses to import as released vLLM does."""
    r = fa_probe(installed_7_5, torch_cuda="none")
    assert not r["vllm_flash_attn"]["imported"]
    assert r["vllm_flash_attn"]["error"].startswith("ImportError: vllm.vllm_flash_attn requires")


# --- the image build's check on the wheel ---------------------------------------------------------------------------

def _wheel_check_step() -> str:
    from g5g import manifest, render
    from g5g.plan import make_plan

    plan = make_plan(manifest.load(patches.REPO_ROOT / "manifests", profile="g5g"), profile="g5g")
    text = render.render(plan)["build/vllm/Dockerfile"].replace("\\\n", "")
    line = next(ln for ln in text.splitlines() if "FlashAttention extensions in the wheel" in ln)
    return line[line.index("python3 -c"):]


@pytest.mark.parametrize("members, ok, listed", [
    (["vllm/vllm_flash_attn/layers/rotary.py"], True, "none"),
    (["vllm/vllm_flash_attn/layers/rotary.py", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"], True,
     "['vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so']"),
    (["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"], False, None),
])
def test_rendered_wheel_check(tmp_path, members, ok, listed):
    """The vLLM Dockerfile's step after `pip wheel`: lists FA extensions, fails without FA's rotary module."""
    import zipfile

    with zipfile.ZipFile(tmp_path / "vllm-0.33.0-cp38-abi3-linux_aarch64.whl", "w") as z:
        for m in members:
            z.writestr(m, "")
    step = _wheel_check_step().replace("/wheels/", f"{tmp_path}/").replace("python3 -c", f"{sys.executable} -c", 1)
    r = subprocess.run(["bash", "-c", step], capture_output=True, text=True)
    assert (r.returncode == 0) is ok, r.stderr
    if ok:
        assert r.stdout.strip() == f"FlashAttention extensions in the wheel: {listed}"
    else:
        assert "vllm/vllm_flash_attn/layers/rotary.py missing from the wheel" in r.stderr


@pytest.mark.optional
@pytest.mark.skipif(not os.environ.get("G5G_FA_SRC"),
                    reason="G5G_FA_SRC (a vllm-project/flash-attention checkout) not set: stand-in FA tree only")
def test_real_fa_tree_installs_an_importable_rotary(trees, tmp_path):
    """With FA's real source tree (G5G_FA_SRC) the patched CMake skips its real CMakeLists for 7.5 and installs its
    real Python files, and `vllm.vllm_flash_attn.layers.rotary.apply_rotary_emb` imports (it needs einops and
    triton, both vLLM dependencies)."""
    pytest.importorskip("einops")
    tree = tmp_path / "tree"
    shutil.copytree(trees[1], tree)
    r = cmake_build(tree, Path(os.environ["G5G_FA_SRC"]), tmp_path / "work", "7.5", prefix=tree, via_git_branch=True)
    assert r["configured"] and r["compiled"] == [] and not r["fa_project_added"], r.get("log")
    assert ROTARY in r["installed"] and "vllm/vllm_flash_attn/ops/triton/rotary.py" in r["installed"]
    probe = fa_probe(tree)
    assert probe["rotary"] == {"imported": True, "apply_rotary_emb": True}, probe["rotary"]
    assert probe["fa_utils"] == {"imported": True, "flash_attn_version": None}
