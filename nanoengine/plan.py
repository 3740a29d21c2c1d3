"""EnginePlan: the user's EngineConfig resolved against the checkpoint and the machine, once, into concrete
values. Chapters 00 and 06.

`resolve_plan(config, hf_config, model_path, pieces)` is the one place that picks (an explicit choice is
checked, and an option that cannot work here is an error saying why and what would work):
- device: CUDA when it is there, else CPU;
- dtype: as given, else the checkpoint's; bfloat16 for float16 on CPU (fp16 matmuls have no fast path there).
  On CPU with the C++ kernels, 'auto' for a 16-bit checkpoint chooses between its decode paths by
  measurement (`pick_dtype`, nanoengine/dtype_choice.py, chapter 08): float32 with bf16 weight copies and the
  fused C++ step, and bfloat16 with oneDNN-packed weights where oneDNN has bf16 here; with both, the faster on
  a stand-in of the model's decode step, timed once per kind of machine and model shape and kept in the
  kernels folder ("measured", then "cached"); with one (an AVX2-only CPU: float32; int8, whose decode runs
  the int8 kernel either way; no fused step) the old rule, untimed ("only candidate"). The plan keeps where
  the dtype came from (`dtype_source`) and the times (`dtype_ms_per_step`);
- attention backend: on CPU `cpu` (the C++ kernels) if they are built or can be built here, else `torch`;
  `triton` only when asked for, and only with TRITON_INTERPRET=1 set (its interpreter). On CUDA `flash_attn`
  if it imports and can serve the config (fp16/bf16; block size unset or a multiple of 256), else `triton`,
  else `torch`. Pieces of the learner's that run inside the model's forward take the torch backend;
- block size: 256 for flash_attn, else 16 (`triton` takes any power of two, `torch` and `cpu` any size);
- the KV pool: a block count when it is known before the model is built, else (CUDA) a share of GPU memory;
  its element type (`kv_cache_dtype`, vLLM's option): the compute dtype, or bfloat16, which halves a float32
  cache's bytes (the same memory holds twice the blocks); the store rounds K/V to it and the `torch` and
  `cpu` backends read it (the C++ decode kernel widens bf16 rows in registers); `triton` and `flash_attn`
  refuse a cache dtype other than the compute dtype;
- one decode mode (chapter 06): CUDA graphs on CUDA unless enforce_eager=True (or the backend cannot run in a
  graph); the graphs' CPU stand-in with graph_stand_in=True (or the learner's stand-in graphs); on CPU with
  the `cpu` backend the whole layer stack in one C++ call; else eager;
- prefill_dtype="bfloat16" (opt-in): for a bf16 checkpoint run in float32 on CPU with bf16 weight copies and
  oneDNN bf16, linears over more rows than a threshold measured on this machine (`prefill_dtype_min_rows`,
  `dtype_choice.prefill_choice`, kept like the dtype: the smallest batch from which bf16 timed faster than the
  bf16 copies' kernel or float32) multiply bf16 activations by oneDNN-packed bf16 weights: prefill chunks, and
  decode steps of that many streams (the fused step takes the same threshold); where bf16 never measured
  faster they stay float32, with a warning saying so;
- torch.compile of the small fused ops and the sampler (default: on CUDA only);
- weight-only int8 (quantization="int8", chapter 08): on CPU with the C++ kernels only, for now (CUDA has no
  W8A16 kernel here yet: a clear error); batches of up to INT8_WEIGHT_MAX_ROWS rows use the int8 kernel;
  quantization="w8a8": the same int8 weights times int8 activations, every batch (prefill too) through the
  int8 dot-product kernel (`quant.ALL_ROWS`).
A mixture-of-experts checkpoint (chapter 10) has its MoE fields checked here, before anything is built, and
runs what its torch expert forward can (`check_moe`): tensor parallelism of every expert, or with
enable_expert_parallel whole experts per rank (the sizes must divide evenly; a dense model refuses the
option), no int8
(its experts have no int8 path yet), and decode steps eagerly or through the CPU graph stand-in: the fused
C++ step has no experts, and the grouped expert forward reads its per-expert counts on the host, which a CUDA
graph cannot capture (CUDA decodes eagerly, with a warning, until a fused-MoE kernel). Prepacked and bf16
weight copies apply to its dense linears (attention, router); the experts keep their stacked weights.
Resolving never compiles anything: it asks whether the CPU kernels are built or can be built here, whether
triton is installed (and on CPU, whether its interpreter is on), and whether flash_attn imports.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from nanoengine import dtype_choice
from nanoengine.attention import flash_attn_backend, get_backend
from nanoengine.config import EngineConfig
from nanoengine.dtype_choice import DtypeChoice
from nanoengine.errors import InvalidValueError
from nanoengine.kernels import cpu as cpu_kernels
from nanoengine.kernels import triton_support
from nanoengine.layers import linear, quant
from nanoengine.models import hf_config as shapes
from nanoengine.pieces import NO_PIECES, PieceSelection

# Block size each attention backend works best with (the torch backend gathers whole blocks; flash-attn's
# paged KV cache needs a multiple of 256 tokens per block).
DEFAULT_BLOCK_SIZE = {"torch": 16, "cpu": 16, "triton": 16, "flash_attn": 256}
FLASH_ATTN_DTYPES = ("float16", "bfloat16")
FLASH_ATTN_BLOCK_MULTIPLE = 256
CPU_KV_CACHE_GB = 2.0  # the KV pool on CPU when neither num_kvcache_blocks nor kv_cache_memory_gb is set
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


class DecodeMode(StrEnum):
    """How a decode-only step runs (every other step runs eagerly). Chapter 06."""
    CUDA_GRAPHS = "cuda_graphs"  # replay a CUDA graph captured per batch-size bucket
    STAND_IN = "stand_in"  # the CPU stand-in of CUDA graphs: the same buckets, padding and static buffers
    FUSED_CPU = "fused_cpu"  # every decoder layer in one C++ call (the CPU's analogue of a graph)
    EAGER = "eager"  # layer by layer, as every other step


@dataclass(frozen=True)
class FixedKVBlocks:
    """A KV pool of a block count known before the model is built (asked for, or from a byte budget)."""
    num_blocks: int


@dataclass(frozen=True)
class GPUMemoryShare:
    """A KV pool of what is left of `utilization` of the GPU after the weights, a warm-up forward at the
    largest batch and the graphs (measured by each rank; the smallest pool wins), at most `max_blocks`."""
    utilization: float
    max_blocks: int


@dataclass(frozen=True)
class EnginePlan:
    """Everything an engine is built and run with, each value concrete. Made by `resolve_plan`."""
    model: str  # as the user named it
    model_path: Path  # the checkpoint folder
    hf_config: Any = field(repr=False, compare=False)  # the checkpoint's Hugging Face config
    device: str  # "cpu" or "cuda" (rank r of a tensor-parallel engine on CUDA uses cuda:r)
    dtype: str  # "float32", "bfloat16" or "float16"
    dtype_source: str  # "given", "only candidate", "measured", "cached" or "unmeasured" (dtype_choice.py)
    dtype_ms_per_step: tuple[tuple[str, float], ...]  # (candidate dtype, ms of a decode step) when timed
    attention_backend: str  # "torch", "cpu", "triton" or "flash_attn"
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    scheduling_policy: str  # "fcfs" or "skip_ahead" (engine/scheduler.py)
    enable_prefix_caching: bool
    kv_cache: FixedKVBlocks | GPUMemoryShare
    kv_bytes_per_block: int  # one block's K and V on one rank (its share of the KV heads)
    kv_cache_dtype: str  # the KV cache's element type: the compute dtype, or "bfloat16" (pick_kv_cache_dtype)
    decode_mode: DecodeMode
    torch_compile: bool
    prepack_weights: bool  # CPU bf16: oneDNN-packed linear weights
    bf16_weight_rows: int  # batches of up to this many rows use bf16 weight copies (0: never)
    prefill_dtype: str  # what larger batches' linears compute in: dtype, or "bfloat16" (pick_prefill_dtype)
    prefill_dtype_min_rows: int  # with prefill_dtype != dtype: batches of more rows (decode too) use it
    # "int8": weight-only int8 linears and LM head; "w8a8": int8 activations too (layers/quant.py); "none"
    quantization: str
    int8_weight_rows: int  # batches of up to this many rows use the int8 copies (0: no quantization)
    tensor_parallel_size: int
    enable_expert_parallel: bool  # an MoE model's ranks hold whole experts (layers/moe.py)
    async_scheduling: bool  # overlap: the host schedules step N+1 while step N runs (engine/executor.py)
    dist_backend: str  # "nccl" when every rank has a GPU, else "gloo"
    seed: int
    trace: bool
    pieces: PieceSelection  # the learner's pieces the engine runs on (empty: the engine's own)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def torch_kv_cache_dtype(self):
        import torch

        return getattr(torch, self.kv_cache_dtype)

    @property
    def max_blocks_per_seq(self) -> int:
        """Block-table entries a sequence of max_model_len tokens needs."""
        return -(-self.max_model_len // self.block_size)

    def describe(self) -> dict[str, Any]:
        """The plan as plain JSON values (the benchmark's record)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "hf_config":
                continue
            if isinstance(value, Enum):
                value = value.value
            elif isinstance(value, Path):
                value = str(value)
            elif f.name == "dtype_ms_per_step":
                value = dict(value)
            elif dataclasses.is_dataclass(value):
                value = {"kind": type(value).__name__, **dataclasses.asdict(value)}
            out[f.name] = value
        return out


def resolve_plan(config: EngineConfig, hf_config: Any, model_path: Path,
                 pieces: PieceSelection = NO_PIECES, launch: Any = None) -> EnginePlan:
    """Resolve what the user asked for against the checkpoint's config and this machine (see the module
    docstring); `pieces` are the learner's pieces the engine is built with; `launch` where a launcher
    (torchrun) put this process (nanoengine.distributed.launcher.Launched), or None."""
    import torch

    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidValueError("EngineConfig: device='cuda' but CUDA is not available; use device='cpu' or "
                                "'auto'")
    check_tensor_parallel(config.tensor_parallel_size, device, hf_config, launch)
    moe = check_moe(config, hf_config)
    if pieces.moe_pieces and not moe:
        raise InvalidValueError(f"EngineConfig: {pieces.option} includes pieces that run only in a "
                                f"mixture-of-experts model's layers ({', '.join(pieces.moe_pieces)}), but "
                                f"{getattr(hf_config, 'model_type', 'this model')!r} is dense; use an MoE "
                                "model (e.g. 'tiny-qwen3-moe'), or leave them out")
    if config.speculative_config is not None and pieces.schedule_pieces:
        raise InvalidValueError(f"EngineConfig: speculative_config needs the engine's own scheduler, which "
                                f"gives a decode its drafts, but {pieces.option} replaces its pass with "
                                f"yours ({', '.join(pieces.schedule_pieces)}); leave those out, or "
                                "speculative_config")
    if config.speculative_config is None and pieces.spec_pieces:
        raise InvalidValueError(f"EngineConfig: {pieces.option} includes pieces that run only while "
                                f"speculating ({', '.join(pieces.spec_pieces)}), but speculative_config is "
                                "not set; add "
                                "speculative_config={'method': 'ngram', 'num_speculative_tokens': 3}, or "
                                "leave them out")
    if pieces.spec_pieces and config.speculative_config.method != "ngram":
        raise InvalidValueError(f"EngineConfig: {pieces.option} plugs in your n-gram proposer "
                                f"(Exercise 9.1), but speculative_config's method is "
                                f"{config.speculative_config.method!r}; "
                                "use method 'ngram' with it, or leave 'ch09' out")
    # on CPU the backend does not depend on the dtype (only flash_attn's check on CUDA does), so it is picked
    # with the rule's dtype, and the dtype then chosen among the decode paths that backend can run
    backend = pick_attention_backend(config, device, rule_dtype(config.dtype, device, hf_config), pieces)
    dtype_choice = pick_dtype(config, device, hf_config, backend, pieces, moe)
    dtype = dtype_choice.dtype
    block_size = config.block_size or DEFAULT_BLOCK_SIZE[backend]
    check_block_size(backend, block_size)
    prepack = pick_prepack(config.prepack_weights, device, dtype)
    torch_compile = pick_torch_compile(config, device, backend, pieces)
    check_quantization(config.quantization, device)
    decode_mode = pick_decode_mode(config, device, backend, prepack, pieces, moe)
    model_max = getattr(hf_config, "max_position_embeddings", None) or 4096
    max_model_len = config.max_model_len or model_max
    if max_model_len > model_max:
        raise InvalidValueError(f"EngineConfig: max_model_len={max_model_len} is longer than the model's "
                                f"max_position_embeddings={model_max}; use max_model_len <= {model_max}")
    tp = config.tensor_parallel_size
    kv_dtype = pick_kv_cache_dtype(config.kv_cache_dtype, dtype, backend, pieces)
    per_token = shapes.kv_bytes_per_token(hf_config, getattr(torch, kv_dtype).itemsize) // tp  # per rank
    bytes_per_block = block_size * per_token
    kv_cache = kv_cache_size(config, device, bytes_per_block, max_model_len, block_size)
    bf16_rows = 0 if config.quantization else bf16_weight_rows(device, backend, dtype, prepack, hf_config)
    prefill_dtype, prefill_rows = pick_prefill_dtype(config.prefill_dtype, dtype, bf16_rows, hf_config)
    return EnginePlan(
        model=config.model, model_path=Path(model_path), hf_config=hf_config, device=device, dtype=dtype,
        dtype_source=dtype_choice.source, dtype_ms_per_step=dtype_choice.ms_per_step,
        attention_backend=backend, block_size=block_size, max_model_len=max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
        scheduling_policy=config.scheduling_policy, enable_prefix_caching=config.enable_prefix_caching,
        kv_cache=kv_cache, kv_bytes_per_block=bytes_per_block, kv_cache_dtype=kv_dtype,
        decode_mode=decode_mode, torch_compile=torch_compile, prepack_weights=prepack,
        bf16_weight_rows=bf16_rows,
        prefill_dtype=prefill_dtype, prefill_dtype_min_rows=prefill_rows,
        quantization=config.quantization or "none",
        int8_weight_rows=int8_weight_rows(config.quantization, prepack),
        tensor_parallel_size=tp, enable_expert_parallel=config.enable_expert_parallel,
        async_scheduling=pick_async_scheduling(config.async_scheduling, device, config.trace,
                                               config.speculative_config),
        dist_backend="nccl" if device == "cuda" else "gloo", seed=config.seed,
        trace=config.trace, pieces=pieces)


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


def pick_async_scheduling(want: bool | None, device: str, trace: bool, speculative: Any = None) -> bool:
    """Overlap scheduling where it pays: on CUDA, where kernels run while the host goes on. Not by default on
    CPU, where the forward would run on the executor's thread beside the host's Python: there a decode step
    is almost all forward (at batch 256, tiny-qwen3's LM head took ~120 ms of a ~170 ms step, the host
    ~1.5 ms), and the measured step time moved by its noise (chapter 06). Off by default with trace=True: a
    traced step's snapshot of the block tables is then taken right after it (with overlap it is taken when
    the step finishes, after the next one has been scheduled). Off with speculative decoding (EngineConfig
    refuses both): the next step's drafts and positions depend on how many of this step's were accepted."""
    if want is not None:
        return want
    if speculative is not None:
        return False
    return device == "cuda" and not trace


def check_tensor_parallel(tp: int, device: str, hf_config: Any, launch: Any = None) -> None:
    """Tensor parallelism splits attention heads, KV heads and the vocabulary evenly across ranks, and puts
    one rank on each GPU: refuse a size that cannot, before any process starts. Under a launcher, its ranks
    are the engine's: as many as tensor_parallel_size, each machine's on its own GPUs."""
    import torch

    if launch is not None and launch.world_size != tp:
        raise InvalidValueError(f"EngineConfig: this process was started by a launcher (torchrun) with "
                                f"WORLD_SIZE={launch.world_size}, but tensor_parallel_size={tp}; every rank "
                                f"is one shard of the model: pass tensor_parallel_size={launch.world_size}, "
                                "or start as many ranks as you want shards")
    if tp == 1:
        return
    sizes = {"attention heads (num_attention_heads)": hf_config.num_attention_heads,
             "KV heads (num_key_value_heads)": shapes.num_kv_heads(hf_config),
             "vocabulary (vocab_size)": hf_config.vocab_size}
    bad = [f"{n} {what}" for what, n in sizes.items() if n % tp]
    if bad:
        works = [d for d in range(1, max(sizes.values()) + 1) if all(n % d == 0 for n in sizes.values())]
        works = [d for d in works if d <= sizes["attention heads (num_attention_heads)"]]
        raise InvalidValueError(f"EngineConfig: tensor_parallel_size={tp} must divide the model's "
                                f"{', '.join(bad)} evenly, since each rank holds an equal share; "
                                f"sizes that work for this model: {', '.join(map(str, works))}")
    here = tp if launch is None else launch.local_world_size  # the ranks on this machine
    if device == "cuda" and here > torch.cuda.device_count():
        if launch is not None:
            raise InvalidValueError(f"EngineConfig: the launcher put {here} ranks on this machine "
                                    f"(LOCAL_WORLD_SIZE), one per GPU, but {torch.cuda.device_count()} CUDA "
                                    "device(s) are visible; start at most that many per machine "
                                    "(torchrun --nproc-per-node)")
        raise InvalidValueError(f"EngineConfig: tensor_parallel_size={tp} needs one GPU per rank, but "
                                f"{torch.cuda.device_count()} CUDA device(s) are visible; use "
                                f"tensor_parallel_size <= {torch.cuda.device_count()} or device='cpu' (gloo, "
                                "for learning and testing)")


def check_moe(config: EngineConfig, hf_config: Any) -> bool:
    """True for a mixture-of-experts checkpoint, whose config fields are checked (hf_config.moe_config) and
    whose options must be ones its experts run (see the module docstring); a clear error otherwise."""
    moe = shapes.moe_config(hf_config)
    tp = config.tensor_parallel_size
    if moe is None:
        if config.enable_expert_parallel:
            raise InvalidValueError(f"EngineConfig: enable_expert_parallel=True splits a mixture of experts "
                                    f"across ranks, but {config.model!r} is a dense model (no experts); "
                                    "leave enable_expert_parallel=False")
        return False
    if config.enable_expert_parallel and moe.num_experts % tp:
        raise InvalidValueError(f"EngineConfig: enable_expert_parallel=True gives each of the "
                                f"tensor_parallel_size={tp} ranks an equal share of whole experts, but the "
                                f"model has num_experts={moe.num_experts}; use a tensor_parallel_size that "
                                f"divides {moe.num_experts}, or enable_expert_parallel=False")
    if not config.enable_expert_parallel and moe.intermediate % tp:
        raise InvalidValueError(f"EngineConfig: tensor_parallel_size={tp} gives each rank an equal share "
                                f"of every expert's moe_intermediate_size={moe.intermediate} rows, which it "
                                f"does not divide; use a tensor_parallel_size that divides "
                                f"{moe.intermediate}, or enable_expert_parallel=True (whole experts a rank)")
    if config.quantization:
        raise InvalidValueError(f"EngineConfig: quantization={config.quantization!r} does not cover "
                                "mixture-of-experts models yet (their experts have no int8 path); leave "
                                "quantization=None")
    return True


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


def pick_attention_backend(config: EngineConfig, device: str, dtype: str, pieces: PieceSelection) -> str:
    """The backend for this device and dtype: 'auto' picks (see the module docstring), an explicit choice is
    checked; both say why when a backend cannot run here."""
    want = config.attention_backend
    if pieces.forward_pieces:
        allowed = pieces.attention_backends
        if want == "auto" or (want in allowed and want != "cpu"):
            return allowed[0] if want == "auto" else want
        if want in allowed and device == "cpu":
            return pick_cpu_kernels(want)
        raise InvalidValueError(f"EngineConfig: {pieces.option} plugs your "
                                f"{', '.join(pieces.forward_pieces)} pieces into the {' or '.join(allowed)} "
                                f"attention backend, so attention_backend={want!r} cannot be used with them; "
                                f"leave attention_backend='auto' (or '{allowed[0]}')")
    if want == "torch":
        return want
    if want == "triton":
        problem = triton_support.problem(device)
        if problem:
            raise InvalidValueError(f"EngineConfig: attention_backend='triton' cannot run here: {problem}")
        return want
    if device == "cpu":
        if want == "flash_attn":
            raise InvalidValueError("EngineConfig: attention_backend='flash_attn' runs on device='cuda' "
                                    "only; on CPU use 'auto' (the C++ kernels), 'cpu', 'torch' or 'triton' "
                                    "(TRITON_INTERPRET=1)")
        return pick_cpu_kernels(want)
    if want == "cpu":
        raise InvalidValueError("EngineConfig: attention_backend='cpu' runs on device='cpu' only; on CUDA "
                                "use 'auto', 'flash_attn', 'triton' or 'torch'")
    flash_problem = flash_attn_problem(flash_attn_backend.problem(), dtype, config.block_size)
    if want == "flash_attn":
        if flash_problem:
            raise InvalidValueError(f"EngineConfig: attention_backend='flash_attn' cannot run here: "
                                    f"{flash_problem}")
        return want
    if flash_problem is None:  # auto on CUDA
        return "flash_attn"
    triton_problem = triton_support.problem(device)
    if triton_problem is None:
        return "triton"
    warnings.warn(f"nanoengine: neither flash_attn ({flash_problem}) nor triton ({triton_problem}) can run "
                  "here; using the slower torch attention backend", stacklevel=4)
    return "torch"


def flash_attn_problem(import_problem: str | None, dtype: str, block_size: int | None) -> str | None:
    """Why flash_attn cannot serve this config (import, dtype, block size), or None."""
    if import_problem:
        return f"{import_problem}; pip install flash-attn, or use attention_backend='triton'"
    if dtype not in FLASH_ATTN_DTYPES:
        return (f"flash-attn computes in float16 or bfloat16, not dtype={dtype!r}; use dtype='bfloat16' or "
                "attention_backend='triton' (any dtype)")
    if block_size is not None and block_size % FLASH_ATTN_BLOCK_MULTIPLE:
        return (f"flash-attn's paged KV cache needs a block size that is a multiple of "
                f"{FLASH_ATTN_BLOCK_MULTIPLE}, not block_size={block_size}; leave block_size unset "
                f"({DEFAULT_BLOCK_SIZE['flash_attn']}) or use attention_backend='triton' for smaller blocks")
    return None


def pick_cpu_kernels(want: str) -> str:
    """'cpu' (the C++ kernels) on CPU when they are built or can be built here, else 'torch'."""
    problem = cpu_kernels.build_problem()
    if problem is None:
        return "cpu"
    if want == "cpu":
        raise InvalidValueError(f"EngineConfig: attention_backend='cpu' cannot be built here ({problem}); "
                                f"{cpu_kernels.FIX}; or use attention_backend='torch'")
    warnings.warn(cpu_kernels.fallback_line(problem), stacklevel=5)  # one line: why, and how to get them
    return "torch"


def check_block_size(backend: str, block_size: int) -> None:
    """A block size the chosen backend can use, or an error saying what would work (flash_attn's was
    checked when it was picked)."""
    if backend == "triton" and block_size & (block_size - 1):
        lower = 1 << (block_size.bit_length() - 1)
        raise InvalidValueError("EngineConfig: attention_backend='triton' needs a power-of-two block_size, "
                                f"not {block_size}; use {lower} or {lower * 2} "
                                f"(default {DEFAULT_BLOCK_SIZE['triton']})")


def pick_torch_compile(config: EngineConfig, device: str, backend: str, pieces: PieceSelection) -> bool:
    if pieces.forward_pieces and config.torch_compile:
        raise InvalidValueError("EngineConfig: torch_compile=True compiles the engine's own norm and rotary "
                                f"ops, but {pieces.option} runs yours; leave torch_compile unset")
    if config.torch_compile is None:
        return device == "cuda" and not pieces.forward_pieces
    if config.torch_compile and backend == "cpu":
        raise InvalidValueError("EngineConfig: torch_compile=True compiles the ops that "
                                "attention_backend='cpu' already runs as fused C++ kernels; use "
                                "attention_backend='torch' to compile them instead, or leave "
                                "torch_compile unset")
    return config.torch_compile


def pick_decode_mode(config: EngineConfig, device: str, backend: str, prepack: bool,
                     pieces: PieceSelection, moe: bool = False) -> DecodeMode:
    """How decode steps run, decided once (chapter 06; see DecodeMode). A mixture-of-experts model decodes
    eagerly or through the CPU stand-in (see the module docstring)."""
    if config.graph_stand_in and device != "cpu":
        raise InvalidValueError("EngineConfig: graph_stand_in=True is the CPU stand-in of CUDA graphs; on "
                                "CUDA the engine captures real graphs (leave graph_stand_in=False; "
                                "enforce_eager=True turns them off)")
    if pieces.graph_pieces and (device != "cpu" or config.enforce_eager):
        names = ", ".join(map(repr, pieces.graph_pieces))
        raise InvalidValueError(f"EngineConfig: use_exercises with {names} runs decode steps through your "
                                "stand-in graphs, which run on device='cpu' only and not with "
                                f"enforce_eager=True; drop {names} or use device='cpu' without enforce_eager")
    if config.graph_stand_in and config.enforce_eager:
        raise InvalidValueError("EngineConfig: graph_stand_in=True runs decode through (stand-in) graphs and "
                                "enforce_eager=True forbids graphs; pick one")
    if config.graph_stand_in or pieces.graph_pieces:  # the learner's graphs are stand-ins
        return DecodeMode.STAND_IN
    if device == "cuda" and not config.enforce_eager:
        if moe:
            warnings.warn("nanoengine: a mixture-of-experts model's expert forward reads its per-expert "
                          "token counts on the host, which a CUDA graph cannot capture, so decode steps run "
                          "eagerly (enforce_eager=True says so)", stacklevel=4)
            return DecodeMode.EAGER
        if not get_backend(backend).cuda_graphs:
            warnings.warn(f"nanoengine: attention_backend={backend!r} cannot run inside a CUDA graph (its "
                          "store decides on the host which slots to skip), so decode steps run eagerly; use "
                          "attention_backend='triton' for CUDA graphs, or enforce_eager=True to say so",
                          stacklevel=4)
            return DecodeMode.EAGER
        # the learner's pieces inside the model run eagerly (their Python may read tensors on the host)
        return DecodeMode.EAGER if pieces.forward_pieces else DecodeMode.CUDA_GRAPHS
    # the fused step mirrors the engine's own layers on one rank, with its bf16 (or int8) weight copies (with
    # oneDNN's packed bf16 weights and no int8, the layer-by-layer forward's linears are those)
    # (the fused step has no experts: a mixture-of-experts model decodes eagerly)
    if (device == "cpu" and backend == "cpu" and not config.enforce_eager and not pieces and not moe
            and config.tensor_parallel_size == 1 and (not prepack or config.quantization)):
        return DecodeMode.FUSED_CPU
    return DecodeMode.EAGER


def kv_cache_size(config: EngineConfig, device: str, bytes_per_block: int, max_model_len: int,
                  block_size: int) -> FixedKVBlocks | GPUMemoryShare:
    """How many KV blocks each rank holds: num_kvcache_blocks as asked; else from kv_cache_memory_gb (per
    rank), or on CPU the default pool shared by the ranks; on CUDA what memory is left (measured later)."""
    if config.num_kvcache_blocks is not None:
        return FixedKVBlocks(config.num_kvcache_blocks)
    most = config.max_num_seqs * -(-max_model_len // block_size)  # every sequence at full length
    if config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 2**30
    elif device == "cuda":
        return GPUMemoryShare(config.gpu_memory_utilization, most)
    else:
        budget = CPU_KV_CACHE_GB * 2**30 / config.tensor_parallel_size  # the ranks share the host's memory
    return FixedKVBlocks(kv_blocks_within(budget, bytes_per_block, most))


def kv_blocks_within(budget: float, bytes_per_block: int, most: int) -> int:
    """Blocks that fit `budget` bytes, at most `most`; an error when not even one does."""
    num_blocks = min(int(budget // bytes_per_block), most)
    if num_blocks < 1:
        raise InvalidValueError(f"no memory left for the KV cache ({budget / 2**30:.2f} GiB); lower "
                                "gpu_memory_utilization's reservation or set kv_cache_memory_gb")
    return num_blocks
