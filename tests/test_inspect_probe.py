"""--probe: run the image and ask torch, when the config carries no arch list."""
import pytest

from g5g import inspect as inspector
from g5g.errors import UserError

BASE = "g5g-local/bookworm:amd64"  # scripts/base-images.sh: debootstrap minbase + python3, no torch


def test_probe_without_an_engine_is_one_clear_line(registry_images, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/g5g-docker.sock")
    with pytest.raises(UserError, match=r"^--probe needs a running Docker engine: "):
        inspector.inspect(registry_images["torch_base"].ref, backend="http", probe_images=True)


def test_probe_is_not_run_when_the_config_answers(registry_images, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/g5g-docker.sock")
    r = inspector.inspect(registry_images["oci_index"].ref, backend="http", probe_images=True)
    assert {e["source"] for e in r["platforms"].values()} == {"env:TORCH_CUDA_ARCH_LIST"}


@pytest.mark.e2e
def test_probe_runs_the_image(docker_client, registry):
    """A base with python3 but no torch: the probe really runs it (pulled by digest from the registry) and
    reports why it could not tell, instead of guessing."""
    try:
        image = docker_client.images.get(BASE)
    except Exception:  # noqa: BLE001
        pytest.skip(f"{BASE} missing: scripts/base-images.sh builds it")
    ref = f"{registry.host}/probe/base:1"
    image.tag(ref)
    for line in docker_client.images.push(ref, stream=True, decode=True):
        assert "error" not in line, line
    r = inspector.inspect(ref, backend="http", platform="linux/amd64", probe_images=True)
    entry = r["platforms"]["linux/amd64"]
    assert entry["covered"] is None and entry["source"] is None
    assert "No module named 'torch'" in entry["probe_error"]
    assert inspector.exit_code([r]) == 3
