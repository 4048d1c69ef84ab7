"""Where a test needing the engine, buildx or the registry runs, and that CI never lets it skip (tests/fixtures/engine.py)."""
from __future__ import annotations

import os
import subprocess
import sys

from devtools.server import REPO

TESTS = '''
import pytest

def test_unit():
    pass

def test_needs_a_missing_module():
    pytest.importorskip("g5g_no_such_module")

@pytest.mark.optional
def test_needs_an_optional_input():
    pytest.skip("no G5G_EXTRA_INPUT")

def test_needs_the_registry(registry):
    pass
'''


def pytest_run(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_policy_sample.py").write_text(TESTS)
    plugins = [a for p in ("tests.fixtures.engine", "tests.fixtures.registry", "tests.e2e.plugin") for a in ("-p", p)]
    environ = {k: v for k, v in os.environ.items() if k not in ("G5G_REQUIRE_E2E", "CI")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-c", str(REPO / "pyproject.toml"),
                           "--rootdir", str(tmp_path), *plugins, str(tmp_path / "test_policy_sample.py"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**environ, "PYTHONPATH": str(REPO), **env})


def test_registry_tests_are_end_to_end_so_the_unit_half_never_waits_on_provisioning(tmp_path):
    r = pytest_run(tmp_path, "-m", "not e2e", G5G_REGISTRY_BIN="/nonexistent/docker-registry")
    assert r.returncode == 0 and "1 passed, 2 skipped, 1 deselected" in r.stdout, r.stdout


def test_a_missing_registry_binary_skips_saying_why_and_fails_in_ci(tmp_path):
    missing = "/nonexistent/docker-registry"
    local = pytest_run(tmp_path, "-m", "e2e", G5G_REGISTRY_BIN=missing)
    assert local.returncode == 0 and "1 skipped" in local.stdout and f"{missing} not found" in local.stdout, local.stdout
    ci = pytest_run(tmp_path, "-m", "e2e", G5G_REGISTRY_BIN=missing, G5G_REQUIRE_E2E="1")
    assert ci.returncode == 1 and "skipped" not in ci.stdout and "1 error" in ci.stdout, ci.stdout  # in its set-up
    assert f"G5G_REQUIRE_E2E=1 and this end-to-end test cannot run: {missing} not found" in ci.stdout


def test_in_ci_a_skipped_unit_test_fails_unless_its_input_is_optional(tmp_path):
    """An importorskip of jax or torch, an unreachable package index: in CI a skip would pass what it hides."""
    for env in ({"CI": "true"}, {"G5G_REQUIRE_E2E": "1"}):
        r = pytest_run(tmp_path, "-m", "not e2e", "-k", "not test_unit", **env)
        assert r.returncode == 1 and "1 failed, 1 skipped" in r.stdout, r.stdout
        assert "a skipped test fails: Skipped: could not import 'g5g_no_such_module'" in r.stdout, r.stdout


def test_in_ci_a_module_skipped_at_collection_fails_and_the_run_goes_on(tmp_path):
    """A module-level importorskip skips while collecting, before any test runs: in CI it fails like a test's skip."""
    (tmp_path / "test_policy_module.py").write_text('import pytest\npytest.importorskip("g5g_no_such_module")\n\n'
                                                    'def test_never_collected():\n    pass\n')
    module = str(tmp_path / "test_policy_module.py")
    local = pytest_run(tmp_path, module, "-m", "not e2e", "-k", "test_unit or collection")
    assert local.returncode == 0 and "1 passed, 1 skipped" in local.stdout, local.stdout
    for env in ({"CI": "true"}, {"G5G_REQUIRE_E2E": "1"}):
        r = pytest_run(tmp_path, module, "-m", "not e2e", "-k", "test_unit or collection", **env)
        assert r.returncode == 1 and "1 failed, 1 passed, 3 deselected in" in r.stdout, r.stdout
        assert "_ skipped-at-collection _" in r.stdout, r.stdout
        why = "a module skipped at collection fails: Skipped: could not import 'g5g_no_such_module'"
        assert why in r.stdout, r.stdout
