"""Issue 51, item 1: the flag-set rehearsal (dockerfiles/check-flagsets.py) and the g5g host flags it proved.

The planner is called on compile_commands.json entries written here; the compiles are real (the host's gcc, and
Debian's aarch64 cross compiler where installed: `apt-get install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu`).
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from g5g import manifest
from tests.fixtures.dockerfiles import stage_runs

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "dockerfiles/check-flagsets.py"
spec = importlib.util.spec_from_file_location("check_flagsets", TOOL)
cf = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = cf                             # dataclasses look their module up
spec.loader.exec_module(cf)
CROSS = shutil.which("aarch64-linux-gnu-g++")
# The arm64 flag sets of FBGEMM (torch's third_party/fbgemm, CMakeLists.txt): its Neon and SVE targets' -march,
# compiled under its own -Werror (cmake/modules/CppLibrary.cmake).
FBGEMM_ARM64 = ["-march=armv8.2-a+fp16fml", "-march=armv8-a+sve2"]


def entry(directory, file, *args, command=False):
    e = {"directory": str(directory), "file": file}
    return {**e, "command": " ".join(args)} if command else {**e, "arguments": list(args)}


def tool(*args, cwd=None):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_entries_group_by_language_and_flags_less_their_own_files():
    """Two sources of one target are one set whatever their object, dependency file or source; another -march is
    another set; C, C++ and CUDA by suffix; our flags go right after the compiler (past a ccache launcher), each
    language its own; an assembly source is set aside, not compiled."""
    items = cf.entries(json.dumps([
        entry("/b", "/s/a.cc", "ccache", "/usr/bin/g++", "-O2", "-Werror", "-MD", "-MT", "a.o", "-MF", "a.o.d",
              "-o", "a.o", "-c", "/s/a.cc"),
        entry("/b", "../s/b.cpp", "ccache /usr/bin/g++ -O2 -Werror -MD -MTb.o -MFb.o.d -ob.o -c ../s/b.cpp",
              command=True),
        entry("/b", "/s/k.cc", "/usr/bin/g++", "-O2", "-Werror", "-march=armv8-a+sve2", "-o", "k.o", "-c", "/s/k.cc"),
        entry("/b", "/s/c.c", "/usr/bin/gcc", "-O2", "-o", "c.o", "-c", "/s/c.c"),
        entry("/b", "/s/d.cu", "/cuda/bin/nvcc", "-gencode=arch=compute_75,code=sm_75", "-x", "cu", "-c", "/s/d.cu",
              "-o", "d.o"),
        entry("/b", "/s/e.S", "/usr/bin/gcc", "-o", "e.o", "-c", "/s/e.S"),
    ]))
    sets, other = cf.plan(items, {"C": ["-mtune=x"], "CXX": ["-mtune=y"], "CUDA": ["--threads=1"]})
    assert [(s.language, s.entries, s.entry.file) for s in sets] == [
        ("CXX", 2, "/s/a.cc"), ("CXX", 1, "/s/k.cc"), ("C", 1, "/s/c.c"), ("CUDA", 1, "/s/d.cu")]
    assert sets[0].flags == ("ccache", "/usr/bin/g++", "-O2", "-Werror")
    assert sets[0].command == ("ccache", "/usr/bin/g++", "-mtune=y", "-O2", "-Werror", "-c", "/s/a.cc", "-o", cf.OUT)
    assert sets[2].command[:2] == ("/usr/bin/gcc", "-mtune=x")
    assert sets[3].command == ("/cuda/bin/nvcc", "--threads=1", "-gencode=arch=compute_75,code=sm_75", "-x", "cu",
                               "-c", "/s/d.cu", "-o", cf.OUT)
    assert [e.file for e in other] == ["/s/e.S"]
    assert cf.summary(sets, other) == ("4 flag sets (C 1, CXX 2, CUDA 1) over 5 entries; 1 entries in no language "
                                       "of ours, not compiled")


@pytest.mark.parametrize("text,says", [
    ("{not json", "not JSON"),
    ("[]", "expected a non-empty list"),
    ('[{"directory": "/b", "file": "a.c"}]', "entry 0 (a.c) has neither arguments nor a command"),
    ('[{"file": "a.c", "command": "gcc -c a.c"}]', "entry 0 lacks its directory or file"),
    ('[{"directory": "/b", "file": "a.c", "command": "gcc \'-c a.c"}]', "its command does not split"),
    ('[{"directory": "/b", "file": "a.S", "command": "gcc -c a.S"}]', "no C, C++ or CUDA entry"),
])
def test_bad_input_gets_one_line(tmp_path, text, says):
    (tmp_path / "cc.json").write_text(text)
    r = tool(tmp_path / "cc.json")
    assert r.returncode == 1 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stdout == ""


def test_missing_file_gets_one_line(tmp_path):
    r = tool(tmp_path / "nowhere.json")
    assert r.returncode == 1 and r.stderr.strip() == f"check-flagsets: {tmp_path / 'nowhere.json'}: No such file or directory"


def host_project(tmp_path: Path) -> Path:
    """A compile_commands.json of three flag sets, compiled by the host's gcc; the third is never reached when the
    second fails."""
    (tmp_path / "a.c").write_text("int a(void) { return 1; }\n")
    (tmp_path / "b.cc").write_text("int b() { return 2; }\n")
    (tmp_path / "c.cc").write_text("int c() { return 3; }\n")
    (tmp_path / "cc.json").write_text(json.dumps([
        entry(tmp_path, "a.c", "gcc", "-O2", "-Werror", "-o", "a.o", "-c", "a.c"),
        entry(tmp_path, "b.cc", "g++ -O2 -Werror -o b.o -c b.cc", command=True),
        entry(tmp_path, "c.cc", "g++", "-O1", "-o", "c.o", "-c", "c.cc"),
    ]))
    return tmp_path / "cc.json"


@pytest.mark.skipif(not shutil.which("gcc") or not shutil.which("g++"), reason="no host gcc/g++")
def test_every_set_compiles_and_the_first_error_stops_with_its_command(tmp_path):
    cc = host_project(tmp_path)
    good = tool(cc, "--cflags=-O0", "--cxxflags=-g")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "3 flag sets (C 1, CXX 2, CUDA 0) over 3 entries" in good.stdout
    assert good.stdout.count(": ok (") == 3 and "every flag set compiled with the exported flags" in good.stdout
    assert not list(tmp_path.glob("*.o"))              # the objects went to a scratch directory
    bad = tool(cc, "--cflags=-O0", "--cxxflags=-mtune=no-such-cpu")
    assert bad.returncode == 1
    assert "[1/3] C (1 entries) a.c: ok" in bad.stdout and "[2/3] CXX (1 entries) b.cc: FAILED" in bad.stdout
    assert "[3/3]" not in bad.stdout                    # stopped at the first error
    assert "g++ -mtune=no-such-cpu -O2 -Werror -c b.cc -o " in bad.stdout   # the failing command, as run
    assert "FAILED at flag set 2 of 3" in bad.stderr and "no-such-cpu" in bad.stderr


def test_plan_compiles_nothing(tmp_path):
    cc = host_project(tmp_path)
    (tmp_path / "b.cc").write_text("this is not C++\n")
    r = tool(cc, "--plan", "--cxxflags=-mtune=neoverse-n1")
    assert r.returncode == 0 and r.stdout.count(" | ") == 3 and "g++ -mtune=neoverse-n1 -O2 -Werror -c b.cc" in r.stdout


@pytest.mark.optional     # an input CI's machine may lack: the cross compiler (apt-get install g++-aarch64-linux-gnu)
@pytest.mark.skipif(not CROSS, reason="Debian's aarch64 cross compiler not installed (g++-aarch64-linux-gnu)")
@pytest.mark.parametrize("profile_flags,ok", [("-mcpu=neoverse-n1", False), (None, True)])
def test_g5g_host_flags_against_fbgemms_arm64_flag_sets(tmp_path, profile_flags, ok):
    """The refusal the review found, reproduced with FBGEMM's two arm64 -march under -Werror: the old
    `-mcpu=neoverse-n1` stops at the SVE set; the g5g profile's flags as the manifest has them (None) compile both."""
    flags = profile_flags or manifest.load(REPO / "manifests", profile="g5g").profiles["g5g"].cpu_flags
    for i, march in enumerate(FBGEMM_ARM64):
        (tmp_path / f"k{i}.cc").write_text(f"int k{i}() {{ return {i}; }}\n")
    (tmp_path / "cc.json").write_text(json.dumps([
        entry(tmp_path, f"k{i}.cc", CROSS, "-O2", "-Wall", "-Werror", march, "-o", f"k{i}.o", "-c", f"k{i}.cc")
        for i, march in enumerate(FBGEMM_ARM64)]))
    r = tool(tmp_path / "cc.json", f"--cxxflags={flags}")
    assert (r.returncode == 0) is ok, r.stdout + r.stderr
    if not ok:
        assert "[2/2] CXX (1 entries) k1.cc: FAILED" in r.stdout
        assert "conflicts with '-march=armv8-a+sve2'" in r.stdout.replace("‘", "'").replace("’", "'")


# --- the torch build's mode: ninja builds each set's object in a tree configured with our flags ----------------------

NINJA_PROJECT = """cmake_minimum_required(VERSION 3.25)
project(p CXX)
add_custom_command(OUTPUT gen.h COMMAND ${CMAKE_COMMAND} -E copy ${CMAKE_CURRENT_SOURCE_DIR}/gen.in gen.h)
add_library(a STATIC a.cc gen.h)
target_include_directories(a PRIVATE ${CMAKE_CURRENT_BINARY_DIR})
add_library(b STATIC b.cc)
target_compile_options(b PRIVATE -Werror -DB_SET)
"""


def configured(tmp_path: Path, cxxflags: str) -> Path:
    """A CMake project whose first set includes a header written at build time (as torch's ATen/ops/*.h), configured
    like the torch build's flag-set step: Ninja, compile commands exported, CXXFLAGS in the environment."""
    src, build = tmp_path / "src", tmp_path / "build"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(NINJA_PROJECT)
    (src / "gen.in").write_text("inline int gen() { return 1; }\n")
    (src / "a.cc").write_text('#include "gen.h"\n#ifndef OURS\n#error "configured without our flags"\n#endif\n'
                              "int a() { return gen(); }\n")
    (src / "b.cc").write_text('#ifdef REFUSED\n#error "b refuses REFUSED"\n#endif\nint b() { return 2; }\n')
    r = subprocess.run(["cmake", "-G", "Ninja", "-S", str(src), "-B", str(build), "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"],
                       env={**__import__("os").environ, "CXXFLAGS": cxxflags}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return build


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja") and shutil.which("g++")),
                    reason="cmake, ninja and g++ not installed")
def test_ninja_mode_builds_each_sets_object_after_its_codegen(tmp_path):
    """--ninja BUILD_DIR: each set's object is built by ninja (the generated header first), with the flags of the
    configure; compiling the entry directly, as the FBGEMM logs did, fails on the header ninja had not yet written."""
    build = configured(tmp_path, "-DOURS")
    direct = tool(build / "compile_commands.json", "--cxxflags=-DOURS")
    assert direct.returncode == 1 and "gen.h" in direct.stdout, direct.stdout
    r = tool(build / "compile_commands.json", "--ninja", build, "--cxxflags=-DOURS")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 flag sets (C 0, CXX 2, CUDA 0)" in r.stdout and r.stdout.count(": ok (") == 2
    assert "expected in the configured flags (ninja builds each set): C (nothing); CXX -DOURS" in r.stdout
    assert (build / "gen.h").is_file() and (build / "CMakeFiles/b.dir/b.cc.o").is_file()
    assert "note" not in r.stdout                        # both sets carry -DOURS
    plan = tool(build / "compile_commands.json", "--ninja", build, "--plan")
    assert f"| ninja -C {build} CMakeFiles/a.dir/a.cc.o" in plan.stdout
    # flags that a set lacks are named, not added
    r = tool(build / "compile_commands.json", "--ninja", build, "--cxxflags=-DOURS -DELSE")
    assert r.returncode == 0 and r.stdout.count("note: configured without -DELSE") == 2, r.stdout


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja") and shutil.which("g++")),
                    reason="cmake, ninja and g++ not installed")
def test_ninja_mode_stops_at_the_set_that_refuses_our_flags(tmp_path):
    build = configured(tmp_path, "-DOURS -DREFUSED")
    r = tool(build / "compile_commands.json", "--ninja", build, "--cxxflags=-DOURS -DREFUSED")
    assert r.returncode == 1, r.stdout
    assert "[1/2] CXX (1 entries)" in r.stdout and "a.cc: ok" in r.stdout
    assert "[2/2] CXX (1 entries)" in r.stdout and "b.cc: FAILED" in r.stdout
    assert "b refuses REFUSED" in r.stdout and "FAILED at flag set 2 of 2" in r.stderr


def test_ninja_mode_needs_each_entrys_object(tmp_path):
    (tmp_path / "cc.json").write_text(json.dumps([entry(tmp_path, "a.c", "gcc", "-c", "a.c")]))
    r = tool(tmp_path / "cc.json", "--ninja", tmp_path)
    assert r.returncode == 1 and r.stderr.strip() == (
        "check-flagsets: a.c: its command names no object (-o), so ninja cannot build it"), r.stderr


# --- CI's rehearsal: every flag set of FBGEMM's real configure, with the profiles' flags -----------------------------

FIXTURES = REPO / "tests/fixtures/flagsets"   # devtools/flagset_fixture.py: one entry per set, flags and file names


def fixture(tmp_path: Path, name: str, cc: str, cxx: str) -> Path:
    """The committed sets of a real FBGEMM configure (no source), an empty translation unit at each file name."""
    text = (FIXTURES / f"{name}.json").read_text()
    for k, v in {"{src}": str(tmp_path / "src"), "{build}": str(tmp_path / "build"), "{cc}": cc, "{cxx}": cxx}.items():
        text = text.replace(k, v)
    sets = json.loads(text)
    (tmp_path / "build").mkdir()
    for i, e in enumerate(sets):
        Path(e["file"]).parent.mkdir(parents=True, exist_ok=True)
        Path(e["file"]).write_text(f"int flagset_unit_{i}(void);\nint flagset_unit_{i}(void) {{ return {i}; }}\n")
    (tmp_path / "cc.json").write_text(text)
    return tmp_path / "cc.json"


@pytest.mark.optional     # an input CI's machine may lack: the cross compiler (apt-get install g++-aarch64-linux-gnu)
@pytest.mark.skipif(not CROSS, reason="Debian's aarch64 cross compiler not installed (g++-aarch64-linux-gnu)")
@pytest.mark.parametrize("profile_flags,ok", [("-mcpu=neoverse-n1", False), (None, True)])
def test_every_fbgemm_arm64_set_with_the_g5g_flags(tmp_path, profile_flags, ok):
    """FBGEMM's 8 arm64 sets (153 entries) as its configure wrote them: the g5g manifest's flags compile all of them;
    the old -mcpu stops at the SVE kernels' set (3), as benchmarks/results/g5g_flagsets_fbgemm_arm64_old_flags.log."""
    flags = profile_flags or manifest.load(REPO / "manifests", profile="g5g").profiles["g5g"].cpu_flags
    cc = fixture(tmp_path, "fbgemm_arm64", CROSS.replace("g++", "gcc"), CROSS)
    r = tool(cc, f"--cflags={flags}", f"--cxxflags={flags}")
    assert "8 flag sets (C 4, CXX 4, CUDA 0) over 8 entries" in r.stdout, r.stdout + r.stderr
    assert sum(e["entries"] for e in json.loads(cc.read_text())) == 153     # the configure's entries, one per set here
    assert (r.returncode == 0) is ok, r.stdout + r.stderr
    if ok:
        assert r.stdout.count(": ok (") == 8
    else:
        assert "[3/8] CXX (1 entries)" in r.stdout and "FbgemmFP16UKernelsSve128.cc: FAILED" in r.stdout
        assert "conflicts with '-march=armv8-a+sve2'" in r.stdout.replace("‘", "'").replace("’", "'")


@pytest.mark.optional     # x86 flags (-mavx512f …) need an x86_64 host compiler
@pytest.mark.skipif(__import__("platform").machine() != "x86_64" or not shutil.which("g++"),
                    reason="the amd64 sets need an x86_64 host gcc/g++")
def test_every_fbgemm_amd64_set_with_the_g4dn_flags(tmp_path):
    flags = manifest.load(REPO / "manifests", profile="g4dn").profiles["g4dn"].cpu_flags
    cc = fixture(tmp_path, "fbgemm_amd64", shutil.which("gcc"), shutil.which("g++"))
    r = tool(cc, f"--cflags={flags}", f"--cxxflags={flags}")
    assert r.returncode == 0 and r.stdout.count(": ok (") == 10, r.stdout + r.stderr
    assert "10 flag sets (C 4, CXX 6, CUDA 0) over 10 entries" in r.stdout
    assert sum(e["entries"] for e in json.loads(cc.read_text())) == 175
    bad = tool(cc, "--cxxflags=-march=no-such-arch")   # the sets do reach the compiler with what we add
    assert bad.returncode == 1 and "[1/10] CXX (1 entries)" in bad.stdout and "FAILED" in bad.stdout


# --- the torch build: the flag-set step before the compile, as data (profile build.flagset_check) -------------------

def torch_base(profile: str, overrides: list[str] | None = None, rehearse: bool = False):
    from g5g import render
    from g5g.plan import make_plan
    m = manifest.load(REPO / "manifests", profile=profile, overrides=overrides, rehearse=rehearse)
    plan = make_plan(m, profile=profile, rehearse=rehearse)
    files = render.render(plan)
    tb = next(i for i in plan.all_images if i.runtime == "torch-base")
    return tb, files[tb.dockerfile], files


def test_the_torch_build_checks_every_flag_set_before_its_compile():
    """g5g compiles torch: in torch-build, after the clone and torch's requirements and before `pip wheel`, a step
    configures torch in the compile step's own environment (CFLAGS/CXXFLAGS from the profile's cpu_flags, the nvcc
    flags, TORCH_BUILD_FLAGS) with compile commands exported, and builds every flag set with check-flagsets.py."""
    tb, text, _ = torch_base("g5g")
    runs = stage_runs(text, "torch-build")
    clone = next(i for i, r in enumerate(runs) if "git clone" in r and "/src/pytorch" in r)
    check = next(i for i, r in enumerate(runs) if "check-flagsets.py" in r)
    wheel = next(i for i, r in enumerate(runs) if "pip wheel" in r)
    assert clone < check < wheel
    step, compile_step = runs[check], runs[wheel]
    env = compile_step[compile_step.index('if [ "$MAX_JOBS" = auto ]'):compile_step.index('echo "building torch')]
    assert env in step, "the configure runs in the compile step's environment"
    assert 'CFLAGS="${CPU_FLAGS}" CXXFLAGS="${CPU_FLAGS}" TORCH_NVCC_FLAGS="--threads=${NVCC_THREADS}"' in env
    assert tb.build_args["CPU_FLAGS"] == manifest.load(REPO / "manifests", profile="g5g").profiles["g5g"].cpu_flags
    assert "cmake -G Ninja -S /src/pytorch -B /tmp/flagsets -DCMAKE_EXPORT_COMPILE_COMMANDS=ON" in step
    assert "$CMAKE_ARGS" in step                       # TORCH_BUILD_FLAGS as -D, as the compile's CMAKE_ARGS
    assert ('check-flagsets.py /tmp/flagsets/compile_commands.json --ninja /tmp/flagsets --cflags "$CFLAGS" '
            '--cxxflags "$CXXFLAGS" --cudaflags "$TORCH_NVCC_FLAGS"') in " ".join(step.split())
    assert ("RUN --mount=type=bind,source=check-flagsets.py,target=/tmp/check/check-flagsets.py \\\n"
            "    if [ \"$MAX_JOBS\" = auto ]") in text
    assert "dockerfiles/check-flagsets.py" in tb.copy
    assert "ARG CPU_FLAGS=\"-mtune=neoverse-n1\"" in text.split("AS torch-build")[1].split("AS torch-wheel")[0]


@pytest.mark.parametrize("profile,overrides,rehearse", [
    ("g5g", ["profile.build.flagset_check=false"], False),   # turned off in the profile
    ("g5g", None, True),                                     # the rehearsal: PyPI's torch stands in, no compile
    ("g4dn", None, False),                                   # PyPI's torch
    ("cpu", None, False),                                    # a local CPU wheel
])
def test_no_flagset_step_without_a_torch_compile_or_when_off(profile, overrides, rehearse):
    tb, _, files = torch_base(profile, overrides, rehearse)
    assert not any("check-flagsets" in t for t in files.values())
    assert "dockerfiles/check-flagsets.py" not in tb.copy
