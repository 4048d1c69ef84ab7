"""The chart's init container (model.source huggingface or s3): put a checkpoint into the cache volume once, checked.

    fetch_model.py huggingface --dest /cache/DIR --repo ORG/NAME --revision REV [--sha256 FILE=HEX ...]
    fetch_model.py s3 --dest /cache/DIR --sha256 FILE=HEX ...     (the `download` init container fetched it)

The --sha256 list is checked first (FILE=<64 hex>), and on Hugging Face against the Hub's listing before anything
is downloaded (each file named there, with the Hub's sha256 where it keeps one). A pod downloads into
/cache/.partial/<pod>, every file's hash is checked (Hugging Face: the Hub's own sha256 of each LFS file and git blob
id of the others, at the commit the revision resolved to; and the --sha256 list), then the directory is renamed to
DIR with a `.verified` record; `.partial/<pod>` directories of fetches that died (nothing written for STALE_S) are
removed first. DIR with its record, checked against the --sha256 list given now, is never fetched again: on a shared
PVC, every pod that starts after the first checked fetch reuses it (pods that start together each fetch; the first to
finish publishes, the others drop their copies). DIR without a record, or checked against other hashes, is refused.
Runs with the serving image's python3 (huggingface_hub comes with transformers and vLLM); stdlib otherwise. An error
is one line on stderr and exit 1 (the kubelet retries the init container).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

VERIFIED = ".verified"
CHUNK = 1 << 20
STALE_S = 2 * 3600   # a .partial/<pod> with nothing written for this long is a fetch that died (a live one writes)


class FetchError(Exception):
    pass


def file_digest(path: Path, kind: str) -> str:
    """sha256 of the file, or its git blob id ("git-sha1": sha1 of `blob <size>\\0` + content, what the Hub lists
    for a file kept outside LFS)."""
    h = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check(directory: Path, expected: dict[str, tuple[str, str]], complete: bool) -> dict[str, str]:
    """Every expected file is there with its digest ({file: (kind, hex)}); `complete`: and no other file. Returns
    {file: "kind:hex"} for the record."""
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    present = {n for n in present if n != VERIFIED and not n.startswith(".cache/")}  # huggingface_hub's metadata
    if not expected:
        raise FetchError("no file hashes to check against (model.sha256 is empty)")
    for name in sorted(expected):
        if name not in present:
            raise FetchError(f"{name}: missing from the download")
        kind, want = expected[name]
        got = file_digest(directory / name, kind)
        if got != want.lower():
            raise FetchError(f"{name}: {kind} {got} but {want} was expected (corrupt or changed at the source)")
    if complete and (extra := sorted(present - set(expected))):
        raise FetchError(f"{extra[0]}: downloaded but not in model.sha256 (list every file of the checkpoint)")
    return {name: f"{kind}:{want.lower()}" for name, (kind, want) in sorted(expected.items())}


def publish(partial: Path, dest: Path, record: dict) -> None:
    """The checked download becomes `dest`, atomically; a pod that lost the race drops its own copy."""
    shutil.rmtree(partial / ".cache", ignore_errors=True)   # huggingface_hub's download metadata
    (partial / VERIFIED).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    try:
        partial.rename(dest)
    except OSError as e:
        if not (dest / VERIFIED).is_file():
            raise FetchError(f"{dest}: the checked download cannot be renamed there ({e.strerror}); "
                             f"nothing was published") from None
        shutil.rmtree(partial, ignore_errors=True)


def reusable(dest: Path, own: dict[str, tuple[str, str]]) -> bool:
    """True where `dest` was fetched and checked before, against every hash the user lists now (a file the record
    holds by its git blob id is hashed again); False where there is nothing yet (absent or empty). Anything else is
    refused: files without a record are not a checked fetch, and another checkpoint is never served under these
    hashes."""
    if not (dest / VERIFIED).is_file():
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise FetchError(f"{dest}: exists without a {VERIFIED} record (not a checked fetch): remove it")
        return False
    try:
        files = json.loads((dest / VERIFIED).read_text())["files"]
        files = {str(name): str(held) for name, held in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FetchError(f"{dest / VERIFIED}: not a fetch record ({type(e).__name__}: {e}): remove {dest}") from None
    for name, (kind, want) in sorted(own.items()):
        held = files.get(name)
        if held == f"{kind}:{want.lower()}":
            continue
        if held and not held.startswith(f"{kind}:") and (dest / name).is_file() \
                and file_digest(dest / name, kind) == want.lower():
            continue
        raise FetchError(f"model.sha256.{name}: {want}, but {dest} was checked against {held or 'no such file'}: "
                         f"another checkpoint needs another revision or URI (or remove {dest})")
    return True


def sweep_partials(partials: Path, own: str, stale_s: float, now: float) -> list[str]:
    """Remove the .partial/<pod> directories that crashed fetches left on a shared cache (another pod's name each
    time: nothing else ever clears them), those with nothing written for `stale_s`; never `own`. Their names."""
    swept = []
    for d in sorted(partials.iterdir()) if partials.is_dir() else ():
        if d.name == own or not d.is_dir():
            continue
        newest = max([p.lstat().st_mtime for p in d.rglob("*")] + [d.lstat().st_mtime])
        if now - newest > stale_s:
            shutil.rmtree(d, ignore_errors=True)
            swept.append(d.name)
    return swept


def hub_expected(siblings) -> dict[str, tuple[str, str]]:
    """The Hub's hashes of a revision's files: an LFS file's sha256, another file's git blob id."""
    out = {}
    for s in siblings:
        lfs = getattr(s, "lfs", None)
        out[s.rfilename] = ("sha256", lfs.sha256) if lfs else ("git-sha1", s.blob_id)
    return out


def agree_with_hub(own: dict[str, tuple[str, str]], hub: dict[str, tuple[str, str]], at: str) -> None:
    """The user's list against the Hub's, before anything is downloaded: every file the user names is in the listing,
    with the same sha256 where the Hub keeps one (an LFS file); another file's sha256 is checked on the download."""
    for name, (_, want) in sorted(own.items()):
        if name not in hub:
            raise FetchError(f"model.sha256.{name}: not in the Hub's listing at {at}")
        kind, listed = hub[name]
        if kind == "sha256" and listed.lower() != want.lower():
            raise FetchError(f"model.sha256.{name}: {want} but the Hub lists {listed} at {at}")


def fetch_huggingface(repo: str, revision: str, partial: Path, own: dict) -> tuple[dict, dict]:
    """The revision's listing, compared with the user's hashes, then its files into `partial`. Returns the Hub's
    hashes and the record's header."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")   # a pod's log: no carriage-return bars
    from huggingface_hub import HfApi, snapshot_download

    token = os.environ.get("HF_TOKEN") or None
    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True, token=token)
        hub = hub_expected(info.siblings or [])
        agree_with_hub(own, hub, f"{repo}@{info.sha}")
        snapshot_download(repo, revision=info.sha, local_dir=str(partial), token=token)
    except FetchError:
        raise
    except Exception as e:  # huggingface_hub's errors (gated repo, no token, unknown revision, network)
        first = (str(e).strip().splitlines() or [""])[0]
        raise FetchError(f"huggingface {repo}@{revision}: {type(e).__name__}: {first}") from None
    return hub, {"source": f"hf://{repo}", "revision": revision, "commit": info.sha}


def parse_sha256(items: list[str]) -> dict[str, tuple[str, str]]:
    out = {}
    for item in items:
        name, _, digest = item.partition("=")
        if not name or len(digest) != 64 or any(c not in "0123456789abcdefABCDEF" for c in digest):
            raise FetchError(f"--sha256 {item}: expected FILE=<64 hex digits>")
        out[name] = ("sha256", digest)
    return out


def run(argv: list[str]) -> str:
    p = argparse.ArgumentParser(prog="fetch_model.py")
    p.add_argument("source", choices=["huggingface", "s3"])
    p.add_argument("--dest", required=True, type=Path)
    p.add_argument("--repo")
    p.add_argument("--revision", default="main")
    p.add_argument("--sha256", action="append", default=[])
    a = p.parse_args(argv)
    own = parse_sha256(a.sha256)   # the arguments first: a bad one is refused whatever the cache holds
    if a.source == "huggingface" and not a.repo:
        raise FetchError("huggingface: --repo is required")
    pod = os.environ.get("POD", "local")
    partial = a.dest.parent / ".partial" / pod
    for name in sweep_partials(partial.parent, pod, STALE_S, time.time()):
        print(f"removed {partial.parent / name}: a fetch that stopped writing {STALE_S // 3600} h ago", flush=True)
    if reusable(a.dest, own):
        return f"{a.dest}: fetched and checked before ({VERIFIED}): nothing to do"
    if a.source == "huggingface":
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        hub, record = fetch_huggingface(a.repo, a.revision, partial, own)
        # every file against the Hub's hashes, and the user's where the Hub's sha256 did not already cover them
        mine = {n: h for n, h in own.items() if hub[n][0] != "sha256"}
        files = check(partial, hub, complete=True) | (check(partial, mine, complete=False) if mine else {})
    else:
        if not partial.is_dir():
            raise FetchError(f"{partial}: no download here (the download init container did not run?)")
        record, files = {"source": "s3"}, check(partial, own, complete=True)
    record["files"] = files
    a.dest.parent.mkdir(parents=True, exist_ok=True)
    publish(partial, a.dest, record)
    return f"{a.dest}: {len(files)} files checked and published"


def main(argv: list[str] | None = None) -> int:
    try:
        print(run(sys.argv[1:] if argv is None else argv), flush=True)
        return 0
    except FetchError as e:
        print(f"fetch_model: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
