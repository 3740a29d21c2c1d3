"""Tensor parallelism over gloo on CPU: two ranks give the same greedy tokens as one process in every
scheduling regime, each sharded layer equals its unsharded self, and a worker that raises, is killed, or is
interrupted makes the driver raise quickly and leaves no process behind."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time

import pytest
import torch
from tp_workload import GREEDY, PROMPTS, child_pids

from nanoengine import LLM, SamplingParams
from nanoengine.errors import WorkerError

# the notebooks' group: these tests start extra processes, and run beside a notebook they slowed it ~2x (the
# notebook test's limit is wall time)
pytestmark = [pytest.mark.xdist_group("notebooks"),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="reads /proc for child processes")]



def no_children_within(seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while child_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    return child_pids()


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ------------------------------------------------------------------------------------ engine equivalence
REGIMES = {  # prefix caching is on in all of them; the second round hits it
    "chunked": {"max_num_batched_tokens": 32},
    "tight_pool": {"num_kvcache_blocks": 14, "block_size": 16, "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_tp2_equals_tp1_token_for_token(regime):
    """Two ranks with overlap scheduling (their input ids from rank 0's last tokens, through an all-reduce)
    give one process's tokens without it."""
    options = dict(dtype="float32", trace=True, **REGIMES[regime])
    one = LLM("tiny-qwen3", async_scheduling=False, **options)
    want = [tokens(one.generate(PROMPTS, GREEDY, use_tqdm=False)) for _ in range(2)]
    with LLM("tiny-qwen3", tensor_parallel_size=2, async_scheduling=True, **options) as two:
        assert two.engine.executor.runner.num_kv_heads == 1, (
            "each of 2 ranks holds 1 of tiny-qwen3's 2 KV heads")
        assert two.engine.block_manager.num_blocks == one.engine.block_manager.num_blocks
        for round in range(2):
            got = tokens(two.generate(PROMPTS, GREEDY, use_tqdm=False))
            for i, (g, w) in enumerate(zip(got, want[round])):
                assert g == w, f"{regime} round {round}: prompt {i} differs between TP=2 and TP=1"
            trace = two.trace
            assert trace.hit_tokens > 0, "the shared prefix should hit the prefix cache"
            if regime == "chunked":
                assert any(e.prefill_tokens and e.num_computed_before
                           for s in trace.steps for e in s.scheduled)
            if regime == "tight_pool" and round == 0:
                assert any(s.preempted for s in trace.steps), "the tight pool should have forced a preemption"
        # a prefill's logits through the sharded vocabulary == one process's
        ids = one.tokenizer.encode(PROMPTS[0])
        torch.testing.assert_close(two.engine.prompt_logits(ids), one.engine.prompt_logits(ids))
    assert no_children_within(5) == []


def test_tp2_logprobs_equal_tp1():
    """Logprobs (generated and prompt) through the sharded vocabulary, gathered on rank 0: one process's."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    want = LLM("tiny-qwen3", dtype="float32").generate(PROMPTS[:2], params, use_tqdm=False)
    with LLM("tiny-qwen3", dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=32) as two:
        got = two.generate(PROMPTS[:2], params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        pairs = list(zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:])) + list(
            zip(g.outputs[0].logprobs, w.outputs[0].logprobs))
        for a, b in pairs:
            token = next(iter(b))
            assert next(iter(a)) == token and abs(a[token].logprob - b[token].logprob) < 1e-4
    assert no_children_within(5) == []


def test_each_rank_holds_its_share_and_the_pools_agree():
    with LLM("tiny-qwen3", tensor_parallel_size=2, kv_cache_memory_gb=0.01) as llm:
        shapes = llm.collective_rpc(shard_shapes)
    (rank0, blocks0), (rank1, blocks1) = shapes
    assert rank0["layers.0.self_attn.qkv_proj.weight"] == (128, 64)  # (4 q + 2 k + 2 v heads) * 32 / 2 ranks
    assert rank0["layers.0.self_attn.o_proj.weight"] == (64, 64)  # 128 input columns / 2
    assert rank0["layers.0.mlp.gate_up_proj.weight"] == (128, 64)
    assert rank0["embed_tokens.weight"] == (151936 // 2, 64)
    assert rank0 == rank1 and blocks0 == blocks1


def shard_shapes(runner):  # module level: collective_rpc pickles functions by name
    return {n: tuple(p.shape) for n, p in runner.model.named_parameters()}, runner.num_blocks


# ------------------------------------------------------------------------------------ sharded layers
def run_ranks(fn, size: int = 2) -> list:
    """Run fn(tp) on `size` fresh processes joined in one gloo group; their results, by rank."""
    from nanoengine.distributed.spawn import RankFailure, run_on_ranks

    results = run_on_ranks(on_group, size, fn, timeout=120)
    failures = [r.traceback for r in results if isinstance(r, RankFailure)]
    if failures:
        pytest.fail("\n".join(failures))
    return results


def on_group(fn):  # module level: run_on_ranks sends it by name
    import torch.distributed as dist

    from nanoengine.layers.tp_group import TPGroup

    return fn(TPGroup(dist.get_rank(), dist.get_world_size()))


def load_from(whole, sharded) -> None:
    """Load `sharded` from `whole`'s weights through the same loaders a checkpoint goes through."""
    from nanoengine.layers.linear import MergedLinear

    for name, p in sharded.named_parameters():
        w = whole.get_parameter(name).detach()
        owner = name.rpartition(".")[0]
        if isinstance(sharded.get_submodule(owner), MergedLinear):  # a checkpoint has one tensor per part
            for part, (start, size) in whole.get_submodule(owner).part_offsets.items():
                p.weight_loader(p, w[start:start + size], part)
        else:
            p.weight_loader(p, w)


def sharded_vs_whole(tp):
    """tiny-qwen3-shaped layers (with biases), sharded over the ranks and loaded from the whole layers'
    weights, against the whole layers: (sharded result, whole result) per check."""
    from transformers import Qwen3Config

    from nanoengine import assets
    from nanoengine.layers.embedding import Embedding, LMHead
    from nanoengine.layers.linear import MergedLinear, RowParallelLinear
    from nanoengine.models.llama import MLP

    torch.manual_seed(0)  # every rank builds the same whole layers and inputs
    hf = Qwen3Config(**{**assets.TINY_QWEN3_DIMS, "vocab_size": 1000, "mlp_bias": True})
    heads, kv_heads, d, hidden = 4, 2, 32, hf.hidden_size
    x = torch.randn(7, hidden)  # [tokens, hidden]
    out = {}
    with torch.no_grad():
        # MLP: gate/up column-parallel, down row-parallel with its all-reduce (and the bias added once)
        whole, mlp = MLP(hf), MLP(hf, tp=tp)
        torch.nn.init.normal_(whole.down_proj.bias)
        load_from(whole, mlp)
        out["mlp"] = (mlp(x), whole(x))
        # attention projections: q/k/v by heads (GQA: rank r holds query heads 2r, 2r+1 and KV head r)
        parts = {"q": heads * d, "k": kv_heads * d, "v": kv_heads * d}
        whole_qkv, qkv = MergedLinear(hidden, parts, bias=True), MergedLinear(hidden, parts, bias=True, tp=tp)
        torch.nn.init.normal_(whole_qkv.bias)
        load_from(whole_qkv, qkv)
        q, k, v = whole_qkv(x).split(list(parts.values()), dim=-1)
        mine = lambda t, n: t.view(7, n, d)[:, tp.rank * n // tp.size:(tp.rank + 1) * n // tp.size].flatten(1)
        out["qkv"] = (qkv(x), torch.cat([mine(q, heads), mine(k, kv_heads), mine(v, kv_heads)], dim=-1))
        # o_proj: each rank multiplies its heads' outputs; the all-reduce makes the whole product
        attn_out = torch.randn(7, heads * d)  # [tokens, heads * head_dim]
        whole_o, o = (torch.nn.Linear(heads * d, hidden),
                      RowParallelLinear(heads * d, hidden, bias=True, tp=tp))
        load_from(whole_o, o)
        out["o_proj"] = (o(mine(attn_out, heads)), whole_o(attn_out))
        # vocab-parallel embedding (ids from every shard) and LM head (gathered on rank 0)
        ids = torch.tensor([0, 1, 499, 500, 501, 999, 3])
        whole_emb, emb = Embedding(1000, hidden), Embedding(1000, hidden, tp)
        load_from(whole_emb, emb)
        out["embedding"] = (emb(ids), whole_emb(ids))
        whole_head, head = LMHead(1000, hidden), LMHead(1000, hidden, tp)
        load_from(whole_head, head)
        logits = head(x)
        out["lm_head"] = (logits, whole_head(x)) if tp.rank == 0 else (logits is None, True)
    return out


def test_sharded_layers_equal_the_whole_layers_across_two_ranks():
    for rank, results in enumerate(run_ranks(sharded_vs_whole, 2)):
        for name, (sharded, whole) in results.items():
            if isinstance(sharded, bool):
                assert sharded, f"rank {rank}: the LM head's logits should only come back on rank 0"
                continue
            torch.testing.assert_close(sharded, whole, msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")


# ------------------------------------------------------------------------------------ failures
def raise_in_the_mlp_on_workers(runner):
    if runner.tp.rank > 0:
        def boom(x):
            raise RuntimeError("injected failure in rank 1's MLP")
        runner.model.layers[1].mlp.forward = boom


def test_a_worker_that_raises_makes_generate_raise_with_its_traceback():
    llm = LLM("tiny-qwen3", tensor_parallel_size=2)
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    llm.collective_rpc(raise_in_the_mlp_on_workers)
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match=r"(?s)worker rank 1 failed:.*injected failure in rank 1's MLP"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    detected = time.perf_counter() - t0
    assert detected < 5, f"the failure took {detected:.1f} s to surface"
    assert no_children_within(5) == [], "the workers must be stopped after a failure"
    with pytest.raises(WorkerError, match="stopped after a failure.*build a new LLM"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    print(f"worker exception surfaced in the driver after {detected:.2f} s")


def test_a_worker_killed_mid_run_is_noticed_within_seconds():
    llm = LLM("tiny-qwen3", tensor_parallel_size=2)
    (worker,) = llm.engine.executor.workers.pids
    long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    killed_at = []

    def kill():
        killed_at.append(time.perf_counter())
        os.kill(worker, signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) was killed by signal 9 \(SIGKILL\)"):
        llm.generate(["a long story"] * 4, long, use_tqdm=False)
    noticed = time.perf_counter() - killed_at[0]
    assert noticed < 10, f"the kill took {noticed:.1f} s to notice"
    assert no_children_within(5) == []
    print(f"SIGKILL noticed after {noticed:.2f} s")


def test_a_worker_killed_between_runs_is_noticed_at_the_next_step():
    llm = LLM("tiny-qwen3", tensor_parallel_size=2)
    (worker,) = llm.engine.executor.workers.pids
    os.kill(worker, signal.SIGKILL)
    time.sleep(0.2)
    with pytest.raises(WorkerError, match=r"was killed by signal 9 \(SIGKILL\)"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert no_children_within(5) == []


def test_ctrl_c_mid_step_leaves_the_ranks_in_step():
    """KeyboardInterrupt arrives during a TP run: it is held to the end of the step, the run stops, and the
    same LLM then gives the same tokens as before (the ranks never fell out of step)."""
    with LLM("tiny-qwen3", tensor_parallel_size=2) as llm:
        want = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a long story"] * 4, long, use_tqdm=False)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want


def test_two_engines_one_after_the_other_leave_no_process():
    for _ in range(2):
        llm = LLM("tiny-qwen3", tensor_parallel_size=2)
        assert len(child_pids()) == 1
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        del llm
        gc.collect()
        assert no_children_within(5) == [], "del llm must stop its worker"


DRIVER = """
import os, sys
from nanoengine import LLM, SamplingParams
llm = LLM("tiny-qwen3", tensor_parallel_size=2)
print(*llm.engine.executor.workers.pids, flush=True)
if sys.argv[1] == "ctrl-c":
    llm.generate(["a long story"] * 4, SamplingParams(max_tokens=4000, ignore_eos=True), use_tqdm=False)
"""


@pytest.mark.parametrize("how", ["exit", "ctrl-c"])
def test_the_driver_exiting_or_interrupted_leaves_no_orphan(how, tmp_path):
    """The script ends without close() (atexit stops the worker), or Ctrl-C stops it mid-run."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", DRIVER, how], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        (worker,) = map(int, proc.stdout.readline().split())
        if how == "ctrl-c":
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
        assert proc.wait(30) != 0 if how == "ctrl-c" else proc.wait(30) == 0
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{worker}"), f"worker {worker} outlived its driver ({how})"
    finally:  # a failure here must not leave the driver running into the next test
        if proc.poll() is None:
            proc.kill()
            proc.wait()


UNGUARDED = """
from nanoengine import LLM, SamplingParams
llm = LLM("tiny-qwen3", tensor_parallel_size=2)
out = llm.generate(["Once upon a time", "The capital of"], SamplingParams(temperature=0, max_tokens=8),
                   use_tqdm=False)
print("TOKENS", [o.outputs[0].token_ids for o in out], flush=True)


def num_blocks(runner):
    return runner.num_blocks


try:
    llm.collective_rpc(num_blocks)
except ValueError as e:
    print("RPC", e, flush=True)
"""


def test_a_script_that_builds_a_tp_llm_at_top_level_works(tmp_path):
    """No `if __name__ == "__main__":` (as vLLM users write scripts): the workers run their own program, so
    the script is not imported again in them; its tokens equal one process's. A function defined in the script
    cannot reach them by name: collective_rpc says so."""
    import subprocess

    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    got = next(line for line in run.stdout.splitlines() if line.startswith("TOKENS"))
    with LLM("tiny-qwen3") as llm:
        out = llm.generate(["Once upon a time", "The capital of"],
                           SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert got == f"TOKENS {[o.outputs[0].token_ids for o in out]}"
    assert "RPC collective_rpc: 'num_blocks' is defined in your script (__main__)" in run.stdout, run.stdout
    assert no_children_within(5) == []


def test_two_live_tp_engines_in_one_process_are_refused_clearly():
    with LLM("tiny-qwen3", tensor_parallel_size=2):
        with pytest.raises(RuntimeError,
                           match="already has a torch.distributed process group.*close it first"):
            LLM("tiny-qwen3", tensor_parallel_size=2)
    assert no_children_within(5) == []


# ------------------------------------------------------------------------------------ GPUs
@pytest.mark.gpu
def test_tp2_over_nccl_equals_tp1():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    one = tokens(LLM("tiny-qwen3", dtype="float32").generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM("tiny-qwen3", dtype="float32", tensor_parallel_size=2) as llm:
        assert llm.plan.dist_backend == "nccl"
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == one
