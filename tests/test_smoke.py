"""smoke: the checks on their own, against the timed server's good and bad answers, and images on a real engine."""
from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest
import requests

from g5g import containers, smoke, wire
from g5g.cli import main
from g5g.commands import smoke as smoke_cmd
from g5g.commands.smoke import check_server
from g5g.errors import UserError

ANSWER = "Site Reliability Engineering keeps services reliable."
EXPECT = r"reliability\s+engineering"


def err_text(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


# ---- pure checks ----

@pytest.mark.parametrize("text", [": ok: ok: ok", ": ok: ok: ok: ok: ok: ok", "<pad><pad>", "<pad>" * 30,
                                  "aaaaaaaaaa", "The answer is 4. The answer is 4. The answer is 4."])
def test_degenerate_answers_are_caught(text):
    assert smoke.degeneracy(text)


@pytest.mark.parametrize("text", [ANSWER, "Paris.", "Wait... what?!!", "1, 2, 3, 4, 5", "Mississippi",
                                  "<think>hmm hmm hmm hmm</think>Paris", "Yes<end_of_turn><eos>", "ok ok", ""])
def test_real_answers_are_not_degenerate(text):
    assert smoke.degeneracy(text) is None


def test_clean_strips_thoughts_special_tokens_and_padding():
    assert smoke.clean("<think>let me see</think> Paris<end_of_turn><pad><pad>") == "Paris"
    assert smoke.clean("<|channel>thought\nplanning<channel|>Paris<eos>") == "Paris"
    assert smoke.clean("<pad><pad><pad>") == ""


@pytest.mark.parametrize("text,reasoning,ok", [
    ("<think>Paris</think>Lyon.", "", False), ("<|channel>thought\nParis<channel|>Lyon.", "", False),
    ("Lyon.", "Paris", False),                         # the thoughts in reasoning_content: not the answer either
    ("<think>Lyon?</think>Paris.", "", True), ("Paris.", "Lyon", True)])
def test_the_expected_answer_is_matched_in_the_answer_not_in_the_thoughts(text, reasoning, ok):
    ans = wire.Answer(success=True, text=text, reasoning=reasoning, finish_reason="stop",
                      usage={"prompt_tokens": 9, "completion_tokens": 6})
    expected = next(c for c in smoke.check_answer(ans, "paris", 64) if c.name == "expected")
    assert expected.ok is ok, expected.detail


def test_token_counts_must_be_consistent_with_the_text():
    good = wire.Answer(success=True, text=ANSWER, finish_reason="stop", chunks=6,
                       usage={"prompt_tokens": 9, "completion_tokens": 7})
    assert smoke.token_check(good, 64).ok
    for usage, chunks, why in [(None, 6, "no completion_tokens"), ({"completion_tokens": 0}, 6, "outside"),
                               ({"completion_tokens": 100}, 6, "outside 1…64"),
                               ({"completion_tokens": 2}, 6, "6 text chunks but 2 tokens"),
                               ({"completion_tokens": 300}, 6, "300 tokens for 53 characters")]:
        bad = wire.Answer(success=True, text=ANSWER, finish_reason="stop", chunks=chunks, usage=usage)
        check = smoke.token_check(bad, 512 if why.startswith("300") else 64)
        assert not check.ok and why in check.detail, (usage, check.detail)


# ---- against the timed server ----

def test_a_good_answer_passes_streamed_and_not(timed_server):
    srv = timed_server(answer=ANSWER, tokens_per_chunk=2, ttft=0.01, gap=0.005)
    report = check_server(srv.url, None, "What is SRE?", EXPECT)
    assert report["ok"], report
    assert set(report["checks"]) == {"stream", "non-stream"}
    assert [c["name"] for c in report["checks"]["stream"]] == list(smoke.CHECKS)
    assert report["answers"]["stream"]["text"] == report["answers"]["non-stream"]["text"] == ANSWER
    assert report["same_text"]


@pytest.mark.parametrize("mode, reason", [("garbage", "not_degenerate"), ("pad", "not_degenerate"),
                                          ("empty", "non_empty"), ("truncated", "finish_reason")])
def test_bad_answers_fail_with_the_right_reason(timed_server, mode, reason):
    srv = timed_server(answer=ANSWER, mode=mode, ttft=0.01, gap=0.002)
    report = check_server(srv.url, None, "What is SRE?", EXPECT)
    assert not report["ok"]
    assert report["failed_check"] == reason, report["reason"]
    assert report["reason"].startswith(f"stream: {reason}: ")
    for answer in ("stream", "non-stream"):  # the same verdict either way
        assert next(c for c in report["checks"][answer] if not c["ok"])["name"] == reason


def test_a_wrong_answer_fails_expected(timed_server):
    srv = timed_server(answer="Paris is the capital of France.", ttft=0.01, gap=0.002)
    report = check_server(srv.url, None, "What is SRE?", EXPECT)
    assert report["failed_check"] == "expected"


def test_missing_usage_chunk_fails_token_counts(timed_server):
    srv = timed_server(answer=ANSWER, usage=False, ttft=0.01, gap=0.002)
    report = check_server(srv.url, None, "What is SRE?", EXPECT)
    assert report["failed_check"] == "token_counts"
    assert "include_usage" in report["reason"]


def test_cli_exit_codes(timed_server, capsys):
    good = timed_server(answer=ANSWER, ttft=0.01, gap=0.002)
    bad = timed_server(answer=ANSWER, mode="garbage", ttft=0.01, gap=0.002)
    assert main(["smoke", "--url", good.url, "--expect", EXPECT]) == 0
    assert "smoke: ok" in capsys.readouterr().out
    assert main(["smoke", "--url", bad.url, "--expect", EXPECT]) == 1
    assert "smoke failed: stream: not_degenerate: repetition ': ok'" in err_text(capsys)
    assert main(["smoke", "--url", good.url]) == 2  # no manifest default for an unknown runtime
    assert "the runtime is unknown; pass --runtime R" in err_text(capsys)
    assert main(["smoke", "--url", good.url, "--expect", "(unclosed"]) == 2
    assert main(["smoke", "img:tag", "--url", good.url, "--expect", "x"]) == 2
    assert "not both" in err_text(capsys)


def test_cli_json_report(timed_server, capsys):
    srv = timed_server(answer=ANSWER, mode="truncated", ttft=0.01, gap=0.002)
    assert main(["smoke", "--url", srv.url, "--expect", EXPECT, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["failed_check"] == "finish_reason"


def test_unreachable_server_fails_the_check():
    report = check_server("http://127.0.0.1:9", None, "hi", "x")
    assert not report["ok"] and "GET /v1/models failed" in report["reason"]


# ---- the docker edge (pure parts) ----

def test_model_dir_is_mounted_read_only_under_its_basename(tmp_path):
    d = tmp_path / "gemma-4-E2B-it"
    d.mkdir()
    volumes, env, arg, name = containers.model_mount(str(d))
    assert volumes == {str(d): {"bind": "/models/gemma-4-E2B-it", "mode": "ro"}}
    assert (arg, name, env) == ("/models/gemma-4-E2B-it", "gemma-4-E2B-it", {})
    assert containers.server_command("flag", arg, name) == [
        "--model", "/models/gemma-4-E2B-it", "--host", "0.0.0.0", "--port", "8000",
        "--served-model-name", "gemma-4-E2B-it"]
    assert containers.server_command("positional", arg, None, 8001) == [  # after `vllm serve <serve_args>`
        "/models/gemma-4-E2B-it", "--host", "0.0.0.0", "--port", "8001"]
    assert containers.server_command("flag", None, None) is None  # the image's own CMD


def test_repo_id_mounts_the_hf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    volumes, env, arg, _ = containers.model_mount("google/gemma-4-E2B-it")
    assert volumes == {str(tmp_path / "hf"): {"bind": "/hf-cache", "mode": "rw"}}
    assert env == {"HF_HOME": "/hf-cache"} and arg == "google/gemma-4-E2B-it"
    with pytest.raises(containers.UserError, match="not a Hugging Face repo id"):
        containers.model_mount(str(tmp_path / "missing" / "dir"))


class _Container:
    """A created container whose removal fails with `error` (None: removed)."""
    id = "0123456789abcdef"

    def __init__(self, error):
        self.error = error

    def start(self):
        pass

    def remove(self, force=False):
        if self.error is not None:
            raise self.error


class _Client:
    def __init__(self, container):
        self.containers = type("Containers", (), {"create": lambda _, *a, **kw: container})()


@pytest.mark.parametrize("failing_run", [False, True])
def test_a_smoke_container_that_cannot_be_removed_is_reported(monkeypatch, failing_run):
    """Before: its removal ran under contextlib.suppress(Exception), so a container left behind went unsaid. Now the
    run says which one and how to remove it: as its error, or as a note on the error that ended the run (that error
    stays the one reported). One already gone is no error."""
    import docker

    monkeypatch.setattr(containers, "wait_ready", lambda *a, **kw: ("http://127.0.0.1:1", {}))
    stuck = _Container(docker.errors.APIError("removal of container is already in progress"))
    with pytest.raises(UserError if not failing_run else KeyError) as got:
        with containers.serve_image("img", gpu=False, model="org/m", docker_client=_Client(stuck)):
            if failing_run:
                raise KeyError("the run failed")
    told = str(got.value) if not failing_run else " ".join(got.value.__notes__)
    assert "0123456789ab could not be removed" in told and "docker rm -f 0123456789ab" in told
    with containers.serve_image("img", gpu=False, model="org/m",
                                docker_client=_Client(_Container(docker.errors.NotFound("gone")))):
        pass


def test_hf_token_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_fake")
    assert containers.token_env() == {"HUGGING_FACE_HUB_TOKEN": "hf_fake"}


# ---- images on a real Docker engine ----

BASE_CANDIDATES = [os.environ.get("G5G_TEST_BASE_IMAGE"), "g5g-local/bookworm:amd64", "g5g-local/bookworm:latest"]
TIMED = Path(__file__).parents[1] / "devtools" / "timed_server.py"


@pytest.fixture(scope="session")
def timed_images(docker_client):
    """Images from the local Debian base (python3, no pip): the timed server, one that dies on start, and the timed
    server labelled as a g4dn (CUDA profile) image."""
    import docker

    base = None
    for ref in filter(None, BASE_CANDIDATES):
        try:
            docker_client.images.get(ref)
            base = ref
            break
        except docker.errors.ImageNotFound:
            continue
    if base is None:
        pytest.skip("no local base image with python3 (scripts/base-images.sh imports g5g-local/bookworm:amd64)")
    entry = ["python3", "/srv/timed_server.py", "--host", "0.0.0.0", "--port", "8000", "--answer", ANSWER,
             "--health-delay", "1"]
    images = {}
    for name, extra, profile in (("good", [], "cpu"),
                                 ("dies", ["--die-after", "1", "--die-message",
                                           "RuntimeError: CUDA error: no kernel image is available"], "cpu"),
                                 ("g4dn", [], "g4dn")):
        dockerfile = (f"FROM {base}\nCOPY timed_server.py /srv/timed_server.py\n"
                      f"LABEL io.g5g.runtime=pytorch io.g5g.profile={profile}\n"
                      f"ENTRYPOINT {json.dumps(entry + extra)}\n")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for arcname, data in (("Dockerfile", dockerfile.encode()), ("timed_server.py", TIMED.read_bytes())):
                info = tarfile.TarInfo(arcname)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        buf.seek(0)
        tag = f"g5g-test/timed-server:{name}"
        docker_client.images.build(fileobj=buf, custom_context=True, tag=tag, pull=False, rm=True, forcerm=True)
        images[name] = tag
    return images


def _leftovers(dc) -> list:
    """Our smoke containers still there (the engine is shared: others' smoke runs are not ours to count)."""
    return [c for c in dc.containers.list(all=True, filters={"label": "io.g5g.smoke=1"})
            if any(t.startswith("g5g-test/timed-server:") for t in c.image.tags)]


@pytest.mark.e2e
def test_image_smoke_passes_and_records_boot(timed_images, docker_client, tmp_path, capsys):
    model = tmp_path / "tiny-model"
    model.mkdir()
    assert main(["smoke", timed_images["good"], "--model", str(model), "--expect", EXPECT, "--json",
                 "--timeout", "60"]) == 0
    report = json.loads(capsys.readouterr().out)
    boot = report["boot"]
    assert 0 < boot["port_open_s"] <= boot["health_s"] <= boot["first_answer_s"]
    assert boot["health_s"] >= 1.0  # the server's /health says 503 for its first second
    assert report["model"] == "tiny-model" and report["runtime"] == "pytorch"
    assert not _leftovers(docker_client)


@pytest.mark.e2e
def test_container_is_local_only_gets_the_token_and_is_removed(timed_images, docker_client, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    with containers.serve_image(timed_images["good"], gpu=False, timeout=60,
                                docker_client=docker_client) as srv:
        srv.container.reload()
        assert "HF_TOKEN=hf_not_a_real_token" in srv.container.attrs["Config"]["Env"]
        bindings = srv.container.attrs["NetworkSettings"]["Ports"]["8000/tcp"]
        assert {b["HostIp"] for b in bindings} == {"127.0.0.1"}
        assert srv.url.startswith("http://127.0.0.1:")
        assert requests.get(f"{srv.url}/health", timeout=5).status_code == 200
    assert not _leftovers(docker_client)


@pytest.mark.e2e
def test_container_dying_in_start_up_is_reported_with_its_logs(timed_images, docker_client, capsys):
    assert main(["smoke", timed_images["dies"], "--expect", EXPECT, "--timeout", "60"]) == 1
    err = err_text(capsys)
    assert "container exited (code 3) during start-up" in err
    assert "no kernel image is available" in err  # the container's own last words
    assert "timed_server: starting" in err
    assert not _leftovers(docker_client)


@pytest.mark.e2e
def test_bench_image_records_boot_then_measures(timed_images, tmp_path):
    out = tmp_path / "boot.json"
    assert main(["bench", "--image", timed_images["good"], "--prompt", "What is SRE?", "--expect", EXPECT,
                 "--requests", "2", "--warmup", "0", "--boot-timeout", "60", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["label"] == "pytorch" and r["completed"] == 2 and r["mode"] == "stream"
    assert set(r["boot"]) == {"port_open_s", "health_s", "first_answer_s"}


def test_prompt_and_expect_default_to_the_runtime_manifest(timed_server, capsys):
    import re

    from g5g.commands.smoke import manifest_defaults

    defaults = manifest_defaults("pytorch")
    assert defaults["prompt"] and defaults["port"]
    assert re.search(defaults["expect"], "Paris") and not re.search(defaults["expect"], "Lyon"), defaults["expect"]
    good = timed_server(answer="Paris", ttft=0.01, gap=0.002)
    wrong = timed_server(answer="Lyon", ttft=0.01, gap=0.002)
    assert main(["smoke", "--url", good.url, "--runtime", "pytorch"]) == 0
    assert main(["smoke", "--url", wrong.url, "--runtime", "pytorch"]) == 1
    assert "expected" in err_text(capsys)


@pytest.mark.e2e
def test_readiness_is_bounded_and_reports_the_stage_and_logs(timed_images, docker_client):
    with pytest.raises(containers.ContainerFailed) as failed:
        with containers.serve_image(timed_images["good"], gpu=False, timeout=3,
                                    command=["--health-delay", "600"], docker_client=docker_client):
            pytest.fail("a server whose /health says 503 for 10 minutes was reported ready")
    assert "not ready after 3 s (waiting for /health 200)" in str(failed.value)
    assert any("timed_server: listening" in line for line in failed.value.logs)
    assert not _leftovers(docker_client)


@pytest.mark.e2e
def test_g5g_profile_asks_the_engine_for_the_gpu(timed_images, docker_client):
    """The g5g profile sends a GPU device request; an engine without the NVIDIA runtime refuses it at start, and
    the error says so (on a G5g host the same request gives the container the T4G)."""
    with pytest.raises(containers.UserError) as failed:
        with containers.serve_image(timed_images["good"], gpu=True, timeout=10,
                                    docker_client=docker_client):
            pytest.skip("this engine has a GPU runtime: the request was granted")
    assert "could not start" in str(failed.value) and "NVIDIA container toolkit" in str(failed.value)
    assert not _leftovers(docker_client)


@pytest.mark.e2e
def test_no_gpu_runs_a_cuda_profile_image_on_the_cpu(timed_images, docker_client, capsys):
    """A g4dn image asks for the GPU (refused by an engine without the NVIDIA runtime); --no-gpu runs it without
    one, as a CUDA build of jax or torch can, and the report says so."""
    image = timed_images["g4dn"]
    rc = main(["smoke", image, "--expect", EXPECT, "--timeout", "60"])
    if rc == 0:
        pytest.skip("this engine has a GPU runtime: the request was granted")
    assert rc == 2 and "NVIDIA container toolkit" in err_text(capsys)
    assert main(["smoke", image, "--no-gpu", "--expect", EXPECT, "--json", "--timeout", "60"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["profile"] == "g4dn" and report["gpu"] is False
    assert not _leftovers(docker_client)


def test_brackets_in_answers_and_regexes_are_printed_as_they_are(timed_server, capsys):
    srv = timed_server(answer="[bold]Site Reliability Engineering[/bold]", ttft=0.01, gap=0.002)
    assert main(["smoke", "--url", srv.url, "--expect", "[Rr]eliability"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "/[Rr]eliability/ matched" in out and "[bold]Site" in out


@pytest.mark.parametrize("labels, gpu", [({"io.g5g.runtime": "vllm", "io.g5g.profile": "g5g"}, True),
                                         ({"io.g5g.runtime": "vllm", "io.g5g.profile": "g4dn"}, True),
                                         ({"io.g5g.runtime": "jax", "io.g5g.profile": "cpu"}, False)])
def test_every_cuda_profile_gets_the_gpu_and_the_labels_choose(labels, gpu):
    """Which profiles are CUDA ones comes from the profile manifests (g4dn too, not only g5g)."""
    assert smoke_cmd.image_runtime("img", labels, None, None) == (labels["io.g5g.runtime"],
                                                                  labels["io.g5g.profile"], gpu)
    assert smoke_cmd.image_runtime("img", labels, "pytorch", "cpu") == ("pytorch", "cpu", False)


@pytest.mark.parametrize("runtime, profile, message", [
    ("torch-base", "g5g", r"runtime unknown .*'torch-base'.*--runtime vllm\|jax\|pytorch"),
    ("vllm", "p4d", r"profile unknown .*'p4d'.*--profile cpu\|g4dn\|g5g"),
    (None, "g5g", r"runtime unknown .*None")])
def test_an_unknown_runtime_or_profile_names_the_choices(runtime, profile, message):
    with pytest.raises(UserError, match=message):
        smoke_cmd.image_runtime("img", {}, runtime, profile)


@pytest.mark.parametrize("text", ["<think>The capital is Paris", "<thought>Paris, surely", "<|channel>thought\nParis"])
def test_an_unterminated_thought_is_stripped_and_cannot_pass_as_the_answer(text):
    """A model cut off mid-thought (max_tokens) has no answer: the thought must not count as one."""
    assert smoke.clean(text + "<eos>") == ""
    ans = wire.Answer(success=True, text=text, finish_reason="stop", usage={"prompt_tokens": 9, "completion_tokens": 6})
    checks = {c.name: c for c in smoke.check_answer(ans, "paris", 64)}
    assert not checks["non_empty"].ok and not checks["expected"].ok


def test_more_visible_characters_than_tokens_can_decode_fails():
    """A token decodes to at most a few dozen characters: 69 per token is text that no token produced."""
    for chars, ok in [(600, True), (640, True), (690, False), (6000, False)]:
        ans = wire.Answer(success=True, text="x" * chars, finish_reason="stop", chunks=5,
                          usage={"prompt_tokens": 9, "completion_tokens": 10})
        check = smoke.token_check(ans, 64)
        assert check.ok is ok and (ok or f"{chars} characters from 10 tokens" in check.detail), (chars, check.detail)
