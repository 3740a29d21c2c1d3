"""GPU only (skipped without CUDA; flash-attn tests also without flash_attn): the flash_attn backend's step ==
dense attention (block size 256, GQA, a fully cached prompt's last token with slot -1), and on the engine,
triton and flash_attn == the torch backend on CUDA: token for token in float32 (triton), and in bfloat16
their prompt logits within bf16 rounding of torch's and their greedy tokens mostly the same."""

from __future__ import annotations

import pytest
import torch
from test_attention import SEQS, expected_outputs, heads_first_view, make_batch, triton_kernels  # noqa: F401

from nanoengine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
GQA = [(4, 2, 32), (9, 3, 64), (16, 8, 128)]


@pytest.fixture(scope="module")
def flash_attn():
    from nanoengine.attention import flash_attn_backend

    if flash_attn_backend.problem():
        pytest.skip(flash_attn_backend.problem())


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", GQA)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attn_step_equals_dense_attention(flash_attn, dtype, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_heads)
    seqs = SEQS + [(300, 256), (512, 511)]  # a chunk after a whole block; a fully cached 2-block prompt
    b = make_batch("flash_attn", seqs, num_heads, num_kv_heads, head_dim, 256, gen, num_blocks=16, dtype=dtype,
                   device="cuda")
    b.meta.plan = b.attn.plan(b.meta, b.attn.k_cache.shape)
    out = b.attn(b.q, b.k, b.v, b.meta)
    torch.testing.assert_close(out.cpu().double(), expected_outputs(b), atol=1e-2, rtol=1.6e-2)
    flat_k = heads_first_view("flash_attn", b.attn.k_cache).reshape(num_kv_heads, -1, head_dim)
    assert torch.equal(flat_k[:, torch.tensor(b.slots, device="cuda")].transpose(0, 1), b.k)


PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 12, "1, 2, 3,", "Once upon a time"]


def test_triton_on_cuda_equals_torch_token_for_token(triton_kernels):  # noqa: F811
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM("tiny-qwen3", device="cuda", dtype="float32", attention_backend=backend,
                  max_num_batched_tokens=64)  # chunked prefill
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, params, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_bf16_backends_agree_with_torch(backend, request):
    request.getfixturevalue("flash_attn" if backend == "flash_attn" else "triton_kernels")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for name in ("torch", backend):
        llm = LLM("smollm2-135m", device="cuda", dtype="bfloat16", attention_backend=name)
        ids = llm.tokenizer.encode(PROMPTS[1])
        runs[name] = (llm.engine.prompt_logits(ids).cpu(),
                      [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
    (want_logits, want), (got_logits, got) = runs["torch"], runs[backend]
    torch.testing.assert_close(got_logits, want_logits, atol=0.15, rtol=0.05)
    same = sum(g == w for g, w in zip(got, want))
    assert same >= len(PROMPTS) - 1, f"{backend}: {same} of {len(PROMPTS)} greedy continuations equal torch's"
