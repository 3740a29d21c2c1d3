"""Exercises of chapter 06 (book/06a_step_cost.ipynb .. 06c_capture_and_overlap.ipynb): 6.1 checked against
nanoengine.viz.overhead.count_ops; 6.2 and 6.3 against nanoengine's own decode graphs (engine/graphs.py:
batch_buckets, DecodeGraphs.bucket_for and .load) on seeded decode batches (6.3: the step's rows exactly, the
padding rows by what they must not do); 6.4 against tiny-qwen3's eager forward (its hidden states and the KV
cache it leaves); and 6.5 against a host-side oracle and an engine that overlaps its steps (async_scheduling)
on the learner's function, compared with one that does not. (6.1's tests come after 6.4's, whose tiny-qwen3
engine and decode steps they reuse.)"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from ex_helpers import assert_close, assert_equal, assert_same_list, book
from torch.overrides import TorchFunctionMode

from nanoengine import LLM, SamplingParams
from nanoengine.engine.graphs import DecodeGraphs, batch_buckets
from nanoengine.engine.inputs import InputBuilder
from nanoengine.engine.scheduler import ScheduledSeq
from nanoengine.engine.sequence import Sequence
from nanoengine.viz import overhead

CHAPTER = "ch06_cuda_graphs"
pytestmark = pytest.mark.xdist_group("ex_ch06")
NB = "06a_step_cost.ipynb"  # (a message names the part that sets its exercise: ex_helpers.book)
SIZES = [*range(1, 41), 63, 64, 65, 100, 255, 256, 257, 511, 512, 513, 4096]


# ------------------------------------------------------------------------------------------ 6.2
def test_6_2_graph_buckets_match_the_engine(ex):
    where = book(NB, "6.2")
    for m in SIZES:
        got, want = ex.graph_buckets(m), batch_buckets(m)
        if got != want and isinstance(got, list) and got == [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= m]:
            raise AssertionError(f"max_num_seqs={m}: this looks like powers of two only; after 8 the buckets go in "
                                 f"steps of 16, and max_num_seqs itself is always a bucket {where}")
        if isinstance(got, list) and got and max(got) != want[-1]:
            raise AssertionError(f"max_num_seqs={m}: the largest bucket is {max(got)}, expected {want[-1]} "
                                 f"(max_num_seqs capped at 512), or a batch of {want[-1]} would have no graph {where}")
        if isinstance(got, list) and len(set(got)) != len(got):
            raise AssertionError(f"max_num_seqs={m}: {got} holds a size twice; one graph per size {where}")
        assert_same_list(sorted(got) if isinstance(got, list) else got, want, f"graph_buckets({m}), sorted", where)


def test_6_2_pick_bucket_matches_the_engine(ex):
    where = book(NB, "6.2")
    for m in (1, 3, 8, 20, 40, 100):
        graphs = DecodeGraphs(lambda inp: torch.zeros(inp.num_tokens, 2), "stand_in", m, max_blocks=2, hidden_size=2,
                              block_size=4, dtype=torch.float32, device=torch.device("cpu"))
        graphs.capture()
        for n in range(1, m + 6):
            got = ex.pick_bucket(batch_buckets(m), n)
            want = graphs.bucket_for(n)
            if want is not None and got is not None and got < n:
                raise AssertionError(f"buckets {graphs.buckets}, batch {n}: bucket {got} has fewer rows than the "
                                     f"batch; take the smallest bucket that holds every row {where}")
            assert_equal(got, want, f"pick_bucket({graphs.buckets}, {n})", where)


# ------------------------------------------------------------------------------------------ 6.3
BLOCK = 4


def random_sequences(rng: random.Random, count: int = 24) -> list[Sequence]:
    seqs = []
    for i in range(count):
        n = rng.randint(1, 40)
        s = Sequence(list(range(1000 + 100 * i, 1000 + 100 * i + n)), SamplingParams(), BLOCK)
        s.block_table = rng.sample(range(1, 500), -(-n // BLOCK))
        s.num_computed_tokens = n - 1
        seqs.append(s)
    return seqs


def decode_batches(seed: int, steps: int):
    """Seeded decode steps whose batches grow, shrink and change members, with tables that grow (a block
    every BLOCK tokens) and get refilled (a preempted sequence back with other blocks)."""
    rng = random.Random(seed)
    seqs = random_sequences(rng)
    builder = InputBuilder(BLOCK)
    for _ in range(steps):
        batch = sorted(rng.sample(seqs, rng.choice([1, 2, 3, 5, 9, 16, 20])), key=lambda s: s.seq_id)
        for s in batch:
            if rng.random() < 0.3:
                s.token_ids.append(7)
                s.num_computed_tokens += 1
                if len(s.block_table) * BLOCK < s.num_tokens:
                    s.block_table.append(rng.randrange(1, 500))
            if rng.random() < 0.05:
                s.block_table[:] = rng.sample(range(1, 500), len(s.block_table))
        yield builder.build([ScheduledSeq(s, 1, False) for s in batch]).inputs


def fresh_buffers(rows: int, max_blocks: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(rows, dtype=torch.int64), "positions": torch.zeros(rows, dtype=torch.int64),
            "slot_mapping": torch.full((rows,), -1, dtype=torch.int64),
            "context_lens": torch.zeros(rows, dtype=torch.int64),
            "block_tables": torch.zeros(rows, max_blocks, dtype=torch.int64)}


@torch.inference_mode()  # the engine's static buffers are inference tensors
def test_6_3_load_static_matches_the_engines_buffers(ex):
    where = book(NB, "6.3")
    max_blocks = 32
    engine = DecodeGraphs(lambda inp: torch.zeros(inp.num_tokens, 2), "stand_in", 20, max_blocks, hidden_size=2,
                          block_size=BLOCK, dtype=torch.float32, device=torch.device("cpu"))
    engine.capture()
    bufs = fresh_buffers(20, max_blocks)
    originals = dict(bufs)
    width = 0
    names = {"input_ids": engine.input_ids, "positions": engine.positions, "slot_mapping": engine.slot_mapping,
             "context_lens": engine.context_lens, "block_tables": engine.block_tables}
    for step, inp in enumerate(decode_batches(62, 120)):
        bs = engine.load(inp)
        n = inp.num_tokens
        width = ex.load_static(bufs, width, inp, bs)
        what = f"step {step} (batch {n}, bucket {bs}, table width {inp.attn.decode_block_tables.shape[1]})"
        for k, orig in originals.items():
            if bufs[k] is not orig:
                raise AssertionError(f"{what}: bufs[{k!r}] was replaced by a new tensor; a captured graph keeps "
                                     f"reading the old one, so write into it in place (copy_, fill_, zero_) {where}")
        if n < bs and int(bufs["slot_mapping"][n]) == 0:
            raise AssertionError(f"{what}: padding row {n} has slot 0, so its K/V would overwrite the first slot "
                                 f"of block 0; padding rows get slot -1 (stored nowhere) {where}")
        if n < bs and int(bufs["context_lens"][n]) != 0:
            raise AssertionError(f"{what}: padding row {n} has context length {int(bufs['context_lens'][n])}; "
                                 f"0 makes its attention read nothing {where}")
        stale = bufs["block_tables"][:, engine.used_width:]
        if stale.any():
            row, col = (int(i) for i in torch.nonzero(stale)[0])
            raise AssertionError(f"{what}: row {row} still holds block id {int(stale[row, col])} in column "
                                 f"{engine.used_width + col}, past this step's width: a stale id a later, larger "
                                 f"bucket or a wider table would read; clear columns width..used_width-1 in every "
                                 f"row {where}")
        for k, want in names.items():  # the step's own rows exactly
            assert_close(bufs[k][:n], want[:n], f"{what}: {k}[:{n}]", where, atol=0, rtol=0)
        for k in ("input_ids", "positions", "block_tables"):  # padding rows: any valid value (they store and read
            if n < bs and (bufs[k][n:bs] < 0).any():  # nothing: slot -1, context 0, checked above)
                raise AssertionError(f"{what}: a padding row holds a negative {k[:-1]}; the forward must be able "
                                     f"to run it (token 0 at position 0, block 0, say) {where}")
        assert_equal(width, engine.used_width, f"{what}: the returned width", where)


# ------------------------------------------------------------------------------------------ 6.4
@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-qwen3", dtype="float32", attention_backend="torch", block_size=BLOCK, max_num_seqs=8,
               max_model_len=256, num_kvcache_blocks=96)


PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 2, "1, 2, 3,", "Once upon a time",
           "A paged KV cache", "x " * 20]


def decode_steps(llm: LLM, lengths=(14, 3, 9, 5, 11, 7)):
    """Drive the engine by hand; yield each decode-only step's input before the engine runs it."""
    eng = llm.engine
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for p, n in zip(PROMPTS, lengths)]
    while eng.has_unfinished():
        out = eng.scheduler.schedule()
        built = eng.inputs.build(out.scheduled)
        inp, sample_seqs = built.inputs, built.sample_seqs
        if inp.is_decode_only:
            yield inp
        forward = eng.executor.launch(inp, eng.sampling.batch(sample_seqs))
        eng.scheduler.update(out, forward.tokens())
    for rid in rids:
        eng.abort(rid)


def test_6_4_replay_equals_eager_and_writes_only_real_rows(ex, tiny):
    where = book(NB, "6.4")
    runner = tiny.engine.executor.runner
    cfg = tiny.plan
    seen: list[torch.Tensor] = []

    def forward(inp):
        seen.append(inp.input_ids)
        return runner.eager_forward(inp)

    buckets = batch_buckets(cfg.max_num_seqs)
    graphs = ex.StandInGraphs(forward, buckets, -(-cfg.max_model_len // BLOCK), cfg.hf_config.hidden_size, BLOCK,
                              torch.float32)
    graphs.capture()
    if len(seen) != len(buckets):
        raise AssertionError(f"capture() ran the forward {len(seen)} times; once per bucket {buckets} expected {where}")
    captured = {t.data_ptr() for t in seen}
    used = Counter()
    for step, inp in enumerate(decode_steps(tiny)):
        n = inp.num_tokens
        kv_before = runner.kv_cache.clone()
        seen.clear()
        got = graphs.replay(inp)
        what = f"decode step {step} (batch {n})"
        if len(seen) != 1 or seen[0].data_ptr() not in captured or seen[0] is inp.input_ids:
            raise AssertionError(f"{what}: replay must call one recorded forward, on the static buffers it was "
                                 f"captured on (called {len(seen)} times"
                                 f"{', on the step input itself' if seen and seen[0] is inp.input_ids else ''}) "
                                 f"{where}")
        used[seen[0].shape[0]] += 1
        got = got.clone() if isinstance(got, torch.Tensor) else got
        kv_yours = runner.kv_cache.clone()
        runner.kv_cache.copy_(kv_before)
        want = runner.eager_forward(inp)
        # a bucket's matmuls may round the real rows' K/V in the last bits; a misplaced row differs wholesale
        changed = ~torch.isclose(kv_yours, runner.kv_cache, atol=1e-5, rtol=1e-5)
        if changed.any():
            raise AssertionError(f"{what}: after your replay the KV cache differs from the eager step's in "
                                 f"{int(changed.sum())} values; a padding row stored K/V somewhere (its slot must "
                                 f"be -1), or a real row was stored in the wrong slot {where}")
        assert_close(got, want, f"{what}: replayed hidden states", where, atol=1e-5, rtol=1e-5)
    assert len(used) >= 3, f"the run was meant to replay several buckets, got {dict(used)}"


# ------------------------------------------------------------------------------------------ 6.1
def function_mode_counts(fn) -> Counter:
    """The classic mix-up: torch-level calls (TorchFunctionMode) instead of dispatched aten ops."""
    counts: Counter = Counter()

    class Fn(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            counts[getattr(func, "__name__", str(func))] += 1
            return func(*args, **(kwargs or {}))

    with Fn():
        fn()
    return counts


def test_6_1_count_ops_matches_a_dispatch_counter(ex, tiny):
    where = book(NB, "6.1")
    torch.manual_seed(64)
    x, y, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(16, 8)
    runner = tiny.engine.executor.runner
    steps = decode_steps(tiny, lengths=(4, 4, 4))
    step_inp = next(steps)
    cases = {"relu(x + y) * 2": lambda: torch.relu(x + y) * 2,
             "softmax(linear(x, w))": lambda: F.softmax(F.linear(x, w), -1),
             "views and an in-place add": lambda: x.clone().view(8, 4).t().add_(1).sum(),
             "a tiny-qwen3 decode step": lambda: runner.execute(step_inp)}
    for name, fn in cases.items():
        with torch.inference_mode():
            want = overhead.count_ops(fn)
            got = ex.count_ops(fn)
            if isinstance(got, dict) and Counter(got) != want and Counter(got) == function_mode_counts(fn):
                raise AssertionError(f"{name}: this looks like torch-level calls (TorchFunctionMode); count the aten "
                                     f"ops the dispatcher runs, with TorchDispatchMode {where}")
        if not isinstance(got, dict):
            raise AssertionError(f"{name}: expected a Counter of op name -> calls, got {type(got).__name__} {where}")
        got = Counter(got)
        if got != want:
            diff = {k: (got.get(k, 0), want.get(k, 0)) for k in set(got) | set(want) if got.get(k, 0) != want.get(k, 0)}
            raise AssertionError(f"{name}: counts differ (op: yours, expected): {dict(sorted(diff.items())[:8])}; "
                                 f"count func.overloadpacket.__name__ once per __torch_dispatch__ call {where}")
    for _ in steps:  # let the engine finish those requests
        pass


def test_6_1_predict_step_ms(ex):
    where = book(NB, "6.1")
    rng = random.Random(6)
    for _ in range(20):
        ops, us, nbytes, bw = rng.randint(10, 5000), rng.uniform(1, 20), rng.uniform(1e6, 2e9), rng.uniform(5, 500)
        got = ex.predict_step_ms(ops, us, nbytes, bw)
        over, mem = ops * us / 1e3, nbytes / (bw * 1e9) * 1e3
        if not isinstance(got, dict) or set(got) != {"overhead_ms", "memory_ms", "total_ms"}:
            raise AssertionError(f"expected a dict with overhead_ms, memory_ms, total_ms, got {got!r} {where}")
        if abs(got["overhead_ms"] - ops * us) < 1e-9 * ops * us:
            raise AssertionError(f"overhead_ms {got['overhead_ms']:.4g} is in microseconds (ops x per_op_us); "
                                 f"divide by 1e3 {where}")
        for key, want in (("overhead_ms", over), ("memory_ms", mem), ("total_ms", over + mem)):
            if abs(got[key] - want) > 1e-9 * max(1.0, abs(want)):
                raise AssertionError(f"{ops} ops x {us:.3g} us, {nbytes:.3g} bytes at {bw:.3g} GB/s: {key} "
                                     f"{got[key]:.6g}, expected {want:.6g} {where}")


# ------------------------------------------------------------------------------------------ 6.5
def naive_read(ids: list[int], prev: list[int]) -> list[int]:
    """The oracle, one id at a time on the host: a reference -(row + 1) is row `row` of prev."""
    return [i if i >= 0 else prev[-1 - i] for i in ids]


def random_pending_step(rng: random.Random) -> tuple[list[int], list[int]]:
    """A step's input ids (token ids and references, mixed) and the tokens the step before sampled."""
    prev = [rng.randrange(0, 1000) for _ in range(rng.randint(1, 12))]
    ids = [rng.randrange(0, 1000) if rng.random() < 0.4 else -1 - rng.randrange(len(prev))
           for _ in range(rng.randint(1, 20))]
    return ids, prev


def test_6_5_read_pending_ids_on_seeded_steps(ex):
    where = book(NB, "6.5")
    rng = random.Random(65)
    cases = [([5, -1, -3], [70, 71, 72]), ([-1], [9]), ([3, 4], [8])] + [random_pending_step(rng) for _ in range(200)]
    for ids, prev in cases:
        input_ids, prev_tokens = torch.tensor(ids), torch.tensor(prev)
        got = ex.read_pending_ids(input_ids, prev_tokens)
        what = f"read_pending_ids({ids}, {prev})"
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{what}: expected a tensor, got {type(got).__name__} {where}")
        if input_ids.tolist() != ids:
            raise AssertionError(f"{what}: input_ids was changed in place; return a new tensor (on the host the "
                                 f"step's input ids are a view of the input builder's buffers) {where}")
        want = naive_read(ids, prev)
        if got.tolist() != want:
            row_is_minus_id = [(g, prev[-i]) for g, i in zip(got.tolist(), ids) if 0 < -i < len(prev)]
            if row_is_minus_id and all(g == p for g, p in row_is_minus_id):
                raise AssertionError(f"{what}: yours {got.tolist()}, expected {want}: this looks like row -id; the "
                                     f"reference -(row + 1) names row -id - 1 (-1 is row 0) {where}")
            if got.tolist() == ids:
                raise AssertionError(f"{what}: the references (< 0) are still there; replace each by the token it "
                                     f"names in prev_tokens {where}")
            assert_same_list(got.tolist(), want, what, where)
    ids, prev = random_pending_step(random.Random(650))
    try:  # tensors with no values: what a function that never reads a value on the host still runs on
        got = ex.read_pending_ids(torch.tensor(ids, device="meta"), torch.tensor(prev, device="meta"))
        ok = isinstance(got, torch.Tensor) and tuple(got.shape) == (len(ids),)
    except Exception:  # noqa: BLE001 (any failure here is the mistake named below)
        ok = False
    if not ok:
        raise AssertionError(f"read_pending_ids reads values on the host (.item(), .tolist(), int(), an `if` on a "
                             f"tensor, or a boolean mask, whose row count depends on the values): it failed on "
                             f"tensors that have none (device='meta'). On a GPU that waits for the step in flight, "
                             f"which is what overlap avoids; compute every row with tensor ops (clamp, indexing, "
                             f"torch.where) {where}")


def test_6_5_the_engine_overlaps_on_yours(ex, monkeypatch):
    """The engine with overlap reads its pending tokens with your function: same tokens as without overlap."""
    from nanoengine.engine import pending

    where = book(NB, "6.5")
    ex.read_pending_ids(torch.tensor([1, -1]), torch.tensor([2]))  # a stub says so here, not in the engine's thread
    engines_own = pending.read_pending_ids
    calls, wrong = [], []

    def yours(input_ids: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        want = engines_own(input_ids, prev_tokens)
        try:
            got = ex.read_pending_ids(input_ids.clone(), prev_tokens)
        except Exception as error:  # noqa: BLE001 (reported after the run, outside the executor's thread)
            got = error
        calls.append(int((input_ids < 0).sum()))
        if not isinstance(got, torch.Tensor) or not torch.equal(got, want):
            wrong.append((input_ids.tolist(), prev_tokens.tolist(), got, want.tolist()))
            return want
        return got

    prompts = PROMPTS + ["Paged attention reads", "A B C D E F"]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True)
              for i, n in enumerate((9, 3, 12, 5, 7, 10, 4, 6))]
    runs = {}
    for on in (False, True):
        llm = LLM("tiny-qwen3", dtype="float32", attention_backend="torch", max_num_seqs=3, num_kvcache_blocks=64,
                  async_scheduling=on)
        if on:
            monkeypatch.setattr(pending, "read_pending_ids", yours)
        runs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert sum(calls) > 0, "the overlap run was meant to read pending tokens"
    if wrong:
        ids, prev, got, want = wrong[0]
        raise AssertionError(f"{len(wrong)} of {len(calls)} overlapped steps: input ids {ids} with the step "
                             f"before's tokens {prev}: yours {got!r}, the engine's {want} {where}")
    if runs[True] != runs[False]:
        raise AssertionError(f"with your read_pending_ids the overlapped engine drew other tokens than the engine "
                             f"without overlap {where}")
