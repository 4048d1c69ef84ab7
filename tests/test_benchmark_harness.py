"""benchmarks/harness/: the result file, the child-process runner, the random checkpoint and serve-and-bench, each on
what it must get right (a failed child said plainly, a figure never lost or taken from an earlier run, a checkpoint
transformers and the memory plan read), on the CPU in seconds."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks.harness import ROOT, checkpoint, children, serve
from benchmarks.harness.results import Results


# ------------------------------------------------------------------------------------------------ results
def test_each_note_rewrites_the_whole_file_and_echoes_its_figures(tmp_path, capsys):
    results = Results(tmp_path / "r.json", echo=40)
    results.note(device="cpu", layers=2)
    assert json.loads((tmp_path / "r.json").read_text()) == {"device": "cpu", "layers": 2}
    results.note(jax={"decode_tok_s": [1.5] * 50}, layers=3)          # a later phase, and a figure corrected
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk == {"device": "cpu", "layers": 3, "jax": {"decode_tok_s": [1.5] * 50}}
    assert list(on_disk) == ["device", "layers", "jax"]                 # first-noted order kept
    assert (tmp_path / "r.json").read_text() == json.dumps(on_disk, indent=1)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == json.dumps({"device": "cpu", "layers": 2})
    assert printed[1] == json.dumps({"jax": {"decode_tok_s": [1.5] * 50}, "layers": 3})[:40]


# ----------------------------------------------------------------------------------------------- children
def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_child_that_fails_says_how_and_what_it_printed(tmp_path):
    got = children.run_child(_python("import sys; print('loading'); sys.exit('CUDA out of memory')"),
                             tmp_path / "r.json", timeout=60)
    assert got.figures is None and got.seconds >= 0
    assert got.error.startswith(f"child {sys.executable} failed (exit status 1); its output ends:\n")
    assert "loading" in got.error and "CUDA out of memory" in got.error
    assert got.record() == {"error": got.error}
    assert got.record(timed="child_s") == {"error": got.error, "child_s": got.seconds}


def test_a_module_child_is_named_and_a_signal_is_named(tmp_path):
    got = children.run_child(children.module_argv("benchmarks.no_such_benchmark"), tmp_path / "r.json", timeout=60,
                             env=children.child_env())
    assert got.error.startswith("child benchmarks.no_such_benchmark failed (exit status 1)")
    assert "No module named benchmarks.no_such_benchmark" in got.error
    got = children.run_child(_python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), tmp_path / "r.json",
                             timeout=60)
    assert "failed (killed by SIGKILL)" in got.error


def test_a_child_that_exits_0_without_figures_is_a_failure_and_old_figures_are_never_read(tmp_path):
    result = tmp_path / "r.json"
    children.write_result(result, {"step_ms_1": 1.0})          # an earlier run's figures
    got = children.run_child(_python("print('done')"), result, timeout=60)
    assert got.figures is None and f"exit status 0 but no result in {result}" in got.error
    assert not result.exists()


def test_a_child_that_writes_garbage_is_a_failure(tmp_path):
    result = tmp_path / "r.json"
    got = children.run_child(_python(f"open({str(result)!r}, 'w').write('{{half')"), result, timeout=60)
    assert got.figures is None and "unreadable result" in got.error


def test_a_child_past_its_bound_is_stopped_and_reported(tmp_path):
    got = children.run_child(_python("import time; time.sleep(60)"), tmp_path / "r.json", timeout=1)
    assert got.error == "timed out after 1 s" and got.record(timed="child_s") == {"error": got.error, "child_s": 1}


def test_a_child_module_writes_its_figures_for_the_parent(tmp_path):
    """The real protocol: a benchmark module run with -m from another directory, its figures read back."""
    result = tmp_path / "r.json"
    code = ("import sys; from benchmarks.harness import children; "
            "children.write_result(sys.argv[1], {'step_ms_1': 2.5, 'cwd': __import__('os').getcwd()})")
    got = children.run_child([sys.executable, "-c", code, str(result)], result, timeout=60, cwd=tmp_path,
                             env=children.child_env())
    assert got.error is None and got.figures == {"step_ms_1": 2.5, "cwd": str(tmp_path)}
    assert got.record(timed="child_s") == {**got.figures, "child_s": got.seconds}


def test_child_env_puts_the_checkout_first_once_and_keeps_the_rest():
    env = children.child_env({"PYTHONPATH": os.pathsep.join(["/x", str(ROOT)]), "A": "1"}, XLA_FLAGS="--f")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/x"]
    assert env["A"] == "1" and env["XLA_FLAGS"] == "--f"
    assert children.child_env({})["PYTHONPATH"] == str(ROOT)
    assert children.module_argv("benchmarks.t4g_model", "--child") == [sys.executable, "-m", "benchmarks.t4g_model",
                                                                      "--child"]


# --------------------------------------------------------------------------------------------- checkpoint
def test_text_config_is_the_memory_plans_shape_with_what_transformers_needs():
    from serving import memory_plan

    e2b = checkpoint.text_config("e2b")
    assert {k: e2b[k] for k in memory_plan.SHAPES["e2b"]["text_config"]} == memory_plan.SHAPES["e2b"]["text_config"]
    assert e2b["final_logit_softcapping"] == 30.0 and e2b["eos_token_id"] == [1, 106]
    ten = checkpoint.text_config("e2b", layers=10)
    assert ten["num_hidden_layers"] == 10 and ten["num_kv_shared_layers"] == 5          # E2B's 20 of 35
    assert [i for i, t in enumerate(ten["layer_types"]) if t == "full_attention"] == [4, 9]
    e4b = checkpoint.text_config("e4b", layers=12)
    assert [i for i, t in enumerate(e4b["layer_types"]) if t == "full_attention"] == [5, 11]
    tiny = checkpoint.text_config("e2b", tiny=True)
    assert tiny["hidden_size"] == 128 and tiny["num_hidden_layers"] == len(tiny["layer_types"]) == 6
    assert checkpoint.text_config("e2b", layers=10, tiny=True)["num_hidden_layers"] == 10


def test_fill_draws_each_kind_of_tensor_as_a_trained_model_holds_it():
    one = lambda shape: 1.0     # noqa: E731  (a draw of exactly 1: the scale of each rule, read off)
    assert checkpoint.fill("model.layers.0.self_attn.q_norm.weight", (256,), one, one) == pytest.approx(0.3)
    assert checkpoint.fill("model.layers.0.input_layernorm.weight", (1536,), one, one) == pytest.approx(1.2)
    assert checkpoint.fill("model.layers.0.layer_scalar", (1,), one, one) == 1.0
    assert checkpoint.fill("model.layers.0.mlp.up_proj.weight", (6144, 1536), one, one) == pytest.approx(1536 ** -0.5)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("tiny") / "ckpt"
    checkpoint.build(ckpt, checkpoint.text_config("e2b", tiny=True), device="cpu")
    return ckpt


def test_a_tiny_checkpoint_loads_in_transformers_and_the_memory_plan(tiny_ckpt):
    import torch
    from transformers import AutoConfig, Gemma4ForConditionalGeneration

    from serving import memory_plan

    cfg = AutoConfig.from_pretrained(tiny_ckpt).text_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (128, 6, 1024)
    text, towers = memory_plan.checkpoint_tensors(tiny_ckpt)
    assert towers == 0 and text == memory_plan.text_tensors({"text_config": checkpoint.text_config("e2b", tiny=True)})
    model = Gemma4ForConditionalGeneration.from_pretrained(tiny_ckpt)
    params = dict(model.named_parameters())
    q_norm = next(t for n, t in params.items() if n.endswith("self_attn.q_norm.weight"))
    assert params["model.language_model.embed_tokens.weight"].dtype == torch.float16
    assert 0.15 < float(q_norm.detach().float().mean()) < 0.35          # drawn small (fill), not transformers' ones
    again = checkpoint.build(tiny_ckpt.parent / "again", checkpoint.text_config("e2b", tiny=True), device="cpu")
    assert (again / "model.safetensors").read_bytes() == (tiny_ckpt / "model.safetensors").read_bytes()


def test_the_whole_vocab_tokenizer_decodes_every_id(tiny_ckpt, tmp_path):
    from transformers import AutoTokenizer

    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    checkpoint.add_whole_vocab_tokenizer(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert len(tok) == 1024 and tok.decode([1023]).strip() == "w1023"


# -------------------------------------------------------------------------------------------------- serve
def test_tpots_are_per_request_and_skip_what_has_no_decode():
    result = {"latencies": [1.0, 0.5, 2.0], "ttfts": [0.1, None, 0.2], "output_lens": [10, 10, 1]}
    assert serve.tpots_ms(result) == [pytest.approx(100.0)]


def test_bench_runs_build_py_bench_with_its_json(monkeypatch, tmp_path):
    calls = []

    def run(argv, cwd, check, timeout, stdout):
        calls.append((argv, cwd, check, stdout))
        Path(argv[argv.index("--json") + 1]).write_text('{"completed": 8}')

    monkeypatch.setattr(serve.subprocess, "run", run)
    assert serve.bench("http://127.0.0.1:1", tmp_path / "b.json", "--requests", "8", quiet=True) == {"completed": 8}
    argv, cwd, check, stdout = calls[0]
    assert argv[1:] == ["build.py", "bench", "--url", "http://127.0.0.1:1", "--requests", "8", "--json",
                        str(tmp_path / "b.json")]
    assert cwd == ROOT and check and stdout is serve.subprocess.DEVNULL


def test_a_server_that_does_not_come_up_ends_a_fatal_benchmark_naming_its_runtime(monkeypatch):
    import contextlib

    import devtools.server as server

    @contextlib.contextmanager
    def failing(*a, **kw):
        raise server.ServerFailed("exited 1: no such model")
        yield

    monkeypatch.setattr(server, "serving", failing)
    with pytest.raises(SystemExit, match="^jax: exited 1: no such model$"):
        with serve.served("jax", Path("/nowhere"), fatal=True):
            pass
    with pytest.raises(server.ServerFailed):
        with serve.served("jax", Path("/nowhere")):
            pass


def test_each_image_lacks_the_other_runtimes_framework_by_its_manifest():
    from benchmarks.harness.as_image import absent
    assert absent("jax") == ["torch"] and absent("pytorch") == ["jax"]


def test_a_served_jax_server_runs_as_its_image_without_torch(tiny_gemma4, tmp_path):
    """served() boots the JAX server as its image runs it: transformers (the tokenizer) finds no torch, so the
    process never maps libtorch, yet the chat is answered."""
    import requests

    from devtools.server import serving_env
    with serve.served("jax", tiny_gemma4, "--served-model-name", "tiny", env=serving_env(jax_cache=tmp_path / "c"),
                      timeout=300) as srv:
        r = requests.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        maps = Path(f"/proc/{srv.proc.pid}/maps").read_text()
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text
    assert "/jaxlib/" in maps and "libtorch" not in maps


def test_hiding_a_package_makes_it_look_uninstalled_and_refuses_one_already_imported():
    import subprocess
    code = ("import importlib.util, sys; from benchmarks.harness.as_image import hide; hide(['torch']); "
            "assert importlib.util.find_spec('torch') is None\n"
            "try:\n    import torch\nexcept ImportError:\n    print('hidden')\n"
            "import json; hide(['json'])")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.stdout == "hidden\n" and "json is imported already: too late to hide it" in run.stderr, run.stderr


# ------------------------------------------------------------------------------------------ one way to run
def test_benchmarks_run_one_way_no_sys_path_edits_no_bare_sibling_imports():
    """Every benchmark is `python -m benchmarks.NAME`: none edits sys.path (so none runs by its path), and none
    imports a sibling by its bare name (what only a path run with its folder on sys.path could resolve)."""
    import ast

    files = sorted((ROOT / "benchmarks").rglob("*.py"))
    stems = {f.stem for f in files} - {"__init__"}
    found = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                found.append(f"{f.relative_to(ROOT)}:{node.lineno}: sys.path")
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{f.relative_to(ROOT)}:{node.lineno}: import {n}" for n in names if n.split(".")[0] in stems]
    assert found == []


def test_prompt_graphs_without_a_gpu_says_so_in_one_line_before_building_anything(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "benchmarks.prompt_graphs", str(tmp_path / "out")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == ("prompt_graphs: no CUDA GPU here (the graphs it compares are "
                                                   "CUDA graphs)")
    assert not (tmp_path / "out").exists()


def test_prompt_graphs_refuses_a_prompt_its_answer_would_push_past_the_context(tmp_path):
    import subprocess

    # 1000 + 32 tokens overflowed the 1024 context on an H100, after the checkpoint and three lengths had run
    out = subprocess.run([sys.executable, "-m", "benchmarks.prompt_graphs", str(tmp_path / "out"),
                          "--lengths", "5,1000"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == ("prompt_graphs: a prompt of 1000 tokens and 32 more do not fit the "
                                                   "context (1024)")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------- decode variants, profiles
def test_decode_variants_pick_a_winner_per_kind_of_paths():
    """Variants on sm_75's paths (cuBLAS dots: what XLA compiles for a T4G) never compete with this GPU's own: each
    kind has its own winner, and a variant's kind is what its XLA_FLAGS make XLA do."""
    from benchmarks import decode_variants as dv
    from serving.jax_runtime import xla

    for name, env in dv.VARIANTS.items():
        assert (dv.paths(name) == "sm75") == (not xla.triton_gemm((9, 0), env.get("XLA_FLAGS", "")))
    assert {n for n in dv.VARIANTS if dv.paths(n) == "sm75"} == {
        "cublas-dots", "cublas-dots-outside-command-buffers", "cublas-dots-no-command-buffers",
        "cublas-dots-stable-temp-addresses"}
    step = {"default": 3.5, "plain": 4.0, "cublas-dots": 14.9, "cublas-dots-no-command-buffers": 6.0}
    assert dv.fastest(step) == {"own": "default", "sm75": "cublas-dots-no-command-buffers"}
    assert dv.fastest({"cublas-dots": 7.0}) == {"sm75": "cublas-dots"}


def test_a_profiles_trace_summary_names_the_hosts_longest_events(tmp_path):
    """serving_speed's JAX trace summary keeps the host's events per step beside the device's kernels (where a
    step's host time went: `command_buffer::update` on sm_75's paths), from a real jax.profiler trace."""
    import glob

    import jax
    import jax.numpy as jnp

    from benchmarks.serving_speed import _trace_summary

    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(4):
            f(x).block_until_ready()
    summary = _trace_summary(Path(glob.glob(f"{tmp_path}/**/*.xplane.pb", recursive=True)[0]), 4)
    host = summary["host_top_ms_per_step"]
    assert host and all(ms > 0 for ms in host.values()) and len(host) <= 20
    assert any("jit" in name.lower() or "execute" in name.lower() for name in host), list(host)
