"""Exercises of book/10_mixture_of_experts.ipynb, checked against nanoengine's own MoE pieces
(nanoengine/layers/moe.py): the router (`route`) and the grouped expert forward (`grouped_experts`) on seeded
random inputs (random float logits: no ties between experts), and the expected number of experts a batch
reads, against its closed form and a seeded simulation. A wrong answer is also compared with the classic
mistakes, so the message can say which one it looks like; each test checks that it names them."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from ex_helpers import assert_close, assert_detects, assert_same_list, book, explained
from torch.overrides import TorchFunctionMode

from nanoengine.layers.moe import grouped_experts, route

CHAPTER = "ch10_mixture_of_experts"
pytestmark = pytest.mark.xdist_group("ex_ch10")
NB = "10_mixture_of_experts.ipynb"


# ---------------------------------------------------------------- 10.1
def router_cases():
    """(logits [T, E], top_k, norm_topk_prob): seeded, float32 and bfloat16, one token to many."""
    g = torch.Generator().manual_seed(10)
    cases = []
    for tokens, experts, k in ((1, 8, 2), (5, 8, 2), (7, 16, 4), (3, 4, 1), (6, 128, 8)):
        for norm in (True, False):
            cases.append((torch.randn(tokens, experts, generator=g) * 2, k, norm))
    cases.append((torch.randn(4, 8, generator=g).to(torch.bfloat16), 2, True))
    return cases


def softmax_after_topk(logits, top_k, norm_topk_prob):
    """The mistake: the top k logits first, then a softmax over those k only."""
    top, ids = torch.topk(logits.float(), top_k, dim=-1)
    return torch.softmax(top, dim=-1).to(logits.dtype), ids


def never_renormalized(logits, top_k, norm_topk_prob):
    """The mistake: norm_topk_prob ignored, the top-k probabilities never renormalized."""
    w, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    return w.to(logits.dtype), ids


def always_renormalized(logits, top_k, norm_topk_prob):
    """The mistake: the top-k probabilities renormalized even when norm_topk_prob is False."""
    w, ids = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(logits.dtype), ids


def first_of(mistake, *args):
    return mistake(*args)[0]


def check_route(fn) -> None:
    where = book(NB, "10.1")
    for logits, k, norm in router_cases():
        want_w, want_ids = route(logits, k, norm)
        got = fn(logits.clone(), k, norm)
        what = f"route(logits {tuple(logits.shape)} {logits.dtype}, top_k={k}, norm_topk_prob={norm})"
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"{what}: expected a tuple (weights, ids), got {type(got).__name__} {where}")
        w, ids = got
        variants = {
            "a softmax over the k chosen logits (after top-k instead of before): that is the renormalized "
            "weight, right only when norm_topk_prob is True":
                partial(first_of, softmax_after_topk, logits, k, norm),
            "ignoring norm_topk_prob: with True the k weights must be divided by their sum":
                partial(first_of, never_renormalized, logits, k, norm),
            "renormalizing although norm_topk_prob is False: then the weights are the softmax's own":
                partial(first_of, always_renormalized, logits, k, norm)}
        if not isinstance(ids, torch.Tensor) or ids.shape != want_ids.shape:
            raise AssertionError(f"{what}: ids should be a tensor of shape {tuple(want_ids.shape)}, got "
                                 f"{getattr(ids, 'shape', type(ids).__name__)} {where}")
        for t in range(ids.shape[0]):
            assert_same_list([int(i) for i in ids[t]], want_ids[t].tolist(),
                             f"{what}: token {t}'s experts (largest probability first)", where)
        with explained(w, variants):
            tol = 1e-2 if logits.dtype == torch.bfloat16 else 1e-6
            assert_close(w, want_w, f"{what}: weights", where, atol=tol, rtol=tol)


def test_10_1_route_matches_the_engines_router(ex):
    check_route(ex.route)
    assert_detects(check_route, softmax_after_topk, "after top-k")
    assert_detects(check_route, never_renormalized, "ignoring norm_topk_prob")
    assert_detects(check_route, always_renormalized, "renormalizing although")


# ---------------------------------------------------------------- 10.2
def expert_cases():
    """(x [T, H], weights [T, k], ids [T, k], w13 [E, 2I, H], w2 [E, H, I]), routed by the engine's router
    on seeded logits. One token routes to k of E experts, so most experts get no token at all."""
    g = torch.Generator().manual_seed(11)
    cases = []
    for tokens, experts, k, hidden, inter in ((1, 8, 2, 16, 8), (6, 8, 2, 16, 8), (9, 4, 1, 8, 12),
                                              (13, 16, 4, 32, 16)):
        x = torch.randn(tokens, hidden, generator=g)
        w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
        w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
        weights, ids = route(torch.randn(tokens, experts, generator=g) * 2, k, True)
        cases.append((x, weights, ids, w13, w2))
    return cases


def _expert(x, w13, w2, e, swap=False):
    inter = w2.shape[2]
    gate, up = F.linear(x, w13[e]).split(inter, dim=-1)
    if swap:
        gate, up = up, gate
    return F.linear(F.silu(gate) * up, w2[e])


def unweighted(x, weights, ids, w13, w2):
    """The mistake: the experts' outputs summed without the router's weights."""
    return torch.stack([sum(_expert(x[t], w13, w2, int(ids[t, j])) for j in range(ids.shape[1]))
                        for t in range(x.shape[0])])


def first_expert_only(x, weights, ids, w13, w2):
    """The mistake: only each token's first expert, not the sum over its k experts."""
    return torch.stack([weights[t, 0] * _expert(x[t], w13, w2, int(ids[t, 0])) for t in range(x.shape[0])])


def gate_up_swapped(x, weights, ids, w13, w2):
    """The mistake: silu on the up half and the gate half multiplying it."""
    return torch.stack([sum(weights[t, j] * _expert(x[t], w13, w2, int(ids[t, j]), swap=True)
                            for j in range(ids.shape[1])) for t in range(x.shape[0])])


def crashes_on_an_idle_expert(x, weights, ids, w13, w2):
    """The mistake: code that assumes every expert got a token."""
    for e in range(w13.shape[0]):
        if not (ids == e).any():
            raise IndexError("index 0 is out of bounds for dimension 0 with size 0")
    return grouped_experts(x, weights, ids, w13, w2)


def check_experts(fn) -> None:
    where = book(NB, "10.2")
    for x, weights, ids, w13, w2 in expert_cases():
        idle = [e for e in range(w13.shape[0]) if not (ids == e).any()]
        what = (f"grouped_experts(x {tuple(x.shape)}, ids {tuple(ids.shape)}, {w13.shape[0]} experts, "
                f"{len(idle)} with no token)")
        try:
            got = fn(x.clone(), weights.clone(), ids.clone(), w13, w2)
        except Exception as e:
            raise AssertionError(f"{what} raised {type(e).__name__}: {e}. Experts {idle} have no token in "
                                 "this batch: an expert with no token must be skipped, not crash "
                                 f"{where}") from e
        variants = {"forgetting the router's weights (each expert's output times weights[t, j])":
                        partial(unweighted, x, weights, ids, w13, w2),
                    "taking only each token's first expert: the output is the sum over its k experts":
                        partial(first_expert_only, x, weights, ids, w13, w2),
                    "swapping the gate and up halves of w13 (gate rows come first; silu goes on the gate)":
                        partial(gate_up_swapped, x, weights, ids, w13, w2)}
        with explained(got, variants):
            assert_close(got, grouped_experts(x, weights, ids, w13, w2), what, where, atol=1e-5, rtol=1e-4)


def test_10_2_grouped_experts_matches_the_engines_expert_forward(ex):
    check_experts(ex.grouped_experts)
    assert_detects(check_experts, unweighted, "forgetting the router's weights")
    assert_detects(check_experts, first_expert_only, "only each token's first expert")
    assert_detects(check_experts, gate_up_swapped, "swapping the gate and up")
    assert_detects(check_experts, crashes_on_an_idle_expert, "must be skipped, not crash")


MATMULS = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.einsum, torch.Tensor.__matmul__,
           torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm}


class CountMatmuls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func in MATMULS
        return func(*args, **(kwargs or {}))


def test_10_2_grouped_experts_runs_each_active_expert_once(ex):
    """One matmul per projection of each active expert, not one per (token, expert) pair."""
    x, weights, ids, w13, w2 = expert_cases()[3]
    with CountMatmuls() as counted:
        ex.grouped_experts(x, weights, ids, w13, w2)
    active = len(set(ids.flatten().tolist()))
    assert counted.calls <= 2 * active, (
        f"grouped_experts made {counted.calls} matrix products for {active} active experts ({ids.numel()} "
        f"(token, expert) pairs); gather the tokens of each expert and run it once on all of them: two "
        f"products per active expert (w13, then w2) {book(NB, '10.2')}")


# ---------------------------------------------------------------- 10.3
def expected_distinct(num_experts: int, top_k: int, batch: int) -> float:
    """The oracle: one token misses an expert with probability 1 - k/E, all B tokens with its B-th power."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def simulated(num_experts: int, top_k: int, batch: int, trials: int = 2000, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(trials, batch, num_experts, generator=g).argsort(-1)[..., :top_k]  # [N, B, k] distinct
    hit = torch.zeros(trials, num_experts, dtype=torch.bool)
    hit.scatter_(1, picks.reshape(trials, -1), True)
    return float(hit.sum(1).double().mean())


def upper_bound(num_experts, top_k, batch):
    """The mistake: min(E, B * k), as if no two tokens ever chose the same expert."""
    return float(min(num_experts, batch * top_k))


def with_replacement(num_experts, top_k, batch):
    """The mistake: one token's k picks treated as independent draws (with replacement)."""
    return num_experts * (1 - (1 - 1 / num_experts) ** (batch * top_k))


GRID = [(8, 2, 1), (8, 2, 4), (8, 2, 64), (128, 8, 1), (128, 8, 4), (128, 8, 16), (128, 8, 256), (64, 6, 10),
        (4, 4, 3)]


def check_expected(fn) -> None:
    where = book(NB, "10.3")
    for e, k, b in GRID:
        got = fn(e, k, b)
        want = expected_distinct(e, k, b)
        variants = {"min(E, B * k), an upper bound: tokens often choose the same expert":
                        partial(upper_bound, e, k, b),
                    "drawing one token's k experts independently (with replacement): its k experts are "
                    "distinct, so one token misses an expert with probability 1 - k/E":
                        partial(with_replacement, e, k, b)}
        with explained(got, variants, same=lambda a, w: isinstance(a, (int, float)) and abs(a - w) < 1e-6):
            if not isinstance(got, (int, float)) or abs(got - want) > 1e-6 * max(1.0, want):
                raise AssertionError(f"expected_active_experts(num_experts={e}, top_k={k}, batch={b}): yours "
                                     f"{got!r}, expected {want:.6f} {where}")


def test_10_3_expected_active_experts(ex):
    for e, k, b in ((8, 2, 4), (128, 8, 16)):  # the oracle itself against a seeded simulation
        assert abs(simulated(e, k, b) - expected_distinct(e, k, b)) < 0.02 * e
    check_expected(ex.expected_active_experts)
    assert_detects(check_expected, upper_bound, "an upper bound")
    assert_detects(check_expected, with_replacement, "with replacement")
