"""The engine's own chapter 05 pieces standing in for a learner's stubs, so that an engine of one's own (5.6,
chapter 11) can be written and run before every piece is done. Chapters 05 and 11.

- `stand_ins(engine_class)`: while 5.6's checks run, the engine's own 5.2 (`Scheduler.pick`), 5.3 (the
  layout) and 5.5 (filters and an exact draw) replace each that is still the untouched stub;
- `your_pieces()`: chapter 11's engine gets the learner's `schedule`, `build_inputs`, `sample` and `FlatBatch`
  the same way, with `stood_in` naming the ones the engine's own replaced (5.0, 5.1 and 5.4 too).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from nanoengine.engine.scheduler import Scheduler


def _admit(bm: Any, waiting: list, budget: int) -> list:
    """The engine's admission (`Scheduler.admit`, first come, first served), standing in for a stub 5.0."""
    sched = Scheduler(bm, set(), max_num_batched_tokens=budget, max_num_seqs=len(waiting) + 1,
                      max_model_len=bm.num_blocks * bm.block_size)
    admitted = []
    for seq in waiting:
        n = sched.admit(seq, budget) if budget > 0 else None
        if n is None:
            break
        admitted.append((seq, n))
        budget -= n
    return admitted


def engine_layout(scheduled: list, block_size: int, builder: Any = None) -> dict[str, list]:
    """The engine's layout of a step (engine/inputs.py's InputBuilder; `builder`: one kept across steps) as
    the fields of chapter 05's FlatBatch, its sampled rows in row order (the engine hands them over in
    scheduled order)."""
    from nanoengine.engine.inputs import InputBuilder

    inp, sample_seqs = (builder or InputBuilder(block_size)).build(scheduled)[:2]
    sampled = sorted(zip(inp.sample_rows.tolist(), [s.seq_id for s in sample_seqs]))
    a = inp.attn
    tables, lens = a.decode_block_tables, a.decode_context_lens  # (None without decodes)
    return {"input_ids": inp.input_ids.tolist(), "positions": inp.positions.tolist(),
            "slot_mapping": a.slot_mapping.tolist(),
            "decode_block_tables": [] if tables is None else tables.tolist(),
            "decode_context_lens": [] if lens is None else lens.tolist(),
            "prefill_query_starts": list(a.prefill_query_starts),
            "prefill_query_lens": list(a.prefill_query_lens),
            "prefill_context_lens": list(a.prefill_context_lens),
            "sample_rows": [r for r, _ in sampled], "sample_seq_ids": [i for _, i in sampled]}


def _layout(module: Any, scheduled: list, block_size: int) -> Any:
    """The engine's layout of a step as your FlatBatch, standing in for a stub 5.3."""
    return module.FlatBatch(**engine_layout(scheduled, block_size))


def _draw(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
          min_ps: list[float], generators: list, shared_generator: torch.Generator) -> list[int]:
    """The engine's filters and an exact draw, standing in for a stub 5.5."""
    from nanoengine.layers.sampler import apply_top_k_top_p_min_p

    tokens = []
    for b in range(logits.shape[0]):
        if temperatures[b] == 0:
            tokens.append(int(logits[b].argmax()))
            continue
        row = apply_top_k_top_p_min_p(
            logits[b:b + 1] / temperatures[b], torch.tensor([top_ks[b]]) if top_ks[b] != -1 else None,
            torch.tensor([top_ps[b]]) if top_ps[b] < 1.0 else None,
            torch.tensor([min_ps[b]]) if min_ps[b] > 0 else None)  # [1, V]
        gen = generators[b] if generators[b] is not None else shared_generator
        tokens.append(int(torch.multinomial(torch.softmax(row[0], -1), 1, generator=gen)))
    return tokens


def _filters(logits: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
             min_ps: list[float]) -> torch.Tensor:
    """The engine's filter chain, standing in for a stub 5.4."""
    from nanoengine.layers.sampler import apply_top_k_top_p_min_p

    rows = []
    for b in range(logits.shape[0]):
        t = temperatures[b] or 1.0
        rows.append(apply_top_k_top_p_min_p(
            logits[b:b + 1] / t, torch.tensor([top_ks[b]]) if top_ks[b] != -1 else None,
            torch.tensor([top_ps[b]]) if top_ps[b] < 1.0 else None,
            torch.tensor([min_ps[b]]) if min_ps[b] > 0 else None)[0])
    return torch.stack(rows)  # [B, V]


def your_pieces(folder: Any = None) -> SimpleNamespace:
    """Your chapter 05 pieces for an engine of your own (chapter 11): `schedule`, `build_inputs`, `sample`
    and `FlatBatch` from your ch05 file (exercises/, or what NANOENGINE_IMPL names), the engine's own in
    place of each one still a stub (5.0, 5.1 and 5.4 too, which 5.2 and 5.5 call); `stood_in` lists those."""
    from nanoengine.pieces import folder_of
    from nanoengine.pieces.learner import is_stub, load
    from nanoengine.pieces.schedule_checks import engine_preempt

    module = load("ch05", folder_of(folder))
    stood_in = []
    for name, number, fn in (("admit_prompts", "5.0", _admit), ("preempt_until_fits", "5.1", engine_preempt),
                             ("process_logits", "5.4", _filters)):
        if is_stub(getattr(module, name)):
            setattr(module, name, fn)
            stood_in.append(number)
    pieces = SimpleNamespace(FlatBatch=module.FlatBatch, stood_in=stood_in)
    for name, number, fn in (("schedule", "5.2", Scheduler.pick),
                             ("build_inputs", "5.3", functools.partial(_layout, module)),
                             ("sample", "5.5", _draw)):
        own = getattr(module, name)
        if is_stub(own):
            own = fn
            stood_in.append(number)
        setattr(pieces, name, own)
    stood_in.sort()
    return pieces


@contextmanager
def stand_ins(engine_class: type) -> Iterator[list[str]]:
    """While the check runs, the engine's own piece replaces each of 5.2, 5.3 and 5.5 that is still the
    untouched stub in the module `engine_class` comes from; yields the exercises stood in for."""
    from nanoengine.pieces.learner import is_stub

    module = sys.modules.get(engine_class.__module__)
    swaps = {"schedule": ("5.2", Scheduler.pick), "build_inputs": ("5.3", functools.partial(_layout, module)),
             "sample": ("5.5", _draw)}
    saved = {}
    for name, (_, fn) in swaps.items():
        own = getattr(module, name, None)
        if own is not None and is_stub(own):
            saved[name] = own
            setattr(module, name, fn)
    try:
        yield [swaps[name][0] for name in saved]
    finally:
        for name, own in saved.items():
            setattr(module, name, own)
