"""What a CPU plan chooses: the dtype, weight copies and int8, the prefill dtype, the KV cache's dtype
(`resolve_plan` in nanoengine/plan.py calls these). Chapter 08.

- dtype: as given, else the checkpoint's; bfloat16 for float16 on CPU (fp16 matmuls have no fast path there).
  On CPU with the C++ kernels, 'auto' for a 16-bit checkpoint chooses between its decode paths by
  measurement (`pick_dtype`, nanoengine/dtype_choice.py): float32 with bf16 weight copies and the
  fused C++ step, and bfloat16 with oneDNN-packed weights where oneDNN has bf16 here; with both, the faster on
  a stand-in of the model's decode step, timed once per kind of machine and model shape and kept in the
  kernels folder ("measured", then "cached"); with one (an AVX2-only CPU: float32; int8, whose decode runs
  the int8 kernel either way; no fused step) the old rule, untimed ("only candidate");
- prepack_weights: oneDNN-packed linear weights for bf16 on a CPU with oneDNN bf16 (`pick_prepack`);
- bf16 weight copies: batches of up to BF16_WEIGHT_MAX_ROWS rows multiply them with the C++ kernel
  (`bf16_weight_rows`);
- the KV cache's element type (`kv_cache_dtype`, vLLM's option): the compute dtype, or bfloat16, which halves
  a float32 cache's bytes (the same memory holds twice the blocks); the store rounds K/V to it and the `torch`
  and `cpu` backends read it (the C++ decode kernel widens bf16 rows in registers); `triton` and `flash_attn`
  refuse a cache dtype other than the compute dtype;
- prefill_dtype="bfloat16" (opt-in): for a bf16 checkpoint run in float32 on CPU with bf16 weight copies and
  oneDNN bf16, linears over more rows than a threshold measured on this machine (`prefill_dtype_min_rows`,
  `dtype_choice.prefill_choice`, kept like the dtype: the smallest batch from which bf16 timed faster than the
  bf16 copies' kernel or float32) multiply bf16 activations by oneDNN-packed bf16 weights: prefill chunks, and
  decode steps of that many streams (the fused step takes the same threshold); where bf16 never measured
  faster they stay float32, with a warning saying so;
- weight-only int8 (quantization="int8"): on CPU with the C++ kernels only, for now (CUDA has no
  W8A16 kernel here yet: a clear error); batches of up to INT8_WEIGHT_MAX_ROWS rows use the int8 kernel;
  quantization="w8a8": the same int8 weights times int8 activations, every batch (prefill too) through the
  int8 dot-product kernel (`quant.ALL_ROWS`).
Nothing here compiles: with the C++ kernels not built yet, the dtype and the prefill threshold are the
untimed rule's, measured on the next start.
"""

from __future__ import annotations

import warnings
from typing import Any

from nanoengine import dtype_choice
from nanoengine.config import EngineConfig
from nanoengine.dtype_choice import DtypeChoice
from nanoengine.errors import InvalidValueError
from nanoengine.kernels import cpu as cpu_kernels
from nanoengine.layers import linear, quant
from nanoengine.models import hf_config as shapes
from nanoengine.pieces import NO_PIECES, PieceSelection
from nanoengine.plan_backend import DEFAULT_BLOCK_SIZE, DecodeMode, pick_decode_mode

# Batches of up to this many rows multiply bf16 weight copies with the C++ kernel
# (layers.linear.use_bf16_weights): on a CPU without a fast bf16 matmul, a linear over a few rows is bound by
# streaming its weight from memory, which the bf16 copy halves, and the kernel's register tiles keep its FMA
# units busy at more rows: on SmolLM2's linears (AMD EPYC, AVX2, 2 threads) it beat the float32 matmul at
# every size up to 512 rows (42 against 76 ms at 32 rows, 330 against 418 at 256, 650 against 696 at 512);
# larger batches (long prefill chunks) keep the float32 matmul
BF16_WEIGHT_MAX_ROWS = 256
# With quantization="int8", batches of up to this many rows multiply the int8 copies (layers.quant); larger
# ones the float32 (or bf16) matmul of the dequantized weights. Measured per linear of SmolLM2 (1 thread,
# Xeon with AVX-512): the int8 kernel beat both the bf16 kernel and the float32 matmul from 1 to 32 rows;
# on an AVX2 EPYC (2 threads) it beat the float32 matmul up to 128 rows (44 against 80 ms at 32, 164 against
# 205 at 128); against oneDNN's packed bf16 matmul (AMX; prepack_weights) it won at 1 row only (SmolLM2's
# gate/up: 0.07 against 0.17 ms at 1 row, 0.26 against 0.17 at 8, 1.08 against 0.20 at 32)
INT8_WEIGHT_MAX_ROWS = 128
INT8_WEIGHT_MAX_ROWS_ONEDNN = 1


def rule_dtype(want: str, device: str, hf_config: Any) -> str:
    """The dtype without measuring: `want`, or for 'auto' the checkpoint's, float32 on a CPU without oneDNN
    bf16; bfloat16 for float16 on CPU."""
    dtype = want
    if dtype == "auto":
        dtype = str(shapes.checkpoint_dtype(hf_config)).removeprefix("torch.")
        if device == "cpu" and dtype in ("float16", "bfloat16") and not linear.onednn_bf16_available():
            # a CPU without AVX-512 or AMX has no fast 16-bit matmul, so bf16 linears (and most of a laptop's
            # prefill) run slower there than in float32
            dtype = "float32"
    if device == "cpu" and dtype == "float16":
        dtype = "bfloat16"  # fp16 matmuls have no fast path on CPU
    return dtype


def pick_dtype(config: EngineConfig, device: str, hf_config: Any, backend: str,
               pieces: PieceSelection = NO_PIECES, moe: bool = False) -> DtypeChoice:
    """dtype= as given ("given"), else 'auto': the fastest of `dtype_candidates`, timed once per machine
    (nanoengine/dtype_choice.py: "measured", then "cached"), or `rule_dtype` where there is one candidate."""
    rule = rule_dtype(config.dtype, device, hf_config)
    if config.dtype != "auto":
        return DtypeChoice(rule, dtype_choice.GIVEN)
    candidates = dtype_candidates(config, device, hf_config, backend, pieces, moe)
    if len(candidates) > 1 and not cpu_kernels.is_built():  # resolving never compiles: measured next start
        return DtypeChoice(rule, dtype_choice.UNMEASURED)
    return dtype_choice.choose(candidates, hf_config, rule)


def dtype_candidates(config: EngineConfig, device: str, hf_config: Any, backend: str,
                     pieces: PieceSelection = NO_PIECES, moe: bool = False) -> list[dtype_choice.Candidate]:
    """The decode paths dtype='auto' chooses between on CPU for a 16-bit checkpoint, as this plan would run
    them: float32 where the fused C++ step would run in float32 (with bf16 weight copies for a bf16
    checkpoint); bfloat16 where its weights would be packed for oneDNN. None with quantization='int8': both
    dtypes decode one stream through the same int8 kernel in the fused step, so timing would compare noise."""
    import torch

    if (device != "cpu" or config.quantization
            or shapes.checkpoint_dtype(hf_config) not in (torch.bfloat16, torch.float16)):
        return []
    block_size = config.block_size or DEFAULT_BLOCK_SIZE[backend]
    out = []
    if (config.prepack_weights is not True
            and pick_decode_mode(config, device, backend, False, pieces, moe) is DecodeMode.FUSED_CPU):
        out.append(dtype_choice.Candidate("float32", prepack=False, fused=True, block_size=block_size,
                                          bf16_rows=bf16_weight_rows(device, backend, "float32", False,
                                                                     hf_config)))
    if pick_prepack(config.prepack_weights, device, "bfloat16"):
        out.append(dtype_choice.Candidate("bfloat16", prepack=True, fused=False, block_size=block_size,
                                          bf16_rows=bf16_weight_rows(device, backend, "bfloat16", True,
                                                                     hf_config)))
    return out


def pick_prepack(want: bool | None, device: str, dtype: str) -> bool:
    if want is False:
        return False
    packable = device == "cpu" and dtype == "bfloat16" and linear.onednn_bf16_available()
    if want and not packable:
        raise InvalidValueError("EngineConfig: prepack_weights=True needs device='cpu', dtype='bfloat16' and "
                                "a torch build with oneDNN bf16 on this CPU; "
                                "leave prepack_weights=None (auto)")
    return packable


def bf16_weight_rows(device: str, backend: str, dtype: str, prepack: bool, hf_config: Any) -> int:
    """Rows up to which linears use bf16 weight copies (`layers.linear.use_bf16_weights`), 0 for never: on CPU
    with the C++ kernels, for a bf16 checkpoint run in float32 (the copy is exact), or in bf16 where oneDNN
    has no bf16 path (prepack_weights is off: an AVX2-only CPU)."""
    import torch

    if device != "cpu" or backend != "cpu":
        return 0
    stored = shapes.checkpoint_dtype(hf_config)
    if dtype == "float32" and stored == torch.bfloat16:
        return BF16_WEIGHT_MAX_ROWS
    if dtype == "bfloat16" and not prepack:
        return BF16_WEIGHT_MAX_ROWS
    return 0


def int8_weight_rows(quantization: str | None, prepack: bool) -> int:
    """Rows up to which linears multiply their int8 copies (0: no quantization): fewer where oneDNN's packed
    bf16 matmul takes the larger batches (see INT8_WEIGHT_MAX_ROWS)."""
    if quantization == "w8a8":
        return quant.ALL_ROWS  # every batch: the activations are quantized at every size
    if quantization != "int8":
        return 0
    return INT8_WEIGHT_MAX_ROWS_ONEDNN if prepack else INT8_WEIGHT_MAX_ROWS


def check_quantization(quantization: str | None, device: str) -> None:
    """quantization="int8" (or "w8a8") runs the C++ int8 kernel: on CPU, where the kernels are built or can be
    built."""
    if quantization is None:
        return
    if device != "cpu":
        raise InvalidValueError(f"EngineConfig: quantization={quantization!r} runs on device='cpu' only for "
                                "now: nanoengine has no int8-weight (W8A16) kernel for CUDA yet; use "
                                "device='cpu', or leave quantization=None on CUDA")
    problem = cpu_kernels.build_problem()
    if problem:
        raise InvalidValueError(f"EngineConfig: quantization={quantization!r} needs the C++ CPU kernels, "
                                f"which cannot be built here ({problem}); {cpu_kernels.FIX}; or leave "
                                "quantization=None")


def pick_kv_cache_dtype(want: str, dtype: str, backend: str, pieces: PieceSelection = NO_PIECES) -> str:
    """The KV cache's element type: the compute dtype for 'auto', else bfloat16 ('bf16' is vLLM's spelling).
    A bf16 cache under another compute dtype needs a backend that reads it (`torch`, `cpu`); the GPU kernels
    (`triton`, `flash_attn`) and the learner's attention pieces read a cache of the compute dtype only."""
    kv_dtype = dtype if want == "auto" else "bfloat16"
    if kv_dtype == dtype:
        return kv_dtype
    if backend in ("triton", "flash_attn"):
        raise InvalidValueError(f"EngineConfig: kv_cache_dtype={want!r} with dtype={dtype!r} needs an "
                                f"attention backend that reads a bfloat16 cache under {dtype} compute "
                                f"('torch' or 'cpu'), not attention_backend={backend!r}; leave "
                                "kv_cache_dtype='auto', use dtype='bfloat16', or attention_backend='torch'")
    if pieces.forward_pieces:
        raise InvalidValueError(f"EngineConfig: kv_cache_dtype={want!r} with dtype={dtype!r} is not "
                                f"supported with {pieces.option}'s attention pieces, which read a cache of "
                                "the compute dtype; leave kv_cache_dtype='auto'")
    return kv_dtype


def pick_prefill_dtype(want: str, dtype: str, bf16_rows: int, hf_config: Any) -> tuple[str, int]:
    """What linears over more than the returned rows compute in: (`dtype`, 0) for 'auto'; for 'bfloat16' (a
    bf16 checkpoint in float32 with bf16 weight copies, oneDNN bf16 here) ('bfloat16', the measured threshold)
    where bf16 measured faster at some batch size (`dtype_choice.prefill_choice`: decode batches included)."""
    import torch

    if want == "auto" or dtype == "bfloat16":
        return dtype, 0
    if not (dtype == "float32" and bf16_rows and shapes.checkpoint_dtype(hf_config) == torch.bfloat16
            and linear.onednn_bf16_available()):
        raise InvalidValueError(f"EngineConfig: prefill_dtype={want!r} runs a bf16 checkpoint's prefill "
                                "linears in bf16 under float32 compute on CPU (the 'cpu' backend's bf16 "
                                "weight copies, no quantization) with torch's oneDNN bf16 matmul, which this "
                                f"engine (dtype={dtype!r}) or CPU does not have; leave prefill_dtype='auto'")
    if not cpu_kernels.is_built():  # resolving never compiles: the fixed threshold, measured next start
        return "bfloat16", linear.BF16_PREFILL_MIN_ROWS
    choice = dtype_choice.prefill_choice(hf_config, bf16_rows)
    if choice.min_rows is None:
        largest = choice.ms_by_rows[-1]
        warnings.warn(f"nanoengine: prefill_dtype='bfloat16' measured slower than float32 on this CPU "
                      f"({largest[2]:.2f} against {largest[1]:.2f} ms for a layer's linears at {largest[0]} "
                      "rows), so prefill stays in float32", stacklevel=4)
        return dtype, 0
    return "bfloat16", choice.min_rows
