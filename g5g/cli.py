"""Command line: one parser, one flag definition per option, dispatch to the module that does the work.

`python build.py [--runtime R] …` with no subcommand is the build command, as in the contract.
Modules are imported lazily so `--dry-run` never loads docker, and no command imports jax or torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from rich.console import Console
from rich.markup import escape

from g5g import REPO_ROOT
from g5g.errors import UserError

SUBCOMMANDS = ("build", "generate", "chart", "doctor", "inspect", "smoke", "bench", "serve", "patches", "quantize",
               "fits")
# The runtimes are the manifests (runtimes/*.yaml): the planner checks --runtime against those of --manifests.
RUNTIMES = sorted(p.stem for p in (REPO_ROOT / "manifests" / "runtimes").glob("*.yaml"))
PROFILES = sorted(p.stem for p in (REPO_ROOT / "manifests" / "profiles").glob("*.yaml"))

err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime", default="all", metavar="RUNTIME",
                   help=f"image to plan: {', '.join(RUNTIMES)} or all (runtimes/*.yaml of --manifests; default: all)")
    p.add_argument("--profile", default="g5g",
                   help=f"target profile: {', '.join(PROFILES)} (profiles/*.yaml of --manifests; default: g5g)")
    p.add_argument("--platform", help="comma-separated platforms, e.g. linux/arm64,linux/amd64 (default: the profile's)")
    p.add_argument("--registry", help="registry/namespace images are tagged for, e.g. ghcr.io/me (default: the manifest's)")
    p.add_argument("--manifests", default=None, help="manifest directory (default: ./manifests)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a manifest value, e.g. profile.base_image=… (repeatable)")
    p.add_argument("--rehearse", action="store_true",
                   help="every stage for real, the long compiles cut to CMake configure + a sample of objects "
                        "(the runtimes' rehearse: sections; docs/g5g-chain.md, \"Rehearsing the g5g chain\")")


def _add_builder_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--builder", metavar="NAME", help="buildx builder to build on (`docker buildx ls`), e.g. one "
                   "with a native remote arm64 node; passed to `docker buildx bake --builder` (default: the current)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="build.py", description="Build LLM serving images for sm_75 (AWS G5g).")
    sub = parser.add_subparsers(dest="command")

    b = sub.add_parser("build", help="plan, generate and build images (the default command)")
    _add_plan_options(b)
    b.add_argument("--push", action="store_true", help="push every tag of every image (all or none)")
    b.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    b.add_argument("--json", action="store_true", help="print the plan (or the result) as JSON")
    b.add_argument("--out", help="where generated Dockerfiles and docker-bake.json go (a relative DIR is from the "
                   "current directory; default: build/ in the checkout)")
    b.add_argument("--cache", metavar="REPO", help="registry layer cache, one tag per image (REPO:<image>): read on "
                   "every build, written by a --push build, e.g. ghcr.io/me/g5g-images-cache")
    b.add_argument("--ca-cert", help="CA bundle passed to the build as a secret "
                   "(default: REQUESTS_CA_BUNDLE, SSL_CERT_FILE or PIP_CERT when set)")
    _add_builder_option(b)
    b.add_argument("--skip-patch-check", action="store_true", help=argparse.SUPPRESS)
    b.add_argument("--sequential", action="store_true",
                   help="build torch-base first and load it, then the images FROM it by tag (engines whose "
                        "BuildKit lacks named contexts, e.g. Docker 20.10's built-in builder)")

    g = sub.add_parser("generate", help="write Dockerfiles and docker-bake.json, build nothing")
    _add_plan_options(g)
    g.add_argument("--out", help="output directory (a relative DIR is from the current directory; default: build/ "
                   "in the checkout)")
    g.add_argument("--sequential", action="store_true", help="bake file without named contexts (see build --help)")

    c = sub.add_parser("chart", help="write the serving Helm chart's values (every runtime x profile) from the "
                       "manifests and deploy/fleet.yaml")
    c.add_argument("--out", default=str(REPO_ROOT / "deploy" / "chart"),
                   help="chart directory; the templates, values.schema.json and files/ are copied there too, a "
                   "values file no longer generated is removed (default: deploy/chart)")
    c.add_argument("--registry", help="registry/namespace of the images (default: the profiles')")
    c.add_argument("--manifests", default=None, help="manifest directory (default: ./manifests)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a manifest value (repeatable)")

    d = sub.add_parser("doctor", help="check docker, buildx, binfmt and the registry, list the builders' nodes and "
                       "platforms; say how to fix what is missing")
    _add_plan_options(d)
    _add_builder_option(d)

    i = sub.add_parser("inspect", help="per-platform CUDA arch lists of images, without pulling them")
    i.add_argument("images", nargs="+", metavar="IMAGE")
    i.add_argument("--platform", help="only this platform, e.g. linux/arm64")
    i.add_argument("--arch", default="7.5", help="the CUDA arch that must be covered (default: 7.5)")
    i.add_argument("--json", action="store_true")
    i.add_argument("--backend", choices=("auto", "imagetools", "http"), default="auto")
    i.add_argument("--probe", action="store_true",
                   help="when the config says nothing, run the image and ask torch (slow; QEMU for foreign platforms)")
    i.add_argument("--insecure", action="store_true", help="plain HTTP for the registry (loopback registries)")

    s = sub.add_parser("smoke", help="run an image (or use a server) and check its chat answer")
    s.add_argument("image", nargs="?", metavar="IMAGE")
    s.add_argument("--url", help="check a running server instead of an image")
    s.add_argument("--runtime", help="runtime of IMAGE, one with a smoke: section in its manifest "
                   "(default: from its labels)")
    s.add_argument("--profile", default=None, help="profile of IMAGE; a CUDA profile's image gets the GPU "
                   "(default: from its labels)")
    s.add_argument("--no-gpu", action="store_true", help="run a CUDA profile's image without the GPU: its CUDA "
                   "build of jax or torch falls back to the CPU (a host with no GPU or no NVIDIA container toolkit)")
    s.add_argument("--model", help="model directory (or Hugging Face cache) to mount into the container")
    s.add_argument("--served-model-name", help="model name to ask for (default: the server's first model)")
    s.add_argument("--prompt", help="chat prompt (default: the runtime's from the manifest)")
    s.add_argument("--expect", help="regex the answer must match (default: the runtime's from the manifest)")
    s.add_argument("--max-tokens", type=int, help="answer length limit (default: 256, or half a shorter context)")
    s.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for readiness")
    s.add_argument("--json", action="store_true")

    be = sub.add_parser("bench", help="client-side benchmark on the wire (TTFT, TPOT, ITL), same for every runtime",
                        description="bench --url URL | --image IMAGE  (or: bench compare A.json B.json … [--plot PNG])")
    be.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    be.add_argument("--image", help="boot this image (boot time recorded, smoke-checked), then bench it")
    be.add_argument("--model", help="model directory or Hugging Face repo id to mount (with --image)")
    be.add_argument("--runtime", help="runtime of IMAGE (default: its label)")
    be.add_argument("--profile", default=None, help="profile of IMAGE; a CUDA profile's image gets the GPU "
                    "(default: its label)")
    be.add_argument("--no-gpu", action="store_true", help="with --image: run a CUDA profile's image without the "
                    "GPU (its jax or torch falls back to the CPU)")
    be.add_argument("--expect", help="with --image: regex the answer to --prompt must match before the benchmark "
                    "(default: the runtime manifest's smoke prompt and regex)")
    be.add_argument("--boot-timeout", type=float, default=900.0, help="seconds to wait for IMAGE to be ready")
    be.add_argument("--mode", choices=("auto", "stream", "gauge", "both"), default="auto",
                    help="stream: wire timings; gauge: the server's /metrics; both: side by side with their ratio; "
                         "auto: both when the server has a gauge, else stream")
    be.add_argument("--requests", type=int, default=16, help="timed requests (default: 16)")
    be.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (default: 1)")
    be.add_argument("--max-tokens", type=int, default=128)
    be.add_argument("--warmup", type=int, default=1, help="untimed requests first (default: 1)")
    be.add_argument("--prompt", help="prompt to send (default: a fixed one)")
    be.add_argument("--ignore-eos", action="store_true",
                    help="ask for exactly --max-tokens tokens (vLLM's ignore_eos; vllm bench serve --ignore-eos)")
    be.add_argument("--tokenizer", help="tokenizer.json (or model dir) to count tokens when the server sends no usage")
    be.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take (default: 300)")
    be.add_argument("--time-limit", type=float, default=1800.0,
                    help="no request starts after this many seconds of the run (default: 1800)")
    be.add_argument("--label", help="name of this run in compare tables (default: runtime or model)")
    be.add_argument("--json", dest="json_file", metavar="FILE", help="write the result as JSON")
    bsub = be.add_subparsers(dest="bench_command", metavar="compare")
    bc = bsub.add_parser("compare", help="one table across bench results, optionally a PNG plot")
    bc.add_argument("files", nargs="+", metavar="RESULT.json")
    bc.add_argument("--plot", metavar="PNG", help="write a PNG plot")

    sv = sub.add_parser("serve", help="run the jax or pytorch server locally, as the image does", allow_abbrev=False,
                        description="Runs `python -m serving`; every other flag (--host, --port, --served-model-name, "
                        "--max-model-len, …: `python -m serving --help`) passes through to it unchanged.")
    sv.add_argument("--runtime", required=True, metavar="RUNTIME",
                    help="a runtime whose manifest has serve.local (runtimes/*.yaml), e.g. jax or pytorch")
    sv.add_argument("--model", required=True, help="checkpoint directory")
    sv.add_argument("--manifests", default=None, help="manifest directory (default: ./manifests)")

    q = sub.add_parser("quantize", help="write a compressed-tensors (int8/int4 weight-only) copy of a Gemma 4 "
                       "checkpoint, as vLLM's Marlin runs it on sm_75 (needs the `quantize` extra)")
    q.add_argument("--model", required=True, help="Hugging Face Gemma 4 checkpoint directory")
    q.add_argument("--scheme", required=True, choices=("w8a16", "w4a16"),
                   help="w8a16: int8, one scale per output channel; w4a16: int4, one scale per --group-size inputs")
    q.add_argument("--out", required=True, help="output directory")
    q.add_argument("--group-size", type=int, help="int4 group size: 32 (default), 64 or 128")

    ft = sub.add_parser("fits", help="will a model + scheme + context + slots fit the GPU with its KV cache? "
                        "(a plan: nothing is started; exit 1 when it does not fit)")
    src = ft.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory (config.json and safetensors headers are read)")
    src.add_argument("--shape", choices=("e2b", "e4b"), help="a known model shape instead of a checkpoint")
    ft.add_argument("--scheme", choices=("fp16", "w8a16", "w4a16"),
                    help="weight scheme (default: the checkpoint's own; fp16 for --shape)")
    ft.add_argument("--max-model-len", type=int, required=True, help="context per sequence, as the servers take it")
    ft.add_argument("--slots", type=int, default=1, help="sequences held at once (default: 1)")
    ft.add_argument("--runtime", default="vllm", metavar="RUNTIME",
                    help="a serving runtime (runtimes/*.yaml with smoke:); with --model: vllm loads the vision/audio "
                    "towers too; jax and pytorch serve the text model only (default: vllm)")
    ft.add_argument("--lm-head", choices=("fp16", "int8"), default="fp16",
                    help="the LM head the PyTorch runtime reads per token (G5G_LM_HEAD): int8 adds a quantised copy "
                    "(the embedding gather stays 16-bit) and streams half the head's bytes (default: fp16)")
    ft.add_argument("--gpu", choices=("t4g", "t4"), default="t4g", help="target GPU (15 360 MiB; default: t4g)")
    ft.add_argument("--overhead-mib", type=int, default=1024,
                    help="CUDA context, workspaces, activations (default: 1024, a stated allowance)")

    pa = sub.add_parser("patches", help="verify our vLLM patches against the pinned upstream release")
    pa.add_argument("action", choices=("verify",))
    pa.add_argument("--version", help="vLLM version (default: the manifest's pin)")
    pa.add_argument("--json", action="store_true")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    # No subcommand means `build`: `python build.py --runtime vllm --push`.
    if not argv or argv[0] not in SUBCOMMANDS + ("-h", "--help"):
        argv = ["build", *argv]
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "serve":  # serve hands the server's own flags to it (one definition: serving/)
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.server_args = rest
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    module = importlib.import_module(f"g5g.commands.{args.command}")
    try:
        return module.run(args)
    except UserError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}")  # messages quote user text: no markup
        return e.exit_code
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]")
        return 130
