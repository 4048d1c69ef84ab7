"""tools/vllm_sources.py: vLLM's external projects laid out for a build without GitHub, from real git mirrors and a
wheel-shaped zip made here; and the real source list for 0.33.0 matches the sdist's CMake."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from g5g import patches

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import vllm_sources  # noqa: E402


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}).stdout.strip()


@pytest.fixture()
def mirrors(tmp_path: Path) -> Path:
    """A bare mirror of 'NVIDIA/cutlass' with tags v1.0 and v1.1 (the layout <owner>+<name>/repo)."""
    work = tmp_path / "work"
    work.mkdir()
    git(work, "init", "-q")
    (work / "include").mkdir()
    (work / "include" / "cutlass.h").write_text("// v1.0\n")
    (work / "run.sh").write_text("#!/bin/sh\n")
    (work / "run.sh").chmod(0o755)
    git(work, "add", "-A")
    git(work, "commit", "-qm", "one")
    git(work, "tag", "v1.0")
    (work / "include" / "cutlass.h").write_text("// v1.1\n")
    git(work, "commit", "-qam", "two")
    git(work, "tag", "v1.1")
    root = tmp_path / "mirrors"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(root / "NVIDIA+cutlass" / "repo")], check=True)
    return root


@pytest.fixture()
def wheel(tmp_path: Path) -> Path:
    path = tmp_path / "vllm-0.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm/vllm_flash_attn/__init__.py", "ours\n")
        z.writestr("vllm/vllm_flash_attn/layers/rotary.py", "rotary\n")
        z.writestr("vllm/vllm_flash_attn/cute/interface.py", "cute\n")
        z.writestr("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", b"\x7fELF")
        z.writestr("vllm/third_party/flashmla/flash_mla_interface.py",
                   "import torch\nimport vllm._flashmla_C\nflash_mla_cuda = torch.ops._flashmla_C\n")
    return path


SPEC = {
    "vllm": "0.0.0",
    "wheel": "vllm-0.0.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    "projects": [
        {"name": "cutlass", "env": "VLLM_CUTLASS_SRC_DIR", "repo": "NVIDIA/cutlass", "ref": "v1.2", "fallback_ref": "v1.1"},
        {"name": "fa", "env": "VLLM_FLASH_ATTN_SRC_DIR", "repo": "x/fa", "ref": "abc",
         "from_wheel": {"vllm/vllm_flash_attn/cute/": "flash_attn/cute/", "vllm/vllm_flash_attn/": "vllm_flash_attn/"},
         "exclude": ["vllm/vllm_flash_attn/__init__.py"]},
        {"name": "flashmla", "env": "FLASH_MLA_SRC_DIR", "repo": "x/mla", "ref": "def",
         "from_wheel": {"vllm/third_party/flashmla/flash_mla_interface.py": "flash_mla/flash_mla_interface.py"},
         "drop_lines": ["import vllm._flashmla_C"]},
        {"name": "deepgemm", "env": "DEEPGEMM_SRC_DIR", "repo": "x/dg", "ref": "123", "kernels_only": True},
    ],
}


def test_prepare_takes_mirror_fallback_wheel_and_placeholder(mirrors: Path, wheel: Path, tmp_path: Path):
    out = tmp_path / "out"
    rec = vllm_sources.prepare(SPEC, mirrors, wheel, out)
    p = rec["projects"]
    # v1.2 is not in the mirror: the fallback ref is used, and said.
    assert p["cutlass"]["from"] == "git" and p["cutlass"]["ref"] == "v1.1" and p["cutlass"]["pinned_ref"] == "v1.2"
    assert (out / "cutlass" / "include" / "cutlass.h").read_text() == "// v1.1\n"
    assert (out / "cutlass" / "run.sh").stat().st_mode & 0o111
    # Wheel members mapped to source paths, longest prefix first; vLLM's own files and .so files left out.
    assert (out / "fa" / "flash_attn" / "cute" / "interface.py").read_text() == "cute\n"
    assert (out / "fa" / "vllm_flash_attn" / "layers" / "rotary.py").exists()
    assert not (out / "fa" / "vllm_flash_attn" / "__init__.py").exists()
    assert not list((out / "fa").rglob("*.so")) and not (out / "fa" / "vllm_flash_attn" / "cute").exists()
    # flashmla.cmake inserts the import again at build time: the stand-in must not carry it twice.
    assert "import vllm._flashmla_C" not in (out / "flashmla" / "flash_mla" / "flash_mla_interface.py").read_text()
    # Kernel-only projects get a non-empty placeholder (FetchContent refuses an empty SOURCE_DIR).
    assert p["deepgemm"]["from"] == "empty" and list((out / "deepgemm").iterdir())
    env = (out / "env.sh").read_text()
    assert 'export VLLM_CUTLASS_SRC_DIR="$VLLM_SOURCES/cutlass"' in env and "DEEPGEMM_SRC_DIR" in env
    assert json.loads((out / "SOURCES.json").read_text()) == rec
    # The env file resolves against wherever the directory is mounted.
    shown = subprocess.run(["bash", "-c", f". {out}/env.sh; echo $FLASH_MLA_SRC_DIR"], capture_output=True, text=True)
    assert shown.stdout.strip() == f"{out}/flashmla"


def test_a_project_with_no_source_is_one_clear_line(mirrors: Path, tmp_path: Path):
    with pytest.raises(SystemExit, match=r"fa: x/fa@abc is not in .*pass --wheel"):
        vllm_sources.prepare(SPEC, mirrors, None, tmp_path / "out")


def test_the_source_list_matches_the_sdists_cmake():
    """Every GitHub fetch and *_SRC_DIR variable in vLLM's CMake is in manifests/vllm-sources/<version>.yaml."""
    spec = yaml.safe_load((ROOT / "manifests" / "vllm-sources" / "0.33.0.yaml").read_text())
    pin = patches.manifest_pin()
    sdist = patches.fetch_sdist(spec["vllm"], pin[1] if pin else None)  # cached under .cache/vllm-sdist/
    with tarfile.open(sdist.path) as t:
        cmake = "\n".join(t.extractfile(m).read().decode() for m in t.getmembers()
                          if m.name.endswith(".cmake") and "external_projects" in m.name
                          or m.name.endswith("/CMakeLists.txt") and m.name.count("/") == 1)
    envs = {p["env"] for p in spec["projects"]}
    assert set(re.findall(r"DEFINED ENV\{(\w+_SRC_DIR)\}", cmake)) == envs
    for p in spec["projects"]:
        assert p["ref"] in cmake, f"{p['name']}: pinned ref {p['ref']} not in vLLM's CMake"
