"""A network step in a generated Dockerfile trusts the CA bundle given as the BuildKit secret `ca-cert`, for apt too
(NVIDIA's repository is https; apt reads neither SSL_CERT_FILE nor any other environment variable for it)."""
from __future__ import annotations

import os
from pathlib import Path

import jinja2
import pytest

from tests.e2e.harness import ROOT, unavailable

pytestmark = pytest.mark.e2e

HOST_CA = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
BASE = "g5g-local/bookworm:amd64"
# Only the one file is exported: BuildKit's local exporter can hang copying a whole rootfs of small files
# (docker-library/docker#534; seen here in CI, stuck after "copying files 7.53MB").
STEP = """{% import "_macros.j2" as m %}FROM {{ base }} AS step
RUN {{ m.ca_mount() }} \\
    {{ m.ca_env() }}; \\
    apt-get update -qq && apt-config dump | grep -i '^Acquire::https::CaInfo' >/apt-ca.txt || true

FROM scratch
COPY --from=step /apt-ca.txt /
"""


@pytest.mark.parametrize("with_secret", [True, False])
def test_apt_in_a_network_step_uses_the_ca_secret(engine, tmp_path, with_secret):
    if engine.docker("image", "inspect", BASE).returncode != 0:
        unavailable(f"{BASE} is missing: `bash scripts/base-images.sh amd64` (scripts/provision.sh does it)")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROOT / "dockerfiles"), undefined=jinja2.StrictUndefined)
    (tmp_path / "Dockerfile").write_text(env.from_string(STEP).render(base=BASE))
    secret = ["--secret", f"id=ca-cert,src={HOST_CA}"] if with_secret else []
    out = tmp_path / "out"
    build = engine.docker("buildx", "build", *secret, "--no-cache", "--output", f"type=local,dest={out}",
                          "--progress", "plain", str(tmp_path), timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]  # apt-get update still works with the config in place
    seen = (out / "apt-ca.txt").read_text().strip()
    assert seen == ('Acquire::https::CaInfo "/run/secrets/ca-cert";' if with_secret else ""), seen
