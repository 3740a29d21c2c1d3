"""models/hf_config: the one place for model-shape facts, across the ways configs spell them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from nanoengine import assets
from nanoengine.models import hf_config


def test_head_dim_and_kv_heads_with_and_without_the_fields():
    # Qwen3 sets head_dim != hidden / heads
    assert hf_config.head_dim(Qwen3Config(**assets.QWEN3_06B_DIMS)) == 128
    smol = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    assert hf_config.head_dim(smol) == 64 and hf_config.num_kv_heads(smol) == 3
    bare = SimpleNamespace(hidden_size=256, num_attention_heads=4, head_dim=None)
    assert hf_config.head_dim(bare) == 64 and hf_config.num_kv_heads(bare) == 4


def test_kv_bytes_per_token_by_hand():
    qwen = Qwen3Config(**assets.QWEN3_06B_DIMS)  # 28 layers x 8 KV heads x 128, K and V, bf16: 112 KiB
    assert hf_config.kv_bytes_per_token(qwen, 2) == 2 * 28 * 8 * 128 * 2 == 112 * 1024
    shape = hf_config.ModelShape.from_hf_config(qwen, 2)
    assert shape.kv_bytes_per_position == hf_config.kv_bytes_per_token(qwen, 2) and shape.qk_norm


def test_rope_theta_and_checkpoint_dtype_both_spellings():
    assert hf_config.rope_theta(
        SimpleNamespace(rope_parameters={"rope_theta": 5e5, "rope_type": "default"})) == 5e5
    assert hf_config.rope_theta(SimpleNamespace(rope_theta=1e4)) == 1e4
    assert hf_config.checkpoint_dtype(SimpleNamespace(dtype="bfloat16")) is torch.bfloat16
    assert hf_config.checkpoint_dtype(SimpleNamespace(dtype=None, torch_dtype=torch.float16)) is torch.float16
    assert hf_config.checkpoint_dtype(SimpleNamespace()) is torch.float32


@pytest.mark.xdist_group("tiny")
def test_the_runner_sizes_its_cache_with_it():
    from nanoengine import LLM

    llm = LLM("tiny-qwen3", num_kvcache_blocks=4, block_size=16)
    runner = llm.engine.executor.runner
    per_token = hf_config.kv_bytes_per_token(llm.plan.hf_config, runner.dtype.itemsize)
    assert llm.plan.kv_bytes_per_block == 16 * per_token
    assert runner.kv_cache.numel() * runner.kv_cache.element_size() == 4 * llm.plan.kv_bytes_per_block
