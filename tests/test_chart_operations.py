"""The chart as an SRE runs it (issue 39): a drain of one replica waits for a replacement, autoscaling falls back
when its metric is lost, `helm test` proves a GPU, a fetched model asks for the node disk it fills, liveness follows
the engine heartbeat, and the s3 download's shell step skips a checked model and clears a crashed one. Rendered
with the real helm and validated as tests/test_chart.py does; the shell step and the fetch script run here."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.fixtures.helm import helm  # noqa: F401 - the fixture
from tests.test_chart import AWS_CLI, CHART, COMBOS, FLEET, PROM_LABEL, REPO, _fetcher, arg, by_kind, render, validate


def pod_spec(docs: list[dict]) -> dict:
    return by_kind(docs)["Deployment"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("sets,spec", [
    ((), {"minAvailable": 1}),
    (("replicaCount=3",), {"maxUnavailable": 1}),
    (("autoscaling.enabled=true", PROM_LABEL), {"minAvailable": 1}),
    (("autoscaling.enabled=true", PROM_LABEL, "autoscaling.minReplicas=2"), {"maxUnavailable": 1}),
    (("replicaCount=3", "podDisruptionBudget.maxUnavailable=2"), {"maxUnavailable": 2}),
])
def test_a_drain_never_evicts_the_only_serving_pod(helm, sets, spec):  # noqa: F811
    """One replica: minAvailable 1 (an eviction waits until a second pod is Ready); more: maxUnavailable at a time.
    A pod that is not Ready never blocks a drain."""
    pdb = by_kind(render(helm, "values.yaml", *sets))["PodDisruptionBudget"]
    validate(pdb)
    assert {k: v for k, v in pdb["spec"].items() if k in ("minAvailable", "maxUnavailable")} == spec
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_the_scaler_falls_back_when_its_query_fails(helm):  # noqa: F811
    so = by_kind(render(helm, "values-jax-g5g.yaml", "autoscaling.enabled=true", PROM_LABEL,
                        "autoscaling.maxReplicas=6"))["ScaledObject"]
    validate(so)
    assert so["spec"]["fallback"] == {"failureThreshold": 3, "replicas": 6}      # default: maxReplicas
    assert so["spec"]["triggers"][0]["metadata"]["ignoreNullValues"] == "false"  # a lost series is a failure
    so = by_kind(render(helm, "values-jax-g5g.yaml", "autoscaling.enabled=true", PROM_LABEL,
                        "autoscaling.fallbackReplicas=2", "autoscaling.fallbackAfterFailures=5"))["ScaledObject"]
    assert so["spec"]["fallback"] == {"failureThreshold": 5, "replicas": 2}


@pytest.mark.parametrize("runtime,profile", COMBOS)
def test_helm_test_asks_the_releases_nodes_for_a_gpu_and_lists_it(helm, runtime, profile):  # noqa: F811
    docs = render(helm, f"values-{runtime}-{profile}.yaml", "image.digest=sha256:" + "ab" * 32)
    (test,) = [d for d in docs if d["kind"] == "Pod"]
    validate(test)
    assert test["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec, pod = test["spec"], pod_spec(docs)
    for key in ("nodeSelector", "affinity", "tolerations"):      # where the release's pods go, the test goes
        assert spec[key] == pod[key], key
    (c,) = spec["containers"]
    assert c["command"] == ["nvidia-smi", "-L"] and c["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert c["image"] == pod["containers"][0]["image"]
    assert "utility" in next(e["value"] for e in c["env"] if e["name"] == "NVIDIA_DRIVER_CAPABILITIES")
    assert spec["restartPolicy"] == "Never" and c["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("sets,storage", [
    (("model.source=huggingface",), "24Gi"),
    (("model.source=huggingface", "model.cache.sizeLimit=40Gi"), "40Gi"),
    (("model.source=s3", "model.s3.uri=s3://m/g/", AWS_CLI, "model.sha256.config\\.json=" + "a" * 64), "24Gi"),
    (("model.source=huggingface", "model.cache.claimName=models"), None),    # a PVC: not the node's disk
    ((), None),                                                              # pvc: nothing fetched
])
def test_a_model_fetched_onto_the_nodes_disk_is_requested_as_ephemeral_storage(helm, sets, storage):  # noqa: F811
    docs = render(helm, "values-vllm-g5g.yaml", *sets)
    pod = pod_spec(docs)
    (c,) = pod["containers"]
    assert c["resources"]["requests"].get("ephemeral-storage") == storage
    if storage:
        cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
        assert cache["emptyDir"]["sizeLimit"] == storage     # the request covers the volume's whole limit
    validate(by_kind(docs)["Deployment"])


@pytest.mark.parametrize("runtime", ["jax", "pytorch", "vllm"])
def test_liveness_restarts_a_wedged_engine_through_the_heartbeat(helm, runtime):  # noqa: F811
    """Our servers get --engine-stall-timeout (fleet.yaml engine_stall_s), so the liveness probe's /health turns 503
    when their engine holds work without finishing a step; vLLM has no such flag and gets none."""
    (c,) = pod_spec(render(helm, f"values-{runtime}-g5g.yaml"))["containers"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    if runtime == "vllm":
        assert "--engine-stall-timeout" not in c["args"]
        return
    stall = int(arg(c, "--engine-stall-timeout"))
    assert stall == FLEET["engine_stall_s"][runtime]
    from serving.__main__ import build_parser

    argv = ["--runtime", runtime, *c["args"]]           # the server's own parser takes it
    assert build_parser().parse_args(argv).engine_stall_timeout == stall


def test_init_containers_request_what_they_use(helm):  # noqa: F811
    pod = pod_spec(render(helm, "values-jax-g5g.yaml", "model.source=s3", "model.s3.uri=s3://m/g/", AWS_CLI,
                          "model.sha256.config\\.json=" + "a" * 64))
    assert [i["name"] for i in pod["initContainers"]] == ["download", "fetch-model"]
    for init in pod["initContainers"]:
        assert init["resources"] == {"requests": FLEET["fetch_resources"]["requests"],
                                     "limits": FLEET["fetch_resources"]["limits"]}, init["name"]
    assert pod["initContainers"][0]["image"].endswith("@sha256:" + "c" * 64)


# --- the s3 path's shell step, run here with a stand-in `aws` (no AWS here): it copies a local directory ----------

FAKE_AWS = """#!/bin/sh
# aws s3 cp --recursive --only-show-errors URI DEST: log the call, copy $FAKE_S3 into DEST
echo "$*" >> "$FAKE_AWS_LOG"
mkdir -p "$6" && cp -R "$FAKE_S3"/. "$6"/
"""


def _download_step(helm_bin: str) -> str:
    pod = pod_spec(render(helm_bin, "values-jax-g5g.yaml", "model.source=s3", "model.s3.uri=s3://m/g/", AWS_CLI,
                          "model.sha256.config\\.json=" + "a" * 64))
    return pod["initContainers"][0]["command"][2]


def test_the_s3_download_step_skips_a_checked_model_and_clears_a_crashed_download(helm, tmp_path):  # noqa: F811
    script = _download_step(helm)
    cache, source, bin_dir, log = tmp_path / "cache", tmp_path / "bucket", tmp_path / "bin", tmp_path / "aws.log"
    source.mkdir()
    (source / "config.json").write_bytes(b'{"model_type": "gemma4"}')
    bin_dir.mkdir()
    (bin_dir / "aws").write_text(FAKE_AWS)
    (bin_dir / "aws").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_S3": str(source), "FAKE_AWS_LOG": str(log),
           "DIR": "gemma-abc", "URI": "s3://m/g/", "POD": "gemma-0"}

    def download() -> None:
        r = subprocess.run(["sh", "-c", script.replace("/cache", str(cache))], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr

    partial = cache / ".partial" / "gemma-0"
    partial.mkdir(parents=True)
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"half")     # a restarted pod's crashed attempt
    download()
    assert sorted(p.name for p in partial.iterdir()) == ["config.json"]      # cleared first, then downloaded
    # the checked copy is what the server mounts: the fetch script passes exactly this download
    sha = hashlib.sha256((source / "config.json").read_bytes()).hexdigest()
    r = subprocess.run([sys.executable, str(CHART / "files" / "fetch_model.py"), "s3", "--dest",
                        str(cache / "gemma-abc"), "--sha256", f"config.json={sha}"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and (cache / "gemma-abc" / ".verified").is_file(), r.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and calls[0].endswith(f"s3://m/g/ {partial}")
    download()                                                                # checked before: no download
    assert log.read_text().splitlines() == calls and not partial.exists()


def test_crashed_fetches_left_on_a_shared_cache_are_swept(tmp_path, monkeypatch, capsys):
    """A .partial/<pod> with nothing written for STALE_S is removed when the next pod starts (its name is never
    reused); a live fetch's directory and the pod's own are kept."""
    fm = _fetcher()
    partials = tmp_path / ".partial"
    old = time.time() - fm.STALE_S - 60
    for pod in ("gemma-dead", "gemma-live", "gemma-me"):
        (partials / pod / "sub").mkdir(parents=True)
        (partials / pod / "sub" / "model.safetensors").write_bytes(b"x")
        for p in (partials / pod / "sub" / "model.safetensors", partials / pod / "sub", partials / pod):
            os.utime(p, (old, old))
    os.utime(partials / "gemma-live" / "sub" / "model.safetensors")          # still being written
    (tmp_path / "gemma" ).mkdir()
    (tmp_path / "gemma" / ".verified").write_text('{"files": {"a": "sha256:%s"}}' % ("0" * 64))
    monkeypatch.setenv("POD", "gemma-me")
    assert fm.main(["s3", "--dest", str(tmp_path / "gemma"), "--sha256", "a=" + "0" * 64]) == 0
    assert sorted(p.name for p in partials.iterdir()) == ["gemma-live", "gemma-me"]
    assert f"removed {partials / 'gemma-dead'}" in capsys.readouterr().out


def test_the_drain_takes_the_slowest_decode_speed_on_record():
    """fleet.yaml may list several speeds for a runtime: the drain must outlast the longest reply at the slowest."""
    from g5g import chart

    fleet = {"decode_tok_s": {"jax": [{"value": 30.0, "source": "a fast run"}, {"value": 12.0, "source": "slow"},
                                      {"value": 20.0, "source": "another"}]}}
    assert chart.decode_speed(fleet, "jax", REPO) == 12.0


@pytest.mark.parametrize("runtime,profile", COMBOS)
def test_an_inference_pool_hands_the_releases_pods_to_an_endpoint_picker(helm, runtime, profile):  # noqa: F811
    """inferencePool.enabled renders an InferencePool (inference.networking.k8s.io/v1) that selects exactly the
    Deployment's pods on the server's port and names the Endpoint Picker as upstream's chart does for a release of
    the pool's name; validated against the CRD's schema and its two CEL rules."""
    import jsonschema

    docs = render(helm, f"values-{runtime}-{profile}.yaml", "inferencePool.enabled=true", "port=9000")
    assert "InferencePool" not in by_kind(render(helm, f"values-{runtime}-{profile}.yaml"))   # optional
    pool, dep = by_kind(docs)["InferencePool"], by_kind(docs)["Deployment"]
    validate(pool)
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert spec["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert spec["targetPorts"] == [{"number": c["ports"][0]["containerPort"]}] == [{"number": 9000}]
    ref = spec["endpointPickerRef"]
    assert ref == {"name": f"{pool['metadata']['name']}-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    # the CRD's CEL rules: a Service (the default kind) needs its port; target port numbers are unique
    assert ref.get("kind", "Service") != "Service" or "port" in ref
    assert len({p["number"] for p in spec["targetPorts"]}) == len(spec["targetPorts"])
    named = by_kind(render(helm, "values.yaml", "inferencePool.enabled=true",
                           "inferencePool.endpointPicker.name=picker", "inferencePool.endpointPicker.failureMode=FailClose"))
    assert named["InferencePool"]["spec"]["endpointPickerRef"]["name"] == "picker"
    # the schema can fail: no target port, an unknown field
    for spoil in (lambda s: s.update(targetPorts=[]), lambda s: s.update(targetPortNumber=8000)):
        bad = {**pool, "spec": dict(spec)}
        spoil(bad["spec"])
        with pytest.raises(jsonschema.ValidationError, match="should be non-empty|Additional properties"):
            validate(bad)
