"""CUDA arch lists as images carry them: parse, normalise to "7.5", and decide whether a GPU is covered.

Pure: strings in, data out. Spellings seen in the wild: `7.5 8.0+PTX` (torch), `7.5;8.0` (CMake-ish),
`sm_75`/`compute_75` (torch.cuda.get_arch_list()), `75-real`/`80-virtual` (CMAKE_CUDA_ARCHITECTURES),
`9.0a` (arch-specific), and torch's names (`Turing`, `Ampere`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# Where arch lists live in image configs, in the order we trust them. The dialect says what a bare
# number means: torch ("7.5" = machine code only) or cmake ("75" = machine code and PTX).
KNOWN_LABELS = {"io.g5g.cuda-archs": "torch"}  # ours, written by the planner; "" means "no CUDA"
KNOWN_ENV = {
    "TORCH_CUDA_ARCH_LIST": "torch",  # vllm/vllm-openai, NGC pytorch, most torch-extension images
    "CUDA_ARCH_LIST": "torch",
    "CMAKE_CUDA_ARCHITECTURES": "cmake",
    "CUDAARCHS": "cmake",  # CMake's environment default for CMAKE_CUDA_ARCHITECTURES
}

# TORCH_CUDA_ARCH_LIST names, as torch.utils.cpp_extension expands them.
NAMED = {
    "kepler+tesla": "3.7", "kepler": "3.5+PTX", "maxwell+tegra": "5.3", "maxwell": "5.0;5.2+PTX",
    "pascal": "6.0;6.1+PTX", "volta+tegra": "7.2", "volta": "7.0+PTX", "turing": "7.5+PTX",
    "ampere+tegra": "8.7", "ampere": "8.0;8.6+PTX", "ada": "8.9+PTX", "hopper": "9.0+PTX",
    "blackwell+tegra": "11.0", "blackwell": "10.0;10.3;12.0;12.1+PTX",
}

_TOKEN = re.compile(
    r"^(?P<prefix>sm_|compute_|sm|compute)?"
    r"(?:(?P<major>\d+)\.(?P<minor>\d)|(?P<packed>\d{2,3}))(?P<suffix>[af])?"
    r"(?P<tail>\+ptx|-real|-virtual)?$",
    re.IGNORECASE,
)


class ArchError(ValueError):
    """A string that is not a CUDA arch."""


@dataclass(frozen=True)
class ArchList:
    native: tuple[str, ...] = ()  # machine code (SASS) for these archs
    ptx: tuple[str, ...] = ()  # PTX for these archs, JIT-compiled by the driver on newer GPUs
    unparsed: tuple[str, ...] = ()  # tokens we could not read (e.g. CMake's "all")

    @property
    def empty(self) -> bool:
        return not self.native and not self.ptx


@dataclass(frozen=True)
class Coverage:
    covered: bool
    how: str | None  # e.g. "sm_75", "sm_70 (binary-compatible)", "PTX 7.0 (JIT)"; None when not covered


@dataclass(frozen=True)
class Found:
    archs: ArchList
    source: str  # "env:TORCH_CUDA_ARCH_LIST" or "label:io.g5g.cuda-archs"
    raw: str  # the value as the image carries it


def _split(cc: str) -> tuple[int, int, str]:
    m = re.fullmatch(r"(\d+)\.(\d)([af]?)", cc)
    assert m, cc
    return int(m[1]), int(m[2]), m[3]


def sort_key(cc: str) -> tuple[int, int, str]:
    return _split(cc)


def normalize(token: str, dialect: str = "torch") -> tuple[str, bool, bool]:
    """One token → ("7.5", native, ptx). Raises ArchError for anything that is not an arch."""
    m = _TOKEN.match(token.strip())
    if not m:
        raise ArchError(f"not a CUDA arch: {token!r}")
    if m["packed"]:
        major, minor = m["packed"][:-1], m["packed"][-1]
    else:
        major, minor = m["major"], m["minor"]
    cc = f"{int(major)}.{minor}{(m['suffix'] or '').lower()}"
    prefix = (m["prefix"] or "").lower().rstrip("_")
    tail = (m["tail"] or "").lower()
    if prefix == "compute":
        return cc, False, True
    if tail == "+ptx":
        return cc, True, True
    if tail == "-real":
        return cc, True, False
    if tail == "-virtual":
        return cc, False, True
    # A bare CMake architecture ("75") means real and virtual: SASS plus PTX.
    return cc, True, dialect == "cmake" and not prefix


def parse(value: str, dialect: str = "torch") -> ArchList:
    """Parse a whole list: separators are spaces, semicolons and commas."""
    native: set[str] = set()
    ptx: set[str] = set()
    unparsed: list[str] = []
    for token in re.split(r"[\s;,]+", value.strip()):
        if not token:
            continue
        if token.lower() in NAMED:
            sub = parse(NAMED[token.lower()])
            native.update(sub.native)
            ptx.update(sub.ptx)
            continue
        try:
            cc, has_native, has_ptx = normalize(token, dialect)
        except ArchError:
            unparsed.append(token)
            continue
        if has_native:
            native.add(cc)
        if has_ptx:
            ptx.add(cc)
    return ArchList(tuple(sorted(native, key=sort_key)), tuple(sorted(ptx, key=sort_key)), tuple(unparsed))


def target(arch: str) -> str:
    """Normalise a GPU's compute capability given by a user ("7.5", "75", "sm_75")."""
    try:
        cc, _, _ = normalize(arch)
    except ArchError:
        raise ArchError(f"--arch {arch!r} is not a CUDA compute capability (e.g. 7.5, sm_75)") from None
    if not re.fullmatch(r"\d+\.\d", cc):
        raise ArchError(f"--arch {arch!r}: a GPU has a plain compute capability such as 7.5, not {cc}")
    return cc


def coverage(archs: ArchList, arch: str) -> Coverage:
    """Does code built for `archs` run on a GPU of compute capability `arch`?

    CUDA's rules: SASS for X.y runs on X.z with z ≥ y (arch-specific "a"/"f" builds only on their own
    chip); PTX for X.y is JIT-compiled for any GPU ≥ X.y. PTX never runs on an older GPU: 8.0 PTX is no
    use on a 7.5 card, which is what upstream arm64 images ship.
    """
    t_major, t_minor, _ = _split(target(arch))
    for cc in archs.native:
        major, minor, suffix = _split(cc)
        if (major, minor) == (t_major, t_minor):
            return Coverage(True, f"sm_{major}{minor}{suffix}")
    for cc in archs.native:
        major, minor, suffix = _split(cc)
        if major == t_major and minor < t_minor and not suffix:
            return Coverage(True, f"sm_{major}{minor} (binary-compatible)")
    for cc in archs.ptx:
        major, minor, suffix = _split(cc)
        if (major, minor) <= (t_major, t_minor) and not suffix:
            return Coverage(True, f"PTX {cc} (JIT-compiled at first launch)")
    return Coverage(False, None)


def find(env: dict[str, str], labels: dict[str, str]) -> Found | None:
    """The arch list an image config carries, from the first known label or env variable that has one."""
    for key, dialect in KNOWN_LABELS.items():
        if key in labels:  # our label: an empty value is an answer ("built without CUDA")
            return Found(parse(labels[key], dialect), f"label:{key}", labels[key])
    for key, dialect in KNOWN_ENV.items():
        value = env.get(key, "").strip()
        if value:
            return Found(parse(value, dialect), f"env:{key}", value)
    return None


def env_dict(env: list[str] | None) -> dict[str, str]:
    """An OCI config's Env (["K=V", …]) as a dict; the last definition wins, as in the runtime."""
    out: dict[str, str] = {}
    for item in env or []:
        key, _, value = item.partition("=")
        out[key] = value
    return out
