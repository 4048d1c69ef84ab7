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
from g5g.manifest import Manifests
from g5g.resolve import RuntimeBuild, resolve
from g5g.schema import IMAGE_RE, Profile

IMAGE_NAME = "g5g-images"
# A secret never travels as a build argument.
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
# buildx builder names (`docker buildx create --name`): what buildx accepts, and never an option ("-…").
BUILDER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class ImagePlan:
    runtime: str
    target: str  # bake target name (= runtime)
    tags: tuple[str, ...]
    platforms: tuple[str, ...]
    build_args: dict[str, str]
    env: dict[str, str]  # the image's ENV at run time (the runtime's `env`), rendered by the template's image_env
    labels: dict[str, str]
    patches: tuple[dict[str, str], ...]
    upstream: dict[str, str]
    dockerfile: str  # path relative to the repo root (absolute with an --out outside it)
    template: str
    contexts: dict[str, str]  # bake named contexts: image ref or name -> "target:…" / local dir
    depends_on: tuple[str, ...]  # the targets it is built FROM, nearest last
    context_vars: dict = field(default_factory=dict, compare=False)  # extra template variables
    context: str | None = None  # the build context when it is not the image's own directory (cpu: the wheels)
    context_origin: str = ""  # "FILE: KEY" the context comes from, for errors
    copy: tuple[str, ...] = ()  # repository paths copied into the build context
    cache_mode: str = "max"  # registry cache export (the runtime's cache_mode)
    patch_base: tuple[str, str, str | None] | None = None  # (package, version, sdist sha256) the patches apply to

    def contract(self, commands: list[list[str]]) -> dict:
        """The `--dry-run --json` entry (docs/CONTRACTS.md); a rehearsal adds `rehearse`."""
        rehearse = self.context_vars.get("rehearse")
        return ({"rehearse": rehearse} if rehearse is not None else {}) | {
            "runtime": self.runtime,
            "tags": list(self.tags),
            "platforms": list(self.platforms),
            "build_args": dict(self.build_args),
            "env": dict(self.env),
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
    bases: tuple[str, ...] = ()  # the runtimes other runtimes are built FROM (sequential builds load them first)
    templates: str = ""  # the template directory searched first (the manifests' repository), before ours
    cache: str | None = None  # registry repository of layer caches, one tag per bake target (REPO:<target>)
    builder: str | None = None  # buildx builder that runs the bakes (`docker buildx ls`); None: the current one
    rehearse: bool = False  # build.py --rehearse: the long compiles cut (the runtimes' rehearse sections)

    @property
    def bake_file(self) -> str:
        return str(PurePosixPath(self.out) / "docker-bake.json")

    def bake_argv(self, targets: list[str], push: bool, load: bool = False, metadata: str | None = None) -> list[str]:
        argv = ["docker", "buildx", "bake", *(["--builder", self.builder] if self.builder else []),
                "--file", self.bake_file]
        for s in self.secrets:
            argv += ["--set", f"*.secrets={s}"]
        if metadata:
            argv += ["--metadata-file", metadata]
        argv += self.cache_sets()
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
        Sequential (engines whose BuildKit lacks named contexts, e.g. Docker 20.10): each base (the torch base) is
        built and loaded into the engine first; the other images then find it by its tag.
        """
        names = [i.target for i in self.images]
        cmds: list[list[str]] = []
        if self.sequential:
            needed = {n for i in self.images for n in (i.target, *i.depends_on)}
            bases = [i.target for i in self.all_images if i.target in self.bases and i.target in needed]
            rest = [n for n in names if n not in bases]
            for b in bases:
                cmds.append(self.bake_argv([b], push=False, load=True,
                                           metadata=metadata if not rest and b == bases[-1] else None))
            if rest:
                cmds.append(self.bake_argv(rest, push=False, load=True, metadata=metadata))
            if self.push:
                cmds.append(self.bake_argv(names, push=True, metadata=metadata))
            return cmds
        if self.push:
            cmds.append(self.bake_argv(names, push=False))
        cmds.append(self.bake_argv(names, push=self.push, metadata=metadata))
        return cmds

    def cache_sets(self) -> list[str]:
        """Every target (the bases too) reads its own registry cache; a pushing build also writes it, from its
        first bake on, so hours of torch-base survive a later image failing (its cache_mode is min: the image, which
        holds the wheel, not the multi-GB build tree; a build whose inputs match skips the compile). Builds that do
        not push (pull requests: no registry credentials) only read."""
        argv: list[str] = []
        for img in self.all_images if self.cache else ():
            t = img.target
            ref = f"type=registry,ref={self.cache}:{t}"
            argv += ["--set", f"{t}.cache-from={ref}"]
            if self.push:
                argv += ["--set", f"{t}.cache-to={ref},mode={img.cache_mode}"]
        return argv

    def image_commands(self, image: ImagePlan) -> list[list[str]]:
        if self.sequential and image.depends_on:
            return [self.bake_argv(list(image.depends_on), push=False, load=True),
                    self.bake_argv([image.target], push=self.push, load=not self.push)]
        return [self.bake_argv([image.target], push=self.push)]

    def to_json(self) -> dict:
        return {
            "profile": self.profile.name,
            **({"rehearse": True} if self.rehearse else {}),
            "images": [i.contract(self.image_commands(i)) for i in self.images],
            "files": [i.dockerfile for i in self.all_images] + [self.bake_file],
            "commands": self.commands(),
        }


def serving_requirements(repo_root: Path, extra: str = "serving") -> tuple[str, ...]:
    """A pyproject.toml extra, e.g. `serving`: what goes into the jax and pytorch images (pinned in one place)."""
    path = repo_root / "pyproject.toml"
    try:
        extras = tomllib.loads(path.read_text())["project"]["optional-dependencies"]
        return tuple(extras[extra])
    except (OSError, KeyError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"{path}: project.optional-dependencies.{extra}: cannot read it ({e})") from None


def _tags(registry: str, runtime: str, version: str, profile: Profile, rehearse: bool = False) -> tuple[str, ...]:
    """REG/g5g-images:vllm-0.33.0-cu130-sm75 + REG/g5g-images:vllm (g5g); other profiles add their tag suffix:
    …:vllm-0.33.0-cu130-sm75-g4dn + …:vllm-g4dn, …:jax-0.10.2-cpu + …:jax-cpu. A rehearsal's images end in
    -rehearsal: never mistaken for (or pushed over) the real ones."""
    repo = f"{registry}/{IMAGE_NAME}"
    v = version.split("+")[0]
    suffix = profile.suffix + ("-rehearsal" if rehearse else "")
    if profile.cuda:
        cu = "cu" + profile.cuda.version.replace(".", "")
        sm = "sm" + "-".join(a.replace(".", "") for a in profile.cuda.archs)
        return f"{repo}:{runtime}-{v}-{cu}-{sm}{suffix}", f"{repo}:{runtime}{suffix}"
    return f"{repo}:{runtime}-{v}{suffix}", f"{repo}:{runtime}{suffix}"


def _upstream(build: RuntimeBuild, profile: Profile) -> dict[str, str]:
    up = {k: v for k, v in build.pins.items() if k not in build.unused_pins}
    if profile.cuda:
        up["cuda"] = profile.cuda.version
    up["python"] = profile.python
    return dict(sorted((up | build.upstream).items()))


def _requirements(build: RuntimeBuild, repo_root: Path) -> list[str]:
    """The pyproject extra the image installs; a pin of the runtime that the extra also pins must agree with it."""
    if build.requirements is None:
        return []
    reqs = serving_requirements(repo_root, build.requirements)
    for r in reqs:
        m = re.match(r"^([\w.-]+)==(.+)$", r)
        if m and m.group(1) in build.pins and m.group(2) != build.pins[m.group(1)]:
            raise UserError(f"{build.file}: pins.{m.group(1)}: {build.pins[m.group(1)]} differs from "
                            f"pyproject.toml's {build.requirements} extra ({r}); the image installs that one")
    return list(reqs)


def _image(build: RuntimeBuild, profile: Profile, tags: dict[str, tuple[str, ...]], platforms: tuple[str, ...],
           out: str, repo_root: Path, rehearse: bool = False, revision: str | None = None) -> ImagePlan:
    """One image, from its runtime's build (g5g/resolve.py): tags, labels, build args, contexts."""
    name = build.name
    archs = " ".join(profile.cuda.archs) if profile.cuda else ""
    upstream = _upstream(build, profile)
    labels = {
        "org.opencontainers.image.title": f"{IMAGE_NAME} {name}",
        "org.opencontainers.image.description": build.description,
        "org.opencontainers.image.version": build.version,
        "org.opencontainers.image.vendor": IMAGE_NAME,
        "org.opencontainers.image.base.name": build.from_image,
        "io.g5g.runtime": name,
        "io.g5g.profile": profile.name,
        "io.g5g.cuda-archs": archs,
        "io.g5g.upstream": json.dumps(upstream, sort_keys=True, separators=(",", ":")),
        "io.g5g.patches": json.dumps([dict(p) for p in build.patches], separators=(",", ":")),
    }
    if revision:  # labels are image metadata: a new commit changes no layer's cache key
        labels["org.opencontainers.image.revision"] = revision
    # A rehearsal: what it cut (the runtime's rehearse.why), or that it is built on a rehearsal's images.
    rehearsal = None
    if rehearse:
        rehearsal = {"why": build.rehearse_why or "no rehearse section: built as always",
                     "objects": list(build.rehearse_objects)}
        labels["io.g5g.rehearsal"] = rehearsal["why"]
    # Build args: exactly the ARGs the image's Dockerfile declares (a render test holds us to it).
    for k in build.args:
        if any(w in k for w in SECRET_WORDS):
            raise UserError(f"{build.file}: args.{k}: secrets travel only as BuildKit secrets (hf-token, ca-cert)")
    for k, v in build.env.items():
        if any(w in k for w in SECRET_WORDS):
            raise UserError(f"{build.file}: env.{k}: an image's ENV is readable by anyone who pulls it; secrets "
                            "travel only as BuildKit secrets")
        if re.search(r'["\\$\n]', v):
            raise UserError(f"{build.file}: env.{k}: {v!r}: no quotes, backslashes, $ or newlines in an ENV value")
    contexts = dict(build.contexts)
    if build.depends_on:  # bake links the image it is built FROM by its tag
        contexts = {build.from_image: f"target:{build.depends_on[-1]}", **contexts}
    ctx_vars = {"source": build.source, "serve_args": list(build.serve_args), "model_arg": build.model_arg,
                "port": build.port, "requirements": _requirements(build, repo_root), "rehearse": rehearsal}
    return ImagePlan(runtime=name, target=name, tags=tags[name], platforms=platforms,
                     build_args=dict(sorted(build.args.items())), env=dict(sorted(build.env.items())), labels=labels, patches=build.patches,
                     upstream=upstream, dockerfile=str(PurePosixPath(out) / name / "Dockerfile"),
                     template=f"{name}.Dockerfile.j2", contexts=contexts, depends_on=build.depends_on,
                     context_vars=ctx_vars, context=build.context, context_origin=build.context_origin,
                     copy=build.copy, cache_mode=build.cache_mode,
                     patch_base=(build.version_pin, build.version, build.sdist_sha256) if build.patches else None)


def make_plan(manifests: Manifests, runtime: str = "all", profile: str = "g5g", platforms: str | None = None,
              registry: str | None = None, out: str = "build", push: bool = False, sequential: bool = False,
              secrets: tuple[str, ...] = (), repo_root: Path | None = None, cache: str | None = None,
              builder: str | None = None, rehearse: bool = False, revision: str | None = None) -> Plan:
    """Every input explicit; the result depends on nothing else.

    repo_root: where pyproject.toml (the serving extra) lives; default: the manifest directory's parent.
    revision: the project commit the images are built from (their org.opencontainers.image.revision label)."""
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
    if cache is not None and not (IMAGE_RE.match(cache) and not re.search(r"[:@]", cache.rsplit("/", 1)[-1])):
        raise UserError(f"--cache {cache}: expected a registry repository without a tag, e.g. ghcr.io/me/g5g-cache "
                        "(each image's cache is tagged with its name)")
    if builder is not None and not BUILDER_RE.match(builder):
        raise UserError(f"--builder {builder!r}: not a builder name (letters, digits, '.', '_', '-'; see "
                        "`docker buildx ls`)")
    root = manifests.root.parent if repo_root is None else Path(repo_root)
    # Generated files go anywhere: inside the checkout the paths stay relative to it (bake runs there), else absolute.
    where = (root / out).resolve()
    out = where.relative_to(root.resolve()).as_posix() if where.is_relative_to(root.resolve()) else where.as_posix()
    builds = resolve(manifests.runtimes, prof, lambda name, version: _tags(reg, name, version, prof, rehearse)[0],
                     rehearse)  # in build order
    names = list(builds)
    if runtime in manifests.runtimes and runtime not in names:
        raise UserError(f"--runtime {runtime} --profile {profile}: {runtime} needs CUDA (needs_cuda in "
                        f"{manifests.runtimes[runtime].file} or what it is built FROM); the {profile} profile has none "
                        f"and builds {', '.join(names)}: use a profile with cuda")
    tags = {n: _tags(reg, n, b.version, prof, rehearse) for n, b in builds.items()}
    every = tuple(_image(b, prof, tags, plats, out, root, rehearse, revision) for b in builds.values())
    selected = every if runtime == "all" else tuple(i for i in every if i.runtime == runtime)
    if not selected:
        raise UserError(f"--runtime {runtime}: unknown runtime (known: {', '.join(names)}, all)")
    return Plan(profile=prof, images=selected, out=out, push=push, sequential=sequential,
                secrets=tuple(secrets),
                all_images=tuple(i for i in every if i in selected or any(i.target in s.depends_on for s in selected)),
                bases=tuple(n for n in names if any(i.depends_on and i.depends_on[-1] == n for i in every)),
                templates=str(root / "dockerfiles"), cache=cache, builder=builder, rehearse=rehearse)
