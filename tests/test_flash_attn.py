"""The flash_attn backend. On CPU: its plumbing (int32 lengths and tables, the paged layout, decode rows
first, cu_seqlens, the permuted store) against dense attention, with flash-attn's two functions replaced by
a plain-torch stand-in written from their documented semantics. GPU only (skipped without CUDA; the
flash-attn ones also without flash_attn): the real backend's step == dense attention (block size 256, GQA,
a fully cached prompt's last token with slot -1), and on the engine, triton and flash_attn == the torch
backend on CUDA: token for token in float32 (triton), and in bfloat16 their prompt logits within bf16
rounding of torch's and their greedy tokens mostly the same."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from test_attention import SEQS, expected_outputs, heads_first_view, make_batch, triton_kernels  # noqa: F401

from nanoengine import LLM, SamplingParams

GQA = [(4, 2, 32), (9, 3, 64), (16, 8, 128)]


def paged_keys(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """[num_blocks, block_size, kvh, d] cache -> one sequence's first `length` rows, heads first
    [kvh, length, d]."""
    block_size = cache.shape[1]
    return cache[table[: -(-length // block_size)].long()].flatten(0, 1)[:length].transpose(0, 1)


def stand_in_flash_attn() -> types.ModuleType:
    """flash_attn_varlen_func and flash_attn_with_kvcache as documented (paged K/V [num_blocks, page_size,
    kvh, d] through int32 block_table, int32 lengths, causal aligned to the bottom right when there are fewer
    queries than keys, page size a multiple of 256), computed with the torch backend's prefill attention."""
    from nanoengine.attention.torch_backend import prefill_attention

    def check(block_table, *lengths):
        assert block_table.dtype == torch.int32 and all(t.dtype == torch.int32 for t in lengths)

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
               causal=False, block_table=None):
        check(block_table, cu_seqlens_q, cu_seqlens_k)
        assert causal and k.shape[1] % 256 == 0 and q.shape[0] == int(cu_seqlens_q[-1])
        out = torch.empty_like(q)
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            klen = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
            assert qe - qs <= max_seqlen_q and klen <= max_seqlen_k
            out[qs:qe] = prefill_attention(q[qs:qe], paged_keys(k, block_table[i], klen),
                                           paged_keys(v, block_table[i], klen), softmax_scale)
        return out

    def with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None,
                     causal=False):
        check(block_table, cache_seqlens)
        assert q.dim() == 4 and q.shape[1] == 1 and k_cache.shape[1] % 256 == 0
        out = torch.empty_like(q)
        for b, n in enumerate(cache_seqlens.tolist()):
            out[b] = prefill_attention(q[b], paged_keys(k_cache, block_table[b], n),
                                       paged_keys(v_cache, block_table[b], n), softmax_scale)
        return out

    return types.SimpleNamespace(flash_attn_varlen_func=varlen, flash_attn_with_kvcache=with_kvcache)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", GQA[:2])
def test_flash_attn_plumbing_with_a_stand_in_for_flash_attn(num_heads, num_kv_heads, head_dim, monkeypatch,
                                                           triton_kernels):  # noqa: F811
    """CPU: what the backend hands flash-attn, checked through a stand-in of its two functions."""
    if torch.cuda.is_available():
        pytest.skip("on CUDA the real flash-attn is tested below")
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in_flash_attn())
    gen = torch.Generator().manual_seed(num_heads)
    seqs = SEQS + [(300, 256), (512, 511)]
    b = make_batch("flash_attn", seqs, num_heads, num_kv_heads, head_dim, 256, gen, num_blocks=16)
    b.meta.prepared = b.attn.prepare(b.meta, b.attn.k_cache.shape)
    out = b.attn(b.q, b.k, b.v, b.meta)
    torch.testing.assert_close(out.double(), expected_outputs(b), atol=1e-5, rtol=1e-5)
    flat_k = heads_first_view("flash_attn", b.attn.k_cache).reshape(num_kv_heads, -1, head_dim)
    assert torch.equal(flat_k[:, torch.tensor(b.slots)].transpose(0, 1), b.k)


@pytest.fixture(scope="module")
def flash_attn():
    from nanoengine.attention import flash_attn_backend

    if flash_attn_backend.problem():
        pytest.skip(flash_attn_backend.problem())


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", GQA)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attn_step_equals_dense_attention(flash_attn, dtype, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_heads)
    seqs = SEQS + [(300, 256), (512, 511)]  # a chunk after a whole block; a fully cached 2-block prompt
    b = make_batch("flash_attn", seqs, num_heads, num_kv_heads, head_dim, 256, gen, num_blocks=16,
                   dtype=dtype, device="cuda")
    b.meta.prepared = b.attn.prepare(b.meta, b.attn.k_cache.shape)
    out = b.attn(b.q, b.k, b.v, b.meta)
    torch.testing.assert_close(out.cpu().double(), expected_outputs(b), atol=1e-2, rtol=1.6e-2)
    flat_k = heads_first_view("flash_attn", b.attn.k_cache).reshape(num_kv_heads, -1, head_dim)
    assert torch.equal(flat_k[:, torch.tensor(b.slots, device="cuda")].transpose(0, 1), b.k)


PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 12, "1, 2, 3,", "Once upon a time"]


@pytest.mark.gpu
def test_triton_on_cuda_equals_torch_token_for_token(triton_kernels):  # noqa: F811
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM("tiny-qwen3", device="cuda", dtype="float32", attention_backend=backend,
                  max_num_batched_tokens=64)  # chunked prefill
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, params, use_tqdm=False)]
    assert outs["triton"] == outs["torch"]


@pytest.mark.gpu
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
