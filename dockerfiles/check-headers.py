"""The header stage: torch's own headers that name an NVIDIA library header, compiled before the hours-long compile.

    python3 check-headers.py TORCH_INCLUDE TU.cu [--skip HEADER=SOURCE]... -- NVCC_COMMAND...

Every header under TORCH_INCLUDE (torch/include of the same torch version's wheel) that includes an NVIDIA library
header (LIBRARY below: cuDNN, NCCL, cuBLAS(Lt), cuSPARSE, cuSOLVER, cuRAND, cuFFT, NVRTC, NVML, CUPTI, cuSPARSELt,
cuFile, NVSHMEM, NVTX) goes into one translation unit, TU.cu, which NVCC_COMMAND compiles (the image's nvcc, the
profile's archs, torch's defines, the include path the real build gets; TU.cu is appended). A header that no
include path can satisfy (it needs torch's own third_party sources, not in the wheel) is named with --skip. Fails, with
nvcc's first error (e.g. `nccl_device/coop.h: No such file or directory`), where the real compile would fail hours in.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

LIBRARY = re.compile(r'^\s*#\s*include\s*[<"]((?:cudnn|nccl|cublas|cusparse|cusolver|curand|cufft|nvrtc|nvml|cupti|'
                     r'cufile|nvshmem|nvtx3/|nvToolsExt|cudss)[^>"]*)[>"]', re.M)
ERROR = re.compile(r"\b(fatal error|error)\b.*")
SHOWN = 200  # lines of nvcc's output kept in the log (an error in a dispatch macro is thousands of characters)


def headers(root: Path) -> dict[str, list[str]]:
    """Header (relative to root) -> the NVIDIA library headers it names."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.suffix in (".h", ".hpp", ".cuh") and p.is_file():
            if names := sorted(set(LIBRARY.findall(p.read_text(errors="replace")))):
                out[p.relative_to(root).as_posix()] = names
    return out


def main(argv: list[str]) -> int:
    own, nvcc = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="check-headers.py", description=__doc__.split("\n\n")[1])
    ap.add_argument("include", type=Path, help="torch/include of the torch wheel")
    ap.add_argument("tu", type=Path, help="the translation unit to write (nvcc's last argument)")
    ap.add_argument("--skip", action="append", default=[], metavar="HEADER=SOURCE",
                    help="a header that needs SOURCE of torch's own tree (e.g. third_party/cutlass), not in the wheel")
    a = ap.parse_args(own)
    if not nvcc:
        ap.error("the nvcc command goes after --")
    if bad := [s for s in a.skip if not re.fullmatch(r"[^=\s]+=[^=\s]+", s)]:
        ap.error(f"--skip {bad[0]}: expected HEADER=SOURCE")
    skip = dict(s.split("=", 1) for s in a.skip)
    found = headers(a.include)
    if not found:
        sys.exit(f"check-headers: no header under {a.include} names an NVIDIA library header: not torch's include/")
    if unknown := sorted(set(skip) - set(found)):
        sys.exit(f"check-headers: --skip {', '.join(unknown)}: no such header names an NVIDIA library header")
    for h, names in found.items():
        print(f"check-headers: {'skip' if h in skip else 'include'} {h}: {' '.join(names)}"
              + (f" (needs torch's own {skip[h]}: in its source tree, not in the wheel)" if h in skip else ""))
    a.tu.write_text("".join(f"#include <{h}>\n" for h in found if h not in skip))
    print("check-headers:", *nvcc, a.tu, flush=True)
    r = subprocess.run([*nvcc, str(a.tu)], capture_output=True, text=True)
    out = (r.stdout + r.stderr).splitlines()
    for line in out[:SHOWN]:
        print(line[:300])
    if len(out) > SHOWN:
        print(f"… {len(out) - SHOWN} more lines")
    if r.returncode != 0:
        errors = [m.group(0) for m in map(ERROR.search, out) if m]
        first = next((e for e in errors if e.startswith("fatal")), errors[0] if errors else "no message")
        print(f"check-headers: FAILED (nvcc exit {r.returncode}): {first[:300]}", file=sys.stderr)
        return 1
    print(f"check-headers: {len(found) - len(skip)} of torch's headers that name NVIDIA library headers compiled "
          f"({len(skip)} skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
