"""The serving Helm chart (deploy/chart): generated values match the manifests, every runtime x profile renders
with the real helm and validates offline (Kubernetes 1.37 OpenAPI schemas via kubernetes-validate; our own
structural schemas for PodMonitor and ScaledObject), and its probes and grace period come from the measured boots
and the servers' drain — read here from the result files and the server code themselves."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.fixtures.helm import helm  # noqa: F401 - the fixture

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "chart"
RESULTS = REPO / "benchmarks" / "results" / "serving_speed_h200"
CRD_SCHEMAS = {"PodMonitor": "podmonitor.json", "ScaledObject": "scaledobject.json"}
COMBOS = [(r, p) for p in ("g5g", "g4dn") for r in ("vllm", "jax", "pytorch")]
FLEET = yaml.safe_load((REPO / "deploy" / "fleet.yaml").read_text())
VLLM_ENGINE_INIT_S = 76.4  # docs/FACTS.md, fleet section: "engine init 76.4 s" (vLLM on a G5g; not measurable here)


def render(helm_bin: str, values: str, *sets: str, namespace: str = "llm") -> list[dict]:
    argv = [helm_bin, "template", "gemma", str(CHART), "--namespace", namespace, "-f", str(CHART / values)]
    for s in sets:
        argv += ["--set", s]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def validate(doc: dict) -> None:
    if doc["kind"] in CRD_SCHEMAS:
        schema = json.loads((REPO / "tests/fixtures/crd_schemas" / CRD_SCHEMAS[doc["kind"]]).read_text())
        jsonschema.validate(doc, schema)
    else:
        kubernetes_validate.validate(doc, "1.37.0", strict=True)


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs}


def test_committed_chart_is_what_build_py_chart_writes(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "chart", "--out", str(tmp_path / "chart")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "chart"
    generated = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    committed = sorted(p.relative_to(CHART) for p in CHART.rglob("*") if p.is_file())
    assert generated == committed
    stale = [str(p) for p in generated if (out / p).read_text() != (CHART / p).read_text()]
    assert not stale, f"deploy/chart is stale: run `python build.py chart` ({stale})"


def test_chart_registry_and_a_new_directory(tmp_path):
    out = tmp_path / "elsewhere"
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "chart", "--out", str(out), "--registry",
                        "123456789012.dkr.ecr.us-west-2.amazonaws.com/llm"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert (out / "templates" / "deployment.yaml").read_text() == (CHART / "templates" / "deployment.yaml").read_text()
    v = yaml.safe_load((out / "values-jax-g4dn.yaml").read_text())
    assert v["image"] == {"repository": "123456789012.dkr.ecr.us-west-2.amazonaws.com/llm/g5g-images",
                          "tag": "jax-0.12.0.1-cu130-sm75-g4dn", "pullPolicy": "IfNotPresent"}
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "chart", "--out", str(out), "--registry", "a b"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error: --registry a b: expected host[:port][/namespace]" in r.stderr, r.stderr


@pytest.mark.parametrize("runtime,profile", COMBOS)
def test_every_runtime_and_profile_renders_and_validates(helm, runtime, profile):  # noqa: F811
    values = f"values-{runtime}-{profile}.yaml"
    plain = render(helm, values)
    full = render(helm, values, "autoscaling.enabled=true", "podMonitor.enabled=true", "secrets.apiKey.name=llm-api",
                  "secrets.hfToken.name=hf", "compileCache.claimName=jax-cache")
    assert sorted(d["kind"] for d in plain) == ["Deployment", "PodDisruptionBudget", "Service"]
    assert sorted(d["kind"] for d in full) == ["Deployment", "PodDisruptionBudget", "PodMonitor", "ScaledObject",
                                               "Service"]
    for doc in plain + full:
        validate(doc)
    dep = by_kind(plain)["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    arch = {"g5g": "arm64", "g4dn": "amd64"}[profile]
    assert pod["nodeSelector"] == {"kubernetes.io/arch": arch}
    types = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert types["matchExpressions"][0]["key"] == "node.kubernetes.io/instance-type"
    assert {t.split(".")[0] for t in types["matchExpressions"][0]["values"]} == {profile}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert c["image"].split(":")[1].startswith(f"{runtime}-") and c["image"].endswith("-sm75" if profile == "g5g"
                                                                                      else "-sm75-g4dn")
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"]["readOnly"] is True
    assert next(m for m in c["volumeMounts"] if m["name"] == "model")["readOnly"] is True
    # how the runtime takes its model: vllm serve MODEL, python -m serving --model MODEL (g5g/containers.py)
    assert c["args"][:2] == (["/models/gemma-4-E2B-it", "--served-model-name"] if runtime == "vllm"
                             else ["--model", "/models/gemma-4-E2B-it"])
    assert "env" not in c  # no secret named: nothing
    assert dep["spec"]["replicas"] == 1 and "replicas" not in by_kind(full)["Deployment"]["spec"]
    caches = [v for v in by_kind(full)["Deployment"]["spec"]["template"]["spec"]["volumes"] if v["name"] != "model"]
    assert caches == ([{"name": "compile-cache", "persistentVolumeClaim": {"claimName": "jax-cache"}}]
                      if runtime in ("jax", "pytorch") else [])      # runtimes that compile: fleet.yaml compile_cache


def test_secrets_come_from_secret_refs_never_from_values(helm):  # noqa: F811
    docs = render(helm, "values.yaml", "secrets.apiKey.name=llm-api", "secrets.hfToken.name=hf")
    (c,) = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert c["env"] == [{"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm-api", "key": "api-key"}}},
                        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    for path in CHART.glob("values*.yaml"):
        v = yaml.safe_load(path.read_text())
        assert set(v["secrets"]) == {"apiKey", "hfToken"} and all(set(s) == {"name", "key"}
                                                                  for s in v["secrets"].values())


def measured_boots() -> dict[str, float]:
    """The slowest boot of each runtime in every committed H200 serving result (not through fleet.yaml), and
    vLLM's: the field report's engine init plus the weights read as the JAX profile measured it."""
    boots: dict[str, float] = {}
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        for runtime, phase, key in (("jax", "jax", "boot_cold_s"), ("pytorch", "pytorch", "boot_s"),
                                    ("pytorch", "pytorch_batched", "boot_s"), ("pytorch", "pytorch", "boot_cold_s"),
                                    ("pytorch", "pytorch_batched", "boot_cold_s")):
            if key in data.get(phase, {}):
                boots[runtime] = max(boots.get(runtime, 0.0), data[phase][key])
        if "load_s" in data.get("jax_profile", {}).get("boot", {}):
            boots["vllm"] = max(boots.get("vllm", 0.0), VLLM_ENGINE_INIT_S + data["jax_profile"]["boot"]["load_s"])
    return boots


@pytest.mark.parametrize("runtime,profile", COMBOS)
def test_startup_budget_covers_the_slowest_measured_boot(helm, runtime, profile):  # noqa: F811
    boot = measured_boots()[runtime]
    (c,) = by_kind(render(helm, f"values-{runtime}-{profile}.yaml"))["Deployment"]["spec"]["template"]["spec"][
        "containers"]
    s = c["startupProbe"]
    budget = s["periodSeconds"] * s["failureThreshold"]
    assert budget >= boot * FLEET["startup_margin"], (runtime, budget, boot)
    assert budget < boot * FLEET["startup_margin"] + s["periodSeconds"]  # derived, not padded by hand
    assert c["startupProbe"]["httpGet"]["path"] == c["readinessProbe"]["httpGet"]["path"] == "/health"
    live = c["livenessProbe"]
    # liveness starts after startup succeeds, and tolerates minutes of a slow /health, not seconds
    assert live["periodSeconds"] * live["failureThreshold"] >= 60 and live["timeoutSeconds"] >= 5


@pytest.mark.parametrize("drain", [None, 60])
def test_grace_period_covers_prestop_drain_and_the_servers_exit(helm, drain):  # noqa: F811
    from serving.__main__ import build_parser
    from serving.api import server

    default = build_parser().get_default("shutdown_timeout")
    shutdown = default if drain is None else drain
    backstop = server(None, "127.0.0.1", 0, shutdown).config.timeout_graceful_shutdown - shutdown  # uvicorn's
    docs = render(helm, "values-jax-g5g.yaml", *([f"shutdownTimeoutSeconds={drain}"] if drain else []))
    pod = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert c["args"][c["args"].index("--shutdown-timeout") + 1] == str(math.ceil(shutdown))
    assert pod["terminationGracePeriodSeconds"] >= sleep + shutdown + backstop, (pod, backstop)


def test_the_scaler_asks_prometheus_for_this_releases_queue(helm):  # noqa: F811
    docs = render(helm, "values-pytorch-g4dn.yaml", "autoscaling.enabled=true", "autoscaling.maxReplicas=8",
                  namespace="team-a")
    so = by_kind(docs)["ScaledObject"]
    assert so["spec"]["scaleTargetRef"]["name"] == by_kind(docs)["Deployment"]["metadata"]["name"] == "gemma-pytorch"
    (trigger,) = so["spec"]["triggers"]
    assert trigger["metadata"]["query"] == \
        'sum(vllm:num_requests_waiting{namespace="team-a",pod=~"gemma-pytorch-[a-z0-9]+-[a-z0-9]+"})'
    assert so["spec"]["maxReplicaCount"] == 8 and trigger["metadata"]["threshold"] == "4"


@pytest.mark.parametrize("bad,error", [
    ("port=http", "containerPort"),                      # Kubernetes schema: an integer
    ("podMonitor.enabled=true,podMonitor.interval=often", "does not match"),   # ours
    ("autoscaling.enabled=true,autoscaling.prometheusServer=prometheus:9090", "does not match"),
])
def test_the_validation_can_fail(helm, bad, error):  # noqa: F811
    docs = render(helm, "values.yaml", *bad.split(","))
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)) as e:
        for doc in docs:
            validate(doc)
    assert error in str(e.value)


@pytest.mark.slow
def test_the_real_server_answers_health_while_busy_and_exits_within_the_grace(tiny_gemma4):
    """What the probes and the grace period assume, on the real server: /health does not wait for a busy engine
    (each decode step here blocks 1.5 s, standing in for a long prefill), and after SIGTERM the process ends within
    --shutdown-timeout + the chart's exit backstop, a request still running."""
    import threading
    import time

    import requests

    from tests.fixtures.serving import tiny_server

    v = yaml.safe_load((CHART / "values-pytorch-g5g.yaml").read_text())
    live_timeout = v["probes"]["liveness"]["timeoutSeconds"]
    drain = 2
    with tiny_server(tiny_gemma4, "--shutdown-timeout", str(drain), pace=1.5, timeout=240) as srv:
        body = {"model": requests.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
                "ignore_eos": True}
        answer: dict = {}
        t = threading.Thread(target=lambda: answer.update(
            r=requests.post(f"{srv.url}/v1/chat/completions", json=body, timeout=240)))
        t.start()
        time.sleep(2.0)  # the engine is inside its paced steps now
        lat = []
        for _ in range(5):
            t0 = time.monotonic()
            assert requests.get(f"{srv.url}/health", timeout=live_timeout).status_code == 200
            lat.append(time.monotonic() - t0)
            time.sleep(0.3)
        assert max(lat) < 1.0, lat  # under one engine step (1.5 s), far under the probe's timeout
        t0 = time.monotonic()
        srv.terminate()
        rc = srv.exited(drain + v["lifecycle"]["exitBackstopSeconds"])
        took = time.monotonic() - t0
        t.join(30)
    assert rc == 0 and took <= drain + v["lifecycle"]["exitBackstopSeconds"], (rc, took)
    assert answer["r"].status_code in (200, 503)

