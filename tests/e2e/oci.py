"""Read an image back from a registry over its HTTP API: manifests, configs, layers (no docker involved)."""
from __future__ import annotations

import json
import zlib
from collections.abc import Iterator

import requests

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
ACCEPT = ", ".join(INDEX_TYPES + ("application/vnd.oci.image.manifest.v1+json",
                                  "application/vnd.docker.distribution.manifest.v2+json"))


def split(ref: str) -> tuple[str, str, str]:
    """127.0.0.1:5000/ns/repo:tag → (host, ns/repo, tag)."""
    host, _, rest = ref.partition("/")
    repo, _, tag = rest.rpartition(":") if ":" in rest else (rest, "", "latest")
    return host, repo, tag


def get_manifest(ref: str) -> tuple[dict, str]:
    host, repo, tag = split(ref)
    r = requests.get(f"http://{host}/v2/{repo}/manifests/{tag}", headers={"Accept": ACCEPT}, timeout=30)
    r.raise_for_status()
    return r.json(), r.headers.get("Docker-Content-Digest", "")


def platform_manifests(ref: str) -> dict[str, dict]:
    """platform ("linux/amd64") → image manifest; attestation entries (platform unknown/unknown) are skipped."""
    host, repo, _ = split(ref)
    top, _ = get_manifest(ref)
    if top.get("mediaType") not in INDEX_TYPES and "manifests" not in top:
        config = blob_json(host, repo, top["config"]["digest"])
        return {f"{config['os']}/{config['architecture']}": top}
    out = {}
    for m in top["manifests"]:
        p = m.get("platform", {})
        if p.get("os") == "unknown":
            continue
        out[f"{p['os']}/{p['architecture']}"] = _by_digest(host, repo, m["digest"])
    return out


def _by_digest(host: str, repo: str, digest: str) -> dict:
    r = requests.get(f"http://{host}/v2/{repo}/manifests/{digest}", headers={"Accept": ACCEPT}, timeout=30)
    r.raise_for_status()
    return r.json()


def blob(host: str, repo: str, digest: str) -> bytes:
    r = requests.get(f"http://{host}/v2/{repo}/blobs/{digest}", timeout=300)
    r.raise_for_status()
    return r.content


def blob_json(host: str, repo: str, digest: str) -> dict:
    return json.loads(blob(host, repo, digest))


def config(ref: str, platform: str) -> dict:
    host, repo, _ = split(ref)
    return blob_json(host, repo, platform_manifests(ref)[platform]["config"]["digest"])


def layer_chunks(host: str, repo: str, digest: str, media_type: str) -> Iterator[bytes]:
    """A layer's uncompressed bytes, streamed in chunks (gzip or plain tar)."""
    r = requests.get(f"http://{host}/v2/{repo}/blobs/{digest}", stream=True, timeout=300)
    r.raise_for_status()
    gz = media_type.endswith("gzip")
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gz else None
    for chunk in r.iter_content(1 << 20):
        if inflate is None:
            yield chunk
            continue
        out = inflate.decompress(chunk)
        while inflate.unused_data:  # concatenated gzip members
            rest = inflate.unused_data
            inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
            out += inflate.decompress(rest)
        yield out
    if inflate is not None:
        yield inflate.flush()


def find_in_layers(ref: str, needles: list[bytes]) -> dict[bytes, list[str]]:
    """needle → digests of the layers (of every platform) whose uncompressed content contains it."""
    host, repo, _ = split(ref)
    found: dict[bytes, list[str]] = {n: [] for n in needles}
    overlap = max(map(len, needles)) - 1
    for manifest in platform_manifests(ref).values():
        for layer in manifest["layers"]:
            tail = b""
            for chunk in layer_chunks(host, repo, layer["digest"], layer["mediaType"]):
                window = tail + chunk
                for n in needles:
                    if n in window and layer["digest"] not in found[n]:
                        found[n].append(layer["digest"])
                tail = window[-overlap:] if overlap else b""
    return found

