"""devtools/server.py, the one way tests and benchmarks start a server, against a real process (timed_server)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from devtools.server import free_port
from tests.fixtures.observe import wait_until
from devtools.server import REPO, ServerFailed, launch, running, serving_env, wait_ready

TIMED = str(REPO / "devtools/timed_server.py")


def timed(*flags: str) -> tuple[list[str], str]:
    port = free_port()
    return [sys.executable, TIMED, "--port", str(port), *flags], f"http://127.0.0.1:{port}"


def test_waits_for_health_then_stops_with_sigterm(tmp_path):
    with running(*timed("--health-delay", "1"), log=tmp_path / "s.log") as srv:
        assert srv.ready_s >= 1.0  # /health said 503 for a second: the wait is on 200, not on the port
        assert requests.get(f"{srv.url}/health", timeout=5).status_code == 200
    assert srv.returncode == -signal.SIGTERM
    assert "timed_server: listening on" in srv.output
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{srv.url}/health", timeout=5)


def test_wait_ready_is_the_poll_for_a_server_started_elsewhere(tmp_path):
    """The same poll Server.wait runs, for a server the helper did not start (an app in a thread, a container)."""
    srv = launch(*timed("--health-delay", "1"), log=tmp_path / "s.log")
    try:
        assert wait_ready(f"{srv.url}/health", timeout=0.3) is None          # still 503: not ready, no exception
        assert wait_ready(f"{srv.url}/health", ok=(503,), timeout=30) is not None
        waited = wait_ready(f"{srv.url}/health", timeout=30, started=srv.started)
        assert waited is not None and waited >= 1.0
        assert wait_ready(f"{srv.url}/health", timeout=30, alive=lambda: False) is None
    finally:
        srv.stop()


def test_a_server_that_dies_in_start_up_is_an_error_with_its_output():
    with pytest.raises(ServerFailed, match=r"exited with 3 before .*/health answered:\n(.|\n)*the engine failed"):
        with running(*timed("--die-after", "0.2", "--die-message", "fatal: the engine failed to start")):
            pass


def test_never_ready_is_stopped_after_the_timeout():
    argv, url = timed("--health-delay", "600")
    with pytest.raises(ServerFailed, match=r"/health not ready after 2 s"):
        with running(argv, url, timeout=2):
            pass
    with pytest.raises(requests.ConnectionError):  # stopped, not left behind
        requests.get(f"{url}/health", timeout=5)


def test_other_readiness_paths_and_codes_and_the_temp_log():
    srv = launch(*timed())
    assert srv.wait(ready="/nothing-here", ok=(404,), timeout=60) is srv
    assert srv.log.is_file()
    srv.stop()
    assert not srv.log.exists()  # a temp log of ours is removed; its text stays
    assert "timed_server: starting" in srv.output


def test_terminate_returns_at_once_and_exited_gives_the_status(tmp_path):
    with running(*timed(), log=tmp_path / "s.log") as srv:
        srv.terminate()
        assert srv.returncode is None  # only signalled: exited() waits
        assert srv.exited(20) == -signal.SIGTERM
        assert "timed_server: listening on" in srv.output
    assert srv.stop() == -signal.SIGTERM  # stopping an ended server changes nothing


def test_exited_kills_a_server_that_ignores_sigterm():
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    srv = launch([sys.executable, "-c", ignore], "http://127.0.0.1:9")
    deadline = time.monotonic() + 60
    while "up" not in srv.log.read_text() and time.monotonic() < deadline:  # its handler is in place
        time.sleep(0.05)
    srv.terminate()
    assert srv.exited(1) == -signal.SIGKILL
    assert srv.output == "up\n"


def test_a_killed_test_run_leaves_no_server_behind():
    argv, url = timed()
    code = f"from devtools.server import running\nwith running({argv!r}, {url!r}): print('up', flush=True); input()"
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert parent.stdout.readline() == b"up\n"
        assert requests.get(f"{url}/health", timeout=5).status_code == 200
    finally:
        parent.kill()  # no chance to stop its server: the parent-death signal must
        parent.wait()

    def gone() -> bool:
        try:
            requests.get(f"{url}/health", timeout=1)
            return False
        except requests.ConnectionError:
            return True
    wait_until(gone, timeout=30, what="the orphaned server to exit")


@pytest.mark.parametrize("before, after", [(None, [str(REPO)]), ("/opt/target:/x", [str(REPO), "/opt/target", "/x"])])
def test_serving_env_prepends_the_checkout_to_pythonpath(monkeypatch, before, after):
    """Packages installed with `pip install --target DIR` and PYTHONPATH=DIR stay importable in the server."""
    if before is None:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    else:
        monkeypatch.setenv("PYTHONPATH", before)
    assert serving_env()["PYTHONPATH"].split(os.pathsep) == after


def test_benchmarks_and_the_package_import_no_test_code():
    """What benchmarks share with the tests (server start/stop, the timed server, the tiny checkpoint) lives in
    devtools/, outside the product: neither benchmarks/ nor the product imports tests/, the product (g5g/,
    serving/: what pyproject.toml ships) imports no devtools, and ships none."""
    import ast
    import fnmatch
    import tomllib

    product = [*(REPO / "g5g").rglob("*.py"), *(REPO / "serving").rglob("*.py")]
    for path in [*(REPO / "benchmarks").rglob("*.py"), *product]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "tests" or n.startswith("tests.") for n in names), (path, names)
            if path in product:
                assert not any("devtools" in n.split(".") for n in names), (path, names)
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    # setuptools' find_packages, without importing setuptools (its distutils hack asserts in a process that has
    # already imported the stdlib's distutils, as CI's full run does): a package is a folder with __init__.py
    packages = [".".join(d.relative_to(REPO).parts) for d in (p.parent for p in REPO.rglob("__init__.py"))
                if ".venv" not in d.parts and d != REPO]
    shipped = [p for p in packages if any(fnmatch.fnmatchcase(p, pattern) for pattern in include)]
    assert "g5g" in shipped and not [p for p in shipped if "devtools" in p.split(".")], shipped
