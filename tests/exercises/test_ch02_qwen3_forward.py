"""Exercises of book/02_qwen3_forward.ipynb, checked against transformers' Qwen3 modules and nanoengine's
layers on seeded random inputs."""

from __future__ import annotations

import pytest
import torch
from ex_helpers import assert_close, book

CHAPTER = "ch02_qwen3_forward"
pytestmark = pytest.mark.xdist_group("ex_ch02")
NB = "02_qwen3_forward.ipynb"


def small_qwen3_config(num_heads=4, num_kv_heads=2, head_dim=16, layers=2, vocab=1000):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                       num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                       max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, initializer_range=0.2)


def randomize_norms(model, gen):
    """transformers initializes RMSNorm weights to 1; make them random so a missing weight shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2_1_rms_norm_matches_transformers(ex, dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    where = book(NB, "2.1")
    gen = torch.Generator().manual_seed(21)
    # scale 1e-3: mean(x^2) ~ 1e-6, where eps matters; a zero row must not divide by zero
    for shape, eps, scale in [((5, 48), 1e-6, 3.0), ((3, 4, 16), 1e-5, 1.0), ((1, 576), 1e-5, 1.0),
                              ((6, 32), 1e-6, 1e-3)]:
        norm = Qwen3RMSNorm(shape[-1], eps=eps)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(shape[-1], generator=gen))
        norm = norm.to(dtype)
        x = scale * torch.randn(shape, generator=gen)
        if scale < 1:
            x[0] = 0
        x = x.to(dtype)
        with torch.no_grad():
            want = norm(x)
        got = ex.rms_norm(x, norm.weight.detach(), eps)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert_close(got, want, f"rms_norm of a {dtype} {tuple(shape)} input of scale {scale:g}, eps={eps:g}", where, atol=tol, rtol=tol)


def test_2_2_rope_matches_transformers_and_nanoengine(ex):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    from nanoengine.layers.rotary import RotaryEmbedding

    where = book(NB, "2.2")
    gen = torch.Generator().manual_seed(22)
    for head_dim, theta, heads in [(16, 10000.0, 4), (32, 1_000_000.0, 2), (64, 100000.0, 3)]:
        T = 11
        positions = torch.randint(0, 900, (T,), generator=gen)
        x = torch.randn(T, heads, head_dim, generator=gen)
        config = small_qwen3_config(head_dim=head_dim)
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
        cos, sin = Qwen3RotaryEmbedding(config)(x, positions[None])  # [1, T, D]
        want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
        want = want[0].transpose(0, 1)  # [T, heads, D]
        got = ex.apply_rope(x, positions, theta)
        assert_close(got, want, f"RoPE (head_dim={head_dim}, theta={theta:g}) vs transformers", where, atol=1e-4)
        ours, _ = RotaryEmbedding(head_dim, 1024, theta)(positions, x, x)
        assert_close(got, ours, f"RoPE (head_dim={head_dim}, theta={theta:g}) vs nanoengine", where, atol=1e-4)
    # position 0 is no rotation
    x = torch.randn(1, 2, 16, generator=gen)
    assert_close(ex.apply_rope(x, torch.zeros(1, dtype=torch.long), 10000.0), x, "RoPE at position 0", where)


@pytest.mark.parametrize("heads,kv_heads,T", [(4, 2, 13), (6, 1, 7), (3, 3, 1), (8, 2, 40)])
def test_2_3_causal_gqa_attention_matches_sdpa(ex, heads, kv_heads, T):
    import torch.nn.functional as F

    where = book(NB, "2.3")
    gen = torch.Generator().manual_seed(heads * 100 + T)
    D = 16
    q = torch.randn(T, heads, D, generator=gen)
    k = torch.randn(T, kv_heads, D, generator=gen)
    v = torch.randn(T, kv_heads, D, generator=gen)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True, enable_gqa=True).transpose(0, 1)
    got = ex.causal_gqa_attention(q, k, v)
    assert_close(got, want, f"attention with {heads} query heads, {kv_heads} kv heads, {T} tokens", where,
                 atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)])
def test_2_4_decoder_layer_matches_transformers(ex, heads, kv_heads):
    from transformers import Qwen3ForCausalLM

    where = book(NB, "2.4")
    gen = torch.Generator().manual_seed(24 + kv_heads)
    config = small_qwen3_config(num_heads=heads, num_kv_heads=kv_heads)
    torch.manual_seed(24)
    model = Qwen3ForCausalLM(config).eval()
    randomize_norms(model, gen)
    T = 9
    x = torch.randn(T, config.hidden_size, generator=gen)
    positions = torch.arange(T)
    for i, layer in enumerate(model.model.layers):
        with torch.no_grad():
            pe = model.model.rotary_emb(x[None], positions[None])
            want = layer(x[None], attention_mask=None, position_ids=positions[None], position_embeddings=pe)
            want = (want[0] if isinstance(want, tuple) else want)[0]  # [T, hidden]
            got = ex.decoder_layer(layer, x, positions, config)
        assert_close(got, want, f"decoder layer {i} output ({heads} heads, {kv_heads} kv heads)", where, atol=1e-4,
                     rtol=1e-4)


def test_2_5_logits_match_transformers(ex):
    from transformers import Qwen3ForCausalLM

    where = book(NB, "2.5")
    gen = torch.Generator().manual_seed(25)
    config = small_qwen3_config(layers=3)
    torch.manual_seed(25)
    model = Qwen3ForCausalLM(config).eval()
    randomize_norms(model, gen)
    ids = torch.randint(0, config.vocab_size, (12,), generator=gen)
    with torch.no_grad():
        want = model(ids[None]).logits[0].float()  # [T, vocab]
    got = ex.qwen3_logits(model, ids)
    assert_close(got, want, "logits of a 3-layer Qwen3 on 12 tokens", where, atol=1e-4, rtol=1e-4)
