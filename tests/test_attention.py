"""Paged attention (torch backend, the CPU backend's C++ decode kernel, the Triton backend's kernels under the
interpreter on CPU) == dense causal attention, for prefill with and without a cached prefix and for batched
decode, with ragged lengths and scattered blocks; and a step prepared once by the runner == each layer
preparing for itself. `make_batch` builds such a step; tests/test_triton_kernels.py reuses it."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import pytest
import torch

from nanoengine.attention import AttentionMetadata, get_backend

BACKENDS = ["torch", "cpu", "triton"]

# Without CUDA the Triton kernels run in Triton's interpreter, which triton switches on when a kernel is
# defined (at the first import of nanoengine's kernel modules): set here, at collection, before any test
# imports them. tests/test_triton_*.py import this module, so they get it too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def triton_kernels():
    """nanoengine's Triton kernels, compiled on CUDA or interpreted on CPU. Skipped where triton is not
    installed; on CI (whose dev extra installs it) that is a failure instead."""
    from nanoengine.kernels import triton_support

    if not triton_support.installed():
        if os.environ.get("CI"):
            pytest.fail("triton is not installed (the dev extra installs it)")
        pytest.skip("triton is not installed")
    from nanoengine.kernels import triton_store

    if not torch.cuda.is_available() and not triton_support.is_interpreted(triton_store.store_kv_kernel):
        pytest.fail("the Triton kernels were imported before TRITON_INTERPRET=1 was set")
    return triton_store


def dense_attention(q, k, v, scale):
    """Reference: full causal attention for one sequence, q/k/v over all its positions, GQA by repeat."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    n = q.shape[0]
    scores.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def make_layout(lens, block_size, num_blocks, gen):
    """Random, non-contiguous block tables for sequences of the given lengths."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in lens:
        nb = -(-n // block_size)
        tables.append([perm.pop() for _ in range(nb)])
    return tables


@dataclass
class Batch:
    """One step over a pre-filled paged cache: decodes first, then prefills, as InputBuilder lays them out."""
    attn: torch.nn.Module  # the backend's layer, its caches bound
    q: torch.Tensor  # [num_tokens, num_heads, head_dim] the new tokens
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor
    meta: AttentionMetadata
    seqs: list[tuple[int, int]]  # (total length, cached before this step), in batch order
    full: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # every position's q, k, v per sequence
    slots: list[int]


# (total length, tokens already cached before this step): decodes (new = 1), a fresh prefill,
# and prefills after a cached prefix (chunked prefill / prefix-cache hit)
SEQS = [(37, 36), (5, 4), (1, 0), (23, 0), (40, 17), (9, 8), (64, 32)]


def heads_first_view(backend: str, cache: torch.Tensor) -> torch.Tensor:
    """A layer's cache seen as [num_kv_heads, num_blocks, block_size, head_dim], whatever its layout."""
    return cache.permute(2, 0, 1, 3) if backend == "flash_attn" else cache


def make_batch(backend, seqs, num_heads, num_kv_heads, head_dim, block_size, gen, num_blocks=200,
               dtype=torch.float32, device="cpu"):
    """A Batch with the layer's caches, the new tokens and the metadata on `device` (the oracle's `full`
    stays on the CPU)."""
    decodes = [s for s in seqs if s[0] - s[1] == 1]
    order = decodes + [s for s in seqs if s[0] - s[1] > 1]
    tables = make_layout([n for n, _ in order], block_size, num_blocks, gen)
    attn = get_backend(backend)(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    attn.k_cache = torch.zeros(attn.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim),
                               dtype=dtype)
    attn.v_cache = torch.zeros_like(attn.k_cache)
    full = [tuple(torch.randn(n, h, head_dim, generator=gen).to(dtype)
                  for h in (num_heads, num_kv_heads, num_kv_heads))
            for n, _ in order]
    # pre-fill the cache with the cached prefixes (the reference writes slots by hand:
    # [kvh, block, offset, d], through a view for flash-attn's [block, offset, kvh, d] layout)
    kc, vc = (heads_first_view(backend, c) for c in (attn.k_cache, attn.v_cache))
    for (_n, cached), table, (_, k, v) in zip(order, tables, full):
        for p in range(cached):
            kc[:, table[p // block_size], p % block_size] = k[p]
            vc[:, table[p // block_size], p % block_size] = v[p]
    qs, ks, vs, slots = [], [], [], []
    starts, qlens, ctxs, ptables = [], [], [], []
    ntok = 0
    for (n, cached), table, (q, k, v) in zip(order, tables, full):
        if n - cached > 1:
            starts.append(ntok)
            qlens.append(n - cached)
            ctxs.append(n)
            ptables.append(torch.tensor(table))
        qs.append(q[cached:])
        ks.append(k[cached:])
        vs.append(v[cached:])
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, n)]
        ntok += n - cached
    width = max((len(t) for (n, c), t in zip(order, tables) if n - c == 1), default=1)
    dtables = torch.tensor([t + [0] * (width - len(t)) for (n, c), t in zip(order, tables) if n - c == 1])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_seqs=len(decodes), decode_block_tables=dtables,
        decode_context_lens=torch.tensor([n for n, _ in decodes]), prefill_query_starts=starts,
        prefill_query_lens=qlens, prefill_context_lens=ctxs, prefill_block_tables=ptables,
        block_size=block_size)
    attn.k_cache, attn.v_cache = attn.k_cache.to(device), attn.v_cache.to(device)
    meta = dataclasses.replace(
        meta, slot_mapping=meta.slot_mapping.to(device), decode_block_tables=dtables.to(device),
        decode_context_lens=meta.decode_context_lens.to(device),
        prefill_block_tables=[t.to(device) for t in ptables])
    return Batch(attn, torch.cat(qs).to(device), torch.cat(ks).to(device), torch.cat(vs).to(device),
                 meta, order, full, slots)


def expected_outputs(batch):
    """Dense fp64 attention of every sequence's new tokens: [num_tokens, num_heads, head_dim]."""
    scale = batch.attn.scale
    return torch.cat([dense_attention(q, k, v, scale)[cached:]
                      for (_, cached), (q, k, v) in zip(batch.seqs, batch.full)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (2, 2, 128), (6, 2, 32)])
@pytest.mark.parametrize("prepared", [True, False], ids=["prepared_once", "layer_prepares"])
def test_paged_equals_dense(backend, block_size, num_heads, num_kv_heads, head_dim, prepared,
                            request):
    if backend == "cpu":
        request.getfixturevalue("cpu_kernels")  # skips where the kernels cannot be built
    if backend == "triton":
        if not prepared:  # the interpreter is slow: only the variants that concern it
            pytest.skip("per-layer preparing is tested on torch")
        request.getfixturevalue("triton_kernels")  # the interpreter on CPU; skips without triton
    gen = torch.Generator().manual_seed(block_size * 100 + num_heads)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    b = make_batch(backend, SEQS, num_heads, num_kv_heads, head_dim, block_size, gen, device=device)
    if prepared:  # as the model runner does once per step; without it each layer prepares for itself
        b.meta.prepared = b.attn.prepare(b.meta, b.attn.k_cache.shape)
    out = b.attn(b.q, b.k, b.v, b.meta).cpu()
    assert out.shape == b.q.shape
    want = expected_outputs(b)
    offset = 0
    for n, cached in b.seqs:
        s = slice(offset, offset + n - cached)
        torch.testing.assert_close(out[s].double(), want[s], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, n=n, c=cached: f"sequence len {n} cached {c}: {m}")
        offset += n - cached
    # the new K/V landed in the cache at their slots
    flat_k = b.attn.k_cache.view(num_kv_heads, -1, head_dim)
    torch.testing.assert_close(flat_k[:, torch.tensor(b.slots, device=device)].transpose(0, 1), b.k)


def test_slot_minus_one_is_not_written():
    from nanoengine.attention.torch_backend import store_kvcache

    k_cache = torch.zeros(1, 2, 4, 2)  # [kvh, blocks, block_size, head_dim]
    v_cache = torch.zeros_like(k_cache)
    k = torch.ones(3, 1, 2)
    store_kvcache(k, k, k_cache, v_cache, torch.tensor([0, -1, 5]))
    assert k_cache.view(1, -1, 2)[0, [0, 5]].eq(1).all()
    assert k_cache.sum() == 4
