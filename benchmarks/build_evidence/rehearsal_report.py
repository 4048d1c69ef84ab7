"""What a `build.py --rehearse` run proved, stage by stage, bound to what it ran on.

    python -m benchmarks.build_evidence.rehearsal_report --bake-log build/logs/bake-….log [--bake-log …] \
        [--resolve aarch64-resolve.json] [--report DIR --report-log LOG] [--base-image REF] [--input FILE…] \
        [--previous benchmarks/results/g5g_rehearsal.json] \
        --json benchmarks/results/g5g_rehearsal.json [--md benchmarks/results/g5g_rehearsal.md]

--bake-log: each attempt's plain BuildKit log (build.py writes them under <out>/logs/), in order: every step with its
time or "cached", the lines that prove something (nvcc's version, check-sass.sh's verdicts, CMake's arch lines, the
rehearsal's own lines), the wheels pip took for the platform, and the error the attempt stopped on.
--resolve: `pip install --dry-run --report` of the runtime stage's requirement set for the target platform.
--report/--report-log: a rehearsal's exported vllm-report stage and its bake log (vllm_build_report).
--input: files the run used (wheels, sdists), recorded by sha256. Nothing here needs Docker but --base-image.
--previous: an earlier report of this tool (its logs may be gone): its attempts come first, each still with the
commit it ran at, and what this run does not give anew (resolution, vLLM report, inputs, bases) is kept.
--discovery NAME=LOG: the torch-discovery stage's CMake output (PyTorch's CUDA discovery, torch's own modules), one
per platform or environment; with --discovery-note NAME=TEXT saying how it ran.
--headers NAME=LOG: the torch-headers stage's log (dockerfiles/check-headers.py: torch's wheel headers that name NVIDIA
library headers, compiled by nvcc), one per platform or recipe variant; with --headers-note NAME=TEXT.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.build_evidence import vllm_build_report as vbr
from benchmarks.build_evidence.image_proof import sha256_file as sha256

PROOF = re.compile(r"(Cuda compilation tools|sass: |no device code|CUDA (supported )?target architectures|REHEARSAL|"
                   r"rehearsal:|arch list:|Successfully installed|No space left|Could not find a version|"
                   r"built for|vllm [0-9.]+ torch|Segmentation fault|MIDR_EL1|uncaught target signal|^loaded lib|^QEMU_CPU=|"
                   r"^== qemu|^import ok|every DT_NEEDED|not found)")
WHEEL = re.compile(r"Downloading (\S+\.whl) \(([\d.]+ [kMG]B)\)")
# What PyPI's torch CMake modules (and the NCCL lookup) say they found or not, in the torch-discovery stage's output.
DISCOVERY = re.compile(r"(g5g discovery:|torch discovery:|Found CUDA|Found CUDNN|Could NOT find|Cannot find|Turning the "
                       r"option off|NCCL_VERSION_CODE|PyTorch: CUDA|Added CUDA NVCC flags|compiler identification)")


def discovery(log: str) -> dict:
    """The torch-discovery lines that prove something, and whether the stage passed (its own last line)."""
    lines = [re.sub(r"^#\d+ [\d.]+ ", "", ln).strip() for ln in log.splitlines()]
    proof = [ln[:300] for ln in lines if DISCOVERY.search(ln)]
    return {"lines": proof, "passed": any(ln.startswith("torch discovery: every library") for ln in lines)}


def header_stage(log: str) -> dict:
    """The torch-headers lines that prove something (what was included or skipped, nvcc's command, its verdict and
    fatal errors), and whether the stage passed (check-headers.py's own last line)."""
    lines = [re.sub(r"^#\d+ [\d.]+ ", "", ln).rstrip() for ln in log.splitlines()]
    proof = [ln[:400] for ln in lines if ln.startswith("check-headers:") or "fatal error" in ln]
    verdict = next((ln for ln in reversed(proof) if " compiled (" in ln or "FAILED" in ln), None)
    return {"lines": proof, "passed": bool(verdict and " compiled (" in verdict), "verdict": verdict}


def steps(log: str) -> list[dict]:
    """Every step BuildKit started: done (its time), cached, or stopped (error/canceled: seconds it had run)."""
    out: dict[str, dict] = {}
    for line in log.splitlines():
        if m := vbr.STEP.match(line):
            out.setdefault(m.group(1), {"stage": f"{m.group(2) or ''}/{m.group(3)}".lstrip("/"),
                                        "step": f"{m.group(4)}/{m.group(5)}", "cmd": m.group(6)[:100],
                                        "status": "started", "wall_s": None})
        elif (m := re.match(r"^#(\d+) (DONE ([\d.]+)s|CACHED|ERROR|CANCELED)", line)) and m.group(1) in out:
            st = out[m.group(1)]
            st["status"] = m.group(2).split()[0].lower()
            if m.group(3):
                st["wall_s"] = float(m.group(3))
        elif (m := re.match(r"^#(\d+) ([\d.]+) ", line)) and m.group(1) in out and out[m.group(1)]["status"] == "started":
            out[m.group(1)]["wall_s"] = float(m.group(2))  # still running: the last time it printed
    return [s for s in out.values() if s["status"] != "started" or s["wall_s"] is not None]


def attempt(log_path: Path) -> dict:
    """One bake: its steps, the lines that prove something, the wheels pip downloaded, the error it stopped on."""
    log = log_path.read_text(errors="replace")
    proof, seen = [], set()
    for line in log.splitlines():
        m = re.match(r"^#\d+ [\d.]+ (.*)$", line)
        if m and PROOF.search(m.group(1)) and (text := m.group(1).strip()[:300]) not in seen:
            proof.append(text)
            # A line repeats once per probe section ("== …" headers): the same result under each variant.
            seen = set() if text.startswith("== ") else seen | {text}
    return {"log": log_path.name, "steps": steps(log), "stages": vbr.stage_times(log), "proof": proof,
            "wheels_downloaded": sorted({f"{w} ({s})" for w, s in WHEEL.findall(log)}),
            "error": next((ln.strip()[:400] for ln in reversed(log.splitlines()) if ln.startswith("ERROR:")), None)}


def resolution(path: Path) -> dict:
    """pip's --dry-run --report: how many distributions, which files for the platform, the newest manylinux tag."""
    r = json.loads(path.read_text())
    files = sorted(i["download_info"]["url"].rsplit("/", 1)[-1] for i in r["install"])
    tags = [tuple(map(int, t)) for f in files for t in re.findall(r"manylinux_(\d+)_(\d+)_", f)]
    return {"distributions": len(files), "needs_glibc": "%d.%d" % max(tags) if tags else None,
            "sdists": [f for f in files if not f.endswith(".whl")], "files": files}


def markdown(r: dict) -> str:
    out = [f"# {r['title']}", "", f"Project commit `{r['provenance']['project_commit']}`"
           f"{' (dirty)' if r['provenance'].get('project_dirty') else ''}; images built FROM: "
           + ", ".join(f"`{b['ref']}` `{b['id']}`" for b in r["base_images"]) + "; inputs (sha256): "
           + ", ".join(f"`{k}` `{v}`" for k, v in r["inputs"].items()) + ".", ""]
    for i, a in enumerate(r["attempts"], 1):
        at = f" (commit `{a['project_commit'][:12]}`{', ' + a['note'] if a.get('note') else ''})" \
            if a.get("project_commit") else ""
        out += [f"## Attempt {i}: `{a['log']}`{at}", "", "| stage | step | s | command |", "|---|---|---:|---|"]
        for s in a["steps"]:
            t = s["wall_s"] if s["status"] == "done" else f"{s['status']} {s['wall_s'] or ''}".strip()
            if not s["stage"].endswith("internal"):
                out.append(f"| {s['stage']} | {s['step']} | {t} | `{s['cmd'][:70].replace('|', '/')}` |")
        out += ["", "What it printed that proves something:", "", "```", *a["proof"], "```"]
        if a["wheels_downloaded"]:
            out += ["", f"Wheels pip took for the platform ({len(a['wheels_downloaded'])}): "
                    + ", ".join(f"`{w}`" for w in a["wheels_downloaded"])]
        out += ["", f"Stopped on: `{a['error'][:200]}…`" if a["error"] else "Completed.", ""]
    if res := r.get("resolution"):
        out += ["## The runtime stage's requirement set, resolved for the platform", "",
                f"{res['distributions']} distributions, all wheels (sdists: {res['sdists'] or 'none'}); newest "
                f"manylinux tag needs glibc {res['needs_glibc']}.", ""]
    if v := r.get("vllm_report"):
        out += [f"## The rehearsal's vLLM stages, run to the end: {r.get('report_note') or ''}", "", vbr.markdown(v)]
    for e in r.get("earlier_vllm_reports", []):
        out += [f"## An earlier run of the rehearsal's vLLM stages: {e['note'] or ''}", "", vbr.markdown(e["report"])]
    if d := r.get("discovery"):
        out += ["## PyTorch's CUDA discovery (torch-discovery: torch 2.14.0's own CMake modules from its wheel)", ""]
        for name, e in d.items():
            out += [f"### {name}: {'passed' if e['passed'] else 'FAILED'}", "", e.get("note") or "", "", "```",
                    *e["lines"], "```", ""]
    if h := r.get("headers"):
        out += ["## The header stage (torch-headers: torch 2.14.0's wheel headers that name NVIDIA library headers, "
                "nvcc for sm_75)", ""]
        for name, e in h.items():
            out += [f"### {name}: {'passed' if e['passed'] else 'FAILED'}", "", e.get("note") or "", "",
                    f"Verdict: `{e['verdict']}`", "", "```", *e["lines"], "```", ""]
    out += ["## Not run here, and what remains", "", *[f"- {x}" for x in r.get("remaining", [])], ""]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--title", default="g5g rehearsal (build.py --runtime vllm --rehearse), linux/arm64")
    ap.add_argument("--bake-log", type=Path, action="append", default=[])
    ap.add_argument("--resolve", type=Path)
    ap.add_argument("--report", type=Path, help="a rehearsal's exported vllm-report stage")
    ap.add_argument("--report-log", type=Path, help="the bake log of --report")
    ap.add_argument("--report-note", help="where and how --report was made (platform, profile, base)")
    ap.add_argument("--base-image", action="append", default=[], help="an image the runs built FROM (repeatable)")
    ap.add_argument("--input", type=Path, action="append", default=[])
    ap.add_argument("--remaining", action="append", default=[], help="a line on what was not run (repeatable)")
    ap.add_argument("--previous", type=Path, help="an earlier report (JSON) whose attempts come first")
    ap.add_argument("--note", action="append", default=[],
                    help="one line per --bake-log, in order: how that attempt ran (e.g. its QEMU)")
    ap.add_argument("--discovery", action="append", default=[], metavar="NAME=LOG",
                    help="a torch-discovery stage's output, named by platform (repeatable)")
    ap.add_argument("--discovery-note", action="append", default=[], metavar="NAME=TEXT")
    ap.add_argument("--headers", action="append", default=[], metavar="NAME=LOG",
                    help="a torch-headers stage's log, named by platform or recipe variant (repeatable)")
    ap.add_argument("--headers-note", action="append", default=[], metavar="NAME=TEXT")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--md", type=Path)
    a = ap.parse_args(argv)
    prev = json.loads(a.previous.read_text()) if a.previous else {}
    fresh = vbr.provenance(a.report or Path("/nonexistent"), None)  # this run's commit
    # The report's provenance is its vLLM report's: kept from --previous unless a new --report replaces it.
    r: dict = {"title": a.title, "provenance": fresh if a.report or not prev else prev["provenance"]}
    r["inputs"] = {**prev.get("inputs", {}), **{p.name: sha256(p) for p in a.input}}
    new = [attempt(p) for p in a.bake_log]
    for i, at in enumerate(new):
        at["project_commit"] = fresh["project_commit"]
        if i < len(a.note):
            at["note"] = a.note[i]
    # Kept attempts ran at the earlier report's commit.
    r["attempts"] = [{"project_commit": prev["provenance"]["project_commit"], **at}
                     for at in prev.get("attempts", [])] + new
    bases = {b["ref"]: b for b in prev.get("base_images", [])}
    bases.update({ref: {"ref": ref, "id": subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref],
                                                         capture_output=True, text=True, timeout=60).stdout.strip()
                        or None} for ref in a.base_image})
    r["base_images"] = list(bases.values())
    if a.resolve:
        r["resolution"] = resolution(a.resolve)
    elif prev.get("resolution"):
        r["resolution"] = prev["resolution"]
    if a.report and a.report_log:
        build_log = (a.report / "build.log").read_text(errors="replace")
        log = a.report_log.read_text(errors="replace")
        units = vbr.ninja_units((a.report / "ninja_log").read_text())
        r["vllm_report"] = {
            "stages": vbr.stage_times(log), "steps": vbr.step_times(log),
            "build_times": " ".join((a.report / "times.txt").read_text().split()),
            "arch_lines": sorted({ln.strip() for ln in build_log.splitlines()
                                  if re.search(r"-- CUDA (supported )?target architectures:", ln)}),
            "ninja": {"units": len(units), "sum_s": round(sum(u["seconds"] for u in units), 1),
                      "fa_units": sum("vllm-flash-attn" in u["output"] for u in units), "slowest": units[:20]},
            "sass": vbr.sass_lines((a.report / "cuobjdump.txt").read_text()),
            "rehearsal": vbr.rehearsal(a.report, log + "\n" + build_log),
            "provenance": vbr.provenance(a.report, None)}
    elif prev.get("vllm_report"):
        r["vllm_report"] = prev["vllm_report"]
    r["report_note"] = a.report_note or (prev.get("report_note") if "vllm_report" in r else None)
    # A new vLLM report does not drop the earlier report's: it is kept, with its note, after the new one.
    earlier = prev.get("earlier_vllm_reports", [])
    if prev.get("vllm_report") and r.get("vllm_report") is not prev["vllm_report"]:
        earlier = [{"note": prev.get("report_note"), "report": prev["vllm_report"]}, *earlier]
    if earlier:
        r["earlier_vllm_reports"] = earlier
    for key, specs, note_specs, read in (("discovery", a.discovery, a.discovery_note, discovery),
                                          ("headers", a.headers, a.headers_note, header_stage)):
        notes = dict(n.split("=", 1) for n in note_specs)
        logs = dict(prev.get(key, {}))          # NAME=LOG: the earlier reports kept, this run's added
        for spec in specs:
            name, _, log = spec.rpartition("=")
            logs[name] = {**read(Path(log).read_text(errors="replace")), "log": Path(log).name,
                          "project_commit": fresh["project_commit"], "note": notes.get(name, "")}
        if logs:
            r[key] = logs
    r["remaining"] = a.remaining or prev.get("remaining", [])
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(r, indent=2) + "\n")
    text = markdown(r)
    if a.md:
        a.md.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
