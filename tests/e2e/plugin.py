"""Skips that would hide a failure in CI are failures there.

- Where end-to-end tests are required (G5G_REQUIRE_E2E=1, as .ci/run sets), a skipped `e2e` test fails: a missing
  engine, buildx, binfmt or base image is a failure with the skip's reason, never a quiet skip.
- In CI (CI=true, or G5G_REQUIRE_E2E=1), a skipped unit test fails too: a missing jax or torch, an unreachable
  package index, a missing cmake would otherwise pass the suite without testing what they guard. A test whose skip
  is about an optional input, not the product (marked `optional`), may still skip, and so may a test that needs a
  CUDA GPU (marked `gpu`: `pytest -m gpu`, tests/test_gpu.py) on a machine without one.
- In CI a module skipped while it is collected (a module-level `pytest.importorskip("torch")`) fails the same way:
  it becomes one failing test named `<module>::skipped-at-collection`, and the rest of the run goes on. A module
  cannot be marked optional (it was never imported): skip inside its tests for that.

Registered in tests/conftest.py's pytest_plugins, so it covers every module, not only tests/e2e/.
"""
from __future__ import annotations

import os

import pytest


def _in_ci() -> bool:
    return os.environ.get("G5G_REQUIRE_E2E") == "1" or os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail") or item.get_closest_marker("optional") \
            or item.get_closest_marker("gpu"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if item.get_closest_marker("e2e"):
        if os.environ.get("G5G_REQUIRE_E2E") == "1":
            report.outcome = "failed"
            report.longrepr = f"G5G_REQUIRE_E2E=1 and this end-to-end test was skipped: {reason}"
    elif _in_ci():
        report.outcome = "failed"
        report.longrepr = f"in CI (CI=true or G5G_REQUIRE_E2E=1) a skipped test fails: {reason}"


class SkippedAtCollection(pytest.Item):
    """What stands in CI for a module that skipped itself while being imported: one test that fails saying why."""

    def __init__(self, *, reason: str, **kw):
        super().__init__(**kw)
        self.reason = reason

    def runtest(self) -> None:
        pytest.fail(f"in CI (CI=true or G5G_REQUIRE_E2E=1) a module skipped at collection fails: {self.reason}",
                    pytrace=False)

    def reportinfo(self):
        return self.path, None, self.name


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(collector, pytest.Module) and _in_ci():
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        item = SkippedAtCollection.from_parent(collector, name="skipped-at-collection", reason=reason)
        outcome.force_result(pytest.CollectReport(collector.nodeid, "passed", None, [item]))
