"""No import circles among the project's modules (g5g/, serving/, benchmarks/, devtools/): a module's imports, at
its top or inside a function, never lead back to it. A circle ties two modules into one that no one can read or test alone
(before: serving/api.py <-> serving/openai_text.py, benchmarks/image_proof.py <-> benchmarks/vllm_build_report.py)."""
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
    assert graph["serving.api"] and graph["benchmarks.image_proof"]      # the finder reads real imports
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
