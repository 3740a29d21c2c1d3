"""kv_cache_dtype (vLLM's option): a bf16 KV cache under float32 compute. The option is checked and resolved
in the plan (the same memory holds twice the blocks; the GPU kernels refuse it); the store rounds K/V to
bf16; the torch backend and the C++ decode kernel (its AVX2 and plain paths) read the bf16 cache as the
float32 path reads the same rounded values; and an engine with a bf16 cache decodes greedily as one with a
float32 cache."""

from __future__ import annotations

import pytest
import torch
from plans import plan_of
from test_attention import make_layout

import nanoengine.attention.torch_backend as torch_backend
from nanoengine.errors import InvalidValueError
from nanoengine.plan import pick_kv_cache_dtype


# ------------------------------------------------------------------------------------------ the option
def test_kv_cache_dtype_is_checked_and_names_the_allowed_values():
    from nanoengine.config import EngineConfig

    for bad in ("fp8", "float32", "int8", "BF16"):
        with pytest.raises(InvalidValueError,
                           match=r"kv_cache_dtype must be one of \('auto', 'bfloat16', 'bf16'\)"):
            EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(TypeError, match="kv_cache_dtype must be str"):
        EngineConfig(kv_cache_dtype=None)


@pytest.mark.parametrize("want,dtype,kv", [("auto", "float32", "float32"), ("auto", "bfloat16", "bfloat16"),
                                           ("bfloat16", "float32", "bfloat16"),
                                           ("bf16", "float32", "bfloat16"), ("bf16", "bfloat16", "bfloat16")])
def test_plan_resolves_the_cache_dtype(want, dtype, kv):
    plan = plan_of(device="cpu", dtype=dtype, attention_backend="torch", kv_cache_dtype=want,
                   num_kvcache_blocks=8)
    assert plan.kv_cache_dtype == kv and plan.torch_kv_cache_dtype == getattr(torch, kv)
    assert plan.describe()["kv_cache_dtype"] == kv


def test_the_same_memory_holds_twice_the_blocks():
    plans = {want: plan_of(device="cpu", dtype="float32", attention_backend="torch", kv_cache_memory_gb=0.01,
                           kv_cache_dtype=want) for want in ("auto", "bfloat16")}
    f32, bf16 = plans["auto"], plans["bfloat16"]
    assert bf16.kv_bytes_per_block * 2 == f32.kv_bytes_per_block
    assert f32.kv_cache.num_blocks * f32.kv_bytes_per_block <= 0.01 * 2**30
    assert bf16.kv_cache.num_blocks in (2 * f32.kv_cache.num_blocks, 2 * f32.kv_cache.num_blocks + 1)


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_gpu_kernels_refuse_a_cache_dtype_other_than_the_compute_dtype(backend):
    with pytest.raises(InvalidValueError, match=rf"kv_cache_dtype='bf16' with dtype='float32'.*not "
                                                rf"attention_backend='{backend}'"):
        pick_kv_cache_dtype("bf16", "float32", backend)
    assert pick_kv_cache_dtype("bfloat16", "bfloat16", backend) == "bfloat16"  # the same dtype: no change


# ------------------------------------------------------------------------------------------ store and read
def test_the_store_rounds_to_the_cache_dtype():
    gen = torch.Generator().manual_seed(0)
    shape = (2, 4, 8, 16)  # [kv_heads, blocks, block_size, head_dim]
    k_cache, v_cache = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
    k, v = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([3, -1, 17, 31, 0])
    torch_backend.store_kvcache(k, v, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(k_cache.view(2, -1, 16)[:, slot], k[t].bfloat16())
        assert torch.equal(v_cache.view(2, -1, 16)[:, slot], v[t].bfloat16())


def decode_case(head_dim: int, batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, block_size, num_blocks = 9, 3, 16, 300
    lens = torch.randint(1, 600, (batch,), generator=gen)
    tables = make_layout(lens.tolist(), block_size, num_blocks, gen)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = torch.randn(batch, num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, block_tables, lens, head_dim ** -0.5


def paths(cpu_kernels) -> list:
    """The decode paths that read a bf16 cache under float32 queries: the torch backend's, and the kernel's
    (its plain loops always, its AVX2 code where this build has it)."""
    out = [("torch", torch_backend.decode_attention)]
    for path in ("plain", "avx2"):
        try:
            cpu_kernels.paged_decode(torch.zeros(1, 1, 64), torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16),
                                     torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16), torch.zeros(1, 1).long(),
                                     torch.ones(1).long(), 1.0, path)
        except RuntimeError:
            continue  # not in this build
        out.append((path, lambda *a, path=path: cpu_kernels.paged_decode(*a, path)))
    return out


@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("batch", [1, 6])
def test_decode_on_a_bf16_cache_equals_the_float32_path_within_bf16_rounding(head_dim, batch, cpu_kernels):
    """On the rounded values each path computes what float32 (float64 for the reference) computes, and its
    output is the float32 cache's within what rounding K/V to bf16 moves it."""
    q, k32, v32, tables, lens, scale = decode_case(head_dim, batch, seed=head_dim + batch)
    k16, v16 = k32.bfloat16(), v32.bfloat16()
    on_rounded = torch_backend.decode_attention(q.double(), k16.double(), v16.double(), tables, lens, scale)
    float32 = torch_backend.decode_attention(q, k32, v32, tables, lens, scale)
    for name, decode in paths(cpu_kernels):
        got = decode(q, k16, v16, tables, lens, scale)
        assert got.dtype == torch.float32 and got.shape == q.shape, name
        torch.testing.assert_close(got.double(), on_rounded, atol=2e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(got, float32, atol=2e-2, rtol=2e-2, msg=name)  # bf16 keeps 8 bits


def test_the_kernel_refuses_a_cache_it_cannot_read(cpu_kernels):
    q = torch.zeros(1, 3, 8)
    with pytest.raises(RuntimeError, match="q's or bfloat16"):
        cpu_kernels.paged_decode(q.bfloat16(), torch.zeros(3, 2, 4, 8), torch.zeros(3, 2, 4, 8),
                                 torch.zeros(1, 1).long(), torch.ones(1).long(), 1.0)
    with pytest.raises(RuntimeError, match="path must be"):
        cpu_kernels.paged_decode(q, torch.zeros(3, 2, 4, 8), torch.zeros(3, 2, 4, 8),
                                 torch.zeros(1, 1).long(), torch.ones(1).long(), 1.0, "avx512")


# ------------------------------------------------------------------------------------------ the engine
PROMPTS = [[5, 17, 300, 42] * n for n in (1, 7, 15)] + [[5, 17, 300, 42] * 15 + [9, 9]]


def generate(model: str, prompts, max_tokens: int, **options):
    from nanoengine import LLM, SamplingParams

    llm = LLM(model, max_num_batched_tokens=32, num_kvcache_blocks=64, **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tiny_qwen3_greedy_with_a_bf16_cache_equals_the_float32_cache(backend, cpu_kernels):
    """tiny-qwen3 in float32, greedy, chunked prefill and a prefix-cache hit in the mix: a bf16 cache gives
    the float32 cache's tokens (tiny-qwen3's logits are far apart; SmolLM2 below states its own agreement)."""
    _, want = generate("tiny-qwen3", PROMPTS, 16, dtype="float32", attention_backend=backend)
    llm, got = generate("tiny-qwen3", PROMPTS, 16, dtype="float32", attention_backend=backend,
                        kv_cache_dtype="bfloat16")
    assert llm.engine.plan.kv_cache_dtype == "bfloat16"
    runner = llm.engine.executor.runner if hasattr(llm.engine.executor, "runner") else None
    if runner is not None:
        assert runner.kv_cache.dtype == torch.bfloat16
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_the_fused_step_stores_and_reads_a_bf16_cache_as_the_layer_by_layer_forward(cpu_kernels):
    """The fused C++ decode step (its store rounds in C++) == the eager forward (the torch store), bit for
    bit: the same tokens and logprobs."""
    _, fused = generate("tiny-qwen3", PROMPTS, 12, dtype="float32", attention_backend="cpu",
                        kv_cache_dtype="bfloat16")
    llm, eager = generate("tiny-qwen3", PROMPTS, 12, dtype="float32", attention_backend="cpu",
                          kv_cache_dtype="bfloat16", enforce_eager=True)
    assert llm.engine.plan.decode_mode.value == "eager"
    for a, b in zip(fused, eager):
        assert a.token_ids == b.token_ids
        assert [next(iter(x.values())).logprob for x in a.logprobs] == \
               [next(iter(x.values())).logprob for x in b.logprobs]


def test_smollm2_greedy_with_a_bf16_cache_agrees_with_the_float32_cache(cpu_kernels):
    """SmolLM2-135M in float32 (with its bf16 weight copies and the fused step) on text prompts: the first 8
    greedy tokens of every prompt equal the float32 cache's, and each chosen token's logprob is within
    0.05."""
    from nanoengine import assets
    from nanoengine.tokenizer import load_tokenizer

    tok = load_tokenizer(assets.resolve_model("smollm2-135m"))
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "The three primary colors are"]
    prompts = [tok.encode(t) for t in texts]
    _, want = generate("smollm2-135m", prompts, 8, dtype="float32")
    _, got = generate("smollm2-135m", prompts, 8, dtype="float32", kv_cache_dtype="bf16")
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob) < 0.05
