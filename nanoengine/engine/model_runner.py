"""ModelRunner: owns the model, the paged KV cache and the sampler; turns one step's ModelInput into next
tokens. Chapter 03.

Building: the model class from config.json's `architectures`, with the attention backend and the compiled
kernels the config chose (`nanoengine.kernels.for_config`: the C++ CPU kernels, or torch.compile'd ops), then
the weights, then the KV cache sized from memory, then the decode graphs (chapter 06, `engine/graphs.py`).
On CUDA the KV cache gets what is left of `gpu_memory_utilization` after a warm-up forward at the largest
batch (weights + peak activations) and the graphs' memory (measured by capturing the largest bucket once).
One step (`run`): a decode-only step that fits a graph bucket replays its graph; any other step plans the
attention once and runs the model eagerly; logits are computed only for the sampled rows (sequences that reach
their last token), and the sampler draws a token for each. The inputs come from `engine/inputs.py`.

Under tensor parallelism (chapter 07) there is one ModelRunner per rank, each with its shard of the model
and of the KV cache (its own KV heads). Rank 0's runner starts the others (`distributed.Workers`) and sends
each step to them; every rank then runs `execute` in lockstep, and rank 0 alone samples. Each rank captures
and replays its own graphs (its collectives inside them), deciding graph or eager from the same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanoengine import kernels
from nanoengine.attention import AttentionMetadata, get_backend
from nanoengine.config import EngineConfig
from nanoengine.distributed.group import TPGroup
from nanoengine.distributed.workers import Workers, call_on
from nanoengine.engine.graphs import DecodeGraphs
from nanoengine.engine.inputs import ModelInput
from nanoengine.engine.sequence import Sequence
from nanoengine.errors import InvalidValueError
from nanoengine.layers.linear import prepack_weights, use_bf16_weights
from nanoengine.layers.sampler import Sampler, SamplingBatch
from nanoengine.models import get_model_class, hf_config
from nanoengine.models.fused_decode import FusedDecode
from nanoengine.models.loader import load_model
from nanoengine.pieces import Pieces

CPU_KV_CACHE_GB = 2.0  # default KV pool on CPU when neither num_kvcache_blocks nor kv_cache_memory_gb is set
# Batches of up to this many rows multiply bf16 weight copies with the C++ kernel (see bf16_weight_rows). On an
# AVX2 EPYC (1 thread) the kernel beat the float32 matmul at 1..32 rows on matrices streamed from memory (the
# LM head: 1.5x at 1 row, 2.6x at 4-32), and matched it on small cache-resident ones at 16-32 rows
BF16_WEIGHT_MAX_ROWS = 32


def bf16_weight_rows(config: EngineConfig) -> int:
    """Rows up to which linears use bf16 weight copies (`layers.linear.use_bf16_weights`), 0 for never: on CPU
    with the C++ kernels, for a bf16 checkpoint run in float32 (the copy is exact), or in bf16 where oneDNN
    has no bf16 path (prepack_weights is off: an AVX2-only CPU)."""
    if config.device != "cpu" or config.attention_backend != "cpu":
        return 0
    stored = hf_config.checkpoint_dtype(config.hf_config)
    if config.dtype == "float32" and stored == torch.bfloat16:
        return BF16_WEIGHT_MAX_ROWS
    if config.dtype == "bfloat16" and not config.prepack_weights:
        return BF16_WEIGHT_MAX_ROWS
    return 0


def zeros_lazily(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose CPU pages are only touched when used (calloc through numpy): a 2 GiB KV pool
    costs milliseconds instead of seconds to allocate. Zeros matter: masked attention multiplies unused
    slots by 0, and 0 * NaN from uninitialized memory would be NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.empty((), dtype=dtype).element_size()
    for n in shape:
        nbytes *= n
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, rank: int = 0) -> None:
        self.config = config
        hf = config.hf_config
        # the learner's pieces (use_exercises, nanoengine.pieces) replace the engine's through the same seams
        self.pieces = Pieces.for_config(config)
        self.tp = TPGroup(rank, config.tensor_parallel_size)
        if self.pieces is not None:
            self.tp = self.pieces.tp_group(self.tp)
        self.device = torch.device(config.device, rank) if config.device == "cuda" else torch.device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.attn_backend = get_backend(config.attention_backend)
        if self.pieces is not None:
            self.attn_backend = self.pieces.attention_backend(self.attn_backend)
        # rank 0 of a tensor-parallel engine starts the other ranks; they build their runners meanwhile
        self.workers = Workers(config, model_path) if rank == 0 and self.tp.size > 1 else None
        with self.lockstep():
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                with torch.device(self.device):
                    model_kernels = kernels.for_config(config)
                    if self.pieces is not None:
                        model_kernels = self.pieces.kernels(model_kernels, hf)
                    self.model = get_model_class(hf)(hf, self.attn_backend, model_kernels, self.tp)
            finally:
                torch.set_default_dtype(default_dtype)
            load_model(self.model, model_path)
            self.model.eval()
            if config.prepack_weights:
                prepack_weights(self.model)
            if rows := bf16_weight_rows(config):
                from nanoengine.kernels import cpu as cpu_kernels

                use_bf16_weights(self.model, cpu_kernels.load(), rows)
            self.num_layers = hf.num_hidden_layers
            self.num_kv_heads = hf_config.num_kv_heads(hf) // self.tp.size  # this rank's KV heads
            self.head_dim = hf_config.head_dim(hf)
            self.graphs: DecodeGraphs | None = None
            self.graph_memory_bytes = 0  # the graph pool, measured before sizing the KV cache (CUDA)
            self.num_blocks = self.allocate_kv_cache()
            if config.decode_graphs:
                self.graphs = self.make_graphs()
                self.graphs.capture()
        self.sampler = Sampler(config.seed, compile=config.torch_compile)
        if self.pieces is not None:
            self.sampler = self.pieces.sampler(self.sampler, config.seed)
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> its own generator (seeded requests)

    def lockstep(self):
        """Context of code every rank runs together: a failure in it on any rank stops the workers and
        raises here, with the failed worker's traceback (a no-op without workers)."""
        return self.workers.lockstep() if self.workers is not None else nullcontext()

    def call(self, method: str | Callable, *args: Any) -> Any:
        """Run a ModelRunner method (or fn(runner, *args)) on every rank; return rank 0's result."""
        with self.lockstep():
            if self.workers is not None:
                self.workers.send(method, args)
            return call_on(self, method, args)

    def collective_rpc(self, method: str | Callable, *args: Any) -> list[Any]:
        """Run a method (or fn(runner, *args)) on every rank and return every rank's result, rank 0 first."""
        with self.lockstep():
            if self.workers is None:
                return [call_on(self, method, args)]
            self.workers.send(method, args, reply=True)
            mine = call_on(self, method, args)
            return [mine, *self.workers.replies()]

    def close(self) -> None:
        """Stop the worker processes (tensor parallelism); the runner cannot step afterwards."""
        if self.workers is not None:
            self.workers.close()

    # ------------------------------------------------------------------------------------------ KV cache
    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block on this rank (its share of the KV heads)."""
        per_token = hf_config.kv_bytes_per_token(self.config.hf_config, self.dtype.itemsize) // self.tp.size
        return self.block_size * per_token

    def allocate_kv_cache(self) -> int:
        cfg = self.config
        if cfg.num_kvcache_blocks is not None:
            num_blocks = cfg.num_kvcache_blocks
        else:
            if cfg.kv_cache_memory_gb is not None:
                budget = cfg.kv_cache_memory_gb * 2**30
            elif self.device.type == "cuda":
                budget = self.cuda_kv_budget()
            else:
                budget = CPU_KV_CACHE_GB * 2**30 / self.tp.size  # the ranks share the host's memory
            num_blocks = int(budget // self.bytes_per_block)
            # never more than every sequence at full length could use
            most = cfg.max_num_seqs * -(-cfg.max_model_len // self.block_size)  # ceil(max_model_len / bs)
            num_blocks = min(num_blocks, most)
            if num_blocks < 1:
                raise InvalidValueError(f"no memory left for the KV cache ({budget / 2**30:.2f} GiB); lower "
                                 f"gpu_memory_utilization's reservation or set kv_cache_memory_gb")
            if self.tp.size > 1:  # every rank must hold the same blocks: the smallest pool wins
                num_blocks = int(self.tp.all_reduce_min(torch.tensor([num_blocks], device=self.device)).item())
        self.bind_kv_cache(num_blocks)
        return num_blocks

    def bind_kv_cache(self, num_blocks: int) -> None:
        layer_shape = self.attn_backend.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache_shape = layer_shape  # one layer's K (or V) cache, in the backend's layout
        self.kv_cache = zeros_lazily((2, self.num_layers, *layer_shape), self.dtype, self.device)
        self.model.bind_kv_cache(self.kv_cache)
        # decode steps in one C++ call (CPU): built on the caches just bound
        self.fused = FusedDecode(self.model, kernels.for_config(self.config)) if self.config.fused_decode else None

    def cuda_kv_budget(self) -> float:
        """Bytes the KV cache may take on CUDA: gpu_memory_utilization of the GPU, less what is not torch's
        (CUDA context, NCCL, other processes), the weights and peak activations of a warm-up forward at the
        largest batch, and the graphs' pool."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self.warm_up()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)  # weights + the warm-up's activations
        free, total = torch.cuda.mem_get_info(dev)
        not_torch = total - free - torch.cuda.memory_reserved(dev)
        if self.config.decode_graphs == "cuda":
            self.graph_memory_bytes = self.measure_graph_memory()
        return self.config.gpu_memory_utilization * total - not_torch - peak - self.graph_memory_bytes

    def warm_up(self) -> None:
        """One forward of max_num_batched_tokens prompt tokens (chunks of at most max_model_len, no KV cache
        bound yet, so attention runs over the new tokens only) and the logits of max_num_seqs rows: the
        largest activations a step can have."""
        cfg = self.config
        total, most = cfg.max_num_batched_tokens, cfg.max_model_len
        lens = [most] * (total // most) + ([total % most] if total % most else [])
        starts = [sum(lens[:i]) for i in range(len(lens))]
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=dev),
                                 num_decode_seqs=0, decode_block_tables=None, decode_context_lens=None,
                                 prefill_query_starts=starts, prefill_query_lens=lens, prefill_context_lens=lens,
                                 prefill_block_tables=[torch.zeros(0, dtype=torch.int64, device=dev)] * len(lens),
                                 block_size=self.block_size)
        ids = torch.zeros(total, dtype=torch.int64, device=dev)  # [total]
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])  # [total]
        rows = [i % total for i in range(cfg.max_num_seqs)]
        self.execute(ModelInput(ids, positions, meta, [], []), rows)

    def measure_graph_memory(self) -> int:
        """Bytes the graphs' pool takes: the largest bucket captured once over a one-block KV cache (the
        smaller buckets reuse its pool), then released."""
        dev = self.device
        self.bind_kv_cache(1)
        before = torch.cuda.memory_reserved(dev)
        graphs = self.make_graphs()
        graphs.capture(graphs.buckets[-1:])
        torch.cuda.synchronize(dev)
        used = torch.cuda.memory_reserved(dev) - before
        del graphs  # its graph and pool go; the real KV cache replaces the one-block one
        torch.cuda.empty_cache()
        return used

    def make_graphs(self) -> DecodeGraphs:
        cfg = self.config
        max_blocks = -(-cfg.max_model_len // self.block_size)
        if self.pieces is not None:  # the learner's stand-in graphs (chapter 06), when use_exercises says so
            return self.pieces.graphs(lambda: self.engine_graphs(max_blocks), self.eager_forward, cfg.max_num_seqs,
                                      max_blocks, cfg.hf_config.hidden_size, self.block_size, self.dtype)
        return self.engine_graphs(max_blocks)

    def engine_graphs(self, max_blocks: int) -> DecodeGraphs:
        cfg = self.config
        return DecodeGraphs(self.eager_forward, cfg.decode_graphs, cfg.max_num_seqs, max_blocks,
                            cfg.hf_config.hidden_size, self.block_size, self.dtype, self.device)

    # ------------------------------------------------------------------------------------------ one step
    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> torch.Tensor:
        """Hidden states [num_tokens, hidden]: by graph replay for a decode step that fits a bucket, in one C++
        call for a decode step on CPU (FusedDecode), else eagerly."""
        if self.graphs is not None and self.graphs.can_replay(inp):
            return self.graphs.replay(inp)
        if self.fused is not None and self.fused.can_run(inp):
            return self.fused(inp)
        return self.eager_forward(inp)

    def eager_forward(self, inp: ModelInput) -> torch.Tensor:
        """Plan the step's attention once, then run the model: hidden states [num_tokens, hidden] (what a
        graph captures)."""
        inp.attn.plan = self.attn_backend.plan(inp.attn, self.kv_cache_shape)
        return self.model(inp.input_ids, inp.positions, inp.attn)

    @torch.inference_mode()
    def execute(self, inp: ModelInput, rows: list[int]) -> torch.Tensor | None:
        """The part of a step every rank runs: the forward, then the logits of `rows` [len(rows), vocab] fp32
        (gathered on rank 0; None on the other ranks, and when no row is asked for)."""
        hidden = self.forward(inp)  # [num_tokens, hidden]
        return self.model.compute_logits(hidden[rows]) if rows else None

    @torch.inference_mode()
    def run(self, inp: ModelInput) -> list[tuple[Sequence, int]]:
        """Run one step; return (sequence, next token) for every sequence that reached its last token."""
        # the workers get what every rank needs; the sequences stay here
        step = inp if self.workers is None else dataclasses.replace(inp, sample_seqs=[])
        logits = self.call("execute", step, inp.sample_rows)  # [num_sampled, vocab] fp32
        if logits is None:
            return []
        tokens = self.sampler(logits, self.sampling_batch(inp.sample_seqs)).tolist()
        return list(zip(inp.sample_seqs, tokens))

    def prompt_logits(self, inp: ModelInput) -> torch.Tensor:
        """Logits of every row of a prefill [num_tokens, vocab] fp32 (the book's check against transformers)."""
        return self.call("execute", inp, list(range(inp.num_tokens)))

    def sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        params = [s.sampling_params for s in seqs]
        gens = []
        for s, p in zip(seqs, params):
            if p.seed is not None and not p.greedy:
                if s.seq_id not in self.generators:
                    self.generators[s.seq_id] = torch.Generator().manual_seed(p.seed + s.index)
                gens.append(self.generators[s.seq_id])
            else:
                gens.append(None)
        vocab = self.config.hf_config.vocab_size
        any_k = any(p.top_k > 0 for p in params)
        any_p = any(p.top_p < 1.0 for p in params)
        any_min_p = any(p.min_p > 0.0 for p in params)
        dev = self.device
        return SamplingBatch(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            top_ks=torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev) if any_k else None,
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev) if any_p else None,
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev) if any_min_p else None,
            generators=gens, all_greedy=all(p.greedy for p in params),
        )

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence's sampling state."""
        self.generators.pop(seq.seq_id, None)
