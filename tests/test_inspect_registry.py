"""The HTTP backend against a real docker-registry on loopback, with images the tests push themselves."""
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from g5g import inspect as inspector
from g5g import registry as reg_client
from g5g.errors import UserError
from tests.fixtures.registry import VLLM_AMD64, VLLM_ARM64, Platform, push_image
from devtools.server import free_port


def inspect_http(ref, **kw):
    return inspector.inspect(ref, backend="http", **kw)


@pytest.fixture(scope="module")
def images(registry_images):
    return registry_images


def test_oci_index_with_attestations(registry, images):
    r = inspect_http(images["oci_index"].ref)
    assert r["digest"] == images["oci_index"].digest
    assert list(r["platforms"]) == ["linux/amd64", "linux/arm64"]  # v8 folded in, unknown/unknown skipped
    amd, arm = r["platforms"]["linux/amd64"], r["platforms"]["linux/arm64"]
    assert amd["cuda_archs"] == VLLM_AMD64.split() and amd["covered"] is True
    assert amd["source"] == "env:TORCH_CUDA_ARCH_LIST"
    assert arm["cuda_archs"] == VLLM_ARM64.split() and arm["covered"] is False
    assert inspector.exit_code([r]) == 1


def test_docker_manifest_list(registry, images):
    r = inspect_http(images["docker_list"].ref)
    assert r["digest"] == images["docker_list"].digest
    amd, arm = r["platforms"]["linux/amd64"], r["platforms"]["linux/arm64"]
    assert amd["cuda_archs"] == ["7.5", "8.0", "8.6"] and amd["ptx"] == ["8.6"] and amd["covered"] is True
    assert arm == {"cuda_archs": ["8.0", "9.0"], "ptx": [], "source": "env:CUDA_ARCH_LIST", "covered": False,
                   "covered_by": None, "raw": "sm_80 sm_90"}


def test_our_labels_are_read_back(registry, images):
    r = inspect_http(images["ours"].ref)
    assert r["digest"] == images["ours"].digest
    assert r["platforms"] == {"linux/arm64": {"cuda_archs": ["7.5"], "ptx": [], "source": "label:io.g5g.cuda-archs",
                                              "covered": True, "covered_by": "sm_75", "raw": "7.5"}}
    assert inspector.exit_code([r]) == 0
    cpu = inspect_http(images["cpu"].ref)
    assert cpu["platforms"]["linux/amd64"]["cuda_archs"] == [] and cpu["platforms"]["linux/amd64"]["covered"] is False


def test_no_cuda_info_is_unknown(registry, images):
    r = inspect_http(images["torch_base"].ref)
    assert r["platforms"]["linux/arm64"]["source"] is None
    assert inspector.exit_code([r]) == 3


def test_by_digest_and_platform_filter(registry, images):
    pushed = images["oci_index"]
    by_digest = f"{registry.host}/vllm/vllm-openai@{pushed.digest}"
    r = inspect_http(by_digest, platform="linux/arm64/v8")
    assert list(r["platforms"]) == ["linux/arm64"] and r["digest"] == pushed.digest
    with pytest.raises(UserError, match=r"has no linux/ppc64le image \(it has: linux/amd64, linux/arm64\)"):
        inspect_http(pushed.ref, platform="linux/ppc64le")


def test_other_arch_target(registry, images):
    r = inspect_http(images["oci_index"].ref, arch="sm_87")
    assert r["arch"] == "8.7"
    assert r["platforms"]["linux/arm64"]["covered"] is True and r["platforms"]["linux/amd64"]["covered"] is True


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_unknown_tag(registry, images):
    with pytest.raises(UserError) as e:
        inspect_http(f"{registry.host}/vllm/vllm-openai:v9.9.9")
    assert one_line(e) == (f"{registry.host}/vllm/vllm-openai:v9.9.9: tag 'v9.9.9' not found in "
                           f"{registry.host}/vllm/vllm-openai (404 MANIFEST_UNKNOWN)")


def test_unknown_repository(registry, images):
    # docker-registry answers MANIFEST_UNKNOWN here (Docker Hub says NAME_UNKNOWN or 401): name both.
    with pytest.raises(UserError) as e:
        inspect_http(f"{registry.host}/nobody/nothing:1")
    assert one_line(e).endswith(f"tag '1' not found in {registry.host}/nobody/nothing (404 MANIFEST_UNKNOWN)")


def test_unreachable_registry():
    port = free_port()
    with pytest.raises(UserError) as e:
        inspect_http(f"127.0.0.1:{port}/x/y:1")
    assert one_line(e) == f"registry 127.0.0.1:{port} unreachable at http://127.0.0.1:{port}: Connection refused"


def test_corrupted_config_blob(registry):
    pushed = push_image(registry, "corrupt/config", "1", [
        Platform("linux/arm64", env={"TORCH_CUDA_ARCH_LIST": "7.5"})], index="oci")
    path = registry.blob_path(pushed.configs["linux/arm64"])
    data = bytearray(path.read_bytes())
    data[data.index(b"7.5")] = ord("8")  # 7.5 → 8.5: same size, different content
    path.write_bytes(bytes(data))
    with pytest.raises(UserError) as e:
        inspect_http(pushed.ref)
    assert one_line(e).startswith(f"{pushed.ref}: blob {pushed.configs['linux/arm64']} from {registry.host} is corrupt")


def test_corrupted_manifest(registry):
    pushed = push_image(registry, "corrupt/manifest", "1", [Platform("linux/arm64")], index="oci")
    path = registry.blob_path(pushed.manifests["linux/arm64"])
    path.write_bytes(path.read_bytes().replace(b'\n  "', b'\n\t "', 1))  # still valid JSON, other bytes
    with pytest.raises(UserError) as e:
        inspect_http(pushed.ref)
    assert f"manifest {pushed.manifests['linux/arm64']} from {registry.host} is corrupt" in one_line(e)


# --- auth -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def private(auth_registry):
    return push_image(auth_registry, "private/vllm", "1", [
        Platform("linux/arm64", env={"TORCH_CUDA_ARCH_LIST": "7.5 8.0"})], index="oci")


def test_basic_auth_with_docker_config(auth_registry, private, tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_CONFIG", str(auth_registry.docker_config(tmp_path / "docker")))
    r = inspect_http(private.ref)
    assert r["digest"] == private.digest and r["platforms"]["linux/arm64"]["covered"] is True


def test_basic_auth_without_credentials_is_401(auth_registry, private, tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "empty"))
    with pytest.raises(UserError) as e:
        inspect_http(private.ref)
    assert one_line(e).startswith(f"registry {auth_registry.host} refused to let us read private/vllm anonymously")
    assert "401 UNAUTHORIZED" in str(e.value)


def test_basic_auth_with_wrong_password_is_401(auth_registry, private, tmp_path, monkeypatch):
    auth_registry_wrong = type(auth_registry)(auth_registry.host, auth_registry.url, auth_registry.root,
                                              auth_registry.username, "wrong")
    monkeypatch.setenv("DOCKER_CONFIG", str(auth_registry_wrong.docker_config(tmp_path / "docker")))
    with pytest.raises(UserError) as e:
        inspect_http(private.ref)
    assert "with the credentials from" in one_line(e) and "401" in str(e.value)


@pytest.fixture(scope="module")
def token_images(token_registry):
    return {
        "public": push_image(token_registry, "public/vllm-openai", "v0.33.0", [
            Platform("linux/amd64", env={"TORCH_CUDA_ARCH_LIST": VLLM_AMD64}),
            Platform("linux/arm64", env={"TORCH_CUDA_ARCH_LIST": VLLM_ARM64})], index="oci"),
        "private": push_image(token_registry, "team/vllm", "1", [
            Platform("linux/arm64", labels={"io.g5g.cuda-archs": "7.5"})], index=None),
    }


def test_bearer_token_anonymous(token_registry, token_images, tmp_path, monkeypatch):
    """Docker Hub's flow: 401 with a Bearer challenge → anonymous pull token from the realm → retry."""
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "empty"))
    token_registry.tokens.requests.clear()
    r = inspect_http(token_images["public"].ref)
    assert r["platforms"]["linux/arm64"]["covered"] is False and r["platforms"]["linux/amd64"]["covered"] is True
    assert token_registry.tokens.requests == [
        {"scopes": ["repository:public/vllm-openai:pull"], "authed": False, "service": ["g5g-test-registry"]}]


def test_bearer_token_private_needs_credentials(token_registry, token_images, tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "empty"))
    with pytest.raises(UserError) as e:
        inspect_http(token_images["private"].ref)
    assert "refused to let us read team/vllm anonymously" in one_line(e) and "401" in str(e.value)
    monkeypatch.setenv("DOCKER_CONFIG", str(token_registry.docker_config(tmp_path / "docker")))
    token_registry.tokens.requests.clear()
    r = inspect_http(token_images["private"].ref)
    assert r["platforms"]["linux/arm64"]["source"] == "label:io.g5g.cuda-archs"
    assert [q["authed"] for q in token_registry.tokens.requests] == [True]


def test_bearer_token_server_rejects_wrong_password(token_registry, token_images, tmp_path, monkeypatch):
    wrong = type(token_registry)(token_registry.host, token_registry.url, token_registry.root, "g5g", "nope")
    monkeypatch.setenv("DOCKER_CONFIG", str(wrong.docker_config(tmp_path / "docker")))
    with pytest.raises(UserError) as e:
        inspect_http(token_images["private"].ref)
    assert one_line(e).startswith(f"token server {token_registry.tokens.realm} of registry {token_registry.host} "
                                  "rejected the credentials")


# --- redirects to blob storage --------------------------------------------------------------------------

@pytest.fixture
def redirecting_front(registry):
    """A front that proxies manifests and redirects blob downloads to the registry under another host name
    (as registries redirect to S3/GCS), so the client must follow the redirect."""
    storage = registry.url.replace("127.0.0.1", "localhost")
    seen = []

    class Front(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.path)
            if "/blobs/" in self.path:
                self.send_response(307)
                self.send_header("Location", storage + self.path)
                self.end_headers()
                return
            up = requests.get(registry.url + self.path, headers={"Accept": self.headers.get("Accept", "")}, timeout=10)
            self.send_response(up.status_code)
            for key in ("Content-Type", "Docker-Content-Digest"):
                if key in up.headers:
                    self.send_header(key, up.headers[key])
            self.send_header("Content-Length", str(len(up.content)))
            self.end_headers()
            self.wfile.write(up.content)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Front)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()
    httpd.server_close()


def test_blob_redirects_are_followed(registry, images, redirecting_front):
    front, seen = redirecting_front
    r = inspect_http(f"{front}/vllm/vllm-openai:v0.33.0")
    assert r["digest"] == images["oci_index"].digest
    assert r["platforms"]["linux/amd64"]["cuda_archs"] == VLLM_AMD64.split()
    assert sum("/blobs/" in p for p in seen) == 2  # both configs came through the redirect


def test_https_is_used_for_remote_registries_and_plain_http_needs_insecure():
    ref = reg_client.parse_reference("ghcr.io/x/y:1")
    assert reg_client.Client().scheme(ref) == "https"
    assert reg_client.Client(insecure=True).scheme(ref) == "http"
    assert reg_client.Client().scheme(reg_client.parse_reference("localhost:5000/x")) == "http"


def test_credentials_from_docker_config(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"auths": {"https://index.docker.io/v1/": {"auth": "dXNlcjpwYXNz"}, "ghcr.io": {"username": "u", "password": "p"}}}')
    assert reg_client.credentials("docker.io", tmp_path) == ("user", "pass")
    assert reg_client.credentials("ghcr.io", tmp_path) == ("u", "p")
    assert reg_client.credentials("quay.io", tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json: not a readable docker config"):
        reg_client.credentials("ghcr.io", tmp_path)


def test_credentials_from_a_credential_helper(auth_registry, tmp_path, monkeypatch):
    """credHelpers/credsStore: the docker-credential-<name> program on PATH is asked, as the docker CLI does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helper = bin_dir / "docker-credential-g5gtest"
    helper.write_text("#!/bin/sh\nread server\n"
                      f"[ \"$server\" = \"{auth_registry.host}\" ] || exit 1\n"
                      f"echo '{{\"Username\": \"{auth_registry.username}\", \"Secret\": \"{auth_registry.password}\"}}'\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    config = tmp_path / "docker"
    config.mkdir()
    (config / "config.json").write_text('{"credHelpers": {"%s": "g5gtest"}}' % auth_registry.host)
    assert reg_client.credentials(auth_registry.host, config) == (auth_registry.username, auth_registry.password)
    assert reg_client.credentials("other.example", config) is None
    pushed = push_image(auth_registry, "private/helper", "1", [Platform("linux/arm64")], index=None)
    monkeypatch.setenv("DOCKER_CONFIG", str(config))
    assert inspect_http(pushed.ref)["digest"] == pushed.digest
