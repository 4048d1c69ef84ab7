"""The g4dn CUDA toolchain, built on every change as far as a real sm_75 kernel: NVIDIA's CUDA wheels laid out as a
toolkit, a kernel compiled and linked by that nvcc, its SASS listed by cuobjdump. A broken toolkit layout (a
missing lib64, link stub or header) fails here in minutes instead of hours into a vLLM build.

    python build.py generate --profile g4dn --runtime vllm --out DIR
    docker buildx build --target cuda-check-report … DIR/vllm   (cuda-check: the stage every g4dn vLLM build runs first)

The stage needs no torch (no GB-sized download): it starts from the local trixie base (scripts/provision.sh).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures.engine import unavailable

pytestmark = pytest.mark.e2e

HOST_CA = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
BASE = "g5g-local/trixie:amd64"


def test_g4dn_nvcc_builds_an_sm75_kernel_with_sass_only(engine, tmp_path):
    if engine.docker("image", "inspect", BASE).returncode != 0:
        unavailable(f"{BASE} is missing: `G5G_BASE_SUITE=trixie bash scripts/base-images.sh amd64` "
                    "(scripts/provision.sh does it)")
    out = tmp_path / "gen"
    gen = engine.cli("generate", "--profile", "g4dn", "--runtime", "vllm", "--out", str(out), log="g4dn-generate")
    assert gen.rc == 0, gen.why()
    result = tmp_path / "result"
    build = engine.docker(
        "buildx", "build", "--target", "cuda-check-report", "--secret", f"id=ca-cert,src={HOST_CA}",
        "--output", f"type=local,dest={result}", "--progress", "plain", str(out / "vllm"), timeout=1500)
    assert build.returncode == 0, build.stderr[-4000:]
    report = (result / "cuda-check.txt").read_text()
    assert "release 13.0" in report, report  # the nvcc of cuda.pip_toolkit 13.0.3: torch's own CUDA release
    assert "/tmp/cuda-check sass: sm_75 ptx: none" in report, report  # check-sass.sh --only: sm_75 alone, no PTX
