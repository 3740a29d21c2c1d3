"""Exercises of chapter 02 (book/02a_layer_parts.ipynb .. 02b_layer_and_forward.ipynb), checked against
transformers' Qwen3 modules and nanoengine's layers on seeded random inputs. A wrong answer is also compared
with the classic mistakes (the weight applied before the cast back, interleaved RoPE, `repeat` for GQA,
q/k-norm after RoPE, the embedding as an untied model's LM head), so the message can say which one it looks
like; each test also checks that it names them."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from ex_helpers import assert_close, assert_detects, book, explained, same_answer

from nanoengine.models.hf_config import rope_theta

CHAPTER = "ch02_qwen3_forward"
pytestmark = pytest.mark.xdist_group("ex_ch02")
NB = "02a_layer_parts.ipynb"  # (a message names the part that sets its exercise: ex_helpers.book)


def small_qwen3_config(num_heads=4, num_kv_heads=2, head_dim=16, layers=2, vocab=1000, tied=True):
    from transformers import Qwen3Config

    # hidden 48, heads x head_dim 64: H * D need not equal the hidden size (Qwen3-0.6B: 16 x 128 vs 1024)
    return Qwen3Config(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
                       num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                       max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=tied, initializer_range=0.2)


# ------------------------------------------------------------------------------ the classic mistakes
def norm_weight_first(x, weight, eps):
    """RMSNorm that multiplies by the weight in float32, then casts back (transformers casts, then multiplies)."""
    xf = x.float()
    return (weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_rms_norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_rope(x, positions, theta, layout="rotate_half"):
    """RoPE in float32; `interleaved` pairs dimensions (2i, 2i+1) instead of (i, i + D/2)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)  # [D/2]
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    xf = x.float()
    a, b = (xf[..., 0::2], xf[..., 1::2]) if layout == "interleaved" else xf.chunk(2, dim=-1)
    ra, rb = a * cos - b * sin, b * cos + a * sin
    out = torch.stack((ra, rb), -1).flatten(-2) if layout == "interleaved" else torch.cat((ra, rb), -1)
    return out.to(x.dtype)


def rope_interleaved(x, positions, theta):
    return ref_rope(x, positions, theta, "interleaved")


def ref_attention(q, k, v, mode="engine"):
    """Causal GQA attention in float32; `repeat` gives query head h kv head h % KVH (not h // group)."""
    group = q.shape[1] // k.shape[1]
    k, v = (k.repeat(1, group, 1), v.repeat(1, group, 1)) if mode == "repeat" else \
        (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().transpose(0, 1),
                                         v.float().transpose(0, 1), is_causal=True)
    return out.transpose(0, 1).to(q.dtype)


def attention_repeat(q, k, v):
    return ref_attention(q, k, v, "repeat")


def ref_decoder_layer(layer, x, positions, config, mode="engine"):
    """One Qwen3 decoder layer; `norm_after_rope` applies q/k-norm to the rotated heads."""
    T = x.shape[0]
    H, KVH, D, eps = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.rms_norm_eps
    theta = rope_theta(config)
    attn, mlp = layer.self_attn, layer.mlp
    h = ref_rms_norm(x, layer.input_layernorm.weight, eps)
    q = F.linear(h, attn.q_proj.weight).view(T, H, D)
    k = F.linear(h, attn.k_proj.weight).view(T, KVH, D)
    v = F.linear(h, attn.v_proj.weight).view(T, KVH, D)
    if mode == "norm_after_rope":
        q, k = ref_rope(q, positions, theta), ref_rope(k, positions, theta)
        q, k = ref_rms_norm(q, attn.q_norm.weight, eps), ref_rms_norm(k, attn.k_norm.weight, eps)
    else:
        q, k = ref_rms_norm(q, attn.q_norm.weight, eps), ref_rms_norm(k, attn.k_norm.weight, eps)
        q, k = ref_rope(q, positions, theta), ref_rope(k, positions, theta)
    x = x + F.linear(ref_attention(q, k, v).reshape(T, H * D), attn.o_proj.weight)
    h = ref_rms_norm(x, layer.post_attention_layernorm.weight, eps)
    return x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                        mlp.down_proj.weight)


def layer_norm_after_rope(layer, x, positions, config):
    return ref_decoder_layer(layer, x, positions, config, "norm_after_rope")


def logits_tied_head(model, input_ids):
    """The forward pass with the embedding matrix as LM head, whether or not the model ties them."""
    inner, config = model.model, model.config
    x = inner.embed_tokens.weight[input_ids]
    positions = torch.arange(input_ids.shape[0])
    for layer in inner.layers:
        x = ref_decoder_layer(layer, x, positions, config)
    x = ref_rms_norm(x, inner.norm.weight, config.rms_norm_eps)
    return F.linear(x, inner.embed_tokens.weight).float()


CLOSE = functools.partial(same_answer, atol=1e-4, rtol=1e-4)
WEIGHT_FIRST = ("multiplying by the weight in float32 before the cast back: normalize in float32, cast to x's "
                "dtype, then multiply by the weight (in that dtype), as transformers' Qwen3RMSNorm does")
INTERLEAVED = ("the interleaved RoPE layout, pairing dimensions (2i, 2i+1): Qwen3 (like transformers' Llama) "
               "uses \"rotate half\", pairing dimension i with i + D/2")
REPEAT = ("`repeat` for grouped-query heads: query head h reads kv head h // (H // KVH), which "
          "`repeat_interleave(H // KVH, dim=1)` gives (`repeat` gives h % KVH)")
NORM_AFTER_ROPE = "q/k-norm after RoPE: Qwen3 normalizes each query and key head first, then rotates it"
TIED_HEAD = ("using the embedding matrix as the LM head of an untied model: when config.tie_word_embeddings is "
             "False the head is model.lm_head.weight")


def randomize_norms(model, gen):
    """transformers initializes RMSNorm weights to 1; make them random so a missing weight shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))


def check_rms_norm(fn, dtype, where: str) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator().manual_seed(21)
    # scale 1e-3: mean(x^2) ~ 1e-6, where eps matters; a zero row must not divide by zero
    for shape, eps, scale in [((5, 48), 1e-6, 3.0), ((3, 4, 16), 1e-5, 1.0), ((16, 576), 1e-5, 1.0),
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
        weight = norm.weight.detach()
        got = fn(x, weight, eps)
        what = f"rms_norm of a {dtype} {tuple(shape)} input of scale {scale:g}, eps={eps:g}"
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        wrong = norm_weight_first(x, weight, eps)
        with explained(got, {WEIGHT_FIRST: lambda wrong=wrong: wrong},
                       same=lambda a, b: isinstance(a, torch.Tensor) and a.shape == b.shape
                       and float((a != b).float().mean()) < 0.02):
            assert_close(got, want, what, where, atol=tol, rtol=tol)
            if dtype == torch.bfloat16:  # the order of the last two roundings shows in bf16's last bit
                differ = float((got != want).float().mean())
                if differ > 0.02:
                    raise AssertionError(f"{what}: {differ:.0%} of the values differ from transformers' in the last "
                                         f"bit (at most 2% may) {where}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_2_1_rms_norm_matches_transformers(ex, dtype):
    where = book(NB, "2.1")
    check_rms_norm(ex.rms_norm, dtype, where)
    if dtype == torch.bfloat16:
        assert_detects(lambda fn: check_rms_norm(fn, dtype, where), norm_weight_first, WEIGHT_FIRST)


def check_rope(fn, where: str) -> None:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    from nanoengine.layers.rotary import RotaryEmbedding

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
        got = fn(x, positions, theta)
        with explained(got, {INTERLEAVED: lambda x=x, p=positions, t=theta: rope_interleaved(x, p, t)},
                       same=CLOSE):
            assert_close(got, want, f"RoPE (head_dim={head_dim}, theta={theta:g}) vs transformers", where, atol=1e-4)
        ours, _ = RotaryEmbedding(head_dim, 1024, theta)(positions, x, x)
        assert_close(got, ours, f"RoPE (head_dim={head_dim}, theta={theta:g}) vs nanoengine", where, atol=1e-4)
    # position 0 is no rotation
    x = torch.randn(1, 2, 16, generator=gen)
    assert_close(fn(x, torch.zeros(1, dtype=torch.long), 10000.0), x, "RoPE at position 0", where)


def test_2_2_rope_matches_transformers_and_nanoengine(ex):
    where = book(NB, "2.2")
    check_rope(ex.apply_rope, where)
    assert_detects(lambda fn: check_rope(fn, where), rope_interleaved, INTERLEAVED)


def check_attention(fn, heads, kv_heads, T, where: str) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + T)
    D = 16
    q = torch.randn(T, heads, D, generator=gen)
    k = torch.randn(T, kv_heads, D, generator=gen)
    v = torch.randn(T, kv_heads, D, generator=gen)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True, enable_gqa=True).transpose(0, 1)
    got = fn(q, k, v)
    with explained(got, {REPEAT: lambda: attention_repeat(q, k, v)}):
        assert_close(got, want, f"attention with {heads} query heads, {kv_heads} kv heads, {T} tokens", where,
                     atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,T", [(4, 2, 13), (6, 1, 7), (3, 3, 1), (8, 2, 40)])
def test_2_3_causal_gqa_attention_matches_sdpa(ex, heads, kv_heads, T):
    where = book(NB, "2.3")
    check_attention(ex.causal_gqa_attention, heads, kv_heads, T, where)
    if 1 < kv_heads < heads:
        assert_detects(lambda fn: check_attention(fn, heads, kv_heads, T, where), attention_repeat, REPEAT)


def check_decoder_layer(fn, heads, kv_heads, where: str) -> None:
    from transformers import Qwen3ForCausalLM

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
            got = fn(layer, x, positions, config)
            variants = {NORM_AFTER_ROPE: lambda layer=layer: layer_norm_after_rope(layer, x, positions, config)}
        with explained(got, variants, same=CLOSE):
            assert_close(got, want, f"decoder layer {i} output ({heads} heads, {kv_heads} kv heads)", where,
                         atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)])
def test_2_4_decoder_layer_matches_transformers(ex, heads, kv_heads):
    where = book(NB, "2.4")
    check_decoder_layer(ex.decoder_layer, heads, kv_heads, where)
    with torch.no_grad():
        assert_detects(lambda fn: check_decoder_layer(fn, heads, kv_heads, where), layer_norm_after_rope,
                       NORM_AFTER_ROPE)


def check_logits(fn, where: str) -> None:
    from transformers import Qwen3ForCausalLM

    for tied in (True, False):
        gen = torch.Generator().manual_seed(25)
        config = small_qwen3_config(layers=3, tied=tied)
        torch.manual_seed(25)
        model = Qwen3ForCausalLM(config).eval()
        randomize_norms(model, gen)
        if not tied:
            assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr(), "test bug: tied"
        ids = torch.randint(0, config.vocab_size, (12,), generator=gen)
        with torch.no_grad():
            want = model(ids[None]).logits[0].float()  # [T, vocab]
            got = fn(model, ids)
            variants = {TIED_HEAD: lambda model=model, ids=ids: logits_tied_head(model, ids)}
        with explained(got, variants, same=CLOSE):
            assert_close(got, want, f"logits of a 3-layer Qwen3 ({'tied' if tied else 'untied'} embeddings) on 12 "
                         f"tokens", where, atol=1e-4, rtol=1e-4)


def test_2_5_logits_match_transformers(ex):
    where = book(NB, "2.5")
    check_logits(ex.qwen3_logits, where)
    with torch.no_grad():
        assert_detects(lambda fn: check_logits(fn, where), logits_tied_head, TIED_HEAD)
