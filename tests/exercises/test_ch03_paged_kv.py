"""Exercises of chapter 03 (book/03a_paged_blocks.ipynb .. 03d_triton_kernel.ipynb), checked against
nanoengine's InputBuilder (on every step of the real Scheduler over seeded workloads of what chapter 03
teaches: decodes and whole prompts, no prefix cache and a budget that never chunks) and torch attention
backend (on seeded random caches). A wrong answer is
also compared with the classic mistakes (writing slots a prefix-cache block holds, `repeat` for GQA, a causal
mask not shifted by the cached prefix, ...), so the message can say which one it looks like; each test also
checks that its own checker names them. Exercises 3.6 (online softmax over blocks, torch) and 3.8 (the same as a
Triton kernel, in Triton's interpreter without a GPU) are checked against dense attention in float64 over ragged
context lengths, GQA groups, padding rows and -1 padded block tables, with the online softmax's classic
mistakes (no max subtraction, no rescaling, the last block's length, the GQA group) planted and named; 3.8 also
must write only its own query heads (padding rows masked when BLOCK_G > GROUP). Exercise 3.7 (a masked row
softmax, the warm-up kernel) is checked against torch.softmax in float64 on rows shorter than their tile.
Without triton, 3.7 and 3.8 skip with a one-line reason (the engine then decodes with the learner's 3.6)."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from ex_helpers import assert_close, assert_detects, assert_equal, book, explained, same_answer

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.inputs import InputBuilder
from nanoengine.engine.scheduler import Scheduler
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams

CHAPTER = "ch03_paged_kv"
pytestmark = pytest.mark.xdist_group("ex_ch03")
NB = "03a_paged_blocks.ipynb"  # (a message names the part that sets its exercise: ex_helpers.book)


# ------------------------------------------------------------------------------------------ batches
@functools.cache
def engine_batches() -> tuple:
    """Every step's batch of the engine's Scheduler on seeded workloads of what chapter 03 teaches: decodes
    and whole prompts (one-token prompts among them), in mixed batches, with preemption when the pool runs
    out; no prefix cache (chapter 04) and a budget no step reaches, so no prompt is chunked (chapter 05).
    Frozen as (batch, block size, the InputBuilder's layout); a batch is a list of ScheduledSeq over copies
    of the sequences at that step."""
    import copy

    batches = []
    for seed, bs, num_blocks in [(31, 4, 22), (32, 8, 12), (33, 1, 80)]:
        rng = random.Random(seed)
        sched = Scheduler(BlockManager(num_blocks, bs, enable_prefix_caching=False), set(),
                          max_num_batched_tokens=4096, max_num_seqs=6, max_model_len=256)
        prefixes = [[rng.randrange(10, 1000) for _ in range(rng.randint(bs, 4 * bs))] for _ in range(2)]
        seen: list[list[int]] = []
        for _ in range(40):
            if rng.random() < 0.35 or not sched.has_unfinished():
                for _ in range(rng.randint(1, 3)):
                    if seen and rng.random() < 0.3:
                        ids = list(rng.choice(seen))  # a repeat: a whole-block prompt hits up to its last token
                    else:
                        ids = (list(rng.choice(prefixes)) if rng.random() < 0.6 else []) + \
                              [rng.randrange(10, 1000) for _ in range(rng.randint(1, 3 * bs))]
                        if rng.random() < 0.4:
                            ids = ids[: max(bs, len(ids) // bs * bs)]
                        if rng.random() < 0.1:
                            ids = ids[:1]  # a one-token prompt: one new token, laid out as a decode
                        seen.append(ids)
                    sched.add(Sequence(ids, SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True), bs))
            out = sched.schedule()
            if out.scheduled:
                prefills = [s for s in out.scheduled if s.is_prefill]
                whole = all(s.start == 0 and s.seq.num_cached_tokens == 0 for s in prefills)
                assert whole, "test bug: a chapter 03 workload should admit whole prompts with no prefix hit"
                batch = copy.deepcopy(out.scheduled)
                batches.append((batch, bs, InputBuilder(bs).build(batch).inputs))
            sched.update(out, [rng.randrange(10, 1000) for _ in out.sampled])
    return tuple(batches)


def describe(batch) -> str:
    return "; ".join(f"seq {s.seq.seq_id}: {s.num_new_tokens} new from position {s.start} "
                     f"(cached {s.seq.num_cached_tokens}, table {s.seq.block_table})" for s in batch)


def groups(batch, mode: str = "engine") -> tuple[list, list]:
    if mode == "batch_order":
        return [], list(batch)
    if mode == "is_prefill":
        return [s for s in batch if not s.is_prefill], [s for s in batch if s.is_prefill]
    return [s for s in batch if s.num_new_tokens == 1], [s for s in batch if s.num_new_tokens > 1]


def variant_slots(batch, bs: int, mode: str) -> list[int]:
    """The slot mapping with one classic mistake."""
    slots = []
    for group in groups(batch, mode):
        for s in group:
            seq, start = s.seq, (s.seq.num_computed_tokens if mode == "computed_as_start" else s.start)
            for p in range(start, start + s.num_new_tokens):
                if p // bs >= len(seq.block_table):  # (computed_as_start: past the blocks the step has)
                    slots.append(-2)
                    continue
                slot = seq.block_table[p // bs] * bs + p % bs
                if mode == "chunk_positions":
                    q = p - start
                    slot = seq.block_table[q // bs] * bs + q % bs
                slots.append(-1 if p < seq.num_cached_tokens and mode != "write_cached" else slot)
    return slots


# (writing a prefix-cache block's slots, counting from a chunk's start: chapters 04 and 05, not tested here)
SLOT_MISTAKES = {
    "batch_order": "keeping the batch's order: the decodes (one new token) come first, then the prefill chunks",
    "is_prefill": "grouping by is_prefill: group by num_new_tokens == 1 (a one-token prompt computes one "
                  "token and is laid out as a decode)",
    "computed_as_start": "starting from seq.num_computed_tokens: the scheduler has already counted this step's "
                         "tokens there when the batch is laid out; the step starts at s.start",
}


def check_slot_mapping(fn, where: str) -> None:
    seen = {"decode": 0, "prefill": 0, "decodes and prefills together": 0, "one-token prefill": 0}
    for batch, bs, inp in engine_batches():
        want = inp.attn.slot_mapping.tolist()
        got = fn(list(batch), bs)
        got = got.tolist() if isinstance(got, torch.Tensor) else got
        got = list(got) if isinstance(got, (list, tuple)) else got
        with explained(got, {d: functools.partial(variant_slots, batch, bs, m) for m, d in SLOT_MISTAKES.items()}):
            assert_equal(got, want, f"slot mapping (block_size={bs}) of the batch [{describe(batch)}]", where)
        seen["decode"] += inp.attn.num_decode_seqs > 0
        seen["prefill"] += bool(inp.attn.prefill_query_lens)
        seen["decodes and prefills together"] += (inp.attn.num_decode_seqs > 0
                                                  and bool(inp.attn.prefill_query_lens))
        seen["one-token prefill"] += any(s.is_prefill and s.num_new_tokens == 1 for s in batch)
    assert all(seen.values()), f"test bug: the batches should cover every case: {seen}"


def test_3_1_batch_slot_mapping_matches_input_builder(ex):
    where = book(NB, "3.1")
    check_slot_mapping(ex.batch_slot_mapping, where)
    for mode, description in SLOT_MISTAKES.items():
        def wrong(batch, bs, mode=mode):
            return variant_slots(batch, bs, mode)
        wrong.__name__ = mode
        assert_detects(lambda fn: check_slot_mapping(fn, where), wrong, description)


def metadata_fields(meta) -> dict:
    """The fields of an AttentionMetadata as plain lists (tensors also report their dtype)."""
    def plain(t):
        return None if t is None else (t.tolist(), t.dtype) if isinstance(t, torch.Tensor) else t
    return {"slot_mapping": plain(meta.slot_mapping), "num_decode_seqs": meta.num_decode_seqs,
            "decode_block_tables": plain(meta.decode_block_tables),
            "decode_context_lens": plain(meta.decode_context_lens),
            "prefill_query_starts": list(meta.prefill_query_starts), "prefill_query_lens": list(meta.prefill_query_lens),
            "prefill_context_lens": list(meta.prefill_context_lens),
            "prefill_block_tables": [plain(t) for t in meta.prefill_block_tables], "block_size": meta.block_size}


def without_padding(fields: dict, batch) -> dict:
    """The fields with each decode block table row cut to its sequence's blocks: what pads a row (its value,
    the width) is never read, so it is the builder's choice (the engine pads with 0 to the longest table)."""
    tables = fields["decode_block_tables"]
    if tables is not None and isinstance(tables[0], list):
        decodes, _ = groups(batch)
        rows = [row[:len(s.seq.block_table)] for row, s in zip(tables[0], decodes)]
        fields = {**fields, "decode_block_tables": (rows + tables[0][len(decodes):], tables[1])}
    return fields


def variant_meta(batch, bs: int, mode: str) -> dict:
    """The metadata fields with one classic mistake (the engine's slots)."""
    decodes, prefills = groups(batch)
    want = metadata_fields(InputBuilder(bs).build(batch).inputs.attn)
    if mode == "context_without_new" and decodes:
        want["decode_context_lens"] = ([s.start for s in decodes], torch.int64)
    elif mode == "starts_from_zero":
        starts, row = [], 0
        for s in prefills:
            starts.append(row)
            row += s.num_new_tokens
        want["prefill_query_starts"] = starts
    return want


META_MISTAKES = {
    "context_without_new": "leaving the new token out of a decode's context length: it attends over "
                           "start + 1 tokens, itself included",
    "starts_from_zero": "counting the prefill query starts from row 0: the decode rows come first, so the first "
                        "chunk starts at row num_decode_seqs",
}


def check_table_shape(meta, batch, where: str) -> None:
    """decode_block_tables: one int64 row per decode, wide enough for the longest table (None without decodes)."""
    decodes, _ = groups(batch)
    tables = meta.decode_block_tables
    if not decodes or not isinstance(tables, torch.Tensor):
        return  # (the field comparison says what is missing)
    width = max(len(s.seq.block_table) for s in decodes)
    if tables.dim() != 2 or tables.shape[0] != len(decodes) or tables.shape[1] < width:
        raise AssertionError(f"decode_block_tables of the batch [{describe(batch)}]: shape {tuple(tables.shape)}, "
                             f"expected {len(decodes)} rows of at least {width} blocks (one per decode, padded to "
                             f"the longest table) {where}")


def check_metadata(fn, where: str) -> None:
    from nanoengine.attention import AttentionMetadata

    for batch, bs, inp in engine_batches():
        meta = fn(list(batch), bs)
        if not isinstance(meta, AttentionMetadata):
            raise AssertionError(f"attention_metadata must return an AttentionMetadata, got {type(meta).__name__} "
                                 f"{where}")
        check_table_shape(meta, batch, where)
        got, want = without_padding(metadata_fields(meta), batch), without_padding(metadata_fields(inp.attn), batch)
        with explained(got, {d: lambda m=m: without_padding(variant_meta(batch, bs, m), batch)
                             for m, d in META_MISTAKES.items()}):
            for key, value in want.items():
                assert_equal(got[key], value, f"{key} of the batch [{describe(batch)}] (block_size={bs})", where)


def test_3_2_attention_metadata_matches_input_builder(ex):
    from nanoengine.attention import AttentionMetadata

    where = book(NB, "3.2")
    for mode, description in META_MISTAKES.items():
        def wrong(batch, bs, mode=mode):
            return AttentionMetadata(**{k: (torch.tensor(v[0], dtype=v[1]) if isinstance(v, tuple) else
                                            [torch.tensor(t[0], dtype=t[1]) for t in v] if k == "prefill_block_tables"
                                            else v) for k, v in variant_meta(batch, bs, mode).items()})
        wrong.__name__ = mode
        assert_detects(lambda fn: check_metadata(fn, where), wrong, description)
    check_metadata(ex.attention_metadata, where)


# ------------------------------------------------------------------------------------------ store, attention
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


def wrong_store_minus_one(k, v, k_cache, v_cache, slots):
    """Writes every row, the -1 ones too (Python's -1 is the cache's last slot)."""
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v


def check_store(fn, where: str) -> None:
    from nanoengine.attention.torch_backend import store_kvcache

    gen = torch.Generator().manual_seed(33)
    for num_blocks, bs, kvh, d, T in [(8, 4, 2, 8, 10), (5, 16, 1, 4, 33), (20, 1, 3, 2, 7)]:
        k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
        v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
        k = torch.randn(T, kvh, d, generator=gen)
        v = torch.randn(T, kvh, d, generator=gen)
        slots = torch.randperm(num_blocks * bs - 1, generator=gen)[:T]
        slots[torch.rand(T, generator=gen) < 0.2] = -1  # prefix-cache hits or padding rows: skip them
        slots[0] = -1
        want_k, want_v = to_engine(k_cache), to_engine(v_cache)
        store_kvcache(k, v, want_k, want_v, slots)
        want_k, want_v = from_engine(want_k), from_engine(want_v)
        fn(k, v, k_cache, v_cache, slots)
        shape = f"cache [{num_blocks}, {bs}, {kvh}, {d}], {T} tokens, slots {slots.tolist()}"
        hint = ("" if torch.equal(k_cache[-1, -1], want_k[-1, -1]) else
                " This looks like writing the rows whose slot is -1: in Python, index -1 is the cache's last "
                "slot; keep only slots >= 0.")
        for got, want, name in [(k_cache, want_k, "k_cache"), (v_cache, want_v, "v_cache")]:
            assert_close(got, want, f"{name} after the store ({shape})", hint + " " + where, atol=0, rtol=0)


def test_3_3_store_kv_matches_engine_store(ex):
    where = book(NB, "3.3")
    check_store(ex.store_kv, where)
    assert_detects(lambda fn: check_store(fn, where), wrong_store_minus_one, "writing the rows whose slot is -1")


def expand(k: torch.Tensor, heads: int, mode: str) -> torch.Tensor:
    """K or V [n, KVH, D] -> [n, H, D]: query head h reads kv head h // group (or h % KVH with `repeat`)."""
    group = heads // k.shape[1]
    return k.repeat(1, group, 1) if mode == "repeat" else k.repeat_interleave(group, 1)


def dense(q, k, v, scale, visible, mode: str = "engine"):
    """Reference attention in float64: q [n_q, H, D], k, v [n_k, KVH, D], visible [n_q, n_k] bool."""
    heads = q.shape[1]
    k, v = expand(k, heads, mode).double(), expand(v, heads, mode).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def variant_decode(q, k_cache, v_cache, tables, lens, scale, mode: str):
    bs = k_cache.shape[1]
    out = []
    for b, n in enumerate(lens):
        used = -(-n // bs)
        k = k_cache[tables[b]].flatten(0, 1)[: used * bs if mode == "whole_blocks" else n]
        v = v_cache[tables[b]].flatten(0, 1)[: used * bs if mode == "whole_blocks" else n]
        out.append(dense(q[b:b + 1], k, v, scale, torch.ones(1, len(k), dtype=torch.bool), mode)[0])
    return torch.stack(out).to(q.dtype)


DECODE_MISTAKES = {
    "repeat": "`repeat` for grouped-query heads: query head h reads kv head h // (H // KVH), which "
              "`repeat_interleave(H // KVH, dim=1)` gives (`repeat` gives h % KVH)",
    "whole_blocks": "attending over every slot of the sequence's last block: only the first context_lens[b] "
                    "tokens are its context; the rest of the block is junk",
}


def check_decode(fn, block_size, heads, kv_heads, where: str) -> None:
    from nanoengine.attention.torch_backend import decode_attention

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
    got = fn(q, k_cache, v_cache, block_tables, context_lens, scale)
    engine = decode_attention(q, to_engine(k_cache), to_engine(v_cache), block_tables, context_lens, scale)
    variants = {d: functools.partial(variant_decode, q, k_cache, v_cache, tables, lens, scale, m)
                for m, d in DECODE_MISTAKES.items()}
    with explained(got, variants):
        assert_close(got, engine, f"decode attention vs nanoengine (block_size={block_size}, {heads} heads, "
                     f"{kv_heads} kv heads, lens {lens})", where, atol=1e-5)
    for b, (n, table) in enumerate(zip(lens, tables)):
        k = torch.cat([k_cache[t] for t in table])[:n]  # the sequence's K, contiguous
        v = torch.cat([v_cache[t] for t in table])[:n]
        want = dense(q[b:b + 1], k, v, scale, torch.ones(1, n, dtype=torch.bool))[0]
        assert_close(got[b].double(), want, f"sequence {b} (length {n}, blocks {table}) vs dense attention", where,
                     atol=1e-5)


@pytest.mark.parametrize("block_size,heads,kv_heads", [(4, 4, 2), (16, 9, 3), (1, 2, 2)])
def test_3_4_paged_decode_attention_equals_dense(ex, block_size, heads, kv_heads):
    where = book(NB, "3.4")
    check_decode(ex.paged_decode_attention, block_size, heads, kv_heads, where)
    if kv_heads < heads:
        for mode, description in DECODE_MISTAKES.items():
            def wrong(q, kc, vc, tables, lens, scale, mode=mode):
                bs = kc.shape[1]
                rows = [[int(b) for b in t[: -(-int(n) // bs)]] for t, n in zip(tables, lens)]
                return variant_decode(q, kc, vc, rows, [int(n) for n in lens], scale, mode)
            wrong.__name__ = mode
            assert_detects(lambda fn: check_decode(fn, block_size, heads, kv_heads, where), wrong,
                           description)


def engine_prefill(q, k_new, v_new, k_cache, v_cache, table, context_len, scale):
    """The torch backend's forward on one prefill chunk (store, then attend over prefix + chunk), on copies of
    caches in the exercises' layout."""
    from nanoengine.attention import AttentionMetadata
    from nanoengine.attention.torch_backend import TorchAttention

    q_len, heads, d = q.shape
    bs = k_cache.shape[1]
    attn = TorchAttention(heads, k_cache.shape[2], d, scale)
    attn.k_cache, attn.v_cache = to_engine(k_cache), to_engine(v_cache)
    positions = range(context_len - q_len, context_len)
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in positions])
    meta = AttentionMetadata(slot_mapping=slots, num_decode_seqs=0, decode_block_tables=None,
                             decode_context_lens=None, prefill_query_starts=[0], prefill_query_lens=[q_len],
                             prefill_context_lens=[context_len], prefill_block_tables=[torch.tensor(table)],
                             block_size=bs)
    out = attn(q, k_new, v_new, meta)
    return out, from_engine(attn.k_cache), from_engine(attn.v_cache)


def variant_prefill(q, k_cache, v_cache, table, context_len, scale, mode: str):
    q_len = q.shape[0]
    k = torch.cat([k_cache[t] for t in table])[:context_len]
    v = torch.cat([v_cache[t] for t in table])[:context_len]
    if mode == "chunk_only":
        k, v = k[context_len - q_len:], v[context_len - q_len:]
    n_k = k.shape[0]
    shift = 0 if mode == "unshifted" else n_k - q_len
    visible = torch.arange(n_k)[None, :] <= torch.arange(q_len)[:, None] + shift
    return dense(q, k, v, scale, visible, "repeat" if mode == "repeat" else "engine").to(q.dtype)


PREFILL_MISTAKES = {
    "unshifted": "a causal mask that is not shifted by the cached prefix: query i is position "
                 "context_len - q_len + i and sees every position up to that one",
    "chunk_only": "attention over the chunk's own tokens only: the cached prefix is part of every query's context",
    "repeat": "`repeat` for grouped-query heads: query head h reads kv head h // (H // KVH)",
}


PREFILL_CASES = [  # block_size, heads, kv_heads, prefix (cached) tokens, chunk tokens
    (4, 4, 2, 8, 5), (4, 4, 2, 6, 7), (16, 9, 3, 37, 12), (1, 2, 2, 5, 3), (4, 4, 1, 0, 9), (8, 4, 2, 13, 1),
]


def check_prefill(fn, where: str) -> None:
    gen = torch.Generator().manual_seed(35)
    D, num_blocks, scale = 8, 64, 8 ** -0.5
    for bs, heads, kv_heads, prefix, q_len in PREFILL_CASES:
        ctx = prefix + q_len
        k_cache = torch.randn(num_blocks, bs, kv_heads, D, generator=gen)
        v_cache = torch.randn(num_blocks, bs, kv_heads, D, generator=gen)
        table = torch.randperm(num_blocks, generator=gen)[: -(-ctx // bs)].tolist()
        q = torch.randn(q_len, heads, D, generator=gen)
        k_new = torch.randn(q_len, kv_heads, D, generator=gen)
        v_new = torch.randn(q_len, kv_heads, D, generator=gen)
        want, k_cache, v_cache = engine_prefill(q, k_new, v_new, k_cache, v_cache, table, ctx, scale)
        got = fn(q, k_cache.clone(), v_cache.clone(), torch.tensor(table), ctx, scale)
        what = (f"prefill attention of a {q_len}-token chunk after {prefix} cached tokens (block_size={bs}, "
                f"{heads} heads, {kv_heads} kv heads, blocks {table})")
        variants = {d: functools.partial(variant_prefill, q, k_cache, v_cache, table, ctx, scale, m)
                    for m, d in PREFILL_MISTAKES.items()}
        with explained(got, variants):
            assert_close(got, want, what + " vs nanoengine's torch backend", where, atol=1e-5)
        visible = torch.arange(ctx)[None, :] <= torch.arange(prefix, ctx)[:, None]
        k, v = torch.cat([k_cache[t] for t in table])[:ctx], torch.cat([v_cache[t] for t in table])[:ctx]
        assert_close(got.double(), dense(q, k, v, scale, visible), what + " vs dense attention", where, atol=1e-5)


def test_3_5_paged_prefill_over_a_cached_prefix(ex):
    where = book(NB, "3.5")
    check_prefill(ex.paged_prefill_attention, where)
    for mode, description in PREFILL_MISTAKES.items():
        def wrong(q, kc, vc, table, ctx, scale, mode=mode):
            return variant_prefill(q, kc, vc, table.tolist(), ctx, scale, mode)
        wrong.__name__ = mode
        assert_detects(lambda fn: check_prefill(fn, where), wrong, description)


# ------------------------------------------------------------------------------------------ online softmax, Triton
def variant_online(q, k_cache, v_cache, table: list[int], n: int, scale: float, mode: str) -> torch.Tensor:
    """One sequence's decode attention [H, D] with one classic mistake of an online softmax over blocks:
    q [H, D]; table the sequence's row of the block table (padded with -1)."""
    H, D = q.shape
    num_blocks, bs, kvh, _ = k_cache.shape
    group = H // kvh
    length = {"one_more": n + 1, "one_fewer": n - 1}.get(mode, n)
    if mode == "mod" and n and n % bs == 0:
        length = n - bs  # the full last block read as holding n % bs == 0 tokens
    dtype = torch.float32 if mode == "no_max" else torch.float64  # the overflow happens in float32
    out = torch.zeros(H, D, dtype=torch.float64)
    if length <= 0:
        return out.to(q.dtype)
    pos = torch.arange(length)
    slots = torch.tensor(table)[pos // bs] * bs + pos % bs  # [length]; a -1 entry wraps like Python's k_cache[-1]
    for h in range(H):
        if mode == "kv_head_h":  # the rows a kernel reads at offset h * stride_head from slot s: flat row s*KVH + h
            rows = slots * kvh + h
            k, v = k_cache.reshape(-1, D)[rows], v_cache.reshape(-1, D)[rows]  # [length, D]
        else:
            kv = h % kvh if mode == "repeat" else h // group
            k, v = k_cache.reshape(-1, kvh, D)[slots, kv], v_cache.reshape(-1, kvh, D)[slots, kv]
        k, v, qh = k.to(dtype), v.to(dtype), q[h].to(dtype)
        s = k @ qh * scale  # [length]
        if mode == "no_max":
            p = torch.exp(s)
            out[h] = ((p @ v) / p.sum()).double()
        elif mode == "no_rescale":  # tile by tile, each tile's exp under the newest max, the old sums not rescaled
            m, l, acc = torch.tensor(float("-inf"), dtype=dtype), 0.0, torch.zeros(D, dtype=dtype)
            for t in range(0, length, bs):
                m = torch.maximum(m, s[t:t + bs].max())
                p = torch.exp(s[t:t + bs] - m)
                l, acc = l + p.sum(), acc + p @ v[t:t + bs]
            out[h] = acc / l
        else:
            out[h] = torch.softmax(s, 0) @ v
    return out.to(q.dtype)


ONLINE_MISTAKES = {
    "no_max": "exponentiating the scores without subtracting the running max: e^s overflows float32 to inf once "
              "a score passes about 88, and inf / inf is NaN; exp(s - m) with the running max m gives the same "
              "softmax and never overflows",
    "no_rescale": "a running max that does not rescale what was already summed: when a block raises the max from "
                  "m_old to m_new, multiply the running sum l and the accumulator acc by exp(m_old - m_new) before "
                  "adding the block's terms",
    "one_more": "one token too many in the last block: block j holds min(block_size, context_len - j * block_size) "
                "tokens, and the slots after them are junk",
    "one_fewer": "one token too few in the last block: context_lens[b] counts the new token too, and it is the last "
                 "filled slot of the last block",
    "mod": "context_len % block_size as the last block's length: that is 0 when the last block is full, so the "
           "block is skipped; use min(block_size, context_len - j * block_size)",
    "kv_head_h": "reading query head h's K/V at kv head h, ignoring the grouped-query group: query heads "
                 "h = kvh * group .. kvh * group + group - 1 all read kv head kvh = h // (H // KVH)",
    "repeat": "kv head h % KVH for query head h (the `repeat` order): query head h reads kv head h // (H // KVH)",
}


def same_or_both_overflow(a, b) -> bool:
    """A wrong answer with inf/NaN (an overflow) matches any answer with inf/NaN; else `same_answer`."""
    if isinstance(b, torch.Tensor) and not torch.isfinite(b).all():
        return isinstance(a, torch.Tensor) and not bool(torch.isfinite(a).all())
    return same_answer(a, b)


ONLINE_CASES = [  # block_size, heads, kv_heads, head_dim, context lengths (0: a padding row), logit scale
    (4, 8, 2, 16, [6, 1, 12, 0, 9, 3], 1.0),  # GQA group 4, partly filled and full last blocks, a padding row
    (4, 4, 1, 8, [7, 10], 100.0),  # logits in the hundreds: e^s overflows float32 without the max
    (3, 9, 3, 8, [8, 3, 1], 1.0),  # a block size that is not a power of two, group 3 (SmolLM2's)
    (16, 4, 2, 32, [40, 17], 1.0),  # tiny-qwen3's shape and the engine's block size
]


def online_case(gen, bs, heads, kv_heads, D, lens, logit_scale):
    """Seeded caches, block tables padded with -1 (the last physical block stays unused), and q."""
    num_blocks = 1 + sum(-(-n // bs) for n in lens) + 3
    k_cache = torch.randn(num_blocks, bs, kv_heads, D, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kv_heads, D, generator=gen)
    free = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    width = max(len(t) for t in tables) + 1
    padded = [t + [-1] * (width - len(t)) for t in tables]  # [B, width]: -1 past each sequence's blocks
    q = torch.randn(len(lens), heads, D, generator=gen) * logit_scale
    return q, k_cache, v_cache, padded, tables


def check_online_decode(fn, where: str, device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(36)
    for bs, heads, kv_heads, D, lens, logit_scale in ONLINE_CASES:
        q, k_cache, v_cache, padded, tables = online_case(gen, bs, heads, kv_heads, D, lens, logit_scale)
        scale = D ** -0.5
        got = fn(*(t.to(device) for t in (q, k_cache, v_cache, torch.tensor(padded), torch.tensor(lens))), scale)
        shape = (f"block_size={bs}, {heads} heads, {kv_heads} kv heads, head_dim {D}, context lengths {lens}"
                 + (f", logits up to {logit_scale:g}x larger" if logit_scale != 1 else ""))
        if not isinstance(got, torch.Tensor) or got.shape != q.shape or got.dtype != q.dtype:
            raise AssertionError(f"the output ({shape}) must be q's shape {tuple(q.shape)} and dtype {q.dtype}, "
                                 f"got {type(got).__name__} {tuple(getattr(got, 'shape', ()))} "
                                 f"{getattr(got, 'dtype', '')} {where}")
        got = got.cpu()
        for b, (n, table) in enumerate(zip(lens, tables)):
            what = f"sequence {b} of context length {n} in blocks {table} ({shape})"
            if n == 0:
                if not bool((got[b] == 0).all()):
                    bad = "NaN" if got[b].isnan().any() else "nonzero values"
                    raise AssertionError(f"{what}: a padding row (context length 0) must give zeros, yours has "
                                         f"{bad}: nothing was read, so l == 0 and acc / l would be 0 / 0; write "
                                         f"0 there {where}")
                continue
            k = torch.cat([k_cache[t] for t in table])[:n]  # [n, KVH, D], contiguous: the dense oracle's input
            v = torch.cat([v_cache[t] for t in table])[:n]
            want = dense(q[b:b + 1], k, v, scale, torch.ones(1, n, dtype=torch.bool))[0]  # [H, D] float64
            variants = {d: functools.partial(variant_online, q[b], k_cache, v_cache, padded[b], n, scale, m)
                        for m, d in ONLINE_MISTAKES.items()}
            with explained(got[b], variants, same_or_both_overflow):
                if not bool(torch.isfinite(got[b]).all()):
                    raise AssertionError(f"{what}: your output has inf or NaN where attention is finite "
                                         f"(largest score {float((k.double() @ q[b].double().T).abs().max() * scale):.0f})"
                                         f" {where}")
                assert_close(got[b].double(), want, what + " vs dense attention in float64", where, atol=1e-5)


def online_wrong(mode: str):
    def wrong(q, kc, vc, tables, lens, scale):
        return torch.stack([variant_online(q[b], kc, vc, tables[b].tolist(), int(n), scale, mode)
                            for b, n in enumerate(lens)])
    wrong.__name__ = mode
    return wrong


def assert_online_checker_names_the_mistakes(where: str) -> None:
    for mode, description in ONLINE_MISTAKES.items():
        assert_detects(lambda fn: check_online_decode(fn, where), online_wrong(mode), description)


def largest_copy(fn, *args) -> tuple[int, str, tuple]:
    """Run fn(*args) and return the largest tensor any non-view op made in it: (elements, op, shape)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.found = (0, "", ())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            is_view = any(r.alias_info is not None for r in func._schema.returns)
            if isinstance(out, torch.Tensor) and not is_view and out.numel() > self.found[0]:
                self.found = (out.numel(), str(func), tuple(out.shape))
            return out

    with Largest() as mode:
        fn(*args)
    return mode.found


GATHER = ("gathering a sequence's K/V into one tensor (as 3.4 does): read each block where it lies, "
          "k_cache[block] for one block at a time, and fold it into the running m, l and acc")


def check_reads_in_place(fn, where: str) -> None:
    """No tensor bigger than one block per sequence for every query head: a copy of a whole sequence's K/V
    (300 tokens here) does not fit."""
    gen = torch.Generator().manual_seed(37)
    bs, heads, kv_heads, D, lens = 16, 4, 2, 32, [300, 5]
    q, k_cache, v_cache, padded, _ = online_case(gen, bs, heads, kv_heads, D, lens, 1.0)
    bound = len(lens) * bs * heads * D
    size, op, shape = largest_copy(fn, q, k_cache, v_cache, torch.tensor(padded), torch.tensor(lens), D ** -0.5)
    if size > bound:
        raise AssertionError(f"reading in place (block_size={bs}, {heads} heads, {kv_heads} kv heads, head_dim {D}, "
                             f"context lengths {lens}): your function made a {list(shape)} tensor ({op}), more "
                             f"than one block per sequence for every query head ({bound} elements). This looks "
                             f"like {GATHER} {where}")


def test_3_6_online_decode_attention_reads_blocks_in_place(ex):
    where = book(NB, "3.6")
    check_online_decode(ex.online_decode_attention, where)
    check_reads_in_place(ex.online_decode_attention, where)
    assert_online_checker_names_the_mistakes(where)
    assert_detects(lambda fn: check_reads_in_place(fn, where), online_wrong("gather"), GATHER)


NO_TRITON = ("triton is not installed: Exercises 3.7 and 3.8 need it (Linux); the chapter's capstone decodes with "
             "your 3.6 instead")


def needs_triton(ex, number: str) -> str:
    """Skip without triton (one line, which check() shows); on CUDA, a stub kernel is "todo" (compiled, the
    stub's `raise` would be a CompilationError). Returns the device the kernel runs on."""
    if getattr(ex, "triton", None) is None:
        pytest.skip(NO_TRITON)
    if not torch.cuda.is_available():
        return "cpu"  # Triton's interpreter
    from nanoengine.pieces.learner import is_stub

    kernel = {"3.7": "masked_row_softmax_kernel", "3.8": "paged_decode_kernel"}[number]
    if is_stub(getattr(ex, kernel)):
        raise NotImplementedError(f"Exercise {number}: {kernel} is still the stub {book(NB, number)}")
    return "cuda"


# ------------------------------------------------------------------------------------------ 3.7: a masked tile
def variant_row_softmax(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The softmax of each row with one classic mistake of a masked tile: x [rows, n] float32."""
    rows, n = x.shape
    block = 1 << (n - 1).bit_length()
    if mode == "zero_pad":  # the padding lanes loaded as 0 and scored as 0
        padded = torch.zeros(rows, block, dtype=torch.float64)
        padded[:, :n] = x.double()
        return torch.softmax(padded, dim=1)[:, :n].float()
    p = torch.exp(x)  # no_max: e^x in float32
    return p / p.sum(dim=1, keepdim=True)


ROW_SOFTMAX_MISTAKES = {
    "zero_pad": "padding lanes loaded as 0 (other=0.0) and scored as 0: a 0 lane raises the max of a row of "
                "negative values and adds e^(0 - max) to the sum; give the padding -inf (other=float(\"-inf\"), "
                "or tl.where(mask, x, float(\"-inf\"))), which weighs e^-inf = 0",
    "no_max": "exponentiating without subtracting the row's max: e^x overflows float32 to inf past x = 88, and "
              "inf / inf is NaN; e^(x - max) gives the same softmax",
}
ROW_SOFTMAX_CASES = [(5, 10, -3.0, 1.0), (3, 33, 0.0, 1.0), (4, 16, -1.0, 1.0), (2, 1, -5.0, 1.0), (3, 7, 0.0, 100.0)]
# (rows, columns, shift, scale): rows shorter than their tile (10 in 16, 33 in 64, 7 in 8), a row that fills
# it, one column; all-negative rows, where a 0 in a padding lane would be the max; values past e^88


def check_row_softmax(fn, where: str, device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(37)
    for rows, n, shift, scale in ROW_SOFTMAX_CASES:
        x = torch.randn(rows, n, generator=gen) * scale + shift  # [rows, n]
        what = f"the row softmax of a [{rows}, {n}] matrix (a tile of {1 << (n - 1).bit_length()} lanes" + (
            f", values up to {float(x.abs().max()):.0f})" if scale != 1 else ")")
        got = fn(x.to(device))
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            raise AssertionError(f"{what}: expected a [{rows}, {n}] tensor, got {type(got).__name__} "
                                 f"{tuple(getattr(got, 'shape', ()))} {where}")
        got = got.cpu()
        variants = {d: functools.partial(variant_row_softmax, x, m) for m, d in ROW_SOFTMAX_MISTAKES.items()}
        with explained(got, variants, same_or_both_overflow):
            if not bool(torch.isfinite(got).all()):
                raise AssertionError(f"{what}: your output has inf or NaN where the softmax is finite {where}")
            assert_close(got.double(), torch.softmax(x.double(), dim=1), what + " vs torch.softmax in float64",
                         where, atol=1e-6)


def test_3_7_masked_row_softmax_kernel(ex):
    device = needs_triton(ex, "3.7")
    where = book(NB, "3.7")
    check_row_softmax(ex.triton_row_softmax, where, device)
    for mode, description in ROW_SOFTMAX_MISTAKES.items():
        def wrong(x, mode=mode):
            return variant_row_softmax(x.cpu(), mode)
        wrong.__name__ = mode
        assert_detects(lambda fn: check_row_softmax(fn, where), wrong, description)


# ------------------------------------------------------------------------------------------ 3.8: the paged kernel
UNMASKED_ROWS = ("query rows past GROUP left unmasked: with BLOCK_G > GROUP (a group of 3 in a tile of 4), the "
                 "padding rows g >= GROUP are the next kv head's query heads; mask them (g < GROUP) in the "
                 "query load and in the store, so that program (b, kvh) writes only heads kvh * GROUP .. "
                 "kvh * GROUP + GROUP - 1")


def launch_first_kv_head(kernel, q, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:
    """The learner's paged kernel on a grid of (B, 1), kv head 0's programs only, into an output that starts
    as NaN: what a program writes outside its own query heads stays visible (on the full grid, another
    program would write over it, or the write would land past the output)."""
    import triton

    B, H, D = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    group = H // kv_heads
    out = torch.full_like(q, float("nan"))  # [B, H, D]
    kernel[(B, 1)](q, k_cache, v_cache, tables, lens, out, scale, q.stride(0), q.stride(1), k_cache.stride(0),
                   k_cache.stride(1), k_cache.stride(2), tables.stride(0), GROUP=group, HEAD_DIM=D,
                   BLOCK_SIZE=bs, BLOCK_G=triton.next_power_of_2(group), BLOCK_D=triton.next_power_of_2(D),
                   BLOCK_N=triton.next_power_of_2(bs))
    return out


def check_own_heads(run, where: str, device: str = "cpu") -> None:
    """run(q, k_cache, v_cache, tables, lens, scale) writes kv head 0's programs only (launch_first_kv_head):
    heads 0 .. GROUP - 1 get values, every other head keeps its NaN."""
    gen = torch.Generator().manual_seed(38)
    bs, heads, kv_heads, D, lens, _ = ONLINE_CASES[2]  # group 3 in a tile of BLOCK_G = 4
    q, k_cache, v_cache, padded, _ = online_case(gen, bs, heads, kv_heads, D, lens, 1.0)
    args = [t.to(device) for t in (q, k_cache, v_cache, torch.tensor(padded), torch.tensor(lens))]
    out = run(*args, D ** -0.5).cpu()
    group = heads // kv_heads
    written = [h for h in range(group, heads) if not bool(out[:, h].isnan().all())]
    if written:
        raise AssertionError(f"kv head 0's programs alone ({heads} heads, {kv_heads} kv heads: a group of {group}, "
                             f"BLOCK_G = 4) wrote query head {written[0]}, outside their group (heads 0 .. "
                             f"{group - 1}). This looks like {UNMASKED_ROWS} {where}")


def wrong_unmasked_rows(q, k_cache, v_cache, tables, lens, scale):
    """Kv head 0's programs writing a whole tile of BLOCK_G = 4 query heads (head 3 too)."""
    out = torch.full_like(q, float("nan"))
    out[:, :4] = online_wrong("engine")(q, k_cache, v_cache, tables, lens, scale)[:, :4]
    return out


def test_3_8_triton_paged_decode_kernel(ex):
    device = needs_triton(ex, "3.8")
    where = book(NB, "3.8")
    check_own_heads(functools.partial(launch_first_kv_head, ex.paged_decode_kernel), where, device)
    check_online_decode(ex.triton_paged_decode, where, device)
    assert_online_checker_names_the_mistakes(where)
    assert_detects(lambda fn: check_own_heads(fn, where), wrong_unmasked_rows, UNMASKED_ROWS)
