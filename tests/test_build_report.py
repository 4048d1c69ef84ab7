"""benchmarks/build_evidence/vllm_build_report.py reads BuildKit's plain log, ninja's log and the build's cuobjdump
listing as they are written (the snippets below are cut from the g4dn build's own files)."""
from __future__ import annotations

from benchmarks.build_evidence import vllm_build_report as report

BAKE_LOG = """\
#14 [torch-base torch-base 3/7] RUN --mount=type=cache,target=/root/.cache/pip pip install "torch==${TORCH_VERSION}"
#14 9.973   Downloading torch-2.14.0-cp313-cp313-manylinux_2_28_x86_64.whl (554.6 MB)
#14 DONE 185.0s
#15 [vllm toolchain 2/6] RUN gcc -dumpversion
#15 CACHED
#36 [vllm vllm-build 3/6] RUN --mount=type=cache,target=/root/.cache/ccache pip wheel .
#36 DONE 3120.1s
#37 [vllm vllm-build 4/6] RUN python3 -c "print(1)"
#37 DONE 0.1s
"""

NINJA_LOG = """\
# ninja log v7
0\t58680\t0\tCMakeFiles/cumem_allocator.dir/csrc/cumem_allocator.cpp.o\tabc
120\t696020\t0\tCMakeFiles/_C_stable_libtorch.dir/csrc/quantization/w8a8/cutlass/scaled_mm_c2x.cu.o\tdef
0\t1000\t0\tCMakeFiles/_C_stable_libtorch.dir/csrc/topk.cu.o\tghi
0\t184400\t0\tCMakeFiles/_C_stable_libtorch.dir/csrc/topk.cu.o\tjkl
"""

CUOBJDUMP = """\
./vllm/_C_stable_libtorch.abi3.so sass: sm_75  ptx: 0
./vllm/cumem_allocator.abi3.so sass: none ptx: 0
./vllm/_moe_C_stable_libtorch.abi3.so sass: sm_75 ptx: none
./vllm/fs_io_C.abi3.so: no device code
"""


def test_stage_times_sum_steps_per_stage_and_count_cached():
    stages = report.stage_times(BAKE_LOG)
    assert stages["torch-base/torch-base"] == {"wall_s": 185.0, "steps": 1, "cached": 0}
    assert stages["vllm/toolchain"] == {"wall_s": 0.0, "steps": 0, "cached": 1}
    assert stages["vllm/vllm-build"] == {"wall_s": 3120.2, "steps": 2, "cached": 0}


def test_ninja_units_take_each_outputs_latest_run_slowest_first():
    units = report.ninja_units(NINJA_LOG)
    assert [u["output"].rsplit("/", 1)[-1] for u in units] == ["scaled_mm_c2x.cu.o", "topk.cu.o",
                                                               "cumem_allocator.cpp.o"]
    assert units[0]["seconds"] == 695.9 and units[1]["seconds"] == 184.4  # the rebuilt topk.cu counts once


def test_sass_lines():
    assert report.sass_lines(CUOBJDUMP) == [
        {"so": "vllm/_C_stable_libtorch.abi3.so", "sass": ["sm_75"], "ptx": 0},
        {"so": "vllm/cumem_allocator.abi3.so", "sass": [], "ptx": 0},
        {"so": "vllm/_moe_C_stable_libtorch.abi3.so", "sass": ["sm_75"], "ptx": 0},  # check-sass.sh's form
        {"so": "vllm/fs_io_C.abi3.so", "sass": [], "ptx": 0}]


def test_main_reads_vllms_arch_lines_and_binds_the_report_to_commit_wheel_and_sources(tmp_path):
    """vLLM prints "CUDA supported target architectures" (the old pattern never matched it); the report carries
    the project commit (and the one the image was built from), the wheel's sha256 and the sources the build used."""
    rep = tmp_path / "report"
    rep.mkdir()
    (rep / "build.log").write_text("#36 12.0   -- CUDA target architectures: 7.5\n"
                                   "#36 12.0   -- CUDA supported target architectures: 7.5\n")
    (rep / "ninja_log").write_text(NINJA_LOG)
    (rep / "times.txt").write_text("wall_s 3120\n")
    (rep / "cuobjdump.txt").write_text(CUOBJDUMP)
    (rep / "wheels.sha256").write_text("ab" * 32 + "  vllm-0.33.0-cp38-abi3-linux_x86_64.whl\n")
    (rep / "SOURCES.json").write_text('{"cutlass": {"ref": "v4.7.0", "from": "mirror"}}')
    log = tmp_path / "bake.log"
    log.write_text(BAKE_LOG)
    out = tmp_path / "r.json"
    assert report.main(["--log", str(log), "--report", str(rep), "--json", str(out), "--build-commit", "HEAD~1"]) == 0
    import json
    r = json.loads(out.read_text())
    assert any("CUDA supported target architectures: 7.5" in a for a in r["arch_lines"]), r["arch_lines"]
    p = r["provenance"]
    assert p["built_from"] != p["project_commit"] and isinstance(p["image_inputs_changed_since_build"], list)
    assert len(p["project_commit"]) == 40 and p["wheels"] == {"vllm-0.33.0-cp38-abi3-linux_x86_64.whl": "ab" * 32}
    assert p["sources"]["cutlass"]["ref"] == "v4.7.0"
    assert r["rehearsal"] is None and [s["wall_s"] for s in r["steps"]] == [185.0, None, 3120.1, 0.1]


def test_a_rehearsals_report_names_its_sample_and_their_cuobjdump(tmp_path):
    """build.py --rehearse leaves report/rehearsal/ (rehearse-cmake.sh + the vllm-build stage): the report says what
    was sampled, out of how many CUDA objects, and what cuobjdump listed."""
    rep = tmp_path / "report"
    (rep / "rehearsal" / "objects").mkdir(parents=True)
    (rep / "rehearsal" / "objects" / "cuda_view.cu.o").write_bytes(b"\x7fELF")
    (rep / "rehearsal" / "sample.txt").write_text("cuda_objects_in_build 78\nsample_wall_s 612\n")
    (rep / "rehearsal" / "cuobjdump-list.txt").write_text("== cuda_view.cu.o\nELF file    1: x.sm_75.cubin\n")
    (rep / "build.log").write_text("#36 9.0 REHEARSAL: vLLM's CMake configures in full\n"
                                   "#36 12.0   -- CUDA supported target architectures: 7.5\n")
    (rep / "ninja_log").write_text(NINJA_LOG)
    (rep / "times.txt").write_text("wall_s 900\n")
    (rep / "cuobjdump.txt").write_text("./cuda_view.cu.o sass: sm_75 ptx: none\n")
    log = tmp_path / "bake.log"
    log.write_text(BAKE_LOG)
    out = tmp_path / "r.json"
    assert report.main(["--log", str(log), "--report", str(rep), "--json", str(out)]) == 0
    import json
    reh = json.loads(out.read_text())["rehearsal"]
    assert reh["objects"] == ["cuda_view.cu.o"] and reh["cuda_objects_in_build"] == 78 and reh["sample_wall_s"] == 612
    assert "ELF file    1: x.sm_75.cubin" in reh["cuobjdump_list_elf"]
    assert reh["log"] == ["REHEARSAL: vLLM's CMake configures in full"]


def test_stage_times_read_steps_buildkit_pads_to_two_digits():
    """BuildKit pads the step number when a stage has 10 steps or more: "[vllm torch-base  4/10]" (two spaces)."""
    log = ("#13 [vllm torch-base  4/10] RUN pip install torch\n#13 DONE 900.5s\n"
           "#14 [vllm torch-base 10/10] RUN python3 -c 1\n#14 CACHED\n")
    assert report.stage_times(log) == {"vllm/torch-base": {"wall_s": 900.5, "steps": 1, "cached": 1}}


def test_rehearsal_report_keeps_the_steps_an_attempt_stopped_on(tmp_path):
    """benchmarks/build_evidence/rehearsal_report.py: a failed attempt's steps are in the record with how long they
    had run."""
    from benchmarks.build_evidence import rehearsal_report as rr
    log = tmp_path / "bake.log"
    log.write_text("#13 [vllm torch-base  4/10] RUN pip install torch\n#13 1184.2 Installing collected packages: x\n"
                   "#13 1657.2 ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"
                   "#13 ERROR: process \"pip install torch\" did not complete successfully: exit code: 1\n"
                   "#19 [vllm cuda-check 6/6] RUN nvcc\n#19 41.33 /tmp/cuda-check sass: sm_75 ptx: none\n#19 DONE 41.9s\n"
                   "ERROR: failed to solve: process \"pip install torch\"\n")
    a = rr.attempt(log)
    assert [(s["step"], s["status"], s["wall_s"]) for s in a["steps"]] == [("4/10", "error", 1657.2),
                                                                          ("6/6", "done", 41.9)]
    assert "/tmp/cuda-check sass: sm_75 ptx: none" in a["proof"] and a["error"].startswith("ERROR: failed to solve")
    assert any("No space left on device" in p for p in a["proof"])


def test_rehearsal_report_keeps_an_earlier_reports_attempts(tmp_path, monkeypatch):
    """--previous: the earlier report's attempts (their logs may be gone) come first, bound to the commit they ran
    at; what this run does not give anew (the resolution, the vLLM report) is kept; the new attempt has its note."""
    import json

    from benchmarks.build_evidence import rehearsal_report as rr
    prev = {"provenance": {"project_commit": "a" * 40}, "inputs": {"x.whl": "00"},
            "attempts": [{"log": "old.log", "steps": [], "proof": ["segfault"], "wheels_downloaded": [], "error": None}],
            "base_images": [{"ref": "base:arm64", "id": "sha256:1"}],
            "resolution": {"distributions": 195, "sdists": [], "needs_glibc": "2.34"},
            "vllm_report": {"stages": {}}, "report_note": "linux/amd64 natively"}
    (tmp_path / "prev.json").write_text(json.dumps(prev))
    log = tmp_path / "bake-new.log"
    log.write_text("#6 [torch-base 6/10] RUN check\n#6 1.0 == qemu cpu=default\n#6 3.1 import ok 2.14.0\n"
                   "#6 3.2 import ok 2.14.0\n#6 4.0 == qemu cpu=neoverse-n1\n#6 6.1 import ok 2.14.0\n#6 DONE 40.0s\n")
    out = tmp_path / "r.json"
    monkeypatch.setattr(rr, "markdown", lambda r: "")  # a partial record's markdown is not this test's
    assert rr.main(["--bake-log", str(log), "--previous", str(tmp_path / "prev.json"), "--note", "QEMU 10.0.2",
                    "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [a["log"] for a in r["attempts"]] == ["old.log", "bake-new.log"]
    assert r["attempts"][0]["project_commit"] == "a" * 40
    # the new attempt ran at this commit; the report's provenance (its vLLM report's) is kept without a new --report
    assert r["attempts"][1]["project_commit"] != "a" * 40 and r["provenance"]["project_commit"] == "a" * 40
    assert r["attempts"][1]["note"] == "QEMU 10.0.2" and "note" not in r["attempts"][0]
    # one result per probe section, repeated lines within one dropped
    assert r["attempts"][1]["proof"] == ["== qemu cpu=default", "import ok 2.14.0", "== qemu cpu=neoverse-n1",
                                         "import ok 2.14.0"]
    assert r["resolution"]["distributions"] == 195 and r["vllm_report"] == {"stages": {}}
    assert r["report_note"] == "linux/amd64 natively" and r["inputs"] == {"x.whl": "00"}
    assert r["base_images"] == [{"ref": "base:arm64", "id": "sha256:1"}]


def test_rehearsal_report_keeps_the_earlier_vllm_report_next_to_a_new_one(tmp_path, monkeypatch):
    """A new --report (e.g. linux/arm64 under QEMU) does not drop the earlier report's vLLM run (linux/amd64)."""
    import json

    from benchmarks.build_evidence import rehearsal_report as rr
    prev = {"provenance": {"project_commit": "a" * 40}, "attempts": [], "vllm_report": {"stages": {"old": 1}},
            "report_note": "linux/amd64 natively"}
    (tmp_path / "prev.json").write_text(json.dumps(prev))
    report = tmp_path / "report"
    report.mkdir()
    (report / "build.log").write_text("-- CUDA supported target architectures: 7.5\n")
    (report / "ninja_log").write_text("# ninja log v7\n0\t1000\t0\tCMakeFiles/x.dir/csrc/a.cu.o\tabc\n")
    (report / "cuobjdump.txt").write_text("")
    (report / "times.txt").write_text("wall_s 9\n")
    log = tmp_path / "bake.log"
    log.write_text("#6 [vllm vllm-build 3/7] RUN pip wheel .\n#6 DONE 650.8s\n")
    out = tmp_path / "r.json"
    monkeypatch.setattr(rr, "markdown", lambda r: "")  # a partial record's markdown is not this test's
    assert rr.main(["--bake-log", str(log), "--previous", str(tmp_path / "prev.json"), "--report", str(report),
                    "--report-log", str(log), "--report-note", "linux/arm64 under QEMU 10", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["report_note"] == "linux/arm64 under QEMU 10"
    assert r["vllm_report"]["arch_lines"] == ["-- CUDA supported target architectures: 7.5"]
    assert r["earlier_vllm_reports"] == [{"note": "linux/amd64 natively", "report": {"stages": {"old": 1}}}]


def test_rehearsal_report_records_torchs_cuda_discovery_per_platform(tmp_path, monkeypatch):
    """--discovery NAME=LOG: what torch's own CMake modules found or not, and whether the stage passed; kept from
    --previous, replaced per name."""
    import json

    from benchmarks.build_evidence import rehearsal_report as rr
    ok, bad = tmp_path / "ok.log", tmp_path / "bad.log"
    ok.write_text("#12 3.0 -- Found CUDNN: /usr/local/cuda/lib64/libcudnn.so\n#12 3.1 -- Detecting C compile features\n"
                  "#12 3.2 -- Looking for NCCL_VERSION_CODE - found\n"
                  "#12 3.3 torch discovery: every library torch 2.14.0's build needs was found for USE_CUDA=1\n")
    bad.write_text("-- Could NOT find CUDNN (missing: CUDNN_LIBRARY_PATH)\n  Cannot find cuDNN library.  Turning the "
                   "option off\n-- Looking for NCCL_VERSION_CODE - not found\n")
    prev = {"provenance": {"project_commit": "a" * 40}, "attempts": [],
            "discovery": {"linux/arm64": {"lines": ["old"], "passed": True, "note": "earlier"}}}
    (tmp_path / "prev.json").write_text(json.dumps(prev))
    out = tmp_path / "r.json"
    assert rr.main(["--previous", str(tmp_path / "prev.json"), "--discovery", f"linux/amd64={ok}",
                    "--discovery", f"linux/amd64, old env={bad}", "--discovery-note", "linux/amd64=host venv",
                    "--json", str(out), "--md", str(tmp_path / "r.md")]) == 0
    d = json.loads(out.read_text())["discovery"]
    assert d["linux/arm64"]["lines"] == ["old"]  # kept
    assert d["linux/amd64"]["passed"] and d["linux/amd64"]["note"] == "host venv"
    assert d["linux/amd64"]["lines"] == ["-- Found CUDNN: /usr/local/cuda/lib64/libcudnn.so",
                                         "-- Looking for NCCL_VERSION_CODE - found",
                                         "torch discovery: every library torch 2.14.0's build needs was found for "
                                         "USE_CUDA=1"]
    assert not d["linux/amd64, old env"]["passed"] and len(d["linux/amd64, old env"]["lines"]) == 3
    md = (tmp_path / "r.md").read_text()
    assert "### linux/amd64: passed" in md and "### linux/amd64, old env: FAILED" in md



def test_rehearsal_report_records_the_header_stage_per_variant(tmp_path):
    """--headers NAME=LOG: what the torch-headers stage included or skipped, nvcc's verdict, fatal errors; a stage
    that stopped on a missing header is FAILED and names it."""
    import json

    from benchmarks.build_evidence import rehearsal_report as rr
    ok, bad = tmp_path / "ok.log", tmp_path / "bad.log"
    ok.write_text("#9 1.0 check-headers: include ATen/cudnn/cudnn-wrapper.h: cudnn.h\n#9 1.1 some warning\n"
                  "#9 90.0 check-headers: 15 of torch's headers that name NVIDIA library headers compiled (3 skipped)\n")
    bad.write_text("check-headers: include torch/csrc/distributed/c10d/symm_mem/nccl_dev_cap.hpp: nccl.h nccl_device.h\n"
                   "/usr/local/cuda/include/nccl_device.h:11:10: fatal error: nccl_device/coop.h: No such file or "
                   "directory\ncheck-headers: FAILED (nvcc exit 1): fatal error: nccl_device/coop.h: No such file or "
                   "directory\n")
    out = tmp_path / "r.json"
    assert rr.main(["--headers", f"fixed={ok}", "--headers", f"old link step={bad}", "--headers-note", "fixed=Docker",
                    "--json", str(out), "--md", str(tmp_path / "r.md")]) == 0
    h = json.loads(out.read_text())["headers"]
    assert h["fixed"]["passed"] and h["fixed"]["note"] == "Docker" and len(h["fixed"]["lines"]) == 2
    assert not h["old link step"]["passed"] and "nccl_device/coop.h" in h["old link step"]["verdict"]
    md = (tmp_path / "r.md").read_text()
    assert "### fixed: passed" in md and "### old link step: FAILED" in md

CCACHE = """\
Cache directory:    /root/.cache/ccache
Config file:        /root/.cache/ccache/ccache.conf
System config file: /etc/ccache.conf
Stats updated:      Tue Dec  1 22:07:02 2026
Cacheable calls:     73 /  73 (100.0%)
  Hits:               0 /  73 ( 0.00%)
    Direct:           0
    Preprocessed:     0
  Misses:            73 /  73 (100.0%)
Successful lookups:
  Direct:             0 /  73 ( 0.00%)
  Preprocessed:       0 /  73 ( 0.00%)
Local storage:
  Cache size (GiB): 0.0 / 5.0 ( 0.91%)
  Files:            146
  Hits:               0 /  73 ( 0.00%)
  Misses:            73 /  73 (100.0%)
  Reads:            146
  Writes:           146
"""


def test_ccache_totals_are_the_first_of_each_line():
    """The g4dn build's `ccache --show-stats --verbose` (a first build: every call a miss): the totals, not the
    local-storage lines below them."""
    c = report.ccache_stats(CCACHE.replace("Hits:               0 /  73", "Hits:               5 /  73", 1))
    assert c["cacheable_calls"] == [73, 73] and c["hits"] == [5, 73] and c["misses"] == [73, 73]
    assert c["lines"][0].startswith("Cache directory:")


def test_the_push_bake_in_the_same_log_numbers_its_steps_again():
    """build.py logs its build and push bakes into one file; BuildKit numbers each from #1, so #14 of the push bake
    is another step than #14 of the build."""
    push = "#0 building with \"default\" instance using docker driver\n" \
           "#14 [vllm vllm 2/6] RUN pip install /tmp/wheels/vllm.whl\n#14 CACHED\n"
    log = "#0 building with \"default\" instance using docker driver\n" + BAKE_LOG + push
    stages = report.stage_times(log)
    assert stages["torch-base/torch-base"] == {"wall_s": 185.0, "steps": 1, "cached": 0}
    assert stages["vllm/vllm"] == {"wall_s": 0.0, "steps": 0, "cached": 1}
    steps = report.step_times(log)
    assert [(s["bake"], s["stage"], s["cached"]) for s in steps][0] == (1, "torch-base/torch-base", False)
    assert (2, "vllm/vllm", True) in [(s["bake"], s["stage"], s["cached"]) for s in steps]
