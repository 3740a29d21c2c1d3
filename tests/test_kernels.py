"""nanoengine.kernels: the CPU kernels' fused glue (RMSNorm with residual, rotary, SwiGLU) == the eager
PyTorch layers they replace: bit for bit in bfloat16 (they round where the eager ops round), to float32
rounding in float32; the paged decode kernel == the torch backend's decode; and an engine with the kernels
== one without them."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_attention import make_layout

import nanoengine.attention.torch_backend as torch_backend
from nanoengine.layers.activation import silu_and_mul
from nanoengine.layers.norm import RMSNorm
from nanoengine.layers.rotary import RotaryEmbedding
from nanoengine.plan import DecodeMode

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def kernels(cpu_kernels):
    return cpu_kernels


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if want.dtype == torch.bfloat16:
        assert torch.equal(got, want), f"{what}: max diff {(got.float() - want.float()).abs().max()}"
    else:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6, msg=what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (17, 576), (5, 1024)])
def test_rms_norm_with_and_without_residual(kernels, dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, dim, generator=gen).to(dtype)
    fused = RMSNorm(dim, 1e-5, kernels).to(dtype)
    fused.weight.data = norm.weight.data
    want, (want_n, want_r) = norm(x), norm.forward_add(x, residual)
    got, (got_n, got_r) = fused(x), fused.forward_add(x, residual)
    same(got, want, "rms_norm")
    same(got_n, want_n, "add + rms_norm: normed")
    same(got_r, want_r, "add + rms_norm: residual sum")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (2, 1, 32)])
def test_rotary_on_views_of_qkv(kernels, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * head_dim)
    tokens = 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided views, as in the model
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    rope, fused = RotaryEmbedding(head_dim, 4096, 10000.0), RotaryEmbedding(head_dim, 4096, 10000.0, kernels)
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = fused(positions, q, k)
    same(got_q, want_q, "rotary q")
    same(got_k, want_k, "rotary k")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(kernels, dtype):
    """SiLU's exp comes from a different vector math library than PyTorch's, so a few bf16 results land one
    rounding step away; everything else is equal."""
    gate_up = (torch.randn(7, 2 * 1536, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    got, want = kernels.silu_and_mul(gate_up), silu_and_mul(gate_up)
    assert got.dtype == want.dtype and got.shape == want.shape
    # about one bf16 step at most
    torch.testing.assert_close(got.float(), want.float(), rtol=1 / 64, atol=1e-6)
    differ = (got != want).float().mean().item()
    assert differ < (0.002 if dtype == torch.bfloat16 else 1.0), f"{differ:.2%} of the outputs differ"


@pytest.mark.xdist_group("tiny")
def test_engine_with_cpu_kernels_equals_torch_backend(kernels):
    """tiny-qwen3 in float32, greedy: the 'cpu' backend (decode kernel + fused glue) gives the same tokens as
    the pure-PyTorch backend, with chunked prefill and a prefix-cache hit in the mix."""
    from nanoengine import LLM, SamplingParams

    prompts = [[5, 17, 300, 42] * n for n in (1, 7, 15)] + [[5, 17, 300, 42] * 15 + [9, 9]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM("tiny-qwen3", attention_backend=backend, max_num_batched_tokens=32, num_kvcache_blocks=64)
        assert llm.plan.attention_backend == backend
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["cpu"] == outs["torch"]


@pytest.mark.parametrize("head_dim", [64, 128, 48])
@pytest.mark.parametrize("batch", [1, 7])
def test_cpu_kernel_equals_torch_decode_in_bf16(head_dim, batch, cpu_kernels):
    """The kernel against the torch backend's decode in bfloat16 (the engine's CPU dtype), on long
    contexts."""
    gen = torch.Generator().manual_seed(head_dim + batch)
    num_heads, num_kv_heads, block_size, num_blocks = 9, 3, 16, 600
    lens = torch.randint(1, 700, (batch,), generator=gen)
    tables = make_layout(lens.tolist(), block_size, num_blocks, gen)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    q = torch.randn(batch, num_heads, head_dim, generator=gen).bfloat16()
    scale = head_dim ** -0.5
    exact = torch_backend.decode_attention(q.double(), k_cache.double(), v_cache.double(), block_tables, lens,
                                           scale)
    kernel = cpu_kernels.paged_decode(q, k_cache, v_cache, block_tables, lens, scale)
    eager = torch_backend.decode_attention(q, k_cache, v_cache, block_tables, lens, scale)
    assert kernel.dtype == torch.bfloat16 and kernel.shape == q.shape
    # the kernel accumulates in float32 and rounds once: no worse than the torch backend's bf16 matmuls
    err_kernel = (kernel.double() - exact).abs().max().item()
    err_eager = (eager.double() - exact).abs().max().item()
    assert err_kernel <= max(err_eager, 4e-3), (err_kernel, err_eager)


@pytest.mark.parametrize("q_dtype,kv_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_cpu_kernel_plain_loops_equal_its_avx2_code(q_dtype, kv_dtype, head_dim, cpu_kernels):
    """The decode kernel's plain loops (what a CPU without AVX2 runs) against its AVX2 code, for each
    (queries, cache) pair it reads (a bf16 cache under float32 queries: kv_cache_dtype="bfloat16"); both
    against float64 where this build has no AVX2."""
    gen = torch.Generator().manual_seed(head_dim)
    lens = torch.tensor([1, 37, 300])
    tables = make_layout(lens.tolist(), 16, 64, gen)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    k_cache = torch.randn(3, 64, 16, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(3, 64, 16, head_dim, generator=gen).to(kv_dtype)
    q = torch.randn(3, 9, head_dim, generator=gen).to(q_dtype)
    scale = head_dim ** -0.5
    plain = cpu_kernels.paged_decode(q, k_cache, v_cache, block_tables, lens, scale, "plain")
    assert plain.dtype == q_dtype
    exact = torch_backend.decode_attention(q.double(), k_cache.double(), v_cache.double(), block_tables, lens,
                                           scale)
    tol = 1e-2 if q_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(plain.double(), exact, atol=tol, rtol=tol)
    try:
        avx2 = cpu_kernels.paged_decode(q, k_cache, v_cache, block_tables, lens, scale, "avx2")
    except RuntimeError as e:
        assert "not in this build" in str(e)
        return
    torch.testing.assert_close(avx2.double(), plain.double(), atol=tol, rtol=tol)
    assert torch.equal(cpu_kernels.paged_decode(q, k_cache, v_cache, block_tables, lens, scale), avx2)


def test_cpu_kernel_rejects_bad_input(cpu_kernels):
    q = torch.zeros(1, 4, 8)
    cache = torch.zeros(3, 2, 4, 8)  # 4 query heads over 3 kv heads: not a group
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        cpu_kernels.paged_decode(q, cache, cache, torch.zeros(1, 1, dtype=torch.long),
                                 torch.ones(1, dtype=torch.long), 1.0)


BF16_PATHS = ("avx512bf16", "avx512", "avx2", "plain")


def bf16_paths_built(kernels) -> list[str]:
    """The bf16_linear paths this build has (the plain loops always; AVX2, AVX-512, AVX512-BF16 where
    compiled): each packed for itself and run once."""
    built = []
    for path in BF16_PATHS:
        try:
            packed = kernels.bf16_pack(torch.zeros(16, 4), path)
            kernels.bf16_linear(torch.zeros(1, 4), packed, None, 16, path)
            built.append(path)
        except RuntimeError as e:
            assert "not in this build" in str(e)
    return built


def test_bf16_paths_follow_the_cpu_and_auto_runs_the_best_widening_path(kernels):
    from nanoengine.kernels import cpu as cpu_kernels

    built = bf16_paths_built(kernels)
    native = any(f in cpu_kernels.chosen_flags() for f in ("-march=native", "-mcpu=native"))
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    assert "plain" in built
    if native and capability.startswith("AVX"):
        assert "avx2" in built
    if native and capability == "AVX512":
        assert "avx512" in built and kernels.bf16_best_path() == "avx512"
    assert set(kernels.simd_paths()) >= set(built) - {"plain"}
    # "auto" packs for the best path and never picks the dot-product path (slower where measured)
    assert kernels.bf16_best_path() in built and kernels.bf16_best_path() != "avx512bf16"
    want_dims = 4 if kernels.bf16_best_path() == "avx512" else 3
    assert kernels.bf16_pack(torch.zeros(16, 4)).dim() == want_dims


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 8, 13, 32])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (13, 40), (6, 1539), (24, 8), (40, 7)])
def test_bf16_linear_equals_the_float32_linear_of_its_weights(kernels, rows, out_features, in_features):
    """Every path this build has, each on its layout ([blocks, K, 8]; pairs [blocks, K2, 16, 2]): bf16
    weights, float32 sums, the float64 linear of the same (bf16-valued) weights, up to the order of the sums;
    the dot-product path (AVX512-BF16) within its documented rounding of x (x = hi + lo, two bf16 parts:
    under 2^-16 of |x|). Partial blocks, an odd K, columns past a multiple of 4, every row tile included."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    magnitude = torch.nn.functional.linear(x.double().abs(), weight.double().abs())  # [rows, out]
    for path in bf16_paths_built(kernels):
        packed = kernels.bf16_pack(weight, path)
        if path.startswith("avx512"):
            assert packed.shape == (-(-out_features // 16), -(-in_features // 2), 16, 2)
        else:
            assert packed.shape == (-(-out_features // 8), in_features, 8)
        got = kernels.bf16_linear(x, packed, bias, out_features, path)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        err = (got.double() - want).abs()
        bound = (2.0**-15 if path == "avx512bf16" else 2.0**-20) * magnitude + 1e-5
        assert (err <= bound).all(), f"path {path}: {(err - bound).max().item():.3g} over the bound"
        # bf16 activations: one rounding of the float32 result, as a bf16 matmul rounds its output
        got_bf16 = kernels.bf16_linear(x.bfloat16(), packed, None, out_features, path)
        want_bf16 = torch.nn.functional.linear(x.bfloat16().float(), weight.float()).bfloat16()
        assert got_bf16.dtype == torch.bfloat16
        differ = (got_bf16 != want_bf16).float().mean().item()
        assert differ < 0.03, f"path {path}: {differ:.1%} of the bf16 outputs differ (sum order flips few)"
        torch.testing.assert_close(got_bf16.float(), want_bf16.float(), rtol=1 / 128, atol=1e-3)


def test_bf16_linear_rejects_bad_input(kernels):
    packed = kernels.bf16_pack(torch.zeros(4, 8), "plain")
    with pytest.raises(RuntimeError, match="packed by bf16_pack"):
        kernels.bf16_linear(torch.zeros(1, 8), torch.zeros(4, 8).bfloat16(), None, 4)
    with pytest.raises(RuntimeError, match="same K"):
        kernels.bf16_linear(torch.zeros(1, 16), packed, None, 4)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.bf16_linear(torch.zeros(1, 8), packed, None, 9)
    with pytest.raises(RuntimeError, match="path must be"):
        kernels.bf16_linear(torch.zeros(1, 8), packed, None, 4, "avx1024")
    built = bf16_paths_built(kernels)
    if "avx512" in built:  # a path reads its own layout: the error names the pack that fits
        with pytest.raises(RuntimeError, match=r"bf16_pack\(weight, 'avx512'\)"):
            kernels.bf16_linear(torch.zeros(1, 8), packed, None, 4, "avx512")
    for path in set(BF16_PATHS) - set(built):
        with pytest.raises(RuntimeError, match="not in this build"):
            kernels.bf16_pack(torch.zeros(4, 8), path)


def test_linears_with_bf16_weights_switch_by_rows_and_refuse_inexact_weights(kernels):
    """use_bf16_weights: batches up to max_rows go through the kernel, larger ones through the float32 matmul,
    both equal to the float32 linear; a float32 weight that bf16 cannot hold exactly is refused."""
    from nanoengine.errors import InvalidValueError
    from nanoengine.layers.linear import MergedLinear, use_bf16_weights

    gen = torch.Generator().manual_seed(5)
    layer = MergedLinear(64, {"q": 48, "k": 16}, bias=True)
    with pytest.raises(InvalidValueError, match="not exactly bf16"):
        use_bf16_weights(layer, kernels, 4)
    layer.weight.data = layer.weight.data.bfloat16().float()
    plain = torch.nn.functional.linear
    assert use_bf16_weights(layer, kernels, 4) == 1 and layer.bf16_weight.dtype == torch.bfloat16
    for rows in (1, 4, 5, 40):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(layer(x), plain(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    # in bf16 (a CPU without oneDNN bf16): small batches through the kernel, large ones in float32 rounded
    # once
    layer = layer.to(torch.bfloat16)
    use_bf16_weights(layer, kernels, 4)
    for rows in (3, 40):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        got, want = layer(x), plain(x.float(), layer.weight.float(), layer.bias.float()).bfloat16()
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=1 / 128, atol=1e-2)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_float32_with_bf16_weight_copies_equals_without(kernels, monkeypatch):
    """smollm2 (a bf16 checkpoint) in float32: greedy tokens with the linears' bf16 weight copies (batches of
    1 and 5 rows decode through the kernel) == the plain float32 matmuls, and the switch is on by default."""
    from nanoengine import LLM, SamplingParams
    from nanoengine import plan_cpu as engine_plan

    prompts = [[5, 17, 300, 42] * n for n in (1, 7, 15, 3, 30)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for rows in (engine_plan.BF16_WEIGHT_MAX_ROWS, 0):
        monkeypatch.setattr(engine_plan, "BF16_WEIGHT_MAX_ROWS", rows)
        llm = LLM("smollm2-135m", dtype="float32", num_kvcache_blocks=64)
        head = llm.engine.executor.runner.model.lm_head
        assert (head.bf16_weight is not None) == bool(rows)
        outs[rows] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        outs[rows, "single"] = llm.generate([prompts[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[engine_plan.BF16_WEIGHT_MAX_ROWS] == outs[0]
    assert outs[engine_plan.BF16_WEIGHT_MAX_ROWS, "single"] == outs[0, "single"]


def decode_step_input(llm, prompts: list[list[int]]):
    """Drive the engine until it builds a decode-only step of these prompts; return that step's input (the
    requests are aborted, their blocks keep the K/V the step reads, so the step can be run more than once)."""
    from nanoengine import SamplingParams

    eng = llm.engine
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
            for p in prompts]
    while True:
        out = eng.scheduler.schedule()
        built = eng.inputs.build(out.scheduled)
        inp, sample_seqs = built.inputs, built.sample_seqs
        if inp.is_decode_only:
            for rid in rids:
                eng.abort(rid)
            return inp
        forward = eng.executor.launch(inp, eng.sampling.batch(sample_seqs))
        eng.scheduler.update(out, forward.tokens())


@pytest.mark.parametrize("model,batch", [("tiny-qwen3", 1), ("tiny-qwen3", 5), ("smollm2-135m", 1),
                                         ("smollm2-135m", 6)])
def test_fused_decode_step_equals_the_layer_by_layer_forward_bit_for_bit(kernels, model, batch):
    """FusedDecode (every decoder layer of a decode step in one C++ call) runs the same kernels in the same
    order as the model's forward: equal hidden states, bit for bit. tiny-qwen3: Qwen3's q/k norms (the kernel
    on one row, the eager ops on strided rows of a batch) and plain float32 linears; smollm2 in float32: the
    linears' bf16 copies."""
    from nanoengine import LLM

    llm = LLM(model, dtype="float32", num_kvcache_blocks=64)
    runner = llm.engine.executor.runner
    assert llm.plan.decode_mode is DecodeMode.FUSED_CPU and runner.fused is not None
    assert (runner.fused.max_rows is None) == (model == "tiny-qwen3")  # tiny-qwen3 is not a bf16 checkpoint
    inp = decode_step_input(llm, [[5 + i, 17, 300, 42] * (3 + 2 * i) for i in range(batch)])
    assert runner.fused.can_run(inp)
    with torch.inference_mode():
        fused = runner.fused(inp)
        eager = runner.eager_forward(inp)
        with runner.fused.timed() as times:
            again = runner.fused(inp)
    assert fused.shape == (batch, llm.plan.hf_config.hidden_size)
    assert torch.equal(fused, eager) and torch.equal(again, fused)
    assert times["linears"] > 0 and times["attention"] > 0


@pytest.mark.xdist_group("tiny")
def test_fused_decode_is_on_where_it_mirrors_the_forward_and_off_with_enforce_eager(kernels):
    """On CPU with the cpu backend decode steps run fused: greedy tokens equal to enforce_eager=True's (which
    turns it off), with chunked prefill and a prefix hit in the mix."""
    from nanoengine import LLM, SamplingParams

    prompts = [[5, 17, 300, 42] * n for n in (1, 7, 15)] + [[5, 17, 300, 42] * 15 + [9, 9]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM("tiny-qwen3", enforce_eager=eager, max_num_batched_tokens=32, num_kvcache_blocks=64)
        fused = llm.plan.decode_mode is DecodeMode.FUSED_CPU
        assert fused is (not eager) and (llm.engine.executor.runner.fused is None) is eager
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[False] == outs[True]


# ------------------------------------------------------------------------------------------ prefill_dtype
def test_prefill_dtype_is_checked_and_refused_where_it_cannot_run():
    from plans import plan_of

    from nanoengine.config import EngineConfig
    from nanoengine.errors import InvalidValueError

    with pytest.raises(InvalidValueError, match=r"prefill_dtype must be one of \('auto', 'bfloat16'\)"):
        EngineConfig(prefill_dtype="float16")
    # tiny-qwen3 is a float32 checkpoint: no exact bf16 copies to multiply
    with pytest.raises(InvalidValueError, match="prefill_dtype='bfloat16' runs a bf16 checkpoint's prefill"):
        plan_of(device="cpu", dtype="float32", attention_backend="torch", prefill_dtype="bfloat16",
                num_kvcache_blocks=8)
    assert plan_of(device="cpu", dtype="float32", attention_backend="torch",
                   num_kvcache_blocks=8).prefill_dtype == "float32"


@pytest.mark.parametrize("faster", [True, False])
def test_prefill_dtype_follows_the_kept_measurement(faster, monkeypatch, tmp_path, kernels):
    """prefill_dtype='bfloat16' is used where bf16 measured faster (measured once, then read back), and
    where it did not, prefill stays float32 with a warning saying so."""
    from plans import plan_of
    from transformers import LlamaConfig

    from nanoengine import dtype_choice, plan
    from nanoengine.layers import linear

    monkeypatch.setattr(dtype_choice, "cache_path", lambda hf: tmp_path / "choice.json")
    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: True)
    calls = []

    def fake(hf, bf16_rows):
        calls.append(bf16_rows)
        return [(r, 2.0, (1.0 if r >= 16 else 3.0) if faster else 3.0) for r in dtype_choice.ROW_SIZES]

    monkeypatch.setattr(dtype_choice, "measure_prefill", fake)
    hf = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, torch_dtype="bfloat16")
    for _ in range(2):
        if faster:
            got = plan.pick_prefill_dtype("bfloat16", "float32", 256, hf)
        else:
            with pytest.warns(UserWarning, match="measured slower than float32"):
                got = plan.pick_prefill_dtype("bfloat16", "float32", 256, hf)
        assert got == (("bfloat16", 15) if faster else ("float32", 0))
    assert calls == [256]  # kept: the second plan reads it back
    with contextlib.nullcontext() if faster else pytest.warns(UserWarning, match="measured slower"):
        made = plan_of(hf, device="cpu", dtype="float32", attention_backend="cpu", num_kvcache_blocks=8,
                       prefill_dtype="bfloat16")
    assert (made.prefill_dtype, made.prefill_dtype_min_rows) == got


@pytest.mark.parametrize("min_rows", [None, 8])
def test_linears_with_bf16_prefill_round_activations_above_the_row_threshold(kernels, min_rows):
    """use_bf16_prefill: batches of over its rows (BF16_PREFILL_MIN_ROWS, or the plan's measured threshold)
    == the bf16 matmul of the rounded activations (bias added in float32), smaller ones keep their path (bf16
    copies' kernel); the fused step's C++ Linear, given the same copy and rows, gives both bit for bit."""
    from nanoengine.layers.linear import BF16_PREFILL_MIN_ROWS, PackableLinear

    rows = BF16_PREFILL_MIN_ROWS if min_rows is None else min_rows
    gen = torch.Generator().manual_seed(0)
    layer = PackableLinear(40, 24, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(24, 40, generator=gen).bfloat16().float())
        layer.bias.copy_(torch.randn(24, generator=gen))
    layer.use_bf16(kernels, 256)
    small, large = torch.randn(rows, 40, generator=gen), torch.randn(rows + 1, 40, generator=gen)
    before = layer(small), layer(large)
    layer.use_bf16_prefill() if min_rows is None else layer.use_bf16_prefill(min_rows)
    assert torch.equal(layer(small), before[0])
    want = torch.nn.functional.linear(large.bfloat16(), layer.weight.bfloat16()).float() + layer.bias
    assert torch.equal(layer(large), want) and not torch.equal(want, before[1])
    torch.testing.assert_close(layer(large), torch.nn.functional.linear(large, layer.weight, layer.bias),
                               atol=0.1, rtol=0.02)  # bf16 activations: ~3 significant digits
    fused = kernels.Linear(packed=layer.bf16_weight, weight=layer.weight.detach(), bias=layer.bias,
                           out_features=24, onednn=layer.bf16_prefill_weight,
                           onednn_min_rows=layer.bf16_min_rows)
    with torch.inference_mode():
        assert torch.equal(fused(small), before[0]) and torch.equal(fused(large), want)
        assert torch.equal(kernels.onednn_bf16_linear(large, layer.bf16_prefill_weight, layer.bias), want)


def test_smollm2_prefill_in_bf16_keeps_its_perplexity(kernels):
    """SmolLM2-135M in float32 with prefill_dtype='bfloat16' (where this CPU has oneDNN bf16 and it measured
    faster): the perplexity of a ~200-token text from one prefill is the float32 prefill's within 2% (measured
    on a Xeon with AMX: 19.77 against 19.81). Greedy tokens are not compared: rounding the activations moves
    near-ties (2 of 12 prompts of bench/quality.py diverged within 64 tokens there)."""
    from nanoengine import LLM
    from nanoengine.bench import quality
    from nanoengine.layers import linear

    if not linear.onednn_bf16_available():
        pytest.skip("no oneDNN bf16 on this CPU: prefill_dtype='bfloat16' is refused here")
    llm = LLM("smollm2-135m", dtype="float32", num_kvcache_blocks=64, prefill_dtype="bfloat16")
    if llm.engine.plan.prefill_dtype != "bfloat16":
        pytest.skip("bf16 prefill measured slower than float32 on this CPU")
    ppl_bf16 = quality.perplexity(llm)
    del llm
    ppl = quality.perplexity(LLM("smollm2-135m", dtype="float32", num_kvcache_blocks=64))
    assert abs(ppl_bf16 / ppl - 1) < 0.02, (ppl_bf16, ppl)
