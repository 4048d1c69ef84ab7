"""A tiny Gemma 4 checkpoint, generated and trained here (no downloads), in the real multimodal layout.

What it has in common with google/gemma-4-E2B-it, so code that serves it serves the real thing:
- `Gemma4ForConditionalGeneration` config (text_config + vision_config + audio_config), safetensors weights
  under `model.language_model.*` (plus small vision/audio towers a text server must skip), bfloat16 on disk;
- sliding and full attention layers with different head dims (32 / 64), partial rotary (0.25) on full layers,
  one KV head, KV-shared trailing layers with double-wide MLPs, per-layer embeddings (PLE), tied embeddings,
  final logit softcapping, a sliding window short enough that the answer crosses it;
- a BPE tokenizer with byte fallback and Gemma 4's control tokens at Gemma's ids (<pad> 0, <eos> 1, <bos> 2,
  <|turn> 105, <turn|> 106; thinking <|think|>/<|channel>/<channel|>), a Gemma 4 style chat template, and a
  generation_config.json whose eos ids are [1, 106].

It is trained for a few seconds (fixed seed) until greedy decoding of the chat-formatted QUESTION yields ANSWER
followed by <turn|>, and the saved checkpoint is checked with transformers' own `generate` before it is cached.

    python -m devtools.tiny_gemma4 OUTDIR      # build into OUTDIR (used by e2e/CI without pytest)
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

QUESTION = "What does SRE stand for?"
# The field report's answer (seed 000), verbatim.
ANSWER = ("Site Reliability Engineering SRE is a discipline that applies software engineering principles to "
          "infrastructure and operations problems to create highly reliable, scalable, and efficient systems.")

# Everything that determines the checkpoint. Change anything here and the cache key changes.
PARAMS = {
    "version": 3,
    "seed": 1234,
    "vocab_size": 512,
    "text": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention", "sliding_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "global_head_dim": 64,
        "sliding_window": 16,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 16,
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 256,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
    },
    "vision": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
               "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
               "position_embedding_size": 64},
    "audio": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "subsampling_conv_channels": [8, 4], "output_proj_dims": 32},
    "train": {"lr": 3e-3, "max_steps": 600, "check_every": 10, "min_margin": 3.0},
    "dtype": "bfloat16",
}

# Gemma 4's control tokens. Ids 0-4 and 105/106 are Gemma's; the rest of 5..104 is filled with <unusedN>.
_LOW_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
_CONTROL = ["<|think|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
            "<|tool_response>", "<tool_response|>", '<|"|>', "<|image>", "<image|>", "<|image|>",
            "<|audio>", "<audio|>", "<|audio|>", "<|video|>"]
TURN_START, TURN_END = "<|turn>", "<turn|>"

# Gemma 4 style: <bos><|turn>role\n…<turn|>\n, the assistant's role is "model"; thinking is switched on by
# <|think|> in the system turn and the model's thoughts come back inside <|channel>…<channel|>.
# Tools as Gemma 4 writes them: declarations <|tool>declaration:NAME{…}<tool|> in the system turn, a call
# <|tool_call>call:NAME{key:value,…}<tool_call|> in the model's turn, an answer <|tool_response>response:NAME{…}
# <tool_response|> in a tool turn; values in Gemma's argument syntax (`arg`: strings quoted with <|"|>, bare keys).
CHAT_TEMPLATE = (
    "{%- macro arg(v) -%}"
    "{%- if v is string -%}{{ '<|\"|>' + v + '<|\"|>' }}"
    "{%- elif v is boolean -%}{{ 'true' if v else 'false' }}"
    "{%- elif v is none -%}null"
    "{%- elif v is mapping -%}{{ '{' }}{%- for k, x in v.items() -%}{{ k }}:{{ arg(x) }}{{ ',' if not loop.last }}{%- endfor -%}{{ '}' }}"
    "{%- elif v is sequence -%}[{%- for x in v -%}{{ arg(x) }}{{ ',' if not loop.last }}{%- endfor -%}]"
    "{%- else -%}{{ v }}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- set system_first = messages | length > 0 and messages[0]['role'] == 'system' -%}"
    "{%- if (enable_thinking is defined and enable_thinking or tools) and not system_first -%}"
    "{{ '<|turn>system\\n' }}{%- if enable_thinking is defined and enable_thinking -%}{{ '<|think|>' }}{%- endif -%}"
    "{%- for t in tools or [] -%}{{ '<|tool>declaration:' + t['function']['name'] + arg(t['function']) + '<tool|>' }}{%- endfor -%}"
    "{{ '<turn|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'model', 'tool'] -%}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- elif message['content'] is none -%}{%- set content = '' -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{{ '<|turn>' + role + '\\n' }}"
    "{%- if role == 'system' and enable_thinking is defined and enable_thinking -%}{{ '<|think|>' }}{%- endif -%}"
    "{%- if role == 'system' -%}{%- for t in tools or [] -%}{{ '<|tool>declaration:' + t['function']['name'] + arg(t['function']) + '<tool|>' }}{%- endfor -%}{%- endif -%}"
    "{%- if role == 'tool' -%}{{ '<|tool_response>response:' + message['name'] + arg({'value': content}) + '<tool_response|>' }}"
    "{%- else -%}{{ content | trim }}{%- endif -%}"
    "{%- for c in message['tool_calls'] or [] -%}{{ '<|tool_call>call:' + c['function']['name'] + arg(c['function']['arguments']) + '<tool_call|>' }}{%- endfor -%}"
    "{{ '<turn|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)

# Text the BPE merges are learned from: the answer plus a little general English, so other prompts tokenise too.
_CORPUS = [
    QUESTION, ANSWER,
    "Site reliability engineers run production systems. They measure latency, errors and saturation.",
    "Hello! How are you today? I am fine, thank you. Tell me a short story about a robot.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "What is the capital of France? Paris is the capital of France.",
    "Count from one to ten: one two three four five six seven eight nine ten.",
    "Graphics cards, tensors, tokens per second, time to first token, kernels and memory.",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE_ROOT = REPO_ROOT / ".cache" / "tiny-gemma4"


def cache_key() -> str:
    import transformers
    blob = json.dumps({"params": PARAMS, "q": QUESTION, "a": ANSWER, "template": CHAT_TEMPLATE,
                       "corpus": _CORPUS, "transformers": transformers.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------- tokenizer
def _special_tokens() -> list[str]:
    fill = 105 - len(_LOW_SPECIALS) - len(_CONTROL)
    return _LOW_SPECIALS + _CONTROL + [f"<unused{i}>" for i in range(fill)] + [TURN_START, TURN_END]


def build_tokenizer(out: Path) -> None:
    """Train a Gemma-style BPE (byte fallback, '▁' for spaces) and save it with transformers' GemmaTokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import GemmaTokenizer

    specials = _special_tokens()
    assert specials.index(TURN_END) == 106
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    n_learned = PARAMS["vocab_size"] - len(specials) - len(byte_tokens)

    def pipeline(tok: Tokenizer) -> Tokenizer:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(pattern="▁", behavior="merged_with_next")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        return tok

    trainer_tok = pipeline(Tokenizer(BPE(unk_token="<unk>")))
    trainer_tok.train_from_iterator(_CORPUS, BpeTrainer(vocab_size=n_learned, show_progress=False))
    learned = json.loads(trainer_tok.to_str())["model"]
    vocab: dict[str, int] = {}
    for t in specials + byte_tokens + sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(t, len(vocab))
    assert len(vocab) <= PARAMS["vocab_size"], len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]

    tok = pipeline(Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    hf = GemmaTokenizer(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                        unk_token="<unk>", mask_token="<mask>", add_bos_token=False, add_eos_token=False)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out)


# ------------------------------------------------------------------------------------------------------- model
def build_config(tokenizer):
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    t = dict(PARAMS["text"])
    ids = tokenizer.convert_tokens_to_ids
    text = Gemma4TextConfig(
        vocab_size=PARAMS["vocab_size"], vocab_size_per_layer_input=PARAMS["vocab_size"],
        pad_token_id=0, eos_token_id=[1, 106], bos_token_id=2, tie_word_embeddings=True, **t)
    return Gemma4Config(
        text_config=text, vision_config=Gemma4VisionConfig(**PARAMS["vision"]),
        audio_config=Gemma4AudioConfig(**PARAMS["audio"]),
        boi_token_id=ids("<|image>"), eoi_token_id=ids("<image|>"), image_token_id=ids("<|image|>"),
        video_token_id=ids("<|video|>"), boa_token_id=ids("<|audio>"), eoa_token_index=ids("<audio|>"),
        audio_token_id=ids("<|audio|>"), tie_word_embeddings=True)


def _prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=[1, 106], pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def train(out: Path, log=print) -> None:
    import torch
    from transformers import AutoTokenizer, Gemma4ForConditionalGeneration, GenerationConfig

    build_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = _prompt_ids(tokenizer)
    target = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(TURN_END)]

    torch.manual_seed(PARAMS["seed"])
    config = build_config(tokenizer)
    config.text_config._attn_implementation = "eager"
    model = Gemma4ForConditionalGeneration(config).float()
    model.config._attn_implementation = "eager"
    # One thread: the tiny matmuls gain nothing from more, and on a busy machine extra threads cost 10x.
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        _train_loop(model, prompt, target, log)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    model.to(getattr(torch, PARAMS["dtype"]))
    model.config.dtype = PARAMS["dtype"]
    model.save_pretrained(out, safe_serialization=True)
    _write_config_as_released(out)
    GenerationConfig(bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0, do_sample=False).save_pretrained(out)
    verify(out)


def _train_loop(model, prompt: list[int], target: list[int], log) -> None:
    import torch
    seq = torch.tensor([prompt + target])
    labels = torch.tensor([[-100] * len(prompt) + target])
    # Only the text path is trained; the towers keep their (random) init, as a text server never runs them.
    params = [p for n, p in model.named_parameters() if "language_model" in n]
    opt = torch.optim.AdamW(params, lr=PARAMS["train"]["lr"], weight_decay=0.0)
    tp = PARAMS["train"]
    t0 = time.monotonic()
    for step in range(1, tp["max_steps"] + 1):
        model.train()
        loss = model(input_ids=seq, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % tp["check_every"] == 0:
            # Teacher-forced argmax over the answer == greedy decoding, at the cost of one forward pass.
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1]
            top2 = logits.topk(2, dim=-1)
            ok = bool((top2.indices[:, 0] == torch.tensor(target)).all())
            margin = float((top2.values[:, 0] - top2.values[:, 1]).min())
            log(f"tiny-gemma4: step {step} loss {loss.item():.4f} greedy-ok={ok} margin {margin:.2f} "
                f"({time.monotonic() - t0:.1f}s)")
            # A margin that survives bfloat16 weights on disk and float16 on a GPU.
            if ok and margin > tp["min_margin"]:
                break
    else:
        raise RuntimeError(f"tiny-gemma4: training did not converge in {tp['max_steps']} steps")


def _write_config_as_released(out: Path) -> None:
    """transformers serialises the per-layer head dims as `per_layer_config`; the released checkpoints carry
    `global_head_dim` instead (what vLLM and our JAX port read). Write it the way the real config.json is."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    text = config["text_config"]
    text.pop("per_layer_config", None)
    text["global_head_dim"] = PARAMS["text"]["global_head_dim"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def verify(path: Path) -> None:
    """Reload the checkpoint from disk with transformers and check the greedy answer, token for token."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    layers = model.model.language_model.layers
    head_dims = [layer.self_attn.head_dim for layer in layers]
    want = [PARAMS["text"]["global_head_dim"] if t == "full_attention" else PARAMS["text"]["head_dim"]
            for t in PARAMS["text"]["layer_types"]]
    if head_dims != want:
        raise RuntimeError(f"tiny-gemma4 at {path}: config.json gives head dims {head_dims}, expected {want}")
    prompt = _prompt_ids(tokenizer)
    got = _greedy(model, prompt, len(tokenizer.encode(ANSWER, add_special_tokens=False)) + 8)
    text = tokenizer.decode(got, skip_special_tokens=True)
    if text != ANSWER or got[-1] != 106:
        raise RuntimeError(f"tiny-gemma4 at {path}: greedy answer {text!r} (last id {got[-1]}) is not the fixed ANSWER")


# ------------------------------------------------------------------------------------------------------- cache
@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(out: Path, log=print) -> Path:
    """Write the checkpoint into `out` (created; must not exist or be empty)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise SystemExit(f"{out}: not empty")
    train(out, log)
    (out / "tiny_gemma4.json").write_text(json.dumps({"key": cache_key(), "question": QUESTION,
                                                      "answer": ANSWER}, indent=1) + "\n")
    return out


def cached(log=print) -> Path:
    """The checkpoint for the current PARAMS, built once per key under <repo>/.cache/tiny-gemma4/."""
    final = CACHE_ROOT / cache_key()
    with _locked(CACHE_ROOT / ".lock"):
        if (final / "tiny_gemma4.json").exists():
            return _readable(final)
        tmp = Path(tempfile.mkdtemp(prefix="build-", dir=CACHE_ROOT))
        try:
            build(tmp, log)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _readable(final)


def _readable(path: Path) -> Path:
    """Built in a private temporary directory (0700, files 0600); the images' unprivileged user must read it when
    mounted, as it reads a downloaded model."""
    path.chmod(0o755)
    for f in path.iterdir():
        f.chmod(0o644)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m devtools.tiny_gemma4 OUTDIR")
    dest = Path(sys.argv[1])
    if dest.exists() and any(dest.iterdir()):
        raise SystemExit(f"{dest}: not empty")
    shutil.copytree(cached(), dest, dirs_exist_ok=True)
    print(dest)
