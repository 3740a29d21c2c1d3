"""prefill_dtype="bfloat16"'s measured row threshold (nanoengine/dtype_choice.py, plan.py): batches of more
rows than the threshold multiply bf16 activations by oneDNN-packed bf16 weights, in the layers and in the
fused C++ decode step alike; smaller ones keep the bf16 copies' kernel (test_kernels.py checks one linear
both ways). Chapter 08."""

from __future__ import annotations

import json

import pytest
import torch

from nanoengine import dtype_choice

ROWS = dtype_choice.ROW_SIZES


def sweep(bf16_ms) -> list[tuple[int, float, float]]:
    """(rows, 2 ms on the plan's path, bf16_ms(rows)) at every measured size."""
    return [(r, 2.0, bf16_ms(r)) for r in ROWS]


@pytest.mark.parametrize("bf16_ms,want", [
    (lambda r: 1.0, 0),  # faster everywhere: every batch
    (lambda r: 1.0 if r >= 16 else 3.0, 15),  # from 16 rows
    (lambda r: 1.0 if r >= 16 or r == 2 else 3.0, 15),  # faster at 2 rows alone: not a threshold
    (lambda r: 1.0 if r >= 512 else 3.0, 511),
    (lambda r: 3.0, None),  # never
    (lambda r: 2.0, None),  # a tie is no reason to round the activations
    (lambda r: 1.9, None),  # nor a near tie (5% faster, within BF16_MARGIN)
    (lambda r: 1.0 if r >= 16 else 1.9, 15),  # near ties at the smaller sizes keep them on the plan's path
    (lambda r: 1.0 if r <= 32 else 3.0, None),  # slower at the largest size: never
])
def test_the_threshold_is_where_bf16_is_faster_at_every_larger_size(bf16_ms, want):
    assert dtype_choice.row_threshold(sweep(bf16_ms)) == want
    assert dtype_choice.row_threshold(list(reversed(sweep(bf16_ms)))) == want  # in any order


def hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, torch_dtype="bfloat16")


def test_the_threshold_is_measured_once_kept_and_a_bad_file_measured_again(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("NANOENGINE_HOME", str(tmp_path))
    calls = []

    def fake(hf, bf16_rows):
        calls.append(bf16_rows)
        return sweep(lambda r: 1.0 if r >= 8 else 3.0)

    hf = hf_config()
    first = dtype_choice.prefill_choice(hf, 256, measure_with=fake)
    assert (first.min_rows, first.source, first.bf16_faster) == (7, dtype_choice.MEASURED, True)
    assert "batches of over 7 rows in bfloat16" in capsys.readouterr().err
    again = dtype_choice.prefill_choice(hf, 256, measure_with=fake)
    assert (again.min_rows, again.source, again.ms_by_rows) == (7, dtype_choice.CACHED, first.ms_by_rows)
    assert calls == [256]
    other = dtype_choice.prefill_choice(hf, 64, measure_with=fake)  # copies of other rows: its own file
    assert other.source == dtype_choice.MEASURED and calls == [256, 64]
    (path,) = tmp_path.glob("kernels/dtype-choice/bf16rows256-*.json")
    record = json.loads(path.read_text())
    record["ms_by_rows"] = record["ms_by_rows"][:3]  # a file of other row sizes (or cut short)
    path.write_text(json.dumps(record))
    assert dtype_choice.prefill_choice(hf, 256, measure_with=fake).source == dtype_choice.MEASURED
    path.write_text("{not json")
    assert dtype_choice.prefill_choice(hf, 256, measure_with=fake).source == dtype_choice.MEASURED
    assert calls == [256, 64, 256, 256]


def test_the_real_measurement_times_both_paths_at_every_size(cpu_kernels):
    from nanoengine.layers import linear

    if not linear.onednn_bf16_available():
        pytest.skip("no oneDNN bf16 on this CPU: prefill_dtype='bfloat16' is refused here")
    ms = dtype_choice.measure_prefill(hf_config(), 8)
    assert [r for r, _, _ in ms] == list(ROWS)
    assert all(a > 0 and b > 0 for _, a, b in ms)


@pytest.mark.slow
@pytest.mark.xdist_group("smollm2")
def test_smollm2_fused_decode_above_the_threshold_equals_the_layer_by_layer_forward(cpu_kernels,
                                                                                     monkeypatch, tmp_path):
    """SmolLM2 in float32 with prefill_dtype='bfloat16' and a threshold of 3 rows: a decode step of 6 streams
    runs its linears in bf16 in the fused C++ step, bit for bit as the layer-by-layer forward; tokens of a
    step of 2 streams equal the float32 engine's (below the threshold nothing changes)."""
    from test_kernels import decode_step_input

    from nanoengine import LLM, SamplingParams
    from nanoengine.layers import linear
    from nanoengine.plan import DecodeMode

    if not linear.onednn_bf16_available():
        pytest.skip("no oneDNN bf16 on this CPU: prefill_dtype='bfloat16' is refused here")
    monkeypatch.setattr(dtype_choice, "cache_path", lambda hf: tmp_path / "choice.json")  # (not the assets)
    monkeypatch.setattr(dtype_choice, "measure_prefill",
                        lambda hf, rows: sweep(lambda r: 1.0 if r >= 4 else 3.0))
    llm = LLM("smollm2-135m", dtype="float32", num_kvcache_blocks=64, prefill_dtype="bfloat16")
    plan = llm.engine.plan
    assert (plan.prefill_dtype, plan.prefill_dtype_min_rows, plan.decode_mode) == ("bfloat16", 3,
                                                                                   DecodeMode.FUSED_CPU)
    runner = llm.engine.executor.runner
    inp = decode_step_input(llm, [[5 + i, 17, 300, 42] * (3 + 2 * i) for i in range(6)])
    assert runner.fused.can_run(inp)
    with torch.inference_mode():
        fused, eager = runner.fused(inp), runner.eager_forward(inp)
    assert torch.equal(fused, eager)
    # one request at a time: a prefill of 3 rows, then steps of 1, all on the bf16 copies' kernel
    prompts = [[5, 17, 300], [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    del llm
    plain = LLM("smollm2-135m", dtype="float32", num_kvcache_blocks=64)
    assert got == [plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_the_plan_takes_the_measured_threshold_and_the_benchmark_records_it(cpu_kernels, monkeypatch,
                                                                           tmp_path):
    from plans import plan_of

    from nanoengine.bench.hardware import gemm_dtype, kernel_paths
    from nanoengine.layers import linear

    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: True)
    monkeypatch.setattr(dtype_choice, "cache_path", lambda hf: tmp_path / "choice.json")
    monkeypatch.setattr(dtype_choice, "measure_prefill",
                        lambda hf, rows: sweep(lambda r: 1.0 if r >= 32 else 3.0))
    opts = dict(device="cpu", dtype="float32", attention_backend="cpu", num_kvcache_blocks=8)
    plan = plan_of(hf_config(), prefill_dtype="bfloat16", **opts)
    assert (plan.bf16_weight_rows, plan.prefill_dtype, plan.prefill_dtype_min_rows) == (256, "bfloat16", 31)
    paths = kernel_paths(plan)
    assert paths["decode_linears"] == paths["prefill_linears"]
    assert "(<= 31 rows), onednn:bf16 activations" in paths["decode_linears"]
    assert gemm_dtype(plan) is torch.bfloat16  # the roofline's compute ceiling: what those linears run in
    plain = plan_of(hf_config(), **opts)  # the default: no threshold, float32 above the copies' rows
    assert (plain.prefill_dtype, plain.prefill_dtype_min_rows) == ("float32", 0)
    assert kernel_paths(plain)["decode_linears"].endswith("(<= 256 rows), torch:float32 matmul above")
    assert gemm_dtype(plain) is torch.float32
