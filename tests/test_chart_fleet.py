"""The chart as an SRE runs a fleet of it (issue 52): autoscaling that neither flaps nor floods, placeholder pods that
keep a GPU node warm, a NetworkPolicy, Guaranteed QoS, bounded scratch volumes, a pinned model revision and image,
and the hardened example. Rendered with the real helm and validated as tests/test_chart.py does."""
from __future__ import annotations

import math
import re

import pytest
import yaml

from tests.fixtures.helm import helm  # noqa: F401 - the fixture
from tests.test_chart import (CHART, COMBOS, FLEET, PROM_LABEL, REPO, REV, arg, by_kind, helm_template, measured_boots,
                              render, validate)

HARDENED = str(REPO / "deploy" / "examples" / "hardened.yaml")
DIGEST = "image.digest=sha256:" + "ab" * 32
AUTO = ("autoscaling.enabled=true", PROM_LABEL)


def pods(docs: list[dict]) -> list[tuple[str, dict]]:
    """(name, pod spec) of every pod the release makes: its Deployments' templates and the `helm test` pod."""
    out = [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] == "Deployment"]
    return out + [(d["metadata"]["name"], d["spec"]) for d in docs if d["kind"] == "Pod"]


def qos_class(pod: dict) -> str:
    """Kubernetes' QoS class of a pod spec (init containers count): Guaranteed when every container has cpu and memory
    limits and its requests, where given, equal them."""
    containers = pod["containers"] + pod.get("initContainers", [])
    if not any(c.get("resources", {}).get(p, {}).get(r) for c in containers for p in ("requests", "limits")
               for r in ("cpu", "memory")):
        return "BestEffort"
    for c in containers:
        res = c.get("resources", {})
        for r in ("cpu", "memory"):
            limit = res.get("limits", {}).get(r)
            if limit is None or str(res.get("requests", {}).get(r, limit)) != str(limit):
                return "Burstable"
    return "Guaranteed"


# --- autoscaling: behavior, a fresh install, the fallback ------------------------------------------------------------

@pytest.mark.parametrize("runtime", ["vllm", "jax", "pytorch"])
def test_the_scaler_scales_up_on_a_held_rise_and_down_one_pod_at_a_time(helm, runtime):  # noqa: F811
    """The HPA behind the ScaledObject has both stabilisation windows: a rise must hold scale_up_window_s before a
    GPU node is bought, and a pod is kept as long as getting it back costs (a node, the pull and the slowest
    measured boot), then released one at a time."""
    docs = render(helm, f"values-{runtime}-g5g.yaml", *AUTO)
    so, dep = by_kind(docs)["ScaledObject"], by_kind(docs)["Deployment"]
    validate(so)
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    up, down = behavior["scaleUp"], behavior["scaleDown"]
    assert up["stabilizationWindowSeconds"] == FLEET["autoscaling"]["scale_up_window_s"] > 0
    assert up["policies"] == [{"type": "Pods", "value": FLEET["autoscaling"]["pods_up"], "periodSeconds": 60}]
    schedule = sum(t["value"] for t in FLEET["rollout"]["schedule"])
    comeback = schedule + math.ceil(measured_boots()[runtime])
    assert down["stabilizationWindowSeconds"] == comeback
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": comeback}]
    assert down["selectPolicy"] == "Min"
    # the scale-down window outlasts a new pod's way to Ready, as the rollout deadline counts it
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert down["stabilizationWindowSeconds"] >= schedule + measured_boots()[runtime]
    assert down["stabilizationWindowSeconds"] < dep["spec"]["progressDeadlineSeconds"]


def test_a_fresh_install_stays_at_min_replicas(helm):  # noqa: F811
    """Before the first pod is scraped there is no series: the query reads 0 (`or vector(0)`), not an error that
    counts toward the fallback, so a new release stays at minReplicas until load arrives; the load is averaged over
    the window, so one poll's burst moves it little."""
    so = by_kind(render(helm, "values.yaml", *AUTO, "autoscaling.minReplicas=2"))["ScaledObject"]
    query = so["spec"]["triggers"][0]["metadata"]["query"]
    assert query.endswith(" or vector(0)") and query.startswith("(") and query.count("(") == query.count(")")
    assert query.count("avg_over_time(") == 2 and query.count("[120s]") == 2
    assert "ignoreNullValues" not in so["spec"]["triggers"][0]["metadata"]
    assert so["spec"]["minReplicaCount"] == 2 and so["spec"]["fallback"]["replicas"] == 2


def test_the_scaler_authenticates_to_prometheus_when_told(helm):  # noqa: F811
    plain = by_kind(render(helm, "values.yaml", *AUTO))["ScaledObject"]["spec"]["triggers"][0]
    assert "authenticationRef" not in plain and "authModes" not in plain["metadata"]
    so = by_kind(render(helm, "values.yaml", *AUTO, "autoscaling.authenticationRef.name=prom-auth",
                        "autoscaling.authModes=bearer"))["ScaledObject"]
    validate(so)
    (trigger,) = so["spec"]["triggers"]
    assert trigger["authenticationRef"] == {"name": "prom-auth", "kind": "TriggerAuthentication"}
    assert trigger["metadata"]["authModes"] == "bearer"


# --- streams per pod: what the drain and the scaler's target assume --------------------------------------------------

@pytest.mark.parametrize("runtime", ["vllm", "jax", "pytorch"])
def test_every_runtime_decodes_the_streams_the_drain_was_measured_at(helm, runtime):  # noqa: F811
    (c,) = by_kind(render(helm, f"values-{runtime}-g5g.yaml"))["Deployment"]["spec"]["template"]["spec"]["containers"]
    n = FLEET["streams"]["per_replica"]
    # the vLLM drain speed is 168.3 tok/s over 8 streams (fleet.yaml decode_tok_s), so the pod is held to 8
    assert "8 streams" in FLEET_TEXT and n == 8
    if runtime == "vllm":
        assert arg(c, "--max-num-seqs") == str(n)
    else:
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env[FLEET["streams"]["how"][runtime]["env"]] == str(n)
        # and the runtime reads that variable (its engine's settings)
        pkg = {"jax": "jax_runtime", "pytorch": "torch_runtime"}[runtime]
        assert FLEET["streams"]["how"][runtime]["env"] in (REPO / "serving" / pkg / "engine.py").read_text()
    assert FLEET["autoscaling"]["target_streams"] < n   # the scaler adds a pod before the slots are full


FLEET_TEXT = (REPO / "deploy" / "fleet.yaml").read_text()


@pytest.mark.parametrize("bad,where", [
    ("extraArgs={--max-num-seqs=64}", "extraArgs: --max-num-seqs is set by streams.perReplica"),
    ("model.source=huggingface", 'model.huggingface.revision: "" is not a commit id'),
    ("model.source=huggingface,model.huggingface.revision=main", "at '/model/huggingface/revision'"),
    ("image.requireDigest=true", "image.digest: required (image.requireDigest)"),
    ("placeholders.replicas=1,placeholders.priority=0", "at '/placeholders/priority'"),
    ("probes.liveness.tokenProbe.deadlineSeconds=10",
     "probes.liveness.tokenProbe.deadlineSeconds: 10 is not below probes.liveness.timeoutSeconds (10)"),
])
def test_round_four_values_are_refused_naming_the_key(helm, bad, where):  # noqa: F811
    r = helm_template(helm, "values.yaml", bad)
    assert r.returncode != 0 and where in r.stderr, r.stderr


def test_the_model_revision_is_a_commit(helm):  # noqa: F811
    """No `main` default: a branch moves, and pods started a day apart would serve different weights."""
    for path in CHART.glob("values*.yaml"):
        assert yaml.safe_load(path.read_text())["model"]["huggingface"]["revision"] == "", path.name
    docs = render(helm, "values.yaml", "model.source=huggingface", REV)
    pod = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]
    cmd = pod["initContainers"][0]["command"]
    assert re.fullmatch("[0-9a-f]{40}", cmd[cmd.index("--revision") + 1])


# --- placeholders and priority ----------------------------------------------------------------------------------------

def test_placeholders_hold_a_gpu_node_at_a_priority_every_server_preempts(helm):  # noqa: F811
    assert not [d for d in render(helm, "values.yaml") if d["kind"] == "PriorityClass"]    # optional
    docs = render(helm, "values.yaml", "placeholders.replicas=2", "priorityClassName=llm-serving", DIGEST)
    for d in docs:
        validate(d)
    (pc,) = [d for d in docs if d["kind"] == "PriorityClass"]
    (server,) = [d for d in docs if d["kind"] == "Deployment" and not d["metadata"]["name"].endswith("-placeholder")]
    (holder,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-placeholder")]
    assert pc["value"] < 0 and pc["preemptionPolicy"] == "Never" and pc["globalDefault"] is False
    spec, sspec = holder["spec"]["template"]["spec"], server["spec"]["template"]["spec"]
    assert holder["spec"]["replicas"] == 2 and spec["priorityClassName"] == pc["metadata"]["name"]
    assert sspec["priorityClassName"] == "llm-serving"       # the server's own class (pods default to 0 > -10)
    (h,), (s,) = spec["containers"], sspec["containers"]
    assert h["resources"] == s["resources"] and h["resources"]["limits"]["nvidia.com/gpu"] == 1   # a node it fits
    assert h["image"] == s["image"]                         # the image is pulled on the node it holds
    for key in ("nodeSelector", "affinity", "tolerations"):
        assert spec[key] == sspec[key], key
    # never one of the server's pods: not behind its Service, PDB, or counted in its spread
    labels = holder["spec"]["template"]["metadata"]["labels"]
    for d in docs:
        if d["kind"] in ("Service", "PodDisruptionBudget"):
            sel = d["spec"]["selector"].get("matchLabels", d["spec"]["selector"])
            assert not sel.items() <= labels.items(), d["kind"]
    assert "priorityClassName" not in by_kind(render(helm, "values.yaml"))["Deployment"]["spec"]["template"]["spec"]


# --- NetworkPolicy ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("source,https", [("pvc", False), ("huggingface", True)])
def test_the_network_policy_lets_in_only_the_named_peers_on_the_servers_port(helm, source, https):  # noqa: F811
    assert "NetworkPolicy" not in by_kind(render(helm, "values.yaml"))                    # optional
    docs = by_kind(render(helm, "values.yaml", "networkPolicy.enabled=true", f"model.source={source}", REV))
    np, dep = docs["NetworkPolicy"], docs["Deployment"]
    validate(np)
    assert np["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    (rule,) = np["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {}}] and rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert "http" in {p["name"] for p in c["ports"]}
    dns, *rest = np["spec"]["egress"]
    assert {p["port"] for p in dns["ports"]} == {53} and dns["to"][0]["podSelector"]["matchLabels"] == {
        "k8s-app": "kube-dns"}
    assert rest == ([{"ports": [{"port": 443, "protocol": "TCP"}]}] if https else [])
    # an empty `from` would let every source in: refused
    import subprocess

    r = subprocess.run([helm, "template", "gemma", str(CHART), "--set", "networkPolicy.enabled=true", "--set-json",
                        "networkPolicy.from=[]"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "at '/networkPolicy/from': minItems" in r.stderr, r.stderr


# --- QoS and scratch --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("runtime,profile", COMBOS)
@pytest.mark.parametrize("source", ["pvc", "huggingface", "s3"])
def test_every_pod_is_guaranteed_and_every_empty_dir_is_bounded(helm, runtime, profile, source):  # noqa: F811
    """Requests equal limits in every container, init containers too (the kubelet evicts Guaranteed pods last), and
    no emptyDir without a sizeLimit (a runaway cache evicts this pod instead of filling the node's disk)."""
    docs = render(helm, f"values-{runtime}-{profile}.yaml", f"model.source={source}", REV,
                  "model.s3.uri=s3://m/g/", "model.s3.image=public.ecr.aws/aws-cli/aws-cli:2.35.19@sha256:" + "c" * 64,
                  "model.sha256.config\\.json=" + "a" * 64, "placeholders.replicas=1")
    seen = 0
    for name, pod in pods(docs):
        assert qos_class(pod) == "Guaranteed", name
        for vol in pod.get("volumes", []):
            if "emptyDir" in vol:
                assert vol["emptyDir"].get("sizeLimit"), (name, vol)
                seen += 1
    assert seen >= 2 + (runtime in FLEET["compile_cache"]) + (source != "pvc")   # home, tmp, compile cache, model


def test_qos_class_can_tell_burstable():
    pod = {"containers": [{"resources": {"requests": {"cpu": "3", "memory": "12Gi"},
                                         "limits": {"cpu": "3", "memory": "14Gi"}}}]}
    assert qos_class(pod) == "Burstable"
    pod["containers"][0]["resources"]["requests"]["memory"] = "14Gi"
    assert qos_class(pod) == "Guaranteed"
    pod["initContainers"] = [{"resources": {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}}]
    assert qos_class(pod) == "Burstable"


def test_max_surge_is_a_value(helm):  # noqa: F811
    dep = by_kind(render(helm, "values.yaml", "rollout.maxSurge=2"))["Deployment"]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 2, "maxUnavailable": 0}


# --- the hardened example ---------------------------------------------------------------------------------------------

def test_the_hardened_example_renders_pinned_private_and_never_one_pod(helm):  # noqa: F811
    argv = ["-f", HARDENED]
    r = helm_template(helm, "values-vllm-g5g.yaml", PROM_LABEL)
    assert r.returncode == 0     # the baseline renders; the example alone must be given a digest:
    import subprocess

    base = [helm, "template", "gemma", str(CHART), "--namespace", "llm", "-f", str(CHART / "values-vllm-g5g.yaml"),
            *argv, "--set", PROM_LABEL]
    r = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "image.digest: required" in r.stderr, r.stderr
    r = subprocess.run(base + ["--set", DIGEST], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = [d for d in yaml.safe_load_all(r.stdout) if d]
    for d in docs:
        validate(d)
    kinds = by_kind(docs)
    assert kinds["NetworkPolicy"]["spec"]["ingress"][0]["from"][-1] == {"podSelector": {}}
    assert kinds["ScaledObject"]["spec"]["minReplicaCount"] == 2
    assert kinds["PodDisruptionBudget"]["spec"] == {**kinds["PodDisruptionBudget"]["spec"], "maxUnavailable": 1}
    assert any(d["kind"] == "PriorityClass" for d in docs)
    for _, pod in pods(docs):
        for c in pod["containers"]:
            assert c["image"].endswith("@sha256:" + "ab" * 32)
    (c,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "gemma-vllm"][0]["spec"][
        "template"]["spec"]["containers"]
    assert {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llm-api", "key": "api-key"}}} in c["env"]


# --- docs/fleet.md: the install steps as a new user reads them --------------------------------------------------------

DOCS = (REPO / "docs" / "fleet.md").read_text()


def test_the_install_steps_schedule_the_device_plugin_on_the_node_group_they_create():
    """Step 1's node group carries a label the device plugin's DaemonSet selects (nvidia.com/gpu.present=true) and
    the taint the chart tolerates, on an instance type the chart selects; the plugin is installed after it."""
    steps = DOCS[DOCS.index("## Install, step by step"):]
    block = steps[steps.index("apiVersion: eksctl.io/v1alpha5"):steps.index("Why a label")]
    group = yaml.safe_load("\n".join(line[7:] for line in block.splitlines()))["managedNodeGroups"][0]
    assert group["labels"]["nvidia.com/gpu.present"] == "true"
    values = yaml.safe_load((CHART / "values-vllm-g5g.yaml").read_text())
    assert group["instanceType"] in values["instanceTypes"]
    (taint,) = group["taints"]
    assert any(t["key"] == taint["key"] and t["effect"] == taint["effect"] and t["operator"] == "Exists"
               for t in values["tolerations"])
    assert steps.index("nvidia.com/gpu.present") < steps.index("helm upgrade --install nvdp")
    assert steps.index("helm upgrade --install nvdp") < steps.index("helm install gemma ")


def test_the_docs_say_what_every_autoscaling_setting_does_with_a_burst_and_with_silence():
    table = DOCS[DOCS.index("| setting | default | with a burst | with silence |"):]
    table = table[:table.index("\n\n")]
    values = yaml.safe_load((CHART / "values.yaml").read_text())["autoscaling"]
    tunable = set(values) - {"enabled", "prometheusServer", "authenticationRef", "authModes"}
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    named = {k for k in tunable if any(f"`{k}" in r or f"`{k}`" in r for r in rows)}
    assert named == tunable, tunable - named
    assert any("fresh install" in r for r in rows)
    # the scale-down figures quoted are the rendered ones
    for runtime, label in (("vllm", "vLLM"), ("jax", "JAX"), ("pytorch", "PyTorch")):
        down = yaml.safe_load((CHART / f"values-{runtime}-g5g.yaml").read_text())["autoscaling"]["behavior"]["scaleDown"]
        assert f"{down['stabilizationWindowSeconds']} s {label}" in table, (runtime, down)
