"""`python -m benchmarks.harness.as_image --runtime R ARGS…`: `python -m serving --runtime R ARGS…` with the
frameworks R's image does not carry made unimportable, as if not installed.

A benchmark machine holds torch and JAX side by side, and transformers imports torch wherever it finds it (the
tokenizer's load, on the JAX server's boot path): on an H100 host the JAX server's tokenizer took 26.3 s of its
28.0 s warm boot, importing a torch its image never ships (2026-12-07). Which frameworks an image holds is the
runtime manifest's `serve.local.packages` (manifests/runtimes/R.yaml)."""
from __future__ import annotations

import runpy
import sys

import yaml

from benchmarks.harness import ROOT

FRAMEWORKS = ("torch", "jax")     # each image carries the one its runtime runs on, never the other


def absent(runtime: str) -> list[str]:
    """The frameworks R's image lacks: those its manifest's serve.local.packages do not name."""
    manifest = yaml.safe_load((ROOT / "manifests" / "runtimes" / f"{runtime}.yaml").read_text())
    return [f for f in FRAMEWORKS if f not in manifest["serve"]["local"]["packages"]]


def hide(packages: list[str]) -> None:
    """Each package unimportable in this process: `import` raises ImportError and importlib.util.find_spec says
    None (what transformers' is_torch_available asks), as for a package that is not installed."""
    for name in packages:
        if name in sys.modules and sys.modules[name] is not None:
            raise RuntimeError(f"{name} is imported already: too late to hide it")
        sys.modules[name] = None


def main(argv: list[str]) -> None:
    runtime = argv[argv.index("--runtime") + 1]
    hide(absent(runtime))
    runpy.run_module("serving", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv)
