"""EnginePlan: the user's EngineConfig resolved against the checkpoint and the machine, once, into concrete
values. Chapters 00 and 06.

`resolve_plan(config, hf_config, model_path, pieces)` is the one place that picks (an explicit choice is
checked, and an option that cannot work here is an error saying why and what would work):
- device: CUDA when it is there, else CPU;
- dtype: as given, else the checkpoint's; bfloat16 for float16 on CPU (fp16 matmuls have no fast path there);
  on CPU 'auto' may choose by measurement (nanoengine/plan_cpu.py, chapter 08). The plan keeps where the
  dtype came from (`dtype_source`) and the times (`dtype_ms_per_step`);
- attention backend, block size, decode mode and torch.compile (nanoengine/plan_backend.py, chapter 06);
- the KV pool: a block count when it is known before the model is built, else (CUDA) a share of GPU memory;
  its element type (`kv_cache_dtype`, vLLM's option: the compute dtype, or bfloat16; plan_cpu.py);
- what a CPU plan chooses besides (plan_cpu.py, chapter 08): oneDNN-packed weights, bf16 weight copies and
  the rows they take, prefill_dtype and its measured row threshold, weight-only int8 (quantization="int8")
  and int8 activations too (quantization="w8a8");
- overlap scheduling (`pick_async_scheduling`) and tensor parallelism's sizes (`check_tensor_parallel`).
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
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from nanoengine.config import EngineConfig
from nanoengine.errors import InvalidValueError
from nanoengine.models import hf_config as shapes
from nanoengine.pieces import NO_PIECES, PieceSelection
from nanoengine.plan_backend import (
    DEFAULT_BLOCK_SIZE,
    DecodeMode,
    check_block_size,
    pick_attention_backend,
    pick_decode_mode,
    pick_torch_compile,
)
from nanoengine.plan_cpu import (
    bf16_weight_rows,
    check_quantization,
    int8_weight_rows,
    pick_dtype,
    pick_kv_cache_dtype,
    pick_prefill_dtype,
    pick_prepack,
    rule_dtype,
)

CPU_KV_CACHE_GB = 2.0  # the KV pool on CPU when neither num_kvcache_blocks nor kv_cache_memory_gb is set



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

    device = pick_device(config.device)
    check_tensor_parallel(config.tensor_parallel_size, device, hf_config, launch)
    moe = check_moe(config, hf_config)
    check_pieces_fit(config, hf_config, pieces, moe)
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
    max_model_len = pick_max_model_len(config.max_model_len, hf_config)
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


def pick_device(device: str) -> str:
    """"cuda" or "cpu": what `device` names ("auto": CUDA where it is available)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidValueError("EngineConfig: device='cuda' but CUDA is not available; use device='cpu' or "
                                "'auto'")
    return device


def check_pieces_fit(config: EngineConfig, hf_config: Any, pieces: PieceSelection, moe: bool) -> None:
    """The learner's pieces run in this engine: MoE pieces need an MoE model, speculation's pieces need
    speculation (an n-gram proposer, the "ngram" method), and speculation needs the engine's own scheduler."""
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


def pick_max_model_len(asked: int | None, hf_config: Any) -> int:
    """The longest sequence (prompt + output): what was asked, at most the model's max_position_embeddings
    (its default; 4096 where the config has none)."""
    model_max = getattr(hf_config, "max_position_embeddings", None) or 4096
    max_model_len = asked or model_max
    if max_model_len > model_max:
        raise InvalidValueError(f"EngineConfig: max_model_len={max_model_len} is longer than the model's "
                                f"max_position_embeddings={model_max}; use max_model_len <= {model_max}")
    return max_model_len


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
