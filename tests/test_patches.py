"""Our vLLM Turing shared-memory patch, checked against the pinned release from PyPI and Triton's sm_75 compile.

Network: the package index once (the vLLM sdist, then cached under .cache/vllm-sdist/; without either, a skip that
says so) and a PEP 503 index of ours on loopback. No GPU: the kernel is compiled for ("cuda", 75, 32) with the
Triton that torch's pin ships (tools/vllm_attn_probe.py).
"""
from __future__ import annotations

import difflib
import hashlib
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from g5g import cli, patches
from g5g.commands.patches import print_report
from g5g.errors import UserError

KERNEL = "vllm/v1/attention/ops/triton_unified_attention.py"
PATCH = "patches/vllm/0.33.0/0001-triton-attn-turing-smem.patch"


def _version() -> str:
    pin = patches.manifest_pin()
    return pin[0] if pin else "0.33.0"


def _sha(path) -> str:
    return hashlib.sha256((patches.REPO_ROOT / path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def sdist(vllm_sdist):
    return vllm_sdist


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_our_patch_applies_to_the_pinned_release(sdist):
    patches.check_apply([(PATCH, _sha(PATCH))], sdist.version)


def test_patch_that_no_longer_applies_names_patch_and_version(sdist, tmp_path):
    text = (patches.REPO_ROOT / PATCH).read_text()
    context = "     return 16 if element_size >= 2 else 32\n"  # a context line of the first hunk
    assert context in text
    bad = tmp_path / "0001-drifted.patch"
    bad.write_text(text.replace(context, "     return 16 if element_size > 1 else 32\n"))  # upstream moved on
    with pytest.raises(UserError) as e:
        patches.check_apply([(str(bad), None)], sdist.version)
    assert _one_line(e).startswith(f"patch {bad} does not apply to vllm {sdist.version}: ")
    assert KERNEL in str(e.value)


def test_patch_sha256_mismatch_is_refused_before_any_download():
    with pytest.raises(UserError) as e:
        patches.check_apply([(PATCH, "0" * 64)], "0.0.0-not-downloaded")
    assert _one_line(e) == f"patch {PATCH}: sha256 {_sha(PATCH)}, the vllm manifest pins {'0' * 64}"


def test_sdist_sha256_mismatch_is_refused(sdist):
    with pytest.raises(UserError) as e:
        patches.fetch_sdist(sdist.version, "f" * 64)
    assert _one_line(e).startswith(f"vllm-{sdist.version}.tar.gz: sha256 {sdist.sha256}, the vllm manifest pins ")


@pytest.fixture
def local_index(monkeypatch):
    """A PEP 503 simple index on loopback that knows one vllm release: the index pip would use, without PyPI."""
    page = b'<html><body><a href="../../files/vllm-0.0.1.tar.gz#sha256=' + b"0" * 64 + b'">vllm-0.0.1.tar.gz</a>'

    class Index(BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path.rstrip("/") == "/simple/vllm"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(page if found else b"")

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/simple"
    monkeypatch.setenv("PIP_INDEX_URL", url)
    yield url
    httpd.shutdown()
    httpd.server_close()


def test_missing_release_names_the_index(local_index):
    with pytest.raises(UserError) as e:
        patches.fetch_sdist("0.0.0.dev424242")
    assert _one_line(e) == f"vllm 0.0.0.dev424242: no sdist vllm-0.0.0.dev424242.tar.gz on package index {local_index}"


def test_cli_verify_unknown_version_is_one_line_exit_2(capsys):
    assert cli.main(["patches", "verify", "--version", "0.0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: vLLM 0.0.1: no patches under patches/vllm/0.0.1/"


@pytest.fixture(scope="module")
def report():
    return patches.verify(_version())


def _launch(report, path, head, window=0):
    (row,) = [r for r in report["launches"]
              if r["path"] == path and r["head_size"] == head and r["sliding_window"] == window]
    return row


@pytest.mark.slow
def test_shared_memory_on_sm75(report, capsys):
    with capsys.disabled():  # the figures belong in CI's log
        print()
        print_report(report)
    limit = report["smem_limit"]
    assert report["target"] == ["cuda", 75, 32] and limit == 65536

    # The field report's failure, reproduced from the released source: head 512 prefill needs 98 304 B.
    full_prefill = _launch(report, "prefill 2D", 512)
    assert full_prefill["unpatched"]["shared"] == 98304 > limit
    assert not full_prefill["unpatched"]["fits"]

    for row in report["launches"]:
        u, p = row["unpatched"], row["patched"]
        assert p["fits"] and p["shared"] <= limit, row
        assert p["num_stages"] == 1
        # The patch's rule is the compiled kernel's own figure, not an estimate with a margin.
        assert p["estimate"] == p["shared"], row
        # Narrowed only where needed, and only as far as needed.
        if u["fits"]:
            assert p["tile"] == u["tile"], row
        else:
            assert p["wider_tile_shared"] > limit, row
        # sm_80: the launch is exactly the unpatched one (tiles, stages, every constexpr).
        assert row["reference"]["unchanged"], row
        assert (row["reference"]["tile"], row["reference"]["num_stages"]) == (u["tile"], u["num_stages"]), row

    assert full_prefill["patched"]["tile"] == 16 and full_prefill["patched"]["shared"] == 65536
    assert report["ok"]


@pytest.mark.slow
def test_verify_fails_without_the_fix(sdist, tmp_path):
    """The check can fail: a patch that applies but does not narrow the tiles leaves head 512 over the limit."""
    with tarfile.open(sdist.path) as tar:
        src = tar.extractfile(f"vllm-{sdist.version}/{KERNEL}").read().decode()
    diff = difflib.unified_diff(src.splitlines(True), (src + "# no fix here\n").splitlines(True),
                                f"a/{KERNEL}", f"b/{KERNEL}")
    noop = tmp_path / "0001-noop.patch"
    noop.write_text(f"diff --git a/{KERNEL} b/{KERNEL}\n" + "".join(diff))
    r = patches.verify(sdist.version, [(str(noop), None)])
    assert not r["ok"]
    assert not _launch(r, "prefill 2D", 512)["patched"]["fits"]
