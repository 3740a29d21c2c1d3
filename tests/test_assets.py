"""The offline assets: the real Qwen3 tokenizer ids, transformers round trips, SmolLM2 knows Paris."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nanoengine import assets
from nanoengine.models.hf_config import rope_theta


@pytest.mark.parametrize("text,ids", list(assets.TOKENIZER_CHECKS.items()))
def test_qwen3_tokenizer_ids(qwen3_tokenizer_path, text, ids):
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_path)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode(ids) == text


def test_qwen3_special_tokens(qwen3_tokenizer_path):
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_path)
    ids = tok.convert_tokens_to_ids(assets.QWEN3_SPECIAL_TOKENS)
    assert ids == list(range(151643, 151669))
    assert tok.convert_tokens_to_ids("<think>") == 151667
    assert len(tok) == 151669
    # <think> survives skip_special_tokens (it is not "special" in Qwen3), <|im_end|> does not
    assert tok.decode([151667, 9707, 151645], skip_special_tokens=True) == "<think>Hello"


def test_qwen3_chat_template(qwen3_tokenizer_path):
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_think = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_byte_level_round_trip(qwen3_tokenizer_path):
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_path)
    text = "naïve café — 東京 🚀 tabs\tand\nnewlines  x²"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("name", ["tiny-qwen3", "smollm2-135m"])
def test_transformers_round_trip(name):
    path = assets.ensure(name)
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("Hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tiny_qwen3_shape(tiny_qwen3_path):
    cfg = json.loads((tiny_qwen3_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["vocab_size"] == 151936
    assert cfg["num_attention_heads"] % 2 == 0 and cfg["num_key_value_heads"] % 2 == 0


def test_tiny_qwen3_is_seeded(tiny_qwen3_path, tmp_path):
    """Rebuilding gives the same weights: the asset is reproducible."""
    from safetensors.torch import load_file

    a = load_file(tiny_qwen3_path / "model.safetensors")
    torch.manual_seed(0)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=assets.QWEN3_VOCAB_SIZE, bos_token_id=151643, eos_token_id=151645,
                      **assets.TINY_QWEN3_DIMS)
    b = Qwen3ForCausalLM(cfg).state_dict()
    for k, v in a.items():
        torch.testing.assert_close(v, b[k], msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_smollm2_knows_paris(smollm2_path):
    answer = assets.smollm2_answer(smollm2_path)
    assert "Paris" in answer, answer


def test_resolve_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local Hugging Face model folder"):
        assets.resolve_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        assets.resolve_model(tmp_path)
    with pytest.raises(KeyError, match="known assets"):
        assets.ensure("gpt-5")
    with pytest.raises(FileNotFoundError, match="a tokenizer, not a model"):
        assets.resolve_model("qwen3-tokenizer")


def test_local_checkpoint_path_is_accepted(tiny_qwen3_path):
    assert assets.resolve_model(str(tiny_qwen3_path)) == tiny_qwen3_path


def test_rope_theta_both_spellings():
    assert rope_theta(SimpleNamespace(rope_parameters={"rope_theta": 5e5, "rope_type": "default"})) == 5e5
    assert rope_theta(SimpleNamespace(rope_theta=1e4)) == 1e4
