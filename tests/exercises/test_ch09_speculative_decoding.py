"""Exercises of book/09_speculative_decoding.ipynb, checked against nanoengine's speculative decoding: the
n-gram proposer (NgramProposer) on seeded random sequences, the greedy acceptance rule (accepted_tokens), the
rejection-sampling step by the law of its draws (the share of each draft kept, the residual law after a
rejection, the target law in all; not the order of its random draws), and the rollback by the block manager's
invariants (not the order in which it frees blocks). A wrong answer is also compared with the classic mistakes,
so the message can say which one it looks like; each test checks that it names them."""

from __future__ import annotations

import random

import pytest
import torch
from ex_helpers import CHI2_P001, assert_detects, assert_equal, assert_same_list, book, chi_square, explained

from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.sequence import Sequence
from nanoengine.sampling_params import SamplingParams
from nanoengine.spec.ngram import NgramProposer
from nanoengine.spec.verify import accepted_tokens

CHAPTER = "ch09_speculative_decoding"
pytestmark = pytest.mark.xdist_group("ex_ch09")
NB = "09_speculative_decoding.ipynb"


# ---------------------------------------------------------------- 9.1
def ngram_cases(seed: int = 0, count: int = 400):
    """(token_ids, k, max_n, min_n): short sequences over a few tokens, so suffixes repeat."""
    rng = random.Random(seed)
    fixed = [([1, 2, 3, 1, 2], 2, 4, 1), ([5, 5, 5, 5], 3, 2, 1), ([1, 2, 3, 4], 2, 3, 1), ([7], 2, 3, 1),
             ([], 2, 3, 1), ([1, 2, 1, 2, 1, 2], 3, 3, 2), ([1, 2, 3, 9, 2, 3, 8, 3], 2, 3, 2)]
    cases = list(fixed)
    for _ in range(count):
        max_n = rng.randint(1, 4)
        tokens = [rng.randrange(rng.randint(2, 5)) for _ in range(rng.randint(0, 30))]
        cases.append((tokens, rng.randint(1, 5), max_n, rng.randint(1, max_n)))
    return cases


def latest_even_if_short(tokens, k, max_n, min_n):
    """The mistake: the latest occurrence always, even when fewer than k tokens follow it."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[len(tokens) - n:]]
        if n > 0 and starts:
            return tokens[starts[-1] + n:starts[-1] + n + k]
    return []


def shortest_first(tokens, k, max_n, min_n):
    """The mistake: n from min_n up (the first, shortest suffix that occurs)."""
    for n in range(min_n, min(max_n, len(tokens) - 1) + 1):
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[len(tokens) - n:]]
        if starts:
            full = [s for s in starts if s + n + k <= len(tokens)]
            s = full[-1] if full else starts[0]
            return tokens[s + n:s + n + k]
    return []


def check_propose(propose) -> None:
    where = book(NB, "9.1")
    for tokens, k, max_n, min_n in ngram_cases():
        want = NgramProposer(k, max_n, min_n).propose(list(tokens))
        got = propose(list(tokens), k, max_n, min_n)
        variants = {"taking the latest occurrence even when fewer than k tokens follow it (then take the "
                    "earliest)": lambda: latest_even_if_short(tokens, k, max_n, min_n),
                    "trying the shortest suffix first (n goes from max_n down: a longer match predicts "
                    "better)": lambda: shortest_first(tokens, k, max_n, min_n)}
        with explained(got, variants):
            assert_same_list(got, want, f"propose_ngram({tokens}, k={k}, max_n={max_n}, min_n={min_n})",
                             where)


def test_9_1_propose_ngram_matches_the_engines_proposer(ex):
    check_propose(ex.propose_ngram)
    assert_detects(check_propose, latest_even_if_short, "fewer than k tokens follow")
    assert_detects(check_propose, shortest_first, "shortest suffix first")


# ---------------------------------------------------------------- 9.2
def no_bonus(drafts, verified):
    """The mistake: no model token after the last accepted draft when every draft is accepted."""
    a = 0
    while a < len(drafts) and drafts[a] == verified[a]:
        a += 1
    return verified[:a + 1] if a < len(drafts) else list(drafts)


def check_accept(accept) -> None:
    where = book(NB, "9.2")
    rng = random.Random(1)
    cases = [([], [4]), ([1, 2, 3], [1, 2, 3, 4]), ([1, 2, 3], [9, 2, 3, 4]), ([1, 2, 3], [1, 9, 3, 4])]
    for _ in range(300):
        k = rng.randint(0, 5)
        verified = [rng.randrange(3) for _ in range(k + 1)]
        cases.append(([rng.randrange(3) for _ in range(k)], verified))
    for drafts, verified in cases:
        got = accept(list(drafts), list(verified))
        with explained(got, {"forgetting the model's own token after the last draft when all are accepted "
                             "(the bonus token)": lambda: no_bonus(drafts, verified)}):
            assert_same_list(got, accepted_tokens(drafts, verified),
                             f"accept_greedy(drafts={drafts}, verified={verified})", where)


def test_9_2_accept_greedy_keeps_the_longest_agreeing_prefix(ex):
    check_accept(ex.accept_greedy)
    assert_detects(check_accept, no_bonus, "the bonus token")


# ---------------------------------------------------------------- 9.3
V, N = 5, 12_000


def laws(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=0)  # [V]
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=0)  # [V]
    return p, q


def resample_from_p(p, q, draft, generator):
    """The mistake: on rejection, draw from p instead of the normalized max(0, p - q)."""
    if torch.rand((), generator=generator) * q[draft] < p[draft]:
        return int(draft)
    return int(torch.multinomial(p, 1, generator=generator))


def always_accept(p, q, draft, generator):
    """The mistake: keep every draft (its law is then q, not p)."""
    return int(draft)


# chi-square critical values at p = 0.001 for the few degrees of freedom a residual law's support can leave
CHI2_P001_SMALL = {1: 10.83, 2: 13.82, **CHI2_P001}


def check_rejection(step) -> None:
    """The law of what `step` returns, whatever order it draws its random numbers in: after a rejection, the
    tokens follow the residual max(0, p - q) / Z (never a token outside its support, and a chi-square test on
    it); per draft d, the share kept is min(1, p(d) / q(d)) (a binomial bound); in all, the tokens follow p."""
    where = book(NB, "9.3")
    for seed in (0, 1):
        p, q = laws(seed)
        g = torch.Generator().manual_seed(100 + seed)
        drafts = torch.multinomial(q, N, replacement=True, generator=g)  # [N] drawn from q
        out = [step(p, q, int(d), g) for d in drafts]
        assert all(isinstance(t, int) and 0 <= t < V for t in out), (
            f"rejection_step must return a token id in 0..{V - 1} (a Python int), got e.g. "
            f"{next(t for t in out if not (isinstance(t, int) and 0 <= t < V))!r} {where}")
        tokens = torch.tensor(out)  # [N]
        kept = tokens == drafts  # [N] (the residual is 0 where a draft can be rejected: out == draft iff kept)
        laws_text = f"p {[round(x, 3) for x in p.tolist()]}, q {[round(x, 3) for x in q.tolist()]} (seed {seed})"
        residual = (p - q).clamp(min=0)  # [V]
        residual = residual / residual.sum()
        rejected = tokens[~kept]  # [R] the tokens drawn after a rejection
        support = residual > 0  # [V]
        outside = sorted(t for t in set(rejected.tolist()) if not support[t])
        index = torch.cumsum(support.long(), 0) - 1  # [V] a token's place in the support
        dof = int(support.sum()) - 1
        stat = chi_square(index[rejected], residual[support]) if dof > 0 and len(rejected) and not outside else 0.0
        if outside or stat >= CHI2_P001_SMALL.get(dof, float("inf")):
            found = (f"you returned {outside}, where p <= q" if outside else
                     f"chi-square {stat:.1f} >= {CHI2_P001_SMALL[dof]}")
            raise AssertionError(
                f"after a rejection the tokens are not distributed as max(0, p - q) normalized ({found}, over "
                f"{len(rejected)} rejections); {laws_text}. The token after a rejection must come from "
                f"max(0, p - q) normalized, not from p (drawing from p counts the tokens where p > q twice: "
                f"once kept, once redrawn) {where}")
        for d in range(V):
            mine = drafts == d
            n, want = int(mine.sum()), min(1.0, float(p[d] / q[d]))
            share = float(kept[mine].double().mean()) if n else want
            bound = 4.5 * (want * (1 - want) / max(n, 1)) ** 0.5 + 1e-9
            if abs(share - want) > bound:
                hint = (" This looks like keeping every draft: their law is then q, not p." if bool(kept.all())
                        else "")
                raise AssertionError(
                    f"draft {d} was kept in {share:.3f} of its {n} draws, expected min(1, p/q) = {want:.3f} "
                    f"(+- {bound:.3f}); {laws_text}.{hint} {where}")
        stat = chi_square(tokens, p)
        assert stat < CHI2_P001[V - 1], (
            f"the tokens rejection_step returns are not distributed as p: chi-square {stat:.1f} >= "
            f"{CHI2_P001[V - 1]} over {N} draws; {laws_text} {where}")
    p, _ = laws(2)  # q == p: every draft is accepted
    got = [step(p, p, d, torch.Generator().manual_seed(3)) for d in range(V)]
    assert_equal(got, list(range(V)),
                 "rejection_step(p, q=p, d) for d = 0..V-1 (with q == p no draft is ever rejected)", where)
    point = torch.nn.functional.one_hot(torch.tensor(1), V).float()  # a point mass on 1, where p is 0
    zero_p = torch.tensor([0.5, 0.0, 0.5, 0.0, 0.0])
    got = [step(zero_p, point, 1, torch.Generator().manual_seed(s)) for s in range(20)]
    assert all(t in (0, 2) for t in got), (
        f"rejection_step(p={zero_p.tolist()}, q=one-hot(1), draft=1) returned {got}: p gives token 1 no "
        f"chance, so it must be rejected and the token drawn from p - q clamped at 0 (tokens 0 and 2) {where}")


def residual_drawn_first(p, q, draft, generator):
    """A right answer that draws in another order (the residual's token first, then u): the check must pass."""
    residual = (p - q).clamp(min=0)
    other = int(torch.multinomial(residual / residual.sum() if residual.sum() > 0 else p, 1, generator=generator))
    return int(draft) if torch.rand((), generator=generator) * q[draft] < p[draft] else other


def test_9_3_rejection_step_draws_from_the_target_law(ex):
    check_rejection(ex.rejection_step)
    check_rejection(residual_drawn_first)  # the law is checked, not the order of the draws
    assert_detects(check_rejection, always_accept, "keeping every draft")
    assert_detects(check_rejection, resample_from_p, "not from p")


# ---------------------------------------------------------------- 9.4
def drafting_pool(seed: int, block_size: int = 4):
    """A block manager with sequence A computed and drafting (fresh blocks past its tokens), and B sharing
    A's prefix from the cache; sometimes B's table also holds A's last block, so that freeing only drops a
    reference. Returns (bm, A, B, num_tokens A keeps)."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=block_size)
    prompt = [rng.randrange(50) for _ in range(rng.randint(3, 14))]
    a = Sequence(list(prompt), SamplingParams(), block_size)
    bm.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    b = Sequence(prompt[:rng.randint(1, len(prompt))] + [99], SamplingParams(), block_size)
    b.num_computed_tokens = bm.match_prefix(b)
    bm.allocate(b, b.num_tokens - b.num_computed_tokens)
    k = rng.randint(1, 9)
    bm.allocate(a, k + 1)  # room for the last token and k drafts
    if rng.random() < 0.3 and len(a.block_table) > 1:  # a shared tail: freeing it only drops a reference
        tail = a.block_table[-1]
        bm.blocks[tail].ref_count += 1
        b.block_table.append(tail)
    return bm, a, b, a.num_tokens + rng.randint(0, k)


def fresh(seed: int) -> tuple[BlockManager, list[int]]:
    """The pool of `seed` anew (for computing a classic mistake's answer): (bm, A's table)."""
    bm, a, _, _ = drafting_pool(seed)
    return bm, a.block_table


def snapshot(bm: BlockManager) -> tuple:
    """What a rollback must leave alone or change only as the invariants say: ref counts, the free blocks (as a
    set: which end of the free list a block goes to is the engine's choice, not a rule), hashes."""
    return ([blk.ref_count for blk in bm.blocks], set(bm.free_block_ids), [blk.hash for blk in bm.blocks],
            dict(bm.hash_to_block_id))


def only_zeroed(bm, table, num_tokens):
    """The mistake: every block past the kept ones goes to the free list, shared or not."""
    keep = -(-num_tokens // bm.block_size)
    freed = [b for b in reversed(table[keep:])]
    for b in freed:
        bm.blocks[b].ref_count = 0
        bm.free_block_ids[b] = None
    del table[keep:]
    return freed


def floor_keep(bm, table, num_tokens):
    """The mistake: keeping num_tokens // block_size blocks (drops the partly filled last one)."""
    keep = num_tokens // bm.block_size
    freed = []
    for b in reversed(table[keep:]):
        bm.blocks[b].ref_count -= 1
        if bm.blocks[b].ref_count == 0:
            bm.free_block_ids[b] = None
            freed.append(b)
    del table[keep:]
    return freed


def check_rollback(rollback) -> None:
    """Invariants, not the engine's order: A's table keeps exactly its first ceil(num_tokens / block_size)
    blocks; each later block lost one reference; the blocks that reached 0 (and only those) joined the free
    list and are returned, in any order; B's table, hashes and every other count are untouched."""
    where = book(NB, "9.4")
    for seed in range(60):
        bm, a, b, keep_tokens = drafting_pool(seed)
        table, b_table = list(a.block_table), list(b.block_table)
        refs, free, hashes, hash_to_block = snapshot(bm)
        keep = -(-keep_tokens // bm.block_size)
        want_refs = list(refs)
        for block_id in table[keep:]:
            want_refs[block_id] -= 1
        want_freed = sorted(b for b in set(table[keep:]) if want_refs[b] == 0)
        what = (f"rollback_blocks(bm, A's table, {keep_tokens}) with block_size {bm.block_size} [before: A's "
                f"table {table}, B's {b_table}]")
        got_freed = rollback(bm, a.block_table, keep_tokens)
        if not (isinstance(got_freed, list) and all(isinstance(x, int) for x in got_freed)):
            raise AssertionError(f"{what}: return the list of blocks that became free, got {got_freed!r} {where}")
        mistakes = {"keeping num_tokens // block_size blocks: the last kept block may be partly filled, so "
                    "keep the ceiling": lambda: sorted(floor_keep(*fresh(seed), keep_tokens)),
                    "freeing a block another table still holds (drop one reference; free it at 0)":
                        lambda: sorted(only_zeroed(*fresh(seed), keep_tokens))}
        with explained(sorted(got_freed), mistakes):
            assert_same_list(a.block_table, table[:keep], f"{what}: A's table afterwards (the "
                             f"ceil({keep_tokens} / {bm.block_size}) = {keep} blocks that hold the kept tokens)",
                             where)
            got_refs, got_free, got_hashes, got_hash_to_block = snapshot(bm)
            assert_same_list(got_refs, want_refs, f"{what}: ref counts per block (each dropped block loses one "
                             "reference, no other count changes)", where)
            assert_equal(sorted(got_freed), want_freed, f"{what}: the blocks that became free (any order)", where)
            assert_equal(sorted(got_free - free), want_freed, f"{what}: the blocks added to the free list", where)
            assert_equal(sorted(free - got_free), [], f"{what}: blocks taken off the free list", where)
            assert_equal(b.block_table, b_table, f"{what}: B's table", where)
            assert_equal((got_hashes, got_hash_to_block), (hashes, hash_to_block),
                         f"{what}: block hashes and hash -> block (a draft block was never hashed)", where)
        try:
            bm.check_invariants([a, b])
        except AssertionError as e:
            raise AssertionError(f"{what}: {e} {where}") from None


def front_first(bm, table, num_tokens):
    """A right answer in another order (first block first, each freed block to the front of the free list):
    the check must pass."""
    keep = -(-num_tokens // bm.block_size)
    freed = []
    for b in table[keep:]:
        bm.blocks[b].ref_count -= 1
        if bm.blocks[b].ref_count == 0:
            bm.free_block_ids[b] = None
            bm.free_block_ids.move_to_end(b, last=False)
            freed.append(b)
    del table[keep:]
    return freed


def test_9_4_rollback_frees_the_rejected_drafts_blocks(ex):
    check_rollback(ex.rollback_blocks)
    check_rollback(front_first)  # the state is checked, not the order of the free list
    assert_detects(check_rollback, floor_keep, "keep the ceiling")
    assert_detects(check_rollback, only_zeroed, "another table still holds")
