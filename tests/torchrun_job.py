"""A script every torchrun rank runs (tests/test_torchrun.py): a tensor-parallel LLM built at top level, as
users write it. `tokens OUT`: two rounds of the TP tests' prompts (chunked prefill, a tight pool that forces a
preemption, prefix hits in round 2) written by rank 0 to OUT as JSON; `raise`: rank 1's MLP raises (a function
of this script sent by collective_rpc) and rank 0 prints the WorkerError; `long`: generate until the engine
fails, printing when it starts and when (time.time()) rank 0 raised."""

import json
import sys
import time

from tp_workload import GREEDY, PROMPTS, TORCHRUN_OPTIONS

from nanoengine import LLM, SamplingParams
from nanoengine.errors import WorkerError


def fail_on_rank_1(runner):
    """Sent by collective_rpc by name: every rank runs this script, and reaches this line before LLM(...)
    (ranks 1.. never get past it), so the function is found there."""
    if runner.tp.rank == 1:
        def boom(x):
            raise RuntimeError("injected failure in rank 1's MLP")
        runner.model.layers[1].mlp.forward = boom


llm = LLM("tiny-qwen3", tensor_parallel_size=2, **TORCHRUN_OPTIONS)  # ranks 1.. serve rank 0 here, then exit
if sys.argv[1] == "tokens":
    rounds, traces = [], []
    for _ in range(2):
        rounds.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)])
        traces.append(llm.trace)
    steps = traces[0].steps
    result = {"tokens": rounds, "hit_tokens": traces[1].hit_tokens,
              "preempted": any(s.preempted for s in steps),
              "chunked": any(e.prefill_tokens and e.num_computed_before for s in steps for e in s.scheduled)}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
elif sys.argv[1] == "raise":
    llm.collective_rpc(fail_on_rank_1)
    try:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    except WorkerError as e:
        print("RAISED", time.time(), repr(str(e)), flush=True)
        sys.exit(3)
else:
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)  # two of them fit the pool
    print("STARTED", flush=True)
    try:
        while True:
            llm.generate(["a long story"] * 2, long, use_tqdm=False)
    except WorkerError as e:
        print("RAISED", time.time(), str(e).splitlines()[0], flush=True)
        sys.exit(3)
