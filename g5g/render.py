"""Render the plan into files: build/<runtime>/Dockerfile (+ the files each build context needs) and docker-bake.json.

`render(plan)` is pure (returns text); `write(plan, repo_root)` puts the files on disk. Every build context is a
self-contained directory under the output dir (`build/vllm/` holds its Dockerfile and our patches, `build/jax/` its
Dockerfile and serving/), so no build sends the whole repository to the builder.
"""
from __future__ import annotations

import json
import posixpath
import shutil
from pathlib import Path, PurePosixPath

import jinja2

from g5g import REPO_ROOT
from g5g.plan import ImagePlan, Plan

TEMPLATES = REPO_ROOT / "dockerfiles"


def _env(plan: Plan) -> jinja2.Environment:
    """Templates from the manifests' repository first (a new runtime's template), then ours (the shared macros)."""
    loader = jinja2.FileSystemLoader([d for d in (plan.templates, str(TEMPLATES)) if d])
    return jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)


def dockerfile(plan: Plan, image: ImagePlan) -> str:
    text = _env(plan).get_template(image.template).render(
        image=image, profile=plan.profile, requirements=image.context_vars.get("requirements", []),
        rehearse=image.context_vars.get("rehearse"))
    lines = [ln.rstrip() for ln in text.strip("\n").splitlines()]
    out: list[str] = []
    for ln in lines:  # collapse runs of blank lines left by template blocks
        if ln or (out and out[-1]):
            out.append(ln)
    return "\n".join(out) + "\n"


def context_dir(plan: Plan, image: ImagePlan) -> str:
    """The build context of an image, relative to the repo root: its own directory under the output dir, or the one
    its manifest names (the cpu torch base: the local wheels directory, too big to copy)."""
    return image.context or str(PurePosixPath(image.dockerfile).parent)


def bake(plan: Plan) -> dict:
    """docker-bake.json for every image of the profile; `contexts` link an image to the target it is built FROM."""
    targets = {}
    for img in plan.all_images:
        ctx = context_dir(plan, img)
        dockerfile_path = img.dockerfile  # relative to the context, unless --out is outside the checkout and ctx not
        if posixpath.isabs(dockerfile_path) == posixpath.isabs(ctx):
            dockerfile_path = posixpath.relpath(dockerfile_path, ctx)
        t: dict = {
            "context": ctx,
            "dockerfile": dockerfile_path,
            "target": img.target,
            "platforms": list(img.platforms),
            "tags": list(img.tags),
            "labels": dict(img.labels),
            "args": dict(img.build_args),
        }
        # Named contexts: links to other targets (not for engines without named contexts: sequential builds
        # find those by tag) and local directories (e.g. vllm-sources).
        links = {k: v for k, v in img.contexts.items() if not (v.startswith("target:") and plan.sequential)}
        if links:
            t["contexts"] = links
        targets[img.target] = t
    return {"group": {"default": {"targets": [i.target for i in plan.all_images]}}, "target": targets}


def render(plan: Plan) -> dict[str, str]:
    """Relative path -> file text, for every generated file."""
    files = {img.dockerfile: dockerfile(plan, img) for img in plan.all_images}
    files[plan.bake_file] = json.dumps(bake(plan), indent=2, sort_keys=False) + "\n"
    return files


def write(plan: Plan, repo_root: str | Path) -> list[Path]:
    """Write the rendered files under repo_root and fill each build context (its manifest's `copy`, its patches)."""
    root = Path(repo_root)
    written = []
    for rel, text in render(plan).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    for img in plan.all_images:
        ctx = root / PurePosixPath(img.dockerfile).parent
        for rel in img.copy:  # from the repository, or ours (e.g. dockerfiles/cuda-check.cu)
            src = root / rel if (root / rel).exists() else REPO_ROOT / rel
            dest = ctx / PurePosixPath(rel).name
            if src.is_dir():
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(src, dest)
        if img.patches:
            dest = ctx / "patches"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            for p in img.patches:
                shutil.copy2(root / p["path"], dest / PurePosixPath(p["path"]).name)
    return written
