"""vLLM's compressed-tensors config parsing, run without a GPU and without the rest of vLLM.

Loads vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py from an unpacked vLLM
source tree (the pinned sdist) as it is; every other `vllm.*` module it imports is a stand-in whose names are
placeholder classes (the scheme classes record their arguments). Then, for a checkpoint's quantization_config:
`CompressedTensorsConfig.from_config` and, per target, `_get_scheme_from_parts` — which scheme vLLM picks.

    python tools/vllm_ct_probe.py VLLM_SRC_ROOT CONFIG_JSON     # prints one JSON document
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import sys
import types
from pathlib import Path

PACKAGE = "vllm.model_executor.layers.quantization.compressed_tensors"
MODULE = PACKAGE + ".compressed_tensors"
REAL = (PACKAGE + ".utils", MODULE)       # loaded from the source tree: the parsing and the layer matching


class _Placeholder:
    """Any name imported from a stubbed vLLM module: a class whose instances record how they were made."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    @classmethod
    def get_min_capability(cls) -> int:
        return 0


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Placeholder,), {})
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "vllm" or fullname.startswith("vllm."):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Stub(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        if module.__name__ == "vllm.logger":
            import logging
            module.init_logger = logging.getLogger
        if module.__name__ == "vllm.platforms":
            module.current_platform = _Turing()


class _Turing:
    """current_platform as vLLM sees a T4/T4G: CUDA, compute capability 7.5."""

    class _Capability(tuple):
        def to_int(self) -> int:
            return self[0] * 10 + self[1]

    def get_device_capability(self):
        return self._Capability((7, 5))

    def is_cuda(self) -> bool:
        return True

    def __getattr__(self, name):         # is_xpu, is_rocm, is_cpu, …: not this platform
        if name.startswith("is_"):
            return lambda: False
        raise AttributeError(name)


def probe(src_root: Path, qc: dict) -> dict:
    sys.meta_path.insert(0, _StubFinder())
    for name in REAL:
        spec = importlib.util.spec_from_file_location(name, src_root / (name.replace(".", "/") + ".py"))
        mod = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    cfg = mod.CompressedTensorsConfig.from_config(json.loads(json.dumps(qc)))
    schemes = {}
    for target, parts in cfg.target_scheme_map.items():
        s = cfg._get_scheme_from_parts(parts["weights"], parts["input_activations"], parts.get("output_activations"),
                                       parts.get("format"), layer_name=target)
        schemes[target] = {"scheme": type(s).__name__, **{k: getattr(v, "value", v) for k, v in s.kwargs.items()}}
    return {"quant_format": cfg.quant_format, "ignore": cfg.ignore, "schemes": schemes}


if __name__ == "__main__":
    raw = json.loads(Path(sys.argv[2]).read_text())
    print(json.dumps(probe(Path(sys.argv[1]), raw["quantization_config"]), indent=1))
