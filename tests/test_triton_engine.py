"""The engine with attention_backend='triton' == the torch backend, token for token, on tiny-qwen3 (float32),
with the Triton kernels in Triton's interpreter on CPU (compiled on CUDA): chunked prefill and prefix hits
with decode steps replayed from graphs (CPU: their stand-in), as on CUDA;
nano-vllm's failure modes (a fully cached prompt of an exact multiple of the block size, whose last token
alone is recomputed; chunked prefill with preemption and prefix hits); greedy and seeded sampling. Each
test checks that the situation it is about really happened (hits, chunks, preemptions in StepStats)."""

from __future__ import annotations

import pytest
import torch
from test_attention import triton_kernels  # noqa: F401

from nanoengine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("triton_kernels")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=3, max_tokens=6, ignore_eos=True)
PREFIX = [5, 17, 300, 42] * 8  # 32 tokens: two whole blocks of 16


def run(backend: str, batches: list[list[list[int]]], params: SamplingParams | list,
        **options) -> tuple[list, dict]:
    """Generate each batch of prompts in turn on one engine: (token ids per prompt, StepStats totals).
    `params`: one SamplingParams for all, or one list per batch."""
    llm = LLM("tiny-qwen3", device=DEVICE, dtype="float32", attention_backend=backend, block_size=16,
              **options)
    assert llm.plan.attention_backend == backend
    tokens, totals = [], {"hits": 0, "preempted": 0, "max_prefill": 0, "cached_prompts": [],
                          "graphs": llm.plan.decode_mode.value}
    for i, prompts in enumerate(batches):
        outs = llm.generate(prompts, params[i] if isinstance(params, list) else params, use_tqdm=False)
        tokens += [o.outputs[0].token_ids for o in outs]
        totals["cached_prompts"] += [o.num_cached_tokens for o in outs]
        for s in llm.engine.stats:
            totals["hits"] += s.cache_hit_tokens
            totals["preempted"] += s.num_preempted
            totals["max_prefill"] = max(totals["max_prefill"], s.prefill_tokens)
    return tokens, totals


@pytest.mark.slow  # ~20 s in the interpreter
def test_triton_equals_torch_with_chunked_prefill_and_a_prefix_hit():
    """Greedy and seeded sampling side by side; the second batch hits the first one's cached prefix, and its
    72-token prompt is prefilled in chunks of 32. Decode steps replay graphs, as they do on CUDA (here the
    graphs' CPU stand-in: batches padded to a bucket with rows of slot -1 and context 0)."""
    prompts = [PREFIX + [9, 8, 7], [11, 12, 13, 14, 15], PREFIX + [1] * 40]
    batches = [prompts[:1], prompts]
    params = [[GREEDY], [SEEDED, GREEDY, SEEDED]]
    options = {"max_num_batched_tokens": 32, "max_num_seqs": 4, "max_model_len": 256}  # 3 small graph buckets
    want, stats = run("torch", batches, params, **options)
    got, graphed = run("triton", batches, params, graph_stand_in=DEVICE == "cpu", **options)
    assert stats["hits"] >= 64 and stats["max_prefill"] == 32 and graphed["graphs"] in ("stand_in", "cuda")
    assert got == want


def test_fully_cached_prompt_of_an_exact_block_multiple():
    """nano-vllm (flash-attn) crashed here: the prompt is 32 tokens, two whole blocks, all cached by an
    earlier request, so the step recomputes only its last token, whose K/V must not be written again."""
    batches = [[PREFIX], [PREFIX, PREFIX + [3]]]
    want, stats = run("torch", batches, GREEDY)
    got, _ = run("triton", batches, GREEDY)
    assert stats["cached_prompts"][1:] == [32, 32]  # both later prompts found both blocks cached
    assert got == want
    assert got[1] == got[0]  # the fully cached prompt continues exactly as the first time


@pytest.mark.slow  # ~20 s in the interpreter
def test_chunked_prefill_with_preemption_and_prefix_hits():
    """A pool too small for every sequence's growth (preemption by recompute, then readmission that hits the
    prefix cache), chunked prefill, and prompts sharing a prefix."""
    prompts = [PREFIX + [i, i + 1, i + 2] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    options = {"max_num_batched_tokens": 24, "num_kvcache_blocks": 6}
    want, stats = run("torch", [prompts], params, **options)
    got, _ = run("triton", [prompts], params, **options)
    assert stats["preempted"] > 0 and stats["hits"] > 64 and stats["max_prefill"] == 24
    assert got == want
