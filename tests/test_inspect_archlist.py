"""Arch-list parsing and coverage rules (pure), checked on the lists real images and wheels carry (docs/FACTS.md)."""
import pytest

from g5g import archlist, registry
from g5g import inspect as inspector
from g5g.errors import FAILED, OK, UNKNOWN, UserError
from tests.fixtures.registry import VLLM_AMD64, VLLM_ARM64


def test_vllm_openai_amd64_has_sm75():
    a = archlist.parse(VLLM_AMD64)
    assert a.native == ("7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
    assert a.ptx == ()
    assert archlist.coverage(a, "7.5") == archlist.Coverage(True, "sm_75")


def test_vllm_openai_arm64_lacks_sm75():
    a = archlist.parse(VLLM_ARM64)
    assert a.native == ("8.0", "8.7", "8.9", "9.0", "10.0", "11.0", "12.0")
    assert archlist.coverage(a, "7.5") == archlist.Coverage(False, None)
    assert archlist.coverage(a, "8.7").covered


def test_ptx_of_a_newer_arch_does_not_cover_an_older_gpu():
    # vLLM 0.33.0 aarch64 wheel: kernels 80…120, PTX 80/89/90, no 75.
    a = archlist.parse("8.0+PTX 8.6 8.7 8.9+PTX 9.0+PTX 10.0 11.0 12.0")
    assert a.ptx == ("8.0", "8.9", "9.0")
    assert "8.0" in a.native  # +PTX is machine code *and* PTX
    assert not archlist.coverage(a, "7.5").covered


def test_ptx_of_an_older_arch_is_jit_compiled():
    cov = archlist.coverage(archlist.parse("5.2 6.1+PTX"), "7.5")  # across majors: PTX, never SASS
    assert cov == archlist.Coverage(True, "PTX 6.1 (JIT-compiled at first launch)")


def test_sass_runs_on_same_major_newer_minor_only():
    assert archlist.coverage(archlist.parse("7.0"), "7.5") == archlist.Coverage(True, "sm_70 (binary-compatible)")
    assert not archlist.coverage(archlist.parse("8.0"), "7.5").covered
    assert not archlist.coverage(archlist.parse("6.1"), "7.5").covered
    assert not archlist.coverage(archlist.parse("8.6"), "8.0").covered


@pytest.mark.parametrize("value", ["7.5 8.0", "7.5;8.0", "sm_75,sm_80", "75 80", "sm75 sm80", " 7.5 ;; 8.0 ", "80 75"])
def test_spellings_normalise_to_the_same_list(value):
    assert archlist.parse(value) == archlist.ArchList(("7.5", "8.0"), ())


def test_torch_get_arch_list_spelling():
    a = archlist.parse(" ".join(["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "compute_90"]))
    assert a.native == ("5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "9.0")
    assert a.ptx == ("9.0",)


def test_cmake_architectures():
    a = archlist.parse("75-real;80-virtual;90", "cmake")
    assert a.native == ("7.5", "9.0") and a.ptx == ("8.0", "9.0")


def test_three_digit_and_arch_specific_archs():
    a = archlist.parse("100 120 9.0a sm_100a")
    assert a.native == ("9.0a", "10.0", "10.0a", "12.0")  # numeric order, not string order
    assert archlist.coverage(a, "9.0") == archlist.Coverage(True, "sm_90a")
    # arch-specific PTX is not forward compatible
    assert not archlist.coverage(archlist.parse("compute_90a"), "10.0").covered


def test_arch_specific_sass_runs_only_on_its_own_chip():
    """sm_100a machine code uses features of 10.0 alone: unlike plain sm_100 it does not run on a 10.3 GPU."""
    assert archlist.coverage(archlist.parse("10.0"), "10.3") == archlist.Coverage(True, "sm_100 (binary-compatible)")
    assert archlist.coverage(archlist.parse("10.0a"), "10.0") == archlist.Coverage(True, "sm_100a")
    assert archlist.coverage(archlist.parse("10.0a"), "10.3") == archlist.Coverage(False, None)
    assert archlist.coverage(archlist.parse("7.0a 9.0a"), "7.5") == archlist.Coverage(False, None)


def test_torch_named_archs():
    a = archlist.parse("Turing Ampere")
    assert a.native == ("7.5", "8.0", "8.6") and a.ptx == ("7.5", "8.6")


def test_unparsed_tokens_are_kept_and_make_a_miss_unknown():
    a = archlist.parse("all 8.0")
    assert a.unparsed == ("all",) and a.native == ("8.0",)
    found = archlist.Found(a, "env:CUDAARCHS", "all 8.0")
    assert inspector.entry_from(found, "7.5")["covered"] is None
    with pytest.raises(archlist.ArchError):
        archlist.normalize("banana")


@pytest.mark.parametrize("text,cc", [("7.5", "7.5"), ("75", "7.5"), ("sm_75", "7.5"), ("compute_75", "7.5"),
                                     ("8.6", "8.6"), ("120", "12.0")])
def test_target(text, cc):
    assert archlist.target(text) == cc


@pytest.mark.parametrize("text", ["turing7", "9.0a", "x"])
def test_bad_target(text):
    with pytest.raises(archlist.ArchError, match="--arch"):
        archlist.target(text)


def test_find_prefers_our_label_and_reads_env():
    env = {"TORCH_CUDA_ARCH_LIST": VLLM_ARM64}
    f = archlist.find(env, {"io.g5g.cuda-archs": "7.5"})
    assert f.source == "label:io.g5g.cuda-archs" and f.archs.native == ("7.5",)
    f = archlist.find(env, {"org.opencontainers.image.title": "x"})
    assert f.source == "env:TORCH_CUDA_ARCH_LIST" and f.raw == VLLM_ARM64
    assert archlist.find({"CUDA_ARCH_LIST": "75"}, {}).source == "env:CUDA_ARCH_LIST"
    assert archlist.find({"CMAKE_CUDA_ARCHITECTURES": "75"}, {}).archs.ptx == ("7.5",)
    assert archlist.find({"TORCH_CUDA_ARCH_LIST": " "}, {}) is None
    assert archlist.find({"PATH": "/bin"}, {}) is None


def test_our_empty_label_means_no_cuda():
    entry = inspector.platform_entry({"config": {"Labels": {"io.g5g.cuda-archs": ""}}}, "7.5")
    assert entry["cuda_archs"] == [] and entry["covered"] is False and entry["source"] == "label:io.g5g.cuda-archs"


def test_env_dict_last_definition_wins():
    assert archlist.env_dict(["A=1", "B=x=y", "A=2"]) == {"A": "2", "B": "x=y"}


def test_platform_entry_from_config_without_cuda():
    entry = inspector.platform_entry({"config": {"Env": ["PATH=/bin"]}}, "7.5")
    assert entry == {"cuda_archs": None, "ptx": [], "source": None, "covered": None, "covered_by": None, "raw": None}


@pytest.mark.parametrize("image,expected", [
    ("debian", ("docker.io", "library/debian", "latest", None, "registry-1.docker.io")),
    ("vllm/vllm-openai:v0.33.0", ("docker.io", "vllm/vllm-openai", "v0.33.0", None, "registry-1.docker.io")),
    ("index.docker.io/library/debian:12", ("docker.io", "library/debian", "12", None, "registry-1.docker.io")),
    ("ghcr.io/me/g5g/vllm:0.33.0", ("ghcr.io", "me/g5g/vllm", "0.33.0", None, "ghcr.io")),
    ("localhost/x", ("localhost", "x", "latest", None, "localhost")),
    ("127.0.0.1:5000/g5g/vllm@sha256:" + "a" * 64,
     ("127.0.0.1:5000", "g5g/vllm", None, "sha256:" + "a" * 64, "127.0.0.1:5000")),
])
def test_parse_reference(image, expected):
    ref = registry.parse_reference(image)
    assert (ref.registry, ref.repository, ref.tag, ref.digest, ref.endpoint) == expected


@pytest.mark.parametrize("image", ["Vllm/Vllm", "x@sha256:1234", "a:b:c", "x:-bad"])
def test_bad_reference(image):
    with pytest.raises(UserError, match="image"):
        registry.parse_reference(image)


def test_platforms_normalise():
    assert registry.normalize_platform("linux", "arm64", "v8") == "linux/arm64"
    assert registry.parse_platform("linux/arm64/v8") == "linux/arm64"
    assert registry.parse_platform("arm64") == "linux/arm64"
    assert registry.parse_platform("linux/arm/v7") == "linux/arm/v7"
    with pytest.raises(UserError, match="--platform"):
        registry.parse_platform("linux//")


def test_loopback_hosts_speak_http():
    assert registry.is_loopback("127.0.0.1:5000") and registry.is_loopback("localhost:5000")
    assert registry.is_loopback("[::1]:5000") and not registry.is_loopback("ghcr.io")
    assert not registry.is_loopback("10.0.0.1:5000")


def test_attestation_entries_are_recognised():
    assert registry.is_attestation({"platform": {"os": "unknown", "architecture": "unknown"}})
    assert registry.is_attestation({"platform": {"os": "linux", "architecture": "arm64"},
                                    "annotations": {"vnd.docker.reference.type": "attestation-manifest"}})
    assert not registry.is_attestation({"platform": {"os": "linux", "architecture": "arm64"}})


def _result(**platforms):
    return {"image": "vllm/vllm-openai:v0.33.0", "arch": "7.5", "digest": None, "backend": "http",
            "platforms": {p.replace("_", "/"): inspector.platform_entry(
                {"config": {"Env": [f"TORCH_CUDA_ARCH_LIST={v}"] if v else []}}, "7.5") for p, v in platforms.items()}}


def test_exit_codes():
    assert inspector.exit_code([_result(linux_amd64=VLLM_AMD64)]) == OK
    assert inspector.exit_code([_result(linux_amd64=VLLM_AMD64, linux_arm64=VLLM_ARM64)]) == FAILED
    assert inspector.exit_code([_result(linux_amd64=VLLM_AMD64, linux_arm64=None)]) == UNKNOWN
    assert inspector.exit_code([_result(linux_arm64=VLLM_ARM64), _result(linux_amd64=None)]) == FAILED


def test_parse_probe_output():
    out = 'Warning: something\n{"torch": "2.14.0+cu130", "cuda": "13.0", "archs": ["sm_75", "sm_80", "compute_80"]}\n'
    found = inspector.parse_probe(out)
    assert found.source == "probe:torch" and found.archs.native == ("7.5", "8.0") and found.archs.ptx == ("8.0",)
    cpu = inspector.parse_probe('{"torch": "2.13.0+cpu", "cuda": null, "archs": []}')
    assert cpu.archs.empty and "without CUDA" in cpu.raw
    assert inspector.entry_from(cpu, "7.5")["covered"] is False
    with pytest.raises(UserError, match="no JSON"):
        inspector.parse_probe("ModuleNotFoundError: No module named 'torch'")
