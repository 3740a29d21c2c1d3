"""Mixture of experts, from a real run: which experts each step's tokens were routed to. Chapter 10.

- `record_routing(model)`: a context manager that puts a forward hook on the router (`gate`) of every
  `SparseMoeBlock` of a built model and keeps, per forward and per MoE layer, the expert ids its tokens were
  routed to (the block's own `route` applied to the gate's logits: the ids the block used);
- `RoutingRecord.counts`: those as tokens per expert, [forwards, layers, experts]; `imbalance`: max over
  mean tokens per expert, per forward and layer (1.0 is a perfect balance; E / k when every token of the
  forward went to the same k experts);
- `RoutingView(record)`: an ipywidgets view with a slider over layers: a heat map of tokens per expert
  (rows: engine steps, columns: experts) and each step's imbalance beside it.
Hooks only: the engine is not changed, and never imports this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import ipywidgets as widgets
import torch
import traitlets
from torch import nn

from nanoengine.errors import InvalidValueError
from nanoengine.layers.moe import SparseMoeBlock
from nanoengine.viz.html import FONT


@dataclass
class RoutingRecord:
    """Per model forward, per MoE layer, the routed expert ids [T, k] (filled by `record_routing`)."""
    num_experts: int
    layers: list[str]  # the MoE blocks' module names, in model order
    forwards: list[list[torch.Tensor]] = field(default_factory=list)  # [forward][layer] -> ids [T, k]

    @property
    def counts(self) -> torch.Tensor:
        """Tokens routed to each expert: [forwards, layers, experts] (a token counts once per expert of its
        top k)."""
        out = torch.zeros(len(self.forwards), len(self.layers), self.num_experts, dtype=torch.long)
        for f, per_layer in enumerate(self.forwards):
            for layer, ids in enumerate(per_layer):
                out[f, layer] = torch.bincount(ids.flatten(), minlength=self.num_experts)
        return out

    @property
    def imbalance(self) -> torch.Tensor:
        """max / mean tokens per expert, [forwards, layers]: how much longer the busiest expert works than an
        even split would make it."""
        counts = self.counts.double()  # [F, L, E]
        return counts.amax(-1) / counts.mean(-1).clamp(min=1e-12)


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecord]:
    """Record the routing of every forward of `model` while inside the `with` (see the module docstring)."""
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)]
    if not blocks:
        raise InvalidValueError("record_routing: the model has no SparseMoeBlock (a dense model routes "
                                "nothing); load an MoE model such as 'tiny-qwen3-moe'")
    record = RoutingRecord(blocks[0][1].gate.out_features, [name for name, _ in blocks])
    pending: dict[int, torch.Tensor] = {}

    def hook_for(layer: int, block: SparseMoeBlock):
        def hook(_module: nn.Module, _inputs: tuple, logits: torch.Tensor) -> None:
            _, ids = block.route(logits, block.top_k, block.norm_topk_prob)  # [T, k]
            pending[layer] = ids.detach().cpu()
            if layer == len(blocks) - 1:  # the last MoE layer: one forward is complete
                record.forwards.append([pending[i] for i in range(len(blocks))])
                pending.clear()
        return hook

    handles = [block.gate.register_forward_hook(hook_for(i, block)) for i, (_, block) in enumerate(blocks)]
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


def heatmap_html(counts: torch.Tensor, imbalance: torch.Tensor, title: str) -> str:
    """counts [steps, experts] as an HTML table, each step's row shaded from white (0 tokens) to dark blue
    (its busiest expert), with the step's imbalance (max / mean) in the last column."""
    head = "".join(f"<th style='padding:0 3px'>e{e}</th>" for e in range(counts.shape[1]))
    rows = []
    for s in range(counts.shape[0]):
        cells = []
        top = max(int(counts[s].max()), 1)
        for e in range(counts.shape[1]):
            n = int(counts[s, e])
            shade = 1 - n / top
            rgb = f"rgb({int(25 + 230 * shade)},{int(118 + 137 * shade)},{int(210 + 45 * shade)})"
            ink = "#fff" if n / top > 0.55 else "#222"
            cells.append(f"<td title='step {s}, expert {e}: {n} tokens' style='background:{rgb};color:{ink};"
                         f"text-align:center;min-width:26px'>{n or ''}</td>")
        rows.append(f"<tr><th style='padding-right:6px'>{s}</th>{''.join(cells)}"
                    f"<td style='padding-left:8px'>{float(imbalance[s]):.2f}</td></tr>")
    return (f"<div style='{FONT}'><b>{title}</b><table style='border-collapse:collapse'>"
            f"<tr><th>step</th>{head}<th style='padding-left:8px'>max/mean</th></tr>{''.join(rows)}"
            "</table></div>")


class RoutingView(widgets.VBox):
    """Tokens per expert per engine step, one MoE layer at a time (`view.layer = i`, or the slider)."""

    layer = traitlets.Int(0)

    def __init__(self, record: RoutingRecord, layer: int = 0) -> None:
        if not record.forwards:
            raise InvalidValueError("RoutingView: the record has no forward; run the model inside "
                                    "`with record_routing(model) as record:` first")
        super().__init__()
        self.record, self.counts, self.imbalance = record, record.counts, record.imbalance
        slider = widgets.IntSlider(value=layer, min=0, max=len(record.layers) - 1, description="MoE layer",
                                   continuous_update=True, layout=widgets.Layout(width="420px"))
        widgets.link((slider, "value"), (self, "layer"))
        self._table = widgets.HTML()
        self.children = [slider, self._table]
        self.layer = layer
        self._draw()

    @traitlets.validate("layer")
    def _valid_layer(self, proposal):
        value = proposal["value"]
        if not 0 <= value < len(self.record.layers):
            raise InvalidValueError(f"RoutingView: layer {value} is not in 0..{len(self.record.layers) - 1}")
        return value

    @traitlets.observe("layer")
    def _on_layer(self, _change) -> None:
        self._draw()

    def _draw(self) -> None:
        counts = self.counts[:, self.layer]  # [steps, E]
        tokens = int(counts.sum(-1).max())
        self._table.value = heatmap_html(counts, self.imbalance[:, self.layer],
                                         f"{self.record.layers[self.layer]}: tokens routed to each expert "
                                         f"(up to {tokens} token-expert pairs per step; each row shaded "
                                         "to its busiest expert)")
