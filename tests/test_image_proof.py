"""benchmarks/build_evidence/image_proof.py's pure parts: cuobjdump's output, coverage of a 7.5 GPU, wheel RECORDs
against the image's, and pip's target arguments from a wheel's tags."""
from __future__ import annotations

import zipfile

import pytest

from benchmarks.build_evidence import image_proof as ip
from benchmarks.build_evidence import provenance

ELF = """ELF file    1: xla_cuda_plugin.1.sm_75.cubin
ELF file    2: xla_cuda_plugin.2.sm_80.cubin
ELF file    3: xla_cuda_plugin.3.sm_75.cubin
ELF file    4: xla_cuda_plugin.4.sm_100a.cubin
"""


def test_cuobjdump_lists_are_read_per_embedded_file():
    assert ip.parse_cuobjdump(ELF, "", 0) == ["sm_75", "sm_80", "sm_75", "sm_100a"]
    assert ip.parse_cuobjdump("PTX file    1: libtorch_cuda.1.sm_90.ptx\n", "", 0) == ["sm_90"]


def test_no_device_code_is_empty_but_any_other_failure_is_fatal():
    info = "cuobjdump info    : File '/x/_linalg.so' does not contain device code\n"
    assert ip.parse_cuobjdump("", info, 255) == []
    with pytest.raises(RuntimeError, match="exit 255"):
        ip.parse_cuobjdump("", "cuobjdump fatal   : Could not open input file '/x/gone.so'\n", 255)
    with pytest.raises(RuntimeError, match="unexpected cuobjdump line"):
        ip.parse_cuobjdump("Fatbin elf code:\n", "", 0)


@pytest.mark.parametrize("sass, ptx, covered, how", [
    (["sm_75", "sm_75", "sm_80"], [], True, "sm_75"),
    (["sm_70"], [], True, "sm_70 (binary-compatible)"),
    (["sm_80", "sm_90a"], ["sm_80"], False, None),       # what upstream arm64 wheels ship
    ([], ["sm_70"], True, "PTX 7.0 (JIT-compiled at first launch)"),
    (["sm_100a"], ["sm_90"], False, None)])
def test_a_library_with_device_code_must_cover_the_arch(sass, ptx, covered, how):
    e = ip.library_entry(sass, ptx, "7.5")
    assert e["device_code"] and e["covered"] is covered and e["covered_by"] == how
    assert sum(e["sass"].values()) == len(sass) and list(e["sass"]) == sorted(set(sass), key=ip.a_cc)


def test_a_library_without_device_code_is_not_judged():
    assert ip.library_entry([], [], "7.5") == {"sass": {}, "ptx": {}, "device_code": False, "covered": None}


def test_arch_lists_are_sorted_numerically():
    assert list(ip.library_entry(["sm_100a", "sm_75", "sm_90", "sm_120"], [], "7.5")["sass"]) == [
        "sm_75", "sm_90", "sm_100a", "sm_120"]


def _wheel(tmp_path, files: dict[str, str]) -> tuple:
    whl = tmp_path / "demo-1.0-py3-none-any.whl"
    import base64
    import hashlib
    rows = []
    with zipfile.ZipFile(whl, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            rows.append(f"{path},sha256={digest},{len(text)}")
        rows.append("demo-1.0.dist-info/RECORD,,")
        z.writestr("demo-1.0.dist-info/RECORD", "\n".join(rows) + "\n")
    return whl, [r.split(",")[:2] for r in rows]


def test_the_image_must_hold_every_file_of_the_wheel_unchanged(tmp_path):
    whl, rows = _wheel(tmp_path, {"demo/__init__.py": "x = 1\n", "demo/_k.so": "\x7fELF"})
    record = ip.wheel_record(whl)
    assert [p for p, _ in record] == ["demo/__init__.py", "demo/_k.so", "demo-1.0.dist-info/RECORD"]
    installed = [[p, h] for p, h in record] + [["demo/__pycache__/__init__.cpython-313.pyc", None]]
    assert ip.compare_records(record, installed) | {"missing": [], "differ": []} == {
        "files_checked": 2, "missing": [], "differ": [], "missing_count": 0, "differ_count": 0, "ok": True}
    changed = [[p, "AAAA" if p.endswith(".so") else h] for p, h in installed]
    out = ip.compare_records(record, changed)
    assert not out["ok"] and out["differ"] == ["demo/_k.so"]
    out = ip.compare_records(record, installed[1:])
    assert not out["ok"] and out["missing"] == ["demo/__init__.py"]


def test_pip_targets_the_wheel_the_image_installed():
    tags = ["cp313-cp313-manylinux_2_27_x86_64", "cp313-cp313-manylinux_2_28_x86_64"]
    assert ip.pip_platform_args(tags, "3.13.5") == [
        "--only-binary=:all:", "--no-deps", "--python-version", "3.13", "--implementation", "cp", "--abi", "cp313",
        "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux_2_28_x86_64"]
    # a pure wheel still needs the image's Python: jax 0.12 requires a newer one than this machine's
    assert ip.pip_platform_args(["py3-none-any"], "3.13.5") == [
        "--only-binary=:all:", "--no-deps", "--python-version", "3.13"]


def test_compressed_wheel_tags_expand(tmp_path):
    whl = tmp_path / "jaxlib-0.12.0.1-cp313-cp313-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl"
    assert ip._tags_of(whl) == {"cp313-cp313-manylinux_2_27_aarch64", "cp313-cp313-manylinux_2_28_aarch64"}


def test_the_proof_names_the_build_commit_and_what_changed_since():
    state = provenance.git_state("HEAD")
    assert len(state["commit"]) == 40 and state["built_from"] == state["commit"]
    assert state["image_inputs_changed_since_build"] == []
    first = provenance.run(["git", "-C", str(provenance.ROOT), "rev-list", "--max-parents=0", "HEAD"]).stdout.split()[0]
    if first != state["commit"]:  # a depth-1 clone has no older commit
        assert "serving/api/app.py" in provenance.git_state(first)["image_inputs_changed_since_build"]
    with pytest.raises(provenance.UserError, match="not a commit"):
        provenance.git_state("0" * 40)


def test_an_uncovered_library_fails_unless_named_with_a_reason():
    linalg = ip.library_entry(["sm_80", "sm_90"], [], "7.5")
    assert ip.judge("torch/lib/libtorch_cuda_linalg.so", linalg, {}, "7.5") == (
        "torch/lib/libtorch_cuda_linalg.so has device code but none for 7.5")
    assert ip.judge("torch/lib/libtorch_cuda_linalg.so", linalg, {"libtorch_cuda_linalg.so": "MAGMA"}, "7.5") is None
    assert linalg["allowed_uncovered"] == "MAGMA"
    covered = ip.library_entry(["sm_75"], [], "7.5")
    assert ip.judge("torch/lib/libtorch_cuda.so", covered, {}, "7.5") is None and "allowed_uncovered" not in covered
    assert ip.main(["img", "--allow-uncovered", "libx.so"]) == 2
