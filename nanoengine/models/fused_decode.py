"""A decode step's decoder layers in one C++ call, on CPU: the CPU's analogue of a CUDA graph. Chapter 08.

Op by op, a decode step makes some twenty calls from Python per layer (linears, norms, rotary, the K/V
store, attention, views); at small batch each costs more in the interpreter and the dispatcher than in
arithmetic. `FusedDecode` hands the C++ kernels' `decode_layers` every layer's weights, norms and K/V
caches once, at construction, and a decode step then runs the whole stack in one call: the same kernels,
in the same order, on the same tensors, so the hidden states are bit for bit the layer-by-layer forward's.
Python keeps the embedding (and the runner the LM head).

It serves what it mirrors exactly: a Llama-family model (Qwen3's per-head q/k norms included) on the `cpu`
attention backend with the C++ kernels, one rank, and decode-only steps whose batch the linears' bf16 (or,
with quantization="int8", int8) copies take (or any batch when the model has none); with
prefill_dtype="bfloat16", batches above its row threshold go through oneDNN's bf16 matmul in C++ as in
Python. The plan's decode mode (`DecodeMode.FUSED_CPU`, nanoengine/plan.py) decides when the runner builds
it; `enforce_eager=True` turns it off, as it turns CUDA graphs off. A mixture-of-experts model has no fused
step yet (the plan decodes it eagerly): building one is an error.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from nanoengine.layers.linear import PackableLinear

if TYPE_CHECKING:
    from nanoengine.engine.inputs import ModelInput


def _linear(kernels: Any, layer: PackableLinear) -> Any:
    return kernels.Linear(packed=layer.bf16_weight, weight=layer.weight.detach(), bias=layer.bias,
                          out_features=layer.out_features, int8=layer.int8_weight,
                          int8_scales=layer.int8_scales, group_size=layer.int8_group_size,
                          onednn=layer.bf16_prefill_weight, onednn_min_rows=layer.bf16_min_rows)


class FusedDecode:
    def __init__(self, model: torch.nn.Module, kernels: Any) -> None:
        if not all(hasattr(layer.mlp, "gate_up_proj") for layer in model.layers):
            from nanoengine.errors import InvalidValueError

            raise InvalidValueError("FusedDecode: the fused C++ decode step runs dense SwiGLU MLPs only, and "
                                    "this model has a mixture of experts; decode it eagerly "
                                    "(enforce_eager=True, as the plan does for MoE models)")
        self.model = model
        self.kernels = kernels
        first = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.scale = first.attn.scale
        self.eps = model.norm.eps
        linears = [m for m in model.modules() if isinstance(m, PackableLinear) and m is not model.lm_head]
        # batches the linears' bf16 or int8 copies take (the layer-by-layer forward uses F.linear above them)
        copies = [m.int8_max_rows if m.int8_weight is not None else m.bf16_max_rows
                  for m in linears if m.bf16_weight is not None or m.int8_weight is not None]
        self.max_rows = min(copies) if copies else None
        self.layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
            self.layers.append(kernels.DecodeLayer(
                input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                q_norm=norms[0], k_norm=norms[1],
                qkv=_linear(kernels, attn.qkv_proj), o=_linear(kernels, attn.o_proj),
                gate_up=_linear(kernels, mlp.gate_up_proj), down=_linear(kernels, mlp.down_proj),
                k_cache=attn.attn.k_cache, v_cache=attn.attn.v_cache))
        self.times: torch.Tensor | None = None  # [linears, attention] seconds while `timed()` is open
        self.untimed = torch.empty(0, dtype=torch.float64)  # what decode_layers gets otherwise

    def can_run(self, inp: ModelInput) -> bool:
        return inp.is_decode_only and (self.max_rows is None or inp.num_tokens <= self.max_rows)

    def __call__(self, inp: ModelInput) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of a decode-only step (what the model's forward returns)."""
        x = self.model.embed_tokens(inp.input_ids)  # [B, hidden]
        rotary = self.model.rotary_emb
        attn = inp.attn
        return self.kernels.decode_layers(
            x, inp.positions, attn.slot_mapping, attn.decode_block_tables, attn.decode_context_lens,
            self.layers, self.model.norm.weight, rotary.cos, rotary.sin, self.num_heads, self.num_kv_heads,
            self.head_dim, self.eps, self.scale, self.times if self.times is not None else self.untimed)

    @contextmanager
    def timed(self):
        """Seconds the fused steps spend in linears and in attention while open: yields {"linears",
        "attention"} (filled when the context closes); the step profile's split (bench/step_profile.py)."""
        self.times = torch.zeros(2, dtype=torch.float64)
        totals: dict[str, float] = {}
        try:
            yield totals
        finally:
            totals["linears"], totals["attention"] = self.times.tolist()
            self.times = None
