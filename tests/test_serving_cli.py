"""The server as the image and `build.py serve` run it: a separate process on loopback."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from devtools.tiny_gemma4 import ANSWER, QUESTION
from devtools.server import free_port
from devtools.server import serving, serving_env

REPO = Path(__file__).resolve().parents[1]
ENV = serving_env()


def test_build_py_serve_runs_the_server(tiny_gemma4, tmp_path):
    with serving("pytorch", tiny_gemma4, "--served-model-name", "tiny", "--max-model-len", "200",
                 via="build.py serve", log=tmp_path / "server.log") as srv:
        card = requests.get(f"{srv.url}/v1/models", timeout=5).json()["data"][0]
        assert (card["id"], card["max_model_len"]) == ("tiny", 200)  # server flags pass through build.py serve
        r = requests.post(f"{srv.url}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": [{"role": "user", "content": QUESTION}]})
        assert r.json()["choices"][0]["message"]["content"] == ANSWER
    # SIGTERM, as `docker stop` sends: the server drains, then exits 0.
    assert srv.returncode == 0, srv.output[-2000:]
    assert "Finished server process" in srv.output


def test_build_py_serve_passes_every_server_flag_through(tmp_path):
    """`python -m serving`'s flags are defined once, in serving/: build.py serve hands each one over unchanged."""
    from g5g import cli
    from g5g.commands import serve
    from serving.__main__ import parse as server_parse, build_parser as server_parser

    flags = [a for a in server_parser()._actions if a.option_strings and a.dest not in ("help", "runtime", "model")]
    assert {a.dest for a in flags} >= {"host", "port", "served_model_name", "max_model_len", "max_waiting", "log_level"}
    given = []
    for a in flags:  # a value its type accepts, unlike the default
        value = str(a.choices[-1]) if a.choices else '["7"]' if getattr(a.type, "__name__", "") == "_json_list" else "7"
        given += [a.option_strings[-1], *([] if a.nargs == 0 else [value])]
    args = cli.parse(["serve", "--runtime", "pytorch", "--model", str(tmp_path), *given])
    cmd = serve.argv(args)
    assert cmd[1:3] == ["-m", "serving"]
    assert server_parse(cmd[3:]) == server_parse(["--runtime", "pytorch", "--model", str(tmp_path.resolve()), *given])
    # other commands still refuse flags they do not know
    with pytest.raises(SystemExit):
        cli.parse(["bench", "--url", "http://127.0.0.1:9", "--max-model-len", "7"])


def test_unloadable_checkpoint_exits_nonzero(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    proc = subprocess.run([sys.executable, "-m", "serving", "--runtime", "pytorch", "--model", str(tmp_path),
                           "--port", str(free_port())], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "loading" in proc.stderr and "failed" in proc.stderr


def test_missing_checkpoint_is_one_line_and_exit_2(tmp_path):
    for cmd in ([sys.executable, "-m", "serving", "--runtime", "pytorch", "--model", str(tmp_path)],
                [sys.executable, "build.py", "serve", "--runtime", "pytorch", "--model", str(tmp_path)]):
        proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        # One message (rich may wrap it at 80 columns when stderr is not a terminal), no traceback.
        assert proc.stderr.startswith("error:") and "config.json" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv", [["--por=9001"], ["--por", "9001"], ["--engine-stall", "0"],
                                  ["--max-model", "8192"]])
def test_python_m_serving_refuses_abbreviated_flags(tmp_path, argv):
    """argparse would expand a prefix (--por to --port): the chart's extraArgs guard, which matches the full flags it
    sets, would then be bypassed. The process stops at the parser, before any model is looked at."""
    proc = subprocess.run([sys.executable, "-m", "serving", "--runtime", "pytorch", "--model", str(tmp_path), *argv],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr, proc.stderr
    from serving.__main__ import build_parser

    assert build_parser().parse_args(["--runtime", "pytorch", "--model", "m", "--port=9001"]).port == 9001


def test_driver_never_imports_torch_or_the_server():
    code = ("import sys, g5g.cli, g5g.commands.serve; "
            "print(sorted(m for m in ('torch', 'jax', 'transformers', 'serving') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_serving_imports_only_what_the_images_install():
    """serving/ runs in the jax/pytorch images: the stdlib, the `serving` extra (and what it pulls in), the runtime."""
    import ast
    import tomllib
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serving"]
    allowed = {r.split("==")[0].split(">")[0].split("<")[0].strip().replace("-", "_") for r in extra}
    allowed |= {"starlette", "pydantic", "tokenizers",          # via fastapi, transformers
                "torch", "jax", "jaxlib", "ml_dtypes", "serving",  # the runtimes (ml_dtypes comes with jax)
                "triton"}                                       # the CUDA PyTorch images' (packed_matmul.py, on a GPU)
    found = {}
    for path in (REPO / "serving").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names:
                    found.setdefault(top, path.relative_to(REPO))
    assert "g5g" not in found
    assert {m: str(p) for m, p in found.items() if m not in allowed} == {}


def test_serving_docstrings_encode_as_utf8():
    """The images' Python 3.13 cleans docstrings at compile time and encodes them as UTF-8: a lone-surrogate escape
    in a (non-raw) docstring makes the module fail to import there, though it imports on an older Python."""
    import ast
    bad = []
    for path in (REPO / "serving").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                try:
                    (doc or "").encode()
                except UnicodeEncodeError:
                    bad.append(f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 1)}")
    assert bad == []


def test_build_py_serve_passes_server_flags_through(tiny_gemma4):
    """Flags of `python -m serving` that build.py does not know reach it (and it checks them)."""
    proc = subprocess.run([sys.executable, "build.py", "serve", "--runtime", "pytorch", "--model", str(tiny_gemma4),
                           "--max-waiting", "-1"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--max-waiting: must be 0 or more" in proc.stderr, proc.stderr


def test_runtimes_that_load_the_tokenizer_beside_them_never_import_transformers(tiny_gemma4):
    """serving/__main__.py's TRANSFORMERS_FREE: each runtime named there loads the checkpoint, in a fresh process,
    without importing transformers (whose lazy names the tokenizer, loading at the same time, resolves)."""
    from serving.__main__ import RUNTIMES, TRANSFORMERS_FREE

    assert TRANSFORMERS_FREE <= set(RUNTIMES)
    for runtime in sorted(TRANSFORMERS_FREE):
        probe = ("import sys; from serving.__main__ import load_engine; "
                 f"load_engine({runtime!r}, {str(tiny_gemma4)!r}); "
                 "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
        out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300,
                             env={**ENV, "G5G_DEVICE": "cpu"})
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "[]", runtime
