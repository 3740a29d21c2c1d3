"""torch.compile'd ops (chapter 06) == the eager layers they come from, once on CPU (inductor's CPU backend):
RMSNorm with and without the residual add, rotary by position, SiLU-and-mul, the sampler's distribution; then
the engine with torch_compile=True == eager, token for token (tiny-qwen3, float32, the torch backend). No
speed is asserted: on CPU compiled ops are slower (scripts/graphs_check.py --ops measures them)."""

from __future__ import annotations

import pytest
import torch

from nanoengine import LLM, SamplingParams
from nanoengine.kernels.compiled import CompiledOps
from nanoengine.layers.activation import silu_and_mul
from nanoengine.layers.norm import RMSNorm
from nanoengine.layers.rotary import RotaryEmbedding
from nanoengine.layers.sampler import Sampler, SamplingBatch

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("compile")]  # inductor's first compile: ~30-60 s here


@pytest.fixture(scope="module")
def ops():
    return CompiledOps()


def test_compiled_ops_equal_eager_ops(ops, seed):
    dtype, tol = torch.float32, 1e-6  # (bf16 is compared on CUDA, as tokens: scripts/graphs_check.py)
    norm = RMSNorm(64, 1e-6).to(dtype)
    norm.weight.data.normal_()
    rot = RotaryEmbedding(32, 256, 10000.0)
    for n in (1, 5, 12):  # several batch sizes through one dynamic-shape graph
        x, res = torch.randn(n, 64, dtype=dtype), torch.randn(n, 64, dtype=dtype)
        with torch.no_grad():
            torch.testing.assert_close(ops.rms_norm(x, None, norm.weight, norm.eps)[0], norm(x),
                                       atol=tol, rtol=tol)
            got, got_res = ops.rms_norm(x, res, norm.weight, norm.eps)
            want, want_res = norm.forward_add(x, res)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)
        gate_up = torch.randn(n, 2 * 96, dtype=dtype)
        torch.testing.assert_close(ops.silu_and_mul(gate_up), silu_and_mul(gate_up), atol=tol, rtol=tol)
        q, k = torch.randn(n, 4, 32, dtype=dtype), torch.randn(n, 2, 32, dtype=dtype)
        positions = torch.randint(0, 256, (n,))
        want_q, want_k = rot(positions, q, k)
        torch.testing.assert_close(ops.rotary(q, positions, rot.cos, rot.sin), want_q, atol=tol, rtol=tol)
        torch.testing.assert_close(ops.rotary(k, positions, rot.cos, rot.sin), want_k, atol=tol, rtol=tol)


def test_compiled_sampler_draws_the_same_tokens(seed):
    logits = torch.randn(6, 500) * 3
    batch = SamplingBatch(temperatures=torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9, 1.0]),
                          top_ks=torch.tensor([500, 20, 500, 5, 500, 50]),
                          top_ps=torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0, 0.95]),
                          min_ps=None, generators=[None] * 6, all_greedy=False)
    assert Sampler(seed=3, compile=True)(logits, batch).tolist() == Sampler(seed=3)(logits, batch).tolist()


def test_engine_with_compiled_ops_equals_eager():
    prompts = ["Hello", "The quick brown fox jumps over the lazy dog. " * 3, "1, 2, 3,"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(dtype="float32", attention_backend="torch", max_num_seqs=4, max_model_len=256)
    eager = LLM("tiny-qwen3", **options).generate(prompts, params, use_tqdm=False)
    llm = LLM("tiny-qwen3", torch_compile=True, **options)
    assert llm.plan.torch_compile and isinstance(llm.engine.executor.runner.model.norm.kernels, CompiledOps)
    compiled = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]
