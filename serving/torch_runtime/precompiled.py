"""The compiled decode step kept whole across boots, dynamo's trace included (G5G_TORCH_PRECOMPILED=1; issue 49).

Over inductor's persistent cache (compile_cache.py) a warm boot still has dynamo trace transformers' forward
before the cache can be asked: 16.4 s of a 46.3 s warm boot on an H100 host at E2B's 35 layers, 11-17 s on this
project's CPU boxes at the same layer count (the trace follows the layers, not the widths). torch's AOT compile
(`torch.compile(...).aot_compile`) keeps what the trace makes as well, the transformed bytecode and its guards,
beside inductor's compiled graph, in one file; a boot that finds the file loads it (3.3-3.9 s at 35 layers on
the CPU) and traces nothing.

A loaded step checks the guards that torch can serialise (its inputs' shapes, dtypes and dynamic ranges, the
constants it read); those it cannot (the identity of functions, classes and modules it called) are the file's
name instead (`key`): the runtime's sources, the torch, transformers and Python versions, the model's config and
dtype, the device, the slots and context, the settings that change the graph. An input the guards refuse, a file
that is unreadable, from another torch or missing a name: the step is traced and compiled as without the file,
and the file written again. Its contents are pickles, like the caches' code that runs on load: the cache
directory must be as trusted as the image.
"""
from __future__ import annotations

import collections  # noqa: F401  (the traced bytecode loads it as a global of this module: see `_step`)
import hashlib
import io
import logging
import os
import sys
import time
from pathlib import Path
from typing import Mapping

import torch

log = logging.getLogger("serving.torch")

OPT_IN = "G5G_TORCH_PRECOMPILED"
DIR = "g5g-decode"                      # under inductor's cache directory (G5G_TORCH_CACHE_DIR)
MODE = "reduce-overhead"                # transformers' CompileConfig default: what get_compiled_call compiles with
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.py")))      # the code the step is traced through, ours
# settings that change the traced graph; the cache directories only say where it is kept
SETTINGS = ("G5G_", "TORCHINDUCTOR_", "TORCH_")
NOT_SETTINGS = ("G5G_TORCH_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
# Dimension marks (torch._dynamo.maybe_mark_dynamic: attention.SlotKV.decode marks every step's tensors for the
# first compile). torch 2.13 rebuilds a loaded step's guards as if no input had been marked, and refuses marked
# ones, so the marks come off before a call.
_MARKS = ("_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices", "_has_dynamo_dim_marking")
_GUARDS_REFUSED = "GuardManager check failed"


def from_env(env: Mapping[str, str] = os.environ) -> bool:
    """G5G_TORCH_PRECOMPILED: 1 keeps the compiled decode step whole across boots (in G5G_TORCH_CACHE_DIR);
    0 (default, until a GPU run shows the loaded step as fast as the traced one) keeps inductor's caches only."""
    text = env.get(OPT_IN) or "0"
    if text not in ("0", "1"):
        raise ValueError(f"{OPT_IN}: {text!r} is not 0 or 1")
    return text == "1"


def key(model, slots: int, max_context: int, env: Mapping[str, str] = os.environ) -> str:
    """What a stored step's unchecked guards stand for (see the module's docstring), hashed."""
    import transformers

    h = hashlib.sha256()
    for path in SOURCES:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    dev = next(model.parameters()).device
    gpu = (torch.cuda.get_device_name(dev), torch.cuda.get_device_capability(dev)) if dev.type == "cuda" else None
    settings = sorted((k, v) for k, v in env.items() if k.startswith(SETTINGS) and k not in NOT_SETTINGS)
    for item in (torch.__version__, transformers.__version__, sys.version_info[:2], model.config.to_json_string(),
                 str(model.dtype), dev.type, gpu, slots, max_context, settings, MODE):
        h.update(repr(item).encode() + b"\0")
    return h.hexdigest()


def path_for(model, slots: int, max_context: int, env: Mapping[str, str] = os.environ) -> Path | None:
    """Where this boot's step is kept: None without a persistent cache directory (nothing would outlive the
    process)."""
    root = env.get("TORCHINDUCTOR_CACHE_DIR") if env.get("G5G_TORCH_CACHE_DIR", "-") else None
    return Path(root) / DIR / f"decode-{key(model, slots, max_context, env)[:32]}.pt2" if root else None


def _step(model, kw):
    """What is compiled: transformers' call. The bytecode dynamo makes of it loads the modules transformers' code
    reaches (`collections`) as globals of this module, by name where this module has them: hence the import above,
    without which a loaded step would miss the name dynamo made up for it in the process that compiled it."""
    return model(**kw)


def _serialisable(entries) -> list[bool]:
    """The guards torch can write (its AOT compile's own filter misses those whose derived types it cannot)."""
    from torch._dynamo.guards import CheckFunctionManager

    refused = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (e.is_global or e.guard_type in refused or refused & set(e.derived_guard_types or ()))
            for e in entries]


def _unmark(kw: dict) -> None:
    """Take the dimension marks off the call's tensors: its own, a dict's, an object's (the KV cache's)."""
    for value in kw.values():
        inner = value.values() if isinstance(value, dict) else vars(value).values() if hasattr(value, "__dict__") \
            else ()
        for t in (value, *inner):
            if isinstance(t, torch.Tensor):
                for mark in _MARKS:
                    if mark in t.__dict__:
                        delattr(t, mark)


class DecodeStep:
    """The decode step as transformers' compiled call is called (keyword arguments), from `path` when it holds one,
    else compiled ahead of time at the first call and written there; transformers' own compiled call (traced at
    every boot) where either fails. `source` says which this boot's step is, `seconds` what it cost."""

    def __init__(self, model, path: Path):
        self.model, self.path = model, path
        self.fn = None                          # the AOT-compiled step (loaded or compiled here)
        self.traced = None                      # transformers' compiled call, once the AOT path is given up
        self.source, self.seconds = "not compiled yet", 0.0
        if path.exists():
            self._load()

    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            data = self.path.read_bytes()
            # the guards are rebuilt here, against the dispatch keys this thread excludes now: in inference mode,
            # as the steps are called (outside it, every tensor check would refuse every call)
            with torch.inference_mode():
                self.fn = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=globals(),
                                                                external_data={"model": self.model})
        except Exception as e:   # another torch, a truncated file, a name the bytecode needs and no one has
            log.warning("precompiled decode step %s not loadable (%s: %s): compiling it again", self.path,
                        type(e).__name__, str(e)[:300])
            return
        self.source, self.seconds = f"loaded from {self.path}", time.perf_counter() - t0

    def _compile(self, kw: dict) -> None:
        t0 = time.perf_counter()
        try:
            options = {**torch._inductor.list_mode_options(MODE), "guard_filter_fn": _serialisable}
            self.fn = torch.compile(_step, fullgraph=True, options=options).aot_compile(((self.model, kw), {}))
        except Exception as e:   # a graph break, a guard torch cannot write: as without the file
            return self._give_up(f"not compiled ahead of time ({type(e).__name__}: {str(e)[:300]})")
        self.source, self.seconds = "compiled ahead of time", time.perf_counter() - t0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fn.save_compiled_function(str(self.path), external_data={"model": self.model})
            self.source += f", written to {self.path}"
        except Exception as e:   # a full disk, a read-only mount: this boot is served all the same
            log.warning("precompiled decode step not written to %s (%s: %s)", self.path, type(e).__name__, e)

    def _give_up(self, why: str) -> None:
        log.warning("precompiled decode step %s: tracing it as every boot does", why)
        self.fn, self.traced, self.source = None, self.model.get_compiled_call(None), f"traced ({why})"

    def __call__(self, **kw):
        if self.traced is None and self.fn is None:
            self._compile(kw)                   # with the marks on: the rows and the span dynamic
        if self.traced is not None:
            return self.traced(**kw)
        _unmark(kw)
        try:
            return self.fn(self.model, kw)
        except RuntimeError as e:
            if not str(e).startswith(_GUARDS_REFUSED):
                raise
            self._give_up(f"refused this call's inputs ({str(e)[:300]})")
            return self.traced(**kw)

    def describe(self) -> str:
        return f"decode step {self.source} ({self.seconds:.1f}s)"
