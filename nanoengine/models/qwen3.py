"""Qwen3: the Llama decoder plus a per-head RMSNorm on queries and keys before RoPE. Chapter 02."""

from nanoengine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
