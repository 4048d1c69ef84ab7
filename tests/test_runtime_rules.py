"""What the driver does for a runtime comes from its manifest, not from its name: a runtime declared only in a scratch
checkout's manifests (tests/fixtures/scratch_repo.py) gets each behaviour the project's runtimes get."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from g5g import chart, containers, manifest
from g5g.commands import build as build_cmd
from g5g.errors import UserError
from g5g.plan import make_plan
from serving.__main__ import runtimes as serving_runtimes
from tests.fixtures.scratch_repo import repo_with_runtime

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "FROM scratch AS tiny\n"


def scratch(tmp_path: Path, extra: str = "") -> Path:
    """A checkout with runtime `tiny` (FROM scratch) and `extra` manifest keys."""
    text = ("runtime: tiny\ndescription: a runtime only this test knows\norder: 9\nversion_pin: tiny\n"
            "pins: {tiny: \"1.2\"}\nfrom: {image: \"'scratch'\"}\nargs: {}\n" + extra)
    return repo_with_runtime(tmp_path / "repo", "tiny", text, TEMPLATE)


def tiny_plan(root: Path):
    plan = make_plan(manifest.load(root / "manifests", profile="cpu"), runtime="tiny", profile="cpu")
    return next(i for i in plan.images if i.runtime == "tiny"), plan


@pytest.mark.parametrize("style, command", [
    ("positional", ["/models/m", "--host", "0.0.0.0", "--port", "8000"]),
    ("flag", ["--model", "/models/m", "--host", "0.0.0.0", "--port", "8000"]),
])
def test_how_a_runtime_takes_its_model_is_its_manifests_serve_model_arg(tmp_path, style, command):
    img, plan = tiny_plan(scratch(tmp_path, f"serve: {{model_arg: {style}}}\n"))
    assert img.context_vars["model_arg"] == style
    assert containers.server_command(img.context_vars["model_arg"], "/models/m", None) == command
    # the chart's values name the flag (or none) the same way
    fleet = chart.load_fleet(REPO) | {"boot": {"tiny": [[{"value": 10}]]}, "decode_tok_s": {"tiny": [{"value": 10}]},
                                      "nodes": {"cpu": {"instance_types": []}}}
    values = chart.values(img, plan, fleet, REPO)
    assert values["model"]["flag"] == ("" if style == "positional" else "--model")


def test_the_model_arg_default_and_a_bad_value(tmp_path):
    img, _ = tiny_plan(scratch(tmp_path))
    assert img.context_vars["model_arg"] == "flag"
    root = scratch(tmp_path / "bad", "serve: {model_arg: keyword}\n")
    with pytest.raises(UserError) as e:
        manifest.load(root / "manifests", profile="cpu")
    assert str(e.value) == ("manifests/runtimes/tiny.yaml: serve.model_arg: 'keyword' must be one of "
                            "'flag' or 'positional'")


def test_a_runtime_with_patches_gets_the_pre_build_patch_check(tmp_path, monkeypatch):
    """The check runs for every runtime that lists patches, against its own version pin's sdist and sha256."""
    root = scratch(tmp_path, "sdist_sha256: " + "c" * 64 + "\nargs: {SDIST: runtime.sdist_sha256}\n"
                   "patches: [{path: patches/tiny/1.2/0001-fix.patch, sha256: " + "d" * 64 + "}]\n")
    calls = []
    monkeypatch.setattr(build_cmd.patches, "check_apply", lambda *a: calls.append(a))
    img, plan = tiny_plan(root)
    build_cmd.check_patches(plan)
    assert calls == [([("patches/tiny/1.2/0001-fix.patch", "d" * 64)], "1.2", "c" * 64, "tiny")]
    calls.clear()
    img, plan = tiny_plan(scratch(tmp_path / "none"))  # no patches: nothing to check, nothing downloaded
    build_cmd.check_patches(plan)
    assert calls == []


def _serve(root: Path, runtime: str, model: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "build.py"), "serve", "--manifests", str(root / "manifests"),
                           "--runtime", runtime, "--model", str(model)], capture_output=True, text=True, timeout=60)


def test_build_py_serve_runs_the_runtimes_whose_manifest_has_serve_local(tmp_path):
    root = scratch(tmp_path, "serve: {local: {packages: [g5g_no_such_module], extras: [serving, tiny]}}\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    r = _serve(root, "tiny", model)
    assert r.returncode == 2 and r.stderr.startswith("error:"), r.stderr
    assert ("serve --runtime tiny: missing Python packages g5g_no_such_module (pip install -e '.[serving,tiny]')"
            in " ".join(r.stderr.split())), r.stderr
    r = _serve(root, "vllm", model)  # no serve.local: vLLM runs in its image only
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "serve --runtime vllm: not one that runs here (runtimes with serve.local in their manifest: jax, pytorch" \
           in " ".join(r.stderr.split()), r.stderr


def test_python_m_serving_runtimes_are_the_serving_runtime_modules(tmp_path):
    (tmp_path / "llama_runtime.py").write_text("")
    (tmp_path / "other_runtime").mkdir()
    (tmp_path / "other_runtime" / "__init__.py").write_text("")
    (tmp_path / "helpers.py").write_text("")
    assert serving_runtimes(tmp_path) == {"llama": "serving.llama_runtime", "other": "serving.other_runtime"}
    assert serving_runtimes() == {"jax": "serving.jax_runtime", "pytorch": "serving.torch_runtime"}


def test_fits_takes_the_serving_runtimes_of_the_manifests():
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "fits", "--shape", "e2b", "--max-model-len", "64",
                        "--runtime", "torch-base"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "fits --runtime torch-base: not a serving runtime (one of vllm, jax, pytorch)" in r.stderr, r.stderr


def test_the_charts_default_values_are_fleet_data():
    """values.yaml is the values file of fleet.yaml's `default` runtime and profile."""
    fleet = yaml.safe_load((REPO / "deploy" / "fleet.yaml").read_text())
    plans = [make_plan(manifest.load(REPO / "manifests", profile=p), profile=p) for p in ("g5g", "g4dn")]
    for default in (["vllm", "g5g"], ["jax", "g4dn"]):
        files = chart.chart_files(plans, fleet | {"default": default}, REPO, "0.1.0")
        assert files["values.yaml"] == files[f"values-{default[0]}-{default[1]}.yaml"]
    assert fleet["default"] == ["vllm", "g5g"]


def test_fits_leaves_the_towers_out_for_a_runtime_whose_manifest_says_text_only(tmp_path, tiny_gemma4, monkeypatch,
                                                                                capsys):
    import argparse

    from g5g.commands import fits, smoke

    root = scratch(tmp_path, "serve: {text_only: true}\nsmoke: {prompt: hi, expect: hi}\n")
    monkeypatch.setattr(smoke, "manifest_dir", lambda: root / "manifests")
    smoke._manifests.cache_clear()
    try:
        def planned(runtime: str) -> str:
            fits.run(argparse.Namespace(runtime=runtime, gpu="t4g", overhead_mib=1024, model=str(tiny_gemma4),
                                        scheme=None, max_model_len=64, slots=1, shape=None, lm_head="fp16"))
            return capsys.readouterr().out

        assert "towers" not in planned("tiny") and "vision/audio towers" in planned("vllm")
    finally:
        smoke._manifests.cache_clear()
