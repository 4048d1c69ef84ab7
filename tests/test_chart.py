"""The serving Helm chart (deploy/chart): generated values match the manifests, every runtime x profile renders
with the real helm and validates offline (Kubernetes 1.37 OpenAPI schemas via kubernetes-validate; our own
structural schemas for PodMonitor and ScaledObject), and its probes and grace period come from the measured boots
and the servers' drain — read here from the result files and the server code themselves."""
from __future__ import annotations

import json
import math
import os
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
PROM_LABEL = "podMonitor.labels.release=kube-prometheus-stack"   # what a default kube-prometheus-stack selects by
REV = "model.huggingface.revision=" + "0123456789abcdef" * 2 + "01234567"   # a commit id (required with the Hub)
AWS_CLI = "model.s3.image=public.ecr.aws/aws-cli/aws-cli:2.35.19@sha256:" + "c" * 64   # pinned (a made-up digest)
VLLM_ENGINE_INIT_S = 76.4  # docs/FACTS.md, fleet section: "engine init 76.4 s" (vLLM on a G5g; not measurable here)


def helm_template(helm_bin: str, values: str, *sets: str, namespace: str = "llm") -> subprocess.CompletedProcess:
    argv = [helm_bin, "template", "gemma", str(CHART), "--namespace", namespace, "-f", str(CHART / values)]
    for s in sets:
        argv += ["--set", s]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def render(helm_bin: str, values: str, *sets: str, namespace: str = "llm") -> list[dict]:
    r = helm_template(helm_bin, values, *sets, namespace=namespace)
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
                          "tag": "jax-0.12.0.1-cu130-sm75-g4dn", "digest": "", "requireDigest": False,
                          "pullPolicy": "IfNotPresent"}
    for static in ("values.schema.json", "files/fetch_model.py"):   # the hand-written parts travel with it
        assert (out / static).read_text() == (CHART / static).read_text()
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "chart", "--out", str(out), "--registry", "a b"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "error: --registry a b: expected host[:port][/namespace]" in r.stderr, r.stderr


def test_helm_lint_passes_with_every_values_file(helm):  # noqa: F811
    """Every generated values file meets values.schema.json, and the chart lints strictly with it."""
    for values in sorted(CHART.glob("values*.yaml")):
        r = subprocess.run([helm, "lint", "--strict", str(CHART), "-f", str(values)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, (values.name, r.stdout + r.stderr)


@pytest.mark.parametrize("runtime,profile", COMBOS)
def test_every_runtime_and_profile_renders_and_validates(helm, runtime, profile):  # noqa: F811
    values = f"values-{runtime}-{profile}.yaml"
    plain = render(helm, values)
    full = render(helm, values, "autoscaling.enabled=true", "podMonitor.enabled=true", "secrets.apiKey.name=llm-api",
                  "secrets.hfToken.name=hf", "compileCache.claimName=jax-cache", PROM_LABEL)
    # Pod: helm test; ConfigMap: its token probe (and vLLM's liveness)
    assert sorted(d["kind"] for d in plain) == ["ConfigMap", "Deployment", "Pod", "PodDisruptionBudget", "Service"]
    assert sorted(d["kind"] for d in full) == ["ConfigMap", "Deployment", "Pod", "PodDisruptionBudget", "PodMonitor",
                                               "ScaledObject", "Service"]
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
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 1, **FLEET["resources"]["limits"]}
    assert c["image"].split(":")[1].startswith(f"{runtime}-") and c["image"].endswith("-sm75" if profile == "g5g"
                                                                                      else "-sm75-g4dn")
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"]["readOnly"] is True
    # the volume holds the model's directory (docs/fleet.md), mounted read-only where the server is pointed
    assert next(m for m in c["volumeMounts"] if m["name"] == "model") == {
        "name": "model", "mountPath": "/models/gemma-4-E2B-it", "readOnly": True, "subPath": "gemma-4-E2B-it"}
    # how the runtime takes its model: vllm serve MODEL, python -m serving --model MODEL (g5g/containers.py)
    assert c["args"][2:4] == (["/models/gemma-4-E2B-it", "--served-model-name"] if runtime == "vllm"
                              else ["--model", "/models/gemma-4-E2B-it"])
    # no secret named: nothing but the streams variable of our runtimes (vLLM takes a flag)
    slots = f"G5G_{'JAX' if runtime == 'jax' else 'TORCH'}_SLOTS"
    assert c.get("env", []) == ([] if runtime == "vllm" else [{"name": slots, "value": "8"}])
    assert dep["spec"]["replicas"] == 1 and "replicas" not in by_kind(full)["Deployment"]["spec"]
    caches = [v for v in by_kind(full)["Deployment"]["spec"]["template"]["spec"]["volumes"]
              if v["name"] == "compile-cache"]
    assert caches == ([{"name": "compile-cache", "persistentVolumeClaim": {"claimName": "jax-cache"}}]
                      if runtime in ("jax", "vllm", "pytorch") else [])      # fleet.yaml compile_cache
    # the model fetched by an init container instead: renders and validates too (ConfigMap with the script)
    for source in ("huggingface", "s3"):
        docs = render(helm, values, f"model.source={source}", "model.s3.uri=s3://models/gemma/", AWS_CLI, REV,
                      "model.sha256.config\\.json=" + "a" * 64, "model.cache.claimName=model-cache")
        assert sorted(d["kind"] for d in docs) == ["ConfigMap", "ConfigMap", "Deployment", "Pod",
                                                   "PodDisruptionBudget", "Service"]
        for doc in docs:
            validate(doc)


def test_secrets_come_from_secret_refs_never_from_values(helm):  # noqa: F811
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    for source in ("pvc", "huggingface"):
        docs = render(helm, "values.yaml", "secrets.apiKey.name=llm-api", "secrets.hfToken.name=hf",
                      f"model.source={source}", REV)
        pod = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        # the server reads a model already on disk: the Hub token goes only to the init container that fetches
        assert c["env"] == [{"name": "VLLM_API_KEY",
                             "valueFrom": {"secretKeyRef": {"name": "llm-api", "key": "api-key"}}}], source
        assert [token in i["env"] for i in pod.get("initContainers", [])] == ([True] if source == "huggingface"
                                                                              else [])
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


def arg(container: dict, flag: str) -> str:
    """The value of the last `flag` in the container's args (argparse: the last one wins)."""
    args = container["args"]
    return args[len(args) - 1 - args[::-1].index(flag) + 1]


@pytest.mark.parametrize("sets", [(), ("maxModelLen=8192",), ("drain.shutdownTimeoutSeconds=60",)])
def test_grace_period_covers_prestop_drain_and_the_servers_exit(helm, sets):  # noqa: F811
    from serving.api.app import server

    docs = render(helm, "values-jax-g5g.yaml", *sets)
    pod = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    shutdown = int(arg(c, "--shutdown-timeout"))
    backstop = server(None, "127.0.0.1", 0, shutdown).config.timeout_graceful_shutdown - shutdown  # uvicorn's
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    if sets == ("drain.shutdownTimeoutSeconds=60",):
        assert shutdown == 60
    assert pod["terminationGracePeriodSeconds"] >= sleep + shutdown + backstop, (pod, backstop)


# One stream's decode speed on a T4G, the slowest figure on record per runtime (docs/FACTS.md, fleet section):
# vLLM 168.3 tok/s over 8 streams; our JAX runtime 12-13 tok/s; none for our PyTorch runtime (JAX's, the slowest).
T4G_STREAM_TOK_S = {"vllm": 168.3 / 8, "jax": 12.0, "pytorch": 12.0}


@pytest.mark.parametrize("runtime", ["vllm", "jax", "pytorch"])
@pytest.mark.parametrize("max_len", [None, 16384])
def test_the_drain_outlasts_the_longest_reply_the_chart_allows_at_t4g_speed(helm, runtime, max_len):  # noqa: F811
    """Every server is capped at --max-model-len tokens (prompt + reply), and after SIGTERM it drains long enough
    for a reply of that length at one stream's T4G speed; the grace period holds the drain."""
    docs = render(helm, f"values-{runtime}-g5g.yaml", *([f"maxModelLen={max_len}"] if max_len else []))
    pod = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    longest = int(arg(c, "--max-model-len"))
    assert longest == (max_len or FLEET["max_model_len"])
    drain = int(arg(c, "--shutdown-timeout"))
    assert drain * T4G_STREAM_TOK_S[runtime] >= longest, (drain, longest)
    assert drain < longest / T4G_STREAM_TOK_S[runtime] + 2  # derived, not padded (fleet.yaml rounds 21.0375 down)
    assert pod["terminationGracePeriodSeconds"] > drain


def test_the_scaler_asks_prometheus_for_this_releases_load(helm):  # noqa: F811
    """The load is every pod's streams, running + waiting, averaged over the window (a full pod with an empty queue
    is still load: scaling on the queue alone drops to minReplicas under full load and flaps); no series is 0."""
    docs = render(helm, "values-pytorch-g4dn.yaml", "autoscaling.enabled=true", "autoscaling.maxReplicas=8",
                  PROM_LABEL, namespace="team-a")
    so = by_kind(docs)["ScaledObject"]
    assert so["spec"]["scaleTargetRef"]["name"] == by_kind(docs)["Deployment"]["metadata"]["name"] == "gemma-pytorch"
    (trigger,) = so["spec"]["triggers"]
    sel = '{namespace="team-a",pod=~"gemma-pytorch-[a-z0-9]+-[a-z0-9]+"}'
    assert trigger["metadata"]["query"] == (f"(sum(avg_over_time(vllm:num_requests_running{sel}[120s])) + "
                                            f"sum(avg_over_time(vllm:num_requests_waiting{sel}[120s]))) or vector(0)")
    assert so["spec"]["maxReplicaCount"] == 8
    assert trigger["metadata"]["threshold"] == f"{FLEET['autoscaling']['target_streams']:g}" == "6"


def test_the_validation_can_fail(helm):  # noqa: F811
    """The offline validation itself catches a bad object (values.schema.json stops bad values before it, so the
    rendered objects are spoiled here)."""
    dep = by_kind(render(helm, "values.yaml"))["Deployment"]
    dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError, match="containerPort"):
        validate(dep)
    so = by_kind(render(helm, "values.yaml", "autoscaling.enabled=true", PROM_LABEL))["ScaledObject"]
    so["spec"]["triggers"][0]["metadata"]["serverAddress"] = "prometheus:9090"
    with pytest.raises(jsonschema.ValidationError, match="does not match"):
        validate(so)


@pytest.mark.parametrize("bad,where", [
    ("autoscaling.enabeld=true", "at '/autoscaling': additional properties 'enabeld' not allowed"),   # a typo
    ("probes.startup.failureThreshold=-1", "at '/probes/startup/failureThreshold': minimum"),
    ("port=http", "at '/port': got string, want integer"),
    ("podMonitor.interval=often", "at '/podMonitor/interval'"),
    ("autoscaling.prometheusServer=prometheus:9090", "at '/autoscaling/prometheusServer'"),
    ("image.digest=sha256:abc", "at '/image/digest'"),
    # scale to zero is refused: with no pod there is no vllm:num_requests_waiting series to wake it and no
    # endpoint for a request to wait on
    ("autoscaling.enabled=true,autoscaling.minReplicas=0", "at '/autoscaling/minReplicas': minimum: got 0, want 1"),
    ("autoscaling.enabled=true,autoscaling.maxReplicas=1,autoscaling.minReplicas=2",
     "autoscaling.maxReplicas: 1 is below autoscaling.minReplicas (2)"),
    ("model.source=s3,model.s3.uri=s3://models/gemma/", "model.sha256: required with model.source s3"),
    # the scrape a default kube-prometheus-stack never selects: refused, naming the key
    ("autoscaling.enabled=true", "podMonitor.labels: required with autoscaling.enabled or podMonitor.enabled"),
    ("podMonitor.enabled=true", "podMonitor.labels: required with autoscaling.enabled or podMonitor.enabled"),
    ("autoscaling.enabled=true,podMonitor.labels.release=kps,autoscaling.fallbackReplicas=9",
     "autoscaling.fallbackReplicas: 9 is outside autoscaling.minReplicas..maxReplicas (1..4)"),
    # a flag the chart sets, spelled --flag=value: refused like --flag value
    ("extraArgs={--port=9001}", "extraArgs: --port is set by port"),
    ("extraArgs={--engine-stall-timeout=5}", "extraArgs: --engine-stall-timeout is set by "
                                             "probes.liveness.engineStallSeconds"),
    ("probes.liveness.engineStallSeconds=60", "probes.liveness.engineStallSeconds: vllm has no engine heartbeat flag"),
    # the AWS CLI runs with the bucket's credentials: by digest only
    ("model.source=s3,model.s3.uri=s3://models/gemma/,model.sha256.config\\.json=" + "a" * 64,
     "model.s3.image: public.ecr.aws/aws-cli/aws-cli:2.35.19 is not pinned by digest"),
    ("model.source=git", "at '/model/source'"),
    ("extraArgs={--max-model-len,32768}", "extraArgs: --max-model-len is set by maxModelLen"),
])
def test_bad_values_are_refused_naming_the_key(helm, bad, where):  # noqa: F811
    r = helm_template(helm, "values.yaml", bad)
    assert r.returncode != 0 and where in r.stderr, r.stderr
    assert "panic" not in r.stderr and "goroutine" not in r.stderr


@pytest.mark.slow
def test_the_real_server_answers_health_while_busy_and_exits_within_the_grace(tiny_gemma4):
    """What the probes and the grace period assume, on the real server: /health does not wait for a busy engine
    (each decode step here blocks 3 s, standing in for a long prefill), and after SIGTERM the process ends within
    --shutdown-timeout + the chart's exit backstop, a request still running."""
    import threading
    import time

    import requests

    from tests.fixtures.serving import tiny_server

    v = yaml.safe_load((CHART / "values-pytorch-g5g.yaml").read_text())
    live_timeout = v["probes"]["liveness"]["timeoutSeconds"]
    drain = 2
    with tiny_server(tiny_gemma4, "--shutdown-timeout", str(drain), pace=3.0, timeout=240) as srv:
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
        # under two thirds of an engine step (3 s; a /health that waited for a step would wait ~2.7 s by the second
        # poll at the latest), far under the probe's timeout; room for a loaded machine's slower answers
        assert max(lat) < 2.0, lat
        t0 = time.monotonic()
        srv.terminate()
        rc = srv.exited(drain + v["lifecycle"]["exitBackstopSeconds"])
        took = time.monotonic() - t0
        t.join(30)
    assert rc == 0 and took <= drain + v["lifecycle"]["exitBackstopSeconds"], (rc, took)
    assert answer["r"].status_code in (200, 503)



def test_autoscaling_scrapes_the_metric_its_scaler_queries(helm):  # noqa: F811
    """autoscaling.enabled alone brings the PodMonitor whose scrape feeds the ScaledObject's query: it selects the
    Deployment's pods on the container's port, carries the labels a kube-prometheus-stack selects by, and the
    trigger errors on a missing series instead of reading it as 0."""
    docs = by_kind(render(helm, "values-jax-g5g.yaml", "autoscaling.enabled=true",
                          "podMonitor.labels.release=kube-prometheus-stack", namespace="team-a"))
    pm, so, dep = docs["PodMonitor"], docs["ScaledObject"], docs["Deployment"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert endpoint["port"] in {p["name"] for p in c["ports"]} and endpoint["path"] == "/metrics"
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (trigger,) = so["spec"]["triggers"]
    # prometheus-operator labels each series with the pod's namespace and name: the query's selector matches the
    # names a ReplicaSet of this Deployment gives its pods
    import re
    pod_re = re.search(r'pod=~"([^"]+)"', trigger["metadata"]["query"]).group(1)
    assert re.fullmatch(pod_re, f"{dep['metadata']['name']}-7c9d8f6b5-x2k4q")
    assert 'namespace="team-a"' in trigger["metadata"]["query"]
    # the metrics exist on our servers under those names (serving/core/metrics.py registers them)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        assert f'"{name}"' in (REPO / "serving" / "core" / "metrics.py").read_text()


@pytest.mark.parametrize("runtime", ["vllm", "jax", "pytorch"])
def test_a_rollout_never_drops_below_the_serving_replicas(helm, runtime):  # noqa: F811
    dep = by_kind(render(helm, f"values-{runtime}-g5g.yaml", "replicaCount=1"))["Deployment"]
    strategy = dep["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate" and strategy["rollingUpdate"]["maxUnavailable"] == 0
    assert strategy["rollingUpdate"]["maxSurge"] >= 1
    # the deadline covers a new node and the pull (fleet.yaml's allowances), the whole startup budget, a readiness
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    budget = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    schedule = sum(t["value"] for t in FLEET["rollout"]["schedule"])
    assert dep["spec"]["progressDeadlineSeconds"] >= schedule + budget + c["readinessProbe"]["periodSeconds"]


def _entrypoint(runtime: str, profile: str) -> list[str]:
    """The image's ENTRYPOINT, as the committed golden Dockerfile has it."""
    line = next(ln for ln in (REPO / "tests" / "golden" / profile / f"{runtime}.Dockerfile").read_text().splitlines()
                if ln.startswith("ENTRYPOINT "))
    return json.loads(line.removeprefix("ENTRYPOINT "))


@pytest.mark.parametrize("runtime,profile", COMBOS)
def test_port_reaches_the_server(helm, runtime, profile):  # noqa: F811
    """`port` moves the server, not only the probes: the chart's args follow the image's entrypoint, and the
    server's own parser (ours; argparse for vLLM too) takes the last --port."""
    docs = by_kind(render(helm, f"values-{runtime}-{profile}.yaml", "port=9000"))
    (c,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert c["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    argv = _entrypoint(runtime, profile) + c["args"]
    assert arg({"args": argv}, "--port") == "9000"
    if runtime != "vllm":  # python3 -m serving --runtime R ...: parse it with the server's parser
        from serving.__main__ import build_parser

        a = build_parser().parse_args(argv[argv.index("serving") + 1:])
        assert (a.port, a.host, a.model, a.max_model_len) == (9000, "0.0.0.0", "/models/gemma-4-E2B-it", 4096)
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == "http"


def test_pods_are_hardened(helm):  # noqa: F811
    digest = "sha256:" + "ab" * 32
    docs = by_kind(render(helm, "values.yaml", f"image.digest={digest}", "model.source=huggingface",
                          REV, "secrets.hfToken.name=hf"))
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    keys = {s["topologyKey"] for s in pod["topologySpreadConstraints"]}
    assert keys == {"topology.kubernetes.io/zone", "kubernetes.io/hostname"}
    selector = docs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert all(s["labelSelector"]["matchLabels"] == selector for s in pod["topologySpreadConstraints"])
    for c in pod["containers"] + pod["initContainers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
    (c,) = pod["containers"]
    assert c["image"].endswith(f"@{digest}") and pod["initContainers"][0]["image"] == c["image"]
    assert c["resources"]["limits"]["memory"] == FLEET["resources"]["limits"]["memory"]
    # a read-only root: HOME (caches) and /tmp are writable volumes
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/home/g5g", "/tmp"}


def test_the_model_from_the_hub_is_fetched_once_into_a_cache_and_checked(helm):  # noqa: F811
    docs = by_kind(render(helm, "values-vllm-g5g.yaml", "model.source=huggingface",
                          "model.huggingface.revision=0123abc" + "0" * 33, "secrets.hfToken.name=hf",
                          "model.cache.claimName=models"))
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    cmd = init["command"]
    assert cmd[:3] == ["python3", "/opt/g5g-chart/fetch_model.py", "huggingface"]
    assert cmd[cmd.index("--repo") + 1] == "google/gemma-4-E2B-it"
    assert cmd[cmd.index("--revision") + 1] == "0123abc" + "0" * 33
    dest = cmd[cmd.index("--dest") + 1]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in init["env"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]
    (c,) = pod["containers"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "model-cache")
    assert mount["readOnly"] is True and f"/cache/{mount['subPath']}" == dest   # the server reads what was checked
    script = next(d for d in render(helm, "values-vllm-g5g.yaml", "model.source=huggingface", REV)
                  if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-fetch"))["data"]["fetch_model.py"]
    assert script == (CHART / "files" / "fetch_model.py").read_text()
    # another revision is another directory: never the old checkpoint under the new name
    other = by_kind(render(helm, "values-vllm-g5g.yaml", "model.source=huggingface",
                           "model.huggingface.revision=4567def" + "0" * 33))["Deployment"]["spec"]["template"]["spec"]
    cmd2 = other["initContainers"][0]["command"]
    assert cmd2[cmd2.index("--dest") + 1] != dest


def test_the_model_from_s3_is_downloaded_then_checked_against_its_hashes(helm):  # noqa: F811
    sums = {"config.json": "a" * 64, "model.safetensors": "b" * 64}
    docs = by_kind(render(helm, "values-jax-g5g.yaml", "model.source=s3", "model.s3.uri=s3://models/gemma-4/", AWS_CLI,
                          *(f"model.sha256.{k.replace('.', chr(92) + '.')}={v}" for k, v in sums.items())))
    download, check = docs["Deployment"]["spec"]["template"]["spec"]["initContainers"]
    assert download["image"].startswith("public.ecr.aws/aws-cli/aws-cli:") and "aws s3 cp" in download["command"][2]
    assert subprocess.run(["sh", "-n", "-c", download["command"][2]], timeout=30).returncode == 0   # it parses
    cmd = check["command"]
    assert cmd[2] == "s3" and [cmd[i + 1] for i, a in enumerate(cmd) if a == "--sha256"] == \
        [f"{k}={v}" for k, v in sums.items()]


def test_fleet_yaml_errors_are_one_line_naming_the_key(tmp_path):
    from g5g import chart
    from g5g.errors import UserError

    good = yaml.safe_load((REPO / "deploy" / "fleet.yaml").read_text())
    cases = [
        ({"probes": {**good["probes"], "period_s": 0}}, "probes.period_s: Input should be greater than or equal to 1"),
        ({"startup_margin": 0}, "startup_margin: Input should be greater than or equal to 1"),
        ({"nodes": {"g5g": {"instance_types": ["g5g.2xlarge"]}}}, "nodes.g5g.instance_types: must be a mapping"),
        # a node whose memory is below the pod's limit: the pod never fits there (g5g.xlarge has 8 GiB)
        ({"nodes": {**good["nodes"], "g5g": {"instance_types": {"g5g.xlarge": 8, "g5g.2xlarge": 16}}}},
         "nodes.g5g.instance_types.g5g.xlarge: 8 GiB of memory is below resources.limits.memory (14Gi)"),
        ({"resources": {"requests": {"cpu": "3", "memory": "16Gi"}, "limits": {"memory": "14Gi"}}},
         "resources.requests.memory: 16Gi is above resources.limits.memory (14Gi)"),
        ({"fetch_resources": {"requests": {"memory": "3Gi"}, "limits": {"memory": "2048Mi"}}},
         "fetch_resources.requests.memory: 3Gi is above fetch_resources.limits.memory (2048Mi)"),
        ({"resources": {"requests": {"memory": "12 GB"}, "limits": {"memory": "14Gi"}}},
         "resources.requests.memory: '12 GB' is not a memory quantity"),
        ({"engine_stall_s": {"llama": 60}}, "engine_stall_s.llama: not a runtime that boots"),
        ({"shutdown": {**good["shutdown"], "exit_backstop_s": -5}}, "shutdown.exit_backstop_s: Input should be"),
        ({"probe": {}}, "probe: unknown key (allowed: autoscaling, boot, compile_cache, decode_tok_s, default, "
                        "engine_stall_s, fetch_resources, max_model_len, nodes, probes, resources, rollout, shutdown, "
                        "startup_margin, streams)"),
        ({"probes": {**good["probes"], "token_deadline_s": 10}},
         "probes.token_deadline_s: 10 is not below probes.liveness.timeout_s (10)"),
        ({"autoscaling": {**good["autoscaling"], "target_streams": 9.0}},
         "autoscaling.target_streams: 9 is above streams.per_replica (8)"),
        ({"streams": {"per_replica": 8, "how": {"vllm": {"flag": "--max-num-seqs"}}}}, "streams.how.jax: missing"),
        ({"max_model_len": "4k"}, "max_model_len: must be a number"),
        ({"boot": {**good["boot"], "jax": [[{"from": "benchmarks/results/nope.json", "key": "a"}]]}},
         "boot.jax[0][0].from: cannot read benchmarks/results/nope.json"),
        ({"boot": {**good["boot"], "jax": [[{"from": good["boot"]["jax"][0][0]["from"], "key": "jax.nope"}]]}},
         "boot.jax[0][0].key: jax.nope is not in"),
        ({"decode_tok_s": {"vllm": [{"value": 21.0}]}}, "decode_tok_s.vllm[0]: a term is {value: N, source: WHY}"),
        ({"default": ["vllm", "g6"]}, "default: [vllm, g6] needs a boot entry for vllm and nodes for g6"),
    ]
    for change, message in cases:
        data = {**good, **change}
        with pytest.raises(UserError) as e:
            chart.check_fleet(data, "deploy/fleet.yaml", REPO)
        assert str(e.value).startswith(f"deploy/fleet.yaml: {message}"), (change, str(e.value))
        assert "\n" not in str(e.value)
    data = {k: v for k, v in good.items() if k != "rollout"}
    with pytest.raises(UserError, match=r"^deploy/fleet.yaml: rollout: missing \(required\)$"):
        chart.check_fleet(data, "deploy/fleet.yaml", REPO)
    (tmp_path / "deploy").mkdir()
    for text, message in (("", "(top level): expected a mapping, got NoneType"), ("nodes: [", "line 1: not valid YAML")):
        (tmp_path / "deploy" / "fleet.yaml").write_text(text)
        with pytest.raises(UserError) as e:
            chart.load_fleet(tmp_path)
        assert str(e.value).startswith(f"deploy/fleet.yaml: {message}"), str(e.value)


def test_build_py_chart_removes_values_files_it_no_longer_generates(tmp_path):
    out = tmp_path / "chart"
    out.mkdir()
    (out / "values-llama-g5g.yaml").write_text("runtime: llama\n")   # a runtime no longer generated
    r = subprocess.run([sys.executable, str(REPO / "build.py"), "chart", "--out", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (out / "values-llama-g5g.yaml").exists() and "removed" in r.stdout
    assert sorted(p.name for p in out.glob("values*")) == sorted(p.name for p in CHART.glob("values*"))


def _fetcher():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fetch_model", CHART / "files" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_fetch_script_checks_every_file_and_publishes_once(tmp_path, monkeypatch, capsys):
    """The init container's script on real files: the s3 path (the download already in .partial/<pod>)."""
    import hashlib

    fm = _fetcher()
    monkeypatch.setenv("POD", "gemma-1")
    cache = tmp_path / "cache"
    partial = cache / ".partial" / "gemma-1"
    partial.mkdir(parents=True)
    files = {"config.json": b'{"model_type": "gemma4"}', "model.safetensors": b"\x00" * 4096}
    for name, data in files.items():
        (partial / name).write_bytes(data)
    sums = [f"{n}={hashlib.sha256(d).hexdigest()}" for n, d in files.items()]
    dest = cache / "gemma"
    argv = ["s3", "--dest", str(dest)] + [x for s in sums for x in ("--sha256", s)]
    # a corrupted file: refused, one line, nothing published
    (partial / "model.safetensors").write_bytes(b"\x00" * 4095 + b"\x01")
    assert fm.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("fetch_model: model.safetensors: sha256 ") and err.count("\n") == 1 and not dest.exists()
    (partial / "model.safetensors").write_bytes(files["model.safetensors"])
    (partial / "extra.bin").write_bytes(b"?")   # a file the list does not name
    assert fm.main(argv) == 1 and "extra.bin: downloaded but not in model.sha256" in capsys.readouterr().err
    (partial / "extra.bin").unlink()
    assert fm.main(argv) == 0
    assert (dest / "model.safetensors").read_bytes() == files["model.safetensors"] and not partial.exists()
    record = json.loads((dest / ".verified").read_text())
    assert record["files"]["config.json"] == "sha256:" + hashlib.sha256(files["config.json"]).hexdigest()
    capsys.readouterr()
    assert fm.main(argv) == 0 and "nothing to do" in capsys.readouterr().out   # fetched once


def test_the_fetch_script_knows_the_hubs_hashes(tmp_path):
    """A file the Hub keeps outside LFS is listed by its git blob id: the script's digest is git's own."""
    from types import SimpleNamespace

    fm = _fetcher()
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<bos>"}\n')
    git = subprocess.run(["git", "hash-object", str(tmp_path / "tokenizer_config.json")], capture_output=True,
                         text=True, timeout=30, check=True).stdout.strip()
    assert fm.file_digest(tmp_path / "tokenizer_config.json", "git-sha1") == git
    siblings = [SimpleNamespace(rfilename="tokenizer_config.json", blob_id=git, lfs=None),
                SimpleNamespace(rfilename="model.safetensors", blob_id="0" * 40,
                                lfs=SimpleNamespace(sha256="c" * 64))]
    assert fm.hub_expected(siblings) == {"tokenizer_config.json": ("git-sha1", git),
                                         "model.safetensors": ("sha256", "c" * 64)}


class _Hub:
    """The two Hub routes a snapshot download uses, on loopback: a revision's file list with hashes, and each
    file's bytes (the real huggingface_hub client talks to it through HF_ENDPOINT)."""

    COMMIT = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, files: dict[str, bytes], lfs: set[str]):
        import hashlib
        import http.server
        import threading

        hub = self
        self.files, self.seen, self.served = files, [], {}   # served: bytes sent instead of a listed file

        def sibling(name: str) -> dict:
            data = files[name]
            out = {"rfilename": name, "size": len(data),
                   "blobId": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
            if name in lfs:
                out["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            return out

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _route(self, body: bool):
                hub.seen.append((self.command, self.path, self.headers.get("authorization")))
                path = self.path.split("?")[0]
                if path.startswith("/api/models/") and "/tree/" in path:   # snapshot_download's listing
                    data = json.dumps([{"type": "file", "path": s["rfilename"], "size": s["size"], "oid": s["blobId"],
                                        **({"lfs": {"oid": s["lfs"]["sha256"], "size": s["size"],
                                                    "pointerSize": 134}} if "lfs" in s else {})}
                                       for s in map(sibling, files)]).encode()
                    headers = {"Content-Type": "application/json"}
                elif path.startswith("/api/models/"):
                    data = json.dumps({"id": "google/gemma-4-E2B-it", "sha": hub.COMMIT,
                                       "siblings": [sibling(n) for n in files]}).encode()
                    headers = {"Content-Type": "application/json"}
                elif "/resolve/" in path:
                    name = path.split("/resolve/", 1)[1].split("/", 1)[1]
                    if name not in files:
                        self.send_response(404)
                        self.end_headers()
                        return
                    data = hub.served.get(name, files[name])
                    s = sibling(name)
                    etag = s["lfs"]["sha256"] if "lfs" in s else s["blobId"]
                    headers = {"X-Repo-Commit": hub.COMMIT, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_GET(self):
                self._route(True)

            def do_HEAD(self):
                self._route(False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_fetch_script_downloads_from_a_hub_and_checks_the_hubs_hashes(tmp_path):
    """The init container's command as the chart renders it, run here with the real huggingface_hub against a
    loopback Hub: the token goes with the requests, every file is checked against the Hub's hashes, and a file
    spoiled on the way is refused."""
    files = {"config.json": b'{"model_type": "gemma4"}\n', "model.safetensors": bytes(range(256)) * 64,
             "tokenizer.json": b'{"version": "1.0"}\n'}
    hub = _Hub(files, lfs={"model.safetensors"})
    try:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_secret", "HF_HOME": str(tmp_path / "hf"),
               "POD": "gemma-0", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}
        dest = tmp_path / "cache" / "gemma"
        argv = [sys.executable, str(CHART / "files" / "fetch_model.py"), "huggingface", "--dest", str(dest),
                "--repo", "google/gemma-4-E2B-it", "--revision", "main"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        assert {n: (dest / n).read_bytes() for n in files} == files
        record = json.loads((dest / ".verified").read_text())
        assert record["commit"] == hub.COMMIT and set(record["files"]) == set(files)
        assert record["files"]["model.safetensors"].startswith("sha256:")
        assert record["files"]["config.json"].startswith("git-sha1:")
        assert all(auth == "Bearer hf_secret" for _, path, auth in hub.seen if "gemma" in path), hub.seen
        # a file that arrives spoiled (the bytes are not those the Hub lists): refused in one line, nothing published
        hub.served["model.safetensors"] = b"\xff" + files["model.safetensors"][1:]
        other = tmp_path / "cache" / "other"
        r = subprocess.run([*argv[:4], str(other), *argv[5:]], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 1 and r.stderr.startswith("fetch_model: model.safetensors: sha256 "), r.stderr
        assert r.stderr.count("\n") == 1 and not other.exists()
        # the first pod's checked copy is never fetched again
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0 and "nothing to do" in r.stdout, r.stderr
    finally:
        hub.server.shutdown()


@pytest.mark.slow
def test_the_real_server_listens_on_the_charts_port_with_the_charts_args(helm, tiny_gemma4):  # noqa: F811
    """The image's entrypoint and the chart's args as the pod runs them (the model path and the host changed for
    this machine: the tiny checkpoint, loopback only): the server answers on the chart's port, not the image's."""
    from devtools.server import free_port, running, serving_env

    port = free_port()
    (c,) = by_kind(render(helm, "values-pytorch-g5g.yaml", f"port={port}"))["Deployment"]["spec"]["template"][
        "spec"]["containers"]
    entry = _entrypoint("pytorch", "g5g")
    assert entry[:3] == ["python3", "-m", "serving"] and "8000" in entry
    args = [str(tiny_gemma4) if a == "/models/gemma-4-E2B-it" else a for a in c["args"]]
    argv = [sys.executable, *entry[1:], *args, "--host", "127.0.0.1", "--log-level", "warning"]
    with running(argv, f"http://127.0.0.1:{port}", env=serving_env(), timeout=600) as srv:
        import requests

        card = requests.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]
        assert card["id"] == "gemma-4-E2B-it" and card["max_model_len"] <= FLEET["max_model_len"]


def test_the_helm_commands_in_the_docs_render(helm):  # noqa: F811
    """Every `helm install` in docs/fleet.md, as `helm template`: a documented value that the schema no longer
    takes fails here."""
    text = (REPO / "docs" / "fleet.md").read_text().replace("\\\n", " ")
    # the placeholders a reader fills in, filled; upstream's charts (an oci:// reference) are not ours to render
    text = text.replace("<40-hex commit>", "0" * 40).replace("sha256:<64 hex>", "sha256:" + "a" * 64)
    commands = [line.split() for line in text.splitlines()
                if line.strip().startswith("helm install ") and " deploy/chart " in line]
    assert len(commands) >= 4
    for argv in commands:
        argv = argv[argv.index("helm"):]
        r = subprocess.run([helm, "template", *argv[2:]], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert r.returncode == 0, (argv, r.stderr)
