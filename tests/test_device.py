"""Fail loud on the wrong machine (issue 51): a server that expects a GPU (G5G_DEVICE=gpu, the CUDA images) and has
no usable one exits non-zero with one line — what the framework said, the driver found, the driver needed and how
to serve on the CPU on purpose; the CPU on purpose still serves."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from devtools.server import free_port, serving_env
from devtools.tiny_gemma4 import ANSWER, QUESTION
from serving import device
from tests.fixtures.serving import tiny_server

REPO = Path(__file__).resolve().parents[1]
# The GPU hidden, so that this machine is one without a usable GPU whatever its hardware; as the CUDA images run.
NO_GPU = {"G5G_DEVICE": "gpu", "CUDA_VISIBLE_DEVICES": "", "NVIDIA_REQUIRE_CUDA": "cuda>=13.0"}


def _serve(runtime: str, model: Path, env: dict, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving", "--runtime", runtime, "--model", str(model),
                           "--port", str(free_port()), *flags], cwd=REPO, env=serving_env(**env),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("runtime", ["pytorch", "jax"])
def test_server_expecting_a_gpu_and_finding_none_exits_with_one_line(runtime, tmp_path):
    pytest.importorskip({"pytorch": "torch", "jax": "jax"}[runtime])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    proc = _serve(runtime, tmp_path, NO_GPU | ({"JAX_PLATFORMS": "cpu"} if runtime == "jax" else {}))
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: G5G_DEVICE=gpu but no usable GPU ("), line
    framework = {"pytorch": "torch: ", "jax": "jax: "}[runtime]
    assert framework in line                                  # the framework's own reason, not swallowed
    assert "; found: " in line and "needs CUDA 13.0 (NVIDIA driver R580 or newer)" in line
    assert "G5G_DEVICE=cpu or --device cpu" in line
    assert "Uvicorn running" not in proc.stderr and "Traceback" not in proc.stderr   # refused before listening


def test_cpu_on_purpose_still_serves(tiny_gemma4, tmp_path):
    """The image's G5G_DEVICE=gpu, overridden by --device cpu: the CPU, on purpose, answers."""
    with tiny_server(tiny_gemma4, "--device", "cpu", env=serving_env(**NO_GPU), log=tmp_path / "server.log") as srv:
        r = requests.post(f"{srv.url}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": [{"role": "user", "content": QUESTION}]})
        assert r.json()["choices"][0]["message"]["content"] == ANSWER


def test_an_unknown_device_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    proc = _serve("pytorch", tmp_path, {"G5G_DEVICE": "tpu"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: G5G_DEVICE: 'tpu' is not one of auto, gpu, cpu"


def test_the_driver_found_and_needed(tmp_path):
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  550.54.15  Release Build  (dvs)\n"
                    "GCC version:  gcc version 12.2.0\n")
    assert device.driver_found(proc, libcuda="libg5g-absent.so") == "NVIDIA driver 550.54.15"
    assert device.driver_found(tmp_path / "absent", libcuda="libg5g-absent.so") == \
        f"no NVIDIA driver ({tmp_path / 'absent'} absent, no libg5g-absent.so)"
    assert device.needed(None, {"NVIDIA_REQUIRE_CUDA": "cuda>=13.0"}) == "CUDA 13.0 (NVIDIA driver R580 or newer)"
    assert device.needed("12.8", {}) == "CUDA 12.8 (NVIDIA driver R525 or newer)"
    assert device.needed(None, {}) == "a CUDA GPU"
    err = device.no_gpu("torch: Found no NVIDIA driver\non your system", "13.0", {}, driver="NVIDIA driver 550.54.15")
    assert "\n" not in str(err) and "(torch: Found no NVIDIA driver on your system); found: NVIDIA driver 550.54.15; " \
        "needs CUDA 13.0 (NVIDIA driver R580 or newer)" in str(err)


def test_the_jax_plugins_failure_is_raised(monkeypatch):
    """The CUDA plugin that cannot start (JAX would log it and fall back to the CPU) is the refusal's reason."""
    jax_engine = pytest.importorskip("serving.jax_runtime.engine")
    failure = RuntimeError("Unable to initialize backend 'cuda': FAILED_PRECONDITION: No visible GPU devices.")

    def backend():
        raise failure
    monkeypatch.setattr(jax_engine.xla_bridge, "backends_are_initialized", lambda: True)   # no jax_platforms change
    monkeypatch.setattr(jax_engine.jax, "default_backend", backend)
    with pytest.raises(device.NoGpuError, match="jax: Unable to initialize backend 'cuda': FAILED_PRECONDITION") as e:
        jax_engine.select_device({"G5G_DEVICE": "gpu"})
    assert e.value.__cause__ is failure
    with pytest.raises(RuntimeError, match="Unable to initialize"):     # auto: JAX's own error, as it is
        jax_engine.select_device({})
    monkeypatch.setattr(jax_engine.jax, "default_backend", lambda: "cpu")
    with pytest.raises(device.NoGpuError, match="jax's backend is cpu"):
        jax_engine.select_device({"G5G_DEVICE": "gpu"})
    assert jax_engine.select_device({"G5G_DEVICE": "cpu"}) == "cpu"


def test_torch_picks_the_device_asked_for(monkeypatch):
    torch_engine = pytest.importorskip("serving.torch_runtime.engine")
    monkeypatch.setattr(torch_engine.torch.cuda, "is_available", lambda: False)
    assert torch_engine.select_device({}) == "cpu"
    assert torch_engine.select_device({"G5G_DEVICE": "cpu"}) == "cpu"
    with pytest.raises(device.NoGpuError, match=r"^G5G_DEVICE=gpu but no usable GPU \(torch: "):
        torch_engine.select_device({"G5G_DEVICE": "gpu"})
    monkeypatch.setattr(torch_engine.torch.cuda, "is_available", lambda: True)
    assert torch_engine.select_device({"G5G_DEVICE": "gpu"}) == "cuda"
    assert torch_engine.select_device({"G5G_DEVICE": "cpu"}) == "cpu"


def test_the_jax_check_starts_xla_only_after_its_default_flags(monkeypatch):
    """The server's check (before it listens) starts XLA, which reads XLA_FLAGS once: the defaults are in by then."""
    jax_engine = pytest.importorskip("serving.jax_runtime.engine")
    seen = {}
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(jax_engine.xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(jax_engine.jax.config, "update", lambda k, v: seen.setdefault("config", (k, v)))

    def backend():
        seen["flags"] = jax_engine.os.environ.get("XLA_FLAGS", "")
        return "gpu"
    monkeypatch.setattr(jax_engine.jax, "default_backend", backend)
    assert jax_engine.select_device({"G5G_DEVICE": "gpu"}) == "gpu"
    assert seen["config"] == ("jax_platforms", "cuda") and "--xla_gpu_enable_command_buffer=" in seen["flags"]
    monkeypatch.delenv("XLA_FLAGS")
    jax_engine.select_device({"G5G_DEVICE": "gpu", "G5G_JAX_XLA_DEFAULTS": "0"})
    assert seen["flags"] == ""
