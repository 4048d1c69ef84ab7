"""inspect: per-platform CUDA arch lists of images, read from their configs without pulling them.

Backends (same answers): `imagetools` runs `docker buildx imagetools inspect` (docker CLI + buildx plugin,
no engine needed); `http` talks to the registry's HTTP API (g5g.registry, no docker at all). `--probe`
runs the image and asks torch when the config says nothing: slow (pulls the image; QEMU for a foreign
platform) and needs a Docker engine.

Result per image (docs/CONTRACTS.md):
  {"image", "digest", "backend", "arch", "platforms": {"linux/arm64": {"cuda_archs": [...] | null,
   "ptx": [...], "source": "env:TORCH_CUDA_ARCH_LIST" | "label:<key>" | "probe:torch" | null,
   "covered": true | false | null, "covered_by": "sm_75" | null, "raw": "<value as found>" | null}}}
"""
from __future__ import annotations

import json
import shutil
import subprocess

from g5g import archlist, registry
from g5g.errors import FAILED, OK, UNKNOWN, UserError

IMAGETOOLS = ["docker", "buildx", "imagetools", "inspect"]
PROBE_CODE = ("import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
              "'archs': torch.cuda.get_arch_list()}))")


# -- pure: configs → answers -------------------------------------------------------------------------

REHEARSAL_LABEL = "io.g5g.rehearsal"  # g5g/plan.py: a rehearsal's images say what it cut


def platform_entry(config: dict, arch: str) -> dict:
    """What one platform's image config says about CUDA archs, and whether `arch` is covered."""
    cfg = config.get("config") or {}
    labels = cfg.get("Labels") or {}
    found = archlist.find(archlist.env_dict(cfg.get("Env")), labels)
    if found is None:
        entry = {"cuda_archs": None, "ptx": [], "source": None, "covered": None, "covered_by": None, "raw": None}
    else:
        entry = entry_from(found, arch)
    if REHEARSAL_LABEL in labels:  # build.py --rehearse: the arch list is the target's, the compile was cut
        entry["rehearsal"], entry["covered"] = labels[REHEARSAL_LABEL], None
    return entry


def entry_from(found: archlist.Found, arch: str) -> dict:
    cov = archlist.coverage(found.archs, arch)
    entry = {"cuda_archs": list(found.archs.native), "ptx": list(found.archs.ptx), "source": found.source,
             "covered": cov.covered, "covered_by": cov.how, "raw": found.raw}
    if found.archs.unparsed:
        entry["unparsed"] = list(found.archs.unparsed)
        if not cov.covered:  # an arch we cannot read might be the one: don't claim "not covered"
            entry["covered"] = None
    return entry


def result(image: str, digest: str | None, backend: str, arch: str, configs: dict[str, dict]) -> dict:
    return {"image": image, "digest": digest, "backend": backend, "arch": arch,
            "platforms": {p: platform_entry(c, arch) for p, c in sorted(configs.items())}}


def exit_code(results: list[dict]) -> int:
    """0: every platform covered; 1: some platform is not; 3: could not tell (and none is known bad)."""
    covered = [e["covered"] for r in results for e in r["platforms"].values()]
    if any(c is False for c in covered):
        return FAILED
    if not covered or any(c is None for c in covered):
        return UNKNOWN
    return OK


# -- backends ---------------------------------------------------------------------------------------

def imagetools_available() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "buildx", "version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def choose_backend(backend: str, ref: registry.Reference, insecure: bool) -> str:
    if backend == "auto":
        if insecure and not registry.is_loopback(ref.endpoint):
            return "http"  # buildx's default builder only speaks plain HTTP to loopback registries
        return "imagetools" if imagetools_available() else "http"
    if backend == "imagetools":
        if not imagetools_available():
            raise UserError("--backend imagetools needs the docker CLI with the buildx plugin "
                            "(`docker buildx version` fails); use --backend http")
        if insecure and not registry.is_loopback(ref.endpoint):
            raise UserError(f"--backend imagetools cannot reach plain-HTTP registry {ref.registry}: buildx only "
                            "allows that for loopback hosts; use --backend http")
    return backend


def via_http(ref: registry.Reference, platform: str | None, insecure: bool) -> tuple[str, dict[str, dict], list[str]]:
    image = registry.Client(insecure=insecure).image(ref, platform)
    return image.digest, image.configs, image.platforms


def _imagetools_error(ref: registry.Reference, stderr: str, rc: int) -> UserError:
    """buildx's last error line, phrased like the HTTP backend's errors where we recognise it."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    msg = (lines[-1] if lines else f"exit status {rc}").removeprefix("ERROR: ")
    low = msg.lower()
    if low.endswith(": not found"):
        return UserError(f"{ref}: tag {ref.tag!r} not found in {ref.registry}/{ref.repository} (imagetools: not found)"
                         if ref.tag and not ref.digest else f"{ref}: not found in {ref.registry} (imagetools)")
    if "connection refused" in low or "no such host" in low or "i/o timeout" in low:
        reason = "Connection refused" if "connection refused" in low else msg.rsplit(": ", 1)[-1]
        return UserError(f"registry {ref.registry} unreachable: {reason} (imagetools)")
    if "authorization" in low or "401" in low or "403" in low or "denied" in low:
        return UserError(f"registry {ref.registry} refused to let us read {ref.repository}: {msg}")
    if "unexpected digest" in low or "digest mismatch" in low:
        return UserError(f"{ref}: content from {ref.registry} is corrupt: {msg}")
    return UserError(f"{ref}: docker buildx imagetools inspect failed: {msg}")


def _imagetools(ref: registry.Reference, fmt: str) -> object:
    argv = [*IMAGETOOLS, "--format", fmt, str(ref)]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise UserError(f"{ref}: `docker buildx imagetools inspect` timed out after 300 s") from None
    if out.returncode != 0:
        raise _imagetools_error(ref, out.stderr, out.returncode)
    try:
        return json.loads(out.stdout)
    except ValueError:
        raise UserError(f"{ref}: docker buildx imagetools inspect printed no JSON: {out.stdout[:200]!r}") from None


def via_imagetools(ref: registry.Reference, platform: str | None) -> tuple[str, dict[str, dict], list[str]]:
    """`{{json .Image}}` is a map keyed by platform for an index of several platforms, else a bare config."""
    manifest = _imagetools(ref, "{{json .Manifest}}")
    images = _imagetools(ref, "{{json .Image}}")
    if not isinstance(manifest, dict) or not isinstance(images, dict):
        raise UserError(f"{ref}: unexpected output from docker buildx imagetools inspect")
    if "rootfs" in images or "architecture" in images:  # one config
        key = registry.normalize_platform(images.get("os", "unknown"), images.get("architecture", "unknown"),
                                          images.get("variant"))
        configs = {key: images}
    else:
        configs = {registry.parse_platform(k): v for k, v in images.items()}
    platforms = sorted(configs)
    if platform:
        configs = {k: v for k, v in configs.items() if k == platform}
    return manifest.get("digest"), configs, platforms


# -- probe ------------------------------------------------------------------------------------------

def parse_probe(stdout: str) -> archlist.Found:
    """The probe's last JSON line → Found; a CPU-only torch has no CUDA archs at all."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
            break
        except ValueError:
            continue
    else:
        raise UserError(f"probe printed no JSON: {stdout[-200:]!r}")
    archs = data.get("archs") or []
    raw = " ".join(archs) if archs else f"torch {data.get('torch')} without CUDA"
    return archlist.Found(archlist.parse(" ".join(archs)), "probe:torch", raw)


class ProbeFailed(Exception):
    """The image ran but could not answer (no python3, no torch): the platform stays "could not tell"."""


def probe(image: str, platform: str) -> archlist.Found:
    """Run the image (pulling it; under QEMU for a foreign platform) and read torch.cuda.get_arch_list()."""
    import docker  # only --probe needs the SDK and an engine

    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as e:
        raise UserError(f"--probe needs a running Docker engine: {str(e).splitlines()[0][:200]}") from None
    try:
        out = client.containers.run(image, entrypoint=["python3", "-c", PROBE_CODE], platform=platform,
                                    remove=True, stdout=True, stderr=False, network_disabled=True)
    except docker.errors.ContainerError as e:
        err = (e.stderr or b"").decode(errors="replace").strip().splitlines()
        raise ProbeFailed(err[-1] if err else f"exit status {e.exit_status}") from None
    except docker.errors.APIError as e:  # ImageNotFound included; "python3": executable file not found
        raise ProbeFailed(str(e.explanation or e).splitlines()[0][:300]) from None
    try:
        return parse_probe(out.decode(errors="replace"))
    except UserError as e:
        raise ProbeFailed(str(e)) from None


# -- the command's core ------------------------------------------------------------------------------

def inspect(image: str, *, arch: str = "7.5", platform: str | None = None, backend: str = "auto",
            insecure: bool = False, probe_images: bool = False, say=lambda msg: None) -> dict:
    try:
        arch = archlist.target(arch)
    except archlist.ArchError as e:
        raise UserError(str(e)) from None
    ref = registry.parse_reference(image)
    plat = registry.parse_platform(platform) if platform else None
    chosen = choose_backend(backend, ref, insecure)
    if chosen == "imagetools":
        digest, configs, platforms = via_imagetools(ref, plat)
    else:
        digest, configs, platforms = via_http(ref, plat, insecure)
    if plat and not configs:
        raise UserError(f"{image} has no {plat} image (it has: {', '.join(platforms) or 'none'})")
    out = result(image, digest, chosen, arch, configs)
    if probe_images:
        pinned = f"{ref.registry}/{ref.repository}@{digest}" if digest else str(ref)
        for p, entry in out["platforms"].items():
            if entry["source"] is None:
                say(f"probing {image} ({p}): no CUDA info in its config, running it to ask torch (slow)")
                try:
                    out["platforms"][p] = entry_from(probe(pinned, p), arch)
                except ProbeFailed as e:
                    entry["probe_error"] = str(e)
    return out
