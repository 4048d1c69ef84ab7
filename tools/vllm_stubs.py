"""Stand-ins for the few vLLM modules our probes need, so a probe loads vLLM files from an unpacked release
without installing vLLM. Imported by the tools/ scripts beside it (run as `python tools/<probe>.py`)."""
from __future__ import annotations

import logging
import types


class VllmLogger(logging.LoggerAdapter):
    """vllm.logger.init_logger: a logger with vLLM's *_once methods."""

    def __init__(self, name: str):
        super().__init__(logging.getLogger(name), {})

    def debug_once(self, msg, *args, **_):
        self.debug(msg, *args)

    def info_once(self, msg, *args, **_):
        self.info(msg, *args)

    def warning_once(self, msg, *args, **_):
        self.warning(msg, *args)


def stub_module(name: str, path: list[str] | None = None, **attrs) -> types.ModuleType:
    """A module object with attrs; a __path__ (empty: submodules resolve through sys.modules) makes it a package."""
    m = types.ModuleType(name)
    m.__path__ = path or []
    m.__dict__.update(attrs)
    return m
