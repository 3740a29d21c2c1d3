"""ModelRunner: one rank's model, paged KV cache and decode graphs; turns a step's ModelInput into the logits
of its sampled rows. Chapter 03.

Building: the model class from config.json's `architectures`, with the parts the engine was assembled from
(`engine/parts.py`: attention backend, kernels, the rank's tensor-parallel group), then the weights, then the
KV cache (the plan's block count, or on CUDA what `gpu_memory_utilization` leaves: `cuda_kv_budget`), then the
decode path the plan's decode mode names (chapter 06), chosen once (`decode_path_of`): CUDA graphs or their
CPU stand-in (`engine/graphs.py`), or every decoder layer in one C++ call (`models/fused_decode.py`), or none.
One step (`execute`): its inputs go to this rank's device; a decode-only step that the decode path takes runs
there, any other step runs eagerly; logits are computed only for the sampled rows.
A runner knows nothing of processes: under tensor parallelism (chapter 07) an executor runs one per rank,
each built with its `TPGroup` (its shard of the model, its own KV heads), and steps them together.
"""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nanoengine.attention import AttentionMetadata
from nanoengine.engine import pending
from nanoengine.engine.inputs import ModelInput
from nanoengine.kernels import cpu as cpu_kernels
from nanoengine.layers.tp_group import TPGroup
from nanoengine.models import get_model_class, hf_config
from nanoengine.models.fused_decode import FusedDecode
from nanoengine.models.loader import load_model
from nanoengine.models.weight_copies import prepare_weights
from nanoengine.plan import DecodeMode, EnginePlan, FixedKVBlocks, GPUMemoryShare, kv_blocks_within

if TYPE_CHECKING:
    from nanoengine.engine.parts import EngineParts


def takes_none(inp: ModelInput) -> bool:
    """The decode path of an engine without one: every step runs eagerly."""
    return False


def no_memory() -> int:
    """What a decode path without a graph pool takes beside the KV cache: nothing."""
    return 0


# a decode path: (takes(inp), run(inp) -> hidden states [num_tokens, hidden]); other steps run eagerly
DecodePath = tuple[Callable[[ModelInput], bool], Callable[[ModelInput], torch.Tensor]]


def zeros_lazily(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose CPU pages are only touched when used: an anonymous memory map, which the kernel
    zeroes page by page on first write, so a 2 GiB KV pool costs microseconds to allocate. Zeros matter:
    masked attention multiplies unused slots by 0, and 0 * NaN from uninitialized memory would be NaN.
    (Not numpy's zeros: it asks for transparent huge pages, whose first touch on our VMs ran at 0.2 GB/s,
    2.7 s per 512 MB, a quarter of a 32-stream prefill's time; small pages: 0.17 s.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.empty((), dtype=dtype).element_size()
    for n in shape:
        nbytes *= n
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)  # keeps `pages`


class ModelRunner:
    def __init__(self, plan: EnginePlan, parts: EngineParts, tp: TPGroup,
                 local_rank: int | None = None) -> None:
        """local_rank: this rank's GPU among its machine's (default: its rank; a launcher's ranks on several
        machines pass theirs)."""
        self.plan = plan
        self.parts = parts
        hf = plan.hf_config
        self.tp = dataclasses.replace(parts.tp_group(tp), expert_parallel=plan.enable_expert_parallel)
        self.device = (torch.device(plan.device, tp.rank if local_rank is None else local_rank)
                       if plan.device == "cuda"
                       else torch.device(plan.device))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = plan.torch_dtype
        self.block_size = plan.block_size
        self.attn_backend = parts.attention_backend
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = get_model_class(hf)(hf, self.attn_backend, parts.kernels, self.tp, parts.moe)
        finally:
            torch.set_default_dtype(default_dtype)
        load_model(self.model, plan.model_path)
        self.model.eval()
        prepare_weights(self.model, plan)  # the plan's CPU weight copies (int8, bf16, prepacked), if any
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = hf_config.num_kv_heads(hf) // self.tp.size  # this rank's KV heads
        self.head_dim = hf_config.head_dim(hf)
        self.graphs = None  # DecodeGraphs (or the learner's), with decode mode CUDA_GRAPHS or STAND_IN
        self.fused: FusedDecode | None = None  # with decode mode FUSED_CPU
        self.graph_memory_bytes = 0  # the graph pool, measured before sizing the KV cache (CUDA)
        self.decode_memory, make_decode_path = self.decode_path_of(plan.decode_mode)
        self.num_blocks = self.allocate_kv_cache()
        self.decode_path: DecodePath = make_decode_path()

    def decode_path_of(self, mode: DecodeMode) -> tuple[Callable[[], int], Callable[[], DecodePath]]:
        """(bytes it takes beside the KV cache, a maker of the decode path) of a decode mode."""
        match mode:
            case DecodeMode.CUDA_GRAPHS:
                return self.measure_graph_memory, lambda: self.use_graphs("cuda")
            case DecodeMode.STAND_IN:
                return no_memory, lambda: self.use_graphs("stand_in")
            case DecodeMode.FUSED_CPU:
                return no_memory, self.use_fused
        return no_memory, lambda: (takes_none, self.eager_forward)

    def use_graphs(self, kind: str) -> DecodePath:
        """Capture the decode graphs (`kind`: "cuda" or "stand_in") over the bound KV cache: a decode step
        with a bucket replays one."""
        self.graphs = self.make_graphs(kind)
        self.graphs.capture()
        return self.graphs.can_replay, self.graphs.replay

    def use_fused(self) -> DecodePath:
        """Every decoder layer in one C++ call, built on the KV cache just bound."""
        self.fused = FusedDecode(self.model, cpu_kernels.load())
        return self.fused.can_run, self.fused

    # ------------------------------------------------------------------------------------------ KV cache
    def allocate_kv_cache(self) -> int:
        match self.plan.kv_cache:
            case FixedKVBlocks(num_blocks):
                pass
            case GPUMemoryShare(utilization, most):
                num_blocks = kv_blocks_within(self.cuda_kv_budget(utilization), self.plan.kv_bytes_per_block,
                                              most)
                # every rank must hold the same blocks: the smallest pool wins
                num_blocks = int(self.tp.all_reduce_min(
                    torch.tensor([num_blocks], device=self.device)).item())
        self.bind_kv_cache(num_blocks)
        return num_blocks

    def bind_kv_cache(self, num_blocks: int) -> None:
        layer_shape = self.attn_backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads,
                                                       self.head_dim)
        self.kv_cache_shape = layer_shape  # one layer's K (or V) cache, in the backend's layout
        # K/V in the plan's kv_cache_dtype (the compute dtype, or bf16, which the store rounds to)
        self.kv_cache = zeros_lazily((2, self.num_layers, *layer_shape), self.plan.torch_kv_cache_dtype,
                                     self.device)
        self.model.bind_kv_cache(self.kv_cache)

    def cuda_kv_budget(self, utilization: float) -> float:
        """Bytes the KV cache may take on CUDA: `utilization` of the GPU, less what is not torch's (CUDA
        context, NCCL, other processes), the weights and peak activations of a warm-up forward at the largest
        batch, and what the decode path takes beside the cache (the graphs' pool)."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self.warm_up()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)  # weights + the warm-up's activations
        free, total = torch.cuda.mem_get_info(dev)
        not_torch = total - free - torch.cuda.memory_reserved(dev)
        self.graph_memory_bytes = self.decode_memory()  # (CUDA graphs' pool; 0 for the other paths)
        return utilization * total - not_torch - peak - self.graph_memory_bytes

    def warm_up(self) -> None:
        """One forward of max_num_batched_tokens prompt tokens (chunks of at most max_model_len, no KV cache
        bound yet, so attention runs over the new tokens only) and the logits of max_num_seqs rows: the
        largest activations a step can have."""
        plan = self.plan
        total, most = plan.max_num_batched_tokens, plan.max_model_len
        lens = [most] * (total // most) + ([total % most] if total % most else [])
        starts = [sum(lens[:i]) for i in range(len(lens))]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=dev), num_decode_seqs=0,
            decode_block_tables=None, decode_context_lens=None, prefill_query_starts=starts,
            prefill_query_lens=lens, prefill_context_lens=lens,
            prefill_block_tables=[torch.zeros(0, dtype=torch.int64, device=dev)] * len(lens),
            block_size=self.block_size)
        ids = torch.zeros(total, dtype=torch.int64, device=dev)  # [total]
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])  # [total]
        rows = torch.arange(plan.max_num_seqs, device=dev) % total  # [max_num_seqs]
        self.execute(ModelInput(ids, positions, meta, rows))

    def measure_graph_memory(self) -> int:
        """Bytes the graphs' pool takes: the largest bucket captured once over a one-block KV cache (the
        smaller buckets reuse its pool), then released."""
        dev = self.device
        self.bind_kv_cache(1)
        before = torch.cuda.memory_reserved(dev)
        graphs = self.make_graphs("cuda")
        graphs.capture(graphs.buckets[-1:])
        torch.cuda.synchronize(dev)
        used = torch.cuda.memory_reserved(dev) - before
        del graphs  # its graph and pool go; the real KV cache replaces the one-block one
        torch.cuda.empty_cache()
        return used

    def make_graphs(self, kind: str):
        """The decode graphs of `kind` ("cuda" or "stand_in"; the engine's, or the learner's stand-in ones:
        parts.graphs builds them), not yet captured."""
        plan = self.plan
        return self.parts.graphs(self.eager_forward, kind, plan.max_num_seqs, plan.max_blocks_per_seq,
                                 plan.hf_config.hidden_size, self.block_size, self.dtype, self.device)

    # ------------------------------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute(self, inp: ModelInput, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """The forward of one step, then the logits of its sampled rows [num_sampled, vocab] fp32, followed by
        its prompt-logprob rows' (gathered on rank 0; None on the other ranks, and when there are no rows).
        `prev_tokens`: the tokens the step before sampled (rank 0), which pending input ids refer to."""
        inp = inp.to(self.device, non_blocking=True)
        if inp.prev_sampled:
            inp = self.with_sampled_ids(inp, prev_tokens)
        hidden = self.forward(inp)  # [num_tokens, hidden]
        rows = inp.logits_rows  # [num_sampled (+ prompt rows)]
        if not rows.shape[0]:
            return None
        return self.model.compute_logits(hidden[rows])  # [num_sampled (+ prompt rows), vocab]

    def with_sampled_ids(self, inp: ModelInput, prev_tokens: torch.Tensor | None) -> ModelInput:
        """The step with its pending input ids read from the step before's tokens (engine/pending.py). Under
        tensor parallelism rank 0 alone has them: an all-reduce of them and the other ranks' zeros hands them
        to every rank."""
        if self.tp.rank != 0:
            prev_tokens = torch.zeros(inp.prev_sampled, dtype=torch.int64, device=self.device)
        elif prev_tokens is None or prev_tokens.shape[0] != inp.prev_sampled:
            raise RuntimeError(f"the step reads {inp.prev_sampled} tokens of the step before, but the "
                               f"executor holds {None if prev_tokens is None else prev_tokens.shape[0]}: "
                               "steps must run in the order they were built")
        elif self.tp.size > 1:
            prev_tokens = prev_tokens.clone()  # the all-reduce sums in place
        prev_tokens = self.tp.all_reduce(prev_tokens)  # [prev_sampled]
        return dataclasses.replace(inp, input_ids=pending.read_pending_ids(inp.input_ids, prev_tokens))

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> torch.Tensor:
        """Hidden states [num_tokens, hidden]: through the decode path (graph replay, or one C++ call) for a
        decode step it takes, else eagerly."""
        takes, run = self.decode_path
        return run(inp) if takes(inp) else self.eager_forward(inp)

    def eager_forward(self, inp: ModelInput) -> torch.Tensor:
        """Prepare the step's attention once (the backend's `prepare`), then run the model: hidden states
        [num_tokens, hidden] (what a graph captures)."""
        inp.attn.prepared = self.attn_backend.prepare(inp.attn, self.kv_cache_shape)
        return self.model(inp.input_ids, inp.positions, inp.attn)
