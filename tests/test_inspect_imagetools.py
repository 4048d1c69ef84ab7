"""The imagetools backend (`docker buildx imagetools inspect`) gives the HTTP backend's answers.

Needs the docker CLI and the buildx plugin, but no Docker engine: buildx reads registries itself and
speaks plain HTTP to loopback registries without any configuration."""

import pytest

from g5g import inspect as inspector
from g5g.errors import UserError
from tests.fixtures.registry import Platform, docker_config_dir, push_image
from devtools.server import free_port

pytestmark = pytest.mark.usefixtures("buildx")  # skips (fails in CI) saying why when it is missing


def both(ref, **kw):
    http = inspector.inspect(ref, backend="http", **kw)
    it = inspector.inspect(ref, backend="imagetools", **kw)
    assert (http.pop("backend"), it.pop("backend")) == ("http", "imagetools")
    return http, it


@pytest.mark.parametrize("name", ["oci_index", "docker_list", "ours", "cpu", "torch_base"])
def test_same_answers_as_http(registry_images, name):
    http, it = both(registry_images[name].ref)
    assert it == http
    assert it["digest"] == registry_images[name].digest


def test_platform_filter(registry_images):
    http, it = both(registry_images["oci_index"].ref, platform="linux/arm64/v8")
    assert it == http and list(it["platforms"]) == ["linux/arm64"]
    assert it["platforms"]["linux/arm64"]["covered"] is False


def test_auto_prefers_imagetools(registry_images):
    assert inspector.inspect(registry_images["ours"].ref)["backend"] == "imagetools"


def test_credentials_from_docker_config(auth_registry, tmp_path, monkeypatch):
    pushed = push_image(auth_registry, "private/imagetools", "1", [
        Platform("linux/arm64", labels={"io.g5g.cuda-archs": "7.5"})], index="oci")
    monkeypatch.setenv("DOCKER_CONFIG", str(auth_registry.docker_config(tmp_path / "docker")))
    http, it = both(pushed.ref)
    assert it == http and it["platforms"]["linux/arm64"]["covered"] is True
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config_dir(tmp_path / "anonymous")))
    with pytest.raises(UserError) as e:
        inspector.inspect(pushed.ref, backend="imagetools")
    assert str(e.value).startswith(f"registry {auth_registry.host} refused to let us read private/imagetools: ")
    assert "\n" not in str(e.value)


def test_unknown_tag(registry, registry_images):
    with pytest.raises(UserError) as e:
        inspector.inspect(f"{registry.host}/vllm/vllm-openai:v9.9.9", backend="imagetools")
    assert str(e.value) == (f"{registry.host}/vllm/vllm-openai:v9.9.9: tag 'v9.9.9' not found in "
                            f"{registry.host}/vllm/vllm-openai (imagetools: not found)")


def test_unreachable():
    port = free_port()
    with pytest.raises(UserError) as e:
        inspector.inspect(f"127.0.0.1:{port}/x/y:1", backend="imagetools")
    assert str(e.value) == f"registry 127.0.0.1:{port} unreachable: Connection refused (imagetools)"


def test_corrupted_blob(registry):
    pushed = push_image(registry, "corrupt/imagetools", "1", [
        Platform("linux/arm64", env={"TORCH_CUDA_ARCH_LIST": "7.5"})], index="oci")
    path = registry.blob_path(pushed.configs["linux/arm64"])
    data = bytearray(path.read_bytes())
    data[data.index(b"7.5")] = ord("8")
    path.write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        inspector.inspect(pushed.ref, backend="imagetools")
    assert str(e.value).startswith(f"{pushed.ref}: content from {registry.host} is corrupt: ")
    assert "\n" not in str(e.value)


def test_plain_http_to_a_remote_host_needs_the_http_backend():
    with pytest.raises(UserError, match="buildx only allows that for loopback hosts; use --backend http"):
        inspector.inspect("registry.example:5000/x:1", backend="imagetools", insecure=True)
