"""The serving Helm chart's values, generated from the same plan as the images (tags, port, platform) and from
deploy/fleet.yaml (nodes, measured boot times, decode speeds, probe, rollout and shutdown settings), which is checked
like the manifests (`check_fleet`: one line naming the file and the key). Pure: files in, dicts out.

The templates (deploy/chart/templates), values.schema.json and the init container's script (files/) are
hand-written; `write` puts Chart.yaml, values.yaml (fleet.yaml's `default`) and one values-<runtime>-<profile>.yaml
per serving image next to them, and removes a values file no longer generated.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Field, StrictFloat, StrictInt, StrictStr, model_validator

from g5g.containers import server_command
from g5g.errors import UserError
from g5g.manifest import _read_yaml
from g5g.plan import ImagePlan, Plan
from g5g.schema import _Model, validate

CHART_NAME = "g5g-serving"
ARCH = {"linux/arm64": "arm64", "linux/amd64": "amd64"}
MODEL = "gemma-4-E2B-it"


# --- deploy/fleet.yaml: validated like the manifests (one line naming the file and the key) -------------------------

Positive = Annotated[StrictFloat, Field(gt=0)]
Count = Annotated[StrictInt, Field(ge=1)]
Name = Annotated[StrictStr, Field(pattern=r"^[a-z0-9][a-z0-9-]*$")]


class Term(_Model):
    """A figure: a quoted `value` with its `source`, or a number in a committed result file (`from` + dotted `key`)."""
    value: Positive | None = None
    source: StrictStr | None = None
    from_: StrictStr | None = Field(None, alias="from")
    key: StrictStr | None = None

    @model_validator(mode="after")
    def _one_kind(self):
        if (self.value is None) == (self.from_ is None) or (self.value is not None and not self.source) \
                or (self.from_ is not None and not self.key):
            raise ValueError("a term is {value: N, source: WHY} or {from: FILE, key: a.b}")
        return self


class Nodes(_Model):
    instance_types: dict[StrictStr, Positive] = Field(min_length=1)   # instance type -> its memory, GiB


class Probe(_Model):
    period_s: Count
    timeout_s: Count
    failures: Count


class Probes(_Model):
    period_s: Count
    liveness: Probe
    readiness: Probe
    token_deadline_s: Count   # files/token_probe.py's deadline: the liveness of a runtime without a heartbeat flag


class Shutdown(_Model):
    prestop_sleep_s: Annotated[StrictInt, Field(ge=0)]
    exit_backstop_s: Count


class Rollout(_Model):
    schedule: tuple[Term, ...] = Field(min_length=1)


class Resources(_Model):
    requests: dict[Literal["cpu", "memory"], StrictStr]
    limits: dict[Literal["cpu", "memory"], StrictStr]


class FetchResources(_Model):
    requests: dict[Literal["cpu", "memory"], StrictStr]
    limits: dict[Literal["cpu", "memory"], StrictStr]


class StreamsHow(_Model):
    flag: Annotated[StrictStr, Field(pattern=r"^--[a-z][a-z0-9-]*$")] | None = None
    env: Annotated[StrictStr, Field(pattern=r"^[A-Z][A-Z0-9_]*$")] | None = None


class Streams(_Model):
    per_replica: Count
    how: dict[Name, StreamsHow]


class Autoscaling(_Model):
    target_streams: Positive
    window_s: Count
    scale_up_window_s: Annotated[StrictInt, Field(ge=0)]
    pods_up: Count


class Fleet(_Model):
    default: tuple[Name, Name]
    nodes: dict[Name, Nodes] = Field(min_length=1)
    boot: dict[Name, tuple[tuple[Term, ...], ...]] = Field(min_length=1)
    startup_margin: Annotated[StrictFloat, Field(ge=1)]   # below 1: under the measured boot, a restart loop
    max_model_len: Count
    decode_tok_s: dict[Name, tuple[Term, ...]]
    rollout: Rollout
    compile_cache: dict[Name, Annotated[StrictStr, Field(pattern="^/")]] = {}
    probes: Probes
    shutdown: Shutdown
    resources: Resources
    fetch_resources: FetchResources
    engine_stall_s: dict[Name, Count] = {}   # runtimes whose server takes --engine-stall-timeout
    streams: Streams
    autoscaling: Autoscaling


UNITS = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(text: str, where: str) -> float:
    """A Kubernetes memory quantity (12Gi, 500M, 1024) in bytes."""
    number = text.rstrip("kMGTi")
    try:
        return float(number) * UNITS[text[len(number):]]
    except (ValueError, KeyError):
        raise UserError(f"{where}: {text!r} is not a memory quantity (e.g. 12Gi)") from None


def _check_memory(fleet: Fleet, file: str) -> None:
    """Requests within limits, and the limit within every listed instance's memory (else: never scheduled)."""
    for name, res in (("resources", fleet.resources), ("fetch_resources", fleet.fetch_resources)):
        request, limit = res.requests.get("memory"), res.limits["memory"]
        if request and quantity_bytes(request, f"{file}: {name}.requests.memory") > \
                quantity_bytes(limit, f"{file}: {name}.limits.memory"):
            raise UserError(f"{file}: {name}.requests.memory: {request} is above {name}.limits.memory ({limit})")
    limit = fleet.resources.limits["memory"]
    for profile, nodes in fleet.nodes.items():
        for itype, gib in nodes.instance_types.items():
            if gib * 2**30 < quantity_bytes(limit, f"{file}: resources.limits.memory"):
                raise UserError(f"{file}: nodes.{profile}.instance_types.{itype}: {gib:g} GiB of memory is below "
                                f"resources.limits.memory ({limit}): the pod never fits there")


def check_fleet(data, file: str, repo_root: Path) -> dict:
    """`data` (deploy/fleet.yaml) checked: the keys and types above, then what they refer to."""
    fleet = validate(Fleet, file, data)
    _check_memory(fleet, file)
    runtime, profile = fleet.default
    if runtime not in fleet.boot or profile not in fleet.nodes:
        raise UserError(f"{file}: default: [{runtime}, {profile}] needs a boot entry for {runtime} and nodes for "
                        f"{profile}")
    if unknown := sorted(set(fleet.engine_stall_s) - set(fleet.boot)):
        raise UserError(f"{file}: engine_stall_s.{unknown[0]}: not a runtime that boots ({', '.join(fleet.boot)})")
    if fleet.probes.token_deadline_s >= fleet.probes.liveness.timeout_s:
        raise UserError(f"{file}: probes.token_deadline_s: {fleet.probes.token_deadline_s} is not below "
                        f"probes.liveness.timeout_s ({fleet.probes.liveness.timeout_s}): the kubelet would kill the "
                        "probe before it reports")
    if fleet.autoscaling.target_streams > fleet.streams.per_replica:
        raise UserError(f"{file}: autoscaling.target_streams: {fleet.autoscaling.target_streams:g} is above "
                        f"streams.per_replica ({fleet.streams.per_replica}): the scaler would wait on a queue")
    for rt in fleet.boot:
        if rt not in fleet.streams.how:
            raise UserError(f"{file}: streams.how.{rt}: missing (how the runtime takes its streams per pod)")
        if rt not in fleet.decode_tok_s:
            raise UserError(f"{file}: decode_tok_s.{rt}: missing (every runtime that boots needs its drain speed)")
        for i, entry in enumerate(fleet.boot[rt]):
            for j, term in enumerate(entry):
                _term(term.model_dump(by_alias=True, exclude_none=True), repo_root, f"{file}: boot.{rt}[{i}][{j}]")
    return data


def load_fleet(repo_root: Path) -> dict:
    path = repo_root / "deploy" / "fleet.yaml"
    shown = "deploy/fleet.yaml"
    return check_fleet(_read_yaml(path, shown), shown, repo_root)


def _term(term: dict, repo_root: Path, where: str = "deploy/fleet.yaml") -> float:
    if "value" in term:
        return float(term["value"])
    try:
        data = json.loads((repo_root / term["from"]).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{where}.from: cannot read {term['from']} ({type(e).__name__})") from None
    for k in term["key"].split("."):
        if not isinstance(data, dict) or k not in data:
            raise UserError(f"{where}.key: {term['key']} is not in {term['from']} (no {k!r})")
        data = data[k]
    if isinstance(data, bool) or not isinstance(data, (int, float)):
        raise UserError(f"{where}.key: {term['key']} in {term['from']} is {data!r}, not a number")
    return float(data)


def boot_seconds(fleet: dict, runtime: str, repo_root: Path) -> float:
    """The slowest measured boot of `runtime` (fleet.yaml `boot`: max over entries, each a sum of terms)."""
    return max(sum(_term(t, repo_root, f"deploy/fleet.yaml: boot.{runtime}[{i}]") for t in entry)
               for i, entry in enumerate(fleet["boot"][runtime]))


def decode_speed(fleet: dict, runtime: str, repo_root: Path) -> float:
    """One stream's decode speed on a T4G under load (fleet.yaml `decode_tok_s`: the slowest entry, so the drain
    outlasts the longest reply at the slowest speed on record)."""
    return min(_term(t, repo_root) for t in fleet["decode_tok_s"][runtime])


def values(image: ImagePlan, plan: Plan, fleet: dict, repo_root: Path) -> dict:
    """The values file of one serving image on one profile."""
    profile = plan.profile.name
    if len(image.platforms) != 1 or image.platforms[0] not in ARCH:
        raise UserError(f"chart: {image.runtime} builds {', '.join(image.platforms)}: one node architecture per "
                        "release (pick --platform)")
    if profile not in fleet["nodes"]:
        raise UserError(f"deploy/fleet.yaml: nodes.{profile}: no instance types for profile {profile}")
    repo, tag = image.tags[0].rsplit(":", 1)
    mount = f"/models/{MODEL}"
    cmd = server_command(image.context_vars["model_arg"], mount, None) or []  # how this runtime takes its model: a flag or positional
    probes = fleet["probes"]
    boot = boot_seconds(fleet, image.runtime, repo_root)
    schedule = math.ceil(sum(_term(t, repo_root) for t in fleet["rollout"]["schedule"]))
    # what it costs to get a pod back: a node, the pull, the boot (the scale-down window and pace, below)
    comeback = schedule + math.ceil(boot)
    stall = fleet.get("engine_stall_s", {}).get(image.runtime)
    scale = fleet["autoscaling"]
    return {
        "runtime": image.runtime,
        "profile": profile,
        # digest: sha256:... pins the image (repository@digest; the tag stays for people); requireDigest: refuse to
        # render without one (on in deploy/examples/hardened.yaml)
        "image": {"repository": repo, "tag": tag, "digest": "", "requireDigest": False, "pullPolicy": "IfNotPresent"},
        "imagePullSecrets": [],
        "replicaCount": 1,
        "port": image.context_vars["port"],
        "maxModelLen": fleet["max_model_len"],
        "model": {
            "mountPath": mount, "servedModelName": MODEL, "flag": cmd[0] if cmd and cmd[0] != mount else "",
            "source": "pvc",                                     # pvc | huggingface | s3
            "pvc": {"claimName": MODEL.lower(), "subPath": MODEL},
            # revision: a commit id, required with source huggingface (a branch moves: pods would differ)
            "huggingface": {"repo": f"google/{MODEL}", "revision": ""},
            # the AWS CLI image; s3 refuses it without a digest (@sha256:...): it runs with the bucket's credentials
            "s3": {"uri": "", "image": "public.ecr.aws/aws-cli/aws-cli:2.35.19"},
            "sha256": {},                                        # file -> sha256: checked after a fetch
            # huggingface/s3: a PVC (fetched once) or an emptyDir on the node's disk, requested as ephemeral storage
            "cache": {"claimName": "", "sizeLimit": "24Gi"},
            "fetchResources": {"requests": dict(fleet["fetch_resources"]["requests"]),
                               "limits": dict(fleet["fetch_resources"]["limits"])},
        },
        # streams one pod decodes at once: a flag (vLLM) or an environment variable (ours)
        "streams": {"perReplica": fleet["streams"]["per_replica"], "flag": "", "env": "",
                    **fleet["streams"]["how"].get(image.runtime, {})},
        "extraArgs": [],
        "env": {},
        "secrets": {"apiKey": {"name": "", "key": "api-key"}, "hfToken": {"name": "", "key": "token"}},
        "serviceAccountName": "",
        "drain": {"decodeTokensPerSecond": decode_speed(fleet, image.runtime, repo_root),
                  "shutdownTimeoutSeconds": None},               # None: ceil(maxModelLen / decodeTokensPerSecond)
        "lifecycle": {"preStopSleepSeconds": fleet["shutdown"]["prestop_sleep_s"],
                      "exitBackstopSeconds": fleet["shutdown"]["exit_backstop_s"]},
        "rollout": {"scheduleSeconds": schedule, "maxSurge": 1},
        "probes": {
            "startup": {"periodSeconds": probes["period_s"], "timeoutSeconds": 5,
                        "failureThreshold": math.ceil(boot * fleet["startup_margin"] / probes["period_s"]),
                        "measuredBootSeconds": round(boot, 1)},
            "readiness": {"periodSeconds": probes["readiness"]["period_s"],
                          "timeoutSeconds": probes["readiness"]["timeout_s"],
                          "failureThreshold": probes["readiness"]["failures"]},
            "liveness": {"periodSeconds": probes["liveness"]["period_s"],
                         "timeoutSeconds": probes["liveness"]["timeout_s"],
                         "failureThreshold": probes["liveness"]["failures"],
                         # --engine-stall-timeout: /health turns 503 when the engine is stuck (None: no such flag)
                         "engineStallSeconds": stall,
                         # no heartbeat flag: liveness runs files/token_probe.py (a token must come out)
                         "tokenProbe": {"enabled": stall is None, "deadlineSeconds": probes["token_deadline_s"]}},
        },
        "nodeSelector": {"kubernetes.io/arch": ARCH[image.platforms[0]]},
        "instanceTypes": list(fleet["nodes"][profile]["instance_types"]),
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        # spread over zones and nodes when there is room (soft: a two-GPU node may still take two pods)
        "topologySpread": [{"topologyKey": k, "maxSkew": 1, "whenUnsatisfiable": "ScheduleAnyway"}
                           for k in ("topology.kubernetes.io/zone", "kubernetes.io/hostname")],
        "resources": {"limits": {"nvidia.com/gpu": 1, **fleet["resources"]["limits"]},
                      "requests": {"nvidia.com/gpu": 1, **fleet["resources"]["requests"]}},
        "priorityClassName": "",
        # emptyDirs are bounded: a runaway cache is this pod's eviction, not the node's full disk
        "scratch": {"homeSizeLimit": "2Gi", "tmpSizeLimit": "1Gi"},
        # a runtime's compile cache (fleet.yaml compile_cache; the image's own cache dir): a restart boots warm
        "compileCache": {"path": fleet.get("compile_cache", {}).get(image.runtime, ""), "claimName": "",
                         "sizeLimit": "4Gi"},
        # low-priority pods that hold GPU nodes (and the pulled image) for the next scale-up, preempted by it
        "placeholders": {"replicas": 0, "priority": -10},
        # ingress to the server's port from these peers only; egress DNS (and 443 while a model is fetched)
        "networkPolicy": {"enabled": False, "from": [{"podSelector": {}}],
                          "dns": {"namespace": "kube-system", "podLabels": {"k8s-app": "kube-dns"}}},
        "service": {"type": "ClusterIP", "port": 80},
        # one replica (replicaCount, or autoscaling.minReplicas): minAvailable 1, a drain waits for a new pod;
        # more: maxUnavailable of them at a time
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": 1},
        # on whenever autoscaling is (the scaler's metric comes from this scrape); labels: what the Prometheus
        # selects PodMonitors by, e.g. {release: kube-prometheus-stack}: required, none is refused
        "podMonitor": {"enabled": False, "interval": "15s", "labels": {}},
        # fallbackReplicas: what KEDA scales to after `fallbackAfterFailures` failed queries (None: maxReplicas)
        # fallback: after `fallbackAfterFailures` failed queries, keep the current replicas, or fallbackReplicas if
        # higher (None: minReplicas, so a failing query never scales an idle release up)
        "autoscaling": {"enabled": False, "minReplicas": 1, "maxReplicas": 4,
                        "targetStreamsPerReplica": scale["target_streams"], "window": f"{scale['window_s']}s",
                        "pollingInterval": 15, "cooldownPeriod": 300, "fallbackAfterFailures": 3,
                        "fallbackReplicas": None, "fallbackBehavior": "currentReplicasIfHigher",
                        "behavior": {
                            "scaleUp": {"stabilizationWindowSeconds": scale["scale_up_window_s"], "selectPolicy": "Max",
                                        "policies": [{"type": "Pods", "value": scale["pods_up"], "periodSeconds": 60}]},
                            "scaleDown": {"stabilizationWindowSeconds": comeback, "selectPolicy": "Min",
                                          "policies": [{"type": "Pods", "value": 1, "periodSeconds": comeback}]}},
                        # a TriggerAuthentication for a Prometheus that needs one (name "": none)
                        "authenticationRef": {"name": "", "kind": "TriggerAuthentication"}, "authModes": "",
                        "prometheusServer": "http://prometheus-operated.monitoring.svc:9090"},
    }


def chart_files(plans: list[Plan], fleet: dict, repo_root: Path, version: str) -> dict[str, str]:
    """Chart.yaml, values.yaml and values-<runtime>-<profile>.yaml: file name -> text."""
    header = "# Generated by `python build.py chart` from manifests/ and deploy/fleet.yaml: do not edit.\n"
    files = {"Chart.yaml": header + yaml.safe_dump({
        "apiVersion": "v2", "name": CHART_NAME, "version": version, "appVersion": version, "type": "application",
        "kubeVersion": ">=1.29.0-0",
        "description": "OpenAI-compatible LLM serving on NVIDIA sm_75 nodes (AWS G5g arm64 + T4G, g4dn amd64 + T4): "
                       "vLLM, JAX or PyTorch images from g5g-images"}, sort_keys=False)}
    for plan in plans:
        for image in plan.images:
            if image.runtime in fleet["boot"]:   # the images that serve: those with a measured boot
                v = values(image, plan, fleet, repo_root)
                text = header + yaml.safe_dump(v, sort_keys=False)
                files[f"values-{image.runtime}-{plan.profile.name}.yaml"] = text
                if [image.runtime, plan.profile.name] == fleet.get("default"):   # values.yaml: the chart's default
                    files["values.yaml"] = text
    return files


STATIC = ("templates", "files", "values.schema.json")   # the chart's hand-written parts, next to the generated ones


def write(out: Path, files: dict[str, str], source: Path) -> tuple[list[Path], list[Path]]:
    """The generated files into `out`, the hand-written parts of the chart at `source` beside them when `out` is
    another directory, and a values-*.yaml that is no longer generated removed: (written, removed)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if out.resolve() != source.resolve():
        for name in STATIC:
            if (source / name).is_dir():
                shutil.copytree(source / name, out / name, dirs_exist_ok=True)
            else:
                shutil.copyfile(source / name, out / name)
            written.append(out / name)
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    removed = [p for p in sorted(out.glob("values-*.yaml")) if p.name not in files]
    for p in removed:
        p.unlink()
    return written, removed
