"""Manifests: a directory of target profiles and runtimes in YAML, loaded and validated strictly before anything runs.

`load(manifest_dir) -> Manifests`. Every error is a UserError naming the file and the key, e.g.
`manifests/runtimes/vllm.yaml: pins.vllm: 0.27.1 is below the Gemma 4 floor 0.28.0`. What each file may say is
g5g/schema.py; the rules across files (an image built FROM another runtime, every source resolves) are here.
Pure: reads files, touches no docker, no network (a listed patch's sha256 is checked separately, `check_patch_digests`).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from g5g.errors import UserError
from g5g.resolve import RuntimeBuild, base_of, build, usable
from g5g.schema import Profile, Runtime, validate


@dataclass(frozen=True)
class Manifests:
    root: Path
    profiles: dict[str, Profile]
    runtimes: dict[str, Runtime]  # in build order



def _profile(file: str, data: Any) -> Profile:
    p = validate(Profile, file, data)
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
    rt = validate(Runtime, file, data)
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
    builds: dict[str, dict[str, RuntimeBuild]] = {p: {} for p in m.profiles}
    for rt in m.runtimes.values():
        for prof in m.profiles.values():
            if not usable(m.runtimes, rt, prof):
                continue
            base = base_of(m.runtimes, rt, prof.name)
            if base is not None:
                pin, want = base.version_pin, base.pins_for(prof.name)[base.version_pin]
                got = rt.pins_for(prof.name).get(pin)
                over = prof.name in rt.profiles and pin in rt.profiles[prof.name].pins
                key = f"profiles.{prof.name}.pins.{pin}" if over else f"pins.{pin}"
                if got is None:
                    raise UserError(f"{rt.file}: {key}: missing pin {pin!r} (the {base.name} image it is built FROM "
                                    f"has {pin} {want})")
                if got != want:
                    raise UserError(f"{rt.file}: {key}: {got} differs from {base.name}'s {pin} {want} "
                                    f"for profile {prof.name} ({base.file})")
            done = builds[prof.name]  # every expression evaluates (FROM a runtime: its tag is not known here)
            done[rt.name] = build(rt, prof, done[base.name] if base else None, lambda name, version: "",
                                  rehearse=True)


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
