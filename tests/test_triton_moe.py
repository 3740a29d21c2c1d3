"""The Triton fused-MoE kernel (kernels/triton_moe.py) == the torch grouped expert forward
(layers/moe.grouped_experts), in Triton's interpreter on CPU (compiled on CUDA): the alignment of the (token,
expert) pairs into one-expert blocks against a plain loop, float32 outputs for several T, k and E (experts no
token chose, whose weights are NaN here and must never be read; several reduction steps and output tiles),
and the engine with attention_backend='triton' on tiny-qwen3-moe, which runs its experts through the kernel,
== the torch engine token for token. On CUDA the compiled kernel in bf16 and float32 at Qwen3-30B-A3B's expert
shapes (marked gpu)."""

from __future__ import annotations

import pytest
import torch
from test_attention import triton_kernels  # noqa: F401

from nanoengine import LLM, SamplingParams
from nanoengine.layers.moe import grouped_experts, route

pytestmark = pytest.mark.usefixtures("triton_kernels")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled there; else the interpreter


def moe_inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int, idle_nan: bool = True,
               device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Seeded x, routing and stacked expert weights; experts no token chose get NaN weights (idle_nan)."""
    gen = torch.Generator().manual_seed(tokens * 100 + experts * 10 + top_k)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, norm_topk_prob=True)
    if idle_nan:
        idle = torch.ones(experts, dtype=torch.bool)
        idle[ids.unique()] = False
        w13[idle] = w2[idle] = float("nan")
    tensors = (x, weights, ids, w13, w2)
    return [t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in tensors]


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 64, 2), (3, 8, 2), (13, 8, 2), (40, 6, 3), (5, 16, 4)])
def test_align_by_expert_puts_each_pair_once_in_blocks_of_one_expert(tokens, experts, top_k):
    from nanoengine.kernels.triton_moe import BLOCK_M, align_by_expert

    ids = moe_inputs(tokens, experts, top_k, 8, 8)[2]
    pair_ids, block_expert, num_padded = align_by_expert(ids, experts)
    pairs = tokens * top_k
    assert pair_ids.numel() % BLOCK_M == 0 and block_expert.numel() == pair_ids.numel() // BLOCK_M
    assert pair_ids.numel() >= pairs + experts * (BLOCK_M - 1)  # room for the worst case
    # the oracle: expert by expert, its pairs in token order, padded to whole blocks
    want_ids: list[int] = []
    want_experts: list[int] = []
    for e in range(experts):
        mine = [p for p in range(pairs) if ids.flatten()[p] == e]
        blocks = -(-len(mine) // BLOCK_M)
        want_ids += mine + [pairs] * (blocks * BLOCK_M - len(mine))
        want_experts += [e] * blocks
    assert int(num_padded) == len(want_ids)
    assert pair_ids[:len(want_ids)].tolist() == want_ids
    assert (pair_ids[len(want_ids):] == pairs).all()
    assert block_expert[:len(want_experts)].tolist() == want_experts


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (1, 64, 8), (13, 8, 2), (40, 6, 3), (5, 16, 4)])
def test_fused_experts_equal_grouped_experts(tokens, experts, top_k):
    """float32; hidden 80 and intermediate 72: two reduction steps and two output tiles per GEMM; experts no
    token chose hold NaN weights, which would show in the output if a block read them."""
    from nanoengine.kernels.triton_moe import triton_fused_experts

    x, weights, ids, w13, w2 = moe_inputs(tokens, experts, top_k, hidden=80, inter=72)
    want = grouped_experts(x, weights, ids, w13, w2)  # [T, H]
    got = triton_fused_experts(*(t.to(DEVICE) for t in (x, weights, ids, w13, w2))).cpu()
    assert got.shape == want.shape and got.dtype == torch.float32
    assert got.isfinite().all(), "an idle expert's (NaN) weights were read"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_no_tokens_gives_an_empty_output():
    from nanoengine.kernels.triton_moe import triton_fused_experts

    x, weights, ids, w13, w2 = moe_inputs(2, 4, 2, hidden=16, inter=16, device=DEVICE)
    got = triton_fused_experts(x[:0], weights[:0], ids[:0], w13, w2)
    assert got.shape == (0, 16)


def test_engine_with_triton_runs_the_fused_kernel_and_equals_torch():
    """tiny-qwen3-moe, float32, greedy: a prompt in prefill chunks of 16 and a short one, 4 tokens each; the
    attention_backend='triton' engine's MoE layers compute with the kernel (the torch engine's with
    grouped_experts), and both give the same tokens."""
    from nanoengine.kernels.triton_moe import triton_fused_experts

    prompts = ["Routing sends each token to two of eight experts, and the kernel sorts them by expert.",
               "A short one"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens, forwards = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM("tiny-qwen3-moe", device=DEVICE, dtype="float32", attention_backend=backend, block_size=16,
                  max_num_batched_tokens=16, max_num_seqs=4, max_model_len=128)
        model = llm.engine.executor.runner.model
        forwards[backend] = {layer.mlp.experts.experts_forward for layer in model.layers}
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.close()
    assert forwards["triton"] == {triton_fused_experts}
    if DEVICE == "cpu":
        assert forwards["torch"] == {grouped_experts}
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 8, 200])
def test_compiled_kernel_at_qwen3_30b_a3b_expert_shapes(dtype, tokens):
    """128 experts, top 8, hidden 2048, expert intermediate 768: the compiled kernel against grouped_experts
    in float32 on the same (rounded) inputs; bf16 within bf16 rounding of the intermediate and output."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from nanoengine.kernels.triton_moe import triton_fused_experts

    args = moe_inputs(tokens, 128, 8, hidden=2048, inter=768, idle_nan=False, device="cuda", dtype=dtype)
    got = triton_fused_experts(*args).float()
    want = grouped_experts(*(t.float() if t.is_floating_point() else t for t in args))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
