"""Which device a server runs on, and the one line it dies with when it expected a GPU and has none.

G5G_DEVICE (`python -m serving --device`): `gpu` — a usable CUDA GPU or exit (the CUDA images set it: an image
that quietly served at CPU speed on a host with an old driver, or with no GPU passed through, was issue 51's
bug); `cpu` — the CPU on purpose; `auto` (unset: a developer's checkout) — the GPU when there is one, else the CPU,
said in the log. Each runtime asks its framework (serving/torch_runtime, serving/jax_runtime); this module only
reads the driver and words the refusal.
"""
from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path
from typing import Mapping

ENV = "G5G_DEVICE"
CHOICES = ("auto", "gpu", "cpu")
# The oldest NVIDIA driver branch each CUDA major runs on (NVIDIA's CUDA release notes: 13.x needs >= 580, 12.x
# >= 525 with minor-version compatibility).
DRIVER_FLOOR = {"12": "R525", "13": "R580"}
PROC_VERSION = Path("/proc/driver/nvidia/version")


class NoGpuError(RuntimeError):
    """A server that expects a GPU (G5G_DEVICE=gpu) found none it can use: str() is the whole, one-line message."""


def expected(env: Mapping[str, str] = os.environ) -> str:
    want = (env.get(ENV) or "auto").strip().lower()
    if want not in CHOICES:
        raise ValueError(f"{ENV}: {env.get(ENV)!r} is not one of {', '.join(CHOICES)}")
    return want


def driver_found(proc: Path = PROC_VERSION, libcuda: str = "libcuda.so.1") -> str:
    """The NVIDIA driver this process sees, in words: the kernel module's version (what `nvidia-smi` shows) and the
    CUDA version the user-space driver (libcuda) supports, as far as either is there."""
    parts = []
    try:
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", proc.read_text())
        if m:
            parts.append(f"NVIDIA driver {m.group(1)}")
    except OSError:
        pass
    try:
        v = ctypes.c_int(0)
        if ctypes.CDLL(libcuda).cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            parts.append(f"libcuda for CUDA {v.value // 1000}.{v.value % 1000 // 10}")
    except (OSError, AttributeError):
        pass
    return ", ".join(parts) or f"no NVIDIA driver ({proc} absent, no {libcuda})"


def needed(built_cuda: str | None, env: Mapping[str, str] = os.environ) -> str:
    """The CUDA (and driver branch) the image needs: NVIDIA_REQUIRE_CUDA (the CUDA images set "cuda>=13.0"), else
    the CUDA the runtime was built on."""
    m = re.search(r"cuda>=(\d+)(\.\d+)?", env.get("NVIDIA_REQUIRE_CUDA", ""))
    version = f"{m.group(1)}{m.group(2) or ''}" if m else built_cuda
    if not version:
        return "a CUDA GPU"
    floor = DRIVER_FLOOR.get(version.split(".")[0])
    return f"CUDA {version}" + (f" (NVIDIA driver {floor} or newer)" if floor else "")


def no_gpu(why: str, built_cuda: str | None, env: Mapping[str, str] = os.environ,
           driver: str | None = None) -> NoGpuError:
    """The refusal: what the framework said, the driver found, the one needed, how to run on the CPU on purpose."""
    why = " ".join(why.split())[:300]   # one line, whatever the framework's message
    found = driver if driver is not None else driver_found()
    return NoGpuError(f"{ENV}=gpu but no usable GPU ({why}); found: {found}; needs {needed(built_cuda, env)} and the "
                      f"GPU passed to the container (docker run --gpus all); to serve on the CPU on purpose: "
                      f"{ENV}=cpu or --device cpu")
