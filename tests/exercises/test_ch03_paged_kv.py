"""Exercises of book/03_paged_kv.ipynb, checked against nanoengine's model runner, block manager and
torch attention backend on seeded random inputs."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from ex_helpers import assert_close, assert_equal, assert_same_list, book

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams

CHAPTER = "ch03_paged_kv"
pytestmark = pytest.mark.xdist_group("ex_ch03")
NB = "03_paged_kv.ipynb"


def engine_slots(block_table, start, end, block_size):
    """The slot mapping nanoengine's InputBuilder builds for one sequence computing [start, end)."""
    from nanoengine.engine.inputs import InputBuilder
    from nanoengine.engine.scheduler import ScheduledSeq

    seq = Sequence(list(range(end)), SamplingParams(), block_size)
    seq.block_table = list(block_table)
    seq.num_computed_tokens = start
    inp = InputBuilder(block_size).build([ScheduledSeq(seq, end - start, end - start > 1)])
    return inp.attn.slot_mapping.tolist()


def test_3_1_slot_mapping_matches_input_builder(ex):
    where = book(NB, "3.1")
    rng = random.Random(31)
    for block_size in (1, 4, 16):
        for _ in range(20):
            end = rng.randint(1, 100)
            start = rng.choice([0, end - 1, rng.randint(0, end - 1)])
            table = rng.sample(range(200), -(-end // block_size))
            want = engine_slots(table, start, end, block_size)
            got = ex.slot_mapping(table, start, end, block_size)
            assert_same_list(got, want, f"slots of positions {start}..{end - 1} with block_size={block_size} and "
                             f"block table {table}", where)


def test_3_2_new_blocks_needed_matches_block_manager(ex):
    where = book(NB, "3.2")
    rng = random.Random(32)
    cases = [(0, 16, 16), (0, 17, 16), (16, 1, 16), (15, 1, 16), (31, 2, 16), (5, 0, 4)]
    cases += [(rng.randint(0, 60), rng.randint(0, 40), rng.choice([1, 2, 4, 16])) for _ in range(100)]
    for computed, new, bs in cases:
        bm = BlockManager(128, bs)
        seq = Sequence(list(range(computed + new + 1)), SamplingParams(), bs)
        bm.allocate(seq, computed)  # the blocks it holds for its cached tokens
        seq.num_computed_tokens = computed
        held = len(seq.block_table)
        want = len(bm.allocate(seq, new))
        got = ex.new_blocks_needed(computed, new, held, bs)
        assert_equal(got, want, f"new blocks for {new} more tokens after {computed} cached, holding {held} blocks "
                     f"of {bs}", where)


def engine_permutation() -> list[int]:
    """How the torch backend orders a layer's cache dimensions, relative to the exercises' layout
    [num_blocks, block_size, KVH, D] (the backend may store heads first: see kv_cache_shape)."""
    from nanoengine.attention.torch_backend import TorchAttention

    shape_fn = getattr(TorchAttention, "kv_cache_shape", None)
    if shape_fn is None:
        return [0, 1, 2, 3]
    sizes = (2, 3, 5, 7)  # distinct sizes reveal the order
    return [sizes.index(n) for n in shape_fn(*sizes)]


def to_engine(cache: torch.Tensor) -> torch.Tensor:
    return cache.permute(*engine_permutation()).contiguous()


def from_engine(cache: torch.Tensor) -> torch.Tensor:
    perm = engine_permutation()
    return cache.permute(*[perm.index(i) for i in range(4)])


def test_3_3_store_kv_matches_engine_store(ex):
    from nanoengine.attention.torch_backend import store_kvcache

    where = book(NB, "3.3")
    gen = torch.Generator().manual_seed(33)
    for num_blocks, bs, kvh, d, T in [(8, 4, 2, 8, 10), (5, 16, 1, 4, 33), (20, 1, 3, 2, 7)]:
        k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
        v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
        k = torch.randn(T, kvh, d, generator=gen)
        v = torch.randn(T, kvh, d, generator=gen)
        slots = torch.randperm(num_blocks * bs, generator=gen)[:T]
        slots[torch.rand(T, generator=gen) < 0.2] = -1  # some tokens already cached: skip them
        want_k, want_v = to_engine(k_cache), to_engine(v_cache)
        store_kvcache(k, v, want_k, want_v, slots)
        want_k, want_v = from_engine(want_k), from_engine(want_v)
        ex.store_kv(k, v, k_cache, v_cache, slots)
        shape = f"cache [{num_blocks}, {bs}, {kvh}, {d}], {T} tokens, slots {slots.tolist()}"
        assert_close(k_cache, want_k, f"k_cache after the store ({shape})", where, atol=0, rtol=0)
        assert_close(v_cache, want_v, f"v_cache after the store ({shape})", where, atol=0, rtol=0)


def dense_decode(q, k, v, scale):
    """Reference: one query per sequence over contiguous K/V [n, KVH, D], in float64."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    probs = (torch.einsum("hd,nhd->hn", q.double(), k) * scale).softmax(-1)
    return torch.einsum("hn,nhd->hd", probs, v)


@pytest.mark.parametrize("block_size,heads,kv_heads", [(4, 4, 2), (16, 9, 3), (1, 2, 2)])
def test_3_4_paged_decode_attention_equals_dense(ex, block_size, heads, kv_heads):
    from nanoengine.attention.torch_backend import decode_attention

    where = book(NB, "3.4")
    gen = torch.Generator().manual_seed(34 + block_size)
    D, num_blocks, scale = 16, 160, 16 ** -0.5
    lens = [1, 5, 37, block_size * 3, 23]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, D, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, D, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [free[0]] * (width - len(t)) for t in tables])  # junk padding
    context_lens = torch.tensor(lens)
    q = torch.randn(len(lens), heads, D, generator=gen)
    got = ex.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    engine = decode_attention(q, to_engine(k_cache), to_engine(v_cache), block_tables, context_lens, scale)
    assert_close(got, engine, f"decode attention vs nanoengine (block_size={block_size}, lens {lens})", where,
                 atol=1e-5)
    for b, (n, table) in enumerate(zip(lens, tables)):
        k = torch.cat([k_cache[t] for t in table])[:n]  # the sequence's K, contiguous
        v = torch.cat([v_cache[t] for t in table])[:n]
        assert_close(got[b].double(), dense_decode(q[b], k, v, scale),
                     f"sequence {b} (length {n}, blocks {table}) vs dense attention", where, atol=1e-5)


def test_3_5_kv_bytes_per_token_matches_the_engine(ex):
    from transformers import LlamaConfig, Qwen3Config

    from nanoengine import assets
    from nanoengine.models.hf_config import kv_bytes_per_token

    where = book(NB, "3.5")
    configs = {
        "tiny-qwen3": Qwen3Config(**assets.TINY_QWEN3_DIMS),
        "Qwen3-0.6B": Qwen3Config(**assets.QWEN3_06B_DIMS),
        "SmolLM2-135M": LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                    num_hidden_layers=30, intermediate_size=1536),
        "no head_dim": SimpleNamespace(hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                                       num_hidden_layers=6),
        "head_dim None": SimpleNamespace(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                         num_hidden_layers=3, head_dim=None),
    }
    for name, config in configs.items():
        for dtype in (torch.float32, torch.bfloat16):
            want = kv_bytes_per_token(config, dtype.itemsize)  # what the model runner sizes its cache with
            got = ex.kv_bytes_per_token(config, dtype)
            assert_equal(got, want, f"KV bytes per token of {name} in {dtype}", where)
