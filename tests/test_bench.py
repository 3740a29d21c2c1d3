"""The benchmark: seeded workloads (nano-vllm's exact draw), metrics and the roofline against hand-computed
cases, and `nanoengine bench` end to end on tiny-qwen3 (JSON, plot, table; online mode; skipped peers).
No speed assertions."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from nanoengine.bench.metrics import percentile, request_latencies, step_summary, summarize
from nanoengine.bench.roofline import ModelShape, roofline, workload_cost
from nanoengine.bench.workload import WORKLOADS, make_workload, poisson_arrivals
from nanoengine.cli import main as cli_main
from nanoengine.trace import StepStats

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ workloads
def seed_bench_draw(num_seqs: int, max_input_len: int, max_output_len: int, min_len: int):
    """nano-vllm's bench.py, verbatim but for the counts (module-level random, as the seed does; the global
    random state is restored afterwards)."""
    from random import randint, seed

    state = random.getstate()
    try:
        seed(0)
        prompt_token_ids = [[randint(0, 10000) for _ in range(randint(min_len, max_input_len))]
                            for _ in range(num_seqs)]
        max_tokens = [randint(min_len, max_output_len) for _ in range(num_seqs)]
    finally:
        random.setstate(state)
    return prompt_token_ids, max_tokens


def test_nano_vllm_workload_is_exactly_the_seeds_draw():
    prompts, outs = seed_bench_draw(256, 1024, 1024, 100)
    wl = make_workload("nano-vllm", vocab_size=151936)
    assert wl.prompts == prompts and wl.output_lens == outs
    assert len(wl) == 256 and wl.temperature == 0.6
    assert max(max(p) for p in wl.prompts) == 10000  # randint is inclusive: 10000 itself is drawn


def test_cpu_small_is_the_same_draw_with_its_sizes():
    prompts, outs = seed_bench_draw(32, 512, 512, 64)
    wl = make_workload("cpu-small", vocab_size=49152)
    assert wl.prompts == prompts and wl.output_lens == outs
    assert all(64 <= len(p) <= 512 for p in wl.prompts) and all(64 <= n <= 512 for n in wl.output_lens)
    assert make_workload("cpu-small").prompts == wl.prompts  # seeded: the same every time
    assert make_workload("cpu-small", seed=1).prompts != wl.prompts


def test_num_requests_takes_the_first_n():
    full = make_workload("cpu-small")
    head = make_workload("cpu-small", num_requests=4)
    assert head.prompts == full.prompts[:4] and head.output_lens == full.output_lens[:4]
    assert head.spec["num_requests"] == 4
    assert len(make_workload("smoke", num_requests=7)) == 7  # more than the default: a larger draw


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="gpu-512"), "unknown workload"),
    (dict(name="cpu-small", num_requests=0), "num-requests"),
    (dict(name="nano-vllm", vocab_size=5000), "vocabulary"),
])
def test_bad_workload_requests_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_workload(**kwargs)


def test_shared_prefix_shares_its_prefix():
    wl = make_workload("shared-prefix", num_requests=16)
    spec = WORKLOADS["shared-prefix"]
    n = spec["prefix_len"]
    prefix = wl.prompts[0][:n]
    assert len(prefix) == n and all(p[:n] == prefix for p in wl.prompts)
    suffixes = [p[n:] for p in wl.prompts]
    lo, hi = spec["suffix_len"]
    assert all(lo <= len(s) <= hi for s in suffixes)
    assert len({tuple(s) for s in suffixes}) == len(suffixes)  # unique suffixes
    assert all(spec["output_len"][0] <= o <= spec["output_len"][1] for o in wl.output_lens)
    assert make_workload("shared-prefix", num_requests=16).prompts == wl.prompts


def test_multi_prefix_puts_each_request_on_one_of_its_system_prompts():
    from nanoengine.bench.workload import shared_prefix_workload

    wl = make_workload("multi-prefix", num_requests=32)
    spec = WORKLOADS["multi-prefix"]
    n, k = spec["prefix_len"], spec["num_prefixes"]
    heads = [tuple(p[:n]) for p in wl.prompts]
    assert len(set(heads)) == k and all(len(h) == n for h in heads)
    order = list(dict.fromkeys(heads))
    which = [order.index(h) for h in heads]
    assert which != [i % k for i in range(len(wl))]  # a seeded mix: round-robin is no accidental match
    one = shared_prefix_workload("x", 16, 64, (4, 8), (2, 3), seed=5)
    assert one.prompts == shared_prefix_workload("x", 16, 64, (4, 8), (2, 3), seed=5, num_prefixes=1).prompts


def test_poisson_arrivals_are_seeded_with_the_right_mean():
    a = poisson_arrivals(4000, rate=5.0, seed=3)
    assert a == poisson_arrivals(4000, rate=5.0, seed=3) and a != poisson_arrivals(4000, rate=5.0, seed=4)
    gaps = [a[0]] + [y - x for x, y in zip(a, a[1:])]
    assert all(g > 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 5.0, rel=0.06)  # mean gap 1/rate (loose, fixed seed)
    var = sum((g - 0.2) ** 2 for g in gaps) / len(gaps)
    assert var == pytest.approx(0.2**2, rel=0.15)  # exponential: sd = mean
    with pytest.raises(ValueError, match="request-rate"):
        poisson_arrivals(3, rate=0)


# ------------------------------------------------------------------------------------------------ metrics
def test_percentiles_interpolate_linearly():
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # rank 0.9 * 3 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    assert summarize([1, 2, 3, 4]) == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})


def test_request_latencies_by_hand():
    m = [SimpleNamespace(arrival_time=1.0, first_token_time=1.5, finished_time=3.5, num_output_tokens=5),
         SimpleNamespace(arrival_time=2.0, first_token_time=2.1, finished_time=2.1, num_output_tokens=1)]
    lat = request_latencies(m)
    assert lat["ttft_s"]["p50"] == pytest.approx(0.3)  # median of 0.5 and 0.1
    assert lat["tpot_s"]["p50"] == pytest.approx(0.5)  # (3.5 - 1.5) / 4; one-token output has no TPOT
    assert lat["e2e_s"]["mean"] == pytest.approx((2.5 + 0.1) / 2)


def _step(num_seqs, prefill, decode, used, hits=0, pre=0, sched=0.001, prep=0.002):
    return StepStats(num_seqs=num_seqs, prefill_tokens=prefill, decode_tokens=decode, used_blocks=used,
                     num_blocks=10, cache_hit_tokens=hits, num_preempted=pre, schedule_s=sched,
                     prepare_s=prep, forward_s=0.01, postprocess_s=0.001, time=0.0)


def test_step_summary_by_hand():
    stats = [_step(2, 100, 0, 4, hits=32), _step(2, 0, 2, 6),
             _step(1, 0, 1, 2, pre=1, sched=0.003, prep=0.001)]
    s = step_summary(stats, prompt_tokens=128)
    assert s["batch_size"] == {"peak": 2, "mean": pytest.approx(5 / 3)}
    assert s["kv_use"]["peak"] == pytest.approx(0.6) and s["kv_use"]["mean"] == pytest.approx(0.4)
    assert s["prefix_cache"]["hit_rate"] == pytest.approx(0.25) and s["preemptions"] == 1
    oh = s["host_overhead_ms"]  # decode steps only (no prefill): 3 ms and 4 ms
    assert oh["num_steps"] == 2 and oh["mean"] == pytest.approx(3.5) and oh["p50"] == pytest.approx(3.5)
    big = step_summary(stats + [_step(256, 0, 256, 9, sched=0.0005, prep=0.0003)], prompt_tokens=128)
    assert big["host_overhead_ms"]["num_steps"] == 1 and big["host_overhead_ms"]["mean"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="no engine steps"):
        step_summary([], prompt_tokens=1)


# ------------------------------------------------------------------------------------------------ roofline
TINY = ModelShape(hidden=4, layers=1, heads=2, kv_heads=1, head_dim=2, intermediate=8, vocab=10, tied=True,
                  dtype_bytes=2)


def test_roofline_costs_by_hand():
    # q 4x4, k 4x2, v 4x2, o 4x4 = 48; gate, up, down 3 x 4x8 = 96
    assert TINY.linear_params == 144 and TINY.lm_head_params == 40 and TINY.norm_params == 12
    assert TINY.weight_bytes_per_step == (144 + 12 + 40) * 2
    # float32 activations and norms, linears streamed as bf16 copies (a bf16 checkpoint on an AVX2 CPU)
    copies = dataclasses.replace(TINY, dtype_bytes=4, weight_dtype_bytes=2)
    assert copies.weight_bytes_per_step == (144 + 40) * 2 + 12 * 4
    assert TINY.kv_bytes_per_position == 2 * 1 * 1 * 2 * 2
    # one request: prompt 3, output 2 -> positions 0..3 go through the layers, context 1..4
    c = workload_cost(TINY, [3], [2], num_steps=2)
    assert c["flops_linear"] == 2 * 144 * 4
    assert c["flops_attention"] == 4 * 1 * 2 * 2 * (1 + 2 + 3 + 4)
    assert c["flops_lm_head"] == 2 * 40 * 2 and c["flops"] == 1152 + 160 + 160
    assert c["bytes_weights"] == 392 * 2
    assert c["bytes_kv_read"] == 8 * 4  # one decode position (3) reads a context of 4
    assert c["bytes_kv_write"] == 8 * 4 and c["bytes"] == 784 + 32 + 32
    hit = workload_cost(TINY, [3], [2], num_steps=2, cached_lens=[2])  # positions 0, 1 from the prefix cache
    assert hit["flops_linear"] == 2 * 144 * 2 and hit["flops_attention"] == 16 * (3 + 4)
    r = roofline(c, gemm_gflops=1472e-9, memory_gbs=848e-9 / 2, seconds=4.0)
    assert r["compute_bound_s"] == pytest.approx(1.0) and r["memory_bound_s"] == pytest.approx(2.0)
    assert r["bound"] == "memory" and r["limit_s"] == pytest.approx(2.0)
    assert r["achieved_fraction_of_limit"] == pytest.approx(0.5)
    assert r["compute_bound_output_tokens_per_s"] == pytest.approx(2.0)
    assert r["fraction_of_compute_bound"] == pytest.approx(0.25)  # engine 0.5 tok/s of 2 tok/s


def test_decode_step_cost_by_hand():
    from nanoengine.bench.roofline import decode_step_cost

    # two sequences with contexts 4 and 1: each feeds one token through the layers and the LM head
    c = decode_step_cost(TINY, [4, 1])
    assert c["flops_linear"] == 2 * 144 * 2 and c["flops_lm_head"] == 2 * 40 * 2
    assert c["flops_attention"] == 4 * 1 * 2 * 2 * (4 + 1) and c["flops"] == 576 + 160 + 80
    assert c["bytes_weights"] == 392  # once for the whole step
    assert c["bytes_kv_read"] == 8 * (4 + 1) and c["bytes_kv_write"] == 8 * 2 and c["bytes"] == 392 + 40 + 16
    assert c["output_tokens"] == 2 and c["num_steps"] == 1 and c["processed_positions"] == 2
    with pytest.raises(ValueError, match=">= 1"):
        decode_step_cost(TINY, [3, 0])
    r = roofline(c, gemm_gflops=816e-9, memory_gbs=448e-9)  # no measured time: bounds only
    assert r["compute_bound_s"] == pytest.approx(1.0) and r["memory_bound_s"] == pytest.approx(1.0)
    assert r["achieved_fraction_of_limit"] is None and r["fraction_of_compute_bound"] is None


def test_assumed_machines_and_the_engines_shape():
    from nanoengine.bench.roofline import LAPTOP_CPU, RTX_4070_LAPTOP, engine_shape

    assert RTX_4070_LAPTOP.memory_gbs == 128 / 8 * 16  # 128-bit bus, 16 Gb/s per pin
    assert RTX_4070_LAPTOP.gemm_gflops == pytest.approx(36_864)
    assert RTX_4070_LAPTOP.balance == pytest.approx(144)
    assert LAPTOP_CPU.memory_gbs == pytest.approx(2 * 8 * 5.6) and LAPTOP_CPU.gemm_gflops == 8 * 2 * 8 * 2 * 3
    cfg = SimpleNamespace(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=2, intermediate_size=8, vocab_size=10, tie_word_embeddings=True)
    plan = SimpleNamespace(hf_config=cfg, torch_dtype=SimpleNamespace(itemsize=4), bf16_weight_rows=0)
    assert engine_shape(plan) == dataclasses.replace(TINY, dtype_bytes=4)
    plan.bf16_weight_rows = 256  # float32 activations, linears streamed as bf16 copies
    assert engine_shape(plan) == dataclasses.replace(TINY, dtype_bytes=4, weight_dtype_bytes=2)


@pytest.mark.xdist_group("tiny")
def test_decode_points_one_per_batch_at_the_contexts_the_engine_ran():
    """decode_points' FLOPs and bytes are those of steps at the contexts the trace records (every sequence
    of a decode step at num_computed_before = prompt + i), its times the gaps between the steps' ends."""
    from nanoengine import LLM
    from nanoengine.bench.decode_batches import decode_points
    from nanoengine.bench.roofline import engine_shape

    llm = LLM("tiny-qwen3", num_kvcache_blocks=64, trace=True)
    shape = engine_shape(llm.plan)
    pts = decode_points(llm, batch_sizes=(3,), prompt_len=5, steps=4)
    decodes = [s for s in llm.trace.steps if s.decode_tokens]
    assert [s.stats.num_seqs for s in decodes] == [3] * 4
    assert [sorted({e.num_computed_before for e in s.scheduled}) for s in decodes] == [[5], [6], [7], [8]]
    (p,) = pts
    per_seq = 2 * (shape.linear_params + shape.lm_head_params)
    contexts = [7, 8, 9]  # the three timed steps (the first decode step follows the prefill: not timed)
    flops = [3 * per_seq + 3 * 4 * shape.layers * shape.heads * shape.head_dim * c for c in contexts]
    nbytes = [shape.weight_bytes_per_step + 3 * shape.kv_bytes_per_position * (c + 1) for c in contexts]
    assert p["batch"] == 3 and p["flops"] == pytest.approx(sum(flops) / 3)
    assert p["bytes"] == pytest.approx(sum(nbytes) / 3)
    assert p["intensity"] == pytest.approx(p["flops"] / p["bytes"])
    ends = [s.time for s in decodes]
    assert p["step_times_s"] == pytest.approx([b - a for a, b in zip(ends, ends[1:])])
    assert p["step_s"] == pytest.approx(sorted(p["step_times_s"])[1])
    assert p["gflops"] == pytest.approx(p["flops"] / p["step_s"] / 1e9)
    with pytest.raises(ValueError, match="does not fit in one step"):
        decode_points(LLM("tiny-qwen3", num_kvcache_blocks=64, max_num_batched_tokens=8), batch_sizes=(2,),
                      prompt_len=5)


def test_model_shape_counts_every_parameter_of_a_real_checkpoint(tiny_qwen3_path):
    from safetensors import safe_open
    from transformers import AutoConfig

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_qwen3_path), dtype_bytes=4)
    with safe_open(tiny_qwen3_path / "model.safetensors", "pt") as f:
        numel = {k: f.get_slice(k).get_shape() for k in f.keys()}
    total = sum(math.prod(s) for s in numel.values())
    assert shape.tied
    # embedding == tied LM head
    assert shape.linear_params + shape.norm_params + shape.lm_head_params == total


# ------------------------------------------------------------------------------------------------ end to end
def run_cli(*args: str) -> int:
    return cli_main(["bench", "--model", "tiny-qwen3", "--quiet", "--threads", "1", *args])


@pytest.mark.xdist_group("tiny")
def test_cli_bench_writes_json_plot_and_table(tmp_path, capsys):
    before = set((ROOT / "figures").iterdir())
    rc = run_cli("--workload", "cpu-small", "--num-requests", "4", "--peers", "vllm,nano-vllm",
                 "--out-dir", str(tmp_path / "res"), "--figures-dir", str(tmp_path / "fig"))
    assert rc == 0
    files = list((tmp_path / "res").glob("*.json"))
    assert len(files) == 1 and "tiny-qwen3_cpu-small" in files[0].name and "torch" in files[0].name

    def no_nan(x):
        raise ValueError(f"not strict JSON: {x}")

    r = json.loads(files[0].read_text(), parse_constant=no_nan)
    wl = make_workload("cpu-small", num_requests=4)
    assert r["num_requests"] == 4 and r["output_tokens"] == wl.num_output_tokens
    assert r["workload_spec"]["seed"] == 0 and r["workload_spec"]["input_len"] == [64, 512]
    eng = r["nanoengine"]
    assert eng["output_tokens"] == wl.num_output_tokens and eng["output_tokens_per_s"] > 0
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert set(eng["latency"][key]) == {"mean", "p50", "p90", "p99"}
    steps = eng["steps"]
    assert steps["decode_tokens"] + steps["prefill_tokens"] == sum(eng["series"]["prefill_tokens"]) + sum(
        eng["series"]["decode_tokens"])
    assert steps["prefill_tokens"] == wl.num_prompt_tokens  # no preemption, no hits on random prompts
    assert steps["decode_tokens"] == wl.num_output_tokens - 4  # the first token of each comes from prefill
    assert 1 <= steps["batch_size"]["peak"] <= 4 and len(eng["series"]["time"]) == steps["num_steps"]
    assert r["ceilings"]["gemm_gflops"] > 0 and r["ceilings"]["memory_gbs"] > 0
    assert 0 < r["roofline"]["fraction_of_compute_bound"] and r["cost"]["flops"] > 0
    assert r["peak_memory"]["mib"] > 0 and r["hardware"]["threads"] == 1
    skipped = {p["peer"]: p.get("skipped") for p in r["peers"]}
    assert set(skipped) == {"vllm", "nano-vllm"}
    assert all(why in ("not installed", "needs a GPU") for why in skipped.values())
    assert (tmp_path / "fig" / "bench_cpu-small.png").stat().st_size > 10_000
    assert r["plot_path"] == str(tmp_path / "fig" / "bench_cpu-small.png")
    assert set((ROOT / "figures").iterdir()) == before  # nothing written into the repo's figures/
    ss = r["single_stream"]  # one stream's decode speed and its step split (bench/step_profile.py)
    assert ss["decode_tokens_per_s"] > 0 and set(ss["step_ms"]) == {"linears", "attention", "other", "host"}
    assert eng["steps"]["host_overhead_ms"]["postprocess_mean"] >= 0
    out = capsys.readouterr().out
    assert "nanoengine" in out and "skipped: " in out and "compute bound" in out and str(files[0]) in out
    assert "single stream" in out and "decode tok/s" in out and "postprocess" in out


@pytest.mark.xdist_group("tiny")
def test_hf_peer_counts_only_requested_tokens(tmp_path):
    from nanoengine.bench.run import bench

    r = bench("tiny-qwen3", "smoke", peers=["hf"], peer_batches=[3], out_dir=None, figures_dir=None,
              quiet=True)
    (hf,) = r["peers"]
    wl = make_workload("smoke")
    assert hf["output_tokens"] == wl.num_output_tokens and hf["prompt_tokens"] == wl.num_prompt_tokens
    assert hf["speedup"] == pytest.approx(r["nanoengine"]["output_tokens_per_s"] / hf["output_tokens_per_s"])
    # batches [0:3] and [3:4] padded to their longest prompt and run to their longest output
    computed = sum(len(b) * (max(map(len, b)) + max(o) - 1) for b, o in
                   ((wl.prompts[:3], wl.output_lens[:3]), (wl.prompts[3:], wl.output_lens[3:])))
    assert hf["computed_positions"] == computed and 0 <= hf["padding_waste"] < 1


@pytest.mark.xdist_group("tiny")
def test_online_mode(tmp_path):
    from nanoengine.bench.run import bench

    r = bench("tiny-qwen3", "smoke", online=True, request_rate=50.0, out_dir=str(tmp_path),
              figures_dir=str(tmp_path), quiet=True)
    eng = r["nanoengine"]
    assert r["online"] and eng["online"]["arrival_times"] == poisson_arrivals(4, 50.0, 0)
    assert eng["output_tokens"] == make_workload("smoke").num_output_tokens
    assert len(eng["latency"]["samples"]["ttft_s"]) == 4 and min(eng["latency"]["samples"]["ttft_s"]) > 0
    assert eng["latency"]["e2e_s"]["p99"] >= eng["latency"]["ttft_s"]["p99"]
    assert all("skipped" in p for p in r["peers"])
    assert (tmp_path / "bench_smoke_online.png").exists() and "online-r50" in Path(r["json_path"]).name


def test_single_stream_and_uniform_workloads():
    one, many = make_workload("single-stream"), make_workload("uniform-32")
    assert len(one) == 1 and one.prompt_lens == [256] and one.output_lens == [256]
    assert len(many) == 32 and set(many.prompt_lens) == {256} and set(many.output_lens) == {256}


@pytest.mark.xdist_group("tiny")
def test_single_stream_times_every_linear_and_attention_call_once_per_step():
    """The step profile's timers see each projection, the LM head and each attention layer once per decode
    step (counted from the model's modules, layer by layer with enforce_eager), or the fused decode step's own
    clocks (its layers run in one C++ call); the parts add up to the profiled step, and the hooks go away."""
    from nanoengine import LLM, SamplingParams
    from nanoengine.attention import AttentionBackend
    from nanoengine.bench.step_profile import module_timers, single_stream
    from nanoengine.layers.linear import PackableLinear

    for eager in (False, True):
        llm = LLM("tiny-qwen3", num_kvcache_blocks=64, enforce_eager=eager)
        assert (llm.engine.executor.runner.fused is None) == (eager or llm.plan.attention_backend != "cpu")
        r = single_stream(llm, prompt_len=20, output_len=6)
        assert r["prompt_tokens"] == 20 and r["profiled_steps"] == 5 and r["decode_tokens_per_s"] > 0
        assert sum(r["step_ms"].values()) == pytest.approx(r["profiled_step_ms"])
        assert sum(r["step_fraction"].values()) == pytest.approx(1.0)
        assert all(v >= 0 for v in r["step_ms"].values())
        assert r["step_ms"]["linears"] > 0 and r["step_ms"]["attention"] > 0
    model = llm.engine.executor.runner.model
    timed = [m for m in model.modules() if isinstance(m, (PackableLinear, AttentionBackend))]
    with module_timers(model) as totals:
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    assert totals["calls"] == 3 * len(timed)  # one prefill step and two decode steps
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in timed)


def test_step_rows_times_steps_of_exactly_the_rows_asked():
    """bench/step_rows: every point timed on steps of its own row count (B sequences, or 1 + k verification
    rows from FixedDrafts with the policy off), ratios against the 1-row step."""
    from nanoengine.bench import step_rows

    assert step_rows.FixedDrafts(3).propose([5, 6, 7], 2) == [7, 7]
    r = step_rows.measure("tiny-qwen3", None, "auto", prompt_len=8, steps=3, repeats=1, batches=(1, 3),
                          drafts=(2,))
    got = [(p["sequences"], p["drafts"], p["rows"]) for p in r["points"]]
    assert got == [(1, 0, 1), (3, 0, 3), (1, 2, 3)]
    assert r["points"][0]["x_one_row"] == 1.0 and all(p["ms"] > 0 for p in r["points"])
