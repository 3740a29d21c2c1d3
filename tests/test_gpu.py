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


def test_a_decode_step_makes_no_host_sync_from_schedule_to_graph_replay():
    """A step's inputs are written into pinned host buffers and copied with non_blocking=True on a side
    stream, a decode step that replays a CUDA graph reads nothing back, and with overlap its input ids come
    from the last step's tokens on the device: from the scheduler to the replay and the draw, launching a
    step never waits for the GPU (torch raises on any synchronizing call in sync-debug mode 'error')."""
    import torch

    from nanoengine.plan import DecodeMode

    llm = LLM("tiny-qwen3", device="cuda", max_num_seqs=8, num_kvcache_blocks=64, async_scheduling=True)
    if llm.plan.decode_mode is not DecodeMode.CUDA_GRAPHS:
        pytest.skip(f"decode steps run {llm.plan.decode_mode.value} here "
                    f"({llm.plan.attention_backend} attention)")
    eng = llm.engine
    for p in PROMPTS[:3]:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for _ in range(3):
        eng.step()  # the prompts (eagerly), then decode steps, one of them in flight
    runner = eng.executor.runner
    replays = sum(runner.graphs.replays.values())
    assert replays >= 1 and eng.in_flight is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # step N+1, its ids read from step N's tokens on the device
        launched = eng.launch(eng.scheduler.schedule())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum(runner.graphs.replays.values()) == replays + 1
    eng.finish(eng.in_flight)  # step N, then N+1, in order
    eng.finish(launched)
    eng.loop.in_flight = None  # (finished by hand above)
    while eng.has_unfinished():
        eng.step()


def test_overlap_on_cuda_equals_off():
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[13]),
              SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=8, ignore_eos=True)]
    options = dict(device="cuda", dtype="float32", num_kvcache_blocks=12, block_size=16,
                   max_num_batched_tokens=32)
    want = LLM("tiny-qwen3", async_scheduling=False, **options).generate(PROMPTS, params, use_tqdm=False)
    got = LLM("tiny-qwen3", async_scheduling=True, **options).generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert [c.token_ids for c in w.outputs] == [c.token_ids for c in g.outputs]


def test_cuda_logprobs_equal_cpu():
    """Logprobs on CUDA (reduced on the device, copied to pinned memory behind the step's event, with overlap
    on) == CPU's: generated and prompt, within 1e-3 (different kernels, float32)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    options = dict(dtype="float32", block_size=16, max_num_batched_tokens=32)
    cpu = LLM("tiny-qwen3", device="cpu", **options).generate(PROMPTS, params, use_tqdm=False)
    gpu = LLM("tiny-qwen3", device="cuda", async_scheduling=True, **options).generate(PROMPTS, params,
                                                                                      use_tqdm=False)
    for c, g in zip(cpu, gpu):
        assert c.outputs[0].token_ids == g.outputs[0].token_ids
        pairs = list(zip(c.prompt_logprobs[1:], g.prompt_logprobs[1:])) + list(
            zip(c.outputs[0].logprobs, g.outputs[0].logprobs))
        for a, b in pairs:
            token = next(iter(a))
            assert next(iter(b)) == token and abs(a[token].logprob - b[token].logprob) < 1e-3
