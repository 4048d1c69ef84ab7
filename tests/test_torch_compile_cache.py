"""The PyTorch runtime's compiled decode step and its persistent cache (serving/torch_runtime/compile_cache.py, issue
49): a second process over the same G5G_TORCH_CACHE_DIR compiles nothing new, whatever its string hashing, and a
span that covers the whole cache does not recompile. On the CPU (G5G_TORCH_COMPILE=always: inductor's C++ backend),
at -O0 (TORCHINDUCTOR_DEBUG_COMPILE) so that the two cold compiles stay short; the GPU suite boots a server twice
(tests/test_gpu.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from serving.torch_runtime import compile_cache, precompiled  # noqa: E402
from serving.torch_runtime.engine import compile_from_env  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LAYER_TYPES = ("sliding_attention", "full_attention")

# One process: load on the CPU (8 slots, context 128), decode a lone sequence in slots 0 and 3 (rows 2, then 4: the
# one graph every row count shares), then a 70-token prompt in slot 1 (span 128, all of max_context: the span
# that recompiled mid-serving, attention.PAD); print the compiles.
CHILD = """
import json, os, sys
from serving.engine import SamplingParams
from serving.torch_runtime import load
eng = load(sys.argv[1], device="cpu", max_context=128, slots=8)
greedy = SamplingParams(temperature=0.0)
tokens = {}
for slot, prompt in ((0, [2, 105, 9]), (3, [2, 105, 9]), (1, [2] + [9] * 69)):
    tokens[slot] = eng.step({slot: eng.start(slot, prompt, greedy)})[slot]
print(json.dumps({"total": eng.compiles.total(), "dir": os.environ["TORCHINDUCTOR_CACHE_DIR"],
                  "set_order": list(set(eng.text_config.layer_types)), "tokens": tokens,
                  "precompiled": eng.precompiled and eng.precompiled.describe()}))
"""


@pytest.fixture(scope="module")
def two_layers(tiny_gemma4, tmp_path_factory) -> Path:
    """A text-only Gemma 4 of the fixture's shapes cut to one sliding and one full layer, random weights: both
    layer types (the hash-ordered loop has two entries) at a third of the fixture's compile time."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    raw = json.loads((tiny_gemma4 / "config.json").read_text())["text_config"]
    config = Gemma4TextConfig(**{**raw, "num_hidden_layers": 2, "num_kv_shared_layers": 0,
                                 "layer_types": list(LAYER_TYPES)})
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("two-layers")
    Gemma4ForCausalLM(config).save_pretrained(out)
    return out


def _boot(model: Path, cache: Path, hash_seed: str, **extra: str) -> dict:
    env = {**os.environ, "G5G_TORCH_COMPILE": "always", "G5G_TORCH_CACHE_DIR": str(cache), "PYTHONHASHSEED": hash_seed,
           "TORCHINDUCTOR_DEBUG_COMPILE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", CHILD, str(model)], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_over_the_same_cache_compiles_nothing_new(two_layers, tmp_path):
    """Hash seeds 1 and 2 iterate Gemma 4's layer types in opposite orders: the graphs must not follow them."""
    cold = _boot(two_layers, tmp_path / "cache", "1")
    warm = _boot(two_layers, tmp_path / "cache", "2")
    assert cold["set_order"] != warm["set_order"]                      # the two processes do hash differently
    assert cold["dir"] == warm["dir"] == str(tmp_path / "cache")
    # the cold process compiled one graph (every row count); the whole-cache span did not make a second
    assert cold["total"]["graphs"] == 1
    assert (cold["total"]["fx_miss"], cold["total"]["aot_miss"]) == (1, 1)
    # the warm one traced the same one and took its compiled graph from the cache
    w = warm["total"]
    assert w["graphs"] == 1 and (w["fx_hit"], w["aot_hit"]) == (1, 1)
    assert (w["fx_miss"], w["fx_bypass"], w["aot_miss"], w["aot_bypass"]) == (0, 0, 0, 0)
    assert warm["tokens"] == cold["tokens"]


def test_torch_writes_its_default_cache_dir_on_import_and_ours_still_wins(monkeypatch, tmp_path):
    """`import torch._dynamo` (transformers does it) sets TORCHINDUCTOR_CACHE_DIR to torch's default: that value is
    not a choice, so G5G_TORCH_CACHE_DIR applies; any other TORCHINDUCTOR_CACHE_DIR does win."""
    import torch._dynamo  # noqa: F401

    code = "import os, torch._dynamo; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))"
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    written = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=120).stdout.strip()
    assert written == compile_cache._torch_default()
    ours = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    assert compile_cache.inductor_env({"TORCHINDUCTOR_CACHE_DIR": written, "G5G_TORCH_CACHE_DIR": "/c"}) == \
        {"TORCHINDUCTOR_CACHE_DIR": "/c"}
    assert compile_cache.inductor_env({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "G5G_TORCH_CACHE_DIR": "/c"}) == {}
    assert compile_cache.inductor_env({"G5G_TORCH_CACHE_DIR": str(tmp_path)}) == ours


def test_layer_types_are_iterated_in_one_order():
    class Inner:
        unique_layer_types = set(LAYER_TYPES)

    class Model:
        model = Inner()

    m = Model()
    compile_cache.ordered_layer_types(m)
    assert m.model.unique_layer_types == tuple(sorted(LAYER_TYPES))


def test_the_loaded_model_iterates_an_ordered_tuple_where_transformers_has_a_set(tiny_gemma4, monkeypatch):
    """The attribute the fix replaces is still transformers' (a rename upstream would silently undo it)."""
    from transformers import AutoConfig, Gemma4ForCausalLM

    config = AutoConfig.from_pretrained(tiny_gemma4).text_config
    model = Gemma4ForCausalLM(config)
    assert isinstance(model.model.unique_layer_types, set) and set(model.model.unique_layer_types) == set(LAYER_TYPES)
    compile_cache.ordered_layer_types(model)
    assert model.model.unique_layer_types == ("full_attention", "sliding_attention")


@pytest.mark.parametrize("value, cuda, cpu", [(None, True, False), ("1", True, False), ("0", False, False),
                                               ("always", True, True)])
def test_compile_defaults_to_cuda_only_and_always_adds_the_cpu(value, cuda, cpu):
    env = {} if value is None else {"G5G_TORCH_COMPILE": value}
    assert (compile_from_env(env, "cuda"), compile_from_env(env, "cpu")) == (cuda, cpu)
    with pytest.raises(ValueError, match="G5G_TORCH_COMPILE"):
        compile_from_env({"G5G_TORCH_COMPILE": "cpu"}, "cpu")


def test_compiles_records_what_a_compile_moved(caplog):
    """Compiles logs and records a call that compiled a graph, and nothing for one that did not."""
    import logging

    log = logging.getLogger("test.compiles")
    seen = compile_cache.Compiles(log)
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")
    with caplog.at_level(logging.INFO, "test.compiles"):
        seen.around(lambda: fn(torch.ones(3)), "first")
        seen.around(lambda: fn(torch.ones(3)), "again")
    assert len(seen.records) == 1 and seen.total()["graphs"] == 1
    assert [r.message.split(":")[:2] for r in caplog.records] == [["compile", " first"]]


@pytest.mark.slow
def test_the_whole_compiled_step_is_kept_and_a_second_process_traces_nothing(two_layers, tmp_path):
    """G5G_TORCH_PRECOMPILED=1 (precompiled.py): the first process compiles the step ahead of time and writes it;
    the second loads it, dynamo compiling no graph, and decodes the same tokens over rows 2 and 4 and the whole-cache
    span; a file that cannot be loaded is compiled and written again."""
    on = {"G5G_TORCH_PRECOMPILED": "1"}
    cold = _boot(two_layers, tmp_path / "cache", "1", **on)
    [kept] = (tmp_path / "cache" / precompiled.DIR).glob("decode-*.pt2")
    assert cold["precompiled"].startswith(f"decode step compiled ahead of time, written to {kept}")
    warm = _boot(two_layers, tmp_path / "cache", "2", **on)
    assert warm["precompiled"].startswith(f"decode step loaded from {kept}")
    assert warm["total"]["graphs"] == 0 and warm["total"]["trace_s"] == 0
    assert warm["tokens"] == cold["tokens"]


class Toy(torch.nn.Module):
    """A model as DecodeStep sees one: called with keywords; transformers' compiled call is its own call here."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 2

    def get_compiled_call(self, _config):
        return self.__call__


@pytest.fixture()
def toy_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return lambda: precompiled.DecodeStep(Toy().eval(), tmp_path / precompiled.DIR / "decode-toy.pt2")


@pytest.mark.slow
def test_an_unloadable_file_is_compiled_and_written_again_and_refused_inputs_are_traced(toy_step, caplog):
    x = torch.ones(3, 4)
    with torch.inference_mode():
        first = toy_step()
        want = first(x=x)
        assert first.source.startswith("compiled ahead of time, written to") and first.path.is_file()
        loaded = toy_step()
        assert loaded.source.startswith("loaded from") and torch.equal(loaded(x=x), want)

        first.path.write_bytes(b"not a compiled function")
        again = toy_step()
        assert again.fn is None and "not loadable" in caplog.text
        assert torch.equal(again(x=x), want) and again.source.startswith("compiled ahead of time, written to")
        assert toy_step().source.startswith("loaded from")

        # an input the guards refuse (another shape): transformers' compiled call from then on, the same answer
        other = torch.ones(5, 4)
        assert torch.equal(loaded(x=other), Toy()(x=other))
        assert loaded.source.startswith("traced (refused this call's inputs") and loaded.traced is not None


def test_precompiled_is_opt_in_and_says_which_values_it_takes():
    assert precompiled.from_env({}) is False and precompiled.from_env({"G5G_TORCH_PRECOMPILED": "1"}) is True
    with pytest.raises(ValueError, match="G5G_TORCH_PRECOMPILED: 'yes' is not 0 or 1"):
        precompiled.from_env({"G5G_TORCH_PRECOMPILED": "yes"})


def test_the_kept_steps_name_covers_what_its_unchecked_guards_stand_for(two_layers, tmp_path):
    from transformers import Gemma4ForCausalLM

    model = Gemma4ForCausalLM.from_pretrained(two_layers)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "G5G_TORCH_SLOTS": "8"}
    base = precompiled.path_for(model, 8, 128, env)
    assert base.parent == tmp_path / precompiled.DIR
    # the slots, the context, a setting, the model's config: each its own file; the cache's place is not a setting
    others = {precompiled.path_for(model, 4, 128, env), precompiled.path_for(model, 8, 256, env),
              precompiled.path_for(model, 8, 128, {**env, "G5G_LM_HEAD": "int8"})}
    assert base not in others and len(others) == 3
    assert precompiled.path_for(model, 8, 128, {**env, "G5G_TORCH_CACHE_DIR": str(tmp_path)}) == base
    model.config.final_logit_softcapping = 31.0
    assert precompiled.path_for(model, 8, 128, env) != base
    # no persistent directory (G5G_TORCH_CACHE_DIR empty): nothing kept
    assert precompiled.path_for(model, 8, 128, {**env, "G5G_TORCH_CACHE_DIR": ""}) is None


def test_a_calls_dimension_marks_come_off_its_own_its_dicts_and_its_objects_tensors():
    class Cache:
        def __init__(self):
            self.pos = torch.zeros(2)

    kw = {"input_ids": torch.zeros(2, 1), "attention_mask": {"full": torch.zeros(2, 4)}, "past_key_values": Cache(),
          "use_cache": True}
    tensors = [kw["input_ids"], kw["attention_mask"]["full"], kw["past_key_values"].pos]
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)
        assert hasattr(t, "_has_dynamo_dim_marking")
    precompiled._unmark(kw)
    assert not any(hasattr(t, m) for t in tensors for m in precompiled._MARKS)
