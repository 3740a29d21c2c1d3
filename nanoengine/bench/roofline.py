"""The roofline: how fast could this machine possibly run this workload? Chapter 08.

A run needs some number of floating-point operations (FLOPs) and must move some number of bytes between
memory and the compute units. With the machine's measured GEMM peak P (FLOP/s) and memory bandwidth B
(bytes/s, see `bench/hardware.py`) it cannot finish faster than

    compute-bound time = FLOPs / P        memory-bound time = bytes / B        limit = max of the two.

The achieved fraction of the machine's limit is limit / measured time (1.0 = perfect). The benchmark also
reports the fraction of the compute bound: engine output tok/s / compute-bound output tok/s, where the
compute-bound tok/s = output tokens / compute-bound time.

FLOPs (kept simple, and stated so): every prompt token and every generated token but the last goes through
the layers (the last sampled token is never fed back), so request i processes n_i = prompt_i + output_i - 1
positions (less the positions a prefix-cache hit skipped, when given). Per processed position:
  2 x (non-embedding linear parameters: q, k, v, o, gate, up, down per layer)   matmul multiply-adds
  + 4 x layers x heads x head_dim x context                                     QK^T and PV, context = pos + 1
and per generated token 2 x (LM-head parameters): logits only where a token is sampled.
Norms, rotary, softmax, activations and biases are a rounding error and are left out.

Bytes (the minimal traffic for the schedule the engine ran):
  weights read once per engine step (all linear layers, norms and the LM head; an untied input embedding is a
  row gather and is left out) x number of steps; linears count at the bytes the engine keeps them in (a
  bf16 checkpoint run in float32 on CPU streams bf16 copies: 2 bytes each; quantization="int8": 1 byte and
  a float32 scale per 32 weights, 1.125 bytes each)
  + the KV cache read by every decode token: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes
    x context
  + the KV cache written once for every processed position.
Activations are left out (they are small next to the weights at these batch sizes).

`decode_step_cost` is the same count for one decode step (what one more step adds to `workload_cost`), the
cost per generated token that chapter 02 works out at batch 1 and chapter 08 measures at several batch sizes.
`LAPTOP_CPU` and `RTX_4070_LAPTOP` are two machines' ceilings as stated assumptions (round figures from
published specifications, not measurements), for the book's arithmetic; `bench/hardware.py` measures this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from nanoengine.models.hf_config import ModelShape

__all__ = ["LAPTOP_CPU", "RTX_4070_LAPTOP", "Machine", "ModelShape", "decode_step_cost", "engine_shape",
           "roofline", "shape_dict", "workload_cost"]


@dataclass(frozen=True)
class Machine:
    """A machine's two ceilings as assumed figures, and where they come from."""
    name: str
    memory_gbs: float  # peak memory bandwidth, GB/s
    gemm_gflops: float  # peak dense matmul rate in `dtype`, GFLOP/s
    dtype: str
    memory_bytes: int | None  # memory the model and its KV cache share (None: not the limit)
    source: str

    @property
    def balance(self) -> float:
        """FLOPs per byte at which the two ceilings meet: below it a step is memory-bound."""
        return self.gemm_gflops / self.memory_gbs


# Assumptions, not measurements. A laptop CPU: dual-channel DDR5-5600 moves 2 channels x 8 bytes x 5.6e9
# transfers/s = 89.6 GB/s at its peak (JEDEC's DDR5 speed grade); 8 cores, each retiring two 256-bit FMAs per
# cycle (8 float32 lanes x 2 FLOPs each; AVX2 cores from Intel's Haswell and AMD's Zen 2 on), at 3 GHz:
# 8 x 2 x 8 x 2 x 3e9 = 768 GFLOP/s in float32.
LAPTOP_CPU = Machine("8-core laptop CPU, dual-channel DDR5-5600", 89.6, 768.0, "float32", None,
                     "DDR5-5600 x 2 channels; 8 cores x 2 AVX2 FMA units x 3 GHz")
# NVIDIA's RTX 4070 Laptop GPU: 8 GB of GDDR6 on a 128-bit bus at 16 Gb/s per pin, 128 / 8 x 16 = 256 GB/s;
# 36 SMs, each 512 dense bf16 FLOPs per clock with float32 accumulation on GeForce Ada parts (the Ada
# whitepaper's RTX 4090: 165.2 TFLOP/s over 128 SMs at 2.52 GHz), at about 2 GHz: 36.9 TFLOP/s.
RTX_4070_LAPTOP = Machine("RTX 4070 Laptop GPU (8 GB)", 256.0, 36 * 512 * 2.0, "bfloat16", 8 * 2**30,
                          "NVIDIA's specification (128-bit GDDR6, 16 Gb/s, 36 SMs) and Ada whitepaper")


def engine_shape(plan: Any) -> ModelShape:
    """The model's shape as the engine runs it (an `EnginePlan`): its dtype, 2 bytes per linear weight where
    it streams bf16 copies of the linears (a bf16 checkpoint in float32 on CPU), and 1 byte plus its share of
    a float32 scale with quantization="int8" or "w8a8" (layers/quant.py)."""
    from nanoengine.layers.quant import GROUP_SIZE

    weight_bytes = 2 if plan.bf16_weight_rows else None
    if getattr(plan, "quantization", None) in ("int8", "w8a8"):
        weight_bytes = 1 + 4 / GROUP_SIZE
    return ModelShape.from_hf_config(plan.hf_config, plan.torch_dtype.itemsize, weight_bytes)


def _sum_range(lo: int, hi: int) -> int:
    """lo + (lo + 1) + ... + hi (0 when hi < lo)."""
    return (hi * (hi + 1) - (lo - 1) * lo) // 2 if hi >= lo else 0


def workload_cost(shape: ModelShape, prompt_lens: Sequence[int], output_lens: Sequence[int], num_steps: int,
                  cached_lens: Sequence[int] | None = None) -> dict[str, int]:
    """FLOPs and bytes of a run (see the module docstring). cached_lens: prompt positions per request that a
    prefix-cache hit skipped (their linear and attention FLOPs and KV writes are not needed)."""
    cached_lens = cached_lens or [0] * len(prompt_lens)
    processed = attn_ctx = decode_ctx = 0
    for p, o, c in zip(prompt_lens, output_lens, cached_lens):
        n = p + o - 1  # positions 0..n-1 go through the layers
        processed += n - c
        attn_ctx += _sum_range(c + 1, n)  # context = position + 1 for positions c..n-1
        decode_ctx += _sum_range(p + 1, n)  # decode positions p..n-1 read their context from the cache
    out_tokens = sum(output_lens)
    s = shape
    flops = {"linear": 2 * s.linear_params * processed,
             "attention": 4 * s.layers * s.heads * s.head_dim * attn_ctx,
             "lm_head": 2 * s.lm_head_params * out_tokens}
    nbytes = {"weights": s.weight_bytes_per_step * num_steps,
              "kv_read": s.kv_bytes_per_position * decode_ctx,
              "kv_write": s.kv_bytes_per_position * processed}
    return {"flops": sum(flops.values()), "bytes": sum(nbytes.values()), "processed_positions": processed,
            "output_tokens": out_tokens, "num_steps": num_steps,
            **{f"flops_{k}": v for k, v in flops.items()}, **{f"bytes_{k}": v for k, v in nbytes.items()}}


def decode_step_cost(shape: ModelShape, context_lens: Sequence[int]) -> dict[str, int]:
    """FLOPs and bytes of one decode step in which sequence i feeds one token whose context (cached tokens and
    itself) is context_lens[i] >= 1: what one more step adds to `workload_cost` (the same keys), so the two
    never disagree. Per sequence 2 x (linear + LM-head parameters) + attention over its context; the weights
    once for the whole step, each sequence's context of K and V read and its new K and V written."""
    if any(c < 1 for c in context_lens):
        raise ValueError(f"a decode token's context counts itself, so it is >= 1; got {list(context_lens)}")
    prompts = [c - 1 for c in context_lens]  # one more output token each: the position at index c - 1
    longer = workload_cost(shape, prompts, [2] * len(prompts), num_steps=1)
    shorter = workload_cost(shape, prompts, [1] * len(prompts), num_steps=0)
    return {k: longer[k] - shorter[k] for k in longer}


def roofline(cost: dict[str, int], gemm_gflops: float, memory_gbs: float,
             seconds: float | None = None) -> dict[str, float]:
    """Time bounds from the ceilings, and how close a run that took `seconds` came to them (those two
    fractions are None without `seconds`)."""
    compute_s = cost["flops"] / (gemm_gflops * 1e9)
    memory_s = cost["bytes"] / (memory_gbs * 1e9)
    limit_s = max(compute_s, memory_s)
    compute_tok_s = cost["output_tokens"] / compute_s if compute_s else float("inf")
    return {"compute_bound_s": compute_s, "memory_bound_s": memory_s, "limit_s": limit_s,
            "bound": "compute" if compute_s >= memory_s else "memory",
            "achieved_fraction_of_limit": limit_s / seconds if seconds else None,
            "compute_bound_output_tokens_per_s": compute_tok_s,
            "limit_output_tokens_per_s": cost["output_tokens"] / limit_s if limit_s else float("inf"),
            "fraction_of_compute_bound": (cost["output_tokens"] / seconds / compute_tok_s
                                          if seconds else None),
            "arithmetic_intensity": cost["flops"] / cost["bytes"] if cost["bytes"] else float("inf"),
            "machine_balance": gemm_gflops / memory_gbs}


def shape_dict(shape: ModelShape) -> dict[str, Any]:
    return {**asdict(shape), "linear_params": shape.linear_params, "lm_head_params": shape.lm_head_params,
            "weight_bytes_per_step": shape.weight_bytes_per_step,
            "kv_bytes_per_position": shape.kv_bytes_per_position}
