"""What one real vLLM image build proves: stage times, the slowest translation units, the SASS in every .so, and
the image itself (import, our Triton attention kernel compiled for sm_75 inside it), bound to what it proves: the
project commit, the wheel's sha256, the external sources used and the image digest.

    python -m benchmarks.build_evidence.vllm_build_report --log build/logs/bake-….log --report DIR --image REF \
        [--build-commit SHA] [--sdist-tree .cache/src/vllm-0.33.0] [--json benchmarks/results/g4dn-vllm-build.json]

DIR is the `vllm-report` stage exported after the build (cached, so instant):
    docker buildx bake -f build/docker-bake.json --set vllm.target=vllm-report \
        --set vllm.output=type=local,dest=DIR vllm
The bake log is the plain-progress log build.py writes under <out>/logs/. Prints a Markdown report; --json keeps
the figures. Docker is driven as argv lists; nothing here needs a GPU.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.build_evidence.provenance import ROOT, git_state, revision_label

STEP = re.compile(r"^#(\d+) \[(?:(\S+) )?(\S+) +(\d+)/(\d+)\] (.*)$")  # "#23 [vllm toolchain 1/6] RUN …", "#13 [vllm torch-base  4/10] …"
DONE = re.compile(r"^#(\d+) DONE ([\d.]+)s$")
CACHED = re.compile(r"^#(\d+) CACHED$")


def _events(log: str):
    """(bake, step id, match) for every step, DONE and CACHED line. build.py logs its build and push bakes into one
    file and BuildKit numbers each bake's steps from #1 again, so a step is known by its bake and number."""
    bake = 0
    for line in log.splitlines():
        if line.startswith("#0 building with "):
            bake += 1
        for kind, rx in (("step", STEP), ("done", DONE), ("cached", CACHED)):
            if m := rx.match(line):
                yield kind, (bake, m.group(1)), m
                break


def stage_times(log: str) -> dict[str, dict]:
    """Per Dockerfile stage: wall seconds summed over its steps (as BuildKit timed them) and steps cached."""
    steps: dict[tuple, str] = {}
    out: dict[str, dict] = defaultdict(lambda: {"wall_s": 0.0, "steps": 0, "cached": 0})
    for kind, key, m in _events(log):
        if kind == "step":
            steps[key] = f"{m.group(2) or ''}/{m.group(3)}".lstrip("/")
        elif kind == "done" and key in steps:
            s = out[steps[key]]
            s["wall_s"] = round(s["wall_s"] + float(m.group(2)), 1)
            s["steps"] += 1
        elif kind == "cached" and key in steps:
            out[steps[key]]["cached"] += 1
    return dict(out)


def step_times(log: str) -> list[dict]:
    """Every step BuildKit ran or found cached, in log order: bake, stage, step, the command's start, seconds (None:
    cached)."""
    steps: dict[tuple, dict] = {}
    for kind, key, m in _events(log):
        if kind == "step":
            steps.setdefault(key, {"bake": key[0], "stage": f"{m.group(2) or ''}/{m.group(3)}".lstrip("/"),
                                   "step": f"{m.group(4)}/{m.group(5)}", "cmd": m.group(6)[:100],
                                   "wall_s": None, "cached": False})
        elif kind == "done" and key in steps:
            steps[key]["wall_s"] = float(m.group(2))
        elif kind == "cached" and key in steps:
            steps[key]["cached"] = True
    return [s for s in steps.values() if s["wall_s"] is not None or s["cached"]]


def rehearsal(report_dir: Path, build_log: str) -> dict | None:
    """A rehearsal's sample (build.py --rehearse; dockerfiles/rehearse-cmake.sh): the objects compiled after the full
    configure, how many CUDA objects the configured build has, the sample's wall time, cuobjdump's ELF listing of
    each object and what the logs (bake's and the wheel build's) say about the rehearsal. None for a real build."""
    d = report_dir / "rehearsal"
    if not d.is_dir():
        return None
    sample = dict(ln.split(None, 1) for ln in (d / "sample.txt").read_text().splitlines() if ln.strip())
    listing = d / "cuobjdump-list.txt"
    return {"objects": sorted(p.name for p in (d / "objects").glob("*.o")),
            "cuda_objects_in_build": int(sample["cuda_objects_in_build"]),
            "sample_wall_s": int(sample["sample_wall_s"]),
            "cuobjdump_list_elf": listing.read_text().splitlines() if listing.is_file() else None,
            "log": list(dict.fromkeys(t for ln in build_log.splitlines()
                                      if (t := re.sub(r"^#\d+ [\d.]+ ", "", ln).strip())
                                      and re.match(r"(REHEARSAL[: ]|rehearsal: )", t)))}


def ninja_units(ninja_log: str) -> list[dict]:
    """Every edge of ninja's log (v5+: start end mtime output hash), latest run of each output, slowest first."""
    units: dict[str, float] = {}
    for line in ninja_log.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        start, end, _, output, *_ = line.split("\t")
        units[output] = (int(end) - int(start)) / 1000
    return [{"output": o, "seconds": round(s, 1)} for o, s in sorted(units.items(), key=lambda kv: -kv[1])]


def sass_lines(cuobjdump_txt: str) -> list[dict]:
    """check-sass.sh's lines (`F sass: sm_75 ptx: none`, `F: no device code`); the older `ptx: N` form too."""
    out = []
    for line in cuobjdump_txt.splitlines():
        if m := re.match(r"^(\S+) sass: (.*) ptx: (.*)$", line):
            sass, ptx = m.group(2).split(), m.group(3).strip()
            out.append({"so": m.group(1).removeprefix("./"), "sass": [] if sass == ["none"] else sass,
                        "ptx": int(ptx) if ptx.isdigit() else (0 if ptx == "none" else len(ptx.split()))})
        elif m := re.match(r"^(\S+): no device code$", line):
            out.append({"so": m.group(1).removeprefix("./"), "sass": [], "ptx": 0})
    return out


def ccache_stats(text: str) -> dict:
    """`ccache --show-stats --verbose` after the build: its first Cacheable/Hits/Misses lines (the totals) as
    [count, of], and the whole listing."""
    out: dict = {"lines": [ln.rstrip() for ln in text.splitlines() if ln.strip()]}
    for ln in text.splitlines():
        m = re.match(r"\s*(Cacheable calls|Hits|Misses):\s+(\d+) / +(\d+)", ln)
        if m:
            out.setdefault(m[1].lower().replace(" ", "_"), [int(m[2]), int(m[3])])
    return out


def provenance(report_dir: Path, image: str | None, build_commit: str | None = None) -> dict:
    """What the report is bound to: this checkout's commit (with the commit the image was built from, which image
    inputs changed between the two), the wheel's sha256, the external sources used (the vllm-sources context's
    SOURCES.json, when the build had one) and the image's digest."""
    label = revision_label(image) if image else None
    state = git_state(build_commit or (label.removesuffix("-dirty") if label else None))
    out: dict = {"project_commit": state.pop("commit"), "project_dirty": state.pop("image_inputs_dirty"), **state}
    if label:
        out["revision_label"] = label
    wheels = report_dir / "wheels.sha256"
    out["wheels"] = {Path(f).name: h for h, f in (ln.split() for ln in wheels.read_text().splitlines() if ln.strip())} \
        if wheels.is_file() else None
    sources = report_dir / "SOURCES.json"
    out["sources"] = json.loads(sources.read_text()) if sources.is_file() else None
    if image:
        d = docker("image", "inspect", "--format", "{{json .}}", image)
        info = json.loads(d.stdout) if d.returncode == 0 else {}
        out["image"] = {"ref": image, "id": info.get("Id"), "repo_digests": info.get("RepoDigests")}
    return out


def docker(*argv: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *argv], capture_output=True, text=True, timeout=timeout)


def image_checks(image: str, sdist_tree: Path | None) -> dict:
    """Run the image as a user would, no GPU: import, the CLI, and our kernel compiled for sm_75 by its own Triton."""
    out: dict = {"image": image}
    size = docker("image", "inspect", "--format", "{{.Size}}", image)
    out["image_bytes"] = int(size.stdout.strip()) if size.returncode == 0 else None
    imp = docker("run", "--rm", "--entrypoint", "python3", image, "-c",
                 "import torch, triton, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, "
                 "'triton', triton.__version__, 'cuda', torch.version.cuda)")
    out["import"] = {"rc": imp.returncode, "stdout": imp.stdout.strip(), "stderr_tail": imp.stderr[-800:]}
    # No `vllm serve --help`: without a GPU it fails in NVML ("Failed to infer device type") and proves nothing. The
    # build itself loads _C_stable_libtorch and _moe_C_stable_libtorch with every symbol bound (vllm stage).
    if sdist_tree:
        site = docker("run", "--rm", "--entrypoint", "python3", image, "-c",
                      "import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))").stdout.strip()
        probe = docker("run", "--rm", "--entrypoint", "python3",
                       "-v", f"{ROOT / 'tools'}:/probe:ro", "-v", f"{sdist_tree.resolve()}:/unpatched:ro",
                       "-e", "TRITON_CACHE_DIR=/tmp/triton", image,
                       "/probe/vllm_attn_probe.py", "--unpatched", "/unpatched", "--patched", site, timeout=1800)
        try:
            out["attn_probe"] = json.loads(probe.stdout)
        except json.JSONDecodeError:
            out["attn_probe"] = {"rc": probe.returncode, "stdout_tail": probe.stdout[-800:],
                                 "stderr_tail": probe.stderr[-1500:]}
    return out


def markdown(r: dict) -> str:
    lines = ["## vLLM image build report" + (" (rehearsal: build.py --rehearse)" if r.get("rehearsal") else ""), ""]
    if r.get("bakes", 0) > 1:
        lines += [f"Summed over the log's {r['bakes']} bakes (build.py's build, then its push).", ""]
    lines += ["| stage | wall (s) | steps run | cached |", "|---|---:|---:|---:|"]
    for name, s in sorted(r["stages"].items(), key=lambda kv: -kv[1]["wall_s"]):
        lines.append(f"| {name} | {s['wall_s']} | {s['steps']} | {s['cached']} |")
    lines += ["", f"vllm-build: {r['build_times']}", "", "Architectures CMake reported:", ""]
    lines += [f"    {a}" for a in r["arch_lines"]]
    n = r["ninja"]
    lines += ["", f"ninja: {n['units']} edges, {n['sum_s']} s summed, {n['fa_units']} under vllm-flash-attn/; "
              "the 20 slowest:", "", "| s | output |", "|---:|---|"]
    lines += [f"| {u['seconds']} | `{u['output']}` |" for u in n["slowest"]]
    if reh := r.get("rehearsal"):
        lines += ["", f"Rehearsal: {len(reh['objects'])} sampled objects of the build's {reh['cuda_objects_in_build']} "
                  f"CUDA objects, compiled in {reh['sample_wall_s']} s after the full configure; cuobjdump --list-elf:",
                  "", "```", *(reh["cuobjdump_list_elf"] or []), "```", "", "What the log says:", "", "```",
                  *reh["log"], "```"]
    what = "the sampled objects" if r.get("rehearsal") else "every .so in the wheel"
    lines += ["", f"cuobjdump over {what}:", "", "| file | SASS | ptx |", "|---|---|---:|"]
    lines += [f"| `{s['so']}` | {' '.join(s['sass']) or 'none'} | {s['ptx']} |" for s in r["sass"]]
    if c := r.get("ccache"):
        hits, misses = (c.get("hits") or ["?", "?"]), (c.get("misses") or ["?", "?"])
        lines += ["", f"ccache's counters after the build (its cache mount persists; the counters add up every build "
                  f"since the cache was created): {hits[0]} hits, {misses[0]} misses of {hits[1]} cacheable calls"]
    if r.get("image_checks"):
        lines += ["", "```", json.dumps(r["image_checks"], indent=1)[:4000], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", type=Path, required=True, help="the bake's plain-progress log")
    ap.add_argument("--report", type=Path, required=True, help="the exported vllm-report stage")
    ap.add_argument("--image", help="the built vllm image, to run the in-image checks")
    ap.add_argument("--sdist-tree", type=Path, help="vLLM's sdist, unpacked: the probe's unpatched reference")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--build-commit", help="the commit the image was built from (recorded with the image inputs that "
                    "changed since; default: the --image's org.opencontainers.image.revision label)")
    a = ap.parse_args(argv)
    build_log = (a.report / "build.log").read_text(errors="replace")
    units = ninja_units((a.report / "ninja_log").read_text())
    log = a.log.read_text(errors="replace")
    r = {
        "stages": stage_times(log),
        "bakes": sum(ln.startswith("#0 building with ") for ln in log.splitlines()),
        "steps": step_times(log),
        "build_times": " ".join((a.report / "times.txt").read_text().split()),
        "arch_lines": sorted({ln.split("] ", 1)[-1].strip() for ln in build_log.splitlines()
                              if re.search(r"-- CUDA (supported )?target architectures:", ln)}),
        "ninja": {"units": len(units), "sum_s": round(sum(u["seconds"] for u in units), 1),
                  "fa_units": sum("vllm-flash-attn" in u["output"] for u in units), "slowest": units[:20]},
        "sass": sass_lines((a.report / "cuobjdump.txt").read_text()),
        "rehearsal": rehearsal(a.report, log + "\n" + build_log),
        "ccache": ccache_stats(ccache.read_text()) if (ccache := a.report / "ccache.txt").is_file() else None,
    }
    r["provenance"] = provenance(a.report, a.image, a.build_commit)
    if a.image:
        r["image_checks"] = image_checks(a.image, a.sdist_tree)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(r, indent=2) + "\n")
    sys.stdout.write(markdown(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
