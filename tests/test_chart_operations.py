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
from tests.test_chart import (AWS_CLI, CHART, COMBOS, FLEET, PROM_LABEL, REPO, REV, _fetcher, arg, by_kind, render,
                              validate)


def pod_spec(docs: list[dict]) -> dict:
    return by_kind(docs)["Deployment"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("sets,spec", [
    ((), {"minAvailable": 1}),
    (("replicaCount=3",), {"maxUnavailable": 1}),
    # autoscaled: one at a time even at minReplicas 1 (minAvailable 1 would let 3 of 4 go at once)
    (("autoscaling.enabled=true", PROM_LABEL), {"maxUnavailable": 1}),
    (("autoscaling.enabled=true", PROM_LABEL, "autoscaling.minReplicas=2"), {"maxUnavailable": 1}),
    (("replicaCount=3", "podDisruptionBudget.maxUnavailable=2"), {"maxUnavailable": 2}),
])
def test_a_drain_never_evicts_the_only_serving_pod(helm, sets, spec):  # noqa: F811
    """A fixed single replica: minAvailable 1 (an eviction waits until a second pod is Ready); more, or autoscaled:
    maxUnavailable at a time.
    A pod that is not Ready never blocks a drain."""
    pdb = by_kind(render(helm, "values.yaml", *sets))["PodDisruptionBudget"]
    validate(pdb)
    assert {k: v for k, v in pdb["spec"].items() if k in ("minAvailable", "maxUnavailable")} == spec
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_the_scaler_falls_back_without_scaling_an_idle_release_up(helm):  # noqa: F811
    """After fallbackAfterFailures failed queries KEDA keeps the current replicas, or fallbackReplicas if higher, and
    that defaults to minReplicas: a Prometheus outage over an idle release never buys GPU nodes (the old default,
    maxReplicas, sent every fresh install to the maximum)."""
    so = by_kind(render(helm, "values-jax-g5g.yaml", "autoscaling.enabled=true", PROM_LABEL,
                        "autoscaling.maxReplicas=6", "autoscaling.minReplicas=2"))["ScaledObject"]
    validate(so)
    assert so["spec"]["fallback"] == {"failureThreshold": 3, "replicas": 2, "behavior": "currentReplicasIfHigher"}
    so = by_kind(render(helm, "values-jax-g5g.yaml", "autoscaling.enabled=true", PROM_LABEL,
                        "autoscaling.fallbackReplicas=3", "autoscaling.fallbackAfterFailures=5"))["ScaledObject"]
    assert so["spec"]["fallback"] == {"failureThreshold": 5, "replicas": 3, "behavior": "currentReplicasIfHigher"}


@pytest.mark.parametrize("runtime,profile", COMBOS)
def test_helm_test_asks_the_service_for_a_token_without_a_gpu(helm, runtime, profile):  # noqa: F811
    """`helm test`: the release's Service must answer a 1-token completion (GPU, driver, model and Service at once);
    the pod asks for no GPU and is kept from the node's GPUs, runs where the release runs, from its image."""
    docs = render(helm, f"values-{runtime}-{profile}.yaml", "image.digest=sha256:" + "ab" * 32,
                  "secrets.apiKey.name=llm-api")
    (test,) = [d for d in docs if d["kind"] == "Pod"]
    validate(test)
    assert test["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec, pod = test["spec"], pod_spec(docs)
    for key in ("nodeSelector", "affinity", "tolerations"):      # where the release's pods go (its image is there)
        assert spec[key] == pod[key], key
    (c,) = spec["containers"]
    for part in ("limits", "requests"):
        assert not any(k.startswith("nvidia.com/") for k in c["resources"].get(part, {})), c["resources"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "void"
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "llm-api"
    svc = by_kind(docs)["Service"]
    assert c["command"][:2] == ["python3", "/opt/g5g-probe/token_probe.py"]
    url = f"http://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    assert arg(c | {"args": c["command"]}, "--url") == url
    assert arg(c | {"args": c["command"]}, "--model") == "gemma-4-E2B-it"
    probe_cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-probe"))
    assert probe_cm["data"]["token_probe.py"] == (CHART / "files" / "token_probe.py").read_text()
    assert next(v for v in spec["volumes"] if v["name"] == "probe-script")["configMap"]["name"] == \
        probe_cm["metadata"]["name"]
    assert c["image"] == pod["containers"][0]["image"]
    assert spec["restartPolicy"] == "Never" and c["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.parametrize("sets,storage", [
    (("model.source=huggingface", REV), "24Gi"),
    (("model.source=huggingface", REV, "model.cache.sizeLimit=40Gi"), "40Gi"),
    (("model.source=s3", "model.s3.uri=s3://m/g/", AWS_CLI, "model.sha256.config\\.json=" + "a" * 64), "24Gi"),
    (("model.source=huggingface", REV, "model.cache.claimName=models"), None),    # a PVC: not the node's disk
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
def test_liveness_restarts_a_wedged_engine_on_every_runtime(helm, runtime):  # noqa: F811
    """Our servers get --engine-stall-timeout (fleet.yaml engine_stall_s), so the liveness probe's /health turns 503
    when their engine holds work without finishing a step. vLLM has no such flag and its /health stays 200 while its
    engine core is stuck: its liveness is the token probe, which needs a token out within its deadline."""
    pod = pod_spec(render(helm, f"values-{runtime}-g5g.yaml"))
    (c,) = pod["containers"]
    live = c["livenessProbe"]
    if runtime == "vllm":
        assert "--engine-stall-timeout" not in c["args"] and "httpGet" not in live
        cmd = live["exec"]["command"]
        assert cmd[:2] == ["python3", "/opt/g5g-probe/token_probe.py"]
        argv = {"args": cmd}
        assert arg(argv, "--url") == f"http://127.0.0.1:{c['ports'][0]['containerPort']}"
        assert arg(argv, "--model") == arg(c, "--served-model-name")
        deadline = int(arg(argv, "--deadline"))
        assert deadline == FLEET["probes"]["token_deadline_s"] and deadline < live["timeoutSeconds"]
        assert arg(argv, "--state").startswith("/tmp/")                 # the writable emptyDir
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/opt/g5g-probe")
        assert next(v for v in pod["volumes"] if v["name"] == mount["name"])["configMap"]["name"] == "gemma-vllm-probe"
        return
    assert live["httpGet"]["path"] == "/health"
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
