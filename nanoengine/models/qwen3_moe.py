"""Qwen3-MoE (Qwen3-30B-A3B's architecture): Qwen3's attention, and in every decoder layer a mixture of
SwiGLU experts in place of the dense MLP (layers/moe.py). Chapter 10.

The config's MoE fields are read and checked once (`hf_config.moe_config`): a field the engine does not
implement (shared experts, dense layers among the sparse ones) is a CheckpointError when the model is built.
The checkpoint's per-expert tensors load into the stacked expert weights through `expert_checkpoint_name`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from torch import nn

from nanoengine.layers.moe import SparseMoeBlock, expert_checkpoint_name
from nanoengine.layers.tp_group import TPGroup
from nanoengine.models import hf_config
from nanoengine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    checkpoint_name = staticmethod(expert_checkpoint_name)  # the loader's hook for the experts' tensors

    def make_mlp(self, config: Any, kernels: ModuleType | None, tp: TPGroup) -> nn.Module:
        moe = hf_config.moe_config(config)
        if moe is None:
            from nanoengine.errors import CheckpointError

            raise CheckpointError("config.json names Qwen3MoeForCausalLM but no experts (num_experts is 0 or "
                                  "missing); a dense Qwen3 checkpoint is Qwen3ForCausalLM")
        # the router and the expert forward the engine was assembled with (EngineParts.moe)
        return SparseMoeBlock(config.hidden_size, moe, tp, self.moe_pieces)
