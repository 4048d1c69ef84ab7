"""What a pushed image is, bound to what proves it: registry digest, the key wheels (sha256, every file checked
against the image), the SASS/PTX in every shared library of the CUDA wheels, ptxas for sm_75, the project commit.

    python -m benchmarks.build_evidence.image_proof 127.0.0.1:5055/g5g-images:jax-g4dn --dists jax jaxlib jax-cuda13-plugin \
        jax-cuda13-pjrt --cuobjdump-dists jax-cuda13-plugin jax-cuda13-pjrt --ptxas \
        --build-log build/logs/bake-….log --json benchmarks/results/g4dn_jax_image.json

- **digest**: read from the registry (`build.py inspect`'s code, HTTP backend), with the per-platform coverage our
  labels claim. The image run below is the registry's, pinned by that digest.
- **wheels**: for each of `--dists`, the image's own Python (no network) reports version, wheel tags and RECORD;
  the same wheel is downloaded here with pip (this machine's index configuration; `--wheel-cache`), its sha256
  taken, and every file its RECORD lists must be in the image with the same sha256 (pip leaves them untouched).
- **cuobjdump**: every .so of `--cuobjdump-dists`, copied out of the image, through `cuobjdump --list-elf` and
  `--list-ptx` (an x86_64 cuobjdump reads an aarch64 ELF as well). An error other than "does not contain device
  code" is fatal; each library with device code must cover `--arch` (SASS for it, or PTX at or below it), unless
  `--allow-uncovered LIB=REASON` names it (the reason goes into the report).
- **ptxas** (`--ptxas`): XLA compiles its fusions to PTX and hands them to ptxas for the GPU it finds. jax tells
  XLA where (`jax._src.lib.cuda_path`, passed as `--xla_gpu_cuda_data_dir`; recorded with its libdevice); that
  directory's `bin/ptxas` (the nvidia-cuda-nvcc wheel) is run in the image on a small PTX kernel for `--arch`, and
  the cubin it writes is read back with cuobjdump.

Exit 0 when everything was proven, 1 when a check failed (the JSON says which), 2 for bad input. Needs Docker
(`DOCKER_HOST`), pip, and cuobjdump (`--cuobjdump PATH`, default: the nvidia-cuda-cuobjdump wheel installed with
pip under .cache/tools/). Runs a foreign platform's image under QEMU.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

from benchmarks.build_evidence.provenance import ROOT, git_state, revision_label, run
from benchmarks.build_evidence.vllm_build_report import stage_times
from g5g import archlist, registry
from g5g.errors import UserError

CUOBJDUMP_VERSION = "13.4.92"  # nvidia-cuda-cuobjdump, the g4dn profile's pin
NO_DEVICE_CODE = "does not contain device code"

# Run by the image's own python3 (network off): the distributions as installed, and where ptxas is.
PROBE = r"""
import glob, importlib.metadata as md, json, os, sys, sysconfig
names = json.loads(sys.argv[1])
out = {"python": sys.version.split()[0], "purelib": sysconfig.get_paths()["purelib"], "dists": {},
       "installed": sorted(f"{d.metadata['Name']}=={d.version}" for d in md.distributions())}
for name in names:
    try:
        d = md.distribution(name)
    except md.PackageNotFoundError:
        out["dists"][name] = None
        continue
    tags = [l.split(":", 1)[1].strip() for l in (d.read_text("WHEEL") or "").splitlines() if l.startswith("Tag:")]
    out["dists"][name] = {"name": d.metadata["Name"], "version": d.version, "tags": tags,
                          "root": str(d.locate_file("")),
                          "record": [[str(f), f.hash.value if f.hash else None] for f in d.files or []]}
out["ptxas"] = sorted(glob.glob(os.path.join(out["purelib"], "nvidia", "**", "bin", "ptxas"), recursive=True))
if "jax" in names and out["dists"].get("jax"):
    try:  # the CUDA directory jax hands XLA (--xla_gpu_cuda_data_dir): XLA runs its bin/ptxas, links nvvm/libdevice
        from jax._src import lib
        cuda = lib.cuda_path
        out["xla_cuda_data_dir"] = {"path": cuda, "ptxas": bool(cuda) and os.path.exists(f"{cuda}/bin/ptxas"),
                                    "libdevice": sorted(glob.glob(f"{cuda}/nvvm/libdevice/*.bc")) if cuda else []}
    except Exception as e:
        out["xla_cuda_data_dir"] = {"error": repr(e)[:300]}
print(json.dumps(out))
"""

# A kernel that stores its thread index: enough for ptxas to emit SASS for the target.
PTX = """.version {ptx_isa}
.target sm_{sm}
.address_size 64
.visible .entry g5g_probe(.param .u64 out)
{{
  .reg .b32 %r<2>;
  .reg .b64 %rd<4>;
  ld.param.u64 %rd1, [out];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u32 %r1, %tid.x;
  mul.wide.u32 %rd3, %r1, 4;
  add.s64 %rd2, %rd2, %rd3;
  st.global.u32 [%rd2], %r1;
  ret;
}}
"""


# -- pure parts ------------------------------------------------------------------------------------------------

def parse_cuobjdump(stdout: str, stderr: str, rc: int) -> list[str]:
    """`cuobjdump --list-elf|--list-ptx` output → the arch of each embedded file, e.g. ["sm_75", "sm_80"].
    No device code → []. Any other failure raises (an unreadable library must not pass as "no SASS")."""
    if rc != 0:
        if NO_DEVICE_CODE in stderr or NO_DEVICE_CODE in stdout:
            return []
        raise RuntimeError(f"cuobjdump failed (exit {rc}): {(stderr or stdout).strip()[:300]}")
    archs = []
    for line in stdout.splitlines():
        if m := re.search(r"(?:ELF|PTX) file\s+\d+:\s+\S*?\.(sm_\d+[af]?)\.(?:cubin|ptx)\s*$", line):
            archs.append(m.group(1))
        elif line.strip():
            raise RuntimeError(f"unexpected cuobjdump line: {line.strip()[:200]}")
    return archs


def library_entry(sass: list[str], ptx: list[str], arch: str) -> dict:
    """One library's arch lists (sorted, with counts) and whether code for `arch` is there."""
    def counted(names: list[str]) -> dict[str, int]:
        return {a: names.count(a) for a in sorted(set(names), key=lambda a: archlist.sort_key(a_cc(a)))}
    entry = {"sass": counted(sass), "ptx": counted(ptx)}
    if not sass and not ptx:
        return entry | {"device_code": False, "covered": None}
    parsed = archlist.parse(" ".join(sass + [p.replace("sm_", "compute_") for p in ptx]))
    cov = archlist.coverage(parsed, arch)
    return entry | {"device_code": True, "covered": cov.covered, "covered_by": cov.how}


def judge(rel: str, entry: dict, allowed: dict[str, str], arch: str) -> str | None:
    """The failure for a library with device code but none for `arch`, unless its file name is allowed (then the
    reason is kept in its entry)."""
    if entry.get("covered") is not False:
        return None
    if reason := allowed.get(Path(rel).name):
        entry["allowed_uncovered"] = reason
        return None
    return f"{rel} has device code but none for {arch}"


def a_cc(name: str) -> str:
    """sm_75 → 7.5, sm_100a → 10.0a."""
    m = re.fullmatch(r"sm_(\d+)(\d)([af]?)", name)
    return f"{m[1]}.{m[2]}{m[3]}" if m else "0.0"


def wheel_record(whl: Path) -> list[list[str | None]]:
    """A wheel's RECORD as [path, sha256 in RECORD's urlsafe-base64 form or None]."""
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1)
        rows = z.read(name).decode().splitlines()
    out = []
    for row in rows:
        if not row.strip():
            continue
        path, digest, _ = row.rsplit(",", 2)
        path = path.strip('"')
        out.append([path, digest.split("=", 1)[1] if digest.startswith("sha256=") else None])
    return out


def compare_records(wheel: list, installed: list) -> dict:
    """Every hashed file of the wheel must be in the image with the same hash (the image may have more: .pyc,
    INSTALLER, console scripts; the wheel's RECORD itself is rewritten by pip and has no hash)."""
    have = {p: h for p, h in installed}
    hashed = [(p, h) for p, h in wheel if h]
    missing = [p for p, _ in hashed if p not in have]
    differ = [p for p, h in hashed if p in have and have[p] != h]
    return {"files_checked": len(hashed), "missing": missing[:20], "differ": differ[:20],
            "missing_count": len(missing), "differ_count": len(differ), "ok": not missing and not differ}


def pip_platform_args(tags: list[str], python: str) -> list[str]:
    """WHEEL tags (cp313-cp313-manylinux_2_27_x86_64, py3-none-any) and the image's Python (3.13.5) → pip
    download's target arguments (the Python version matters for a pure wheel too: Requires-Python)."""
    interp, abi, _ = tags[0].split("-")
    major_minor = ".".join(python.split(".")[:2])
    args = ["--only-binary=:all:", "--no-deps", "--python-version", major_minor]
    if interp.startswith("cp"):
        args += ["--implementation", "cp", "--abi", abi]
    for plat in sorted({t.split("-")[2] for t in tags} - {"any"}):
        args += ["--platform", plat]
    return args


# -- against the image -----------------------------------------------------------------------------------------

def docker_run(image: str, platform: str, argv: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    return run(["docker", "run", "--rm", "--network", "none", "--platform", platform, "--entrypoint", argv[0],
                image, *argv[1:]], timeout=timeout)


def copy_out(container: str, path: str, dest: Path) -> Path:
    """One file out of a created container (docker cp streams a tar)."""
    data = subprocess.run(["docker", "cp", f"{container}:{path}", "-"], capture_output=True, check=True,
                          timeout=1800).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        member = next(m for m in tar.getmembers() if m.isfile())
        out = dest / Path(path).name
        out.write_bytes(tar.extractfile(member).read())
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(info: dict, python: str, cache: Path) -> Path:
    """The wheel the image installed, fetched with pip (the index this machine is configured with)."""
    name, version, tags = info["name"], info["version"], info["tags"]
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for whl in cache.glob(f"{stem}-{version}-*.whl"):
        if _tags_of(whl) == set(tags):
            return whl
    cp = run([sys.executable, "-m", "pip", "download", "-q", "-d", str(cache), *pip_platform_args(tags, python),
              f"{name}=={version}"], timeout=3600)
    if cp.returncode != 0:
        raise RuntimeError(f"pip download {name}=={version} failed: {cp.stderr.strip()[-400:]}")
    for whl in cache.glob(f"{stem}-{version}-*.whl"):
        if _tags_of(whl) == set(tags):
            return whl
    raise RuntimeError(f"pip download {name}=={version}: no wheel with the image's tags {tags} in {cache}")


def _tags_of(whl: Path) -> set[str]:
    """The expanded tag set of a wheel file name (compressed tags: cp313-cp313-manylinux_2_27_x86_64.manylinux…)."""
    interp, abi, plat = whl.stem.split("-")[-3:]
    return {f"{i}-{a}-{p}" for i in interp.split(".") for a in abi.split(".") for p in plat.split(".")}


def cuobjdump_library(cuobjdump: str, path: Path, arch: str) -> dict:
    lists = {}
    for flag, key in (("--list-elf", "sass"), ("--list-ptx", "ptx")):
        cp = run([cuobjdump, flag, str(path)], timeout=600)
        lists[key] = parse_cuobjdump(cp.stdout, cp.stderr, cp.returncode)
    return library_entry(lists["sass"], lists["ptx"], arch) | {"bytes": path.stat().st_size,
                                                               "sha256": sha256_file(path)}


def ensure_cuobjdump(path: str | None) -> str:
    if path:
        return path
    target = ROOT / ".cache" / "tools" / f"cuobjdump-{CUOBJDUMP_VERSION}"
    exe = target / "nvidia" / "cu13" / "bin" / "cuobjdump"
    if not exe.exists():
        cp = run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
                  f"nvidia-cuda-cuobjdump=={CUOBJDUMP_VERSION}"])
        if cp.returncode != 0 or not exe.exists():
            raise UserError(f"cannot install nvidia-cuda-cuobjdump=={CUOBJDUMP_VERSION}: {cp.stderr[-300:]} "
                            "(pass --cuobjdump PATH)")
    return str(exe)


def ptxas_check(image: str, platform: str, ptxas: str, cuobjdump: str, arch: str, work: Path) -> dict:
    """The image's ptxas compiles a kernel for `arch`; the cubin is read back with cuobjdump."""
    sm = arch.replace(".", "")
    ptx = PTX.format(ptx_isa="8.0", sm=sm)
    script = (f"set -e; {ptxas} --version | tail -n 2; printf '%s' \"$0\" > /tmp/p.ptx; "
              f"{ptxas} -arch=sm_{sm} -o /tmp/p.cubin /tmp/p.ptx; echo CUBIN; base64 -w0 /tmp/p.cubin")
    cp = docker_run(image, platform, ["bash", "-c", script, ptx])
    if cp.returncode != 0 or "CUBIN" not in cp.stdout:
        return {"ok": False, "ptxas": ptxas, "rc": cp.returncode, "stderr": cp.stderr.strip()[-500:]}
    version, b64 = cp.stdout.split("CUBIN", 1)
    cubin = work / "probe.cubin"
    cubin.write_bytes(base64.b64decode(b64.strip()))
    dump = run([cuobjdump, "--list-elf", str(cubin)], timeout=120)
    try:
        archs = parse_cuobjdump(dump.stdout, dump.stderr, dump.returncode)
    except RuntimeError as e:
        archs = [str(e)]
    return {"ok": archs == [f"sm_{sm}"], "ptxas": ptxas, "version": version.strip().splitlines(),
            "ptx_target": f"sm_{sm}", "cubin_archs": archs, "cubin_bytes": cubin.stat().st_size}


def prove(args) -> dict:
    from g5g import inspect as g5g_inspect

    arch = archlist.target(args.arch)
    found = g5g_inspect.inspect(args.image, arch=arch, backend="http", insecure=args.insecure)
    ref = registry.parse_reference(args.image)
    pinned = f"{ref.registry}/{ref.repository}@{found['digest']}"
    platforms = [args.platform] if args.platform else sorted(found["platforms"])
    report: dict = {"image": args.image, "digest": found["digest"], "pinned": pinned,
                    "project": git_state(args.build_commit), "arch": arch, "inspect": found["platforms"],
                    "platforms": {}, "failures": []}
    if args.build_log:
        log = Path(args.build_log).read_text(errors="replace")
        report["build"] = {"log": str(args.build_log), "stages": stage_times(log)}
    if args.build_wall_s or args.build_command:
        report.setdefault("build", {}).update(
            {k: v for k, v in (("wall_s", args.build_wall_s), ("command", args.build_command)) if v})
    allowed = dict(a.split("=", 1) for a in args.allow_uncovered)
    if allowed:
        report["allowed_uncovered"] = allowed
    cuobjdump = ensure_cuobjdump(args.cuobjdump)
    report["cuobjdump"] = run([cuobjdump, "--version"]).stdout.strip().splitlines()[-1:]
    cache = Path(args.wheel_cache)
    cache.mkdir(parents=True, exist_ok=True)
    for plat in platforms:
        t0 = time.perf_counter()
        pulled = run(["docker", "pull", "-q", "--platform", plat, pinned], timeout=3600)
        if pulled.returncode != 0:
            raise UserError(f"docker pull {pinned} ({plat}): {pulled.stderr.strip()[-300:]}")
        if not args.build_commit and (label := revision_label(pinned)):  # the commit build.py labelled it with
            report["project"] = git_state(label.removesuffix("-dirty")) | {"revision_label": label}
        names = sorted(set(args.dists) | set(args.cuobjdump_dists))
        cp = docker_run(pinned, plat, ["python3", "-c", PROBE, json.dumps(names)])
        if cp.returncode != 0:
            raise UserError(f"probing {pinned} ({plat}) failed: {cp.stderr.strip()[-400:]}")
        probe = json.loads(cp.stdout)
        out: dict = {"python": probe["python"], "installed": probe["installed"], "wheels": {}, "libraries": {}}
        for name in names:
            if probe["dists"][name] is None:
                report["failures"].append(f"{plat}: {name} is not installed in the image")
        for name in args.dists:
            info = probe["dists"].get(name)
            if not info:
                continue
            try:
                whl = download_wheel(info, probe["python"], cache)
            except RuntimeError as e:
                report["failures"].append(f"{plat}: {name}: {e}")
                continue
            check = compare_records(wheel_record(whl), info["record"])
            out["wheels"][name] = {"version": info["version"], "file": whl.name, "sha256": sha256_file(whl),
                                   "bytes": whl.stat().st_size, "tags": info["tags"], "record": check}
            if not check["ok"]:
                report["failures"].append(f"{plat}: {name}: the image's files differ from {whl.name}")
        container = run(["docker", "create", "--platform", plat, pinned]).stdout.strip()
        try:
            with tempfile.TemporaryDirectory(dir=ROOT / ".cache") as tmp:
                work = Path(tmp)
                for name in args.cuobjdump_dists:
                    info = probe["dists"].get(name)
                    for rel, _ in (info or {}).get("record", []):
                        if not re.search(r"\.so(\.\d+)*$", rel):
                            continue
                        lib = copy_out(container, f"{info['root'].rstrip('/')}/{rel}", work)
                        try:
                            entry = cuobjdump_library(cuobjdump, lib, arch)
                        except RuntimeError as e:
                            entry = {"error": str(e)}
                            report["failures"].append(f"{plat}: {rel}: {e}")
                        lib.unlink()
                        out["libraries"][rel] = entry | {"dist": name}
                        if failed := judge(rel, out["libraries"][rel], allowed, arch):
                            report["failures"].append(f"{plat}: {failed}")
                if "xla_cuda_data_dir" in probe:
                    out["xla_cuda_data_dir"] = probe["xla_cuda_data_dir"]
                if args.ptxas:
                    xla = probe.get("xla_cuda_data_dir") or {}
                    ptxas = f"{xla['path']}/bin/ptxas" if xla.get("ptxas") else (probe["ptxas"] or [None])[0]
                    if not ptxas:
                        report["failures"].append(f"{plat}: no ptxas under site-packages/nvidia")
                    else:
                        out["ptxas"] = ptxas_check(pinned, plat, ptxas, cuobjdump, arch, work)
                        out["ptxas"]["found"] = probe["ptxas"]
                        if not out["ptxas"]["ok"]:
                            report["failures"].append(f"{plat}: ptxas did not compile for {arch}")
        finally:
            run(["docker", "rm", "-f", container])
        if not any(e.get("covered") for e in out["libraries"].values()) and args.cuobjdump_dists:
            report["failures"].append(f"{plat}: no library carries code for {arch}")
        out["proof_wall_s"] = round(time.perf_counter() - t0, 1)
        report["platforms"][plat] = out
    if args.smoke:
        smoke = json.loads(args.smoke.read_text())
        report["smoke"] = smoke
        if smoke.get("image") != pinned:
            report["failures"].append(f"the smoke report is for {smoke.get('image')}, not {pinned}")
        elif not smoke.get("ok"):
            report["failures"].append(f"the smoke test failed: {smoke.get('reason')}")
    report["ok"] = not report["failures"]
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("image", help="a pushed image, e.g. 127.0.0.1:5055/g5g-images:jax-g4dn")
    ap.add_argument("--dists", nargs="+", default=[], help="distributions whose wheels are checked")
    ap.add_argument("--cuobjdump-dists", nargs="*", default=[], help="distributions whose .so files are listed")
    ap.add_argument("--ptxas", action="store_true", help="compile a kernel for --arch with the image's ptxas")
    ap.add_argument("--arch", default="7.5")
    ap.add_argument("--allow-uncovered", nargs="*", default=[], metavar="LIB=REASON",
                    help="a library (file name) allowed to lack code for --arch, with the reason (recorded)")
    ap.add_argument("--platform", help="only this platform (default: every platform of the image)")
    ap.add_argument("--cuobjdump", help=f"cuobjdump binary (default: nvidia-cuda-cuobjdump {CUOBJDUMP_VERSION})")
    ap.add_argument("--wheel-cache", default=str(ROOT / ".cache" / "wheels"))
    ap.add_argument("--build-log", help="build.py's bake log: per-stage times go into the report")
    ap.add_argument("--build-commit", help="the commit the image was built from (checked: which image inputs "
                    "changed since; default: the image's org.opencontainers.image.revision label)")
    ap.add_argument("--build-command", help="the command that built the image, recorded as given")
    ap.add_argument("--build-wall-s", type=float, help="the build command's wall time, recorded as given")
    ap.add_argument("--smoke", type=Path, help="a `build.py smoke IMAGE --json` report to keep with the proof "
                    "(smoke the pinned reference this script prints, so the report names the digest)")
    ap.add_argument("--insecure", action="store_true", help="plain HTTP to a non-loopback registry")
    ap.add_argument("--json", type=Path, help="write the report here")
    a = ap.parse_args(argv)
    if any("=" not in x or not x.split("=", 1)[1].strip() for x in a.allow_uncovered):
        print("image_proof: --allow-uncovered takes LIB=REASON (the reason is recorded)", file=sys.stderr)
        return 2
    try:
        report = prove(a)
    except (UserError, archlist.ArchError) as e:
        print(f"image_proof: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    for plat, p in report["platforms"].items():
        print(f"{report['pinned']} {plat}")
        for name, w in p["wheels"].items():
            print(f"  wheel {w['file']} sha256 {w['sha256'][:16]}… files {w['record']['files_checked']} "
                  f"{'match' if w['record']['ok'] else 'DIFFER'}")
        for rel, e in p["libraries"].items():
            if e.get("device_code"):
                print(f"  {rel}: sass {' '.join(e['sass']) or '-'}; ptx {' '.join(e['ptx']) or '-'}; "
                      f"{arch_word(e)}" + (f" (allowed: {e['allowed_uncovered']})" if "allowed_uncovered" in e else ""))
        if "ptxas" in p:
            print(f"  ptxas {p['ptxas'].get('ptxas')}: cubin {p['ptxas'].get('cubin_archs')}")
    for f in report["failures"]:
        print(f"FAILED: {f}", file=sys.stderr)
    return 0 if report["ok"] else 1


def arch_word(entry: dict) -> str:
    return f"covered by {entry['covered_by']}" if entry.get("covered") else "NOT covered"


if __name__ == "__main__":
    sys.exit(main())
