"""Manifests: target profiles and runtimes in YAML, validated strictly before anything runs.

`load(manifest_dir) -> Manifests`. Every error is a UserError naming the file and the key, e.g.
`manifests/runtimes/vllm.yaml: pins.vllm: 0.27.1 is below the Gemma 4 floor 0.28.0`.
Pure: reads files, touches no docker, no network (a listed patch's sha256 is checked separately, `check_patch_digests`).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from g5g.errors import UserError

RUNTIMES = ("torch-base", "vllm", "jax", "pytorch")
PROFILES = ("g5g", "g4dn", "cpu")
VLLM_FLOOR = (0, 28, 0)  # Gemma 4's per-layer head_dim is handled from vLLM 0.28.0
PLATFORM_RE = re.compile(r"^linux/(amd64|arm64)$")
ARCH_RE = re.compile(r"^\d+\.\d+$")  # "7.5"; "+PTX", "sm_75", "75" are refused
VERSION_RE = re.compile(r"^\d+(\.\d+)*([a-z0-9.+]*)$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:@-]*$")
DIGEST_RE = re.compile(r"@sha256:[0-9a-f]{64}$")
TORCH_SOURCES = ("build", "image", "pypi")  # pypi: the index's CUDA wheel, checked for the profile's SASS


@dataclass(frozen=True)
class Cuda:
    """Where the toolkit comes from: NVIDIA's images (devel + runtime, g5g) or NVIDIA's wheels (pip, g4dn)."""
    version: str
    archs: tuple[str, ...]
    devel_image: str | None = None
    runtime_image: str | None = None
    pip_toolkit: str | None = None  # cuda-toolkit==X on the index, e.g. "13.0.3" (what PyPI's torch is built on)
    cuobjdump: str = ""  # nvidia-cuda-cuobjdump==X: lists the SASS of torch's and vLLM's libraries at build time
    nccl: str | None = None  # nvidia-nccl-cu13==X for a source-built torch: one version to build and run with


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    platforms: tuple[str, ...]
    registry: str
    python: str
    dtype: str
    cuda: Cuda | None = None
    cpu_baseline: str | None = None
    base_image: str | None = None
    wheels: str | None = None
    max_jobs: str = "auto"
    nvcc_threads: int = 1
    rust_frontend: bool = True  # vLLM's Rust frontend (vllm-rs) needs the crates registry at build time
    vllm_sources: str | None = None  # local tree of vLLM's external projects (tools/vllm_sources.py), not GitHub
    torch_source: str | None = None  # overrides torch-base's source for this profile
    tag_suffix: str = ""  # appended to the image tags: "" for the flagship profile, "-<name>" by default
    source: str = ""


@dataclass(frozen=True)
class Patch:
    path: str
    sha256: str


@dataclass(frozen=True)
class Smoke:
    prompt: str
    expect: str


@dataclass(frozen=True)
class Runtime:
    name: str
    description: str
    pins: dict[str, str]
    profile_pins: dict[str, dict[str, str]] = field(default_factory=dict)
    source: str = "build"
    image: str | None = None
    sdist_sha256: str | None = None
    patches: tuple[Patch, ...] = ()
    serve_args: tuple[str, ...] = ()
    port: int = 8000
    smoke: Smoke | None = None
    file: str = ""

    def pins_for(self, profile: str) -> dict[str, str]:
        return {**self.pins, **self.profile_pins.get(profile, {})}


@dataclass(frozen=True)
class Manifests:
    root: Path
    profiles: dict[str, Profile]
    runtimes: dict[str, Runtime]


# --- a small strict schema reader -------------------------------------------------------------------------------

class _Reader:
    """Walks one YAML mapping, remembering the file and key path for error messages."""

    def __init__(self, file: str, data: Any, path: str = ""):
        self.file, self.path = file, path
        if not isinstance(data, dict):
            self.fail(f"expected a mapping, got {type(data).__name__}")
        self.data: dict = data
        self.seen: set[str] = set()

    def key(self, k: str) -> str:
        return f"{self.path}.{k}" if self.path else k

    def fail(self, msg: str, key: str | None = None) -> None:
        where = self.key(key) if key else (self.path or "(top level)")
        raise UserError(f"{self.file}: {where}: {msg}")

    def get(self, k: str, kind: type | tuple, required: bool = True, default: Any = None) -> Any:
        self.seen.add(k)
        if k not in self.data or self.data[k] is None:
            if required:
                self.fail("missing (required)", k)
            return default
        v = self.data[k]
        if kind is str and isinstance(v, (int, float)) and not isinstance(v, bool):
            self.fail(f"must be a quoted string, got {v!r} (YAML reads it as a number)", k)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            names = kind.__name__ if isinstance(kind, type) else "/".join(t.__name__ for t in kind)
            self.fail(f"must be {names}, got {type(v).__name__} {v!r}", k)
        return v

    def sub(self, k: str, required: bool = True) -> _Reader | None:
        v = self.get(k, dict, required)
        return None if v is None else _Reader(self.file, v, self.key(k))

    def strings(self, k: str, required: bool = True) -> tuple[str, ...]:
        v = self.get(k, list, required, [])
        for i, item in enumerate(v):
            if not isinstance(item, str):
                self.fail(f"item {i} must be a quoted string, got {item!r}", k)
        return tuple(v)

    def done(self) -> None:
        extra = sorted(set(self.data) - self.seen)
        if extra:
            self.fail(f"unknown key (allowed: {', '.join(sorted(self.seen))})", extra[0])


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def _pins(r: _Reader, k: str, required: bool = True) -> dict[str, str]:
    sub = r.sub(k, required)
    if sub is None:
        return {}
    out = {}
    for name in list(sub.data):
        v = sub.get(name, str)
        if not VERSION_RE.match(v):
            sub.fail(f"{v!r} is not an exact version (a pin is X.Y.Z, no ranges)", name)
        out[name] = v
    sub.done()
    return out


# --- profiles -----------------------------------------------------------------------------------------------------

def _profile(file: str, data: Any) -> Profile:
    r = _Reader(file, data)
    name = r.get("name", str)
    if name != Path(file).stem:
        r.fail(f"{name!r} does not match the file name {Path(file).stem!r}", "name")
    platforms = r.strings("platforms")
    if not platforms:
        r.fail("needs at least one platform", "platforms")
    for p in platforms:
        if not PLATFORM_RE.match(p):
            r.fail(f"{p!r} is not a supported platform (linux/amd64 or linux/arm64)", "platforms")
    cuda = None
    c = r.sub("cuda", required=False)
    if c is not None:
        version = c.get("version", str)
        if not re.match(r"^\d+\.\d+$", version):
            c.fail(f"{version!r} must be MAJOR.MINOR, e.g. \"13.2\"", "version")
        archs = c.strings("archs")
        if not archs:
            c.fail("needs at least one CUDA arch, e.g. [\"7.5\"]", "archs")
        for a in archs:
            if "PTX" in a.upper():
                c.fail(f"{a!r}: +PTX is not allowed (vLLM filters the global PTX flag; PTX cannot JIT down to 7.5)",
                       "archs")
            if not ARCH_RE.match(a):
                c.fail(f"{a!r} is not a CUDA arch like \"7.5\"", "archs")
        devel, runtime = c.get("devel_image", str, required=False), c.get("runtime_image", str, required=False)
        pip_toolkit = c.get("pip_toolkit", str, required=False)
        if (devel is None) != (runtime is None) or (devel is None) == (pip_toolkit is None):
            c.fail("needs devel_image and runtime_image (NVIDIA's images) or pip_toolkit (NVIDIA's wheels), "
                   "not both", "pip_toolkit" if pip_toolkit else "devel_image")
        cuda = Cuda(version, archs, devel, runtime, pip_toolkit, c.get("cuobjdump", str, required=False, default=""),
                    c.get("nccl", str, required=False))
        c.done()
    base_image = r.get("base_image", str, required=False)
    if cuda is None and base_image is None:
        r.fail("a profile without cuda needs a base_image", "base_image")
    if cuda is not None and cuda.pip_toolkit and base_image is None:
        r.fail("cuda.pip_toolkit (no NVIDIA image) needs a base_image to install it on", "base_image")
    for key, img in (("base_image", base_image),) + (
            (("cuda.devel_image", cuda.devel_image), ("cuda.runtime_image", cuda.runtime_image)) if cuda else ()):
        if img is not None and not IMAGE_RE.match(img):
            r.fail(f"{img!r} is not an image reference", key)
        if img is not None and "@" in img and not DIGEST_RE.search(img):
            r.fail(f"{img!r}: a digest is @sha256: and 64 hex digits", key)
    max_jobs, nvcc_threads, rust_frontend, vllm_sources = "auto", 1, True, None
    b = r.sub("build", required=False)
    if b is not None:
        mj = b.get("max_jobs", (str, int), required=False, default="auto")
        if isinstance(mj, bool) or (isinstance(mj, int) and mj < 1) or (isinstance(mj, str) and mj != "auto"):
            b.fail(f"{mj!r} must be a positive number or \"auto\"", "max_jobs")
        max_jobs = str(mj)
        nvcc_threads = b.get("nvcc_threads", int, required=False, default=1)
        if nvcc_threads < 1:
            b.fail("must be at least 1", "nvcc_threads")
        rust_frontend = b.get("rust_frontend", bool, required=False, default=True)
        vllm_sources = b.get("vllm_sources", str, required=False)
        if vllm_sources is not None and (vllm_sources.startswith("/") or ".." in Path(vllm_sources).parts):
            b.fail(f"{vllm_sources!r} must be a directory inside the repository (it is a build context)",
                   "vllm_sources")
        b.done()
    wheels = r.get("wheels", str, required=False)
    if wheels is not None and (wheels.startswith("/") or ".." in Path(wheels).parts):
        r.fail(f"{wheels!r} must be a directory inside the repository (it is a build context)", "wheels")
    torch_source = r.get("torch_source", str, required=False)
    if torch_source is not None and torch_source not in TORCH_SOURCES:
        r.fail(f"{torch_source!r} must be one of {', '.join(TORCH_SOURCES)}", "torch_source")
    registry = r.get("registry", str)
    if not IMAGE_RE.match(registry) or registry.endswith("/"):
        r.fail(f"{registry!r} is not a registry/namespace like ghcr.io/me", "registry")
    profile = Profile(
        name=name, description=r.get("description", str), platforms=platforms, registry=registry,
        python=r.get("python", str), dtype=r.get("dtype", str), cuda=cuda,
        cpu_baseline=r.get("cpu_baseline", str, required=False), base_image=base_image,
        wheels=wheels, max_jobs=max_jobs, nvcc_threads=nvcc_threads, rust_frontend=rust_frontend,
        vllm_sources=vllm_sources, torch_source=torch_source,
        tag_suffix=r.get("tag_suffix", str, required=False, default=f"-{name}"), source=file)
    r.done()
    return profile


# --- runtimes -----------------------------------------------------------------------------------------------------

REQUIRED_PINS = {
    "torch-base": ("torch",),
    "vllm": ("vllm", "torch", "torchvision", "transformers", "rust", "triton"),
    "jax": ("jax", "transformers"),
    "pytorch": ("torch", "transformers"),
}


def _runtime(file: str, data: Any) -> Runtime:
    r = _Reader(file, data)
    name = r.get("runtime", str)
    if name not in RUNTIMES:
        r.fail(f"{name!r} is not a runtime ({', '.join(RUNTIMES)})", "runtime")
    if name != Path(file).stem:
        r.fail(f"{name!r} does not match the file name {Path(file).stem!r}", "runtime")
    pins = _pins(r, "pins")
    for p in REQUIRED_PINS[name]:
        if p not in pins:
            r.fail(f"missing pin {p!r}", f"pins.{p}")
    profile_pins: dict[str, dict[str, str]] = {}
    pr = r.sub("profiles", required=False)
    if pr is not None:
        for prof in list(pr.data):
            if prof not in PROFILES:
                pr.fail(f"unknown profile (known: {', '.join(PROFILES)})", prof)
            sub = pr.sub(prof)
            profile_pins[prof] = _pins(sub, "pins")
            for p in profile_pins[prof]:
                if p not in pins:
                    sub.fail(f"overrides a pin the runtime does not have ({', '.join(pins)})", f"pins.{p}")
            sub.done()
        pr.done()
    if name == "vllm":
        for prof, prof_pins in [("", pins), *profile_pins.items()]:
            v = prof_pins.get("vllm", pins["vllm"])
            if _version_tuple(v) < VLLM_FLOOR:
                key = f"profiles.{prof}.pins.vllm" if prof else "pins.vllm"
                r.fail(f"{v} is below the Gemma 4 floor {'.'.join(map(str, VLLM_FLOOR))}", key)
    source = r.get("source", str, required=False, default="build")
    image = r.get("image", str, required=False)
    if name == "torch-base":
        if source not in ("build", "image"):
            r.fail(f"{source!r} must be build or image", "source")
        if source == "image" and not image:
            r.fail("source: image needs the image reference", "image")
        if image is not None and not IMAGE_RE.match(image):
            r.fail(f"{image!r} is not an image reference", "image")
    elif "source" in r.data or "image" in r.data:
        r.fail("only torch-base takes source/image", "source" if "source" in r.data else "image")
    sdist = r.get("sdist_sha256", str, required=(name == "vllm"))
    if sdist is not None and (name != "vllm" or not SHA256_RE.match(sdist)):
        r.fail("must be the 64-hex sha256 of the vLLM sdist" if name == "vllm" else "only vllm takes it",
               "sdist_sha256")
    patches: list[Patch] = []
    if name == "vllm":
        raw = r.get("patches", list, required=False, default=[])
        for i, item in enumerate(raw):
            pr_ = _Reader(file, item, f"patches[{i}]")
            path, sha = pr_.get("path", str), pr_.get("sha256", str)
            if not SHA256_RE.match(sha):
                pr_.fail(f"{sha!r} is not a 64-hex sha256", "sha256")
            if not re.match(rf"^patches/vllm/{re.escape(pins['vllm'])}/[\w.-]+\.patch$", path):
                pr_.fail(f"{path!r} must live under patches/vllm/{pins['vllm']}/ and end in .patch", "path")
            pr_.done()
            patches.append(Patch(path, sha))
    elif "patches" in r.data:
        r.fail("only vllm takes patches", "patches")
    serve_args = r.strings("serve_args", required=False)
    port = r.get("port", int, required=False, default=8000)
    if not 1 <= port <= 65535:
        r.fail(f"{port} is not a TCP port", "port")
    smoke = None
    s = r.sub("smoke", required=(name != "torch-base"))
    if s is not None:
        expect = s.get("expect", str)
        try:
            re.compile(expect)
        except re.error as e:
            s.fail(f"{expect!r} is not a regular expression ({e})", "expect")
        smoke = Smoke(s.get("prompt", str), expect)
        s.done()
    rt = Runtime(name=name, description=r.get("description", str), pins=pins, profile_pins=profile_pins,
                 source=source, image=image, sdist_sha256=sdist, patches=tuple(patches),
                 serve_args=serve_args, port=port, smoke=smoke, file=file)
    r.done()
    return rt


# --- loading ------------------------------------------------------------------------------------------------------

def _read_yaml(path: Path, shown: str) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{shown}: missing (every manifest set needs it)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "?"
        raise UserError(f"{shown}: {where}: not valid YAML ({getattr(e, 'problem', e)})") from None


def _apply_overrides(raw: dict[str, Any], overrides: list[str], files: dict[str, str]) -> None:
    """`--set profile.base_image=REF` or `--set vllm.pins.vllm=0.33.0`: the first part names the document."""
    for item in overrides:
        key, sep, value = item.partition("=")
        doc, _, rest = key.partition(".")
        if not sep or not rest or doc not in raw:
            raise UserError(f"--set {item}: expected DOC.KEY=VALUE with DOC one of {', '.join(raw)}")
        node = raw[doc]
        parts = rest.split(".")
        for p in parts[:-1]:
            if not isinstance(node, dict):
                raise UserError(f"--set {item}: {files[doc]}: {rest}: not a mapping")
            node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UserError(f"--set {item}: {files[doc]}: {rest}: not a mapping")
        try:
            node[parts[-1]] = yaml.safe_load(value) if value.strip() else None
        except yaml.YAMLError as e:
            raise UserError(f"--set {item}: {value!r} is not a YAML value ({getattr(e, 'problem', None) or e})") from None


def load(manifest_dir: str | Path, profile: str | None = None, overrides: list[str] | None = None) -> Manifests:
    """Load and validate every manifest (or only `profile` among the profiles); raise UserError on the first problem.

    overrides: `DOC.KEY=VALUE` strings applied before validation; DOC is `profile` (the chosen profile) or a runtime.
    """
    root = Path(manifest_dir)
    if not root.is_dir():
        raise UserError(f"{root}: manifest directory not found")

    def shown(p: Path) -> str:
        return f"{root.name}/{p.relative_to(root)}"

    raw: dict[str, Any] = {}
    files: dict[str, str] = {}
    names = [profile] if profile else list(PROFILES)
    for n in names:
        p = root / "profiles" / f"{n}.yaml"
        if profile and not p.exists():
            known = sorted(x.stem for x in (root / "profiles").glob("*.yaml"))
            raise UserError(f"--profile {n}: no {shown(p)} (known: {', '.join(known)})")
        raw[f"profile:{n}"], files[f"profile:{n}"] = _read_yaml(p, shown(p)), shown(p)
    for n in RUNTIMES:
        p = root / "runtimes" / f"{n}.yaml"
        raw[n], files[n] = _read_yaml(p, shown(p)), shown(p)
    if overrides:
        if profile:
            raw["profile"], files["profile"] = raw.pop(f"profile:{profile}"), files.pop(f"profile:{profile}")
        _apply_overrides(raw, overrides, files)
        if profile:
            raw[f"profile:{profile}"], files[f"profile:{profile}"] = raw.pop("profile"), files.pop("profile")
    profiles = {k.split(":", 1)[1]: _profile(files[k], raw[k]) for k in raw if k.startswith("profile:")}
    runtimes = {n: _runtime(files[n], raw[n]) for n in RUNTIMES}
    _check_consistency(profiles, runtimes)
    return Manifests(root=root, profiles=profiles, runtimes=runtimes)


def _check_consistency(profiles: dict[str, Profile], runtimes: dict[str, Runtime]) -> None:
    """Cross-file rules: the torch every image runs on is the torch-base one."""
    base = runtimes["torch-base"]
    for prof in PROFILES:
        want = base.pins_for(prof)["torch"]
        for name in ("vllm", "pytorch"):
            rt = runtimes[name]
            if name == "vllm" and prof == "cpu":
                continue  # vLLM is refused on the cpu profile at plan time
            got = rt.pins_for(prof)["torch"]
            if got != want:
                key = f"profiles.{prof}.pins.torch" if prof in rt.profile_pins and "torch" in rt.profile_pins[
                    prof] else "pins.torch"
                raise UserError(f"{rt.file}: {key}: {got} differs from torch-base's torch {want} "
                                f"for profile {prof} ({base.file})")
    if "g5g" in profiles and profiles["g5g"].cuda is None:
        raise UserError(f"{profiles['g5g'].source}: cuda: missing (the g5g profile targets a GPU)")


def check_patch_digests(manifests: Manifests, repo_root: str | Path) -> None:
    """Each listed patch exists under repo_root and has the sha256 the manifest pins (file + key on failure)."""
    rt = manifests.runtimes["vllm"]
    for i, p in enumerate(rt.patches):
        path = Path(repo_root) / p.path
        if not path.is_file():
            raise UserError(f"{rt.file}: patches[{i}].path: {p.path} does not exist")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != p.sha256:
            raise UserError(f"{rt.file}: patches[{i}].sha256: {p.path} has sha256 {digest}, manifest says {p.sha256}")
