"""The chart's fetch script (deploy/chart/files/fetch_model.py) against inputs that must fail (issue 41): a hash that
is not 64 hex digits, the user's hash against the Hub's listing, the user's hashes on the Hugging Face path, a model
directory that was never checked or was checked against other hashes, a rename that fails. Real files, the real
huggingface_hub client against a loopback Hub (tests/test_chart.py's _Hub); each refusal named by its message."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_chart import CHART, _fetcher, _Hub

FILES = {"config.json": b'{"model_type": "gemma4"}\n', "model.safetensors": bytes(range(256)) * 64,
         "tokenizer.json": b'{"version": "1.0"}\n'}
REPO_ID = "google/gemma-4-E2B-it"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def hub():
    h = _Hub(FILES, lfs={"model.safetensors"})
    yield h
    h.server.shutdown()


def fetch_hf(hub: _Hub, tmp_path: Path, *sums: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The init container's command, as the chart renders it for model.source huggingface."""
    dest = tmp_path / "cache" / "gemma"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "POD": "gemma-0",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}
    argv = [sys.executable, str(CHART / "files" / "fetch_model.py"), "huggingface", "--dest", str(dest),
            "--repo", REPO_ID, "--revision", "main", *(x for s in sums for x in ("--sha256", s))]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env), dest


def downloads(hub: _Hub) -> list[str]:
    return [path for _, path, _ in hub.seen if "/resolve/" in path]


def s3_cache(tmp_path: Path, monkeypatch) -> tuple[Path, Path, list[str]]:
    """A cache volume as the s3 path leaves it: the `download` init container's copy in .partial/<pod>."""
    monkeypatch.setenv("POD", "gemma-1")
    partial = tmp_path / "cache" / ".partial" / "gemma-1"
    partial.mkdir(parents=True)
    for name, data in FILES.items():
        (partial / name).write_bytes(data)
    argv = ["s3", "--dest", str(tmp_path / "cache" / "gemma")]
    for name, data in FILES.items():
        argv += ["--sha256", f"{name}={sha(data)}"]
    return tmp_path / "cache" / "gemma", partial, argv


@pytest.mark.parametrize("item", ["model.safetensors=" + "a" * 63, "model.safetensors=" + "a" * 65,
                                  "model.safetensors=abc", "model.safetensors=" + "g" * 64, "=" + "a" * 64,
                                  "model.safetensors"])
def test_a_sha256_that_is_not_a_file_and_64_hex_digits_is_refused_whatever_the_cache_holds(item, tmp_path, monkeypatch,
                                                                                         capsys):
    """Checked before the cache is looked at: a directory fetched and checked before does not let a bad list pass."""
    fm = _fetcher()
    dest, _, argv = s3_cache(tmp_path, monkeypatch)
    assert fm.main(argv) == 0 and (dest / ".verified").is_file()
    capsys.readouterr()
    assert fm.main(argv + ["--sha256", item]) == 1
    assert capsys.readouterr().err == f"fetch_model: --sha256 {item}: expected FILE=<64 hex digits>\n"


def test_the_users_sha256_is_compared_with_the_hubs_listing_before_anything_is_downloaded(hub, tmp_path):
    right, wrong = sha(FILES["model.safetensors"]), "0" * 64
    r, dest = fetch_hf(hub, tmp_path, f"model.safetensors={wrong.upper()}")
    assert r.returncode == 1 and r.stderr == (f"fetch_model: model.sha256.model.safetensors: {wrong.upper()} but "
                                              f"the Hub lists {right} at {REPO_ID}@{hub.COMMIT}\n"), r.stderr
    assert downloads(hub) == [] and not dest.exists()
    r, dest = fetch_hf(hub, tmp_path, f"model.safetensors={right}", "extra.bin=" + "1" * 64)
    assert r.returncode == 1 and r.stderr == (f"fetch_model: model.sha256.extra.bin: not in the Hub's listing at "
                                              f"{REPO_ID}@{hub.COMMIT}\n"), r.stderr
    assert downloads(hub) == [] and not dest.exists()
    r, dest = fetch_hf(hub, tmp_path, f"model.safetensors={right.upper()}")   # hex in either case
    assert r.returncode == 0, r.stderr
    assert json.loads((dest / ".verified").read_text())["files"]["model.safetensors"] == f"sha256:{right}"


def test_the_users_sha256_of_a_file_the_hub_lists_by_blob_id_is_checked_on_the_download(hub, tmp_path):
    """config.json is kept outside LFS: the Hub lists its git blob id, which the user's sha256 cannot be compared
    with before the download; the download is checked against both."""
    right = sha(FILES["config.json"])
    r, dest = fetch_hf(hub, tmp_path, "config.json=" + "c" * 64)
    assert r.returncode == 1 and r.stderr == (f"fetch_model: config.json: sha256 {right} but {'c' * 64} was expected "
                                              f"(corrupt or changed at the source)\n"), r.stderr
    assert not dest.exists()
    r, dest = fetch_hf(hub, tmp_path, f"config.json={right}")
    assert r.returncode == 0, r.stderr
    files = json.loads((dest / ".verified").read_text())["files"]
    assert files["config.json"] == f"sha256:{right}" and files["tokenizer.json"].startswith("git-sha1:")
    # the same list finds it checked; a wrong one is refused, not served. A sha256 added for a file the record holds
    # by its blob id is checked on the file itself
    assert "nothing to do" in fetch_hf(hub, tmp_path, f"config.json={right}")[0].stdout
    tokenizer = f"tokenizer.json={sha(FILES['tokenizer.json'])}"
    assert "nothing to do" in fetch_hf(hub, tmp_path, f"config.json={right}", tokenizer)[0].stdout
    r, _ = fetch_hf(hub, tmp_path, "tokenizer.json=" + "d" * 64)
    assert r.returncode == 1 and f"{dest} was checked against git-sha1:" in r.stderr, r.stderr
    r, _ = fetch_hf(hub, tmp_path, "config.json=" + "c" * 64)
    assert r.returncode == 1 and r.stderr.startswith(f"fetch_model: model.sha256.config.json: {'c' * 64}, but {dest} "
                                                     f"was checked against sha256:{right}: "), r.stderr


def test_a_model_directory_is_reused_only_when_checked_against_the_hashes_asked_now(tmp_path, monkeypatch, capsys):
    fm = _fetcher()
    dest, partial, argv = s3_cache(tmp_path, monkeypatch)
    dest.mkdir(parents=True)
    (dest / "model.safetensors").write_bytes(FILES["model.safetensors"])   # right bytes, but never checked here
    assert fm.main(argv) == 1
    assert capsys.readouterr().err == (f"fetch_model: {dest}: exists without a .verified record "
                                       f"(not a checked fetch): remove it\n")
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors"] and partial.is_dir()
    (dest / "model.safetensors").unlink()                                    # an empty directory is nothing yet
    assert fm.main(argv) == 0 and (dest / ".verified").is_file() and not partial.exists()
    capsys.readouterr()
    other = sha(b"another checkpoint")
    assert fm.main(argv + ["--sha256", f"model.safetensors={other}"]) == 1
    assert capsys.readouterr().err == (
        f"fetch_model: model.sha256.model.safetensors: {other}, but {dest} was checked against "
        f"sha256:{sha(FILES['model.safetensors'])}: another checkpoint needs another revision or URI "
        f"(or remove {dest})\n")
    assert fm.main(argv + ["--sha256", f"generation_config.json={other}"]) == 1
    assert "generation_config.json: " in capsys.readouterr().err
    for text, why in (("{}", "KeyError: 'files'"), ('{"files": []}', "AttributeError: 'list' object has no "
                                                                        "attribute 'items'"), ("{", "JSONDecodeError")):
        (dest / ".verified").write_text(text)                                # not a record this script wrote
        assert fm.main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"fetch_model: {dest / '.verified'}: not a fetch record ({why}") and \
            err.endswith(f"): remove {dest}\n") and err.count("\n") == 1, err


def test_a_rename_that_fails_publishes_nothing_and_says_so(tmp_path):
    """A real rename onto a directory that is not empty (ENOTEMPTY): an error, not exit 0 with nothing published;
    where the directory holds another pod's checked fetch, this pod drops its own copy."""
    fm = _fetcher()
    partial, dest = tmp_path / ".partial" / "gemma-0", tmp_path / "gemma"
    for d in (partial, dest):
        d.mkdir(parents=True)
    (partial / "config.json").write_bytes(FILES["config.json"])
    (dest / "stray").write_text("?")
    with pytest.raises(fm.FetchError, match=rf"^{dest}: the checked download cannot be renamed there "
                                            r"\(Directory not empty\); nothing was published$"):
        fm.publish(partial, dest, {"files": {}})
    assert (partial / "config.json").is_file() and not (dest / ".verified").exists()
    (dest / ".verified").write_text('{"files": {}}')                          # another pod won the race
    fm.publish(partial, dest, {"files": {}})
    assert not partial.exists() and sorted(p.name for p in dest.iterdir()) == [".verified", "stray"]
