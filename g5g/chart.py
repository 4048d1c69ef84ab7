"""The serving Helm chart's values, generated from the same plan as the images (tags, port, platform) and from
deploy/fleet.yaml (nodes, measured boot times, probe and shutdown settings). Pure: files in, dicts out.

The templates are static Helm templates in deploy/chart/templates; `write` puts Chart.yaml, values.yaml (the
g5g vLLM defaults) and one values-<runtime>-<profile>.yaml per serving image next to them.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import yaml

from g5g.containers import server_command
from g5g.errors import UserError
from g5g.plan import ImagePlan, Plan

CHART_NAME = "g5g-serving"
ARCH = {"linux/arm64": "arm64", "linux/amd64": "amd64"}
MODEL = "gemma-4-E2B-it"


def load_fleet(repo_root: Path) -> dict:
    path = repo_root / "deploy" / "fleet.yaml"
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"{path}: cannot read it ({e})") from None


def _term(term: dict, repo_root: Path) -> float:
    if "value" in term:
        return float(term["value"])
    data = json.loads((repo_root / term["from"]).read_text())
    for k in term["key"].split("."):
        data = data[k]
    return float(data)


def boot_seconds(fleet: dict, runtime: str, repo_root: Path) -> float:
    """The slowest measured boot of `runtime` (fleet.yaml `boot`: max over entries, each a sum of terms)."""
    try:
        return max(sum(_term(t, repo_root) for t in entry) for entry in fleet["boot"][runtime])
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise UserError(f"deploy/fleet.yaml: boot.{runtime}: cannot read a figure ({type(e).__name__}: {e})") from None


def server_shutdown_default() -> int:
    """`python -m serving --shutdown-timeout`'s default: the drain the chart asks every server for (vLLM's own
    default, 0, aborts at once)."""
    from serving.__main__ import build_parser  # argparse only: no jax, no torch

    return math.ceil(build_parser().get_default("shutdown_timeout"))


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
    out = {
        "runtime": image.runtime,
        "profile": profile,
        "image": {"repository": repo, "tag": tag, "pullPolicy": "IfNotPresent"},
        "imagePullSecrets": [],
        "replicaCount": 1,
        "port": image.context_vars["port"],
        "model": {"claimName": MODEL.lower(), "subPath": "", "mountPath": mount, "servedModelName": MODEL,
                  "flag": cmd[0] if cmd and cmd[0] != mount else ""},
        "extraArgs": [],
        "env": {},
        "secrets": {"apiKey": {"name": "", "key": "api-key"}, "hfToken": {"name": "", "key": "token"}},
        "shutdownTimeoutSeconds": server_shutdown_default(),
        "lifecycle": {"preStopSleepSeconds": fleet["shutdown"]["prestop_sleep_s"],
                      "exitBackstopSeconds": fleet["shutdown"]["exit_backstop_s"]},
        "probes": {
            "startup": {"periodSeconds": probes["period_s"], "timeoutSeconds": 5,
                        "failureThreshold": math.ceil(boot * fleet["startup_margin"] / probes["period_s"]),
                        "measuredBootSeconds": round(boot, 1)},
            "readiness": {"periodSeconds": probes["readiness"]["period_s"],
                          "timeoutSeconds": probes["readiness"]["timeout_s"],
                          "failureThreshold": probes["readiness"]["failures"]},
            "liveness": {"periodSeconds": probes["liveness"]["period_s"],
                         "timeoutSeconds": probes["liveness"]["timeout_s"],
                         "failureThreshold": probes["liveness"]["failures"]},
        },
        "nodeSelector": {"kubernetes.io/arch": ARCH[image.platforms[0]]},
        "instanceTypes": list(fleet["nodes"][profile]["instance_types"]),
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "resources": {"limits": {"nvidia.com/gpu": 1}, "requests": dict(fleet["resources"]["requests"])},
        # a runtime's compile cache (fleet.yaml compile_cache; the image's own cache dir): a restart boots warm
        "compileCache": {"path": fleet.get("compile_cache", {}).get(image.runtime, ""), "claimName": ""},
        "service": {"type": "ClusterIP", "port": 80},
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": 1},
        "podMonitor": {"enabled": False, "interval": "15s"},
        "autoscaling": {"enabled": False, "minReplicas": 1, "maxReplicas": 4, "waitingPerReplica": 4,
                        "pollingInterval": 15, "cooldownPeriod": 300,
                        "prometheusServer": "http://prometheus-operated.monitoring.svc:9090"},
    }
    return out


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


def write(out: Path, files: dict[str, str], templates: Path) -> list[Path]:
    """The generated files into `out`, and the templates beside them when `out` is not their own chart."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if (out / "templates").resolve() != templates.resolve():
        shutil.copytree(templates, out / "templates", dirs_exist_ok=True)
        written.append(out / "templates")
    for name, text in files.items():
        (out / name).write_text(text)
        written.append(out / name)
    return written
