"""Import vLLM's FlashAttention wrapper and fa_utils from an unpacked vLLM tree, as a CUDA build would, without a GPU.

What a real image has and this machine lacks is replaced by a small explicit seam: torch.version.cuda is set
(a CUDA build of torch; the one here is CPU-only), and the few vLLM modules fa_utils imports (platform at
compute capability 7.5, envs, logger, config, _custom_ops, kv_cache_interface) are stand-ins. The modules under
test (vllm/vllm_flash_attn/__init__.py, flash_attn_interface.py, v1/attention/backends/fa_utils.py) and
whatever FA Python files the tree holds (e.g. layers/rotary.py as CMake installs them) are imported as they are.

    python tools/vllm_fa_probe.py --src DIR [--capability 75] [--torch-cuda 13.0|none]

prints one JSON document: whether each import worked (or the exception), FA2/FA3 availability, what
is_fa_version_supported says for 2/3/4, and fa_utils.get_flash_attn_version().
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import types
from collections import namedtuple
from pathlib import Path

import torch
from vllm_stubs import VllmLogger, stub_module

FA_UTILS = "vllm/v1/attention/backends/fa_utils.py"
Capability = namedtuple("DeviceCapability", "major minor")


class Platform:
    """The slice of vllm.platforms.current_platform that fa_utils and flash_attn_interface use."""

    def __init__(self, capability: int):
        self.capability = capability

    def is_cuda(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0):
        return Capability(*divmod(self.capability, 10))

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        if isinstance(capability, tuple):
            capability = capability[0] * 10 + capability[1]
        return self.capability >= capability

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        return self.capability // 10 == capability // 10


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def probe(src: Path, capability: int = 75, torch_cuda: str | None = "13.0") -> dict:
    torch.version.cuda = torch_cuda  # seam: the image's torch is a CUDA build (None: ROCm or CPU torch)
    logging.basicConfig(level=logging.ERROR, handlers=[logging.StreamHandler(sys.stderr)])
    sys.modules.update({
        # `vllm` resolves its submodules from the tree (vllm/__init__.py itself pulls in the whole engine).
        "vllm": stub_module("vllm", [str(src / "vllm")]),
        "vllm.envs": stub_module("vllm.envs", VLLM_BATCH_INVARIANT=False),
        "vllm.logger": stub_module("vllm.logger", init_logger=VllmLogger),
        "vllm.platforms": stub_module("vllm.platforms", current_platform=Platform(capability)),
        "vllm.config": stub_module("vllm.config", get_current_vllm_config_or_none=lambda: None),
        "vllm._custom_ops": stub_module("vllm._custom_ops", reshape_and_cache_flash=lambda *a, **k: None),
        "vllm.v1": stub_module("vllm.v1"),
        "vllm.v1.attention": stub_module("vllm.v1.attention"),
        "vllm.v1.attention.backends": stub_module("vllm.v1.attention.backends"),
        "vllm.v1.kv_cache_interface": stub_module("vllm.v1.kv_cache_interface",
                                              is_quantized_kv_cache=lambda dtype: False),
    })
    report: dict = {"torch_cuda": torch.version.cuda, "capability": capability}
    try:
        import vllm.vllm_flash_attn as fa
        import vllm.vllm_flash_attn.flash_attn_interface as fai

        report["vllm_flash_attn"] = {
            "imported": True,
            "FA2_AVAILABLE": fai.FA2_AVAILABLE, "FA3_AVAILABLE": fai.FA3_AVAILABLE,
            "supported": {v: fa.is_fa_version_supported(v) for v in (2, 3, 4)},
            "reasons": {v: fa.fa_version_unsupported_reason(v) for v in (2, 3, 4)},
        }
    except Exception as e:  # what the user would see
        report["vllm_flash_attn"] = {"imported": False, "error": _error(e)}
    try:
        from vllm.vllm_flash_attn.layers.rotary import apply_rotary_emb

        report["rotary"] = {"imported": True, "apply_rotary_emb": callable(apply_rotary_emb)}
    except Exception as e:
        report["rotary"] = {"imported": False, "error": _error(e)}
    try:
        name = "vllm.v1.attention.backends.fa_utils"
        spec = importlib.util.spec_from_file_location(name, src / FA_UTILS)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        report["fa_utils"] = {"imported": True, "flash_attn_version": mod.get_flash_attn_version(head_size=256)}
    except Exception as e:
        report["fa_utils"] = {"imported": False, "error": _error(e)}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, required=True, help="unpacked vLLM source tree")
    ap.add_argument("--capability", type=int, default=75)
    ap.add_argument("--torch-cuda", default="13.0", help="torch.version.cuda to present; 'none' for a non-CUDA torch")
    a = ap.parse_args(argv)
    print(json.dumps(probe(a.src.resolve(), a.capability, None if a.torch_cuda == "none" else a.torch_cuda)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
