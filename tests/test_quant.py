"""quantization="int8" (nanoengine/layers/quant.py, kernels/csrc/int8_linear.cpp): the per-group quantizer's
rounding and error bound, the C++ int8_linear (every path this build has: AVX-512, AVX2, plain loops) against
a float64 linear of the dequantized weights, the linears' switch between the kernel and the matmul, the plan's
checks, the fused decode step, tensor parallelism over gloo, and a pinned bound on SmolLM2's perplexity."""

from __future__ import annotations

import math

import pytest
import torch
from int8_paths import int8_paths_built

from nanoengine.errors import InvalidValueError
from nanoengine.kernels import cpu as cpu_kernels
from nanoengine.layers.quant import dequantize_int8, quantize_int8, quantize_weights
from nanoengine.plan import DecodeMode

PATHS = ("avx512", "avx2", "plain")


@pytest.fixture(scope="module")
def kernels(cpu_kernels):
    return cpu_kernels


def paths_built(kernels) -> list[str]:
    """The int8_linear paths this build has (the plain loops always; AVX2 / AVX-512 where compiled)."""
    packed, scales = kernels.int8_pack(torch.zeros(16, 4, dtype=torch.int8), torch.ones(16, 1))
    return int8_paths_built(kernels, packed, scales, PATHS)


@pytest.mark.parametrize("shape,group", [((48, 96), 32), ((7, 40), 32), ((5, 19), 8), ((6, 64), 64)])
def test_quantize_int8_rounds_to_nearest_within_half_a_step_and_reaches_127_per_group(shape, group):
    """What pins the per-group formula down (its float64 oracle is Exercise 8.5's test): every group's
    largest weight maps to +-127 (so the step is not larger), no weight is off by more than half its group's
    step in float64 (so the step is not smaller, and rounding is to nearest, not truncation), q never holds
    -128, and an outlier coarsens its own group only."""
    gen = torch.Generator().manual_seed(shape[0] * shape[1] + group)
    w = torch.randn(shape, generator=gen)
    w[0, :group] = 0  # a group of zeros: scale 0
    w[1, 3] = 40.0  # an outlier
    q, scales = quantize_int8(w, group)
    out, cols = shape
    groups = -(-cols // group)
    assert q.dtype == torch.int8 and q.shape == shape and scales.shape == (out, groups)
    assert q.min() >= -127 and q.max() <= 127, "symmetric: -128 is never used"
    step = scales.double().repeat_interleave(group, dim=1)[:, :cols]  # [out, cols]
    assert (scales[0, 0] == 0) and (q[0, :group] == 0).all()
    for g in range(groups):
        cols_g = slice(g * group, (g + 1) * group)
        nonzero = w[:, cols_g].abs().amax(dim=1) > 0
        assert (q[nonzero, cols_g].abs().amax(dim=1) == 127).all(), f"group {g}: its largest weight -> +-127"
    err = (dequantize_int8(q, scales, group).double() - w.double()).abs()
    assert (err <= step / 2 * (1 + 1e-6)).all(), "no weight is off by more than half its group's step"
    if cols > group:
        assert err[1, group:].max() < 0.05, "an outlier must not coarsen the other groups of its row"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 7, 13, 32, 70])
@pytest.mark.parametrize("out_features,in_features,group", [(960, 576, 32), (13, 40, 32), (6, 1539, 32),
                                                            (40, 100, 7), (24, 8, 32)])
def test_int8_linear_equals_the_float64_linear_of_the_dequantized_weights(kernels, rows, out_features,
                                                                        in_features, group):
    """Every path of the kernel (partial 16-row blocks, a shorter last group, columns past a multiple of 4,
    the row chunks and AVX2's widened tiles) == x @ (q * s)^T + b in float64, up to float32 sums."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    q, scales = quantize_int8(torch.randn(out_features, in_features, generator=gen), group)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    want = torch.nn.functional.linear(x.double(), dequantize_int8(q, scales, group).double(), bias.double())
    packed, packed_scales = kernels.int8_pack(q, scales)
    assert packed.shape == (-(-out_features // 16), in_features, 16) and packed.dtype == torch.int8
    built = paths_built(kernels)
    # (a SIMD path is built where the CPU has AVX and the compiler targets this CPU: kernels/cpu.py's probe)
    native = any(f in cpu_kernels.chosen_flags() for f in ("-march=native", "-mcpu=native"))
    simd = torch.backends.cpu.get_cpu_capability().startswith("AVX") and native
    assert "plain" in built and (len(built) >= 2 or not simd), built
    for path in built:
        got = kernels.int8_linear(x, packed, packed_scales, bias, out_features, group, path)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        torch.testing.assert_close(got.double(), want, atol=1e-4 * math.sqrt(in_features), rtol=1e-5,
                                   msg=f"path {path}")
    # bf16 activations: the float32 result rounded once
    got = kernels.int8_linear(x.bfloat16(), packed, packed_scales, None, out_features, group)
    want = torch.nn.functional.linear(x.bfloat16().double(), dequantize_int8(q, scales, group).double())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=1 / 128, atol=1e-2)


def test_int8_linear_rejects_bad_input(kernels):
    q = torch.zeros(16, 8, dtype=torch.int8)
    packed, scales = kernels.int8_pack(q, torch.ones(16, 1))
    with pytest.raises(RuntimeError, match="int8 weight"):
        kernels.int8_pack(torch.zeros(16, 8), torch.ones(16, 1))
    with pytest.raises(RuntimeError, match="packed by int8_pack"):
        kernels.int8_linear(torch.zeros(1, 8), torch.zeros(1, 8, 16), scales, None, 16, 8)
    with pytest.raises(RuntimeError, match="same K"):
        kernels.int8_linear(torch.zeros(1, 16), packed, scales, None, 16, 8)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.int8_linear(torch.zeros(1, 8), packed, scales, None, 17, 8)
    with pytest.raises(RuntimeError, match="2 groups of 4"):
        kernels.int8_linear(torch.zeros(1, 8), packed, scales, None, 16, 4)
    with pytest.raises(RuntimeError, match="path must be"):
        kernels.int8_linear(torch.zeros(1, 8), packed, scales, None, 16, 8, "avx1024")


def test_quantized_linears_switch_by_rows_and_leave_a_tied_embedding_alone(kernels):
    """quantize_weights: the weight becomes its dequantized self; batches up to max_rows go through the int8
    kernel and larger ones through the matmul, both the float64 linear of the dequantized weight; a tied LM
    head gets its own weight and the embedding keeps the checkpoint's rows."""
    from nanoengine.layers.embedding import Embedding, LMHead
    from nanoengine.layers.linear import MergedLinear

    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Module()
    model.proj = MergedLinear(64, {"q": 48, "k": 16}, bias=True)
    model.embed, model.head = Embedding(100, 64), LMHead(100, 64)
    model.head.weight = model.embed.weight
    original = model.proj.weight.detach().clone()
    embedding = model.embed.weight.detach().clone()
    assert quantize_weights(model, kernels, max_rows=4) == 2
    q, scales = quantize_int8(original)
    assert torch.equal(model.proj.weight, dequantize_int8(q, scales))
    assert torch.equal(model.embed.weight, embedding) and model.head.weight is not model.embed.weight
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 64, generator=gen)
        want = torch.nn.functional.linear(x.double(), model.proj.weight.double(), model.proj.bias.double())
        torch.testing.assert_close(model.proj(x).double(), want, atol=1e-4, rtol=1e-5)
    assert model.head.int8_weight is not None and model.head(torch.randn(2, 64)).shape == (2, 100)


def test_the_plan_takes_int8_on_cpu_and_refuses_it_on_cuda_or_a_bad_name():
    from plans import plan_of

    from nanoengine import plan_cpu as engine_plan
    from nanoengine.config import EngineConfig
    from nanoengine.plan import check_quantization

    with pytest.raises(InvalidValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(InvalidValueError, match="no int8-weight .W8A16. kernel for CUDA"):
        check_quantization("int8", "cuda")
    plan = plan_of(device="cpu", quantization="int8")
    assert plan.quantization == "int8" and plan.int8_weight_rows > 0 and plan.bf16_weight_rows == 0
    assert plan_of(device="cpu").int8_weight_rows == 0 and plan_of(device="cpu").quantization == "none"
    # where oneDNN's packed bf16 matmul is there (AMX), it takes every batch but one row
    bf16 = plan_of(device="cpu", dtype="bfloat16", quantization="int8")
    rows = engine_plan.INT8_WEIGHT_MAX_ROWS_ONEDNN, engine_plan.INT8_WEIGHT_MAX_ROWS
    assert bf16.int8_weight_rows == rows[0 if bf16.prepack_weights else 1]


def test_the_roofline_counts_int8_weights_at_one_byte_and_a_scale_per_group():
    from types import SimpleNamespace

    from nanoengine.bench.roofline import engine_shape
    from nanoengine.models.hf_config import ModelShape

    cfg = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                          model_type="llama")
    plan = SimpleNamespace(hf_config=cfg, torch_dtype=torch.float32, bf16_weight_rows=0, quantization="int8")
    shape = engine_shape(plan)
    plain = ModelShape.from_hf_config(cfg, 4)
    linears = plain.linear_params + plain.lm_head_params
    assert shape.weight_bytes_per_step == round(linears * 1.125) + plain.norm_params * 4


@pytest.mark.xdist_group("tiny")
def test_int8_fused_decode_equals_the_layer_by_layer_forward_and_enforce_eager(kernels):
    """tiny-qwen3 with int8 weights: the fused decode step == the layer-by-layer forward bit for bit, and
    greedy tokens equal enforce_eager=True's (chunked prefill through the dequantized matmul in the mix)."""
    from test_kernels import decode_step_input

    from nanoengine import LLM, SamplingParams

    prompts = [[5, 17, 300, 42] * n for n in (1, 7, 15)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM("tiny-qwen3", quantization="int8", enforce_eager=eager, max_num_batched_tokens=32,
                  num_kvcache_blocks=64, dtype="float32")
        runner = llm.engine.executor.runner
        assert (llm.plan.decode_mode is DecodeMode.FUSED_CPU) is (not eager)
        assert runner.model.lm_head.int8_weight is not None
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager:
            assert runner.fused.max_rows == llm.plan.int8_weight_rows
            inp = decode_step_input(llm, [[5 + i, 17, 300, 42] * 3 for i in range(3)])
            with torch.inference_mode():
                assert torch.equal(runner.fused(inp), runner.eager_forward(inp))
    assert outs[False] == outs[True]


@pytest.mark.xdist_group("notebooks")
def test_int8_over_two_gloo_ranks_quantizes_each_shard_like_the_whole():
    """TP=2 with int8: each rank quantizes its shard; groups of 32 never straddle a shard boundary, so the
    ranks hold the whole model's quantized values and a prefill's logits equal one process's."""
    from nanoengine import LLM

    options = dict(quantization="int8", dtype="float32", num_kvcache_blocks=32)
    one = LLM("tiny-qwen3", **options)
    ids = one.tokenizer.encode("The paged KV cache stores keys and values")
    with LLM("tiny-qwen3", tensor_parallel_size=2, **options) as two:
        torch.testing.assert_close(two.engine.prompt_logits(ids), one.engine.prompt_logits(ids),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.xdist_group("smollm2")
def test_smollm2_int8_perplexity_and_greedy_agreement_stay_within_bounds(kernels):
    """SmolLM2 (real weights) with int8: the fixed text's perplexity rises by under 2% (measured: +0.3% in
    float32) and most short greedy continuations are identical to the unquantized model's."""
    from nanoengine.bench import quality

    prompts = quality.PROMPTS[:4]
    result = quality.compare("smollm2-135m", "int8", max_tokens=8, prompts=prompts, text=quality.TEXT,
                             dtype="float32", num_kvcache_blocks=32)
    ppl = result["perplexity"]
    assert 5 < ppl["none"] < 60, f"the unquantized perplexity {ppl['none']:.1f} is off: a broken load?"
    assert result["perplexity_increase"] < 0.02, ppl
    assert result["identical_share"] >= 0.5, result["first_difference"]
