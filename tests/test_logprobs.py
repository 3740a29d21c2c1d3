"""Logprobs (SamplingParams.logprobs / prompt_logprobs, vLLM's semantics) against transformers' log_softmax,
under every regime a step can run in: chunked prefill, prefix-cache hits, preemption, overlap, speculation,
n > 1, and batches mixing requests that ask and requests that do not. The oracle is transformers' float32
forward over the prompt and the tokens the engine produced; values agree within 1e-4, ranks within the ties
that 1e-4 allows."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoengine import LLM, SamplingParams, assets
from nanoengine.errors import InvalidValueError

pytestmark = pytest.mark.xdist_group("logprobs")
TOL = 1e-4
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello there, how are you today?",
           "def fibonacci(n):\n    return"]


@functools.cache
def hf_model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(assets.ensure("tiny-qwen3"), dtype=torch.float32).eval()


def reference(ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits [len(ids), vocab] at every position (predicting the next)."""
    with torch.no_grad():
        return torch.log_softmax(hf_model()(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_position(entry: dict, token: int, ref: torch.Tensor, k: int) -> None:
    """One position's entry against its reference row [vocab]: the token's logprob and rank, and the top k."""
    assert next(iter(entry)) == token, "the position's own token comes first"
    own = entry[token]
    assert abs(own.logprob - ref[token].item()) < TOL
    lo = int((ref > ref[token] + TOL).sum()) + 1
    hi = int((ref >= ref[token] - TOL).sum())
    assert lo <= own.rank <= hi, f"rank {own.rank}, expected within [{lo}, {hi}]"
    top = ref.topk(k)
    others = {t: lp for t, lp in entry.items() if t != token or lp.rank <= k}
    assert len(entry) in (k, k + 1) and len(others) >= k - 1
    for t, lp in list(entry.items())[1:]:
        assert abs(lp.logprob - ref[t].item()) < TOL
        assert lp.logprob >= top.values[-1].item() - TOL, "a top-k entry is among the k most likely"
        assert lp.decoded_token is not None


def check_output(out, k: int | None, prompt_k: int | None) -> None:
    """Every logprob of a RequestOutput against transformers over its prompt + its first completion."""
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    ref = reference(ids)
    num_prompt = len(out.prompt_token_ids)
    if prompt_k is None:
        assert out.prompt_logprobs is None
    else:
        assert len(out.prompt_logprobs) == num_prompt and out.prompt_logprobs[0] is None
        for i in range(1, num_prompt):
            check_position(out.prompt_logprobs[i], ids[i], ref[i - 1], prompt_k)
    if k is None:
        assert comp.logprobs is None and comp.cumulative_logprob is None
    else:
        assert len(comp.logprobs) == len(comp.token_ids)
        for j, entry in enumerate(comp.logprobs):
            check_position(entry, ids[num_prompt + j], ref[num_prompt + j - 1], k)
        own = [e[t].logprob for e, t in zip(comp.logprobs, comp.token_ids)]
        assert math.isclose(comp.cumulative_logprob, sum(own), abs_tol=1e-3)


GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)

REGIMES = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_kvcache_blocks": 6, "block_size": 8},
    "overlap": {"async_scheduling": True},
    "speculation": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_logprobs_equal_transformers(tiny_qwen3_path, regime):
    llm = LLM(tiny_qwen3_path, dtype="float32", **REGIMES[regime])
    params = [SamplingParams(**GREEDY, logprobs=3, prompt_logprobs=2), SamplingParams(**GREEDY),
              SamplingParams(**GREEDY, logprobs=0)]
    outs = llm.generate(PROMPTS, params)
    check_output(outs[0], 3, 2)
    check_output(outs[1], None, None)  # a request that asked for nothing, batched with ones that did
    check_output(outs[2], 0, None)
    if regime == "preemption":
        assert sum(s.num_preempted for s in llm.engine.stats) > 0, "the pool was meant to be too small"
    if regime == "speculation":
        assert llm.engine.spec_counts.accepted > 0, "some drafts were meant to be kept"
    if regime == "overlap":
        assert llm.engine.plan.async_scheduling
    alone = LLM(tiny_qwen3_path, dtype="float32").generate(PROMPTS[1], SamplingParams(**GREEDY))
    assert outs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_prompt_logprobs_after_a_prefix_cache_hit(tiny_qwen3_path):
    """A prompt whose blocks are cached still gets every prompt logprob: the request computes its prompt."""
    llm = LLM(tiny_qwen3_path, dtype="float32", block_size=4)
    llm.generate(PROMPTS[0], SamplingParams(**GREEDY))  # its blocks are in the cache now
    again = llm.generate(PROMPTS[0], SamplingParams(**GREEDY))[0]
    assert again.num_cached_tokens > 0
    out = llm.generate(PROMPTS[0], SamplingParams(**GREEDY, prompt_logprobs=1, n=2))[0]
    assert out.num_cached_tokens == 0
    check_output(out, None, 1)


def test_processed_logprobs_are_the_drawn_distribution(tiny_qwen3_path):
    """logprobs_mode="processed_logprobs": log_softmax after temperature and top-k (the rest is -inf)."""
    llm = LLM(tiny_qwen3_path, dtype="float32", logprobs_mode="processed_logprobs")
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.7, top_k=5, max_tokens=4, seed=1, logprobs=6,
                                                  ignore_eos=True))[0]
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    with torch.no_grad():
        logits = hf_model()(torch.tensor([ids])).logits[0].float() / 0.7
    num_prompt = len(out.prompt_token_ids)
    for j, entry in enumerate(comp.logprobs):
        row = logits[num_prompt + j - 1]
        kept = row.topk(5)
        ref = torch.full_like(row, -math.inf).scatter(0, kept.indices, torch.log_softmax(kept.values, 0))
        token = comp.token_ids[j]
        assert abs(entry[token].logprob - ref[token].item()) < TOL
        sixth = [lp.logprob for t, lp in entry.items() if lp.rank == 6]
        assert sixth == [-math.inf], "the filtered-out tokens have logprob -inf"


def test_logprobs_follow_a_stop_string(tiny_qwen3_path):
    """Tokens a stop string drops take their logprobs with them."""
    llm = LLM(tiny_qwen3_path, dtype="float32")
    free = llm.generate(PROMPTS[2], SamplingParams(**GREEDY))[0].outputs[0]
    stop = free.text[len(free.text) // 2:][:2]
    if not stop.strip():
        pytest.skip("the greedy text has no usable stop string")
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=6, logprobs=1, stop=stop))[0]
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and len(comp.logprobs) == len(comp.token_ids)


def test_more_logprobs_than_max_logprobs_is_refused(tiny_qwen3_path):
    llm = LLM(tiny_qwen3_path, max_logprobs=4)
    with pytest.raises(InvalidValueError, match=r"logprobs=5 is more than this engine's max_logprobs=4"):
        llm.generate("Hi", SamplingParams(logprobs=5))
    with pytest.raises(InvalidValueError, match=r"prompt_logprobs=9 .*max_logprobs"):
        llm.generate("Hi", SamplingParams(prompt_logprobs=9))
