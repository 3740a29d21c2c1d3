"""Decoder-only models (Llama, Qwen3), chosen from config.json's `architectures`. Chapter 02."""

from nanoengine.models.registry import get_model_class

__all__ = ["get_model_class"]
