"""The cross-platform path: a linux/arm64 image built on an x86 host under QEMU (binfmt), pushed, read back
and run. The jax CPU image is the small one: its wheels exist for aarch64 on PyPI."""
from __future__ import annotations

import pytest

from tests.e2e import oci
from tests.e2e.harness import plan_tag, unavailable

pytestmark = pytest.mark.e2e

BASE = "g5g-local/bookworm:arm64"


def test_arm64_build_under_qemu(engine, registry, tmp_path):
    binfmt = "/proc/sys/fs/binfmt_misc/qemu-aarch64"
    try:
        enabled = open(binfmt).read().startswith("enabled")
    except OSError:
        enabled = False
    if not enabled:
        unavailable(f"{binfmt} is not enabled: install qemu-user-static (scripts/provision.sh does)")
    if engine.docker("image", "inspect", BASE).returncode != 0:
        unavailable(f"no local base {BASE}: bash scripts/base-images.sh arm64")

    args = ["--runtime", "jax", "--profile", "cpu", "--platform", "linux/arm64",
            "--set", f"profile.base_image={BASE}", "--registry", f"{registry.host}/arm64",
            "--out", str(engine.logs / "out-jax-arm64")]      # not the checkout's build/: another worker builds there
    ref = plan_tag(engine, *args)
    run = engine.cli(*args, "--push", log="build-jax-arm64", timeout=2400)
    assert run.rc == 0, run.why()

    assert list(oci.platform_manifests(ref)) == ["linux/arm64"]
    cfg = oci.config(ref, "linux/arm64")
    assert cfg["architecture"] == "arm64" and cfg["config"]["Labels"]["io.g5g.runtime"] == "jax"

    inspected = engine.cli("inspect", ref, "--json", "--backend", "http", "--insecure", log="inspect-jax-arm64")
    assert list(inspected.json()["platforms"]) == ["linux/arm64"], inspected.why()

    # The image really is aarch64 and its Python stack imports under emulation.
    probe = engine.docker("run", "--rm", "--platform", "linux/arm64", "--entrypoint", "python3", ref, "-c",
                          "import platform, jax; print(platform.machine(), jax.__version__)", timeout=600)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split()[0] == "aarch64", probe.stdout
    engine.forget(ref)


def test_arm64_steps_get_the_provisioned_qemu(engine, tmp_path):
    """What a linux/arm64 RUN step runs under is scripts/provision.sh's QEMU (>= 10, flag F): the step sees an
    emulated aarch64 /proc/cpuinfo. Bookworm's 7.2 passed the host's x86 one through, and under it `import torch` of
    PyPI's aarch64 wheel segfaulted (benchmarks/results/g5g_rehearsal.md)."""
    binfmt = "/proc/sys/fs/binfmt_misc/qemu-aarch64"
    try:
        entry = open(binfmt).read()
    except OSError:
        entry = ""
    if not entry.startswith("enabled"):
        unavailable(f"{binfmt} is not enabled: install qemu-user-static (scripts/provision.sh does)")
    if engine.docker("image", "inspect", BASE).returncode != 0:
        unavailable(f"no local base {BASE}: bash scripts/base-images.sh arm64")
    flags = next((ln.split(":", 1)[1] for ln in entry.splitlines() if ln.startswith("flags:")), "")
    assert "F" in flags, f"{binfmt}: flags {flags!r}, without F the handler is not found inside containers"

    (tmp_path / "Dockerfile").write_text(f"FROM {BASE}\nRUN grep -m2 -E '^CPU (implementer|part)' /proc/cpuinfo\n")
    r = engine.docker("buildx", "build", "--platform", "linux/arm64", "--no-cache", "--progress", "plain",
                      "--output", "type=cacheonly", str(tmp_path), timeout=600)
    assert r.returncode == 0, ("an arm64 RUN step does not see an aarch64 /proc/cpuinfo (an older QEMU, e.g. "
                               f"bookworm's 7.2):\n{r.stderr[-3000:]}")
    assert "CPU implementer" in r.stderr and "CPU part" in r.stderr, r.stderr[-3000:]
