"""How a tensor-parallel model's weights are split across ranks, and where a step communicates: a figure
drawn from a live sharded model (rank 0's ModelRunner.model). Chapter 07.

Each weight of one decoder layer (plus the embedding and the LM head) is a box; its coloured bands are the
ranks' shares: horizontal bands for rows (column-parallel q/k/v and gate/up, and the vocabulary rows of the
embedding and LM head), vertical bands for columns (row-parallel o_proj and down_proj). Under the boxes, the
step's data flow marks each collective: an all-reduce after the embedding, o_proj and down_proj, and the
gather of the logits on rank 0.
"""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

GAP = 1.7  # distance between two weights' boxes
RANK_COLORS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#72B7B2", "#EECA3B", "#9D755D"]


def _weights(model: Any) -> list[tuple[str, str, Any]]:
    """(label, how it is split, module) for the weights the figure draws, in the order a step uses them."""
    layer = model.layers[0]
    return [("embed_tokens", "vocab rows", model.embed_tokens),
            ("qkv_proj", "column (heads)", layer.self_attn.qkv_proj),
            ("o_proj", "row", layer.self_attn.o_proj),
            ("gate_up_proj", "column", layer.mlp.gate_up_proj),
            ("down_proj", "row", layer.mlp.down_proj),
            ("lm_head", "vocab rows", model.lm_head)]


def plot_tp_shards(model: Any, ax: Axes | None = None) -> Axes:
    """Draw how `model`'s weights are split over its tensor-parallel group (rank 0's copy of the model)."""
    size = model.embed_tokens.tp.size
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 4.2))
    weights = _weights(model)
    for i, (name, how, module) in enumerate(weights):
        x0 = i * GAP
        rows, cols = module.weight.shape  # this rank's share
        full = (rows * size, cols) if how != "row" else (rows, cols * size)
        parts = getattr(module, "part_sizes", {name: full[0]})
        top = 1.0
        for part, n in parts.items():  # parts stacked top to bottom, each split by rank
            h = n / full[0]
            for r in range(size):
                if how == "row":
                    ax.add_patch(Rectangle((x0 + r / size, 0), 1 / size, 1, color=RANK_COLORS[r % 8],
                                           ec="white"))
                else:
                    ax.add_patch(Rectangle((x0, top - (r + 1) * h / size), 1, h / size,
                                           color=RANK_COLORS[r % 8], ec="white", lw=0.8))
            if len(parts) > 1:
                ax.text(x0 - 0.05, top - h / 2, part, ha="right", va="center", fontsize=8)
            top -= h
        ax.add_patch(Rectangle((x0, 0), 1, 1, fill=False, ec="black", lw=1))
        ax.text(x0 + 0.5, 1.08, name, ha="center", fontsize=10, weight="bold")
        ax.text(x0 + 0.5, -0.06, f"{how}\n{full[0]} x {full[1]}\n{rows} x {cols} per rank", ha="center",
                va="top", fontsize=8)
    # the step's data flow, with its collectives
    y = -0.62
    steps = [("embed", "all-reduce"), ("q/k/v, attention\non its own heads", None), ("o_proj", "all-reduce"),
             ("gate/up, SwiGLU", None), ("down_proj", "all-reduce"), ("LM head", "gather to rank 0")]
    for i, (what, comm) in enumerate(steps):
        x = i * GAP + 0.5
        if i:
            ax.add_patch(FancyArrowPatch((x - GAP + 0.55, y), (x - 0.55, y), arrowstyle="->",
                                         mutation_scale=10))
        ax.text(x, y, what, ha="center", va="center", fontsize=8)
        if comm:
            ax.text(x, y - 0.2, comm, ha="center", va="center", fontsize=8, color="white", weight="bold",
                    bbox=dict(boxstyle="round", fc="#444444"))
    layers = len(model.layers)
    ax.text(2.5 * GAP + 0.5, y - 0.42,
            f"x {layers} decoder layers: {2 * layers + 1} all-reduces and 1 gather per step",
            ha="center", va="top", fontsize=9)
    ax.legend(handles=[Patch(color=RANK_COLORS[r % 8], label=f"rank {r}") for r in range(size)],
              loc="upper right", bbox_to_anchor=(1.0, 1.32), ncol=size, fontsize=9, frameon=False)
    ax.set_xlim(-0.6, len(weights) * GAP)
    ax.set_ylim(-1.15, 1.25)
    ax.axis("off")
    return ax
