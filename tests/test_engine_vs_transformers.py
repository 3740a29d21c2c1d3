"""Greedy decoding through nanoengine == transformers `generate`, token for token, under every scheduling
and caching regime: default, prefix caching off, chunked prefill, preemption, block sizes 1/16/256.

The oracle is transformers' own greedy generate, one prompt at a time (no padding). Both run in float32 so
that ties cannot flip between two correct implementations.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanoengine import LLM, SamplingParams, assets

MAX_TOKENS = 12
SYSTEM = ("You are a careful assistant. Answer briefly and exactly. Facts matter more than style, and when "
          "you are unsure, say so instead of guessing. ")
PROMPTS = [
    "Hi",
    SYSTEM + "What is the capital of France?",
    SYSTEM + "Name three primary colors.",
    "The quick brown fox jumps over the lazy dog. " * 6,
    SYSTEM + "What is 2 + 2?",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):\n    ",
    SYSTEM * 2 + "Why is the sky blue?",
    "List the planets of the solar system in order from the sun:",
]

CONFIGS = {
    "default": {},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 24},
    "preemption": {"num_kvcache_blocks": 14, "block_size": 16},
    "block_size_1": {"block_size": 1},
    "block_size_16": {"block_size": 16},
    "block_size_256": {"block_size": 256},
}


@functools.cache
def reference(name: str) -> tuple[list[list[int]], list[list[int]]]:
    path = assets.ensure(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS may be emitted, it just does not stop
    prompts, outs = [], []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0)
        prompts.append(ids[0].tolist())
        outs.append(gen[0, ids.shape[1]:].tolist())
    return prompts, outs


def check(name: str, options: dict) -> tuple[LLM, list]:
    """Two rounds over the same prompts: the second one is served from the prefix cache (hit == miss)."""
    prompts, want = reference(name)
    llm = LLM(name, dtype="float32", trace=True, **options)
    traces = []
    for round in range(2):
        # the prompts go in as text (so tokenization is checked too); prompt ids must match transformers'
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        compare(name, options, round, outs, prompts, want)
        traces.append(llm.trace)
    return llm, traces


def compare(name, options, round, outs, prompts, want):
    for i, (o, p, w) in enumerate(zip(outs, prompts, want)):
        assert o.prompt_token_ids == p, f"prompt {i}: tokenization differs from transformers"
        got = o.outputs[0].token_ids
        if got != w:
            first = next(j for j, (a, b) in enumerate(zip(got, w)) if a != b)
            pytest.fail(f"{name} {options} round {round}: prompt {i} differs from transformers at output "
                        f"token {first}: got {got}, want {w}")


@pytest.mark.xdist_group("tiny")
@pytest.mark.parametrize("config", list(CONFIGS))
def test_tiny_qwen3_matches_transformers(config):
    llm, (trace, second) = check("tiny-qwen3", CONFIGS[config])
    if config == "preemption":
        assert any(s.preempted for s in trace.steps), "the tiny KV pool should have forced a preemption"
    if config == "chunked_prefill":
        assert max(s.num_batched_tokens for s in trace.steps) <= 24
        assert any(e.prefill_tokens and e.num_computed_before for s in trace.steps for e in s.scheduled)
    if config in ("default", "block_size_16", "block_size_1"):
        assert second.hit_tokens > 0.5 * second.prompt_tokens, "the second round should hit the prefix cache"
    if config == "no_prefix_cache":
        assert trace.hit_tokens == second.hit_tokens == 0


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
@pytest.mark.parametrize("config", list(CONFIGS))
def test_smollm2_matches_transformers(config):
    check("smollm2-135m", CONFIGS[config])


@pytest.mark.xdist_group("tiny")
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prompt_logits_match_transformers(backend, request):
    """LLMEngine.prompt_logits (one prefill through the engine's model and KV cache) == transformers'
    logits."""
    if backend == "cpu":
        request.getfixturevalue("cpu_kernels")
    path = assets.ensure("tiny-qwen3")
    llm = LLM("tiny-qwen3", dtype="float32", attention_backend=backend, num_kvcache_blocks=16)
    ids = llm.tokenizer.encode(PROMPTS[1])
    ours = llm.engine.prompt_logits(ids)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape == (len(ids), model.config.vocab_size)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)
    assert llm.engine.block_manager.num_free_blocks == 16, "prompt_logits must give its blocks back"
