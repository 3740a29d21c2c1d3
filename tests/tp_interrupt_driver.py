"""A tensor-parallel (TP=2) script for test_tp_interrupt.py, run as its own process:
`python tp_interrupt_driver.py POINT [N] [overlap]` (overlap: async_scheduling, so that on CPU the steps run
on the executor's forward thread).

It prints markers (one line each, flushed) that the test waits on: `STARTING`, `BUILDING` (imports done;
"outside" only), then `UP <worker pids>` once the LLM is built, `GENERATING` before the long run. With
POINT = "outside" it does nothing else: the test sends Ctrl-C itself (to the script's process group, as a
terminal or a notebook does), and nothing catches it.

Any other POINT sends Ctrl-C to this process from inside the engine, at the N-th time it passes there (a
seeded choice of the test), and catches the KeyboardInterrupt where a notebook cell would end:
- `hello`: while rank 0 waits for its worker to start; `runner`: while rank 0 builds its ModelRunner;
- `prefill` / `decode`: inside rank 0's forward of such a step; `collective`: inside an all-reduce;
- `between`: in the scheduler, between two steps;
- `stuck`: in a step whose worker is stuck (it sleeps a minute), so the step cannot end: it is abandoned.
Then it prints `INTERRUPTED <seconds from the Ctrl-C> <where>`, checks the engine after it (the same LLM
gives the tokens it gave before, or says it was stopped), and that a new `LLM(...)` works in this process
(`AGAIN`); `DONE` last. A check that fails raises (a non-zero exit, with the traceback on stderr).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from tp_workload import child_pids

POINT = sys.argv[1]
NTH = int(sys.argv[2]) if len(sys.argv) > 2 else 1
OPTIONS = {"async_scheduling": True} if "overlap" in sys.argv[3:] else {}  # CPU overlap: a forward thread
PROMPTS = ["The paged KV cache stores keys and values in blocks", "Hi", "Once upon a time, in a land far"]


def say(*words: object) -> None:
    print(*words, flush=True)


sent_at: list[float] = []
passes = {"n": 0}


def interrupt_here() -> None:
    """Ctrl-C to this process, the NTH time it passes here (once)."""
    passes["n"] += 1
    if passes["n"] == NTH and not sent_at:
        sent_at.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)


def stuck_in_the_mlp(runner):  # sent by name to the worker (collective_rpc): this module is importable there
    if runner.tp.rank > 0:
        real = runner.model.layers[0].mlp.forward

        def slow(x):
            if x.shape[0] > 1:  # (every step here has several rows)
                time.sleep(60)
            return real(x)
        runner.model.layers[0].mlp.forward = slow


def patch() -> None:
    """Put `interrupt_here` at POINT."""
    from nanoengine.distributed import workers
    from nanoengine.engine import model_runner, scheduler
    from nanoengine.layers import tp_group

    def before(owner, name, when=lambda *a, **k: True):
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if when(*args, **kwargs):
                interrupt_here()
            return real(*args, **kwargs)
        setattr(owner, name, wrapped)

    if POINT == "hello":
        before(workers.LocalWorkers, "receive", lambda self, i, timeout=None, starting=False: starting)
    elif POINT == "runner":
        real_init = model_runner.ModelRunner.__init__

        def init(self, plan, parts, tp, *args, **kwargs):
            if tp.size > 1:
                interrupt_here()
            real_init(self, plan, parts, tp, *args, **kwargs)
        model_runner.ModelRunner.__init__ = init
    elif POINT in ("prefill", "decode", "stuck"):
        def of_kind(self, inp, prev=None):
            return self.tp.size > 1 and inp.is_decode_only == (POINT == "decode")
        before(model_runner.ModelRunner, "execute", of_kind)
    elif POINT == "collective":
        before(tp_group.TPGroup, "all_reduce", lambda self, x: self.size > 1)
    elif POINT == "between":
        before(scheduler.Scheduler, "schedule")


def main() -> None:
    say("STARTING")
    from nanoengine import LLM, SamplingParams
    from nanoengine.errors import WorkerError

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    if POINT == "outside":
        say("BUILDING")
        llm = LLM("tiny-qwen3", tensor_parallel_size=2, **OPTIONS)
        say("UP", *llm.engine.executor.workers.pids)
        say("GENERATING")
        llm.generate(["a long story"] * 4, long, use_tqdm=False)
        return
    at_start = POINT in ("hello", "runner")
    if not at_start:
        llm = LLM("tiny-qwen3", tensor_parallel_size=2, **OPTIONS)
        say("UP", *llm.engine.executor.workers.pids)
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        if POINT == "stuck":
            from tp_interrupt_driver import stuck_in_the_mlp as by_name  # (not __main__'s: sent by name)

            llm.collective_rpc(by_name)
    patch()
    try:
        if at_start:
            llm = LLM("tiny-qwen3", tensor_parallel_size=2, **OPTIONS)
        else:
            say("GENERATING")
            llm.generate(["a long story"] * 4, long, use_tqdm=False)
        raise AssertionError(f"no KeyboardInterrupt ({passes['n']} passes at {POINT})")
    except KeyboardInterrupt:
        say("INTERRUPTED", f"{time.monotonic() - sent_at[0]:.2f}", POINT)
    sent_at.append(0.0)  # (no second Ctrl-C from here on)
    if not at_start:
        try:  # held to the step's end: the ranks are in step; abandoned: the LLM says so
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
            assert got == want, f"after Ctrl-C at {POINT}: {got} != {want}"
            say("SAME")
        except WorkerError as e:
            assert "build a new LLM" in str(e), e
            say("STOPPED", str(e).splitlines()[0])
        llm.close()
    deadline = time.monotonic() + 10
    while child_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child_pids(), f"workers left after Ctrl-C at {POINT}: {child_pids()}"
    with LLM("tiny-qwen3", tensor_parallel_size=2, **OPTIONS) as again:
        got = [o.outputs[0].token_ids for o in again.generate(PROMPTS, greedy, use_tqdm=False)]
    if not at_start:
        assert got == want
    say("AGAIN")
    say("DONE")


if __name__ == "__main__":
    main()
