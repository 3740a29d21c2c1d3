"""ModelRunner: owns the model, the paged KV cache and the sampler; turns a scheduled batch into next
tokens. Chapters 03 and 06.

One step: lay the batch out (decode sequences first, then prefill chunks), build the flat input ids,
positions, slot mapping and block tables, run the model, compute logits only for sequences that reach
their last token this step, and sample.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanoengine.attention import AttentionMetadata
from nanoengine.config import EngineConfig
from nanoengine.layers.linear import prepack_weights
from nanoengine.layers.sampler import Sampler, SamplingBatch
from nanoengine.models import get_model_class
from nanoengine.models.llama import head_dim_of
from nanoengine.models.loader import load_model

CPU_KV_CACHE_GB = 2.0  # default KV pool on CPU when neither num_kvcache_blocks nor kv_cache_memory_gb is set


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
    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        self.config = config
        hf = config.hf_config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = get_model_class(hf)(hf, config.attention_backend)
        finally:
            torch.set_default_dtype(default_dtype)
        load_model(self.model, model_path)
        self.model.eval()
        if config.prepack_weights:
            prepack_weights(self.model)
        if config.attention_backend == "cpu":  # the compiled CPU kernels also fuse norms, rotary, SwiGLU
            from nanoengine.attention.cpu_backend import use_cpu_kernels

            use_cpu_kernels(self.model)
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = hf.num_key_value_heads
        self.head_dim = head_dim_of(hf)
        self.num_blocks = self.allocate_kv_cache()
        self.sampler = Sampler(config.seed)
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> its own generator (seeded requests)
        self.last_prepare_s = 0.0  # host time spent in prepare() in the last run (the benchmark reports it)
        self.reset_decode_tables()

    # ------------------------------------------------------------------------------------------ KV cache
    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def allocate_kv_cache(self) -> int:
        cfg = self.config
        if cfg.num_kvcache_blocks is not None:
            num_blocks = cfg.num_kvcache_blocks
        else:
            if cfg.kv_cache_memory_gb is not None:
                budget = cfg.kv_cache_memory_gb * 2**30
            elif self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = free - (1 - cfg.gpu_memory_utilization) * total
            else:
                budget = CPU_KV_CACHE_GB * 2**30
            num_blocks = int(budget // self.bytes_per_block)
            # never more than every sequence at full length could use
            most = cfg.max_num_seqs * -(-cfg.max_model_len // self.block_size)
            num_blocks = min(num_blocks, most)
            if num_blocks < 1:
                raise ValueError(f"no memory left for the KV cache ({budget / 2**30:.2f} GiB); lower "
                                 f"gpu_memory_utilization's reservation or set kv_cache_memory_gb")
        attn = self.model.layers[0].self_attn.attn
        layer_shape = attn.kv_cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = zeros_lazily((2, self.num_layers, *layer_shape), self.dtype, self.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.attn.k_cache = self.kv_cache[0, i]  # the backend's layout, e.g. [kvh, blocks, bs, d]
            layer.self_attn.attn.v_cache = self.kv_cache[1, i]
        return num_blocks

    # ------------------------------------------------------------------------------------------ one step
    def prepare(self, scheduled: list[Any]):
        """Flat inputs for a batch of ScheduledSeq (any order); returns (input_ids, positions, meta,
        sample_rows, sample_seqs)."""
        bs = self.block_size
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs = []

        def add_tokens(seq, start: int, n: int) -> None:
            table = seq.block_table
            for pos in range(start, start + n):
                input_ids.append(seq.token_ids[pos])
                positions.append(pos)
                # a token whose K/V already sits in a shared prefix-cache block is not written again
                slots.append(-1 if pos < seq.num_cached_tokens else table[pos // bs] * bs + pos % bs)
            if start + n == seq.num_tokens:  # reaches the end: this sequence gets a new token
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)

        for s in decodes:  # add_tokens(seq, num_computed_tokens, 1), inlined: this loop runs for every sequence
            seq = s.seq
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(-1 if pos < seq.num_cached_tokens else seq.block_table[pos // bs] * bs + pos % bs)
            if pos + 1 == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        starts, qlens, ctxs, tables = [], [], [], []
        for s in prefills:
            seq, start = s.seq, s.seq.num_computed_tokens
            starts.append(len(input_ids))
            qlens.append(s.num_new_tokens)
            ctxs.append(start + s.num_new_tokens)
            tables.append(torch.tensor(seq.block_table, dtype=torch.int64, device=self.device))
            add_tokens(seq, start, s.num_new_tokens)
        dev = self.device
        if decodes:
            dtables = torch.from_numpy(self.decode_block_tables(decodes)).to(dev)
            dctx = torch.tensor([s.seq.num_computed_tokens + 1 for s in decodes], dtype=torch.int64, device=dev)
        else:
            dtables = dctx = None
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_seqs=len(decodes), decode_block_tables=dtables, decode_context_lens=dctx,
            prefill_query_starts=starts, prefill_query_lens=qlens, prefill_context_lens=ctxs,
            prefill_block_tables=tables, block_size=bs,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, sample_rows, sample_seqs

    def reset_decode_tables(self) -> None:
        self._decode_ids: list[tuple[int, int]] = []  # the last decode batch's sequences, their padded tables
        self._decode_lens: list[int] = []
        self._decode_tables = np.zeros((0, 0), dtype=np.int64)

    def decode_block_tables(self, decodes: list[Any]) -> np.ndarray:
        """Padded [num_decodes, max_blocks] block tables. Consecutive steps mostly decode the same sequences,
        and a table only grows (by one block every block_size tokens) until the block manager empties it
        (preemption, counted in seq.num_table_resets), so the array of the last step is kept and only the
        rows whose table grew are rewritten (at batch 256: 0.05 ms instead of 0.25 ms for a fresh
        numpy fill, or 1.9 ms for torch.tensor on nested lists)."""
        ids = [(s.seq.seq_id, s.seq.num_table_resets) for s in decodes]
        lens = [len(s.seq.block_table) for s in decodes]
        width = max(lens)
        buf = self._decode_tables
        if ids != self._decode_ids or width > buf.shape[1]:  # another batch: start afresh (with headroom)
            buf = self._decode_tables = np.zeros((len(decodes), width + 8), dtype=np.int64)
            self._decode_ids, self._decode_lens = ids, [0] * len(ids)
        old = self._decode_lens
        for i, n in enumerate(lens):
            if n != old[i]:
                buf[i, old[i]:n] = decodes[i].seq.block_table[old[i]:n]  # tables only ever grow at the end
                old[i] = n
        return buf[:, :width]

    def sampling_batch(self, seqs: list[Any]) -> SamplingBatch:
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

    @torch.inference_mode()
    def run(self, scheduled: list[Any]) -> dict[int, int]:
        """Run one batch; return {seq_id: next token} for sequences that reached their last token."""
        t0 = time.perf_counter()
        ids, pos, meta, rows, seqs = self.prepare(scheduled)
        self.last_prepare_s = time.perf_counter() - t0
        hidden = self.model(ids, pos, meta)  # [num_tokens, hidden]
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[rows])  # [num_sampled, vocab] fp32
        tokens = self.sampler(logits, self.sampling_batch(seqs)).tolist()
        return {seq.seq_id: tok for seq, tok in zip(seqs, tokens)}

    def release(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)
