"""Mixture of experts (Qwen3-MoE, chapter 10): the router and the grouped expert forward against transformers'
and a naive per-token loop, the checked config fields, the plan's refusals, and greedy decoding of
tiny-qwen3-moe through the engine == transformers `generate` under chunked prefill, prefix hits, preemption,
the CPU graph stand-in and n-gram speculation (verify steps of several rows per sequence)."""

from __future__ import annotations

import functools
import json
import types

import pytest
import torch
from plans import plan_of
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from nanoengine import LLM, SamplingParams, assets
from nanoengine.errors import CheckpointError, InvalidValueError
from nanoengine.layers.activation import silu_and_mul
from nanoengine.layers.moe import grouped_experts, route
from nanoengine.models import hf_config
from nanoengine.plan import DecodeMode

MOE = "tiny-qwen3-moe"
MAX_TOKENS = 10
# prompts no other test uses (the asset was built without looking at them)
PROMPTS = [
    "Routing sends each token to two of eight experts.",
    "A short one",
    "Grace Hopper wrote the first compiler, and she kept a nanosecond of wire on her desk to show " * 2,
    "1, 1, 2, 3, 5, 8, 13,",
    "Quelle est la capitale du Japon ? Répondez en une phrase.",
]


def tiny_moe_config(**changes) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**assets.TINY_QWEN3_MOE_DIMS, **changes})


# ------------------------------------------------------------------------------------ router and experts

def naive_experts(x, weights, ids, w13, w2):
    """One token and one of its experts at a time: the definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            out[t] += weights[t, j] * (silu_and_mul(x[t:t + 1] @ w13[e].T) @ w2[e].T)[0]
    return out


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (13, 8, 2), (40, 6, 3), (5, 16, 4)])
def test_grouped_experts_equal_a_per_token_loop(seed, tokens, experts, top_k):
    hidden, inter = 24, 16
    x = torch.randn(tokens, hidden)
    w13 = torch.randn(experts, 2 * inter, hidden) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter) / inter ** 0.5
    weights, ids = route(torch.randn(tokens, experts), top_k, norm_topk_prob=True)
    got = grouped_experts(x, weights, ids, w13, w2)
    torch.testing.assert_close(got, naive_experts(x, weights, ids, w13, w2), atol=1e-5, rtol=1e-5)


def test_grouped_experts_skip_idle_experts(seed):
    """Experts no token chose are never multiplied (one token routed to 2 of 64 experts)."""
    x = torch.randn(1, 8)
    w13, w2 = torch.randn(64, 12, 8), torch.randn(64, 8, 6)
    w13[5] = w2[5] = float("nan")  # an expert that must not run
    weights, ids = torch.tensor([[0.75, 0.25]]), torch.tensor([[9, 2]])
    got = grouped_experts(x, weights, ids, w13, w2)
    torch.testing.assert_close(got, naive_experts(x, weights, ids, w13, w2))


@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_transformers_router(seed, norm):
    config = tiny_moe_config(norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(33, config.hidden_size)
    _, want_weights, want_ids = router(x)
    weights, ids = route(x @ router.weight.detach().T, config.num_experts_per_tok, norm)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.detach(), atol=1e-6, rtol=1e-6)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(33))
    else:
        assert (weights.sum(-1) <= 1 + 1e-6).all() and (weights.sum(-1) < 0.99).any()


# ------------------------------------------------------------------------------------ config and plan

@pytest.mark.parametrize("field,value,message", [
    ("decoder_sparse_step", 2, "decoder_sparse_step=2 is not supported"),
    ("mlp_only_layers", [1], "mlp_only_layers=[1] is not supported"),
    ("shared_expert_intermediate_size", 256, "no shared expert"),
    ("hidden_act", "gelu", "hidden_act='gelu' is not supported"),
    ("num_experts_per_tok", 9, "num_experts_per_tok between 1 and num_experts=8"),
])
def test_unsupported_moe_fields_are_refused(field, value, message):
    config = types.SimpleNamespace(**{**tiny_moe_config().to_dict(), "num_experts": 8, field: value})
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        hf_config.moe_config(config)
    with pytest.raises(CheckpointError, match="not supported|between"):
        plan_of(config)  # before anything is built


def test_moe_config_fields():
    moe = hf_config.moe_config(tiny_moe_config())
    assert (moe.num_experts, moe.top_k, moe.intermediate, moe.norm_topk_prob) == (8, 2, 64, True)
    assert hf_config.moe_config(plan_of().hf_config) is None  # dense tiny-qwen3
    # the checkpoint's config.json spells num_experts as num_local_experts (transformers' attribute_map)
    written = json.loads(tiny_moe_config().to_json_string())
    assert hf_config.moe_config(types.SimpleNamespace(**written)).num_experts == 8


def test_moe_shape_counts_active_experts():
    """The roofline's bytes per token: attention, the router and top_k of the experts (Qwen3-30B-A3B: ~3.3B
    active parameters of ~30.5B)."""
    full = tiny_moe_config(**{k: v for k, v in assets.QWEN3_30B_A3B_12L_DIMS.items()},
                           vocab_size=assets.QWEN3_VOCAB_SIZE)
    full.num_hidden_layers = assets.QWEN3_30B_A3B_LAYERS
    shape = hf_config.ModelShape.from_hf_config(full)
    active = shape.linear_params + shape.lm_head_params + shape.lm_head_params  # + the embedding
    assert 3.2e9 < active < 3.4e9
    assert shape.qk_norm and shape.experts == 128 and shape.experts_per_token == 8


def test_plan_refuses_what_moe_cannot_run(cpu_kernels):
    config = tiny_moe_config()  # (tensor and expert parallelism: test_moe_parallel.py)
    with pytest.raises(InvalidValueError, match="quantization='int8' does not cover mixture-of-experts"):
        plan_of(config, quantization="int8", device="cpu")
    # the fused C++ decode step has no experts: eager (or the graph stand-in when asked)
    assert plan_of(config, device="cpu", attention_backend="cpu").decode_mode is DecodeMode.EAGER
    assert plan_of(plan_of().hf_config, device="cpu", attention_backend="cpu").decode_mode \
        is DecodeMode.FUSED_CPU
    assert plan_of(config, device="cpu", graph_stand_in=True).decode_mode is DecodeMode.STAND_IN


@pytest.mark.xdist_group("tiny")
def test_fused_decode_refuses_an_moe_model(cpu_kernels):
    from nanoengine.models.fused_decode import FusedDecode
    from nanoengine.models.qwen3_moe import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(tiny_moe_config(num_hidden_layers=1, vocab_size=64))
    with pytest.raises(InvalidValueError, match="mixture of experts; decode it eagerly"):
        FusedDecode(model, cpu_kernels)


# ------------------------------------------------------------------------------------ the engine

@functools.cache
def reference() -> tuple[list[list[int]], list[list[int]]]:
    path = assets.ensure(MOE)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    prompts, outs = [], []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0)
        prompts.append(ids[0].tolist())
        outs.append(gen[0, ids.shape[1]:].tolist())
    return prompts, outs


CONFIGS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "preemption": {"num_kvcache_blocks": 8, "block_size": 16},
    "graph_stand_in": {"graph_stand_in": True},
    "ngram_speculation": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
}


@pytest.mark.xdist_group("tiny")
@pytest.mark.parametrize("config", list(CONFIGS))
def test_tiny_qwen3_moe_matches_transformers(config):
    """Two rounds over the same prompts (the second one from the prefix cache), greedy, float32."""
    prompts, want = reference()
    traced = "speculative_config" not in CONFIGS[config]  # (a trace does not record drafts yet)
    llm = LLM(MOE, dtype="float32", trace=traced, **CONFIGS[config])
    traces = []
    for round in range(2):
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        for i, (o, p, w) in enumerate(zip(outs, prompts, want)):
            assert o.prompt_token_ids == p, f"prompt {i}: tokenization differs from transformers"
            assert o.outputs[0].token_ids == w, f"{config} round {round}: prompt {i} differs from " \
                "transformers"
        traces.append(llm.trace)
    if not traced:
        return
    first, second = traces
    if config == "preemption":
        assert any(s.preempted for s in first.steps), "the tiny KV pool should have forced a preemption"
    if config == "chunked_prefill":
        assert max(s.num_batched_tokens for s in first.steps) <= 16
        assert any(e.prefill_tokens and e.num_computed_before for s in first.steps for e in s.scheduled)
    if config == "default":
        assert second.hit_tokens > 0.5 * second.prompt_tokens, "the second round should hit the prefix cache"


@pytest.mark.xdist_group("tiny")
def test_tiny_qwen3_moe_routes_to_many_experts():
    """The asset exercises routing: over one prompt, every layer sends tokens to most of its 8 experts, and
    each token to 2."""
    llm = LLM(MOE, dtype="float32", num_kvcache_blocks=16)
    model = llm.engine.executor.runner.model  # rank 0's (the only one)
    chosen: list[torch.Tensor] = []
    hooks = [layer.mlp.experts.register_forward_hook(lambda m, args, out: chosen.append(args[2]))
             for layer in model.layers]
    try:
        llm.engine.prompt_logits(llm.tokenizer.encode(PROMPTS[2]))
    finally:
        for h in hooks:
            h.remove()
    assert len(chosen) == len(model.layers) == 4
    for ids in chosen:
        assert ids.shape[1] == 2 and (ids[:, 0] != ids[:, 1]).all()
        assert len(ids.unique()) >= 6, f"only experts {ids.unique().tolist()} of 8 were used"


@pytest.mark.xdist_group("tiny")
def test_tiny_qwen3_moe_is_seeded_and_per_expert(tmp_path):
    """Rebuilding gives the same weights (the asset is reproducible), saved as the real checkpoints are: one
    tensor per expert and projection, and the router as mlp.gate."""
    from safetensors.torch import load_file

    built = assets.ensure(MOE)
    assets.build_tiny_qwen3_moe(tmp_path)
    a, b = load_file(built / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert a["model.layers.3.mlp.experts.7.gate_proj.weight"].shape == (64, 64)
    assert a["model.layers.0.mlp.gate.weight"].shape == (8, 64)
    assert json.loads((built / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]


def test_loader_stacks_experts_and_reports_a_missing_one(tmp_path, seed):
    """Each expert's gate, up and down tensors land in its slice of w13 / w2; a checkpoint without one of
    them is a CheckpointError naming the missing slice."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeForCausalLM as TheirMoe

    from nanoengine.models.loader import load_model
    from nanoengine.models.qwen3_moe import Qwen3MoeForCausalLM

    config = tiny_moe_config(num_hidden_layers=1, vocab_size=64)
    config.architectures = ["Qwen3MoeForCausalLM"]
    TheirMoe(config).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    ours = Qwen3MoeForCausalLM(config)
    load_model(ours, tmp_path)
    experts = ours.layers[0].mlp.experts
    for e in (0, 5):
        prefix = f"model.layers.0.mlp.experts.{e}."
        gate_up = torch.cat([tensors[prefix + "gate_proj.weight"], tensors[prefix + "up_proj.weight"]])
        assert torch.equal(experts.w13_weight[e], gate_up)
        assert torch.equal(experts.w2_weight[e], tensors[prefix + "down_proj.weight"])
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing \['layers.0.mlp.experts.w13_weight:3:up'\]"):
        load_model(Qwen3MoeForCausalLM(config), tmp_path)
