"""Resolving engine options into an EnginePlan without loading a model, for the config and graphs tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_hf_config():
    from transformers import Qwen3Config

    from nanoengine import assets

    return Qwen3Config(**assets.TINY_QWEN3_DIMS)


def plan_of(hf_config: Any = None, **options: Any):
    """The EnginePlan build_engine would make of these options for a model config (tiny-qwen3's by
    default)."""
    from nanoengine import pieces
    from nanoengine.config import EngineConfig
    from nanoengine.plan import resolve_plan

    config = EngineConfig(**options)
    chosen = pieces.selected(config.use_exercises, config.exercises_dir)
    return resolve_plan(config, hf_config if hf_config is not None else tiny_hf_config(), Path("."), chosen)
