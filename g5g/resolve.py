"""A runtime's image for one profile, resolved once into plain data (`resolve`): what it is built FROM, its build
args, contexts, upstream versions and copied paths — the runtime manifest's Jinja expressions evaluated over the
profile, the pins, the runtime and `base` (the image it is built FROM) — and what the manifest says of the image
as it is. The planner (g5g/plan.py) reads only this; no expression is evaluated while planning.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import jinja2

from g5g.errors import UserError
from g5g.schema import Profile, Runtime, When, compiled


@dataclass(frozen=True)
class RuntimeBuild:
    name: str
    file: str                       # the runtime's manifest, for errors
    description: str
    version_pin: str                # the pin that versions the image's tags
    version: str                    # its value for the profile
    pins: dict[str, str]            # the runtime's pins for the profile
    depends_on: tuple[str, ...]     # the runtimes it is built FROM, nearest last
    source: str                     # which of the runtime's sources ("": its top level)
    from_image: str
    args: dict[str, str]
    env: dict[str, str]             # the image's ENV (the manifest's `env`, those whose `if` holds)
    contexts: dict[str, str]
    context: str | None             # the build context when it is not the image's own directory
    context_origin: str             # "FILE: KEY" the context comes from, for errors
    upstream: dict[str, str]        # extra upstream versions the source declares
    copy: tuple[str, ...]
    unused_pins: tuple[str, ...]    # pins only unused args read: not in the image
    patches: tuple[dict[str, str], ...]   # {path, sha256}
    sdist_sha256: str | None
    requirements: str | None        # the pyproject.toml extra the image installs
    serve_args: tuple[str, ...]
    model_arg: str
    port: int
    cache_mode: str
    rehearse_why: str | None        # the runtime's rehearse section (None: it has none)
    rehearse_objects: tuple[str, ...]


def base_of(runtimes: dict[str, Runtime], rt: Runtime, profile: str) -> Runtime | None:
    """The runtime whose image `rt`'s image is built FROM for `profile` (None: FROM an image)."""
    name = rt.build_for(profile)[1].from_.runtime
    return name and runtimes.get(name)


def usable(runtimes: dict[str, Runtime], rt: Runtime, profile: Profile) -> bool:
    """Whether the profile builds it: a runtime that needs CUDA (or is built FROM one that does) needs a cuda."""
    base = base_of(runtimes, rt, profile.name)
    return (profile.cuda is not None or not rt.needs_cuda) and (base is None or usable(runtimes, base, profile))


def resolve(runtimes: dict[str, Runtime], profile: Profile, tag: Callable[[str, str], str],
            rehearse: bool = False) -> dict[str, RuntimeBuild]:
    """Every runtime the profile builds, in build order (`runtimes` is). tag(runtime, version): the image reference
    `base` names for an image built FROM that runtime's. rehearse: add the runtimes' rehearse.args."""
    out: dict[str, RuntimeBuild] = {}
    for name, rt in runtimes.items():
        if usable(runtimes, rt, profile):
            base = base_of(runtimes, rt, profile.name)
            out[name] = build(rt, profile, out[base.name] if base else None, tag, rehearse)
    return out


def build(rt: Runtime, profile: Profile, base: RuntimeBuild | None, tag: Callable[[str, str], str],
          rehearse: bool = False) -> RuntimeBuild:
    """One runtime's image; base: the build of the runtime it is built FROM (resolved first)."""
    prefix, src = rt.build_for(profile.name)
    pins = rt.pins_for(profile.name)
    ns = {"profile": profile, "pins": pins, "runtime": rt}

    def value(key: str, v: When) -> str | None:   # key: where the expression is, for errors
        if not _eval(rt, f"{key}.if", v.if_, ns, profile.name, test=True):
            return None
        return _eval(rt, key, v.value, ns, profile.name)

    src_name = rt.source_for(profile.name) or ""
    if src.from_.runtime:
        from_image = tag(base.name, base.version) if base else None
    else:
        from_image = _eval(rt, f"{prefix}from.image", src.from_.image, ns, profile.name, hint=src_name)
    ns["base"] = from_image
    args = {k: v for k, e in src.args.items() if (v := value(f"{prefix}args.{k}", e)) is not None}
    if rehearse and rt.rehearse:
        if (af := rt.rehearse.args_from) and _eval(rt, "rehearse.args_from.if", af.if_, ns, profile.name, test=True):
            if af.source not in rt.sources:
                raise UserError(f"{rt.file}: rehearse.args_from.source: {af.source} is not one of sources "
                                f"({', '.join(sorted(rt.sources))})")
            args |= {k: v for k, e in rt.sources[af.source].args.items()
                     if (v := value(f"sources.{af.source}.args.{k}", e)) is not None}
        args |= {k: v for k, e in rt.rehearse.args.items() if (v := value(f"rehearse.args.{k}", e)) is not None}
    # A pin that only unused args read (rust with the Rust frontend off; torch-base's CUDA wheels for a source
    # other than `build`) is not in the image: no label claims it. Pins no arg reads (e.g. transformers) stay.
    def read(exprs) -> set[str]:
        return {p for e in exprs for p in rt.pins if re.search(rf"pins(\.{p}\b|\[['\"]{p}['\"]\])", e)}
    every = [e.value for s in (rt, *rt.sources.values()) for e in (*s.args.values(), *s.contexts.values())]
    unused = read(every) - read([e.value for k, e in src.args.items() if k in args]
                                + [e.value for e in src.contexts.values()] + list(src.upstream.values()))
    contexts = {k: v for k, e in src.contexts.items() if (v := value(f"{prefix}contexts.{k}", e)) is not None}
    context = src.context and _eval(rt, f"{prefix}context", src.context, ns, profile.name)
    origin = src.context or ""
    origin = (f"{profile.source}: {origin.removeprefix('profile.')}" if re.match(r"^profile\.[\w.]+$", origin)
              else f"{rt.file}: context")
    return RuntimeBuild(
        name=rt.name, file=rt.file, description=rt.description, version_pin=rt.version_pin,
        version=pins[rt.version_pin], pins=pins, depends_on=(*base.depends_on, base.name) if base else (),
        source=src_name, from_image=from_image, args=args,
        env={k: v for k, e in rt.env.items() if (v := value(f"env.{k}", e)) is not None}, contexts=contexts, context=context, context_origin=origin,
        upstream={k: _eval(rt, f"{prefix}upstream.{k}", e, ns, profile.name) for k, e in src.upstream.items()},
        copy=tuple(c.path for c in rt.copy_ if _eval(rt, "copy.if", c.if_, ns, profile.name, test=True)),
        unused_pins=tuple(sorted(unused)), patches=tuple({"path": p.path, "sha256": p.sha256} for p in rt.patches),
        sdist_sha256=rt.sdist_sha256, requirements=rt.requirements, serve_args=tuple(rt.serve_args),
        model_arg=rt.serve.model_arg, port=rt.port, cache_mode=rt.cache_mode,
        rehearse_why=rt.rehearse.why if rt.rehearse else None,
        rehearse_objects=tuple(rt.rehearse.objects) if rt.rehearse else ())


def _eval(rt: Runtime, key: str, expr: str, ns: dict, profile: str, test: bool = False, hint: str = "") -> Any:
    """One expression's value as a string (lists joined with spaces), or its truth for test; none or undefined
    is an error naming the file and the key."""
    why = ""
    try:
        v = compiled(expr)(**ns)
        if test:
            return bool(v)
    except jinja2.UndefinedError as e:
        v, why = None, f" ({e.message})"
    except jinja2.TemplateError as e:
        raise UserError(f"{rt.file}: {key}: {expr}: {e}") from None
    if v is None or isinstance(v, jinja2.Undefined):
        hint = f", source: {hint}" if hint else ""
        raise UserError(f"{rt.file}: {key}: {expr} is not set for profile {profile}{hint}{why}")
    return " ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
