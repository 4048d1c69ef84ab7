"""What scripts/provision.sh promises, checked the way a user checks it: `build.py doctor` passes for a
two-platform build, and the local base images exist for both architectures."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.e2e


def test_doctor_passes_for_amd64_and_arm64(engine, registry):
    run = engine.cli("doctor", "--profile", "cpu", "--platform", "linux/amd64,linux/arm64",
                     "--registry", registry.host, log="doctor")
    assert run.rc == 0, run.why()
    out = run.output
    for line in ("docker engine: server", "named contexts: supported", "registry: http://"):
        assert f"ok   {line}" in out, out
    # linux/arm64 is foreign on x86 and needs QEMU; on an arm64 host amd64 would be the foreign one.
    assert "binfmt linux/" in out and "/proc/sys/fs/binfmt_misc/qemu-" in out, out


@pytest.mark.parametrize("arch", ["amd64", "arm64"])
def test_local_base_images(engine, arch):
    ref = f"g5g-local/bookworm:{arch}"
    r = engine.docker("image", "inspect", ref)
    assert r.returncode == 0, f"{ref} missing: bash scripts/base-images.sh {arch}\n{r.stderr}"
    image = json.loads(r.stdout)[0]
    assert (image["Os"], image["Architecture"]) == ("linux", arch)
