"""What each of two real ranks computes for chapter 07's collective exercises (7.5-7.7), run by
test_ch07_tensor_parallelism.py through nanoengine.distributed.spawn.run_on_ranks: the learner's functions and
classic wrong answers (planted, so that the tests can show they catch them), on the same seeded float64
inputs on every rank. The ranks only compute; the test compares with the whole layer in its own process."""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

TOKENS, IN, COL_OUT, ROW_OUT, VOCAB, DIM = 5, 12, 8, 7, 24, 5
IDS = torch.tensor([0, 1, 5, 11, 12, 13, 17, 23, 7, 7, 12])  # both shards of 24 / 2, and their edges


def inputs() -> dict[str, torch.Tensor]:
    """The whole layers' weights and inputs, the same on every rank and in the test (seeded, float64)."""
    g = torch.Generator().manual_seed(707)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return {"x": r(TOKENS, IN), "col_w": r(COL_OUT, IN), "col_b": r(COL_OUT), "row_w": r(ROW_OUT, IN),
            "row_b": r(ROW_OUT), "table": r(VOCAB, DIM), "ids": IDS.clone()}


def shard(n: int, rank: int, size: int) -> slice:
    return slice(rank * n // size, (rank + 1) * n // size)


# ------------------------------------------------------------------------------ classic wrong answers
def col_all_reduces_its_slice(x, weight_shard, bias_shard, gather=False):
    out = F.linear(x, weight_shard, bias_shard)
    dist.all_reduce(out)  # wrong: the slices are different outputs, not partial sums of one
    if not gather:
        return out
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, out)
    return torch.cat(parts, dim=-1)


def col_gathers_along_tokens(x, weight_shard, bias_shard, gather=False):
    out = F.linear(x, weight_shard, bias_shard)
    if not gather:
        return out
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, out)
    return torch.cat(parts, dim=0)  # wrong: the slices are columns of one output


def row_bias_on_every_rank(x_shard, weight_shard, bias):
    out = F.linear(x_shard, weight_shard, bias)  # wrong: every rank's partial sum carries the bias
    dist.all_reduce(out)
    return out


def row_no_all_reduce(x_shard, weight_shard, bias):
    out = F.linear(x_shard, weight_shard)  # wrong: this rank's partial sum only
    return out if bias is None else out + bias


def emb_no_offset(ids, weight_shard):
    rows, rank = weight_shard.shape[0], dist.get_rank()
    here = (ids >= rank * rows) & (ids < (rank + 1) * rows)
    out = weight_shard[ids.clamp(0, rows - 1)]  # wrong: the global id used as the shard's row
    out = out * here[:, None].to(out.dtype)
    dist.all_reduce(out)
    return out


def emb_not_zeroed(ids, weight_shard):
    rows = weight_shard.shape[0]
    local = (ids - dist.get_rank() * rows).clamp(0, rows - 1)
    out = weight_shard[local].clone()  # wrong: the other ranks' ids look up this shard's edge rows
    dist.all_reduce(out)
    return out


def emb_not_masked(ids, weight_shard):
    out = F.embedding(ids - dist.get_rank() * weight_shard.shape[0], weight_shard)  # wrong: ids out of range
    dist.all_reduce(out)
    return out


def emb_no_all_reduce(ids, weight_shard):
    rows = weight_shard.shape[0]
    local = ids - dist.get_rank() * rows
    here = (local >= 0) & (local < rows)
    return F.embedding(local.masked_fill(~here, 0), weight_shard).masked_fill(~here[:, None], 0)


PLANTED = {
    "column_parallel_forward": (col_all_reduces_its_slice, col_gathers_along_tokens),
    "row_parallel_forward": (row_bias_on_every_rank, row_no_all_reduce),
    "vocab_parallel_embedding_forward": (emb_no_offset, emb_not_zeroed, emb_not_masked, emb_no_all_reduce),
}


# ------------------------------------------------------------------------------ one rank's run
def cases(name: str, t: dict, rank: int, size: int) -> dict[str, tuple]:
    """The calls of each exercise on this rank: case -> arguments."""
    if name == "column_parallel_forward":
        rows = shard(COL_OUT, rank, size)
        w, b = t["col_w"][rows].clone(), t["col_b"][rows].clone()
        return {"bias": (t["x"], w, b), "no bias": (t["x"], w, None), "gathered": (t["x"], w, b, True)}
    if name == "row_parallel_forward":
        cols = shard(IN, rank, size)
        x, w = t["x"][:, cols].contiguous(), t["row_w"][:, cols].contiguous()
        return {"bias": (x, w, t["row_b"]), "no bias": (x, w, None)}
    return {"ids": (t["ids"], t["table"][shard(VOCAB, rank, size)].clone())}


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"_ch07_ranks_impl_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def call(fn, args) -> dict:
    try:
        return {"out": fn(*args)}
    except BaseException as e:  # noqa: BLE001 - the test names what was raised
        return {"error": type(e).__name__, "message": str(e), "traceback": traceback.format_exc(limit=4)}


def run_all(impl_path: str, progress: str) -> dict:
    """On one rank: {function: {candidate: {case: {"out": tensor} or {"error": ...}}}}, the planted wrong
    answers first (they reach every collective they start), the learner's last. Before each call the rank
    writes what it is about to run into the file progress + rank, so that a rank stuck in a collective can be
    named."""
    rank, size = dist.get_rank(), dist.get_world_size()
    t = inputs()
    module = load(impl_path)
    results: dict = {}

    def run(name: str, candidate: str, fn) -> dict:
        out = {}
        for case, args in cases(name, t, rank, size).items():
            Path(f"{progress}{rank}").write_text(f"{name} ({candidate}, case {case!r})")
            out[case] = call(fn, args)
        return out

    for name, wrong in PLANTED.items():
        results[name] = {fn.__name__: run(name, fn.__name__, fn) for fn in wrong}
    for name in PLANTED:
        results[name]["yours"] = run(name, "yours", getattr(module, name))
    return results


def impl_file(module) -> str:
    return str(Path(module.__file__).resolve())
