"""The build plan: pure data computed from validated manifests — tags, labels, build args, patches, commands.

No docker, no network, no host probing here: the same inputs give the same plan (golden tests pin it).
"""
from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from g5g.errors import UserError
from g5g.manifest import Manifests, Profile, Runtime

IMAGE_NAME = "g5g-images"
ORDER = ("torch-base", "vllm", "jax", "pytorch")  # dependencies first
PRIMARY_PIN = {"torch-base": "torch", "vllm": "vllm", "jax": "jax", "pytorch": "torch"}
# A secret never travels as a build argument.
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")


@dataclass(frozen=True)
class ImagePlan:
    runtime: str
    target: str  # bake target name (= runtime)
    tags: tuple[str, ...]
    platforms: tuple[str, ...]
    build_args: dict[str, str]
    labels: dict[str, str]
    patches: tuple[dict[str, str], ...]
    upstream: dict[str, str]
    dockerfile: str  # path relative to the repo root (absolute with an --out outside it)
    template: str
    contexts: dict[str, str]  # bake named contexts: image ref or name -> "target:…" / local dir
    depends_on: tuple[str, ...]
    context_vars: dict = field(default_factory=dict, compare=False)  # extra template variables

    def contract(self, commands: list[list[str]]) -> dict:
        """The `--dry-run --json` entry (docs/CONTRACTS.md)."""
        return {
            "runtime": self.runtime,
            "tags": list(self.tags),
            "platforms": list(self.platforms),
            "build_args": dict(self.build_args),
            "labels": dict(self.labels),
            "patches": [dict(p) for p in self.patches],
            "upstream": dict(self.upstream),
            "commands": commands,
        }


@dataclass(frozen=True)
class Plan:
    profile: Profile
    images: tuple[ImagePlan, ...]  # the selected images, dependencies first
    out: str  # output dir for generated files, relative to the repo root (absolute when outside it)
    push: bool
    sequential: bool
    secrets: tuple[str, ...]  # bake secret specs, e.g. "id=ca-cert,src=/etc/ssl/certs/ca.pem"
    all_images: tuple[ImagePlan, ...]  # the selected images and what they are built FROM (the bake file's targets)

    @property
    def bake_file(self) -> str:
        return str(PurePosixPath(self.out) / "docker-bake.json")

    def bake_argv(self, targets: list[str], push: bool, load: bool = False, metadata: str | None = None) -> list[str]:
        argv = ["docker", "buildx", "bake", "--file", self.bake_file]
        for s in self.secrets:
            argv += ["--set", f"*.secrets={s}"]
        if metadata:
            argv += ["--metadata-file", metadata]
        if push:
            argv.append("--push")
        elif load:
            argv.append("--load")
        return argv + targets

    def commands(self, metadata: str | None = None) -> list[list[str]]:
        """What `build` runs, in order.

        Default: one bake for every selected target (named contexts link them, the torch base is built once).
        With push: the same bake twice, first without pushing, then with --push from the cache, so a failing
        image means nothing is pushed, and every tag of an image goes in one export.
        Sequential (engines whose BuildKit lacks named contexts, e.g. Docker 20.10): the torch base is built and
        loaded into the engine first; the other images then find it by its tag.
        """
        names = [i.target for i in self.images]
        cmds: list[list[str]] = []
        if self.sequential:
            base_needed = "torch-base" in names or any("torch-base" in i.depends_on for i in self.images)
            rest = [n for n in names if n != "torch-base"]
            if base_needed:
                cmds.append(self.bake_argv(["torch-base"], push=False, load=True,
                                           metadata=metadata if not rest else None))
            if rest:
                cmds.append(self.bake_argv(rest, push=False, load=True, metadata=metadata))
            if self.push:
                cmds.append(self.bake_argv(names, push=True, metadata=metadata))
            return cmds
        if self.push:
            cmds.append(self.bake_argv(names, push=False))
        cmds.append(self.bake_argv(names, push=self.push, metadata=metadata))
        return cmds

    def image_commands(self, image: ImagePlan) -> list[list[str]]:
        if self.sequential and image.depends_on:
            return [self.bake_argv(list(image.depends_on), push=False, load=True),
                    self.bake_argv([image.target], push=self.push, load=not self.push)]
        return [self.bake_argv([image.target], push=self.push)]

    def to_json(self) -> dict:
        return {
            "profile": self.profile.name,
            "images": [i.contract(self.image_commands(i)) for i in self.images],
            "files": [i.dockerfile for i in self.all_images] + [self.bake_file],
            "commands": self.commands(),
        }


def serving_requirements(repo_root: Path) -> tuple[str, ...]:
    """pyproject.toml's `serving` extra: what goes into the jax and pytorch images (pinned in one place)."""
    path = repo_root / "pyproject.toml"
    try:
        extras = tomllib.loads(path.read_text())["project"]["optional-dependencies"]
        return tuple(extras["serving"])
    except (OSError, KeyError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"{path}: project.optional-dependencies.serving: cannot read it ({e})") from None


def _tags(registry: str, runtime: str, version: str, profile: Profile) -> tuple[str, ...]:
    """REG/g5g-images:vllm-0.33.0-cu132-sm75 + REG/g5g-images:vllm (g5g); other profiles add their tag suffix:
    …:vllm-0.33.0-cu130-sm75-g4dn + …:vllm-g4dn, …:jax-0.10.2-cpu + …:jax-cpu."""
    repo = f"{registry}/{IMAGE_NAME}"
    v = version.split("+")[0]
    suffix = profile.tag_suffix
    if profile.cuda:
        cu = "cu" + profile.cuda.version.replace(".", "")
        sm = "sm" + "-".join(a.replace(".", "") for a in profile.cuda.archs)
        return f"{repo}:{runtime}-{v}-{cu}-{sm}{suffix}", f"{repo}:{runtime}{suffix}"
    return f"{repo}:{runtime}-{v}{suffix}", f"{repo}:{runtime}{suffix}"


def _upstream(rt: Runtime, profile: Profile) -> dict[str, str]:
    up = {k: v for k, v in rt.pins_for(profile.name).items()}
    if profile.cuda:
        up["cuda"] = profile.cuda.version
    up["python"] = profile.python
    if rt.name == "torch-base" and rt.source == "image":
        up["base_image"] = rt.image or ""
    return dict(sorted(up.items()))


def _image(manifests: Manifests, profile: Profile, name: str, registry: str, platforms: tuple[str, ...],
           out: str, base_tag: str, repo_root: Path) -> ImagePlan:
    rt = manifests.runtimes[name]
    pins = rt.pins_for(profile.name)
    version = pins[PRIMARY_PIN[name]]
    tags = _tags(registry, name, version, profile)
    archs = " ".join(profile.cuda.archs) if profile.cuda else ""
    upstream = _upstream(rt, profile)
    patches = tuple({"path": p.path, "sha256": p.sha256} for p in rt.patches)
    cuda = profile.cuda
    torch_source = (profile.torch_source or rt.source) if cuda else "wheels"
    base_name = (rt.image if (name == "torch-base" and torch_source == "image") else
                 cuda.runtime_image if (cuda and cuda.runtime_image and name in ("torch-base", "jax")) else
                 profile.base_image if name in ("torch-base", "jax") else base_tag)
    labels = {
        "org.opencontainers.image.title": f"{IMAGE_NAME} {name}",
        "org.opencontainers.image.description": rt.description,
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.vendor": IMAGE_NAME,
        "org.opencontainers.image.base.name": base_name or "",
        "io.g5g.runtime": name,
        "io.g5g.profile": profile.name,
        "io.g5g.cuda-archs": archs,
        "io.g5g.upstream": json.dumps(upstream, sort_keys=True, separators=(",", ":")),
        "io.g5g.patches": json.dumps([dict(p) for p in patches], separators=(",", ":")),
    }
    # Build args: exactly the ARGs the image's Dockerfile declares (a render test holds us to it).
    args: dict[str, str] = {}
    ctx_vars: dict = {}
    contexts: dict[str, str] = {}
    depends: tuple[str, ...] = ()
    if name == "torch-base":
        args["TORCH_VERSION"] = pins["torch"]
        if torch_source == "build":
            args |= {"CUDA_DEVEL_IMAGE": cuda.devel_image, "CUDA_RUNTIME_IMAGE": cuda.runtime_image,
                     "TORCH_CUDA_ARCH_LIST": archs, "MAX_JOBS": profile.max_jobs, "NCCL_VERSION": cuda.nccl or "",
                     "NVCC_THREADS": str(profile.nvcc_threads), "CPU_BASELINE": profile.cpu_baseline or "native"}
        elif torch_source == "image":
            args["TORCH_BASE_IMAGE"] = rt.image or ""
        else:
            args["BASE_IMAGE"] = profile.base_image or ""
            if torch_source == "pypi":
                args |= {"TORCH_CUDA_ARCH_LIST": archs, "CUOBJDUMP_VERSION": cuda.cuobjdump}
            elif profile.wheels:
                contexts["wheels"] = profile.wheels
        ctx_vars["source"] = torch_source
    else:
        if name in ("vllm", "pytorch"):
            args["TORCH_BASE"] = base_tag
            contexts[base_tag] = "target:torch-base"
            depends = ("torch-base",)
        if name == "jax":
            args["BASE_IMAGE"] = (cuda and cuda.runtime_image) or profile.base_image or ""
            args["JAX_VERSION"] = pins["jax"]
            if cuda:
                args["JAX_EXTRA"] = f"cuda{cuda.version.split('.')[0]}"
        if name == "vllm":
            args |= {"VLLM_VERSION": pins["vllm"], "VLLM_SDIST_SHA256": rt.sdist_sha256 or "",
                     "TORCHVISION_VERSION": pins["torchvision"], "TRANSFORMERS_VERSION": pins["transformers"],
                     "TRITON_VERSION": pins["triton"], "TORCH_CUDA_ARCH_LIST": archs, "MAX_JOBS": profile.max_jobs,
                     "NVCC_THREADS": str(profile.nvcc_threads)}
            if cuda.pip_toolkit:
                args |= {"CUDA_TOOLKIT_VERSION": cuda.pip_toolkit, "CUOBJDUMP_VERSION": cuda.cuobjdump,
                         "BASE_IMAGE": profile.base_image or ""}
            else:
                args["CUDA_DEVEL_IMAGE"] = cuda.devel_image
            if profile.rust_frontend:
                args["RUST_VERSION"] = pins["rust"]
            if profile.vllm_sources:
                contexts["vllm-sources"] = str(PurePosixPath(profile.vllm_sources) / pins["vllm"])
            ctx_vars |= {"toolkit": "pip" if cuda.pip_toolkit else "image", "rust_frontend": profile.rust_frontend,
                         "vllm_sources": bool(profile.vllm_sources)}
        if name in ("jax", "pytorch"):
            reqs = serving_requirements(repo_root)
            for r in reqs:
                m = re.match(r"^transformers==(.+)$", r)
                if m and m.group(1) != pins["transformers"]:
                    raise UserError(f"{rt.file}: pins.transformers: {pins['transformers']} differs from "
                                    f"pyproject.toml's serving extra ({r}); the image installs that one")
            ctx_vars["requirements"] = list(reqs)
        ctx_vars["serve_args"] = list(rt.serve_args)
        ctx_vars["port"] = rt.port
    for k in args:
        if any(w in k for w in SECRET_WORDS):
            raise UserError(f"build arg {k}: secrets travel only as BuildKit secrets (hf-token, ca-cert)")
    return ImagePlan(runtime=name, target=name, tags=tags, platforms=platforms, build_args=dict(sorted(args.items())),
                     labels=labels, patches=patches, upstream=upstream,
                     dockerfile=str(PurePosixPath(out) / name / "Dockerfile"), template=f"{name}.Dockerfile.j2",
                     contexts=contexts, depends_on=depends, context_vars=ctx_vars)


def make_plan(manifests: Manifests, runtime: str = "all", profile: str = "g5g", platforms: str | None = None,
              registry: str | None = None, out: str = "build", push: bool = False, sequential: bool = False,
              secrets: tuple[str, ...] = (), repo_root: Path | None = None) -> Plan:
    """Every input explicit; the result depends on nothing else.

    repo_root: where pyproject.toml (the serving extra) lives; default: the manifest directory's parent."""
    if profile not in manifests.profiles:
        raise UserError(f"--profile {profile}: unknown profile (known: {', '.join(sorted(manifests.profiles))})")
    prof = manifests.profiles[profile]
    if platforms:
        plats = tuple(p.strip() for p in platforms.split(",") if p.strip())
        for p in plats:
            if p not in ("linux/arm64", "linux/amd64"):
                raise UserError(f"--platform {p}: not a supported platform (linux/arm64, linux/amd64)")
            # The CUDA templates are per platform (NVIDIA's repo path, -mcpu): only the profile's own platforms build.
            if prof.cuda and p not in prof.platforms:
                raise UserError(f"--platform {p}: profile {profile} builds only {', '.join(prof.platforms)} "
                                "(its CUDA toolkit and host flags are per platform); for sm_75 there, pick the "
                                "profile that builds it (manifests/profiles/: g4dn is linux/amd64)")
        if not plats:
            raise UserError("--platform: empty")
    else:
        plats = prof.platforms
    reg = (registry or prof.registry).rstrip("/")
    if not reg or any(c.isspace() for c in reg) or "://" in reg:
        raise UserError(f"--registry {registry}: expected host[:port][/namespace], e.g. ghcr.io/me")
    root = manifests.root.parent if repo_root is None else Path(repo_root)
    # Generated files go anywhere: inside the checkout the paths stay relative to it (bake runs there), else absolute.
    where = (root / out).resolve()
    out = where.relative_to(root.resolve()).as_posix() if where.is_relative_to(root.resolve()) else where.as_posix()
    cpu = prof.cuda is None
    if runtime == "vllm" and cpu:
        raise UserError(f"--runtime vllm --profile {profile}: vLLM needs CUDA here; use --profile g5g or g4dn "
                        f"(the {profile} profile builds jax, pytorch and torch-base)")
    names = [n for n in ORDER if not (cpu and n == "vllm")]
    base_rt = manifests.runtimes["torch-base"]
    base_tag = _tags(reg, "torch-base", base_rt.pins_for(profile)["torch"], prof)[0]
    every = tuple(_image(manifests, prof, n, reg, plats, out, base_tag, root) for n in names)
    selected = every if runtime == "all" else tuple(i for i in every if i.runtime == runtime)
    if not selected:
        raise UserError(f"--runtime {runtime}: unknown runtime (known: {', '.join(names)}, all)")
    return Plan(profile=prof, images=selected, out=out, push=push, sequential=sequential,
                secrets=tuple(secrets),
                all_images=tuple(i for i in every if i in selected or any(i.target in s.depends_on for s in selected)))
