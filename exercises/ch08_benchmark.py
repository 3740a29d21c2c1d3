# Your exercises for book/08a_measuring.ipynb, 08b_cpu_and_int8.ipynb -- this file is yours to edit.
# Replace each `raise NotImplementedError(...)` with your code, then run the chapter's check cell
# (`check("ch08")`, from nanoengine.check) or: pytest tests/exercises/test_ch08_benchmark.py
# Generated from solutions/ch08_benchmark.py by scripts/make_exercises.py (maintainers: edit the solution, regenerate).
"""Chapter 08, book/08_benchmark.ipynb: what a benchmark measures, and what the machine allows.

Exercise 8.1: percentiles and request latencies (TTFT, TPOT, end-to-end).
Exercise 8.2: the FLOPs a workload needs (linear, attention, LM head).
Exercise 8.3: how much of a static batch's work is padding.
Exercise 8.4: FLOPs, bytes and time bound of one decode step.
Exercise 8.5: per-group symmetric int8 quantization of a weight, and back.

Everything here is plain arithmetic on plain numbers; nanoengine.bench computes the same numbers for
`nanoengine bench` and is what the tests compare yours with. `ModelShape` (nanoengine.bench.roofline) holds a
model's sizes: hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, dtype_bytes, ...
Exercise 8.4 shows why a bigger decode batch is nearly free while a step is memory-bound; exercise 8.5 writes
what quantization="int8" does to every weight at load time (nanoengine/layers/quant.py), halving the bytes
a batch-1 decode step streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nanoengine.bench.roofline import ModelShape

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Exercise 8.1: the q-th percentile (0 <= q <= 100) of `values`, interpolated as numpy does by default.

    Sort the values; the percentile sits at fractional rank r = (n - 1) * q / 100 in the sorted list: with
    lo = floor(r), it is sorted[lo] + (sorted[lo + 1] - sorted[lo]) * (r - lo) (just sorted[lo] at the end of
    the list). p50 of [1, 2, 3, 4] is 2.5; p0 is the minimum, p100 the maximum. Return None for no values.
    """
    raise NotImplementedError("Exercise 8.1: the q-th percentile (0 <= q <= 100) of `values`, interpolated as numpy does by default - see book/08a_measuring.ipynb")


def latency_summary(requests: Sequence[Any]) -> dict[str, dict[str, float | None]]:
    """Exercise 8.1: TTFT, TPOT and end-to-end latency percentiles over a run's requests.

    Each request has arrival_time, first_token_time, finished_time (seconds; the last two None if it never got
    there) and num_output_tokens. Per request:
      TTFT = first_token_time - arrival_time                                 (needs a first token)
      TPOT = (finished_time - first_token_time) / (num_output_tokens - 1)    (needs both, and >= 2 tokens)
      e2e  = finished_time - arrival_time                                    (needs finished_time)
    A request without what a latency needs is left out of that latency. Return {"ttft_s": ..., "tpot_s": ...,
    "e2e_s": ...}, each {"mean", "p50", "p90", "p99"} over the requests that have that latency (percentiles
    with your `percentile`), all four None when no request has it.
    """
    raise NotImplementedError("Exercise 8.1: TTFT, TPOT and end-to-end latency percentiles over a run's requests - see book/08a_measuring.ipynb")


def workload_flops(shape: ModelShape, prompt_lens: Sequence[int], output_lens: Sequence[int],
                   cached_lens: Sequence[int] | None = None) -> dict[str, int]:
    """Exercise 8.2: the FLOPs of a workload, split into linear layers, attention and LM head.

    Request i has a prompt of p_i tokens and generates o_i tokens; positions 0 .. n_i - 1 with
    n_i = p_i + o_i - 1 go through the layers (the last generated token is never fed back), except the first
    c_i = cached_lens[i] positions, which a prefix-cache hit skipped (cached_lens None: no hits). Count from
    the shape's fields (h = hidden, d = head_dim):
      linear:    2 x (linear parameters) per processed position, where each layer has q (h x heads*d),
                 k and v (h x kv_heads*d each), o (heads*d x h), and gate, up, down (h x intermediate each);
      attention: 4 x layers x heads x d x context per processed position (Q K^T and P V), where the
                 position at index pos has context pos + 1;
      lm_head:   2 x vocab x h per generated token (its logits).
    Return the three exact integer counts: {"linear": ..., "attention": ..., "lm_head": ...}.
    """
    raise NotImplementedError("Exercise 8.2: the FLOPs of a workload, split into linear layers, attention and LM head - see book/08a_measuring.ipynb")


def static_batch_waste(prompt_lens: Sequence[int], output_lens: Sequence[int],
                       batch_size: int) -> dict[str, float]:
    """Exercise 8.3: the positions static batches compute, the useful ones, and the fraction wasted.

    The requests, in the given order (nothing sorted), run in batches of `batch_size` (the last may be
    smaller). A batch left-pads every prompt to its longest prompt and generates until its longest output is
    done, so each of its rows computes (longest prompt + longest output - 1) positions. The useful work is
    what the requests need alone: sum of p_i + o_i - 1. Return {"computed": ..., "useful": ..., "waste": ...}
    with waste = 1 - useful / computed (0.0: nothing wasted).
    """
    raise NotImplementedError("Exercise 8.3: the positions static batches compute, the useful ones, and the fraction wasted - see book/08a_measuring.ipynb")


def decode_step_cost(shape: ModelShape, context_lens: Sequence[int], gemm_gflops: float,
                     memory_gbs: float) -> dict[str, float]:
    """Exercise 8.4: the FLOPs, bytes and time bound of one decode step of a batch.

    In the step, each sequence i feeds one token whose context (cached tokens + itself) is context_lens[i].
      flops:  per sequence, the linear layers (2 x shape.linear_params), attention over its context
              (4 x layers x heads x head_dim x context) and the LM head (2 x shape.lm_head_params);
      bytes:  the weights, read once for the whole step (shape.weight_bytes_per_step), plus per sequence its
              context's keys and values read (shape.kv_bytes_per_position x context) and its new key and value
              written (shape.kv_bytes_per_position);
      compute_s = flops / (gemm_gflops x 1e9), memory_s = bytes / (memory_gbs x 1e9), and the step cannot take
      less than limit_s = the larger of the two.
      Return {"flops", "bytes", "compute_s", "memory_s", "limit_s"}.
    """
    raise NotImplementedError("Exercise 8.4: the FLOPs, bytes and time bound of one decode step of a batch - see book/08a_measuring.ipynb")


def quantize_per_group(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 8.5: quantize, symmetric int8 per group.

    weight [out, in] (float), one scale per output row and group of input columns: row n's input columns are
    cut into groups of group_size (the last one may be shorter), group g holding columns g * group_size ..
    (g + 1) * group_size - 1. For each row and group:
      scale s = max |w| over the group / 127          (a group of zeros: s = 0, and its q = 0)
      q = w / s rounded to the nearest integer         (in [-127, 127])
    Return (q [out, in] torch.int8, scales [out, groups] float32), groups = ceil(in / group_size).
    """
    raise NotImplementedError("Exercise 8.5: quantize, symmetric int8 per group - see book/08b_cpu_and_int8.ipynb")


def dequantize_per_group(q: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Exercise 8.5: dequantize, back to float32.

    q [out, in] int8 and scales [out, groups] (quantize_per_group's) -> the float32 weight [out, in] they
    stand for: w[n, k] = q[n, k] * scales[n, k // group_size].
    """
    raise NotImplementedError("Exercise 8.5: dequantize, back to float32 - see book/08b_cpu_and_int8.ipynb")
