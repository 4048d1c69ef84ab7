"""The server as the image and `build.py serve` run it: a separate process on loopback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from tests.fixtures.tiny_gemma4 import ANSWER, QUESTION
from tests.fixtures.net import free_port

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _wait_health(proc: subprocess.Popen, url: str, timeout: float = 120) -> list[int]:
    codes = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            codes.append(requests.get(f"{url}/health", timeout=2).status_code)
            if codes[-1] == 200:
                return codes
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    raise AssertionError("server not healthy in time")


def _stop(proc: subprocess.Popen) -> str:
    """SIGTERM, as `docker stop` does; returns stderr. The server drains, then exits 0."""
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]     # a drained shutdown exits 0
    return err


def test_build_py_serve_runs_the_server(tiny_gemma4):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "build.py", "serve", "--runtime", "pytorch", "--model", str(tiny_gemma4),
                             "--port", str(port), "--served-model-name", "tiny"],
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(proc, url)
        assert requests.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"] == "tiny"
        r = requests.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": [{"role": "user", "content": QUESTION}]})
        assert r.json()["choices"][0]["message"]["content"] == ANSWER
    finally:
        err = _stop(proc)
    assert "Finished server process" in err


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
                "torch", "jax", "jaxlib", "ml_dtypes", "serving"}  # the runtimes (ml_dtypes comes with jax)
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


def test_build_py_serve_passes_server_flags_through(tiny_gemma4):
    """Flags of `python -m serving` that build.py does not know reach it (and it checks them)."""
    proc = subprocess.run([sys.executable, "build.py", "serve", "--runtime", "pytorch", "--model", str(tiny_gemma4),
                           "--max-waiting", "-1"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--max-waiting: must be 0 or more" in proc.stderr, proc.stderr
