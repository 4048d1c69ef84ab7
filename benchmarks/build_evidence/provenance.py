"""Where an image and a report come from: the checkout a proof ran from, and the commit build.py labelled the image
with (image_proof and vllm_build_report both record it)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from g5g.commands.build import IMAGE_INPUTS
from g5g.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def run(argv: list[str], timeout: int = 1800, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def git_state(build_commit: str | None) -> dict:
    """The checkout this proof ran from; with the commit the image was built from, whether anything that goes into
    an image changed between the two."""
    git = ["git", "-C", str(ROOT)]
    head = run([*git, "rev-parse", "HEAD"]).stdout.strip()
    dirty = run([*git, "status", "--porcelain", "--untracked-files=no", "--", *IMAGE_INPUTS]).stdout.strip()
    out = {"commit": head, "image_inputs_dirty": bool(dirty)}
    if build_commit:
        full = run([*git, "rev-parse", "--verify", f"{build_commit}^{{commit}}"])
        if full.returncode != 0:
            raise UserError(f"build commit {build_commit}: not a commit of this repository")
        changed = run([*git, "diff", "--name-only", full.stdout.strip(), "HEAD", "--", *IMAGE_INPUTS]).stdout.split()
        out |= {"built_from": full.stdout.strip(), "image_inputs_changed_since_build": changed}
    return out


def revision_label(image: str) -> str | None:
    """The org.opencontainers.image.revision label build.py gives every image (a local image: pull it first)."""
    cp = run(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", image])
    labels = json.loads(cp.stdout or "null") if cp.returncode == 0 else None
    return (labels or {}).get("org.opencontainers.image.revision") or None
