"""Where end-to-end tests are required (G5G_REQUIRE_E2E=1, as .ci/run sets), a skipped `e2e` test fails.

Registered in tests/conftest.py's pytest_plugins, so it covers every module's e2e tests, not only tests/e2e/:
on CI a missing engine, buildx, binfmt or base image is a failure with the skip's reason, never a quiet skip.
"""
from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("G5G_REQUIRE_E2E") == "1" and item.get_closest_marker("e2e"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"G5G_REQUIRE_E2E=1 and this end-to-end test was skipped: {reason}"
