"""GPU runs of the same engine (skipped without CUDA): CUDA == CPU, token for token, on the torch backend."""

from __future__ import annotations

import pytest

from nanoengine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 4, "1, 2, 3,", "Once upon a time"]


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 16}, {"num_kvcache_blocks": 10}],
                         ids=["default", "chunked_prefill", "preemption"])
def test_cuda_matches_cpu(options):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM("tiny-qwen3", device="cpu", block_size=16, **options).generate(PROMPTS, params, use_tqdm=False)
    gpu = LLM("tiny-qwen3", device="cuda", block_size=16, **options).generate(PROMPTS, params, use_tqdm=False)
    for c, g in zip(cpu, gpu):
        assert c.outputs[0].token_ids == g.outputs[0].token_ids


def test_cuda_seeded_sampling_is_reproducible():
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    llm = LLM("tiny-qwen3", device="cuda")
    a = llm.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(PROMPTS, p, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
