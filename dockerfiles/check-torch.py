"""What torch-base built, read back: fails unless it agrees with the flags the manifest asks for. No GPU needed.

    python3 check-torch.py cmake-cache build/CMakeCache.txt USE_CUDA=1 USE_CUDNN=1 …   (torch-build, after the compile)
    python3 check-torch.py installed USE_CUDA=1 USE_CUDNN=1 …                          (torch-base, the installed torch)

cmake-cache: every flag must be in the configure's cache with that truth value (a flag the build did not pass
through, or an option torch's configure turned off, shows there). installed: the flags torch.__config__.show()
lists must agree, and what USE_CUDNN, USE_NCCL and USE_KINETO promise must be there: cuDNN compiled in, the NCCL
process group, and CUPTI linked for kineto (libcupti loaded with torch's libraries).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

TRUE = {"1", "ON", "YES", "TRUE", "Y"}


def wanted(flags: list[str]) -> dict[str, bool]:
    out = {}
    for f in flags:
        name, eq, value = f.partition("=")
        if not eq or not re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
            sys.exit(f"check-torch: {f!r}: expected NAME=VALUE (e.g. USE_CUDNN=1)")
        out[name] = value.upper() in TRUE
    return out


def cmake_cache(path: Path, want: dict[str, bool]) -> list[str]:
    try:
        text = path.read_text()
    except OSError as e:
        return [f"{path}: cannot read the configure's cache ({e.strerror})"]
    cache = dict(re.findall(r"^([A-Za-z0-9_]+):[A-Z]+=(.*)$", text, re.M))
    bad = []
    for name, on in want.items():
        if name not in cache:
            bad.append(f"{name}: not in {path} (the build did not pass it to CMake)")
        elif (cache[name].upper() in TRUE) != on:
            bad.append(f"{name}: {cache[name]} in {path}, the manifest asks for {'ON' if on else 'OFF'}")
    return bad


def loaded() -> set[str]:
    """The shared objects this process has mapped: after `import torch`, its libraries and their DT_NEEDED."""
    return {Path(ln.split()[-1]).name for ln in Path("/proc/self/maps").read_text().splitlines() if ".so" in ln}


def installed(want: dict[str, bool]) -> list[str]:
    import torch
    import torch.distributed

    show = torch.__config__.show()
    print(show)
    listed = dict(re.findall(r"\b(USE_[A-Z0-9_]+|BUILD_[A-Z0-9_]+)=([^,\s]+)", show))
    bad = [f"{n}: {listed[n]} in torch.__config__.show(), the manifest asks for {'ON' if on else 'OFF'}"
           for n, on in want.items() if n in listed and (listed[n].upper() in TRUE) != on]
    facts = {"USE_CUDA": ("CUDA compiled in (torch.version.cuda)", torch.version.cuda is not None),
             "USE_CUDNN": ("cuDNN compiled in (torch.backends.cudnn.is_available())",
                           torch.backends.cudnn.is_available()),
             "USE_NCCL": ("the NCCL process group (torch.distributed.is_nccl_available())",
                          torch.distributed.is_available() and torch.distributed.is_nccl_available())}
    if "USE_KINETO" in want:
        facts["USE_KINETO"] = ("kineto built with CUPTI (-DHAS_CUPTI, libcupti loaded with torch)",
                               "-DHAS_CUPTI" in show and any(d.startswith("libcupti.so") for d in loaded()))
    for name, (what, present) in facts.items():
        if name in want and want[name] != present:
            bad.append(f"{name}={'1' if want[name] else '0'}: {what} is {present}")
        elif name in want:
            print(f"check-torch: {name}={'1' if want[name] else '0'}: {what}: {present}")
    return bad


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("cmake-cache", "installed") or (argv[0] == "cmake-cache" and len(argv) < 3):
        sys.exit(__doc__.split("\n\n")[1])
    bad = cmake_cache(Path(argv[1]), wanted(argv[2:])) if argv[0] == "cmake-cache" else installed(wanted(argv[1:]))
    for b in bad:
        print(f"check-torch: {b}", file=sys.stderr)
    if not bad:
        print(f"check-torch: {argv[0]}: every flag agrees: {' '.join(argv[2 if argv[0] == 'cmake-cache' else 1:])}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
