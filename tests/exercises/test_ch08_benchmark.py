"""Exercises of book/08_benchmark.ipynb, checked against nanoengine.bench on seeded random inputs: metrics
(percentiles, TTFT / TPOT / end-to-end), roofline (workload FLOPs and bytes, time bounds) and the transformers
peer's static-batch accounting (run with a stand-in model, so no model is loaded)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from ex_helpers import assert_equal, book

from nanoengine.bench import metrics, roofline
from nanoengine.bench.roofline import ModelShape
from nanoengine.bench.workload import Workload, make_workload, poisson_arrivals
from nanoengine.outputs import RequestMetrics

CHAPTER = "ch08_benchmark"
pytestmark = pytest.mark.xdist_group("ex_ch08")
NB = "08_benchmark.ipynb"

# real model shapes (inputs, from their config.json files) and seeded random ones
QWEN3_06B = ModelShape(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                       vocab=151_936, tied=True, dtype_bytes=2, qk_norm=True)
SMOLLM2_135M = ModelShape(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                          vocab=49_152, tied=True, dtype_bytes=2)


def random_shape(rng: random.Random) -> ModelShape:
    kv = rng.choice([1, 2, 4, 8])
    return ModelShape(hidden=64 * rng.randint(1, 40), layers=rng.randint(1, 40), heads=kv * rng.choice([1, 2, 3, 4]),
                      kv_heads=kv, head_dim=rng.choice([32, 64, 80, 128]), intermediate=32 * rng.randint(2, 300),
                      vocab=rng.randint(1000, 200_000), tied=rng.random() < 0.5, dtype_bytes=rng.choice([1, 2, 4]),
                      qk_norm=rng.random() < 0.5)


def shapes(seed: int) -> list[ModelShape]:
    rng = random.Random(seed)
    return [SMOLLM2_135M, QWEN3_06B] + [random_shape(rng) for _ in range(10)]


def assert_number(got, want, what: str, where: str, rel: float = 1e-9) -> None:
    """Equal numbers (within rounding for floats); None only where None is expected."""
    if want is None or got is None or isinstance(got, bool) or not isinstance(got, int | float):
        assert_equal(got, want, what, where)
        return
    if not math.isclose(got, want, rel_tol=rel, abs_tol=1e-12):
        raise AssertionError(f"{what}: yours {got!r}, expected {want!r} {where}")


def assert_keys(got, keys, what: str, where: str) -> None:
    if not isinstance(got, dict) or set(got) != set(keys):
        have = sorted(got) if isinstance(got, dict) else type(got).__name__
        raise AssertionError(f"{what}: expected a dict with keys {sorted(keys)}, got {have} {where}")


# Exercise 8.1 ------------------------------------------------------------------------------------------------

def test_8_1_percentile_matches_metrics(ex):
    where = book(NB, "8.1")
    got = ex.percentile([4.0, 1.0, 3.0, 2.0], 50)
    assert_number(got, metrics.percentile([4.0, 1.0, 3.0, 2.0], 50), "p50 of [4, 1, 3, 2] (sort first; the "
                  "rank (n - 1) * q / 100 = 1.5 falls between the 2nd and 3rd smallest)", where)
    assert_equal(ex.percentile([], 90), None, "percentile of no values", where)
    rng = random.Random(81)
    for _ in range(200):
        n = rng.choice([1, 2, 3, rng.randint(4, 300)])
        values = [round(rng.lognormvariate(0, 1), rng.choice([1, 6])) for _ in range(n)]  # ties when rounded
        for q in (0, 50, 90, 99, 100, rng.uniform(0, 100)):
            want = metrics.percentile(values, q)
            assert math.isclose(want, float(np.percentile(values, q)), rel_tol=1e-9)  # the oracle is numpy's
            assert_number(ex.percentile(values, q), want, f"p{q:g} of {n} values {values[:6]}...", where)


def random_requests(rng: random.Random, n: int, online: bool) -> list[RequestMetrics]:
    """A run's request metrics: arrivals (all at the start, or Poisson), then queueing, prefill and decode."""
    arrivals = poisson_arrivals(n, rate=rng.uniform(0.5, 8), seed=rng.randrange(1000)) if online else [0.0] * n
    reqs = []
    for at in arrivals:
        r = RequestMetrics(arrival_time=100.0 + at)
        r.num_output_tokens = rng.choice([1, 2, rng.randint(3, 300)])
        if rng.random() < 0.9:  # got its first token
            r.first_scheduled_time = r.arrival_time + rng.expovariate(2)
            r.first_token_time = r.first_scheduled_time + rng.uniform(0.01, 0.5)
            if rng.random() < 0.9:  # and finished
                r.finished_time = r.first_token_time + (r.num_output_tokens - 1) * rng.uniform(0.01, 0.1)
        else:
            r.num_output_tokens = 0
        reqs.append(r)
    return reqs


HINTS = {"ttft_s": "TTFT = first_token_time - arrival_time, for requests with a first token",
         "tpot_s": "TPOT = (finished_time - first_token_time) / (num_output_tokens - 1), only for finished "
                   "requests with at least 2 output tokens",
         "e2e_s": "end-to-end = finished_time - arrival_time, for finished requests"}


def test_8_1_latency_summary_matches_request_latencies(ex):
    where = book(NB, "8.1")
    rng = random.Random(811)
    cases = [random_requests(rng, rng.randint(1, 60), online=bool(k % 2)) for k in range(30)]
    one_token = random_requests(rng, 5, online=False)
    for r in one_token:  # nobody has a TPOT
        r.num_output_tokens = 1
    cases += [one_token, []]
    for reqs in cases:
        want = metrics.request_latencies(reqs)
        got = ex.latency_summary(reqs)
        assert_keys(got, HINTS, f"latency_summary of {len(reqs)} requests", where)
        for key, hint in HINTS.items():
            assert_keys(got[key], want[key], f"latency_summary(...)[{key!r}]", where)
            for stat in want[key]:
                what = f"{key} {stat} over {len(reqs)} requests ({hint}; None when no request has one)"
                assert_number(got[key][stat], want[key][stat], what, where)


# Exercise 8.2 ------------------------------------------------------------------------------------------------

FLOP_HINTS = {"linear": "2 x linear parameters per processed position: q, k, v, o and gate, up, down in every "
                        "layer, k and v with kv_heads heads",
              "attention": "4 x layers x heads x head_dim x context, context = position + 1, over the processed "
                           "positions c_i .. p_i + o_i - 2",
              "lm_head": "2 x vocab x hidden per generated token"}


def test_8_2_workload_flops_match_roofline(ex):
    where = book(NB, "8.2")
    rng = random.Random(82)
    cpu_small = make_workload("cpu-small")
    for k, shape in enumerate(shapes(82)):
        cases = [([5], [1], None), ([5], [3], None), ([7, 3], [2, 4], [4, 0])]
        cases.append((cpu_small.prompt_lens, cpu_small.output_lens, None))
        for _ in range(4):
            n = rng.randint(1, 20)
            prompts = [rng.randint(1, 600) for _ in range(n)]
            outs = [rng.randint(1, 300) for _ in range(n)]
            cached = None if rng.random() < 0.3 else [rng.randint(0, p - 1) for p in prompts]
            cases.append((prompts, outs, cached))
        for prompts, outs, cached in cases:
            want = roofline.workload_cost(shape, prompts, outs, num_steps=1, cached_lens=cached)
            got = ex.workload_flops(shape, prompts, outs, cached)
            what = (f"FLOPs of prompts {prompts[:4]}{'...' if len(prompts) > 4 else ''}, outputs {outs[:4]}, "
                    f"cached {cached if cached is None else cached[:4]} on shape {k} ({shape})")
            assert_keys(got, FLOP_HINTS, what, where)
            for key, hint in FLOP_HINTS.items():
                assert_equal(got[key], want[f"flops_{key}"], f"{key} {what} [{hint}]", where)


# Exercise 8.3 ------------------------------------------------------------------------------------------------

class StandInModel:
    """Takes the place of a transformers model in peers.hf_static_batches: generate() only records its call."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.generation_config = SimpleNamespace(eos_token_id=0)
        self.calls = 0

    def generate(self, ids, attention_mask=None, max_new_tokens=0, **kwargs) -> None:
        self.calls += 1


def peer_accounting(prompt_lens: list[int], output_lens: list[int], batch_size: int) -> dict:
    """The positions the transformers peer of `nanoengine bench` reports for static batches of batch_size."""
    from nanoengine.bench import peers

    wl = Workload("test", [[1] * p for p in prompt_lens], list(output_lens))
    return peers.hf_static_batches(None, wl, batch_size, dtype=None, model=StandInModel())


def test_8_3_static_batch_waste_matches_peer(ex):
    where = book(NB, "8.3")
    rng = random.Random(83)
    cpu_small = make_workload("cpu-small")
    cases = [([4, 2], [1, 3], 2), ([4, 2], [1, 3], 1), ([3, 9, 5], [7, 2, 4], 2)]
    cases += [(cpu_small.prompt_lens, cpu_small.output_lens, b) for b in (1, 3, 8, 32, 64)]
    for _ in range(20):
        n = rng.randint(1, 40)
        cases.append(([rng.randint(1, 500) for _ in range(n)], [rng.randint(1, 500) for _ in range(n)],
                      rng.randint(1, n + 2)))
    for prompts, outs, b in cases:
        got = ex.static_batch_waste(prompts, outs, b)
        want = peer_accounting(prompts, outs, b)
        what = (f"batches of {b} over prompts {prompts[:6]}{'...' if len(prompts) > 6 else ''} and outputs "
                f"{outs[:6]}{'...' if len(outs) > 6 else ''}")
        assert_keys(got, ("computed", "useful", "waste"), what, where)
        assert_equal(got["useful"], want["useful_positions"], f"useful positions (sum of p + o - 1) for {what}",
                     where)
        assert_equal(got["computed"], want["computed_positions"], f"computed positions for {what} (each row of "
                     "a batch: its longest prompt + its longest output - 1; the last batch may be smaller)", where)
        assert_number(got["waste"], want["padding_waste"], f"waste (1 - useful / computed) for {what}", where)


# Exercise 8.4 ------------------------------------------------------------------------------------------------

def one_decode_step(shape: ModelShape, contexts: list[int]) -> dict:
    """What one more decode step adds to roofline.workload_cost: each sequence with context c, prompt c - 1
    and 2 output tokens instead of 1 (so one more position, at context c), and one more engine step."""
    prompts = [c - 1 for c in contexts]
    two = roofline.workload_cost(shape, prompts, [2] * len(contexts), num_steps=1)
    one = roofline.workload_cost(shape, prompts, [1] * len(contexts), num_steps=0)
    return {k: two[k] - one[k] for k in ("flops", "bytes", "output_tokens")}


def test_8_4_decode_step_cost_matches_roofline(ex):
    where = book(NB, "8.4")
    rng = random.Random(84)
    for k, shape in enumerate(shapes(84)):
        for batch in (1, 2, rng.randint(3, 300)):
            contexts = [rng.randint(2, 4000) for _ in range(batch)]
            gflops, gbs = rng.uniform(10, 1e6), rng.uniform(5, 5e3)
            got = ex.decode_step_cost(shape, contexts, gflops, gbs)
            step = one_decode_step(shape, contexts)
            bounds = roofline.roofline(step, gflops, gbs, seconds=1.0)
            want = {"flops": step["flops"], "bytes": step["bytes"], "compute_s": bounds["compute_bound_s"],
                    "memory_s": bounds["memory_bound_s"], "limit_s": bounds["limit_s"]}
            what = (f"decode step of a batch of {batch}, contexts {contexts[:5]}{'...' if batch > 5 else ''}, "
                    f"on shape {k} ({shape}), {gflops:.0f} GFLOP/s, {gbs:.0f} GB/s")
            assert_keys(got, want, what, where)
            hints = {"flops": "per sequence 2 x (linear + LM-head params) + 4 x layers x heads x head_dim x context",
                     "bytes": "weights once per step + per sequence kv_bytes_per_position x (context + 1)",
                     "compute_s": "flops / (GFLOP/s x 1e9)", "memory_s": "bytes / (GB/s x 1e9)",
                     "limit_s": "the larger bound"}
            for key, hint in hints.items():
                assert_number(got[key], want[key], f"{key} of the {what} [{hint}]", where)


# Exercise 8.5 ------------------------------------------------------------------------------------------------

# the classic mistakes, named in the messages
ASYMMETRIC = ("the scale is max |w| over the group / 127 (symmetric, no zero point); (max - min) / 255 is the "
              "asymmetric range, which only works with a zero point the symmetric formula does not have")
SWAPPED = ("one scale per output row (dim 0) and group of input columns (dim 1): scales [out, groups]; scales "
           "per column, or groups cut along the rows, swap the two")
TRUNCATED = "round to the nearest integer (torch.round): .to(torch.int8) and int() truncate toward zero"
OVERFLOW = ("q stays in [-127, 127]: with max |w| / 128 as the scale, +max becomes 128, which int8 cannot hold "
            "(it wraps to -128)")


def oracle_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group symmetric int8 in float64, one group at a time (q as float64 integers)."""
    out, cols = w.shape
    w = w.double()
    groups = -(-cols // group)
    scales = torch.zeros(out, groups, dtype=torch.float64)
    q = torch.zeros(out, cols, dtype=torch.float64)
    for g in range(groups):
        part = slice(g * group, min(cols, (g + 1) * group))
        s = w[:, part].abs().max(dim=1).values / 127
        scales[:, g] = s
        q[:, part] = torch.round(w[:, part] / torch.where(s > 0, s, torch.ones_like(s))[:, None])
    return q, scales


def crafted_weight(out: int, cols: int, seed: int) -> torch.Tensor:
    """Random weights with the rows that expose the classic mistakes: all positive (max - min differs from
    2 max |w|), the largest magnitude negative, an outlier in one group, a group of zeros."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=gen)
    w[0] = w[0].abs() + 0.5
    w[1, 0] = -3 * w[1].abs().max()
    w[2, -1] = 25.0
    w[3, :min(cols, 4)] = 0
    return w


@pytest.mark.parametrize("out,cols,group", [(8, 64, 32), (5, 70, 32), (16, 48, 16), (6, 10, 4)])
def test_8_5_quantize_per_group_matches_a_float64_oracle(ex, out, cols, group):
    where = book(NB, "8.5")
    w = crafted_weight(out, cols, out * cols + group)
    what = f"quantize_per_group of a [{out}, {cols}] weight, group_size {group}"
    got = ex.quantize_per_group(w.clone(), group)
    if not isinstance(got, tuple) or len(got) != 2:
        raise AssertionError(f"{what}: return (q, scales), got {type(got).__name__} {where}")
    q, scales = got
    want_q, want_s = oracle_quantize(w, group)
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or tuple(q.shape) != (out, cols):
        raise AssertionError(f"{what}: q must be an int8 tensor of shape {(out, cols)}, got "
                             f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))} {where}")
    if not isinstance(scales, torch.Tensor) or tuple(scales.shape) != tuple(want_s.shape):
        raise AssertionError(f"{what}: scales of shape {tuple(want_s.shape)} expected, got "
                             f"{tuple(getattr(scales, 'shape', ()))}; {SWAPPED} {where}")
    if int(q.min()) < -127:
        raise AssertionError(f"{what}: q holds {int(q.min())}; {OVERFLOW} {where}")
    if not torch.allclose(scales.double(), want_s, rtol=1e-6, atol=0):
        bad = (scales.double() - want_s).abs().argmax().item()
        row, g = divmod(bad, want_s.shape[1])
        raise AssertionError(f"{what}: scale of row {row}, group {g}: yours {scales[row, g].item():.6g}, "
                             f"expected {want_s[row, g].item():.6g}; {ASYMMETRIC} {where}")
    diff = (q.double() - want_q).abs()
    if diff.max() > 1 or (diff > 0).double().mean() > 0.01:  # a float32 .5 tie may round the other way
        per_column = want_s.repeat_interleave(group, dim=1)[:, :cols]
        truncated = torch.trunc(w.double() / torch.where(per_column > 0, per_column, 1))
        like_trunc = (q.double() == truncated).double().mean() > 0.98 and (truncated != want_q).any()
        hint = TRUNCATED if like_trunc else "q = round(w / scale) of its group"
        row, col = divmod(diff.argmax().item(), cols)
        raise AssertionError(f"{what}: q[{row}, {col}] yours {int(q[row, col])}, expected "
                             f"{int(want_q[row, col])} (w = {w[row, col].item():.5f}); {hint} {where}")


def test_8_5_dequantize_per_group_inverts_with_at_most_half_a_step_of_error(ex):
    """Dequantized from the engine's own quantizer (layers.quant), so this test does not lean on yours."""
    from nanoengine.layers.quant import quantize_int8

    where = book(NB, "8.5")
    for out, cols, group in [(8, 64, 32), (5, 70, 32), (6, 10, 4)]:
        w = crafted_weight(out, cols, 7 * cols + group)
        q, scales = quantize_int8(w, group)
        what = f"dequantize_per_group of a [{out}, {cols}] weight, group_size {group}"
        got = ex.dequantize_per_group(q, scales, group)
        per_column = scales.double().repeat_interleave(group, dim=1)[:, :cols]
        want = q.double() * per_column
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (out, cols):
            raise AssertionError(f"{what}: a tensor of shape {(out, cols)} expected, got "
                                 f"{tuple(getattr(got, 'shape', ()))} {where}")
        if not torch.allclose(got.double(), want, rtol=1e-6, atol=1e-7):
            row, col = divmod((got.double() - want).abs().argmax().item(), cols)
            raise AssertionError(f"{what}: w[{row}, {col}] yours {got[row, col].item():.6g}, expected "
                                 f"{want[row, col].item():.6g} = q * the scale of column {col}'s group "
                                 f"(scales[{row}, {col // group}]); {SWAPPED} {where}")
        err = (got.double() - w.double()).abs()
        assert (err <= per_column / 2 * (1 + 1e-5) + 1e-7).all(), (
            f"{what}: an error above half a quantization step {where}")
