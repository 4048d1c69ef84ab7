"""Issue 51, item 3: the libcuda link stub (dockerfiles/_macros.j2, libcuda_stub) holds every CUresult entry point
that cuda.h declares, declarations split across lines included, and the build fails when its count differs.

The macro is rendered as the toolkit step renders it and run by bash with the host's gcc, on headers written here and
on CUDA 13.1's real cuda.h where one is installed (Triton's wheel carries it).
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest

from g5g import manifest, render
from g5g.plan import make_plan

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not shutil.which("gcc") or not shutil.which("nm"), reason="no host gcc/nm")
HEAD = "#define CUDAAPI\ntypedef enum { CUDA_SUCCESS = 0 } CUresult;\n"
# cuda.h's own layout for the five CUDA 13.1 loses to a per-line match: the line breaks after `CUresult CUDAAPI`.
SPLIT = HEAD + ("CUresult CUDAAPI cuInit(unsigned int Flags);\n"
                "CUresult CUDAAPI\ncuLinkCreate_v2(unsigned int numOptions, void **optionValues);\n"
                "__attribute__((deprecated)) CUresult CUDAAPI cuCtxDetach(void *ctx);\n"
                "int cuNotAnEntryPoint(void);\n")


def stub_step(out: Path) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(REPO / "dockerfiles"))
    return str(env.get_template("_macros.j2").module.libcuda_stub('"$INC"', f'"{out}"'))


def build(tmp_path: Path, header: str | Path) -> tuple[subprocess.CompletedProcess, Path]:
    inc = tmp_path / "include"
    if isinstance(header, Path):
        inc = header
    else:
        inc.mkdir()
        (inc / "cuda.h").write_text(header)
    out = tmp_path / "libcuda.so"
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", stub_step(out)], capture_output=True, text=True,
                       env={"INC": str(inc), "PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}, timeout=120)
    return r, out


def exported(lib: Path) -> set[str]:
    r = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {ln.split()[-1] for ln in r.stdout.splitlines() if " T " in ln}


def test_a_declaration_split_after_its_return_type_is_in_the_stub(tmp_path):
    r, lib = build(tmp_path, SPLIT)
    assert r.returncode == 0, r.stderr
    assert "libcuda stub: 3 entry points, as many as cuda.h declares" in r.stdout
    assert exported(lib) == {"cuInit", "cuLinkCreate_v2", "cuCtxDetach"}
    soname = subprocess.run(["objdump", "-p", str(lib)], capture_output=True, text=True).stdout
    assert "SONAME               libcuda.so.1" in soname


def test_a_count_that_differs_from_the_headers_fails_the_build(tmp_path):
    """Two entry points in one declaration: the text match sees one, GCC declares two; the step fails, naming the
    missed one, and writes no library."""
    r, lib = build(tmp_path, HEAD + "CUresult CUDAAPI cuA(void), cuB(void);\n")
    assert r.returncode == 1
    assert "libcuda stub: 1 entry points collected, cuda.h declares 2" in r.stderr and "< cuB" in r.stderr, r.stderr
    assert not lib.exists()


def test_cuda_13_1s_header_gives_all_458(tmp_path):
    """The review's count on CUDA 13.1's cuda.h: 458 entry points, the five link functions among them."""
    inc = next(iter(sorted(REPO.glob(".venv/lib/python*/site-packages/triton/backends/nvidia/include"))), None)
    if inc is None or "#define CUDA_VERSION 13010" not in (inc / "cuda.h").read_text():
        pytest.skip("no CUDA 13.1 cuda.h here (Triton's wheel carries one)")
    r, lib = build(tmp_path, inc)
    assert r.returncode == 0 and "libcuda stub: 458 entry points" in r.stdout, r.stderr
    names = exported(lib)
    assert {"cuLinkCreate_v2", "cuLinkAddData_v2", "cuLinkAddFile_v2", "cuLinkComplete", "cuLinkDestroy"} <= names
    assert len(names) == 458


def test_the_toolkit_step_builds_the_checked_stub():
    plan = make_plan(manifest.load(REPO / "manifests", profile="g5g"), profile="g5g")
    tb = next(i for i in plan.all_images if i.runtime == "torch-base")
    text = render.render(plan)[tb.dockerfile]
    assert stub_step(Path("/x")).replace('"$INC"', '"$cu/include"').replace('"/x"', '"$cu/lib/stubs/libcuda.so"') \
        in text
