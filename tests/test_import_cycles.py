"""No import circles among the project's modules (g5g/, serving/, benchmarks/, devtools/): a module's imports, at
its top or inside a function, never lead back to it. A circle ties two modules into one that no one can read or test alone
(before: serving/api/app.py <-> serving/api/completions.py, benchmarks/image_proof.py <->
benchmarks/vllm_build_report.py)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("g5g", "serving", "benchmarks", "devtools")


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of PACKAGES (a package is its __init__.py)."""
    out = {}
    for pkg in PACKAGES:
        for f in (REPO / pkg).rglob("*.py"):
            parts = f.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports. A benchmark script's bare `import vllm_build_report` (its directory is
    on sys.path) is benchmarks.vllm_build_report."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            for candidate in (t, f"{package}.{t}"):
                while candidate and candidate not in known:
                    candidate = candidate.rpartition(".")[0]
                if candidate and candidate != name and not name.startswith(candidate + "."):
                    found.add(candidate)
                    break
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path around each strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                on.discard(w)
                group.append(w)
            on.discard(v)
            group.append(v)
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_finder_finds_a_circle_and_its_absence():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_module_imports_itself_back():
    known = modules()
    graph = {n: imports(n, p, known) for n, p in known.items()}
    assert graph["serving.api.app"] and graph["benchmarks.build_evidence.image_proof"]      # the finder reads real imports
    assert cycles(graph) == []


RUNTIMES = ("serving.jax_runtime", "serving.torch_runtime")


def test_the_api_layer_reaches_a_runtime_only_through_the_engine_seam():
    """Outside the runtime packages no serving module imports one (python -m serving loads the one --runtime names
    by its module name: serving/__main__.py), and neither runtime imports the other: each implements
    serving/engine.py's Engine, and only that is shared."""
    known = modules()
    inside = lambda n, pkg: n == pkg or n.startswith(pkg + ".")          # noqa: E731
    for name, path in known.items():
        if not name.startswith("serving"):
            continue
        reached = {r for r in RUNTIMES for i in imports(name, path, known) if inside(i, r)}
        own = {r for r in RUNTIMES if inside(name, r)}
        assert reached <= own, f"{name} imports {sorted(reached - own)}"
    assert "serving.engine" in imports("serving.torch_runtime.engine", known["serving.torch_runtime.engine"], known)


# serving/'s layers: the API layer -> the engine core -> request shaping -> the runtime contract and pure helpers <-
# the runtimes. A package stands for all its modules (serving/api/, core/, shaping/: a layer each); a module
# outside them is named. Data, so a move of modules edits only this.
SERVING_LAYERS = {
    "entry": ["serving", "serving.__main__"],       # `python -m serving` picks the runtime and starts the app
    "api": ["serving.api"],                         # each package with all its modules
    "core": ["serving.core"],
    "shaping": ["serving.shaping"],
    "contract": ["serving.engine", "serving.memory_plan", "serving.quantized", "serving.device"],
    "runtime": ["serving.jax_runtime", "serving.torch_runtime"],
}
# The layers each layer's modules may import (its own included). A runtime reaches only the contract (and,
# by the test above, never the other runtime).
MAY_IMPORT = {
    "entry": set(SERVING_LAYERS),
    "api": {"api", "core", "shaping", "contract"},
    "core": {"core", "shaping", "contract"},
    "shaping": {"shaping", "contract"},
    "contract": {"contract"},
    "runtime": {"runtime", "contract"},
}


def layer_of(name: str) -> str | None:
    """The layer of a serving module (a package's modules are its), or None."""
    return next((layer for layer, names in SERVING_LAYERS.items()
                 for n in names if name == n or (n != "serving" and name.startswith(n + "."))), None)


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a serving module that goes up (or across to the runtimes), and every module in no layer."""
    out = []
    for name in sorted(n for n in graph if n == "serving" or n.startswith("serving.")):
        layer = layer_of(name)
        if layer is None:
            out.append(f"{name} is in no layer (SERVING_LAYERS)")
            continue
        out += [f"{name} ({layer}) imports {i} ({layer_of(i)})" for i in sorted(graph[name])
                if i.startswith("serving.") and layer_of(i) not in MAY_IMPORT[layer]]
    return out


def test_the_layer_check_finds_an_upward_import():
    graph = {"serving.core.scheduler": {"serving.api.protocol"}, "serving.shaping.grammar": {"serving.engine"},
             "serving.jax_runtime.engine": {"serving.shaping.grammar"}, "serving.newcomer": set()}
    assert crossings(graph) == ["serving.core.scheduler (core) imports serving.api.protocol (api)",
                                "serving.jax_runtime.engine (runtime) imports serving.shaping.grammar (shaping)",
                                "serving.newcomer is in no layer (SERVING_LAYERS)"]


def test_serving_imports_only_down_its_layers():
    """api -> core -> shaping -> contract <- runtimes: the engine core raises its own errors (the API layer maps
    them to HTTP), the mask is the runtime contract's, and a runtime needs nothing of the layers above."""
    known = modules()
    graph = {n: imports(n, p, known) for n, p in known.items() if n == "serving" or n.startswith("serving.")}
    assert "serving.core.scheduler" in graph["serving.api.app"]          # the finder reads real imports
    assert crossings(graph) == []


def test_no_serving_module_imports_another_ones_private_names():
    """A name with a leading underscore is its module's own: another module uses its public functions."""
    found = []
    for name, path in modules().items():
        if name == "serving" or name.startswith("serving."):
            found += [f"{name}: from {node.module} import {a.name}" for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("serving")
                      for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []
