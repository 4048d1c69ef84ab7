"""`pytest -m gpu`: both servers on CUDA, serving the tiny checkpoint (fp16, w8a16, w4a16), on this GPU's own paths
and on sm_75's paths forced (SM75 below). Where no CUDA GPU is present every test skips, saying so (CPU CI runs
them as skips: tests/e2e/plugin.py lets a `gpu` test skip there). docs/developing.md says how to run them.

Every server the module needs is started at once (one boot's wait, not fourteen) and kept for the module; each
server's log stays in the test's tmp directory, and a server that fails to boot fails the suite with its log's tail.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import requests

from devtools.greedy import Step, parting, steps
from devtools.server import launch, serving, serving_argv, serving_env, together
from devtools.tiny_gemma4 import ANSWER, QUESTION
from g5g import wire

pytestmark = pytest.mark.gpu

# sm_75's paths on a newer GPU. PyTorch: the packed kernels configured for Turing's compute capability and 40 SMs
# (SDPA keeps only memory-efficient and math wherever slots > 1, on every GPU: serving/torch_runtime/engine.py).
# JAX: no Triton GEMM (gated to sm_80 and up in XLA), which sends packed weights down the multiply-reduce.
SM75 = {"pytorch": {"G5G_PACKED_ARCH": "75", "G5G_PACKED_SMS": "40"},
        "jax": {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}}
# name: (runtime, checkpoint, environment)
SERVERS = {
    "pytorch": ("pytorch", "fp16", {}),
    "pytorch-no-pipeline": ("pytorch", "fp16", {"G5G_TORCH_PIPELINE": "0"}),
    "pytorch-one-slot": ("pytorch", "fp16", {"G5G_TORCH_SLOTS": "1"}),
    "pytorch-eager-prompts": ("pytorch", "fp16", {"G5G_TORCH_PREFILL_GRAPHS": "0"}),
    **{f"pytorch-{q}": ("pytorch", q, {}) for q in ("w8a16", "w4a16")},
    "jax": ("jax", "fp16", {}),
    **{f"jax-{q}": ("jax", q, {}) for q in ("w8a16", "w4a16")},
}
SERVERS |= {f"{name}-sm75": (rt, ckpt, SM75[rt]) for name, (rt, ckpt, _) in list(SERVERS.items())
            if name not in ("pytorch-no-pipeline", "pytorch-one-slot", "pytorch-eager-prompts")}
# How much of the fixture's answer each checkpoint keeps, greedy: int4 leaves it after 47 characters on a CPU in
# float32 (tests/test_quantize.py); 40 is what it keeps on the H200's float16 paths too (2026-12-03), sm_75's included.
KEEPS = {"fp16": len(ANSWER), "w8a16": len(ANSWER), "w4a16": 40}
BOOT_S = 900
MAX_TOKENS = 64


def _cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "no CUDA GPU here (the gpu suite runs where one is: pytest -m gpu)"


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    """{name: base URL} of every server in SERVERS, booted together, stopped at the end."""
    if why := _cuda():
        pytest.skip(why)
    tiny_gemma4 = request.getfixturevalue("tiny_gemma4")
    from tools import quantize
    tmp = tmp_path_factory.mktemp("gpu")
    checkpoints = {"fp16": tiny_gemma4}
    for scheme in ("w8a16", "w4a16"):
        quantize.quantize(tiny_gemma4, tmp / scheme, scheme, log=lambda *_: None)
        checkpoints[scheme] = tmp / scheme

    def launcher(name: str, runtime: str, ckpt: str, env: dict):
        argv, url = serving_argv(runtime, checkpoints[ckpt], "--served-model-name", "tiny")
        jax = {"G5G_JAX_CACHE_DIR": str(tmp / "jax-cache"), "G5G_JAX_BUCKETS": "32,64,256",
               "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.04"} if runtime == "jax" else {}
        return partial(launch, argv, url, log=tmp / f"{name}.log",
                       env=serving_env(G5G_TORCH_CACHE_DIR=str(tmp / f"inductor-{name}"), **jax, **env))

    with together({name: launcher(name, *spec) for name, spec in SERVERS.items()}, BOOT_S) as urls:
        yield urls


def _chat(url: str, stream: bool = False, prompt: str = QUESTION, **kw) -> wire.Answer:
    payload = {**wire.chat_payload("tiny", prompt, kw.pop("max_tokens", 200), stream), **kw}
    with requests.Session() as s:
        ans = (wire.stream_chat if stream else wire.chat)(s, url, payload, timeout=300)
    assert ans.success, ans.error
    return ans


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_chat_answer_streamed_and_not(servers, name):
    """The fixture's answer (as far as the checkpoint keeps it), the same streamed and not."""
    keep = KEEPS[SERVERS[name][1]]
    plain, streamed = _chat(servers[name]), _chat(servers[name], stream=True)
    assert plain.text[:keep] == ANSWER[:keep], plain.text
    assert streamed.text == plain.text and streamed.finish_reason == plain.finish_reason


PROMPTS = [QUESTION, "Tell me about reliability.", "What is SRE?", "Hello", "Explain operations.",
           "software engineering", "scalable systems", "Why?"]


def _greedy(url: str, prompt: str) -> list[Step]:
    """The greedy answer to `prompt` (MAX_TOKENS, the eos ignored), token by token with each step's top two."""
    payload = {**wire.chat_payload("tiny", prompt, MAX_TOKENS, False), "ignore_eos": True, "logprobs": True,
               "top_logprobs": 2}
    r = requests.post(f"{url}/v1/chat/completions", json=payload, timeout=300)
    assert r.status_code == 200, r.text
    return steps(r.json()["choices"][0]["logprobs"])


def _answers(url: str, concurrent: bool) -> list[list[Step]]:
    """Greedy answers to PROMPTS, all at once or one after another."""
    if not concurrent:
        return [_greedy(url, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(partial(_greedy, url), PROMPTS))


def _assert_same_greedy(a: list[list[Step]], b: list[list[Step]]) -> None:
    """Token for token, or parted only at a near-tie (devtools/greedy.py: float16 on other shapes may do that)."""
    partings = {p: why for p, x, y in zip(PROMPTS, a, b) if (why := parting(x, y))}
    assert not partings, partings


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_concurrent_greedy_answers_are_the_answers_alone(servers, name):
    _assert_same_greedy(_answers(servers[name], concurrent=True), _answers(servers[name], concurrent=False))


def _seeded(url: str) -> list[str]:
    """Seeded samples of PROMPTS, all at once: the same seed gives the same tokens whatever shares the batch."""
    ask = lambda i: _chat(url, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8,  # noqa
                          top_p=0.95, seed=100 + i).text
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, range(len(PROMPTS))))


# Whether `other` runs the default's shapes: then seeded samples must match token for token. One slot runs batch 1
# where the default runs 8, so float16 rounds the logits apart and a draw near a boundary may flip (one prompt of 8,
# after ~40 tokens, on an H100, 2026-12-06); that draws depend on (seed, position) alone, whatever shares the batch,
# is tests/test_torch_sampler.py's, exactly, on the CPU. Eager prompts run unpadded where the default's prompt graphs
# pad them to a bucket: other shapes too.
SAME_SHAPES = {"pytorch-no-pipeline": True, "pytorch-one-slot": False, "pytorch-eager-prompts": False}


@pytest.mark.parametrize("other", sorted(SAME_SHAPES))
def test_pytorch_pipeline_off_one_slot_and_eager_prompts_answer_as_the_default(servers, other):
    """Pipeline on = off, eight slots = one, eager prompts = prompts from CUDA graphs: the same greedy answers to
    concurrent requests (to a near-tie), and with the pipeline off, the same seeded samples."""
    base, alt = servers["pytorch"], servers[other]
    _assert_same_greedy(_answers(alt, concurrent=True), _answers(base, concurrent=True))
    if SAME_SHAPES[other]:
        assert _seeded(alt) == _seeded(base)


@pytest.mark.parametrize("name", sorted(n for n in SERVERS if n.endswith("-sm75")))
def test_sm75_paths_answer_as_this_gpus_own(servers, name):
    """sm_75's kernels (forced) give this GPU's own greedy answers, on every checkpoint."""
    _assert_same_greedy(_answers(servers[name], concurrent=True),
                        _answers(servers[name.removesuffix("-sm75")], concurrent=True))


# serving/api/app.py's warm-up line, with the PyTorch engine's compile summary (serving/torch_runtime/compile_cache.py)
WARM_UP = re.compile(r"boot: warm-up [\d.]+s \(.*?\); compiled decode: (?P<graphs>\d+) graph\(s\).*"
                     r"FX graph cache (?P<fx_hit>\d+) hit (?P<fx_miss>\d+) miss (?P<fx_bypass>\d+) bypass, "
                     r"AOT cache (?P<aot_hit>\d+) hit (?P<aot_miss>\d+) miss (?P<aot_bypass>\d+) bypass")


def test_a_second_pytorch_boot_over_the_same_cache_compiles_nothing(request, tmp_path):
    """Two boots, one after the other, over one G5G_TORCH_CACHE_DIR (and string hashing seeded differently, as two
    processes are): the first compiles the decode step's graphs into it, the second traces the same graphs and takes
    every one from the cache (no FX graph or AOT miss, no bypass), then answers as the first did."""
    if why := _cuda():
        pytest.skip(why)
    tiny_gemma4 = request.getfixturevalue("tiny_gemma4")
    boots = []
    for seed in ("1", "2"):
        env = serving_env(G5G_TORCH_CACHE_DIR=str(tmp_path / "cache"), PYTHONHASHSEED=seed)
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        with serving("pytorch", tiny_gemma4, "--served-model-name", "tiny", env=env, timeout=BOOT_S) as srv:
            answer = _chat(srv.url, max_tokens=MAX_TOKENS).text
        found = WARM_UP.search(srv.output)
        assert found, srv.output[-3000:]
        assert re.search(r"prefill graphs: [1-9]\d* captured in", srv.output), srv.output[-3000:]
        assert f"compile cache: {tmp_path / 'cache'}" in srv.output
        boots.append(({k: int(v) for k, v in found.groupdict().items()}, answer))
    (cold, cold_answer), (warm, warm_answer) = boots
    assert cold["graphs"] >= 1 and cold["fx_miss"] == cold["graphs"] and cold["aot_miss"] == cold["graphs"], cold
    assert warm["graphs"] == cold["graphs"] and warm["fx_hit"] == warm["aot_hit"] == warm["graphs"], warm
    assert (warm["fx_miss"], warm["fx_bypass"], warm["aot_miss"], warm["aot_bypass"]) == (0, 0, 0, 0), warm
    assert warm_answer == cold_answer


def test_a_second_pytorch_boot_loads_the_whole_compiled_step_and_answers_as_the_first(request, tmp_path):
    """G5G_TORCH_PRECOMPILED=1, two boots over one G5G_TORCH_CACHE_DIR: the first compiles the decode step ahead of
    time and writes it, the second loads it (dynamo compiles no graph: nothing traced) and answers as the first did,
    with CUDA graphs and all (precompiled.py's opt-in waits for this and for serving_speed's
    pytorch_batched_precompiled phase)."""
    if why := _cuda():
        pytest.skip(why)
    tiny_gemma4 = request.getfixturevalue("tiny_gemma4")
    boots = []
    for seed in ("1", "2"):
        env = serving_env(G5G_TORCH_CACHE_DIR=str(tmp_path / "cache"), G5G_TORCH_PRECOMPILED="1", PYTHONHASHSEED=seed)
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        with serving("pytorch", tiny_gemma4, "--served-model-name", "tiny", env=env, timeout=BOOT_S) as srv:
            answers = _answers(srv.url, concurrent=True)
        found = WARM_UP.search(srv.output)
        assert found, srv.output[-3000:]
        boots.append((int(found["graphs"]), srv.output, answers))
    (_, cold_log, cold_answers), (warm_graphs, warm_log, warm_answers) = boots
    assert "decode step compiled ahead of time, written to" in cold_log, cold_log[-3000:]
    assert "decode step loaded from" in warm_log and warm_graphs == 0, warm_log[-3000:]
    _assert_same_greedy(warm_answers, cold_answers)


# serving/jax_runtime/engine.py's compile line
JAX_COMPILE = re.compile(r"jax boot: compile [\d.]+s for (?P<executables>\d+) executables: (?P<store_hits>\d+) from the "
                         r"executable store in [\d.]+s; (?P<traced>\d+) traced")


def test_a_second_jax_boot_takes_every_executable_from_the_store_and_answers_as_the_first(request, tmp_path):
    """G5G_JAX_EXECUTABLE_STORE=1, two boots over one G5G_JAX_CACHE_DIR: the first traces and compiles the ladder
    and stores it, the second deserialises every executable (nothing traced) and gives the same greedy answers to
    concurrent prompts: executables deserialised on XLA:GPU run as the traced ones (executables.py's opt-in)."""
    if why := _cuda():
        pytest.skip(why)
    tiny_gemma4 = request.getfixturevalue("tiny_gemma4")
    boots = []
    for _ in range(2):
        env = serving_env(G5G_JAX_CACHE_DIR=str(tmp_path / "cache"), G5G_JAX_EXECUTABLE_STORE="1",
                          G5G_JAX_BUCKETS="32,64,256", XLA_PYTHON_CLIENT_MEM_FRACTION="0.04")
        with serving("jax", tiny_gemma4, "--served-model-name", "tiny", env=env, timeout=BOOT_S) as srv:
            answers = _answers(srv.url, concurrent=True)
        found = JAX_COMPILE.search(srv.output)
        assert found, srv.output[-3000:]
        boots.append(({k: int(v) for k, v in found.groupdict().items()}, answers))
    (cold, cold_answers), (warm, warm_answers) = boots
    assert cold["executables"] >= 2 and cold["store_hits"] == 0, cold
    assert warm["store_hits"] == warm["executables"] == cold["executables"] and warm["traced"] == 0, warm
    _assert_same_greedy(warm_answers, cold_answers)


def test_the_input_ring_waits_for_each_copy_before_writing_its_buffer_again():
    """serving/torch_runtime/pipeline.py's Stager: three steps' inputs through a ring of two pinned buffers while
    the stream is held back (a kernel that sleeps), so every copy is still queued when the third step's inputs are
    written. Each device tensor holds its own step's inputs: the third waited for the first's copy (its event)
    rather than writing over the buffer under it."""
    if why := _cuda():
        pytest.skip(why)
    import numpy as np
    import torch

    from serving.torch_runtime.pipeline import INPUTS, Stager
    stager = Stager(slots=4, device=torch.device("cuda"), depth=2)
    steps = [np.full((INPUTS, 4), i, np.int64) for i in (1, 2, 3)]
    torch.cuda._sleep(2_000_000_000)                    # about a second of the stream's time at 2 GHz
    sent = [stager.send(x) for x in steps]
    torch.cuda.synchronize()
    assert [int(t.min()) for t in sent] == [int(t.max()) for t in sent] == [1, 2, 3]
