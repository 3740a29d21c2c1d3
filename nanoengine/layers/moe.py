"""Mixture of experts: a router picks top_k of E SwiGLU experts per token, and their outputs are summed with
the router's weights (Qwen3-MoE; chapter 10).

    logits = x @ gate^T                      # [T, E]
    probs  = softmax(logits in float32)      # [T, E]
    w, ids = topk(probs, k)                  # [T, k]   (w / w.sum() when norm_topk_prob)
    y[t]   = sum_j w[t, j] * expert_{ids[t, j]}(x[t]),   expert_e(x) = down_e(silu(gate_e x) * up_e x)

`route` is the router, `grouped_experts` the expert forward on torch: the T * k (token, expert) pairs are
sorted by expert, so that each expert's tokens are one contiguous block, and each active expert runs one
matmul over its block (the count per expert comes from `bincount`); the outputs, scaled by their weights,
are added back into their tokens' rows with `index_add_`. Same ops, same order per token as transformers'
Qwen3MoeExperts (expert by expert, ascending), so float32 results agree. This is the seam a kernel replaces
(the CPU decode kernel, Triton's fused MoE): a function with `grouped_experts`' signature, handed to
`SparseMoeBlock` / `FusedMoE` when the model is built (the model's `make_mlp` picks it).

The experts' weights are stacked, one tensor per projection, as vLLM's FusedMoE holds them:
`w13_weight` [E, 2 * I, H] (each expert's gate rows, then its up rows: one matmul per expert) and
`w2_weight` [E, H, I]. The checkpoint's per-expert tensors (`experts.{e}.gate_proj.weight`, ...) load into
their expert's slice (`expert_checkpoint_name` maps the names).

Across N ranks (chapter 07) the experts split one of two ways; either way every rank sees every token (the
hidden states are whole after attention's all-reduce), the router `gate` is replicated, and the ranks' partial
outputs are summed by ONE all-reduce after the experts:
- tensor parallelism (the default): each rank holds 1/N of every expert's intermediate rows (gate/up
  column-parallel, down row-parallel, as the dense MLP): w13 [E, 2I/N, H], w2 [E, H, I/N];
- expert parallelism (`TPGroup.expert_parallel`, vLLM's enable_expert_parallel): rank r holds whole experts
  [r*E/N, (r+1)*E/N): w13 [E/N, 2I, H], w2 [E/N, H, I], and computes only the (token, expert) pairs routed to
  them (the expert forward runs on those pairs, one row each); the loader skips the other experts' tensors
  without reading them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.layers.activation import silu_and_mul
from nanoengine.layers.linear import PackableLinear, checkpoint_shape
from nanoengine.layers.tp_group import SINGLE, TPGroup

if TYPE_CHECKING:
    from nanoengine.models.hf_config import MoEConfig

# checkpoint name of one expert's projection -> (layer prefix, expert, projection)
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_OURS = {"gate_proj": ("w13_weight", "gate"), "up_proj": ("w13_weight", "up"),
         "down_proj": ("w2_weight", "down")}

ExpertsForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                          torch.Tensor]


def expert_checkpoint_name(name: str) -> tuple[str, tuple[int, str]] | None:
    """`layers.0.mlp.experts.3.gate_proj.weight` -> (`layers.0.mlp.experts.w13_weight`, (3, "gate")); None
    for any other tensor name."""
    m = _EXPERT_NAME.match(name)
    if m is None:
        return None
    param, part = _OURS[m.group(3)]
    return f"{m.group(1)}.{param}", (int(m.group(2)), part)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64): softmax in
    float32, the top k, renormalized to sum to 1 when norm_topk_prob (as transformers' Qwen3MoeTopKRouter)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token: x [T, H], weights and ids [T, k],
    w13 [E, 2I, H], w2 [E, H, I] -> [T, H]. The (token, expert) pairs sorted by expert, one matmul per
    active expert (see the module docstring)."""
    num_tokens, top_k = ids.shape
    flat = ids.flatten()  # [T * k]
    order = flat.argsort(stable=True)  # [T * k]: pairs grouped by expert, in token order within one
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # [E] on the host: the groups' sizes
    tokens = order // top_k  # [T * k]: the token of each sorted pair
    xs = x[tokens]  # [T * k, H]
    ys = torch.empty_like(xs)  # [T * k, H]
    start = 0
    for expert, n in enumerate(counts):
        if n:
            h = silu_and_mul(F.linear(xs[start:start + n], w13[expert]))  # [n, I]
            ys[start:start + n] = F.linear(h, w2[expert])  # [n, H]
            start += n
    ys *= weights.flatten()[order, None]  # [T * k, H]
    return torch.zeros_like(x).index_add_(0, tokens, ys)  # [T, H]


class MoEPieces(NamedTuple):
    """What an MoE layer computes with: the router and the expert forward. The engine's are `route` and
    `grouped_experts`; a kernel (Triton's fused MoE, a CPU decode kernel) or the learner's chapter 10 pieces
    replace them through EngineParts.moe (engine/parts.py), handed to the model when it is built."""
    route: Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]] = route
    experts: ExpertsForward = grouped_experts


ENGINE_MOE = MoEPieces()  # the engine's own


class FusedMoE(nn.Module):
    """E SwiGLU experts with stacked weights (w13 [E, 2I, H], w2 [E, H, I], this rank's share of them: see
    the module docstring); `forward(x, weights, ids)` runs `experts_forward` (grouped_experts on torch, or a
    kernel with its signature) and sums the ranks' outputs."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup = SINGLE,
                 experts_forward: ExpertsForward = grouped_experts) -> None:
        super().__init__()
        self.num_experts, self.hidden, self.tp = num_experts, hidden, tp
        if tp.expert_parallel:  # whole experts [first_expert, first_expert + local_experts)
            self.first_expert, self.local_experts = tp.shard(num_experts)
            self.intermediate = intermediate
        else:  # every expert, this rank's rows of each
            self.first_expert, self.local_experts = 0, num_experts
            self.intermediate = intermediate // tp.size
        self.w13_weight = nn.Parameter(torch.empty(self.local_experts, 2 * self.intermediate, hidden),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.local_experts, hidden, self.intermediate),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.experts_forward = experts_forward
        # what the loader must fill (report_mismatch): every part of this rank's experts
        mine = range(self.first_expert, self.first_expert + self.local_experts)
        self.expected_parts = {
            "w13_weight": [f"{e}:{p}" for e in mine for p in ("gate", "up")],
            "w2_weight": [f"{e}:down" for e in mine],
        }

    def weight_loader(self, param: nn.Parameter, loaded, shard: tuple[int, str]) -> None:
        """One expert's gate, up or down projection (its rank's share) into its slice of the stack; another
        rank's expert (expert parallelism) is skipped unread."""
        expert, part = shard
        full = checkpoint_shape(loaded)
        inter = self.intermediate if self.tp.expert_parallel else self.intermediate * self.tp.size
        want = (self.hidden, inter) if part == "down" else (inter, self.hidden)
        if not 0 <= expert < self.num_experts or full != want:
            raise ValueError(f"expert {expert} {part}: expected expert < {self.num_experts} and shape "
                             f"{want}, checkpoint has {full}")
        local = expert - self.first_expert
        if not 0 <= local < self.local_experts:
            return  # another rank's expert
        whole = self.tp.expert_parallel  # this rank holds the whole expert
        if part == "down":
            param.data[local].copy_(loaded[...] if whole else self.tp.columns(loaded, inter))
        else:
            first = 0 if part == "gate" else self.intermediate
            rows = loaded[...] if whole else self.tp.rows(loaded, inter)
            param.data[local, first:first + self.intermediate].copy_(rows)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x, weights, ids))  # [T, H]: the ranks' parts summed

    def partial(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of the output [T, H] (the whole of it on one rank). Tensor parallelism: every
        pair through this rank's rows of its expert. Expert parallelism: the (token, expert) pairs routed to
        this rank's experts only, each as one row with one expert (top_k 1), summed into their tokens' rows
        (zeros for a token none of whose experts is here)."""
        if self.local_experts == self.num_experts:
            return self.experts_forward(x, weights, ids, self.w13_weight, self.w2_weight)  # [T, H]
        local = ids - self.first_expert  # [T, k]: this rank's expert index
        token, slot = ((local >= 0) & (local < self.local_experts)).nonzero(as_tuple=True)  # [P] each
        out = torch.zeros_like(x)  # [T, H]
        if token.numel():
            ys = self.experts_forward(x[token], weights[token, slot, None], local[token, slot, None],
                                      self.w13_weight, self.w2_weight)  # [P, H]
            out.index_add_(0, token, ys)
        return out


class SparseMoeBlock(nn.Module):
    """The MLP of an MoE decoder layer: the router `gate` (a replicated linear, checkpoint `mlp.gate`) and
    the `experts`."""

    def __init__(self, hidden: int, moe: MoEConfig, tp: TPGroup = SINGLE,
                 pieces: MoEPieces = ENGINE_MOE) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.route = pieces.route
        self.gate = PackableLinear(hidden, moe.num_experts, bias=False)
        self.experts = FusedMoE(moe.num_experts, hidden, moe.intermediate, tp, pieces.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        weights, ids = self.route(self.gate(x), self.top_k, self.norm_topk_prob)  # [T, k] each
        return self.experts(x, weights, ids)  # [T, hidden]
