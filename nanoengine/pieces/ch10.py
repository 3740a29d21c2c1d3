"""Chapter 10's pieces in the engine: an MoE layer's router (your 10.1) and its expert forward (your 10.2).

`moe_pieces(module)` is a `MoEPieces` (nanoengine/layers/moe.py) on your `route` and `grouped_experts`,
which `engine.parts.assemble` hands to the model when it is built: every `SparseMoeBlock` routes its tokens
with yours and runs its experts with yours. They run inside the model's forward, eagerly (the plan allows no
torch.compile and no CUDA graphs around them), and only on a mixture-of-experts model (the plan refuses
use_exercises=["ch10"] on a dense one, where they would never run). What they return is checked on every
call: weights and ids of shape [T, k], ids in range, an output of x's shape and dtype.
"""

from __future__ import annotations

from types import ModuleType

import torch

from nanoengine.layers.moe import MoEPieces
from nanoengine.pieces.learner import check_result, piece


def moe_pieces(module: ModuleType) -> MoEPieces:
    route = piece(module, "route", "ch10")
    grouped_experts = piece(module, "grouped_experts", "ch10")

    def learner_route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor,
                                                                                         torch.Tensor]:
        out = route(logits, top_k, norm_topk_prob)
        want = (logits.shape[0], top_k)
        ok = (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
              and tuple(out[0].shape) == want and tuple(out[1].shape) == want)
        check_result(ok, route, f"{_describe(out)} for logits {tuple(logits.shape)}, top_k={top_k}; it must "
                                f"return (weights, ids), two tensors of shape {want}")
        weights, ids = out
        in_range = ids.numel() == 0 or (not ids.is_floating_point() and 0 <= int(ids.min())
                                        and int(ids.max()) < logits.shape[1])
        check_result(in_range, route, f"expert ids outside 0..{logits.shape[1] - 1} (or not integers): "
                                      f"{ids.flatten()[:8].tolist()}")
        return weights.to(logits.dtype), ids.long()

    def learner_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor) -> torch.Tensor:
        out = grouped_experts(x, weights, ids, w13, w2)
        check_result(isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == x.dtype,
                     grouped_experts, f"{_describe(out)} for x {tuple(x.shape)} {x.dtype}; it must return a "
                                      "tensor of x's shape and dtype")
        return out

    return MoEPieces(learner_route, learner_experts)


def _describe(out: object) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)} {out.dtype}"
    if isinstance(out, tuple):
        return "(" + ", ".join(_describe(o) for o in out) + ")"
    return type(out).__name__
