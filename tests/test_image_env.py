"""The images' run-time environment (a runtime manifest's `env`, issue 51): every CUDA image says the CUDA it needs as
NVIDIA_REQUIRE_CUDA, so the NVIDIA container runtime refuses an older driver with its own message; the serving images
say the device they expect (G5G_DEVICE: serving/device.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from g5g import manifest, render
from g5g.errors import UserError
from g5g.plan import make_plan

REPO = Path(__file__).resolve().parent.parent
SERVING = {"jax", "pytorch"}     # the images whose entrypoint is `python -m serving`


def _plans():
    for profile in ("g5g", "g4dn", "cpu"):
        m = manifest.load(REPO / "manifests", profile=profile)
        for rehearse in (False, True):
            yield profile, m, make_plan(m, profile=profile, repo_root=REPO, rehearse=rehearse)


def _last_stage(dockerfile: str) -> str:
    return dockerfile[dockerfile.rindex("\nFROM "):]


@pytest.mark.parametrize("profile,m,plan", list(_plans()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_gpu_image_requires_its_cuda_and_every_server_its_device(profile, m, plan):
    cuda = m.profiles[profile].cuda
    files = render.render(plan)
    assert {i.runtime for i in plan.images} >= SERVING
    for img in plan.images:
        last = _last_stage(files[img.dockerfile])
        if cuda:
            assert img.env["NVIDIA_REQUIRE_CUDA"] == f"cuda>={cuda.version}" == "cuda>=13.0", img.runtime
            assert 'NVIDIA_REQUIRE_CUDA="cuda>=13.0"' in last, img.runtime       # in the image the plan builds
        else:
            assert "NVIDIA_REQUIRE_CUDA" not in img.env and "NVIDIA_REQUIRE_CUDA" not in files[img.dockerfile]
        if img.runtime in SERVING:
            want = "gpu" if cuda else "cpu"
            assert img.env["G5G_DEVICE"] == want and f'G5G_DEVICE="{want}"' in last, img.runtime
        assert img.contract([])["env"] == img.env


def _edited(tmp_path: Path, text: str) -> Path:
    shutil.copytree(REPO / "manifests", tmp_path / "manifests")
    runtime = tmp_path / "manifests" / "runtimes" / "pytorch.yaml"
    old = runtime.read_text()
    assert "\nenv:" in old
    runtime.write_text(old.replace("\nenv:", f"\nenv:\n  {text}", 1))
    return tmp_path / "manifests"


@pytest.mark.parametrize("line,error", [
    ("HF_TOKEN: \"'x'\"", "env.HF_TOKEN: an image's ENV is readable by anyone who pulls it"),
    ("G5G_X: \"'a\\\"b'\"", "env.G5G_X: 'a\"b': no quotes, backslashes, \\$ or newlines"),
    ("G5G_X: \"'$HOME'\"", "env.G5G_X: '\\$HOME': no quotes"),
])
def test_an_env_that_would_leak_or_break_the_dockerfile_is_refused(tmp_path, line, error):
    with pytest.raises(UserError, match=error):
        make_plan(manifest.load(_edited(tmp_path, line), profile="g5g"), runtime="pytorch", repo_root=REPO)


def test_an_env_name_that_is_not_a_variable_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"pytorch.yaml: env.1BAD: '1BAD' is not an environment variable name"):
        manifest.load(_edited(tmp_path, "1BAD: \"'x'\""), profile="g5g")
