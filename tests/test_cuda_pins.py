"""nvcc and cccl at the toolkit's own versions wherever a package would pull its own (issue 51, item 7): the CUDA
profiles' cuda.constraints, read back from cuda-toolkit==pip_toolkit's metadata, cover every CUDA part that vLLM's
humming-kernels[cu13] asks for unpinned, and torch-base's PIP_CONSTRAINT holds every later pip install to them."""
from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from g5g import manifest, render
from g5g.errors import UserError
from g5g.plan import make_plan

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".cache" / "nvidia-wheels"
PROFILES = ("g5g", "g4dn")


def _metadata(requirement: str, *platform: str) -> str:
    """METADATA of the wheel of `requirement` (name==version), downloaded once into .cache/nvidia-wheels."""
    name, version = requirement.split("==")
    stem = f"{name.replace('-', '_')}-{version}"
    found = [w for w in WHEELS.glob(f"{stem}*.whl") if re.match(rf"{re.escape(stem)}(\.0)?-", w.name)]
    if not found:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            *platform, "-d", str(WHEELS), requirement], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        found = [w for w in WHEELS.glob(f"{stem}*.whl") if re.match(rf"{re.escape(stem)}(\.0)?-", w.name)]
    with zipfile.ZipFile(found[0]) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def _requires(metadata: str) -> list[str]:
    return [ln.split(":", 1)[1].strip() for ln in metadata.splitlines() if ln.startswith("Requires-Dist:")]


@pytest.mark.parametrize("profile", PROFILES)
def test_the_constraints_are_the_toolkits_own_versions(profile):
    cuda = manifest.load(REPO / "manifests", profile=profile).profiles[profile].cuda
    toolkit = {}
    for req in _requires(_metadata(f"cuda-toolkit=={cuda.pip_toolkit}")):
        if m := re.match(r"^([\w.-]+)==([\d.]+)\.\*", req):
            toolkit[m.group(1)] = m.group(2)
    assert {"nvidia-cuda-nvcc", "nvidia-cuda-cccl"} <= set(cuda.constraints)
    for name, version in cuda.constraints.items():
        assert toolkit.get(name) == version, f"{profile}: {name}=={version}, cuda-toolkit {cuda.pip_toolkit} has " \
                                             f"{toolkit.get(name)}"


def test_every_cuda_part_humming_kernels_asks_for_unpinned_is_constrained(vllm_sdist):
    with tarfile.open(vllm_sdist.path) as t:
        cuda_txt = t.extractfile(f"vllm-{vllm_sdist.version}/requirements/cuda.txt").read().decode()
    m = re.search(r"^humming-kernels\[(\w+)\]==([\w.]+)", cuda_txt, re.M)
    assert m and m.group(1) == "cu13", "vLLM's requirements/cuda.txt no longer asks for humming-kernels[cu13]"
    meta = _metadata(f"humming-kernels=={m.group(2)}", "--platform", "manylinux_2_28_x86_64", "--python-version", "3.13")
    asked = {re.match(r"^([\w.-]+)", r).group(1) for r in _requires(meta)
             if re.search(r"extra == .cu13.", r) and r.startswith("nvidia-")}
    assert {"nvidia-cuda-nvcc", "nvidia-cuda-cccl"} <= asked
    for profile in PROFILES:
        constraints = manifest.load(REPO / "manifests", profile=profile).profiles[profile].cuda.constraints
        assert asked <= set(constraints), f"{profile}: {sorted(asked - set(constraints))} unconstrained"


@pytest.mark.parametrize("profile,rehearse", [("g5g", False), ("g5g", True), ("g4dn", False)])
def test_torch_bases_pip_constraint_holds_every_later_install_to_them(profile, rehearse):
    m = manifest.load(REPO / "manifests", profile=profile)
    plan = make_plan(m, profile=profile, repo_root=REPO, rehearse=rehearse)
    files = render.render(plan)
    tb = next(i for i in plan.all_images if i.runtime == "torch-base")
    want = " ".join(f"{k}=={v}" for k, v in m.profiles[profile].cuda.constraints.items())
    assert tb.build_args["CUDA_CONSTRAINTS"] == want and "nvidia-cuda-nvcc==13.0.88" in want
    text = files[tb.dockerfile].replace("\\\n", "")
    written = text.index("printf '%s\\n' ${CUDA_CONSTRAINTS} >> /opt/g5g/constraints.txt")
    assert written < text.index("ENV PIP_CONSTRAINT=/opt/g5g/constraints.txt")
    assert written > text.rindex("\nFROM ")        # in the image itself, not a build stage
    for img in plan.all_images:      # nothing after torch-base drops or replaces the constraint
        assert not re.search(r"^(ENV|ARG)\b.*\bPIP_CONSTRAINT=|PIP_CONSTRAINT= |unset PIP_CONSTRAINT|--no-constraint",
                             files[img.dockerfile].replace("\\\n", ""), re.M) or img.runtime == "torch-base", img.runtime


def test_torch_bases_image_source_carries_them_too():
    m = manifest.load(REPO / "manifests", profile="g5g", overrides=["torch-base.source=image",
                                                                     "torch-base.image=example.org/dlami:1"])
    tb = next(i for i in make_plan(m, profile="g5g", repo_root=REPO).all_images if i.runtime == "torch-base")
    assert "nvidia-cuda-cccl==13.0.85" in tb.build_args["CUDA_CONSTRAINTS"]


def test_a_constraint_must_be_an_exact_version():
    with pytest.raises(UserError, match=r"g5g.yaml: cuda.constraints.nvidia-cuda-nvcc: '>=13' is not an exact version"):
        manifest.load(REPO / "manifests", profile="g5g", overrides=['profile.cuda.constraints.nvidia-cuda-nvcc=">=13"'])
