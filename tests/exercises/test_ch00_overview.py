"""Exercises of book/00_overview.ipynb, checked against transformers on a small random Qwen3."""

from __future__ import annotations

import pytest
import torch
from ex_helpers import assert_equal, assert_same_list, book

CHAPTER = "ch00_overview"
pytestmark = pytest.mark.xdist_group("ex_ch00")
NB = "00_overview.ipynb"


@pytest.fixture(scope="module")
def chaotic_model():
    """A 2-layer Qwen3 with large random weights (so greedy outputs vary) and a small vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.5, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def chaotic_qwen3_dir(tmp_path_factory):
    """The same kind of model with Qwen3's real vocabulary and tokenizer, saved as a folder nanoengine loads."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from nanoengine import assets

    tok_dir = assets.ensure("qwen3-tokenizer")
    config = Qwen3Config(vocab_size=assets.QWEN3_VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         max_position_embeddings=512, initializer_range=0.5, tie_word_embeddings=True,
                         bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("chaotic-qwen3")
    Qwen3ForCausalLM(config).eval().save_pretrained(out)
    for f in tok_dir.iterdir():
        if f.is_file() and not f.name.startswith("."):
            shutil.copy(f, out / f.name)
    return out


class CountingModel:
    """Wraps a transformers model and records how many tokens each call feeds it."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, input_ids=None, *args, **kwargs):
        self.calls.append(int(input_ids.shape[-1]))
        return self.model(input_ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_0_1_chat_answer_matches_transformers(ex, chaotic_qwen3_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nanoengine import LLM

    where = book(NB, "0.1")
    llm = LLM(str(chaotic_qwen3_dir), num_kvcache_blocks=32, max_model_len=256)
    tok = AutoTokenizer.from_pretrained(chaotic_qwen3_dir)
    model = AutoModelForCausalLM.from_pretrained(chaotic_qwen3_dir).eval()
    for question, max_tokens in [("What is the capital of France?", 7), ("Name a prime number.", 12)]:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
        want = tok.decode(out[0, len(ids):], skip_special_tokens=True)
        got = ex.chat_answer(llm, question, max_tokens=max_tokens)
        assert_equal(got, want, f"answer to {question!r} with max_tokens={max_tokens} (a user message through "
                     "llm.chat, temperature=0)", where)


@pytest.mark.parametrize("prompt_len,n", [(5, 10), (1, 4), (17, 1)])
def test_0_2_greedy_generate_matches_transformers(ex, chaotic_model, prompt_len, n):
    where = book(NB, "0.2")
    prompt = torch.randint(0, 512, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    want = hf_greedy(chaotic_model, prompt, n)
    counting = CountingModel(chaotic_model)
    got = ex.greedy_generate(counting, prompt, n)
    assert_same_list(got, want, f"generated ids for a {prompt_len}-token prompt", where)
    assert_same_list(counting.calls, [prompt_len + i for i in range(n)],
                     "tokens fed to the model per call (the whole sequence so far, each step)", where)


@pytest.mark.parametrize("prompt_len,n", [(5, 10), (1, 4), (17, 1)])
def test_0_3_greedy_generate_cached_matches_transformers(ex, chaotic_model, prompt_len, n):
    where = book(NB, "0.3")
    prompt = torch.randint(0, 512, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    want = hf_greedy(chaotic_model, prompt, n)
    counting = CountingModel(chaotic_model)
    got = ex.greedy_generate_cached(counting, prompt, n)
    assert_same_list(got, want, f"generated ids for a {prompt_len}-token prompt", where)
    assert_same_list(counting.calls, [prompt_len] + [1] * (n - 1),
                     "tokens fed to the model per call (prefill: the prompt once; decode: 1 token)", where)
