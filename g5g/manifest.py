"""Manifests: target profiles and runtimes in YAML, validated strictly (pydantic models) before anything runs.

`load(manifest_dir) -> Manifests`. Every error is a UserError naming the file and the key, e.g.
`manifests/runtimes/vllm.yaml: pins.vllm: 0.27.1 is below the Gemma 4 floor 0.28.0`.
The profiles are the files in profiles/, the runtimes the files in runtimes/. A runtime says how its image is built
(`Runtime.resolve`): FROM another runtime or an image, build args, contexts — Jinja expressions over the profile,
the pins and the runtime itself, so a new runtime is a manifest and a template, no code.
Pure: reads files, touches no docker, no network (a listed patch's sha256 is checked separately, `check_patch_digests`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import jinja2
import yaml
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
def _compiled(expr: str):
    return _EXPR.compile_expression(expr, undefined_to_none=False)


def _expression(v: str) -> str:
    try:
        _compiled(v)
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


class Build(_Model):
    max_jobs: Annotated[StrictStr | StrictInt, AfterValidator(_max_jobs)] = "auto"
    nvcc_threads: Annotated[StrictInt, _check(lambda n: n >= 1, "must be at least 1")] = 1
    rust_frontend: StrictBool = True  # vLLM's Rust frontend (vllm-rs) needs the crates registry at build time
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
    cpu_baseline: StrictStr | None = None
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
    """`build.py --rehearse` (docs/g5g-chain.md, "Rehearsing the g5g chain"): every stage for real, the long compile cut to its
    configure and a sample of objects. What a runtime's rehearsal changes is data: manifest overrides (as --set,
    applied before the user's), the sampled objects, build args only a rehearsal has."""
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

    def resolve(self, profile: Profile, base: str | None, rehearse: bool = False) -> Resolved:
        """Evaluate the expressions of the profile's source. base: the tag of the runtime it is built FROM.
        rehearse: add the build args of the runtime's `rehearse` section."""
        prefix, src = self.build_for(profile.name)
        ns = {"profile": profile, "pins": self.pins_for(profile.name), "runtime": self}

        def value(key: str, v: When) -> str | None:   # key: where the expression is, for errors
            if not self._eval(f"{key}.if", v.if_, ns, profile.name, test=True):
                return None
            return self._eval(key, v.value, ns, profile.name)

        src_name = self.source_for(profile.name) or ""
        from_image = base if src.from_.runtime else self._eval(f"{prefix}from.image", src.from_.image, ns,
                                                                profile.name, hint=src_name)
        ns["base"] = from_image
        args = {k: v for k, e in src.args.items() if (v := value(f"{prefix}args.{k}", e)) is not None}
        if rehearse and self.rehearse:
            if (af := self.rehearse.args_from) and self._eval("rehearse.args_from.if", af.if_, ns, profile.name,
                                                              test=True):
                if af.source not in self.sources:
                    raise UserError(f"{self.file}: rehearse.args_from.source: {af.source} is not one of sources "
                                    f"({', '.join(sorted(self.sources))})")
                args |= {k: v for k, e in self.sources[af.source].args.items()
                         if (v := value(f"sources.{af.source}.args.{k}", e)) is not None}
            args |= {k: v for k, e in self.rehearse.args.items() if (v := value(f"rehearse.args.{k}", e)) is not None}
        # A pin that only unused args read (rust with the Rust frontend off; torch-base's CUDA wheels for a source
        # other than `build`) is not in the image: no label claims it. Pins no arg reads (e.g. transformers) stay.
        def read(exprs) -> set[str]:
            return {p for e in exprs for p in self.pins if re.search(rf"pins(\.{p}\b|\[['\"]{p}['\"]\])", e)}
        every = [e.value for s in (self, *self.sources.values()) for e in (*s.args.values(), *s.contexts.values())]
        unused = read(every) - read([e.value for k, e in src.args.items() if k in args]
                                    + [e.value for e in src.contexts.values()] + list(src.upstream.values()))
        contexts = {k: v for k, e in src.contexts.items() if (v := value(f"{prefix}contexts.{k}", e)) is not None}
        context = src.context and self._eval(f"{prefix}context", src.context, ns, profile.name)
        upstream = {k: self._eval(f"{prefix}upstream.{k}", e, ns, profile.name) for k, e in src.upstream.items()}
        copy = tuple(c.path for c in self.copy_ if self._eval("copy.if", c.if_, ns, profile.name, test=True))
        return Resolved(source=src_name, from_image=from_image, args=args, contexts=contexts, context=context,
                        context_expr=src.context, upstream=upstream, copy=copy, unused_pins=tuple(sorted(unused)))

    def _eval(self, key: str, expr: str, ns: dict, profile: str, test: bool = False, hint: str = "") -> Any:
        """One expression's value as a string (lists joined with spaces), or its truth for test; none or undefined
        is an error naming the file and the key."""
        why = ""
        try:
            v = _compiled(expr)(**ns)
            if test:
                return bool(v)
        except jinja2.UndefinedError as e:
            v, why = None, f" ({e.message})"
        except jinja2.TemplateError as e:
            raise UserError(f"{self.file}: {key}: {expr}: {e}") from None
        if v is None or isinstance(v, jinja2.Undefined):
            hint = f", source: {hint}" if hint else ""
            raise UserError(f"{self.file}: {key}: {expr} is not set for profile {profile}{hint}{why}")
        return " ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


@dataclass(frozen=True)
class Resolved:
    source: str
    from_image: str
    args: dict[str, str]
    contexts: dict[str, str]
    context: str | None
    context_expr: str | None
    upstream: dict[str, str]
    copy: tuple[str, ...]
    unused_pins: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifests:
    root: Path
    profiles: dict[str, Profile]
    runtimes: dict[str, Runtime]  # in build order

    def base(self, rt: Runtime, profile: str) -> Runtime | None:
        """The runtime whose image `rt`'s image is built FROM for `profile` (None: FROM an image)."""
        name = rt.build_for(profile)[1].from_.runtime
        return name and self.runtimes.get(name)

    def usable(self, rt: Runtime, profile: Profile) -> bool:
        """Whether the profile builds it: a runtime that needs CUDA (or is built FROM one that does) needs a cuda."""
        base = self.base(rt, profile.name)
        return (profile.cuda is not None or not rt.needs_cuda) and (base is None or self.usable(base, profile))


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


def _validate(model: type[BaseModel], file: str, data: Any) -> Any:
    if not isinstance(data, dict):
        raise UserError(f"{file}: (top level): expected a mapping, got {type(data).__name__}")
    try:
        obj = model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        err = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])  # a typo: say it, not "missing"
        loc, kind, value = err["loc"], err["type"], err.get("input")
        # a union reports each branch: keep the path, drop the branch names pydantic adds ("str", "int")
        loc = tuple(p for p in loc if p not in ("str", "int") and not str(p).startswith("function-"))
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


def _profile(file: str, data: Any) -> Profile:
    p = _validate(Profile, file, data)
    if p.name != Path(file).stem:
        raise UserError(f"{file}: name: {p.name!r} does not match the file name {Path(file).stem!r}")
    if p.base_image is None:
        raise UserError(f"{file}: base_image: missing: every image starts from it (Debian or Ubuntu with python3; "
                        "a CUDA profile installs NVIDIA's wheels on it)")
    # nvcc's --threads compiles a file's archs in parallel: with one arch it has nothing to split, and vLLM's setup.py
    # still divides MAX_JOBS by it (NVCC_THREADS=2 halved the jobs).
    if p.cuda is not None and len(p.cuda.archs) == 1 and p.build.nvcc_threads > 1:
        raise UserError(f"{file}: build.nvcc_threads: {p.build.nvcc_threads} with one CUDA arch ({p.cuda.archs[0]}) "
                        "only divides the compile jobs (nvcc's --threads splits the archs of a file): use 1")
    return p


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def _runtime(file: str, data: Any, profiles: list[str]) -> Runtime:
    rt = _validate(Runtime, file, data)
    if rt.runtime != Path(file).stem:
        raise UserError(f"{file}: runtime: {rt.runtime!r} does not match the file name {Path(file).stem!r}")
    if rt.version_pin not in rt.pins:
        raise UserError(f"{file}: version_pin: {rt.version_pin!r} is not one of the pins ({', '.join(rt.pins)})")
    for prof, section in rt.profiles.items():
        if prof not in profiles:
            raise UserError(f"{file}: profiles.{prof}: unknown profile (known: {', '.join(profiles)})")
        for p in section.pins:
            if p not in rt.pins:
                raise UserError(f"{file}: profiles.{prof}.pins.{p}: overrides a pin the runtime does not have "
                                f"({', '.join(rt.pins)})")
    for pin, floor in rt.min_pins.items():
        for prof, pins in [("", rt.pins), *((p, s.pins) for p, s in rt.profiles.items())]:
            if pin in pins and _version_tuple(pins[pin]) < _version_tuple(floor):
                key = f"profiles.{prof}.pins.{pin}" if prof else f"pins.{pin}"
                raise UserError(f"{file}: {key}: {pins[pin]} is below the Gemma 4 floor {floor}")
    for key, src in [("source", rt.source), *((f"profiles.{p}.source", s.source) for p, s in rt.profiles.items())]:
        if src is not None and src not in rt.sources:
            raise UserError(f"{file}: {key}: {src!r} must be one of {', '.join(rt.sources) or '(no sources)'}")
    if rt.sources and rt.source is None:
        raise UserError(f"{file}: source: missing (required with sources: one of {', '.join(rt.sources)})")
    for prefix, src in [("", rt)] + [(f"sources.{n}.", s) for n, s in rt.sources.items()]:
        if rt.sources and prefix == "":
            if src.from_ or src.args or src.contexts or src.context or src.upstream:
                raise UserError(f"{file}: from: with sources, each source says how the image is built")
            continue
        f = src.from_
        if f is None or (f.runtime is None) == (f.image is None):
            raise UserError(f"{file}: {prefix}from: needs runtime (another runtime's image) or image, one of them")
    for field in ("image", "sdist_sha256"):  # values only some runtimes' expressions read
        if getattr(rt, field) is not None and f"runtime.{field}" not in yaml.safe_dump(data):
            raise UserError(f"{file}: {field}: {rt.runtime} does not use it (no expression reads runtime.{field})")
    for i, p in enumerate(rt.patches):
        if not re.match(rf"^patches/{re.escape(rt.runtime)}/{re.escape(rt.pins[rt.version_pin])}/[\w.-]+\.patch$",
                        p.path):
            raise UserError(f"{file}: patches[{i}].path: {p.path!r} must live under "
                            f"patches/{rt.runtime}/{rt.pins[rt.version_pin]}/ and end in .patch")
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


def names(manifest_dir: str | Path, kind: str) -> list[str]:
    """The profiles or runtimes a manifest directory holds: its profiles/*.yaml or runtimes/*.yaml, by file name."""
    return sorted(p.stem for p in (Path(manifest_dir) / kind).glob("*.yaml"))


def load(manifest_dir: str | Path, profile: str | None = None, overrides: list[str] | None = None,
         rehearse: bool = False) -> Manifests:
    """Load and validate every manifest (or only `profile` among the profiles); raise UserError on the first problem.

    overrides: `DOC.KEY=VALUE` strings applied before validation; DOC is `profile` (the chosen profile) or a runtime.
    rehearse: apply the runtimes' rehearse.set overrides first (build.py --rehearse); `overrides` still win.
    """
    if rehearse:
        first = rehearsal_overrides(load(manifest_dir, profile, overrides))
        return load(manifest_dir, profile, first + list(overrides or []))
    root = Path(manifest_dir)
    if not root.is_dir():
        raise UserError(f"{root}: manifest directory not found")

    def shown(p: Path) -> str:
        return f"{root.name}/{p.relative_to(root)}"

    known = names(root, "profiles")
    runtime_names = names(root, "runtimes")
    for kind, found in (("profiles", known), ("runtimes", runtime_names)):
        if not found:
            raise UserError(f"{shown(root / kind)}: no *.yaml manifests")
    raw: dict[str, Any] = {}
    files: dict[str, str] = {}
    for n in [profile] if profile else known:
        p = root / "profiles" / f"{n}.yaml"
        if profile and not p.exists():
            raise UserError(f"--profile {n}: no {shown(p)} (known: {', '.join(known)})")
        raw[f"profile:{n}"], files[f"profile:{n}"] = _read_yaml(p, shown(p)), shown(p)
    for n in runtime_names:
        p = root / "runtimes" / f"{n}.yaml"
        raw[n], files[n] = _read_yaml(p, shown(p)), shown(p)
    if overrides:
        if profile:
            raw["profile"], files["profile"] = raw.pop(f"profile:{profile}"), files.pop(f"profile:{profile}")
        _apply_overrides(raw, overrides, files)
        if profile:
            raw[f"profile:{profile}"], files[f"profile:{profile}"] = raw.pop("profile"), files.pop("profile")
    profiles = {k.split(":", 1)[1]: _profile(files[k], raw[k]) for k in raw if k.startswith("profile:")}
    runtimes = [_runtime(files[n], raw[n], known) for n in runtime_names]
    runtimes.sort(key=lambda r: (r.order, r.name))
    m = Manifests(root=root, profiles=profiles, runtimes={r.name: r for r in runtimes})
    _check_consistency(m)
    return m


def _check_consistency(m: Manifests) -> None:
    """Cross-file rules: an image built FROM another runtime comes after it and pins its version pin (the torch every
    image runs on is the torch-base one); every source of every loaded profile resolves."""
    for rt in m.runtimes.values():
        for prefix, src in [("", rt)] + [(f"sources.{n}.", s) for n, s in rt.sources.items()]:
            base_name = src.from_ and src.from_.runtime
            base = m.runtimes.get(base_name or "")
            if base_name and (base is None or base.order >= rt.order):  # so no image is built FROM itself
                why = "is not a runtime" if base is None else f"must come first (its order is {base.order})"
                raise UserError(f"{rt.file}: {prefix}from.runtime: {base_name!r} {why} "
                                f"(runtimes: {', '.join(m.runtimes)})")
    for rt in m.runtimes.values():
        for prof in m.profiles.values():
            if not m.usable(rt, prof):
                continue
            base = m.base(rt, prof.name)
            if base is not None:
                base_name = base.name
                pin, want = base.version_pin, base.pins_for(prof.name)[base.version_pin]
                got = rt.pins_for(prof.name).get(pin)
                over = prof.name in rt.profiles and pin in rt.profiles[prof.name].pins
                key = f"profiles.{prof.name}.pins.{pin}" if over else f"pins.{pin}"
                if got is None:
                    raise UserError(f"{rt.file}: {key}: missing pin {pin!r} (the {base_name} image it is built FROM "
                                    f"has {pin} {want})")
                if got != want:
                    raise UserError(f"{rt.file}: {key}: {got} differs from {base_name}'s {pin} {want} "
                                    f"for profile {prof.name} ({base.file})")
            rt.resolve(prof, base="" if base else None, rehearse=True)


def rehearsal_overrides(m: Manifests) -> list[str]:
    """What `build.py --rehearse` sets before the user's --set: every runtime's rehearse.set, as DOC.KEY=VALUE."""
    return [f"{k}={json.dumps(v)}" for rt in m.runtimes.values() if rt.rehearse for k, v in rt.rehearse.set.items()]


def check_patch_digests(manifests: Manifests, repo_root: str | Path) -> None:
    """Each listed patch exists under repo_root and has the sha256 the manifest pins (file + key on failure)."""
    for rt in manifests.runtimes.values():
        for i, p in enumerate(rt.patches):
            path = Path(repo_root) / p.path
            if not path.is_file():
                raise UserError(f"{rt.file}: patches[{i}].path: {p.path} does not exist")
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest != p.sha256:
                raise UserError(f"{rt.file}: patches[{i}].sha256: {p.path} has sha256 {digest}, "
                                f"manifest says {p.sha256}")
