"""Run a serving image with the docker SDK, wait until it answers, always remove it.

    with serve_image(image, gpu=False, model="/models/tiny") as server:
        ... server.url, server.boot (container start → port open → /health 200, in seconds) ...

The container gets the GPU through a device request when asked (a CUDA profile's image), the model directory
read-only (or the Hugging Face cache, for a repo id), the Hugging Face token from this environment as run-time env
(never a build arg, never printed), and its port published on 127.0.0.1 only, on a free port docker picks. While
waiting it watches that the container is still running: one that exits is reported at once with its last log lines.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

import requests

from g5g.errors import UserError

PORT = 8000  # the port servers listen on inside the container (a runtime manifest's `port` overrides it)
MODEL_MOUNT = "/models"
HF_MOUNT = "/hf-cache"
TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
LOG_LINES = 40


class ContainerFailed(Exception):
    """The container died or never became ready; `logs` holds its last lines."""

    def __init__(self, message: str, logs: list[str]) -> None:
        super().__init__(message)
        self.logs = logs


@dataclasses.dataclass
class Server:
    url: str
    container: object
    model_name: str | None
    started: float  # perf_counter just before the container started
    boot: dict = dataclasses.field(default_factory=dict)  # seconds from `started`

    def logs(self, lines: int = LOG_LINES) -> list[str]:
        return last_logs(self.container, lines)


def client():
    """A docker client (DOCKER_HOST honoured), or a UserError saying why there is none."""
    import docker

    try:
        c = docker.from_env()
        c.ping()
        return c
    except Exception as e:  # docker raises several unrelated types for "no engine"
        host = os.environ.get("DOCKER_HOST", "the default socket")
        raise UserError(f"no Docker engine at {host}: {e} (start one, e.g. scripts/provision.sh, "
                        "and export DOCKER_HOST from .cache/docker.env)") from None


def image_labels(docker_client, image: str) -> dict[str, str]:
    import docker

    try:
        return docker_client.images.get(image).labels or {}
    except docker.errors.ImageNotFound:
        raise UserError(f"image {image} is not in the local engine (docker pull it first)") from None


def model_mount(model: str | None) -> tuple[dict, dict, str | None, str | None]:
    """(volumes, environment, model argument inside the container, served model name) for `model`:
    a directory is mounted read-only under /models/<basename>; anything else is a Hugging Face repo id, served
    from the host's Hugging Face cache mounted at /hf-cache (writable: a missing file gets downloaded)."""
    if not model:
        return {}, {}, None, None
    path = Path(model).expanduser()
    if path.is_dir():
        inside = f"{MODEL_MOUNT}/{path.resolve().name}"
        return {str(path.resolve()): {"bind": inside, "mode": "ro"}}, {}, inside, path.resolve().name
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise UserError(f"--model {model}: no such directory, and not a Hugging Face repo id (org/name)")
    cache = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    cache.mkdir(parents=True, exist_ok=True)
    return {str(cache.resolve()): {"bind": HF_MOUNT, "mode": "rw"}}, {"HF_HOME": HF_MOUNT}, model, model


def server_command(style: str, model_arg: str | None, served_name: str | None, port: int = PORT) -> list[str] | None:
    """Arguments after the image's entrypoint (dockerfiles/*.j2): the model, its name. style: the runtime
    manifest's serve.model_arg, "flag" (`python3 -m serving … --model DIR`) or "positional" (`vllm serve DIR`).
    Host and port are repeated so that an image with another entrypoint still listens where we look."""
    if model_arg is None:
        return None  # the image's own CMD
    listen = ["--host", "0.0.0.0", "--port", str(port)]
    cmd = [model_arg, *listen] if style == "positional" else ["--model", model_arg, *listen]
    return cmd + (["--served-model-name", served_name] if served_name else [])


def token_env() -> dict[str, str]:
    return {k: os.environ[k] for k in TOKEN_VARS if os.environ.get(k)}


def last_logs(container, lines: int = LOG_LINES) -> list[str]:
    try:
        return container.logs(tail=lines).decode("utf-8", "replace").splitlines()
    except Exception as e:  # the container may be gone already
        return [f"(no logs: {e})"]


def _port_open(port: int) -> bool:
    """True when something accepts on 127.0.0.1:port and keeps the connection: docker's userland proxy accepts
    at once and then drops the connection while nothing listens inside, so a bare connect proves nothing."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.settimeout(0.2)
            try:
                return s.recv(1) != b""
            except socket.timeout:
                return True
    except OSError:
        return False


def _published_port(container, port: int) -> int:
    container.reload()
    bindings = (container.attrs.get("NetworkSettings", {}).get("Ports") or {}).get(f"{port}/tcp") or []
    for b in bindings:
        if b.get("HostIp") in ("127.0.0.1", "") and b.get("HostPort"):
            return int(b["HostPort"])
    raise ContainerFailed(f"port {port} was not published", last_logs(container))


def wait_ready(container, timeout: float, t0: float | None = None, port: int = PORT,
               poll: float = 0.25) -> tuple[str, dict]:
    """Wait for port open then /health 200, watching the container; return (url, boot timings in seconds from
    t0, the container's start)."""
    t0 = time.perf_counter() if t0 is None else t0
    deadline = time.perf_counter() + timeout
    boot: dict = {}
    url = None
    session = requests.Session()
    while True:
        container.reload()
        if container.status in ("exited", "dead", "removing"):
            code = container.attrs.get("State", {}).get("ExitCode")
            raise ContainerFailed(f"container exited (code {code}) during start-up", last_logs(container))
        if url is None and container.status == "running":
            url = f"http://127.0.0.1:{_published_port(container, port)}"
        if url and "port_open_s" not in boot and _port_open(int(url.rsplit(":", 1)[1])):
            boot["port_open_s"] = time.perf_counter() - t0
        if "port_open_s" in boot:
            try:
                if session.get(f"{url}/health", timeout=2).status_code == 200:
                    boot["health_s"] = time.perf_counter() - t0
                    return url, boot
            except requests.RequestException:
                pass
        if time.perf_counter() > deadline:
            stage = "/health 200" if "port_open_s" in boot else f"port {port} open"
            raise ContainerFailed(f"not ready after {timeout:.0f} s (waiting for {stage})", last_logs(container))
        time.sleep(poll)


@contextlib.contextmanager
def serve_image(image: str, *, gpu: bool, model_style: str = "flag", model: str | None = None,
                served_model_name: str | None = None, timeout: float = 900.0, port: int = PORT,
                command: list[str] | None = None, docker_client=None) -> Iterator[Server]:
    """Run `image` (with every GPU of the host when `gpu`: a CUDA profile's image), wait until ready, yield a
    Server; the container is removed whatever happens. model_style: how the image takes --model (server_command)."""
    import docker

    dc = docker_client or client()
    volumes, env, model_arg, name = model_mount(model)
    name = served_model_name or name
    env |= token_env()
    kwargs: dict = dict(detach=True, environment=env, volumes=volumes, ports={f"{port}/tcp": ("127.0.0.1",)},
                        labels={"io.g5g.smoke": "1"})
    if gpu:
        kwargs["device_requests"] = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
        kwargs["shm_size"] = "2g"  # NCCL/torch workers need more than docker's 64 MiB default
    cmd = command if command is not None else server_command(model_style, model_arg, name, port)
    try:
        container = dc.containers.create(image, command=cmd, **kwargs)
    except docker.errors.ImageNotFound:
        raise UserError(f"image {image} is not in the local engine (docker pull it first)") from None
    except docker.errors.APIError as e:
        raise UserError(f"docker could not create a container from {image}: {e.explanation or e}") from None
    try:
        started = time.perf_counter()
        try:
            container.start()
        except docker.errors.APIError as e:
            hint = " (no GPU runtime? CUDA images need the NVIDIA container toolkit)" if gpu else ""
            raise UserError(f"docker could not start {image}: {e.explanation or e}{hint}") from None
        url, boot = wait_ready(container, timeout, t0=started, port=port)
        yield Server(url=url, container=container, model_name=name, started=started, boot=boot)
    finally:
        leftover = remove(container)
        if leftover:
            failing = sys.exc_info()[1]
            if failing is None:
                raise UserError(leftover)
            failing.add_note(leftover)      # the failure that ended the run stays the one reported


def remove(container) -> str | None:
    """Remove a smoke container (one already gone is fine); what to tell the user if it stays behind."""
    import docker

    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        return None
    except (docker.errors.DockerException, requests.RequestException) as e:
        return f"the smoke container {container.id[:12]} could not be removed ({e}); remove it with " \
               f"`docker rm -f {container.id[:12]}`"
    return None
