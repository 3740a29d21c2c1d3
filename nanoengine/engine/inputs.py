"""InputBuilder: flattening a scheduled batch into the model's inputs. Chapters 03 and 05.

The model takes one flat batch of new tokens from many sequences. `InputBuilder.build(scheduled)` lays it
out in two passes, named as in nano-vllm (each new token's cache slot by one rule, `slot`), and writes it
(`write`, with its `layout`'s attention metadata):
- decodes (`lay_out_decodes`), first: their rows are 0..num_decodes-1. A sequence verifying k drafts
  (speculative decoding, chapter 09) is 1 + k decode rows, its last token and its drafts at positions p..p+k,
  each attending up to its own position (every row's K/V is stored before any row attends), so the step
  stays decode-only: the fused CPU step and CUDA graphs run it;
- prefill chunks (`lay_out_prefills`): then every prompt chunk, with its query start, length and context.
The sampled rows are one per sequence that reaches its last token (1 + k for a verifying one), in the order
the sequences were scheduled (`SchedulerOutput.sampled`: its update reads the tokens in that order); a
sequence whose prompt rows are scored (`Sequence.scored_until`: prompt logprobs) also gets those rows, each
scoring the next prompt token, their logits after the sampled rows'. A decode whose input is still pending
gets a reference to the step before's row instead of an id (engine/pending.py).

Plain Python and numpy over Sequences, written into reusable host buffers (engine/host_buffers.py) and copied
to the device on a side stream (`to_device`). A decode-only `ModelInput` is all fixed-width tensors (ids,
positions, slots, context lengths [B]; block tables [B, W]), which a CUDA-graph runner copies into its padded
static buffers as they are. No model: it is tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from nanoengine.attention import AttentionMetadata
from nanoengine.engine import pending
from nanoengine.engine.host_buffers import HostBuffers
from nanoengine.engine.sequence import Sequence


def no_rows() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass
class ModelInput:
    """One step's inputs to the model, on every rank: tensors and plain numbers only."""
    input_ids: torch.Tensor  # [num_tokens] int64, decodes first, then prefill chunks
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    sample_rows: torch.Tensor = field(default_factory=no_rows)  # [num_sampled] int64, in scheduled order
    prev_sampled: int = 0  # > 0: tokens the step before sampled, which some input ids refer to (pending.py)
    scored_rows: torch.Tensor = field(default_factory=no_rows)  # [P] int64: scored prompt rows
    # the same step in host memory, when these tensors are device copies of it (`to`): what tensor parallelism
    # sends the other ranks, so that rank 0 never copies device tensors back (that would wait for the step in
    # flight). Not an init field: a `dataclasses.replace`d input (other tensors) has none, and is sent as is
    host: ModelInput | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_sampled(self) -> int:
        return self.sample_rows.shape[0]

    @property
    def num_scored_rows(self) -> int:
        return self.scored_rows.shape[0]

    @property
    def logits_rows(self) -> torch.Tensor:
        """The rows whose logits the step computes: the sampled rows, then the scored prompt rows."""
        return torch.cat([self.sample_rows, self.scored_rows]) if self.num_scored_rows else self.sample_rows

    @property
    def is_decode_only(self) -> bool:
        """Every row is one sequence's single new token (the steps a CUDA graph replays)."""
        return self.attn.num_decode_seqs == self.num_tokens

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ModelInput:
        """The same step with its tensors on `device` (itself when they are there already); moved off the
        host, it keeps the host input as its `host`."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        moved = ModelInput(self.input_ids.to(device, non_blocking=non_blocking),
                           self.positions.to(device, non_blocking=non_blocking),
                           self.attn.to(device, non_blocking),
                           self.sample_rows.to(device, non_blocking=non_blocking), self.prev_sampled,
                           self.scored_rows.to(device, non_blocking=non_blocking))
        moved.host = self if self.input_ids.device.type == "cpu" else self.host
        return moved

    def host_side(self) -> ModelInput:
        """This step in host memory: its `host` input, or itself (already on the host, or none kept)."""
        return self if self.host is None else self.host


class PromptRows(NamedTuple):
    """A sequence's scored prompt rows in one step: the prompt tokens first..first+count-1, each predicted at
    the row of the token before it (Sequence.scored_until: SamplingParams.prompt_logprobs)."""
    seq: Sequence
    first: int
    count: int


class BuiltStep(NamedTuple):
    """What `build` returns: the ModelInput every rank needs, and what stays with the driver."""
    inputs: ModelInput
    sample_seqs: list[Sequence]  # the sequence of each sampled row (for the sampler and the scheduler)
    prompt_rows: list[PromptRows] = []  # the scored prompt rows (ModelInput.scored_rows), by sequence
    prompt_targets: list[int] = []  # and the prompt token each of those rows predicts


def slot(seq: Sequence, pos: int, block_size: int) -> int:
    """Where the K/V of `seq`'s position `pos` is written: its block's first slot plus the offset in the
    block; -1 where a prefix-cache block already holds it (not written again)."""
    if pos < seq.num_cached_tokens:
        return -1
    return seq.block_table[pos // block_size] * block_size + pos % block_size


@dataclass(slots=True)
class Rows:
    """One step's rows as the builder lays them out: decode rows first, then the prefill chunks."""
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits are sampled
    sample_seqs: list[Sequence] = field(default_factory=list)  # and the sequence of each
    row_seqs: list[Sequence] = field(default_factory=list)  # each decode row's sequence
    table_lens: list[int] = field(default_factory=list)  # and its block-table length
    prev_sampled: int = 0  # > 0: some decode's input is a token of the step before (which sampled this many)
    starts: list[int] = field(default_factory=list)  # each prefill chunk's first row, length and context
    qlens: list[int] = field(default_factory=list)
    ctxs: list[int] = field(default_factory=list)
    scored_rows: list[int] = field(default_factory=list)  # prompt rows whose logits a sequence has scored
    prompt_rows: list[PromptRows] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)  # the prompt token each of those rows predicts

    def add_prompt_rows(self, seq: Sequence, row: int, first: int, count: int) -> None:
        """`count` scored prompt rows from `row`, predicting seq's prompt tokens first..first+count-1."""
        self.scored_rows += range(row, row + count)
        self.prompt_rows.append(PromptRows(seq, first, count))
        self.targets += seq.token_ids[first:first + count]


class AttentionLayout(Protocol):
    """How a step's attention metadata is laid out (a declared hook): the engine's own (`PAGED`, below), or
    the learner's exercises 3.1 and 3.2 (nanoengine/pieces/ch03.py), chosen in `assemble()`."""

    verify_as_decodes: bool  # a decode verifying k drafts is 1 + k decode rows (else one prefill chunk)

    def metadata(self, builder: InputBuilder, rows: Rows, decodes: list[Any], prefills: list[Any]
                 ) -> AttentionMetadata:
        """The step's metadata, its decode rows first (`rows`, laid out by `builder`, whose host buffers
        are this step's)."""


class PagedLayout:
    """The engine's own attention metadata (chapter 03): the slot of every new token, the decode rows' block
    tables padded into one [num_decode_rows, max_blocks] array with their context lengths, and each prefill
    chunk's block table, written into the step's host buffers."""

    verify_as_decodes = True

    def metadata(self, builder: InputBuilder, rows: Rows, decodes: list[Any], prefills: list[Any]
                 ) -> AttentionMetadata:
        host, n, nd = builder.host, len(rows.ids), len(rows.row_seqs)
        host.slots[:n] = rows.slots
        if decodes:
            dtables = host.decode_tables_t[:nd, :builder.decode_block_tables(rows.row_seqs, rows.table_lens)]
            host.context_lens[:nd] = [p + 1 for p in rows.positions[:nd]]  # each row's context, its token too
            dctx = host.context_lens_t[:nd]
        else:
            dtables = dctx = None
        ptables = []
        for i, s in enumerate(prefills):
            table = s.seq.block_table
            host.prefill_tables[i, :len(table)] = table
            ptables.append(host.prefill_tables_t[i, :len(table)])
        return AttentionMetadata(
            slot_mapping=host.slots_t[:n], num_decode_seqs=nd, decode_block_tables=dtables,
            decode_context_lens=dctx, prefill_query_starts=rows.starts, prefill_query_lens=rows.qlens,
            prefill_context_lens=rows.ctxs, prefill_block_tables=ptables, block_size=builder.block_size)


PAGED = PagedLayout()


class InputBuilder:
    def __init__(self, block_size: int, device: torch.device | str = "cpu", layout: AttentionLayout = PAGED,
                 max_tokens: int = 256, max_seqs: int = 16, max_blocks: int = 16) -> None:
        """`layout`: how the attention metadata is laid out (AttentionLayout). The max_* size the host buffers
        up front (the engine passes its limits), which grow if a step needs more."""
        self.block_size = block_size
        self.device = torch.device(device)
        self.layout = layout
        on_cuda = self.device.type == "cuda"
        self.sets = [HostBuffers(max_tokens, max_seqs, max_blocks, pin=on_cuda) for _ in range(2)]
        self.turn = 0  # the set the next step is built in
        self.host = self.sets[0]
        self.copy_stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.last_sample_seqs: list[Sequence] = []  # the last built step's sampled rows (its tokens: pending)

    def build(self, scheduled: list[Any]) -> BuiltStep:
        """The flat inputs of a batch of ScheduledSeq (seq, num_new_tokens; any order): its decode rows, then
        its prefill chunks, written into this step's host buffers."""
        rows_ok = self.layout.verify_as_decodes
        decodes = [s for s in scheduled if s.num_new_tokens == 1 or (rows_ok and verifies(s))]
        prefills = [s for s in scheduled if s.num_new_tokens > 1 and not (rows_ok and verifies(s))]
        rows = Rows()
        self.lay_out_decodes(decodes, rows)
        self.lay_out_prefills(prefills, rows)
        if decodes and prefills:  # sampled rows in scheduled order
            where = {s.seq.seq_id: i for i, s in enumerate(scheduled)}
            order = sorted(range(len(rows.sample_seqs)), key=lambda r: where[rows.sample_seqs[r].seq_id])
            rows.sample_rows = [rows.sample_rows[r] for r in order]
            rows.sample_seqs = [rows.sample_seqs[r] for r in order]
        return self.write(rows, decodes, prefills, len(scheduled))

    def lay_out_decodes(self, decodes: list[Any], rows: Rows) -> None:
        """Decode rows: one per sequence with one new token, 1 + k (all sampled) for one verifying k drafts.
        This loop runs for every sequence of every step, so it is written out flat."""
        block_size, prev_rows = self.block_size, None  # (seq_id -> its row in the step before's tokens)
        ids, positions, slots, table_lens, row_seqs = (rows.ids, rows.positions, rows.slots, rows.table_lens,
                                                       rows.row_seqs)
        sample_rows, sample_seqs = rows.sample_rows, rows.sample_seqs
        for s in decodes:
            seq = s.seq
            pos = s.start
            token_ids = seq.token_ids
            known = len(token_ids)
            if s.num_new_tokens == 1:
                if pos < known:
                    ids.append(token_ids[pos])
                else:  # its input is the token the step in flight samples for it
                    if prev_rows is None:
                        prev_rows = {x.seq_id: row for row, x in enumerate(self.last_sample_seqs)}
                        rows.prev_sampled = len(self.last_sample_seqs)
                    ids.append(pending.input_id(prev_rows[seq.seq_id]))
                positions.append(pos)
                slots.append(slot(seq, pos, block_size))
                table_lens.append(len(seq.block_table))
                row_seqs.append(seq)
                if pos + 1 >= known:  # it reaches its end: its next token is sampled
                    sample_rows.append(len(ids) - 1)
                    sample_seqs.append(seq)
                elif pos < seq.scored_until:  # a 1-token prompt chunk whose row is scored
                    rows.add_prompt_rows(seq, len(ids) - 1, pos + 1, 1)
                continue
            for p, token in enumerate([token_ids[pos], *seq.spec_token_ids], pos):  # every row sampled
                ids.append(token)
                positions.append(p)
                slots.append(slot(seq, p, block_size))
                table_lens.append(len(seq.block_table))
                row_seqs.append(seq)
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)

    def lay_out_prefills(self, prefills: list[Any], rows: Rows) -> None:
        """Prefill chunks: positions start..start+n-1 of each sequence, after its cached prefix, with its
        query start, length and context (a chunk with drafts: its last token and its drafts)."""
        block_size, ids = self.block_size, rows.ids
        for s in prefills:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            first = len(ids)
            rows.starts.append(first)
            rows.qlens.append(n)
            rows.ctxs.append(start + n)
            known = len(seq.token_ids)
            chunk = seq.token_ids[start:start + n]
            if start + n > known:
                chunk += seq.spec_token_ids
            ids += chunk
            rows.positions += range(start, start + n)
            rows.slots += [slot(seq, pos, block_size) for pos in range(start, start + n)]
            last = min(start + n, seq.scored_until)  # its scored rows in this chunk: start..last-1
            if last > start:
                rows.add_prompt_rows(seq, first, start + 1, last - start)
            if start + n >= known:  # the chunk reaches the end: its last known token's row and the drafts'
                for pos in range(known - 1, start + n):
                    rows.sample_rows.append(first + pos - start)
                    rows.sample_seqs.append(seq)

    def write(self, rows: Rows, decodes: list[Any], prefills: list[Any], num_seqs: int) -> BuiltStep:
        """The laid-out rows into this step's host buffers, with the batch's attention metadata (the
        layout's), as a ModelInput on the device."""
        widest = max(max(rows.table_lens, default=0),  # block-table columns this step needs
                     max((len(s.seq.block_table) for s in prefills), default=0))
        # (a speculating sequence samples 1 + k rows)
        host = self.host_buffers(len(rows.ids), max(num_seqs, len(rows.sample_rows), len(rows.row_seqs)),
                                 widest)
        n, sample_rows = len(rows.ids), rows.sample_rows
        host.ids[:n] = rows.ids
        host.positions[:n] = rows.positions
        host.sample_rows[:len(sample_rows)] = sample_rows
        sampled = host.sample_rows_t[:len(sample_rows)]
        self.last_sample_seqs = rows.sample_seqs
        scored = torch.tensor(rows.scored_rows, dtype=torch.int64) if rows.scored_rows else no_rows()  # [P]
        meta = self.layout.metadata(self, rows, decodes, prefills)
        inp = ModelInput(host.ids_t[:n], host.positions_t[:n], meta, sampled, rows.prev_sampled, scored)
        return BuiltStep(self.to_device(inp), rows.sample_seqs, rows.prompt_rows, rows.targets)

    def host_buffers(self, tokens: int, seqs: int, blocks: int) -> HostBuffers:
        """This step's set of host buffers (the sets take turns), free to overwrite (the copies out of it are
        done) and large enough for this step."""
        host = self.sets[self.turn]
        if host.copied is not None and not host.copied.query():
            host.copied.synchronize()  # only if the device has not yet read that step's inputs
        if not host.fits(tokens, seqs, blocks):
            host = self.sets[self.turn] = host.grown(tokens, seqs, blocks)
        self.turn = 1 - self.turn
        self.host = host
        return host

    def to_device(self, inp: ModelInput) -> ModelInput:
        if self.copy_stream is None:
            return inp.to(self.device)
        step_stream = torch.cuda.current_stream(self.device)
        # (the copies read this set's host buffers, free since its event, into new device memory: they need
        # not wait for the step in flight, and run beside its forward)
        with torch.cuda.stream(self.copy_stream):
            inp = inp.to(self.device, non_blocking=True)
            self.host.copied.record()
        step_stream.wait_stream(self.copy_stream)  # the step reads them after the copies, without a host sync
        for t in tensors_of(inp):  # made on the copy stream, used on the step's: keep their memory till then
            t.record_stream(step_stream)
        return inp

    def decode_block_tables(self, seqs: list[Sequence], lens: list[int]) -> int:
        """Fill host.decode_tables[:num_rows] with the block tables of the decode rows' sequences (`lens`
        long), padded with 0; return the width (the longest table). Consecutive steps mostly decode the same
        sequences, and a table only grows (by one block every block_size tokens) until the block manager
        empties or cuts it (preemption, a rollback: counted in seq.num_table_resets), so the rows of the last
        step are kept and only those whose table grew are written."""
        host = self.host
        ids = [(seq.seq_id, seq.num_table_resets) for seq in seqs]
        buf = host.decode_tables
        if ids != host.decode_ids:  # another batch: start afresh
            rows, cols = host.dirty
            buf[:rows, :cols] = 0
            host.dirty = (0, 0)
            host.decode_ids, host.decode_lens = ids, [0] * len(ids)
        old = host.decode_lens
        for i, n in enumerate(lens):
            if n != old[i]:
                buf[i, old[i]:n] = seqs[i].block_table[old[i]:n]  # tables only ever grow at the end
                old[i] = n
        width = max(lens)
        host.dirty = (max(host.dirty[0], len(lens)), max(host.dirty[1], width))
        return width


def verifies(s: Any) -> bool:
    """A scheduled decode with drafts to verify (speculative decoding): its last token and its drafts."""
    return bool(s.seq.spec_token_ids) and s.num_new_tokens == 1 + len(s.seq.spec_token_ids)


def tensors_of(inp: ModelInput) -> list[torch.Tensor]:
    """Every tensor a ModelInput holds, its attention metadata's included."""
    found = [inp.input_ids, inp.positions, inp.sample_rows, inp.scored_rows]
    for value in vars(inp.attn).values():
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found

