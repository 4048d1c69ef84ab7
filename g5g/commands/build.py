"""`build.py [build] --runtime R [--push] …`: manifests → plan → files → `docker buildx bake`.

Order: validate manifests and patch digests, plan, (dry-run: print and stop), preflight checks, our patches
against the pinned vLLM (g5g.patches), write the files, bake. Exit codes: 0 built, 1 a build failed, 2 bad input.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from g5g import REPO_ROOT, buildx, manifest, patches, render
from g5g.console import print_table
from g5g.errors import FAILED, OK, UserError
from g5g.plan import Plan, make_plan

CA_ENV = ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "PIP_CERT")

console = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def ca_cert_path(flag: str | None, environ: dict[str, str] | None = None) -> str | None:
    """--ca-cert, else the first of REQUESTS_CA_BUNDLE / SSL_CERT_FILE / PIP_CERT that is set."""
    environ = os.environ if environ is None else environ
    source, path = "--ca-cert", flag
    if not path:
        source, path = next(((k, environ[k]) for k in CA_ENV if environ.get(k)), ("", None))
    if path and not Path(path).is_file():
        raise UserError(f"{source} {path}: CA bundle file not found")
    return str(Path(path).resolve()) if path else None


def secrets(ca_cert: str | None, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """BuildKit secrets: the CA bundle (id ca-cert) and the Hugging Face token (id hf-token) — never build args."""
    environ = os.environ if environ is None else environ
    out = []
    if ca_cert:
        out.append(f"id=ca-cert,src={ca_cert}")
    if environ.get("HF_TOKEN"):
        out.append("id=hf-token,env=HF_TOKEN")
    return tuple(out)


def out_dir(out: str | None) -> str:
    """--out DIR as the user means it: relative to the current directory; without it, build/ in the checkout."""
    return str(Path(out).resolve()) if out else str(REPO_ROOT / "build")


# What build.py turns into an image: templates and their scripts, manifests, patches, the serving code, the generator.
IMAGE_INPUTS = ("dockerfiles", "manifests", "patches", "serving", "g5g", "pyproject.toml")


def git_revision(root: Path) -> str | None:
    """The checkout's commit, "-dirty" when a tracked image input differs from it (git describe's convention); None
    outside git (or without git). It becomes the images' org.opencontainers.image.revision label, which proofs and
    reports read back."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    except FileNotFoundError:
        return None
    if head.returncode != 0:
        return None
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                            *IMAGE_INPUTS], capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("-dirty" if dirty else "")


def plan_from_args(args, push: bool = False, with_secrets: bool = True) -> Plan:
    mdir = Path(args.manifests) if args.manifests else REPO_ROOT / "manifests"
    rehearse = getattr(args, "rehearse", False)
    m = manifest.load(mdir, profile=args.profile, overrides=args.overrides, rehearse=rehearse)
    manifest.check_patch_digests(m, REPO_ROOT)
    sec = secrets(ca_cert_path(getattr(args, "ca_cert", None))) if with_secrets else ()
    return make_plan(m, runtime=args.runtime, profile=args.profile, platforms=args.platform,
                     registry=args.registry, out=out_dir(getattr(args, "out", None)), push=push,
                     sequential=getattr(args, "sequential", False), secrets=sec, repo_root=REPO_ROOT,
                     cache=getattr(args, "cache", None), builder=getattr(args, "builder", None),
                     rehearse=rehearse, revision=git_revision(REPO_ROOT))


def check_patches(plan: Plan) -> None:
    """A runtime's patches must apply to its pinned sdist (the package index's, of its version pin) before hours of
    compiling start (g5g.patches, issue 3)."""
    for img in plan.images:
        if img.patch_base:  # the plan's pins (--manifests, --set)
            package, version, sha256 = img.patch_base
            patches.check_apply([(p["path"], p["sha256"]) for p in img.patches], version, sha256, package)


def check_contexts(plan: Plan, repo_root: Path) -> None:
    """A build context a manifest names (the profile's local wheels directory) must exist, or bake fails with a
    context error."""
    for img in plan.all_images:
        if img.context and not (repo_root / img.context).is_dir():
            pins = ", ".join(f"{k} {v}" for k, v in img.upstream.items())
            raise UserError(f"{img.context_origin}: {img.context}/ not found in {repo_root} (the build context of the "
                            f"{img.runtime} image: {pins})")


def print_plan(plan: Plan) -> None:
    t = Table(title=f"Plan · profile {plan.profile.name}", show_lines=False)
    for col in ("image", "tags", "platforms", "upstream", "stages"):
        t.add_column(col)
    files = render.render(plan)
    for img in plan.images:
        # the Dockerfile's stages in build order (the header stage, the compile, the checks' stages)
        stages = re.findall(r"^FROM \S+ AS (\S+)$", files[img.dockerfile], re.M)
        t.add_row(img.runtime, "\n".join(img.tags), ",".join(img.platforms),
                  " ".join(f"{k}={v}" for k, v in img.upstream.items()), " ".join(stages))
    print_table(console, t)
    for argv in plan.commands():
        console.print("$ " + " ".join(argv), markup=False, soft_wrap=True)


def run(args) -> int:
    plan = plan_from_args(args, push=args.push)
    if args.dry_run:
        if args.json:
            print(json.dumps(plan.to_json(), indent=2))
        else:
            print_plan(plan)
        return OK
    check_contexts(plan, REPO_ROOT)
    buildx.require(buildx.preflight(plan.images[0].platforms, plan.images[0].tags[0].rsplit("/", 1)[0]
                                    if plan.push else None, plan.sequential, plan.builder))
    if not args.skip_patch_check:
        check_patches(plan)
    render.write(plan, REPO_ROOT)
    return execute(plan, REPO_ROOT, as_json=args.json)


def execute(plan: Plan, repo_root: Path, as_json: bool = False) -> int:
    out = repo_root / plan.out
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_path = out / "logs" / f"bake-{stamp}.log"
    meta_rel = f"{plan.out}/logs/bake-{stamp}.metadata.json"
    known = {i.target for i in plan.all_images}
    state = {i.target: "waiting" for i in plan.images}
    started = time.monotonic()

    def table() -> Table:
        t = Table.grid(padding=(0, 2))
        for name, s in state.items():
            t.add_row(f"[bold]{name}[/]", s[:110])
        return t

    rc = 0
    with Live(table(), console=err, refresh_per_second=4, transient=False) as live:
        def on_event(target: str, text: str) -> None:
            if target in state:
                state[target] = f"building {escape(text)}"
                live.update(table())

        for argv in plan.commands(metadata=meta_rel):
            targets = [a for i, a in enumerate(argv) if a in known and argv[i - 1] != "--builder"]
            rc = buildx.run_bake(argv, repo_root, log_path, targets, on_event)
            if rc != 0:
                break
        for name in state:
            state[name] = "[green]done[/]" if rc == 0 else "[red]failed or not built[/]"
        live.update(table())
    digests = buildx.read_metadata(repo_root / meta_rel)
    error = buildx.last_error(log_path) if rc else ""
    result = {"ok": rc == 0, "pushed": plan.push and rc == 0, "log": str(log_path), "error": error,
              "seconds": round(time.monotonic() - started, 1),
              "images": [{"runtime": i.runtime, "tags": list(i.tags), "digest": digests.get(i.target, "")}
                         for i in plan.images]}
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        t = Table(title="Built" if rc == 0 else "Build failed")
        for col in ("image", "tags", "digest"):
            t.add_column(col)
        for img in result["images"]:
            t.add_row(img["runtime"], "\n".join(img["tags"]), img["digest"] or "-")
        print_table(console, t)
        if error:
            err.print(f"[bold red]build failed:[/] {escape(error)}", markup=True, highlight=False)  # pip's extras []
        console.print(f"log: {log_path}" + ("" if rc == 0 else f" (docker buildx bake exited {rc})"))
        if plan.push and rc != 0:
            console.print("nothing was pushed: the push runs only after every image built")
    return OK if rc == 0 else FAILED
