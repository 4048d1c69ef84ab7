"""Registry HTTP API client (OCI distribution spec) with requests: image configs per platform, no docker.

Handles what real registries do: Docker Hub's naming (`debian` → docker.io/library/debian, served by
registry-1.docker.io), bearer tokens from the WWW-Authenticate challenge (anonymous, or with the docker
config's credentials), basic auth, OCI indexes, Docker manifest lists and single manifests, redirects to
blob storage. Every manifest and blob fetched is checked against its digest.
"""
from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import requests

from g5g.errors import UserError

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEXES = (OCI_INDEX, DOCKER_LIST)
MANIFESTS = (OCI_MANIFEST, DOCKER_MANIFEST)

DOCKER_HUB = "docker.io"
DOCKER_HUB_ENDPOINT = "registry-1.docker.io"
DOCKER_HUB_AUTH_KEYS = ("https://index.docker.io/v1/", "index.docker.io", "docker.io", "registry-1.docker.io")
MAX_BLOB = 64 << 20  # image configs are kilobytes; refuse to buffer anything absurd

_REPO = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class Reference:
    registry: str  # "docker.io", "ghcr.io", "127.0.0.1:5000"
    repository: str  # "library/debian"
    tag: str | None = None
    digest: str | None = None

    @property
    def endpoint(self) -> str:
        return DOCKER_HUB_ENDPOINT if self.registry == DOCKER_HUB else self.registry

    @property
    def ref(self) -> str:
        """What to ask the manifests endpoint for: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out


def parse_reference(image: str) -> Reference:
    """Docker's rules: the first path component is a registry only if it has a '.' or ':' or is localhost."""
    name, digest = image, None
    if "@" in name:
        name, digest = name.split("@", 1)
        if not _DIGEST.match(digest):
            raise UserError(f"image {image!r}: digest must be sha256:<64 hex digits>")
    tag = None
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = name.rsplit(":", 1)
        if not _TAG.match(tag):
            raise UserError(f"image {image!r}: invalid tag {tag!r}")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, repo = first, rest
    else:
        registry, repo = DOCKER_HUB, name
    if registry in ("index.docker.io", "registry-1.docker.io"):
        registry = DOCKER_HUB
    if registry == DOCKER_HUB and "/" not in repo:
        repo = f"library/{repo}"
    if not _REPO.match(repo):
        raise UserError(f"image {image!r}: invalid repository name {repo!r} (lowercase letters, digits, . _ - /)")
    if tag is None and digest is None:
        tag = "latest"
    return Reference(registry, repo, tag, digest)


def normalize_platform(os_: str, arch: str, variant: str | None = None) -> str:
    """"linux/arm64/v8" and "linux/arm64" are the same platform (containerd's normalisation)."""
    if arch == "aarch64":
        arch = "arm64"
    if arch in ("x86_64", "x86-64"):
        arch = "amd64"
    if arch == "arm64" and variant == "v8":
        variant = None
    if arch == "amd64" and variant == "v1":
        variant = None
    return "/".join(p for p in (os_, arch, variant) if p)


def parse_platform(text: str) -> str:
    parts = text.strip().split("/")
    if len(parts) == 1:
        parts = ["linux", parts[0]]
    if len(parts) > 3 or not all(parts):
        raise UserError(f"--platform {text!r}: expected os/arch[/variant], e.g. linux/arm64")
    return normalize_platform(*parts)


def is_loopback(host: str) -> bool:
    hostname = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    hostname = hostname.strip("[]")
    if hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


def is_attestation(entry: dict) -> bool:
    """BuildKit's attestation manifests sit in the index as platform unknown/unknown."""
    plat = entry.get("platform") or {}
    annotations = entry.get("annotations") or {}
    return "vnd.docker.reference.type" in annotations or (
        plat.get("os") == "unknown" and plat.get("architecture") == "unknown")


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def docker_config_dir() -> Path:
    return Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker")


def credentials(registry: str, config_dir: Path | None = None) -> tuple[str, str] | None:
    """(username, password) for `registry` from the docker config: `auths`, then credential helpers."""
    path = (config_dir or docker_config_dir()) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable docker config ({e})") from None
    keys = DOCKER_HUB_AUTH_KEYS if registry == DOCKER_HUB else (registry, f"https://{registry}", f"http://{registry}")
    auths = cfg.get("auths") or {}
    for key in keys:
        entry = auths.get(key) or auths.get(key.rstrip("/"))
        if not entry:
            continue
        if entry.get("username") and entry.get("password"):
            return entry["username"], entry["password"]
        if entry.get("auth"):
            try:
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except ValueError:
                raise UserError(f"{path}: auths[{key!r}].auth is not base64 of user:password") from None
            return user, password
    helper = (cfg.get("credHelpers") or {}).get(registry) or cfg.get("credsStore")
    if helper:
        return _credential_helper(helper, keys[0])
    return None


def _credential_helper(helper: str, server: str) -> tuple[str, str] | None:
    exe = shutil.which(f"docker-credential-{helper}")
    if not exe:
        return None  # as if logged out: the registry's 401 then says what is wrong
    out = subprocess.run([exe, "get"], input=server, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return None  # "credentials not found in native keychain"
    data = json.loads(out.stdout)
    return data.get("Username", ""), data.get("Secret", "")


def _reason(e: Exception) -> str:
    m = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(e))
    if m:
        return m.group(1).strip()
    if isinstance(e, requests.Timeout):
        return "timed out"
    return str(e).splitlines()[0][:200]


def _error_code(r: requests.Response) -> tuple[str, str]:
    try:
        err = r.json()["errors"][0]
        return err.get("code", ""), err.get("message", "")
    except (ValueError, KeyError, IndexError, TypeError):
        return "", ""


@dataclass
class Image:
    reference: Reference
    digest: str  # of the manifest the reference points at (index, list or single manifest)
    media_type: str
    configs: dict[str, dict] = field(default_factory=dict)  # platform → image config JSON
    platforms: list[str] = field(default_factory=list)  # every platform in the image, before filtering


class Client:
    def __init__(self, insecure: bool = False, config_dir: Path | None = None, timeout: float = 30.0):
        self.insecure = insecure
        self.config_dir = config_dir
        self.timeout = timeout
        self.session = requests.Session()
        self.session.headers["User-Agent"] = "g5g-images-inspect"
        self._auth: dict[tuple[str, str], str] = {}  # (endpoint, repository) → Authorization header

    def scheme(self, ref: Reference) -> str:
        return "http" if self.insecure or is_loopback(ref.endpoint) else "https"

    # -- transport ------------------------------------------------------------------------------------
    def _get(self, ref: Reference, path: str, what: str, **headers) -> requests.Response:
        url = f"{self.scheme(ref)}://{ref.endpoint}/v2/{ref.repository}/{path}"
        key = (ref.endpoint, ref.repository)
        for attempt in range(2):
            if key in self._auth:
                headers["Authorization"] = self._auth[key]
            try:
                r = self.session.get(url, headers=headers, timeout=self.timeout, stream=True)
            except requests.exceptions.SSLError as e:
                raise UserError(f"registry {ref.registry}: TLS failed ({_reason(e)}); "
                                "a plain-HTTP registry needs --insecure") from None
            except (requests.ConnectionError, requests.Timeout) as e:
                raise UserError(f"registry {ref.registry} unreachable at {url.split('/v2/')[0]}: {_reason(e)}") from None
            if r.status_code == 401 and attempt == 0 and self._authenticate(ref, r):
                r.close()
                continue
            break
        if r.status_code in (401, 403):
            code, message = _error_code(r)
            creds = "with the credentials from " + str((self.config_dir or docker_config_dir()) / "config.json") \
                if credentials(ref.registry, self.config_dir) else "anonymously (no credentials in the docker config)"
            raise UserError(f"registry {ref.registry} refused to let us read {ref.repository} {creds}: "
                            f"{r.status_code} {code or r.reason}{': ' + message if message else ''}")
        if r.status_code == 404:
            code, _ = _error_code(r)
            status = f"404 {code or 'Not Found'}"
            if code == "NAME_UNKNOWN":
                raise UserError(f"{ref}: repository {ref.repository!r} not found in {ref.registry} ({status})")
            if what == "manifest" and path == f"manifests/{ref.tag}" and not ref.digest:
                raise UserError(f"{ref}: tag {ref.tag!r} not found in {ref.registry}/{ref.repository} ({status})")
            raise UserError(f"{ref}: {what} {path.rsplit('/', 1)[-1]} not found in {ref.registry} ({status})")
        if r.status_code >= 400:
            code, message = _error_code(r)
            raise UserError(f"registry {ref.registry} answered {r.status_code} {code or r.reason} for {what} of "
                            f"{ref.repository}{': ' + message if message else ''}")
        return r

    def _authenticate(self, ref: Reference, r: requests.Response) -> bool:
        """Answer a 401's challenge; True when there is something new to retry with."""
        challenge = r.headers.get("WWW-Authenticate", "")
        scheme = challenge.split(" ", 1)[0].lower()
        creds = credentials(ref.registry, self.config_dir)
        key = (ref.endpoint, ref.repository)
        if scheme == "basic":
            if not creds:
                return False
            self._auth[key] = "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
            return True
        if scheme != "bearer":
            return False
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = params.get("realm")
        if not realm:
            raise UserError(f"registry {ref.registry}: bearer challenge without a realm: {challenge!r}")
        query = {"scope": params.get("scope") or f"repository:{ref.repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        try:
            t = self.session.get(realm, params=query, auth=creds, timeout=self.timeout)
        except (requests.ConnectionError, requests.Timeout) as e:
            raise UserError(f"token server {realm} of registry {ref.registry} unreachable: {_reason(e)}") from None
        if t.status_code in (401, 403):
            raise UserError(f"token server {realm} of registry {ref.registry} rejected the credentials from the "
                            f"docker config: {t.status_code}")
        if t.status_code >= 400:
            raise UserError(f"token server {realm} of registry {ref.registry} answered {t.status_code}")
        try:
            body = t.json()
            token = body.get("token") or body["access_token"]
        except (ValueError, KeyError):
            raise UserError(f"token server {realm} of registry {ref.registry} sent no token") from None
        self._auth[key] = f"Bearer {token}"
        return True

    def _read(self, r: requests.Response, what: str) -> bytes:
        chunks, size = [], 0
        for chunk in r.iter_content(65536):
            size += len(chunk)
            if size > MAX_BLOB:
                raise UserError(f"{what} at {r.url} is over {MAX_BLOB >> 20} MiB; not an image config")
            chunks.append(chunk)
        return b"".join(chunks)

    # -- API ------------------------------------------------------------------------------------------
    def manifest(self, ref: Reference, reference: str | None = None) -> tuple[str, str, dict]:
        """(digest, media type, manifest) for a tag or digest, digest verified."""
        reference = reference or ref.ref
        r = self._get(ref, f"manifests/{reference}", "manifest", Accept=", ".join(INDEXES + MANIFESTS))
        body = self._read(r, "manifest")
        actual = sha256_digest(body)
        expected = reference if reference.startswith("sha256:") else r.headers.get("Docker-Content-Digest")
        if expected and expected != actual:
            raise UserError(f"{ref}: manifest {expected} from {ref.registry} is corrupt: its content hashes to {actual}")
        try:
            doc = json.loads(body)
        except ValueError:
            raise UserError(f"{ref}: manifest {actual} from {ref.registry} is not JSON") from None
        media = doc.get("mediaType") or r.headers.get("Content-Type", "").split(";")[0]
        if media not in INDEXES + MANIFESTS:
            raise UserError(f"{ref}: unsupported manifest type {media!r} (need an OCI or Docker schema 2 manifest)")
        return actual, media, doc

    def blob(self, ref: Reference, digest: str) -> bytes:
        """A blob by digest; redirects to blob storage are followed (requests drops our auth header there)."""
        r = self._get(ref, f"blobs/{digest}", "blob")
        data = self._read(r, "blob")
        actual = sha256_digest(data)
        if actual != digest:
            raise UserError(f"{ref}: blob {digest} from {ref.registry} is corrupt: its content hashes to {actual}")
        return data

    def config(self, ref: Reference, manifest: dict) -> dict:
        digest = manifest.get("config", {}).get("digest")
        if not digest:
            raise UserError(f"{ref}: manifest has no config")
        try:
            return json.loads(self.blob(ref, digest))
        except ValueError:
            raise UserError(f"{ref}: config blob {digest} is not JSON") from None

    def image(self, ref: Reference, platform: str | None = None) -> Image:
        """Image configs per platform (all, or only `platform`), attestation entries skipped."""
        digest, media, doc = self.manifest(ref)
        image = Image(ref, digest, media)
        if media in MANIFESTS:
            cfg = self.config(ref, doc)
            key = normalize_platform(cfg.get("os", "unknown"), cfg.get("architecture", "unknown"), cfg.get("variant"))
            image.platforms.append(key)
            if platform in (None, key):
                image.configs[key] = cfg
            return image
        for entry in doc.get("manifests", []):
            if is_attestation(entry) or entry.get("mediaType") not in MANIFESTS + ("",):
                continue
            plat = entry.get("platform") or {}
            key = normalize_platform(plat.get("os", "unknown"), plat.get("architecture", "unknown"), plat.get("variant"))
            image.platforms.append(key)
            if platform not in (None, key) or key in image.configs:
                continue
            _, _, child = self.manifest(ref, entry["digest"])
            image.configs[key] = self.config(ref, child)
        return image
