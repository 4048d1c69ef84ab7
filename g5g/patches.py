"""Our vLLM patches against the pinned upstream release: fetch its sdist, `git apply --check`, measure the kernel.

Effects live here: the package index (over HTTP, cached under .cache/vllm-sdist/), `git apply`, and a
subprocess that compiles vLLM's attention kernel with Triton (tools/vllm_attn_probe.py; g5g/ itself never
imports torch or triton).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import requests

from g5g import REPO_ROOT, manifest
from g5g.errors import UserError

CACHE_DIR = REPO_ROOT / ".cache"
# What `patches verify` probes (the tools/vllm_attn_probe.py kernel) and what the helpers default to; `build` checks
# any runtime's patches against its own version pin's sdist (check_apply's package).
PACKAGE = "vllm"
PROBE = REPO_ROOT / "tools" / "vllm_attn_probe.py"
# What the probe loads from the sdist, besides the files the patches touch.
PROBE_FILES = (
    "vllm/v1/attention/ops/triton_unified_attention.py",
    "vllm/v1/attention/ops/triton_attention_helpers.py",
    "vllm/v1/kv_cache_interface.py",
)
TURING_SMEM_OPTIN = 65536  # bytes a block may opt in to on sm_75 (T4, T4G)


@dataclass(frozen=True)
class Sdist:
    version: str
    path: Path
    sha256: str
    package: str = PACKAGE


# --- the package index -------------------------------------------------------------------------------------------

def index_url() -> str:
    """The simple index pip uses on this machine: PIP_INDEX_URL, pip's configured index-url, or pip's default."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
        for line in out.stdout.splitlines():
            key, _, value = line.partition("=")
            if key.endswith(".index-url"):
                url = value.strip().strip("'\"")
                break
    if not url:
        from pip._internal.models.index import PyPI  # pip's own default index, not written in our code

        url = PyPI.simple_url
    return url.rstrip("/")


class _Links(HTMLParser):
    """Anchors of a PEP 503 simple page: (filename, href)."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def _shown(url: str) -> str:
    """A URL fit for messages: no user:password@."""
    return re.sub(r"//[^/@]*@", "//", url)


def _sdist_entry(version: str, package: str = PACKAGE) -> tuple[str, str | None]:
    """(url, sha256 the index publishes or None) of <package>-<version>.tar.gz."""
    base = index_url()
    page = f"{base}/{package}/"
    try:
        r = requests.get(page, timeout=60, headers={
            "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    except requests.RequestException as e:
        raise UserError(f"package index {_shown(base)}: unreachable ({type(e).__name__})") from None
    if r.status_code != 200:
        raise UserError(f"package index {_shown(base)}: HTTP {r.status_code} for {_shown(page)}")
    name = f"{package}-{version}.tar.gz"
    if r.headers.get("content-type", "").startswith("application/vnd.pypi.simple.v1+json"):
        files = [(f["filename"], f["url"], f.get("hashes", {}).get("sha256")) for f in r.json()["files"]]
    else:
        parser = _Links()
        parser.feed(r.text)
        files = []
        for fname, href in parser.links:
            url, _, frag = href.partition("#")
            files.append((fname, url, frag[len("sha256="):] if frag.startswith("sha256=") else None))
    for fname, url, sha in files:
        if fname == name:
            return requests.compat.urljoin(page, url), sha
    raise UserError(f"{package} {version}: no sdist {name} on package index {_shown(base)}")


def fetch_sdist(version: str, expected_sha256: str | None = None, package: str = PACKAGE) -> Sdist:
    """The package's sdist for `version`, from the cache or the index, checked against the index's and our sha256."""
    dest = CACHE_DIR / f"{package}-sdist" / f"{package}-{version}.tar.gz"
    if not dest.is_file():
        url, published = _sdist_entry(version, package)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.part")   # each process its own: parallel test workers
        try:
            with requests.get(url, stream=True, timeout=300) as r:
                if r.status_code != 200:
                    raise UserError(f"package index: HTTP {r.status_code} for {_shown(url)}")
                h = hashlib.sha256()
                with open(tmp, "wb") as f:
                    for chunk in r.iter_content(1 << 20):
                        h.update(chunk)
                        f.write(chunk)
        except requests.RequestException as e:
            raise UserError(f"package index: download of {dest.name} failed ({type(e).__name__})") from None
        if published and h.hexdigest() != published:
            tmp.unlink()
            raise UserError(f"{dest.name}: sha256 {h.hexdigest()}, the package index says {published}")
        tmp.rename(dest)
    digest = hashlib.sha256(dest.read_bytes()).hexdigest()
    if expected_sha256 and digest != expected_sha256:
        raise UserError(f"{dest.name}: sha256 {digest}, the {package} manifest pins {expected_sha256} "
                        f"(cached at {dest.relative_to(REPO_ROOT)}; delete it to download again)")
    return Sdist(version, dest, digest, package)


# --- patches -------------------------------------------------------------------------------------------------------

def touched_files(patch: Path) -> list[str]:
    """Source paths a git-format patch modifies (relative to the vLLM source root)."""
    return re.findall(r"^--- a/(\S+)$", patch.read_text(), flags=re.M)


def _unpack(sdist: Sdist, members: set[str], dest: Path) -> Path:
    """Extract `members` (paths under the source root) of the sdist into dest; returns the source root."""
    prefix = f"vllm-{sdist.version}/"
    with tarfile.open(sdist.path) as tar:
        wanted = [m for m in tar.getmembers() if m.name.removeprefix(prefix) in members]
        tar.extractall(dest, members=wanted, filter="data")
    return dest / prefix.rstrip("/")


def _git_apply(patch: Path, root: Path, *flags: str) -> subprocess.CompletedProcess:
    # A ceiling stops git from finding an enclosing repository (ours: .cache/ lives in it), which would make
    # `git apply` resolve paths against that repository and silently skip them.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
    if shutil.which("git") is None:
        raise UserError("git not found: checking our vLLM patches needs `git apply`")
    return subprocess.run(["git", "apply", *flags, str(patch)], cwd=root, env=env, capture_output=True, text=True)


def _resolve(patches: list[tuple[str, str | None]]) -> list[Path]:
    """Patch files (paths relative to the repo root, or absolute), each checked against its sha256 if given."""
    paths = []
    for rel, sha in patches:
        p = REPO_ROOT / rel
        if not p.is_file():
            raise UserError(f"patch {rel}: file not found")
        if sha is not None:
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            if digest != sha:
                raise UserError(f"patch {rel}: sha256 {digest}, the vllm manifest pins {sha}")
        paths.append(p)
    return paths


def apply_all(patches: list[tuple[str, str | None]], sdist: Sdist, dest: Path,
              extra_files: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Unpack the sdist twice under dest (as released, and with every patch applied in order).

    Each patch is `git apply --check`ed before it is applied; one that does not apply raises a UserError
    naming the patch and the vLLM version. Returns (unpatched_root, patched_root).
    """
    paths = _resolve(patches)
    members = set(extra_files)
    for p in paths:
        members.update(touched_files(p))
    unpatched = _unpack(sdist, members, dest / "unpatched")
    patched = _unpack(sdist, members, dest / "patched")
    for p, (rel, _) in zip(paths, patches):
        check = _git_apply(p, patched, "--check")
        if check.returncode != 0:
            why = next((ln for ln in check.stderr.splitlines() if ln.startswith("error:")), check.stderr.strip())
            raise UserError(f"patch {rel} does not apply to {sdist.package} {sdist.version}: "
                            f"{why.removeprefix('error: ')}")
        applied = _git_apply(p, patched)
        if applied.returncode != 0:
            raise UserError(f"patch {rel}: git apply failed on {sdist.package} {sdist.version}: "
                            f"{applied.stderr.strip()}")
    return unpatched, patched


def manifest_pin(manifest_dir: Path | None = None) -> tuple[str, str | None, list[tuple[str, str]]] | None:
    """(vllm version, sdist sha256, patches) pinned by manifests/runtimes/vllm.yaml, or None without one.

    Read through g5g.manifest, so a broken manifest is the same one-line error as in `build`."""
    root = manifest_dir or REPO_ROOT / "manifests"
    if not (root / "runtimes" / f"{PACKAGE}.yaml").is_file():
        return None
    rt = manifest.load(root).runtimes[PACKAGE]
    return rt.pins[rt.version_pin], rt.sdist_sha256, [(p.path, p.sha256) for p in rt.patches]


def _sdist_sha_for(version: str) -> str | None:
    pin = manifest_pin()
    return pin[1] if pin and pin[0] == version else None


def check_apply(patches: list[tuple[str, str]], version: str, sdist_sha256: str | None = None,
                package: str = PACKAGE) -> None:
    """Every patch has its pinned sha256 and applies, in order, to `package` `version`'s sdist; else UserError.

    sdist_sha256: the pin the build uses (default for vLLM: manifests/runtimes/vllm.yaml's for that version)."""
    _resolve(patches)  # sha256s first: no download for a patch we would refuse anyway
    pinned = _sdist_sha_for(version) if package == PACKAGE else None
    sdist = fetch_sdist(version, sdist_sha256 or pinned, package)
    with tempfile.TemporaryDirectory(prefix="g5g-patches-") as tmp:
        apply_all(patches, sdist, Path(tmp))


# --- verify: what the kernel needs, compiled for sm_75 -------------------------------------------------------------

def patches_for(version: str) -> list[tuple[str, str | None]]:
    """The manifest's patch list when it pins `version`, else every patches/vllm/<version>/*.patch in order."""
    pin = manifest_pin()
    if pin and pin[0] == version and pin[2]:
        return list(pin[2])
    found = sorted((REPO_ROOT / "patches" / PACKAGE / version).glob("*.patch"))
    if not found:
        raise UserError(f"vLLM {version}: no patches under patches/vllm/{version}/")
    return [(str(p.relative_to(REPO_ROOT)), None) for p in found]


def probe(unpatched: Path, patched: Path, smem_limit: int = TURING_SMEM_OPTIN) -> dict:
    """Run tools/vllm_attn_probe.py (torch + triton) in a subprocess; its JSON report."""
    env = dict(os.environ)
    env.setdefault("TRITON_CACHE_DIR", str(CACHE_DIR / "triton"))
    argv = [sys.executable, str(PROBE), "--unpatched", str(unpatched), "--patched", str(patched),
            "--smem-limit", str(smem_limit)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        if "No module named 'triton'" in out.stderr or "No module named 'torch'" in out.stderr:
            raise UserError(f"patches verify needs torch and triton in {sys.executable}: {tail[0]}")
        raise UserError(f"compiling vLLM's attention kernel failed: {tail[0]} (run {' '.join(argv)} to see all)")
    return json.loads(out.stdout)


def verify(version: str | None = None, patches: list[tuple[str, str | None]] | None = None) -> dict:
    """Apply our patches to the pinned (or given) vLLM and compile every Gemma 4 attention launch for sm_75.

    The report (the probe's JSON plus version, patches and `ok`) says, per launch, the unpatched and patched
    tiles, stages and shared memory, and whether sm_80 launches are unchanged. `patches` defaults to
    `patches_for(version)`.
    """
    pin = manifest_pin()
    if version is None:
        if pin is None:
            raise UserError("patches verify: no manifests/runtimes/vllm.yaml to read the vLLM pin from; pass --version")
        version = pin[0]
    patches = patches_for(version) if patches is None else patches
    sdist = fetch_sdist(version, _sdist_sha_for(version))
    with tempfile.TemporaryDirectory(prefix="g5g-patches-") as tmp:
        unpatched, patched = apply_all(patches, sdist, Path(tmp), PROBE_FILES)
        report = probe(unpatched, patched)
    report.update(vllm=version, sdist_sha256=sdist.sha256,
                  patches=[{"path": rel, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                           for (rel, _), p in zip(patches, _resolve(patches))])
    report["ok"] = all(r["patched"]["fits"] and r["reference"]["unchanged"] for r in report["launches"])
    return report

