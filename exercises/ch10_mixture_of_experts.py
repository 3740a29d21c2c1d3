# Your exercises for book/10_mixture_of_experts.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch10")`, from nanoengine.check) or: pytest tests/exercises/test_ch10_mixture_of_experts.py
# Generated from solutions/ch10_mixture_of_experts.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
"""Chapter 10, book/10_mixture_of_experts.ipynb: mixture of experts.

Exercise 10.1: the router: softmax over the experts, the top k, renormalized when norm_topk_prob.
Exercise 10.2: the grouped expert forward: each expert runs once, on the tokens routed to it.
Exercise 10.3: how many experts a decode batch of B tokens reads, when routing is uniform.

10.1 and 10.2 plug into the engine (`use_exercises=["ch10"]` on an MoE model): every MoE layer routes with
your router and runs its experts with your forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 10.1: the router: logits [T, E] -> (weights [T, k], expert ids [T, k]).

    Softmax over the E experts in float32, then each token's k largest probabilities and their experts
    (largest first); when norm_topk_prob, divide the k weights by their sum so that they add up to 1. The
    weights come back in the logits' dtype, the ids as int64.
    """
    raise NotImplementedError("Exercise 10.1: the router: logits [T, E] -> (weights [T, k], expert ids [T, k]) - see book/10_mixture_of_experts.ipynb")


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor) -> torch.Tensor:
    """Exercise 10.2: y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t.

    x [T, H]; weights and ids [T, k]; w13 [E, 2I, H] holds each expert's gate rows then its up rows, w2
    [E, H, I] its down projection: expert_e(x) = w2[e] @ (silu(gate) * up), with gate, up = (w13[e] @ x)
    split in two halves of I. Run each expert once, on all the tokens routed to it (an expert no token chose
    does not run), and add each output, times its weight, into its token's row. Returns [T, H].
    """
    raise NotImplementedError("Exercise 10.2: y[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t - see book/10_mixture_of_experts.ipynb")


def expected_active_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Exercise 10.3: the expected number of distinct experts one layer reads for a batch of tokens.

    Each of the `batch` tokens picks top_k different experts of num_experts uniformly at random,
    independently of the other tokens. (Not min(num_experts, batch * top_k): tokens often pick the same
    expert.)
    """
    raise NotImplementedError("Exercise 10.3: the expected number of distinct experts one layer reads for a batch of tokens - see book/10_mixture_of_experts.ipynb")
