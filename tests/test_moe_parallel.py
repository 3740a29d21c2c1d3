"""A mixture of experts across ranks (chapter 10): tensor parallelism (1/N of every expert's rows) and expert
parallelism (enable_expert_parallel: E/N whole experts per rank), each with one all-reduce after the experts.
Over gloo on CPU, two ranks of tiny-qwen3-moe give one process's greedy tokens and prompt logits (chunked
prefill); each rank holds exactly its share of the checkpoint's experts; the ranks' partial outputs sum to
the whole layer's (no processes); another rank's experts are never read; the options that cannot work are
refused before anything starts."""

from __future__ import annotations

import sys

import pytest
import torch
from plans import plan_of
from safetensors import safe_open
from test_tp import no_children_within
from transformers import Qwen3MoeConfig

from nanoengine import LLM, SamplingParams, assets
from nanoengine.config import EngineConfig
from nanoengine.errors import InvalidValueError
from nanoengine.layers.moe import FusedMoE, route
from nanoengine.layers.tp_group import TPGroup

# extra processes: the notebooks' group, as test_tp's
pytestmark = [pytest.mark.xdist_group("notebooks")]

MOE = "tiny-qwen3-moe"
PROMPTS = [
    "Each rank holds half of the experts, and the router still sees all eight of them.",
    "Two",
    "An all-reduce sums the partial outputs of the ranks: " * 3,  # chunks at 32 tokens a step
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
OPTIONS = dict(dtype="float32", max_num_batched_tokens=32, kv_cache_memory_gb=0.02)
MODES = {"tensor_parallel": {}, "expert_parallel": {"enable_expert_parallel": True}}


def tiny_moe_config(**changes) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**assets.TINY_QWEN3_MOE_DIMS, **changes})


# ------------------------------------------------------------------------------------ two ranks == one
@pytest.fixture(scope="module")
def one_rank():
    llm = LLM(MOE, **OPTIONS)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ids = llm.tokenizer.encode(PROMPTS[0])
    return [o.outputs[0].token_ids for o in outs], ids, llm.engine.prompt_logits(ids)


def layer0_experts(runner):  # module level: collective_rpc pickles functions by name
    experts = runner.model.layers[0].mlp.experts
    return (experts.w13_weight.clone(), experts.w2_weight.clone(),
            tuple(runner.model.layers[0].mlp.gate.weight.shape))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="spawns worker processes")
@pytest.mark.parametrize("mode", list(MODES))
def test_two_ranks_equal_one_and_hold_their_share(one_rank, mode):
    want_tokens, ids, want_logits = one_rank
    with LLM(MOE, tensor_parallel_size=2, **OPTIONS, **MODES[mode]) as two:
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]
        logits = two.engine.prompt_logits(ids)
        shares = two.collective_rpc(layer0_experts)
    assert no_children_within(5) == []
    for i, (g, w) in enumerate(zip(got, want_tokens)):
        assert g == w, f"{mode}: prompt {i} differs between two ranks and one"
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)

    # each rank's share, against the checkpoint's per-expert tensors
    dims = assets.TINY_QWEN3_MOE_DIMS
    num_experts, inter, hidden = dims["num_experts"], dims["moe_intermediate_size"], dims["hidden_size"]
    with safe_open(str(assets.ensure(MOE) / "model.safetensors"), "pt") as f:
        def expert(e: int, part: str) -> torch.Tensor:
            return f.get_tensor(f"model.layers.0.mlp.experts.{e}.{part}_proj.weight")
        for rank, (w13, w2, gate) in enumerate(shares):
            assert gate == (num_experts, hidden), "the router is replicated"
            if mode == "expert_parallel":  # whole experts 4r .. 4r + 3
                assert w13.shape == (num_experts // 2, 2 * inter, hidden)
                assert w2.shape == (num_experts // 2, hidden, inter)
                for local in range(num_experts // 2):
                    e = rank * num_experts // 2 + local
                    torch.testing.assert_close(w13[local], torch.cat([expert(e, "gate"), expert(e, "up")]))
                    torch.testing.assert_close(w2[local], expert(e, "down"))
            else:  # every expert's rows (gate, up) / columns (down) rank * I/2 .. (rank + 1) * I/2
                half = slice(rank * inter // 2, (rank + 1) * inter // 2)
                assert w13.shape == (num_experts, inter, hidden)
                assert w2.shape == (num_experts, hidden, inter // 2)
                for e in range(num_experts):
                    want = torch.cat([expert(e, "gate")[half], expert(e, "up")[half]])
                    torch.testing.assert_close(w13[e], want)
                    torch.testing.assert_close(w2[e], expert(e, "down")[:, half])


# ------------------------------------------------------------------------------------ the layer, no processes
class Unreadable:
    """A lazy checkpoint slice that must not be read (another rank's expert)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index):
        raise AssertionError("another rank's expert was read")


def loaded_share(whole: FusedMoE, tp: TPGroup) -> FusedMoE:
    """A FusedMoE for rank tp.rank, loaded expert by expert from `whole`'s weights through its loaders (as a
    checkpoint's per-expert tensors are); another rank's experts come as slices that fail if read."""
    share = FusedMoE(whole.num_experts, whole.hidden, whole.intermediate, tp)
    inter = whole.intermediate
    for e in range(whole.num_experts):
        parts = {"gate": whole.w13_weight[e, :inter], "up": whole.w13_weight[e, inter:],
                 "down": whole.w2_weight[e]}
        first, count = tp.shard(whole.num_experts)
        held = not tp.expert_parallel or first <= e < first + count
        for part, tensor in parts.items():
            param = share.w2_weight if part == "down" else share.w13_weight
            param.weight_loader(param, tensor if held else Unreadable(tuple(tensor.shape)), (e, part))
    return share


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("size", [2, 4])
def test_rank_parts_sum_to_the_whole_layer(seed, expert_parallel, size):
    experts, hidden, inter, tokens = 8, 16, 12, 23
    whole = FusedMoE(experts, hidden, inter)
    torch.nn.init.normal_(whole.w13_weight, std=hidden ** -0.5)
    torch.nn.init.normal_(whole.w2_weight, std=inter ** -0.5)
    x = torch.randn(tokens, hidden)
    weights, ids = route(torch.randn(tokens, experts), 2, norm_topk_prob=True)
    ranks = [loaded_share(whole, TPGroup(r, size, expert_parallel=expert_parallel)) for r in range(size)]
    if expert_parallel:
        assert [m.w13_weight.shape[0] for m in ranks] == [experts // size] * size
        assert all(m.w13_weight.shape[1] == 2 * inter for m in ranks)
    else:
        assert all(m.w13_weight.shape == (experts, 2 * inter // size, hidden) for m in ranks)
    got = sum(m.partial(x, weights, ids) for m in ranks)
    torch.testing.assert_close(got, whole(x, weights, ids), atol=1e-5, rtol=1e-5)


def test_a_rank_without_pairs_adds_zeros():
    """Expert parallelism: no token routed to this rank's experts -> zeros, and the expert forward is not
    called (the all-reduce still is, by forward)."""
    def never(*args):
        raise AssertionError("called without pairs")

    m = FusedMoE(4, 8, 6, TPGroup(1, 2, expert_parallel=True), experts_forward=never)  # experts 2, 3
    out = m.partial(torch.ones(3, 8), torch.full((3, 2), 0.5), torch.tensor([[0, 1], [1, 0], [0, 1]]))
    assert torch.equal(out, torch.zeros(3, 8))


# ------------------------------------------------------------------------------------ refusals
def test_expert_parallel_refusals():
    with pytest.raises(InvalidValueError, match="enable_expert_parallel=True .* tensor_parallel_size=1"):
        EngineConfig(enable_expert_parallel=True)
    with pytest.raises(InvalidValueError, match="enable_expert_parallel=True .* dense model"):
        plan_of(tensor_parallel_size=2, enable_expert_parallel=True, device="cpu")  # tiny-qwen3
    with pytest.raises(InvalidValueError, match="num_experts=5; use a tensor_parallel_size that divides 5"):
        plan_of(tiny_moe_config(num_experts=5), tensor_parallel_size=2, enable_expert_parallel=True,
                device="cpu")
    # tensor parallelism splits moe_intermediate_size, expert parallelism does not
    with pytest.raises(InvalidValueError, match="moe_intermediate_size=65 rows"):
        plan_of(tiny_moe_config(moe_intermediate_size=65), tensor_parallel_size=2, device="cpu")
    plan = plan_of(tiny_moe_config(moe_intermediate_size=65), tensor_parallel_size=2, device="cpu",
                   enable_expert_parallel=True)
    assert plan.enable_expert_parallel and plan.tensor_parallel_size == 2
    with pytest.raises(InvalidValueError, match="quantization='int8' does not cover mixture-of-experts"):
        plan_of(tiny_moe_config(), tensor_parallel_size=2, quantization="int8", device="cpu")
