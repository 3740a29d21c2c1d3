"""quantization="w8a8" (nanoengine/layers/quant.py, kernels/csrc/w8a8_linear.cpp): int8 weights times int8
activations quantized per row and group on the fly. Every kernel path this build has (AVX512-VNNI,
AVX-VNNI, AVX2, plain loops) against a float64 oracle that quantizes x itself with torch; the linears taking
every batch; the plan's checks; the fused decode step; and a pinned bound on SmolLM2's perplexity."""

from __future__ import annotations

import pytest
import torch
from int8_paths import int8_paths_built

from nanoengine.errors import InvalidValueError
from nanoengine.kernels import cpu as cpu_kernels
from nanoengine.layers.quant import ALL_ROWS, quantize_int8, quantize_weights
from nanoengine.plan import DecodeMode

PATHS = ("avx512vnni", "avxvnni", "avx2", "plain")


@pytest.fixture(scope="module")
def kernels(cpu_kernels):
    return cpu_kernels


def paths_built(kernels) -> list[str]:
    """The W8A8 paths this build has (plain loops always; AVX2 / AVX-VNNI / AVX512-VNNI where compiled)."""
    packed, scales = kernels.w8a8_pack(torch.zeros(16, 4, dtype=torch.int8), torch.ones(16, 1), 4)
    return int8_paths_built(kernels, packed, scales, PATHS)


def oracle(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int, bias: torch.Tensor | None
           ) -> torch.Tensor:
    """x [M, K] quantized per row and group (scale max|x| / 127, xq = round(x * (127 / max|x|))), times the
    int8 weight per group, scaled by both scales: float64 [M, N]."""
    M, K = x.shape
    groups = -(-K // group)
    xg = torch.nn.functional.pad(x.float(), (0, groups * group - K)).view(M, groups, group)  # [M, G, group]
    amax = xg.abs().amax(2, keepdim=True)  # [M, G, 1]
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xg * inv).clamp(-127, 127).double()  # [M, G, group]
    qg = torch.nn.functional.pad(q.double(), (0, groups * group - K)).view(q.shape[0], groups, group)
    sums = torch.einsum("mgk,ngk->mng", xq, qg)  # [M, N, G]: exact integers
    y = (sums * (amax / 127).double().view(M, 1, groups) * scales.double().view(1, -1, groups)).sum(2)
    return y if bias is None else y + bias.double()


def test_the_vnni_path_is_built_where_the_cpu_has_it(kernels):
    built = paths_built(kernels)
    native = any(f in cpu_kernels.chosen_flags() for f in ("-march=native", "-mcpu=native"))
    assert "plain" in built
    if native and torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        assert "avx2" in built
    from nanoengine.bench.hardware import cpuinfo_flags

    flags = set(cpuinfo_flags())
    for path, flag in (("avx512vnni", "avx512_vnni"), ("avxvnni", "avx_vnni")):
        assert (path in built) == (path in kernels.simd_paths())
        if native and flag not in flags:
            assert path not in built
    if native and "avx512_vnni" in flags and "avx512bw" in flags:
        assert "avx512vnni" in built


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 32, 70])
@pytest.mark.parametrize("out_features,in_features,group", [(960, 576, 32), (13, 41, 32), (40, 70, 8),
                                                            (24, 8, 32), (6, 1539, 32)])
def test_w8a8_linear_equals_a_torch_oracle_on_every_path(kernels, rows, out_features, in_features, group):
    """Partial 16-row blocks, K past a multiple of 4, a shorter last group and every row chunk: the same
    int32 sums on every path, so the results differ only in float32 rounding; bf16 x: rounded once."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    q, scales = quantize_int8(torch.randn(out_features, in_features, generator=gen) * 0.05, group)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    x[0, : min(group, in_features)] = 0.0  # a group of zeros: scale 0, no division by zero
    want = oracle(x, q, scales, group, bias)
    packed, packed_scales = kernels.w8a8_pack(q, scales, group)
    assert packed.shape == (-(-out_features // 16), -(-in_features // 4), 16, 4)
    assert packed_scales.shape == (-(-out_features // 16), -(-in_features // group), 2, 16)
    for path in paths_built(kernels):
        got = kernels.int8_linear(x, packed, packed_scales, bias, out_features, group, path)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5, msg=f"path {path}")
    got = kernels.int8_linear(x.bfloat16(), packed, packed_scales, None, out_features, group)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), oracle(x.bfloat16(), q, scales, group, None), rtol=1 / 128,
                               atol=1e-2)


def test_w8a8_rejects_bad_input_with_the_fix(kernels):
    q = torch.zeros(16, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="multiple of 4.*GROUP_SIZE"):
        kernels.w8a8_pack(q, torch.ones(16, 2), 6)
    with pytest.raises(RuntimeError, match="2 groups of 4"):
        kernels.w8a8_pack(q, torch.ones(16, 1), 4)
    packed, scales = kernels.w8a8_pack(q, torch.ones(16, 2), 4)
    with pytest.raises(RuntimeError, match="same K"):
        kernels.int8_linear(torch.zeros(1, 16), packed, scales, None, 16, 4)
    with pytest.raises(RuntimeError, match="packed by w8a8_pack"):
        kernels.int8_linear(torch.zeros(1, 8), packed, scales[:, :1].contiguous(), None, 16, 4)
    with pytest.raises(RuntimeError, match="path must be"):
        kernels.int8_linear(torch.zeros(1, 8), packed, scales, None, 16, 4, "avx512")
    for path in set(PATHS) - set(paths_built(kernels)):
        with pytest.raises(RuntimeError, match="not in this build"):
            kernels.int8_linear(torch.zeros(1, 8), packed, scales, None, 16, 4, path)
    from nanoengine.layers.linear import MergedLinear

    with pytest.raises(InvalidValueError, match="multiple of 4"):
        quantize_weights(MergedLinear(64, {"q": 16}), kernels, ALL_ROWS, group_size=6)


def test_w8a8_linears_take_every_batch(kernels):
    """quantize_weights with ALL_ROWS: the W8A8 layout, and every batch (1 row to a prefill's 300) through
    the int8-activation kernel: the oracle's result, not the dequantized matmul's."""
    from nanoengine.layers.linear import MergedLinear

    gen = torch.Generator().manual_seed(4)
    layer = MergedLinear(64, {"q": 48, "k": 16}, bias=True)
    original = layer.weight.detach().clone()
    assert quantize_weights(layer, kernels, ALL_ROWS) == 1
    assert layer.int8_weight.dim() == 4 and layer.int8_max_rows == ALL_ROWS
    q, scales = quantize_int8(original)
    for rows in (1, 7, 300):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(layer(x).double(), oracle(x, q, scales, 32, layer.bias), atol=1e-4,
                                   rtol=1e-5)


def test_the_plan_takes_w8a8_on_cpu_and_refuses_it_on_cuda():
    from plans import plan_of

    from nanoengine.plan import check_quantization

    with pytest.raises(InvalidValueError, match="device='cpu' only"):
        check_quantization("w8a8", "cuda")
    plan = plan_of(device="cpu", quantization="w8a8")
    assert plan.quantization == "w8a8" and plan.int8_weight_rows == ALL_ROWS and plan.bf16_weight_rows == 0


@pytest.mark.xdist_group("tiny")
def test_w8a8_fused_decode_equals_the_layer_by_layer_forward(kernels):
    """tiny-qwen3 in W8A8: the fused decode step == the layer-by-layer forward bit for bit, and greedy tokens
    equal enforce_eager=True's."""
    from test_kernels import decode_step_input

    from nanoengine import LLM, SamplingParams

    prompts = [[5, 17, 300, 42] * n for n in (1, 7, 15)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM("tiny-qwen3", quantization="w8a8", enforce_eager=eager, max_num_batched_tokens=32,
                  num_kvcache_blocks=64, dtype="float32")
        runner = llm.engine.executor.runner
        assert (llm.plan.decode_mode is DecodeMode.FUSED_CPU) is (not eager)
        assert runner.model.lm_head.int8_weight.dim() == 4
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager:
            inp = decode_step_input(llm, [[5 + i, 17, 300, 42] * 3 for i in range(3)])
            with torch.inference_mode():
                assert torch.equal(runner.fused(inp), runner.eager_forward(inp))
    assert outs[False] == outs[True]


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_w8a8_perplexity_stays_within_bounds(kernels):
    """SmolLM2 (real weights) in W8A8: the fixed text's perplexity rises by under 3% (measured: +0.8% in
    float32)."""
    from nanoengine.bench import quality

    result = quality.compare("smollm2-135m", "w8a8", max_tokens=8, prompts=quality.PROMPTS[:4],
                             text=quality.TEXT, dtype="float32", num_kvcache_blocks=32)
    ppl = result["perplexity"]
    assert 5 < ppl["none"] < 60, f"the unquantized perplexity {ppl['none']:.1f} is off: a broken load?"
    assert result["perplexity_increase"] < 0.03, ppl


def test_the_benchmark_records_which_instruction_paths_run(kernels):
    """bench JSON's kernel_paths: the build's flags and instruction sets, and per kind of work the path that
    'auto' takes here (the same names the kernels' `path` argument takes)."""
    from plans import plan_of

    from nanoengine.bench.hardware import kernel_paths

    auto = dict(kernels.auto_paths())
    w8a8 = kernel_paths(plan_of(device="cpu", quantization="w8a8"))
    assert w8a8["decode_linears"] == w8a8["prefill_linears"] == f"w8a8_linear:{auto['w8a8_linear']}"
    assert auto["w8a8_linear"] in paths_built(kernels) and set(w8a8["cpp_simd"]) == set(kernels.simd_paths())
    int8 = kernel_paths(plan_of(device="cpu", quantization="int8"))
    assert int8["decode_linears"].startswith(f"int8_linear:{auto['int8_linear']}")
    default = plan_of(device="cpu")
    if default.bf16_weight_rows:
        assert kernel_paths(default)["decode_linears"].startswith(f"bf16_linear:{auto['bf16_linear']}")
    assert kernel_paths(plan_of(device="cpu", attention_backend="cpu"))["decode_attention"] == (
        f"paged_decode:{auto['paged_decode']}")


def test_the_roofline_counts_w8a8_weights_as_int8_ones():
    from types import SimpleNamespace

    from nanoengine.bench.roofline import engine_shape

    cfg = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                          model_type="llama")
    shapes = [engine_shape(SimpleNamespace(hf_config=cfg, torch_dtype=torch.float32, bf16_weight_rows=0,
                                           quantization=q)) for q in ("int8", "w8a8", "none")]
    assert shapes[0].weight_bytes_per_step == shapes[1].weight_bytes_per_step
    assert shapes[1].weight_bytes_per_step < shapes[2].weight_bytes_per_step / 3  # 1.125 against 4 bytes
