"""What patch 0002 saves, measured: FlashAttention's translation units in a 7.5 build without the patch.

    python benchmarks/fa_compile_share.py --bake build/docker-bake.json --vllm-ninja-log DIR/ninja_log \
        [--fa-mirror /work/.mirror/vllm-project+flash-attention/repo] [--sample 4] [--json FILE]

Method. In the image's own `vllm-source` stage (vLLM 0.33.0 with both patches, the g4dn toolchain), vLLM's CMake
is configured exactly as setup.py does for TORCH_CUDA_ARCH_LIST=7.5, but with VLLM_SKIP_FLASH_ATTN=0 (patch 0002's
override: FA's CMake project is added, as it is upstream). ninja then lists FA's object files, a seeded random sample
of FA2's, of FA3's and of vLLM's own CUDA units is compiled with the flags FA's CMake gives them (`ninja -j 2 <objects>`, as the real build ran, no ccache), and
each unit's time is read from ninja's log. FA's cost = mean unit time × its number of units, per extension;
vLLM's own cost = the sum over the real build's ninja log, scaled by how the sampled vLLM units' times here compare
with theirs in that build (so both sides count under the same load). FA's sources: the newest tree
the mirror holds (the commit 0.33.0 pins was not reachable here), its CUTLASS submodule at the commit it records.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import vllm_sources  # noqa: E402
from vllm_build_report import ninja_units  # noqa: E402

IMAGE = "g5g-local/vllm-source:g4dn"
INSIDE = r"""
set -euo pipefail
cd /src/vllm
python3 tools/use_existing_torch.py --prefix >/dev/null
pip install -q -r requirements/build/cuda.txt
. /vllm-sources/env.sh
export VLLM_FLASH_ATTN_SRC_DIR=/fa VLLM_SKIP_FLASH_ATTN=0 TORCH_CUDA_ARCH_LIST=7.5
cmake -S /src/vllm -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVLLM_TARGET_DEVICE=cuda \
  -DVLLM_PYTHON_EXECUTABLE="$(command -v python3)" -DNVCC_THREADS=1 > /out/configure.log 2>&1 \
  || { tail -n 40 /out/configure.log >&2; exit 1; }
grep -E "CUDA (target|supported) arch" /out/configure.log | sort -u > /out/archs.txt || true
ninja -C /tmp/b -t targets all | cut -d: -f1 | grep -E 'vllm-flash-attn/.*\.cu\.o$' | sort > /out/fa_objects.txt
ninja -C /tmp/b -t targets all | cut -d: -f1 | grep -E '^CMakeFiles/_(moe_)?C_stable_libtorch.dir/.*\.cu\.o$' | sort > /out/vllm_objects.txt
python3 - "$SAMPLE" "$SEED" <<'PY' > /out/sample.txt
import random, sys
objs = open("/out/fa_objects.txt").read().split(); own = open("/out/vllm_objects.txt").read().split()
fa2 = [o for o in objs if "/csrc/flash_attn/" in o]; fa3 = [o for o in objs if "/hopper/" in o]
rng = random.Random(int(sys.argv[2])); n = int(sys.argv[1])
print("\n".join(rng.sample(fa2, min(n, len(fa2))) + rng.sample(fa3, min(n, len(fa3))) + rng.sample(own, min(n, len(own)))))
PY
ninja -C /tmp/b -j 2 $(cat /out/sample.txt) > /out/ninja.out 2>&1 || { tail -n 60 /out/ninja.out >&2; exit 1; }
cp /tmp/b/.ninja_log /out/fa_ninja_log
"""


def fa_tree(mirror: Path, cutlass_mirror: Path, dest: Path) -> dict:
    """FA's newest mirrored tree with its CUTLASS submodule filled in; returns the commits used."""
    head = subprocess.run(["git", "-C", str(mirror), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if not dest.exists():
        vllm_sources._git_tree(mirror, head, dest)
    link = subprocess.run(["git", "-C", str(mirror), "ls-tree", head, "csrc/cutlass"], capture_output=True, text=True,
                          check=True).stdout.split()[2]
    if not (dest / "csrc" / "cutlass" / "include").exists():
        missing = vllm_sources._git_tree(cutlass_mirror, link, dest / "csrc" / "cutlass")
        if missing is None:
            raise SystemExit(f"CUTLASS {link} (FA's submodule) is not in {cutlass_mirror}")
    return {"flash_attention": head, "cutlass_submodule": link}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bake", type=Path, default=ROOT / "build/docker-bake.json")
    ap.add_argument("--vllm-ninja-log", type=Path, required=True, help="ninja_log of the real build (vllm-report)")
    ap.add_argument("--fa-mirror", type=Path, default=Path("/work/.mirror/vllm-project+flash-attention/repo"))
    ap.add_argument("--cutlass-mirror", type=Path, default=Path("/work/.mirror/NVIDIA+cutlass/repo"))
    ap.add_argument("--sources", type=Path, default=ROOT / ".cache/vllm-sources/0.33.0")
    ap.add_argument("--sample", type=int, default=3, help="units per FA extension")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ca-cert", type=Path, default=Path("/etc/ssl/certs/ca-certificates.crt"),
                    help="CA bundle for pip inside the container (where a proxy re-signs TLS)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    work = ROOT / ".cache" / "fa-share"
    out = work / "out"
    out.mkdir(parents=True, exist_ok=True)
    commits = fa_tree(a.fa_mirror, a.cutlass_mirror, work / "fa")
    subprocess.run(["docker", "buildx", "bake", "-f", str(a.bake), "--set", "vllm.target=vllm-source",
                    "--set", f"vllm.tags={IMAGE}", "--set", "vllm.output=type=docker", "vllm"], check=True, cwd=ROOT)
    ca = ["-v", f"{a.ca_cert}:/ca.pem:ro", "-e", "PIP_CERT=/ca.pem"] if a.ca_cert.is_file() else []
    subprocess.run(["docker", "run", "--rm", "-e", f"SAMPLE={a.sample}", "-e", f"SEED={a.seed}", *ca,
                    "-v", f"{a.sources.resolve()}:/vllm-sources:ro", "-v", f"{(work / 'fa').resolve()}:/fa:ro",
                    "-v", f"{out.resolve()}:/out", "--entrypoint", "bash", IMAGE, "-c", INSIDE], check=True)
    fa_objects = (out / "fa_objects.txt").read_text().split()
    sampled = {u["output"]: u["seconds"] for u in ninja_units((out / "fa_ninja_log").read_text())}
    vllm_units = ninja_units(a.vllm_ninja_log.read_text())
    vllm_s = sum(u["seconds"] for u in vllm_units)
    r: dict = {"method": __doc__.split("Method. ", 1)[1].strip(), "commits": commits,
               "archs": (out / "archs.txt").read_text().splitlines(),
               "vllm_units": len(vllm_units), "vllm_unit_seconds": round(vllm_s, 1), "fa": {}}
    for ext, marker in (("fa2", "/csrc/flash_attn/"), ("fa3", "/hopper/")):
        objs = [o for o in fa_objects if marker in o]
        times = [s for o, s in sampled.items() if marker in o]
        mean = sum(times) / len(times) if times else 0.0
        r["fa"][ext] = {"units": len(objs), "sampled": len(times), "sample_seconds": times,
                        "mean_s": round(mean, 1), "estimated_s": round(mean * len(objs))}
    real = {u["output"]: u["seconds"] for u in vllm_units}
    own = [(s, real[o]) for o, s in sampled.items() if o in real]
    r["load_factor"] = round(sum(s for s, _ in own) / sum(t for _, t in own), 3) if own else 1.0
    r["vllm_units_sampled"] = [{"here_s": s, "in_build_s": t} for s, t in own]
    vllm_s = vllm_s * r["load_factor"]  # vLLM's own units, as long as they take under this run's load
    r["vllm_unit_seconds_at_this_load"] = round(vllm_s, 1)
    fa_s = sum(v["estimated_s"] for v in r["fa"].values())
    r["fa_share_of_unpatched_build"] = round(fa_s / (fa_s + vllm_s), 3) if fa_s + vllm_s else None
    r["unpatched_over_patched"] = round((fa_s + vllm_s) / vllm_s, 2) if vllm_s else None
    if a.json:
        a.json.write_text(json.dumps(r, indent=2) + "\n")
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
