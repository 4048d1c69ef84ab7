"""The compiled decode step's persistent cache, and what each boot's compiles cost (issue 49).

A boot compiles the decode step once (every row count: attention.ROWS, the rows dimension dynamic). Each
compile is dynamo's trace (never cached across processes), then AOTAutograd and inductor, whose outputs
(FX graphs, Triton or C++ kernels) `inductor_env`'s directory keeps: a second boot over the same directory only
traces and loads. Two things made every boot miss that cache:
- `import torch._dynamo` (transformers imports it) writes torch's default into TORCHINDUCTOR_CACHE_DIR, so checking
  "already set?" always found it set and G5G_TORCH_CACHE_DIR was never used (a container's /tmp, lost on restart);
- transformers' Gemma 4 computes the rotary tables over `set(config.layer_types)`, in an order that follows the
  process's string hashing (PYTHONHASHSEED): the graph's inputs came in another order in about half the boots, so
  its cache key did too. `ordered_layer_types` gives that loop a fixed order.
`Compiles` reads dynamo's and the caches' counters around each compiled call and logs one line per compile.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

DEFAULT_CACHE_DIR = "~/.cache/g5g-torch"
# the counters a compile moves (torch._dynamo.utils.counters): {name: (group, key)}
COUNTERS = {"graphs": ("stats", "unique_graphs"),
            **{f"fx_{w}": ("inductor", f"fxgraph_cache_{w}") for w in ("hit", "miss", "bypass")},
            **{f"aot_{w}": ("aot_autograd", f"autograd_cache_{w}") for w in ("hit", "miss", "bypass")}}
# seconds spent per compile phase (torch._dynamo.utils.compilation_time_metrics): dynamo's trace, and the backend
# (AOTAutograd + inductor: codegen and kernel compiles on a miss, loading on a hit)
TIMES = {"trace_s": "bytecode_tracing", "backend_s": "OutputGraph.call_user_compiler"}


def _torch_default() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def inductor_env(env=os.environ) -> dict[str, str]:
    """G5G_TORCH_CACHE_DIR: where inductor keeps the compiled decode step (FX graphs, AOT graphs, Triton kernels), so
    a restarted server loads them instead of compiling (default ~/.cache/g5g-torch; empty: torch's temporary
    directory, lost with the container). The variables to set; TORCHINDUCTOR_CACHE_DIR wins when set to anything but
    torch's own default, which torch itself writes there on import."""
    own = env.get("TORCHINDUCTOR_CACHE_DIR")
    if own is not None and os.path.abspath(own) != _torch_default():
        return {}
    path = env.get("G5G_TORCH_CACHE_DIR", DEFAULT_CACHE_DIR)
    return {"TORCHINDUCTOR_CACHE_DIR": str(Path(path).expanduser())} if path else {}


def ordered_layer_types(model) -> None:
    """Gemma 4's text model loops over `unique_layer_types`, a set: give it a fixed order (sorted), so the traced
    graph, and its cache key, are the same in every process."""
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "unique_layer_types", None), (set, frozenset)):
        inner.unique_layer_types = tuple(sorted(inner.unique_layer_types))


def snapshot() -> dict[str, float]:
    """The COUNTERS and TIMES now (totals since the process began)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    out: dict[str, float] = {name: counters[group][key] for name, (group, key) in COUNTERS.items()}
    out |= {name: sum(compilation_time_metrics.get(key, ())) for name, key in TIMES.items()}
    return out


def describe(c: dict[str, float]) -> str:
    """One line of a compile record (`Compiles.total()` or one compile)."""
    return (f"{c['graphs']:.0f} graph(s), {c['seconds']:.1f}s (dynamo trace {c['trace_s']:.1f}s, "
            f"inductor {c['backend_s']:.1f}s); FX graph cache {c['fx_hit']:.0f} hit {c['fx_miss']:.0f} miss "
            f"{c['fx_bypass']:.0f} bypass, AOT cache {c['aot_hit']:.0f} hit {c['aot_miss']:.0f} miss "
            f"{c['aot_bypass']:.0f} bypass")


class Compiles:
    """The compiles of a compiled callable: `around(call, what)` runs it and, if dynamo compiled a graph during the
    call (a first shape, or a recompile), records and logs what it cost and what the caches gave."""

    def __init__(self, log):
        self.log = log
        self.records: list[dict[str, float]] = []
        self._base = snapshot()

    def around(self, call, what: str):
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        out = call()
        if counters["stats"]["unique_graphs"] != graphs:
            now = snapshot()
            rec = {k: now[k] - self._base[k] for k in now} | {"seconds": time.perf_counter() - t0}
            self._base = now
            self.records.append(rec)
            self.log.info("compile: %s: %s", what, describe(rec))
        return out

    def total(self) -> dict[str, float]:
        """Every record summed (zeros before the first compile)."""
        keys = (*COUNTERS, *TIMES, "seconds")
        return {k: sum(r[k] for r in self.records) for k in keys}
