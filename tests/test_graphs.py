"""Decode graphs (chapter 06) through the CPU stand-in, which takes the CUDA graphs' code path: bucket choice,
padding (slot -1, context length 0), the static-buffer copies and stale block-table columns checked against
oracles built from the sequences themselves; then the engine with the stand-in == the eager engine, token for
token (tiny-qwen3, float32), through block-table growth, batch changes, preemption and re-admission, and
nano-vllm's two failure modes: a preempted sequence re-prefilled and then taken for a decode, and a graph
replayed with a stale block table after a batch shrank or after a sequence was preempted and came back.
Marked `gpu`: real CUDA graphs == eager on CUDA."""

from __future__ import annotations

import random

import pytest
import torch
from plans import plan_of

from nanoengine import LLM, SamplingParams
from nanoengine.engine.graphs import DecodeGraphs, batch_buckets
from nanoengine.engine.inputs import InputBuilder
from nanoengine.engine.scheduler import ScheduledSeq
from nanoengine.engine.sequence import Sequence
from nanoengine.plan import DecodeMode

pytestmark = pytest.mark.xdist_group("tiny")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog. " * 4, "1, 2, 3,", "Once upon a time",
           "A paged KV cache", "x " * 30]


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert batch_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]  # max_num_seqs is always a bucket
    assert batch_buckets(3) == [1, 2, 3] and batch_buckets(1) == [1]
    assert batch_buckets(4096)[-2:] == [496, 512]  # capped at 512
    graphs = stand_in(max_num_seqs=20)
    assert ([graphs.bucket_for(n) for n in (1, 3, 5, 8, 9, 16, 17, 20, 21)]
            == [1, 4, 8, 8, 16, 16, 20, 20, None])


def recording_forward(calls: list):
    """A model stand-in: records what it is called on and returns rows that say which token they came from."""
    def forward(inp):
        calls.append(inp)
        return inp.input_ids[:, None].float() * torch.ones(1, 3) + inp.positions[:, None]  # [bs, 3]
    return forward


def stand_in(max_num_seqs: int = 20, max_blocks: int = 12, calls: list | None = None) -> DecodeGraphs:
    g = DecodeGraphs(recording_forward([] if calls is None else calls), "stand_in", max_num_seqs, max_blocks,
                     hidden_size=3, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    g.capture()
    return g


def check_static_buffers(graphs: DecodeGraphs, seqs: list[Sequence], bs: int, block_size: int,
                         pos: list[int] | None = None) -> None:
    """The static buffers of a bucket-`bs` replay against the sequences themselves: each row's token,
    position (`pos`, default: each one's num_computed_tokens), slot, context and whole block table, then
    padding rows (slot -1, context 0, no block), and no block id past the step's widest table in any row."""
    n = len(seqs)
    pos = [s.num_computed_tokens for s in seqs] if pos is None else pos
    assert graphs.input_ids[:bs].tolist() == [s.token_ids[p] for s, p in zip(seqs, pos)] + [0] * (bs - n)
    assert graphs.positions[:bs].tolist() == pos + [0] * (bs - n)
    slots = [-1 if p < s.num_cached_tokens else s.block_table[p // block_size] * block_size + p % block_size
             for s, p in zip(seqs, pos)]
    assert graphs.slot_mapping[:bs].tolist() == slots + [-1] * (bs - n)
    assert graphs.context_lens[:bs].tolist() == [p + 1 for p in pos] + [0] * (bs - n)
    want = torch.zeros(bs, graphs.max_blocks, dtype=torch.int64)
    for i, s in enumerate(seqs):
        want[i, :len(s.block_table)] = torch.tensor(s.block_table)
    assert torch.equal(graphs.block_tables[:bs], want), "a stale block id in the static block table"
    width = max(len(s.block_table) for s in seqs)
    assert not graphs.block_tables[:, width:].any(), "a stale column in a row another bucket reads later"


def test_stand_in_pads_copies_and_clears_stale_columns():
    """Random decode batches that grow, shrink, change members, grow tables and reset them (preemption): every
    replay finds exactly its step in the static buffers, calls the recorded forward on those same buffers,
    and returns the rows of its own sequences."""
    rng = random.Random(0)
    bs_ = 4
    calls: list = []
    graphs = stand_in(max_blocks=32, calls=calls)
    captured = {inp.num_tokens: inp for inp in calls}  # bucket -> the static input its graph recorded
    builder = InputBuilder(bs_)
    seqs = []
    for i in range(24):
        n = rng.randint(1, 40)
        s = Sequence(list(range(1000 + 100 * i, 1000 + 100 * i + n)), SamplingParams(), bs_)
        s.block_table = rng.sample(range(500), -(-n // bs_))
        s.num_computed_tokens = n - 1
        seqs.append(s)
    seen = set()
    for step in range(150):
        batch = sorted(rng.sample(seqs, rng.choice([1, 2, 3, 5, 9, 16, 20])), key=lambda s: s.seq_id)
        for s in batch:
            if rng.random() < 0.3:  # one more token; a new block when it crosses a block boundary
                s.token_ids.append(7)
                s.num_computed_tokens += 1
                if len(s.block_table) * bs_ < s.num_tokens:
                    s.block_table.append(rng.randrange(500))
            if rng.random() < 0.03:  # preempted and re-admitted: an emptied table refilled with other blocks
                s.block_table[:] = rng.sample(range(500), len(s.block_table))
                s.num_table_resets += 1
        inp = builder.build([ScheduledSeq(s, 1, False) for s in batch]).inputs
        assert graphs.can_replay(inp)
        calls.clear()
        out = graphs.replay(inp)
        bs = graphs.bucket_for(len(batch))
        seen.add(bs)
        check_static_buffers(graphs, batch, bs, bs_)
        (called,) = calls  # replay called the forward recorded for this bucket, on the same static buffers
        assert called is captured[bs]
        assert called.attn.decode_block_tables.data_ptr() == graphs.block_tables.data_ptr()
        want = (torch.tensor([s.token_ids[s.num_computed_tokens] for s in batch]).float()[:, None]
                + inp.positions[:, None])
        assert torch.equal(out, want.expand(-1, 3)), f"step {step}: rows of other sequences"
    assert seen == {1, 2, 4, 8, 16, 20}


def test_readmitted_sequence_replays_with_its_new_table():
    """nano-vllm's two failure modes, step by step: b decodes beside a; b is preempted (its table emptied and
    refilled with other blocks) and comes back through the prefix cache with only its last token to compute, a
    one-token prefill that the step lays out as a decode and replays; then the batch shrinks to a's narrower
    table. Each replay must see b's new table, never the old one, and no column of b's wider table."""
    calls: list = []
    graphs = stand_in(max_blocks=12, calls=calls)
    builder = InputBuilder(4)
    a = Sequence(list(range(100, 106)), SamplingParams(), 4)  # 6 tokens: 2 blocks
    b = Sequence(list(range(200, 218)), SamplingParams(), 4)  # 18 tokens: 5 blocks
    a.block_table, a.num_computed_tokens = [7, 8], 5
    b.block_table, b.num_computed_tokens = [1, 2, 3, 4, 5], 17

    def step(scheduled, seqs):
        inp = builder.build(scheduled).inputs
        assert inp.is_decode_only and graphs.can_replay(inp)
        out = graphs.replay(inp)
        check_static_buffers(graphs, seqs, graphs.bucket_for(len(seqs)), 4)
        assert out[:, 0].tolist() == [float(s.token_ids[s.num_computed_tokens] + s.num_computed_tokens)
                                      for s in seqs]

    step([ScheduledSeq(a, 1, False), ScheduledSeq(b, 1, False)], [a, b])
    b.block_table[:] = [9, 10, 11, 12, 13]  # preempted, re-admitted: the prefix cache gave other blocks
    b.num_table_resets += 1
    b.num_cached_tokens = 17  # every token but the last is cached: one token to compute, as a prefill
    step([ScheduledSeq(a, 1, False), ScheduledSeq(b, 1, True)], [a, b])
    assert graphs.block_tables[1, :5].tolist() == [9, 10, 11, 12, 13]
    step([ScheduledSeq(a, 1, False)], [a])  # b finished: the batch shrank to a's two columns
    assert not graphs.block_tables[:, 2:].any()


def test_out_of_range_steps_run_eagerly():
    graphs = stand_in(max_num_seqs=4)
    seqs = [Sequence(list(range(9)), SamplingParams(), 4) for _ in range(6)]
    for s in seqs:
        s.block_table, s.num_computed_tokens = [1, 2, 3], 8
    builder = InputBuilder(4)
    assert graphs.can_replay(builder.build([ScheduledSeq(s, 1, False) for s in seqs[:4]]).inputs)
    assert not graphs.can_replay(
        builder.build([ScheduledSeq(s, 1, False) for s in seqs[:5]]).inputs)  # > largest
    prompt = Sequence(list(range(9)), SamplingParams(), 4)
    prompt.block_table = [4, 5, 6]
    mixed = builder.build([ScheduledSeq(seqs[0], 1, False), ScheduledSeq(prompt, 9, True)]).inputs
    assert not graphs.can_replay(mixed)  # a prefill chunk in the step
    wide = Sequence(list(range(60)), SamplingParams(), 4)
    wide.block_table, wide.num_computed_tokens = list(range(15)), 59
    assert not graphs.can_replay(builder.build([ScheduledSeq(wide, 1, False)]).inputs)  # wider than allowed


# ------------------------------------------------------------------------------------------ the engine
def generate(batches: list[list[str]], params, checked: bool = False, **options) -> tuple[list, LLM]:
    """Greedy tokens of each batch in turn on one engine (tiny-qwen3, float32). With `checked`, every replay's
    static buffers are checked against the step's sequences (their true tables, contexts, slots), without
    overlap scheduling (with it the host moves the sequences on while the step runs)."""
    if checked:
        options["async_scheduling"] = False
    llm = LLM("tiny-qwen3", dtype="float32", block_size=4, max_num_seqs=8, max_model_len=256, **options)
    engine, runner = llm.engine, llm.engine.executor.runner
    if checked:
        step = {}
        build, load = engine.inputs.build, runner.graphs.load

        def build_and_remember(scheduled):
            step["seqs"] = [s.seq for s in scheduled]  # (a decode-only step keeps the scheduled order)
            step["pos"] = [s.start for s in scheduled]  # (committed: num_computed_tokens counts the step)
            return build(scheduled)

        def load_and_check(inp):
            bucket = load(inp)
            check_static_buffers(runner.graphs, step["seqs"], bucket, llm.plan.block_size, step["pos"])
            return bucket

        # this test's instruments
        engine.inputs.build, runner.graphs.load = build_and_remember, load_and_check
    tokens = []
    for prompts in batches:
        p = (params if isinstance(params, SamplingParams)
             else [params[i % len(params)] for i in range(len(prompts))])
        tokens += [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    return tokens, llm


def test_stand_in_equals_eager_through_growth_and_batch_changes():
    """Six prompts with different output lengths: the batch shrinks 6 -> 1 through buckets 8, 4, 2, 1 while
    the tables grow by a block every 4 tokens; then a second batch reuses the engine."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 5, 17, 9, 24, 12)]
    batches = [PROMPTS, PROMPTS[:3]]
    eager, _ = generate(batches, params)
    graphed, llm = generate(batches, params, checked=True, graph_stand_in=True)
    assert graphed == eager
    assert llm.plan.decode_mode is DecodeMode.STAND_IN
    assert set(llm.engine.executor.runner.graphs.replays) == {1, 2, 4, 8}


def test_stand_in_equals_eager_through_preemption_and_readmission():
    """A 28-block pool for six growing sequences: preempted sequences are recomputed (eagerly: a step with a
    prefill chunk) and then decode again in replayed graphs with their new tables; every replay's buffers are
    checked against the sequences, so a stale table after the batch shrank or a sequence came back would show.
    (The one-token re-prefill is `test_readmitted_sequence_replays_with_its_new_table`.)"""
    options = dict(num_kvcache_blocks=28)
    eager, _ = generate([PROMPTS], GREEDY, **options)
    graphed, llm = generate([PROMPTS], GREEDY, checked=True, graph_stand_in=True, trace=True, **options)
    assert graphed == eager
    steps = llm.trace.steps
    preempted = {i for s in steps for i in s.preempted}
    assert len(preempted) >= 2, "the pool was meant to force preemptions"
    assert any(e.seq_id in preempted and e.prefill_tokens for s in steps for e in s.scheduled)  # re-admitted
    replayed = sum(llm.engine.executor.runner.graphs.replays.values())
    one_token_each = sum(all(e.prefill_tokens + e.decode_tokens == 1 for e in s.scheduled) for s in steps)
    assert replayed == one_token_each < len(steps)  # steps with a prefill chunk ran eagerly


def test_stand_in_with_the_cpu_kernels_and_padding_rows(cpu_kernels):
    """The C++ decode kernel on padding rows (context 0) writes zeros and reads nothing
    (batch 3 -> bucket 4)."""
    eager, _ = generate([PROMPTS[:3]], GREEDY, attention_backend="cpu")
    graphed, llm = generate([PROMPTS[:3]], GREEDY, attention_backend="cpu", graph_stand_in=True)
    assert graphed == eager and 4 in llm.engine.executor.runner.graphs.replays


def replays_on(runner) -> int:
    return sum(runner.graphs.replays.values())


@pytest.mark.xdist_group("notebooks")  # starts a worker process (see test_tp.py)
def test_stand_in_under_tensor_parallelism_equals_eager():
    """Two ranks over gloo: each records and replays its own graphs (their all-reduces inside), deciding graph
    or eager from the same step, so they stay in lockstep; tokens == one eager process as the batch
    shrinks."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (14, 3, 9, 6)]
    eager, _ = generate([PROMPTS[:4]], params)
    graphed, llm = generate([PROMPTS[:4]], params, checked=True, graph_stand_in=True, tensor_parallel_size=2)
    with llm:
        assert graphed == eager
        per_rank = llm.collective_rpc(replays_on)
    assert per_rank[0] == per_rank[1] > 0


def test_graph_options_are_decided_once_in_the_config():

    with pytest.raises(ValueError, match=r"graph_stand_in=True runs decode.*enforce_eager=True forbids"):
        plan_of(device="cpu", graph_stand_in=True, enforce_eager=True)
    assert plan_of(device="cpu").decode_mode in (DecodeMode.FUSED_CPU, DecodeMode.EAGER)  # no graphs on CPU
    assert plan_of(device="cpu", graph_stand_in=True).decode_mode is DecodeMode.STAND_IN
    with pytest.raises(ValueError, match=r"torch_compile=True compiles the ops that attention_backend='cpu'"):
        plan_of(device="cpu", attention_backend="cpu", torch_compile=True)
    assert plan_of(device="cpu").torch_compile is False  # slower on CPU


def test_graph_options_on_cuda(monkeypatch):
    """On a (pretended) CUDA machine: graphs unless enforce_eager, never with the torch backend (its store
    syncs with the host: eager, with a warning), no stand-in; torch.compile on by default."""
    from nanoengine.kernels import triton_support

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_support, "problem", lambda device: None)
    cuda = dict(device="cuda", dtype="float32", attention_backend="triton")
    cfg = plan_of(**cuda)
    assert (cfg.decode_mode, cfg.torch_compile) == (DecodeMode.CUDA_GRAPHS, True)
    assert plan_of(**cuda, enforce_eager=True).decode_mode is DecodeMode.EAGER
    assert plan_of(**cuda, torch_compile=False).torch_compile is False
    with pytest.warns(UserWarning, match=r"'torch' cannot run inside a CUDA graph.*decode steps run eagerly"):
        cfg = plan_of(device="cuda", attention_backend="torch")
    assert cfg.decode_mode is DecodeMode.EAGER
    with pytest.raises(ValueError,
                       match=r"graph_stand_in=True is the CPU stand-in.*on CUDA the engine captures"):
        plan_of(**cuda, graph_stand_in=True)




@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_equal_eager_on_cuda(dtype):
    """Real CUDA graphs (and torch.compile'd ops, the CUDA default) == eager, through batch changes and
    preemption; the graphs were replayed in several buckets."""
    options = dict(device="cuda", dtype=dtype, num_kvcache_blocks=28)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 5, 17, 9, 24, 12)]
    eager, _ = generate([PROMPTS], params, enforce_eager=True, torch_compile=False, **options)
    graphed, llm = generate([PROMPTS], params, **options)
    assert (llm.plan.decode_mode is DecodeMode.CUDA_GRAPHS
            and len(llm.engine.executor.runner.graphs.replays) >= 3)
    if dtype == "float32":
        assert graphed == eager
    else:  # bf16: compiled ops round differently; most tokens agree
        same = sum(a == b for g, e in zip(graphed, eager) for a, b in zip(g, e))
        assert same >= 0.9 * sum(map(len, eager))
