"""The ladder's compiled executables kept across boots under a key of our own, so a warm boot skips tracing too.

JAX's persistent compilation cache keys an executable by its lowered module: to look one up, a boot first traces
and lowers the function, and with Gemma 4's layers unrolled in Python that is most of a warm boot (35 layers:
~1.4 s an executable on this project's CPU boxes, under the GIL, so one after another), while the cache load itself
is a deserialisation. This store keys each executable by what its module is made from instead: the runtime's own
source files, the arguments' shapes, dtypes and tree (packed weights' static fields included), the model config,
JAX's and jaxlib's versions, the backend and its devices, XLA_FLAGS and JAX's environment; a hit is deserialised
(jax.experimental.serialize_executable) without tracing. Anything unreadable is a miss: the boot traces, then
JAX's persistent cache (or XLA) gives the executable, and the store keeps it for next time.

It lives beside JAX's persistent cache, in EXECUTABLES_DIR under G5G_JAX_CACHE_DIR, and is on when that cache is
and G5G_JAX_EXECUTABLE_STORE=1: off by default until a GPU run shows that executables deserialised on XLA:GPU run
as the traced ones do (on XLA:CPU a re-serialised cache load lost its kernels: see `obtain`). Its files are pickles, like the cache's executables code that runs on load: the cache directory must be
as trusted as the image.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping, Sequence

import jax
from jax.experimental import serialize_executable

from . import xla

log = logging.getLogger("serving.jax")

EXECUTABLES_DIR = "g5g-executables"
OPT_IN = "G5G_JAX_EXECUTABLE_STORE"
_SERVING = Path(__file__).resolve().parents[1]
# What the ladder's functions are traced from: a change to any of these makes every stored executable a miss.
SOURCES = (*sorted(Path(__file__).parent.glob("*.py")), _SERVING / "engine.py")     # engine.py: the mask, MASKED


def fingerprint(*parts) -> str:
    """What every executable of this process shares: sources, versions, backend, devices, flags, plus `parts`."""
    import jaxlib

    h = hashlib.sha256()
    for path in SOURCES:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    dev = jax.devices()[0]
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("JAX_", "XLA_FLAGS", "LIBTPU")))
    for item in (jax.__version__, jaxlib.__version__, jax.default_backend(), dev.client.platform_version,
                 dev.device_kind, getattr(dev, "compute_capability", None), len(jax.devices()), env,
                 jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision, *parts):
        h.update(repr(item).encode() + b"\0")
    return h.hexdigest()


def spec_key(args) -> str:
    """The arguments' tree (static fields included) and each leaf's shape and dtype."""
    leaves, tree = jax.tree.flatten(args)
    return repr((str(tree), [(tuple(a.shape), str(a.dtype)) for a in leaves]))


class Store:
    """name + argument specs -> a jax.stages.Compiled, in directory `root` (None: off, every load a miss)."""

    def __init__(self, root: str | Path | None, salt: str):
        self.root = Path(root) if root else None
        self.salt = salt

    @classmethod
    def beside_persistent_cache(cls, *parts, env: Mapping[str, str] = os.environ) -> "Store":
        on = (env.get(OPT_IN) == "1" and jax.config.jax_enable_compilation_cache
              and jax.config.jax_compilation_cache_dir)
        return cls(Path(jax.config.jax_compilation_cache_dir) / EXECUTABLES_DIR if on else None,
                   fingerprint(*parts) if on else "")

    def path(self, name: tuple, args) -> Path:
        key = hashlib.sha256(f"{self.salt}\0{name!r}\0{spec_key(args)}".encode()).hexdigest()
        return self.root / f"{'-'.join(map(str, name))}-{key[:32]}.pickle"

    def load(self, name: tuple, args) -> jax.stages.Compiled | None:
        if self.root is None:
            return None
        path = self.path(name, args)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("executable store: %s unreadable (%s): tracing it instead", path, e)
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(blob)
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:   # written by another jaxlib, truncated by a full disk: the boot traces it
            log.warning("executable store: %s not loadable (%s: %s): tracing it instead", path.name,
                        type(e).__name__, e)
            return None

    def load_all(self, wanted: Mapping[tuple, tuple], workers: int) -> dict:
        """{name: Compiled} of those of `wanted` ({name: args}) found, loaded side by side."""
        if self.root is None or not wanted:
            return {}
        with ThreadPoolExecutor(max(1, min(len(wanted), workers))) as pool:
            got = dict(zip(wanted, pool.map(lambda n: self.load(n, wanted[n]), wanted)))
        return {n: c for n, c in got.items() if c is not None}

    def save(self, name: tuple, args, compiled: jax.stages.Compiled) -> bool:
        """Keep `compiled` for the next boot (written whole, then renamed: a reader never sees half a file)."""
        if self.root is None:
            return False
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:   # an executable JAX cannot serialise (e.g. closed-over constants): traced each boot
            log.warning("executable store: %s not serialisable (%s: %s)", name, type(e).__name__, e)
            return False
        path = self.path(name, args)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
                f.write(blob)
            os.replace(f.name, path)
            return True
        except OSError as e:
            log.warning("executable store: %s not written (%s)", path, e)
            return False



def obtain(jobs: Mapping[tuple, tuple[Callable, tuple]], store: Store,
           waves: Callable[[Sequence[tuple]], tuple[list, list]], workers: int) -> tuple[dict, dict]:
    """({name: Compiled}, boot stats) for jobs {name: (function, argument specs)}, each jitted with the cache and
    state donated (arguments 1 and 2): from the store where it has them, side by side; the rest traced and lowered
    (holding the GIL: one after another), then compiled by XLA or loaded from JAX's persistent cache (which do not
    hold it): `waves(names)`' first wave one after another, its second side by side. What XLA compiled is stored."""
    t0 = time.perf_counter()
    compiled = store.load_all({k: args for k, (_, args) in jobs.items()}, workers)
    t_store = time.perf_counter() - t0
    todo = [k for k in jobs if k not in compiled]
    lowered = {k: jax.jit(jobs[k][0], donate_argnums=(1, 2)).lower(*jobs[k][1]) for k in todo}
    t_lower = time.perf_counter() - t0 - t_store
    fresh = set()

    def compile_one(k):
        hits = xla.thread_cache_hits()
        out = lowered[k].compile()
        if xla.thread_cache_hits() == hits:
            fresh.add(k)
        return out

    first, rest = waves(todo)
    compiled |= {k: compile_one(k) for k in first}
    with ThreadPoolExecutor(max(1, min(len(rest), workers))) as pool:
        compiled |= dict(zip(rest, pool.map(compile_one, rest)))
    t_compile = time.perf_counter() - t0 - t_store - t_lower
    # Only what XLA compiled in this process is kept: XLA:CPU serialises an executable it deserialised (from JAX's
    # cache) without its kernels ("NOT_FOUND: Function wrapped_convert.1 not found" when run; jax 0.10.2).
    saved = sum(store.save(k, jobs[k][1], compiled[k]) for k in todo if k in fresh)
    if store.root is not None and len(fresh) < len(todo):
        log.warning("jax boot: %d executables came from JAX's persistent cache but not from the executable store, "
                    "and cannot be added to it: every boot traces them until they are compiled afresh (empty %s to "
                    "have that done once)", len(todo) - len(fresh), jax.config.jax_compilation_cache_dir)
    return compiled, {"store_hits": len(jobs) - len(todo), "store_saved": saved, "store_load_s": round(t_store, 3),
                      "lower_s": round(t_lower, 3), "xla_s": round(t_compile, 3)}
