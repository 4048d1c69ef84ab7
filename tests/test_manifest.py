"""Manifests are validated strictly: each broken manifest gives one UserError naming the file and the key."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import yaml

from g5g import manifest
from g5g.errors import UserError

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = REPO / "manifests"


@pytest.fixture
def mdir(tmp_path: Path) -> Path:
    d = tmp_path / "manifests"
    shutil.copytree(MANIFESTS, d)
    return d


def edit(mdir: Path, rel: str, change) -> None:
    path = mdir / rel
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_real_manifests_load():
    m = manifest.load(MANIFESTS)
    assert set(m.profiles) == {"g5g", "g4dn", "cpu"}
    assert set(m.runtimes) == {"torch-base", "vllm", "jax", "pytorch"}
    g5g = m.profiles["g5g"]
    assert g5g.platforms == ("linux/arm64",) and g5g.cuda.archs == ("7.5",) and g5g.cuda.version == "13.0"
    assert g5g.python == "3.13" and g5g.dtype == "float16"
    assert m.profiles["cpu"].cuda is None
    vllm = m.runtimes["vllm"]
    assert vllm.pins["vllm"] == "0.33.0" and vllm.pins["torch"] == m.runtimes["torch-base"].pins["torch"] == "2.14.0"
    assert "--dtype" in vllm.serve_args and "float16" in vllm.serve_args
    assert m.runtimes["jax"].pins_for("cpu")["jax"] == "0.10.2"
    assert m.runtimes["jax"].pins_for("g5g")["jax"] == "0.12.0.1"
    for name in ("vllm", "jax", "pytorch"):
        assert m.runtimes[name].smoke is not None


def test_real_patch_digests_match():
    manifest.check_patch_digests(manifest.load(MANIFESTS), REPO)


def _set(path: str, value):
    def change(d):
        keys = path.split(".")
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return change


def _del(path: str):
    def change(d):
        keys = path.split(".")
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]
    return change


# (file, change, substrings the one-line error must contain)
BROKEN = [
    ("runtimes/vllm.yaml", _set("pins.vllm", "0.27.1"), ["runtimes/vllm.yaml", "pins.vllm", "0.28.0"]),
    ("runtimes/vllm.yaml", _set("turbo", True), ["runtimes/vllm.yaml", "turbo", "unknown key"]),
    ("runtimes/vllm.yaml", _del("pins.torch"), ["runtimes/vllm.yaml", "pins.torch", "missing pin"]),
    ("runtimes/vllm.yaml", _set("pins.vllm", ">=0.33"), ["runtimes/vllm.yaml", "pins.vllm", "exact version"]),
    ("runtimes/vllm.yaml", _set("sdist_sha256", "abc"), ["runtimes/vllm.yaml", "sdist_sha256"]),
    ("runtimes/vllm.yaml", _set("patches", [{"path": "patches/vllm/0.33.0/x.patch", "sha256": "zz"}]),
     ["runtimes/vllm.yaml", "patches[0].sha256"]),
    ("runtimes/vllm.yaml", _set("patches", [{"path": "patches/vllm/0.32.0/x.patch", "sha256": "0" * 64}]),
     ["runtimes/vllm.yaml", "patches[0].path", "patches/vllm/0.33.0/"]),
    ("runtimes/vllm.yaml", _set("smoke.expect", "(unclosed"), ["runtimes/vllm.yaml", "smoke.expect"]),
    ("runtimes/jax.yaml", _set("profiles.cpu.pins.flax", "0.1.0"), ["runtimes/jax.yaml", "profiles.cpu.pins.flax"]),
    ("runtimes/jax.yaml", _set("profiles.tpu", {"pins": {}}), ["runtimes/jax.yaml", "profiles.tpu", "unknown profile"]),
    ("runtimes/pytorch.yaml", _set("pins.torch", "2.13.0"), ["runtimes/pytorch.yaml", "pins.torch", "torch-base"]),
    ("runtimes/pytorch.yaml", _set("port", 70000), ["runtimes/pytorch.yaml", "port"]),
    ("runtimes/torch-base.yaml", _set("source", "image"), ["runtimes/torch-base.yaml", "image", "source: image"]),
    ("runtimes/jax.yaml", _set("image", "foo:1"), ["runtimes/jax.yaml", "image", "does not use it"]),
    ("runtimes/torch-base.yaml", _set("order", 9), ["runtimes/vllm.yaml", "from.runtime", "must come first"]),
    ("runtimes/torch-base.yaml", _set("sources.build.argz", {}),
     ["runtimes/torch-base.yaml", "sources.build.argz", "unknown key (allowed: args, context, contexts, from"]),
    ("runtimes/jax.yaml", _set("args.JAX_VERSION", "pins.jaxx"),
     ["runtimes/jax.yaml", "args.JAX_VERSION", "pins.jaxx is not set for profile"]),
    ("runtimes/jax.yaml", _set("args.JAX_VERSION", "pins.("), ["runtimes/jax.yaml", "args.JAX_VERSION", "Jinja"]),
    ("runtimes/jax.yaml", _set("version_pin", "flax"), ["runtimes/jax.yaml", "version_pin", "not one of the pins"]),
    ("runtimes/pytorch.yaml", _set("from", {"runtime": "torch-base", "image": "x"}),
     ["runtimes/pytorch.yaml", "from", "one of them"]),
    ("profiles/g5g.yaml", _set("cuda.archs", ["7.5+PTX"]), ["profiles/g5g.yaml", "cuda.archs", "+PTX"]),
    ("profiles/g5g.yaml", _set("cuda.archs", ["sm_75"]), ["profiles/g5g.yaml", "cuda.archs"]),
    ("profiles/g5g.yaml", _set("platforms", ["linux/riscv64"]), ["profiles/g5g.yaml", "platforms", "linux/riscv64"]),
    ("profiles/g5g.yaml", _set("cuda.version", 13.2), ["profiles/g5g.yaml", "cuda.version", "quoted string"]),
    ("profiles/g5g.yaml", _del("cuda.pip_toolkit"), ["profiles/g5g.yaml", "cuda.pip_toolkit", "missing"]),
    ("profiles/g5g.yaml", _del("base_image"), ["profiles/g5g.yaml", "base_image", "NVIDIA's wheels"]),
    ("profiles/g5g.yaml", _set("build.nvcc_threads", 2), ["profiles/g5g.yaml", "build.nvcc_threads", "one CUDA arch"]),
    ("profiles/g5g.yaml", _set("cuda.runtime_image", "nvidia/cuda:13.0.2-runtime-ubuntu24.04"),
     ["profiles/g5g.yaml", "cuda.runtime_image", "unknown key"]),
    ("profiles/g5g.yaml", _set("build.max_jobs", 0), ["profiles/g5g.yaml", "build.max_jobs"]),
    ("profiles/g5g.yaml", _set("name", "g4dn"), ["profiles/g5g.yaml", "name", "file name"]),
    ("profiles/cpu.yaml", _del("base_image"), ["profiles/cpu.yaml", "base_image"]),
    ("profiles/cpu.yaml", _set("registry", "http://x/"), ["profiles/cpu.yaml", "registry"]),
    ("profiles/cpu.yaml", _set("wheels", "/opt/wheels"), ["profiles/cpu.yaml", "wheels", "inside the repository"]),
]


@pytest.mark.parametrize("rel,change,expect", BROKEN, ids=[f"{b[0]}:{i}" for i, b in enumerate(BROKEN)])
def test_broken_manifest_names_file_and_key(mdir: Path, rel, change, expect):
    edit(mdir, rel, change)
    with pytest.raises(UserError) as e:
        manifest.load(mdir)
    msg = str(e.value)
    assert "\n" not in msg
    for s in expect:
        assert s in msg, msg


def test_invalid_yaml_names_file_and_line(mdir: Path):
    (mdir / "runtimes/jax.yaml").write_text("runtime: jax\npins: [unclosed\n")
    with pytest.raises(UserError, match=r"runtimes/jax.yaml: line \d+: not valid YAML"):
        manifest.load(mdir)


def test_runtimes_and_profiles_are_the_files(mdir: Path):
    """The runtime and profile lists are the manifest files: a runtime whose base is gone is named, not skipped."""
    (mdir / "runtimes/jax.yaml").unlink()
    g5g = (mdir / "profiles/g5g.yaml").read_text()
    (mdir / "profiles/g5g-east.yaml").write_text(g5g.replace("name: g5g", "name: g5g-east"))
    m = manifest.load(mdir)
    assert list(m.runtimes) == ["torch-base", "vllm", "pytorch"]
    assert set(m.profiles) == {"g5g", "g5g-east", "g4dn", "cpu"}
    (mdir / "runtimes/torch-base.yaml").unlink()
    with pytest.raises(UserError, match=r"runtimes/vllm.yaml: from.runtime: 'torch-base' is not a runtime"):
        manifest.load(mdir)
    for p in (mdir / "runtimes").iterdir():
        p.unlink()
    with pytest.raises(UserError, match=r"manifests/runtimes: no \*.yaml manifests"):
        manifest.load(mdir)


def test_unknown_profile_lists_known(mdir: Path):
    with pytest.raises(UserError, match=r"--profile p4d: .*known: cpu, g4dn, g5g"):
        manifest.load(mdir, profile="p4d")


def test_override_sets_value_before_validation(mdir: Path):
    m = manifest.load(mdir, profile="cpu", overrides=["profile.base_image=local/debian:12"])
    assert m.profiles["cpu"].base_image == "local/debian:12"
    with pytest.raises(UserError, match=r"runtimes/vllm.yaml: pins.vllm: 0.20.0 is below"):
        manifest.load(mdir, profile="g5g", overrides=["vllm.pins.vllm=0.20.0"])
    with pytest.raises(UserError, match=r"--set nonsense=1: expected DOC.KEY=VALUE"):
        manifest.load(mdir, profile="g5g", overrides=["nonsense=1"])
    with pytest.raises(UserError, match=r"--set profile.base_image=\[oops: '\[oops' is not a YAML value"):
        manifest.load(mdir, profile="cpu", overrides=["profile.base_image=[oops"])


def _patch_dir(tmp_path: Path, mdir: Path, content: bytes, listed_sha: str) -> Path:
    root = tmp_path / "repo"
    (root / "patches/vllm/0.33.0").mkdir(parents=True)
    (root / "patches/vllm/0.33.0/0001-fix.patch").write_bytes(content)
    edit(mdir, "runtimes/vllm.yaml",
         _set("patches", [{"path": "patches/vllm/0.33.0/0001-fix.patch", "sha256": listed_sha}]))
    return root


def test_patch_digest_check(tmp_path: Path, mdir: Path):
    body = b"--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a = 1\n+a = 2\n"
    good = hashlib.sha256(body).hexdigest()
    root = _patch_dir(tmp_path, mdir, body, good)
    manifest.check_patch_digests(manifest.load(mdir), root)  # matches: no error
    (root / "patches/vllm/0.33.0/0001-fix.patch").write_bytes(body + b" \n")
    with pytest.raises(UserError, match=r"runtimes/vllm.yaml: patches\[0\].sha256: .*0001-fix.patch has sha256"):
        manifest.check_patch_digests(manifest.load(mdir), root)
    (root / "patches/vllm/0.33.0/0001-fix.patch").unlink()
    with pytest.raises(UserError, match=r"patches\[0\].path: .*does not exist"):
        manifest.check_patch_digests(manifest.load(mdir), root)


@pytest.mark.parametrize("archs", [["7.5+PTX"], ["7.5", "8.0+ptx"]])
def test_ptx_in_an_arch_list_is_refused_for_what_it_is(mdir: Path, archs):
    """Not merely "not an arch like 7.5": the error says why +PTX cannot serve sm_75."""
    edit(mdir, "profiles/g5g.yaml", _set("cuda.archs", archs))
    with pytest.raises(UserError, match=r"profiles/g5g.yaml: cuda.archs: .*\+PTX is not allowed .*cannot JIT down"):
        manifest.load(mdir)


def test_a_pin_equal_to_its_floor_is_accepted(mdir: Path):
    vllm = yaml.safe_load((mdir / "runtimes/vllm.yaml").read_text())["pins"]["vllm"]
    edit(mdir, "runtimes/vllm.yaml", _set("min_pins.vllm", vllm))
    assert manifest.load(mdir).runtimes["vllm"].min_pins["vllm"] == vllm
    above = ".".join([*vllm.split(".")[:2], str(int(vllm.split(".")[2]) + 1)])
    edit(mdir, "runtimes/vllm.yaml", _set("min_pins.vllm", above))
    with pytest.raises(UserError, match=rf"runtimes/vllm.yaml: pins.vllm: {vllm} is below the Gemma 4 floor"):
        manifest.load(mdir)


@pytest.mark.parametrize("key,path", [("wheels", "../outside"), ("wheels", ".whl/../../outside"),
                                      ("build.vllm_sources", "../../src")])
def test_a_path_escaping_the_repository_is_refused(mdir: Path, key, path):
    rel = "profiles/cpu.yaml" if key == "wheels" else "profiles/g4dn.yaml"
    edit(mdir, rel, _set(key, path))
    with pytest.raises(UserError, match=rf"{rel}: {key}: .*inside the repository"):
        manifest.load(mdir)
