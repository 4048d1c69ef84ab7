"""The JAX Gemma 4 port against transformers, on tiny random checkpoints we build here (CPU, float32).

Tolerance: float32 logits (soft-capped, |logit| up to ~5 here) agree within ATOL = 5e-4 absolute at every
position; greedy continuations are identical for 40 tokens.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("jax")

from serving.engine import SamplingParams  # noqa: E402
from serving.jax_runtime import CheckpointError, Settings, compile_counts, load  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ATOL = 5e-4
BUCKETS = (16, 48)     # prompt buckets and full-attention capacities: decode below crosses 16 -> 48
SLOTS, BATCHES = 4, (1, 2, 4)
GREEDY = SamplingParams(temperature=0.0)
SEQ_LEN = 46           # longest sequence the tests run (prompt + teacher-forced tokens)
S, F = "sliding_attention", "full_attention"

# Each covers something the others don't; all have prompts longer than the sliding window and decode far past
# a ring wrap-around (window 3..5, sequences of 46).
CONFIGS = {
    # E2B's shape in miniature: head dims 8 (sliding) / 16 (full), GQA 4:2, the last 3 layers KV-shared,
    # per-layer embeddings, double-wide MLP on shared layers, proportional RoPE 0.25, soft-capping, tied.
    "e2b_like": dict(layout="multimodal", text=dict(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=5, layer_types=[S, S, F, S, S, F],
        num_kv_shared_layers=3, hidden_size_per_layer_input=4, vocab_size_per_layer_input=128,
        use_double_wide_mlp=True, final_logit_softcapping=30.0)),
    # No sharing, no PLE, no soft-capping, MHA, full head dim smaller than sliding, RoPE 0.5 on full layers,
    # untied lm_head, a sharded checkpoint.
    "plain_untied_sharded": dict(layout="multimodal", untied=True, shard="20KB", text=dict(
        vocab_size=96, hidden_size=24, intermediate_size=40, num_hidden_layers=5, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, global_head_dim=8, sliding_window=3, layer_types=[S, F, S, S, F],
        hidden_size_per_layer_input=0, final_logit_softcapping=None,
        rope_parameters={S: {"rope_type": "default", "rope_theta": 500.0},
                         F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 20000.0}})),
    # Text-only Gemma4ForCausalLM layout (weights under model.*), keys-equal-values on full layers with their own
    # KV head count, and a shared full layer.
    "causal_lm_k_eq_v": dict(layout="causal_lm", text=dict(
        vocab_size=80, hidden_size=32, intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, attention_k_eq_v=True, num_global_key_value_heads=1,
        sliding_window=4, layer_types=[S, S, F, S, F], num_kv_shared_layers=2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=80, final_logit_softcapping=15.0)),
}


def _randomise(model, seed: int) -> None:
    """Transformers' init leaves norms at 1 and scalars at 1; perturb everything so each weight matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name or "embed_scale" in name:
                continue
            if name.endswith("layer_scalar"):
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
            elif "norm" in name:
                t.copy_(1 + 0.3 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5)


def build_checkpoint(name: str, out: Path):
    """Save a random tiny Gemma 4 as transformers would; return the model (float32, eval)."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    spec = CONFIGS[name]
    text = dict(spec["text"], tie_word_embeddings=not spec.get("untied"), max_position_embeddings=1024)
    if spec["layout"] == "causal_lm":
        model = Gemma4ForCausalLM(Gemma4TextConfig(**text))
    else:
        cfg = Gemma4Config(text_config=text, vision_config=None, audio_config=None,
                           tie_word_embeddings=not spec.get("untied"))
        model = Gemma4ForConditionalGeneration(cfg)
    _randomise(model, seed=len(name))
    model.save_pretrained(out, max_shard_size=spec.get("shard", "5GB"))
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(name, transformers model, JAX engine) over the same checkpoint directory."""
    out = tmp_path_factory.mktemp(request.param)
    ref = build_checkpoint(request.param, out)
    engine = load(out, Settings(buckets=BUCKETS, dtype="float32", cache_dir=None, slots=SLOTS, batches=BATCHES))
    return request.param, ref, engine, out


@pytest.fixture(scope="module")
def e2b_ckpt(tmp_path_factory):
    """(transformers model, checkpoint dir) of the E2B-like configuration, for the checks one config suffices for."""
    out = tmp_path_factory.mktemp("e2b_like_ckpt")
    return build_checkpoint("e2b_like", out), out


def _sequence(vocab: int, n: int = SEQ_LEN, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def forced_logits(engine, prompt: list[int], forced: list[int], slot: int = 0) -> np.ndarray:
    """Logits after the prompt and after each forced token (teacher forcing through start/step)."""
    engine.start(slot, prompt, GREEDY)
    out = [engine.logits(slot)]
    for t in forced:
        engine.step({slot: t})
        out.append(engine.logits(slot))
    return np.stack(out)


def _reference_logits(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("prompt_len", [1, 4, 13, 16, 20])
def test_teacher_forced_logits_match_transformers(pair, prompt_len):
    name, ref, engine, _ = pair
    seq = _sequence(engine.cfg.vocab_size)
    want = _reference_logits(ref, seq)[prompt_len - 1:-1]
    got = forced_logits(engine, seq[:prompt_len], seq[prompt_len:-1])
    assert got.shape == want.shape and got.dtype == np.float32
    err = np.abs(got - want).max(axis=-1)
    assert err.max() <= ATOL, f"{name}: worst position {int(err.argmax()) + prompt_len - 1}, |Δ| {err.max():.2e}"


def test_greedy_continuation_matches_generate(pair):
    name, ref, engine, _ = pair
    prompt = _sequence(engine.cfg.vocab_size, 7, seed=1)
    new = 40
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    got = [engine.start(1, prompt, GREEDY)]
    while len(got) < new:
        got.append(engine.step({1: got[-1]})[1])
    assert got == want, name


def test_no_compilation_after_boot(pair):
    name, _, engine, _ = pair
    assert engine.boot["executables"] == len(BUCKETS) * (1 + len(BATCHES))
    before = compile_counts()
    for n, steps in [(1, 3), (16, 2), (17, 20), (5, 43), (48, 0), (30, 18), (2, 0)]:
        engine.start(0, _sequence(engine.cfg.vocab_size, n, seed=n), SamplingParams(temperature=1.0, top_p=0.5))
        for t in range(steps):
            engine.step({0: t})
    for slot in range(SLOTS):                    # every batch bucket, sampled and greedy rows together
        engine.start(slot, [1, 2, 3], SamplingParams(temperature=0.5 * slot, top_k=slot))
        engine.step({s: 1 for s in range(slot + 1)})
    assert compile_counts() == before, f"{name}: something compiled or traced after boot"


def test_limits_are_clear_errors(pair):
    _, _, engine, _ = pair
    assert engine.max_context == BUCKETS[-1]
    with pytest.raises(ValueError, match="max_context 48"):
        engine.start(0, [1] * 49, GREEDY)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.start(0, [], GREEDY)
    with pytest.raises(ValueError, match="slot 4 is not one of"):
        engine.start(SLOTS, [1], GREEDY)
    engine.start(0, [1] * 48, GREEDY)
    with pytest.raises(ValueError, match="max_context 48"):
        engine.step({0: 1})


def test_float16_stays_near_the_float32_reference(e2b_ckpt):
    """The GPU dtype, run on CPU: float32 logits out, within 0.1 of transformers' float32 logits, same argmax.
    (At E2B's real shapes on an H200 it was compared with transformers' float16:
    benchmarks/results/jax_gpu_e2b_shape_h200.json.)"""
    ref, ckpt = e2b_ckpt
    half = load(ckpt, Settings(buckets=(16,), dtype="float16", cache_dir=None, slots=1))
    seq = _sequence(ref.config.get_text_config().vocab_size, 16, seed=3)
    got = forced_logits(half, seq[:6], seq[6:-1])
    want = _reference_logits(ref, seq)[5:-1]
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert np.abs(got - want).max() < 0.1
    assert (got.argmax(-1) == want.argmax(-1)).all()


def _drop_tensor(src: Path, dst: Path, key: str) -> None:
    from safetensors.numpy import save_file
    from serving.jax_runtime.checkpoint import SafetensorsDir

    st = SafetensorsDir(src)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({k: np.array(st.get(k)) for k in st.names() if k != key}, str(dst / "model.safetensors"))


def test_missing_tensor_names_the_key(e2b_ckpt, tmp_path):
    _, ckpt = e2b_ckpt
    key = "model.language_model.layers.2.self_attn.k_norm.weight"
    _drop_tensor(ckpt, tmp_path / "broken", key)
    with pytest.raises(CheckpointError, match=f"'{key}' missing"):
        load(tmp_path / "broken", Settings(buckets=(16,), cache_dir=None))

    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["text_config"]["layer_types"]
    (tmp_path / "badcfg").mkdir()
    (tmp_path / "badcfg" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json text_config: missing key 'layer_types'"):
        load(tmp_path / "badcfg", Settings(buckets=(16,), cache_dir=None))
    with pytest.raises(CheckpointError, match="config.json: not found"):
        load(tmp_path / "nothing-here", Settings(buckets=(16,), cache_dir=None))


BOOT = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
from serving.jax_runtime import compile_counts, load
from serving.engine import SamplingParams
e = load(sys.argv[1])
booted = compile_counts()
e.step({0: e.start(0, [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(temperature=0.0))})
e.step({0: 5, 1: e.start(1, [2, 7], SamplingParams(temperature=0.7, seed=1))})   # 2 rows: the batch-2 decode
after = {k: v - booted[k] for k, v in compile_counts().items()}
print(json.dumps({"boot": e.boot, "after_boot": after, "logits": e.logits(0)[:8].tolist()}))
"""


@pytest.mark.slow
def test_second_boot_loads_every_executable_from_the_persistent_cache(e2b_ckpt, tmp_path):
    """A cold boot compiles the ladder and keeps it; a warm one loads every executable from the executable store
    (serving/jax_runtime/executables.py), tracing and compiling nothing; a store entry that cannot be read is traced
    and loaded from JAX's persistent cache instead. Each boot logs its phases."""
    _, ckpt = e2b_ckpt
    cache = tmp_path / "jaxcache"
    env = {"G5G_JAX_CACHE_DIR": str(cache), "G5G_JAX_BUCKETS": "16,32", "G5G_JAX_SLOTS": "2",
           "G5G_JAX_EXECUTABLE_STORE": "1", "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}

    def boot(hash_seed):
        # Different string hashing in each process, as in real boots: the cache key must not depend on it.
        out = subprocess.run([sys.executable, "-c", BOOT, str(ckpt)], cwd=ROOT, capture_output=True, text=True,
                             env={**env, "PYTHONHASHSEED": str(hash_seed)}, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        for phase in ("jax boot: load ", "jax boot: compile ", "jax boot: weights "):
            assert phase in out.stderr, out.stderr[-2000:]
        return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stderr}

    cold, warm = boot(1), boot(2)
    assert cold["boot"]["executables"] == 4  # 2 prefill + 2 decode (batch 2: the slot count)
    assert cold["boot"]["boot_cache_hits"] == cold["boot"]["store_hits"] == 0
    assert cold["boot"]["boot_xla_compiles"] == cold["boot"]["store_saved"] == 4
    assert warm["boot"]["store_hits"] == warm["boot"]["executables"] == 4
    assert warm["boot"]["boot_compiles"] == warm["boot"]["boot_traces"] == warm["boot"]["boot_cache_hits"] == 0
    assert "compile" in warm["log"] and "4 from the executable store" in warm["log"]
    for run in (cold, warm):
        assert run["after_boot"] == {"compiles": 0, "traces": 0, "cache_hits": 0}, run["after_boot"]
    np.testing.assert_array_equal(cold["logits"], warm["logits"])

    stored = sorted((cache / "g5g-executables").glob("prefill-16-*"))
    assert len(stored) == 1
    stored[0].write_bytes(stored[0].read_bytes()[:100])       # truncated: unreadable, so traced and cache-loaded
    third = boot(3)
    assert third["boot"]["store_hits"] == 3 and third["boot"]["boot_cache_hits"] == 1
    assert third["boot"]["boot_xla_compiles"] == 0 and third["after_boot"]["compiles"] == 0
    assert "not loadable" in third["log"] and "cannot be added to it" in third["log"]
    np.testing.assert_array_equal(cold["logits"], third["logits"])


def test_unusable_cache_dir_only_costs_the_cache(e2b_ckpt, tmp_path, caplog):
    _, ckpt = e2b_ckpt
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    engine = load(ckpt, Settings(buckets=(16,), cache_dir=str(blocker / "cache"), slots=1))
    engine.start(0, [1, 2, 3], GREEDY)
    assert engine.boot["boot_cache_hits"] == 0 and engine.logits(0).shape == (128,)
    assert "unusable" in caplog.text


def test_weights_convert_in_row_blocks_across_threads(monkeypatch):
    """load_params' conversion (transpose and cast, in blocks on a thread pool) gives numpy's own result; a tensor
    that needs neither stays the memory-mapped array itself."""
    from concurrent.futures import ThreadPoolExecutor

    import ml_dtypes
    from serving.jax_runtime import checkpoint

    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 1000)          # many blocks, a ragged last one
    src = np.random.default_rng(0).standard_normal((301, 77)).astype(ml_dtypes.bfloat16)
    pending = []
    with ThreadPoolExecutor(3) as pool:
        flat = checkpoint._converted(pool, pending, src, np.dtype(np.float16), transpose=False)
        turned = checkpoint._converted(pool, pending, src, np.dtype(np.float16), transpose=True)
        same = checkpoint._converted(pool, pending, src, src.dtype, transpose=False)
        other = np.random.default_rng(1).standard_normal((45, 77)).astype(ml_dtypes.bfloat16)
        side = checkpoint._converted(pool, pending, [src, other], np.dtype(np.float16), transpose=True)
        for task in pending:
            task.result()
    assert len(pending) > 20 and same is src
    np.testing.assert_array_equal(side, np.concatenate([src.T, other.T], axis=1).astype(np.float16))
    np.testing.assert_array_equal(flat, src.astype(np.float16))
    np.testing.assert_array_equal(turned, np.ascontiguousarray(src.T).astype(np.float16))
    assert turned.flags.c_contiguous


def test_weights_that_share_an_input_are_one_dot_per_step(e2b_ckpt):
    """q|k|v and gate|up are fused at load: in the lowered decode and prefill no two dots read the same
    activation, so XLA's DotMerger (which, with dots on cuBLAS as on sm_75, concatenates the weights of such dots
    on every call) finds nothing to join. Today's separate weights give 3 dots per KV-owning layer on one input."""
    import functools
    import re

    import jax
    import jax.numpy as jnp
    from serving.jax_runtime import checkpoint, config, model

    _, ckpt = e2b_ckpt
    cfg = config.load(ckpt)
    params = checkpoint.load_params(ckpt, cfg, np.float32)
    assert all("qkv" in lp and "gate_up" in lp and "q" not in lp for lp in params["layers"])
    cache = model.empty_cache(cfg, 2, 16, jnp.float32)
    i32 = jax.ShapeDtypeStruct
    programs = {
        "decode": jax.jit(functools.partial(model.decode, cfg, 16)).lower(
            params, cache, i32((2,), jnp.int32), i32((2,), jnp.int32)),
        "prefill": jax.jit(functools.partial(model.prefill, cfg)).lower(
            params, cache, i32((), jnp.int32), i32((16,), jnp.int32), i32((), jnp.int32))}
    for name, lowered in programs.items():
        dots = re.findall(r"stablehlo\.dot_general (%[\w#]+), (%[\w#]+)", lowered.as_text())
        # the activation each weight (an argument of the program) is multiplied with
        inputs = [a if w.startswith("%arg") else w for a, w in dots if "%arg" in a + w]
        assert len(inputs) >= 4 * cfg.num_layers, name            # qkv, o, gate_up, down, PLE gate/proj, head
        shared = {v for v in inputs if inputs.count(v) > 1}
        assert not shared, f"{name}: weights multiplied with the same input {sorted(shared)}"


def test_a_dtype_the_gpu_cannot_run_is_refused_in_one_line(e2b_ckpt, monkeypatch):
    """bfloat16 on a Turing GPU (no bf16 datapath): refused at load, before any weight is read (the device query
    is the seam: no GPU here); float16 and auto pass, and bfloat16 passes from compute capability 8.0."""
    import jax.numpy as jnp
    from serving.jax_runtime import checkpoint, engine

    _, ckpt = e2b_ckpt
    monkeypatch.setattr(engine, "_gpu_capability", lambda: (7, 5))
    monkeypatch.setattr(checkpoint, "load_params", lambda *a: pytest.fail("weights read before the refusal"))
    with pytest.raises(ValueError) as refused:
        load(ckpt, Settings(buckets=(16,), dtype="bfloat16", cache_dir=None, slots=1))
    line = str(refused.value)
    assert "G5G_JAX_DTYPE: bfloat16 needs a GPU of compute capability 8.0" in line and "7.5" in line
    assert "\n" not in line
    assert Settings(dtype="float16").resolve_dtype((7, 5)) == jnp.float16
    assert Settings(dtype="bfloat16").resolve_dtype((8, 0)) == jnp.bfloat16
    assert Settings(dtype="bfloat16").resolve_dtype(None) == jnp.bfloat16       # CPU: XLA runs it


def test_one_executable_per_lm_head_shape_compiles_alone_before_the_rest():
    """compile_waves: the first wave holds one executable per shape of the head's dot (decode: per batch size;
    prefill: per prompt-logprobs chunk, 16 -> 16, 48 -> 24, 64 and 128 -> 32), so the ones compiled side by side
    after it find XLA's autotuning results for their head (memory_plan counts one copy of it)."""
    from serving.jax_runtime.engine import compile_waves

    ladder = [("prefill", c) for c in (16, 48, 64, 128)] + [("decode", b, c) for c in (16, 48, 64, 128) for b in (1, 4)]
    first, rest = compile_waves(ladder)
    assert first == [("prefill", 16), ("prefill", 48), ("prefill", 64), ("decode", 1, 16), ("decode", 4, 16)]
    assert sorted(first + rest) == sorted(ladder) and ("prefill", 128) in rest


def test_pipeline_and_xla_default_switches_read_0_or_1_and_refuse_anything_else():
    assert Settings.from_env({}).pipeline and not Settings.from_env({"G5G_JAX_PIPELINE": "0"}).pipeline
    assert Settings.from_env({}).xla_defaults and not Settings.from_env({"G5G_JAX_XLA_DEFAULTS": "0"}).xla_defaults
    for name in ("G5G_JAX_PIPELINE", "G5G_JAX_XLA_DEFAULTS"):
        with pytest.raises(ValueError, match=f"{name}: 'yes' is not 0 or 1"):
            Settings.from_env({name: "yes"})


def test_default_xla_flags_fill_in_what_the_user_did_not_set():
    from serving.jax_runtime.xla import DEFAULT_XLA_FLAGS, with_default_xla_flags

    every = with_default_xla_flags("")
    assert every.split() == [f"{k}={v}" for k, v in DEFAULT_XLA_FLAGS.items()]
    assert "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" in every
    # the user's own value of a default flag wins, and their other flags stay in their order
    mine = with_default_xla_flags("--xla_dump_to=/tmp/d  --xla_gpu_enable_command_buffer=")
    assert mine.split() == ["--xla_dump_to=/tmp/d", "--xla_gpu_enable_command_buffer=",
                            "--xla_gpu_graph_min_graph_size=1"]
    assert with_default_xla_flags(every) == every


# ------------------------------------------------------------------------------------- continuous batching
def _run_schedule(engine, jobs, joins):
    """Drive the engine as the API layer does: job j = (prompt, params, tokens) joins a free slot before decode
    step joins[j]; every live slot steps together; a job leaves after its tokens. Returns each job's tokens."""
    out = {j: [] for j in range(len(jobs))}
    live: dict[int, int] = {}                     # slot -> job
    step = 0
    while len(live) or step <= max(joins):
        for j, at in enumerate(joins):
            if at == step:
                slot = next(s for s in range(engine.slots) if s not in live)
                prompt, params, _ = jobs[j]
                out[j].append(engine.start(slot, prompt, params))
                live[slot] = j
        for slot, j in list(live.items()):        # leave when done (a slot freed here is reused next step)
            if len(out[j]) >= jobs[j][2]:
                del live[slot]
        if live:
            for slot, t in engine.step({s: out[j][-1] for s, j in live.items()}).items():
                out[live[slot]].append(t)
        step += 1
    return [out[j][:jobs[j][2]] for j in range(len(jobs))]


def test_batched_greedy_equals_single_stream_greedy(pair):
    """Prompts of different lengths join and leave mid-stream; each gets, token for token, what it gets alone.
    Windows are 3..5: every sequence here runs past the window and wraps its ring several times."""
    name, _, engine, _ = pair
    v = engine.cfg.vocab_size
    jobs = [(_sequence(v, n, seed=10 + n), GREEDY, k) for n, k in [(3, 30), (13, 20), (1, 40), (20, 12), (7, 25)]]
    alone = [_run_schedule(engine, [job], [0])[0] for job in jobs]
    together = _run_schedule(engine, jobs, [0, 0, 4, 9, 23])   # at most 4 live at once (the slot count)
    assert together == alone, name


def test_pipelined_decode_gives_the_tokens_of_plain_decode(pair):
    """The speculative next step is taken when the call asks for exactly it and run again otherwise (a slot joins
    or leaves, a forced token): penalised, seeded and greedy sequences get the same tokens either way."""
    name, _, engine, _ = pair
    v = engine.cfg.vocab_size
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.3),
              SamplingParams(temperature=1.2, seed=7, top_p=0.8, frequency_penalty=1.5),
              GREEDY, SamplingParams(temperature=0.9, seed=3, presence_penalty=2.0, min_tokens=12)]
    jobs = [(_sequence(v, 4 + 5 * i, seed=30 + i), p, 18 + 4 * i) for i, p in enumerate(params)]
    joins = [0, 3, 3, 11]
    try:
        engine.pipeline = False
        plain = _run_schedule(engine, jobs, joins)
        forced = forced_logits(engine, jobs[0][0], list(range(1, 9)))
    finally:
        engine.pipeline = True
    before = dict(engine.speculation)
    assert _run_schedule(engine, jobs, joins) == plain, name
    np.testing.assert_allclose(forced_logits(engine, jobs[0][0], list(range(1, 9))), forced, rtol=1e-5, atol=1e-5)
    used, replaced = (engine.speculation[k] - before[k] for k in ("used", "replaced"))
    assert used > 3 * replaced > 0, (name, used, replaced)

    # the penalties' history counts each token fed once, also the one a replaced speculative step had counted
    toks, other = [engine.start(0, jobs[0][0], params[0])], None
    for i in range(8):
        if i == 4:
            other = engine.start(1, jobs[1][0], GREEDY)        # a join: the step in flight is run again
        engine.pipeline = i < 7                                   # the last step leaves nothing in flight
        out = engine.step({0: toks[-1], **({} if other is None else {1: other})})
        toks.append(out[0])
        other = out.get(1, other)
    engine.pipeline = True
    counts = np.asarray(engine._state["counts"])[0]
    np.testing.assert_array_equal(counts, np.bincount(toks[:-1], minlength=counts.size))


def _only(token: int, vocab: int) -> np.ndarray:
    """The allowed-token mask (serving/engine.py's layout) that allows `token` alone."""
    bits = np.zeros(-(-vocab // 32) * 32, np.uint8)
    bits[token] = 1
    return np.packbits(bits, bitorder="little").view("<i4")


def test_a_restarted_slot_never_takes_the_step_speculated_for_its_previous_sequence(pair):
    """A sequence ends in slot 0 while the step after its last token x is in flight (fed x); a new sequence starts
    in slot 0 whose first token is x too (forced by start's mask). Its next token must come from its own context:
    the speculative step would serve the call (same slot, same token fed) and hand out the old sequence's next
    token. Deterministic: among a few prompts, one whose next token differs between the two contexts is used."""
    name, _, engine, _ = pair
    v = engine.cfg.vocab_size
    old = _sequence(v, 6, seed=40)

    def restart(new: list[int], pipeline: bool) -> tuple[list[int], list[int]]:
        engine.pipeline = pipeline
        try:
            first = [engine.start(0, old, GREEDY)]
            for _ in range(4):                    # the last call leaves a step in flight, fed first[-1]
                first.append(engine.step({0: first[-1]})[0])
            then = [engine.start(0, new, GREEDY, _only(first[-1], v))]
            for _ in range(3):
                then.append(engine.step({0: then[-1]})[0])
            return first, then
        finally:
            engine.pipeline = True

    first, _ = restart(old, False)
    engine.pipeline = False
    engine.start(0, old, GREEDY)
    for t in first:
        out = engine.step({0: t})[0]              # what the old sequence would have got after x
    engine.pipeline = True
    for seed in range(50, 60):
        new = _sequence(v, 5, seed=seed)
        _, plain = restart(new, False)
        if plain[1] != out:
            break
    else:
        pytest.fail(f"{name}: no prompt whose next token differs from the old sequence's")
    before = engine.speculation["replaced"]
    assert restart(new, True) == (first, plain), name
    assert engine.speculation["replaced"] > before


def test_seeded_sampling_is_reproducible_in_any_batch(pair):
    name, _, engine, _ = pair
    v = engine.cfg.vocab_size
    hot = [SamplingParams(temperature=1.5, seed=s, top_p=0.9 if s % 2 else 1.0, top_k=s % 3) for s in range(3)]
    jobs = [(_sequence(v, 5 + 3 * i, seed=i), hot[i], 15) for i in range(3)] + [(_sequence(v, 4), GREEDY, 15)]
    alone = [_run_schedule(engine, [job], [0])[0] for job in jobs]
    together = _run_schedule(engine, jobs, [2, 0, 5, 1])
    assert together == alone, name
    assert len({tuple(t) for t in alone}) == 4


def test_the_executable_store_is_opt_in(tmp_path):
    """G5G_JAX_EXECUTABLE_STORE=1 turns the store on beside the persistent cache; unset, a boot traces as before
    (no GPU run has yet shown that deserialised executables run as the traced ones do)."""
    import jax

    from serving.jax_runtime import executables

    before = jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        assert executables.Store.beside_persistent_cache("cfg", env={}).root is None
        on = executables.Store.beside_persistent_cache("cfg", env={executables.OPT_IN: "1"})
        assert on.root == tmp_path / executables.EXECUTABLES_DIR
    finally:
        jax.config.update("jax_enable_compilation_cache", before[0])
        jax.config.update("jax_compilation_cache_dir", before[1])
