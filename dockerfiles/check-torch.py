"""What torch-base built, read back: fails unless it agrees with the flags the manifest asks for. No GPU needed.

    python3 check-torch.py cmake-cache build/CMakeCache.txt USE_CUDA=1 USE_CUDNN=1 …   (torch-build, after the compile)
    python3 check-torch.py library build/lib/libtorch_cuda.so USE_MEM_EFF_ATTENTION=1 …  (torch-build, the compiled library)
    python3 check-torch.py installed USE_CUDA=1 USE_CUDNN=1 …                          (torch-base, the installed torch)

cmake-cache: every flag must be in the configure's cache with that truth value (a flag the build did not pass
through, or an option torch's configure turned off, shows there); it only confirms what the build was told.
library: evidence that does not depend on the input, in the compiled library: the kernels' names (NAMES).
installed: the flags torch.__config__.show() lists must agree, and each flag's own evidence must be there for 1 and
absent for 0: runtime calls (cuDNN, torch.distributed, the NCCL process group, cuSPARSELt, memory-efficient
attention enabled), the libraries loaded with torch (the system's NCCL, CUPTI for kineto, cuDSS, cuFile), and the
kernels' names in libtorch_cuda.so.
"""
from __future__ import annotations

import mmap
import re
import sys
from pathlib import Path

TRUE = {"1", "ON", "YES", "TRUE", "Y"}
FALSE = {"0", "OFF", "NO", "FALSE", "N"}   # what a flag may ask; anything else is a typo, not OFF


def wanted(flags: list[str]) -> dict[str, bool]:
    out = {}
    for f in flags:
        name, eq, value = f.partition("=")
        if not eq or not re.fullmatch(r"[A-Z][A-Z0-9_]*", name) or value.upper() not in TRUE | FALSE:
            sys.exit(f"check-torch: {f!r}: expected NAME=VALUE, VALUE one of 1 ON YES TRUE Y or 0 OFF NO FALSE N "
                     f"(e.g. USE_CUDNN=1)")
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


def linked(prefix: str) -> bool:
    return any(d.startswith(prefix) for d in loaded())


def kineto_with_cupti(show: str, libraries: set[str]) -> bool:
    """Both, for either alone is another torch: -DHAS_CUPTI among show()'s CXX_FLAGS (kineto's CUPTI code compiled
    in: PyPI's CUDA 2.14.1 lists it, a CPU build does not) and libcupti among the libraries loaded with torch (CUPTI
    linked as a shared library, torch's USE_CUPTI_SO default and PyPI's, so the image's CUPTI wheel is the one used).
    libcupti loaded without the flag is a CPU-only kineto beside some other user of CUPTI."""
    return bool(re.search(r"-DHAS_CUPTI\b", show)) and any(d.startswith("libcupti.so") for d in libraries)


# Evidence in the compiled library itself, whatever the build was told: a flag's kernels leave their names there
# (the host side registers every __global__ by name; PyPI's 2.14 libtorch_cuda.so has both).
NAMES = {"USE_MEM_EFF_ATTENTION": ("memory-efficient attention's Turing kernels",
                                   [b"fmha_cutlassF_f16_aligned_64x64_rf_sm75"]),
         "USE_FLASH_ATTENTION": ("FlashAttention's kernels", [b"_ZN13pytorch_flash"])}


def has_names(lib: Path, names: list[bytes]) -> bool:
    try:
        with lib.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return all(m.find(n) >= 0 for n in names)
    except (OSError, ValueError):  # no such library (a CPU torch), or an empty file
        return False


def compare(want: dict[str, bool], facts: dict) -> list[str]:
    """Each fact of a flag the manifest names must be what the flag asks: present for 1, absent for 0."""
    bad = []
    for name, (what, probe) in facts.items():
        if name not in want:
            continue
        present = bool(probe())
        if present != want[name]:
            bad.append(f"{name}={'1' if want[name] else '0'}: {what} is {present}")
        else:
            print(f"check-torch: {name}={'1' if want[name] else '0'}: {what}: {present}")
    return bad


def library(lib: Path, want: dict[str, bool]) -> list[str]:
    if not lib.is_file() or lib.stat().st_size == 0:   # else every kernel "absent": a wrong path would pass =0
        return [f"{lib}: no such library, or an empty file (nothing to read the kernels' names from)"]
    return compare(want, {n: (f"{what} in {lib.name} ({b', '.join(names).decode()})", lambda ns=names: has_names(lib, ns))
                          for n, (what, names) in NAMES.items()})


def installed(want: dict[str, bool]) -> list[str]:
    import torch
    import torch.distributed

    show = torch.__config__.show()
    print(show)
    listed = dict(re.findall(r"\b(USE_[A-Z0-9_]+|BUILD_[A-Z0-9_]+)=([^,\s]+)", show))
    bad = [f"{n}: {listed[n]} in torch.__config__.show(), the manifest asks for {'ON' if on else 'OFF'}"
           for n, on in want.items() if n in listed and (listed[n].upper() in TRUE) != on]
    lib = Path(torch.__file__).parent / "lib"
    dist = torch.distributed.is_available()
    facts = {
        "USE_CUDA": ("CUDA compiled in (torch.version.cuda)", lambda: torch.version.cuda is not None),
        "USE_CUDNN": ("cuDNN compiled in (torch.backends.cudnn.is_available())", torch.backends.cudnn.is_available),
        "USE_DISTRIBUTED": ("torch.distributed.is_available()", lambda: dist),
        "USE_NCCL": ("the NCCL process group (torch.distributed.is_nccl_available())",
                     lambda: dist and torch.distributed.is_nccl_available()),
        "USE_SYSTEM_NCCL": ("the system's libnccl.so linked (not NCCL built into torch)", lambda: linked("libnccl.so")),
        "USE_KINETO": ("kineto built with CUPTI (-DHAS_CUPTI in torch.__config__.show() and libcupti loaded with torch)",
                       lambda: kineto_with_cupti(show, loaded())),
        "USE_MEM_EFF_ATTENTION": (
            "memory-efficient attention (its sm_75 kernels in libtorch_cuda.so and "
            "torch.backends.cuda.mem_efficient_sdp_enabled())",
            lambda: has_names(lib / "libtorch_cuda.so", NAMES["USE_MEM_EFF_ATTENTION"][1])
            and torch.backends.cuda.mem_efficient_sdp_enabled()),
        "USE_FLASH_ATTENTION": ("FlashAttention's kernels in libtorch_cuda.so",
                                lambda: has_names(lib / "libtorch_cuda.so", NAMES["USE_FLASH_ATTENTION"][1])),
        "USE_CUSPARSELT": ("torch.backends.cusparselt.is_available()", torch.backends.cusparselt.is_available),
        "USE_CUDSS": ("libcudss linked", lambda: linked("libcudss.so")),
        "USE_CUFILE": ("libcufile linked (GPUDirect Storage)", lambda: linked("libcufile.so")),
        "USE_NVSHMEM": ("torch's NVSHMEM library (lib/libtorch_nvshmem.so)",
                        lambda: (lib / "libtorch_nvshmem.so").is_file()),
    }
    return bad + compare(want, facts)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in MODES or (argv[0] != "installed" and len(argv) < 3):
        sys.exit(__doc__.split("\n\n")[1])
    mode, flags = argv[0], argv[1:] if argv[0] == "installed" else argv[2:]
    bad = installed(wanted(flags)) if mode == "installed" else MODES[mode](Path(argv[1]), wanted(flags))
    for b in bad:
        print(f"check-torch: {b}", file=sys.stderr)
    if not bad:
        print(f"check-torch: {mode}: every flag agrees: {' '.join(flags)}")
    return 1 if bad else 0


MODES = {"cmake-cache": cmake_cache, "library": library, "installed": installed}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
