"""Chapter 03's pieces in the engine: your batch slot mapping and attention metadata in the input builder,
and an attention backend whose K/V store, paged decode attention (your Triton kernel, 3.8, or your 3.6 where
triton is not installed) and paged prefill attention are yours.

The backend keeps the exercises' cache layout, blocks first: k_cache, v_cache [num_blocks, block_size,
num_kv_heads, head_dim] per layer (the engine's torch backend stores heads first; a backend declares its own
layout with `kv_cache_shape`, and the model runner allocates what it says). It prepares nothing per step:
your functions read the step's slot mapping, block tables and context lengths straight from the
AttentionMetadata that your 3.2 built. A prompt chunk with no cached prefix attends over its own tokens
(chapter 02's piece, or the engine's); every other query attends over your blocks. Decode runs your
Exercise 3.8 kernel through the file's `triton_paged_decode`: compiled on CUDA, in Triton's interpreter
without a GPU (the chapter file switches it on before defining the kernel), so a CPU run is slow but goes
through the same kernel. Where triton is not installed (macOS, Windows), decode runs your Exercise 3.6,
`online_decode_attention`, which takes the same arguments.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from nanoengine.attention import AttentionMetadata, AttentionPrep, TorchAttention
from nanoengine.errors import ExerciseError
from nanoengine.pieces.learner import check_result, piece


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_blocks, block_size, num_kv_heads, head_dim)


class LearnerLayout:
    """Your attention_metadata(scheduled, block_size) (with your batch_slot_mapping) as the input builder's
    layout, its result checked against the batch's shape. It sees a decode verifying drafts as one chunk."""

    verify_as_decodes = False

    def __init__(self, module: ModuleType) -> None:
        self.build = piece(module, "attention_metadata", "ch03")  # (it calls your batch_slot_mapping)

    def metadata(self, builder: Any, rows: Any, decodes: list, prefills: list) -> AttentionMetadata:
        scheduled = decodes + prefills
        meta = self.build(scheduled, builder.block_size)
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        check_result(isinstance(meta, AttentionMetadata), self.build,
                     f"a {type(meta).__name__}; it must return an AttentionMetadata")
        check_result(meta.slot_mapping.shape == (num_tokens,), self.build,
                     f"a slot_mapping of shape {tuple(meta.slot_mapping.shape)} for {num_tokens} new tokens")
        return meta


def has_triton(module: ModuleType) -> bool:
    """Could the chapter file import triton? (Without it, decode runs your 3.6.)"""
    return getattr(module, "triton", None) is not None


def check_kernel_can_run(module: ModuleType) -> None:
    """With triton installed, your 3.8 kernel runs here: without CUDA it was defined under Triton's
    interpreter; else an ExerciseError saying what to change."""
    if not has_triton(module):
        return  # decode runs your 3.6 (see decode_function)
    if not torch.cuda.is_available():
        from nanoengine.kernels.triton_support import is_interpreted

        if not is_interpreted(module.paged_decode_kernel):
            raise ExerciseError("use_exercises: there is no GPU, so your Exercise 3.8 kernel can only run in "
                                "Triton's interpreter, but TRITON_INTERPRET is set to something other than 1 "
                                f"({module.__file__} sets it to 1 only when it is unset): unset it or set "
                                "TRITON_INTERPRET=1 before building the LLM")
        if not is_interpreted(module.tl.zeros):
            raise ExerciseError("use_exercises: no GPU, so your Exercise 3.8 kernel runs in Triton's "
                                "interpreter, but triton was imported before TRITON_INTERPRET=1 was set (by "
                                "torch.compile, say), so triton.language is not interpreted: restart the "
                                "kernel (or process) and set TRITON_INTERPRET=1 before anything else")


def decode_function(module: ModuleType):
    """The decode attention the backend runs, (q, k_cache, v_cache, block_tables, context_lens, scale) ->
    [B, H, D]: your 3.8 kernel through triton_paged_decode, or your 3.6 without triton; and whether it walks
    the rows one by one (the interpreter, or 3.6's Python loop), so padding rows are better left out."""
    from nanoengine.kernels.triton_support import is_interpreted

    if not has_triton(module):
        return piece(module, "online_decode_attention", "ch03"), True
    check_kernel_can_run(module)
    return piece(module, "triton_paged_decode", "ch03"), is_interpreted(module.paged_decode_kernel)


def live_rows(context_lens: torch.Tensor) -> torch.Tensor | None:
    """The decode rows with a context [n] (a host read), or None when every row has one."""
    live = (context_lens > 0).nonzero().squeeze(1)
    return None if len(live) == len(context_lens) else live


def with_paged_kv(base: type[TorchAttention], module: ModuleType) -> type[TorchAttention]:
    """`base` with the blocks-first cache layout, your store_kv, your decode (3.8's Triton kernel through the
    file's triton_paged_decode, or 3.6 without triton: decode_function) and your paged_prefill_attention.

    In Triton's interpreter every program of the grid runs in turn in NumPy, milliseconds each (and 3.6 loops
    over the rows in Python), and a decode graph's capture (chapter 06's stand-in) runs batches of up to 256
    padding rows (context 0, whose output is 0 whatever the kernel): there decode runs on the rows with a
    context only, and the padding rows are zeros. Compiled (CUDA), the kernel gets every row, as the engine's
    kernels do."""
    store_kv = piece(module, "store_kv", "ch03")
    decode, interpreted = decode_function(module)
    prefill = piece(module, "paged_prefill_attention", "ch03")

    class LearnerPagedAttention(base):
        @staticmethod
        def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_dim: int) -> tuple[int, ...]:
            return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

        @classmethod
        def prepare(cls, meta: AttentionMetadata, kv_cache_shape: tuple[int, ...]) -> AttentionPrep:
            return AttentionPrep()  # your functions take the metadata as it is

        def store(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                  prep: AttentionPrep) -> None:
            store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)

        def decode(self, q: torch.Tensor, meta: AttentionMetadata, prep: AttentionPrep) -> torch.Tensor:
            # q [num_decode_seqs, num_heads, head_dim]
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            live = live_rows(lens) if interpreted else None
            if live is not None:  # padding rows (interpreter only): launch on the others
                out = torch.zeros_like(q)
                if len(live):
                    out[live] = self.decode_rows(q[live], tables[live], lens[live])
                return out
            return self.decode_rows(q, tables, lens)

        def decode_rows(self, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
            out = decode(q, self.k_cache, self.v_cache, tables, lens, self.scale)
            check_result(isinstance(out, torch.Tensor) and out.shape == q.shape, decode,
                         f"shape {tuple(getattr(out, 'shape', ()))} for q {tuple(q.shape)}; "
                         "it must return q's shape")
            return out.to(q.dtype)

        def prefix_attention(self, q: torch.Tensor, block_table: torch.Tensor,
                             context_len: int) -> torch.Tensor:
            out = prefill(q, self.k_cache, self.v_cache, block_table, context_len, self.scale)
            check_result(isinstance(out, torch.Tensor) and out.shape == q.shape, prefill,
                         f"shape {tuple(getattr(out, 'shape', ()))} for q {tuple(q.shape)}; "
                         "it must return q's shape")
            return out.to(q.dtype)

    return LearnerPagedAttention
