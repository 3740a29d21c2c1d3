"""Architecture registry: config.json's `architectures` -> model class. Chapter 02."""

from __future__ import annotations

from typing import Any

from nanoengine.errors import CheckpointError
from nanoengine.models.llama import LlamaForCausalLM
from nanoengine.models.qwen3 import Qwen3ForCausalLM
from nanoengine.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(hf_config: Any):
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in MODELS:
            return MODELS[arch]
    raise CheckpointError(f"unsupported architecture {archs or '(none in config.json)'}; "
                          f"nanoengine runs: {', '.join(MODELS)}")
