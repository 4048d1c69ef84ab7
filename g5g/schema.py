"""What a manifest may say: target profiles and runtimes as strict pydantic models, and the one-line error when
it says something else (`validate`: "FILE: KEY: message").

The profiles are the files in profiles/, the runtimes the files in runtimes/ (g5g/manifest.py loads them). A runtime
says how its image is built: FROM another runtime or an image, build args, contexts — Jinja expressions over the
profile, the pins and the runtime itself (g5g/resolve.py evaluates them), so a new runtime is a manifest and a
template, no code.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import jinja2
from jinja2.sandbox import SandboxedEnvironment
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictBool,
                      StrictInt, StrictStr, ValidationError)

from g5g.errors import UserError

PLATFORM_RE = re.compile(r"^linux/(amd64|arm64)$")
ARCH_RE = re.compile(r"^\d+\.\d+$")  # "7.5"; "+PTX", "sm_75", "75" are refused
VERSION_RE = re.compile(r"^\d+(\.\d+)*([a-z0-9.+]*)$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._/:@-]*$")
DIGEST_RE = re.compile(r"@sha256:[0-9a-f]{64}$")
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_EXPR = SandboxedEnvironment(undefined=jinja2.StrictUndefined)


# --- value checks (a ValueError becomes "FILE: KEY: message") -------------------------------------------------------

def _check(test, message: str):
    def run(v):
        if v is not None and not test(v):
            raise ValueError(message.format(v=v))
        return v
    return AfterValidator(run)


def _image_ref(v: str) -> str:
    if not IMAGE_RE.match(v):
        raise ValueError(f"{v!r} is not an image reference")
    if "@" in v and not DIGEST_RE.search(v):
        raise ValueError(f"{v!r}: a digest is @sha256: and 64 hex digits")
    return v


def _in_repo(v: str) -> str:
    if v.startswith("/") or ".." in Path(v).parts:
        raise ValueError(f"{v!r} must be a directory inside the repository (it is a build context)")
    return v


def _archs(v: tuple[str, ...]) -> tuple[str, ...]:
    if not v:
        raise ValueError("needs at least one CUDA arch, e.g. [\"7.5\"]")
    for a in v:
        if "PTX" in a.upper():
            raise ValueError(f"{a!r}: +PTX is not allowed (vLLM filters the global PTX flag; "
                             "PTX cannot JIT down to 7.5)")
        if not ARCH_RE.match(a):
            raise ValueError(f"{a!r} is not a CUDA arch like \"7.5\"")
    return v


def _platforms(v: tuple[str, ...]) -> tuple[str, ...]:
    if not v:
        raise ValueError("needs at least one platform")
    for p in v:
        if not PLATFORM_RE.match(p):
            raise ValueError(f"{p!r} is not a supported platform (linux/amd64 or linux/arm64)")
    return v


def _max_jobs(v: str | int) -> str:
    if (isinstance(v, int) and v < 1) or (isinstance(v, str) and v != "auto"):
        raise ValueError(f"{v!r} must be a positive number or \"auto\"")
    return str(v)


@functools.lru_cache(maxsize=None)
def compiled(expr: str):
    return _EXPR.compile_expression(expr, undefined_to_none=False)


def _expression(v: str) -> str:
    try:
        compiled(v)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{v!r} is not a Jinja expression ({e.message})") from None
    return v


def _regex(v: str) -> str:
    try:
        re.compile(v)
    except re.error as e:
        raise ValueError(f"{v!r} is not a regular expression ({e})") from None
    return v


Image = Annotated[StrictStr, AfterValidator(_image_ref)]
Pin = Annotated[StrictStr, _check(VERSION_RE.match, "{v!r} is not an exact version (a pin is X.Y.Z, no ranges)")]
Sha256 = Annotated[StrictStr, _check(SHA256_RE.match, "{v!r} is not a 64-hex sha256")]
Expr = Annotated[StrictStr, AfterValidator(_expression)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


# --- profiles -----------------------------------------------------------------------------------------------------

class Cuda(_Model):
    """NVIDIA's CUDA 13 wheels (cuda-toolkit==pip_toolkit on the index): the toolkit of the compile stages and the
    libraries torch runs on, on every CUDA profile; devel_image takes the compile toolkit from NVIDIA's image instead."""
    version: Annotated[StrictStr, _check(re.compile(r"^\d+\.\d+$").match, "{v!r} must be MAJOR.MINOR, e.g. \"13.0\"")]
    archs: Annotated[tuple[StrictStr, ...], AfterValidator(_archs)]
    pip_toolkit: Annotated[StrictStr, _check(VERSION_RE.match, "{v!r} is not an exact version of cuda-toolkit")]
    devel_image: Image | None = None  # an nvidia/cuda …-devel image: its /usr/local/cuda, not the wheels' nvcc
    cuobjdump: Pin  # nvidia-cuda-cuobjdump==X: lists the SASS of torch's and vLLM's libraries at build time
    constraints: dict[StrictStr, Pin] = {}  # toolkit parts held at pip_toolkit's own versions in every later pip install
    # (torch-base's PIP_CONSTRAINT): a package that asks for nvcc or cccl unpinned gets the toolkit's, not the newest


class Build(_Model):
    max_jobs: Annotated[StrictStr | StrictInt, AfterValidator(_max_jobs)] = "auto"
    nvcc_threads: Annotated[StrictInt, _check(lambda n: n >= 1, "must be at least 1")] = 1
    rust_frontend: StrictBool = True  # vLLM's Rust frontend (vllm-rs) needs the crates registry at build time
    flagset_check: StrictBool = True  # torch's compile starts only after one translation unit of every flag set
    # of its configure built with our flags (dockerfiles/check-flagsets.py): a refused flag fails in minutes
    vllm_sources: Annotated[StrictStr, AfterValidator(_in_repo)] | None = None  # local tree of vLLM's external
    # projects (tools/vllm_sources.py), not GitHub


class Profile(_Model):
    name: StrictStr
    description: StrictStr
    platforms: Annotated[tuple[StrictStr, ...], AfterValidator(_platforms)]
    registry: Annotated[StrictStr, _check(lambda r: IMAGE_RE.match(r) and not r.endswith("/"),
                                          "{v!r} is not a registry/namespace like ghcr.io/me")]
    python: StrictStr
    dtype: StrictStr
    cuda: Cuda | None = None
    cpu_flags: StrictStr | None = None  # host code's compiler flags (-mcpu= on arm64, -march= on x86)
    base_image: Image | None = None
    wheels: Annotated[StrictStr, AfterValidator(_in_repo)] | None = None
    build: Build = Build()
    tag_suffix: StrictStr | None = None  # appended to the image tags: "" for the flagship profile, "-<name>" by default
    _file: str = PrivateAttr("")

    @property
    def source(self) -> str:
        return self._file

    @property
    def suffix(self) -> str:
        return f"-{self.name}" if self.tag_suffix is None else self.tag_suffix


# --- runtimes -----------------------------------------------------------------------------------------------------

class From(_Model):
    """What an image is built FROM: another runtime's image (bake links the targets) or an image (an expression)."""
    runtime: StrictStr | None = None
    image: Expr | None = None


class When(_Model):
    """A value used only when `if` is true, e.g. {value: pins.rust, if: profile.build.rust_frontend}; a plain
    expression is used always."""
    value: Expr
    if_: Expr = Field(alias="if")


class Copy(_Model):
    path: StrictStr
    if_: Expr = Field(alias="if")


def _always(key: str) -> BeforeValidator:
    return BeforeValidator(lambda v: v if isinstance(v, dict) else {key: v, "if": "true"})


Value = Annotated[When, _always("value")]


class Source(_Model):
    """How an image is built: FROM, build args (exactly the ARGs its Dockerfile declares), named contexts that are local
    directories, the build context itself when it is not the image's own directory, and extra upstream pins."""
    from_: From | None = Field(None, alias="from")
    args: dict[StrictStr, Value] = {}
    contexts: dict[StrictStr, Value] = {}
    context: Expr | None = None
    upstream: dict[StrictStr, Expr] = {}


class Patch(_Model):
    path: StrictStr
    sha256: Sha256


class Smoke(_Model):
    prompt: StrictStr
    expect: Annotated[StrictStr, AfterValidator(_regex)]


class Local(_Model):
    """`build.py serve --runtime R`: run the image's server (`python -m serving`) on this host."""
    packages: tuple[StrictStr, ...]  # what it imports: checked before it starts, so a missing one is one clear line
    extras: tuple[StrictStr, ...]  # the pyproject.toml extras that install them (the hint of that line)


class Serve(_Model):
    """How the image's server takes its model: flag (`python -m serving --model DIR`) or positional
    (`vllm serve DIR`); `local`: `build.py serve` can run it here."""
    model_arg: Literal["flag", "positional"] = "flag"
    local: Local | None = None
    text_only: bool = False  # serves the text model only: the vision/audio towers are never loaded (build.py fits)


class ProfileSection(_Model):
    pins: dict[StrictStr, Pin] = {}
    source: StrictStr | None = None


class ArgsFrom(_Model):
    source: StrictStr  # one of the runtime's `sources`
    if_: Expr = Field("true", alias="if")


class Rehearse(_Model):
    """`build.py --rehearse` (docs/g5g-chain.md, "Rehearsing the g5g chain"): every stage for real, the long compile
    cut to its configure and a sample of objects. What a runtime's rehearsal changes is data: manifest overrides (as
    --set, applied before the user's), the sampled objects, build args only a rehearsal has."""
    why: StrictStr  # what the rehearsal cuts or stands in, and why: in the plan and the io.g5g.rehearsal label
    set: dict[StrictStr, Any] = {}  # DOC.KEY: value, as `--set DOC.KEY=VALUE` (DOC: profile or a runtime)
    objects: tuple[StrictStr, ...] = ()  # build-system targets compiled instead of everything (ninja's names)
    args: dict[StrictStr, Value] = {}  # build args only a rehearsal has (the template declares them under `rehearse`)
    args_from: ArgsFrom | None = None  # and those of another source (e.g. `build`'s, for a stage the rehearsal keeps)


class Runtime(Source):
    runtime: StrictStr
    description: StrictStr
    order: StrictInt  # images are planned (and listed) in this order; an image comes after what it is built FROM
    version_pin: StrictStr  # the pin that versions the image's tags
    pins: dict[StrictStr, Pin]
    min_pins: dict[StrictStr, Pin] = {}  # floors, e.g. vllm >= 0.28.0 for Gemma 4
    profiles: dict[StrictStr, ProfileSection] = {}  # per-profile pins and source
    needs_cuda: StrictBool = False
    cache_mode: Literal["min", "max"] = "max"  # registry cache export: max keeps every stage; min only the image (a
    # build stage too large to export, e.g. PyTorch's build tree)
    source: StrictStr | None = None  # which of `sources` (instead of from/args/contexts at the top level)
    sources: dict[StrictStr, Source] = {}
    image: Image | None = None
    sdist_sha256: Sha256 | None = None
    patches: tuple[Patch, ...] = ()  # copied into the build context's patches/; before a build, each must
    # `git apply` to the package index's sdist of the version pin (checked against sdist_sha256)
    copy_: tuple[Annotated[Copy, _always("path")], ...] = Field((), alias="copy")  # repository paths copied into
    # the build context
    requirements: StrictStr | None = None  # a pyproject.toml extra the image installs (template: `requirements`)
    env: dict[Annotated[StrictStr, _check(ENV_RE.match, "{v!r} is not an environment variable name")], Value] = {}
    # the image's ENV at run time, e.g. NVIDIA_REQUIRE_CUDA (the container runtime refuses an older driver)
    serve_args: tuple[StrictStr, ...] = ()
    serve: Serve = Serve()
    port: Annotated[StrictInt, _check(lambda p: 1 <= p <= 65535, "{v} is not a TCP port")] = 8000
    smoke: Smoke | None = None
    rehearse: Rehearse | None = None  # build.py --rehearse; without it the image builds as always
    _file: str = PrivateAttr("")

    @property
    def name(self) -> str:
        return self.runtime

    @property
    def file(self) -> str:
        return self._file

    def pins_for(self, profile: str) -> dict[str, str]:
        return {**self.pins, **(self.profiles[profile].pins if profile in self.profiles else {})}

    def source_for(self, profile: str) -> str | None:
        section = self.profiles.get(profile)
        return (section and section.source) or self.source

    def build_for(self, profile: str) -> tuple[str, Source]:
        """(key prefix for errors, the source) of this runtime's image for `profile`."""
        src = self.source_for(profile)
        return (f"sources.{src}.", self.sources[src]) if src else ("", self)


# --- errors: one line naming the file and the key -------------------------------------------------------------------

def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _allowed(model: type, loc: tuple) -> list[str]:
    """The keys the model at `loc` takes (for "unknown key" errors)."""
    for part in loc:
        if isinstance(part, int) or not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        if field is None:  # a key of a dict field: the model of its values
            continue
        model = _model_in(field.annotation)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    return sorted(f.alias or n for n, f in model.model_fields.items())


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for a in get_args(annotation):
        if (m := _model_in(a)) is not None:
            return m
    return None


def validate(model: type[BaseModel], file: str, data: Any) -> Any:
    if not isinstance(data, dict):
        raise UserError(f"{file}: (top level): expected a mapping, got {type(data).__name__}")
    try:
        obj = model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        err = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])  # a typo: say it, not "missing"
        loc, kind, value = err["loc"], err["type"], err.get("input")
        # a union reports each branch: keep the path, drop the branch names pydantic adds ("str", "int")
        loc = tuple(p for p in loc if p not in ("str", "int", "[key]") and not str(p).startswith("function-"))
        where = _where(loc) or "(top level)"
        if kind == "missing":
            msg = "missing (required)"
        elif kind == "extra_forbidden":
            msg = f"unknown key (allowed: {', '.join(_allowed(model, loc[:-1]))})"
        elif kind == "string_type" and isinstance(value, (int, float)) and not isinstance(value, bool):
            msg = f"must be a quoted string, got {value!r} (YAML reads it as a number)"
        elif kind == "literal_error":
            msg = f"{value!r} must be one of {err['ctx']['expected']}"
        elif kind.endswith("_type"):
            want = {"dict": "a mapping", "model": "a mapping", "tuple": "a list", "string": "a string",
                    "int": "a number", "bool": "true or false"}.get(kind.removesuffix("_type"), kind)
            msg = f"must be {want}, got {type(value).__name__} {value!r}"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        raise UserError(f"{file}: {where}: {msg}") from None
    obj._file = file
    return obj
